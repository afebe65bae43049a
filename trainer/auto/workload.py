"""What a job instrumented from outside (`gpuwatch run`) trains, for the hello's `model`, `global_batch` and `seq_len`:
with them diagnosis predicts the step from the planner (the PLAN rules), as it does for the reference trainer.

The model's shape is read, in order of trust:
* a Hugging Face model's `config` (`transformers.PretrainedConfig`, `model.config.to_dict()`): Llama-style configs
  (Llama, Mistral, Qwen2, ...: RMSNorm, a SwiGLU MLP, no biases, rotary positions) as `gpuwatch plan --model` reads
  a config.json (`plan.model.from_hf_config`), and GPT-2's (LayerNorm, a GELU MLP of `n_inner` or 4h, biases,
  learned positions, tied embeddings) by its own keys; source "hf";
* else the module's own parts, where they say it without guessing: a token embedding (vocabulary × hidden), one
  `nn.ModuleList` of like blocks (the layers), whose attention says its heads (`nn.MultiheadAttention.num_heads`,
  or an attribute `num_heads`, `n_head`, `num_attention_heads`), and whose linear layers give the MLP's width (the
  widest output but a fused QKV's; two of that width: gated); source "parameters".
Anything else (a GRU, a model without a block list, heads nowhere said) gives no shape, and the reason, which the
hello's notes carry: a wrong shape would make the PLAN rules judge the job against another model.

The batch is read from the data loader's batches of the first optimizer step (`batch_shape`): sequences per step on
this rank (every micro-batch's, gradient accumulation included) × the data-parallel replicas is the global batch, and
the token ids' second dimension the sequence length.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gpuwatch.plan.model import ModelError, ModelShape, from_hf_config

#: Hugging Face model types read as GPT-2 (LayerNorm, GELU MLP, biases, learned positions) rather than Llama-style.
GPT2_TYPES = frozenset({"gpt2"})
#: Model types whose configs `from_hf_config` reads as they are (Llama-style).
LLAMA_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "olmo2", "granite"})
#: Attributes an attention module names its heads by (torch's MultiheadAttention, Hugging Face's and nanoGPT's).
HEAD_ATTRIBUTES = ("num_heads", "n_head", "num_attention_heads")


def unwrapped(model: nn.Module) -> nn.Module:
    """The user's module inside DistributedDataParallel's, FSDP1's or accelerate's wrappers (`.module`)."""
    while isinstance(inner := getattr(model, "module", None), nn.Module):
        model = inner
    return model


def model_shape(model: nn.Module) -> tuple[ModelShape | None, str]:
    """The shape of the transformer ``model`` trains and how it was read, or None and why it could not be."""
    inner = unwrapped(model)
    config = getattr(inner, "config", None)
    if config is not None and callable(getattr(config, "to_dict", None)):
        return _from_config(config.to_dict())
    return _from_modules(inner)


def _from_config(config: Mapping[str, Any]) -> tuple[ModelShape | None, str]:
    kind = config.get("model_type")
    try:
        if kind in LLAMA_TYPES:
            return from_hf_config(dict(config), "model.config"), f"the Hugging Face config ({kind})"
        if kind in GPT2_TYPES:
            hidden = config["n_embd"]
            return ModelShape(layers=config["n_layer"], hidden=hidden, heads=config["n_head"],
                              kv_heads=config["n_head"], ffn=config.get("n_inner") or 4 * hidden,
                              vocab=config["vocab_size"], tied_embeddings=config.get("tie_word_embeddings", True),
                              gated=False, norm_params=2, bias=True, positions=config["n_positions"],
                              source="hf"), f"the Hugging Face config ({kind})"
    except (KeyError, ModelError) as error:
        return None, f"the Hugging Face config ({kind}) cannot be read as a transformer's: {error}"
    return None, f"the Hugging Face config's model type {kind!r} is not one the planner reads"


def _from_modules(model: nn.Module) -> tuple[ModelShape | None, str]:
    embeddings = [module for module in model.modules() if isinstance(module, nn.Embedding)]
    blocks = max((list(module) for module in model.modules() if isinstance(module, nn.ModuleList)
                  and len(module) and len({type(block) for block in module}) == 1), key=len, default=[])
    if not embeddings or not blocks:
        return None, "the model has no token embedding or no list of like blocks: not read as a transformer"
    vocab, hidden = max((module.num_embeddings, module.embedding_dim) for module in embeddings)
    heads = next((value for module in blocks[0].modules() for name in HEAD_ATTRIBUTES
                  if isinstance(value := getattr(module, name, None), int) and value > 0), None)
    if heads is None:
        return None, "no attention module of its blocks says its heads (num_heads, n_head, num_attention_heads)"
    linears = [module for module in blocks[0].modules() if isinstance(module, nn.Linear)]
    widths = [module.out_features for module in linears if module.out_features not in (hidden, 3 * hidden)]
    ffn = max(widths, default=4 * hidden)
    positions = max((module.num_embeddings for module in embeddings
                     if module.embedding_dim == hidden and module.num_embeddings != vocab), default=0)
    head = next((module for module in model.modules() if isinstance(module, nn.Linear)
                 and module.out_features == vocab), None)
    norms = [module for module in blocks[0].modules() if isinstance(module, nn.LayerNorm)]
    try:
        shape = ModelShape(
            layers=len(blocks), hidden=hidden, heads=heads, kv_heads=heads, ffn=ffn, vocab=vocab,
            tied_embeddings=head is not None and any(head.weight is module.weight for module in embeddings),
            gated=widths.count(ffn) >= 2, norm_params=2 if any(norm.bias is not None for norm in norms) else 1,
            bias=any(module.bias is not None for module in linears), positions=positions, source="parameters")
    except ModelError as error:
        return None, f"the model's parts do not make a transformer the planner reads: {error}"
    return shape, "the model's parameters"


def batch_shape(batch: Any) -> tuple[int, int] | None:
    """(sequences, tokens per sequence) of a batch of token ids: its `input_ids`, else its first two-dimensional
    integer tensor (a tensor, a sequence or a mapping of them); None if it holds none."""
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        batch = batch["input_ids"]
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 2 and not batch.is_floating_point() and not batch.is_complex():
            return int(batch.shape[0]), int(batch.shape[1])
        return None
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, list | tuple) else ()
    return next((shape for shape in map(batch_shape, items) if shape is not None), None)
