"""A user's ``accelerate`` training loop that knows nothing of gpuwatch, its first import ``accelerate``: the tiny
language model of framework_job (plain torch, no transformers) on synthetic token sequences, 2 CPU ranks with gloo,
``Accelerator(gradient_accumulation_steps=2)``, each micro-batch of 4 under ``accelerator.accumulate(model)`` with
``accelerator.backward(loss)``, ``optimizer.step()`` and ``zero_grad()`` called on every micro-batch (accelerate skips
them until the accumulation is complete), a progress line logged after each optimizer step
(``accelerator.sync_gradients``), and ``accelerator.end_training()`` at the end.

    gpuwatch run -- torchrun --standalone --nproc-per-node 2 tests/workloads/accelerate_loop.py --steps 12

The framework's own per-step loss (``--out``) is what accelerate back-propagates in an optimizer step: the sum of
its micro-batches' ``loss / gradient_accumulation_steps`` (``accelerator.backward`` divides), in float32, per rank.

Faults (framework_job.FAULTS): ``slow-data`` in the data set's ``__getitem__``; ``slow-compute`` in the model's
forward; ``slow-outside`` in the logging call between optimizer steps; ``slow-optimizer`` in the optimizer's
``step``; ``--never-learns``: a learning rate of 0.
"""

from __future__ import annotations

# isort: split
import accelerate  # the first import, before torch

# isort: split
import os

import torch
from clean_exit import run_then_exit
from framework_job import Fault, TinyLM, Tokens, next_token_loss, parameters_hash, parser, slow_optimizer, write_results
from torch.utils.data import DataLoader

MICRO_BATCH, ACCUMULATE = 4, 2


def log_progress(accelerator: accelerate.Accelerator, step: int, loss: torch.Tensor, fault: Fault) -> None:
    """What a user prints between steps (``slow-outside``: it takes its time)."""
    fault.sleep("outside")
    if step % 4 == 0:
        accelerator.print(f"step {step}: loss {loss.item():.4f}")


def main() -> None:
    args = parser(__doc__).parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fault = Fault(args, rank)
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=ACCUMULATE, cpu=True)
    accelerate.utils.set_seed(0)
    model = TinyLM(fault.delay / ACCUMULATE if fault.slows("compute") else 0.0)
    optimizer = slow_optimizer(torch.optim.AdamW, fault)(model.parameters(), lr=0.0 if fault.never_learns else 1e-3)
    data = Tokens(args.steps * ACCUMULATE * MICRO_BATCH * world, fault, MICRO_BATCH * ACCUMULATE)
    loader = DataLoader(data, batch_size=MICRO_BATCH, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses: list[float] = []
    step_loss = torch.zeros(())
    model.train()
    step = 0
    while step < args.steps:
        for tokens in loader:
            with accelerator.accumulate(model):
                loss = next_token_loss(model(tokens), tokens)
                accelerator.backward(loss)
                step_loss += loss.detach() / ACCUMULATE
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                losses.append(step_loss.item())
                log_progress(accelerator, step, step_loss, fault)
                step_loss = torch.zeros(())
                if step == args.steps:
                    break
    write_results(args.out, rank, losses, parameters_hash(accelerator.unwrap_model(model).parameters()))
    accelerator.end_training()


if __name__ == "__main__":
    run_then_exit(main)
