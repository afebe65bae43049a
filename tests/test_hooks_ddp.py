"""A plain DistributedDataParallel script (examples/ddp_train.py), not the reference trainer, instrumented
through the public API: its ranks' core signals reach a real agent and its run log. Then what DDP's gradients
tell: the gradient norm when the script reports none, and why a zero gradient has no cosine."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hooks_helpers import AGENT, by_rank, read_run_log, wait_for_step
from torch.nn.parallel import DistributedDataParallel

from gpuwatch.trainer import hooks
from gpuwatch.trainer.launch import launch

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ddp_train.py"


def _example():
    spec = importlib.util.spec_from_file_location("ddp_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_example(device, steps: int):
    return _example().train(device, steps=steps, measure_every=2)


def test_a_plain_ddp_script_reports_the_core_signals_of_every_rank(start_agent, monkeypatch, tmp_path):
    agent = start_agent(*AGENT)
    monkeypatch.setenv("GPUWATCH_SOCKET", str(agent.telemetry_socket))
    monkeypatch.setenv("GPUWATCH_JOB", "ddp-example")
    monkeypatch.setenv("GPUWATCH_RUN_LOG", str(tmp_path / "runs"))
    steps = 6
    losses = launch(_train_example, 2, steps, device="cpu", timeout=120)
    states = wait_for_step(agent, "ddp-example", ranks=2, step=steps)
    text = agent.get("/metrics").decode()

    def series(name: str, **labels: str) -> dict[int, float]:
        values = by_rank(text, name, "ddp-example", **labels)
        assert set(values) == {0, 1}, (name, values)
        return values

    step_time, compute = series("gpuwatch_train_step_seconds"), series("gpuwatch_train_compute_seconds")
    for rank in (0, 1):
        assert 0 < compute[rank] < step_time[rank]
        assert 0 < series("gpuwatch_train_dataloader_wait_seconds")[rank] < step_time[rank]
        assert 0 < series("gpuwatch_train_optimizer_seconds")[rank] < step_time[rank]
        assert series("gpuwatch_train_loss")[rank] == pytest.approx(losses[rank][-1])
    # DDP's buckets, timed by the communication hook: at least one all-reduce per step, the whole gradient
    n_params = sum(p.numel() for p in _example().TinyLM(256, 64, 2).parameters())
    assert all(count >= steps for count in series("gpuwatch_train_collective_seconds_count", op="all_reduce").values())
    assert set(series("gpuwatch_train_collective_bytes_total", op="all_reduce").values()) == {steps * 4 * n_params}
    assert all(-1 < value < 0.999 for value in series("gpuwatch_train_grad_cosine_similarity").values())
    checksum = series("gpuwatch_train_param_checksum")
    assert checksum[0] == checksum[1]  # DDP keeps the replicas identical
    assert len(set(series("gpuwatch_train_grad_norm").values())) == 1  # clipped after the reduction: shared
    assert set(series("gpuwatch_train_tokens_total").values()) == {steps * 8 * 32}
    assert all(value > 0 for value in series("gpuwatch_train_model_flops_per_second").values())
    assert all(value > 50 << 20 for value in series("gpuwatch_train_memory_peak_bytes", kind="host_rss").values())
    assert {state["hello"]["dp_size"] for state in states} == {2}

    runs = read_run_log(tmp_path / "runs")  # GPUWATCH_RUN_LOG: every record of every rank, in order
    assert sorted(runs) == [0, 1]
    for records in runs.values():
        hello, *records = records
        assert hello["backends"] == {"default": "gloo", "dp": "gloo"}
        assert [r["step"] for r in records] == list(range(1, steps + 1))
        for record in records:
            assert record["samples"] == 8  # the batch: sequences
            # DDP's buckets are launched in the compute phase, which waits for the last of them
            assert 0 <= record["exposed_collective_seconds"] <= record["step_seconds"] - record["compute_seconds"]
            assert "unavailable" not in record  # every signal due was measured


def _ddp_steps(device, steps: int, run_log: Path, zero_gradient: bool) -> list[float]:
    """A DDP linear model, a few SGD steps reporting the loss only; the norm of the averaged gradient of each step,
    as DDP left it in .grad. With `zero_gradient`, cross-entropy over a single logit: the loss and every gradient
    are zero whatever the weights."""
    torch.manual_seed(0)
    classes = 1 if zero_gradient else 3
    model = DistributedDataParallel(torch.nn.Linear(4, classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = hooks.Monitor(model, job="ddp-gradients", run_log=run_log, grad_similarity_every=2, checksum_every=2)
    rank = torch.distributed.get_rank()
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))  # each rank its own data
    targets = torch.randint(classes, (8,), generator=torch.Generator().manual_seed(rank))
    norms = []
    for _ in range(steps):
        with monitor.step(samples=len(inputs)) as step:
            with step.compute():
                loss = F.cross_entropy(model(inputs), targets)
                loss.backward()
            norms.append(math.sqrt(sum(p.grad.double().square().sum().item() for p in model.parameters())))
            with step.optimizer():
                optimizer.step()
                optimizer.zero_grad()
            step.report(loss=loss.detach())
    monitor.close()
    return norms


def test_ddp_reports_the_gradient_norm_the_script_did_not_and_cosines_on_measuring_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUWATCH_SOCKET", str(tmp_path / "no-agent.sock"))
    norms = launch(_ddp_steps, 2, 4, tmp_path, False, device="cpu", timeout=120)
    for rank, records in read_run_log(tmp_path).items():
        steps = records[1:]
        assert ["grad_norm" in r for r in steps] == ["grad_cosine_similarity" in r for r in steps] == [
            False, True, False, True]
        for record, norm in zip(steps[1::2], norms[rank][1::2], strict=True):
            assert record["grad_norm"] == pytest.approx(norm, rel=1e-6) and norm > 0  # |ḡ|, the mean's norm
            assert -1 < record["grad_cosine_similarity"] < 0.999  # different data on each rank
            assert "unavailable" not in record


def test_a_zero_gradient_has_no_cosine_and_says_why_with_a_zero_gradient_norm(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUWATCH_SOCKET", str(tmp_path / "no-agent.sock"))
    norms = launch(_ddp_steps, 2, 4, tmp_path, True, device="cpu", timeout=120)
    assert set(norms[0] + norms[1]) == {0.0}
    for records in read_run_log(tmp_path).values():
        steps = records[1:]
        assert [r.get("unavailable") for r in steps] == [None, {"grad_cosine_similarity": "zero_gradient"}] * 2
        assert [r.get("grad_norm") for r in steps] == [None, 0.0] * 2
        assert all(r["loss"] == 0.0 and "grad_cosine_similarity" not in r for r in steps)
        assert ["param_checksum" in r for r in steps] == [False, True] * 2
