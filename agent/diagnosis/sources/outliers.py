"""The outlier fetch of ``--prometheus``: yardsticks computed where the data is, and only what deviates fetched.

A cluster of 12,000 nodes exports millions of series; pulling them into one process to take medians does not
scale. Here the engine computes the per-job and per-stage yardsticks (medians, counts per value) and answers
*selectors*: PromQL expressions that return only the nodes or jobs where a rule could find something (ranks
busy beyond k × their stage's median, ports not ACTIVE, GPUs with Xids, links down, non-finite losses, env
values differing from the job's majority). Each answer is one row per deviating node or job, so bytes and time grow
with anomalies and jobs, not nodes. The Prometheus source then reads those nodes in full (the same reads, and so
the same Facts, as a full pull), plus one node per job so that every rule has ranks of every job to stand on.

Every number a selector compares with is the rule's own ``Threshold`` (with ``--config`` overrides): a selector is
a superset of what its rule flags, never a second copy of its judgement. A selector names the rules resting on it;
when the engine cannot answer it (a timeout, a partial answer), those rules are reported as not run because of the
source. Rules whose judgement no selector can narrow down (job-wide trends judged over every rank) are reported
as not run by this fetch, with the way to run them (``--prometheus.fetch full``).

Recording rules (``RECORDED``, shipped in ``alerts/gpuwatch.rules.yml``) precompute the yardsticks and
threshold-free per-node signals, so that with them loaded no query diagnose sends scans every rank or GPU: it reads
a few recorded series per job, and at most one per node. They are used when the engine evaluates this version of
them (``SENTINEL``), and their expressions are evaluated in the queries otherwise (same answers, more engine time).
A selector's threshold stays in the selector, never in a recording rule.

Where a selector is a superset: HW003's peers are narrowed to the link layer (not the HCA model); PERF002's ratio
is the smaller of its two (a CPU job's larger one is the rule's to apply); HANG002's mismatch is fetched through
the ranks it leaves overdue; CONV003's checksums through any shard whose replicas disagree, at whatever step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from gpuwatch.agent.collectors.infiniband import PORT_STATES
from gpuwatch.agent.diagnosis import rules as _catalogue  # noqa: F401 - the thresholds of every rule, registered
from gpuwatch.agent.diagnosis.facts import SLOWDOWN_REASONS, Peers, Unjudged
from gpuwatch.agent.diagnosis.registry import REGISTRY
from gpuwatch.agent.diagnosis.sources import WINDOW, QueryError
from gpuwatch.agent.telemetry.metrics import (
    EXITED,
    HELLO_TIME,
    LAST_STEP,
    PHASE,
    RAISED,
    STALLED,
    WINDOW_MEDIAN,
)
from gpuwatch.agent.telemetry.window import BUSY, MIN_WINDOW_STEPS, PHASE_TIMINGS

#: Selector queries in flight at once: enough to keep a multi-core engine busy, few enough not to crowd it.
PARALLEL_QUERIES = 4
_ACTIVE = next(code for code, name in PORT_STATES.items() if name == "ACTIVE")
#: A rank's identity in its series. Like the alerts, the outlier fetch reads the training job from ``job``: the
#: agents are scraped with ``honor_labels: true`` (alerts/gpuwatch.rules.yml says why).
_RANK = "instance, job, rank"
_JOB = "job"


class Engine(Protocol):
    def query(self, expr: str) -> list[dict[str, Any]]: ...


def _nonfinite(name: str) -> str:
    """``name``'s series holding NaN (which differs from itself) or ±Inf (beyond any float)."""
    return f"({name} != {name} or abs({name}) > 1e308)"


#: Version of the recording rules below; ``SENTINEL`` records it, so the fetch knows the rule file it reads was
#: loaded whole (a sparse signal's empty answer then means "nothing deviates", not "not recorded").
RECORDING_RULES_VERSION = 4
SENTINEL = "gpuwatch:diagnose:recording_rules"
#: Recording rules the fetch uses when the engine evaluates them, and the expression each records (the same text as
#: in alerts/gpuwatch.rules.yml; tests/test_alerts.py holds the two equal). None holds a threshold: the yardsticks,
#: and threshold-free signals that keep only the nodes with something wrong (sparse, so that a selector reads a
#: few series instead of scanning 18 NVLinks, a dozen clock-event reasons and 8 ports per GPU or node).
RECORDED = {
    SENTINEL: f"vector({RECORDING_RULES_VERSION})",
    "gpuwatch:train_window_busy_seconds:judged":
        f'{WINDOW_MEDIAN}{{timing="{BUSY}"}} and on (instance, job, rank) '
        f"gpuwatch_train_window_steps >= {MIN_WINDOW_STEPS}",
    "gpuwatch:train_window_busy_seconds:median_by_stage":
        "quantile by (job, pp_stage) (0.5, gpuwatch:train_window_busy_seconds:judged)",
    "gpuwatch:train_window_busy_seconds:count_by_stage":
        "count by (job, pp_stage) (gpuwatch:train_window_busy_seconds:judged)",
    # Each stage's median of each phase: where a straggler's extra time is, against peers not fetched.
    "gpuwatch:train_window_phase_seconds:median_by_stage":
        f'quantile by (job, pp_stage, timing) (0.5, {WINDOW_MEDIAN}{{timing=~"{"|".join(PHASE_TIMINGS)}"}} '
        f"and on (instance, job, rank) gpuwatch_train_window_steps >= {MIN_WINDOW_STEPS})",
    "gpuwatch:train_window_step_seconds:median_by_job":
        f'quantile by (job) (0.5, {WINDOW_MEDIAN}{{timing="step_seconds"}})',
    "gpuwatch:train_rank_info:count_by_job": "count by (job) (gpuwatch_train_rank_info)",
    "gpuwatch:train_env_info:count_by_value": "count by (job, name, value) (gpuwatch_train_env_info)",
    "gpuwatch:gpu_faulty:by_instance":
        "group by (instance) (gpuwatch_gpu_lost == 1 or gpuwatch_gpu_xid_errors_total > 0"
        ' or gpuwatch_gpu_ecc_volatile_errors_total{error="uncorrected"} > 0'
        " or gpuwatch_gpu_row_remap_pending == 1 or gpuwatch_gpu_row_remap_failure == 1)",
    "gpuwatch:gpu_pcie_below_max:by_instance": "group by (instance) (" + " or ".join(
        f'gpuwatch_gpu_pcie_link_{q}{{kind="current"}} < ignoring (kind) gpuwatch_gpu_pcie_link_{q}{{kind!="current"}}'
        for q in ("generation", "width")) + ")",
    "gpuwatch:gpu_slowdown:by_instance":
        f'group by (instance) (gpuwatch_gpu_clock_event_active{{reason=~"{"|".join(SLOWDOWN_REASONS)}"}} == 1)',
    "gpuwatch:nvlink_down:by_instance": "group by (instance) (gpuwatch_nvlink_up == 0)",
    # Peers of a port are those of the same HCA model and link layer on its node (HW003); this keeps only the
    # link layer, so a frontend NIC down beside running backend ports is fetched and HW003 then judges it.
    "gpuwatch:ib_port_unhealthy:by_instance":
        f"group by (instance) ((gpuwatch_ib_port_state_id != {_ACTIVE} and on (instance, link_layer) "
        f"gpuwatch_ib_port_state_id == {_ACTIVE})"
        " or gpuwatch_ib_port_rate_bytes_per_second < on (instance, link_layer) group_left () "
        "max by (instance, link_layer) (gpuwatch_ib_port_rate_bytes_per_second)"
        f" or increase(gpuwatch_ib_port_errors_total[{WINDOW}]) > 0)",
    "gpuwatch:train_nonfinite:by_instance":
        f"group by (instance) ({_nonfinite('gpuwatch_train_loss')} or {_nonfinite('gpuwatch_train_grad_norm')}"
        " or gpuwatch_train_nonfinite_steps_total > 0)",
    "gpuwatch:train_alloc_trouble:by_instance":
        "group by (instance) (gpuwatch_train_alloc_retries_total > 0 or gpuwatch_train_ooms_total > 0)",
    # Each node's largest per-rank figure that a rule compares with a threshold: one series per node, so that the
    # selector (which holds the threshold) reads a node's worth of samples, not a rank's or a histogram's.
    "gpuwatch:train_busy_over_stage_median:max_by_instance":
        "max by (instance) (gpuwatch:train_window_busy_seconds:judged / on (job, pp_stage) group_left () "
        "gpuwatch:train_window_busy_seconds:median_by_stage)",
    "gpuwatch:train_input_wait_share:max_by_instance":
        f'max by (instance) ({WINDOW_MEDIAN}{{timing="dataloader_wait_seconds"}} / ignoring (timing) '
        f'{WINDOW_MEDIAN}{{timing="step_seconds"}})',
    "gpuwatch:train_cuda_peak_share:max_by_instance":
        'max by (instance) (gpuwatch_train_memory_peak_bytes{kind="cuda"} / on (instance) group_left () '
        "min by (instance) (gpuwatch_gpu_memory_total_bytes))",
    "gpuwatch:train_collective_tail:max_by_job":
        "max by (job) (histogram_quantile(0.99, gpuwatch_train_collective_seconds_bucket)"
        " / histogram_quantile(0.5, gpuwatch_train_collective_seconds_bucket))",
    "gpuwatch:train_grad_cosine:max_by_instance": "max by (instance) (gpuwatch_train_grad_cosine_similarity)",
    "gpuwatch:train_grad_norm:max_by_instance": "max by (instance) (gpuwatch_train_grad_norm)",
    # Per job: one of its ranks (its node is read in detail, so that every job has ranks to judge), and per shard
    # (tensor rank × stage) how many distinct parameter checksums its data-parallel replicas hold.
    "gpuwatch:train_rank_info:one_by_job": "bottomk by (job) (1, gpuwatch_train_rank_info)",
    "gpuwatch:train_param_checksum:distinct_by_shard":
        "count by (job, tp_rank, pp_stage) (count_values by (job, tp_rank, pp_stage) "
        '("checksum", gpuwatch_train_param_checksum))',
}
#: Rules no selector narrows down: they judge a trend or a spread over every rank of a job.
WHOLE_JOB_RULES = {
    "PERF004": "it splits each job's exposed collective time over all its ranks",
    "MEM003": "it reads every rank's host-memory history",
    "CONV005": "it averages gradient agreement over every rank of a job",
    "CONV006": "it judges the spread of losses over every rank of a job",
    "TOPO001": "it compares the process groups of every rank of a job",
    "TOPO002": "it compares the placement of every rank of a job",
}


@dataclasses.dataclass(frozen=True)
class Selector:
    """A PromQL expression answering one row per node (``by = "instance"``) or job (``by = _JOB``) where the
    ``rules`` could find something; built from the rules' thresholds (``t(code)``) and the yardsticks (``y``)."""

    what: str
    rules: tuple[str, ...]
    expr: Callable[[Callable[[str], types.SimpleNamespace], Mapping[str, str]], str]
    by: str = "instance"


SELECTORS = (
    Selector("GPUs lost, with Xids, uncorrectable ECC errors or pending row remaps", ("HW004",),
             lambda t, y: y["gpuwatch:gpu_faulty:by_instance"]),
    Selector("PCIe links below their maximum", ("HW002",), lambda t, y: y["gpuwatch:gpu_pcie_below_max:by_instance"]),
    Selector("GPUs slowing themselves down", ("HW005",), lambda t, y: y["gpuwatch:gpu_slowdown:by_instance"]),
    Selector("NVLink links down", ("HW001",), lambda t, y: y["gpuwatch:nvlink_down:by_instance"]),
    Selector("collectors down", ("HW001", "HW002", "HW003", "HW004", "HW005"),
             lambda t, y: "gpuwatch_collector_up != 1"),
    Selector("InfiniBand/RoCE ports not ACTIVE beside an ACTIVE peer, slower than the node's fastest, or erring",
             ("HW003", "NCCL001", "NCCL002"), lambda t, y: y["gpuwatch:ib_port_unhealthy:by_instance"]),
    Selector("ranks with a non-finite loss or gradient norm, or an exploding one", ("CONV001", "CONV002"),
             lambda t, y: f'{y["gpuwatch:train_nonfinite:by_instance"]} or '
                          f'{y["gpuwatch:train_grad_norm:max_by_instance"]} > {t("CONV002").max_grad_norm:g}'),
    Selector("ranks that retried allocations or ran out of memory, or peak near their GPU's capacity",
             ("MEM001", "MEM002"), lambda t, y: (
                 f'{y["gpuwatch:train_alloc_trouble:by_instance"]} or '
                 f'{y["gpuwatch:train_cuda_peak_share:max_by_instance"]} > {t("MEM002").max_peak_share:g}')),
    Selector("ranks busy beyond k × their stage's median", ("PERF002",), lambda t, y: (
        f'{y["gpuwatch:train_busy_over_stage_median:max_by_instance"]} > '
        f"{min(t('PERF002').straggler_ratio, t('PERF002').shared_cpu_ratio):g}")),
    Selector("ranks waiting on input for a large share of their step", ("PERF003",), lambda t, y: (
        f'{y["gpuwatch:train_input_wait_share:max_by_instance"]} > {t("PERF003").max_wait_share:g}')),
    Selector("jobs with a heavy collective latency tail (read whole: a tail on some ranks only is a wait on the "
             "others)", ("NCCL005",), lambda t, y: (
                 f'{y["gpuwatch:train_collective_tail:max_by_job"]} > {t("NCCL005").tail_ratio:g}'), by=_JOB),
    Selector("ranks that name NCCL's socket interface", ("NCCL003",),
             lambda t, y: 'gpuwatch_train_env_info{name="NCCL_SOCKET_IFNAME"}'),
    Selector("ranks with gradients too alike across data-parallel replicas", ("CONV004",), lambda t, y: (
        f'{y["gpuwatch:train_grad_cosine:max_by_instance"]} > {t("CONV004").min_cosine:g}')),
    Selector("jobs with an overdue, dead or failed rank", ("HANG001", "HANG002", "HANG003", "HANG004"),
             lambda t, y: f"{STALLED} or {EXITED} or {RAISED}", by=_JOB),
    Selector("jobs with ranks that said hello long ago, or ended, and reported no step", ("HANG005",), lambda t, y: (
        f'(time() - {HELLO_TIME} >= {t("HANG005").min_age_seconds:g} or {PHASE}{{phase="closed"}}) '
        f"unless on ({_RANK}) {LAST_STEP.name}"), by=_JOB),
    Selector("jobs whose replicas of one shard hold different parameter checksums", ("CONV003",), lambda t, y: (
        f'{y["gpuwatch:train_param_checksum:distinct_by_shard"]} > 1'), by=_JOB),
    Selector("jobs whose median pipeline bubble is high", ("PERF001",), lambda t, y: (
        f"quantile by (job) (0.5, gpuwatch_train_window_bubble_ratio) "
        f"> {t('PERF001').max_bubble_ratio:g}"), by=_JOB),
    Selector("nodes that ran an interconnect probe", ("PERF005",), lambda t, y: "gpuwatch_probe_info"),
)


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


def _thresholds(overrides: Mapping[str, Mapping[str, float]]) -> Callable[[str], types.SimpleNamespace]:
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


def plan(engine: Engine, overrides: Mapping[str, Mapping[str, float]]) -> Plan:
    """Ask the engine which nodes deviate, which jobs need reading whole, and the yardsticks of the rest."""
    result = Plan()
    for code, why in WHOLE_JOB_RULES.items():
        if code in REGISTRY:
            result.unjudged[code] = Unjudged(f"the outlier fetch does not read every rank ({why}): use "
                                             "--prometheus.fetch full", source=False)
    for code in uncovered(REGISTRY):
        result.unjudged[code] = Unjudged("no outlier selector covers it, so the outlier fetch would judge it on some "
                                         "nodes only: use --prometheus.fetch full", source=False)
    yardsticks = _yardsticks(engine)
    t = _thresholds(overrides)
    whole_jobs: set[str] = set()

    def ask(selector: Selector) -> list[dict[str, Any]] | QueryError:
        try:
            return engine.query(f"group by ({selector.by}) ({selector.expr(t, yardsticks)})")
        except QueryError as exc:
            return exc

    # The selectors are independent: an engine evaluates them side by side (each over whole families), so they
    # are sent together, a few at a time, and read in order.
    with concurrent.futures.ThreadPoolExecutor(PARALLEL_QUERIES) as pool:
        answers = list(pool.map(ask, SELECTORS))
    for selector, rows in zip(SELECTORS, answers, strict=True):
        if isinstance(rows, QueryError):
            result.fail(selector.rules, selector.what, rows)
            continue
        if selector.by == "instance":
            result.add((row["metric"].get("instance", "") for row in rows), selector.what)
        else:
            whole_jobs |= {row["metric"].get("job", "") for row in rows}
    _env_minorities(engine, yardsticks, result)
    _stage_peers(engine, yardsticks, result)
    try:
        if whole_jobs:
            rows = engine.query(f"group by (instance) (gpuwatch_train_rank_info{{{_jobs(whole_jobs)}}})")
            result.add((row["metric"]["instance"] for row in rows), "jobs read whole")
        # One node per job (and one node at all), so that every rule has each job's ranks and a node to stand on.
        rows = engine.query(f'{yardsticks["gpuwatch:train_rank_info:one_by_job"]} or bottomk (1, gpuwatch_agent_info)')
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


#: The rules whose nodes the environment's minorities select (`_env_minorities`): a setting the whole job shares is
#: seen on the one node per job read in detail.
ENV_MINORITY_RULES = ("NCCL001", "NCCL002", "NCCL004", "MEM001")


def uncovered(codes: Iterable[str]) -> list[str]:
    """The rules among `codes` that no outlier selector, whole-job read or environment minority covers: judged on the
    nodes read in detail only, they could miss what the others show, so the outlier fetch does not run them."""
    covered = {code for selector in SELECTORS for code in selector.rules} | set(WHOLE_JOB_RULES)
    return [code for code in codes if code not in covered | set(ENV_MINORITY_RULES)]


def _env_minorities(engine: Engine, y: Mapping[str, str], result: Plan) -> None:
    """Nodes of ranks whose exported environment differs from their job's majority (a variable unset counts as a
    value): from the counts per value, one row per job, variable and value."""
    rules = ENV_MINORITY_RULES
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
                variable = f"gpuwatch_train_env_info{{{_jobs([job])}, name={_quoted(name)}"
                selectors.append(f"(gpuwatch_train_rank_info{{{_jobs([job])}}} unless on ({_RANK}) {variable}}})"
                                 if value is None else f"{variable}, value={_quoted(value)}}}")
        if selectors:
            rows = engine.query(f"group by (instance) ({' or '.join(selectors)})")
            result.add((row["metric"]["instance"] for row in rows), "environments differing from their job's")
    except QueryError as exc:
        result.fail(rules, "environments differing from their job's majority", exc)


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
