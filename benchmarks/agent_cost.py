"""What the node agent costs a GPU node, measured from outside its process, beside node_exporter, on any machine.

Why from outside: an operator sizes a DaemonSet's requests/limits from the process's CPU time and RSS as the
kernel counts them (the process's CPU-time clock; psutil for RSS), not from timings inside the agent. The agent
serves a simulated dgx-h100 (8 GPUs, 18 NVLinks each, 8 IB ports) at a 1 s sampling interval while 64 ranks
(``--ranks``) report one step per second each through the real telemetry socket (TelemetryClient, from a separate
process so the senders' CPU is not counted; handed over as the hooks hand them, so the clients fold plain steps for up
to ``FOLD_SECONDS``), and Prometheus-like scrapes arrive every 15 s at a steady rhythm, as a Prometheus server's do
(the window runs from just after one scrape to just after another, so it holds the work of its own scrapes and no
other). Then ``/metrics`` latency is timed over loopback three ways: back to back (most read a snapshot already
read); once per sampling interval, each reading a new snapshot; and at irregular gaps 0.2 to 3 intervals apart.

What the agent's CPU share includes that a real node does not pay: ``--simulate`` rewrites the generated sysfs
tree and advances the scripted NVML before every round, and the collectors' NVML calls run the scripted NVML's
Python. The simulated agent counts that part itself, in the same process over the same window
(``gpuwatch_agent_simulation_cpu_seconds_total``: ``Simulation.advance`` and the scripted NVML's functions, by
their threads' CPU clocks), and the agent proper is the total without it. A real node pays pynvml's ctypes calls
and the driver's time instead, which no simulation has.

Idle: the agent with every collector enabled on a node with nothing to collect (no NVIDIA driver, an empty sysfs
tree, no rank reporting). CPU time is read from the process's CPU-time clock, in nanoseconds: at ~0.1 % of a
core, psutil's 10 ms clock ticks would be most of the figure.

Side by side on the same InfiniBand sysfs fixture (tests/fixtures/procfs-infiniband/sys): the agent with only its
infiniband collector against Debian's ``prometheus-node-exporter`` restricted to its infiniband collector
(``--collector.disable-defaults --collector.infiniband``), ratio of scrape latencies. node_exporter reads sysfs on
every scrape; the agent serves a snapshot rendered once per sampling round.

Every measurement is repeated ``--runs`` times (default 3) and reported as min / median / max, with the machine
(CPU model, cores, load average before and after, Python build): figures from a shared machine wander, and the
ratios against node_exporter, measured in the same run, are what should hold anywhere.

    apt-get install prometheus-node-exporter   # for the side-by-side; skipped with a note when missing
    python benchmarks/agent_cost.py [--runs 3] [--seconds 30] [--scrapes 300] [--interval 1] [--ranks 64]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _harness import free_port, get, load_average, machine, running, spread, wait_until
from telemetry_records import collectives, hello, plain_step, step

from gpuwatch.trainer.telemetry import TelemetryClient

ROOT = Path(__file__).resolve().parent.parent
IB_FIXTURE = ROOT / "tests" / "fixtures" / "procfs-infiniband" / "sys"
RANKS = 64
#: Seconds between the busy agent's scrapes (``--scrape-every``): Prometheus' usual scrape interval.
SCRAPE_EVERY = 15.0
#: The steps whose records carry what the hooks measure every N steps (their DEFAULT_EVERY: memory, gradient
#: similarity, parameter checksum).
MEASURED_EVERY = 10
#: Tensor-parallel ranks: one per GPU of the simulated node.
TP_SIZE = 8


@contextlib.contextmanager
def _process(command: list[str], ready_url: str) -> Iterator[subprocess.Popen]:
    with running(command) as proc:
        wait_until(lambda: get(ready_url, timeout=1), f"{ready_url} to answer")
        yield proc


def agent_command(port: int, sock: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gpuwatch.cli.main", "agent", "--listen", f"127.0.0.1:{port}",
            "--telemetry.socket", str(sock), "--log-level", "warning", *extra]


def rank_layout(rank: int, ranks: int = RANKS) -> dict:
    """The hello's layout of ``rank`` of ``ranks``: tp over the node's 8 GPUs, then pp 2 where the rest is even,
    then dp (64 ranks: tp 8 × dp 4 × pp 2; 8 ranks, one per GPU: tp 8)."""
    tp = TP_SIZE if ranks % TP_SIZE == 0 else ranks
    pp = 2 if ranks // tp % 2 == 0 else 1
    dp = ranks // (tp * pp)
    return {"world_size": ranks, "tp_size": tp, "pp_size": pp, "dp_size": dp, "micro_batches": 8, "faults": [],
            "local_rank": rank, "tp_rank": rank % tp, "dp_rank": rank // tp % dp, "pp_stage": rank // (tp * dp),
            "gpu": {"index": rank % TP_SIZE, "uuid": f"GPU-{rank % TP_SIZE:08d}-0000-4000-8000-000000000000"}}


def step_collectives() -> dict:
    """A step's collective calls, as a rank of the simulated node's tp 8 × dp × pp layout makes them: four
    all-reduces, eight all-gathers, eight sends and receives to the next stage."""
    return collectives({"all_reduce": [0.004] * 4, "all_gather": [0.001] * 8, "send": [0.0002] * 8,
                        "recv": [0.0002] * 8})


def step_record(rank: int, number: int, ops: dict, **fields: float) -> dict:
    """Step ``number`` of ``rank`` as the hooks report it: every ``MEASURED_EVERY``-th with what they measure, the
    others plain. Its timings, loss and gradient norm vary from step to step by a few per cent (seeded by rank and step,
    so every run and tree gets the same), as a real job's do: the agent writes, sorts and compares figures of all their
    digits, which cost it twice what the test records' round numbers do (``repr`` of 0.5 against 0.4837...)."""
    record = (step if number % MEASURED_EVERY == 0 else plain_step)(rank, number, job="bench", collectives=ops,
                                                                     **fields)
    jitter = random.Random(rank * 1_000_003 + number).uniform
    for name in ("step_seconds", "compute_seconds", "dataloader_wait_seconds", "optimizer_seconds", "loss",
                 "grad_norm"):
        record[name] *= jitter(0.95, 1.05)
    pipeline = record["pipeline"]
    pipeline["busy_seconds"] *= jitter(0.95, 1.05)
    pipeline["idle_seconds"] *= jitter(0.95, 1.05)
    pipeline["bubble_ratio"] = pipeline["idle_seconds"] / (pipeline["busy_seconds"] + pipeline["idle_seconds"])
    return record


def send_steps(sock: str, seconds: float, ranks: int = RANKS) -> None:
    """``ranks`` ranks, one client each as in as many processes, one step per rank per second, handed over as the
    hooks do (``submit``: the client folds plain steps). As the hooks' defaults measure them, every 10th step carries a
    memory reading, the gradient similarity and a parameter checksum, the others none."""
    clients = [TelemetryClient(sock, heartbeat_interval=0) for _ in range(ranks)]
    for rank, client in enumerate(clients):
        client.send(hello(rank, job="bench", **rank_layout(rank, ranks)))
    ops = step_collectives()
    deadline, number = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        number += 1
        tick = time.monotonic()
        for rank, client in enumerate(clients):
            client.submit(functools.partial(step_record, rank, number, ops))
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    for client in clients:
        client.close()


@dataclass
class Usage:
    cpu_share: float  # of one core
    simulation_share: float  # of one core: gpuwatch_agent_simulation_cpu_seconds_total over the same window
    rss_max_mb: float
    rss_last_mb: float


def _simulation_cpu(page: bytes) -> float:
    """The simulated agent's own count of what its simulation cost it, from a /metrics page; 0 for an agent on a
    real node, which simulates nothing (the GPU acceptance kit's agent-cost check)."""
    for line in page.decode().splitlines():
        if line.startswith("gpuwatch_agent_simulation_cpu_seconds_total "):
            return float(line.split()[1])
    return 0.0


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` so far, every thread's, those that exited too (the agent's HTTP server
    serves each scrape in a thread of its own), in nanoseconds: the process's CPU-time clock, as
    clock_getcpuclockid(3) gives it (``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)`` in Linux's
    include/linux/posix-timers.h). psutil's figures come in 10 ms clock ticks: ±0.03 % of a core over 30 s, a
    tenth of the 5 s target."""
    return time.clock_gettime((~pid << 3) | 2)


def usage(pid: int, seconds: float, scrape_url: str, scrape_every: float) -> Usage:
    """CPU time and RSS of ``pid`` from just after one scrape to just after a scrape ``seconds`` later (a whole
    number of gaps), scraping every ``scrape_every`` seconds as Prometheus does: the window holds the work of
    ``seconds / scrape_every`` scrapes, each rendered ahead in the round before it once the agent has seen the
    rhythm (the caller scraped once ``scrape_every`` before). The simulation's share from the agent's counter on the
    pages of the scrapes at both ends."""
    proc = psutil.Process(pid)
    simulation_before = _simulation_cpu(get(scrape_url))
    before, started = process_cpu_seconds(pid), time.monotonic()
    rss, scrapes, page = [], round(seconds / scrape_every), b""
    for number in range(1, scrapes + 1):
        while (now := time.monotonic()) < started + number * scrape_every:
            rss.append(proc.memory_info().rss)
            time.sleep(min(1.0, started + number * scrape_every - now))
        page = get(scrape_url)
    after, elapsed = process_cpu_seconds(pid), time.monotonic() - started
    simulation = _simulation_cpu(page) - simulation_before
    return Usage((after - before) / elapsed, simulation / elapsed, max(rss) / 1e6, rss[-1] / 1e6)


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


def idle_cpu_share(seconds: float, sysfs_root: Path, sock: Path) -> float:
    """The agent with every collector enabled and nothing to collect (on a machine without an NVIDIA driver), at 1 s
    sampling, unscraped."""
    port = free_port()
    command = agent_command(port, sock, "--interval", "1", "--sysfs-root", str(sysfs_root))
    with _process(command, f"http://127.0.0.1:{port}/healthz") as agent:
        time.sleep(3)  # the first rounds: collectors fail once and back off
        before, started = process_cpu_seconds(agent.pid), time.monotonic()
        time.sleep(seconds)
        return (process_cpu_seconds(agent.pid) - before) / (time.monotonic() - started)


def node_exporter() -> str | None:
    return shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")


@dataclass
class Run:
    """One run's figures."""

    ranks: int
    records: dict[str, float]
    cost: Usage
    full: Latency
    fresh: Latency
    irregular: Latency
    idle: float
    agent_ib: Latency
    exporter_ib: Latency | None


def measure(args: argparse.Namespace, tmp: Path) -> Run:
    sock, port = tmp / "telemetry.sock", free_port()
    url = f"http://127.0.0.1:{port}"
    simulated = agent_command(port, sock, "--simulate", "dgx-h100", "--interval", str(args.interval))
    with _process(simulated, url + "/healthz") as agent:
        sender = multiprocessing.Process(target=send_steps,
                                         args=(str(sock), args.warmup + args.scrape_every + args.seconds
                                               + args.scrapes * 0.05 + args.fresh_scrapes * args.interval * 3 + 30,
                                               args.ranks))
        sender.start()
        try:
            time.sleep(args.warmup)
            # A scraper at work before the window, one gap before its first scrape: the window does not pay the
            # agent's first render, and the agent has seen the rhythm it renders ahead of.
            get(url + "/metrics")
            time.sleep(args.scrape_every)
            cost = usage(agent.pid, args.seconds, url + "/metrics", args.scrape_every)
            full = latency(url + "/metrics", args.scrapes)
            fresh = latency(url + "/metrics", args.fresh_scrapes, every=args.interval)
            irregular = latency(url + "/metrics", args.fresh_scrapes, every=args.interval, irregular=True)
            page = get(url + "/metrics").decode()
        finally:
            sender.terminate()
            sender.join()
    ranks = page.count("gpuwatch_train_last_step{")
    records = {result: sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                           if line.startswith("gpuwatch_telemetry_records_total{") and f'"{result}"' in line)
               for result in ("accepted", "rejected", "dropped")}

    empty_sysfs = tmp / "empty-sys"
    empty_sysfs.mkdir(exist_ok=True)
    idle = idle_cpu_share(args.seconds, empty_sysfs, tmp / "idle.sock")

    ib_only = ("--sysfs-root", str(IB_FIXTURE), "--interval", "1", "--no-collector.nvml", "--no-collector.nvlink",
               "--no-collector.host", "--no-collector.telemetry")
    port = free_port()
    with _process(agent_command(port, tmp / "ib.sock", *ib_only), f"http://127.0.0.1:{port}/healthz"):
        time.sleep(2)
        agent_ib = latency(f"http://127.0.0.1:{port}/metrics", args.scrapes)
    exporter_ib = None
    if binary := node_exporter():
        port = free_port()
        command = [binary, "--collector.disable-defaults", "--collector.infiniband", f"--path.sysfs={IB_FIXTURE}",
                   f"--web.listen-address=127.0.0.1:{port}"]
        with _process(command, f"http://127.0.0.1:{port}/metrics"):
            exporter_ib = latency(f"http://127.0.0.1:{port}/metrics", args.scrapes)
    return Run(ranks, records, cost, full, fresh, irregular, idle, agent_ib, exporter_ib)


def _window(args: argparse.Namespace) -> float:
    """The busy window: ``--seconds`` as a whole number of scrape gaps."""
    return round(args.seconds / args.scrape_every) * args.scrape_every


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="times every measurement is repeated")
    parser.add_argument("--seconds", type=float, default=30.0, help="CPU/RSS measurement window (busy and idle)")
    parser.add_argument("--scrapes", type=int, default=300, help="scrapes per latency measurement")
    parser.add_argument("--interval", type=float, default=1.0, help="the agent's sampling interval (its default is 5)")
    parser.add_argument("--ranks", type=int, default=RANKS, help="ranks reporting to the busy agent (an 8-GPU node "
                        "runs 8; the targets are for 64)")
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds before measuring (ranks registered)")
    parser.add_argument("--scrape-every", type=float, default=SCRAPE_EVERY,
                        help="seconds between the busy agent's scrapes; its window is a whole number of them")
    parser.add_argument("--fresh-scrapes", type=int, default=20, help="scrapes one sampling interval apart")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.ranks < 1:
        parser.error("--ranks must be at least 1")
    if args.scrape_every <= 0 or args.seconds < args.scrape_every:
        parser.error("--scrape-every must be positive and at most --seconds")

    print(f"machine: {machine()}")
    print(f"load average before: {load_average()}", flush=True)
    runs = []
    for number in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(prefix="gpuwatch-cost-") as tmp:
            run = measure(args, Path(tmp))
        runs.append(run)
        proper = (run.cost.cpu_share - run.cost.simulation_share) * 100
        print(f"run {number}: agent {run.cost.cpu_share * 100:.2f} % (proper {proper:.2f} %), "
              f"idle {run.idle * 100:.3f} %, fresh p50/p99 {run.fresh.p50_ms:.2f}/{run.fresh.p99_ms:.2f} ms, "
              f"load {load_average()}", flush=True)
    print(f"load average after: {load_average()}")
    _report(args, runs)


def _report(args: argparse.Namespace, runs: list[Run]) -> None:
    def figures(pick: Callable[[Run], float]) -> list[float]:
        return [pick(run) for run in runs]

    last = runs[-1]
    print(f"\n{args.runs} run(s), min / median / max. Simulated dgx-h100 (8 GPUs × 18 NVLinks, 8 IB ports), "
          f"{last.ranks} ranks reporting 1 step/s each, {args.interval:g} s sampling, a scrape every "
          f"{args.scrape_every:g} s at a steady rhythm, {_window(args):g} s window (records accepted "
          f"{spread(figures(lambda run: run.records['accepted']), digits=0)}, rejected "
          f"{sum(figures(lambda run: run.records['rejected'])):.0f}, dropped "
          f"{sum(figures(lambda run: run.records['dropped'])):.0f}):")
    print(f"  agent CPU      {spread(figures(lambda run: run.cost.cpu_share * 100), ' %')} of one core, end to end")
    simulation = figures(lambda run: run.cost.simulation_share * 100)
    proper = figures(lambda run: (run.cost.cpu_share - run.cost.simulation_share) * 100)
    print(f"    of which simulation {spread(simulation, ' %')} (sysfs rewrites, scripted NVML; not on a real node)")
    print(f"    agent proper {spread(proper, ' %')}   (target ≤ 1 % at 1 s, ≤ 0.3 % at 5 s)")
    print(f"  agent RSS      {spread(figures(lambda run: run.cost.rss_max_mb), ' MB', 1)} max   (target ≤ 60 MB)")
    print(f"  idle agent     {spread(figures(lambda run: run.idle * 100), ' %', 3)} of one core: every collector, "
          "nothing to collect (no driver, empty sysfs), 1 s sampling   (target ≤ 0.1 %)")
    for name, scrapes in (("/metrics back to back", [run.full for run in runs]),
                          (f"/metrics every {args.interval:g} s", [run.fresh for run in runs]),
                          ("/metrics irregular", [run.irregular for run in runs])):
        print(f"  {name:<22} p50 {spread([scrape.p50_ms for scrape in scrapes], ' ms')}  "
              f"p99 {spread([scrape.p99_ms for scrape in scrapes], ' ms')}")
    print(f"    ({last.full.samples} samples, {last.full.kbytes:.0f} KiB; {args.scrapes} back to back, "
          f"{args.fresh_scrapes} a new snapshot each, {args.fresh_scrapes} at 0.2-3 intervals; "
          "target for a new snapshot: p50 ≤ 5 ms, p99 ≤ 10 ms)")
    print(f"\nInfiniBand only, same sysfs fixture ({IB_FIXTURE.relative_to(ROOT)}), {args.scrapes} scrapes:")
    print(f"  gpuwatch agent       p50 {spread(figures(lambda run: run.agent_ib.p50_ms), ' ms')}  "
          f"p99 {spread(figures(lambda run: run.agent_ib.p99_ms), ' ms')}  ({last.agent_ib.samples} samples)")
    compared = [run for run in runs if run.exporter_ib is not None]
    if not compared:
        print("  node_exporter        not installed: apt-get install prometheus-node-exporter")
        return
    exporter = [run.exporter_ib for run in compared if run.exporter_ib is not None]
    print(f"  node_exporter        p50 {spread([e.p50_ms for e in exporter], ' ms')}  "
          f"p99 {spread([e.p99_ms for e in exporter], ' ms')}  ({exporter[-1].samples} samples)")
    print(f"  ratio agent / node_exporter, same run: "
          f"p50 {spread([run.agent_ib.p50_ms / e.p50_ms for run, e in zip(compared, exporter, strict=True)], '×')}, "
          f"p99 {spread([run.agent_ib.p99_ms / e.p99_ms for run, e in zip(compared, exporter, strict=True)], '×')}"
          "   (target ≤ 1)")


if __name__ == "__main__":
    main()
