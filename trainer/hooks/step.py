"""The objects the training loop holds: a `Step`, its phases (`Phase`) and its timed collectives (`CollectiveTimer`).

This is the hot path: every step the training thread enters and leaves a step and a few phases, and a
tensor-parallel layer times several collectives a micro-batch. So none of them has an `__init__` that the
Monitor could do without (it fills a Step's and a Phase's slots itself), none calls a method of its own, and
each guards itself inline rather than with `guarded` (a wrapper's Python frame per call adds up here). They
read and write the state their Monitor shares with them (`Monitor.current`, `data_wait`, `pending`, ...)
directly, for the same reason: a method of the Monitor's per step would be one more frame.

A step's measurements are marks (`clock`) and device tensors taken without waiting for the device; the
Monitor builds its record (`record.step_record`) once they are resolved.
"""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.distributed import ProcessGroup

from gpuwatch.trainer.hooks.clock import Mark
from gpuwatch.trainer.hooks.collectives import Call
from gpuwatch.trainer.hooks.gradients import GradientSimilarity
from gpuwatch.trainer.hooks.off import OFF, Off
from gpuwatch.trainer.hooks.pipeline import PipelineClock, WindowClock
from gpuwatch.trainer.hooks.progress import InFlight, error_record
from gpuwatch.trainer.hooks.record import HostValues, plain
from gpuwatch.trainer.hooks.safety import Failures

if TYPE_CHECKING:
    from gpuwatch.trainer.hooks.monitor import Monitor

#: Makes an instance without calling its class (no `__init__` frame): `Monitor.step` fills a Step's slots, and the
#: Step a Phase's.
new = object.__new__


class Step:
    """One training step: a context manager around it, with phases inside (`data`, `compute`,
    `optimizer`) and the values only the training loop knows (`report`)."""

    __slots__ = ("calls", "checksum_due", "collective_calls", "end", "failures", "host", "measured", "memory",
                 "memory_due", "monitor", "norm_from_grads", "number", "phase", "phases", "pipeline", "reported",
                 "samples", "scalars", "similarity", "similarity_due", "start", "time", "tokens", "values", "waits")

    # Made by Monitor.step (no __init__: a Python frame fewer on the hot path). What each slot holds:
    monitor: Monitor
    failures: Failures
    number: int
    tokens: int | None
    samples: int | None
    start: Mark | None
    end: Mark | None
    phase: str | None  # the phase open now, which collective calls are attributed to
    phases: list[tuple[str, Mark, Mark]]  # (name, start, end) of each interval, in order
    calls: list[Call]  # timed collective calls (the comm layer's, the bucket hook's)
    collective_calls: dict[str, int] | None  # the monitor's count per group as the step ended
    waits: list[tuple[str | None, Mark, Mark]]  # DDP's all-reduce tails: (phase, start, end)
    values: dict[str, float | torch.Tensor]  # what the user reported
    #: tensors the monitor made on a measuring step (a tensor, or one per parameter), read with the record
    measured: dict[str, torch.Tensor | list[torch.Tensor]] | None
    pipeline: PipelineClock | WindowClock | None
    memory: dict[str, Any] | None
    time: float
    scalars: dict[str, float | list[float]] | None  # the values read on the host, at the end
    reported: dict[str, tuple[torch.Tensor, int]] | None  # the user's host tensors and their versions, at the end
    host: HostValues | None  # the values on the device, copied to the host without a sync
    checksum_due: bool
    memory_due: bool
    similarity_due: bool
    #: this step's GradientSimilarity, or None when the step does not measure it (or nothing would feed it)
    similarity: GradientSimilarity | None
    norm_from_grads: bool  # whether step.optimizer() takes the gradient norm from .grad

    def __enter__(self) -> Step:
        # The hot path guards itself inline (as `CollectiveTimer` does): a `guarded` wrapper per call adds up here.
        monitor = self.monitor
        try:
            wait, monitor.data_wait = monitor.data_wait, None
            if wait is None:
                self.start = monitor.mark()
            else:  # measured by data() just before this step, which then starts with it
                self.start = wait[0]
                self.phases.append(("data", wait[0], wait[1]))
            monitor.current = self
            watch = monitor.ddp_watch
            if watch is not None:
                watch.tail_stage = 0  # a backward that raised never ran its callbacks
            progress = monitor.progress
            progress.at("step")
            progress.step_started = progress.since
        except Exception as error:
            self.failures.record("Step.__enter__", error)
        return self

    def __exit__(self, exc_type: type | None, *exc_info: object) -> Literal[False]:
        """The step's end mark and what the record needs before the next step changes it, then the hand-over;
        nothing here waits for the device. Guarded inline, in parts (the hot path, as `__enter__`)."""
        monitor = self.monitor
        monitor.current = None
        watch = monitor.ddp_watch
        if watch is not None and (watch.grad_handles or watch.keep_at_tail):  # a measuring step DDP never averaged
            watch.drop_gradients()  # (a failed backward)
        progress = monitor.progress
        if exc_type is not None:  # the training loop raised: no step record, and no collective of ours to wait in
            error = exc_info[0]
            if isinstance(error, BaseException):  # said at once: the rank may be about to die, its peers to wait
                try:
                    monitor.raised = True
                    monitor.client.send(error_record(monitor.job, monitor.layout.rank, progress, error))
                except Exception as failure:
                    self.failures.record("Step.__exit__", failure)
            return False
        progress.step = self.number
        progress.at("idle")
        if progress.step_started is not None:
            progress.durations.append(progress.since - progress.step_started)
        monitor.raised = False  # a step that raised was caught, and training went on
        try:
            self.end = monitor.mark()
        except Exception as error:
            self.failures.record("Clock.mark", error)
        if monitor.collective_counts:
            self.collective_calls = monitor.collective_counts.copy()
        if self.similarity is not None:
            # A collective over the shard groups unless the training loop made it already: every rank
            # makes it on every measuring step, whatever else fails here, or its peers would wait forever.
            sums = self.similarity.reduce()
            if sums is not None:
                self.measure("similarity", sums)
        if self.checksum_due and monitor.params:
            monitor.gradients.take_checksum(self)
        if self.memory_due and monitor.memory is not None:
            try:
                self.memory = monitor.memory.read()
                monitor.memory.reset()  # the next reading's peak starts here
            except Exception as error:
                self.failures.record("Monitor._read_memory", error)
        try:
            self.time = time.time()
            # The user's values: numbers as they are; tensors on the host read with the record, on the client's
            # thread, if they have not changed by then (their version counter says: the next step may change a
            # tensor the user reported); tensors on the device copied to the host without a sync (`HostValues`),
            # with those the monitor made there. The monitor's own host tensors never change: read with the record.
            scalars: dict[str, float | list[float]] = {}
            on_device: dict[str, torch.Tensor] | None = None
            for name, value in self.values.items():
                if type(value) is float:
                    scalars[name] = value
                elif not isinstance(value, torch.Tensor):
                    scalars[name] = float(value)
                elif value.is_cuda:
                    if on_device is None:
                        on_device = {}
                    on_device[name] = value
                else:
                    try:
                        version = value._version
                    except RuntimeError:  # an inference tensor has no version counter: read it now
                        scalars[name] = plain(value)
                        continue
                    if self.reported is None:
                        self.reported = {}
                    self.reported[name] = (value, version)
            self.scalars = scalars
            if self.measured is not None and not monitor.on_host:
                on_device = {**(on_device or {}), **{name: torch.stack(value) if isinstance(value, list) else value
                                                     for name, value in self.measured.items()}}
                self.measured = None
            if on_device is not None:
                self.host = HostValues(on_device, monitor.clock)
            if monitor.on_host and not monitor.pending and self.pipeline is None:  # resolved: hand it over
                monitor.client.submit(partial(monitor.finish, self))
                return False
            monitor.pending.append(self)
        except Exception as error:
            self.failures.record("Monitor._end", error)
        monitor.flush()
        return False

    # The phases are made by hand: `Phase(self, name)` would cost an `__init__` frame more on the hot path.

    def data(self) -> Phase:
        """Waiting for the input batch."""
        phase = new(Phase)
        phase.step, phase.name, phase.start = self, "data", None
        return phase

    def compute(self) -> Phase:
        """Forward and backward; time spent waiting on collectives inside it is taken out."""
        phase = new(Phase)
        phase.step, phase.name, phase.start = self, "compute", None
        return phase

    def optimizer(self) -> Phase:
        """The optimizer's update. On a measuring step without the gradient similarity's sums, the gradient norm
        is taken from .grad here, before the update and before zero_grad (and not timed as the optimizer's)."""
        if self.norm_from_grads:
            self.norm_from_grads = False
            self.monitor.gradients.take_norm(self)
        phase = new(Phase)
        phase.step, phase.name, phase.start = self, "optimizer", None
        return phase

    def report(
        self,
        *,
        loss: float | torch.Tensor | None = None,
        grad_norm: float | torch.Tensor | None = None,
        lr: float | None = None,
        loss_scale: float | torch.Tensor | None = None,
    ) -> None:
        """Values of this step; tensors are read later without a sync. A non-finite loss or gradient norm
        sets the record's `nonfinite` flag."""
        values = self.values
        try:
            if loss is not None:
                values["loss"] = loss
            if grad_norm is not None:
                values["grad_norm"] = grad_norm
            if lr is not None:
                values["lr"] = lr
            if loss_scale is not None:
                values["loss_scale"] = loss_scale
        except Exception as error:  # guarded inline, as in __enter__
            self.failures.record("Step.report", error)

    def measure(self, name: str, value: torch.Tensor | list[torch.Tensor]) -> None:
        """Keep a tensor the monitor made (or one per parameter) for the record."""
        if self.measured is None:
            self.measured = {}
        self.measured[name] = value

    def pipeline_clock(self, group: ProcessGroup, micro_batches: int) -> PipelineClock | Off:
        """A clock for this step's pipeline schedule over `group` (the stage's pipeline, its rank 0 the first
        stage), or OFF when the pipeline signal is off or there is one stage. Every stage must ask on
        the same steps and call its `start`, `busy` and `stop` (`PipelineClock`)."""
        try:
            if "pipeline" in self.monitor.signals and torch.distributed.get_world_size(group) > 1:
                self.pipeline = PipelineClock(self.monitor.clock, self.failures, group, micro_batches,
                                              self.monitor.device)
                return self.pipeline
        except Exception as error:
            self.failures.record("Step.pipeline_clock", error)
        return OFF

    def window_clock(self, group: ProcessGroup | None, theoretical: float | None) -> PipelineClock | WindowClock:
        """This step's pipeline clock seen from outside the schedule over `group` (`WindowClock`, for `gpuwatch
        run`): the one the step has already, or a new one; `theoretical` the schedule's bubble with equal stages,
        where known."""
        if self.pipeline is None:
            self.pipeline = WindowClock(self.monitor.clock, self.calls, self.monitor.group_name(group), theoretical)
        return self.pipeline

    def ready(self) -> bool:
        """Whether the device has passed every mark, so the record can be built without waiting."""
        if self.scalars is None or (self.host is not None and not self.host.ready()) or (
                self.pipeline is not None and not self.pipeline.ready()):
            return False
        if any(call.end is None for call in self.calls):
            return False
        ready = self.monitor.clock.ready
        return all(ready(end) for _, _, end in self.waits)

    def marks(self) -> list[Mark]:
        marks = [self.start, self.end] + [m for _, start, end in self.phases for m in (start, end)]
        marks += [m for call in self.calls for m in (call.start, call.end)]
        marks += [m for _, start, end in self.waits for m in (start, end)]
        marks += self.pipeline.marks() if self.pipeline is not None else []
        marks += [self.host.mark] if self.host is not None and self.host.mark is not None else []
        return [m for m in marks if m is not None]


class Phase:
    """`with step.compute():` and the like; phases may repeat within a step (their times add up). Made by
    `Step.data`, `compute` and `optimizer`, without an `__init__`."""

    __slots__ = ("name", "outer", "start", "step")
    step: Step
    name: str
    start: Mark | None
    outer: str | None  # the phase this one is inside, restored as it ends

    def __enter__(self) -> None:
        step = self.step  # guarded inline, as Step.__enter__
        try:
            self.outer, step.phase = step.phase, self.name
            step.monitor.progress.at(self.name)
            self.start = step.monitor.mark()
        except Exception as error:
            self.start = None
            step.failures.record("Phase.__enter__", error)

    def __exit__(self, *exc_info: object) -> Literal[False]:
        step = self.step
        try:
            if self.start is not None:
                step.phases.append((self.name, self.start, step.monitor.mark()))
            step.phase = self.outer
            step.monitor.progress.at(self.outer or "step")
        except Exception as error:
            step.failures.record("Phase.__exit__", error)
        return False


class CollectiveTimer:
    """One blocking collective call, timed by `Monitor.collective`. On the hot path (a tensor-parallel
    layer makes several calls per micro-batch), so it guards itself inline rather than with `guarded`."""

    __slots__ = ("clock", "failures", "in_flight", "nbytes", "op", "progress", "start", "step")

    def __init__(self, monitor: Monitor, step: Step, op: str, nbytes: int, in_flight: InFlight | None) -> None:
        self.step, self.clock, self.failures, self.progress = step, monitor.clock, monitor.failures, monitor.progress
        self.op, self.nbytes, self.start, self.in_flight = op, nbytes, None, in_flight

    def __enter__(self) -> None:
        try:
            self.progress.at("collective", self.in_flight)
            self.start = self.clock.mark()
        except Exception as error:
            self.failures.record("CollectiveTimer.__enter__", error)

    def __exit__(self, *exc_info: object) -> Literal[False]:
        try:
            step = self.step
            if self.start is not None:
                end = self.clock.mark()
                in_flight = self.in_flight
                step.calls.append(Call(self.op, self.nbytes, self.start, True, step.phase, end,
                                       group=None if in_flight is None else in_flight.group))
                if self.progress.device_done is not None and self.in_flight is not None:
                    self.progress.on_device = (self.in_flight, end)  # done once the device passes it
            self.progress.at(step.phase or "step")
        except Exception as error:
            self.failures.record("CollectiveTimer.__exit__", error)
        return False
