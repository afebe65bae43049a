"""A tiny language model trained the way many LLM scripts do it (nanoGPT's ``get_batch``): no DataLoader and no
sampler, each rank draws random windows of a token stream from its own generator, seeded with a base seed
plus its rank. It computes no gradient norm: the hooks see the loss, the learning rate and the tokens only.
The model is an embedding, a GRU and a head. gpuwatch's lines are marked ``# gpuwatch``.

    gpuwatch agent &
    torchrun --standalone --nproc-per-node 2 tests/workloads/tiny_lm.py --steps 40

``--fault`` (given more than once: each) plants a bug users really write:

* ``sleep-rank``: one rank (``--fault-rank``, default the last) sleeps 0.3 s in its forward pass, as a slow GPU
  would.
* ``same-data``: the generator is seeded with the base seed alone, without the rank: every rank draws the
  same windows, so all ranks compute the same gradients.
* ``bad-loss-shape``: the target token's logit is picked out *before* ``log_softmax`` (gather, then normalise)
  instead of after: the softmax runs over that single logit, every log-probability is 0, and so are the loss
  and the gradients.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from clean_exit import run_then_exit
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gpuwatch.trainer import hooks

VOCAB, CONTEXT, WIDTH = 128, 32, 64


def token_stream(length: int, seed: int = 0) -> torch.Tensor:
    """A stream from a random sparse bigram chain (each token has 4 likely successors): learnable structure."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(VOCAB, (VOCAB, 4), generator=generator)
    stream = torch.empty(length, dtype=torch.long)
    stream[0] = 0
    choices = torch.randint(4, (length,), generator=generator)
    for i in range(1, length):
        stream[i] = successors[stream[i - 1], choices[i]]
    return stream


class TinyGRULM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.rnn = nn.GRU(WIDTH, WIDTH, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        return self.head(hidden)


def main() -> object:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--fault", action="append", default=[], help="a planted bug (given again: several)",
                        choices=("none", "sleep-rank", "same-data", "bad-loss-shape"))
    parser.add_argument("--fault-rank", type=int, default=None, help="the sleeping rank (default: the last)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    slow_rank = world_size - 1 if args.fault_rank is None else args.fault_rank

    data = token_stream(20_000)
    seed_offset = 0 if "same-data" in args.fault else rank  # the bug: every rank seeded alike
    generator = torch.Generator().manual_seed(args.seed + seed_offset)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(data) - CONTEXT - 1, (args.batch_size,), generator=generator)
        windows = torch.stack([data[i:i + CONTEXT + 1] for i in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]

    torch.manual_seed(args.seed)
    model = TinyGRULM()
    n_params = sum(p.numel() for p in model.parameters())
    model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    monitor = hooks.Monitor(model, flops_per_token=6 * n_params)  # gpuwatch (an approximation)

    for number in range(1, args.steps + 1):
        inputs, targets = get_batch()
        with monitor.step(tokens=inputs.numel()) as step:  # gpuwatch
            with step.compute():  # gpuwatch
                logits = model(inputs)
                if "sleep-rank" in args.fault and rank == slow_rank:
                    time.sleep(0.3)  # a slow GPU
                picked = targets.unsqueeze(-1)
                if "bad-loss-shape" in args.fault:  # the bug: normalised over the one logit gathered
                    log_probs = logits.gather(-1, picked).log_softmax(-1)
                else:
                    log_probs = logits.log_softmax(-1).gather(-1, picked)
                loss = -log_probs.mean()
                loss.backward()
            with step.optimizer():  # gpuwatch
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step.report(loss=loss.detach(), lr=optimizer.param_groups[0]["lr"])  # gpuwatch
        if rank == 0 and number in (1, args.steps):
            print(f"step {number}: loss {loss.item():.4f}")
    monitor.close()  # gpuwatch: sends the last steps
    dist.destroy_process_group()
    return model


if __name__ == "__main__":
    run_then_exit(main)
