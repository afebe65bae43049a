"""One DDP job over two "nodes" joined by a real link: two network namespaces, each with its own hostname (a UTS
namespace), its own `gpuwatch agent --simulate` and 2 ranks of a 4-rank job (`gpuwatch run -- torchrun --nnodes 2`,
gloo over the veth pair between them, GLOO_SOCKET_IFNAME set). Only private addresses (RFC 1918) on the veths the
fixture makes; the namespaces are deleted on the way out, also on failure. Needs root (CI runs as root); where
namespaces cannot be made, each test skips with one line saying why.

A real Prometheus in node a scrapes both agents throughout. A healthy job is quiet; with node b's side of the link
throttled to 50 Mbit/s (`tc ... tbf`), PERF004 names the network (its bus bandwidth against the NIC's rating, the nodes,
what each node's NIC carried over the step window), from both agents and from Prometheus alike; node a's agent alone,
which sees ranks 0-1 only, gives no verdict on the job, only whom its ranks wait for. A compute straggler on node b is
PERF002 from every view of all ranks (both agents, Prometheus, the run log) and never network blame from node a's
partial view. `gpuwatch probe` across the throttled link measures the tbf rate."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from foreign import SERIOUS, Diagnosis
from foreign import diagnose as diagnose_source

from conftest import require_tool, stop_server, wait_until

pytestmark = pytest.mark.integration

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "wide_ddp.py"
#: Private addresses of node a and node b on the veth pair (RFC 1918).
ADDRESSES = ("10.231.7.1", "10.231.7.2")
AGENT_PORT = 9411
PROMETHEUS_PORT = 9412
MASTER_PORT = 29531
#: The tbf rate, in bytes per second.
THROTTLED_BYTES_PER_SECOND = 50e6 / 8
#: The throttled link: tbf, as the issue tried it (netem is not available everywhere).
THROTTLE = ("rate", "50mbit", "burst", "32kbit", "latency", "400ms")
RUN_TIMEOUT_S = 240


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclasses.dataclass
class Node:
    name: str  # the hostname, and the namespace's suffix
    namespace: str
    veth: str
    address: str
    workdir: Path
    agent: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{AGENT_PORT}"

    @property
    def socket(self) -> Path:
        return self.workdir / "telemetry.sock"

    def command(self, *args: str) -> list[str]:
        """``args`` run in the node: its network namespace and a UTS namespace of its own named after it."""
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.name, *args]

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "GPUWATCH_SOCKET": str(self.socket), "OMP_NUM_THREADS": "1", **extra}


@dataclasses.dataclass
class Cluster:
    nodes: tuple[Node, Node]
    #: Prometheus, in node a, scraping both agents (its URL from inside the nodes)
    prometheus_url: str = ""

    def run_job(self, job: str, *workload_args: str, run_log: Path | None = None) -> None:
        """The 4-rank job, 2 ranks a node, under ``gpuwatch run``; both halves must finish. ``run_log``: every
        rank's records also go there (the nodes share this machine's file system)."""
        self._torchrun(job, 2, ("-m", "gpuwatch.cli.main", "run", "--", sys.executable), (str(WORKLOAD),
                                                                                          *workload_args),
                       {"GPUWATCH_RUN_LOG": str(run_log)} if run_log is not None else {})

    def probe(self, job: str, run_log: Path, *probe_args: str) -> None:
        """``gpuwatch probe`` as one rank a node, under torchrun (docs/probe.md), its record in ``run_log``."""
        self._torchrun(job, 1, (), ("-m", "gpuwatch.trainer.probe", "--device", "cpu", "--job", job,
                                    "--run-log", str(run_log), *probe_args), {})

    def _torchrun(self, job: str, per_node: int, wrapper: tuple[str, ...], command: tuple[str, ...],
                  env: dict[str, str]) -> None:
        master = self.nodes[0].address
        procs = []
        for index, node in enumerate(self.nodes):
            cmd = node.command(sys.executable, *wrapper, "-m", "torch.distributed.run", "--nnodes", "2",
                               "--node-rank", str(index), "--nproc-per-node", str(per_node), "--master-addr", master,
                               "--master-port", str(MASTER_PORT), *command)
            procs.append(subprocess.Popen(cmd, env=node.env(GPUWATCH_JOB=job, GLOO_SOCKET_IFNAME=node.veth, **env),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        outputs = []
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=RUN_TIMEOUT_S)[0])
            except subprocess.TimeoutExpired:
                for p in procs:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, 9)
                raise
        assert all(p.returncode == 0 for p in procs), "\n".join(outputs)[-4000:]

    def diagnose(self, job: str, *nodes: Node) -> list[dict]:
        """``gpuwatch diagnose --agent`` of the given nodes' agents, run from node a; the job's findings (and those
        naming no job: the nodes' own)."""
        args = [a for node in nodes for a in ("--agent", node.url)]
        result = subprocess.run(self.nodes[0].command(sys.executable, "-m", "gpuwatch.cli.main", "diagnose", *args,
                                                      "--format", "json", "--fail-on", "never"),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return Diagnosis("agent", job, json.loads(result.stdout)).findings()

    def diagnose_prometheus(self, job: str) -> list[dict]:
        """``gpuwatch diagnose --prometheus`` of the Prometheus in node a, once it holds the end of every rank of
        ``job``."""
        query = urllib.parse.urlencode({"query": f'gpuwatch_train_window_last_step{{exported_job="{job}"}}'})

        def scraped() -> bool:
            series = json.loads(self.fetch(self.nodes[0], f"{self.prometheus_url}/api/v1/query?{query}"))
            ends = {r["metric"]["rank"]: float(r["value"][1]) for r in series["data"]["result"]}
            return len(ends) == 4 and all(end > 0 for end in ends.values())

        wait_until(scraped, what=f"Prometheus holding every rank of {job}")
        time.sleep(3)  # a few more scrapes: every rank's window at its last step
        result = subprocess.run(self.nodes[0].command(sys.executable, "-m", "gpuwatch.cli.main", "diagnose",
                                                      "--prometheus", self.prometheus_url, "--format", "json",
                                                      "--fail-on", "never"),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return Diagnosis("prometheus", job, json.loads(result.stdout)).findings()

    @staticmethod
    def fetch(node: Node, url: str) -> str:
        """GET ``url`` from inside ``node``."""
        fetched = subprocess.run(node.command(sys.executable, "-c", "import sys, urllib.request; sys.stdout.write("
                                              f"urllib.request.urlopen({url!r}).read().decode())"),
                                 capture_output=True, text=True, timeout=60, check=True)
        return fetched.stdout

    def ranks(self, node: Node, job: str) -> list[dict]:
        """The agent of ``node``'s state of each rank of ``job`` it holds, by rank."""
        ranks = json.loads(self.fetch(node, f"{node.url}/api/v1/state"))["facts"].get("telemetry", {}).get("ranks", ())
        return sorted((r for r in ranks if r["job"] == job), key=lambda r: r["rank"])

    def throttle(self, node: Node) -> None:
        _ip("netns", "exec", node.namespace, "tc", "qdisc", "add", "dev", node.veth, "root", "tbf", *THROTTLE)

    def unthrottle(self, node: Node) -> None:
        subprocess.run(["ip", "netns", "exec", node.namespace, "tc", "qdisc", "del", "dev", node.veth, "root"],
                       capture_output=True, timeout=30)


def _healthy(node: Node) -> bool:
    if node.agent is not None and node.agent.poll() is not None:
        raise AssertionError(f"agent on {node.name} exited: {node.agent.stdout.read() if node.agent.stdout else ''}")
    probe = subprocess.run(["ip", "netns", "exec", node.namespace, sys.executable, "-c",
                            f"import urllib.request; urllib.request.urlopen('{node.url}/healthz', timeout=1)"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    """Two namespaced nodes joined by a veth pair, each with an agent; everything made is removed on the way out."""
    if shutil.which("ip") is None or shutil.which("unshare") is None or shutil.which("tc") is None:
        pytest.skip("network namespaces cannot be made here: ip, unshare or tc is missing")
    tag = f"gw{os.getpid() % 100000}"
    made: list[str] = []
    nodes: list[Node] = []
    prometheus: subprocess.Popen | None = None
    try:
        for suffix, address in zip("ab", ADDRESSES, strict=True):
            namespace = f"{tag}{suffix}"
            try:
                _ip("netns", "add", namespace)
            except subprocess.CalledProcessError as exc:
                pytest.skip(f"network namespaces cannot be made here: {exc.stderr.strip().splitlines()[-1]}")
            made.append(namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
            nodes.append(Node(f"node-{suffix}", namespace, f"{tag}v{suffix}", address,
                              tmp_path_factory.mktemp(f"node-{suffix}")))
        a, b = nodes
        _ip("link", "add", a.veth, "type", "veth", "peer", "name", b.veth)
        for node in nodes:
            _ip("link", "set", node.veth, "netns", node.namespace)
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.veth)
            _ip("-n", node.namespace, "link", "set", node.veth, "up")
        for node in nodes:
            node.agent = subprocess.Popen(
                node.command(sys.executable, "-m", "gpuwatch.cli.main", "agent", "--listen",
                             f"{node.address}:{AGENT_PORT}", "--simulate", "dgx-h100", "--interval", "1",
                             "--collector-timeout", "30", "--log-level", "warning"),
                env=node.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for node in nodes:
            wait_until(lambda node=node: _healthy(node), what=f"agent on {node.name}")
        workdir = tmp_path_factory.mktemp("prometheus")
        config = workdir / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "gpuwatch", "static_configs": [
                {"targets": [f"{node.address}:{AGENT_PORT}" for node in nodes]}]}]}))
        prometheus_log = (workdir / "prometheus.log").open("w")
        prometheus = subprocess.Popen(
            ["ip", "netns", "exec", a.namespace, require_tool("prometheus"), f"--config.file={config}",
             f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address={a.address}:{PROMETHEUS_PORT}"],
            stdout=prometheus_log, stderr=subprocess.STDOUT, env={**os.environ, "GOMAXPROCS": "1"})
        cluster = Cluster((a, b), f"http://{a.address}:{PROMETHEUS_PORT}")
        wait_until(lambda: _ready(cluster), what="Prometheus in node a")
        yield cluster
    finally:
        if prometheus is not None:
            stop_server(prometheus, prometheus_log)
        for node in nodes:
            if node.agent is not None and node.agent.poll() is None:
                os.killpg(node.agent.pid, 15)
                try:
                    node.agent.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(node.agent.pid, 9)
        for namespace in made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


def _ready(cluster: Cluster) -> bool:
    try:
        return cluster.fetch(cluster.nodes[0], f"{cluster.prometheus_url}/-/ready").strip() != ""
    except subprocess.CalledProcessError:
        return False


def _settle() -> None:
    time.sleep(3)  # a few of the agents' 1 s rounds: the last steps reach their state


def test_healthy_job_across_two_nodes_is_quiet(cluster):
    cluster.run_job("netns-healthy")
    _settle()
    a, b = cluster.nodes
    assert [r["rank"] for r in cluster.ranks(a, "netns-healthy")] == [0, 1]  # each node's agent holds its own ranks
    assert [r["rank"] for r in cluster.ranks(b, "netns-healthy")] == [2, 3]
    findings = cluster.diagnose("netns-healthy", *cluster.nodes)
    assert [f for f in findings if f["severity"] in ("warning", "critical")] == [], findings


def test_throttled_link_is_named_as_the_network_and_a_partial_view_gives_no_verdict(cluster):
    a, b = cluster.nodes
    cluster.throttle(b)
    try:
        cluster.run_job("netns-throttled")
    finally:
        cluster.unthrottle(b)
    _settle()
    (finding,) = [f for f in cluster.diagnose("netns-throttled", a, b) if f["code"] == "PERF004"]
    assert "on a slow network" in finding["title"], finding
    assert "node-a, node-b" in finding["title"]
    (bandwidth,) = [e for e in finding["evidence"] if "busbw_bytes_per_second" in e.get("values", {})]
    values = bandwidth["values"]
    assert values["crosses_nodes"] is True and values["nodes"] == ["node-a", "node-b"]
    assert values["rated_bytes_per_second"] == 10e9 / 8  # the veth's speed in sysfs
    # gpuwatch's own bytes over the exposed time give the link's speed: the tbf rate (measured 1.01x)
    assert 0.5 * 50e6 / 8 < values["busbw_bytes_per_second"] < 1.5 * 50e6 / 8, values
    assert "tc qdisc show" in finding["fix"]
    # Each node's NIC counters over the step window: the ring's cross-node part, 2(n-1)/n of the gradients a step
    # through each side's veth (measured 1.05x: TCP/IP headers), at the same rate on both sides, which therefore name
    # no slow side (tbf shapes one direction of a lockstep ring)
    counters = {e["values"]["node"]: e["values"] for e in finding["evidence"] if "interface" in e.get("values", {})}
    assert set(counters) == {"node-a", "node-b"}, finding
    (ring,) = [e["values"] for e in finding["evidence"] if "slow_side" in e.get("values", {})]
    for side in counters.values():
        assert 0.9 < side["bytes_per_step"] / ring["ring_bytes_per_step"] < 1.5, (side, ring)
        assert side["errors"] == side["drops"] == 0 and side["utilization"] < 0.01
    assert ring["slow_side"] is None and "slow side" not in finding["title"]
    # Prometheus, scraping both agents, agrees on the verdict, the nodes, the NICs' rating and the bandwidth
    (scraped,) = [f for f in cluster.diagnose_prometheus("netns-throttled") if f["code"] == "PERF004"]
    assert scraped["severity"] == finding["severity"] and "on a slow network" in scraped["title"], scraped
    (scraped_bandwidth,) = [e["values"] for e in scraped["evidence"] if "busbw_bytes_per_second" in e.get("values", {})]
    assert scraped_bandwidth["crosses_nodes"] is True and scraped_bandwidth["nodes"] == ["node-a", "node-b"]
    assert scraped_bandwidth["rated_bytes_per_second"] == 10e9 / 8  # gpuwatch_network_speed_bytes_per_second
    assert 0.5 * 50e6 / 8 < scraped_bandwidth["busbw_bytes_per_second"] < 1.5 * 50e6 / 8, scraped_bandwidth
    partial = [f for f in cluster.diagnose("netns-throttled", a) if f["code"] == "PERF004"]
    assert [f["severity"] for f in partial] in ([], ["info"]), partial
    assert all("ranks not reporting here (2-3)" in f["title"] for f in partial), partial
    assert all(f"--agent {a.url} --agent URL" in f["fix"] for f in partial), partial


def test_a_compute_straggler_on_node_b_is_perf002_from_every_view_of_all_ranks_and_never_network_blame(cluster,
                                                                                                     tmp_path):
    """Rank 3 (node b) sleeps 0.5 s in each forward: the others wait for it at every all-reduce. Both agents
    together, Prometheus scraping both and the run log of all ranks name it (PERF002), with no PERF004; node a's agent
    alone, whose ranks only wait for ranks it cannot see, blames neither the network nor the job's shape."""
    a, b = cluster.nodes
    run_log = tmp_path / "run-log"
    run_log.mkdir()
    cluster.run_job("netns-straggler", "--fault", "sleep-rank", run_log=run_log)
    _settle()
    views = {"agents": cluster.diagnose("netns-straggler", a, b),
             "prometheus": cluster.diagnose_prometheus("netns-straggler"),
             "run_log": diagnose_source("netns-straggler", "run_log", run_log).findings()}
    for view, findings in views.items():
        serious = [f for f in findings if f["severity"] in SERIOUS]
        stragglers = [f for f in serious if f["code"] == "PERF002"]
        assert len(stragglers) == 1, (view, findings)
        assert {e["where"].get("rank") for e in stragglers[0]["evidence"]} >= {3}, (view, stragglers)
        assert "rank 3" in stragglers[0]["title"], (view, stragglers)
        assert not [f for f in findings if f["code"] == "PERF004" and f["severity"] in SERIOUS], (view, findings)
    partial = cluster.diagnose("netns-straggler", a)
    assert not [f for f in partial if f["severity"] in SERIOUS], partial
    assert not [f for f in partial if "slow network" in f["title"] or "communication-bound" in f["title"]], partial
    assert all("ranks not reporting here (2-3)" in f["title"] for f in partial if f["code"] == "PERF004"), partial


def test_gpuwatch_probe_across_the_throttled_link_measures_the_tbf_rate(cluster, tmp_path):
    """One rank a node, all-reduce of 4 MiB over gloo across the link throttled to 50 Mbit/s on node b's side: the
    bus bandwidth (2 ranks: algbw x 2(n-1)/n = algbw) is the tbf rate, within 0.5-1.5x."""
    b = cluster.nodes[1]
    run_log = tmp_path / "probe.jsonl"
    cluster.throttle(b)
    try:
        cluster.probe("netns-probe", run_log, "--ops", "all_reduce", "--min-bytes", "4M", "--max-bytes", "4M",
                      "--iters", "3", "--warmup", "1")
    finally:
        cluster.unthrottle(b)
    (record,) = [json.loads(line) for line in run_log.read_text().splitlines()]
    assert record["kind"] == "probe" and record["nodes"] == 2 and record["hostnames"] == ["node-a", "node-b"]
    assert record["interconnect"] == "socket" and record["world_size"] == 2
    (result,) = record["results"]
    assert result["op"] == "all_reduce" and result["bytes"] == 4 * 2**20
    assert 0.5 * THROTTLED_BYTES_PER_SECOND < result["busbw_bytes_per_second"] < 1.5 * THROTTLED_BYTES_PER_SECOND, \
        result
