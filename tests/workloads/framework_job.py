"""What the real-framework workloads share (hf_trainer.py, accelerate_loop.py, lightning_fit.py, fsdp2_loop.py): their
options, a synthetic token data set, a tiny language model in plain torch, the planted faults and the results file.
Nothing here imports gpuwatch, and nothing downloads: every model is built from a config, every batch made here.

Options every such script takes (tests/foreign.py's Workload passes the first three):

* ``--steps S``: optimizer steps;
* ``--fault F`` with ``--fault-rank R`` (default: every rank) and ``--delay D`` (default 0.2 s): a planted fault
  (``FAULTS``): ``slow-data`` sleeps inside the data set's ``__getitem__``, ``slow-compute`` inside a module's
  forward (in training mode only), ``slow-outside`` in a framework callback or a logging call between two optimizer
  steps, ``slow-optimizer`` inside the optimizer's ``step`` (after its update, outside any closure), each ``D``
  seconds per optimizer step on the slowed ranks, spread over its micro-batches or samples;
* ``--never-learns``: on every rank, a model that does not learn (how, each script says: a learning rate of 0, or a
  loss over a single logit), alone or with a slow-* fault (one run then plants both);
* ``--out DIR``: each rank writes DIR/rank-R.json: ``losses``, the framework's own per-optimizer-step loss as the
  script reads it from the framework (``float.hex``: exact; each script says which value that is), and ``params``,
  a SHA-256 of the rank's final parameters (its shards under FSDP), for comparing a run under ``gpuwatch run`` with
  the same run without it, bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

FAULTS = ("none", "slow-data", "slow-compute", "slow-outside", "slow-optimizer")
#: The tiny model's sizes: a vocabulary of 128, hidden 32, 2 layers, sequences of 16 tokens.
VOCAB, HIDDEN, LAYERS, SEQUENCE = 128, 32, 2, 16

# Nothing may reach a hub at run time: the Hugging Face libraries are told so before any of them is imported.
for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY",
              "DISABLE_TELEMETRY"):
    os.environ.setdefault(_name, "1")


def parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps")
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-rank", default=None, help="the rank the fault is planted on (default: every rank)")
    parser.add_argument("--delay", type=float, default=0.2, help="seconds a slow-* fault costs an optimizer step")
    parser.add_argument("--never-learns", action="store_true", help="on every rank, a model that does not learn")
    parser.add_argument("--out", type=Path, default=None, help="write each rank's losses and parameter hash here")
    return parser


class Fault:
    """The faults planted on this rank: its slow-* fault (``none`` on a rank it is not planted on), and whether its
    model never learns (``--never-learns``, every rank's)."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        planted = args.fault_rank is None or int(args.fault_rank) == rank
        self.name = args.fault if planted else "none"
        self.delay = args.delay
        self.never_learns: bool = args.never_learns

    def slows(self, phase: str) -> bool:
        """Whether this rank is slowed in ``phase`` ("data", "compute", "outside", "optimizer")."""
        return self.name == f"slow-{phase}"

    def sleep(self, phase: str, share: int = 1) -> None:
        """Sleep this fault's delay divided by ``share`` (the calls it is spread over in one optimizer step), if this
        rank is slowed in ``phase``."""
        if self.slows(phase):
            time.sleep(self.delay / share)


class Tokens(Dataset):
    """``size`` synthetic sequences of SEQUENCE tokens, item ``i`` made from seed ``i``: a start and a stride, the
    tokens counting up from the start by the stride modulo VOCAB (something a tiny model learns to predict). With
    ``as_dict`` an item is ``{"input_ids": x, "labels": x}`` (a Hugging Face causal LM shifts the labels itself),
    else the tensor. Slowed in ``data``, each item sleeps its share of the step's delay (``per_step`` items make an
    optimizer step)."""

    def __init__(self, size: int, fault: Fault | None = None, per_step: int = 1, as_dict: bool = False) -> None:
        self.size, self.fault, self.per_step, self.as_dict = size, fault, per_step, as_dict

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor | dict[str, torch.Tensor]:
        if self.fault is not None:
            self.fault.sleep("data", self.per_step)
        generator = torch.Generator().manual_seed(index)
        start = torch.randint(0, VOCAB, (1,), generator=generator)
        stride = torch.randint(1, 4, (1,), generator=generator)
        tokens = (start + stride * torch.arange(SEQUENCE)) % VOCAB
        return {"input_ids": tokens, "labels": tokens.clone()} if self.as_dict else tokens


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(F.gelu(self.up(self.norm(hidden))))


class TinyLM(nn.Module):
    """A language model in plain torch: an embedding, LAYERS residual MLP blocks, a head over the vocabulary. In
    training mode its forward first sleeps ``delay`` seconds (``slow-compute``: inside the model's forward)."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(HIDDEN) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.delay = delay

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.training and self.delay:
            time.sleep(self.delay)
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, single_logit: bool = False) -> torch.Tensor:
    """Cross-entropy of each next token. ``single_logit``: the bug of a loss over a wrongly shaped output, one logit
    per position, whose cross-entropy is 0 whatever the weights (and so are its gradients): a model that never
    learns."""
    if single_logit:
        return F.cross_entropy(logits[:, :-1, :1].reshape(-1, 1), torch.zeros_like(tokens[:, 1:]).reshape(-1))
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def slow_optimizer(base: type[torch.optim.Optimizer], fault: Fault) -> type[torch.optim.Optimizer]:
    """``base`` whose ``step`` sleeps the fault's delay (``slow-optimizer``) once its own update is done: inside
    ``step``, after any closure it was given (a forward and backward) has run, as a slow update would be."""

    class Slow(base):  # type: ignore[misc, valid-type]
        def step(self, closure=None):
            result = super().step(closure)
            fault.sleep("optimizer")
            return result

    Slow.__name__ = Slow.__qualname__ = f"Slow{base.__name__}"
    return Slow


def parameters_hash(parameters: Iterable[torch.Tensor]) -> str:
    """SHA-256 over the bytes of ``parameters`` in order (a DTensor's local shard)."""
    digest = hashlib.sha256()
    for parameter in parameters:
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        digest.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def write_results(out: Path | None, rank: int, losses: Iterable[float], params: str, **extra: int) -> None:
    """DIR/rank-R.json (``--out``): the losses, the parameters' hash and what else the script counted (``extra``)."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    results = {"losses": [float(x).hex() for x in losses], "params": params, **extra}
    (out / f"rank-{rank}.json").write_text(json.dumps(results))
