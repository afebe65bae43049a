"""`gpuwatch agent` as a real process receiving telemetry: series, state, TTL, hostile input, SIGKILL."""

import json
import os
import random
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from telemetry_records import JOB, coordinates, hello, samples, step

from gpuwatch.agent.telemetry.store import TelemetryStore
from gpuwatch.protocol.schema import MAX_RECORD_BYTES, encode
from gpuwatch.trainer.telemetry import TelemetryClient

from conftest import require_tool, wait_until

pytestmark = pytest.mark.integration

# Only the telemetry collector: these tests are about it, and the machine is small.
TELEMETRY_ONLY = ("--no-collector.nvml", "--no-collector.nvlink", "--no-collector.infiniband",
                  "--no-collector.host", "--interval", "0.2")
SECRETS = {"AWS_SECRET_ACCESS_KEY": "AKIAsecretvalue", "WANDB_API_KEY": "wandbsecretvalue",
           "NCCL_FAKE_TOKEN": "tokensecretvalue"}


def _promtool_clean(text: str) -> None:
    check = subprocess.run([require_tool("promtool"), "check", "metrics"], input=text, capture_output=True,
                           text=True)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check


def _telemetry_facts(agent) -> dict:
    return agent.state()["facts"]["telemetry"]


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_ranks_series_and_hellos_reach_metrics_and_state(start_agent):
    agent = start_agent("--simulate", "a100-roce", "--interval", "0.2", "--log-level", "debug")
    client = TelemetryClient(agent.telemetry_socket, heartbeat_interval=0)
    for rank in range(8):
        # A careless client that copied secrets into its hello: the agent must drop them.
        client.send(hello(rank, env={"NCCL_DEBUG": "INFO", **SECRETS}))
    for number in (1, 2, 3):
        for rank in range(8):
            client.send(step(rank, number, step_seconds=0.5 + rank / 100, loss=3.0 / number))
    # A rank's hello can be in the state before its first step (last_step still None): wait for the steps.
    wait_until(lambda: [(r["last_step"] or {}).get("step") for r in _telemetry_facts(agent)["ranks"]] == [3] * 8,
               what="8 ranks at step 3 in /api/v1/state")

    text = agent.get("/metrics").decode()
    assert samples(text, "gpuwatch_train_step_seconds")[coordinates(5)] == 0.55
    assert samples(text, "gpuwatch_train_loss")[coordinates(5)] == 1.0
    assert samples(text, "gpuwatch_train_tokens_total")[coordinates(2)] == 3 * 4096
    assert samples(text, "gpuwatch_train_alloc_retries_total")[coordinates(2)] == 3
    assert samples(text, "gpuwatch_train_collective_seconds_count")[coordinates(4, op="all_reduce")] == 6
    assert samples(text, "gpuwatch_train_pipeline_bubble_ratio")[coordinates(7)] == 0.2
    assert samples(text, "gpuwatch_train_memory_peak_bytes")[coordinates(0, kind="cuda")] == 3 << 30
    assert len(samples(text, "gpuwatch_gpu_job_info")) == 8
    assert samples(text, "gpuwatch_telemetry_ranks") == {frozenset({("job", JOB)}): 8}
    assert 'gpuwatch_collector_up{collector="telemetry"} 1.0' in text
    _promtool_clean(text)

    state = agent.get("/api/v1/state").decode()
    ranks = json.loads(state)["facts"]["telemetry"]["ranks"]
    assert [(r["rank"], r["hello"]["tp_rank"], r["hello"]["pp_stage"], r["hello"]["dp_rank"]) for r in ranks] == \
        [(rank, rank % 2, rank // 4, rank // 2 % 2) for rank in range(8)]
    assert ranks[0]["hello"]["env"] == {"NCCL_DEBUG": "INFO"}
    for name, value in SECRETS.items():
        assert name not in state and value not in state and name not in text and value not in text
    _, log = agent.stop()
    assert "telemetry" in log and not any(value in log for value in SECRETS.values())  # nor in the agent's log


def test_silent_ranks_expire_after_the_ttl_while_live_ones_stay(start_agent):
    agent = start_agent(*TELEMETRY_ONLY, "--telemetry.ttl", "1")
    client = TelemetryClient(agent.telemetry_socket, heartbeat_interval=0)
    client.send(hello(0))
    client.send(hello(1))
    client.send(step(0))
    wait_until(lambda: coordinates(0) in samples(agent.get("/metrics").decode(), "gpuwatch_train_loss"),
               timeout=10, what="rank 0 exported")

    def rank_0_expired() -> bool:  # rank 1 keeps reporting, rank 0 is silent
        client.send(step(1))
        return coordinates(0) not in samples(agent.get("/metrics").decode(), "gpuwatch_train_loss")

    # however slow the machine: rank 0 goes once the TTL has passed, and a rank that reports stays meanwhile
    wait_until(rank_0_expired, timeout=30, interval=0.2, what="rank 0 expired")
    text = agent.get("/metrics").decode()
    assert coordinates(0) not in samples(text, "gpuwatch_train_loss")
    assert coordinates(0) not in samples(text, "gpuwatch_train_rank_info")
    assert coordinates(1) in samples(text, "gpuwatch_train_loss")
    assert [r["rank"] for r in _telemetry_facts(agent)["ranks"]] == [1]


def _hostile_datagrams() -> list[bytes]:
    rng = random.Random(4)
    valid = encode(step())
    nested: object = 0
    for _ in range(50):
        nested = {"x": nested}
    datagrams = [
        *(rng.randbytes(rng.randrange(1, 300)) for _ in range(200)),
        *(valid[:cut] for cut in range(1, len(valid), 97)),  # truncated JSON
        b"[1, 2]", encode(step(v=0)), encode(step(kind="bye")), encode({"v": 1, "kind": "step"}),
        encode(step(loss="2.5")), encode(step(rank=-1)), encode(step(memory=[1])),  # wrong types, ranges
        encode(step(step_seconds=float("nan"))), encode(step(lr=float("inf"))),  # NaN/Inf where illegal
        b'{"v":1,"kind":"step","pad":"' + b"x" * MAX_RECORD_BYTES + b'"}',  # oversized
        encode(step(extension=nested)), b"[" * 10000,  # deeply nested
        *(encode(step(job=job)) for job in ('a"b', "a\nb", "a}b", 'x",rank="1', "a\\")),  # label injection
        encode(hello(0, future={"field": [1, 2, 3]})), encode(step(0, unknown_metric=1.0)),  # unknown: accepted
    ]
    # A rank-id flood with bulky hellos, so keeping them all would show in the agent's memory.
    bulky_env = {f"NCCL_SETTING_{i}": "v" * 200 for i in range(30)}
    datagrams += [encode(hello(rank, job="flood", world_size=6000, pp_stage=rank // 4 % 2, env=bulky_env))
                  for rank in range(6000)]
    return datagrams


def test_hostile_input_is_rejected_and_counted_and_the_exposition_stays_valid(start_agent):
    agent = start_agent(*TELEMETRY_ONLY, "--telemetry.max-ranks", "64")
    datagrams = _hostile_datagrams()
    expected = TelemetryStore(max_ranks=64)  # the same datagrams through the same code, in-process
    for datagram in datagrams:
        expected.ingest(datagram)
    _, expected_records = expected.snapshot()
    assert expected_records["accepted", ""] == 2 + 63  # the two with unknown fields take one rank slot
    assert expected_records["rejected", "cardinality"] == 6000 - 63
    assert all(count for (result, _), count in expected_records.items() if result == "rejected")

    rss_before = _rss_bytes(agent.proc.pid)
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # blocking: a test sender can wait, a rank never
    for datagram in datagrams:
        sender.sendto(datagram, str(agent.telemetry_socket))

    def counts() -> dict:
        records = _telemetry_facts(agent)["records"]
        return {("accepted", ""): records["accepted"],
                **{(result, reason): count for result in ("rejected", "dropped")
                   for reason, count in records[result].items()}}

    wait_until(lambda: counts() == expected_records, timeout=30, what="every datagram counted")
    assert agent.proc.poll() is None
    text = agent.get("/metrics").decode()
    assert sum(samples(text, "gpuwatch_telemetry_ranks").values()) == 64
    assert samples(text, "gpuwatch_telemetry_records_total")[
        frozenset({("result", "rejected"), ("reason", "bad_label")})] == 5
    _promtool_clean(text)
    # Without the cap the 6000 bulky hellos cost ~250 MB (measured); with it, 64 ranks are kept.
    assert _rss_bytes(agent.proc.pid) - rss_before < 16 << 20


def test_agent_killed_and_restarted_on_the_same_socket_resumes_delivery(start_agent):
    first = start_agent(*TELEMETRY_ONLY)
    client = TelemetryClient(first.telemetry_socket, heartbeat_interval=0)
    client.send(hello(3))
    client.send(step(3, 1))
    wait_until(lambda: _telemetry_facts(first)["ranks"], timeout=10, what="rank 3 at the first agent")

    first.stop(signal.SIGKILL)
    assert first.telemetry_socket.is_socket()  # what a killed agent leaves behind
    client.send(step(3, 2))
    client.send(step(3, 3))
    assert client.drops["no_agent"] == 2

    # The flag, not GPUWATCH_SOCKET (a fresh path here), says where the second agent listens.
    second = start_agent(*TELEMETRY_ONLY, "--telemetry.socket", str(first.telemetry_socket))
    client.send(step(3, 4))
    # Two datagrams: a state request read between them would show the hello alone.
    (rank,) = wait_until(lambda: [r for r in _telemetry_facts(second)["ranks"] if r["last_step"]], timeout=10,
                         what="rank 3's step at the second agent")
    assert rank["hello"]["rank"] == 3 and rank["last_step"]["step"] == 4  # the hello was re-sent first
    assert _telemetry_facts(second)["records"]["dropped"]["no_agent"] == 2  # reported by the client
    assert second.state()["collectors"]["telemetry"]["up"] is True


def test_the_host_collector_attributes_resident_memory_and_cpu_to_the_ranks_that_report(start_agent):
    """The ranks' pids come from the kernel with each record (SO_PASSCRED), so the host collector exports the
    training processes' RSS and CPU time labelled with their job and rank, not only the agent's own."""
    agent = start_agent("--no-collector.nvml", "--no-collector.nvlink", "--no-collector.infiniband",
                        "--interval", "0.2")
    with TelemetryClient(agent.telemetry_socket, heartbeat_interval=0) as client:
        client.send(hello(3))
        client.send(step(3, 1))
        own = {("pid", str(os.getpid())), ("job", JOB), ("rank", "3")}
        wait_until(lambda: any(own <= labels for labels in samples(agent.get("/metrics").decode(),
                                                                   "gpuwatch_host_process_resident_bytes")),
                   what="this process's RSS, labelled as job-42 rank 3")
    text = agent.get("/metrics").decode()
    (rss,) = [value for labels, value in samples(text, "gpuwatch_host_process_resident_bytes").items() if own <= labels]
    assert rss == pytest.approx(_rss_bytes(os.getpid()), rel=0.5)
    assert any(own <= labels for labels in samples(text, "gpuwatch_host_process_cpu_seconds_total"))
