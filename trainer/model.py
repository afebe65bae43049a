"""A GPT-style decoder (nanoGPT's shape), built as the slice one rank owns.

Pipeline parallelism decides which layers a rank holds: the first stage has the embeddings, the
last has the final norm and the LM head, each stage `layers / pp` blocks. Tensor parallelism
decides which slice of each layer: whole attention heads, a slice of the MLP and of the vocabulary.

Every weight is drawn from a generator seeded by (seed, parameter name), then sliced. A layer
therefore starts from the same numbers whatever the layout, which is what lets a TP × PP × DP run
reproduce the single-process losses. Parameter names use global block indices (blocks.5.mlp.up),
so they mean the same on every layout.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from gpuwatch.plan.model import ModelConfig
from gpuwatch.trainer.parallel.groups import Grid
from gpuwatch.trainer.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

INIT_STD = 0.02


class Init:
    """Full-size initial tensors, reproducible per parameter name."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def normal(self, name: str, *shape: int, std: float = INIT_STD) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(*shape, generator=generator) * std

    @staticmethod
    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, name: str, init: Init, group: ProcessGroup, out_std: float) -> None:
        super().__init__()
        h = cfg.hidden
        self.head_dim = h // cfg.heads
        self.qkv = ColumnParallelLinear(init.normal(f"{name}.qkv", 3 * h, h), init.zeros(3 * h), group, chunks=3)
        self.proj = RowParallelLinear(init.normal(f"{name}.proj", h, h, std=out_std), init.zeros(h), group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (
            t.view(batch, seq, -1, self.head_dim).transpose(1, 2)  # [batch, this rank's heads, seq, head_dim]
            for t in self.qkv(x).chunk(3, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, name: str, init: Init, group: ProcessGroup, out_std: float) -> None:
        super().__init__()
        h = cfg.hidden
        self.up = ColumnParallelLinear(init.normal(f"{name}.up", 4 * h, h), init.zeros(4 * h), group)
        self.down = RowParallelLinear(init.normal(f"{name}.down", h, 4 * h, std=out_std), init.zeros(h), group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, name: str, init: Init, group: ProcessGroup) -> None:
        super().__init__()
        out_std = INIT_STD / math.sqrt(2 * cfg.layers)  # GPT-2: residual projections scaled by depth
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg, f"{name}.attn", init, group, out_std)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg, f"{name}.mlp", init, group, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig, init: Init, group: ProcessGroup) -> None:
        super().__init__()
        self.token = VocabParallelEmbedding(init.normal("embed.token", cfg.vocab_size, cfg.hidden), group)
        self.position = nn.Parameter(init.normal("embed.position", cfg.seq_len, cfg.hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.token(ids) + self.position[: ids.shape[1]]


class GPTStage(nn.Module):
    """The part of the model one rank runs: token ids or hidden states in; hidden states or logits out.

    The residual stream between stages stays fp32 under autocast (only matmuls run in bf16/fp16),
    so the pipeline always sends fp32 activations of shape [micro-batch, seq, hidden].
    """

    def __init__(self, cfg: ModelConfig, grid: Grid, seed: int) -> None:
        super().__init__()
        init, group = Init(seed), grid.tp_group
        per_stage = cfg.layers // grid.pp
        first = grid.pp_rank * per_stage
        self.group = group
        self.embed = Embedding(cfg, init, group) if grid.is_first_stage else None
        self.blocks = nn.ModuleDict(
            {str(i): Block(cfg, f"blocks.{i}", init, group) for i in range(first, first + per_stage)}
        )
        self.norm: nn.LayerNorm | None
        self.head: ColumnParallelLinear | None
        if grid.is_last_stage:
            self.norm = nn.LayerNorm(cfg.hidden)
            self.head = ColumnParallelLinear(  # logits split by vocabulary, never gathered
                init.normal("head", cfg.vocab_size, cfg.hidden), init.zeros(cfg.vocab_size), group
            )
        else:
            self.norm = self.head = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None and self.norm is not None:  # both or neither
            x = self.head(self.norm(x))
        return x

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the micro-batch (last stage only)."""
        return vocab_parallel_cross_entropy(logits, targets, self.group).mean()
