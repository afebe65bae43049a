"""The recent steps of one rank, and the robust statistics diagnosis judges them by.

One step is a noisy sample: on a shared CPU a 2 ms step's compute time varies 4x from one step to the
next, and a verdict on the latest step alone cries wolf on healthy jobs. So the agent keeps each rank's
last ``WINDOW_STEPS`` step records (fewer when they span more than ``WINDOW_SECONDS`` of the rank's own
clock), and the timing rules judge medians over them. The same ``StepWindow`` is filled by the agent's
store and by the run-log reader, and the agent exports the same ``summarize`` figures to Prometheus, so a
job gets the same verdict from all three sources.

A window holds at most ``WINDOW_STEPS`` compact points (a dozen numbers each): ~0.5 KiB per step, 32 KiB per
rank, 32 MiB at the agent's default cap of 1,024 ranks.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from gpuwatch.protocol.records import FoldedStep, Step
from gpuwatch.protocol.schema import STEP_PHASES

#: Steps a window holds; a fault that starts mid-run moves the medians once it holds half the window.
WINDOW_STEPS = 64
#: Seconds of the rank's clock a window spans at most: slow steps are not judged on hour-old company.
WINDOW_SECONDS = 300.0
#: Steps a window needs before its medians are judged: a median of 5 stands however wrong 2 of them are.
MIN_WINDOW_STEPS = 5
#: The step's phases (``schema.STEP_PHASES``: data, compute, optimizer, outside the model), each net of the collectives
#: waited for inside it.
PHASE_TIMINGS = tuple(STEP_PHASES.values())
#: The per-step timings summarised by their median: step record field -> path in the record body.
TIMINGS: Mapping[str, tuple[str, ...]] = {
    "step_seconds": ("step_seconds",),
    **{field: (field,) for field in PHASE_TIMINGS},
    "exposed_collective_seconds": ("exposed_collective_seconds",),
    "cpu_seconds": ("cpu_seconds",),
    "cpu_wait_seconds": ("cpu_wait_seconds",),
    "bubble_ratio": ("pipeline", "bubble_ratio"),
}
#: A timing no record carries, summarised beside TIMINGS: the step's busy time, the sum of the phases it reported.
#: With every phase reported it is the step without its waits in collectives; where a rank waits there for a late
#: peer, the late peer's busy time is what makes the others wait, so a straggler is judged by it (PERF002). A step
#: that reported only some phases (an older client: compute alone) is busy for those. Where a step says how long its
#: training thread waited for a CPU (``cpu_wait_seconds``, CPU ranks: the host's shortage of cores, not the rank's
#: work), that wait comes out of the busy time, but never below the thread's time on a CPU in the step
#: (``cpu_seconds``): max(busy - wait, min(busy, cpu)). The wait is measured over the whole step, and a thread also
#: waits for a core as it wakes from a collective; all of it taken out made a healthy Lightning rank that mostly
#: waited for its peer look idle, its peer a 23x straggler (4 test workers on a 2-CPU machine). A rank's busy time
#: less its time on a CPU is the most of it that can have been a wait, so the bound is exact for a rank that waited
#: only while busy (the contended one) and for one that waited only in collectives (its peers), and a rank that
#: slept while busy (a planted straggler) keeps its sleep.
BUSY = "busy_seconds"
#: The training thread's wait for a CPU in a step (CPU ranks), which BUSY is net of, and its time on one.
CPU_WAIT, CPU_SECONDS = "cpu_wait_seconds", "cpu_seconds"
#: The timings in seconds whose medians a summary holds, TIMINGS' then BUSY.
MEDIAN_SECONDS = (*(name for name in TIMINGS if name.endswith("_seconds")), BUSY)


#: TIMINGS as a ``StepPoint`` holds them: the top-level fields, then the one nested, the pipeline's bubble, which
#: ``StepPoint.of`` reads by attribute (walking its path was a third of a point's cost; a test holds ``of`` to every
#: path of TIMINGS).
_TOP_LEVEL_TIMINGS = tuple(path[0] for path in TIMINGS.values() if len(path) == 1)
#: The names of a ``StepPoint``'s timing fields, in their order.
TIMING_ORDER = (*_TOP_LEVEL_TIMINGS, "bubble_ratio")
#: A step's number, clock and top-level timings, read in one call in C.
_NUMBER_AND_TIMINGS = operator.attrgetter("step", "time", *_TOP_LEVEL_TIMINGS)


class StepPoint(NamedTuple):
    """What a window keeps of one step record: its number, clock, the timings of ``TIMINGS`` (one field each, in
    ``TIMING_ORDER``: finite, the schema rejects others, or None), loss, gradient norm and parameter checksum.

    A named tuple, built in C: the agent makes one for every step its ranks report (~10 a datagram, ~1,000 between two
    scrapes at 64 ranks). Flat, so that ``summarize`` takes every column of a window in one transposition."""

    step: int
    time: float
    step_seconds: float | None = None
    dataloader_wait_seconds: float | None = None
    compute_seconds: float | None = None
    optimizer_seconds: float | None = None
    outside_model_seconds: float | None = None
    exposed_collective_seconds: float | None = None
    cpu_seconds: float | None = None
    cpu_wait_seconds: float | None = None
    bubble_ratio: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    param_checksum: float | str | None = None

    @classmethod
    def of(cls, body: Step | FoldedStep) -> StepPoint:
        """The point of a validated step record body (``schema.decode``), or of a step folded into one (which carries
        no parameter checksum: ``schema.FOLDED_STEP_FIELDS``)."""
        pipeline = body.pipeline
        return tuple.__new__(cls, (*_NUMBER_AND_TIMINGS(body), None if pipeline is None else pipeline.bubble_ratio,
                                   body.loss, body.grad_norm,
                                   body.param_checksum if isinstance(body, Step) else None))

    def as_dict(self) -> dict[str, Any]:
        """For /api/v1/state: the step record's own field names, absent values left out."""
        return {name: value for name, value in self._asdict().items() if value is not None}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> StepPoint:
        """The inverse of ``as_dict``, for a point read back from an agent's state, where a non-finite loss or
        gradient norm is written "NaN", "+Inf" or "-Inf"."""
        return cls(values["step"], values["time"], **{name: values.get(name) for name in TIMING_ORDER},
                   loss=_number(values.get("loss")), grad_norm=_number(values.get("grad_norm")),
                   param_checksum=values.get("param_checksum"))


#: Where a point holds its timings, in ``TIMING_ORDER`` (a test holds the fields to it), and its phases among them.
_TIMINGS_AT = slice(2, 2 + len(TIMING_ORDER))
_PHASES_AT = [TIMING_ORDER.index(field) for field in PHASE_TIMINGS]
_CPU_WAIT_AT, _CPU_AT = TIMING_ORDER.index(CPU_WAIT), TIMING_ORDER.index(CPU_SECONDS)


def _number(value: float | str | None) -> float | None:
    return float(value) if isinstance(value, str) else value


class StepWindow:
    """The last steps of one rank, oldest first, bounded by count and by the rank's clock. A step number
    that goes back (a rank restarted, a run resumed from a checkpoint) starts the window again: steps of
    two runs are not one sample."""

    __slots__ = ("_points", "seconds")

    def __init__(self, steps: int = WINDOW_STEPS, seconds: float = WINDOW_SECONDS,
                 points: Iterable[StepPoint] = ()) -> None:
        self._points: collections.deque[StepPoint] = collections.deque(points, maxlen=steps)
        self.seconds = seconds

    def add(self, body: Step | FoldedStep) -> None:
        point = StepPoint.of(body)
        points = self._points
        if points and point.step <= points[-1].step:
            points.clear()
        points.append(point)
        while point.time - points[0].time > self.seconds:
            points.popleft()

    def points(self) -> tuple[StepPoint, ...]:
        return tuple(self._points)

    def copy(self) -> StepWindow:
        return StepWindow(self._points.maxlen or WINDOW_STEPS, self.seconds, self._points)


@dataclasses.dataclass(frozen=True)
class WindowSummary:
    """Robust figures of one rank's window: how many steps, which, over how long, the median of each timing
    (over the steps that reported it), and the range of loss, gradient norm and parameter checksum."""

    steps: int
    first_step: int
    last_step: int
    seconds: float
    medians: Mapping[str, float]  # TIMINGS name or BUSY -> median
    #: When the window's last step ended (the rank's wall clock, its record's time); None where the source cannot tell.
    ended: float | None = None
    loss_steps: int = 0  # steps with a finite loss
    loss_min: float | None = None
    loss_max: float | None = None
    grad_norm_steps: int = 0  # steps with a finite gradient norm
    grad_norm_max: float | None = None
    checksums: int = 0  # steps that measured the parameter checksum
    distinct_checksums: int = 0

    def median(self, timing: str) -> float | None:
        return self.medians.get(timing)

    @property
    def bubble_ratio(self) -> float | None:
        """The median measured pipeline bubble."""
        return self.medians.get("bubble_ratio")

    def describe(self) -> str:
        """The window as evidence states it: ``12 steps (41-52, 3.1 s)``."""
        span = f"{self.first_step}-{self.last_step}" if self.steps > 1 else f"{self.last_step}"
        return f"{self.steps} step{'s' if self.steps != 1 else ''} ({span}, {self.seconds:.3g} s)"


def summarize(points: Iterable[StepPoint]) -> WindowSummary | None:
    """The summary of a window's points, oldest first; None for an empty window."""
    points = tuple(points)
    if not points:
        return None
    columns = tuple(zip(*points, strict=True))  # a column a field
    loss_column, norm_column, checksum_column = columns[_TIMINGS_AT.stop:]
    timings = columns[_TIMINGS_AT]
    medians = {}
    for name, column in (*zip(TIMING_ORDER, timings, strict=True),
                         (BUSY, _busy([timings[index] for index in _PHASES_AT], timings[_CPU_WAIT_AT],
                                      timings[_CPU_AT]))):
        ordered = _sorted_reported(column)
        if ordered:
            middle = len(ordered) // 2  # the median as statistics.median takes it
            medians[name] = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    losses, norms = _finite(loss_column), _finite(norm_column)
    checksums = [checksum for checksum in checksum_column if checksum is not None]
    return WindowSummary(
        steps=len(points), first_step=points[0].step, last_step=points[-1].step,
        seconds=max(0.0, points[-1].time - points[0].time), medians=medians, ended=points[-1].time,
        loss_steps=len(losses), loss_min=min(losses, default=None), loss_max=max(losses, default=None),
        grad_norm_steps=len(norms), grad_norm_max=max(norms, default=None),
        checksums=len(checksums), distinct_checksums=len(set(checksums)))


# The agent summarises every rank's window for each scrape. A test per value of its 64 points was most of a summary's
# ~290,000 instructions; these two take the common case, every value reported and finite, in C.

def _sorted_reported(column: tuple[float | None, ...]) -> list[float]:
    """The values of the steps that reported the timing, in order. Sorted as they come: a None beside a number cannot
    be sorted (TypeError), and only then is each value tested."""
    try:
        ordered: list[Any] = sorted(column)  # type: ignore[type-var]  # a None beside a number raises
    except TypeError:
        return sorted(value for value in column if value is not None)
    # empty: a window of one step that did not report it, or a busy column of steps that reported no phase
    return ordered if ordered and ordered[-1] is not None else []


def _busy(phases: list[tuple[float | None, ...]], cpu_wait: tuple[float | None, ...],
          cpu: tuple[float | None, ...]) -> tuple[float | None, ...]:
    """Each step's busy time (``BUSY``): the sum of the phases it reported, less its wait for a CPU where it reported
    that and its time on one (never below that time); None for a step that reported no phase; no column where no
    step reported a phase. Summed in C while every step reported the same phases, value by value only where a phase's
    column mixes reported and missing."""
    present = [column for column in phases if column.count(None) < len(column)]
    if not present:
        return ()
    if not any(None in column for column in present):
        sums: tuple[float | None, ...] = tuple(map(sum, zip(*present, strict=True)))
    else:
        sums = tuple(sum(value for value in row if value is not None) if row.count(None) < len(row) else None
                     for row in zip(*present, strict=True))
    if cpu_wait.count(None) == len(cpu_wait):  # GPU ranks, and CPU ranks where the kernel keeps no schedstat
        return sums
    return tuple(net_busy(busy, wait, ran) if busy is not None and wait is not None and ran is not None else busy
                 for busy, wait, ran in zip(sums, cpu_wait, cpu, strict=True))


def net_busy(busy: float, cpu_wait: float, cpu: float) -> float:
    """A CPU rank's busy time less its wait for a CPU, never below its time on one (``BUSY`` says why)."""
    return max(busy - cpu_wait, min(busy, cpu))


def _finite(column: tuple[float | None, ...]) -> Sequence[float]:
    """The finite values of a column. Summed first: a sum of finite numbers is finite unless it overflows, and a None
    (TypeError), a NaN or an infinity, or an overflow, sends the column to a test per value."""
    try:
        if math.isfinite(sum(column)):  # type: ignore[arg-type]  # a None raises
            return column  # type: ignore[return-value]  # no None: the sum would have raised
    except TypeError:
        pass
    return [value for value in column if value is not None and math.isfinite(value)]
