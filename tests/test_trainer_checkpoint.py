"""Save and resume: train 2k steps, or train k, stop, resume and train k more: the same losses."""

import dataclasses
from pathlib import Path

import pytest

from gpuwatch.trainer import checkpoint
from gpuwatch.trainer.config import ModelConfig, TrainConfig
from gpuwatch.trainer.launch import RankFailed, launch
from gpuwatch.trainer.parallel.groups import build_grid
from gpuwatch.trainer.train import Trainer, train

K = 3
CONFIG = TrainConfig(
    model=ModelConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4),
    tp=1, pp=2, dp=2, micro_batches=2, global_batch=8, steps=2 * K, warmup_steps=2, lr=1e-2,
)


def _losses(cfg: TrainConfig) -> list[float]:
    ranks = launch(train, cfg.world_size, cfg, device="cpu", timeout=120)
    return [result.loss for result in ranks[-1]]  # the last rank is on the last stage


def _stop_after_k_steps(device, cfg: TrainConfig) -> list[float | None]:
    """A run of 2K steps that ends (as if preempted) after its checkpoint at step K."""
    grid = build_grid(cfg.tp, cfg.pp, cfg.dp)
    trainer = Trainer(cfg, grid, device)
    losses = [trainer.train_step().loss for _ in range(K)]
    checkpoint.save(trainer, Path(cfg.checkpoint_dir), grid)
    return losses


@pytest.mark.integration
def test_resumed_run_continues_exactly_where_it_stopped(tmp_path):
    straight = _losses(CONFIG)
    stopping = dataclasses.replace(CONFIG, checkpoint_dir=str(tmp_path))
    first = launch(_stop_after_k_steps, CONFIG.world_size, stopping, device="cpu", timeout=120)[-1]
    second = _losses(dataclasses.replace(stopping, resume=True))

    assert len(first) == len(second) == K
    # Bitwise: the same operations on the same data in the same order (gloo reductions are deterministic).
    # Anything not restored (Adam moments, LR schedule position, data position) would change step K+1.
    assert first + second == straight

    saved = tmp_path / f"step_{K:08d}"
    assert sorted(p.name for p in saved.iterdir()) == [
        "tp0-pp0-dp0.pt", "tp0-pp0-dp1.pt", "tp0-pp1-dp0.pt", "tp0-pp1-dp1.pt",  # one file per rank
    ]
    assert (tmp_path / "latest").read_text() == f"{2 * K}\n"  # the resumed run saved at its end


def test_resuming_with_another_layout_is_refused(tmp_path):
    launch(train, CONFIG.world_size, dataclasses.replace(CONFIG, steps=1, checkpoint_dir=str(tmp_path)),
           device="cpu", timeout=120)
    other = dataclasses.replace(CONFIG, pp=1, dp=4, steps=1, checkpoint_dir=str(tmp_path), resume=True)
    with pytest.raises(RankFailed, match="resume with the same --tp/--pp/--dp, model options and learning-rate"):
        launch(train, other.world_size, other, device="cpu", timeout=120)


def test_resuming_with_another_step_count_is_refused(tmp_path):
    """The cosine schedule spans --steps: resumed with another --steps every later learning rate would differ from
    the run that was interrupted, so the checkpoint refuses rather than continue "exactly" on other terms."""
    launch(train, CONFIG.world_size, dataclasses.replace(CONFIG, steps=1, checkpoint_dir=str(tmp_path)),
           device="cpu", timeout=120)
    longer = dataclasses.replace(CONFIG, steps=4, checkpoint_dir=str(tmp_path), resume=True)
    with pytest.raises(RankFailed, match=r"'schedule': \{'lr': 0.01, 'warmup_steps': 2, 'steps': 1\}.*--steps: the "
                                         "cosine decay spans --steps"):
        launch(train, longer.world_size, longer, device="cpu", timeout=120)
