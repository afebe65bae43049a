"""A pipeline stage's bubble, measured: its busy time (forward and backward passes) against its idle time.

Every stage's window opens as it enters the step's schedule and closes at one point common to all
stages: the end of the schedule's last operation anywhere in the pipeline. Closing each stage's
window at its own last operation instead would scatter the figures: the last stage finishes long
before the first stage's final backward, and the wait it then owes is its share of the bubble. With a
common end, a balanced GPipe or 1F1B schedule idles every stage (p-1)/(m+p-1) of its window.

The common end needs no barrier. The schedule's last operation is the first stage's last backward
pass (it needs every later stage's last gradient first; true of GPipe, 1F1B and interleaved 1F1B),
so as its part ends the first stage sends each other stage a 4-byte end marker, and each other
stage, as its own part ends, posts the matching receive (`stop`). The first stage closes its window
at once; another closes it when the marker arrives, marked by a callback (on CUDA an event on a
stream ordered after the receive; gloo's receives have no future, so a waiter thread marks them).
No rank waits for it: the stage goes on with its data-parallel reduction, and the step record goes
out once the mark is ready.

Cost per step: p - 1 point-to-point messages of 4 bytes from the first stage, never waited for
(an asynchronous all-reduce would do too, at ~10x the CPU on gloo); two marks per pass.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gpuwatch.plan.compute import bubble_fraction
from gpuwatch.trainer.hooks.clock import Clock, Mark
from gpuwatch.trainer.hooks.collectives import Call
from gpuwatch.trainer.hooks.safety import Failures, guarded

#: Tag of the end markers (gloo matches point-to-point messages by tag; NCCL by order).
MARKER_TAG = 0x6777


def theoretical_bubble(stages: int, micro_batches: int) -> float:
    """Idle share of a non-interleaved GPipe or 1F1B schedule with equal stages: (p-1)/(m+p-1), the planner's
    formula (gpuwatch.plan.compute, which also knows the other schedules)."""
    return bubble_fraction(stages, micro_batches)


class _Window:
    """A stage's window in one step, from `_start` to `_end`, and what of it was idle (`_idle`, each kind's own):
    the step record's `pipeline` figures, once the device has passed the end."""

    def __init__(self, clock: Clock, theoretical: float | None) -> None:
        self._clock, self._theoretical = clock, theoretical
        self._start: Mark | None = None
        self._end: Mark | None = None

    def _idle(self, window: float) -> float:
        raise NotImplementedError

    def ready(self) -> bool:
        return self._end is not None and self._clock.ready(self._end)

    def result(self) -> dict[str, float] | None:
        """The step record's `pipeline` field, once `ready`."""
        if self._start is None or not self.ready():
            return None
        window = self._clock.seconds(self._start, self._end)
        if window <= 0:
            return None
        idle = min(window, self._idle(window))
        result = {"busy_seconds": window - idle, "idle_seconds": idle, "bubble_ratio": idle / window}
        return result if self._theoretical is None else {**result, "bubble_ratio_theoretical": self._theoretical}


class PipelineClock(_Window):
    """One stage, one step: `start`, then `with busy():` around every forward and backward pass, then `stop`."""

    def __init__(
        self, clock: Clock, failures: Failures, group: ProcessGroup, micro_batches: int, device: torch.device
    ) -> None:
        super().__init__(clock, theoretical_bubble(dist.get_world_size(group), micro_batches))
        self.failures = failures
        self._group, self._device = group, device
        self._passes: list[tuple[Mark, Mark]] = []
        self._opened: Mark | None = None
        self._pending: Any = None  # the marker's works, kept alive until they complete

    @guarded
    def start(self) -> None:
        self._start = self._clock.mark()

    def busy(self) -> PipelineClock:
        return self

    @guarded
    def __enter__(self) -> None:
        self._opened = self._clock.mark()

    def __exit__(self, *exc_info: object) -> Literal[False]:
        self._close_pass()
        return False

    @guarded
    def _close_pass(self) -> None:
        if self._opened is not None:
            self._passes.append((self._opened, self._clock.mark()))
            self._opened = None

    @guarded
    def stop(self) -> None:
        """The stage's part of the schedule is over: exchange the end marker. Every stage of the group
        must call it, every step; the group's rank 0 is the first stage."""
        members = dist.get_process_group_ranks(self._group)
        token = torch.zeros(1, device=self._device)
        if dist.get_rank(self._group) == 0:
            self._end = self._clock.mark()
            ops = [dist.P2POp(dist.isend, token, peer, self._group, MARKER_TAG) for peer in members[1:]]
        else:
            ops = [dist.P2POp(dist.irecv, token, members[0], self._group, MARKER_TAG)]
        self._pending = dist.batch_isend_irecv(ops)  # kept alive until they complete
        if self._end is None:
            _when_done(self._pending[0], self._ended)

    @guarded
    def _ended(self, _: object = None) -> None:
        self._end = self._clock.mark()

    def marks(self) -> list[Mark]:
        return [mark for mark in (self._start, self._end) if mark is not None] + [m for p in self._passes for m in p]

    def _idle(self, window: float) -> float:
        """The window less the passes."""
        return window - sum(self._clock.seconds(start, end) for start, end in self._passes)


class WindowClock(_Window):
    """One stage, one step, measured from outside its schedule (`gpuwatch run` around torch.distributed.pipelining):
    the window opens as the rank enters the schedule's step and closes as it leaves it (several schedule steps in
    one optimizer step share one window, from the first entry to the last exit). Its idle time is what the training
    thread spent waiting on the pipeline's own sends and receives (the step's timed calls on the pipeline's group):
    waiting for a neighbour's activations or gradients is what a bubble is; all else in the window, the schedule's
    own work included, is busy.

    No end marker as `PipelineClock` exchanges: `gpuwatch run` sends nothing on a job's own process groups. The
    windows still agree once the schedule runs step after step: a stage that leaves the schedule early (the last
    stage, whose last backward comes first) enters the next step that much earlier and waits for its first input
    there, so every stage's window is the pipeline's period and a balanced GPipe or 1F1B schedule idles
    (p-1)/(m+p-1) of it on every stage. The first step, which no earlier one staggered, reads lower on later stages."""

    def __init__(self, clock: Clock, calls: list[Call], group: str, theoretical: float | None) -> None:
        super().__init__(clock, theoretical)
        self._calls, self._group = calls, group

    def start(self) -> None:
        if self._start is None:
            self._start = self._clock.mark()

    def stop(self) -> None:
        self._end = self._clock.mark()

    def marks(self) -> list[Mark]:
        return [mark for mark in (self._start, self._end) if mark is not None]

    def _idle(self, window: float) -> float:
        """The step's waits on the pipeline's group (its calls resolved by then: the record is built after)."""
        return sum(call.seconds for call in self._calls if call.group == self._group and call.blocking)


def _when_done(work: dist.Work, callback: Callable[[object], None]) -> None:
    """Call `callback` once `work` completes: from its future where it has one (NCCL, with the current
    stream ordered after the work), else from the waiter thread."""
    try:
        future = work.get_future()
    except RuntimeError:  # gloo's send and receive: "Work::getFuture not implemented"
        future = None
    if future is None:
        _WAITER.put((work, callback))
    else:
        future.then(callback)


class _Waiter:
    """One daemon thread that waits for works without a future, oldest first, and calls back."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pid = 0  # the process whose thread it is: a forked child starts its own

    def put(self, item: tuple[dist.Work, Callable[[object], None]]) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._queue = queue.SimpleQueue()
                threading.Thread(target=self._run, args=(self._queue,), name="gpuwatch-pipeline-waiter",
                                 daemon=True).start()
                self._pid = os.getpid()
        self._queue.put(item)

    @staticmethod
    def _run(waiting: queue.SimpleQueue) -> None:
        while True:
            work, callback = waiting.get()
            try:
                work.wait()
            except Exception:  # the training loop meets the same failure in its own collectives
                continue
            callback(None)


_WAITER = _Waiter()
