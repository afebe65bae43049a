"""Each tensor-parallel layer against its dense equivalent, forward and backward, on 2 gloo ranks.

Tolerance: torch.testing.assert_close's fp32 default (rtol 1.3e-6, atol 1e-5). The parallel layers
compute the same sums as the dense ones, split in two and added up by an all-reduce, so they differ
only in fp32 summation order (~1e-7 here).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from gpuwatch.trainer.launch import launch
from gpuwatch.trainer.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard,
    unshard,
    vocab_parallel_cross_entropy,
)

TP = 2


def _coordinates():
    torch.manual_seed(0)  # the same dense layer, input and upstream gradient on every rank
    return dist.group.WORLD, dist.get_rank(), dist.get_world_size()


def _column(device, chunks):
    group, rank, size = _coordinates()
    dense = nn.Linear(8, 12)
    x = torch.randn(3, 5, 8, requires_grad=True)
    upstream = torch.randn(3, 5, 12)
    (dense(x) * upstream).sum().backward()

    layer = ColumnParallelLinear(dense.weight.detach(), dense.bias.detach(), group, chunks=chunks)
    x_local = x.detach().clone().requires_grad_()
    y = layer(x_local)
    (y * shard(upstream, -1, rank, size, chunks)).sum().backward()
    return [
        (y, shard(dense(x), -1, rank, size, chunks)),
        (x_local.grad, x.grad),  # f all-reduced the input gradient: every rank has the full one
        (layer.weight.grad, shard(dense.weight.grad, 0, rank, size, chunks)),
        (layer.bias.grad, shard(dense.bias.grad, 0, rank, size, chunks)),
    ]


def _row(device):
    group, rank, size = _coordinates()
    dense = nn.Linear(12, 8)
    x = torch.randn(3, 5, 12, requires_grad=True)
    upstream = torch.randn(3, 5, 8)
    (dense(x) * upstream).sum().backward()

    layer = RowParallelLinear(dense.weight.detach(), dense.bias.detach(), group)
    x_local = shard(x.detach(), -1, rank, size).requires_grad_()
    y = layer(x_local)
    (y * upstream).sum().backward()
    return [
        (y, dense(x)),  # g summed the partial products
        (x_local.grad, shard(x.grad, -1, rank, size)),
        (layer.weight.grad, shard(dense.weight.grad, 1, rank, size)),
        (layer.bias.grad, dense.bias.grad),
    ]


def _column_then_row(device):
    """The MLP pattern: one all-reduce forward (g), one backward (f), nothing in between."""
    group, rank, size = _coordinates()
    up, down = nn.Linear(8, 16), nn.Linear(16, 8)
    x = torch.randn(3, 5, 8, requires_grad=True)
    upstream = torch.randn(3, 5, 8)
    (down(F.gelu(up(x))) * upstream).sum().backward()

    up_tp = ColumnParallelLinear(up.weight.detach(), up.bias.detach(), group)
    down_tp = RowParallelLinear(down.weight.detach(), down.bias.detach(), group)
    x_tp = x.detach().clone().requires_grad_()
    y = down_tp(F.gelu(up_tp(x_tp)))
    (y * upstream).sum().backward()
    return [
        (y, down(F.gelu(up(x)))),
        (x_tp.grad, x.grad),
        (up_tp.weight.grad, shard(up.weight.grad, 0, rank, size)),
        (down_tp.weight.grad, shard(down.weight.grad, 1, rank, size)),
    ]


def _embedding(device):
    group, rank, size = _coordinates()
    dense = nn.Embedding(10, 6)
    ids = torch.randint(0, 10, (4, 7))
    upstream = torch.randn(4, 7, 6)
    (dense(ids) * upstream).sum().backward()

    layer = VocabParallelEmbedding(dense.weight.detach(), group)
    y = layer(ids)
    (y * upstream).sum().backward()
    return [(y, dense(ids)), (layer.weight.grad, shard(dense.weight.grad, 0, rank, size))]


def _cross_entropy(device):
    group, rank, size = _coordinates()
    logits = (torch.randn(4, 7, 10) * 3).requires_grad_()
    targets = torch.randint(0, 10, (4, 7))
    weights = torch.rand(4, 7)  # a non-uniform upstream gradient
    dense_loss = F.cross_entropy(logits.view(-1, 10), targets.view(-1), reduction="none").view(4, 7)
    (dense_loss * weights).sum().backward()

    local = shard(logits.detach(), -1, rank, size).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, group)
    (loss * weights).sum().backward()
    return [(loss, dense_loss), (local.grad, shard(logits.grad, -1, rank, size))]


@pytest.mark.parametrize(
    ("check", "args"),
    [
        (_column, (1,)),
        (_column, (3,)),  # a fused QKV weight: each rank gets its heads of Q, K and V
        (_row, ()),
        (_column_then_row, ()),
        (_embedding, ()),
        (_cross_entropy, ()),
    ],
    ids=["column", "column-qkv", "row", "column-then-row", "vocab-embedding", "vocab-cross-entropy"],
)
def test_parallel_layer_matches_its_dense_equivalent(check, args):
    for rank_pairs in launch(check, TP, *args, device="cpu", timeout=120):
        for parallel, dense in rank_pairs:
            assert_close(parallel, dense.detach())


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("dim", [0, 1])
def test_unshard_inverts_shard(dim, chunks):
    full = torch.arange(6 * 12).reshape(6, 12) if dim == 1 else torch.arange(12 * 6).reshape(12, 6)
    slices = [shard(full, dim, rank, 2, chunks) for rank in range(2)]
    assert all(s.shape[dim] == full.shape[dim] // 2 for s in slices)
    assert torch.equal(unshard(slices, dim, chunks), full)


def test_qkv_shard_gives_each_rank_the_same_heads_of_q_k_and_v():
    q, k, v = torch.zeros(4, 2), torch.ones(4, 2), torch.full((4, 2), 2.0)
    mine = shard(torch.cat([q, k, v]), 0, rank=1, size=2, chunks=3)
    assert torch.equal(mine, torch.cat([q[2:], k[2:], v[2:]]))
