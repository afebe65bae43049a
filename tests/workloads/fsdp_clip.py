"""A user's FSDP2 script that knows nothing of gpuwatch (no import of it): a small MLP sharded over every rank with
``torch.distributed.fsdp.fully_shard`` (gloo on the CPU), its gradient clipped by ``torch.nn.utils.clip_grad_norm_``
(which reduces the sharded norm across the ranks) before each SGD step; with ``--as-torchtitan``, in two calls as
torchtitan's own ``clip_grad_norm_`` makes them: ``torch.nn.utils.get_total_norm``, the norm made whole
(``full_tensor``), then ``torch.nn.utils.clip_grads_with_norm_``. ``--norms DIR`` writes each rank's clipped
norms (``float.hex``: exact) to DIR/rank-R.json, for comparing with what gpuwatch reported.

    gpuwatch run -- torchrun --standalone --nproc-per-node 2 tests/workloads/fsdp_clip.py --steps 6
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from clean_exit import run_then_exit
from torch import nn
from torch.distributed.fsdp import fully_shard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--norms", type=Path, default=None)
    parser.add_argument("--as-torchtitan", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    norms: list[str] = []
    for _ in range(args.steps):
        inputs = torch.randn(8, 16, generator=generator)
        F.mse_loss(model(inputs), inputs.sum(dim=1, keepdim=True)).backward()
        if args.as_torchtitan:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm).hex())
        optimizer.step()
        optimizer.zero_grad()
    if args.norms is not None:
        args.norms.mkdir(parents=True, exist_ok=True)
        (args.norms / f"rank-{rank}.json").write_text(json.dumps(norms))
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)
