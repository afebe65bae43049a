"""The gradient statistics of a measuring step: what is taken on the training thread, and what the record says.

Every N steps (`Monitor(grad_similarity_every=..., checksum_every=...)`) a step measures the replica's gradient
against its peers' (the cosine, `gradients.GradientSimilarity`), the gradient norm where the user reports none,
and the parameter checksum. On the training thread only what the next update or `zero_grad` would change is
taken: each parameter's sum (or, on the CPU, a copy) and each gradient's norm, as tensors, without waiting for
the device. The record reads them on the telemetry client's thread (`record.step_record`), and says why a signal
that was due could not be had (`unavailable`). The math itself is in `gradients.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ProcessGroup

from gpuwatch.trainer.hooks.gradients import (
    GradientSimilarity,
    checksum_of,
    gradient_norms,
    norm_of,
    parameter_sums,
    similarity_of,
)
from gpuwatch.trainer.hooks.safety import Failures, guarded

if TYPE_CHECKING:
    from gpuwatch.trainer.hooks.step import Step

#: On the CPU, parameters up to this size are copied for the checksum, which the client's thread then takes.
COPY_CHECKSUM_BYTES = 32 << 20


class GradientStatistics:
    """One rank's gradient statistics. `params`: the model's parameters (the checksum's, and the gradient norm's
    .grad); `dp_size`: the data-parallel replicas (one: no cosine, the norm from .grad); `shard_groups`: the
    groups one replica is sharded over (TP, PP), where a shard's .grad is not the replica's gradient;
    `stream`: on CUDA, the stream the similarity's sums are read on."""

    def __init__(self, params: Sequence[torch.Tensor], device: torch.device, dp_size: int,
                 shard_groups: tuple[ProcessGroup, ...], failures: Failures, on_host: bool,
                 stream: torch.cuda.Stream | None) -> None:
        self.params = params
        self.failures = failures
        self._device, self._shard_groups, self._stream = device, shard_groups, stream
        self._replicated = dp_size > 1
        #: copy the parameters for the checksum (summed on the client's thread) rather than sum them now
        self._copy = on_host and sum(p.numel() * p.element_size() for p in params) <= COPY_CHECKSUM_BYTES

    def start(self, step: Step) -> None:
        """Set what a step due for the gradient similarity measures: the similarity where there are replicas to
        compare (its sums give the norm too); else the gradient norm from .grad, where the replica has it whole."""
        if self._replicated:
            step.similarity = GradientSimilarity(self._device, self._shard_groups, self.failures, self._stream)
        step.norm_from_grads = not self._replicated and not self._shard_groups

    @guarded
    def take_checksum(self, step: Step) -> None:
        """Each parameter's sum now (the next update changes them); the weighted sum with the record
        (`checksum_of`). On the CPU, a model of at most COPY_CHECKSUM_BYTES is copied instead and summed with the
        record, on the client's thread: a copy costs the training thread a fraction of the fp64 sums (~30 against
        ~110 µs for 68 k parameters in a training loop)."""
        if self._copy:
            step.measure("param_copies", [p.detach().clone() for p in self.params])
        else:
            step.measure("param_sums", parameter_sums(self.params))

    @guarded
    def take_norm(self, step: Step) -> None:
        """Each gradient's norm now (zero_grad and the next backward change them); their norm with the record
        (`norm_of`)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            step.measure("grad_norms", gradient_norms(grads))

    def read(self, measured: dict[str, torch.Tensor | list[torch.Tensor]], values: dict[str, Any]) -> None:
        """The tensors a step measured on the host, final since the monitor made them, into `values`: the
        similarity's sums as they are, the checksum and the norm of the gradients as one number each."""
        copies = measured.pop("param_copies", None)
        if isinstance(copies, list):  # summed here rather than on the training thread
            measured["param_sums"] = parameter_sums(copies)
        values.update({name: [t.item() for t in value] if isinstance(value, list) else value.tolist()
                       for name, value in measured.items()})

    def similarity_fields(self, values: dict[str, Any], record: dict[str, Any], unavailable: dict[str, str]) -> None:
        """On a gradient-similarity step: the cosine, else why not; and the gradient norm when the user reported
        none (into `values`, where the user's would be), else why not."""
        if not self._replicated:
            unavailable["grad_cosine_similarity"] = "no_data_parallel_group"
            if "grad_norm" not in values:
                if "grad_norm_of_grads" in values:  # as step.optimizer() found them
                    values["grad_norm"] = values["grad_norm_of_grads"]
                else:
                    unavailable["grad_norm"] = "no_data_parallel_group" if self._shard_groups else "no_gradient_seen"
            return
        if "similarity" not in values:  # the reduction failed, which is counted in failures
            return
        similarity, reason = similarity_of(values["similarity"])
        if similarity is not None:
            record["grad_cosine_similarity"] = similarity
        elif reason is not None:
            unavailable["grad_cosine_similarity"] = reason
        if "grad_norm" not in values:
            mean_squared, seen = values["similarity"][2], values["similarity"][3]
            if seen > 0:
                scale = values.get("loss_scale", math.nan)
                values["grad_norm"] = math.sqrt(mean_squared) / (scale if math.isfinite(scale) and scale > 0 else 1)
            else:
                unavailable["grad_norm"] = "no_gradient_seen"

    def checksum_field(self, values: dict[str, Any], record: dict[str, Any], unavailable: dict[str, str]) -> None:
        """On a checksum step: the checksum, else why not (a checksum the step could not take, counted in failures,
        is left out)."""
        if not self.params:
            unavailable["param_checksum"] = "no_parameters"
        elif math.isfinite(values.get("param_checksum", math.nan)):
            record["param_checksum"] = values["param_checksum"]


def combine_measured(values: dict[str, Any]) -> None:
    """The per-parameter sums and gradient norms a step measured, from the host (`GradientStatistics.read`) or the
    device (copied without a sync, `HostValues`, which reads a one-element tensor as a number), as one checksum and
    one norm each, in `values`."""
    for name, combined, combine in (("param_sums", "param_checksum", checksum_of),
                                    ("grad_norms", "grad_norm_of_grads", norm_of)):
        if name in values:
            each = values.pop(name)
            values[combined] = combine(each if isinstance(each, list) else [each])
