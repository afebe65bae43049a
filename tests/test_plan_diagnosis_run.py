"""The loop closed on a real run: the reference trainer on the CPU (gloo, two data-parallel ranks) writes a run log
whose hellos carry the model's shape and batch and whose steps carry the bytes and seconds of each process group;
diagnosis reads it, plans the job and compares.

What a CPU step should take is no figure a test can hold the machine to (its load, its speed), so the run is
judged against a calibration of an ideal machine (every FLOP and byte free): every run is then slower than its
plan, and what the test asserts is which term PLAN001 names. The planted fault is a slow network: every rank's DP
all-reduce takes SLOW_SECONDS more, far beyond what anything else in this tiny model's step takes on any machine
that runs the suite. The verdicts on healthy and faulty timings against a realistic plan are
tests/test_diagnose_plan.py's, on injected timings.
"""

from __future__ import annotations

import time

import pytest

from gpuwatch.diagnosis import engine
from gpuwatch.diagnosis.rules.plan import GROUP_NAMES
from gpuwatch.diagnosis.sources import run_log
from gpuwatch.plan.gpus import Calibration
from gpuwatch.trainer.config import ModelConfig, TrainConfig

pytestmark = pytest.mark.integration

TINY = ModelConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2)
SLOW_SECONDS = 0.5
IDEAL = Calibration(matmul_flops=1e18, bus_bandwidth={"nvlink": ((1, 1e18),), "ib": ((1, 1e18),)})


def _train_on_a_slow_network(device, cfg: TrainConfig) -> None:
    """train() on this rank, its DP group's all-reduces each SLOW_SECONDS longer (inside the timed call, as a
    congested link would make them)."""
    import torch.distributed as dist

    from gpuwatch.trainer.parallel import comm
    from gpuwatch.trainer.train import train

    reduce = dist.all_reduce

    def slow(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if group is not None and dist.get_world_size(group) == cfg.dp:
            time.sleep(SLOW_SECONDS)
        return reduce(tensor, op=op, group=group, async_op=async_op)

    comm.dist.all_reduce = slow
    train(device, cfg)


def test_a_slow_data_parallel_network_is_named_against_the_plan(tmp_path):
    from gpuwatch.trainer.launch import launch

    cfg = TrainConfig(model=TINY, tp=1, pp=1, dp=2, global_batch=4, steps=8, telemetry=True, job="planned",
                      run_log=str(tmp_path / "runs"), telemetry_socket=str(tmp_path / "no-agent.sock"),
                      grad_similarity_every=0, checksum_every=0, device="cpu")
    launch(_train_on_a_slow_network, cfg.world_size, cfg, device="cpu", timeout=180)
    facts = run_log.read(tmp_path / "runs")
    assert {rank.rank for rank in facts.ranks} == {0, 1}
    for rank in facts.ranks:
        assert rank.workload is not None and rank.workload.global_batch == 4 and rank.workload.seq_len == 16
        assert rank.workload.model.layers == 2 and rank.workload.model.source == "reference"
        assert rank.last is not None and rank.last.groups is not None
        assert rank.last.groups["dp"].seconds >= SLOW_SECONDS  # the hooks saw the wait, on the DP group

    uncalibrated = engine.run(facts, engine.select(["PLAN"]))
    assert {skipped.code for skipped in uncalibrated.skipped} == {"PLAN001", "PLAN002"}
    assert "give --calibration" in uncalibrated.skipped[0].reason

    facts.calibration = IDEAL
    report = engine.run(facts, engine.select(["PLAN001"]))
    assert report.ran == ["PLAN001"]
    [finding] = report.findings
    assert f": {GROUP_NAMES['dp']} " in finding.title
    assert finding.evidence[1].values["term"] == GROUP_NAMES["dp"]
    assert finding.evidence[1].values["measured_seconds"] >= SLOW_SECONDS
