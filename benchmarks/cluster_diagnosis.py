"""Cluster-scale diagnosis: ``gpuwatch diagnose --prometheus`` over 64 … 1,024 simulated 8-GPU nodes.

Why this shape: diagnosis must answer within seconds for a whole cluster, and its Prometheus source sends a fixed
handful of whole-family queries, so its cost should grow with the number of series, not with round trips. To
measure that against a real Prometheus without 1,024 agents, one real agent (``--simulate dgx-h100``, 8 ranks
reporting through the real telemetry socket) is scraped once; its exposition is the per-node template, replicated
with each node's ``instance``/``node``/rank labels into OpenMetrics, backfilled with ``promtool tsdb
create-blocks-from openmetrics`` and served by a real ``prometheus``. The series names are therefore exactly the
agent's. Only families the Prometheus source reads are kept (every query selects by metric name, so the others
would cost disk, not query time).

Planted faults, and whether Prometheus can show them:

* a straggler node (all 8 ranks compute 2× the median, and are busy 2×) → PERF002
* a down InfiniBand port (mlx5_3/1 DOWN, Disabled)       → HW003
* a NaN rank (loss NaN, non-finite steps counted)         → CONV001
* a fragmented rank (reserved ≫ allocated, alloc retries) → MEM001
* NCCL_IB_DISABLE=1 on some nodes' ranks                 → NCCL001 on those nodes: the agent exports the part of
  the ranks' environment that rules read as ``gpuwatch_train_env_info{name, value}`` (the template's ranks run
  with NCCL_IB_DISABLE=0, the planted nodes' with 1).

The backfilled samples end when the file is written, so the server runs with ``--query.lookback-delta=2h``: the
source's instant queries carry no ``time`` parameter (they ask for "now"), and the default 5 m lookback would
expire the data while a large backfill is still running. Nodes are backfilled a chunk at a time, each chunk's samples
``CHUNK_SPACING_S`` earlier than the one before: blocks that overlap in time would be merged by Prometheus in the
background (a vertical compaction of every series, minutes long at 4,096 nodes) while the diagnoses run, and
``--storage.tsdb.max-block-duration=2h`` leaves the disjoint ones as they are. Each query of the outlier fetch is
then run once more, alone, with the engine's own statistics (``stats=all``: samples touched), and their growth from
the smallest cluster printed beside the cluster's.

    python benchmarks/cluster_diagnosis.py [--nodes 64,256,1024,4096] [--repeat 3] [--full-up-to 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _harness import free_port, get, load_average, machine, running, wait_until
from telemetry_records import collectives, hello, step

from gpuwatch.agent.telemetry.window import BUSY, MIN_WINDOW_STEPS
from gpuwatch.diagnosis.sources import prometheus
from gpuwatch.trainer.telemetry import TelemetryClient

GPUS = 8
JOB = "llm-pretrain"
LOOKBACK = "2h"
RULES = Path(__file__).resolve().parent.parent / "alerts" / "gpuwatch.rules.yml"
#: Nodes backfilled at a time: promtool's memory grows with the series of one run (about 4 GB per 1,024 nodes).
BACKFILL_CHUNK = 1024
#: Seconds between the samples of one chunk of nodes and the next: their blocks then never overlap in time.
CHUNK_SPACING_S = 90
#: The engine's work per query (``stats=all`` on /api/v1/query): samples read from storage (and from recorded series)
#: while evaluating it.
SAMPLES = "totalQueryableSamples"
#: Families the Prometheus source of ``gpuwatch diagnose`` queries (diagnosis/sources/prometheus.py).
READ_BY_DIAGNOSE = re.compile(
    r"gpuwatch_(agent_info|collector_up|gpu_(info|lost|job_info|pcie_link_(generation|width)|row_remap_(pending|failure)"
    r"|utilization_ratio|sm_active_ratio|memory_(total|used)_bytes|temperature_celsius|power_watts|sm_clock_hertz"
    r"|clock_event_active|xid_errors_total|ecc_volatile_errors_total)"
    r"|nvlink_(up|speed_bytes_per_second)"
    r"|ib_(device_info|port_(up|rate_bytes_per_second|state_id|physical_state_id|errors_total))"
    r"|train_.*|probe_.*)")
HEALTHY_MEMORY = {"kind": "cuda", "peak_bytes": 30 << 30, "allocated_bytes": 24 << 30, "reserved_bytes": 26 << 30,
                  "inactive_split_bytes": 64 << 20, "alloc_retries": 0, "ooms": 0}
_SAMPLE = re.compile(r'^(\w+)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Series:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


@dataclass(frozen=True)
class Plan:
    """Where the faults go in a cluster of ``nodes`` (spread out, never on the same node)."""

    nodes: int

    def __post_init__(self) -> None:
        if self.nodes < 16:
            raise ValueError("the planted faults need at least 16 nodes to land on distinct nodes")

    @property
    def straggler_node(self) -> int:
        return self.nodes - 3

    @property
    def ib_down_node(self) -> int:
        return 7

    @property
    def nan_rank(self) -> int:
        return self.nodes // 3 * GPUS + 5

    @property
    def fragmented_rank(self) -> int:
        return self.nodes // 4 * GPUS + 2

    @property
    def ib_disabled_nodes(self) -> tuple[int, ...]:
        return 1, self.nodes - 1

    def expected(self) -> set[tuple[str, str]]:
        """(rule, node) pairs diagnosis must report, no more and no fewer."""
        return {("PERF002", node_name(self.straggler_node)), ("HW003", node_name(self.ib_down_node)),
                ("CONV001", node_name(self.nan_rank // GPUS)), ("MEM001", node_name(self.fragmented_rank // GPUS)),
                *(("NCCL001", node_name(node)) for node in self.ib_disabled_nodes)}


def node_name(node: int) -> str:
    return f"gpu-{node:04d}"


# --- one real agent's exposition, the per-node template ---------------------------------------------------------

@contextlib.contextmanager
def _process(command: list[str], log: Path, **kwargs) -> Iterator[subprocess.Popen]:
    with log.open("w") as out, running(command, stdout=out, grace=30, **kwargs) as proc:
        yield proc


def capture_template(workdir: Path) -> list[Series]:
    """Scrape a simulated dgx-h100 agent with 8 healthy ranks (tp=8 on the node) reporting to it."""
    port, sock = free_port(), workdir / "telemetry.sock"
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "gpuwatch.cli.main", "agent", "--simulate", "dgx-h100", "--interval", "0.5",
               "--listen", f"127.0.0.1:{port}", "--telemetry.socket", str(sock), "--node", "template"]
    with _process(command, workdir / "agent.log"):
        state = wait_until(lambda: json.loads(get(url + "/api/v1/state"))["facts"].get("nvml"), "the agent's GPUs")
        uuids = [gpu["uuid"] for gpu in state["gpus"]]
        layout = {"world_size": GPUS, "tp_size": GPUS, "pp_size": 1, "dp_size": 1, "pp_stage": 0, "dp_rank": 0,
                  "micro_batches": 1, "faults": [], "hostname": "template"}
        with TelemetryClient(sock, heartbeat_interval=0) as client:
            for rank in range(GPUS):
                client.send(hello(rank, job=JOB, local_rank=rank, tp_rank=rank, **layout,
                                  gpu={"index": rank, "uuid": uuids[rank]},
                                  env={"NCCL_DEBUG": "WARN", "NCCL_IB_DISABLE": "0"}))
                for number in range(100 - MIN_WINDOW_STEPS + 1, 101):  # a window the timing rules judge
                    client.send(step(rank, number, job=JOB, memory=HEALTHY_MEMORY, pipeline=None,
                                     collectives=collectives({"all_reduce": [0.002] * 4})))

        def ready() -> str | None:
            text = get(url + "/metrics").decode()
            full = f" {MIN_WINDOW_STEPS}.0"
            full_windows = sum(line.startswith("gpuwatch_train_window_steps{") and line.endswith(full)
                               for line in text.splitlines())
            return text if full_windows == GPUS and \
                text.count("gpuwatch_gpu_job_info{") == GPUS and text.count("gpuwatch_train_env_info{") == GPUS \
                else None

        text = wait_until(ready, "8 ranks in /metrics")
    return [series for series in parse(text) if READ_BY_DIAGNOSE.fullmatch(series.name)]


def parse(text: str) -> list[Series]:
    out = []
    for line in text.splitlines():
        if line and not line.startswith("#") and (match := _SAMPLE.match(line)):
            name, labels, value = match.groups()
            out.append(Series(name, tuple(_LABEL.findall(labels or "")), float(value)))
    return out


# --- the cluster, as OpenMetrics -------------------------------------------------------------------------------

def _node_labels(series: Series, node: int, plan: Plan) -> dict[str, str]:
    """The template series' labels as node ``node`` of the plan's cluster exports them, seen through a scrape with
    honor_labels (the training series keep their own ``job``; the agent's get the scrape job)."""
    nodes = plan.nodes
    labels = dict(series.labels)
    if node in plan.ib_disabled_nodes and series.name == "gpuwatch_train_env_info" \
            and labels["name"] == "NCCL_IB_DISABLE":
        labels["value"] = "1"
    labels["instance"] = f"{node_name(node)}:9746"
    labels.setdefault("job", "gpuwatch")
    if series.name == "gpuwatch_agent_info":
        labels["node"] = node_name(node)
    if "rank" in labels:
        labels["rank"] = str(node * GPUS + int(labels["rank"]))
    if "dp_rank" in labels:
        labels["dp_rank"] = str(node)
    if "dp_size" in labels:
        labels["dp_size"] = str(nodes)
    if "world_size" in labels:
        labels["world_size"] = str(nodes * GPUS)
    if "hostname" in labels:
        labels["hostname"] = node_name(node)
    if "uuid" in labels:
        labels["uuid"] = labels["uuid"][:-6] + f"{node:06d}"
    return labels


def _planted(plan: Plan, node: int, name: str, labels: dict[str, str], value: float) -> float:
    """The value a series has once the plan's faults are in."""
    rank = int(labels["rank"]) if "rank" in labels else None
    if node == plan.straggler_node and (name == "gpuwatch_train_compute_seconds" or (
            name == "gpuwatch_train_window_median_seconds" and labels.get("timing") in ("compute_seconds", BUSY))):
        return value * 2  # its busy time (the phases summed: compute most of it) too, by which PERF002 judges
    if node == plan.ib_down_node and labels.get("device") == "mlx5_3" and labels.get("port") == "1":
        faulty = {"gpuwatch_ib_port_up": 0, "gpuwatch_ib_port_state_id": 1, "gpuwatch_ib_port_physical_state_id": 3}
        return faulty.get(name, value)
    if rank == plan.nan_rank:
        return {"gpuwatch_train_loss": math.nan, "gpuwatch_train_nonfinite_steps_total": 3}.get(name, value)
    if rank == plan.fragmented_rank:
        return {"gpuwatch_train_memory_reserved_bytes": 70 << 30, "gpuwatch_train_memory_allocated_bytes": 40 << 30,
                "gpuwatch_train_memory_inactive_split_bytes": 22 << 30,
                "gpuwatch_train_alloc_retries_total": 17}.get(name, value)
    return value


def _format(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def write_openmetrics(template: list[Series], plan: Plan, path: Path, timestamps: list[float],
                      nodes: range | None = None) -> int:
    """The ``nodes`` of the plan (all by default), one family after another (OpenMetrics wants them contiguous),
    each series' samples in time order. Returns the number of series."""
    by_name: dict[str, list[Series]] = {}
    for series in template:
        by_name.setdefault(series.name, []).append(series)
    count = 0
    stamps = [f"{t:.3f}" for t in timestamps]
    with path.open("w") as out:
        for name, family in by_name.items():
            for node in nodes if nodes is not None else range(plan.nodes):
                lines = []
                for series in family:
                    labels = _node_labels(series, node, plan)
                    value = _format(_planted(plan, node, name, labels, series.value))
                    text = ",".join(f'{key}="{val}"' for key, val in sorted(labels.items()))
                    lines.extend(f"{name}{{{text}}} {value} {stamp}\n" for stamp in stamps)
                    count += 1
                out.writelines(lines)
        out.write("# EOF\n")
    return count


# --- Prometheus and diagnose -----------------------------------------------------------------------------------

def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        sys.exit(f"{name} not found: apt-get install prometheus (Debian's package has prometheus and promtool)")
    return path


@dataclass
class Run:
    nodes: int
    series: int
    generate_s: float
    backfill_s: float
    diagnose_s: list[float]
    bytes_received: int
    queries: int
    full_bytes: int | None
    full_s: float | None
    found: set[tuple[str, str]]
    info: list[str]
    not_run: dict[str, str]
    #: each query of the outlier fetch (``query_key``), run alone with the engine's statistics
    costs: dict[str, QueryCost]
    #: seconds the engine took for its last round of the rule file (every group's evaluationTime)
    rules_s: float


@dataclass(frozen=True)
class QueryCost:
    """One query, run alone: the engine's samples touched, the rows answered and the wall time around it."""

    expr: str
    samples: int
    rows: int
    seconds: float


#: The label matchers that scope a query to nodes or jobs by name, which differ from one cluster to the next.
_SCOPE = re.compile(r'\b(instance|job)=~"(?:[^"\\]|\\.)*"')


def query_key(expr: str) -> str:
    """The query with its nodes or jobs by name left out: the same query across cluster sizes."""
    return _SCOPE.sub(r'\1=~"…"', " ".join(expr.split()))


def engine_cost(url: str, expr: str) -> QueryCost:
    """``expr`` run once with ``stats=all`` (Prometheus ≥ 2.35 answers the samples it touched)."""
    form = urllib.parse.urlencode({"query": expr, "stats": "all", "timeout": "120"}).encode()
    started = time.perf_counter()
    with urllib.request.urlopen(f"{url}/api/v1/query", data=form, timeout=180) as response:
        answer = json.loads(response.read())
    seconds = time.perf_counter() - started
    stats = answer["data"].get("stats")
    if not stats or SAMPLES not in stats.get("samples", {}):
        raise RuntimeError(f"{url} gives no query statistics (stats=all): Prometheus 2.35 or later does")
    return QueryCost(expr, int(stats["samples"][SAMPLES]), len(answer["data"]["result"]), seconds)


def diagnose(url: str, fetch: str) -> tuple[float, dict]:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "gpuwatch.cli.main", "diagnose", "--prometheus", url,
                             "--prometheus.fetch", fetch, "--query.timeout", "120", "--format", "json",
                             "--fail-on", "never"], capture_output=True, text=True, check=True)
    return time.perf_counter() - started, json.loads(result.stdout)


def findings(document: dict) -> tuple[set[tuple[str, str]], list[str]]:
    """(rule, node) of every warning or critical finding's evidence, and the info findings' titles."""
    found, info = set(), []
    for finding in document["findings"]:
        if finding["severity"] == "info":
            info.append(f"{finding['code']}: {finding['title']}")
            continue
        nodes = {e["where"].get("node") for e in finding["evidence"]} - {None}
        found |= {(finding["code"], node) for node in nodes} or {(finding["code"], "?")}
    return found, info


class RecordingApi(prometheus.Api):
    """The source's own API, keeping each query it sends."""

    def __init__(self, url: str) -> None:
        super().__init__(url, timeout=120)
        self.sent: list[str] = []

    def query(self, expr: str) -> list[dict]:
        self.sent.append(expr)
        return super().query(expr)


def query_costs(url: str) -> dict[str, QueryCost]:
    """Each distinct query of an outlier fetch (run in this process), run again alone with the engine's statistics."""
    api = RecordingApi(url)
    prometheus.read(api, "outliers")
    return {query_key(expr): engine_cost(url, expr) for expr in dict.fromkeys(api.sent)}


def rule_evaluation_s(url: str) -> float:
    groups = json.loads(get(url + "/api/v1/rules", timeout=60))["data"]["groups"]
    return sum(group["evaluationTime"] for group in groups)


def backfill(template: list[Series], plan: Plan, workdir: Path) -> tuple[Path, int, float, float]:
    """The plan's cluster backfilled into a new TSDB under ``workdir``: (its path, series, seconds generating the
    OpenMetrics, seconds in promtool)."""
    data, tsdb = workdir / f"cluster-{plan.nodes}.om", workdir / f"tsdb-{plan.nodes}"
    now = time.time()
    series, generating, backfilling = 0, 0.0, 0.0
    # promtool holds every series of a block in memory (15.8 GB for 4,096 nodes at once): it backfills a chunk of
    # nodes at a time into the same TSDB, each chunk's samples earlier than the last's, so that their blocks are
    # disjoint in time and Prometheus has nothing to merge (CHUNK_SPACING_S).
    for first in range(0, plan.nodes, BACKFILL_CHUNK):
        chunk_started = time.perf_counter()
        end = now - first // BACKFILL_CHUNK * CHUNK_SPACING_S
        series += write_openmetrics(template, plan, data, [end - 60, end - 30, end],
                                    range(first, min(plan.nodes, first + BACKFILL_CHUNK)))
        written = time.perf_counter()
        subprocess.run([_tool("promtool"), "tsdb", "create-blocks-from", "openmetrics", str(data), str(tsdb)],
                       check=True, capture_output=True)
        generating += written - chunk_started
        backfilling += time.perf_counter() - written
        data.unlink()
    return tsdb, series, generating, backfilling


def _rules_evaluated(url: str) -> bool:
    """Every group of the rule file evaluated at least once, and the recording rules' version recorded."""
    groups = json.loads(get(url + "/api/v1/rules", timeout=60))["data"]["groups"]
    return bool(groups) and all(not group["lastEvaluation"].startswith("0001-") for group in groups) and bool(
        json.loads(get(url + "/api/v1/query?query=count(gpuwatch:diagnose:recording_rules)", timeout=60))["data"][
            "result"])


@contextlib.contextmanager
def serve(tsdb: Path, workdir: Path, evaluation_interval: str = "1m") -> Iterator[str]:
    """A real ``prometheus`` serving ``tsdb`` with the shipped rule file, once it has evaluated the rules: its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = workdir / "prometheus.yml"
    # The shipped recording rules, evaluated over the backfilled samples (the lookback covers them): the outlier
    # fetch's yardsticks, as a production engine would hold them.
    config.write_text(f"global: {{scrape_interval: 1m, evaluation_interval: {evaluation_interval}}}\n"
                      f"rule_files: [{RULES}]\n")
    command = [_tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tsdb}",
               f"--web.listen-address=127.0.0.1:{port}", f"--query.lookback-delta={LOOKBACK}",
               "--storage.tsdb.max-block-duration=2h"]  # the backfilled blocks stay as they are while measured
    with _process(command, workdir / f"prometheus-{tsdb.name}.log"):
        wait_until(lambda: get(url + "/-/ready", timeout=1), "prometheus ready", timeout=300)
        wait_until(lambda: _rules_evaluated(url), "the rule file evaluated", timeout=1800)
        yield url


def measure(template: list[Series], nodes: int, repeat: int, workdir: Path, full: bool,
            evaluation_interval: str = "1m") -> Run:
    tsdb, series, generating, backfilling = backfill(template, Plan(nodes), workdir)
    with serve(tsdb, workdir, evaluation_interval) as url:
        times, document = [], {}
        for _ in range(repeat):
            elapsed, document = diagnose(url, "outliers")
            times.append(elapsed)
        costs = query_costs(url)
        rules_s = rule_evaluation_s(url)
        full_s, full_bytes = None, None
        if full:  # today's whole-family pull, once: the yardstick of the bytes
            full_s, full_document = diagnose(url, "full")
            full_bytes = full_document["sources"][0]["bytes_received"]
    shutil.rmtree(tsdb)
    found, info = findings(document)
    not_run = {item["code"]: item["reason"] for item in document.get("not_run", [])}
    source = document["sources"][0]
    if source["nodes"] != nodes:
        raise RuntimeError(f"diagnose saw {source['nodes']} nodes, not {nodes}")
    return Run(nodes, series, generating, backfilling, times, source["bytes_received"],
               source["queries"], full_bytes, full_s, found, info, not_run, costs, rules_s)


def print_sample_growth(runs: list[Run]) -> None:
    """Per query of the outlier fetch: the samples the engine touched at each size, and their growth from the smallest
    size beside the cluster's (a query that grows faster than the cluster is marked)."""
    base = runs[0]
    print(f"\nsamples touched per query (stats=all, each query alone); growth from {base.nodes:,d} nodes "
          "(the cluster's growth in brackets):")
    print("  " + " ".join(f"{run.nodes:>9,d}" for run in runs) + "   growth  query")
    largest = runs[-1].costs
    keys = sorted(set().union(*(run.costs for run in runs)), key=lambda key: -getattr(largest.get(key), "samples", 0))
    for key in keys:
        samples = [run.costs[key].samples if key in run.costs else None for run in runs]
        cells = " ".join(f"{'-' if count is None else f'{count:,d}':>9}" for count in samples)
        first, last = samples[0], samples[-1]
        growth = "" if first is None or last is None else "=" if first == last == 0 else \
            "new" if first == 0 else f"{last / first:.2f}×"
        faster = first is not None and last is not None and last > first * runs[-1].nodes / base.nodes
        print(f"  {cells} {growth:>8}{' FASTER THAN THE CLUSTER' if faster else ''}  {key[:110]}")
    print(f"  (cluster: {runs[-1].nodes / base.nodes:.2f}× nodes and series)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="64,256,1024", help="comma-separated cluster sizes")
    parser.add_argument("--repeat", type=int, default=3, help="diagnose runs per size (the median is reported)")
    parser.add_argument("--full-up-to", type=int, default=1024,
                        help="also run the full pull (the bytes' yardstick) once at sizes up to this")
    parser.add_argument("--evaluation-interval", default="1m",
                        help="Prometheus' rule evaluation interval (the shipped rule file's every round reads every "
                             "family: past a few thousand nodes on 2 cores a round outlasts 1m, and diagnose then "
                             "shares the cores with it)")
    args = parser.parse_args()
    sizes = [int(n) for n in args.nodes.split(",")]
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="gpuwatch-cluster-") as tmp:
        workdir = Path(tmp)
        template = capture_template(workdir)
        print(f"template: {len(template)} series per node (8 GPUs, 18 NVLinks each, 8 IB ports, 8 ranks) "
              "from a simulated dgx-h100 agent")
        runs = []
        for nodes in sizes:
            run = measure(template, nodes, args.repeat, workdir, nodes <= args.full_up_to, args.evaluation_interval)
            runs.append(run)
            plan = Plan(nodes)
            missed, spurious = plan.expected() - run.found, run.found - plan.expected()
            verdict = "exactly the planted faults" if not missed and not spurious else \
                f"MISSED {sorted(missed)} SPURIOUS {sorted(spurious)}"
            print(f"{nodes:5d} nodes  {run.series:9,d} series  generate {run.generate_s:6.1f} s  "
                  f"backfill {run.backfill_s:6.1f} s  diagnose median {statistics.median(run.diagnose_s):5.2f} s "
                  f"(min {min(run.diagnose_s):.2f}, max {max(run.diagnose_s):.2f})  {run.bytes_received:,d} bytes in "
                  f"{run.queries} queries  → {verdict}")
            if run.full_bytes is not None and run.full_s is not None:
                print(f"        full pull: {run.full_s:.2f} s, {run.full_bytes:,d} bytes; outliers receive "
                      f"{100 * run.bytes_received / run.full_bytes:.2f} % of it")
            print(f"        the rule file's last evaluation took {run.rules_s:.2f} s")
            for cost in sorted(run.costs.values(), key=lambda cost: -cost.seconds)[:5]:
                print(f"        slow query alone {cost.seconds:5.2f} s {cost.samples:9,d} samples  "
                      f"{query_key(cost.expr)[:100]}")
            for code, node in sorted(run.found):
                print(f"        found {code} on {node}")
            for line in run.info:
                print(f"        info  {line}")
            print(f"        not run: {', '.join(sorted(run.not_run)) or 'none'}")
        base = runs[0]
        print("\ngrowth of diagnose wall time (median) against the smallest cluster:")
        for run in runs:
            growth = statistics.median(run.diagnose_s) / statistics.median(base.diagnose_s)
            more_bytes = run.bytes_received / base.bytes_received
            print(f"  {run.nodes:5d} nodes: {growth:5.2f}× time, {more_bytes:5.2f}× bytes "
                  f"for {run.series / base.series:5.1f}× series")
        print_sample_growth(runs)
        print(f"\nmachine: {machine()}; load average before {load_before}, after {load_average()}; "
              f"rule evaluation every {args.evaluation_interval}")
        print("targets: exactly the planted faults at every size; 4,096 nodes in under 10 s; outlier bytes at 1,024 "
              "nodes ≤ 5 % of the full pull's and ≤ 2× from 1,024 to 4,096 nodes")


if __name__ == "__main__":
    main()
