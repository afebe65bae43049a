"""A decoder-only transformer's shape, whatever it was described by: a Hugging Face ``config.json``, command-line
figures, or the reference trainer's ``ModelConfig``, declared here (the trainer builds its model from it, the planner
predicts it): the planner then imports nothing from the trainer, which imports this.

The shape also says what each rank of a tensor-parallel group holds: Megatron-LM's column- and row-parallel layers
(Shoeybi et al. 2019, "Megatron-LM", arXiv:1909.08053, §3) split every matmul weight and the column-parallel
biases over the TP ranks, while the norms and the row-parallel biases are replicated on each. Counting the two apart
is what lets the prediction equal what a rank allocates, not the model divided by t.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from gpuwatch.protocol.records import ModelShapeFields

#: Where a shape came from; "reference" also means the reference trainer's own rules apply (even layer splits).
SOURCES = ("hf", "flags", "reference", "parameters")


@dataclass(frozen=True)
class ModelConfig:
    """The reference trainer's GPT-style decoder (gpuwatch.trainer.model); the defaults are tiny so a CPU run takes
    seconds."""

    vocab_size: int = 128
    seq_len: int = 32
    hidden: int = 64
    heads: int = 4
    layers: int = 4


class ModelError(ValueError):
    """A model description that cannot be planned: the message names the file or flag and what is wrong."""


@dataclass(frozen=True)
class Parameters:
    """Parameter counts on one rank: ``split`` ones are a 1/t slice of a weight, ``replicated`` ones whole."""

    split: int = 0
    replicated: int = 0

    def __add__(self, other: Parameters) -> Parameters:
        return Parameters(self.split + other.split, self.replicated + other.replicated)

    def __mul__(self, times: int) -> Parameters:
        return Parameters(self.split * times, self.replicated * times)

    def on_rank(self, tp: int) -> int:
        """Elements one rank of a TP group of ``tp`` holds (``split`` counts are already divisible by ``tp``
        where the layout is valid; the vocabulary is padded to a multiple of ``tp`` first: `vocab_per_rank`)."""
        return self.split // tp + self.replicated


class ModelShape(ModelShapeFields, frozen=True):  # type: ignore[misc]  # msgspec allows it; mypy reads dataclasses
    """Everything the planner needs of a model: the hello's model block (``protocol.records.ModelShapeFields``,
    which declares the fields, their types and their bounds), with the planner's default for each field a description
    may leave out, and checked on construction. ``ffn`` is the MLP's inner width; ``gated`` a SwiGLU-style MLP (gate
    and up projections, three matrices); ``norm_params`` 2 for LayerNorm (gain and bias), 1 for RMSNorm; ``bias``
    whether every linear layer has a bias (the LM head's included); ``positions`` the rows of a learned position
    embedding (0 with rotary embeddings). Frozen, so that it is hashable (``compute.stage_seconds`` caches by it)."""

    tied_embeddings: bool = False
    gated: bool = True
    norm_params: int = 1
    bias: bool = False
    positions: int = 0
    source: str = "flags"

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"):
            if getattr(self, name) < 1:
                raise ModelError(f"{name} must be at least 1 (got {getattr(self, name)})")
        if self.hidden % self.heads:
            raise ModelError(f"hidden size {self.hidden} is not divisible by {self.heads} attention heads")
        if self.heads % self.kv_heads:
            raise ModelError(f"{self.heads} attention heads are not divisible by {self.kv_heads} key/value heads")
        if self.source not in SOURCES:
            raise ModelError(f"source must be one of {', '.join(SOURCES)} (got {self.source})")

    @property
    def kv_width(self) -> int:
        """Width of the key (and of the value) projection: kv heads × head size (grouped-query attention)."""
        return self.kv_heads * (self.hidden // self.heads)

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated else 2

    def layer_parameters(self) -> Parameters:
        """One transformer layer: Q and output projections h², K and V h × kv_width each, the MLP's matrices
        h × ffn each; column-parallel biases (Q, K, V, the MLP's first ones) split, row-parallel ones (the output
        projection's, the MLP's last) and the two norms replicated."""
        h, kv, f = self.hidden, self.kv_width, self.ffn
        split = 2 * h * h + 2 * h * kv + self.mlp_matrices * h * f
        if self.bias:
            split += h + 2 * kv + (self.mlp_matrices - 1) * f
        return Parameters(split, 2 * self.norm_params * h + (2 * h if self.bias else 0))

    def vocab_per_rank(self, tp: int) -> int:
        """The vocabulary rows one TP rank holds, padded to a multiple of ``tp`` as Megatron-LM pads it
        (--make-vocab-size-divisible-by)."""
        return math.ceil(self.vocab / tp)

    def embedding_parameters(self, tp: int) -> Parameters:
        """The first stage's input embedding: vocabulary rows split over TP, learned positions replicated."""
        return Parameters(self.vocab_per_rank(tp) * tp * self.hidden, self.positions * self.hidden)

    def head_parameters(self, tp: int, pp: int) -> Parameters:
        """The last stage's final norm and LM head (vocabulary-parallel). Tied embeddings share the first stage's
        matrix when that stage is also the last (pp = 1); across stages the last one keeps a copy whose gradient
        is summed with the first's every step (Megatron-LM's embedding group)."""
        head = Parameters(0, self.norm_params * self.hidden)
        if not self.tied_embeddings or pp > 1:
            rows = self.vocab_per_rank(tp) * tp
            head += Parameters(rows * self.hidden + (rows if self.bias else 0), 0)
        return head

    def as_record(self) -> ModelShapeFields:
        """The shape as a rank's hello carries it (``model``), for diagnosis to plan from: every field written, a
        default included (the record's own defaults are "not said", which a ``ModelShape``'s as_dict would leave
        out)."""
        return ModelShapeFields(**msgspec.structs.asdict(self))

    def total_parameters(self) -> int:
        """The model's parameters, each counted once (tied embeddings once)."""
        return (self.layer_parameters() * self.layers + self.embedding_parameters(1)
                + self.head_parameters(1, 1)).on_rank(1)


def from_record(record: ModelShapeFields) -> ModelShape:
    """The shape a hello carried (`ModelShape.as_record`); a field it left out takes `ModelShape`'s default, a
    shape that cannot be planned is a ModelError."""
    given = {name: value for name, value in msgspec.structs.asdict(record).items() if value is not None}
    return ModelShape(**given)


#: Hugging Face config keys, by the field they fill; the first present wins (GPT-2 style names second).
HF_KEYS = {
    "layers": ("num_hidden_layers", "n_layer"),
    "hidden": ("hidden_size", "n_embd"),
    "heads": ("num_attention_heads", "n_head"),
    "vocab": ("vocab_size",),
}


def _hf_value(config: dict[str, Any], field: str, path: str) -> int:
    for key in HF_KEYS[field]:
        if key in config:
            value = config[key]
            if not isinstance(value, int) or isinstance(value, bool):
                raise ModelError(f"{path}: {key} must be an integer (got {value!r})")
            return value
    raise ModelError(f"{path}: no {' or '.join(HF_KEYS[field])}: not a decoder transformer's config.json")


def from_hf_config(config: dict[str, Any], path: str = "config.json") -> ModelShape:
    """A Llama-style Hugging Face config: RMSNorm, SwiGLU MLP of ``intermediate_size``, no biases, rotary
    positions, grouped-query attention when ``num_key_value_heads`` is given (else as many as the heads), embeddings
    tied when ``tie_word_embeddings`` says so (Hugging Face's default is tied: PretrainedConfig)."""
    layers, hidden = _hf_value(config, "layers", path), _hf_value(config, "hidden", path)
    heads, vocab = _hf_value(config, "heads", path), _hf_value(config, "vocab", path)
    ffn = config.get("intermediate_size", config.get("n_inner") or 4 * hidden)
    kv_heads = config.get("num_key_value_heads") or heads
    for key, value in (("intermediate_size", ffn), ("num_key_value_heads", kv_heads)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ModelError(f"{path}: {key} must be an integer (got {value!r})")
    try:
        return ModelShape(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab,
                          tied_embeddings=bool(config.get("tie_word_embeddings", True)), source="hf")
    except ModelError as error:
        raise ModelError(f"{path}: {error}") from None


def read_hf_config(path: Path) -> ModelShape:
    """`from_hf_config` of a file; unreadable or malformed files are a one-line ModelError."""
    try:
        config = json.loads(path.read_text())
    except OSError as error:
        raise ModelError(f"{path}: {error.strerror or error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelError(f"{path}: not JSON ({error})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path}: not a JSON object")
    return from_hf_config(config, str(path))


def from_reference(config: ModelConfig) -> ModelShape:
    """The reference trainer's GPT (gpuwatch.trainer.model, nanoGPT's shape): LayerNorm, a GELU MLP of 4h, biases
    everywhere (the LM head's included), learned positions of ``seq_len`` rows, an untied head."""
    return ModelShape(layers=config.layers, hidden=config.hidden, heads=config.heads, kv_heads=config.heads,
                      ffn=4 * config.hidden, vocab=config.vocab_size, tied_embeddings=False, gated=False,
                      norm_params=2, bias=True, positions=config.seq_len, source="reference")
