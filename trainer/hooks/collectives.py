"""Collective calls of one step: when each started and ended, and the step record's histogram of them.

A call is *blocking* when the training thread waits for it (the reference trainer's comm layer: the
call returns when the collective is done) and *overlapped* when it runs beside the computation (a
DDP bucket's all-reduce during backward). Both count in the latency histogram; they differ in what
they take away from compute time (`exposed_seconds`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpuwatch.agent.telemetry.schema import COLLECTIVE_BUCKETS, bucket_index
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


def exposed_seconds(calls: list[Call], phase: str, phase_end: Mark, clock: Clock) -> float:
    """Time `phase` spent waiting on collectives rather than computing.

    Blocking calls count whole. Overlapped calls hide behind the computation until it runs out of
    work: what shows is the tail from the last one's launch (DDP launches a bucket as soon as its
    gradients are ready, so the last launch is the end of the backward computation) to the phase's
    end, when the training thread has waited for all of them.
    """
    blocked = sum(c.seconds for c in calls if c.phase == phase and c.blocking)
    overlapped = [c for c in calls if c.phase == phase and not c.blocking]
    tail = clock.seconds(overlapped[-1].start, phase_end) if overlapped else 0.0
    return blocked + tail
