"""Bad layouts are refused before any process starts, with a message that names the options."""

import subprocess
import sys

import pytest
from click.testing import CliRunner

from gpuwatch.trainer.cli import train
from gpuwatch.trainer.config import ConfigError, ModelConfig, TrainConfig


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (TrainConfig(model=ModelConfig(layers=3), pp=2), "--layers 3 cannot be split into --pp 2"),
        (TrainConfig(model=ModelConfig(heads=4), tp=8), "--heads 4 cannot be split across --tp 8"),
        (TrainConfig(model=ModelConfig(vocab_size=100, heads=8), tp=8), "--vocab 100 cannot be split"),
        (TrainConfig(model=ModelConfig(hidden=30, heads=4)), "--hidden 30 is not divisible by --heads 4"),
        (TrainConfig(global_batch=16, dp=2, micro_batches=3), "--global-batch 16 is not divisible by --dp 2"),
        (TrainConfig(tp=0), "--tp must be at least 1"),
        (TrainConfig(precision="fp16", device="cpu"), "fp16 needs CUDA"),
        (TrainConfig(resume=True), "need --checkpoint-dir"),
        (TrainConfig(memory_every=-1), "--memory-every must not be negative"),
    ],
)
def test_bad_combinations_are_refused_with_the_options_named(config, message):
    with pytest.raises(ConfigError, match=message):
        config.validate()


def test_world_size_must_match_the_layout():
    config = TrainConfig(tp=2, pp=2, dp=2)
    config.validate(world_size=8)
    with pytest.raises(ConfigError, match="= 8 ranks, but the job has 4"):
        config.validate(world_size=4)


def test_micro_batch_size_splits_the_global_batch():
    assert TrainConfig(global_batch=32, dp=2, micro_batches=4).micro_batch_size == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layers", "3", "--pp", "2"], "--layers 3 cannot be split into --pp 2 stages"),
        (["--heads", "4", "--tp", "8"], "--heads 4 cannot be split across --tp 8"),
        (["--global-batch", "10", "--dp", "2", "--micro-batches", "4"], "--global-batch 10 is not divisible"),
        (["--schedule", "zigzag"], "'zigzag' is not one of 'gpipe', '1f1b'"),
        (["--memory-every", "-2"], "--memory-every must not be negative (0 turns them off)"),
    ],
)
def test_cli_usage_errors_exit_2_with_a_message_and_no_traceback(args, message):
    result = CliRunner().invoke(train, args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_cli_module_does_not_import_torch():
    """The agent's CLI loads this module lazily; the agent must run without torch."""
    code = "import sys, gpuwatch.trainer.cli; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
