"""FLOPs and the pipeline bubble.

FLOPs follow Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (arXiv:2104.04473), §5.1: a GPT step of B sequences costs 96·B·s·l·h²·(1 + s/(6h) + V/(16lh)) with
full activation recomputation, counting only matmuls, the attention's over the whole sequence (no causal discount)
and the LM head's. We count the same matmuls per token for any shape — 2 FLOPs per matmul weight (Q, K, V, output
projection, the MLP's matrices), 4sh per layer for the attention's QKᵀ and AV, 2hV for the head — forward once, the
backward twice that. Model FLOPs (for MFU) count no recomputation: 72·B·s·l·h²·(1 + s/(6h) + V/(12lh)) for a GPT
layer; the hardware does one more forward of every layer under full recomputation (the paper's 96, i.e. ×4/3 of the
layers' work) and of the attention's QKᵀ and AV under selective recomputation (Korthikanti et al. 2022, §5).

Flash attention (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness",
arXiv:2205.14135, §3.1 and Algorithm 4; the default of PyTorch's SDPA on current GPUs, and what Megatron-LM's
estimator assumes) keeps no s × s scores for the backward pass: it keeps the output and one softmax statistic per
row, and its backward recomputes the scores S = QKᵀ block by block from Q and K. That is one more QKᵀ matmul per
layer and token, 2sh FLOPs (half the attention's forward 4sh), run on the hardware and not counted in the model's
FLOPs; it also makes selective recomputation (whose point is not to keep the scores) the same as none.

Time (the shape model, ``gpus.Cluster`` without a flat efficiency or a calibration, `stage_seconds`): each of a
layer's matmuls on the roofline (Williams et al. 2009, "Roofline: an insightful visual performance model", CACM
52(4); NVIDIA's "Matrix Multiplication Background User's Guide", arithmetic intensity): the longer of its FLOPs at a
share of the peak (``gpus.GEMM_EFFICIENCY``) and its operands' and result's bytes at the HBM's bandwidth — which
puts the attention's per-head QKᵀ and AV (inner or outer dimension the head's 128) below the peak, and leaves the
weight matmuls of a large model compute-bound; a flash attention kernel is taken as compute-bound (Dao et al.: its
point is to stay out of HBM); and its elementwise work — the norms, the activation function, the residual
adds and their dropout, and without flash attention the softmax, its scaling and masking and its dropout over the
a·s scores of each token — at the HBM's bandwidth: these kernels do a few FLOPs per byte and are bound by memory,
not by the tensor cores (Williams et al. 2009, "Roofline", CACM 52(4); Korthikanti et al. 2022, §5, on why
sequence parallelism speeds up the norms and dropouts it splits). The bytes are each op's reads and writes
(``layer_elementwise_bytes``); the backward pass reads and writes about twice the forward's, as it does twice its
FLOPs. Their share of the step falls as the hidden size grows (elementwise bytes grow with h, matmul FLOPs with h²):
that is why larger models reach a larger share of the peak (Narayanan et al. 2021, Table 1: 44 % at h 2,304,
52 % at h 25,600).

The bubble: with p stages and m micro-batches both GPipe and 1F1B idle for (p − 1) micro-batch slots of forward and
backward (Narayanan et al. 2021, §2.2.1, bubble time fraction (p − 1)/m of the ideal time). We report it as a share
of the whole step, (p − 1)/(m + p − 1): the step is m + p − 1 slots of which p − 1 are idle. Other schedules
(``schedule_bubble``) are reported the same way, as a share of the step: ideal time I and bubble time B give B/(I + B).
"""

from __future__ import annotations

import functools
import math

from gpuwatch.plan.calibrate import model_shapes
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


def recompute_flops(shape: ModelShape, seq: int, recompute: str, flash_attention: bool = True) -> float:
    """The extra FLOPs per token of one layer that are run again: the recomputed forward (full: the whole layer;
    selective: the attention's QKᵀ and AV, 4sh, unless flash attention keeps no scores to spare), and under flash
    attention its backward's QKᵀ, 2sh (module docstring)."""
    flash = attention_forward_flops(shape, seq) / 2 if flash_attention else 0.0
    if recompute == "full":
        return layer_forward_flops(shape, seq) + flash
    if recompute == "selective" and not flash_attention:
        return attention_forward_flops(shape, seq)
    return flash


def layer_elementwise_bytes(shape: ModelShape, seq: int, tp: int, sequence_parallel: bool,
                            flash_attention: bool = True, element_bytes: int = 2) -> float:
    """Bytes a layer's elementwise kernels read and write per token on one TP rank, forward: the two norms (read
    and write h each), the two residual adds with their dropout (read the branch and the residual, write the sum:
    3h each, and an h-byte mask), left whole on every TP rank unless sequence parallelism splits them; the MLP's
    activation function (read ffn, write ffn; gated read 2·ffn) and, without flash attention, the fused scale-mask-
    softmax (read and write a·s scores) and its dropout (read and write a·s, an a·s-byte mask), split with the
    heads and the MLP over TP."""
    h, e = shape.hidden, element_bytes
    whole = (4 * h + 6 * h) * e + 2 * h
    split = (3 if shape.gated else 2) * shape.ffn * e
    if not flash_attention:
        split += 4 * shape.heads * seq * e + shape.heads * seq
    return whole / (tp if sequence_parallel else 1) + split / tp


def stage_elementwise_bytes_per_token(shape: ModelShape, seq: int, layers: int, tp: int, sequence_parallel: bool,
                                      recompute: str, flash_attention: bool = True, element_bytes: int = 2) -> float:
    """Elementwise bytes per token one TP rank of a stage moves in a step's forward and backward passes (3 × the
    forward's, as the FLOPs), and again in the recomputed forward (full: the whole layer's; selective without flash
    attention: the softmax and its dropout)."""
    forward = layer_elementwise_bytes(shape, seq, tp, sequence_parallel, flash_attention, element_bytes)
    if recompute == "full":
        again = forward
    elif recompute == "selective" and not flash_attention:
        again = forward - layer_elementwise_bytes(shape, seq, tp, sequence_parallel, True, element_bytes)
    else:
        again = 0.0
    return layers * (PASSES * forward + again)


def gemm_seconds(m: int, k: int, n: int, flops_rate: float, memory_bandwidth: float, element_bytes: int) -> float:
    """One (m × k) · (k × n) matmul on the roofline: its 2mkn FLOPs at ``flops_rate``, or its operands and result
    through HBM, whichever takes longer."""
    return max(2 * m * k * n / flops_rate, (m * k + k * n + m * n) * element_bytes / memory_bandwidth)


@functools.lru_cache(maxsize=4096)
def stage_seconds(shape: ModelShape, seq: int, batch: int, layers: int, last: bool, tp: int, sequence_parallel: bool,
                  recompute: str, flash_attention: bool, element_bytes: int, flops_rate: float,
                  memory_bandwidth: float, cp: int = 1) -> float:
    """The shape model's seconds of one micro-batch of ``batch`` sequences on one TP rank of a stage, forward and
    backward (module docstring): the weight matmuls and the attention's on the roofline, 3 passes (the backward's two
    matmuls per forward one are its transposes, of the same size) and the recomputed forward, flash attention's
    recomputed QKᵀ, the head on the last stage, the elementwise bytes at ``memory_bandwidth``. With context
    parallelism ``cp`` the rank holds 1/cp of each sequence, whose queries attend over all of it (ring attention
    needs flash attention's blockwise kernel)."""
    tokens, e = seq * batch // cp, element_bytes
    weights = sum(gemm_seconds(m, k, n, flops_rate, memory_bandwidth, e) for m, k, n in model_shapes(shape, tokens, tp))
    heads = max(1, shape.heads // tp) * batch
    head_dim = shape.hidden // shape.heads
    if flash_attention:
        attention = attention_forward_flops(shape, seq) * tokens / tp / flops_rate
    else:
        attention = heads * (gemm_seconds(seq, head_dim, seq, flops_rate, memory_bandwidth, e)
                             + gemm_seconds(seq, seq, head_dim, flops_rate, memory_bandwidth, e))
    forward = weights + attention
    again = forward if recompute == "full" else attention if recompute == "selective" and not flash_attention else 0.0
    flash = attention / 2 if flash_attention else 0.0
    elementwise = stage_elementwise_bytes_per_token(shape, seq, 1, tp, sequence_parallel, recompute, flash_attention,
                                                    e) * tokens / memory_bandwidth
    total = layers * (PASSES * forward + again + flash + elementwise)
    if last:
        total += PASSES * gemm_seconds(tokens, shape.hidden, shape.vocab_per_rank(tp), flops_rate, memory_bandwidth, e)
    return total


def model_flops_per_token(shape: ModelShape, seq: int) -> float:
    """Training FLOPs per token of the whole model, without recomputation (what MFU divides)."""
    return PASSES * (shape.layers * layer_forward_flops(shape, seq) + head_forward_flops(shape))


def stage_flops_per_token(shape: ModelShape, seq: int, layers: int, last: bool, recompute: str,
                          flash_attention: bool = True) -> float:
    """Hardware FLOPs per token one pipeline stage runs: its layers (recomputation, and flash attention's
    recomputed scores, included) and, on the last stage, the head (never recomputed)."""
    per_layer = PASSES * layer_forward_flops(shape, seq) + recompute_flops(shape, seq, recompute, flash_attention)
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
