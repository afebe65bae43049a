"""fp16's dynamic loss scaler: the policy, and a whole pipeline skipping an overflowing step together."""

import dataclasses
import math

import pytest
import torch

from gpuwatch.trainer.config import ModelConfig, TrainConfig
from gpuwatch.trainer.launch import RankFailed, launch
from gpuwatch.trainer.parallel.groups import build_grid
from gpuwatch.trainer.precision import DynamicLossScaler
from gpuwatch.trainer.train import Trainer, train

CONFIG = TrainConfig(model=ModelConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2),
                     pp=2, micro_batches=2, global_batch=4, precision="fp16")


def test_scaler_halves_and_skips_on_overflow_and_grows_after_a_run_of_good_steps():
    scaler = DynamicLossScaler(enabled=True, init_scale=1024.0, growth_interval=3)
    assert scaler.update(grads_finite=False) is False and scaler.scale == 512.0
    assert all(scaler.update(grads_finite=True) for _ in range(2)) and scaler.scale == 512.0
    assert scaler.update(grads_finite=True) and scaler.scale == 1024.0
    restored = DynamicLossScaler(enabled=True)
    restored.load_state_dict(scaler.state_dict())
    assert (restored.scale, restored.good_steps) == (1024.0, 0)


def test_a_disabled_scaler_never_scales_nor_skips():
    scaler = DynamicLossScaler(enabled=False)
    assert scaler.scale == 1.0 and scaler.update(grads_finite=False) and scaler.scale == 1.0


def _overflow_then_recover(device, cfg):
    """fp16 autocast on CPU exercises the mechanism; the CLI keeps fp16 for CUDA."""
    trainer = Trainer(cfg, build_grid(cfg.tp, cfg.pp, cfg.dp), device)
    before = [p.detach().clone() for p in trainer.params]
    trainer.scaler.scale = 1e38  # loss × scale overflows to inf: every gradient is inf/NaN
    overflow = trainer.train_step()
    unchanged = all(torch.equal(a, p) for a, p in zip(before, trainer.params, strict=True))
    halved = trainer.scaler.scale
    trainer.scaler.scale = 2.0**8  # as if it had backed off far enough
    recovered = trainer.train_step()
    moved = not all(torch.equal(a, p) for a, p in zip(before, trainer.params, strict=True))
    return overflow, unchanged, halved, recovered, moved


def test_an_overflow_skips_the_step_on_every_stage_and_training_goes_on():
    for overflow, unchanged, halved, recovered, moved in launch(_overflow_then_recover, 2, CONFIG, device="cpu",
                                                                timeout=60):
        assert overflow.skipped and not math.isfinite(overflow.grad_norm) and unchanged and halved == 5e37
        assert not recovered.skipped and math.isfinite(recovered.grad_norm) and moved


def test_fp16_off_cuda_is_refused_inside_the_rank():
    with pytest.raises(RankFailed, match="fp16 needs CUDA, and this rank runs on cpu"):
        launch(train, 1, dataclasses.replace(CONFIG, pp=1, device="auto"), device="cpu", timeout=60)
