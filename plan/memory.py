"""What one rank holds: its parameters, gradients and optimizer states, its activations, and an allowance.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), §4 and Table 2: per layer, with s the sequence, b the micro-batch, h the hidden size, a the
heads and t the TP degree, 16-bit activations and 1-byte dropout masks,

    no parallelism            sbh (34 + 5as/h)
    tensor parallel           sbh (10 + 24/t + 5as/(ht))
    tensor + sequence par.    sbh/t (34 + 5as/h)
    selective recomputation   the 5as/h term (attention scores, softmax, its dropout) is dropped
    full recomputation        only the layer's input, 2sbh (2sbh/t with sequence parallelism)

The 34 is 10 that tensor parallelism leaves whole (two norms' inputs 4, the QKV and MLP inputs 2 + 2, two dropout
masks 2) and 24 it splits: Q, K, V and the output projection's input (2 + 2 + 2 + 2), the MLP's two 4h-wide
tensors (8 + 8). We count the same tensors for other shapes: K and V shrink to kv/a of Q (grouped-query attention:
4 + 4·kv/a), the MLP's wide tensors are ffn/h wide (4·ffn/h), and a gated MLP keeps three of them (6·ffn/h).
Other element sizes scale the whole (fp32: ×2).

Pipelines keep several micro-batches' activations (Narayanan et al. 2021, arXiv:2104.04473, §2.2): stage k of p
holds min(m, p − k) under 1F1B, all m under GPipe; with m < p that is Megatron-LM's scaling by m/p on the first
stage. The first stage adds the embedding's input ids (8 bytes a token) and dropout mask (1 byte an element) per
micro-batch in flight, as Megatron-LM's estimator counts them; the last stage the logits of one micro-batch in fp32
for the loss (4sbV, /t vocabulary-parallel) and the final norm's output.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from gpuwatch.plan.model import ModelShape
from gpuwatch.plan.run import Layout, Numerics, Run

#: Korthikanti et al.'s per-layer coefficients of sbh (16-bit): left whole by TP, and the attention score term's 5.
WHOLE_COEFFICIENT = 10
SCORES_COEFFICIENT = 5
#: Bytes of the ids fed to the embedding (int64) per token: Megatron-LM's estimator's 8sb.
TOKEN_ID_BYTES = 8
#: The loss is computed on fp32 logits.
LOGIT_BYTES = 4


def split_coefficient(shape: ModelShape) -> float:
    """The sbh coefficient tensor parallelism splits: 24 for a GPT layer (multi-head attention, ffn = 4h)."""
    attention = 4 + 4 * shape.kv_heads / shape.heads
    return attention + (6 if shape.gated else 4) * shape.ffn / shape.hidden


def layer_activation_bytes(shape: ModelShape, seq: int, batch: int, tp: int, sequence_parallel: bool,
                           recompute: str, element_bytes: int = 2) -> float:
    """Bytes one layer keeps for its backward pass, per micro-batch of ``batch`` sequences (Korthikanti et al.
    2022, Table 2, generalised as the module docstring says)."""
    sbh = seq * batch * shape.hidden
    scale = element_bytes / 2
    if recompute == "full":
        return 2 * sbh * scale / (tp if sequence_parallel else 1)
    scores = 0.0 if recompute == "selective" else SCORES_COEFFICIENT * shape.heads * seq / shape.hidden
    split = split_coefficient(shape) + scores
    if sequence_parallel:
        return sbh * (WHOLE_COEFFICIENT + split) / tp * scale
    return sbh * (WHOLE_COEFFICIENT + split / tp) * scale


def in_flight(schedule: str, stage: int, pp: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at its peak (Narayanan et al. 2021, §2.2)."""
    return micro_batches if schedule == "gpipe" else min(micro_batches, pp - stage)


@dataclass(frozen=True)
class Memory:
    """One rank's bytes, by what holds them."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    embeddings_logits: float
    allowance: float

    @property
    def total(self) -> float:
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
    s, t, sp = run.seq_len, layout.tp, run.sequence_parallel
    total = 0.0
    if stage == 0:
        per_micro_batch = TOKEN_ID_BYTES * s * batch + s * batch * shape.hidden
        total += per_micro_batch * in_flight(layout.schedule, 0, layout.pp, layout.micro_batches) / (t if sp else 1)
    if stage == layout.pp - 1:
        total += LOGIT_BYTES * s * batch * shape.vocab_per_rank(t)
        total += s * batch * shape.hidden * run.numerics.activation / (t if sp else 1)
    return total


def stage_memory(shape: ModelShape, run: Run, layout: Layout, stage: int, layers: int, parameters: int) -> Memory:
    """The bytes a rank of pipeline stage ``stage`` holds at its peak, ``layers`` layers and ``parameters``
    parameters on it."""
    batch = layout.micro_batch_size(run.global_batch)
    weights, grads, optimizer = state_bytes(parameters, run.numerics, layout.dp, layout.zero1)
    activations = layers * in_flight(layout.schedule, stage, layout.pp, layout.micro_batches) * layer_activation_bytes(
        shape, run.seq_len, batch, layout.tp, run.sequence_parallel and layout.tp > 1, layout.recompute,
        run.numerics.activation)
    edges = edge_activation_bytes(shape, run, layout, stage, batch)
    tensors = weights + grads + optimizer + activations + edges
    return Memory(weights, grads, optimizer, activations, edges,
                  run.allowance_bytes + run.allowance_fraction * tensors)
