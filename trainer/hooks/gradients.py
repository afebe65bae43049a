"""Gradient agreement across data-parallel replicas, and a checksum that shows replicas drifting apart.

Gradient cosine similarity, cos(g_i, ḡ) = g_i·ḡ / (|g_i| |ḡ|), between data-parallel rank i's local
gradient g_i (before the reduction) and the DP mean ḡ. Exact, not a sketch: ḡ is what the DP
all-reduce produces anyway, and g_i is still at hand while it does, so three sums g_i·ḡ, |g_i|²
and |ḡ|² are taken bucket by bucket as the reduced values appear, then added over the tensor- and
pipeline-parallel shards of the replica, with a count of the pieces seen. Where the cosine is
undefined, `similarity_of` says why (no gradient seen, a non-finite or a zero gradient), and |ḡ|²
is the squared global gradient norm the optimizer sees, for free.

* compute: per bucket, the difference g_i - ḡ and three norms, |g_i|, |ḡ| and |g_i - ḡ|, from which
  g_i·ḡ = (|g_i|² + |ḡ|² - |g_i - ḡ|²) / 2 (four passes over the bucket, each one vectorised kernel: ~100 µs for
  74 k fp32 elements on a 2-core EPYC VM, against ~420 µs for the three fp32 dot products over 256-element
  chunks this replaced), on measuring steps only (every N);
* memory, on measuring steps only: a copy of one bucket at a time. The reference trainer reduces a
  flat copy of each bucket while .grad keeps the local values, and concatenates those (leaving out
  replicated parameters on all but TP rank 0, which adds a copy of their mean); DDP reduces its
  buckets in place, so each is copied from its launch to its completion (at most one gradient
  copy when all are in flight); without a communication hook the monitor copies every gradient once the
  backward has computed them all and compares them with DDP's averages when those are back
  (`observe_each`: per-parameter norms, no flat copy), so one gradient copy as well;
* communication: none under plain DDP; one all-reduce of 3 fp64 numbers per TP and per PP group
  when the replica is sharded;
* accuracy: exact up to rounding. Each norm is accurate to about fp32's epsilon however large the
  bucket (`_squares`); the identity then puts the cosine within about 1e-7 · (|g_i|/|ḡ| + |ḡ|/|g_i|)
  of its fp64 value, and where it matters most, replicas that see the same data (cos → 1), |g_i - ḡ|
  is computed from the difference itself. The test suite holds the cosine to 1e-6 against an fp64
  brute force over the gathered full gradients of tp 2 × pp 2 × dp 2 runs, and against what a DDP
  script computes beside DDP.

Parameter checksum: Σ_j (j + 1) · Σ_k p_jk over this rank's parameters j in a fixed order, summed in
fp64. Replicas that hold the same weights produce the same bits (the same reduction in the same
order); a replica that missed an update, applied another learning rate or loaded other weights
moves it by far more than fp64 rounding. The weights (j + 1) keep two tensors' changes from
cancelling. One read of the parameters, every N steps: each parameter's fp64 sum on the training thread (the
next update changes them), their weighted sum with the record.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gpuwatch.trainer.hooks.safety import Failures, guarded


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
        local, mean = local.detach().reshape(-1), mean.detach().reshape(-1)
        self._add(_squares(local, mean, local - mean))

    @guarded
    def observe_each(self, locals_: list[torch.Tensor], means: list[torch.Tensor]) -> None:
        """Many tensors at once (one parameter's gradient each, in pairs of equal shape): the same sums from
        each tensor's norm, with no flat copy of either: one `torch._foreach_norm` over the locals and the means,
        one over the differences, summed per kind in fp64 (each op is a few µs of dispatch on the CPU, where this
        runs on the training thread: the fewer, the cheaper a measuring step). `locals_` must be the caller's own
        copies: they are overwritten with the differences g_i - ḡ."""
        norms = list(torch._foreach_norm([*locals_, *means]))
        torch._foreach_sub_(locals_, means)
        norms += torch._foreach_norm(locals_)
        self._add(torch.stack(norms).double().square().view(3, -1).sum(1))

    def _add(self, squares: torch.Tensor) -> None:
        """One piece's sums from its three squared norms [|g|², |ḡ|², |g - ḡ|²] (an fp64 device tensor), in one
        op: [g·ḡ, |g|², |ḡ|², 1] with g·ḡ = (|g|² + |ḡ|² - |g - ḡ|²) / 2, the count a device tensor too (one made
        from a Python number would sync)."""
        polarisation, count = _polarisation(squares.device)
        part = torch.addmv(count, polarisation, squares)
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


def _polarisation(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The matrix and vector that turn [|g|², |ḡ|², |g - ḡ|²] into [g·ḡ, |g|², |ḡ|², 1] (`GradientSimilarity._add`),
    made once per device."""
    constants = _POLARISATION.get(device)
    if constants is None:
        matrix = torch.tensor([[0.5, 0.5, -0.5], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]],
                              dtype=torch.float64, device=device)
        constants = _POLARISATION[device] = (matrix, torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64,
                                                                   device=device))
    return constants


_POLARISATION: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _squares(*vectors: torch.Tensor) -> torch.Tensor:
    """|v|² of each vector, in fp64, as a device tensor: `torch.linalg.vector_norm` in the vectors' own dtype
    (one pass each; its sum runs in fp64 on the CPU and as a tree on CUDA, so the error stays near the dtype's
    epsilon however long the vector), squared in fp64."""
    return torch.stack([torch.linalg.vector_norm(vector) for vector in vectors]).double().square()


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


def gradient_norms(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's 2-norm, as clip_grad_norm_ takes them (one `torch._foreach_norm` per device and dtype): 0-d
    tensors, on the first one's device unless all share one device and dtype, to be read later without a sync and
    added up with `norm_of`."""
    device, dtype = grads[0].device, grads[0].dtype
    if all(grad.device == device and grad.dtype == dtype for grad in grads):  # the usual case: one pass, no casts
        return list(torch._foreach_norm(list(grads)))
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = collections.defaultdict(list)
    for grad in grads:
        groups[grad.device, grad.dtype].append(grad)
    return [norm.to(device, torch.float64) for group in groups.values() for norm in torch._foreach_norm(group)]


def norm_of(norms: Iterable[float]) -> float:
    """The 2-norm of all the gradients together, from each one's (`gradient_norms`), in fp64."""
    return math.sqrt(math.fsum(norm * norm for norm in norms))


def gradient_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of `grads` together (`gradient_norms`), as a 0-d fp64 tensor on the first one's device."""
    return torch.linalg.vector_norm(torch.stack(gradient_norms(grads)), dtype=torch.float64)


def parameter_sums(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Σ_k p_jk of each parameter j, in fp64: 0-d tensors on its device, to be read later without a sync and
    weighted with `checksum_of`."""
    return [p.detach().sum(dtype=torch.float64) for p in params]


def checksum_of(sums: Sequence[float]) -> float:
    """Σ_j (j + 1) · s_j over the parameters' sums (`parameter_sums`), correctly rounded (`math.fsum`): the same
    bits for the same sums in the same order, whatever the machine."""
    return math.fsum((j + 1) * total for j, total in enumerate(sums))


def parameter_checksum(params: Sequence[torch.Tensor]) -> float:
    """Σ_j (j + 1) · Σ_k p_jk in fp64 (`parameter_sums`, `checksum_of`). Reads the sums at once, which waits for
    a GPU: the Monitor takes them without waiting and weights them with the record."""
    return checksum_of([total.item() for total in parameter_sums(params)])
