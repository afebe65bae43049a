"""Tensor parallelism (Megatron-LM): layers whose weights are split across the ranks of a TP group.

Two operators carry all of it (Megatron-LM paper, §3):

    f = copy_to_tp      forward: identity     backward: all-reduce  (entering a column-parallel layer)
    g = reduce_from_tp  forward: all-reduce   backward: identity    (leaving a row-parallel layer)

They are autograd functions of our own: torch.distributed.nn.functional.all_reduce differentiates
to another all-reduce, which is wrong for g.

A block's MLP is column-parallel (each rank computes a slice of the hidden units) followed by
row-parallel (each rank multiplies its slice, g sums): one all-reduce forward and one backward per
layer pair. Attention is the same with whole heads per rank. The vocabulary is split in the
embedding and in the LM head, and the cross-entropy works on the split logits, never gathering them.

Every layer is built from the full (dense) tensors and keeps its own slice, so a parallel model
starts from exactly the weights of the single-process one. Split parameters carry `tp_split =
(dim, chunks)`: gradient-norm code counts them on every rank, replicated ones once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from gpuwatch.trainer.parallel.comm import all_reduce


def shard(full: torch.Tensor, dim: int, rank: int, size: int, chunks: int = 1) -> torch.Tensor:
    """Slice `rank` of `size` along `dim`. With chunks > 1, `full` is that many blocks stacked along
    `dim` (Q, K and V) and each block is sliced, so a rank gets its own heads of every block."""
    blocks = full.chunk(chunks, dim)
    return torch.cat([block.chunk(size, dim)[rank] for block in blocks], dim).contiguous()


def unshard(shards: list[torch.Tensor], dim: int, chunks: int = 1) -> torch.Tensor:
    """Inverse of shard: the full tensor from every rank's slice, in TP rank order."""
    pieces = [s.chunk(chunks, dim) for s in shards]
    return torch.cat([torch.cat([p[c] for p in pieces], dim) for c in range(chunks)], dim)


def is_tp_split(param: torch.Tensor) -> bool:
    return hasattr(param, "tp_split")


def split_parameter(full: torch.Tensor, dim: int, group: ProcessGroup, chunks: int = 1) -> nn.Parameter:
    """This rank's slice of `full` as a parameter, marked as split."""
    param = nn.Parameter(shard(full, dim, dist.get_rank(group), dist.get_world_size(group), chunks))
    # A tensor takes Python attributes at run time; torch's stubs declare none beyond its own.
    param.tp_split = (dim, chunks)  # type: ignore[attr-defined]
    return param


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return all_reduce(x.clone(memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """f: identity forward; backward sums the input gradient over the TP ranks."""
    return x if dist.get_world_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """g: sums partial results over the TP ranks forward; identity backward."""
    return x if dist.get_world_size(group) == 1 else _ReduceFromTP.apply(x, group)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's output rows split: the input is replicated, each rank gets its slice of y.

    `weight` is the full [out, in] matrix; `chunks` says it stacks that many blocks (3 for a fused
    QKV projection), each split on its own.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, group: ProcessGroup, chunks: int = 1) -> None:
        super().__init__()
        self.group = group
        self.weight = split_parameter(weight, 0, group, chunks)
        self.bias = split_parameter(bias, 0, group, chunks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's input columns split: each rank multiplies its slice of x (a column-parallel
    layer's output) and g sums the partial products. The bias is replicated and added once, after g."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, group: ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.weight = split_parameter(weight, 1, group)
        self.bias = nn.Parameter(bias.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.group) + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary's rows split: each rank looks up the tokens it owns, writes
    zeros for the others, and g sums, so every rank ends with the full embedding."""

    def __init__(self, weight: torch.Tensor, group: ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.weight = split_parameter(weight, 0, group)
        self.vocab_start = dist.get_rank(group) * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_tp(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """loss = log Σ exp(z) − z[target] over the full vocabulary, from each rank's slice of the logits.

    Forward exchanges one max and one (sum of exp, target logit) pair per token, never the logits.
    Backward needs no communication: d loss / d z = softmax(z) − onehot(target), slice by slice.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        z = logits.float()
        z = z - all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX).unsqueeze(-1)  # for a stable exp
        local = targets - dist.get_rank(group) * z.shape[-1]
        owned = (local >= 0) & (local < z.shape[-1])
        local = local.masked_fill(~owned, 0)
        target_logit = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        exp = z.exp()
        sum_exp, target_logit = all_reduce(torch.stack([exp.sum(dim=-1), target_logit]), group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, owned)
        ctx.logits_dtype = logits.dtype
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local, owned = ctx.saved_tensors
        grad = softmax.scatter_add(-1, local.unsqueeze(-1), -owned.unsqueeze(-1).to(softmax.dtype))
        return (grad * grad_loss.unsqueeze(-1)).to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Per-token cross-entropy (fp32) of logits whose last dimension is this rank's vocabulary slice."""
    return _VocabParallelCrossEntropy.apply(logits, targets, group)
