"""A rank's state as /api/v1/state serves it (``rounds.rank_readings``), typed: what diagnosis reads it back as.

The agent writes each rank's state as JSON (hello and latest step as the record bodies, the counters, collective
totals, sampled signals, window points, progress, exit); ``gpuwatch diagnose --agent`` converts it into these structs
(``protocol.records.convert``) and builds its facts by attribute, and the run-log source goes through the same form, so
a rank reads alike from either. A state that does not fit is one ``msgspec.ValidationError`` naming where.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

from gpuwatch.protocol.records import CollectiveTotals, Hello, Memory, Probe, Progress, Step

T = TypeVar("T")


class SampledAt(msgspec.Struct, Generic[T], kw_only=True):
    """A signal measured every N steps: its latest value, with the step that measured it."""

    step: int
    value: T


class SampledSignals(msgspec.Struct, kw_only=True):
    """The step fields measured every N steps, each as last measured (``store.SAMPLED_FIELDS`` are these names)."""

    grad_cosine_similarity: SampledAt[float] | None = None
    param_checksum: SampledAt[float | str] | None = None
    memory: SampledAt[Memory] | None = None


class UnavailableAt(msgspec.Struct, kw_only=True):
    """The latest step that could not compute a signal due, and why (``schema.UNAVAILABLE_REASONS``)."""

    step: int
    reason: str


class RankCounters(msgspec.Struct, kw_only=True):
    """Totals since the agent (or the log) first saw the rank (``store.RankState.counters``); None: not reported."""

    steps: int | None = None
    nonfinite_steps: int | None = None
    tokens: int | None = None
    samples: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None


class RankReadings(msgspec.Struct, kw_only=True):
    """One rank in /api/v1/state. ``window`` holds the points as ``window.StepPoint.as_dict`` wrote them, read back by
    ``StepPoint.from_dict`` (the point's own JSON form); a value is a number, or a non-finite loss's text."""

    job: str
    rank: int
    hello: Hello | None = None
    last_step: Step | None = None
    counters: RankCounters = msgspec.field(default_factory=RankCounters)
    collectives: dict[str, CollectiveTotals] = msgspec.field(default_factory=dict)
    sampled: SampledSignals = msgspec.field(default_factory=SampledSignals)
    unavailable: dict[str, UnavailableAt] = msgspec.field(default_factory=dict)
    window: list[dict[str, int | float | str | None]] = msgspec.field(default_factory=list)
    sender_pid: int | None = None
    last_seen: float | None = None
    progress: Progress | None = None
    exited: float | None = None


class TelemetryReadings(msgspec.Struct, kw_only=True):
    """The telemetry collector's part of /api/v1/state that diagnosis reads: its ranks and each job's latest probe."""

    ranks: list[RankReadings] = msgspec.field(default_factory=list)
    probes: list[Probe] = msgspec.field(default_factory=list)
