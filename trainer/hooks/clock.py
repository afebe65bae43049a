"""Timestamps without synchronisation: wall time on the CPU, CUDA events on a GPU.

On a GPU the host runs ahead of the device, so a wall-clock interval around a kernel launch says
nothing about the kernel, and a `torch.cuda.synchronize()` to make it say something would stall
the pipeline of queued work. Every interval the hooks measure is therefore a pair of *marks*: on
CUDA an event recorded on the calling thread's current stream and read with `elapsed_time` once
the device has passed it (`ready`); on the CPU a `perf_counter` reading, ready at once.

On CUDA every duration is device time. A data-loader wait, for one, becomes how long the stream
sat idle waiting for the host to hand it the batch: the stall that matters, not the host's time.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

#: Events kept for reuse: creating one costs more than recording it, and a step records hundreds.
EVENT_POOL = 4096

Mark = Any  # a float (WallClock) or a torch.cuda.Event (CudaClock)


class Clock(Protocol):
    def mark(self) -> Mark: ...

    def ready(self, mark: Mark) -> bool: ...

    def seconds(self, start: Mark, end: Mark) -> float: ...

    def release(self, marks: list[Mark]) -> None: ...


class WallClock:
    """`time.perf_counter`, for CPU training: every mark is ready when taken."""

    #: perf_counter itself, not a method calling it: a mark costs no Python frame (the hooks take ~10 a step)
    mark = staticmethod(time.perf_counter)

    def ready(self, mark: float) -> bool:
        return True

    def seconds(self, start: float, end: float) -> float:
        return max(0.0, end - start)

    def release(self, marks: list[float]) -> None:
        pass


class CudaClock:
    """CUDA events on the calling thread's current stream of `device`, pooled; `ready` asks the device
    without waiting for it. In a communication callback the current stream is one ordered after the
    communication, so a mark there is its end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: list[torch.cuda.Event] = []

    def mark(self) -> torch.cuda.Event:
        try:
            event = self._pool.pop()
        except IndexError:  # a comm-hook thread may have taken the last one since we looked
            event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def ready(self, mark: torch.cuda.Event) -> bool:
        return mark.query()

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return max(0.0, start.elapsed_time(end) / 1000)

    def release(self, marks: list[torch.cuda.Event]) -> None:
        self._pool.extend(marks[: max(0, EVENT_POOL - len(self._pool))])


def clock_for(device: torch.device) -> Clock:
    return CudaClock(device) if device.type == "cuda" else WallClock()
