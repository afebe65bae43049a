"""The run's per-rank phases and collectives as a Chrome/Perfetto trace: Trace Event Format JSON (the "JSON Object
Format": ``{"traceEvents": [...], "displayTimeUnit": "ms"}``), openable in ui.perfetto.dev and chrome://tracing.

One process per rank (``pid`` = rank, named by its layout), one thread (track) per phase and per collective op.
A step record carries each phase's duration, not when it started, so each step's phases are laid end to end in the
schema's order (data, compute, optimizer, outside the model, then the collectives waited for), ending where the rank's
clock says the step ended; a collective op's slice is its calls' summed time in the step, from the step's start, on a
track of its own. The spec: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from gpuwatch.diagnosis.facts import RankFacts, StepRow
from gpuwatch.report.model import PHASES

#: Microseconds per second: the format's timestamps and durations are in µs.
US = 1e6


def _meta(pid: int, tid: int | None, name: str, value: str) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "M", "pid": pid, "name": name, "args": {"name": value}}
    if tid is not None:
        event["tid"] = tid
    return event


def _slice(pid: int, tid: int, name: str, start: float, seconds: float, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": "step", "ts": round(start * US, 3),
            "dur": round(seconds * US, 3), "args": args}


def _rank_events(rank: RankFacts, ops: Sequence[str]) -> Iterator[dict[str, Any]]:
    layout = rank.layout
    place = f" (dp {layout.dp_rank}, pp {layout.pp_stage}, tp {layout.tp_rank})" if layout else ""
    yield _meta(rank.rank, None, "process_name", f"rank {rank.rank}{place}")
    yield {"ph": "M", "pid": rank.rank, "name": "process_sort_index", "args": {"sort_index": rank.rank}}
    tracks = [name for name, _ in PHASES] + [f"collective {op}" for op in ops]
    for tid, name in enumerate(tracks, 1):
        yield _meta(rank.rank, tid, "thread_name", name)
        yield {"ph": "M", "pid": rank.rank, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}}
    for row in rank.history.steps if rank.history else ():
        yield from _step_events(rank.rank, row, ops)


def _step_events(pid: int, row: StepRow, ops: Sequence[str]) -> Iterator[dict[str, Any]]:
    start = row.time - row.step_seconds
    at = start
    for tid, (name, field) in enumerate(PHASES, 1):
        seconds = getattr(row, field)
        if seconds:
            yield _slice(pid, tid, name, at, seconds, {"step": row.step})
            at += seconds
    for op, count, seconds in row.collectives:
        if seconds:
            yield _slice(pid, len(PHASES) + 1 + ops.index(op), op, start, seconds,
                         {"step": row.step, "calls": count})


def trace(ranks: Iterable[RankFacts]) -> dict[str, Any]:
    """The trace of these ranks' steps (their run-log history; none from a live source)."""
    ranks = list(ranks)
    ops = sorted({op for rank in ranks for row in (rank.history.steps if rank.history else ()) for op, _, _ in
                  row.collectives})
    events = [event for rank in ranks for event in _rank_events(rank, ops)]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "gpuwatch report", "layout": "one process per rank, one track per phase"}}
