"""A plain DistributedDataParallel script (examples/ddp_train.py), not the reference trainer, instrumented
through the public API: its ranks' core signals reach a real agent."""

import importlib.util
from pathlib import Path

import pytest
from hooks_helpers import AGENT, by_rank, wait_for_step

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


def test_a_plain_ddp_script_reports_the_core_signals_of_every_rank(start_agent, monkeypatch):
    agent = start_agent(*AGENT)
    monkeypatch.setenv("GPUWATCH_SOCKET", str(agent.telemetry_socket))
    monkeypatch.setenv("GPUWATCH_JOB", "ddp-example")
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
