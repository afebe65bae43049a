"""Rank facts from telemetry as the agent keeps it: a rank's hello and latest step record bodies (schema v1),
its accumulated counters, collective totals and sampled values; and bandwidth measurements from probe records.
Shared by the agent and run-log sources."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatch.agent.diagnosis.facts import (
    BandwidthMeasurement,
    CollectiveFacts,
    History,
    InFlightFacts,
    Layout,
    ProgressFacts,
    RankFacts,
    Sampled,
    StepFacts,
    group_members,
)
from gpuwatch.agent.telemetry.store import probe_peaks
from gpuwatch.agent.telemetry.window import StepPoint, summarize
from gpuwatch.protocol.schema import COLLECTIVE_BUCKETS, STEP_PHASES


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


def collective(op: str, totals: Mapping[str, Any]) -> CollectiveFacts:
    buckets = totals.get("buckets") or ()
    return CollectiveFacts(op=op, count=totals["count"], seconds=totals["seconds"], bytes=totals.get("bytes"),
                           p50_seconds=histogram_quantile(0.5, buckets), p99_seconds=histogram_quantile(0.99, buckets))


def layout(hello: Mapping[str, Any]) -> Layout:
    return Layout(
        world_size=hello["world_size"], tp_size=hello["tp_size"], pp_size=hello["pp_size"], dp_size=hello["dp_size"],
        tp_rank=hello["tp_rank"], pp_stage=hello["pp_stage"], dp_rank=hello["dp_rank"],
        local_rank=hello.get("local_rank"), schedule=hello.get("schedule"), micro_batches=hello.get("micro_batches"),
        precision=hello.get("precision"))


def _maybe_nonfinite(value: Any) -> float | None:
    """Loss and grad norm may be non-finite; JSON state carries those as "NaN", "+Inf", "-Inf"."""
    return float(value) if isinstance(value, str) else value


def step(body: Mapping[str, Any], memory: Mapping[str, Any] | None) -> StepFacts:
    """The latest step record, with the latest memory reading (a step in N has one: `memory_every`)."""
    pipeline = body.get("pipeline") or {}
    memory = memory or {}
    return StepFacts(
        step=body["step"], step_seconds=body.get("step_seconds"),
        **{field: body.get(field) for field in STEP_PHASES.values()},
        exposed_collective_seconds=body.get("exposed_collective_seconds"),
        gradient_sync_bytes=body.get("gradient_sync_bytes"),
        collective_calls=dict(body["collective_calls"]) if "collective_calls" in body else None,
        bubble_ratio=pipeline.get("bubble_ratio"), bubble_ratio_theoretical=pipeline.get("bubble_ratio_theoretical"),
        loss=_maybe_nonfinite(body.get("loss")), grad_norm=_maybe_nonfinite(body.get("grad_norm")),
        loss_scale=body.get("loss_scale"),
        memory_kind=memory.get("kind"), peak_bytes=memory.get("peak_bytes"),
        allocated_bytes=memory.get("allocated_bytes"), reserved_bytes=memory.get("reserved_bytes"),
        inactive_split_bytes=memory.get("inactive_split_bytes"))


def progress(body: Mapping[str, Any], groups: Mapping[str, Sequence[int]] | None,
             world_size: int | None) -> ProgressFacts:
    """A progress record body; the in-flight collective's group members from the rank's hello (`groups`), or the
    whole world for "default"."""
    collective = body.get("collective")
    in_flight = None
    if collective is not None:
        in_flight = InFlightFacts(op=collective["op"], group=collective["group"],
                                  members=group_members(groups, world_size, collective["group"]), seq=collective["seq"],
                                  bytes=collective.get("bytes"), seconds=collective.get("seconds"))
    error = body.get("error")
    return ProgressFacts(
        step=body["step"], phase=body["phase"], stalled_seconds=body["stalled_seconds"],
        overdue_seconds=body["overdue_seconds"], collective=in_flight,
        stack=tuple(f"{frame['file']}:{frame['line']} {frame['function']}" for frame in body.get("stack") or ()),
        error=f"{error['type']}: {error['message']}" if error else None, time=body.get("time"))


def rank_facts(
    job: str,
    rank: int,
    *,
    node: str | None,
    hello: Mapping[str, Any] | None,
    last_step: Mapping[str, Any] | None,
    counters: Mapping[str, int],
    collectives: Mapping[str, Mapping[str, Any]],
    sampled: Mapping[str, tuple[int, Any]],
    unavailable: Mapping[str, tuple[int, str]],
    window: Sequence[StepPoint],
    history: History | None = None,
    progress_body: Mapping[str, Any] | None = None,
    exited_at: float | None = None,
    now: float | None = None,
) -> RankFacts:
    """One rank. Counters and collectives are totals since the agent (or the log) first saw the rank; the
    window is its latest steps; ``unavailable`` maps a signal to the step and reason it last could not be
    computed, which stands unless a later step measured it. ``now`` is the moment the source's view is of (the
    agent's round; ``math.inf`` for a run log, read after the run), against which the hello's age is told."""
    hello = hello or {}
    gpu = hello.get("gpu") or {}
    sampled_facts = {name: Sampled(value=value, step=at) for name, (at, value) in sampled.items()}
    missing = {signal: reason for signal, (at, reason) in unavailable.items() if at >= sampled.get(signal, (-1,))[0]}
    return RankFacts(
        job=job, rank=rank, node=node or hello.get("hostname"), hostname=hello.get("hostname"),
        layout=layout(hello) if hello and "layout" not in hello.get("unavailable_from_outside", ()) else None,
        gpu_index=gpu.get("index"), gpu_uuid=gpu.get("uuid"),
        env=dict(hello["env"]) if "env" in hello else None,
        process_groups={name: list(members) for name, members in hello["process_groups"].items()}
        if "process_groups" in hello else None,
        cpus=hello.get("cpus"), backends=dict(hello["backends"]) if "backends" in hello else None,
        faults=tuple(hello.get("faults", ())),
        unavailable_from_outside=tuple(hello.get("unavailable_from_outside", ())),
        hello_notes=tuple(hello.get("notes", ())),
        hello_age_seconds=max(0.0, now - hello["time"]) if hello and now is not None else None,
        last=step(last_step, sampled.get("memory", (0, None))[1]) if last_step else None,
        window=summarize(window),
        unavailable=missing or None,
        steps=counters.get("steps"), nonfinite_steps=counters.get("nonfinite_steps"),
        alloc_retries=counters.get("alloc_retries"), ooms=counters.get("ooms"),
        collectives={op: collective(op, totals) for op, totals in collectives.items()},
        param_checksum=sampled_facts.get("param_checksum"), grad_cosine=sampled_facts.get("grad_cosine_similarity"),
        history=history,
        progress=progress(progress_body, hello.get("process_groups"), hello.get("world_size"))
        if progress_body else None,
        exited_at=exited_at,
    )


def bandwidth(probes: Sequence[Mapping[str, Any]], node: str | None) -> list[BandwidthMeasurement] | None:
    """Each probe's peak bus bandwidth per op, placed on ``node`` (the agent's node; None: the probe's host)."""
    measurements = [
        BandwidthMeasurement(node=node or probe["hostname"], interconnect=probe["interconnect"], op=op,
                             size_bytes=row["bytes"], busbw_bytes_per_second=row["busbw_bytes_per_second"],
                             ranks=probe["world_size"], job=probe["job"], ranks_per_node=probe["ranks_per_node"])
        for probe in probes for op, row in sorted(probe_peaks(probe).items())]
    return measurements or None
