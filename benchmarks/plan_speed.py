"""How long `gpuwatch plan` takes to plan 1,024 GPUs: every tp × pp × dp grid and every micro-batch count, schedule
(GPipe, 1F1B, interleaved 1F1B at each number of virtual stages, ZB-V), recomputation and ZeRO-1 variant of it, with
the shape model of compute (`gpuwatch plan`'s default). Targets: at most 1 s before the schedules (issue #21), at
most 2 s with them (issue #46). Wall seconds and the process's CPU seconds (on a shared machine the wall time
includes others' load; the CPU time does not).

The model is Llama-2-70B's shape (80 layers, hidden 8192, 64 heads and 8 key/value heads, ffn 28672, vocabulary
32000), on H100s in nodes of 8, a global batch of 2,048 sequences of 4,096 tokens (``--seq-len``: longer sequences add
the context-parallel grids). Times the planner itself (no
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


def measure(gpus: int, global_batch: int, seq_len: int, repeats: int) -> tuple[list[float], list[float], int, int]:
    """Wall and CPU seconds of each plan, and how many layouts it found feasible and rejected."""
    cluster = Cluster(gpus, 8, preset("h100-80gb"), efficiency=None)
    run = Run(global_batch, seq_len, numerics("bf16"))
    seconds, cpu = [], []
    for _ in range(repeats):
        started, started_cpu = time.perf_counter(), time.process_time()
        result = plan(LLAMA_70B, cluster, run)
        seconds.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    return seconds, cpu, len(result.feasible), len(result.rejected)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=4096,
                        help="Tokens per sequence; from 8,192 the planner also searches context parallelism.")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if min(args.gpus, args.global_batch, args.seq_len, args.repeats) < 1:
        parser.error("--gpus, --global-batch, --seq-len and --repeats must be at least 1")
    load_before = load_average()
    seconds, cpu, feasible, rejected = measure(args.gpus, args.global_batch, args.seq_len, args.repeats)
    print(f"machine: {machine()}; load {load_before} before, {load_average()} after")
    print(f"plan of {args.gpus} GPUs, global batch {args.global_batch} × {args.seq_len} tokens: {feasible} feasible "
          f"layouts, {rejected} rejected; {args.repeats} plans, s min / median / max: {spread(seconds, ' s', 3)}; CPU "
          f"{spread(cpu, ' s', 3)}")


if __name__ == "__main__":
    main()
