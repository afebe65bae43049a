"""A user's hand-written FSDP2 loop that knows nothing of gpuwatch: the tiny language model of framework_job sharded
with ``torch.distributed.fsdp.fully_shard`` on its default mesh (no mesh given: a one-dimensional mesh over the world
without dimension names), each block sharded, then the root; 2 CPU ranks with gloo, micro-batches of 4 synthetic
token sequences from a DataLoader with a DistributedSampler, AdamW, a progress line logged between steps.

    gpuwatch run -- torchrun --standalone --nproc-per-node 2 tests/workloads/fsdp2_loop.py --steps 12

The framework's own per-step loss (``--out``) is the loss ``backward()`` was called on (``loss.item()``), per rank.

Faults (framework_job.FAULTS): ``slow-data`` in the data set's ``__getitem__``; ``slow-compute`` in the model's
forward; ``slow-outside`` in the logging call between optimizer steps; ``slow-optimizer`` in the optimizer's
``step``; ``--never-learns``: a cross-entropy over a single logit (loss 0 and gradients 0 whatever the weights: no
parameter checksum can show it here, FSDP shards the parameters).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from clean_exit import run_then_exit
from framework_job import Fault, TinyLM, Tokens, next_token_loss, parameters_hash, parser, slow_optimizer, write_results
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

MICRO_BATCH = 4


def log_progress(step: int, loss: torch.Tensor, fault: Fault) -> None:
    """What a user prints between steps (``slow-outside``: it takes its time)."""
    fault.sleep("outside")
    if step % 4 == 0 and dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}", flush=True)


def main() -> None:
    args = parser(__doc__).parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    fault = Fault(args, rank)
    torch.manual_seed(0)
    model = TinyLM(fault.delay if fault.slows("compute") else 0.0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = slow_optimizer(torch.optim.AdamW, fault)(model.parameters(), lr=1e-3)
    data = Tokens(args.steps * MICRO_BATCH * world, fault, MICRO_BATCH)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=MICRO_BATCH, sampler=sampler)
    losses: list[float] = []
    model.train()
    for step, tokens in enumerate(loader, start=1):
        loss = next_token_loss(model(tokens), tokens, single_logit=fault.never_learns)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        log_progress(step, loss, fault)
        if step == args.steps:
            break
    write_results(args.out, rank, losses, parameters_hash(model.parameters()))
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)
