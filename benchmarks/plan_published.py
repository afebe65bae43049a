"""How close `gpuwatch plan` comes to what large published jobs achieved, on their own layouts: no timing here, the
planner's predictions beside published figures.

* Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
  (arXiv:2104.04473), Table 1: ten GPT models, 1.7 B … 1,008 B parameters, on 32 … 3,072 A100 80 GB (DGX A100,
  Selene), sequence 2,048, vocabulary 51,200, with the tensor- and pipeline-parallel sizes and global batch given
  there; achieved teraFLOP/s per GPU as the paper counts them (§5.1: 96·B·s·l·h²(1 + s/(6h) + V/(16lh)) a step,
  full activation recomputation counted), 137 … 163. The runs recompute every layer (the paper's FLOPs count
  assumes it) and use no sequence parallelism (it came with Korthikanti et al. 2022) and no flash attention (Dao
  et al. 2022 came later), and no distributed optimizer (Megatron-LM added it in 2022): the planner is given the
  same.
* Llama 3 405B (Llama Team, "The Llama 3 Herd of Models", arXiv:2407.21783, Table 4): 8,192 H100 at tp 8, cp 1,
  pp 16, dp 64, sequence 8,192, 16 M tokens a batch (2,048 sequences), 430 teraFLOP/s per GPU in BF16, i.e.
  430/989 = 43.5 % MFU. The shape: 126 layers, hidden 16,384, ffn 53,248, 128 heads, 8 key/value heads,
  vocabulary 128,256 (the paper's Table 3).

For each, the planner plans the paper's grid (tp × pp × dp fixed) and keeps its fastest feasible variant (micro-
batches, schedule, recomputation where the paper does not fix it, ZeRO-1): what a user of the planner would be
told. Printed: the variant, its predicted step, the published step (the paper's FLOPs over its achieved FLOP/s),
and the ratio predicted speed / achieved speed (= published step / predicted step; 1 is exact, below 1 the planner
is pessimistic). Nothing is tuned per row.

    python benchmarks/plan_published.py [--efficiency 0.5]   # a flat efficiency instead of the shape model
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from gpuwatch.plan.gpus import Cluster, preset
from gpuwatch.plan.model import ModelShape
from gpuwatch.plan.planner import Prediction, divisors, predict, variants
from gpuwatch.plan.run import Layout, Run, numerics


@dataclass(frozen=True)
class Row:
    """One published run: the model, the grid, the batch, what it achieved per GPU (FLOP/s as its paper counts)."""

    name: str
    shape: ModelShape
    tp: int
    pp: int
    gpus: int
    global_batch: int
    seq_len: int
    achieved: float


def gpt(layers: int, hidden: int, heads: int) -> ModelShape:
    return ModelShape(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=51200,
                      tied_embeddings=True, gated=False, norm_params=2, bias=True, positions=2048)


#: Narayanan et al. 2021, Table 1: (billions, heads, hidden, layers, tp, pp, GPUs, batch, achieved TFLOP/s/GPU).
NARAYANAN_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
NARAYANAN_ROWS = [Row(f"GPT {billions} B", gpt(layers, hidden, heads), tp, pp, gpus, batch, 2048, achieved * 1e12)
                  for billions, heads, hidden, layers, tp, pp, gpus, batch, achieved in NARAYANAN_TABLE_1]
LLAMA_3_405B = Row("Llama 3 405B", ModelShape(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248,
                                              vocab=128256, tied_embeddings=False),
                   8, 16, 8192, 2048, 8192, 430e12)


def narayanan_flops(row: Row) -> float:
    """§5.1's FLOPs of a step, with full recomputation."""
    shape, s, b = row.shape, row.seq_len, row.global_batch
    h, layers, v = shape.hidden, shape.layers, shape.vocab
    return 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))


#: The schedules both jobs could run: Megatron-LM's 1F1B and interleaved 1F1B (Llama 3 ran a modified interleaved
#: 1F1B, its paper's §3.3.2); the zero-bubble schedules came later (Qi et al. 2024).
PUBLISHED_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")


def fastest(row: Row, cluster: Cluster, run: Run, recompute: str | None, zero1: bool = True) -> Prediction | None:
    """The fastest variant of the row's grid that fits (recomputation ``recompute`` only, where given; the
    schedules of its time; ZeRO-1 only if ``zero1``)."""
    dp = row.gpus // (row.tp * row.pp)
    best: Prediction | None = None
    for layout in variants(Layout(row.tp, row.pp, dp), run, row.shape.layers):
        if (recompute is not None and layout.recompute != recompute) or layout.schedule not in PUBLISHED_SCHEDULES:
            continue
        if layout.zero1 and not zero1:
            continue
        prediction = predict(row.shape, cluster, run, layout)
        if prediction.memory.total > cluster.gpu.memory_bytes:
            continue
        if best is None or prediction.step_seconds < best.step_seconds:
            best = prediction
    return best


def narayanan(row: Row, efficiency: float | None) -> tuple[Prediction | None, float]:
    cluster = Cluster(row.gpus, 8, preset("a100-80gb"), efficiency=efficiency)
    run = Run(row.global_batch, row.seq_len, numerics("fp16"), sequence_parallel=False)
    run = with_attention(run, flash=False)
    return fastest(row, cluster, run, "full", zero1=False), narayanan_flops(row) / (row.achieved * row.gpus)


def llama(row: Row, efficiency: float | None) -> tuple[Prediction | None, float]:
    cluster = Cluster(row.gpus, 8, preset("h100-80gb"), efficiency=efficiency)
    run = with_attention(Run(row.global_batch, row.seq_len, numerics("bf16")), flash=True)
    best = fastest(row, cluster, run, None)
    peak = cluster.gpu.peak_flops["bf16"]
    model_flops = best.model_flops if best else 0.0
    return best, model_flops / (row.achieved / peak * peak * row.gpus)


def with_attention(run: Run, flash: bool) -> Run:
    """The run with flash attention on or off, where the planner knows the setting."""
    return replace(run, flash_attention=flash) if hasattr(run, "flash_attention") else run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--efficiency", type=float, default=None,
                        help="a flat efficiency (the planner before the shape model: 0.5) instead of the shape model")
    args = parser.parse_args()
    assert all(row.gpus % (row.tp * row.pp) == 0 and (row.gpus // (row.tp * row.pp)) in divisors(row.gpus)
               for row in NARAYANAN_ROWS)
    print(f"{'run':<16} {'grid':<16} {'fastest variant the planner finds':<52} {'pred s':>8} {'paper s':>8} "
          f"{'bubble':>6} {'ratio':>6}")
    ratios = []
    for row, judge in [*((r, narayanan) for r in NARAYANAN_ROWS), (LLAMA_3_405B, llama)]:
        best, published = judge(row, args.efficiency)
        grid = f"tp{row.tp} pp{row.pp} dp{row.gpus // (row.tp * row.pp)}"
        if best is None:
            print(f"{row.name:<16} {grid:<16} nothing fits")
            continue
        ratio = published / best.step_seconds
        ratios.append(ratio)
        print(f"{row.name:<16} {grid:<16} {best.layout.name:<52} {best.step_seconds:>8.2f} {published:>8.2f} "
              f"{best.bubble:>6.1%} {ratio:>6.2f}")
    print(f"ratio predicted/achieved speed: min {min(ratios):.2f}, max {max(ratios):.2f}; within 15 %: "
          f"{sum(abs(r - 1) <= 0.15 for r in ratios)} of {len(ratios)}")


if __name__ == "__main__":
    main()
