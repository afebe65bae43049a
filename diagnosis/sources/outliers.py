"""The outlier fetch of ``--prometheus``: yardsticks computed where the data is, and only what deviates fetched.

A cluster of 12,000 nodes exports millions of series; pulling them into one process to take medians does not
scale. Here the engine computes the per-job and per-stage yardsticks (medians, counts per value) and answers
*selectors*: PromQL expressions that return only the nodes or jobs where a rule could find something (ranks
busy beyond k × their stage's median, ports not ACTIVE, GPUs with Xids, links down, non-finite losses, env
values differing from the job's majority). Each answer is one row per deviating node or job, so bytes and time grow
with anomalies and jobs, not nodes. The Prometheus source then reads those nodes in full (the same reads, and so
the same Facts, as a full pull), plus one node per job so that every rule has ranks of every job to stand on.

Each rule declares in its ``@rule`` how this fetch covers it (``diagnosis/coverage.py``: the selectors, the
environment minorities, or a whole-job read), and the fetch asks what the registry's rules declare (``served``).
Every number a selector compares with is the rule's own ``Threshold`` (with ``--config`` overrides). When the
engine cannot answer a selector (a timeout, a partial answer), the rules resting on it are reported as not run
because of the source. Rules whose judgement no selector can narrow down (job-wide trends judged over every rank)
are reported as not run by this fetch, with the way to run them (``--prometheus.fetch full``).

Recording rules (``RECORDED``, shipped in ``alerts/gpuwatch.rules.yml``) precompute the yardsticks and
threshold-free per-node signals, so that with them loaded no query diagnose sends scans every rank or GPU: it reads
a few recorded series per job, and at most one per node. They are used when the engine evaluates this version of
them (``SENTINEL``), and their expressions are evaluated in the queries otherwise (same answers, more engine time).
A selector's threshold stays in the selector, never in a recording rule.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from gpuwatch.agent.collectors.infiniband import PORT_ERRORS, PORT_RATE, PORT_STATE, PORT_STATES
from gpuwatch.agent.collectors.nvlink import LINK_UP
from gpuwatch.agent.collectors.nvml import (
    CLOCK_EVENT_ACTIVE,
    ECC_VOLATILE_ERRORS,
    GPU_GAUGES,
    GPU_LOST,
    PCIE_LINK_GENERATION,
    PCIE_LINK_WIDTH,
    ROW_REMAP_FAILURE,
    ROW_REMAP_PENDING,
    XID_ERRORS,
)
from gpuwatch.agent.metricspec import by_field
from gpuwatch.agent.sampler import AGENT_INFO, COLLECTOR_UP
from gpuwatch.agent.telemetry.metrics import (
    CHECKSUM,
    COSINE,
    COUNTERS,
    ENV_INFO,
    HELLO_TIME,
    LAST_STEP,
    LATENCY,
    MEMORY_PEAK,
    PHASE,
    RANK_INFO,
    STEP_GAUGES,
    WINDOW_GAUGES,
    WINDOW_MEDIAN,
)
from gpuwatch.agent.telemetry.window import BUSY, MIN_WINDOW_STEPS, PHASE_TIMINGS
from gpuwatch.diagnosis import rules as _catalogue  # noqa: F401 - the thresholds of every rule, registered
from gpuwatch.diagnosis.coverage import (
    DECLARED,
    ENV_MINORITY,
    INSTANCE,
    RANK,
    EnvMinority,
    Selector,
    Thresholds,
    WholeJob,
)
from gpuwatch.diagnosis.facts import SLOWDOWN_REASONS, Peers, Unjudged
from gpuwatch.diagnosis.registry import REGISTRY, Rule
from gpuwatch.diagnosis.sources import WINDOW, QueryError

#: Selector queries in flight at once: enough to keep a multi-core engine busy, few enough not to crowd it.
PARALLEL_QUERIES = 4
_ACTIVE = next(code for code, name in PORT_STATES.items() if name == "ACTIVE")
#: The families below the recorded signals that their tables name by what they hold.
_WINDOW_STEPS, _BUBBLE_RATIO = by_field(WINDOW_GAUGES, "steps"), by_field(WINDOW_GAUGES, "bubble_ratio")
_LOSS, _GRAD_NORM = by_field(STEP_GAUGES, "loss"), by_field(STEP_GAUGES, "grad_norm")
_NONFINITE_STEPS, _ALLOC_RETRIES, _OOMS = (by_field(COUNTERS, field)
                                           for field in ("nonfinite_steps", "alloc_retries", "ooms"))
_GPU_MEMORY_TOTAL = by_field(GPU_GAUGES, "memory_total_bytes")


class Engine(Protocol):
    def query(self, expr: str) -> list[dict[str, Any]]: ...


def _nonfinite(name: str) -> str:
    """``name``'s series holding NaN (which differs from itself) or ±Inf (beyond any float)."""
    return f"({name} != {name} or abs({name}) > 1e308)"


#: Version of the recording rules below; ``SENTINEL`` records it, so the fetch knows the rule file it reads was
#: loaded whole (a sparse signal's empty answer then means "nothing deviates", not "not recorded").
RECORDING_RULES_VERSION = 5
SENTINEL = "gpuwatch:diagnose:recording_rules"
#: Recording rules the fetch uses when the engine evaluates them, and the expression each records (the same text as
#: in alerts/gpuwatch.rules.yml; tests/test_alerts.py holds the two equal). None holds a threshold: the yardsticks,
#: and threshold-free signals that keep only the nodes with something wrong (sparse, so that a selector reads a
#: few series instead of scanning 18 NVLinks, a dozen clock-event reasons and 8 ports per GPU or node).
RECORDED = {
    SENTINEL: f"vector({RECORDING_RULES_VERSION})",
    "gpuwatch:train_window_busy_seconds:judged":
        f'{WINDOW_MEDIAN}{{timing="{BUSY}"}} and on (instance, job, rank) '
        f"{_WINDOW_STEPS} >= {MIN_WINDOW_STEPS}",
    "gpuwatch:train_window_busy_seconds:median_by_stage":
        "quantile by (job, pp_stage) (0.5, gpuwatch:train_window_busy_seconds:judged)",
    "gpuwatch:train_window_busy_seconds:count_by_stage":
        "count by (job, pp_stage) (gpuwatch:train_window_busy_seconds:judged)",
    # Each job's least busy rank: PERF006's yardstick, one series per job.
    "gpuwatch:train_window_busy_seconds:min_by_job": "min by (job) (gpuwatch:train_window_busy_seconds:judged)",
    # Each stage's median of each phase: where a straggler's extra time is, against peers not fetched.
    "gpuwatch:train_window_phase_seconds:median_by_stage":
        f'quantile by (job, pp_stage, timing) (0.5, {WINDOW_MEDIAN}{{timing=~"{"|".join(PHASE_TIMINGS)}"}} '
        f"and on (instance, job, rank) {_WINDOW_STEPS} >= {MIN_WINDOW_STEPS})",
    "gpuwatch:train_window_step_seconds:median_by_job":
        f'quantile by (job) (0.5, {WINDOW_MEDIAN}{{timing="step_seconds"}})',
    "gpuwatch:train_rank_info:count_by_job": f"count by (job) ({RANK_INFO})",
    "gpuwatch:train_env_info:count_by_value": f"count by (job, name, value) ({ENV_INFO})",
    "gpuwatch:gpu_faulty:by_instance":
        f"group by (instance) ({GPU_LOST} == 1 or {XID_ERRORS}_total > 0"
        f' or {ECC_VOLATILE_ERRORS}_total{{error="uncorrected"}} > 0'
        f" or {ROW_REMAP_PENDING} == 1 or {ROW_REMAP_FAILURE} == 1)",
    "gpuwatch:gpu_pcie_below_max:by_instance": "group by (instance) (" + " or ".join(
        f'{link}{{kind="current"}} < ignoring (kind) {link}{{kind!="current"}}'
        for link in (PCIE_LINK_GENERATION, PCIE_LINK_WIDTH)) + ")",
    "gpuwatch:gpu_slowdown:by_instance":
        f'group by (instance) ({CLOCK_EVENT_ACTIVE}{{reason=~"{"|".join(SLOWDOWN_REASONS)}"}} == 1)',
    "gpuwatch:nvlink_down:by_instance": f"group by (instance) ({LINK_UP} == 0)",
    "gpuwatch:collector_down:by_instance": f"group by (instance) ({COLLECTOR_UP} != 1)",
    # Peers of a port are those of the same HCA model and link layer on its node (HW003); this keeps only the
    # link layer, so a frontend NIC down beside running backend ports is fetched and HW003 then judges it.
    "gpuwatch:ib_port_unhealthy:by_instance":
        f"group by (instance) (({PORT_STATE} != {_ACTIVE} and on (instance, link_layer) "
        f"{PORT_STATE} == {_ACTIVE})"
        f" or {PORT_RATE} < on (instance, link_layer) group_left () "
        f"max by (instance, link_layer) ({PORT_RATE})"
        f" or increase({PORT_ERRORS}_total[{WINDOW}]) > 0)",
    "gpuwatch:train_nonfinite:by_instance":
        f"group by (instance) ({_nonfinite(_LOSS.name)} or {_nonfinite(_GRAD_NORM.name)}"
        f" or {_NONFINITE_STEPS}_total > 0)",
    "gpuwatch:train_alloc_trouble:by_instance":
        f"group by (instance) ({_ALLOC_RETRIES}_total > 0 or {_OOMS}_total > 0)",
    # Each node's largest per-rank figure that a rule compares with a threshold: one series per node, so that the
    # selector (which holds the threshold) reads a node's worth of samples, not a rank's or a histogram's.
    "gpuwatch:train_busy_over_stage_median:max_by_instance":
        "max by (instance) (gpuwatch:train_window_busy_seconds:judged / on (job, pp_stage) group_left () "
        "gpuwatch:train_window_busy_seconds:median_by_stage)",
    "gpuwatch:train_input_wait_share:max_by_instance":
        f'max by (instance) ({WINDOW_MEDIAN}{{timing="dataloader_wait_seconds"}} / ignoring (timing) '
        f'{WINDOW_MEDIAN}{{timing="step_seconds"}})',
    "gpuwatch:train_cuda_peak_share:max_by_instance":
        f'max by (instance) ({MEMORY_PEAK}{{kind="cuda"}} / on (instance) group_left () '
        f"min by (instance) ({_GPU_MEMORY_TOTAL}))",
    "gpuwatch:train_collective_tail:max_by_job":
        f"max by (job) (histogram_quantile(0.99, {LATENCY}_bucket)"
        f" / histogram_quantile(0.5, {LATENCY}_bucket))",
    "gpuwatch:train_grad_cosine:max_by_instance": f"max by (instance) ({COSINE})",
    "gpuwatch:train_grad_norm:max_by_instance": f"max by (instance) ({_GRAD_NORM})",
    # Per job: one of its ranks (its node is read in detail, so that every job has ranks to judge), and per shard
    # (tensor rank × stage) how many distinct parameter checksums its data-parallel replicas hold.
    "gpuwatch:train_rank_info:one_by_job": f"bottomk by (job) (1, {RANK_INFO})",
    "gpuwatch:train_param_checksum:distinct_by_shard":
        "count by (job, tp_rank, pp_stage) (count_values by (job, tp_rank, pp_stage) "
        f'("checksum", {CHECKSUM}))',
    # What the whole-job selectors compare, one series per job (they read no rank's series): each job's median
    # pipeline bubble, the earliest hello of its ranks that reported no step (the selector holds the age), and
    # whether one of those closed its hooks.
    "gpuwatch:train_window_bubble_ratio:median_by_job": f"quantile by (job) (0.5, {_BUBBLE_RATIO})",
    "gpuwatch:train_hello_without_step:min_by_job": f"min by (job) ({HELLO_TIME} unless on ({RANK}) {LAST_STEP})",
    "gpuwatch:train_closed_without_step:by_job":
        f'group by (job) ({PHASE}{{phase="closed"}} unless on ({RANK}) {LAST_STEP})',
}
@dataclasses.dataclass(frozen=True)
class Served:
    """What the outlier fetch asks for the rules of a registry, from the coverage each rule declares."""

    #: each selector and the rules resting on it, in the order they are asked: ``coverage.DECLARED``'s, then any
    #: other in the order of the rules declaring them
    selectors: dict[Selector, tuple[str, ...]]
    #: the rules not run by this fetch, and why
    whole_job: dict[str, str]
    #: the rules resting on the environment minorities' nodes
    env_minority: tuple[str, ...]


def served(registry: Mapping[str, Rule]) -> Served:
    """Which selectors ``registry``'s rules rest on, which need their jobs whole, which the environment minorities:
    read from the registry at each fetch, so that a rule registered with a selector of its own is served by it."""
    selectors: dict[Selector, list[str]] = collections.defaultdict(list)
    whole_job: dict[str, str] = {}
    env_minority: list[str] = []
    for code, entry in registry.items():
        for part in entry.coverage:
            if isinstance(part, WholeJob):
                whole_job[code] = part.why
            elif isinstance(part, EnvMinority):
                env_minority.append(code)
            else:
                selectors[part].append(code)
    position = {selector: index for index, selector in enumerate(DECLARED)}
    ordered = sorted(selectors, key=lambda selector: position.get(selector, len(DECLARED)))
    return Served({selector: tuple(selectors[selector]) for selector in ordered}, whole_job, tuple(env_minority))


@dataclasses.dataclass
class Plan:
    """What an outlier fetch reads in detail, and what it learnt on the way."""

    instances: set[str] = dataclasses.field(default_factory=set)
    peers: dict[tuple[str, int | None, str], Peers] = dataclasses.field(default_factory=dict)
    unjudged: dict[str, Unjudged] = dataclasses.field(default_factory=dict)
    #: why each instance is read, for the report's note
    reasons: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def add(self, instances: Iterable[str], why: str) -> None:
        new = set(instances) - self.instances
        self.instances |= new
        if new:
            self.reasons[why] += len(new)

    def describe(self) -> str:
        return "; ".join(f"{count} for {why}" for why, count in self.reasons.items()) or "nothing deviates"

    def fail(self, rules: Iterable[str], what: str, error: QueryError) -> None:
        for code in rules:
            self.unjudged.setdefault(code, Unjudged(f"the outlier query for {what} failed: {error}", source=True))


def _thresholds(overrides: Mapping[str, Mapping[str, float]]) -> Thresholds:
    return lambda code: REGISTRY[code].params(overrides.get(code))


def _matcher(values: Iterable[str]) -> str:
    """An RE2 alternation matching exactly ``values``."""
    special = set("\\.+*?()|[]{}^$")
    return "|".join("".join("\\" + c if c in special else c for c in value) for value in sorted(values))


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def instance_matcher(instances: Iterable[str]) -> str:
    """The label matcher that scopes the detailed reads to ``instances``."""
    return f"instance=~{_quoted(_matcher(instances))}"


def _jobs(jobs: Iterable[str]) -> str:
    return f"job=~{_quoted(_matcher(jobs))}"


def selector_query(selector: Selector, t: Thresholds, yardsticks: Mapping[str, str]) -> str:
    """The query that asks ``selector``: one row per node or job it picks."""
    return f"group by ({selector.by}) ({selector.expr(t, yardsticks)})"


def plan(engine: Engine, overrides: Mapping[str, Mapping[str, float]]) -> Plan:
    """Ask the engine which nodes deviate, which jobs need reading whole, and the yardsticks of the rest."""
    result = Plan()
    rules = served(REGISTRY)
    for code, why in rules.whole_job.items():
        result.unjudged[code] = Unjudged(f"the outlier fetch does not read every rank ({why}): use "
                                         "--prometheus.fetch full", source=False)
    yardsticks = _yardsticks(engine)
    t = _thresholds(overrides)
    whole_jobs: set[str] = set()

    def ask(selector: Selector) -> list[dict[str, Any]] | QueryError:
        try:
            return engine.query(selector_query(selector, t, yardsticks))
        except QueryError as exc:
            return exc

    # The selectors are independent: an engine evaluates them side by side (each over whole families), so they
    # are sent together, a few at a time, and read in order.
    with concurrent.futures.ThreadPoolExecutor(PARALLEL_QUERIES) as pool:
        answers = list(pool.map(ask, rules.selectors))
    for (selector, codes), rows in zip(rules.selectors.items(), answers, strict=True):
        if isinstance(rows, QueryError):
            result.fail(codes, selector.what, rows)
            continue
        if selector.by == INSTANCE:
            result.add((row["metric"].get("instance", "") for row in rows), selector.what)
        else:
            whole_jobs |= {row["metric"].get("job", "") for row in rows}
    _env_minorities(engine, yardsticks, rules.env_minority, result)
    _stage_peers(engine, yardsticks, result)
    try:
        if whole_jobs:
            rows = engine.query(f"group by (instance) ({RANK_INFO}{{{_jobs(whole_jobs)}}})")
            result.add((row["metric"]["instance"] for row in rows), "jobs read whole")
        # One node per job (and one node at all), so that every rule has each job's ranks and a node to stand on.
        rows = engine.query(f'{yardsticks["gpuwatch:train_rank_info:one_by_job"]} or bottomk (1, {AGENT_INFO})')
        result.add((row["metric"]["instance"] for row in rows), "one node per job")
    except QueryError as exc:
        result.fail(REGISTRY, "the jobs' nodes", exc)
    return result


def _yardsticks(engine: Engine) -> dict[str, str]:
    """Each recorded expression by its name: the recording rule where the engine evaluates this version of them
    (``SENTINEL``), else the expression it records (with the recording rules it reads resolved the same way)."""
    try:
        recorded = any(float(row["value"][1]) >= RECORDING_RULES_VERSION for row in engine.query(SENTINEL))
    except QueryError:
        recorded = False

    def resolve(name: str) -> str:
        if recorded:
            return name
        expr = RECORDED[name]
        for other in RECORDED:
            if other != name and other in expr:
                expr = expr.replace(other, resolve(other))
        return f"({expr})"

    return {name: resolve(name) for name in RECORDED}


def _env_minorities(engine: Engine, y: Mapping[str, str], rules: Iterable[str], result: Plan) -> None:
    """Nodes of ranks whose exported environment differs from their job's majority (a variable unset counts as a
    value): from the counts per value, one row per job, variable and value. A setting the whole job shares is seen
    on the one node per job read in detail."""
    try:
        ranks = {row["metric"].get("job", ""): int(float(row["value"][1]))
                 for row in engine.query(y["gpuwatch:train_rank_info:count_by_job"])}
        counts: dict[tuple[str, str], dict[str | None, int]] = collections.defaultdict(dict)
        for row in engine.query(y["gpuwatch:train_env_info:count_by_value"]):
            labels = row["metric"]
            counts[labels.get("job", ""), labels["name"]][labels.get("value", "")] = int(float(row["value"][1]))
        selectors = []
        for (job, name), values in counts.items():
            unset = ranks.get(job, 0) - sum(values.values())
            if unset > 0:
                values[None] = unset
            majority = max(values.values())
            for value, count in values.items():
                if count == majority and list(values.values()).count(majority) == 1:
                    continue  # the job's majority: a rank with it reads like its peers
                variable = f"{ENV_INFO}{{{_jobs([job])}, name={_quoted(name)}"
                selectors.append(f"({RANK_INFO}{{{_jobs([job])}}} unless on ({RANK}) {variable}}})"
                                 if value is None else f"{variable}, value={_quoted(value)}}}")
        if selectors:
            rows = engine.query(f"group by (instance) ({' or '.join(selectors)})")
            result.add((row["metric"]["instance"] for row in rows), "environments differing from their job's")
    except QueryError as exc:
        result.fail(rules, ENV_MINORITY.what, exc)


def _stage_peers(engine: Engine, y: Mapping[str, str], result: Plan) -> None:
    """Each (job, stage)'s median busy time and of each phase, with how many ranks it is over (a phase's counted as
    its busy time's: every rank reports the phases its busy time is the sum of), and each job's median step: PERF002's
    yardsticks for the ranks it has without their peers."""
    try:
        counts = {(row["metric"].get("job", ""), row["metric"].get("pp_stage")): int(float(row["value"][1]))
                  for row in engine.query(y["gpuwatch:train_window_busy_seconds:count_by_stage"])}
        medians = [(row, BUSY) for row in engine.query(y["gpuwatch:train_window_busy_seconds:median_by_stage"])]
        medians += [(row, row["metric"].get("timing", ""))
                    for row in engine.query(y["gpuwatch:train_window_phase_seconds:median_by_stage"])]
        for row, timing in medians:
            job, stage = row["metric"].get("job", ""), row["metric"].get("pp_stage")
            result.peers[job, int(stage) if stage else None, timing] = Peers(
                float(row["value"][1]), counts.get((job, stage), 0))
        for row in engine.query(y["gpuwatch:train_window_step_seconds:median_by_job"]):
            job = row["metric"].get("job", "")
            result.peers[job, None, "step_seconds"] = Peers(float(row["value"][1]), sum(
                count for (name, _), count in counts.items() if name == job))
    except QueryError as exc:
        result.fail(("PERF002",), "the stages' median busy and phase times", exc)
