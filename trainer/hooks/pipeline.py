"""A pipeline stage's bubble, measured: its busy time (forward and backward passes) against its idle time.

Every stage's window opens as it enters the step's schedule and closes at one point common to all
stages: the end of the schedule's last operation anywhere in the pipeline. Closing each stage's
window at its own last operation instead would scatter the figures: the last stage finishes long
before the first stage's final backward, and the wait it then owes is its share of the bubble. With a
common end, a balanced GPipe or 1F1B schedule idles every stage (p-1)/(m+p-1) of its window.

The common end needs no barrier. As its part of the schedule ends, each stage posts an asynchronous
one-element all-reduce over the pipeline group (`stop`); it completes on every stage once the last
stage has posted it, that is when the schedule's last operation ends, and a callback marks that
moment (on CUDA an event on a stream ordered after the all-reduce). No rank waits for it: the stage
goes on with its data-parallel reduction, and the step record goes out once the mark is ready.

Cost per step: one 4-byte all-reduce per pipeline group, never waited for; two marks per pass.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gpuwatch.trainer.hooks._safety import Failures, guarded
from gpuwatch.trainer.hooks.clock import Clock, Mark


def theoretical_bubble(stages: int, micro_batches: int) -> float:
    """Idle share of a non-interleaved GPipe or 1F1B schedule with equal stages: (p-1)/(m+p-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


class PipelineClock:
    """One stage, one step: `start`, then `with busy():` around every forward and backward pass, then `stop`."""

    def __init__(
        self, clock: Clock, failures: Failures, group: ProcessGroup, micro_batches: int, device: torch.device
    ) -> None:
        self.failures = failures
        self._clock, self._group, self._device = clock, group, device
        self._theoretical = theoretical_bubble(dist.get_world_size(group), micro_batches)
        self._passes: list[tuple[Mark, Mark]] = []
        self._start: Mark | None = None
        self._opened: Mark | None = None
        self._end: Mark | None = None
        self._pending: Any = None  # the all-reduce's future, kept alive until it completes

    @guarded
    def start(self) -> None:
        self._start = self._clock.mark()

    def busy(self) -> PipelineClock:
        return self

    @guarded
    def __enter__(self) -> None:
        self._opened = self._clock.mark()

    def __exit__(self, *exc_info: object) -> bool:
        self._close_pass()
        return False

    @guarded
    def _close_pass(self) -> None:
        if self._opened is not None:
            self._passes.append((self._opened, self._clock.mark()))
            self._opened = None

    @guarded
    def stop(self) -> None:
        """Post the end-of-schedule all-reduce; every stage of the group must call it, every step."""
        work = dist.all_reduce(torch.zeros(1, device=self._device), group=self._group, async_op=True)
        self._pending = work.get_future().then(self._ended)

    @guarded
    def _ended(self, future: torch.futures.Future) -> None:
        self._end = self._clock.mark()

    def marks(self) -> list[Mark]:
        return [mark for mark in (self._start, self._end) if mark is not None] + [m for p in self._passes for m in p]

    def ready(self) -> bool:
        return self._end is not None and self._clock.ready(self._end)

    def result(self) -> dict[str, float] | None:
        """The step record's `pipeline` field, once `ready`."""
        if self._start is None or not self.ready():
            return None
        window = self._clock.seconds(self._start, self._end)
        busy = min(window, sum(self._clock.seconds(start, end) for start, end in self._passes))
        if window <= 0:
            return None
        return {"busy_seconds": busy, "idle_seconds": window - busy, "bubble_ratio": (window - busy) / window,
                "bubble_ratio_theoretical": self._theoretical}
