"""`gpuwatch probe`: the bandwidth arithmetic against hand computations, how it names the interconnect, its
command line, and a real gloo run that reports to a real (simulated-node) agent."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from click.testing import CliRunner
from telemetry_records import samples

from gpuwatch.agent.simulate import PRESETS
from gpuwatch.agent.simulate.sysfs import SimulatedSysfs
from gpuwatch.cli.main import main
from gpuwatch.protocol.interconnect import NodeLinks, classify
from gpuwatch.protocol.schema import MAX_RECORD_BYTES, decode, encode
from gpuwatch.trainer import probe
from gpuwatch.trainer.probe import Measurement, Result, bus_factor, element_count, probe_record, sweep

from conftest import wait_until


def test_bus_factors_and_bandwidths_match_hand_computation():
    assert bus_factor("all_reduce", 2) == 1.0  # 2·1/2
    assert bus_factor("all_reduce", 4) == 1.5  # 2·3/4
    assert bus_factor("all_reduce", 8) == 1.75  # 2·7/8
    assert bus_factor("all_gather", 4) == 0.75  # 3/4
    assert bus_factor("reduce_scatter", 8) == 0.875  # 7/8
    assert [bus_factor(op, 1) for op in ("all_reduce", "all_gather", "reduce_scatter")] == [0, 0, 0]

    # 1 MiB all-reduced by 4 ranks in 1 ms: 1,048,576 B / 0.001 s = 1.048576 GB/s; × 1.5 on the bus.
    reduced = Result("all_reduce", 2**20, 2**18, 1e-3, ranks=4)
    assert reduced.algbw == pytest.approx(1.048576e9) and reduced.busbw == pytest.approx(1.572864e9)
    # 8 MiB gathered by 8 ranks in 2 ms: 4.194304 GB/s; × 7/8 = 3.670016 GB/s.
    gathered = Result("all_gather", 8 * 2**20, 2**21, 2e-3, ranks=8)
    assert gathered.algbw == pytest.approx(4.194304e9) and gathered.busbw == pytest.approx(3.670016e9)


def test_sweep_sizes_and_element_counts():
    assert sweep(1024, 2**20, 4) == [1024, 4096, 16384, 65536, 262144, 1048576]
    assert sweep(1000, 5000, 2) == [1000, 2000, 4000]
    assert sweep(8, 8, 2) == [8]
    assert element_count("all_reduce", 1024, 3) == 256
    assert element_count("all_gather", 1024, 3) == 255  # the gathered buffer splits evenly over the ranks
    assert element_count("reduce_scatter", 4, 2) == 0  # too small to split: the size is skipped


NVLINK_NODE = NodeLinks(nvlink_up=True, active_link_layers=frozenset({"InfiniBand"}))  # a DGX: NVLink, NDR ports
ROCE_NODE = NodeLinks(nvlink_up=True, active_link_layers=frozenset({"Ethernet"}))


ONE, TWO = ["a", "a"], ["a", "b"]  # the ranks' hosts: one node, two nodes


@pytest.mark.parametrize(("backend", "hosts", "env", "links", "expected"), [
    ("gloo", ONE, {}, None, "loopback"),
    ("gloo", ["a", "b", "c", "d"], {}, None, "socket"),
    ("nccl", ["a"], {}, NVLINK_NODE, "loopback"),  # one rank: nothing crosses a link, busbw is 0
    ("nccl", ONE, {}, NVLINK_NODE, "nvlink"),
    ("nccl", ONE, {"NCCL_P2P_DISABLE": "1"}, NVLINK_NODE, "pcie"),
    ("nccl", ONE, {}, NodeLinks(nvlink_up=False, active_link_layers=frozenset()), "pcie"),  # links all down
    ("nccl", ONE, {}, NodeLinks(nvlink_up=None, active_link_layers=None), "unknown"),
    ("nccl", TWO, {}, NVLINK_NODE, "infiniband"),
    ("nccl", TWO, {"NCCL_IB_DISABLE": "0"}, NVLINK_NODE, "infiniband"),
    ("nccl", TWO, {"NCCL_IB_DISABLE": "1"}, NVLINK_NODE, "socket"),
    ("nccl", TWO, {"NCCL_NET": "Socket"}, NVLINK_NODE, "socket"),
    ("nccl", TWO, {"NCCL_NET": "AWS Libfabric"}, NVLINK_NODE, "unknown"),
    ("nccl", TWO, {}, ROCE_NODE, "roce"),
    ("nccl", TWO, {}, NodeLinks(nvlink_up=True, active_link_layers=frozenset()), "socket"),  # no port ACTIVE
    ("nccl", TWO, {}, NodeLinks(nvlink_up=True, active_link_layers=None), "unknown"),
    ("nccl", TWO, {}, None, "unknown"),
])
def test_classify_names_the_path_honestly(backend, hosts, env, links, expected):
    assert classify(backend, hosts, env, links) == expected


def test_the_probe_reads_its_node_links_with_the_agents_collectors(tmp_path):
    """A simulated DGX H100's sysfs: 8 active InfiniBand ports read as such; no NVML driver here, NVLink unknown."""
    sysfs = SimulatedSysfs(PRESETS["dgx-h100"], tmp_path / "sys")
    links = probe._node_links(sysfs.root)
    assert links.active_link_layers == frozenset({"InfiniBand"})


def test_largest_probe_record_fits_one_datagram():
    """3 ops × 30 sizes up to 512 GiB, 17-digit times, 16 hosts of 255 characters: still one valid datagram."""
    hosts = [f"{'h' * 250}{i:05d}" for i in range(16)]
    results = [Result(op, 2**(10 + k), 2**(8 + k), 1.2345678912345e-05 * (k + 1), ranks=32)
               for op in ("all_reduce", "all_gather", "reduce_scatter") for k in range(30)]
    record = probe_record(Measurement(results, hosts * 2, "nccl", "cuda", "infiniband"), "job-" + "9" * 120)
    payload = encode(record)
    assert len(payload) <= MAX_RECORD_BYTES
    body = decode(payload).body.as_dict()
    assert (body["nodes"], len(body["hostnames"]), body["ranks_per_node"]) == (16, 8, 2)
    assert len(body["results"]) == 90


def test_probe_is_listed_and_helps_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"  # any import of torch would now raise
            "from click.testing import CliRunner\n"
            "from gpuwatch.cli.main import main\n"
            "listing = CliRunner().invoke(main, ['--help'])\n"
            "assert listing.exit_code == 0 and 'probe' in listing.output, listing.output\n"
            "result = CliRunner().invoke(main, ['probe', '--help'])\n"
            "assert result.exit_code == 0, result.output\n"
            "print(result.output)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "algbw x 2(n-1)/n for all-reduce" in result.stdout and "--min-bytes" in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--min-bytes", "1M", "--max-bytes", "1K"], "--min-bytes 1048576 is larger than --max-bytes 1024"),
    (["--min-bytes", "1", "--max-bytes", "1G"], "31 sizes x 3 ops = 93 results"),
    (["--max-bytes", "4", "--min-bytes", "4", "--nproc", "2"], "at least one float32 per rank: 8 bytes"),
    (["--ops", "all_reduce,all_to_all"], "all_to_all: choose from all_reduce, all_gather, reduce_scatter"),
    (["--min-bytes", "12X"], "'12X' is not a byte count"),
])
def test_usage_errors_exit_2_before_any_rank_starts(args, message):
    result = CliRunner().invoke(main, ["probe", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def _table(output: str) -> dict[str, list[list[str]]]:
    """The printed rows of each op's block."""
    blocks: dict[str, list[list[str]]] = {}
    current = None
    for line in output.splitlines():
        if line.startswith("# ") and ": busbw = algbw x" in line:
            current = blocks.setdefault(line[2:].split(":")[0], [])
        elif line and not line.startswith("#"):
            current.append(line.split())
    return blocks


@pytest.mark.integration
def test_gloo_probe_prints_the_table_and_the_agent_exports_it(start_agent, tmp_path):
    agent = start_agent("--simulate", "dgx-h100", "--interval", "0.5", "--node", "sim-a")
    run_log = tmp_path / "probe.jsonl"
    result = CliRunner(env={"GPUWATCH_SOCKET": str(agent.telemetry_socket)}).invoke(main, [
        "probe", "--nproc", "3", "--device", "cpu", "--min-bytes", "1K", "--max-bytes", "256K", "--factor", "16",
        "--iters", "3", "--warmup", "1", "--job", "probe-e2e", "--run-log", str(run_log)])
    assert result.exit_code == 0, result.output
    assert "# gpuwatch probe: 3 ranks on 1 node(s) (3 per node), gloo on cpu, interconnect: loopback" in result.output
    assert f"# sent to the agent at {agent.telemetry_socket}" in result.output
    assert "# Avg bus bandwidth    : " in result.output

    table = _table(result.output)
    assert [[row[0] for row in rows] for rows in table.values()] == [["1024", "16384", "262144"],
                                                                     ["1020", "16380", "262140"],
                                                                     ["1020", "16380", "262140"]]
    assert list(table) == ["all_reduce", "all_gather", "reduce_scatter"]
    assert all(row[2] == "float32" for rows in table.values() for row in rows)

    (line,) = run_log.read_text().splitlines()
    body = decode(line.encode()).body.as_dict()
    assert (body["world_size"], body["nodes"], body["backend"], body["interconnect"]) == (3, 1, "gloo", "loopback")
    for row in body["results"]:
        assert row["algbw_bytes_per_second"] == pytest.approx(row["bytes"] / row["seconds"], rel=2e-3)
        factor = 4 / 3 if row["op"] == "all_reduce" else 2 / 3
        assert row["busbw_bytes_per_second"] == pytest.approx(row["algbw_bytes_per_second"] * factor, rel=2e-3)
    peak = max(r["busbw_bytes_per_second"] for r in body["results"] if r["op"] == "all_reduce")
    assert peak > 0
    printed = max(float(row[5]) for row in table["all_reduce"])
    assert math.isclose(printed, peak / 1e9, abs_tol=1e-3)

    def exported() -> dict:
        return samples(agent.get("/metrics").decode(), "gpuwatch_probe_bus_bandwidth_bytes_per_second")

    series = wait_until(exported, what="the probe's series on /metrics")
    assert series[frozenset({("job", "probe-e2e"), ("op", "all_reduce"), ("interconnect", "loopback")})] == peak
    assert len(series) == 3  # one per op, not per size
    (kept,) = agent.state()["facts"]["telemetry"]["probes"]
    assert kept["results"] == body["results"]

    # The probe measured loopback: PERF005 has nothing to compare with and says so.
    diagnosed = CliRunner().invoke(main, ["diagnose", "--agent", agent.url, "--select", "PERF005", "--format", "json"])
    document = json.loads(diagnosed.output)
    assert document["findings"] == []
    (skipped,) = document["not_run"]
    assert skipped["code"] == "PERF005" and "the probe measured loopback" in skipped["reason"], skipped
