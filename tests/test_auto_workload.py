"""What a job run under `gpuwatch run` trains (gpuwatch.trainer.auto.workload), read from real models built from their
configs (transformers' Llama and GPT-2) and from a model of PyTorch's own layers: the shape the planner gets has the
model's own parameter count, and a model that is not a transformer the planner reads gives none, with the reason."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from torch import nn

from gpuwatch.plan.model import from_hf_config
from gpuwatch.trainer.auto.workload import batch_shape, model_shape, unwrapped


@pytest.fixture(scope="module")
def hf() -> ModuleType:
    """transformers, imported by the tests that build its models rather than at collection, where each of the
    suite's xdist workers would pay its ~2 s (a Hugging Face config pulls in its modelling code)."""
    import transformers

    return transformers


def llama_config(hf: ModuleType):
    return hf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


class EncoderLM(nn.Module):
    """A language model of PyTorch's own layers: token and position embeddings, two TransformerEncoderLayers (4
    heads, feed-forward 64), a final norm and an untied head without bias."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.positions = nn.Embedding(128, 32), nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True) for _ in range(2))
        self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, 128, bias=False)


class GruLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.rnn, self.head = nn.Embedding(128, 32), nn.GRU(32, 32), nn.Linear(32, 128)


def test_a_llama_is_read_from_its_config_as_gpuwatch_plan_reads_a_config_json(hf):
    config = llama_config(hf)
    model = hf.LlamaForCausalLM(config)
    shape, read = model_shape(model)
    assert read == "the Hugging Face config (llama)"
    assert shape == from_hf_config(config.to_dict(), "model.config")
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn, shape.vocab) == (2, 32, 4, 2, 64, 128)
    assert shape.total_parameters() == parameters(model)


def test_a_gpt2_is_read_with_its_layernorms_biases_learned_positions_and_tied_head(hf):
    model = hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=64,
                                             bos_token_id=0, eos_token_id=0))
    shape, read = model_shape(model)
    assert read == "the Hugging Face config (gpt2)" and shape.source == "hf"
    assert (shape.gated, shape.bias, shape.norm_params, shape.positions, shape.tied_embeddings) == (
        False, True, 2, 64, True)
    assert shape.total_parameters() == parameters(model)


def test_a_model_of_torchs_own_layers_is_read_from_its_parts_and_says_so():
    model = EncoderLM()
    shape, read = model_shape(model)
    assert read == "the model's parameters" and shape.source == "parameters"
    assert (shape.layers, shape.hidden, shape.heads, shape.ffn, shape.vocab, shape.positions) == (2, 32, 4, 64, 128, 64)
    assert (shape.gated, shape.norm_params, shape.tied_embeddings) == (False, 2, False)
    # the planner gives every linear layer a bias when the layers have them, this head's too: 128 more
    assert shape.total_parameters() - parameters(model) == 128


@pytest.mark.parametrize(("build", "why"), [
    (lambda hf: GruLM(), "no token embedding or no list of like blocks"),
    (lambda hf: nn.Sequential(nn.Embedding(128, 32), nn.ModuleList([nn.Linear(32, 32)])),
     "no attention module of its blocks"),
    (lambda hf: hf.BertModel(hf.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           intermediate_size=64)),
     "model type 'bert' is not one the planner reads"),
], ids=["gru", "no-attention", "bert"])
def test_a_model_the_planner_cannot_read_gives_no_shape_and_the_reason(hf, build, why):
    shape, read = model_shape(build(hf))
    assert shape is None and why in read


def test_wrappers_are_looked_through(hf):
    class Wrapper(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    inner = hf.LlamaForCausalLM(llama_config(hf))
    assert unwrapped(Wrapper(Wrapper(inner))) is inner
    assert model_shape(Wrapper(inner)) == model_shape(inner)


@pytest.mark.parametrize(("batch", "shape"), [
    ({"input_ids": torch.zeros(4, 16, dtype=torch.long), "labels": torch.zeros(4, 16, dtype=torch.long)}, (4, 16)),
    ((torch.zeros(8, 32, dtype=torch.long), torch.zeros(8, 32, dtype=torch.long)), (8, 32)),
    ([torch.zeros(2, 3), {"tokens": torch.zeros(2, 5, dtype=torch.int32)}], (2, 5)),
    (torch.zeros(4, 16), None),  # floats: not token ids
    (torch.zeros(16, dtype=torch.long), None),  # one dimension: no sequences
    ("text", None),
])
def test_a_batch_of_token_ids_gives_its_sequences_and_their_length(batch, shape):
    assert batch_shape(batch) == shape
