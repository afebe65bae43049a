"""Data parallelism: average gradients over the DP group, then clip by the global norm.

Gradients travel in buckets (flattened runs of parameters up to `bucket_bytes`): one all-reduce per
bucket instead of one per parameter, as DDP does, so small tensors do not each pay the latency.

Clipping comes after the reduction and uses the norm of the whole model: the sum of squares over
this rank's parameters, then over the TP ranks (split parameters) and the pipeline stages. Clipping
per rank before the all-reduce, a common mistake, would have each replica scale by a different factor
from its local norm, and the update would no longer match the single-process one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from gpuwatch.trainer.parallel import comm
from gpuwatch.trainer.parallel.groups import Grid
from gpuwatch.trainer.parallel.tensor import is_tp_split


def grad_of(param: torch.nn.Parameter) -> torch.Tensor:
    """The gradient of a parameter the caller knows has one (the all-reduce takes only those)."""
    grad = param.grad
    assert grad is not None, "a parameter without a gradient is never all-reduced"
    return grad


def buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> Iterator[list[torch.nn.Parameter]]:
    """Consecutive runs of parameters (one dtype per run) holding at most `bucket_bytes`, or one parameter.
    Every parameter has a gradient."""
    bucket: list[torch.nn.Parameter] = []
    size = 0
    for param in params:
        grad = grad_of(param)
        nbytes = grad.numel() * grad.element_size()
        if bucket and (size + nbytes > bucket_bytes or grad.dtype != grad_of(bucket[0]).dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(param)
        size += nbytes
    if bucket:
        yield bucket


def all_reduce_gradients(
    params: list[torch.nn.Parameter],
    grid: Grid,
    bucket_bytes: int,
    observe: Callable[[list[torch.nn.Parameter], torch.Tensor], None] | None = None,
) -> None:
    """Replace each gradient by its mean over the DP ranks.

    `observe(bucket, mean)`, when given, sees each bucket's DP-mean gradient (flat) while the bucket's
    .grad still hold this rank's own: the hooks' gradient similarity needs both.
    """
    if grid.dp == 1:
        return
    for bucket in buckets([p for p in params if p.grad is not None], bucket_bytes):
        flat = torch.cat([grad_of(p).reshape(-1) for p in bucket])
        comm.all_reduce(flat, grid.dp_group).div_(grid.dp)
        if observe is not None:
            observe(bucket, flat)
        for param, reduced in zip(bucket, flat.split([grad_of(p).numel() for p in bucket]), strict=True):
            grad = grad_of(param)
            grad.copy_(reduced.view_as(grad))


def global_grad_norm(params: list[torch.nn.Parameter], grid: Grid) -> float:
    """L2 norm of the full model's gradient; the same number on every rank."""
    device = params[0].device
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for param in params:
        if param.grad is not None and (is_tp_split(param) or grid.tp_rank == 0):  # replicated: count once
            squares += param.grad.float().pow(2).sum()
    comm.all_reduce(squares, grid.tp_group)
    comm.all_reduce(squares, grid.pp_group)
    return squares.sqrt().item()


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float, norm: float) -> None:
    """Scale the gradients so their global norm is at most `max_norm` (0 turns clipping off)."""
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        for param in params:
            if param.grad is not None:
                param.grad.mul_(max_norm / (norm + 1e-6))
