"""A resolved step's record (gpuwatch.protocol.schema), built on the telemetry client's thread.

The training thread only took marks and kept the values that would change under it (`step.Step.__exit__`); the
record is built here (`step.Step.finish`), beside the training loop, once the device has passed every mark, from the
step and what its Monitor handed it (`step.StepContext`). The less Python here, the
less it takes the GIL from the training thread: wall-clock marks are subtracted inline, not through
`Clock.seconds`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from gpuwatch.protocol.schema import SCHEMA_VERSION, STEP_PHASES
from gpuwatch.trainer.hooks.clock import Clock, Mark
from gpuwatch.trainer.hooks.collectives import by_group, by_phase, exposed_seconds, histogram, resolve
from gpuwatch.trainer.hooks.cpu_times import thread_seconds
from gpuwatch.trainer.hooks.gradient_stats import combine_measured
from gpuwatch.trainer.hooks.safety import Failures

if TYPE_CHECKING:
    from gpuwatch.trainer.hooks.step import Step


def step_record(step: Step) -> dict[str, Any] | None:
    """The step record of a resolved step; None for a step that never started or ended."""
    if step.start is None or step.end is None:
        return None
    context = step.context
    clock, on_host = context.clock, context.on_host
    step_seconds = max(0.0, step.end - step.start) if on_host else clock.seconds(step.start, step.end)
    record: dict[str, Any] = {
        "v": SCHEMA_VERSION, "kind": "step", "job": context.job, "rank": context.rank, "time": step.time,
        "step": step.number, "step_seconds": step_seconds,
    }
    phases: dict[str, float] = {}
    phase_ends: dict[str, Mark] = {}
    for name, start, end in step.phases:
        phases[name] = phases.get(name, 0.0) + (max(0.0, end - start) if on_host else clock.seconds(start, end))
        phase_ends[name] = end
    calls = [call for call in step.calls if call.end is not None] if step.calls else None
    exposed: dict[str | None, float] = {}
    groups: dict[str, dict[str, Any]] = {}
    if calls:
        resolve(calls, clock)
        waited = exposed_seconds(calls, phase_ends, clock)
        exposed, groups = by_phase(waited), by_group(calls, waited)
    for phase, start, end in step.waits:  # DDP's all-reduce tail, waited for whole
        exposed[phase] = exposed.get(phase, 0.0) + (
            max(0.0, end - start) if on_host else clock.seconds(start, end))
    # Each phase net of the collectives waited for inside it, and outside the model the rest of the step:
    # with the exposed collectives they sum to the step (schema.STEP_PHASES)
    accounted = sum(exposed.values())
    for phase, field in STEP_PHASES.items():
        if phase in phases:
            record[field] = seconds = max(0.0, phases[phase] - exposed.get(phase, 0.0))
            accounted += seconds
    if phases:
        record["outside_model_seconds"] = max(0.0, step_seconds - accounted)
    if step.cpu_at_start is not None and step.cpu_at_end is not None:
        on_cpu, cpu_wait = thread_seconds(step.cpu_at_start, step.cpu_at_end)
        record["cpu_seconds"], record["cpu_wait_seconds"] = min(step_seconds, on_cpu), min(step_seconds, cpu_wait)
    if step.pipeline is not None:
        pipeline = step.pipeline.result()
        if pipeline is not None:
            record["pipeline"] = pipeline
    if calls:
        record["collectives"] = histogram(calls)
    if calls or step.waits:
        record["exposed_collective_seconds"] = sum(exposed.values())
    watch = context.ddp_watch
    if step.waits and watch is not None:  # DDP's all-reduce, whose calls no hook sees: its volume
        record["gradient_sync_bytes"] = watch.sync_bytes
    if step.collective_calls:
        record["collective_calls"] = step.collective_calls
    if groups:
        record["groups"] = groups
    assert step.scalars is not None  # set when the step ended; only ended steps are recorded
    values: dict[str, Any] = dict(step.scalars)
    if step.reported is not None:
        read_reported(step.reported, values, context.failures)
    if step.host is not None:
        values.update(step.host.read())
    gradients = context.gradients
    if step.measured is not None:  # the monitor's own tensors on the host, final since it made them
        gradients.read(step.measured, values)
    combine_measured(values)  # on a GPU they came with the device's values (step.host)
    unavailable: dict[str, str] = {}
    if step.similarity_due:
        gradients.similarity_fields(values, record, unavailable)
    # loss, grad_norm, lr, loss_scale and the nonfinite flag, as the schema takes them
    loss, grad_norm = values.get("loss"), values.get("grad_norm")
    if loss is not None:
        record["loss"] = loss
    if grad_norm is not None:
        record["grad_norm"] = grad_norm
    if loss is not None or grad_norm is not None:
        record["nonfinite"] = not ((loss is None or math.isfinite(loss))
                                   and (grad_norm is None or math.isfinite(grad_norm)))
    for name in ("lr", "loss_scale"):  # finite and non-negative, or left out
        value = values.get(name)
        if value is not None and math.isfinite(value) and value >= 0:
            record[name] = value
    if step.checksum_due:
        gradients.checksum_field(values, record, unavailable)
    if unavailable:
        record["unavailable"] = unavailable
    if step.memory is not None:
        record["memory"] = step.memory
    if step.samples is not None:
        record["samples"] = step.samples
    if step.tokens is not None:
        record["tokens"] = step.tokens
        flops_per_token, peak = context.flops_per_token, context.peak_flops
        if flops_per_token and step_seconds > 0:
            flops = flops_per_token * step.tokens / step_seconds
            record["model_flops_per_second"] = flops
            if peak and flops <= peak:  # above peak: a wrong flops_per_token
                record["mfu"] = flops / peak
    return record


def read_reported(reported: dict[str, tuple[torch.Tensor, int]], values: dict[str, Any], failures: Failures) -> None:
    """The host tensors the user reported, read now (on the client's thread) where they have not changed since
    the step ended; one that has is left out, and counted as a failure (report a copy, or a number)."""
    for name, (tensor, version) in reported.items():
        value = plain(tensor)
        if tensor._version == version:  # after the read: unchanged until then, so the value is the step's
            values[name] = value
        else:
            failures.record("Step.report", RuntimeError(
                f"the tensor reported as {name} changed before the record read it: report a copy or a number"))


class HostValues:
    """A step's values, some of them device tensors, brought to the host without a sync: one
    non-blocking copy into pinned memory, read once the device has passed the mark after it. Values
    on the CPU are read at once: a tensor the user reported may change in the next step."""

    __slots__ = ("_clock", "_host", "_sizes", "_values", "mark")

    def __init__(self, values: Mapping[str, float | torch.Tensor], clock: Clock) -> None:
        self._clock = clock
        self._host: torch.Tensor | None = None
        self.mark: Mark | None = None
        self._values: dict[str, float | list[float]] = {}
        on_gpu: dict[str, torch.Tensor] | None = None
        for name, value in values.items():
            if type(value) is float:
                self._values[name] = value
            elif isinstance(value, torch.Tensor) and value.is_cuda:
                if on_gpu is None:
                    on_gpu = {}
                on_gpu[name] = value.detach().reshape(-1).double()
            else:
                self._values[name] = plain(value)
        self._sizes: dict[str, int] = {}
        if on_gpu:
            self._sizes = {name: t.numel() for name, t in on_gpu.items()}
            flat = torch.cat(list(on_gpu.values()))
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self.mark = clock.mark()

    def ready(self) -> bool:
        return self.mark is None or self._clock.ready(self.mark)

    def read(self) -> dict[str, Any]:
        """name → float, or a list of floats for a tensor of several elements."""
        values = dict(self._values)
        if self._host is not None:
            flat = self._host.tolist()
            for name, size in self._sizes.items():
                values[name], flat = (flat[0] if size == 1 else flat[:size]), flat[size:]
        return values


def plain(value: float | torch.Tensor) -> float | list[float]:
    """A number, or a CPU tensor's value(s) (reading a CPU tensor needs no device sync)."""
    if not isinstance(value, torch.Tensor):
        return float(value)
    if value.numel() == 1:  # every value but the similarity's sums
        return float(value.item())
    return value.detach().reshape(-1).double().tolist()
