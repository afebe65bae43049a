"""The trainer's fault switches (`gpuwatch train --fault NAME`): refused where they cannot show, each doing what
its docstring says, and listed in every rank's hello. Diagnosis of real faulty runs: tests/test_e2e_faults.py."""

import json
import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from gpuwatch.trainer import faults
from gpuwatch.trainer.cli import train as train_cli
from gpuwatch.trainer.config import FAULTS, ConfigError, ModelConfig, TrainConfig
from gpuwatch.trainer.data import DistributedSampler
from gpuwatch.trainer.launch import launch
from gpuwatch.trainer.parallel.groups import build_grid
from gpuwatch.trainer.train import Trainer, train

MODEL = ModelConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4)


def config(**fields) -> TrainConfig:
    return TrainConfig(**{"model": MODEL, "global_batch": 8, "steps": 3, "warmup_steps": 1, **fields})


@pytest.mark.parametrize(("cfg", "message"), [
    (config(faults=("desync",)), "--fault desync needs data-parallel replicas: --dp 2"),
    (config(faults=("duplicate-shards",), pp=2), "--fault duplicate-shards needs data-parallel replicas"),
    (config(faults=("shared-pp-dp-group",), dp=2), "needs both a pipeline and replicas: --pp 2 or more and --dp 2"),
    (config(faults=("shared-pp-dp-group",), pp=2), "needs both a pipeline and replicas"),
    (config(faults=("slow-rank",), pp=2), "--fault slow-rank needs peers doing the same work"),
    (config(dp=2, fault_rank=1), "--fault-rank picks the rank of --fault slow-rank"),
    (config(faults=("slow-rank",), dp=2, fault_rank=2), r"--fault-rank 2 is not a rank of this job \(0 to 1\)"),
    (config(faults=("slow-rank",), dp=2, fault_rank=-1), "--fault-rank -1 is not a rank"),
    (config(faults=("fp16-no-scaler",)), "--fault fp16-no-scaler trains in fp16 without its loss scaler: add "
                                         "--precision fp16"),
    (config(faults=("bit-flip",)), "--fault must be one of duplicate-shards, slow-rank"),
    (config(faults=("fragment-memory",), device="cpu"), "--fault fragment-memory fragments the CUDA caching "
                                                        "allocator: it needs a GPU"),
])
def test_faults_are_refused_where_they_cannot_show(cfg, message):
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_fp16_on_the_cpu_only_for_the_fault_that_shows_it_failing():
    with pytest.raises(ConfigError, match="--precision fp16 needs CUDA"):
        config(precision="fp16", device="cpu").validate()
    config(precision="fp16", device="cpu", faults=("fp16-no-scaler",)).validate()


def test_the_slow_rank_is_the_last_unless_picked():
    assert config(dp=2, pp=2, faults=("slow-rank",)).faulty_rank == 3
    assert config(dp=2, pp=2, faults=("slow-rank",), fault_rank=1).faulty_rank == 1
    assert config(dp=2).faulty_rank is None


def test_cli_refuses_a_fault_rank_without_its_fault_and_lists_every_fault():
    result = CliRunner().invoke(train_cli, ["--fault-rank", "3"])
    assert result.exit_code == 2 and "--fault-rank picks the rank of --fault slow-rank" in result.output
    assert "Traceback" not in result.output
    help_text = "".join(CliRunner().invoke(train_cli, ["--help"]).output.split())  # wrapped, at hyphens too
    assert all("".join(f"{name}: {what}".split()) in help_text for name, what in FAULTS.items())


class _ScriptedTime:
    """Stands in for the `time` module as gpuwatch.trainer.faults uses it: its clocks return scripted readings
    and its sleep only records what it was asked for, so a pass's stretch is exact, whatever the machine's load.
    `log` keeps the order of clock readings, sleeps and (on a GPU) device synchronisations."""

    def __init__(self, thread_time: Iterable[float] = (), perf_counter: Iterable[float] = ()) -> None:
        self._readings = {"thread_time": iter(thread_time), "perf_counter": iter(perf_counter)}
        self.log: list[str] = []
        self.slept: list[float] = []

    def _read(self, clock: str) -> float:
        self.log.append(clock)
        return next(self._readings[clock])  # StopIteration: the pass read a clock it should not

    def thread_time(self) -> float:
        return self._read("thread_time")

    def perf_counter(self) -> float:
        return self._read("perf_counter")

    def sleep(self, seconds: float) -> None:
        self.log.append("sleep")
        self.slept.append(seconds)


def _two_passes(slow: Callable[[], AbstractContextManager]) -> None:
    for _ in range(2):
        with slow():
            pass


def _slowed(cfg, device: str) -> Callable[[], AbstractContextManager]:
    """The pace rank 1's pipeline gets from the slow-rank fault, applied to a stand-in trainer."""
    trainer = SimpleNamespace(cfg=cfg, grid=SimpleNamespace(rank=1), device=torch.device(device),
                              pipeline=SimpleNamespace(pace=nullcontext))
    faults.slow_rank(trainer)
    return trainer.pipeline.pace


def test_only_the_slow_rank_stretches_its_passes_to_slowdown_times_their_cpu_time(monkeypatch):
    """Each pass sleeps SLOWDOWN - 1 times the thread CPU time it used, so it takes SLOWDOWN times as long; the
    time between passes (waits for peers) is not stretched. Scripted clocks: the figures are exact."""
    assert _slowed(config(dp=2, faults=("slow-rank",), fault_rank=0), "cpu") is nullcontext
    slow = _slowed(config(dp=2, faults=("slow-rank",)), "cpu")
    scripted = _ScriptedTime(thread_time=[10.0, 10.25, 11.0, 11.5])  # passes of 0.25 s and 0.5 s of CPU
    monkeypatch.setattr(faults, "time", scripted)
    _two_passes(slow)
    assert scripted.slept == [(faults.SLOWDOWN - 1) * 0.25, (faults.SLOWDOWN - 1) * 0.5]
    assert scripted.log == ["thread_time", "thread_time", "sleep"] * 2  # CPU time only: no wall clock


def test_on_a_gpu_the_slow_rank_stretches_its_passes_by_their_wall_time_once_the_device_is_done(monkeypatch):
    """On a GPU the host runs ahead of the device: each reading of the wall clock follows a synchronisation."""
    slow = _slowed(config(dp=2, faults=("slow-rank",)), "cuda")
    scripted = _ScriptedTime(perf_counter=[5.0, 5.125, 6.0, 6.25])
    monkeypatch.setattr(faults, "time", scripted)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: scripted.log.append("synchronize"))
    _two_passes(slow)
    assert scripted.slept == [(faults.SLOWDOWN - 1) * 0.125, (faults.SLOWDOWN - 1) * 0.25]
    assert scripted.log == ["synchronize", "perf_counter", "synchronize", "perf_counter", "sleep"] * 2


def test_fragment_memory_is_refused_on_the_cpu_in_one_line():
    """The CLI refuses it before any rank starts (`auto` lands on the CPU here, or is told to); a rank whose device
    turned out to be the CPU refuses it too, and its gradient reduction is left alone."""
    for device in (["--device", "cpu"], [] if not torch.cuda.is_available() else ["--device", "cpu"]):
        result = CliRunner().invoke(train_cli, ["--tp", "1", "--pp", "1", "--dp", "1", "--fault", "fragment-memory",
                                                *device])
        assert result.exit_code == 2, result.output
        assert "--fault fragment-memory fragments the CUDA caching allocator: it needs a GPU" in result.output
        assert "Traceback" not in result.output
    reduce = object()
    trainer = SimpleNamespace(device=torch.device("cpu"), reduce_gradients=reduce)
    with pytest.raises(ConfigError, match="this rank runs on cpu: it needs a GPU"):
        faults.fragment_memory(trainer)
    assert trainer.reduce_gradients is reduce


def test_duplicate_shards_give_every_replica_the_first_slice():
    trainers = [SimpleNamespace(sampler=DistributedSampler(1024, 8, rank, 4, seed=0)) for rank in range(4)]
    for trainer in trainers:
        faults.duplicate_shards(trainer)
    batches = [trainer.sampler.next_indices() for trainer in trainers]
    assert batches == [DistributedSampler(1024, 8, 0, 4, seed=0).next_indices()] * 4


def test_every_fault_the_cli_offers_has_one_injector():
    assert set(faults.INJECTORS) == set(FAULTS)


def test_lr_explode_takes_the_gradient_norm_past_100_within_four_steps():
    (results,) = launch(train, 1, config(steps=4, warmup_steps=5, faults=("lr-explode",)), device="cpu")
    assert results[0].lr == faults.EXPLODING_LR / 5  # the warm-up still applies
    assert results[0].grad_norm < 10 < 100 < results[-1].grad_norm
    assert all(math.isfinite(r.loss) for r in results)


def _replica_state(device, cfg):
    """This rank's parameter sum before training, after 3 steps, and its last gradient."""
    trainer = Trainer(cfg, build_grid(cfg.tp, cfg.pp, cfg.dp), device)
    faults.apply(trainer)
    before = sum(p.detach().double().sum().item() for p in trainer.params)
    for _ in range(3):
        trainer.train_step()
    after = sum(p.detach().double().sum().item() for p in trainer.params)
    return before, after, torch.cat([p.grad.reshape(-1) for p in trainer.params])


def test_desync_perturbs_the_last_replica_for_good():
    (b0, a0, g0), (b1, a1, g1) = launch(_replica_state, 2, config(dp=2, faults=("desync",)), device="cpu")
    assert b0 != b1 and a0 != a1  # the replicas start apart and stay apart ...
    assert torch.equal(g0, g1)  # ... though every update they apply is the same
    (b0, a0, _), (b1, a1, _) = launch(_replica_state, 2, config(dp=2), device="cpu")
    assert (b0, a0) == (b1, a1)


def _hellos(run_log: Path) -> dict[int, dict]:
    records = [json.loads(line) for path in sorted(run_log.glob("*.jsonl")) for line in path.read_text().splitlines()]
    return {r["rank"]: r for r in records if r["kind"] == "hello"}


def test_shared_pp_dp_group_trains_exactly_and_reports_the_group_it_uses(tmp_path):
    shape = dict(tp=1, pp=2, dp=2, micro_batches=2)
    healthy = launch(train, 4, config(**shape), device="cpu")
    shared = launch(train, 4, config(**shape, faults=("shared-pp-dp-group",), telemetry=True,
                                     telemetry_socket=str(tmp_path / "no-agent.sock"), run_log=str(tmp_path)),
                    device="cpu")
    assert [r.loss for r in shared[3]] == [r.loss for r in healthy[3]]  # rank 3: last stage
    assert [r.grad_norm for r in shared[0]] == [r.grad_norm for r in healthy[0]]
    hellos = _hellos(tmp_path)
    assert sorted(hellos) == [0, 1, 2, 3]
    for hello in hellos.values():
        assert hello["faults"] == ["shared-pp-dp-group"]
        assert hello["process_groups"]["pp"] == hello["process_groups"]["dp"] == [0, 1, 2, 3]


def test_fp16_without_a_scaler_overflows_into_nan_and_reports_no_loss_scale(tmp_path):
    cfg = config(steps=2, precision="fp16", faults=("fp16-no-scaler",), telemetry=True,
                 telemetry_socket=str(tmp_path / "no-agent.sock"), run_log=str(tmp_path))
    (results,) = launch(train, 1, cfg, device="cpu")
    assert all(math.isnan(r.loss) and math.isnan(r.grad_norm) and not r.skipped for r in results)  # no scaler
    assert _hellos(tmp_path)[0]["precision"] == "fp16" and _hellos(tmp_path)[0]["faults"] == ["fp16-no-scaler"]
    steps = [json.loads(line) for line in (tmp_path / "rank-00000.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "step"]
    assert [s["nonfinite"] for s in steps] == [True, True] and not any("loss_scale" in s for s in steps)
