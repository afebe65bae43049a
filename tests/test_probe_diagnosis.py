"""PERF005 fed by probe results: the rating it compares with (NVLink links, InfiniBand/RoCE ports × rails), when it
stays silent or does not run, and the three sources that carry a probe — a real simulated agent fed by a real
TelemetryClient, a run log, and a real Prometheus server."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from diagnose_facts import NDR, facts, node, port
from telemetry_records import probe

from gpuwatch.cli.main import main
from gpuwatch.diagnosis import engine
from gpuwatch.diagnosis.facts import BandwidthMeasurement
from gpuwatch.diagnosis.sources import run_log
from gpuwatch.trainer.telemetry import TelemetryClient

from conftest import wait_until

#: The simulated dgx-h100's ports: 400 Gb/s NDR InfiniBand.
PORT_RATE = 400e9 / 8


def measured(busbw: float, interconnect: str = "infiniband", op: str = "all_reduce", **fields) -> BandwidthMeasurement:
    values = dict(node="node-a", interconnect=interconnect, op=op, size_bytes=64 << 20, busbw_bytes_per_second=busbw,
                  ranks=16, job="job-1", ranks_per_node=8)
    values.update(fields)
    return BandwidthMeasurement(**values)


def perf005(*measurements: BandwidthMeasurement, nodes=None):
    result = engine.run(facts(nodes if nodes is not None else [node()], bandwidth=list(measurements)),
                        engine.select(["PERF005"]))
    return result.findings, {skipped.code: skipped.reason for skipped in result.skipped}


# -- the rule, on facts built in the test ----------------------------------------------------------


def test_network_rating_counts_the_ports_the_nodes_ranks_drive():
    """node(): 4 active NDR ports. 8 ranks per node drive all 4: 200 GB/s rated."""
    (finding,), _ = perf005(measured(100e9))
    assert finding.title == "InfiniBand on node-a delivers 50% of its rated bandwidth"
    assert finding.evidence[0].text == "rated 1600 Gb/s: 4 active InfiniBand port(s) of 400 Gb/s"
    assert finding.evidence[1].text == "all_reduce: peak bus bandwidth 800 Gb/s (50% of rated) at 64 MiB over 16 ranks"
    assert finding.evidence[1].where.as_dict() == {"node": "node-a", "job": "job-1"}
    assert perf005(measured(150e9)) == ([], {})  # 75 %: healthy
    assert perf005(measured(0.75 * NDR, ranks_per_node=1)) == ([], {})  # one rank drives one port
    (one_rail,), _ = perf005(measured(0.5 * NDR, ranks_per_node=None))  # unknown: one port, the least
    assert "50%" in one_rail.title


def test_only_ports_of_the_probed_link_layer_rate_it():
    mixed = [node(ib_ports=[port("mlx5_0"), port("mlx5_1", rate=100e9 / 8, link_layer="Ethernet")])]
    # 10 GB/s over InfiniBand is 20 % of the NDR port; the 100 Gb/s RoCE port must not lower the rating to 12.5 GB/s.
    (finding,), _ = perf005(measured(10e9, ranks_per_node=1), nodes=mixed)
    assert finding.title == "InfiniBand on node-a delivers 20% of its rated bandwidth"
    (roce,), _ = perf005(measured(5e9, "roce", ranks_per_node=1), nodes=mixed)
    assert roce.title == "RoCE on node-a delivers 40% of its rated bandwidth"


def test_the_best_op_is_judged_once_per_probe():
    # all-gather reaches 90 % of the rating: the path is fine, whatever all-reduce did.
    assert perf005(measured(0.5 * 200e9), measured(0.9 * 200e9, op="all_gather")) == ([], {})
    # The same probe seen through two sources (agent and run log) gives one evidence line per op.
    (finding,), _ = perf005(measured(100e9), measured(100e9), measured(80e9, op="reduce_scatter"))
    assert [e.text.split(":")[0] for e in finding.evidence] == ["rated 1600 Gb/s", "all_reduce", "reduce_scatter"]


def test_nvlink_rating_is_the_slowest_gpus_links_and_size_may_be_unknown():
    (finding,), _ = perf005(measured(0.6 * 18 * 26.5e9, "nvlink", size_bytes=None, ranks=None))
    assert finding.title == "NVLink on node-a delivers 60% of its rated bandwidth"
    assert finding.evidence[1].text == "all_reduce: peak bus bandwidth 2289.6 Gb/s (60% of rated)"


@pytest.mark.parametrize(("interconnect", "reason"), [
    ("loopback", "the probe measured loopback: a single-node gloo probe moves data through this host's loopback"),
    ("socket", "the probe measured socket: TCP sockets reach a share of the NIC rate"),
    ("pcie", "the probe measured pcie: PCIe peer traffic crosses switches"),
    ("unknown", "the probe measured unknown: the probe could not tell which interconnect"),
])
def test_unrated_paths_are_not_run_with_the_reason(interconnect, reason):
    findings, not_run = perf005(measured(1e6, interconnect))
    assert findings == [] and not_run["PERF005"].startswith(reason), not_run


def test_not_run_without_the_probed_nodes_link_facts():
    _, not_run = perf005(measured(1e9), nodes=[])
    assert not_run["PERF005"] == ("rated link speed unknown: no NVLink/port facts of the probed node(s) node-a "
                                  "(add --agent, or diagnose on the node)")


# -- through the sources --------------------------------------------------------------------------


def diagnose(*args: str) -> dict:
    result = CliRunner().invoke(main, ["diagnose", *args, "--select", "PERF005", "--format", "json"])
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.output)


def send(agent, record: dict) -> None:
    """One probe record through a real client; returns once the agent holds it."""
    with TelemetryClient(agent.telemetry_socket, heartbeat_interval=0) as client:
        client.send(record)
    wait_until(lambda: agent.state()["facts"]["telemetry"]["probes"] == [json.loads(json.dumps(record))],
               what="the probe in the agent's state")


@pytest.mark.integration
def test_perf005_fires_at_40_percent_through_agent_and_prometheus_not_at_80_and_not_for_loopback(
        start_agent, prometheus_server):
    agent = start_agent("--simulate", "dgx-h100", "--interval", "0.5", "--node", "sim-a")
    # Started first: Prometheus takes a few seconds to its first scrape, while the agent is diagnosed directly.
    prometheus = prometheus_server([f"127.0.0.1:{agent.port}"], scrape_interval="1s")

    send(agent, probe(busbw=0.4 * PORT_RATE, hostname="sim-a"))
    document = diagnose("--agent", agent.url)
    (finding,) = document["findings"]
    assert finding["title"] == "InfiniBand on sim-a delivers 40% of its rated bandwidth"
    assert finding["evidence"][0]["text"] == "rated 400 Gb/s: 1 active InfiniBand port(s) of 400 Gb/s"
    assert finding["evidence"][1]["values"]["busbw_bytes_per_second"] == 0.4 * PORT_RATE
    assert finding["evidence"][1]["where"] == {"node": "sim-a", "job": "job-42"}

    wait_until(lambda: prometheus.query("gpuwatch_probe_info"), what="the probe series in Prometheus")
    (finding,) = diagnose("--prometheus", prometheus.url)["findings"]
    assert finding["title"] == "InfiniBand on sim-a delivers 40% of its rated bandwidth"
    # Prometheus keeps the peak, not the size it was reached at; the rank count comes from gpuwatch_probe_info.
    assert finding["evidence"][1]["text"] == "all_reduce: peak bus bandwidth 160 Gb/s (40% of rated) over 2 ranks"

    send(agent, probe(busbw=0.8 * PORT_RATE, hostname="sim-a"))  # the latest probe of the job replaces it
    document = diagnose("--agent", agent.url)
    assert document["findings"] == [] and document["not_run"] == []

    send(agent, probe(interconnect="loopback", busbw=2e9, hostname="sim-a", nodes=1, hostnames=["sim-a"],
                      backend="gloo", device="cpu"))
    document = diagnose("--agent", agent.url)
    assert document["findings"] == []
    assert document["not_run"][0]["reason"].startswith("the probe measured loopback"), document["not_run"]


@pytest.mark.integration
def test_run_log_probe_is_judged_against_the_agents_links(start_agent, tmp_path):
    path = tmp_path / "probe.jsonl"
    with TelemetryClient(tmp_path / "no-agent.sock", run_log=path, heartbeat_interval=0) as client:
        client.send(probe(busbw=0.4 * PORT_RATE, hostname="sim-b"))
    gathered, reduced = run_log.read(path).bandwidth
    assert (reduced.node, reduced.op, reduced.busbw_bytes_per_second) == ("sim-b", "all_reduce", 0.4 * PORT_RATE)
    assert (gathered.op, gathered.size_bytes, gathered.ranks_per_node) == ("all_gather", 64 << 20, 1)
    alone = diagnose("--run-log", str(path))
    assert alone["not_run"][0]["reason"].startswith("rated link speed unknown"), alone["not_run"]

    agent = start_agent("--simulate", "dgx-h100", "--interval", "0.5", "--node", "sim-b")
    (finding,) = diagnose("--run-log", str(path), "--agent", agent.url)["findings"]
    assert finding["title"] == "InfiniBand on sim-b delivers 40% of its rated bandwidth"
