"""Collective calls of one step: when each started and ended, and the step record's histogram of them.

A call is *blocking* when the training thread waits for it (the reference trainer's comm layer: the
call returns when the collective is done) and *overlapped* when it runs beside the computation (a
DDP bucket's all-reduce during backward). Both count in the latency histogram; they differ in how
much of them the training thread spent waiting (`exposed_seconds`).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatch.protocol.schema import COLLECTIVE_BUCKETS, bucket_index
from gpuwatch.trainer.hooks.clock import Clock, Mark


@dataclass(slots=True)
class Call:
    op: str  # one of schema.COLLECTIVE_OPS
    nbytes: int
    start: Mark
    blocking: bool
    phase: str | None  # the step phase it was issued in ("compute", ...), None outside any
    end: Mark | None = None  # set when it completes; an overlapped call completes on another thread
    seconds: float = 0.0  # end - start, once the step is resolved (`resolve`)
    group: str | None = None  # its process group's hello name, where the hooks numbered it (`Monitor.in_flight`)


def resolve(calls: Iterable[Call], clock: Clock) -> None:
    """Fill in each call's duration, once the device has passed its marks."""
    for call in calls:
        call.seconds = clock.seconds(call.start, call.end)


def histogram(calls: Iterable[Call]) -> dict[str, dict[str, Any]]:
    """The step record's `collectives` field: per op, count, bytes, seconds and pre-bucketed latencies."""
    ops: dict[str, dict[str, Any]] = {}
    for call in calls:
        seconds = call.seconds
        op = ops.get(call.op)
        if op is None:
            op = ops[call.op] = {"count": 0, "bytes": 0, "seconds": 0.0, "buckets": [0] * (len(COLLECTIVE_BUCKETS) + 1)}
        op["count"] += 1
        op["bytes"] += call.nbytes
        op["seconds"] += seconds
        op["buckets"][bucket_index(seconds)] += 1
    return ops


def exposed_seconds(calls: Iterable[Call], phase_ends: Mapping[str, Mark], clock: Clock) -> list[tuple[Call, float]]:
    """Each call with the time the training thread spent waiting on it rather than computing; `calls` resolved and
    in launch order, `phase_ends` the end of each phase's last interval.

    Blocking calls count whole. Overlapped calls hide behind the computation until it runs out of
    work: what shows is the tail from the phase's last launch (DDP launches a bucket as soon as its
    gradients are ready, so the last launch is the end of the backward computation) to the phase's
    end, when the training thread has waited for all of them; the tail is the last launch's. An overlapped
    call issued outside any phase has no such end and counts nothing.
    """
    exposed: list[tuple[Call, float]] = []
    last_launch: dict[str, Call] = {}
    for call in calls:
        if call.blocking:
            exposed.append((call, call.seconds))
        elif call.phase is not None and call.phase in phase_ends:
            last_launch[call.phase] = call
    exposed += [(call, clock.seconds(call.start, phase_ends[phase])) for phase, call in last_launch.items()]
    return exposed


def by_phase(exposed: Iterable[tuple[Call, float]]) -> dict[str | None, float]:
    """Exposed seconds per phase (None: outside any)."""
    phases: dict[str | None, float] = collections.defaultdict(float)
    for call, seconds in exposed:
        phases[call.phase] += seconds
    return phases


def by_group(calls: Iterable[Call], exposed: Iterable[tuple[Call, float]]) -> dict[str, dict[str, Any]]:
    """The step record's `groups` field: per process group (of the calls whose group is known), the bytes handed
    to its calls and the seconds waited on them."""
    groups: dict[str, dict[str, Any]] = {}
    for call in calls:
        if call.group is not None:
            groups.setdefault(call.group, {"bytes": 0, "seconds": 0.0})["bytes"] += call.nbytes
    for call, seconds in exposed:
        if call.group is not None:
            groups[call.group]["seconds"] += seconds
    return groups
