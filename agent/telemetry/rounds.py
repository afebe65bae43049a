"""What the telemetry collector makes of the store each sampling round: one read of it, made on first use, and the
telemetry part of /api/v1/state.

A round's read (apply what was queued, expire, copy the ranks) is made by whichever thread first needs it, a render
ahead of a scrape or a state request (``Once``); a round nobody uses reads nothing. Its families and its readings
are built from the copies when asked for (``Round``): the ranks are copies and probe bodies are never mutated, so
building later is the same. Hello, step, progress and probe bodies are the typed records (``protocol.records``),
written as the schema's JSON objects (their ``as_dict``, by ``snapshot.json_safe``); their readers convert a rank
back into ``readings.RankReadings``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from prometheus_client.core import Metric

from gpuwatch.agent.telemetry.store import RankState
from gpuwatch.protocol.records import Probe


class Round(NamedTuple):
    """One read of the store: its families, built when rendered, and its readings, built when /api/v1/state asks."""

    families: Callable[[], list[Metric]]
    readings: Callable[[], dict[str, Any]]


class Once:
    """``read(self)`` called once, by whichever thread first needs its value; the others wait for it."""

    def __init__(self, read: Callable[[Once], Round]) -> None:
        self._read = read
        self._lock = threading.Lock()
        self._value: Round | None = None

    def __call__(self) -> Round:
        with self._lock:
            if self._value is None:
                self._value = self._read(self)
            return self._value


class StateReadings:
    """The telemetry collector's readings in /api/v1/state: the socket, the record counts, the senders' processes,
    each rank's state and the probes. Each rank's readings are kept with the store's copy they were made from: the
    store hands out the same copy while the rank does not change, and its readings are then the same too."""

    def __init__(self, path: Path, queue_limit: int | None, ttl: float) -> None:
        self._path, self._queue_limit, self._ttl = path, queue_limit, ttl
        self._ranks: dict[tuple[str, int], tuple[RankState, dict[str, Any]]] = {}

    def __call__(self, ranks: Sequence[RankState], records: dict[tuple[str, str], int],
                 probes: list[Probe]) -> dict[str, Any]:
        return {
            "socket": str(self._path),
            "queue_limit": self._queue_limit,
            "ttl_seconds": self._ttl,
            "records": {
                "accepted": records["accepted", ""],
                **{result: {reason: count for (kind, reason), count in records.items() if kind == result}
                   for result in ("rejected", "dropped")},
            },
            # For per-process attribution (host RSS): the senders' pids as the kernel reported them, in the
            # agent's pid namespace; the pid in a hello is the rank's view, wrong across containers.
            "processes": [{"pid": s.sender_pid, "job": s.job, "rank": s.rank} for s in ranks if s.sender_pid],
            "ranks": self._ranks_readings(ranks),
            "probes": probes,
        }

    def _ranks_readings(self, ranks: Sequence[RankState]) -> list[dict[str, Any]]:
        """Each rank's readings, made again only for the ranks whose copy is new. Read and replaced whole, never
        mutated: rounds' readings built at once in two threads at worst leave the cache one round old."""
        readings = {}
        for state in ranks:
            key = (state.job, state.rank)
            last = self._ranks.get(key)
            readings[key] = last if last is not None and last[0] is state else (state, rank_readings(state))
        self._ranks = readings  # a rank that expired is forgotten
        return [rank for _, rank in readings.values()]


def rank_readings(state: RankState) -> dict[str, Any]:
    """A rank's state as /api/v1/state serves it, read back as ``readings.RankReadings`` (the same keys: a test)."""
    return {
        "job": state.job,
        "rank": state.rank,
        "hello": state.hello,
        "last_step": state.last_step,
        "counters": state.counters(),
        "collectives": {op: totals.as_dict() for op, totals in state.collectives.items()},
        "sampled": {name: {"step": step, "value": value} for name, (step, value) in state.sampled.items()},
        "unavailable": {signal: {"step": step, "reason": reason}
                        for signal, (step, reason) in state.unavailable.items()},
        "window": state.window.points(),  # StepPoints: written as JSON only when /api/v1/state is asked for
        "sender_pid": state.sender_pid,
        "last_seen": state.last_seen_time,
        "progress": state.progress,
        "exited": state.exited_time,
    }
