"""Gradient accumulation with DistributedDataParallel, the way people stretch a batch that does not fit:
each optimizer step runs several micro-batches, only the last of which synchronises gradients (the others
under ``model.no_sync()``), then clips the gradient norm and steps an LR schedule (linear warm-up, cosine
decay). The model is a small convolutional classifier of random 8×8 images. gpuwatch's hooks measure one
optimizer step as one step; those lines are marked ``# gpuwatch``.

    gpuwatch agent &
    torchrun --standalone --nproc-per-node 2 tests/workloads/grad_accumulation.py --steps 40

``--fault`` (given more than once: each) plants a bug users really write:

* ``sleep-rank``: one rank (``--fault-rank``, default the last) sleeps 0.3 s per step in its forward passes, as
  a slow GPU would.
* ``same-data``: the sampler's rank is read from ``NODE_RANK`` (the node's index, 0 on a single node) instead of
  ``RANK``: every rank reads the same shard.
* ``bad-loss-shape``: the head keeps a trailing singleton dimension (N, classes, 1) and ``log_softmax`` runs over
  ``dim=-1``, that singleton, instead of the classes: every log-probability is 0, so are the loss and the
  gradients.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from clean_exit import run_then_exit
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from gpuwatch.trainer import hooks

CLASSES = 4


def quadrant_images(count: int, seed: int = 0) -> TensorDataset:
    """Noisy 8×8 images whose label is the brightest quadrant: learnable by a couple of convolutions."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(CLASSES, (count,), generator=generator)
    images = torch.randn(count, 1, 8, 8, generator=generator)
    for label in range(CLASSES):
        row, col = divmod(label, 2)
        images[labels == label, :, 4 * row:4 * row + 4, 4 * col:4 * col + 4] += 2.0
    return TensorDataset(images, labels)


def small_convnet() -> nn.Module:
    """Two convolutions, global average pooling and a 1×1 convolution as the head: output (N, classes, 1)."""
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Conv2d(8, CLASSES, 1), nn.Flatten(2))


def main() -> object:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--fault", action="append", default=[], help="a planted bug (given again: several)",
                        choices=("none", "sleep-rank", "same-data", "bad-loss-shape"))
    parser.add_argument("--fault-rank", type=int, default=None, help="the sleeping rank (default: the last)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    slow_rank = world_size - 1 if args.fault_rank is None else args.fault_rank

    dataset = quadrant_images(args.steps * args.accumulate * args.micro_batch * world_size)
    sampler_rank = int(os.environ.get("NODE_RANK", 0)) if "same-data" in args.fault else rank  # the bug: NODE_RANK
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=sampler_rank, seed=42)
    loader = DataLoader(dataset, batch_size=args.micro_batch * args.accumulate, sampler=sampler, drop_last=True)

    model = DistributedDataParallel(small_convnet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    warmup = max(1, args.steps // 10)

    def warmup_then_cosine(done: int) -> float:
        """The LR factor after `done` optimizer steps: linear warm-up over a tenth of the run, then cosine decay."""
        return min(1.0, (done + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(done, args.steps) / args.steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_cosine)
    monitor = hooks.Monitor(model)  # gpuwatch

    for images, labels in monitor.data(loader):  # gpuwatch: one batch per optimizer step, split below
        with monitor.step(samples=len(images)) as step:  # gpuwatch
            with step.compute():  # gpuwatch
                step_loss = torch.zeros(())
                micro_batches = list(zip(images.chunk(args.accumulate), labels.chunk(args.accumulate), strict=True))
                for index, (micro_images, micro_labels) in enumerate(micro_batches):
                    last = index == len(micro_batches) - 1
                    with nullcontext() if last else model.no_sync():  # all-reduce on the last micro-batch only
                        logits = model(micro_images)  # (N, classes, 1)
                        if "sleep-rank" in args.fault and rank == slow_rank:
                            time.sleep(0.3 / args.accumulate)  # a slow GPU
                        class_dim = -1 if "bad-loss-shape" in args.fault else 1  # the bug: dim=-1 is the singleton
                        log_probs = F.log_softmax(logits, dim=class_dim).squeeze(-1)
                        loss = F.nll_loss(log_probs, micro_labels) / args.accumulate
                        loss.backward()
                        step_loss += loss.detach()
            with step.optimizer():  # gpuwatch
                grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step.report(loss=step_loss, grad_norm=grad_norm, lr=scheduler.get_last_lr()[0])  # gpuwatch
            scheduler.step()
    monitor.close()  # gpuwatch: sends the last steps

    if rank == 0:
        print(f"{world_size} rank(s), {args.steps} optimizer steps of {args.accumulate} micro-batches, "
              f"last loss {step_loss.item():.4f}")
    dist.destroy_process_group()
    return model


if __name__ == "__main__":
    run_then_exit(main)
