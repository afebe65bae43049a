"""A user's DistributedDataParallel script that knows nothing of gpuwatch (no import of it): a small MLP learning a
binary label of random feature vectors, a DataLoader with a DistributedSampler, SGD with a step LR schedule, an
all-reduce of the loss for logging after each step, and optionally gradient accumulation (``--accumulate K``: K
micro-batches per optimizer step, the first K-1 under ``model.no_sync()``, each loss divided by K). Measured only
from outside:

    gpuwatch run -- torchrun --standalone --nproc-per-node 2 tests/workloads/plain_ddp.py --steps 40

``--losses DIR`` writes each rank's loss per optimizer step (the sum of its micro-batches' divided losses, as
``float.hex``: exact) to DIR/rank-R.json, for comparing what the script computed with what gpuwatch reported.

``--scaler``: the AMP way of stepping (``torch.amp.GradScaler``: the scaled loss's backward, ``unscale_``, the gradient
clipped by ``torch.nn.utils.clip_grad_norm_``, ``scaler.step``), on the CPU in float32: what gpuwatch sees of a loss
scaler and a clipped norm.

``--comm-hook before|after``: the script registers a DDP communication hook of its own (PyTorch's
``fp16_compress_hook``: the gradients all-reduced in float16, which changes the losses), right after making the DDP
model or after its first forward (when ``gpuwatch run`` has made its Monitor and registered its own hook).

``--fault`` (given more than once: each) plants a bug users really write:

* ``sleep-rank``: one rank (``--fault-rank``, default the last) sleeps 0.3 s in its forward passes, as a slow GPU
  would: a straggler the others wait for at every all-reduce.
* ``same-data``: ``DistributedSampler(dataset, num_replicas=1, rank=0)``: every rank trains on the same data.
* ``stuck-rank``: at the fifth optimizer step one rank (``--fault-rank``) waits for good on a lock nobody releases
  before its backward: the others wait for it in DDP's all-reduce until someone stops the job.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from clean_exit import run_then_exit
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES = 32


def random_dataset(size: int, seed: int = 0) -> TensorDataset:
    """Random feature vectors labelled by a fixed random hyperplane: something a small MLP can learn."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, FEATURES, generator=generator)
    hyperplane = torch.randn(FEATURES, 1, generator=generator)
    return TensorDataset(inputs, (inputs @ hyperplane > 0).float())


def wait_for_a_lock_nobody_releases() -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # held already, by this very thread: waits for good


def main() -> object:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--fault", action="append", default=[], help="a planted bug (given again: several)",
                        choices=("none", "sleep-rank", "same-data", "stuck-rank"))
    parser.add_argument("--fault-rank", type=int, default=None, help="the sleeping or stuck rank (default: the last)")
    parser.add_argument("--losses", type=Path, default=None, help="write each rank's losses to DIR/rank-R.json")
    parser.add_argument("--scaler", action="store_true", help="step through a GradScaler, clipping the gradient")
    parser.add_argument("--comm-hook", choices=("none", "before", "after"), default="none",
                        help="register fp16_compress_hook before the first forward or after it")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    faulty_rank = world_size - 1 if args.fault_rank is None else args.fault_rank
    torch.manual_seed(0)

    dataset = random_dataset(args.batch_size * 10 * world_size)
    if "same-data" in args.fault:
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0)  # the bug: one replica's sampler on every rank
    else:
        sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1)))
    if args.comm_hook == "before":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=args.scaler)

    losses: list[float] = []
    step, micro, epoch, step_loss = 0, 0, 0, 0.0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            micro += 1
            synchronise = micro % args.accumulate == 0
            with nullcontext() if synchronise else model.no_sync():
                logits = model(inputs)
                if args.comm_hook == "after" and micro == 1:
                    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
                if "sleep-rank" in args.fault and rank == faulty_rank:
                    time.sleep(0.3)  # a slow GPU
                if "stuck-rank" in args.fault and rank == faulty_rank and step == 4:
                    wait_for_a_lock_nobody_releases()
                loss = F.binary_cross_entropy_with_logits(logits, labels) / args.accumulate
                scaler.scale(loss).backward()
            step_loss += loss.item()
            if not synchronise:
                continue
            if args.scaler:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(step_loss)
            logged = torch.tensor([step_loss])
            dist.all_reduce(logged)  # the mean loss over the ranks, for the log
            step, step_loss = step + 1, 0.0
            if rank == 0 and step % 10 == 0:
                print(f"step {step}: mean loss {logged.item() / world_size:.4f}", flush=True)
            if step == args.steps:
                break
        epoch += 1

    if args.losses is not None:
        args.losses.mkdir(parents=True, exist_ok=True)
        (args.losses / f"rank-{rank}.json").write_text(json.dumps([loss.hex() for loss in losses]))
    dist.destroy_process_group()
    return model


if __name__ == "__main__":
    run_then_exit(main)
