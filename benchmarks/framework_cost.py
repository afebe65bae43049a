"""What `gpuwatch run` costs a framework's job, as its user sees it: the wall time of the whole job. The jobs: a
Hugging Face Trainer (`--job hf_trainer`, the default) and the hybrid-parallel jobs built from PyTorch's own parts
(`--job tp`, `fsdp_tp`, `pp_gpipe`, `pp_1f1b`, `pp_interleaved`, `pp_tp_dp`: tests/workloads/hybrid_job.py, DTensor
tensor parallelism, FSDP2 on a device mesh, torch.distributed.pipelining); several `--job`s are measured one after
the other, each against its own unmeasured runs.

Why: a user decides whether to leave `gpuwatch run -- torchrun ...` in front of every job by how much longer the job
takes; a per-step figure (run_overhead.py, hooks_overhead.py) does not show what a real framework's job pays, with
its imports, its evaluations and checkpoints, and the instrumentation of every rank's start-up. The job is
tests/workloads/hf_trainer.py (a tiny Llama built from its config, 2 ranks with gloo on the CPU, gradient
accumulation, an evaluation and a checkpoint every 4 steps; its first import `transformers`), launched as
tests/foreign.py launches it: `torchrun --standalone --nproc-per-node 2 hf_trainer.py --steps S`, unmeasured
("off") and under `gpuwatch run --` ("on"). Each arm is a job of its own (the instrumentation cannot be switched off
inside a process), and the arms alternate, the first of each round taking turns (off, on; on, off; ...), so that a
shared machine's changing load falls on both alike; a warm-up round first, not counted, reads the packages from disk
into the page cache for both.

Per run: the wall time of the whole command (process start to exit, torchrun's and the ranks' start-up included, and
for "on" the wrapper's), the CPU time all its processes used (user + system: what the job cost the machine, which
other work on a shared machine moves less than the wall time), and the time of the training itself as the job
measures and prints it (`train_runtime`: the Trainer's `trainer.train()` from start to end, evaluations and
checkpoints included, start-up excluded; the hybrid job's training loop), and, where the job prints it, the CPU time
of rank 0's training thread per optimizer step (`train_thread_cpu_per_step`: what the hooks add to the thread that
trains, which no other thread's work can hide).
Printed: every round with its on/off ratios, min / median / max per arm, the ratio of the arms' medians and the
per-round ratios' spread, with the machine line and the load average before and after. No agent listens (as in
run_overhead.py): the ranks' records are dropped at a socket nobody binds, so what is measured is `gpuwatch run` and
its instrumentation in the job, not an agent sharing the job's CPUs (agent_cost.py measures that). A run under
`gpuwatch run` counts only if its end-of-run line says every rank was measured, every step.

    python benchmarks/framework_cost.py [--job hf_trainer] [--job tp ...] [--rounds 5] [--steps 100]
"""

from __future__ import annotations

import argparse
import compileall
import importlib.metadata
import importlib.util
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import foreign
from _harness import load_average, machine, spread

ARMS = ("off", "on")
#: Each job: (script in tests/workloads/, its ranks, its arguments).
JOBS: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "hf_trainer": ("hf_trainer", 2, ()),
    **{layout: ("hybrid_job", ranks, ("--layout", layout)) for layout, ranks in (
        ("tp", 2), ("fsdp_tp", 4), ("pp_gpipe", 2), ("pp_1f1b", 2), ("pp_interleaved", 2), ("pp_tp_dp", 8))},
}
#: The job's own timing of its training, as rank 0 prints it (the Trainer's printer callback: a string or a number).
TRAIN_RUNTIME = re.compile(r"'train_runtime': '?([0-9.]+(?:[eE][-+]?[0-9]+)?)")
#: Rank 0's training thread's CPU time per optimizer step, where the job prints it.
THREAD_CPU = re.compile(r"'train_thread_cpu_per_step': '?([0-9.]+(?:[eE][-+]?[0-9]+)?)")
#: A whole job: far above the ~10-20 s one takes on 2 CPUs.
RUN_TIMEOUT_S = 300.0


@dataclass
class Timing:
    """One run of the job: its wall time, the CPU time of all its processes (user + system), the job's
    `train_runtime` and its training thread's CPU time a step (None where it printed none)."""

    wall: float
    cpu: float
    train: float | None
    thread_cpu: float | None


def byte_compile_gpuwatch() -> list[str]:
    """Byte-compile gpuwatch's modules, as `pip install` does for a wheel: an editable install under
    PYTHONDONTWRITEBYTECODE (set on some CI machines) compiles them from source in every process instead, which
    measured ~95 ms a rank on this 2-vCPU machine, a cost no installed gpuwatch has. Returns the folders compiled."""
    folders = [location for name in ("agent", "cli", "plan", "protocol", "trainer")
               if (spec := importlib.util.find_spec(f"gpuwatch.{name}")) is not None
               for location in spec.submodule_search_locations or ()]
    for folder in folders:
        if not compileall.compile_dir(folder, quiet=1):
            raise SystemExit(f"framework_cost: could not byte-compile {folder}")
    return folders


def run_job(job: str, arm: str, steps: int, scratch: Path) -> Timing:
    """One run of `job` (JOBS), unmeasured ("off") or under `gpuwatch run` ("on"), in ``scratch``; a run that fails
    or hangs (stopped after RUN_TIMEOUT_S, its ranks too), or one under `gpuwatch run` that did not measure every
    rank's every step, raises with its output."""
    script, ranks, arguments = JOBS[job]
    workload = foreign.Workload(script, ranks, steps, args=arguments,
                                wrapper=foreign.GPUWATCH_RUN if arm == "on" else ())
    env = {name: value for name, value in os.environ.items() if not name.startswith("GPUWATCH_")}
    env["GPUWATCH_SOCKET"] = str(scratch / "nobody-listens.sock")
    out, err = scratch / f"{arm}.out", scratch / f"{arm}.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        cpu_before, started = _children_cpu(), time.perf_counter()
        process = subprocess.Popen(workload.command(), env=env, cwd=scratch, stdout=stdout, stderr=stderr)
        try:
            returncode = process.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            returncode = None
            foreign._stop(process)  # torchrun's ranks with it: they run in sessions of their own
        wall, cpu = time.perf_counter() - started, _children_cpu() - cpu_before
    output, errors = out.read_text(), err.read_text()
    if returncode != 0:
        ended = f"timed out after {RUN_TIMEOUT_S:.0f} s" if returncode is None else f"exited {returncode}"
        raise RuntimeError(f"the {arm} run {ended}:\n{(output + errors)[-4000:]}")
    measured = f"gpuwatch run: {ranks} of {ranks} ranks measured, {steps} steps each"
    if arm == "on" and measured not in errors:
        lines = [line for line in errors.splitlines() if line.startswith("gpuwatch run:")]
        raise RuntimeError(f"the on run was not measured whole: {lines or 'no end-of-run line'}\n{errors[-4000:]}")
    train, thread_cpu = TRAIN_RUNTIME.search(output), THREAD_CPU.search(output)
    return Timing(wall, cpu, float(train.group(1)) if train else None,
                  float(thread_cpu.group(1)) if thread_cpu else None)


def _children_cpu() -> float:
    """User + system CPU seconds of this process's ended children and of their descendants each waited for (the
    wrapper, torchrun, the ranks): a cost other work on a shared machine moves less than wall time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _ratio(on: float | None, off: float | None) -> str:
    return f"{on / off:.3f}" if on is not None and off else "n/a"


def _seconds(value: float | None) -> str:
    return f"{value:6.2f} s" if value is not None else "   n/a  "


def report(timings: dict[str, list[Timing]]) -> None:
    """Per arm min / median / max, the ratio of the medians, and the spread of the per-round ratios, for the whole
    job's wall and CPU time, for the job's training time and its training thread's CPU a step (where every run
    printed them)."""
    for what, label, scale, unit in (("wall", "whole job (wall)", 1, " s"),
                                     ("cpu", "whole job (CPU time of its processes)", 1, " s"),
                                     ("train", "training (the job's train_runtime)", 1, " s"),
                                     ("thread_cpu", "rank 0's training thread, CPU a step", 1000, " ms")):
        values = {arm: [None if (value := getattr(t, what)) is None else value * scale for t in timings[arm]]
                  for arm in ARMS}
        if any(value is None for arm in ARMS for value in values[arm]):
            print(f"{label}: not printed by every run")
            continue
        medians = {arm: statistics.median(values[arm]) for arm in ARMS}
        rounds = [on / off for off, on in zip(values["off"], values["on"], strict=True)]
        print(f"{label}, min / median / max: off {spread(values['off'], unit)}, on {spread(values['on'], unit)}\n"
              f"  on/off, ratio of the medians: {medians['on'] / medians['off']:.3f}; per round (min / median / "
              f"max): {spread(rounds, digits=3)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", action="append", choices=tuple(JOBS), help="the job(s) measured (default hf_trainer)")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each arm, alternating")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps of each run")
    parser.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    args = parser.parse_args()

    versions = [f"{name} {importlib.metadata.version(name)}" for name in ("torch", "transformers")]
    print(f"machine: {machine(*versions)}\nload average before: {load_average()}")
    print(f"gpuwatch byte-compiled first, as an installed wheel is: {', '.join(byte_compile_gpuwatch())}", flush=True)
    for job in args.job or ["hf_trainer"]:
        measure(job, args.rounds, args.steps, args.warmup)
    print(f"load average after: {load_average()}")


def measure(job: str, rounds: int, steps: int, warmup: int) -> None:
    """`rounds` rounds of `job`, each arm once a round, alternating, after `warmup` rounds not counted."""
    script, ranks, arguments = JOBS[job]
    print(f"\njob {job} (tests/workloads/{script}.py {' '.join(arguments)}), {ranks} ranks (gloo), {steps} steps a "
          f"run, unmeasured (off) and under `gpuwatch run` (on); {warmup} warm-up round(s), then {rounds} rounds, "
          f"the arms alternating", flush=True)
    timings: dict[str, list[Timing]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="gpuwatch-fc-") as tmp:
        for index in range(-warmup, rounds):
            order = ARMS if index % 2 == 0 else ARMS[::-1]
            done = {arm: run_job(job, arm, steps, Path(tmp)) for arm in order}
            off, on = done["off"], done["on"]
            label = f"round {index + 1}" if index >= 0 else "warm-up"
            print(f"  {label:9} {' then '.join(order):11}  off {_seconds(off.wall)} (train {_seconds(off.train)})  "
                  f"on {_seconds(on.wall)} (train {_seconds(on.train)})  on/off {_ratio(on.wall, off.wall)} "
                  f"(CPU {_ratio(on.cpu, off.cpu)}, train {_ratio(on.train, off.train)})", flush=True)
            if index >= 0:
                for arm in ARMS:
                    timings[arm].append(done[arm])
    report(timings)


if __name__ == "__main__":
    main()
