"""Does the calibrated planner rank real layouts in their measured order? The reference trainer runs on this CPU
(gloo, one process and one thread per rank) at several tp × pp × dp layouts, both pipeline schedules; the planner,
calibrated on this machine (`gpuwatch.plan.calibrate`: its matmuls' FLOP/s at the model's shapes, and `gpuwatch
probe`'s bus bandwidth per size on loopback), predicts each one's step. Printed: the machine and its load before
and after, each layout's measured step (min / median / max over the rounds of each round's median step), its
prediction and relative error, Kendall's τ-b between the two orders, and each pipeline layout's bubble as the
hooks measure it (`PipelineClock`) beside the planner's (p − 1)/(m + p − 1).

Layouts take turns round by round, so that a shared machine's changing load falls on all of them. World sizes stay
at most the machine's cores (2 here): the planner's GPU is a whole device per rank, and two ranks time-sharing one
core would measure the scheduler, not the layout.

Kendall's τ-b (Kendall 1945, "The treatment of ties in ranking problems", Biometrika 33(3)) is computed here by
hand (scipy is not a dependency): (concordant − discordant) / sqrt((n0 − n1)(n0 − n2)), ties in either order
counting in neither.

    python benchmarks/plan_ranking.py [--rounds 3] [--steps 8] [--warmup 3] [--per-layout-calibration]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from itertools import combinations
from pathlib import Path
from typing import Any

from _harness import load_average, machine, spread

from gpuwatch.plan import calibrate
from gpuwatch.plan.compute import bubble_fraction
from gpuwatch.plan.gpus import Calibration, Cluster, preset
from gpuwatch.plan.model import ModelShape, from_reference
from gpuwatch.plan.planner import predict
from gpuwatch.plan.run import Layout, Run, numerics
from gpuwatch.trainer.config import ModelConfig, TrainConfig

#: Big enough that a step is mostly matmuls (about 20 GFLOP, a quarter of a second on one core), small enough for
#: several rounds of every layout in a few minutes.
MODEL = ModelConfig(vocab_size=512, seq_len=128, hidden=256, heads=4, layers=4)
GLOBAL_BATCH = 8
LAYOUTS = (
    Layout(1, 1, 1, 1), Layout(1, 1, 1, 4), Layout(2, 1, 1, 1), Layout(1, 1, 2, 1),
    Layout(1, 2, 1, 2, "gpipe"), Layout(1, 2, 1, 2, "1f1b"), Layout(1, 2, 1, 4, "gpipe"), Layout(1, 2, 1, 4, "1f1b"),
    Layout(1, 2, 1, 8, "1f1b"),
)
#: The calibration's sweep: every micro-batch size the layouts run (global batch / dp / m).
MICRO_BATCH_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Measured:
    """One layout's run: the step seconds of each step after the warm-up (the slowest rank's), and each pipeline
    stage's measured bubble ratios over those steps."""

    steps: list[float]
    bubbles: dict[int, list[float]]


def train_config(layout: Layout, steps: int, run_log: Path) -> TrainConfig:
    return TrainConfig(model=MODEL, tp=layout.tp, pp=layout.pp, dp=layout.dp, micro_batches=layout.micro_batches,
                       schedule=layout.schedule, global_batch=GLOBAL_BATCH, steps=steps, telemetry=True,
                       job="plan-ranking", run_log=str(run_log), telemetry_socket=str(run_log / "no-agent.sock"),
                       grad_similarity_every=0, checksum_every=0, memory_every=0, device="cpu")


def quiet_train(device: Any, cfg: TrainConfig) -> list[Any]:
    """One rank of `gpuwatch.trainer.train.train`, its per-step lines not printed."""
    from gpuwatch.trainer.train import train

    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        return train(device, cfg)


def run_layout(layout: Layout, steps: int, warmup: int) -> Measured:
    """The reference trainer at ``layout`` for ``steps`` steps, forked ranks on gloo; its step records read back
    from the run log."""
    from gpuwatch.trainer.launch import launch

    with tempfile.TemporaryDirectory(prefix="plan-ranking-") as work:
        run_log = Path(work)
        cfg = train_config(layout, steps, run_log)
        results = launch(quiet_train, cfg.world_size, cfg, device="cpu", timeout=600)
        records = {path.name: [json.loads(line) for line in path.read_text().splitlines()]
                   for path in sorted(run_log.glob("rank-*.jsonl"))}
    kept = range(warmup, steps)
    step_seconds = [max(rank[index].step_time_s for rank in results) for index in kept]
    bubbles: dict[int, list[float]] = {}
    for rank_records in records.values():
        stage = next(r["pp_stage"] for r in rank_records if r["kind"] == "hello")
        for record in rank_records:
            if record["kind"] == "step" and record["step"] > warmup and record.get("pipeline"):
                bubbles.setdefault(stage, []).append(record["pipeline"]["bubble_ratio"])
    return Measured(step_seconds, bubbles)


def probe_bandwidth(ranks: int, out: Path) -> Path:
    """`gpuwatch probe` on gloo over ``ranks`` forked ranks, its record in ``out`` (a JSONL run log)."""
    command = [sys.executable, "-m", "gpuwatch.cli.main", "probe", "--device", "cpu", "--nproc", str(ranks),
               "--max-bytes", "16M", "--iters", "10", "--warmup", "3", "--run-log", str(out)]
    env = {**os.environ, "GPUWATCH_SOCKET": str(out.with_suffix(".sock"))}  # never a real agent's
    subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    return out


def layout_shapes(shape: ModelShape, layout: Layout) -> list[calibrate.Shape]:
    """The matmuls one rank of ``layout`` runs most: a micro-batch's tokens, its TP slice."""
    tokens = layout.micro_batch_size(GLOBAL_BATCH) * MODEL.seq_len
    return calibrate.model_shapes(shape, tokens, layout.tp)


def kendall_tau_b(xs: list[float], ys: list[float]) -> float:
    """Kendall's τ-b of two paired lists (module docstring)."""
    concordant = discordant = ties_x = ties_y = 0
    for (x1, y1), (x2, y2) in combinations(zip(xs, ys, strict=True), 2):
        dx, dy = x1 - x2, y1 - y2
        if dx == 0 or dy == 0:
            ties_x += dx == 0
            ties_y += dy == 0
            continue
        if (dx > 0) == (dy > 0):
            concordant += 1
        else:
            discordant += 1
    pairs = len(xs) * (len(xs) - 1) // 2
    return (concordant - discordant) / math.sqrt((pairs - ties_x) * (pairs - ties_y))


def separated_pairs(ranges: list[tuple[float, float]], predicted: list[float]) -> tuple[int, int]:
    """Of the pairs of layouts measured apart (their rounds' min-max ranges do not overlap: an order the noise
    cannot swap), how many the prediction orders the same way, and how many there are. τ-b counts every pair,
    those within each other's noise too."""
    right = total = 0
    for ((low1, high1), p1), ((low2, high2), p2) in combinations(zip(ranges, predicted, strict=True), 2):
        if high1 < low2 or high2 < low1:
            total += 1
            right += (low1 < low2) == (p1 < p2)
    return right, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of every layout, taking turns")
    parser.add_argument("--steps", type=int, default=8, help="steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps per run left out")
    parser.add_argument("--repeats", type=int, default=calibrate.REPEATS, help="matmul calibration rounds")
    args = parser.parse_args()
    if min(args.rounds, args.repeats) < 1 or not 0 <= args.warmup < args.steps:
        parser.error("--rounds and --repeats must be at least 1, --warmup below --steps")
    import torch

    shape = from_reference(MODEL)
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="plan-ranking-probe-") as work:
        probe = probe_bandwidth(2, Path(work) / "probe.jsonl")
        reference = Layout(1, 1, 1, 1)
        calibration = calibrate.measure(layout_shapes(shape, reference), "cpu", "fp32", args.repeats, threads=1,
                                        probes=[probe], sweep=calibrate.sweep_shapes(shape, MODEL.seq_len,
                                                                                     MICRO_BATCH_SIZES))
    measured: dict[Layout, list[Measured]] = {layout: [] for layout in LAYOUTS}
    for _ in range(args.rounds):
        for layout in LAYOUTS:
            measured[layout].append(run_layout(layout, args.steps, args.warmup))
    print(f"machine: {machine(f'torch {torch.__version__}')}; load {load_before} before, {load_average()} after")
    print(f"model: {MODEL}, global batch {GLOBAL_BATCH}; {args.rounds} rounds of {args.steps} steps "
          f"({args.warmup} warm-up left out), one thread per rank")
    points = calibration.bus_bandwidth["nvlink"]
    print(f"calibration: matmul {calibration.matmul_flops / 1e9:.1f} GFLOP/s (median of "
          f"{spread([r / 1e9 for r in calibration.measured['flops_samples']], '', 1)} at "
          f"{calibration.measured['shapes']}); loopback all-reduce busbw {points[0][1] / 1e9:.3f} GB/s at "
          f"{points[0][0]} B … {points[-1][1] / 1e9:.3f} GB/s at {points[-1][0]} B")
    print("matmul FLOP/s by a layer's matmul work per micro-batch: " + ", ".join(
        f"{size / 1e6:.0f} MFLOP {rate / 1e9:.1f} G" for size, rate in calibration.flops_by_work))
    report(shape, calibration, measured)


def report(shape: ModelShape, calibration: Calibration, measured: dict[Layout, list[Measured]]) -> None:
    # on the CPU, SDPA's math kernel keeps the scores and recomputes nothing: no flash attention
    run = Run(GLOBAL_BATCH, MODEL.seq_len, numerics("fp32", reference=True), sequence_parallel=False,
              flash_attention=False)
    medians, predicted, unswept, ranges = [], [], [], []
    print(f"{'layout':<34} {'measured step s min / median / max':>36} {'predicted':>9} {'error':>7} "
          f"{'unswept':>9} {'error':>7}")
    for layout, runs in measured.items():
        cluster = Cluster(layout.tp * layout.pp * layout.dp, 2, preset("h100-80gb"), calibration=calibration)
        one_figure = replace(cluster, calibration=replace(calibration, flops_by_work=()))
        prediction, plain = (predict(shape, c, run, layout).step_seconds for c in (cluster, one_figure))
        rounds = [statistics.median(m.steps) for m in runs]
        median = statistics.median(rounds)
        medians.append(median)
        ranges.append((min(rounds), max(rounds)))
        predicted.append(prediction)
        unswept.append(plain)
        print(f"{layout.name:<34} {spread(rounds, ' s', 3):>36} {prediction:>9.3f} "
              f"{(prediction - median) / median:>+7.1%} {plain:>9.3f} {(plain - median) / median:>+7.1%}")
    print(f"Kendall tau-b, measured against predicted: {kendall_tau_b(medians, predicted):.3f} (one matmul figure, "
          f"no sweep: {kendall_tau_b(medians, unswept):.3f})")
    right, apart = separated_pairs(ranges, predicted)
    print(f"pairs measured apart (min-max ranges disjoint) ranked in their measured order: {right} of {apart}")
    print("bubble, measured by the hooks (median over steps and rounds, per stage) against (p - 1)/(m + p - 1):")
    for layout, runs in measured.items():
        if layout.pp == 1:
            continue
        stages = sorted({stage for m in runs for stage in m.bubbles})
        by_stage = [statistics.median([b for m in runs for b in m.bubbles.get(stage, [])]) for stage in stages]
        print(f"  {layout.name:<34} measured {', '.join(f'{b:.3f}' for b in by_stage)}; predicted "
              f"{bubble_fraction(layout.pp, layout.micro_batches):.3f}")


if __name__ == "__main__":
    main()
