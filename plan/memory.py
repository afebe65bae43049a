"""What one rank holds: its parameters, gradients and optimizer states, its activations, and an allowance.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), §4 and Table 2: per layer, with s the sequence, b the micro-batch, h the hidden size, a the
heads and t the TP degree, 16-bit activations and 1-byte dropout masks,

    no parallelism            sbh (34 + 5as/h)
    tensor parallel           sbh (10 + 24/t + 5as/(ht))
    tensor + sequence par.    sbh/t (34 + 5as/h)
    selective recomputation   the 5as/h term (attention scores, softmax, its dropout) is dropped
    full recomputation        only the layer's input, 2sbh (2sbh/t with sequence parallelism)

Flash attention (Dao et al. 2022, arXiv:2205.14135, §3.1; the default, ``Run.flash_attention``) keeps no
scores, softmax or attention dropout mask: the 5as/h term goes as under selective recomputation, and in its place
the kernel keeps one fp32 softmax statistic (the log-sum-exp) per head and token, 4as bytes per sequence position,
split over TP with the heads (the dropout mask is regenerated from the random state, not kept).

The 34 is 10 that tensor parallelism leaves whole (two norms' inputs 4, the QKV and MLP inputs 2 + 2, two dropout
masks 2) and 24 it splits: Q, K, V and the output projection's input (2 + 2 + 2 + 2), the MLP's two 4h-wide
tensors (8 + 8). We count the same tensors for other shapes: K and V shrink to kv/a of Q (grouped-query attention:
4 + 4·kv/a), the MLP's wide tensors are ffn/h wide (4·ffn/h), and a gated MLP keeps three of them (6·ffn/h).
Other element sizes scale the whole (fp32: ×2). Under context parallelism s is the rank's 1/cp of the sequence:
ring attention keeps each rank's own queries, keys and values and the blocks' softmax statistics only (Liu et al.
2023, arXiv:2310.01889), and the key/value chunk in transit is a transient the allowance's fraction covers.

Pipelines keep several micro-batches' activations (Narayanan et al. 2021, arXiv:2104.04473, §2.2): stage k of p
holds min(m, p − k) under 1F1B, all m under GPipe; with m < p that is Megatron-LM's scaling by m/p on the first
stage. Interleaved 1F1B with v chunks a rank (§2.2.2) runs ahead by Megatron-LM's warm-up, 2(p − k − 1) + (v − 1)p
chunk forwards, plus the one in its steady state: min(v·m, 2(p − k − 1) + (v − 1)p + 1) chunks of L/(pv) layers,
i.e. p + (p − 1)/v stages' worth on the first rank — Megatron-LM's estimator's penalty 1 + (p − 1)/(pv) on p
micro-batches (megatron/training/theoretical_memory_usage.py). ZB-V (Qi et al. 2024, arXiv:2401.10241, §6) peaks
at 1F1B's first stage on every rank, p micro-batches of the rank's layers (min(m, p)): its V balances the ranks.
The first stage adds the embedding's input ids (8 bytes a token) and dropout mask (1 byte an element) per
micro-batch in flight, as Megatron-LM's estimator counts them; the last stage the logits of one micro-batch in fp32
for the loss (4sbV, /t vocabulary-parallel) and the final norm's output.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

from gpuwatch.plan.model import ModelShape
from gpuwatch.plan.run import ZBV, Layout, Numerics, Run

#: Korthikanti et al.'s per-layer coefficients of sbh (16-bit): left whole by TP, and the attention score term's 5.
WHOLE_COEFFICIENT = 10
SCORES_COEFFICIENT = 5
#: Flash attention's one fp32 softmax statistic per head and token.
SOFTMAX_STATISTIC_BYTES = 4
#: Bytes of the ids fed to the embedding (int64) per token: Megatron-LM's estimator's 8sb.
TOKEN_ID_BYTES = 8
#: The loss is computed on fp32 logits.
LOGIT_BYTES = 4


def split_coefficient(shape: ModelShape) -> float:
    """The sbh coefficient tensor parallelism splits: 24 for a GPT layer (multi-head attention, ffn = 4h)."""
    attention = 4 + 4 * shape.kv_heads / shape.heads
    return attention + (6 if shape.gated else 4) * shape.ffn / shape.hidden


def layer_activation_bytes(shape: ModelShape, seq: int, batch: int, tp: int, sequence_parallel: bool,
                           recompute: str, element_bytes: int = 2, flash_attention: bool = True) -> float:
    """Bytes one layer keeps for its backward pass, per micro-batch of ``batch`` sequences (Korthikanti et al.
    2022, Table 2, generalised as the module docstring says; with ``flash_attention`` no scores but the softmax
    statistic)."""
    sbh = seq * batch * shape.hidden
    scale = element_bytes / 2
    if recompute == "full":
        return 2 * sbh * scale / (tp if sequence_parallel else 1)
    kept = recompute != "selective" and not flash_attention
    scores = SCORES_COEFFICIENT * shape.heads * seq / shape.hidden if kept else 0.0
    statistic = SOFTMAX_STATISTIC_BYTES * shape.heads * seq * batch / tp if flash_attention else 0.0
    split = split_coefficient(shape) + scores
    if sequence_parallel:
        return sbh * (WHOLE_COEFFICIENT + split) / tp * scale + statistic
    return sbh * (WHOLE_COEFFICIENT + split / tp) * scale + statistic


def in_flight(layout: Layout, stage: int) -> float:
    """Micro-batches of all of its layers whose activations stage ``stage`` holds at its peak, under the layout's
    schedule (module docstring; fractional when interleaved)."""
    m, p, v = layout.micro_batches, layout.pp, layout.chunks
    if layout.schedule == "gpipe":
        return m
    if layout.schedule == ZBV:
        return min(m, p)
    if v > 1:
        return min(v * m, 2 * (p - stage - 1) + (v - 1) * p + 1) / v
    return min(m, p - stage)


@dataclass(frozen=True)
class Memory:
    """One rank's bytes, by what holds them."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    embeddings_logits: float
    allowance: float

    @functools.cached_property
    def total(self) -> float:
        """Cached: the planner compares every stage's total to find the heaviest."""
        return sum(getattr(self, item.name) for item in fields(self))

    def as_dict(self) -> dict[str, float]:
        return {**{item.name: getattr(self, item.name) for item in fields(self)}, "total": self.total}


def state_bytes(parameters: int, numerics: Numerics, dp: int, zero1: bool) -> tuple[float, float, float]:
    """Weights, gradients and optimizer states of ``parameters`` (Rajbhandari et al. 2020): with ZeRO stage 1 the
    optimizer's share (12 bytes a parameter mixed, 8 fp32) is divided over the ``dp`` replicas."""
    return (parameters * numerics.weight, parameters * numerics.grad,
            parameters * numerics.optimizer / (dp if zero1 else 1))


def edge_activation_bytes(shape: ModelShape, run: Run, layout: Layout, stage: int, batch: int) -> float:
    """The first stage's embedding inputs and the last stage's logits and final norm output (module docstring)."""
    s, t, sp = layout.tokens(run.seq_len), layout.tp, run.sequence_parallel
    total = 0.0
    if stage == 0:
        per_micro_batch = TOKEN_ID_BYTES * s * batch + s * batch * shape.hidden
        total += per_micro_batch * in_flight(layout, 0) / (t if sp else 1)
    if stage == layout.last_stage:
        total += LOGIT_BYTES * s * batch * shape.vocab_per_rank(t)
        total += s * batch * shape.hidden * run.numerics.activation / (t if sp else 1)
    return total


def stage_memory(shape: ModelShape, run: Run, layout: Layout, stage: int, layers: int, parameters: int) -> Memory:
    """The bytes a rank of pipeline stage ``stage`` holds at its peak, ``layers`` layers and ``parameters``
    parameters on it."""
    batch = layout.micro_batch_size(run.global_batch)
    weights, grads, optimizer = state_bytes(parameters, run.numerics, layout.replicas, layout.zero1)
    activations = layers * in_flight(layout, stage) * layer_activation_bytes(
        shape, layout.tokens(run.seq_len), batch, layout.tp, run.sequence_parallel and layout.tp > 1, layout.recompute,
        run.numerics.activation, run.flash_attention)
    edges = edge_activation_bytes(shape, run, layout, stage, batch)
    tensors = weights + grads + optimizer + activations + edges
    return Memory(weights, grads, optimizer, activations, edges,
                  run.allowance_bytes + run.allowance_fraction * tensors)
