"""How often ``gpuwatch diagnose`` cries wolf on users' own healthy training scripts, and how soon it names a real
straggler.

Why: a rule that fires on healthy jobs teaches users to ignore the report. A user's plain DDP tutorial (2 ranks,
gloo, ~2 ms steps) got a straggler warning on 7 of 10 healthy runs. This runs N healthy runs of the user-style
scripts in tests/workloads/ (a DDP tutorial, gradient accumulation, a tiny LM), cycling through them and through
1-4 ranks, each under torchrun against a real ``gpuwatch agent --simulate dgx-h100 --interval 1``
(tests/foreign.py), and judges each through the agent, its run log and a real Prometheus scraping the agent every
second. A false alarm is any warning or critical finding about a healthy run.

It also prints the noise the timing rules face on those healthy runs: each rank's median compute time over the
median of the other ranks' (from the run log; from the agent's window of recent steps where the hooks wrote no
log), and how close PERF002 came to firing on the run (``foreign.straggler_closeness``: both of its conditions,
the ratio for ranks on CPUs and the margin against the step; 1 would fire). Noise must sit well below 1.

Then the detection latency of a planted straggler (``--fault sleep-rank``: the last of 2 ranks sleeps 0.3 s per
step): from the moment the agent first shows a step record of the job (its /api/v1/state polled every 0.1 s) to
the first ``gpuwatch diagnose --agent`` report (one every ~0.5 s, each its own process as a user runs it) that
names PERF002 on the sleeping rank, measured by the report's own ``generated_at``.

    python benchmarks/false_alarms.py [--runs 50] [--steps 40] [--latency-repeats 3]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import foreign
from _harness import load_average, machine

from gpuwatch.agent.diagnosis.registry import REGISTRY

from conftest import PrometheusServer, wait_until

SOURCES = ("agent", "run_log", "prometheus")
RANK_COUNTS = (1, 2, 3, 4)
#: diagnose --agent is started this often while waiting for the straggler to be named.
POLL_DIAGNOSE_S = 0.5
#: Gives up on naming the straggler after this long (a run of 60 slow steps lasts ~20 s).
DETECTION_TIMEOUT_S = 90.0


@dataclass
class Tally:
    """What one source said about the healthy runs."""

    judged: int = 0
    alarmed: int = 0  # runs with at least one warning or critical finding
    by_rule: collections.Counter = field(default_factory=collections.Counter)  # runs each rule fired on
    errors: list[str] = field(default_factory=list)  # runs the source could not judge, and why

    def add(self, diagnosis: foreign.Diagnosis) -> None:
        if diagnosis.report is None:
            self.errors.append(diagnosis.error or "no report")
            return
        self.judged += 1
        serious = diagnosis.serious()
        self.alarmed += bool(serious)
        self.by_rule.update(serious.keys())


@dataclass
class Noise:
    """One healthy run's compute-time spread across its ranks."""

    name: str
    ranks: int
    origin: str  # where the per-step compute times came from: "run log" or "agent window"
    ratios: dict[int, float]
    closeness: float  # how near PERF002 came to naming a rank (1 fires), 0 for one rank


def plan(runs: int) -> list[tuple[str, int]]:
    """``runs`` (script, ranks) pairs cycling through every script at every rank count."""
    pairs = [(script, ranks) for ranks in RANK_COUNTS for script in foreign.SCRIPTS]
    return [pairs[i % len(pairs)] for i in range(runs)]


def timing_series(run: foreign.Run, field: str) -> tuple[str, dict[int, list[float]]]:
    """Each rank's per-step ``field`` (compute_seconds, step_seconds): the run log's every step, else the steps the
    agent's window kept."""
    logged = run.run_log_steps()
    if logged:
        return "run log", {rank: [s[field] for s in steps if field in s] for rank, steps in logged.items()}
    return "agent window", {r["rank"]: [p[field] for p in r.get("window") or () if field in p] for r in run.ranks}


def perf002_closeness(run: foreign.Run) -> float:
    """How near PERF002 came to naming a rank of ``run`` (1 fires), with the thresholds it uses for ranks that
    compute on CPUs, as these do (the shared-core bar)."""
    thresholds = {name: threshold.value for name, threshold in REGISTRY["PERF002"].thresholds.items()}
    ratio = max(thresholds["straggler_ratio"], thresholds["shared_cpu_ratio"])
    closeness = foreign.straggler_closeness(timing_series(run, "compute_seconds")[1],
                                            timing_series(run, "step_seconds")[1], ratio, thresholds["min_step_share"])
    return max(closeness.values(), default=0.0)


def healthy_runs(agent, prometheus: PrometheusServer, workdir: Path, runs: int,
                 steps: int) -> tuple[dict[str, Tally], list[Noise]]:
    tallies = {source: Tally() for source in SOURCES}
    noise = []
    for index, (script, ranks) in enumerate(plan(runs), 1):
        started = time.monotonic()
        try:
            run = foreign.run(foreign.Workload(script, ranks, steps), agent, workdir, prometheus)
        except RuntimeError as error:  # the workload itself failed: no verdict to count, but say so
            print(f"  [{index:3}/{runs}] {script:17} {ranks} rank(s)  RUN FAILED: {str(error)[-300:]}", flush=True)
            continue
        verdicts = []
        for source in SOURCES:
            diagnosis = run.diagnosis(source)
            tallies[source].add(diagnosis)
            verdicts.append(f"{source}: " + (", ".join(sorted(diagnosis.serious())) or "quiet")
                            if diagnosis.report is not None else f"{source}: no report")
        origin, series = timing_series(run, "compute_seconds")
        ratios = foreign.compute_ratios(series) if ranks > 1 else {}
        noise.append(Noise(f"{script} {ranks}r", ranks, origin, ratios, perf002_closeness(run)))
        spread = f"max ratio {max(ratios.values()):.2f}, PERF002 at {noise[-1].closeness:.2f}" if ratios else \
            "one rank"
        print(f"  [{index:3}/{runs}] {script:17} {ranks} rank(s)  {'; '.join(verdicts):40}  {spread:24} "
              f"{time.monotonic() - started:4.0f} s", flush=True)
    return tallies, noise


def detection_latency(agent, workdir: Path, script: str, steps: int) -> float | None:
    """Seconds from the job's first step record in the agent to the first report naming PERF002 on the sleeping
    rank; None when no report named it within DETECTION_TIMEOUT_S."""
    workload = foreign.Workload(script, 2, steps, fault="sleep-rank")
    with foreign.launched(workload, agent, workdir):
        first_seen = wait_until(lambda: any(r.get("last_step") for r in foreign.job_ranks(agent, workload.job))
                                and time.time(), timeout=60, interval=0.1, what=f"job {workload.job}'s first step")
        deadline = time.monotonic() + DETECTION_TIMEOUT_S
        while time.monotonic() < deadline:
            started = time.monotonic()
            diagnosis = foreign.diagnose(workload.job, "agent", agent.url, process=True)
            for finding in diagnosis.serious().get("PERF002", ()):
                if foreign.ranks_named(finding) == {workload.slow_rank}:
                    return diagnosis.report["generated_at"] - first_seen
            time.sleep(max(0.0, POLL_DIAGNOSE_S - (time.monotonic() - started)))
    return None


def _rate(count: int, total: int) -> str:
    return f"{count}/{total} ({100 * count / total:.0f} %)" if total else "n/a"


def report(tallies: dict[str, Tally], noise: list[Noise], runs: int) -> None:
    print(f"\nfalse alarms: runs with a warning or critical finding, of the {runs} healthy runs each source judged")
    for source, tally in tallies.items():
        line = f"  {source:8} {_rate(tally.alarmed, tally.judged):>14}"
        if tally.errors:
            line += f"   could not judge {len(tally.errors)} run(s): {tally.errors[0][:150]}"
        print(line)
    rules = sorted(set().union(*(tally.by_rule for tally in tallies.values())))
    print("per rule (runs it fired on):" + ("" if rules else " none fired"))
    for code in rules:
        print(f"  {code:8} " + "   ".join(f"{source} {_rate(tally.by_rule[code], tally.judged):>14}"
                                      for source, tally in tallies.items()))

    cpus = os.cpu_count() or 1
    print(f"\nnoise: each rank's median compute_seconds / the median of the other ranks' medians ({cpus} CPUs)")
    for sample in noise:
        if sample.ratios:
            ratios = ", ".join(f"{rank}: {ratio:.2f}" for rank, ratio in sorted(sample.ratios.items()))
            shared = "oversubscribed" if sample.ranks > cpus else "a CPU each"
            print(f"  {sample.name:20} {shared:14} max {max(sample.ratios.values()):5.2f}  PERF002 at "
                  f"{sample.closeness:4.2f}  ({ratios}; {sample.origin})")
    judged = [(max(s.ratios.values()), s) for s in noise if s.ratios]
    if judged:
        for oversubscribed in (False, True):
            group = [(ratio, s) for ratio, s in judged if (s.ranks > cpus) == oversubscribed]
            if group:
                ratio, worst = max(group, key=lambda item: item[0])
                print(f"  largest {'(oversubscribed)' if oversubscribed else '(a CPU each)    '} {ratio:.2f}  "
                      f"({worst.name})")
    thresholds = {name: threshold.value for name, threshold in REGISTRY["PERF002"].thresholds.items()}
    print(f"  PERF002 thresholds: {', '.join(f'{name} {value:g}' for name, value in thresholds.items())}")
    closest = [s.closeness for s in noise if s.ratios]
    if closest:
        print(f"  PERF002 closest to firing on a healthy run: {max(closest):.2f} (1 fires; median "
              f"{statistics.median(closest):.2f} over {len(closest)} multi-rank runs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="healthy runs, cycling through scripts and 1-4 ranks")
    parser.add_argument("--steps", type=int, default=40, help="steps of each healthy run")
    parser.add_argument("--latency-repeats", type=int, default=3, help="straggler runs timed for detection")
    parser.add_argument("--latency-steps", type=int, default=60, help="steps of each straggler run (0.3 s each)")
    args = parser.parse_args()

    print(f"machine: {machine()}; load average before {load_average()}")
    print(f"{args.runs} healthy runs of {args.steps} steps ({', '.join(foreign.SCRIPTS)} × 1-4 ranks, gloo), "
          f"agent {' '.join(foreign.AGENT_ARGS[:4])}", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpuwatch-fa-") as tmp:
        workdir = Path(tmp)
        with foreign.simulated_agent(workdir) as agent:
            prometheus = PrometheusServer(workdir, [f"127.0.0.1:{agent.port}"])
            try:
                tallies, noise = healthy_runs(agent, prometheus, workdir, args.runs, args.steps)
            finally:
                prometheus.stop()
            report(tallies, noise, args.runs)
            print(f"\ndetection latency of a sleeping rank (2 ranks, the last sleeps 0.3 s a step; diagnose --agent "
                  f"every {POLL_DIAGNOSE_S:g} s):", flush=True)
            latencies = []
            for repeat in range(args.latency_repeats):
                script = foreign.SCRIPTS[repeat % len(foreign.SCRIPTS)]
                latency = detection_latency(agent, workdir, script, args.latency_steps)
                print(f"  {script:17} " + (f"{latency:.2f} s" if latency is not None
                                           else f"not named within {DETECTION_TIMEOUT_S:.0f} s"), flush=True)
                if latency is not None:
                    latencies.append(latency)
            if latencies:
                print(f"  min {min(latencies):.2f} s  median {statistics.median(latencies):.2f} s  "
                      f"max {max(latencies):.2f} s  ({len(latencies)} of {args.latency_repeats} named)")
    print(f"\n{time.monotonic() - started:.0f} s in all; load average after {load_average()}")


if __name__ == "__main__":
    main()
