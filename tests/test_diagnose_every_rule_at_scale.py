"""Every rule of the registry, planted into one small cluster and judged through Prometheus twice: with the full pull
and with the outlier fetch that ``diagnose`` uses above 64 nodes (``--prometheus.fetch outliers`` forces it here).

The cluster: simulated agents (``gpuwatch agent --simulate``) scraped by one real Prometheus. Hardware faults are
planted into one node with ``--simulate.faults``; each training rule gets a job of its own (named after the rule) whose
fake ranks send what a job with that fault sends, through the real TelemetryClient, to the agents' sockets. Two idle
nodes run nothing and carry no fault.

For every rule: it fires with the full pull; with the outlier fetch it fires too and its findings are the full pull's
(same codes, same evidence locations), unless the outlier fetch leaves it to the full pull by design (a whole-job
rule: then it says so in its not-run note). The idle nodes are not read in detail by the outlier fetch (but for the
one node the plan reads to stand on). Every rule has a scenario (the PLAN rules' jobs say in their hellos what they
train, which the agents export); a rule without one fails the first test, which says to add one.

MEM003 judges the host RSS history that the full pull reads at a 30 s resolution (``prometheus.HISTORY``); its
``min_points`` threshold is lowered to 2 (``OVERRIDES``, as ``--config`` would), so a minute of steps shows a trend.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import math
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from telemetry_records import closed, collectives, hello, probe, progress, step

from gpuwatch.agent.telemetry.store import DEFAULT_MAX_JOBS
from gpuwatch.agent.telemetry.window import MIN_WINDOW_STEPS
from gpuwatch.diagnosis import engine, report
from gpuwatch.diagnosis.registry import REGISTRY
from gpuwatch.diagnosis.sources import outliers, prometheus
from gpuwatch.trainer.telemetry import BACKLOG_RECORDS, TelemetryClient

from conftest import AgentProcess, IdleSender, http_get, wait_until

pytestmark = pytest.mark.integration

GIB = 1 << 30
STEPS = MIN_WINDOW_STEPS + 1  # a full window
HW, ROCE = "hw-0", "roce-0"
#: The training nodes, in pairs: each job runs two ranks on each node of a pair (an agent keeps at most
#: ``DEFAULT_MAX_JOBS`` jobs, so the jobs are dealt to the pairs in turn).
PAIRS = (("train-0", "train-1"), ("train-2", "train-3"))
IDLE = ("idle-0", "idle-1")
#: The hardware faults of node HW, one per hardware rule (``--simulate.faults``).
HW_FAULTS = [
    {"fault": "nvlink_down", "gpu": 0, "link": 2},  # HW001
    {"fault": "pcie", "gpu": 1, "generation": 3},  # HW002
    {"fault": "ib_port_down", "device": "mlx5_1"},  # HW003
    {"fault": "xid", "gpu": 3, "xid": 79},  # HW004
    {"fault": "clock_slowdown", "gpu": 2, "reasons": ["hw_thermal_slowdown"]},  # HW005
]
#: Each node's preset and planted faults.
NODES: dict[str, tuple[str, list[dict[str, Any]]]] = {
    HW: ("dgx-h100", HW_FAULTS), ROCE: ("a100-roce", []),
    **{name: ("dgx-h100", []) for name in (*(node for pair in PAIRS for node in pair), *IDLE)}}
#: Threshold overrides both modes judge with (as ``diagnose --config`` passes them).
OVERRIDES = {"MEM003": {"min_points": 2.0}}

HEALTHY_MEMORY = {"kind": "cuda", "peak_bytes": 3 * GIB, "allocated_bytes": 2 * GIB, "reserved_bytes": 3 * GIB,
                  "inactive_split_bytes": 1 << 20, "alloc_retries": 0, "ooms": 0}
#: What every rank reports unless its scenario says otherwise: a healthy bf16 rank of a model that learns, whose
#: all-reduces all take the same time (no latency tail) and whose environment sets an exported NCCL variable.
BASE_HELLO = {"faults": [], "env": {"NCCL_ALGO": "Ring"}}
BASE_STEP = {"memory": HEALTHY_MEMORY, "collectives": collectives({"all_reduce": [0.002, 0.002]})}
DP4 = {"tp_size": 1, "pp_size": 1, "dp_size": 4}
PP2 = {"tp_size": 1, "pp_size": 2, "dp_size": 2, "schedule": "1f1b", "micro_batches": 4}
Fields = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A rule's fault: on a node (``node``: the planted hardware faults of ``NODES``), or in a job of its own, one
    rank per entry of ``placement`` (by default two on each node of a pair of ``PAIRS``: every job spans nodes).
    ``hello`` and ``step`` hold fields over each rank's records, by rank (a callable value is called with the step's
    number); ``after`` makes the records a rank sends after its steps (from its rank, job and node). A job that keeps
    ``stepping`` sends a step a second for as long as the test runs. With ``idle_sender`` the ``after`` records come
    from a process of their own, which then idles until the test ends (``IdleSender``)."""

    node: str | None = None
    layout: Fields = dataclasses.field(default_factory=lambda: DP4)
    placement: tuple[str, ...] | None = None
    hello: Mapping[int, Fields] = dataclasses.field(default_factory=dict)
    step: Mapping[int, Fields] = dataclasses.field(default_factory=dict)
    after: Mapping[int, Callable[[int, str, str], list[dict[str, Any]]]] = dataclasses.field(default_factory=dict)
    steps: int = STEPS
    stepping: bool = False
    idle_sender: bool = False


def each(fields: Fields, ranks: int = 4) -> dict[int, Fields]:
    return dict.fromkeys(range(ranks), fields)


def in_collective(seq: int) -> Callable[[int, str, str], list[dict[str, Any]]]:
    """A rank overdue in all-reduce number ``seq`` on the job's data-parallel group (ranks 0-3)."""
    return lambda rank, job, node: [progress(rank, job, stalled=30.0, step=STEPS, collective={
        "group": "dp", "group_size": 4, "group_rank": rank, "seq": seq})]


def computing(rank: int, job: str, node: str) -> list[dict[str, Any]]:
    return [progress(rank, job, stalled=30.0, step=STEPS)]


def raised(rank: int, job: str, node: str) -> list[dict[str, Any]]:
    return [progress(rank, job, stalled=0.5, step=STEPS, error={
        "type": "RuntimeError", "message": "CUDA error: an illegal memory access was encountered"})]


def closed_long_ago(rank: int, job: str, node: str) -> list[dict[str, Any]]:
    """Hooks closed two minutes ago (past HANG007's minute); the process stays, idle (``IdleSender``)."""
    return [closed(rank, job, step=STEPS, time=time.time() - 120)]


def slow_probe(rank: int, job: str, node: str) -> list[dict[str, Any]]:
    """A probe between two nodes at a tenth of one NDR port's 50 GB/s."""
    return [probe(job, busbw=5e9, hostname=node, hostnames=[node, "elsewhere"])]


DP_GROUP = {"process_groups": {"dp": [0, 1, 2, 3]}}
#: What a job trains, as the reference trainer's hello says it (the PLAN rules' premise).
GPT2_SMALL = {"model": {"layers": 12, "hidden": 768, "heads": 12, "kv_heads": 12, "ffn": 3072, "vocab": 50257,
                        "tied_embeddings": True, "gated": False, "bias": True, "norm_params": 2, "positions": 1024,
                        "source": "hf"},
              "global_batch": 32, "seq_len": 1024}
HANG = {"layout": DP4, "hello": each(DP_GROUP)}
SCENARIOS: dict[str, Scenario] = {
    **{code: Scenario(node=HW) for code in ("HW001", "HW002", "HW003", "HW004", "HW005")},
    "CONV001": Scenario(step={1: {"loss": math.nan}}),
    "CONV002": Scenario(step={1: {"grad_norm": 500.0}}),
    "CONV003": Scenario(step={3: {"param_checksum": lambda number: 5000.0 + number}}),
    "CONV004": Scenario(step=each({"grad_cosine_similarity": 1.0})),
    "CONV005": Scenario(step=each({"grad_cosine_similarity": 0.6})),
    "CONV006": Scenario(step=each({"loss": 2.0, "param_checksum": 7.0})),
    "HANG001": Scenario(**HANG, after={0: in_collective(7), 1: in_collective(7), 2: in_collective(7), 3: computing}),
    "HANG002": Scenario(**HANG, after={0: in_collective(7), 1: in_collective(7), 2: in_collective(8),
                                       3: in_collective(8)}),
    "HANG003": Scenario(**HANG, after=dict.fromkeys(range(4), in_collective(7))),
    "HANG004": Scenario(**HANG, after={2: raised}),
    "HANG005": Scenario(hello=each({"time": time.time() - 300}), steps=0),
    "HANG006": Scenario(**HANG, after=dict.fromkeys(range(4), computing)),
    "HANG007": Scenario(**HANG, after={3: closed_long_ago}, idle_sender=True,
                        placement=tuple(node for node in PAIRS[1] for _ in range(2))),
    "MEM001": Scenario(step={1: {"memory": {**HEALTHY_MEMORY, "reserved_bytes": 8 * GIB, "allocated_bytes": 4 * GIB,
                                            "alloc_retries": 9}}}),
    "MEM002": Scenario(step={1: {"memory": {**HEALTHY_MEMORY, "peak_bytes": 79 * GIB, "reserved_bytes": 79 * GIB}}}),
    "MEM003": Scenario(step=each({"memory": lambda number: {"kind": "host_rss",
                                                            "peak_bytes": GIB + number * GIB // 20}}), stepping=True),
    "NCCL001": Scenario(hello={1: {"env": {"NCCL_ALGO": "Ring", "NCCL_IB_DISABLE": "1"}}}),
    # The majority sets the GID index; rank 0, on the RoCE node, does not.
    "NCCL002": Scenario(placement=(ROCE, ROCE, *PAIRS[0]),
                        hello={0: {"env": {"NCCL_ALGO": "Ring"}}, **{rank: {"env": {"NCCL_ALGO": "Ring",
                                                                                     "NCCL_IB_GID_INDEX": "3"}}
                                                                    for rank in (1, 2, 3)}}),
    "NCCL003": Scenario(hello={1: {"env": {"NCCL_ALGO": "Ring", "NCCL_SOCKET_IFNAME": "ib9"}}}),
    "NCCL004": Scenario(hello={1: {"env": {"NCCL_ALGO": "Ring", "NCCL_P2P_DISABLE": "1"}}}),
    "NCCL005": Scenario(step={2: {"collectives": collectives({"all_reduce": [0.001] * 90 + [0.01] * 10})}}),
    "PERF001": Scenario(layout=PP2, step=each({"pipeline": {"busy_seconds": 0.25, "idle_seconds": 0.25,
                                                            "bubble_ratio": 0.5, "bubble_ratio_theoretical": 0.2}})),
    "PERF002": Scenario(step={**each({"step_seconds": 1.0}), 1: {"step_seconds": 1.0, "compute_seconds": 0.9}}),
    "PERF003": Scenario(step=each({"dataloader_wait_seconds": 0.3})),
    "PERF004": Scenario(step=each({"step_seconds": 1.0, "exposed_collective_seconds": 0.6})),
    "PERF005": Scenario(after={0: slow_probe}),
    # stage 1 (ranks 2-3) computes twice as long as stage 0
    "PERF006": Scenario(layout=PP2, step={2: {"compute_seconds": 0.6}, 3: {"compute_seconds": 0.6}}),
    # GPT-2 small (124 M) on 4 H100s: the plan predicts a step of ~10 ms and a few GiB a rank
    "PLAN001": Scenario(hello=each(GPT2_SMALL), step=each({"step_seconds": 5.0})),
    "PLAN002": Scenario(hello=each(GPT2_SMALL), step=each({"memory": {**HEALTHY_MEMORY, "peak_bytes": 60 * GIB,
                                                                      "reserved_bytes": 60 * GIB}})),
    "TOPO001": Scenario(layout=PP2, hello=each({"process_groups": {"pp": [0, 1, 2, 3], "dp": [0, 1, 2, 3]}})),
    "TOPO002": Scenario(layout={"tp_size": 4, "pp_size": 1, "dp_size": 1}),
}


#: Where each training rule's job runs: its own placement, else a pair of training nodes, dealt in turn.
PLACEMENT = {code: scenario.placement or tuple(node for node in PAIRS[index % len(PAIRS)] for _ in range(2))
             for index, (code, scenario) in enumerate((code, scenario) for code, scenario in SCENARIOS.items()
                                                      if scenario.node is None)}


def whole_job_rules() -> Mapping[str, str]:
    """The rules the outlier fetch leaves to the full pull, with why: the one place this test reads that list."""
    return outliers.served(REGISTRY).whole_job


def job_of(code: str) -> str:
    return f"job-{code.lower()}"


def test_every_rule_has_a_planted_scenario():
    missing = sorted(set(REGISTRY) - set(SCENARIOS))
    assert not missing, f"no planted scenario for {', '.join(missing)}: add one to SCENARIOS in {Path(__file__).name}"
    assert not set(SCENARIOS) - set(REGISTRY), "a scenario for a rule no longer registered"
    jobs = collections.Counter(node for placement in PLACEMENT.values() for node in set(placement))
    assert max(jobs.values()) <= DEFAULT_MAX_JOBS, f"more jobs on a node than its agent keeps: add a pair ({jobs})"


def _records(code: str, rank: int, gpus: Mapping[str, list[str]], numbers: range) -> Iterator[dict[str, Any]]:
    """The hello (when ``numbers`` starts at 1) and the steps ``numbers`` of one rank of ``code``'s job."""
    scenario, placement, job = SCENARIOS[code], PLACEMENT[code], job_of(code)
    node = placement[rank]
    layout = {**scenario.layout, **scenario.hello.get(rank, {})}
    tp, dp = layout["tp_size"], layout["dp_size"]
    local = placement[:rank].count(node)
    if numbers.start == 1:
        record = hello(rank, job, **{**BASE_HELLO, "world_size": len(placement), "tp_rank": rank % tp,
                                  "dp_rank": rank // tp % dp, "pp_stage": rank // (tp * dp), "local_rank": local,
                                  "hostname": node, "gpu": {"index": local, "uuid": gpus[node][local]},
                                  "process_groups": {}, **layout})
        if "micro_batches" not in layout:  # a job without a pipeline has no schedule
            del record["schedule"], record["micro_batches"]
        yield record
    for number in numbers:
        fields = {**BASE_STEP, **scenario.step.get(rank, {})}
        yield step(rank, number, job, **{name: value(number) if callable(value) else value
                                         for name, value in fields.items()})


#: Records sent by one client at a time: fewer than its backlog holds while the agent's socket is full
#: (``BACKLOG_RECORDS``), which its close then gives all the time it takes to reach the agent.
CHUNK = BACKLOG_RECORDS // 2


def _send(agents: Mapping[str, AgentProcess], batches: Mapping[str, list[dict[str, Any]]]) -> None:
    """Every record to its node's agent, in order, none dropped however busy the machine."""
    for node, records in batches.items():
        for start in range(0, len(records), CHUNK):
            client = TelemetryClient(agents[node].telemetry_socket, heartbeat_interval=0)
            for record in records[start:start + CHUNK]:
                client.send(record)
            client.close(timeout=60)
            assert client.dropped == 0, (node, client.drops)


def _count(url: str, expr: str) -> int:
    status, body, _ = http_get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    result = json.loads(body)["data"]["result"] if status == 200 else []
    return int(float(result[0]["value"][1])) if result else 0


def _diagnose(url: str, mode: str) -> tuple[dict[str, Any], set[str]]:
    """``diagnose --prometheus URL --prometheus.fetch MODE --format json`` (the same fetch, rules and report), and the
    nodes the fetch read in detail."""
    facts = prometheus.fetch(url, mode=mode, overrides=OVERRIDES)
    document = report.to_json(engine.run(facts, overrides=OVERRIDES))
    assert document["sources"][0]["fetch"] == mode, document["sources"]
    assert not [item for item in document["not_run"] if item["cause"] == "source"], document["not_run"]
    return document, set(facts.nodes)


def _located(document: Mapping[str, Any], code: str) -> list[tuple[tuple[str, Any], ...]]:
    """The evidence locations of ``code``'s findings."""
    return sorted(tuple(sorted(evidence["where"].items())) for finding in document["findings"]
                  if finding["code"] == code for evidence in finding["evidence"])


def _fired(document: Mapping[str, Any], code: str) -> bool:
    """Whether ``code`` found its planted fault: on its node, or about its job."""
    scenario = SCENARIOS[code]
    for finding in (f for f in document["findings"] if f["code"] == code):
        if scenario.node is not None and any(e["where"].get("node") == scenario.node for e in finding["evidence"]):
            return True
        if scenario.node is None and job_of(code) in json.dumps(finding):
            return True
    return False


@pytest.fixture
def cluster(start_agent, prometheus_server, tmp_path) -> Iterator[tuple[str, dict[str, AgentProcess]]]:
    """The agents, the Prometheus scraping them and every scenario planted; yields once Prometheus shows them all."""
    def start(name: str) -> AgentProcess:
        preset, faults = NODES[name]
        args = ["--simulate", preset, "--node", name, "--interval", "1", "--telemetry.ttl", "600"]
        if faults:
            (tmp_path / f"{name}.json").write_text(json.dumps({"faults": faults}))
            args += ["--simulate.faults", str(tmp_path / f"{name}.json")]
        return start_agent(*args)

    with concurrent.futures.ThreadPoolExecutor(len(NODES)) as pool:
        agents = dict(zip(NODES, pool.map(start, NODES), strict=True))
    server = prometheus_server([f"127.0.0.1:{agent.port}" for agent in agents.values()], honor_labels=True)
    gpus = {name: [gpu["uuid"] for gpu in agent.state()["facts"]["nvml"]["gpus"]] for name, agent in agents.items()}
    batches: dict[str, list[dict[str, Any]]] = {name: [] for name in NODES}
    idle: list[tuple[str, list[dict[str, Any]]]] = []
    for code, placement in PLACEMENT.items():
        scenario = SCENARIOS[code]
        for rank, node in enumerate(placement):
            batches[node] += _records(code, rank, gpus, range(1, scenario.steps + 1))
            if rank in scenario.after:
                after = scenario.after[rank](rank, job_of(code), node)
                if scenario.idle_sender:
                    idle.append((node, after))
                else:
                    batches[node] += after
    _send(agents, batches)
    senders = [IdleSender(agents[node].telemetry_socket, records) for node, records in idle]

    stop = threading.Event()

    def keep_stepping() -> None:
        number = STEPS
        while not stop.wait(1.0):
            number += 1
            next_steps: dict[str, list[dict[str, Any]]] = {}
            for code in (code for code in PLACEMENT if SCENARIOS[code].stepping):
                for rank, node in enumerate(PLACEMENT[code]):
                    next_steps.setdefault(node, []).extend(_records(code, rank, gpus, range(number, number + 1)))
            _send(agents, next_steps)

    stepper = threading.Thread(target=keep_stepping, daemon=True)
    stepper.start()
    try:
        ranks = sum(len(placement) for placement in PLACEMENT.values())
        stepping = sum(len(placement) for code, placement in PLACEMENT.items() if SCENARIOS[code].steps)
        overdue = sum(len(SCENARIOS[code].after) for code in PLACEMENT if code.startswith("HANG"))
        ready = {
            "every agent": ("count(gpuwatch_agent_info)", len(NODES)),
            "every rank": ("count(gpuwatch_train_rank_info)", ranks),
            "every stepping rank's full window": (f"count(gpuwatch_train_window_steps >= {MIN_WINDOW_STEPS})",
                                                  stepping),
            "the overdue ranks": ("count(gpuwatch_train_stalled_seconds)", overdue),
            "the probe": ("count(gpuwatch_probe_info)", 1),
            "the idle senders' process CPU time": (
                "count(gpuwatch_host_process_cpu_seconds_total"
                " and on (job, rank) gpuwatch_train_closed_timestamp_seconds)",
                len(senders)),
            "the planted hardware faults": (
                "count(gpuwatch_nvlink_up == 0) + count(gpuwatch_gpu_pcie_link_generation{kind='current'} == 3)"
                " + count(gpuwatch_ib_port_state_id == 1) + count(gpuwatch_gpu_xid_errors_total > 0)"
                " + count(gpuwatch_gpu_clock_event_active{reason='hw_thermal_slowdown'} == 1)", len(HW_FAULTS)),
            # MEM003's history: the full pull samples host RSS every 30 s (prometheus.HISTORY)
            "two host RSS points per leaking rank": (
                f"count(count_over_time(gpuwatch_train_memory_peak_bytes{{kind='host_rss'}}[{prometheus.HISTORY}])"
                f" >= {OVERRIDES['MEM003']['min_points']:g})", 4),
        }
        for what, (expr, expected) in ready.items():
            wait_until(lambda expr=expr, expected=expected: _count(server.url, expr) == expected, timeout=150,
                       interval=0.5, what=f"{what} in Prometheus ({expr} == {expected})")
        yield server.url, agents
    finally:
        stop.set()
        stepper.join()
        for sender in senders:
            sender.close()


def test_every_rule_fires_alike_through_the_full_pull_and_the_outlier_fetch(cluster):
    url, _ = cluster
    full, read_in_full = _diagnose(url, "full")
    fetched, read_in_detail = _diagnose(url, "outliers")
    assert read_in_full == set(NODES)
    # The outlier fetch reads the nodes its selectors and jobs name; of the idle nodes, at most the one node the
    # plan reads to stand on (`bottomk (1, gpuwatch_agent_info)`).
    (anyone,) = [row["metric"]["node"] for row in
                 json.loads(http_get(f"{url}/api/v1/query?query=bottomk(1,gpuwatch_agent_info)")[1])["data"]["result"]]
    assert read_in_detail & set(IDLE) <= {anyone}, (read_in_detail, anyone)
    assert set(IDLE) - read_in_detail, read_in_detail
    not_run = {mode: {item["code"]: item for item in document["not_run"]}
               for mode, document in (("full", full), ("outliers", fetched))}
    problems = []
    for code in REGISTRY:
        if not _fired(full, code):
            problems.append(f"{code}: the full pull does not find the planted fault "
                            f"({not_run['full'].get(code) or [f for f in full['findings'] if f['code'] == code]})")
            continue
        if code in whole_job_rules():
            skipped = not_run["outliers"].get(code, {})
            if skipped.get("cause") != "fetch" or whole_job_rules()[code] not in skipped.get("reason", ""):
                problems.append(f"{code}: a whole-job rule, not reported as left to the full pull: {skipped}")
            continue
        if not _fired(fetched, code):
            problems.append(f"{code}: the outlier fetch does not find the planted fault "
                            f"({not_run['outliers'].get(code)})")
        elif _located(full, code) != _located(fetched, code):
            problems.append(f"{code}: the modes' findings differ: full {_located(full, code)}, "
                            f"outliers {_located(fetched, code)}")
    assert not problems, "\n".join(problems)
