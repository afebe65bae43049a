"""A script that calls every collective torch.distributed exports once per optimizer step, through each entry point:
blocking, asynchronous then waited for (`async_op=True`, `isend`/`irecv`), coalesced, `*_single` and
`*_into_tensor` (FSDP2's), the object collectives that call others inside. No gpuwatch import: measured from
outside, by `gpuwatch run`.

``--hang-rank R``: at the last step rank R never joins the asynchronous all-gather its peers wait for in
`Work.wait()`, and sleeps; the other ranks hang inside that wait.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from clean_exit import run_then_exit
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hang-rank", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ones = torch.ones(4)
    for step in range(1, args.steps + 1):
        model(torch.randn(2, 4)).sum().backward()
        gathered = torch.empty(4 * world)
        if step == args.steps and rank == args.hang_rank:
            time.sleep(3600)
        dist.all_gather_single(gathered, ones, async_op=True).wait()
        dist.all_gather_into_tensor(gathered, ones)
        dist.all_gather([torch.empty(4) for _ in range(world)], ones)
        dist.reduce_scatter_single(torch.empty(2), torch.ones(2 * world), async_op=True).wait()
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world))
        dist.all_reduce(ones.clone())
        dist.all_reduce_coalesced([torch.ones(2), torch.ones(3)])
        dist.all_to_all_single(torch.empty(4), torch.ones(4))
        dist.broadcast(ones.clone(), src=0)
        dist.reduce(ones.clone(), dst=0)
        dist.gather(ones.clone(), [torch.empty(4) for _ in range(world)] if rank == 0 else None, dst=0)
        dist.scatter(torch.empty(4), [torch.ones(4) for _ in range(world)] if rank == 0 else None, src=0)
        dist.all_gather_object([None] * world, {"step": step})
        if rank == 0:
            dist.isend(ones, 1).wait()
            dist.send(ones, 1)
        elif rank == 1:
            dist.irecv(torch.empty(4), 0).wait()
            dist.recv(torch.empty(4), 0)
        dist.barrier()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group(None)  # the default group given positionally, as accelerate's end_training does


if __name__ == "__main__":
    run_then_exit(main)
