"""Diagnosis sources on real components: a simulated `gpuwatch agent` fed by a real TelemetryClient, a run log
written by the real client, and a real Prometheus server scraping two simulated agents."""

from __future__ import annotations

import json
import os
import time

import pytest
from click.testing import CliRunner
from telemetry_records import JOB, collectives, hello, step

from gpuwatch.agent.telemetry.window import MIN_WINDOW_STEPS
from gpuwatch.cli.main import main
from gpuwatch.diagnosis import engine
from gpuwatch.diagnosis.sources import agent as agent_source
from gpuwatch.diagnosis.sources import gather as sources_gather
from gpuwatch.diagnosis.sources import prometheus as prometheus_source
from gpuwatch.diagnosis.sources import run_log
from gpuwatch.trainer.telemetry import TelemetryClient

from conftest import FIXTURES, wait_until

pytestmark = pytest.mark.integration

#: CUDA memory of a healthy step: no allocation retries, little slack.
HEALTHY_MEMORY = {"kind": "cuda", "peak_bytes": 3 << 30, "allocated_bytes": 2 << 30, "reserved_bytes": 3 << 29,
                  "inactive_split_bytes": 1 << 20, "alloc_retries": 0, "ooms": 0}
#: The agents' own threads only: lighter on a small machine.
FAST = ("--simulate", "dgx-h100", "--interval", "0.5")


def diagnose(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["diagnose", *args, "--format", "json"])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.output)


def findings(document: dict, code: str) -> list[dict]:
    return [finding for finding in document["findings"] if finding["code"] == code]


def feed(agent, ranks: range, steps: dict[int, dict], hostname: str, env: dict[int, dict] | None = None,
         first: int = 1, count: int = MIN_WINDOW_STEPS, **hello_fields) -> None:
    """Each rank's hello (with the GPU it runs on, by the agent's UUIDs) and ``count`` step records numbered from
    ``first``: by default a window's worth (MIN_WINDOW_STEPS), the fewest the timing rules judge."""
    uuids = [gpu["uuid"] for gpu in agent.state()["facts"]["nvml"]["gpus"]]
    with TelemetryClient(agent.telemetry_socket, heartbeat_interval=0) as client:
        for rank in ranks:
            client.send(hello(rank, hostname=hostname, gpu={"index": rank % 4, "uuid": uuids[rank % 4]},
                              env=(env or {}).get(rank, {"NCCL_DEBUG": "WARN"}), **hello_fields))
            for number in range(first, first + count):
                client.send(step(rank, number, memory=HEALTHY_MEMORY, **steps.get(rank, {})))


def test_agent_source_finds_ib_disabled_straggler_and_nan(start_agent, monkeypatch):
    agent = start_agent(*FAST, "--node", "sim-a")
    feed(agent, range(8), {5: {"compute_seconds": 0.6}, 2: {"loss": float("nan")}}, "sim-a",
         env={3: {"NCCL_IB_DISABLE": "1"}}, world_size=16, dp_size=4)  # half of a job: it spans nodes
    wait_until(lambda: sum(r["last_step"] is not None for r in agent.state()["facts"]["telemetry"]["ranks"]) == 8,
               what="8 ranks with a step in the agent's state")

    status, document = diagnose("--agent", agent.url)
    assert status == 1
    assert {f["code"] for f in document["findings"]} == {"NCCL001", "PERF002", "CONV001"}, document["findings"]
    (ib,) = findings(document, "NCCL001")
    assert ib["evidence"][0]["where"] == {"node": "sim-a", "job": JOB, "rank": 3}
    assert [e["where"]["port"] for e in ib["evidence"][1:]] == [f"mlx5_{i}/1" for i in range(8)]
    assert "400 Gb/s" in ib["evidence"][1]["text"]
    (straggler,) = findings(document, "PERF002")
    assert straggler["title"] == (f"straggler in job {JOB}: rank 5 on sim-a is busy up to 1.91x the median, the "
                                  "extra in compute (forward and backward)")  # 0.63 s of phases against 0.33 s
    (nan,) = findings(document, "CONV001")
    assert nan["evidence"][0]["where"]["rank"] == 2 and "loss nan at step 5" in nan["evidence"][0]["text"]
    # The simulated hardware is healthy: every hardware rule ran and said nothing.
    not_run = {item["code"] for item in document["not_run"]}
    assert not not_run & {"HW001", "HW002", "HW003", "HW004", "HW005", "MEM002"}, document["not_run"]

    # Without a source option: this node read directly (here: a sysfs fixture), the ranks from the local agent.
    monkeypatch.setattr(sources_gather, "DEFAULT_AGENT_URL", agent.url)
    status, local = diagnose("--sysfs-root", str(FIXTURES / "procfs-infiniband" / "sys"), "--select", "NCCL001")
    assert status == 1 and local["summary"]["ranks"] == 8
    assert [s["kind"] for s in local["sources"]] == ["local", "agent"]
    (ib,) = local["findings"]
    assert ib["evidence"][0]["where"]["rank"] == 3
    assert [e["where"]["port"] for e in ib["evidence"][1:]] == ["hfi1_0/1", "mlx4_0/1", "mlx4_0/2", "mlx5_0/1"]


def test_agent_state_with_collectors_down_or_disabled():
    state = {
        "agent": {"node": "n1", "mode": "real"},
        "collectors": {"nvml": {"up": False, "last_error": "CollectorError: NVML library not found"},
                       "telemetry": {"up": True, "partial_errors": []}},
        "facts": {"telemetry": {"ranks": [{"job": "j", "rank": 0, "hello": hello(0, env={"NCCL_IB_DISABLE": "1"}),
                                           "last_step": None, "counters": {}, "collectives": {}, "sampled": {}}]}},
    }
    facts = agent_source.facts_from_state(state, "http://n1:9746/api/v1/state")
    node = facts.nodes["n1"]
    assert node.gpus is None and node.missing["gpus"] == "nvml collector down: CollectorError: NVML library not found"
    assert node.missing["ib_ports"] == "infiniband collector not enabled on the agent"
    result = engine.run(facts, engine.select(["NCCL001", "HW004"]))
    assert result.findings == []
    assert {s.code: s.reason for s in result.skipped} == {
        "NCCL001": "InfiniBand/RoCE port facts unknown (n1: infiniband collector not enabled on the agent)",
        "HW004": "GPU facts (NVML) unknown (n1: nvml collector down: CollectorError: NVML library not found)"}


def test_run_log_written_by_the_client_gives_history_rules(tmp_path):
    path = tmp_path / "run.jsonl"
    layout = {"world_size": 2, "tp_size": 1, "pp_size": 1, "dp_size": 2, "tp_rank": 0, "pp_stage": 0, "gpu": None}
    with TelemetryClient(tmp_path / "no-agent.sock", run_log=path, heartbeat_interval=0) as client:
        for rank in range(2):
            client.send(hello(rank, local_rank=rank, dp_rank=rank, **layout))
        for number in range(1, 41):
            for rank in range(2):
                client.send(step(rank, number, grad_norm=25.0 if number == 25 else 1.0,
                                 loss=float("nan") if number >= 30 and rank == 1 else 2.0 - 0.01 * number,
                                 memory={"kind": "host_rss", "peak_bytes": (1 << 30) + rank * number * (16 << 20)}))
    with path.open("a") as log:
        log.write("garbage\n")
        log.write(json.dumps(step(0, 41, loss="high")) + "\n")
        log.write(json.dumps(step(0, 41))[:50])  # a record still being written: no newline yet

    facts = run_log.read(path)
    assert [(r.rank, r.steps, r.nonfinite_steps, len(r.history.loss)) for r in facts.ranks] == [(0, 40, 0, 40),
                                                                                            (1, 40, 11, 40)]
    assert facts.notes == [f"{path}:85: the last line is still being written: skipped", f"{path}:83: not_json",
                           f"{path}:84: bad_type: loss"]

    status, document = diagnose("--run-log", str(path))
    assert status == 1
    assert {f["code"] for f in document["findings"]} == {"CONV001", "CONV002", "MEM003"}, document["findings"]
    (nan,) = findings(document, "CONV001")
    assert "rank 1: loss nan at step 30; 11 non-finite step(s)" in nan["evidence"][0]["text"]
    assert findings(document, "CONV002")[0]["title"] == f"gradient norm explosion in job {JOB}: 25 at step 25"
    (leak,) = findings(document, "MEM003")
    assert [e["where"]["rank"] for e in leak["evidence"]] == [1]
    assert document["sources"] == [{"kind": "run_log", "location": str(path)}]


def test_run_log_directory_of_one_file_per_rank(tmp_path):
    """`gpuwatch train --run-log DIR` writes DIR/rank-NNNNN.jsonl; diagnosis reads them together."""
    layout = {"world_size": 2, "tp_size": 1, "pp_size": 1, "dp_size": 2, "tp_rank": 0, "pp_stage": 0, "gpu": None}
    for rank in range(2):
        with TelemetryClient(tmp_path / "no-agent.sock", run_log=tmp_path / f"rank-{rank:05d}.jsonl",
                             heartbeat_interval=0) as client:
            client.send(hello(rank, local_rank=rank, dp_rank=rank, **layout))
            for number in range(1, 11):  # rank 1 computes 4x as long on every step but the last
                slow = rank == 1 and number < 10
                client.send(step(rank, number, compute_seconds=1.2 if slow else 0.3))
    facts = run_log.read(tmp_path)
    assert [(r.rank, r.steps, r.window.steps) for r in facts.ranks] == [(0, 10, 10), (1, 10, 10)]
    _, document = diagnose("--run-log", str(tmp_path), "--select", "PERF002")
    (straggler,) = findings(document, "PERF002")
    assert "rank 1 (node-1) is busy 1.23 s per step (median of 10 steps (1-10, " in straggler["evidence"][0]["text"]
    assert straggler["evidence"][0]["values"]["window_steps"] == 10

    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(main, ["diagnose", "--run-log", str(tmp_path / "empty")])
    assert result.exit_code == 2 and "holds no *.jsonl file" in result.output


def test_ranks_that_said_hello_and_never_stepped_are_a_finding_not_zero_ranks(start_agent, tmp_path):
    """A job whose steps the instrumentation never saw: its ranks' hellos reached the agent five minutes ago, and the
    run log, and no step followed. Both sources say so (HANG005) instead of judging nothing: from the agent with the
    hello's age, from the run log (read after the run) for certain."""
    agent = start_agent(*FAST, "--node", "sim-c")
    layout = {"world_size": 2, "tp_size": 1, "pp_size": 1, "dp_size": 2, "tp_rank": 0, "pp_stage": 0, "gpu": None}
    with TelemetryClient(agent.telemetry_socket, run_log=tmp_path / "run.jsonl", heartbeat_interval=0) as client:
        for rank in range(2):
            client.send(hello(rank, local_rank=rank, dp_rank=rank, hostname="sim-c", time=time.time() - 300, **layout))
    wait_until(lambda: len(agent.state()["facts"]["telemetry"]["ranks"]) == 2, what="2 ranks in the agent's state")
    told = {}
    for source in (("--agent", agent.url), ("--run-log", str(tmp_path / "run.jsonl"))):
        _, document = diagnose(*source, "--select", "HANG005")
        (finding,) = findings(document, "HANG005")
        assert finding["title"] == (f"job {JOB}: ranks 0-1 said hello but reported no step: gpuwatch measured "
                                    "nothing of its training")
        (told[source[0]],) = finding["evidence"]
    assert told["--agent"]["values"]["hello_age_seconds"] == pytest.approx(300, abs=10)  # by the agent's round
    assert "no step record since the hello" in told["--agent"]["text"]
    assert told["--run-log"]["text"] == "ranks 0-1 on sim-c: the run log ends after the hello without a step record"


def test_prometheus_over_two_simulated_nodes_names_the_straggler(start_agent, prometheus_server):
    agents = {name: start_agent(*FAST, "--node", name) for name in ("node-a", "node-b")}
    prometheus = prometheus_server([f"127.0.0.1:{a.port}" for a in agents.values()], scrape_interval="1s")
    feed(agents["node-a"], range(4), {}, "node-a")
    feed(agents["node-b"], range(4, 8), {}, "node-b")
    wait_until(lambda: len(prometheus.query("gpuwatch_train_compute_seconds")) == 8
               and len(prometheus.query("gpuwatch_gpu_info")) == 16 and prometheus.query("gpuwatch_gpu_job_info"),
               what="both nodes' GPUs and 8 ranks in Prometheus")

    status, healthy = diagnose("--prometheus", prometheus.url)
    assert status == 0 and healthy["summary"]["nodes"] == 2 and healthy["summary"]["ranks"] == 8
    assert [f for f in healthy["findings"] if f["severity"] != "info"] == []
    not_run = {item["code"] for item in healthy["not_run"]}
    assert not not_run & {"PERF002", "HW001", "HW002", "HW003", "HW004", "HW005", "MEM002", "CONV003", "TOPO002"}
    assert "NCCL001" in not_run  # these ranks set none of the NCCL variables the agent exports
    assert {name: node.cpus for name, node in prometheus_source.fetch(prometheus.url).nodes.items()} == \
        {"node-a": os.cpu_count(), "node-b": os.cpu_count()}  # for the timing rules' CPU-sharing judgement

    # Slow from step 6 on: once most of its window is slow, its median is (the window's evidence, not one step).
    feed(agents["node-b"], range(4, 8), {6: {"compute_seconds": 0.6}}, "node-b", first=1 + MIN_WINDOW_STEPS,
         count=2 * MIN_WINDOW_STEPS)
    wait_until(lambda: prometheus.query('gpuwatch_train_window_median_seconds{rank="6",timing="compute_seconds"} '
                                        '== 0.6'), what="the slow rank's window median in Prometheus")
    status, slow = diagnose("--prometheus", prometheus.url, "--fail-on", "warning")
    assert status == 1
    (straggler,) = findings(slow, "PERF002")
    assert straggler["title"] == (f"straggler in job {JOB}: rank 6 on node-b is busy up to 1.91x the median, the "
                                  "extra in compute (forward and backward)")
    assert straggler["evidence"][0]["where"] == {"node": "node-b", "job": JOB, "rank": 6}
    assert [f["code"] for f in slow["findings"] if f["severity"] != "info"] == ["PERF002"]


def test_agent_source_finds_the_rules_no_trainer_fault_reproduces(start_agent):
    """The settings and symptoms the reference trainer cannot produce on a CPU (NCCL settings, a heavy all-reduce
    tail, an input stall, a fragmented CUDA allocator, skewed gradients), sent by the real client as a GPU job's
    ranks would, to a real agent: each rule names its rank. Half of a 16-rank job runs here, so it spans nodes."""
    agent = start_agent(*FAST, "--node", "sim-b")
    uuids = [gpu["uuid"] for gpu in agent.state()["facts"]["nvml"]["gpus"]]
    env = {rank: {"NCCL_DEBUG": "WARN"} for rank in range(8)}
    env[0]["NCCL_SOCKET_IFNAME"], env[1]["NCCL_P2P_DISABLE"] = "ib9", "1"
    tail = collectives({"all_reduce": [0.001] * 90 + [0.01] * 10})  # p99 10x its p50, over 100 calls a step
    fragmented = {**HEALTHY_MEMORY, "reserved_bytes": 40 << 30, "allocated_bytes": 20 << 30,
                  "inactive_split_bytes": 12 << 30, "alloc_retries": 7}
    # every rank of pipeline stage 1 waits for its input: the job's input pipeline (a lone one would be a straggler)
    unusual = {rank: {"dataloader_wait_seconds": 0.3} for rank in range(4, 8)}
    unusual[2], unusual[4]["memory"] = {"collectives": tail}, fragmented
    with TelemetryClient(agent.telemetry_socket, heartbeat_interval=0) as client:
        for rank in range(8):
            client.send(hello(rank, hostname="sim-b", world_size=16, dp_size=4,
                              gpu={"index": rank, "uuid": uuids[rank]}, env=env[rank]))
            for number in range(1, MIN_WINDOW_STEPS + 1):
                client.send(step(rank, number, **{"memory": HEALTHY_MEMORY, "grad_cosine_similarity": 0.6,
                                                  **unusual.get(rank, {})}))
    wait_until(lambda: sum(r["last_step"] is not None for r in agent.state()["facts"]["telemetry"]["ranks"]) == 8,
               what="8 ranks with a step in the agent's state")

    status, document = diagnose("--agent", agent.url)
    assert status == 1
    assert {f["code"] for f in document["findings"]} == {"NCCL003", "NCCL004", "NCCL005", "PERF003", "MEM001",
                                                         "CONV005"}, document["findings"]
    ranks = {f["code"]: {e["where"].get("rank") for e in f["evidence"]} - {None} for f in document["findings"]}
    assert ranks["NCCL003"] == {0} and ranks["NCCL004"] == {1} and ranks["NCCL005"] == {2}
    assert ranks["PERF003"] == {4, 5, 6, 7} and ranks["MEM001"] == {4}
    (ifname,) = findings(document, "NCCL003")
    assert "ib9" in ifname["title"] + ifname["evidence"][0]["text"]
    assert ifname["fix"].startswith("export NCCL_SOCKET_IFNAME=")
    assert findings(document, "NCCL005")[0]["fix"].startswith("export NCCL_ALGO=Tree")
    (p2p,) = findings(document, "NCCL004")
    assert p2p["fix"] == "unset NCCL_P2P_DISABLE (or set them to 0)"
    (fragmentation,) = findings(document, "MEM001")
    assert "expandable_segments:True" in fragmentation["fix"]
    assert findings(document, "CONV005")[0]["severity"] == "info"
