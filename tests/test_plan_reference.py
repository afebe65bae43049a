"""The planner's structure is exact for the reference trainer on the CPU: on real multi-process gloo runs, the
parameters, gradients and Adam states each rank allocates, and the bytes per step each rank hands each process
group's collectives as the hooks measure them, equal the prediction for that rank's pipeline stage.

The hooks' figures: the step records of the run log, whose `groups` give the bytes handed to each process group's
calls (named as the hello names the groups) and whose `collectives` the same bytes per op. The hooks' own
collectives (gradient similarity, checksums) are turned off: they are not the training's traffic. Adam's `step`
counters (one 4-byte scalar per parameter tensor) are not counted: the planner counts bytes per parameter.
"""

from __future__ import annotations

import pytest
from hooks_helpers import read_run_log

from gpuwatch.plan.gpus import Cluster, preset
from gpuwatch.plan.model import from_reference
from gpuwatch.plan.planner import predict
from gpuwatch.plan.run import Layout, Run, numerics
from gpuwatch.trainer.config import ModelConfig, TrainConfig

pytestmark = pytest.mark.integration

TINY = ModelConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4)
STEPS = 2


def _train_and_count(device, cfg: TrainConfig) -> dict:
    """train()'s loop on this rank, then what the rank allocated."""
    from gpuwatch.trainer.parallel import comm
    from gpuwatch.trainer.parallel.groups import build_grid
    from gpuwatch.trainer.train import Trainer, instrument

    grid = build_grid(cfg.tp, cfg.pp, cfg.dp)
    trainer = Trainer(cfg, grid, device)
    monitor = instrument(trainer)
    for _ in range(cfg.steps):
        trainer.train_step()
    comm.set_timer(None)
    monitor.close()
    states = [state for state in trainer.optimizer.state.values()]
    return {
        "stage": grid.pp_rank,
        "parameters": sum(p.numel() for p in trainer.params),
        "weight_bytes": sum(p.nbytes for p in trainer.params),
        "grad_bytes": sum(p.grad.nbytes for p in trainer.params),
        "optimizer_bytes": sum(s["exp_avg"].nbytes + s["exp_avg_sq"].nbytes for s in states),
    }


@pytest.mark.parametrize(("tp", "pp", "dp", "m", "schedule", "precision"), [
    (2, 2, 1, 2, "1f1b", "fp32"),
    (1, 2, 2, 4, "gpipe", "fp32"),
    (2, 1, 2, 1, "1f1b", "bf16"),
])
def test_reference_trainer_allocates_and_sends_what_the_plan_predicts(tmp_path, tp, pp, dp, m, schedule, precision):
    from gpuwatch.trainer.launch import launch

    cfg = TrainConfig(model=TINY, tp=tp, pp=pp, dp=dp, micro_batches=m, schedule=schedule, precision=precision,
                      global_batch=8, steps=STEPS, telemetry=True, job="plan", run_log=str(tmp_path / "runs"),
                      telemetry_socket=str(tmp_path / "no-agent.sock"), grad_similarity_every=0, checksum_every=0,
                      memory_every=0, device="cpu")
    ranks = launch(_train_and_count, cfg.world_size, cfg, device="cpu", timeout=180)
    layout = Layout(tp, pp, dp, m, schedule)
    run = Run(cfg.global_batch, TINY.seq_len, numerics(precision, reference=True), sequence_parallel=False)
    prediction = predict(from_reference(TINY), Cluster(cfg.world_size, cfg.world_size, preset("h100-80gb")), run,
                         layout)
    records = read_run_log(tmp_path / "runs")
    for rank, measured in enumerate(ranks):
        stage = prediction.stages[measured["stage"]]
        assert measured["parameters"] == stage.parameters, rank
        assert measured["weight_bytes"] == stage.memory.parameters
        assert measured["grad_bytes"] == stage.memory.gradients
        assert measured["optimizer_bytes"] == stage.memory.optimizer
        predicted = {group: nbytes for group, nbytes in stage.traffic.bytes_by_group().items() if nbytes}
        steps = [record for record in records[rank] if record["kind"] == "step"]
        assert len(steps) == STEPS
        for record in steps:
            by_group = {group: totals["bytes"] for group, totals in record.get("groups", {}).items()}
            assert by_group == predicted, (rank, record["step"])
            assert sum(op["bytes"] for op in record.get("collectives", {}).values()) == sum(by_group.values())
