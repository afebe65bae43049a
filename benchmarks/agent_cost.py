"""What the node agent costs a GPU node, measured from outside its process, beside node_exporter.

Why from outside: an operator sizes a DaemonSet's requests/limits from the process's CPU time and RSS as the
kernel counts them (psutil on the agent's pid), not from timings inside the agent. The agent serves a simulated
dgx-h100 (8 GPUs, 18 NVLinks each, 8 IB ports) at a 1 s sampling interval while 64 ranks report one step per
second each through the real telemetry socket (TelemetryClient, from a separate process so the senders' CPU is
not counted), and Prometheus-like scrapes arrive every 15 s. Then ``/metrics`` latency is timed over loopback
three ways: back to back (all but the first hit a snapshot already rendered); once per sampling interval, each
reading a new snapshot, at a steady rhythm as Prometheus scrapes (the agent renders the round the next scrape will
read ahead of it); and at irregular gaps, where a scrape the last gap did not predict renders the snapshot it reads.

What the agent's CPU share includes that a real node does not pay: ``--simulate`` rewrites the generated sysfs
tree and advances the scripted NVML before every round. That part is measured separately, in this process, by
timing ``Simulation.advance`` over the same number of rounds, and reported beside the total.

Side by side on the same InfiniBand sysfs fixture (tests/fixtures/procfs-infiniband/sys): the agent with only its
infiniband collector against Debian's ``prometheus-node-exporter`` restricted to its infiniband collector
(``--collector.disable-defaults --collector.infiniband``), ratio of scrape latencies. node_exporter reads sysfs on
every scrape; the agent serves a snapshot rendered once per sampling round.

    apt-get install prometheus-node-exporter   # for the side-by-side; skipped with a note when missing
    python benchmarks/agent_cost.py [--seconds 30] [--scrapes 300]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _harness import free_port, get, running, wait_until
from telemetry_records import collectives, hello, step

from gpuwatch.agent.simulate import PRESETS, Simulation
from gpuwatch.trainer.telemetry import TelemetryClient

ROOT = Path(__file__).resolve().parent.parent
IB_FIXTURE = ROOT / "tests" / "fixtures" / "procfs-infiniband" / "sys"
RANKS = 64
SCRAPE_EVERY = 15.0
#: 64 ranks as tp 8 × dp 4 × pp 2, eight per GPU's worth of local ranks.
LAYOUT = {"world_size": RANKS, "tp_size": 8, "pp_size": 2, "dp_size": 4, "micro_batches": 8, "faults": []}


@contextlib.contextmanager
def _process(command: list[str], ready_url: str) -> Iterator[subprocess.Popen]:
    with running(command) as proc:
        wait_until(lambda: get(ready_url, timeout=1), f"{ready_url} to answer")
        yield proc


def agent_command(port: int, sock: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gpuwatch.cli.main", "agent", "--listen", f"127.0.0.1:{port}",
            "--telemetry.socket", str(sock), "--log-level", "warning", *extra]


def _rank_layout(rank: int) -> dict:
    return {**LAYOUT, "local_rank": rank, "tp_rank": rank % 8, "dp_rank": rank // 8 % 4, "pp_stage": rank // 32,
            "gpu": {"index": rank % 8, "uuid": f"GPU-{rank % 8:08d}-0000-4000-8000-000000000000"}}


def send_steps(sock: str, seconds: float) -> None:
    """64 ranks, one client each as in 64 processes, one full step record per rank per second."""
    clients = [TelemetryClient(sock, heartbeat_interval=0) for _ in range(RANKS)]
    for rank, client in enumerate(clients):
        client.send(hello(rank, job="bench", **_rank_layout(rank)))
    ops = collectives({"all_reduce": [0.004] * 4, "all_gather": [0.001] * 8, "send": [0.0002] * 8,
                       "recv": [0.0002] * 8})
    deadline, number = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        number += 1
        tick = time.monotonic()
        for rank, client in enumerate(clients):
            client.send(step(rank, number, job="bench", collectives=ops))
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    for client in clients:
        client.close()


@dataclass
class Usage:
    cpu_share: float  # of one core
    rss_max_mb: float
    rss_last_mb: float


def usage(pid: int, seconds: float, scrape_url: str | None) -> Usage:
    """CPU time and RSS of ``pid`` over ``seconds``, scraping ``scrape_url`` every SCRAPE_EVERY seconds."""
    proc = psutil.Process(pid)
    before, started = proc.cpu_times(), time.monotonic()
    rss, next_scrape = [], started
    while (now := time.monotonic()) < started + seconds:
        if scrape_url and now >= next_scrape:
            get(scrape_url)
            next_scrape += SCRAPE_EVERY
        rss.append(proc.memory_info().rss)
        time.sleep(1.0)
    after, elapsed = proc.cpu_times(), time.monotonic() - started
    cpu = (after.user + after.system) - (before.user + before.system)
    return Usage(cpu / elapsed, max(rss) / 1e6, rss[-1] / 1e6)


@dataclass
class Latency:
    p50_ms: float
    p99_ms: float
    samples: int
    kbytes: float


def latency(url: str, scrapes: int, every: float = 0.0, irregular: bool = False) -> Latency:
    """Scrapes back to back, one every ``every`` seconds, or ``irregular``-ly 0.2 to 3 times ``every`` apart."""
    times, body = [], b""
    gaps = random.Random(0)
    for _ in range(scrapes):
        time.sleep(every * gaps.uniform(0.2, 3.0) if irregular else every)
        started = time.perf_counter()
        body = get(url)
        times.append((time.perf_counter() - started) * 1e3)
    times.sort()
    samples = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    return Latency(statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))], samples,
                   len(body) / 1024)


def simulation_cpu_per_round(rounds: int, interval: float) -> float:
    """CPU seconds one ``Simulation.advance`` of dgx-h100 takes when called every ``interval`` seconds."""
    with tempfile.TemporaryDirectory(prefix="gpuwatch-sim-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK)
                                     else None) as workdir:
        simulation = Simulation(PRESETS["dgx-h100"], Path(workdir))
        spent = 0.0
        for _ in range(rounds):
            time.sleep(interval)
            started = time.process_time()
            simulation.advance()
            spent += time.process_time() - started
    return spent / rounds


def node_exporter() -> str | None:
    return shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="CPU/RSS measurement window")
    parser.add_argument("--scrapes", type=int, default=300, help="scrapes per latency measurement")
    parser.add_argument("--interval", type=float, default=1.0, help="the agent's sampling interval (its default is 5)")
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds before measuring (ranks registered)")
    parser.add_argument("--fresh-scrapes", type=int, default=20, help="scrapes one sampling interval apart")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="gpuwatch-cost-") as tmp:
        sock, port = Path(tmp) / "telemetry.sock", free_port()
        url = f"http://127.0.0.1:{port}"
        simulated = agent_command(port, sock, "--simulate", "dgx-h100", "--interval", str(args.interval))
        with _process(simulated, url + "/healthz") as agent:
            sender = multiprocessing.Process(target=send_steps,
                                             args=(str(sock), args.warmup + args.seconds + args.scrapes * 0.05
                                                   + args.fresh_scrapes * args.interval * 3 + 30))
            sender.start()
            try:
                time.sleep(args.warmup)
                cost = usage(agent.pid, args.seconds, url + "/metrics")
                full = latency(url + "/metrics", args.scrapes)
                fresh = latency(url + "/metrics", args.fresh_scrapes, every=args.interval)
                irregular = latency(url + "/metrics", args.fresh_scrapes, every=args.interval, irregular=True)
                page = get(url + "/metrics").decode()
            finally:
                sender.terminate()
                sender.join()
            ranks = page.count("gpuwatch_train_last_step{")
            outcome = {result: sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                                   if line.startswith("gpuwatch_telemetry_records_total{") and f'"{result}"' in line)
                       for result in ("accepted", "rejected", "dropped")}

        rounds = max(3, min(30, int(args.seconds / args.interval)))  # as many rounds as the measured window held
        simulation = simulation_cpu_per_round(rounds, args.interval) / args.interval
        ib_only = ("--sysfs-root", str(IB_FIXTURE), "--interval", "1", "--no-collector.nvml", "--no-collector.nvlink",
                   "--no-collector.host", "--no-collector.telemetry")
        port = free_port()
        with _process(agent_command(port, Path(tmp) / "ib.sock", *ib_only), f"http://127.0.0.1:{port}/healthz"):
            time.sleep(2)
            agent_ib = latency(f"http://127.0.0.1:{port}/metrics", args.scrapes)

        exporter_ib = None
        if binary := node_exporter():
            port = free_port()
            command = [binary, "--collector.disable-defaults", "--collector.infiniband", f"--path.sysfs={IB_FIXTURE}",
                       f"--web.listen-address=127.0.0.1:{port}"]
            with _process(command, f"http://127.0.0.1:{port}/metrics"):
                exporter_ib = latency(f"http://127.0.0.1:{port}/metrics", args.scrapes)

    print(f"simulated dgx-h100 (8 GPUs × 18 NVLinks, 8 IB ports), {ranks} ranks reporting 1 step/s each, "
          f"{args.interval:g} s sampling, a scrape every {SCRAPE_EVERY:.0f} s, {args.seconds:.0f} s window "
          f"(records accepted {outcome['accepted']:.0f}, rejected {outcome['rejected']:.0f}, "
          f"dropped {outcome['dropped']:.0f}):")
    print(f"  agent CPU      {cost.cpu_share * 100:6.2f} % of one core   (target < 1 %)")
    print(f"    of which simulation {simulation * 100:.2f} % (sysfs rewrites, scripted NVML; not on a real node), "
          f"without it {(cost.cpu_share - simulation) * 100:.2f} %")
    print(f"  agent RSS      {cost.rss_max_mb:6.1f} MB max, {cost.rss_last_mb:.1f} MB at the end   (target < 80 MB)")
    print(f"  /metrics       p50 {full.p50_ms:.2f} ms  p99 {full.p99_ms:.2f} ms  ({full.samples} samples, "
          f"{full.kbytes:.0f} KiB; target p50 < 5 ms), back to back: a snapshot already rendered")
    print(f"  /metrics every {args.interval:g} s p50 {fresh.p50_ms:.2f} ms  p99 {fresh.p99_ms:.2f} ms  "
          f"({args.fresh_scrapes} scrapes, a new snapshot each, at a steady rhythm: rendered ahead)")
    print(f"  /metrics irregular p50 {irregular.p50_ms:.2f} ms  p99 {irregular.p99_ms:.2f} ms  "
          f"({args.fresh_scrapes} scrapes 0.2-3 intervals apart: ahead when the last gap predicts them, else "
          "on demand)")
    print(f"\nInfiniBand only, same sysfs fixture ({IB_FIXTURE.relative_to(ROOT)}), {args.scrapes} scrapes:")
    print(f"  gpuwatch agent       p50 {agent_ib.p50_ms:.2f} ms  p99 {agent_ib.p99_ms:.2f} ms  "
          f"({agent_ib.samples} samples)")
    if exporter_ib is None:
        print("  node_exporter        not installed: apt-get install prometheus-node-exporter")
    else:
        print(f"  node_exporter        p50 {exporter_ib.p50_ms:.2f} ms  p99 {exporter_ib.p99_ms:.2f} ms  "
              f"({exporter_ib.samples} samples)")
        print(f"  ratio agent / node_exporter: p50 {agent_ib.p50_ms / exporter_ib.p50_ms:.2f}×, "
              f"p99 {agent_ib.p99_ms / exporter_ib.p99_ms:.2f}×")
    print(f"\nmachine: {os.cpu_count()} CPUs ({_cpu_model()}), Python {sys.version.split()[0]}")


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
