"""The GPU acceptance kit's job for the flight-recorder check: a small model trained a few steps with its gradients
averaged by hand over a data-parallel group and its loss over the world, under `gpuwatch run`, with PyTorch's
Flight Recorder on; at its end each rank writes what the recorder holds, per process group, for the kit to set beside
what gpuwatch counted (the step records' `collective_calls`).

    TORCH_NCCL_TRACE_BUFFER_SIZE=2000 gpuwatch run --layout 1,1,N --run-log DIR -- \\
        torchrun --standalone --nproc-per-node N benchmarks/flight_recorder_job.py --backend nccl --out DIR2

Every collective runs after the first forward in training mode and before the last optimizer step ends, where
`gpuwatch run` counts them: no DistributedDataParallel (its parameter broadcast comes before the first forward) and
nothing after the loop. The only gpuwatch import is the recorder's reader (gpuwatch.trainer.hooks.flight_recorder).
``DIR2/rank-N.json``: {"rank", "world_size", "backend", "entries", "groups": {torch's group name: {"desc", "ranks",
"world", "finished", "unfinished", "ops": {op: finished}}}}, collectives only (send/recv are numbered apart).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpuwatch.trainer.hooks.flight_recorder import FlightEntry, FlightRecorder


def groups_recorded(entries: list[FlightEntry]) -> dict[str, dict[str, Any]]:
    """The recorder's collectives per process group (torch's name), with the group's members from torch."""
    names = dist.distributed_c10d._world.pg_names  # {ProcessGroup: torch's name}
    members: dict[str, dist.ProcessGroup] = {str(name): group for group, name in names.items()}
    out: dict[str, dict[str, Any]] = {}
    for entry in entries:
        if entry.p2p:
            continue
        group = out.get(entry.group)
        if group is None:
            pg = members.get(entry.group)
            group = out[entry.group] = {
                "desc": entry.group_desc, "ranks": dist.get_process_group_ranks(pg) if pg is not None else None,
                "world": pg is not None and pg is dist.GroupMember.WORLD, "finished": 0, "unfinished": 0, "ops": {}}
        if entry.finished:
            group["finished"] += 1
            group["ops"][entry.op] = group["ops"].get(entry.op, 0) + 1
        else:
            group["unfinished"] += 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = dist.new_group(list(range(world)), group_desc="dp")  # the layout's data-parallel group: every rank
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        inputs = torch.randn(8, 16, generator=generator).to(device)
        loss = model(inputs).square().mean()
        loss.backward()
        for param in model.parameters():  # 4 all-reduces a step on the data-parallel group
            assert param.grad is not None
            dist.all_reduce(param.grad, group=dp)
            param.grad /= world
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # 1 on the world
        optimizer.step()
        optimizer.zero_grad()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # every collective done on the device: the recorder's events say so
    entries = FlightRecorder.read_settled()  # gloo retires its last work just after it returned
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank-{rank}.json").write_text(json.dumps({
        "rank": rank, "world_size": world, "backend": args.backend, "buffer_size": FlightRecorder.buffer_size(),
        "entries": None if entries is None else len(entries),
        "groups": groups_recorded(entries or []),
    }, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # End as tests/workloads/clean_exit.py says why: the exit handlers (gpuwatch's monitor closing, its records
    # written), then past the interpreter's finalization, which a gloo worker thread can race into an abort.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
