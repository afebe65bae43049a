"""A plain DistributedDataParallel tutorial script, as users copy it from PyTorch's examples: a small MLP
that learns a binary label of random feature vectors, a DataLoader with a DistributedSampler, SGD. gpuwatch's
hooks are added the way the README shows them; those lines are marked ``# gpuwatch``.

    gpuwatch agent &
    torchrun --standalone --nproc-per-node 2 tests/workloads/ddp_tutorial.py --steps 40

``--fault`` (given more than once: each) plants a bug users really write, so that gpuwatch's diagnosis can be
checked against it:

* ``sleep-rank``: one rank (``--fault-rank``, default the last) sleeps 0.3 s in its forward pass, as a slow GPU
  would: a straggler the others wait for at every all-reduce.
* ``same-data``: ``DistributedSampler(dataset, num_replicas=1, rank=0)``, copied from a single-process run:
  every rank trains on the whole dataset, so all ranks compute the same gradients.
* ``bad-loss-shape``: ``cross_entropy`` over the model's single logit where binary cross-entropy was meant.
  A softmax over one class is always 1, so the loss is 0, every gradient is 0 and the model never learns.
* ``stuck-rank``: at step 5 one rank (``--fault-rank``) waits for good on a lock nobody releases before its
  backward, as a rank stuck on a filesystem or in a deadlocked helper thread: the others wait for it in DDP's
  all-reduce until someone stops the job.
* ``stuck-at-exit``: after its training and ``destroy_process_group()``, one rank (``--fault-rank``) waits for good on
  a lock nobody releases, as a rank deadlocked in its teardown (PyTorch issue #56297 is one way there): its hooks
  closed, its process never exits. The other ranks go on working (an evaluation, on CPU) until someone stops the job.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from clean_exit import run_then_exit
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from gpuwatch.trainer import hooks

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


def evaluate_until_stopped(model: nn.Module) -> None:
    """Work after training, as an evaluation does: forwards without gradients, for good."""
    with torch.no_grad():
        while True:
            model(torch.randn(1024, FEATURES))


def main() -> object:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--fault", action="append", default=[], help="a planted bug (given again: several)",
                        choices=("none", "sleep-rank", "same-data", "bad-loss-shape", "stuck-rank", "stuck-at-exit"))
    parser.add_argument("--fault-rank", type=int, default=None,
                        help="the sleeping or stuck rank (default: the last)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    slow_rank = world_size - 1 if args.fault_rank is None else args.fault_rank

    batches_per_epoch = 10
    dataset = random_dataset(args.batch_size * batches_per_epoch * world_size)
    if "same-data" in args.fault:
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0)  # the bug: one replica's sampler on every rank
    else:
        sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model = DistributedDataParallel(nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = hooks.Monitor(model)  # gpuwatch

    step, epoch, losses = 0, 0, []
    while step < args.steps:
        sampler.set_epoch(epoch)
        for inputs, labels in monitor.data(loader):  # gpuwatch: times the wait for each batch
            with monitor.step(samples=len(inputs)) as measured:  # gpuwatch
                with measured.compute():  # gpuwatch
                    logits = model(inputs)
                    if "sleep-rank" in args.fault and rank == slow_rank:
                        time.sleep(0.3)  # a slow GPU
                    if "stuck-rank" in args.fault and rank == slow_rank and step == 4:
                        wait_for_a_lock_nobody_releases()
                    if "bad-loss-shape" in args.fault:
                        loss = F.cross_entropy(logits, labels)  # the bug: a softmax over one logit
                    else:
                        loss = F.binary_cross_entropy_with_logits(logits, labels)
                    loss.backward()
                with measured.optimizer():  # gpuwatch
                    optimizer.step()
                    optimizer.zero_grad()
                measured.report(loss=loss.detach(), lr=optimizer.param_groups[0]["lr"])  # gpuwatch
            losses.append(loss.item())
            step += 1
            if step == args.steps:
                break
        epoch += 1
    monitor.close()  # gpuwatch: sends the last steps

    if rank == 0:
        print(f"{world_size} rank(s), {step} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    dist.destroy_process_group()
    if "stuck-at-exit" in args.fault:
        if rank == slow_rank:
            wait_for_a_lock_nobody_releases()
        evaluate_until_stopped(model.module)
    return model


if __name__ == "__main__":
    run_then_exit(main)
