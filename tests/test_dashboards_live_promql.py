"""Every PromQL expression of the dashboards and of the alert rules returns data on a live system.

A real Prometheus, loading alerts/gpuwatch.rules.yml and scraping with honor_labels as docs/runbook.md#setup
says, scrapes a real simulated dgx-h100 agent (`gpuwatch agent --simulate`). The agent receives telemetry
from a real short gloo training run (`gpuwatch train` on CPU: 2 stages x 2 replicas) and from the eight
ranks of a GPU job on the simulated node (records built as the hooks build them, sent by the real
TelemetryClient, naming the simulated GPUs' UUIDs): the CPU run cannot report what only a GPU run has
(CUDA memory, MFU, the GPU it runs on). A query that returns nothing is a panel that shows "No data".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import telemetry_records as records
import yaml

from gpuwatch.dashboards import DASHBOARDS
from gpuwatch.dashboards.generate import JSON_DIR
from gpuwatch.trainer.telemetry import TelemetryClient

from conftest import IdleSender, http_get, wait_until

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "alerts" / "gpuwatch.rules.yml"
GPU_JOB, GLOO_JOB, HUNG_JOB, DEAD_JOB = "gpu-job", "gloo-run", "hung-job", "dead-job"
STOPPED_JOB, UNSTEPPED_JOB, ENDED_JOB = "stopped-job", "unstepped-job", "ended-job"
#: Grafana's variables as "All" selects them; rate windows hold several 1 s scrapes.
VARIABLES = {"node": ".*", "job": ".*", "rank": ".*", "gpu": ".*", "__rate_interval": "10s"}
#: Training health panels a CPU (gloo) run must fill on its own.
GLOO_PANELS = {"Loss", "Gradient norm", "Pipeline bubble per stage", "Collective latency p50 / p99",
               "Collective traffic", "Data-loader wait", "Data-loader wait share", "Step time per rank",
               "Compute time per rank"}
pytestmark = pytest.mark.integration
_COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)(?!\s*bool\b)")


def with_bool(expr: str) -> str:
    """The expression with every comparison made a `bool` one (outside label matchers and strings), so a
    healthy system's alert expression returns its 0/1 verdicts instead of nothing."""
    out, depth, quote = [], 0, None
    i = 0
    while i < len(expr):
        char = expr[i]
        if quote:
            out.append(char)
            if char == "\\":
                out.append(expr[i + 1])
                i += 1
            elif char == quote:
                quote = None
        elif char in "\"'":
            quote = char
            out.append(char)
        elif char in "{}":
            depth += 1 if char == "{" else -1
            out.append(char)
        elif depth == 0 and (match := _COMPARISON.match(expr, i)):
            out.append(match.group(1) + " bool")
            i += len(match.group(1))
            continue
        else:
            out.append(char)
        i += 1
    return "".join(out)


def test_with_bool_rewrites_only_comparisons():
    assert with_bool('x{a!="b", c=~"d"} != x > 0.2') == 'x{a!="b", c=~"d"} != bool x > bool 0.2'
    assert with_bool("a < bool ignoring (k) b") == "a < bool ignoring (k) b"


def _substitute(expr: str) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: VARIABLES[m.group(1)], expr)


def dashboard_queries() -> dict[str, str]:
    """{where: PromQL} of every panel query and every query variable of the committed dashboards."""
    queries = {}
    for name, uid in DASHBOARDS.items():
        board = json.loads((JSON_DIR / f"{uid}.json").read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                queries[f"{name} / {panel['title']} / {target['refId']}"] = _substitute(target["expr"])
        for variable in board["templating"]["list"]:
            if variable["type"] == "query":
                metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"]).groups()
                queries[f"{name} / variable {variable['name']}"] = f"count by ({label}) ({_substitute(metric)})"
    return queries


def rule_queries() -> dict[str, str]:
    """{where: PromQL} of every recording rule and every alert, their comparisons made `bool`: the diagnose fetch's
    sparse signals, like the alerts, keep only what is wrong, and a live test must see their verdicts."""
    queries = {}
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            where = f"record {rule['record']}" if "record" in rule else f"alert {rule['alert']}"
            queries[where] = with_bool(rule["expr"])
    return queries


def _honour_labels_and_load_rules(prometheus, workdir: Path) -> None:
    """The conftest server scrapes with Prometheus's defaults; reconfigure it as the runbook's setup says."""
    config_path = workdir / "prometheus.yml"
    config = json.loads(config_path.read_text())
    config["scrape_configs"][0]["honor_labels"] = True
    config["rule_files"] = [str(RULES)]
    config_path.write_text(json.dumps(config))
    request = urllib.request.Request(prometheus.url + "/-/reload", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def _simulated_gpus(agent) -> list[tuple[str, str]]:
    info = records.samples(agent.get("/metrics").decode(), "gpuwatch_gpu_info")
    return sorted((labels["gpu"], labels["uuid"]) for labels in map(dict, info))


def _gpu_job(agent, stop: threading.Event) -> None:
    """Eight ranks of a tp=2 pp=2 dp=2 job, one per simulated GPU, stepping every 0.2 s until stopped;
    rank 5 computes slower, collectives take a few milliseconds."""
    gpus = _simulated_gpus(agent)
    with TelemetryClient(agent.telemetry_socket, heartbeat_interval=0) as client:
        for rank in range(8):
            index, uuid = gpus[rank]
            client.send(records.hello(rank, job=GPU_JOB, gpu={"index": int(index), "uuid": uuid},
                                      env={"NCCL_IB_DISABLE": "0"}))  # an exported variable
        step = 0
        while not stop.is_set():
            step += 1
            for rank in range(8):
                client.send(records.step(
                    rank, step, job=GPU_JOB, compute_seconds=0.3 + 0.05 * (rank == 5), loss=2.5 - 0.01 * step,
                    collectives=records.collectives({"all_reduce": [0.002, 0.004, 0.03], "send": [0.0001]})))
            stop.wait(0.2)


def _hung_job(agent, stop: threading.Event) -> None:
    """Two ranks of a hung job, as their watchdogs report them every second: rank 0 waits in an all-reduce, rank 1
    is stuck in its compute."""
    with TelemetryClient(agent.telemetry_socket, heartbeat_interval=0) as client:
        for rank in range(2):
            client.send(records.hello(rank, job=HUNG_JOB))
        stalled = 10.0
        while not stop.is_set():
            client.send(records.progress(0, job=HUNG_JOB, stalled=stalled, collective={}))
            client.send(records.progress(1, job=HUNG_JOB, stalled=stalled))
            stalled += 0.2
            stop.wait(0.2)


def _stopped_jobs(agent, stop: threading.Event) -> None:
    """Two ranks that stepped, then both stopped outside any collective (HANG006's), as their watchdogs report them;
    and a rank that said hello and closed its hooks without a step (the never-silent rules' closed-without-step)."""
    with TelemetryClient(agent.telemetry_socket, heartbeat_interval=0) as client:
        for rank in range(2):
            client.send(records.hello(rank, job=STOPPED_JOB, world_size=2, tp_size=1, pp_size=1, dp_size=2,
                                      tp_rank=0, pp_stage=0, dp_rank=rank, process_groups={"dp": [0, 1]}))
            client.send(records.step(rank, 3, job=STOPPED_JOB))
        client.send(records.hello(0, job=UNSTEPPED_JOB))
        client.send(records.closed(0, job=UNSTEPPED_JOB))
        stalled = 10.0
        while not stop.is_set():
            for rank in range(2):
                client.send(records.progress(rank, job=STOPPED_JOB, stalled=stalled + rank))
            stalled += 0.2
            stop.wait(0.2)


def _dead_rank(agent) -> None:
    """A rank whose process sends its hello and a step, waits a few of the agent's rounds (so the agent watches its
    pid), then exits: the agent finds it gone."""
    code = "\n".join([
        f"import sys, time; sys.path.insert(0, {str(Path(__file__).parent)!r})",
        "import telemetry_records as records",
        "from gpuwatch.trainer.telemetry import TelemetryClient",
        f"with TelemetryClient({str(agent.telemetry_socket)!r}, heartbeat_interval=0) as client:",
        f"    client.send(records.hello(0, job={DEAD_JOB!r}))",
        f"    client.send(records.step(0, 1, job={DEAD_JOB!r}))",
        "    time.sleep(3)"])
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _ended_rank(agent) -> IdleSender:
    """A rank that stepped, closed its hooks two minutes ago and whose process idles since, not exiting (HANG007's):
    its close, and its process's CPU time from the host collector."""
    return IdleSender(agent.telemetry_socket, [
        records.hello(0, job=ENDED_JOB), records.step(0, 1, job=ENDED_JOB),
        records.closed(0, job=ENDED_JOB, time=time.time() - 120)])


def _still_missing(missing: Callable[[], list[str]], timeout: float = 60.0) -> list[str]:
    """`missing()` polled until it lists nothing, for at most `timeout` seconds, and its last list. Polled, not
    slept on: the rate windows fill as scrapes come, later on a loaded machine."""
    deadline = time.monotonic() + timeout
    while (found := missing()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def test_every_dashboard_and_rule_expression_returns_data(start_agent, prometheus_server, tmp_path):
    agent = start_agent("--simulate", "dgx-h100", "--interval", "0.5")
    prometheus = prometheus_server([f"127.0.0.1:{agent.port}"], scrape_interval="1s")
    _honour_labels_and_load_rules(prometheus, tmp_path)

    stop = threading.Event()
    sender = threading.Thread(target=_gpu_job, args=(agent, stop), daemon=True)
    sender.start()
    hung = threading.Thread(target=_hung_job, args=(agent, stop), daemon=True)
    hung.start()
    stopped = threading.Thread(target=_stopped_jobs, args=(agent, stop), daemon=True)
    stopped.start()
    _dead_rank(agent)
    ended = _ended_rank(agent)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "gpuwatch.cli.main", "train", "--steps", "6", "--tp", "1", "--pp", "2",
             "--dp", "2", "--device", "cpu", "--layers", "2", "--job", GLOO_JOB],
            env={**os.environ, "GPUWATCH_SOCKET": str(agent.telemetry_socket)},
            capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        # Both jobs scraped with their own job label, and several scrapes of traffic for the rate windows.
        wait_until(lambda: prometheus.query(f'gpuwatch_train_step_seconds{{job="{GLOO_JOB}"}}'), what="gloo run")
        wait_until(lambda: prometheus.query(
            f'sum(rate(gpuwatch_train_collective_seconds_count{{job="{GPU_JOB}"}}[10s])) > 0'), what="gpu job")
        wait_until(lambda: prometheus.query("gpuwatch:gpu_rank:info"), what="recording rules")

        queries = {**dashboard_queries(), **rule_queries()}
        empty = _still_missing(lambda: [f"{where}: {expr}" for where, expr in queries.items()
                                        if not prometheus.query(expr)])
        assert not empty, "queries without data:\n" + "\n".join(empty)

        # The real CPU run alone fills the training panels that do not need a GPU.
        board = json.loads((JSON_DIR / f"{DASHBOARDS['training']}.json").read_text())
        silent = _still_missing(lambda: [
            panel["title"] for panel in board["panels"] if panel["title"] in GLOO_PANELS
            and not any(prometheus.query(_substitute(t["expr"]).replace('job=~".*"', f'job="{GLOO_JOB}"'))
                        for t in panel["targets"])])
        assert not silent, f"panels without data for the gloo run: {silent}"
    finally:
        stop.set()
        sender.join(5)
        hung.join(5)
        stopped.join(5)
        ended.close()

    # Prometheus loaded every rule and evaluates it without error.
    status, body, _ = http_get(prometheus.url + "/api/v1/rules")
    rules = [r for g in json.loads(body)["data"]["groups"] for r in g["rules"]]
    assert status == 200 and len(rules) == len(rule_queries())
    assert [r["name"] for r in rules if r["health"] != "ok"] == []
