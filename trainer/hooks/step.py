"""A step's life cycle, from start to record: the `Step` the training loop holds, its phases (`Phase`) and timed
collectives (`CollectiveTimer`), and what the Monitor hands every step (`StepContext`).

A step owns its state from `__enter__` to its record: it takes its marks and device tensors without waiting for
the device, keeps at its end the values the next step would change, then goes to the client's thread at once (on
the CPU) or to the Monitor's queue of steps waiting for the device (`StepContext.pending`, resolved by
`StepContext.flush`), and its record is built on the client's thread (`Step.finish`, `record.step_record`). What
it reads or writes beyond itself is its `StepContext`: the rank's clock, client, progress, gradient statistics and
the like, and the little one step passes on to the next (the step open now, the data-loader wait, whether the last
one raised). It never reads or writes its Monitor: to change when a step ends, read this module.

This is the hot path: every step the training thread enters and leaves a step and a few phases, and a
tensor-parallel layer times several collectives a micro-batch. So none of them has an `__init__` that the
Monitor could do without (it fills a Step's and a Phase's slots itself), none calls a method of its own, and
each guards itself inline rather than with `guarded` (a wrapper's Python frame per call adds up here). They
read and write their context's attributes directly, for the same reason: a method per step would be one more
frame.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.distributed import ProcessGroup

from gpuwatch.trainer.hooks.clock import Clock, Mark
from gpuwatch.trainer.hooks.collectives import Call
from gpuwatch.trainer.hooks.gradients import GradientSimilarity
from gpuwatch.trainer.hooks.off import OFF, Off
from gpuwatch.trainer.hooks.pipeline import PipelineClock, WindowClock
from gpuwatch.trainer.hooks.progress import InFlight, Progress, error_record
from gpuwatch.trainer.hooks.record import HostValues, plain, step_record
from gpuwatch.trainer.hooks.safety import Failures, guarded

if TYPE_CHECKING:
    from gpuwatch.trainer.hooks.ddp import DdpWatch
    from gpuwatch.trainer.hooks.gradient_stats import GradientStatistics
    from gpuwatch.trainer.hooks.memory import CudaMemory, HostMemory
    from gpuwatch.trainer.hooks.monitor import Monitor  # a step's `monitor` slot only: the step reads its context
    from gpuwatch.trainer.telemetry import TelemetryClient


@dataclass(slots=True, eq=False)
class StepContext:
    """What the Monitor hands each of its steps, one per rank (`Monitor.step` gives every step the same): the
    rank-wide parts a step uses from start to record, which the Monitor owns and sets up, and what steps pass on to
    each other (and to the Monitor, DDP's watch and the bucket hook, which read the step open now). Slotted
    attributes, read on the hot path without a method's frame."""

    failures: Failures
    clock: Clock
    mark: Callable[[], Mark]  # clock.mark, on the CPU time.perf_counter itself: no Python frame per mark
    on_host: bool  # every mark ready when taken: no queue
    progress: Progress  # the training thread's place, which the watchdog reports
    client: TelemetryClient
    job: str
    rank: int  # the global rank, which a relayout keeps
    device: torch.device
    signals: frozenset[str]
    times_collectives: bool  # whether collectives are timed (blocking calls, DDP's all-reduce tail, the buckets)
    params: Sequence[torch.Tensor]
    gradients: GradientStatistics
    memory: CudaMemory | HostMemory | None  # None: memory is not read
    flops_per_token: float | None
    peak_flops: float | None
    #: the collectives numbered per group (the Monitor counts them), copied into a step's record as it ends
    collective_counts: dict[str, int]
    #: the Monitor's numbering of the collective about to start on a group, and a group's name in the hello
    in_flight: Callable[[str, int, Any], InFlight | None]
    group_name: Callable[[Any], str]
    #: ended steps waiting for the device, and the Monitor's hand-over of those the device has passed
    pending: deque[Step]
    flush: Callable[[], None]
    #: reads the training thread's time on a CPU and wait for one (`cpu_times`), as a step starts and ends; None: not
    #: measured (a GPU's step, or no such file)
    read_cpu_times: Callable[[], bytes] | None
    #: a DDP model that reduces its gradients in C++, watched through autograd (set once the Monitor made it)
    ddp_watch: DdpWatch | None = None
    #: the step open now, which collectives are counted in
    current: Step | None = None
    #: the data-loader wait `Monitor.data` measured for the next step, which then starts with it
    data_wait: tuple[Mark, Mark] | None = None
    #: a step raised: its error record stands, and no "closed" record follows it
    raised: bool = False


#: Makes an instance without calling its class (no `__init__` frame): `Monitor.step` fills a Step's slots, and the
#: Step a Phase's.
new = object.__new__


class Step:
    """One training step: a context manager around it, with phases inside (`data`, `compute`,
    `optimizer`) and the values only the training loop knows (`report`)."""

    __slots__ = ("calls", "checksum_due", "collective_calls", "context", "cpu_at_end", "cpu_at_start", "end",
                 "failures", "host", "measured", "memory", "memory_due", "monitor", "norm_from_grads", "number",
                 "phase", "phases", "pipeline", "reported", "samples", "scalars", "similarity", "similarity_due",
                 "start", "time", "tokens", "values", "waits")

    # Made by Monitor.step (no __init__: a Python frame fewer on the hot path). What each slot holds:
    monitor: Monitor  # the Monitor that made it, for the training loop; the step reads only its context
    context: StepContext
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
    cpu_at_start: bytes | None  # the thread's scheduler statistics as the step started and ended (`cpu_times`)
    cpu_at_end: bytes | None

    def __enter__(self) -> Step:
        # The hot path guards itself inline (as `CollectiveTimer` does): a `guarded` wrapper per call adds up here.
        context = self.context
        try:
            wait, context.data_wait = context.data_wait, None
            if wait is None:
                self.start = context.mark()
            else:  # measured by data() just before this step, which then starts with it
                self.start = wait[0]
                self.phases.append(("data", wait[0], wait[1]))
            context.current = self
            read_cpu_times = context.read_cpu_times
            if read_cpu_times is not None:
                self.cpu_at_start = read_cpu_times()
            watch = context.ddp_watch
            if watch is not None:
                watch.tail_stage = 0  # a backward that raised never ran its callbacks
            progress = context.progress
            progress.at("step")
            progress.step_started = progress.since
        except Exception as error:
            self.failures.record("Step.__enter__", error)
        return self

    def __exit__(self, exc_type: type | None, *exc_info: object) -> Literal[False]:
        """The step's end mark and what the record needs before the next step changes it, then the hand-over;
        nothing here waits for the device. Guarded inline, in parts (the hot path, as `__enter__`)."""
        context = self.context
        context.current = None
        watch = context.ddp_watch
        if watch is not None and (watch.grad_handles or watch.keep_at_tail):  # a measuring step DDP never averaged
            watch.drop_gradients()  # (a failed backward)
        progress = context.progress
        if exc_type is not None:  # the training loop raised: no step record, and no collective of ours to wait in
            error = exc_info[0]
            if isinstance(error, BaseException):  # said at once: the rank may be about to die, its peers to wait
                try:
                    context.raised = True
                    context.client.send(error_record(context.job, context.rank, progress, error))
                except Exception as failure:
                    self.failures.record("Step.__exit__", failure)
            return False
        progress.step = self.number
        progress.at("idle")
        if progress.step_started is not None:
            progress.durations.append(progress.since - progress.step_started)
        context.raised = False  # a step that raised was caught, and training went on
        try:
            self.end = context.mark()
            read_cpu_times = context.read_cpu_times
            if read_cpu_times is not None:
                self.cpu_at_end = read_cpu_times()
        except Exception as error:
            self.failures.record("Clock.mark", error)
        if context.collective_counts:
            self.collective_calls = context.collective_counts.copy()
        if self.similarity is not None:
            # A collective over the shard groups unless the training loop made it already: every rank
            # makes it on every measuring step, whatever else fails here, or its peers would wait forever.
            sums = self.similarity.reduce()
            if sums is not None:
                self.measure("similarity", sums)
        if self.checksum_due and context.params:
            context.gradients.take_checksum(self)
        if self.memory_due and context.memory is not None:
            try:
                self.memory = context.memory.read()
                context.memory.reset()  # the next reading's peak starts here
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
            if self.measured is not None and not context.on_host:
                on_device = {**(on_device or {}), **{name: torch.stack(value) if isinstance(value, list) else value
                                                     for name, value in self.measured.items()}}
                self.measured = None
            if on_device is not None:
                self.host = HostValues(on_device, context.clock)
            if context.on_host and not context.pending and self.pipeline is None:  # resolved: hand it over
                context.client.submit(self.finish)
                return False
            context.pending.append(self)
        except Exception as error:
            self.failures.record("Monitor._end", error)
        context.flush()
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
            self.context.gradients.take_norm(self)
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
        context = self.context
        try:
            if "pipeline" in context.signals and torch.distributed.get_world_size(group) > 1:
                self.pipeline = PipelineClock(context.clock, self.failures, group, micro_batches, context.device)
                return self.pipeline
        except Exception as error:
            self.failures.record("Step.pipeline_clock", error)
        return OFF

    def window_clock(self, group: ProcessGroup | None, theoretical: float | None) -> PipelineClock | WindowClock:
        """This step's pipeline clock seen from outside the schedule over `group` (`WindowClock`, for `gpuwatch
        run`): the one the step has already, or a new one; `theoretical` the schedule's bubble with equal stages,
        where known."""
        if self.pipeline is None:
            context = self.context
            self.pipeline = WindowClock(context.clock, self.calls, context.group_name(group), theoretical)
        return self.pipeline

    def ready(self) -> bool:
        """Whether the device has passed every mark, so the record can be built without waiting."""
        if self.scalars is None or (self.host is not None and not self.host.ready()) or (
                self.pipeline is not None and not self.pipeline.ready()):
            return False
        if any(call.end is None for call in self.calls):
            return False
        ready = self.context.clock.ready
        return all(ready(end) for _, _, end in self.waits)

    @guarded
    def finish(self) -> dict[str, Any] | None:
        """The record of a resolved step (`record.step_record`), its marks then free for reuse (CUDA events;
        numbers need no release); on the client's thread."""
        context = self.context
        try:
            return step_record(self)
        finally:
            if not context.on_host:
                pending = context.progress.on_device
                kept = pending[1] if pending is not None else None  # the watchdog may still ask about it
                context.clock.release([mark for mark in self.marks() if mark is not kept])

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
            context = step.context
            context.progress.at(self.name)
            self.start = context.mark()
        except Exception as error:
            self.start = None
            step.failures.record("Phase.__enter__", error)

    def __exit__(self, *exc_info: object) -> Literal[False]:
        step = self.step
        try:
            context = step.context
            if self.start is not None:
                step.phases.append((self.name, self.start, context.mark()))
            step.phase = self.outer
            context.progress.at(self.outer or "step")
        except Exception as error:
            step.failures.record("Phase.__exit__", error)
        return False


class CollectiveTimer:
    """One blocking collective call, timed by `Monitor.collective`. On the hot path (a tensor-parallel
    layer makes several calls per micro-batch), so it guards itself inline rather than with `guarded`."""

    __slots__ = ("clock", "failures", "in_flight", "nbytes", "op", "progress", "start", "step")

    def __init__(self, context: StepContext, step: Step, op: str, nbytes: int, in_flight: InFlight | None) -> None:
        self.step, self.clock, self.failures, self.progress = step, context.clock, context.failures, context.progress
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
