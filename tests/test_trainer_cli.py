"""`gpuwatch train` as a user runs it: the fork launcher, torchrun, the JSONL log, failures."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from gpuwatch.cli.main import main

TINY = ["--layers", "2", "--heads", "2", "--hidden", "16", "--seq-len", "8", "--vocab", "32",
        "--global-batch", "8", "--steps", "3"]


def _train(*args: str, launcher: tuple[str, ...] = (sys.executable,)) -> subprocess.CompletedProcess:
    command = [*launcher, "-m", "gpuwatch.trainer.cli", *TINY, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=240)


def _log(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.integration
def test_fork_launcher_trains_logs_every_step_and_a_bad_resume_fails_with_the_rank_error(tmp_path):
    log, checkpoints = tmp_path / "run.jsonl", tmp_path / "ckpt"
    run = _train("--tp", "2", "--pp", "2", "--dp", "1", "--micro-batches", "2",
                 "--log-jsonl", str(log), "--checkpoint-dir", str(checkpoints))
    assert run.returncode == 0, run.stderr
    records = _log(log)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(isinstance(r["loss"], float) and r["loss"] > 0 for r in records)
    assert "4 ranks: tp 2 × pp 2 × dp 1 on cpu (gloo)" in run.stdout
    assert f"step     3/3  loss {records[-1]['loss']:.4f}" in run.stdout  # each step is printed too

    resumed_elsewhere = _train("--tp", "1", "--pp", "2", "--dp", "2", "--micro-batches", "2",
                               "--checkpoint-dir", str(checkpoints), "--resume")
    assert resumed_elsewhere.returncode == 1
    assert "failed: " in resumed_elsewhere.stderr
    assert "resume with the same --tp/--pp/--dp, model options and learning-rate schedule" in resumed_elsewhere.stderr


@pytest.mark.integration
def test_torchrun_runs_the_same_entry_point_with_the_same_losses(tmp_path):
    layout = ["--tp", "1", "--pp", "2", "--dp", "1", "--micro-batches", "2"]
    forked = _train(*layout, "--log-jsonl", str(tmp_path / "fork.jsonl"))
    assert forked.returncode == 0, forked.stderr
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    under_torchrun = _train(*layout, "--log-jsonl", str(tmp_path / "torchrun.jsonl"), launcher=torchrun)
    assert under_torchrun.returncode == 0, under_torchrun.stderr
    fork_losses = [r["loss"] for r in _log(tmp_path / "fork.jsonl")]
    torchrun_losses = [r["loss"] for r in _log(tmp_path / "torchrun.jsonl")]
    assert torchrun_losses == pytest.approx(fork_losses, abs=1e-6)


def test_torchrun_world_size_must_match_the_layout(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    result = CliRunner().invoke(main, ["train", "--tp", "2", "--pp", "2", "--dp", "1"])
    assert result.exit_code == 2
    assert "= 4 ranks, but the job has 3 (WORLD_SIZE)" in result.output


def test_gpuwatch_lists_train_with_its_options():
    result = CliRunner().invoke(main, ["train", "--help"])
    assert result.exit_code == 0
    for option in ("--tp", "--pp", "--dp", "--micro-batches", "--schedule", "--global-batch", "--log-jsonl",
                   "--precision", "--device", "--checkpoint-dir", "--resume"):
        assert option in result.output


def test_fp16_on_a_machine_without_cuda_is_refused_before_any_rank_starts(monkeypatch):
    """`--device auto` on a CPU-only machine (this CPU build of torch, or no GPU for NVML) is the CPU: fp16 there is
    a usage error at once, not a rank failing after gloo has started."""
    import gpuwatch.trainer.cli as train_cli

    monkeypatch.setattr(train_cli, "_cuda_possible", lambda: False)
    monkeypatch.setattr("gpuwatch.trainer.launch.launch", lambda *args, **kwargs: pytest.fail("a rank started"))
    result = CliRunner().invoke(main, ["train", *TINY, "--tp", "1", "--pp", "1", "--dp", "1", "--micro-batches", "1",
                                       "--precision", "fp16"])
    assert result.exit_code == 2
    assert "--precision fp16 needs CUDA; use bf16 on CPU" in result.output
