"""Per-rank checkpoints, so that a resumed run continues exactly where it stopped.

    DIR/step_00000010/tp0-pp1-dp0.pt   one file per rank: no two ranks ever write the same file
    DIR/latest                         "10", moved by rank 0 once every rank has saved step 10

A file holds the rank's model slice, optimizer state, LR schedule, loss scaler, RNG state, step and
data position. Files are written under a temporary name and renamed, and `latest` moves only after
a barrier, so a crash mid-save leaves the previous checkpoint in charge. DIR must be shared by all
nodes. Resuming needs the layout and model it was saved with: slices are not re-split.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gpuwatch.trainer.config import ConfigError
from gpuwatch.trainer.parallel import comm
from gpuwatch.trainer.parallel.groups import Grid

if TYPE_CHECKING:
    from gpuwatch.trainer.train import Trainer

SAME_RUN = ("resume with the same --tp/--pp/--dp, model options and learning-rate schedule (--lr, --warmup-steps, "
            "--steps: the cosine decay spans --steps, so another value would change every later step's rate)")


def rank_file(directory: Path, step: int, grid: Grid) -> Path:
    return directory / f"step_{step:08d}" / f"tp{grid.tp_rank}-pp{grid.pp_rank}-dp{grid.dp_rank}.pt"


def _identity(trainer: Trainer, grid: Grid) -> dict:
    """What must match for a checkpoint to fit this run: the layout, the model, and the learning-rate schedule, whose
    cosine ends at --steps (resumed with another --steps, the losses would differ from an uninterrupted run)."""
    cfg = trainer.cfg
    return {"tp": grid.tp, "pp": grid.pp, "dp": grid.dp, "model": asdict(cfg.model),
            "schedule": {"lr": cfg.lr, "warmup_steps": cfg.warmup_steps, "steps": cfg.steps}}


def _atomic_write(path: Path, write) -> None:
    temporary = path.with_name(path.name + ".tmp")
    write(temporary)
    os.replace(temporary, path)


def save(trainer: Trainer, directory: Path, grid: Grid) -> Path:
    """Every rank writes its own file; `latest` points at the step once all have."""
    path = rank_file(directory, trainer.step, grid)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {**trainer.state_dict(), "identity": _identity(trainer, grid)}
    _atomic_write(path, lambda target: torch.save(state, target))
    comm.barrier()
    if grid.rank == 0:
        _atomic_write(directory / "latest", lambda target: target.write_text(f"{trainer.step}\n"))
    return path


def load_latest(trainer: Trainer, directory: Path, grid: Grid) -> bool:
    """Load this rank's file of the latest complete checkpoint; False when there is none."""
    latest = directory / "latest"
    if not latest.exists():
        return False
    path = rank_file(directory, int(latest.read_text()), grid)
    if not path.exists():
        raise ConfigError(f"{path} is missing: {directory} holds another layout; {SAME_RUN}")
    state = torch.load(path, map_location="cpu", weights_only=True)  # RNG states must stay on the CPU
    if state["identity"] != _identity(trainer, grid):
        this_run = _identity(trainer, grid)
        raise ConfigError(f"{path} was saved by {state['identity']}, this run is {this_run}; {SAME_RUN}")
    trainer.load_state_dict(state)
    return True
