"""The hooks in one process: what a step record holds, that it meets the schema, and that the hooks never
raise into the training loop. Multi-process behaviour is in test_hooks_trainer.py and test_hooks_ddp.py."""

import json
import logging
import math
import time

import pytest
import torch
from click.testing import CliRunner

from gpuwatch.agent.cli import main
from gpuwatch.agent.telemetry.schema import COLLECTIVE_BUCKETS, decode, encode
from gpuwatch.trainer import hooks
from gpuwatch.trainer.hooks.identity import hello_record


class Records:
    """Stands in for the TelemetryClient: keeps what the monitor sends, checked against the agent's schema."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.closed = False

    def send(self, record: dict) -> None:
        decode(encode(record))  # raises RecordRejected: the agent would drop it
        self.sent.append(record)

    def close(self) -> None:
        self.closed = True

    def steps(self) -> list[dict]:
        return [record for record in self.sent if record["kind"] == "step"]


@pytest.fixture
def records() -> Records:
    return Records()


def _monitor(records: Records, **options) -> hooks.Monitor:
    return hooks.Monitor(torch.nn.Linear(4, 4), job="unit", client=records, **options)


def test_a_step_record_times_each_phase_and_takes_collective_waits_out_of_compute(records):
    monitor = _monitor(records, flops_per_token=1e6, peak_flops_per_second=1e12)
    with monitor.step(tokens=4096) as step:
        with step.data():
            time.sleep(0.01)
        with step.compute():
            time.sleep(0.02)
            with monitor.collective("all_reduce", 1 << 20):
                time.sleep(0.03)
        with step.optimizer():
            time.sleep(0.005)
        step.report(loss=torch.tensor(2.5), grad_norm=1.5, lr=1e-3, loss_scale=1024.0)
    monitor.close()

    assert records.closed
    hello, record = records.sent
    assert hello["kind"] == "hello" and hello["job"] == record["job"] == "unit"
    assert 0.01 <= record["dataloader_wait_seconds"] < 0.03
    assert 0.02 <= record["compute_seconds"] < 0.045  # 0.05 had the all-reduce's 0.03 s stayed in
    assert 0.005 <= record["optimizer_seconds"] < 0.025
    assert record["step_seconds"] >= 0.065
    all_reduce = record["collectives"]["all_reduce"]
    assert (all_reduce["count"], all_reduce["bytes"]) == (1, 1 << 20)
    assert 0.03 <= all_reduce["seconds"] < 0.05
    assert all_reduce["buckets"][COLLECTIVE_BUCKETS.index(0.05)] == 1  # le 0.05: after 0.02, before 0.1
    assert (record["loss"], record["grad_norm"], record["lr"], record["loss_scale"]) == (2.5, 1.5, 1e-3, 1024.0)
    assert record["nonfinite"] is False
    assert record["tokens"] == 4096
    assert record["model_flops_per_second"] == pytest.approx(1e6 * 4096 / record["step_seconds"])
    assert record["mfu"] == pytest.approx(record["model_flops_per_second"] / 1e12)
    assert record["memory"]["kind"] == "host_rss" and record["memory"]["peak_bytes"] > 10 << 20
    assert not monitor.failures.counts


def test_data_wrapper_times_the_wait_for_each_batch_as_part_of_the_step_it_feeds(records):
    def slow_loader():
        for batch in range(3):
            time.sleep(0.02)
            yield batch

    with _monitor(records) as monitor:  # closes the monitor, sending what is pending
        for batch in monitor.data(slow_loader()):
            with monitor.step(tokens=batch + 1):
                pass
    assert records.closed
    steps = records.steps()
    assert [(r["step"], r["tokens"]) for r in steps] == [(1, 1), (2, 2), (3, 3)]
    for record in steps:
        assert 0.02 <= record["dataloader_wait_seconds"] <= record["step_seconds"]


def test_nonfinite_loss_is_flagged_and_sent_as_data(records):
    monitor = _monitor(records)
    with monitor.step() as step:
        step.report(loss=torch.tensor(float("nan")), grad_norm=float("inf"))
    monitor.close()
    (record,) = records.steps()
    assert math.isnan(record["loss"]) and record["grad_norm"] == math.inf
    assert record["nonfinite"] is True


def test_peak_host_rss_is_per_step(records):
    monitor = _monitor(records)
    with monitor.step():
        big = torch.ones(64 << 20)  # 256 MiB, every page touched
        del big
    with monitor.step():
        pass
    monitor.close()
    first, second = (record["memory"] for record in records.steps())
    assert first["kind"] == second["kind"] == "host_rss"
    assert first["peak_bytes"] - second["peak_bytes"] > 200 << 20  # the peak was reset between the steps


def test_checksum_and_similarity_come_every_n_steps_only(records):
    monitor = _monitor(records, checksum_every=2)
    for _ in range(4):
        with monitor.step():
            pass
    monitor.close()
    assert ["param_checksum" in record for record in records.steps()] == [False, True, False, True]
    # one process is not data parallel: no gradient to compare, no cosine
    assert not any("grad_cosine_similarity" in record for record in records.steps())


def test_a_failing_hook_is_counted_and_logged_once_while_training_goes_on(records, caplog):
    monitor = _monitor(records)

    def broken() -> dict:
        raise OSError("no /proc here")

    monitor._memory.read = broken
    with caplog.at_level(logging.WARNING, logger="gpuwatch.trainer.hooks"):
        for _ in range(3):
            with monitor.step() as step, step.compute():
                pass
    monitor.close()
    assert len(records.steps()) == 3  # the records still go out, without memory
    assert not any("memory" in record for record in records.steps())
    assert monitor.failures.counts == {"Monitor._read_memory": 3}
    assert [r.message for r in caplog.records].count(
        "gpuwatch hooks: Monitor._read_memory failed (training goes on; further failures here are only counted)") == 1


def test_the_training_codes_own_exceptions_pass_through_untouched(records):
    monitor = _monitor(records)
    with pytest.raises(ZeroDivisionError), monitor.step() as step, step.compute():
        1 / 0  # noqa: B018
    with monitor.step():
        pass
    monitor.close()
    assert [record["step"] for record in records.steps()] == [2]  # the failed step sends nothing
    assert not monitor.failures.counts


def test_off_stands_in_for_a_step_a_phase_and_a_pipeline_clock():
    with hooks.OFF as step, step.compute(), step.pipeline_clock(None, 4).busy():
        step.report(loss=1.0)
    assert hooks.OFF.similarity is None


def test_gradient_cosine_similarity_is_exact_over_pieces_and_undefined_for_a_zero_gradient():
    generator = torch.Generator().manual_seed(0)
    local, other = torch.randn(10_000, generator=generator), torch.randn(10_000, generator=generator)
    mean = (local + other) / 2
    similarity = hooks.GradientSimilarity(torch.device("cpu"))
    for piece_local, piece_mean in zip(local.split(777), mean.split(777), strict=True):  # tensor by tensor
        similarity.observe(piece_local.view(-1, 1), piece_mean)
    cosine = hooks.cosine(*similarity.reduce().tolist())
    expected = torch.nn.functional.cosine_similarity(local.double(), mean.double(), dim=0).item()
    assert cosine == pytest.approx(expected, abs=1e-6)
    assert 0.5 < cosine < 0.9  # two independent halves: ~0.71, not a degenerate 1
    assert hooks.cosine(0.0, 0.0, 4.0) is None
    assert hooks.cosine(math.nan, 1.0, 1.0) is None
    assert hooks.cosine(1.0 + 1e-12, 1.0, 1.0) == 1.0  # rounding never leaves [-1, 1]


def test_parameter_checksum_is_deterministic_and_sees_a_one_ulp_change():
    params = [torch.randn(300, 200, generator=torch.Generator().manual_seed(1)), torch.randn(200)]
    replica = [p.clone() for p in params]
    assert hooks.parameter_checksum(params).item() == hooks.parameter_checksum(replica).item()
    replica[0][17, 3] = torch.nextafter(replica[0][17, 3], torch.tensor(math.inf))
    assert hooks.parameter_checksum(params).item() != hooks.parameter_checksum(replica).item()
    assert hooks.parameter_checksum(params[::-1]).item() != hooks.parameter_checksum(params).item()  # weighted


def test_model_flops_bubble_and_peaks():
    assert hooks.transformer_flops_per_token(1_000_000, 12, 768, 1024) == 6e6 + 12 * 12 * 768 * 1024
    assert hooks.theoretical_bubble(2, 1) == 0.5 and hooks.theoretical_bubble(4, 8) == 3 / 11
    assert hooks.peak_flops(torch.device("cpu")) is None
    names = dict(hooks.PEAK_FLOPS)
    assert names["A100"] == 312e12 and names["H100"] == names["H200"] == 989.5e12


def test_job_id_comes_from_the_flag_then_the_environment_then_is_generated():
    environ = {"SLURM_JOB_ID": "4711", "TORCHELASTIC_RUN_ID": "elastic-1"}
    assert hooks.resolve_job("my run/1", environ) == "my_run/1"  # made a valid label
    assert hooks.resolve_job(None, {**environ, "GPUWATCH_JOB": "from-env"}) == "from-env"
    assert hooks.resolve_job(None, environ) == "4711"
    assert hooks.resolve_job(None, {"TORCHELASTIC_RUN_ID": "elastic-1"}) == "elastic-1"
    generated = hooks.resolve_job(None, {"TORCHELASTIC_RUN_ID": "none"})  # torchrun's default means unset
    assert generated.startswith("gpuwatch-") and generated != hooks.resolve_job(None, {})


def test_hello_carries_layout_groups_faults_and_only_allowlisted_environment(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_IB_TOKEN_SECRET", "leak")
    monkeypatch.setenv("HOME_SECRET", "leak")
    layout = hooks.Layout(rank=5, world_size=8, local_rank=5, tp_size=2, pp_size=2, dp_size=2, tp_rank=1,
                          pp_stage=1, dp_rank=0, schedule="1f1b", micro_batches=4, precision="bf16",
                          process_groups={"tp": (4, 5), "pp": (1, 5), "dp": (5, 7), "huge": tuple(range(600))})
    record = hello_record("job-1", layout, torch.device("cpu"), ("duplicate-shards",))
    body = decode(encode(record)).body
    assert (body["rank"], body["tp_rank"], body["pp_stage"], body["dp_rank"]) == (5, 1, 1, 0)
    assert body["process_groups"] == {"tp": [4, 5], "pp": [1, 5], "dp": [5, 7]}  # 600 members would not fit
    assert body["faults"] == ["duplicate-shards"]
    assert body["env"]["NCCL_DEBUG"] == "INFO"
    assert "leak" not in json.dumps(record)
    assert "gpu" not in body and body["torch_version"] == torch.__version__


def test_gpuwatch_train_has_the_telemetry_options_and_checks_them():
    runner = CliRunner()
    help_text = runner.invoke(main, ["train", "--help"]).output
    for option in ("--telemetry / --no-telemetry", "--telemetry-socket", "--job", "--run-log",
                   "--grad-similarity-every", "--checksum-every", "--fault"):
        assert option in help_text
    no_telemetry = runner.invoke(main, ["train", "--no-telemetry", "--run-log", "logs"])
    assert no_telemetry.exit_code == 2 and "--run-log and --telemetry-socket need --telemetry" in no_telemetry.output
    bad_fault = runner.invoke(main, ["train", "--fault", "cosmic-rays"])
    assert bad_fault.exit_code == 2 and "duplicate-shards" in bad_fault.output
