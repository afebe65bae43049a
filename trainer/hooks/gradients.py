"""Gradient agreement across data-parallel replicas, and a checksum that shows replicas drifting apart.

Gradient cosine similarity, cos(g_i, ḡ) = g_i·ḡ / (|g_i| |ḡ|), between data-parallel rank i's local
gradient g_i (before the reduction) and the DP mean ḡ. Exact, not a sketch: ḡ is what the DP
all-reduce produces anyway, and g_i is still at hand while it does, so three sums g_i·ḡ, |g_i|²
and |ḡ|² are taken bucket by bucket as the reduced values appear, then added over the tensor- and
pipeline-parallel shards of the replica, with a count of the pieces seen. Where the cosine is
undefined, `similarity_of` says why (no gradient seen, a non-finite or a zero gradient), and |ḡ|²
is the squared global gradient norm the optimizer sees, for free.

* compute: three dot products per bucket (~3 multiply-adds per parameter; about 3x the time of a
  plain fp32 dot on the CPU, for the accuracy below), on measuring steps only (every N);
* memory, on measuring steps only: a copy of one bucket at a time. The reference trainer reduces a
  flat copy of each bucket while .grad keeps the local values, and concatenates those (leaving out
  replicated parameters on all but TP rank 0, which adds a copy of their mean); DDP reduces its
  buckets in place, so each is copied from its launch to its completion (at most one gradient
  copy when all are in flight);
* communication: none under plain DDP; one all-reduce of 3 fp64 numbers per TP and per PP group
  when the replica is sharded;
* accuracy: exact up to rounding. Dot products are fp32 over chunks of 256 elements, the chunks
  added in fp64 (`_dot`), so the error stays near fp32's epsilon however large a bucket; against an
  fp64 brute force over the gathered full gradients of tp 2 × pp 2 × dp 2 runs the cosine was off
  by at most 8e-8 (55 k and 0.87 M parameters; one plain fp32 dot per bucket: 5e-6), and the test
  suite holds it to 1e-6.

Parameter checksum: Σ_j (j + 1) · Σ_k p_jk over this rank's parameters j in a fixed order, summed in
fp64. Replicas that hold the same weights produce the same bits (the same reduction in the same
order); a replica that missed an update, applied another learning rate or loaded other weights
moves it by far more than fp64 rounding. The weights (j + 1) keep two tensors' changes from
cancelling. One read of the parameters, every N steps.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gpuwatch.trainer.hooks._safety import Failures, guarded

#: Elements per fp32 partial dot product (see `_dot`).
DOT_CHUNK = 256


class GradientSimilarity:
    """Accumulates g_i·ḡ, |g_i|², |ḡ|² and a count of the pieces over one step's gradient tensors (`observe`),
    then adds them up over the shards of the replica (`reduce`).

    `shard_groups`: the groups one data-parallel replica is sharded over (TP, PP; none under plain DDP).
    `observe` may run on a DDP communication thread while the training thread computes: on CUDA,
    `consumer` is the stream the training thread will read the sums on.
    """

    def __init__(
        self,
        device: torch.device,
        shard_groups: tuple[ProcessGroup, ...] = (),
        failures: Failures | None = None,
        consumer: torch.cuda.Stream | None = None,
    ) -> None:
        self.failures = failures or Failures()
        self._device, self._shard_groups, self._consumer = device, shard_groups, consumer
        self._parts: list[torch.Tensor] = []
        self._total: torch.Tensor | None = None

    @guarded
    def observe(self, local: torch.Tensor, mean: torch.Tensor) -> None:
        """One bucket (or tensor): this rank's gradient values and their DP mean, any shape, same numel."""
        local, mean = local.detach().reshape(-1).float(), mean.detach().reshape(-1).float()
        dot = _dot(local, mean)  # the count as a device tensor too: one made from a Python number would sync
        part = torch.stack([dot, _dot(local, local), _dot(mean, mean), torch.ones_like(dot)])
        if self._consumer is not None and part.is_cuda:
            part.record_stream(self._consumer)  # made on a comm stream, read on the training stream
        self._parts.append(part)

    @guarded
    def reduce(self) -> torch.Tensor:
        """[g·ḡ, |g|², |ḡ|², pieces seen] of the whole replica (fp64), this rank's parts all-reduced over the
        shard groups; once, later calls return the same tensor. A collective: every rank of those groups
        makes it on the same steps, even when its own part failed (then NaN, which reads as no gradient
        seen). Call it where the ranks are in step anyway (the reference trainer: before the global gradient
        norm's all-reduces), or the monitor does at the step's end."""
        if self._total is None:
            total = self._local_sums()
            if total is None:
                total = torch.full((4,), math.nan, dtype=torch.float64, device=self._device)
            for group in self._shard_groups:
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(total, group=group)
            self._total = total
        return self._total

    @guarded
    def _local_sums(self) -> torch.Tensor:
        if not self._parts:
            return torch.zeros(4, dtype=torch.float64, device=self._device)
        return torch.stack(self._parts).sum(0)


def _dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x·y in fp64 from fp32 dot products over chunks of DOT_CHUNK elements (one batched matmul, no copy of
    the bucket). A single fp32 dot over a whole bucket loses the many small products of a gradient to a
    large running sum (5e-6 off in the cosine at 0.4 M elements); chunks keep the error near fp32's
    epsilon however long the bucket. (On CUDA with TF32 matmuls allowed the chunks are TF32 products.)"""
    n = x.numel() // DOT_CHUNK * DOT_CHUNK
    chunks = torch.bmm(x[:n].view(-1, 1, DOT_CHUNK), y[:n].view(-1, DOT_CHUNK, 1))  # one fp32 dot per chunk
    return chunks.double().sum() + torch.dot(x[n:], y[n:]).double()


def cosine(dot: float, local_squared: float, mean_squared: float) -> float | None:
    """cos from the three sums, clamped to [-1, 1] against rounding; None when a gradient is zero or not finite.
    The square roots are taken apart, so two large finite norms cannot overflow their product."""
    denominator = math.sqrt(max(0.0, local_squared)) * math.sqrt(max(0.0, mean_squared))  # max(0.0, nan) is 0.0
    value = dot / denominator if 0 < denominator < math.inf else math.nan
    return max(-1.0, min(1.0, value)) if math.isfinite(value) else None


def similarity_of(sums: Sequence[float]) -> tuple[float | None, str | None]:
    """The cosine from `GradientSimilarity.reduce`'s four sums, or None and why not (a reason code of
    schema.UNAVAILABLE_REASONS): the hooks saw no gradient, one held NaN/Inf, or one was zero."""
    dot, local_squared, mean_squared, seen = sums
    if not seen > 0:  # NaN too: the hooks failed on some shard
        return None, "no_gradient_seen"
    if not math.isfinite(dot + local_squared + mean_squared):
        return None, "nonfinite_gradient"
    value = cosine(dot, local_squared, mean_squared)
    return (value, None) if value is not None else (None, "zero_gradient")


def gradient_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of `grads` together, as clip_grad_norm_ takes it (one `torch._foreach_norm` per device
    and dtype), as a 0-d fp64 tensor on the first one's device, to be read later without a sync."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = collections.defaultdict(list)
    for grad in grads:
        groups[grad.device, grad.dtype].append(grad)
    device = grads[0].device
    norms = [norm.to(device, torch.float64) for group in groups.values() for norm in torch._foreach_norm(group)]
    return torch.linalg.vector_norm(torch.stack(norms))


def parameter_checksum(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ_j (j + 1) · Σ_k p_jk in fp64, as a 0-d tensor on the parameters' device (read it without a sync later)."""
    sums = torch.stack([p.detach().sum(dtype=torch.float64) for p in params])
    weights = torch.arange(1, len(params) + 1, dtype=torch.float64, device=sums.device)
    return torch.dot(sums, weights)
