"""The hooks in the reference trainer: real gloo ranks sending to a real `gpuwatch agent`."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hooks_helpers import AGENT, by_rank, read_run_log, wait_for_step

from gpuwatch.trainer import train as train_module
from gpuwatch.trainer.config import ModelConfig, TrainConfig
from gpuwatch.trainer.launch import launch
from gpuwatch.trainer.parallel import comm
from gpuwatch.trainer.parallel.groups import build_grid
from gpuwatch.trainer.parallel.tensor import unshard
from gpuwatch.trainer.train import Trainer, instrument, train

from conftest import wait_until

pytestmark = pytest.mark.integration

TINY = ModelConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2)
TINY_OPTIONS = ["--layers", "2", "--heads", "2", "--hidden", "16", "--seq-len", "8", "--vocab", "32",
                "--global-batch", "8", "--micro-batches", "4"]


def test_gpuwatch_train_reports_every_signal_of_every_rank_to_the_agent(start_agent, tmp_path):
    """tp 2 × pp 2 × dp 2, 1F1B over 4 micro-batches, with duplicated data shards on purpose."""
    agent = start_agent(*AGENT)
    job, steps = "hooks-e2e", 4
    started = time.time()
    run = subprocess.run(
        [sys.executable, "-m", "gpuwatch.trainer.cli", *TINY_OPTIONS, "--steps", str(steps), "--job", job,
         "--grad-similarity-every", "2", "--checksum-every", "2", "--memory-every", "2", "--fault", "duplicate-shards",
         "--run-log", str(tmp_path / "runs"), "--log-jsonl", str(tmp_path / "losses.jsonl")],
        env={**os.environ, "GPUWATCH_SOCKET": str(agent.telemetry_socket)},
        capture_output=True, text=True, timeout=240,
    )
    assert run.returncode == 0, run.stderr
    assert "step     4/4  loss" in run.stdout  # the trainer's own printing stays
    logged = [json.loads(line) for line in (tmp_path / "losses.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logged] == [1, 2, 3, 4]  # --log-jsonl keeps its contract

    states = wait_for_step(agent, job, ranks=8, step=steps)
    text = agent.get("/metrics").decode()
    everyone = set(range(8))

    def series(name: str, **labels: str) -> dict[int, float]:
        values = by_rank(text, name, job, **labels)
        assert set(values) == everyone, (name, labels, values)
        return values

    step_time, compute = series("gpuwatch_train_step_seconds"), series("gpuwatch_train_compute_seconds")
    data_wait, optimizer = series("gpuwatch_train_dataloader_wait_seconds"), series("gpuwatch_train_optimizer_seconds")
    for rank in everyone:
        assert 0 < compute[rank] < step_time[rank] and 0 < optimizer[rank] < step_time[rank]
        assert 0 < data_wait[rank] < step_time[rank]
    assert set(series("gpuwatch_train_pipeline_bubble_ratio_theoretical").values()) == {(2 - 1) / (4 + 2 - 1)}
    assert all(0 <= value <= 1 for value in series("gpuwatch_train_pipeline_bubble_ratio").values())
    assert all(value > 0 for value in series("gpuwatch_train_pipeline_busy_seconds").values())
    series("gpuwatch_train_pipeline_idle_seconds")
    for op in ("all_reduce", "send", "recv"):  # TP and DP all-reduces; each stage sends and receives
        assert all(count >= steps for count in series("gpuwatch_train_collective_seconds_count", op=op).values())
        assert all(size > 0 for size in series("gpuwatch_train_collective_bytes_total", op=op).values())

    last_stage = {4, 5, 6, 7}  # the loss exists on the last pipeline stage only
    assert set(by_rank(text, "gpuwatch_train_loss", job).values()) == {logged[-1]["loss"]}
    assert set(by_rank(text, "gpuwatch_train_loss", job)) == last_stage
    assert set(series("gpuwatch_train_grad_norm").values()) == {logged[-1]["grad_norm"]}  # global: same everywhere
    assert set(series("gpuwatch_train_learning_rate").values()) == {logged[-1]["lr"]}
    assert "gpuwatch_train_loss_scale{" not in text  # fp32 runs no loss scaler: no scale to report
    assert set(series("gpuwatch_train_nonfinite_steps_total").values()) == {0}
    assert set(series("gpuwatch_train_steps_total").values()) == {steps}
    tokens_per_step = 8 // 2 * 8  # a DP replica's sequences × sequence length
    assert set(series("gpuwatch_train_tokens_total").values()) == {steps * tokens_per_step}
    assert all(value > 0 for value in series("gpuwatch_train_model_flops_per_second").values())
    assert "gpuwatch_train_mfu_ratio{" not in text  # no known peak on a CPU
    assert all(value > 50 << 20 for value in series("gpuwatch_train_memory_peak_bytes", kind="host_rss").values())
    last_steps = series("gpuwatch_train_last_step_timestamp_seconds").values()
    assert all(started <= value <= time.time() for value in last_steps)  # Unix time, of this run

    # Every DP rank read the same data: local gradients equal the mean, the cosine is 1.
    assert all(abs(value - 1) < 1e-6 for value in series("gpuwatch_train_grad_cosine_similarity").values())
    checksum = series("gpuwatch_train_param_checksum")
    for rank in (0, 1, 4, 5):  # DP peers (dp_rank 0 and 1 of the same TP rank and stage) hold the same weights
        assert checksum[rank] == checksum[rank + 2]
    assert len(set(checksum.values())) == 4  # and the four different shards differ

    hellos = {state["rank"]: state["hello"] for state in states}
    assert hellos[5]["process_groups"] == {"tp": [4, 5], "dp": [5, 7], "pp": [1, 5]}
    assert (hellos[5]["tp_rank"], hellos[5]["pp_stage"], hellos[5]["dp_rank"]) == (1, 1, 0)
    assert hellos[5]["faults"] == ["duplicate-shards"] and hellos[5]["env"]["WORLD_SIZE"] == "8"
    assert (hellos[5]["schedule"], hellos[5]["micro_batches"], hellos[5]["precision"]) == ("1f1b", 4, "fp32")
    assert 'faults="duplicate-shards"' in text

    runs = read_run_log(tmp_path / "runs")  # the post-mortem copy: every record of every rank
    assert sorted(runs) == sorted(everyone)
    assert all([r["kind"] for r in records] == ["hello"] + ["step"] * steps for records in runs.values())


def test_a_real_gpipe_run_reports_a_consistent_bubble_for_every_stage_and_step(start_agent, tmp_path, monkeypatch):
    """Two stages, with m = 1 and m = 8 micro-batches. How much a real run idles depends on the machine and its
    load, so this checks structure only: the theory for m, the four fields on every step, a bubble strictly
    inside (0, 1) (every stage computes, and waits for its peer: causality, not speed), and the exported
    gauges equal to the last records. The measured bubble against the theory: tests/test_hooks_pipeline.py."""
    agent = start_agent(*AGENT)
    monkeypatch.setenv("GPUWATCH_SOCKET", str(agent.telemetry_socket))
    steps = 3
    for m, theory in ((1, 1 / 2), (8, 1 / 9)):
        job = f"bubble-m{m}"
        cfg = TrainConfig(model=TINY, pp=2, micro_batches=m, schedule="gpipe", global_batch=8, steps=steps,
                          telemetry=True, job=job, run_log=str(tmp_path / job))
        launch(train, cfg.world_size, cfg, device="cpu", timeout=120)
        runs = read_run_log(tmp_path / job)
        wait_for_step(agent, job, ranks=2, step=steps)
        text = agent.get("/metrics").decode()
        assert by_rank(text, "gpuwatch_train_pipeline_bubble_ratio_theoretical", job) == {0: theory, 1: theory}
        exported = by_rank(text, "gpuwatch_train_pipeline_bubble_ratio", job)
        assert sorted(runs) == sorted(exported) == [0, 1]
        for stage, records in runs.items():
            pipelines = [record["pipeline"] for record in records if record["kind"] == "step"]
            assert len(pipelines) == steps
            for pipeline in pipelines:
                assert pipeline["bubble_ratio_theoretical"] == theory
                assert pipeline["busy_seconds"] > 0 and pipeline["idle_seconds"] > 0
                window = pipeline["busy_seconds"] + pipeline["idle_seconds"]
                assert pipeline["bubble_ratio"] == pytest.approx(pipeline["idle_seconds"] / window)
            assert exported[stage] == pipelines[-1]["bubble_ratio"]


def _local_gradients_and_cosines(device, cfg: TrainConfig):
    """Train with the hooks, keeping each step's local gradients from just before the DP reduction
    (all_reduce_gradients is wrapped in this forked rank only)."""
    local: list[dict[str, torch.Tensor]] = []
    reduce = train_module.all_reduce_gradients

    def keep_local(params, grid, bucket_bytes, observe=None):
        local.append({name: p.grad.clone() for name, p in trainer.model.named_parameters()})
        reduce(params, grid, bucket_bytes, observe)

    train_module.all_reduce_gradients = keep_local
    grid = build_grid(cfg.tp, cfg.pp, cfg.dp)
    trainer = Trainer(cfg, grid, device)
    monitor = instrument(trainer)
    for _ in range(cfg.steps):
        trainer.train_step()
    comm.set_timer(None)
    monitor.close()
    splits = {name: getattr(p, "tp_split", None) for name, p in trainer.model.named_parameters()}
    return {"tp_rank": grid.tp_rank, "dp_rank": grid.dp_rank, "rank": grid.rank, "local": local, "splits": splits}


def test_gradient_cosine_similarity_matches_a_brute_force_over_the_gathered_full_gradients(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUWATCH_SOCKET", str(tmp_path / "no-agent.sock"))
    cfg = TrainConfig(model=ModelConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4), tp=2, pp=2, dp=2,
                      micro_batches=2, global_batch=8, steps=3, telemetry=True, grad_similarity_every=1,
                      run_log=str(tmp_path / "runs"))
    ranks = launch(_local_gradients_and_cosines, cfg.world_size, cfg, device="cpu", timeout=120)
    reported = {rank: [r["grad_cosine_similarity"] for r in records if r["kind"] == "step"]
                for rank, records in read_run_log(tmp_path / "runs").items()}
    for step in range(cfg.steps):
        replicas = [_full_gradient([r for r in ranks if r["dp_rank"] == d], step) for d in range(cfg.dp)]
        mean = sum(replicas) / cfg.dp
        for d, gradient in enumerate(replicas):
            expected = (gradient @ mean / (gradient.norm() * mean.norm())).item()
            assert 0 < expected < 0.999  # a real comparison, not identical data
            for r in ranks:
                if r["dp_rank"] == d:
                    assert abs(reported[r["rank"]][step] - expected) < 1e-6, (step, r["rank"])


def _full_gradient(replica: list[dict], step: int) -> torch.Tensor:
    """One DP replica's whole-model gradient (fp64), TP slices put back together, stages side by side."""
    pieces = []
    for name in sorted({name for r in replica for name in r["local"][step]}):
        holders = sorted((r for r in replica if name in r["local"][step]), key=lambda r: r["tp_rank"])
        split = holders[0]["splits"][name]
        slices = [r["local"][step][name] for r in holders]
        pieces.append((unshard(slices, *split) if split else slices[0]).double().reshape(-1))
    return torch.cat(pieces)


def _train_with_pauses(device, cfg: TrainConfig, gates: Path, pauses: tuple[int, ...]):
    """Train; after each step in `pauses` tell the test (a file) and wait until it says go on (another)."""
    grid = build_grid(cfg.tp, cfg.pp, cfg.dp)
    trainer = Trainer(cfg, grid, device)
    monitor = instrument(trainer) if cfg.telemetry else None
    losses = []
    while trainer.step < cfg.steps:
        losses.append(trainer.train_step().loss)
        if trainer.step in pauses:
            (gates / f"at-{trainer.step}-{grid.rank}").touch()
            wait_until(lambda: (gates / f"go-{trainer.step}").exists(), timeout=60, what="the test")
    if monitor is None:
        return losses, {}
    comm.set_timer(None)
    monitor.close()
    return losses, dict(monitor.client.drops)


def test_an_agent_killed_mid_run_costs_records_not_training_and_a_new_one_gets_the_rest(
    start_agent, tmp_path, monkeypatch
):
    """tp 1 × pp 2 × dp 2 for 9 steps: the agent is SIGKILLed after step 3 and a new one started on the
    same socket after step 6."""
    cfg = TrainConfig(model=TINY, pp=2, dp=2, micro_batches=2, global_batch=8, steps=9)
    world = cfg.world_size
    baseline, _ = launch(_train_with_pauses, world, cfg, tmp_path, (), device="cpu", timeout=120)[-1]

    first = start_agent(*AGENT)
    gates = tmp_path / "gates"
    gates.mkdir()
    agents, failures = [first], []

    def orchestrate() -> None:
        try:
            wait_until(lambda: len(list(gates.glob("at-3-*"))) == world, timeout=60, what="step 3 everywhere")
            wait_for_step(first, "killed", ranks=world, step=3)
            first.stop(signal.SIGKILL)
            (gates / "go-3").touch()
            wait_until(lambda: len(list(gates.glob("at-6-*"))) == world, timeout=60, what="step 6 everywhere")
            agents.append(start_agent(*AGENT, telemetry_socket=first.telemetry_socket))
        except BaseException as error:
            failures.append(error)
        (gates / "go-3").touch()
        (gates / "go-6").touch()

    orchestrator = threading.Thread(target=orchestrate)
    orchestrator.start()
    monkeypatch.setenv("GPUWATCH_SOCKET", str(first.telemetry_socket))
    try:
        with_telemetry = TrainConfig(**{**cfg.__dict__, "telemetry": True, "job": "killed"})
        results = launch(_train_with_pauses, world, with_telemetry, gates, (3, 6), device="cpu", timeout=180)
    finally:
        orchestrator.join()
    assert not failures, failures

    losses, _ = results[-1]  # the last stage's losses, as it printed them
    assert losses == baseline  # bit for bit: the hooks and the dead agent changed nothing
    second = agents[-1]
    states = wait_for_step(second, "killed", ranks=world, step=9)
    assert all(state["hello"]["rank"] == state["rank"] for state in states)  # hellos re-sent to the new agent
    # Steps 4-6 went nowhere, counted as dropped, or were held by the client (folded) until the new agent came; the
    # first agent had steps 1-3, the new one has 7-9 and whatever of 4-6 reached it.
    reached = {state["rank"]: state["counters"]["steps"] for state in states}
    assert all(3 <= reached[rank] <= 6 for rank in range(world)), reached
    lost = {rank: 6 - reached[rank] for rank in range(world)}
    assert all(drops.get("no_agent", 0) >= lost[rank] for rank, (_, drops) in enumerate(results))
    # and the new agent heard of them, from the counters its step records carry
    assert second.state()["facts"]["telemetry"]["records"]["dropped"]["no_agent"] >= sum(lost.values())
