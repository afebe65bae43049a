"""What the report page shows, typed: built from the facts the diagnosis sources read and the findings its engine
judged (``gather``), written out by ``render`` (HTML) and ``trace`` (Trace Event Format). Nothing here judges: the
findings are the engine's, and the views only arrange what the ranks reported, so that a finding's evidence can be
seen where it stands.

Every view is plain numbers in lists, in the ranks' layout order (dp, pp, tp): the page's script draws them as they
are. The heaviest view, the step-time heatmap, is downsampled to at most ``MAX_HEATMAP_CELLS`` cells, each the
slowest step of its bin, so that a straggler's slow steps survive the reduction (docs/report.md).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gpuwatch.agent.telemetry.window import BUSY
from gpuwatch.diagnosis.engine import Report
from gpuwatch.diagnosis.facts import RankFacts, StepRow, finite, rank_list
from gpuwatch.diagnosis.registry import REGISTRY, Finding
from gpuwatch.protocol.schema import COLLECTIVE_BUCKETS, STEP_PHASES, bucket_index

#: The heatmap's cell budget (ranks × step columns): 64 ranks × 1,000 steps whole, 1,024 ranks in bins of 6 steps.
MAX_HEATMAP_CELLS = 65_536
#: Points of each line over the steps: the steps are binned beyond this, each bin's median kept.
MAX_CURVE_POINTS = 1_000
#: The phases of a step as the page stacks them (``schema.STEP_PHASES``, then the collectives waited for).
PHASES: tuple[tuple[str, str], ...] = (*STEP_PHASES.items(), ("exposed_collectives", "exposed_collective_seconds"))
#: The curves over the steps: name, StepRow field, unit.
CURVES: tuple[tuple[str, str, str], ...] = (
    ("loss", "loss", ""), ("gradient norm", "grad_norm", ""), ("learning rate", "lr", ""),
    ("gradient cosine similarity", "grad_cosine", ""), ("memory peak", "memory_peak_bytes", "bytes"))
#: The phase of the progress record a rank sends when its monitor closes (trainer/hooks/progress.py).
CLOSED = "closed"


@dataclasses.dataclass(frozen=True)
class RankRow:
    """A rank and its place in the grid; None where its hello gave no layout."""

    rank: int
    dp: int | None
    pp: int | None
    tp: int | None
    node: str | None

    @property
    def label(self) -> str:
        place = f" dp{self.dp} pp{self.pp} tp{self.tp}" if self.dp is not None else ""
        return f"r{self.rank}{place}"


@dataclasses.dataclass(frozen=True)
class EvidenceView:
    text: str
    rank: int | None
    step: int | None


@dataclasses.dataclass(frozen=True)
class FindingView:
    """A finding of the engine, and where the page shows its evidence: a view, the ranks and steps it names."""

    code: str
    severity: str
    title: str
    evidence: tuple[EvidenceView, ...]
    fix: str
    reason: str
    view: str
    ranks: tuple[int, ...]
    steps: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Heatmap:
    """Per rank (rows, layout order) and step column: the step's seconds, and its busy seconds (its phases summed,
    what a straggler is judged by: the others' steps last as long as its, waiting). ``bin`` steps per column, the
    slowest of each kept."""

    steps: list[int]  # each column's first step
    step_seconds: list[list[float | None]]
    busy_seconds: list[list[float | None]]
    bin: int
    of: str  # "steps", or "window medians" where the source keeps no per-step history


@dataclasses.dataclass(frozen=True)
class PhaseBars:
    """Each rank's median seconds per phase (``PHASES``), stacked on the page."""

    phases: list[str]
    values: list[list[float | None]]  # per phase, per rank


@dataclasses.dataclass(frozen=True)
class Bubble:
    """The pipeline's measured bubble per stage (median over its ranks' steps) against the schedule's theory."""

    stages: list[int]
    measured: list[float | None]
    theoretical: list[float | None]
    planned: float | None


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective op across the job: calls per latency bucket (summed over ranks), each rank's mean latency,
    and their skew (the slowest rank's mean over the median rank's)."""

    op: str
    bucket_bounds: list[float]
    buckets: list[int]
    rank_mean_seconds: list[float | None]
    skew: float | None
    slowest_rank: int | None


@dataclasses.dataclass(frozen=True)
class CollectiveGroup:
    """One process group across the job (the hello's names: tp, pp, dp, ...): the seconds a rank waited on the
    group's calls in a step (step records' ``groups``), counted per latency bucket over every rank's steps; each
    rank's median; their skew (the most-waiting rank's median over the median rank's: in a synchronous group the
    rank that waits least is the late one)."""

    group: str
    bucket_bounds: list[float]
    buckets: list[int]
    rank_median_seconds: list[float | None]
    skew: float | None
    most_waiting_rank: int | None
    least_waiting_rank: int | None


@dataclasses.dataclass(frozen=True)
class Curve:
    """A value over the steps across the ranks that report it: the median, lowest and highest rank each step."""

    name: str
    unit: str
    steps: list[int]
    median: list[float | None]
    low: list[float | None]
    high: list[float | None]
    planned: float | None = None


@dataclasses.dataclass(frozen=True)
class Wait:
    """A stalled rank's state: where it is, the collective it waits in, the group members it waits for."""

    rank: int
    step: int
    phase: str
    stalled_seconds: float
    op: str | None
    group: str | None
    seq: int | None
    waits_for: tuple[int, ...]
    stack_top: str | None
    error: str | None


@dataclasses.dataclass(frozen=True)
class Hang:
    """The ranks the hang findings name, and every stalled rank's wait, the named ones first."""

    culprits: tuple[int, ...]
    waits: tuple[Wait, ...]


@dataclasses.dataclass(frozen=True)
class PlanOverlay:
    """What ``gpuwatch plan`` predicted for this layout (or its fastest, when the job's layout is not among them)."""

    layout: str
    matched: bool
    step_seconds: float | None
    bubble: float | None
    memory_bytes: float | None


@dataclasses.dataclass(frozen=True)
class ReportModel:
    job: str
    jobs: tuple[str, ...]
    sources: tuple[str, ...]
    generated_at: float
    ranks: tuple[RankRow, ...]
    findings: tuple[FindingView, ...]
    not_run: tuple[str, ...]
    notes: tuple[str, ...]
    missing: tuple[str, ...]
    heatmap: Heatmap | None
    phases: PhaseBars | None
    bubble: Bubble | None
    collectives: tuple[CollectiveOp, ...]
    groups: tuple[CollectiveGroup, ...]
    curves: tuple[Curve, ...]
    hang: Hang | None
    plan: PlanOverlay | None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- building ---------------------------------------------------------------------------------------------------------


def _order(rank: RankFacts) -> tuple[int, ...]:
    layout = rank.layout
    return (0, layout.dp_rank, layout.pp_stage, layout.tp_rank, rank.rank) if layout else (1, 0, 0, 0, rank.rank)


def _row(rank: RankFacts) -> RankRow:
    layout = rank.layout
    return RankRow(rank.rank, layout.dp_rank if layout else None, layout.pp_stage if layout else None,
                   layout.tp_rank if layout else None, rank.host)


def _steps(rank: RankFacts) -> list[StepRow]:
    return rank.history.steps if rank.history else []


def _median(values: Iterable[float | None]) -> float | None:
    present = [value for value in values if finite(value)]
    return statistics.median(present) if present else None


def _bins(steps: Sequence[int], budget: int) -> tuple[list[int], int]:
    """The first step of each column and the steps a column holds, so that at most ``budget`` columns remain."""
    size = max(1, math.ceil(len(steps) / max(1, budget)))
    return [steps[i] for i in range(0, len(steps), size)], size


def _busy(row: StepRow) -> float | None:
    phases = [value for _, field in PHASES[:-1] if (value := getattr(row, field)) is not None]
    return sum(phases) if phases else None


def _binned(ranks: Sequence[RankFacts], column: Mapping[int, int], width: int,
            value: Callable[[StepRow], float | None]) -> list[list[float | None]]:
    """Each rank's row of ``width`` columns, each the highest value of the steps binned into it."""
    rows = []
    for rank in ranks:
        cells: list[float | None] = [None] * width
        for row in _steps(rank):
            found = value(row)
            if found is None:
                continue
            at = column[row.step]
            current = cells[at]
            cells[at] = found if current is None else max(current, found)
        rows.append(cells)
    return rows


def heatmap(ranks: Sequence[RankFacts]) -> Heatmap | None:
    every = sorted({row.step for rank in ranks for row in _steps(rank)})
    if every:
        starts, size = _bins(every, MAX_HEATMAP_CELLS // max(1, len(ranks)))
        column = {step: index // size for index, step in enumerate(every)}
        return Heatmap(starts, _binned(ranks, column, len(starts), lambda row: row.step_seconds),
                       _binned(ranks, column, len(starts), _busy), size, "steps")
    if not any(rank.window for rank in ranks):
        return None
    first = min((rank.window.first_step for rank in ranks if rank.window), default=0)
    return Heatmap([first], [[rank.window.median("step_seconds") if rank.window else None] for rank in ranks],
                   [[rank.window.median(BUSY) if rank.window else None] for rank in ranks], 1, "window medians")


def phase_bars(ranks: Sequence[RankFacts]) -> PhaseBars | None:
    def per_rank(rank: RankFacts, field: str) -> float | None:
        rows = _steps(rank)
        if rows:
            return _median(getattr(row, field) for row in rows)
        return rank.window.median(field) if rank.window else None

    values = [[per_rank(rank, field) for rank in ranks] for _, field in PHASES]
    if not any(value is not None for row in values for value in row):
        return None
    return PhaseBars([name for name, _ in PHASES], values)


def bubble(ranks: Sequence[RankFacts], planned: float | None) -> Bubble | None:
    stages: dict[int, list[RankFacts]] = {}
    for rank in ranks:
        if rank.layout is not None and rank.layout.pp_size > 1:
            stages.setdefault(rank.layout.pp_stage, []).append(rank)
    if not stages:
        return None

    def measured(rank: RankFacts) -> list[float | None]:
        rows = _steps(rank)
        return [row.bubble_ratio for row in rows] if rows else [rank.window.bubble_ratio if rank.window else None]

    def theory(rank: RankFacts) -> list[float | None]:
        rows = _steps(rank)
        return [row.bubble_ratio_theoretical for row in rows] or [
            rank.last.bubble_ratio_theoretical if rank.last else None]

    order = sorted(stages)
    return Bubble(order, [_median(v for rank in stages[s] for v in measured(rank)) for s in order],
                  [_median(v for rank in stages[s] for v in theory(rank)) for s in order], planned)


def collectives(ranks: Sequence[RankFacts]) -> tuple[CollectiveOp, ...]:
    ops = sorted({op for rank in ranks for op in rank.collectives or {}})
    found = []
    for op in ops:
        buckets = [0] * (len(COLLECTIVE_BUCKETS) + 1)
        means: list[float | None] = []
        for rank in ranks:
            calls = (rank.collectives or {}).get(op)
            means.append(calls.seconds / calls.count if calls is not None and calls.count else None)
            for index, count in enumerate(calls.buckets or () if calls is not None else ()):
                buckets[index] += count
        typical = _median(means)
        present = [(mean, rank.rank) for mean, rank in zip(means, ranks, strict=True) if mean is not None]
        slowest = max(present) if present else None
        skew = slowest[0] / typical if slowest is not None and typical else None
        found.append(CollectiveOp(op, [*COLLECTIVE_BUCKETS, math.inf], buckets, means, skew,
                                  slowest[1] if slowest else None))
    return tuple(found)


def collective_groups(ranks: Sequence[RankFacts]) -> tuple[CollectiveGroup, ...]:
    waits = [_waits_by_group(_steps(rank)) for rank in ranks]
    found = []
    for group in sorted({name for by_group in waits for name in by_group}):
        buckets = [0] * (len(COLLECTIVE_BUCKETS) + 1)
        medians: list[float | None] = []
        for by_group in waits:
            seconds = by_group.get(group, [])
            medians.append(statistics.median(seconds) if seconds else None)
            for value in seconds:
                buckets[bucket_index(value)] += 1
        present = [(value, rank.rank) for value, rank in zip(medians, ranks, strict=True) if value is not None]
        typical = _median(medians)
        most, least = (max(present), min(present)) if present else (None, None)
        found.append(CollectiveGroup(group, [*COLLECTIVE_BUCKETS, math.inf], buckets, medians,
                                     most[0] / typical if most is not None and typical else None,
                                     most[1] if most else None, least[1] if least else None))
    return tuple(found)


def _waits_by_group(rows: Sequence[StepRow]) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for row in rows:
        for group, seconds in row.groups:
            found.setdefault(group, []).append(seconds)
    return found


def curve(name: str, field: str, unit: str, ranks: Sequence[RankFacts], planned: float | None = None) -> Curve | None:
    per_step: dict[int, list[float]] = {}
    for rank in ranks:
        for row in _steps(rank):
            value = getattr(row, field)
            if finite(value):
                per_step.setdefault(row.step, []).append(value)
    if not per_step:
        return None
    every = sorted(per_step)
    starts, size = _bins(every, MAX_CURVE_POINTS)
    median: list[float | None] = []
    low: list[float | None] = []
    high: list[float | None] = []
    for index in range(len(starts)):
        values = [v for step in every[index * size:(index + 1) * size] for v in per_step[step]]
        median.append(statistics.median(values))
        low.append(min(values))
        high.append(max(values))
    return Curve(name, unit, starts, median, low, high, planned)


def step_time_curve(ranks: Sequence[RankFacts], planned: float | None) -> Curve | None:
    return curve("step time", "step_seconds", "s", ranks, planned)


def finding_view(finding: Finding, job: str) -> FindingView:
    rule = REGISTRY.get(finding.code)  # each rule declares its view (``@rule(view=...)``)
    view = rule.view if rule is not None else "ranks"
    evidence = []
    for item in finding.evidence:
        if item.where.job not in (None, job):
            continue
        step = item.values.get("step")
        evidence.append(EvidenceView(item.text, item.where.rank, step if isinstance(step, int) else None))
    return FindingView(
        finding.code, finding.severity.label, finding.title, tuple(evidence), finding.fix, finding.reason, view,
        tuple(sorted({e.rank for e in evidence if e.rank is not None})),
        tuple(sorted({e.step for e in evidence if e.step is not None})))


def hang(ranks: Sequence[RankFacts], findings: Sequence[FindingView]) -> Hang | None:
    culprits = tuple(sorted({r for f in findings if f.view == "hang" for r in f.ranks}))
    # a rank that closed cleanly says so in a last progress record: that is no stall, unless a finding names it (its
    # process does not exit: HANG007)
    stalled = [rank for rank in ranks if (p := rank.progress) is not None
               and (p.phase != CLOSED or p.error or rank.rank in culprits)]
    if not stalled and not culprits:
        return None
    in_collective = {(rank.rank, p.collective.group, p.collective.seq)
                     for rank in stalled if (p := rank.progress) is not None and p.collective is not None}
    waits = []
    for rank in stalled:
        progress = rank.progress
        assert progress is not None
        inflight = progress.collective
        waits_for: tuple[int, ...] = ()
        if inflight is not None and inflight.members is not None:
            waits_for = tuple(member for member in inflight.members if member != rank.rank
                              and (member, inflight.group, inflight.seq) not in in_collective)
        waits.append(Wait(rank.rank, progress.step, progress.phase, progress.stalled_seconds,
                          inflight.op if inflight else None, inflight.group if inflight else None,
                          inflight.seq if inflight else None, waits_for, progress.stack_top, progress.error))
    waits.sort(key=lambda wait: (wait.rank not in culprits, wait.rank))
    return Hang(culprits, tuple(waits))


def plan_overlay(plan: Mapping[str, Any] | None, ranks: Sequence[RankFacts]) -> PlanOverlay | None:
    """The plan's prediction for the job's layout (tp, pp, dp, and micro-batches and schedule where the ranks say),
    else its fastest layout, said so on the page."""
    if not plan or not plan.get("feasible"):
        return None
    layout = next((rank.layout for rank in ranks if rank.layout is not None), None)

    def matches(entry: Mapping[str, Any]) -> bool:
        want = entry["layout"]
        if layout is None or (want["tp"], want["pp"], want["dp"]) != (layout.tp_size, layout.pp_size, layout.dp_size):
            return False
        return all(have is None or want.get(key) == have
                   for key, have in (("micro_batches", layout.micro_batches), ("schedule", layout.schedule)))

    chosen = next((entry for entry in plan["feasible"] if matches(entry)), None)
    entry = chosen or plan["feasible"][0]
    grid = entry["layout"]
    text = f"tp{grid['tp']} pp{grid['pp']} dp{grid['dp']} m{grid.get('micro_batches')} {grid.get('schedule', '')}"
    return PlanOverlay(text.strip(), chosen is not None, entry.get("step_seconds"), entry.get("bubble"),
                       (entry.get("memory") or {}).get("total"))


def build(report: Report, job: str, plan: Mapping[str, Any] | None, generated_at: float,
          sources: Iterable[str]) -> ReportModel:
    """The page of one job: its ranks in layout order, the engine's findings about it, and every view."""
    facts = report.facts
    ranks = sorted(facts.jobs()[job], key=_order)
    findings = tuple(finding_view(f, job) for f in report.findings
                     if any(e.where.job in (None, job) for e in f.evidence) or not f.evidence)
    overlay = plan_overlay(plan, ranks)
    planned: Callable[[str], float | None] = lambda key: getattr(overlay, key) if overlay else None  # noqa: E731
    curves = [step_time_curve(ranks, planned("step_seconds"))]
    curves += [curve(name, field, unit, ranks, planned("memory_bytes") if field == "memory_peak_bytes" else None)
               for name, field, unit in CURVES]
    model = ReportModel(
        job=job, jobs=tuple(facts.jobs()), sources=tuple(sources), generated_at=generated_at,
        ranks=tuple(_row(rank) for rank in ranks), findings=findings,
        not_run=tuple(f"{s.code}: {s.reason}" for s in report.skipped), notes=tuple(report.notes), missing=(),
        heatmap=heatmap(ranks), phases=phase_bars(ranks), bubble=bubble(ranks, planned("bubble")),
        collectives=collectives(ranks), groups=collective_groups(ranks),
        curves=tuple(c for c in curves if c is not None),
        hang=hang(ranks, findings), plan=overlay)
    return dataclasses.replace(model, missing=tuple(missing(model, ranks)))


def missing(model: ReportModel, ranks: Sequence[RankFacts]) -> list[str]:
    """What the page cannot show and why, a line each: the views left out say so instead of drawing nothing."""
    lines = []
    if not any(_steps(rank) for rank in ranks):
        lines.append("no per-step history: the source keeps only each rank's window (a run log has every step); "
                     "the heatmap and phases show window medians, the curves and the waits per process group are "
                     "left out")
    stepped = [rank.rank for rank in ranks if not _steps(rank) and not rank.window]
    if stepped:
        lines.append(f"ranks {rank_list(stepped)} reported no step")
    if model.bubble is None:
        lines.append("no pipeline bubble: the job has one pipeline stage, or its ranks gave no layout")
    if not model.collectives:
        lines.append("no collective timings: the ranks timed no collective calls")
    elif not any(sum(op.buckets) for op in model.collectives):  # a PromQL engine: the fetch reads count and sum
        lines.append("no collective latency buckets: the source gives each op's calls and time, not their histogram "
                     "(an agent or a run log has it); the skew per op is shown")
    have = {c.name for c in model.curves}
    absent = [name for name, _, _ in CURVES if name not in have]
    if absent and any(_steps(rank) for rank in ranks):
        lines.append(f"not reported by any rank: {', '.join(absent)}")
    return lines
