"""Rank facts from telemetry as the agent keeps it, typed (``telemetry.readings.RankReadings``): a rank's hello and
latest step records (``protocol.records``), its accumulated counters, collective totals and sampled values; and
bandwidth measurements from probe records. Shared by the agent and run-log sources, read by attribute."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import msgspec

from gpuwatch.agent.telemetry.readings import RankReadings, SampledAt
from gpuwatch.agent.telemetry.store import SAMPLED_FIELDS, probe_peaks
from gpuwatch.agent.telemetry.window import StepPoint, summarize
from gpuwatch.diagnosis.facts import (
    AfterClose,
    BandwidthMeasurement,
    CollectiveFacts,
    History,
    InFlightFacts,
    Layout,
    ProgressFacts,
    RankFacts,
    Sampled,
    StepFacts,
    Workload,
    group_members,
)
from gpuwatch.protocol.records import CollectiveTotals, Hello, Memory, Probe, Progress, Step
from gpuwatch.protocol.schema import COLLECTIVE_BUCKETS


def histogram_quantile(quantile: float, buckets: Sequence[int]) -> float | None:
    """The quantile of per-bucket counts over COLLECTIVE_BUCKETS (+ overflow), interpolated inside the bucket
    as Prometheus's histogram_quantile does; the overflow bucket answers with the highest finite bound."""
    total = sum(buckets)
    if total == 0:
        return None
    target = quantile * total
    seen = 0
    for index, count in enumerate(buckets):
        if seen + count >= target and count:
            if index == len(COLLECTIVE_BUCKETS):
                return COLLECTIVE_BUCKETS[-1]
            lower = COLLECTIVE_BUCKETS[index - 1] if index else 0.0
            upper = COLLECTIVE_BUCKETS[index]
            return lower + (upper - lower) * (target - seen) / count
        seen += count
    return COLLECTIVE_BUCKETS[-1]


def collective(op: str, totals: CollectiveTotals) -> CollectiveFacts:
    return CollectiveFacts(op=op, count=totals.count, seconds=totals.seconds, bytes=totals.bytes,
                           p50_seconds=histogram_quantile(0.5, totals.buckets),
                           p99_seconds=histogram_quantile(0.99, totals.buckets), buckets=tuple(totals.buckets))


def layout(hello: Hello) -> Layout:
    return Layout(
        world_size=hello.world_size, tp_size=hello.tp_size, pp_size=hello.pp_size, dp_size=hello.dp_size,
        tp_rank=hello.tp_rank, pp_stage=hello.pp_stage, dp_rank=hello.dp_rank, local_rank=hello.local_rank,
        schedule=hello.schedule, micro_batches=hello.micro_batches, precision=hello.precision,
        virtual_stages=hello.virtual_stages,
        stage_modules=tuple(hello.stage_modules) if hello.stage_modules is not None else None)


def workload(hello: Hello) -> Workload | None:
    """What the rank trains, where its hello says it all (the reference trainer's does)."""
    if hello.model is None or hello.global_batch is None or hello.seq_len is None:
        return None
    return Workload(hello.model, hello.global_batch, hello.seq_len)


#: The step view's fields (``StepFacts``), each named as the record names it, and the one it renames: the memory
#: reading's ``kind``.
_STEP_VIEW = frozenset(field.name for field in dataclasses.fields(StepFacts))
_RENAMED = {"kind": "memory_kind"}


def step(body: Step, memory: Memory | None) -> StepFacts:
    """The latest step record, with the latest memory reading (a step in N has one: `memory_every`), as diagnosis'
    view of them: each field of ``StepFacts`` taken by its name from the step, its pipeline or the memory reading, so
    a field added to the view reads the record's field of that name, no copying code between them."""
    values: dict[str, Any] = {}
    for part in (body, body.pipeline, memory):
        if part is not None:
            values.update((_RENAMED.get(name, name), value) for name, value in msgspec.structs.asdict(part).items())
    # Any, as mypy cannot match ** keys to StepFacts' own fields; a mapping copied, not shared with the record.
    view: dict[str, Any] = {name: dict(value) if isinstance(value, dict) else value for name, value in values.items()
                            if name in _STEP_VIEW}
    return StepFacts(**view)


def progress(body: Progress, hello: Hello | None) -> ProgressFacts:
    """A progress record; the in-flight collective's group members from the rank's hello, or the whole world for
    "default"."""
    collective = body.collective
    in_flight = None
    if collective is not None:
        in_flight = InFlightFacts(
            op=collective.op, group=collective.group, seq=collective.seq, bytes=collective.bytes,
            seconds=collective.seconds,
            members=group_members(hello.process_groups if hello else None, hello.world_size if hello else None,
                                  collective.group))
    error = body.error
    return ProgressFacts(
        step=body.step, phase=body.phase, stalled_seconds=body.stalled_seconds,
        overdue_seconds=body.overdue_seconds, collective=in_flight,
        stack=tuple(f"{frame.file}:{frame.line} {frame.function}" for frame in body.stack or ()),
        error=f"{error.type}: {error.message}" if error else None, time=body.time, recorder=body.flight_recorder,
        cpu_seconds=body.cpu_seconds)


def rank_facts(rank: RankReadings, *, node: str | None, history: History | None = None,
               now: float | None = None) -> RankFacts:
    """One rank, as the agent's state holds it (a run log's ranks are read into the same form). Counters and
    collectives are totals since the agent (or the log) first saw the rank; the window is its latest steps;
    ``unavailable`` maps a signal to the step and reason it last could not be computed, which stands unless a later
    step measured it. ``now`` is the moment the source's view is of (the agent's round; ``math.inf`` for a run log,
    read after the run), against which the hello's age is told."""
    hello, sampled, counters = rank.hello, rank.sampled, rank.counters
    measured_at = {signal: at.step for signal in SAMPLED_FIELDS if (at := getattr(sampled, signal)) is not None}
    missing = {signal: unavailable.reason for signal, unavailable in rank.unavailable.items()
               if unavailable.step >= measured_at.get(signal, -1)}
    gpu = hello.gpu if hello else None
    return RankFacts(
        job=rank.job, rank=rank.rank, node=node or (hello.hostname if hello else None),
        hostname=hello.hostname if hello else None,
        layout=layout(hello) if hello and "layout" not in (hello.unavailable_from_outside or ()) else None,
        workload=workload(hello) if hello else None,
        gpu_index=gpu.index if gpu else None, gpu_uuid=gpu.uuid if gpu else None,
        env=dict(hello.env) if hello and hello.env is not None else None,
        process_groups={name: list(members) for name, members in hello.process_groups.items()}
        if hello and hello.process_groups is not None else None,
        cpus=hello.cpus if hello else None,
        backends=dict(hello.backends) if hello and hello.backends is not None else None,
        faults=tuple(hello.faults or ()) if hello else (),
        unavailable_from_outside=tuple(hello.unavailable_from_outside or ()) if hello else (),
        hello_notes=tuple(hello.notes or ()) if hello else (),
        hello_age_seconds=max(0.0, now - hello.time) if hello and now is not None else None,
        last=step(rank.last_step, sampled.memory.value if sampled.memory else None) if rank.last_step else None,
        window=summarize(StepPoint.from_dict(point) for point in rank.window),
        unavailable=missing or None,
        steps=counters.steps, nonfinite_steps=counters.nonfinite_steps,
        alloc_retries=counters.alloc_retries, ooms=counters.ooms,
        collectives={op: collective(op, totals) for op, totals in rank.collectives.items()},
        param_checksum=_sampled(sampled.param_checksum), grad_cosine=_sampled(sampled.grad_cosine_similarity),
        history=history,
        progress=progress(rank.progress, hello) if rank.progress else None,
        exited_at=rank.exited,
    )


def after_close(seconds: float | None, cpu_at_close: float | None, process: tuple[int, float] | None,
                exited: bool) -> AfterClose | None:
    """A closed rank whose process has not exited: ``seconds`` since its hooks closed (by the source's clock),
    its process's CPU time as they closed and ``process``, its (pid, CPU time) as the agent on its node read it last.
    None where any is unknown: a run log ends at the close, and an agent in another pid namespace sees no process."""
    if seconds is None or cpu_at_close is None or process is None or exited:
        return None
    pid, cpu_seconds = process
    return AfterClose(seconds=max(0.0, seconds), cpu_seconds=max(0.0, cpu_seconds - cpu_at_close), pid=pid)


def _sampled(at: SampledAt[Any] | None) -> Sampled | None:
    return Sampled(value=at.value, step=at.step) if at is not None else None


def bandwidth(probes: Sequence[Probe], node: str | None) -> list[BandwidthMeasurement] | None:
    """Each probe's peak bus bandwidth per op, placed on ``node`` (the agent's node; None: the probe's host)."""
    measurements = [
        BandwidthMeasurement(node=node or probe.hostname, interconnect=probe.interconnect, op=op,
                             size_bytes=row.bytes, busbw_bytes_per_second=row.busbw_bytes_per_second,
                             ranks=probe.world_size, job=probe.job, ranks_per_node=probe.ranks_per_node)
        for probe in probes
        for op, row in sorted(probe_peaks(probe).items())]
    return measurements or None

