"""Data-parallel gradient averaging in buckets, and the global gradient norm across TP and PP."""

import math

import torch
from torch import nn

from gpuwatch.trainer.launch import launch
from gpuwatch.trainer.parallel.data import all_reduce_gradients, buckets, clip_gradients, global_grad_norm
from gpuwatch.trainer.parallel.groups import build_grid
from gpuwatch.trainer.parallel.tensor import split_parameter


def _params(*sizes: int, value: float = 1.0) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros(size)) for size in sizes]
    for param in params:
        param.grad = torch.full((param.numel(),), value)
    return params


def test_buckets_hold_consecutive_parameters_up_to_the_byte_limit():
    params = _params(4, 4, 10, 2, 2)  # 16, 16, 40, 8, 8 bytes
    assert [[p.numel() for p in b] for b in buckets(params, bucket_bytes=32)] == [[4, 4], [10], [2, 2]]
    assert [[p.numel() for p in b] for b in buckets(params, bucket_bytes=1 << 20)] == [[4, 4, 10, 2, 2]]


def _average(device, bucket_bytes):
    grid = build_grid(tp=1, pp=1, dp=4)
    params = _params(3, 5, 2, value=float(grid.rank))
    params[1].grad = torch.arange(5.0) * (grid.rank + 1)
    all_reduce_gradients(params, grid, bucket_bytes)
    return [p.grad for p in params]


def test_gradients_become_their_mean_over_the_dp_ranks_with_one_or_many_buckets():
    mean_rank = (0 + 1 + 2 + 3) / 4
    for bucket_bytes in (8, 1 << 20):  # one parameter per bucket, and all in one
        for grads in launch(_average, 4, bucket_bytes, device="cpu", timeout=60):
            assert torch.equal(grads[0], torch.full((3,), mean_rank))
            assert torch.equal(grads[1], torch.arange(5.0) * 2.5)  # mean of (rank + 1)
            assert torch.equal(grads[2], torch.full((2,), mean_rank))


def _norm(device):
    """tp=2 × pp=2: a split weight (different on every rank) and a replicated bias (the same on TP peers)."""
    grid = build_grid(tp=2, pp=2, dp=1)
    split = split_parameter(torch.zeros(4, 3), 0, grid.tp_group)  # this rank's [2, 3] slice
    split.grad = torch.full((2, 3), float(grid.rank + 1))
    replicated = nn.Parameter(torch.zeros(5))
    replicated.grad = torch.full((5,), float(grid.pp_rank + 1))
    params = [split, replicated]
    norm = global_grad_norm(params, grid)
    clip_gradients(params, max_norm=1.0, norm=norm)
    clipped = global_grad_norm(params, grid)
    return norm, clipped


def test_global_norm_sums_split_shards_and_counts_replicated_parameters_once():
    # split: 6 elements per rank with value rank+1 over ranks 0..3; replicated: 5 elements of pp_rank+1 per stage
    expected = math.sqrt(6 * (1 + 4 + 9 + 16) + 5 * (1 + 4))
    for norm, clipped in launch(_norm, 4, device="cpu", timeout=60):
        assert math.isclose(norm, expected, rel_tol=1e-6)
        assert math.isclose(clipped, 1.0, rel_tol=1e-5)  # every rank scaled by the same global factor


def test_clipping_leaves_small_gradients_and_can_be_turned_off():
    params = _params(4, value=0.1)
    clip_gradients(params, max_norm=1.0, norm=0.2)
    assert torch.equal(params[0].grad, torch.full((4,), 0.1))
    clip_gradients(params, max_norm=0.0, norm=50.0)
    assert torch.equal(params[0].grad, torch.full((4,), 0.1))
