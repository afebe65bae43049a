"""FLOPs and the pipeline bubble.

FLOPs follow Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (arXiv:2104.04473), §5.1: a GPT step of B sequences costs 96·B·s·l·h²·(1 + s/(6h) + V/(16lh)) with
full activation recomputation, counting only matmuls, the attention's over the whole sequence (no causal discount)
and the LM head's. We count the same matmuls per token for any shape — 2 FLOPs per matmul weight (Q, K, V, output
projection, the MLP's matrices), 4sh per layer for the attention's QKᵀ and AV, 2hV for the head — forward once, the
backward twice that. Model FLOPs (for MFU) count no recomputation: 72·B·s·l·h²·(1 + s/(6h) + V/(12lh)) for a GPT
layer; the hardware does one more forward of every layer under full recomputation (the paper's 96, i.e. ×4/3 of the
layers' work) and of the attention's QKᵀ and AV under selective recomputation (Korthikanti et al. 2022, §5).

The bubble: with p stages and m micro-batches both GPipe and 1F1B idle for (p − 1) micro-batch slots of forward and
backward (Narayanan et al. 2021, §2.2.1, bubble time fraction (p − 1)/m of the ideal time). We report it as a share
of the whole step, (p − 1)/(m + p − 1): the step is m + p − 1 slots of which p − 1 are idle. Other schedules
(``schedule_bubble``) are reported the same way, as a share of the step: ideal time I and bubble time B give B/(I + B).
"""

from __future__ import annotations

import math

from gpuwatch.plan.model import ModelShape

#: A training step is the forward pass and a backward pass of twice its FLOPs.
PASSES = 3


def layer_matmul_flops(shape: ModelShape) -> float:
    """Forward FLOPs of one layer's weight matmuls, per token: 2 a weight (Q, K, V, the output projection, the
    MLP's matrices)."""
    h = shape.hidden
    return 2 * (2 * h * h + 2 * h * shape.kv_width + shape.mlp_matrices * h * shape.ffn)


def layer_forward_flops(shape: ModelShape, seq: int) -> float:
    """Forward FLOPs of one layer, per token: its matmul weights and the attention over ``seq`` tokens."""
    return layer_matmul_flops(shape) + attention_forward_flops(shape, seq)


def attention_forward_flops(shape: ModelShape, seq: int) -> float:
    """QKᵀ and AV per token: 2sh each."""
    return 4 * seq * shape.hidden


def head_forward_flops(shape: ModelShape) -> float:
    return 2 * shape.hidden * shape.vocab


def recompute_flops(shape: ModelShape, seq: int, recompute: str) -> float:
    """The extra forward FLOPs per token of one layer that recomputation runs again."""
    if recompute == "full":
        return layer_forward_flops(shape, seq)
    return attention_forward_flops(shape, seq) if recompute == "selective" else 0.0


def model_flops_per_token(shape: ModelShape, seq: int) -> float:
    """Training FLOPs per token of the whole model, without recomputation (what MFU divides)."""
    return PASSES * (shape.layers * layer_forward_flops(shape, seq) + head_forward_flops(shape))


def stage_flops_per_token(shape: ModelShape, seq: int, layers: int, last: bool, recompute: str) -> float:
    """Hardware FLOPs per token one pipeline stage runs: its layers (recomputation included) and, on the last
    stage, the head (never recomputed)."""
    per_layer = PASSES * layer_forward_flops(shape, seq) + recompute_flops(shape, seq, recompute)
    return layers * per_layer + (PASSES * head_forward_flops(shape) if last else 0.0)


def bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The share of a step the pipeline idles, GPipe and 1F1B alike: (p − 1)/(m + p − 1); with ``virtual_stages`` v
    model chunks per rank (interleaved 1F1B), (p − 1)/(v·m + p − 1) (``schedule_bubble``)."""
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)


#: The schedules a hello names (``protocol.schema.PIPELINE_SCHEDULES``) whose bubble ``schedule_bubble`` knows, by
#: kind: one model chunk per rank, several (interleaved, looped), zero-bubble.
PLAIN_SCHEDULES = ("gpipe", "1f1b")
INTERLEAVED_SCHEDULES = ("interleaved_1f1b", "looped_bfs")
ZERO_BUBBLE_SCHEDULES = ("interleaved_zero_bubble", "zbv_zero_bubble")


def schedule_bubble(schedule: str | None, pp: int, micro_batches: int,
                    virtual_stages: int | None = None) -> float | None:
    """The share of a step a balanced pipeline of ``pp`` stages fed ``micro_batches`` idles under ``schedule``, as
    ``bubble_fraction`` reports it (idle over the whole step); None where it is not modelled.

    * GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush; Narayanan et al. 2021, "Efficient Large-Scale Language
      Model Training on GPU Clusters Using Megatron-LM", arXiv:2104.04473, §2.2.1): (p − 1)/m of the ideal time, so
      (p − 1)/(m + p − 1) of the step. A schedule not named (None: an older hello) is taken for one of these.
    * Interleaved 1F1B with v model chunks per rank (Narayanan et al. 2021, §2.2.2): (p − 1)/(v·m) of the ideal time,
      so (p − 1)/(v·m + p − 1) of the step; looped breadth-first (Lamy-Poirier 2023, "Breadth-First Pipeline
      Parallelism", arXiv:2211.05953) loops over the same v chunks and idles as much. Without v (the hello did not
      say) it is not modelled.
    * The zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR, arXiv:2401.10241, §3 and
      §6: ZB-V, torch's ScheduleZBVZeroBubble, and its interleaved variant): the backward is split into the input
      gradient and the weight gradient, and the weight-gradient passes fill the slots where 1F1B idles; with m ≥ p
      micro-batches there are enough of them to fill every slot, so the bubble is taken as 0, assuming the three
      passes of a stage take about equal time, as the paper's schedules are tuned for. With m < p it is not
      modelled.
    * DualPipeV (DeepSeek-V3's DualPipe cut in a V) and any other label: not modelled.
    """
    if pp <= 1:
        return 0.0
    if schedule is None or schedule in PLAIN_SCHEDULES:
        return bubble_fraction(pp, micro_batches)
    if schedule in INTERLEAVED_SCHEDULES:
        return bubble_fraction(pp, micro_batches, virtual_stages) if virtual_stages else None
    if schedule in ZERO_BUBBLE_SCHEDULES:
        return 0.0 if micro_batches >= pp else None
    return None


def micro_batches_for(pp: int, max_bubble: float, virtual_stages: int = 1) -> int:
    """The fewest micro-batches whose ``bubble_fraction`` is at most ``max_bubble``: (p − 1)/(v·m + p − 1) ≤ b when
    m ≥ (p − 1)(1 − b)/(v·b)."""
    return max(1, math.ceil((pp - 1) * (1 - max_bubble) / (virtual_stages * max_bubble) - 1e-9))
