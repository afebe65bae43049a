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
of the whole step, (p − 1)/(m + p − 1): the step is m + p − 1 slots of which p − 1 are idle.
"""

from __future__ import annotations

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


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """The share of a step the pipeline idles, GPipe and 1F1B alike: (p − 1)/(m + p − 1)."""
    return (pp - 1) / (micro_batches + pp - 1)
