"""What the training thread is doing, and a watchdog thread that tells the agent when it stops moving.

A hung job is silent: no step ends, so no step record comes. `Progress` is the training thread's current place
(phase, the collective in flight with its process group and per-group sequence number, the last step done),
kept in plain attribute stores as the hooks pass through it (one `time.monotonic` and a few stores per phase
or call). The `Watchdog` runs on its own thread and reads it about once a second; while the training thread
moves it sends nothing. Once the thread has made no progress for longer than the step's own rhythm allows
(`overdue_seconds`: OVERDUE_FACTOR × the median of the last steps, at least OVERDUE_FLOOR_SECONDS; before
MIN_STEPS steps, STARTUP_SECONDS, which leaves room for compilation and the first collectives' set-up), it
sends a ``progress`` record every interval, and after STACK_AFTER_SECONDS without progress the training thread's
Python stack with it (`sys._current_frames`: file, line and function, no locals). Neither gloo's nor NCCL's
timeouts are needed to find out: those fire after minutes (NCCL's watchdog after 10 by default, PyTorch
`init_process_group(timeout=...)`).

On a GPU a collective's host call returns before the device has run it (NCCL queues it on its stream), so the host
may move on while the device is still in it, and a hang there stops the host only later, at whatever next waits for
the device. The hooks therefore also keep the last collective the host has left (`on_device`) with the mark
recorded after it on the device, and while the device has not passed that mark (`device_done`, which asks without
waiting) the watchdog reports it as the collective in flight.

Where PyTorch's Flight Recorder is on (`flight_recorder.FlightRecorder.enabled`: TORCH_FR_BUFFER_SIZE or
TORCH_NCCL_TRACE_BUFFER_SIZE above 0, or unset on a torch that records by default), a record also carries, as a
second source, the oldest collective the recorder has not seen finish (``flight_recorder``: op, torch's name and
description of its group, its per-group number, its state): PyTorch's own account, kept by the process group itself,
of where the rank waits, which holds where the hooks see no collective (one they do not wrap, one a C++ framework
launches). It is read on the watchdog's thread, only when a record is sent: never while steps flow.

The watchdog reads what the training thread writes without a lock: each attribute is one reference, replaced
whole, so a read sees an old or a new value, never a torn one; a record may mix the phase of one moment with the
collective of the next, which the next second's record corrects.
"""

from __future__ import annotations

import re
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from gpuwatch.protocol.schema import (
    MAX_GROUP_TEXT_CHARS,
    MAX_STACK_FRAMES,
    MAX_TEXT_CHARS,
    OVERDUE_FACTOR,
    OVERDUE_FLOOR_SECONDS,
    SCHEMA_VERSION,
)
from gpuwatch.trainer.hooks.flight_recorder import FlightEntry, FlightRecorder

#: Until MIN_STEPS steps have ended there is no rhythm to judge by: this long, for compilation and set-up.
STARTUP_SECONDS = 60.0
MIN_STEPS = 3
#: The watchdog's period, and how long without progress before it adds the stack.
INTERVAL_SECONDS = 1.0
STACK_AFTER_SECONDS = 3.0
#: Step durations the median is taken over.
RECENT_STEPS = 16


class InFlight(NamedTuple):
    """A collective the training thread is in: op, process group (its name in the hello, its size, this rank's
    place in it), the per-group sequence number (1 for the group's first call), bytes, and since when. A named
    tuple: made on every collective call, and a tuple is the cheapest immutable record to make."""

    op: str
    group: str
    group_size: int
    group_rank: int
    seq: int
    nbytes: int
    since: float  # time.monotonic()


class Progress:
    """The training thread's place, written by the hooks as it moves (see the module's docstring)."""

    __slots__ = ("collective", "device_done", "durations", "on_device", "phase", "since", "step", "step_started")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.phase = "idle"
        self.since = clock()  # the last progress
        self.step = 0  # the last step completed
        self.step_started: float | None = None
        self.collective: InFlight | None = None
        self.durations: deque[float] = deque(maxlen=RECENT_STEPS)
        #: on a GPU: the last collective the host has left, and the mark recorded after it on the device
        self.on_device: tuple[InFlight, Any] | None = None
        #: whether the device has passed a mark, without waiting (`Clock.ready`); None where marks are ready at once
        self.device_done: Callable[[Any], bool] | None = None

    def at(self, phase: str, collective: InFlight | None = None) -> None:
        """The training thread moved: it is now in `phase` (and `collective`), as of now."""
        self.phase, self.collective, self.since = phase, collective, time.monotonic()


class Watchdog:
    """Sends ``progress`` records (gpuwatch.protocol.schema) while the training thread is overdue; `check` is the
    decision, with the clocks injected, and the thread calls it every `interval` seconds. `recorder` gives a record's
    ``flight_recorder`` field (or None); by default `flight_recorder_field` where the Flight Recorder is on."""

    def __init__(self, progress: Progress, send: Callable[[Mapping[str, Any]], None], job: str, rank: int,
                 thread_id: int, *, interval: float = INTERVAL_SECONDS, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 recorder: Callable[[], dict[str, Any] | None] | None = None) -> None:
        self.progress, self.send, self.job, self.rank, self.thread_id = progress, send, job, rank, thread_id
        self.interval, self._clock, self._wall = interval, clock, wall
        #: read only when a record is sent; None: the Flight Recorder is off in this process, and is not read
        self.recorder = recorder or (flight_recorder_field if FlightRecorder.enabled() else None)
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpuwatch-watchdog", daemon=True)
        self._thread.start()

    def overdue_seconds(self) -> float:
        durations = self.progress.durations
        if len(durations) < MIN_STEPS:
            return STARTUP_SECONDS
        return max(OVERDUE_FLOOR_SECONDS, OVERDUE_FACTOR * statistics.median(durations))

    def check(self) -> dict[str, Any] | None:
        """The progress record to send now, or None while the training thread moves."""
        progress, now = self.progress, self._clock()
        stalled = max(0.0, now - progress.since)
        overdue = self.overdue_seconds()
        if stalled < overdue:
            return None
        collective = progress.collective or self._still_on_device()
        record: dict[str, Any] = {
            "v": SCHEMA_VERSION, "kind": "progress", "job": self.job, "rank": self.rank, "time": self._wall(),
            "step": progress.step, "phase": progress.phase, "stalled_seconds": stalled, "overdue_seconds": overdue,
        }
        if collective is not None:
            record["collective"] = {
                "op": collective.op, "group": collective.group, "group_size": collective.group_size,
                "group_rank": collective.group_rank, "seq": collective.seq, "bytes": collective.nbytes,
                "seconds": max(0.0, now - collective.since)}
        if stalled >= STACK_AFTER_SECONDS:
            stack = thread_stack(self.thread_id)
            if stack:
                record["stack"] = stack
        if self.recorder is not None:
            try:
                unfinished = self.recorder()
            except Exception:  # a second source that fails takes nothing from the first
                unfinished = None
            if unfinished is not None:
                record["flight_recorder"] = unfinished
        return record

    def _still_on_device(self) -> InFlight | None:
        """The collective the host has left and the device has not finished, if any."""
        progress = self.progress
        pending, done = progress.on_device, progress.device_done
        if pending is None or done is None:
            return None
        try:
            return None if done(pending[1]) else pending[0]
        except Exception:  # a mark that cannot be asked about (its device gone) tells nothing
            return None

    def _run(self) -> None:
        while not self._closed.wait(self.interval):
            try:
                record = self.check()
                if record is not None:
                    self.send(record)
            except Exception:  # never into training: the next round tries again
                continue

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(2 * self.interval)


_NOT_LABEL = re.compile(r"[^A-Za-z0-9_.:+/-]")


def flight_recorder_field(entries: list[FlightEntry] | None = None) -> dict[str, Any] | None:
    """A progress record's ``flight_recorder``: the oldest entry of this process's Flight Recorder (or of
    `entries`) not finished, fitted to the schema (labels and lengths); None where every entry finished, there is
    none, or the recorder cannot be read."""
    if entries is None:
        entries = FlightRecorder.read(only_active=True)
    entry = FlightRecorder.oldest_unfinished(entries)
    if entry is None:
        return None
    field: dict[str, Any] = {
        "op": _NOT_LABEL.sub("_", entry.op)[:64] or "unknown", "group": entry.group[:MAX_GROUP_TEXT_CHARS],
        "seq": min(entry.seq, 2**53), "p2p": entry.p2p, "state": _NOT_LABEL.sub("_", entry.state)[:32] or "unknown"}
    if entry.group_desc:
        field["group_desc"] = entry.group_desc[:MAX_GROUP_TEXT_CHARS]
    return field


def thread_stack(thread_id: int) -> list[dict[str, Any]]:
    """The Python stack of the thread `thread_id`, outermost first, its innermost MAX_STACK_FRAMES frames: file,
    line and function only (no locals, no source lines read). Empty when the thread is gone."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return []
    frames = traceback.extract_stack(frame, limit=MAX_STACK_FRAMES)  # the innermost, outermost first
    return [{"file": entry.filename[-MAX_TEXT_CHARS:], "line": entry.lineno or 0,
             "function": entry.name[:MAX_TEXT_CHARS]} for entry in frames]


def closed_record(job: str, rank: int, progress: Progress) -> dict[str, Any]:
    """The progress record of hooks being closed: the rank ended its training; its process's exit is no death. Its
    process's CPU time then lets an agent tell a process that never exits and does nothing (stuck in its teardown)
    from one still at work."""
    return {
        "v": SCHEMA_VERSION, "kind": "progress", "job": job, "rank": rank, "time": time.time(),
        "step": progress.step, "phase": "closed", "stalled_seconds": 0.0, "overdue_seconds": 0.0,
        "cpu_seconds": time.process_time(),
    }


def error_record(job: str, rank: int, progress: Progress, error: BaseException) -> dict[str, Any]:
    """The progress record of a step that raised `error`: the rank may be about to die, and its peers to wait."""
    name = type(error).__name__
    return {
        "v": SCHEMA_VERSION, "kind": "progress", "job": job, "rank": rank, "time": time.time(),
        "step": progress.step, "phase": progress.phase, "stalled_seconds": 0.0, "overdue_seconds": 0.0,
        "error": {"type": name if name.isidentifier() else "Exception", "message": str(error)[:MAX_TEXT_CHARS]},
    }
