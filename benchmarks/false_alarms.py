"""How often ``gpuwatch diagnose`` cries wolf on users' own healthy training scripts, and how soon it names a real
straggler.

Why: a rule that fires on healthy jobs teaches users to ignore the report. A user's plain DDP tutorial (2 ranks,
gloo, ~2 ms steps) got a straggler warning on 7 of 10 healthy runs. This runs N healthy runs of the user-style
scripts in tests/workloads/ (a DDP tutorial, gradient accumulation, a tiny LM), cycling through them and through
1-4 ranks, each under torchrun against a real ``gpuwatch agent --simulate dgx-h100 --interval 1``
(tests/foreign.py), and judges each through the agent, its run log and a real Prometheus scraping the agent every
second. A false alarm is any warning or critical finding about a healthy run.

Then the same for jobs on the real frameworks (``--framework-runs``): the jobs of tests/test_frameworks.py (its
``VARIANTS``: a Hugging Face ``Trainer`` with gradient accumulation, evaluations and checkpoints, an ``accelerate``
loop, Lightning through ``lightning`` and ``pytorch_lightning`` with ``accumulate_grad_batches`` 1 and 2, an FSDP2
loop), cycling through them, each as a user runs it: ``gpuwatch run -- torchrun --standalone --nproc-per-node 2``,
its first import the framework, no gpuwatch import in it, reporting to the same agent and judged through the same
three sources. Why: most training jobs train through one of these, whose callbacks, evaluations, checkpoints,
closures and sharded collectives put time in places a hand-written loop does not; a rule that fires on them would
fire on most users' jobs. Every source's verdicts are printed per workload, and a multi-rank run on which PERF002
did not run at all (its ranks not compared: a silence that is no verdict) is counted apart.

It also prints the noise the timing rules face on those healthy runs: each rank's median busy time (its step's
phases summed, what PERF002 judges) over the median of the other ranks' (from the run log; from the agent's window
of recent steps where the hooks wrote no log), and how close PERF002 came to firing on the run
(``foreign.straggler_closeness``: both of its conditions, the ratio for ranks on CPUs and the margin against the
step; 1 would fire). Noise must sit well below 1.

Then the detection latency of a planted straggler (``--fault sleep-rank``: the last of 2 ranks sleeps 0.3 s per
step): from the moment the agent first shows a step record of the job (its /api/v1/state polled every 0.1 s) to
the first ``gpuwatch diagnose --agent`` report (one every ~0.5 s, each its own process as a user runs it) that
names PERF002 on the sleeping rank, measured by the report's own ``generated_at``.

    python benchmarks/false_alarms.py [--runs 50] [--framework-runs 70] [--steps 40] [--latency-repeats 3]
"""

from __future__ import annotations

import argparse
import collections
import json
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
from test_frameworks import VARIANTS

from gpuwatch.agent.telemetry.window import BUSY, PHASE_TIMINGS
from gpuwatch.diagnosis.registry import REGISTRY

from conftest import PrometheusServer, wait_until

SOURCES = ("agent", "run_log", "prometheus")
RANK_COUNTS = (1, 2, 3, 4)
#: The framework jobs' ranks: 2, as tests/test_frameworks.py runs them.
FRAMEWORK_RANKS = 2
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
    uncompared: int = 0  # multi-rank runs on which PERF002 did not run: no straggler verdict at all
    why_uncompared: collections.Counter = field(default_factory=collections.Counter)

    def add(self, diagnosis: foreign.Diagnosis, ranks: int) -> None:
        if diagnosis.report is None:
            self.errors.append(diagnosis.error or "no report")
            return
        self.judged += 1
        serious = diagnosis.serious()
        self.alarmed += bool(serious)
        self.by_rule.update(serious.keys())
        if ranks > 1 and (why := diagnosis.not_run().get("PERF002")) is not None:
            self.uncompared += 1
            self.why_uncompared[why] += 1

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.judged + other.judged, self.alarmed + other.alarmed, self.by_rule + other.by_rule,
                     self.errors + other.errors, self.uncompared + other.uncompared,
                     self.why_uncompared + other.why_uncompared)


@dataclass
class Noise:
    """One healthy run's busy-time spread across its ranks."""

    name: str
    ranks: int
    origin: str  # where the per-step busy times came from: "run log" or "agent window"
    ratios: dict[int, float]
    closeness: float  # how near PERF002 came to naming a rank (1 fires), 0 for one rank


def plan(runs: int, framework_runs: int, steps: int) -> list[tuple[str, foreign.Workload]]:
    """(name, workload) of every healthy run: ``runs`` of the user scripts, cycling through every script at every
    rank count, then ``framework_runs`` of the framework jobs under ``gpuwatch run``, cycling through their variants
    (a variant's name is the workload's name in the tables: one script serves the four Lightning variants)."""
    pairs = [(script, ranks) for ranks in RANK_COUNTS for script in foreign.SCRIPTS]
    variants = list(VARIANTS.items())
    return [(script, foreign.Workload(script, ranks, steps))
            for script, ranks in (pairs[i % len(pairs)] for i in range(runs))] + \
        [(name, foreign.Workload(script, FRAMEWORK_RANKS, steps, args=args, wrapper=foreign.GPUWATCH_RUN))
         for name, (script, args) in (variants[i % len(variants)] for i in range(framework_runs))]


def _timing(step: dict, field: str) -> float | None:
    """A step's ``field``, or for ``BUSY`` the phases it reported summed (``window.summarize``'s busy time)."""
    if field != BUSY:
        return step.get(field)
    phases = [step[phase] for phase in PHASE_TIMINGS if phase in step]
    return sum(phases) if phases else None


def timing_series(run: foreign.Run, field: str) -> tuple[str, dict[int, list[float]]]:
    """Each rank's per-step ``field`` (busy_seconds, step_seconds): the run log's every step, else the steps the
    agent's window kept."""
    logged = run.run_log_steps()
    if logged:
        steps_of = {rank: steps for rank, steps in logged.items()}
        origin = "run log"
    else:
        steps_of = {r["rank"]: list(r.get("window") or ()) for r in run.ranks}
        origin = "agent window"
    return origin, {rank: [value for s in steps if (value := _timing(s, field)) is not None]
                    for rank, steps in steps_of.items()}


def perf002_closeness(run: foreign.Run) -> float:
    """How near PERF002 came to naming a rank of ``run`` (1 fires), with the thresholds it uses for ranks that
    compute on CPUs, as these do (the shared-core bar)."""
    thresholds = {name: threshold.value for name, threshold in REGISTRY["PERF002"].thresholds.items()}
    ratio = max(thresholds["straggler_ratio"], thresholds["shared_cpu_ratio"])
    closeness = foreign.straggler_closeness(timing_series(run, BUSY)[1],
                                            timing_series(run, "step_seconds")[1], ratio, thresholds["min_step_share"])
    return max(closeness.values(), default=0.0)


def healthy_runs(agent, prometheus: PrometheusServer, workdir: Path, jobs: list[tuple[str, foreign.Workload]]
                 ) -> tuple[dict[str, dict[str, Tally]], list[Noise], list[str]]:
    """Run each of ``jobs`` to its end and judge it through every source: {workload name: {source: Tally}}, each
    run's busy-time noise, and the names of the runs that failed (no verdict to count)."""
    tallies: dict[str, dict[str, Tally]] = {}
    noise = []
    failed = []
    for index, (name, workload) in enumerate(jobs, 1):
        started = time.monotonic()
        ranks = workload.nproc
        try:
            run = foreign.run(workload, agent, workdir, prometheus)
        except RuntimeError as error:  # the workload itself failed: no verdict to count, but say so
            print(f"  [{index:3}/{len(jobs)}] {name:19} {ranks} rank(s)  RUN FAILED: {str(error)[-300:]}", flush=True)
            failed.append(name)
            continue
        verdicts = []
        for source in SOURCES:
            diagnosis = run.diagnosis(source)
            tallies.setdefault(name, {s: Tally() for s in SOURCES})[source].add(diagnosis, ranks)
            verdicts.append(f"{source}: " + (", ".join(sorted(diagnosis.serious())) or "quiet")
                            if diagnosis.report is not None else f"{source}: no report")
            for code, findings in diagnosis.serious().items():  # a false alarm: what it said, to be read and fixed
                for finding in findings:
                    evidence = json.dumps([{"where": e["where"], "values": e.get("values")}
                                           for e in finding["evidence"]])
                    print(f"      FALSE ALARM {source}: {finding['severity']} {code} {finding['title']}; evidence "
                          f"{evidence[:600]}", flush=True)
        origin, series = timing_series(run, BUSY)
        ratios = foreign.busy_ratios(series) if ranks > 1 else {}
        noise.append(Noise(f"{name} {ranks}r", ranks, origin, ratios, perf002_closeness(run)))
        spread = f"max ratio {max(ratios.values()):.2f}, PERF002 at {noise[-1].closeness:.2f}" if ratios else \
            "one rank"
        print(f"  [{index:3}/{len(jobs)}] {name:19} {ranks} rank(s)  {'; '.join(verdicts):40}  {spread:24} "
              f"{time.monotonic() - started:4.0f} s", flush=True)
    return tallies, noise, failed


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


def _total(tallies: list[dict[str, Tally]]) -> dict[str, Tally]:
    """Each source's tallies added up over several workloads."""
    return {source: sum((t[source] for t in tallies), Tally()) for source in SOURCES}


def report(tallies: dict[str, dict[str, Tally]], noise: list[Noise], failed: list[str]) -> None:
    groups = {"all user scripts": [t for name, t in tallies.items() if name in foreign.SCRIPTS],
              "all framework jobs": [t for name, t in tallies.items() if name in VARIANTS]}
    total = _total(list(tallies.values()))
    rows = [*tallies.items(), *((label, _total(group)) for label, group in groups.items() if group), ("all", total)]
    print("\nfalse alarms: runs with a warning or critical finding, of the healthy runs each source judged")
    print(f"  {'workload':19} " + " ".join(f"{source:>15}" for source in SOURCES))
    for name, by_source in rows:
        print(f"  {name:19} " + " ".join(f"{_rate(t.alarmed, t.judged):>15}" for t in by_source.values()))
    if failed:
        print(f"  runs that failed, not judged: {len(failed)} ({', '.join(sorted(set(failed)))})")
    for source, tally in total.items():
        if tally.errors:
            print(f"  {source} could not judge {len(tally.errors)} run(s): {tally.errors[0][:150]}")
        if tally.uncompared:
            print(f"  {source}: PERF002 did not run on {tally.uncompared} multi-rank run(s): "
                  + "; ".join(f"{why} ({count})" for why, count in tally.why_uncompared.most_common()))
    rules = sorted(set().union(*(tally.by_rule for tally in total.values())))
    print("per rule (runs it fired on):" + ("" if rules else " none fired"))
    for code in rules:
        where = ", ".join(name for name, by_source in tallies.items()
                          if any(t.by_rule[code] for t in by_source.values()))
        print(f"  {code:8} " + "   ".join(f"{source} {_rate(tally.by_rule[code], tally.judged):>14}"
                                      for source, tally in total.items()) + f"   ({where})")

    cpus = os.cpu_count() or 1
    print(f"\nnoise: each rank's median {BUSY} / the median of the other ranks' medians ({cpus} CPUs)")
    for sample in noise:
        if sample.ratios:
            ratios = ", ".join(f"{rank}: {ratio:.2f}" for rank, ratio in sorted(sample.ratios.items()))
            shared = "oversubscribed" if sample.ranks > cpus else "a CPU each"
            print(f"  {sample.name:24} {shared:14} max {max(sample.ratios.values()):5.2f}  PERF002 at "
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


def latency_report(agent, workdir: Path, repeats: int, steps: int) -> None:
    """Print the detection latency of a sleeping rank, ``repeats`` runs of ``steps`` steps cycling through the
    user scripts."""
    print(f"\ndetection latency of a sleeping rank (2 ranks, the last sleeps 0.3 s a step; diagnose --agent "
          f"every {POLL_DIAGNOSE_S:g} s):", flush=True)
    latencies = []
    for repeat in range(repeats):
        script = foreign.SCRIPTS[repeat % len(foreign.SCRIPTS)]
        latency = detection_latency(agent, workdir, script, steps)
        print(f"  {script:17} " + (f"{latency:.2f} s" if latency is not None
                                   else f"not named within {DETECTION_TIMEOUT_S:.0f} s"), flush=True)
        if latency is not None:
            latencies.append(latency)
    if latencies:
        print(f"  min {min(latencies):.2f} s  median {statistics.median(latencies):.2f} s  "
              f"max {max(latencies):.2f} s  ({len(latencies)} of {repeats} named)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="healthy runs, cycling through scripts and 1-4 ranks")
    parser.add_argument("--framework-runs", type=int, default=2 * len(VARIANTS),
                        help="healthy runs of the framework jobs under gpuwatch run, cycling through their variants")
    parser.add_argument("--steps", type=int, default=40, help="steps (optimizer steps) of each healthy run")
    parser.add_argument("--latency-repeats", type=int, default=3, help="straggler runs timed for detection")
    parser.add_argument("--latency-steps", type=int, default=60, help="steps of each straggler run (0.3 s each)")
    args = parser.parse_args()

    print(f"machine: {machine()}; load average before {load_average()}")
    print(f"{args.runs} healthy runs of {args.steps} steps ({', '.join(foreign.SCRIPTS)} × 1-4 ranks, gloo), then "
          f"{args.framework_runs} of the framework jobs under gpuwatch run ({', '.join(VARIANTS)} × "
          f"{FRAMEWORK_RANKS} ranks), agent {' '.join(foreign.AGENT_ARGS[:4])}", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpuwatch-fa-") as tmp:
        workdir = Path(tmp)
        with foreign.simulated_agent(workdir) as agent:
            prometheus = PrometheusServer(workdir, [f"127.0.0.1:{agent.port}"])
            try:
                tallies, noise, failed = healthy_runs(agent, prometheus, workdir,
                                                      plan(args.runs, args.framework_runs, args.steps))
            finally:
                prometheus.stop()
            report(tallies, noise, failed)
            if args.latency_repeats:
                latency_report(agent, workdir, args.latency_repeats, args.latency_steps)
    print(f"\n{time.monotonic() - started:.0f} s in all; load average after {load_average()}")


if __name__ == "__main__":
    main()
