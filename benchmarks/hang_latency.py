"""How soon a hang or a death is named: from the fault's onset to the first `gpuwatch diagnose` finding that names the
right rank, through the agents (`--agent A --agent B`), through Prometheus (1 s scrapes) and, after the job was
killed, from its run logs (the post-mortem: how long diagnose takes there, and whether it names the rank).

A 2-node-style layout on this machine: two `gpuwatch agent --simulate dgx-h100` processes, each with its own
telemetry socket and node name, and the reference trainer (tp 1 × pp 2 × dp 2, 4 ranks, gloo on the CPU) started as
two torchrun "nodes" of 2 ranks each (`--nnodes 2 --node-rank 0|1`, one rendezvous), each node's ranks reporting to
its own agent. The last rank is the culprit: `hang-rank` blocks before the DP all-reduce of step 4,
`skip-collective` leaves out its DP all-reduces of step 4 (the ranks soon wait on each other in a circle), `crash-rank`
is killed with SIGKILL there. Onset, on this machine's clock: for a hang, the culprit's progress record's time less
the seconds it says it has been stalled; for a crash, the moment the agent's pidfd saw its
process exit. Each finding source is polled every `--poll` seconds (0.25 s: each poll is a `gpuwatch diagnose`
process); each fault runs `--repeat` times and the latencies are printed as min / median / max. Target: ≤ 10 s,
against 10 minutes for NCCL's watchdog.

    python benchmarks/hang_latency.py [--repeat 3] [--poll 0.25]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _harness import free_port, get, load_average, machine, running, wait_until

from conftest import PrometheusServer

CULPRIT = 3
FAULT_STEP = 4
EXPECTED = {"hang-rank": "HANG001", "skip-collective": "HANG002", "crash-rank": "HANG004"}
POLL_SECONDS = 0.25


def _diagnose(*source: str) -> dict | None:
    result = subprocess.run([sys.executable, "-m", "gpuwatch.cli.main", "diagnose", *source, "--select", "HANG",
                             "--format", "json", "--fail-on", "never"], capture_output=True, text=True, timeout=60)
    return json.loads(result.stdout) if result.returncode == 0 else None


def _names_culprit(report: dict | None, code: str, job: str) -> bool:
    """Whether a `code` finding about `job` names the culprit (where HANG002 lists every member of the group, as the
    odd one out)."""
    return report is not None and any(
        finding["code"] == code and any(e["where"].get("rank") == CULPRIT and e["where"].get("job") == job
                                        and e["values"].get("odd", True) for e in finding["evidence"])
        for finding in report["findings"])


@contextlib.contextmanager
def _agents(workdir: Path) -> Iterator[list[tuple[str, Path]]]:
    """Two agents, one per "node": (URL, telemetry socket) each."""
    with contextlib.ExitStack() as stack:
        agents = []
        for node in range(2):
            port, sock = free_port(), workdir / f"node-{node}.sock"
            stack.enter_context(running([sys.executable, "-m", "gpuwatch.cli.main", "agent", "--simulate",
                                         "dgx-h100", "--interval", "0.5", "--listen", f"127.0.0.1:{port}",
                                         "--telemetry.socket", str(sock), "--node", f"node-{node}",
                                         "--log-level", "warning"]))
            url = f"http://127.0.0.1:{port}"
            wait_until(lambda url=url: get(url + "/healthz"), what=f"agent node-{node}")
            agents.append((url, sock))
        yield agents


@contextlib.contextmanager
def _job(fault: str, job: str, agents: list[tuple[str, Path]], run_log: Path) -> Iterator[list[subprocess.Popen]]:
    """The 4-rank job as two torchrun nodes, each reporting to its own agent."""
    endpoint = f"127.0.0.1:{free_port()}"
    with contextlib.ExitStack() as stack:
        nodes = []
        for node, (_, sock) in enumerate(agents):
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                       "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                       "--rdzv-id", job, "-m", "gpuwatch.trainer.cli", "--tp", "1", "--pp", "2", "--dp", "2",
                       "--steps", "1000", "--job", job, "--fault", fault, "--fault-step", str(FAULT_STEP),
                       "--telemetry-socket", str(sock), "--run-log", str(run_log)]
            nodes.append(stack.enter_context(running(command, grace=5, start_new_session=True)))
        yield nodes


def _culprit_state(url: str, job: str) -> dict | None:
    state = json.loads(get(url + "/api/v1/state"))
    return next((r for r in state["facts"].get("telemetry", {}).get("ranks", ())
                 if r["job"] == job and r["rank"] == CULPRIT), None)


def _onset(fault: str, urls: list[str], job: str) -> float | None:
    """The fault's onset, from the agent the culprit reports to (c10d's rendezvous, not --node-rank, decides which
    "node" its ranks are)."""
    rank = next((state for url in urls if (state := _culprit_state(url, job)) is not None), None)
    if rank is None:
        return None
    if fault == "crash-rank":
        return rank.get("exited")
    progress = rank.get("progress")
    return progress["time"] - progress["stalled_seconds"] if progress else None


def _first(source: list[str], code: str, job: str, deadline: float, poll_seconds: float) -> float | None:
    """When `gpuwatch diagnose SOURCE` first names the culprit of `job` under `code` (wall clock), else None."""
    while time.time() < deadline:
        if _names_culprit(_diagnose(*source), code, job):
            return time.time()
        time.sleep(poll_seconds)
    return None


def measure(fault: str, repeat: int, workdir: Path, poll_seconds: float = POLL_SECONDS) -> dict[str, list[float]]:
    code, results = EXPECTED[fault], {"agent": [], "prometheus": [], "post-mortem (diagnose time)": []}
    workdir.mkdir(parents=True)
    with _agents(workdir) as agents:
        urls = [url for url, _ in agents]
        agent_sources = [arg for url in urls for arg in ("--agent", url)]
        prometheus = PrometheusServer(workdir, [url.removeprefix("http://") for url in urls])
        try:
            for attempt in range(repeat):
                job, run_log = f"{fault}-{attempt}", workdir / f"{fault}-{attempt}"
                with _job(fault, job, agents, run_log):
                    deadline = time.time() + 120
                    by_agent = _first(agent_sources, code, job, deadline, poll_seconds)
                    by_prometheus = _first(["--prometheus", prometheus.url], code, job, deadline, poll_seconds)
                    onset = _onset(fault, urls, job)
                if onset is None or by_agent is None or by_prometheus is None:
                    print(f"  {fault} run {attempt}: not found (onset {onset}, agent {by_agent}, "
                          f"prometheus {by_prometheus})", flush=True)
                    continue
                results["agent"].append(by_agent - onset)
                results["prometheus"].append(by_prometheus - onset)
                started = time.monotonic()
                if _names_culprit(_diagnose("--run-log", str(run_log)), code, job):
                    results["post-mortem (diagnose time)"].append(time.monotonic() - started)
                print(f"  {fault} run {attempt}: agent {by_agent - onset:.1f} s, prometheus "
                      f"{by_prometheus - onset:.1f} s after onset", flush=True)
        finally:
            prometheus.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="Runs per fault.")
    parser.add_argument("--poll", type=float, default=POLL_SECONDS, help="Seconds between two polls of a source.")
    args = parser.parse_args()
    if args.repeat < 1 or not args.poll > 0:
        parser.error("--repeat must be at least 1 and --poll positive")
    print(f"machine: {machine()}; load average before {load_average()}", flush=True)
    print(f"layout: 2 agents (node-0, node-1), tp 1 x pp 2 x dp 2 as 2 torchrun nodes x 2 ranks; culprit rank "
          f"{CULPRIT}, fault at step {FAULT_STEP}; {args.repeat} run(s) per fault", flush=True)
    table = []
    with tempfile.TemporaryDirectory(prefix="gpuwatch-hangs-") as workdir:
        for fault in EXPECTED:
            for source, values in measure(fault, args.repeat, Path(workdir) / fault, args.poll).items():
                table.append((fault, source, values))
    print(f"\n{'fault':15} {'source':28} {'named':>6}   {'seconds: min  median    max':>28}")
    for fault, source, values in table:
        spread = (f"{min(values):7.1f} {statistics.median(values):7.1f} {max(values):7.1f}" if values
                  else "      -       -       -")
        print(f"{fault:15} {source:28} {len(values):>3}/{args.repeat}   {spread:>28}")
    print(f"load average after {load_average()}")


if __name__ == "__main__":
    main()
