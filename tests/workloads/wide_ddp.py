"""A user's DistributedDataParallel script with no gpuwatch import, whose gradient is large enough to be bound by
bandwidth (two 768 x 768 layers: 4.5 MiB of float32 gradients a step, above PERF004's 1 MiB) and whose compute
outweighs its all-reduce on a healthy link: what a job across nodes looks like to the network. Measured from outside:

    gpuwatch run -- torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr ADDR tests/workloads/wide_ddp.py

``--fault sleep-rank`` makes one rank (``--fault-rank``, default the last) sleep 0.5 s in each forward, as a slow GPU
would: a compute straggler the others wait for at every all-reduce.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from clean_exit import run_then_exit
from torch import nn
from torch.nn.parallel import DistributedDataParallel

WIDTH = 768


class Sleepy(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


def main() -> object:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--fault", choices=("none", "sleep-rank"), default="none")
    parser.add_argument("--fault-rank", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    slow = args.fault == "sleep-rank" and rank == (world_size - 1 if args.fault_rank is None else args.fault_rank)
    model = nn.Sequential(Sleepy(0.5 if slow else 0.0), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        inputs = torch.randn(args.batch_size, WIDTH, generator=generator)
        loss = ddp(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()
    return ddp


if __name__ == "__main__":
    run_then_exit(main)
