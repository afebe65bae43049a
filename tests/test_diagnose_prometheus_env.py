"""The ranks' NCCL environment reaches Prometheus (gpuwatch_train_env_info), so NCCL001 runs with --prometheus: a
real simulated agent fed by the real TelemetryClient, scraped by a real Prometheus server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from telemetry_records import JOB, hello, step

from gpuwatch.cli.main import main
from gpuwatch.protocol.schema import EXPORTED_ENV, MAX_EXPORTED_ENV_VALUE_CHARS
from gpuwatch.trainer.telemetry import TelemetryClient

from conftest import wait_until

pytestmark = pytest.mark.integration

RULES = Path(__file__).resolve().parent.parent / "diagnosis" / "rules"
HEALTHY_MEMORY = {"kind": "cuda", "peak_bytes": 3 << 30, "allocated_bytes": 2 << 30, "reserved_bytes": 3 << 29,
                  "inactive_split_bytes": 1 << 20, "alloc_retries": 0, "ooms": 0}


def _diagnose(url: str, *extra: str) -> dict:
    result = CliRunner().invoke(main, ["diagnose", "--prometheus", url, "--format", "json", *extra])
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.output)


def test_every_variable_a_rule_reads_is_exported():
    """A rule reading a variable the agent does not export would judge it unset through Prometheus."""
    read = set()
    for source in RULES.glob("*.py"):
        read |= set(re.findall(r'"((?:NCCL|PYTORCH|TORCH|CUDA)_[A-Z0-9_]+)"', source.read_text()))
    assert read and read <= set(EXPORTED_ENV)


@pytest.mark.parametrize("honor_labels", [False, True])
def test_nccl001_fires_through_prometheus(start_agent, prometheus_server, honor_labels):
    agent = start_agent("--simulate", "dgx-h100", "--interval", "0.5", "--node", "node-a")
    prometheus = prometheus_server([f"127.0.0.1:{agent.port}"], scrape_interval="1s", honor_labels=honor_labels)
    uuids = [gpu["uuid"] for gpu in agent.state()["facts"]["nvml"]["gpus"]]
    too_long = "x" * (MAX_EXPORTED_ENV_VALUE_CHARS + 1)
    environments = {rank: {"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": too_long} for rank in range(4)}
    environments[1] = {"NCCL_IB_DISABLE": "1", "NCCL_ALGO": 'Ring"\\\n', "MASTER_PORT": "29500"}
    with TelemetryClient(agent.telemetry_socket, heartbeat_interval=0) as client:
        for rank, env in environments.items():
            client.send(hello(rank, hostname="node-a", gpu={"index": rank, "uuid": uuids[rank]}, env=env))
            client.send(step(rank, 1, memory=HEALTHY_MEMORY))
    wait_until(lambda: len(prometheus.query("gpuwatch_train_compute_seconds")) == 4
               and prometheus.query("gpuwatch_train_env_info") and prometheus.query("gpuwatch_ib_port_up"),
               what="4 ranks, their environment and the IB ports in Prometheus")

    exported = {(s["metric"]["rank"], s["metric"]["name"], s["metric"]["value"])
                for s in prometheus.query("gpuwatch_train_env_info")}
    # Only the variables rules read, escaped and unescaped intact; over-long values and other names stay out.
    assert exported == {("1", "NCCL_IB_DISABLE", "1"), ("1", "NCCL_ALGO", 'Ring"\\\n')}

    document = _diagnose(prometheus.url)
    (finding,) = [f for f in document["findings"] if f["code"] == "NCCL001"]
    assert finding["evidence"][0]["where"]["node"] == "node-a"
    assert "NCCL_IB_DISABLE=1" in finding["evidence"][0]["text"]
    assert "rank 1" in json.dumps(finding) and JOB in json.dumps(finding)
    assert "NCCL001" not in {item["code"] for item in document["not_run"]}

    # The outlier fetch finds the same (the rank whose environment differs from its job's majority is read in
    # detail); without honor_labels it says it pulled every series instead.
    outliers = _diagnose(prometheus.url, "--prometheus.fetch", "outliers")
    assert outliers["sources"][0]["fetch"] == ("outliers" if honor_labels else "full")
    assert [f for f in outliers["findings"] if f["code"] == "NCCL001"] == [finding]
    assert honor_labels or any("without honor_labels" in note for note in outliers["notes"])
