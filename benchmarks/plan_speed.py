"""How long `gpuwatch plan` takes to plan 1,024 GPUs: every tp × pp × dp grid and every micro-batch count, schedule,
recomputation and ZeRO-1 variant of it (the issue's target: at most 1 s).

The model is Llama-2-70B's shape (80 layers, hidden 8192, 64 heads and 8 key/value heads, ffn 28672, vocabulary
32000), on H100s in nodes of 8, a global batch of 2,048 sequences of 4,096 tokens. Times the planner itself (no
output), min / median / max over the repeats."""

from __future__ import annotations

import argparse
import time

from _harness import load_average, machine, spread

from gpuwatch.plan.gpus import Cluster, preset
from gpuwatch.plan.model import ModelShape
from gpuwatch.plan.planner import plan
from gpuwatch.plan.run import Run, numerics

LLAMA_70B = ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000, tied_embeddings=False)


def measure(gpus: int, global_batch: int, repeats: int) -> tuple[list[float], int, int]:
    """Seconds of each plan, and how many layouts it found feasible and rejected."""
    cluster, run = Cluster(gpus, 8, preset("h100-80gb")), Run(global_batch, 4096, numerics("bf16"))
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = plan(LLAMA_70B, cluster, run)
        seconds.append(time.perf_counter() - started)
    return seconds, len(result.feasible), len(result.rejected)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if min(args.gpus, args.global_batch, args.repeats) < 1:
        parser.error("--gpus, --global-batch and --repeats must be at least 1")
    load_before = load_average()
    seconds, feasible, rejected = measure(args.gpus, args.global_batch, args.repeats)
    print(f"machine: {machine()}; load {load_before} before, {load_average()} after")
    print(f"plan of {args.gpus} GPUs, global batch {args.global_batch}: {feasible} feasible layouts, {rejected} "
          f"rejected; {args.repeats} plans, s min / median / max: {spread(seconds, ' s', 3)}")


if __name__ == "__main__":
    main()
