"""The hooks in one process: what a step record holds, that it meets the schema, and that the hooks never
raise into the training loop. Multi-process behaviour is in test_hooks_trainer.py and test_hooks_ddp.py."""

import json
import logging
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from hooks_helpers import ManualClock

from gpuwatch.cli.main import main
from gpuwatch.protocol.schema import COLLECTIVE_BUCKETS, decode, encode
from gpuwatch.trainer import hooks
from gpuwatch.trainer.hooks import cpu_times, memory
from gpuwatch.trainer.hooks import monitor as monitor_module
from gpuwatch.trainer.hooks.collectives import Call, by_group, by_phase, exposed_seconds
from gpuwatch.trainer.hooks.gradients import similarity_of
from gpuwatch.trainer.hooks.identity import hello_record


class Records:
    """Stands in for the TelemetryClient: keeps what the monitor sends, checked against the agent's schema.
    Submitted records are built at `close`, after every step: a record that read state of a later step
    would show it."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.submitted: list = []
        self.closed = False

    def send(self, record: dict) -> None:
        decode(encode(record))  # raises RecordRejected: the agent would drop it
        self.sent.append(record)

    def submit(self, build) -> None:
        self.submitted.append(build)

    def close(self) -> None:
        for build in self.submitted:
            record = build()
            if record is not None:
                self.send(record)
        self.closed = True

    def steps(self) -> list[dict]:
        return [record for record in self.sent if record["kind"] == "step"]


@pytest.fixture
def records() -> Records:
    return Records()


@pytest.fixture
def clock(monkeypatch) -> ManualClock:
    """The clock every Monitor of the test measures with: phases last what the test advances it by."""
    manual = ManualClock()
    monkeypatch.setattr(monitor_module, "clock_for", lambda device: manual)
    return manual


def _monitor(records: Records, model: torch.nn.Module | None = None, **options) -> hooks.Monitor:
    return hooks.Monitor(torch.nn.Linear(4, 4) if model is None else model, job="unit", client=records, **options)


def test_a_step_record_times_each_phase_and_takes_collective_waits_out_of_compute(records, clock):
    monitor = _monitor(records, flops_per_token=1e6, peak_flops_per_second=1e12)
    with monitor.step(tokens=4096, samples=8) as step:
        with step.data():
            clock.advance(0.01)
        with step.compute():
            clock.advance(0.02)
            with monitor.collective("all_reduce", 1 << 20):
                clock.advance(0.03)
        with monitor.collective("barrier", 0):  # outside any phase: waited for all the same
            clock.advance(0.001)
        with step.optimizer():
            clock.advance(0.005)
        step.report(loss=torch.tensor(2.5), grad_norm=1.5, lr=1e-3, loss_scale=1024.0)
    monitor.close()

    assert records.closed
    hello, record, closed = records.sent
    assert closed["kind"] == "progress" and closed["phase"] == "closed"
    assert hello["kind"] == "hello" and hello["job"] == record["job"] == "unit"
    assert "backends" not in hello  # torch.distributed is not initialised here
    assert record["dataloader_wait_seconds"] == pytest.approx(0.01)
    assert record["compute_seconds"] == pytest.approx(0.02)  # 0.05 had the all-reduce's 0.03 s stayed in
    assert record["optimizer_seconds"] == pytest.approx(0.005)
    assert record["step_seconds"] == pytest.approx(0.066)
    assert record["exposed_collective_seconds"] == pytest.approx(0.031)  # the all-reduce and the barrier
    all_reduce = record["collectives"]["all_reduce"]
    assert (all_reduce["count"], all_reduce["bytes"]) == (1, 1 << 20)
    assert all_reduce["seconds"] == pytest.approx(0.03)
    assert all_reduce["buckets"][COLLECTIVE_BUCKETS.index(0.05)] == 1  # le 0.05: after 0.02, before 0.1
    assert all_reduce["buckets"][COLLECTIVE_BUCKETS.index(0.02)] == 0
    assert (record["loss"], record["grad_norm"], record["lr"], record["loss_scale"]) == (2.5, 1.5, 1e-3, 1024.0)
    assert record["nonfinite"] is False
    assert (record["tokens"], record["samples"]) == (4096, 8)
    assert record["model_flops_per_second"] == pytest.approx(1e6 * 4096 / 0.066)
    assert record["mfu"] == pytest.approx(1e6 * 4096 / 0.066 / 1e12)
    assert "memory" not in record and "unavailable" not in record  # nothing was due on step 1
    assert not monitor.failures.counts


def test_a_step_without_collectives_has_no_exposed_time_and_samples_only_when_given(records):
    monitor = _monitor(records)
    with monitor.step(samples=3):
        pass
    with monitor.step(tokens=5):
        pass
    monitor.close()
    first, second = records.steps()
    assert first["samples"] == 3 and "tokens" not in first
    assert second["tokens"] == 5 and "samples" not in second
    assert not any("exposed_collective_seconds" in r or "collectives" in r for r in (first, second))


def test_exposed_collective_time_is_blocking_calls_whole_and_the_overlapped_tail_of_each_phase():
    calls = [
        Call("all_reduce", 8, 10.0, blocking=False, phase="compute", end=10.5, group="dp"),  # hidden behind compute
        Call("all_reduce", 8, 10.2, blocking=False, phase="compute", end=10.9, group="dp"),  # last launch: 10.2-11.0
        Call("send", 4, 11.5, blocking=True, phase="optimizer", end=11.6, group="pp"),
        Call("barrier", 0, 12.0, blocking=True, phase=None, end=12.25),
        Call("all_reduce", 8, 12.5, blocking=False, phase=None, end=12.6),  # no phase end to measure against
    ]
    for call in calls:
        call.seconds = call.end - call.start
    waited = exposed_seconds(calls, {"compute": 11.0, "optimizer": 11.7}, ManualClock())
    assert by_phase(waited) == pytest.approx({"compute": 0.8, "optimizer": 0.1, None: 0.25})
    groups = by_group(calls, waited)  # the barrier and the last all-reduce name no group
    assert groups == {"dp": {"bytes": 16, "seconds": pytest.approx(0.8)},
                      "pp": {"bytes": 4, "seconds": pytest.approx(0.1)}}


def test_data_wrapper_times_the_wait_for_each_batch_as_part_of_the_step_it_feeds(records, clock):
    def slow_loader():
        for batch in range(3):
            clock.advance(0.02 * (batch + 1))
            yield batch

    with _monitor(records) as monitor:  # closes the monitor, sending what is pending
        for batch in monitor.data(slow_loader()):
            with monitor.step(tokens=batch + 1):
                clock.advance(0.01)
    assert records.closed
    steps = records.steps()
    assert [(r["step"], r["tokens"]) for r in steps] == [(1, 1), (2, 2), (3, 3)]
    assert [r["dataloader_wait_seconds"] for r in steps] == pytest.approx([0.02, 0.04, 0.06])
    assert [r["step_seconds"] for r in steps] == pytest.approx([0.03, 0.05, 0.07])  # the step starts with its wait


def test_nonfinite_loss_is_flagged_and_sent_as_data(records):
    monitor = _monitor(records)
    with monitor.step() as step:
        step.report(loss=torch.tensor(float("nan")), grad_norm=float("inf"))
    monitor.close()
    (record,) = records.steps()
    assert math.isnan(record["loss"]) and record["grad_norm"] == math.inf
    assert record["nonfinite"] is True


def test_memory_is_read_every_n_steps_its_peak_covering_every_step_since_the_last_reading(records):
    """A reading's peak is the peak since the previous one (reset as it is read): the spike of a step between two
    readings shows in the next, and is gone from the one after."""
    monitor = _monitor(records, memory_every=2)
    for number in range(1, 5):
        with monitor.step():
            if number == 1:
                big = torch.ones(64 << 20)  # 256 MiB, every page touched, on a step that reads nothing
                del big
    monitor.close()
    readings = [record.get("memory") for record in records.steps()]
    assert readings[0] is None and readings[2] is None
    first, second = readings[1], readings[3]
    assert first["kind"] == second["kind"] == "host_rss"
    assert first["peak_bytes"] - second["peak_bytes"] > 200 << 20
    with _monitor(records, memory_every=0) as never:
        assert never.memory is None  # never read: nothing opened


def _rusage(*readings_kib: int):
    """Stands in for the resource module: ru_maxrss reads these values in turn, then the last again."""
    values = list(readings_kib)
    return SimpleNamespace(RUSAGE_THREAD=1, getrusage=lambda who: SimpleNamespace(
        ru_maxrss=values.pop(0) if len(values) > 1 else values[0]))


def test_peak_rss_comes_from_getrusage_above_its_exec_floor_and_from_proc_status_below(monkeypatch):
    """ru_maxrss never reads below the peak of the process that exec'd this one (a launcher): at or below what
    it read right after the first reset, only /proc/self/status tells the step's peak."""
    monkeypatch.setattr(memory, "resource", _rusage(1 << 40))  # a floor far above anything real
    below = memory.HostMemory()
    peak = below.read()["peak_bytes"]
    assert 10 << 20 < peak < 1 << 40  # from status, not the floor
    below.close()
    monkeypatch.setattr(memory, "resource", _rusage(1000, 5_000_000))  # the floor, then a step's peak above it
    above = memory.HostMemory()
    assert above.read() == {"kind": "host_rss", "peak_bytes": 5_000_000 * 1024}
    above.close()


def test_status_is_read_only_while_a_reading_might_be_the_floor(monkeypatch):
    """With no floor above the process's own peaks (a forked rank), status confirms a reading once and the bound
    drops beneath it: later readings at that level or above are taken as they are, a new low is checked again.
    Where status shows less than the reading, the reading was the floor: the bound stays."""
    status_peaks: list[int] = []
    monkeypatch.setattr(memory.os, "pread", lambda fd, size, offset: b"VmHWM:\t %d kB\n" % status_peaks.pop(0))
    monkeypatch.setattr(memory, "resource", _rusage(1000, 1000, 3000, 1000, 3000, 990))
    host = memory.HostMemory()  # the bound: 1000, read just after the first reset
    status_peaks.extend([1000, 990])
    assert [host.read()["peak_bytes"] // 1024 for _ in range(5)] == [1000, 3000, 1000, 3000, 990]
    assert status_peaks == []  # read for the first 1000 and for 990 only
    monkeypatch.setattr(memory, "resource", _rusage(5000, 5000, 5000))  # a launcher's floor of 5000
    floored = memory.HostMemory()
    status_peaks.extend([1200, 1300])
    assert [floored.read()["peak_bytes"] // 1024 for _ in range(2)] == [1200, 1300]  # status each time
    assert status_peaks == []
    host.close()
    floored.close()


@pytest.mark.parametrize("target", ["runs", "logs/run.jsonl"])
@pytest.mark.parametrize("given", ["argument", "environment"])
def test_run_log_keeps_every_record_in_a_file_per_rank_or_in_one_file(tmp_path, monkeypatch, target, given):
    monkeypatch.setenv("GPUWATCH_SOCKET", str(tmp_path / "no-agent.sock"))  # every send fails: the log has it all
    monkeypatch.delenv("GPUWATCH_RUN_LOG", raising=False)
    path = tmp_path / target
    if given == "environment":
        monkeypatch.setenv("GPUWATCH_RUN_LOG", str(path))
    monitor = hooks.Monitor(torch.nn.Linear(4, 4), job="logged", run_log=path if given == "argument" else None)
    for _ in range(3):
        with monitor.step(samples=2):
            pass
    monitor.close()
    log = path / "rank-00000.jsonl" if path.suffix != ".jsonl" else path
    logged = [decode(line).body.as_dict() for line in log.read_bytes().splitlines()]
    assert [(r["kind"], r.get("step"), r.get("samples")) for r in logged] == [
        ("hello", None, None), ("step", 1, 2), ("step", 2, 2), ("step", 3, 2), ("progress", 3, None)]
    assert logged[-1]["phase"] == "closed"  # the rank ended its training: its exit is no death
    assert monitor.client.drops["no_agent"] == 5


def test_a_client_of_ones_own_takes_no_run_log_or_socket_from_the_monitor(records, tmp_path):
    with pytest.raises(ValueError, match="give them to yours"):
        hooks.Monitor(job="unit", client=records, run_log=tmp_path)


def test_checksum_and_similarity_come_every_n_steps_only(records):
    monitor = _monitor(records, checksum_every=2, grad_similarity_every=3)
    for _ in range(6):
        with monitor.step():
            pass
    monitor.close()
    assert ["param_checksum" in record for record in records.steps()] == [False, True, False, True, False, True]
    # one process is not data parallel: no gradient to compare, no cosine, and the measuring steps say why
    why = {"grad_cosine_similarity": "no_data_parallel_group", "grad_norm": "no_gradient_seen"}
    assert [record.get("unavailable") for record in records.steps()] == [None, None, why, None, None, why]


def _train(monitor: hooks.Monitor, model: torch.nn.Module, steps: int, targets: torch.Tensor,
           optimizer_phase: bool = True) -> list[torch.Tensor]:
    """A few plain SGD steps on a fixed batch; the gradient norm of each step, as the optimizer saw it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, norms = torch.randn(len(targets), 4, generator=torch.Generator().manual_seed(0)), []
    for _ in range(steps):
        with monitor.step(samples=len(inputs)) as step:
            with step.compute():
                loss = torch.nn.functional.cross_entropy(model(inputs), targets)
                loss.backward()
            norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
            with step.optimizer() if optimizer_phase else hooks.OFF:
                optimizer.step()
                optimizer.zero_grad()
            step.report(loss=loss.detach())
    monitor.close()
    return norms


def test_without_data_parallelism_the_gradient_norm_comes_from_grad_on_measuring_steps(records):
    model = torch.nn.Linear(4, 3)
    norms = _train(_monitor(records, model, grad_similarity_every=2), model, 4, torch.tensor([0, 1, 2, 1]))
    steps = records.steps()
    assert ["grad_norm" in record for record in steps] == [False, True, False, True]
    for record, norm in zip(steps[1::2], norms[1::2], strict=True):
        assert record["grad_norm"] == pytest.approx(norm.item(), rel=1e-6) and norm > 0
        assert record["unavailable"] == {"grad_cosine_similarity": "no_data_parallel_group"}
        assert record["nonfinite"] is False


def test_a_model_with_zero_gradients_reports_a_zero_gradient_norm(records):
    """Cross-entropy over a single logit: the loss is 0 whatever the weights, and so is every gradient."""
    model = torch.nn.Linear(4, 1)
    _train(_monitor(records, model, grad_similarity_every=2), model, 2, torch.zeros(4, dtype=torch.long))
    record = records.steps()[1]
    assert (record["loss"], record["grad_norm"]) == (0.0, 0.0)
    assert record["unavailable"] == {"grad_cosine_similarity": "no_data_parallel_group"}


def test_without_an_optimizer_phase_the_gradient_norm_is_unavailable_and_without_a_model_the_checksum(records):
    model = torch.nn.Linear(4, 3)
    _train(_monitor(records, model, grad_similarity_every=1), model, 1, torch.tensor([0, 1]), optimizer_phase=False)
    (record,) = records.steps()
    assert record["unavailable"] == {"grad_cosine_similarity": "no_data_parallel_group",
                                     "grad_norm": "no_gradient_seen"}
    bare = Records()
    monitor = hooks.Monitor(None, job="unit", client=bare, checksum_every=1, grad_similarity_every=0)
    with monitor.step():
        pass
    monitor.close()
    (record,) = bare.steps()
    assert record["unavailable"] == {"param_checksum": "no_parameters"} and "param_checksum" not in record


def test_similarity_says_why_it_has_no_cosine():
    assert similarity_of([0.5, 1.0, 1.0, 3.0]) == (0.5, None)
    assert similarity_of([0.0, 0.0, 0.0, 0.0]) == (None, "no_gradient_seen")
    assert similarity_of([math.nan] * 4) == (None, "no_gradient_seen")  # the hooks failed on a shard
    assert similarity_of([math.nan, math.inf, 1.0, 2.0]) == (None, "nonfinite_gradient")
    assert similarity_of([0.0, 0.0, 4.0, 2.0]) == (None, "zero_gradient")  # this rank's gradient is zero
    assert similarity_of([0.0, 4.0, 0.0, 2.0]) == (None, "zero_gradient")  # the mean is
    assert similarity_of([1e300, 1e300, 1e300, 1.0]) == (1.0, None)  # large norms do not overflow


def test_a_failing_hook_is_counted_and_logged_once_while_training_goes_on(records, caplog):
    monitor = _monitor(records, memory_every=1)

    def broken() -> dict:
        raise OSError("no /proc here")

    monitor.memory.read = broken
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
    sums = similarity.reduce().tolist()
    assert sums[3] == len(range(0, 10_000, 777))  # the pieces seen
    cosine = hooks.cosine(*sums[:3])
    expected = torch.nn.functional.cosine_similarity(local.double(), mean.double(), dim=0).item()
    assert cosine == pytest.approx(expected, abs=1e-6)
    assert 0.5 < cosine < 0.9  # two independent halves: ~0.71, not a degenerate 1
    assert hooks.cosine(0.0, 0.0, 4.0) is None
    assert hooks.cosine(math.nan, 1.0, 1.0) is None
    assert hooks.cosine(1.0 + 1e-12, 1.0, 1.0) == 1.0  # rounding never leaves [-1, 1]


def test_parameter_checksum_is_deterministic_and_sees_a_one_ulp_change():
    params = [torch.randn(300, 200, generator=torch.Generator().manual_seed(1)), torch.randn(200)]
    replica = [p.clone() for p in params]
    assert hooks.parameter_checksum(params) == hooks.parameter_checksum(replica)
    replica[0][17, 3] = torch.nextafter(replica[0][17, 3], torch.tensor(math.inf))
    assert hooks.parameter_checksum(params) != hooks.parameter_checksum(replica)
    assert hooks.parameter_checksum(params[::-1]) != hooks.parameter_checksum(params)  # weighted


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


def test_hello_carries_layout_groups_and_only_allowlisted_environment(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_IB_TOKEN_SECRET", "leak")
    monkeypatch.setenv("HOME_SECRET", "leak")
    layout = hooks.Layout(rank=5, world_size=8, local_rank=5, tp_size=2, pp_size=2, dp_size=2, tp_rank=1,
                          pp_stage=1, dp_rank=0, schedule="1f1b", micro_batches=4, precision="bf16",
                          process_groups={"tp": (4, 5), "pp": (1, 5), "dp": (5, 7), "huge": tuple(range(600))})
    record = hello_record("job-1", layout, torch.device("cpu"))
    body = decode(encode(record)).body.as_dict()
    assert (body["rank"], body["tp_rank"], body["pp_stage"], body["dp_rank"]) == (5, 1, 1, 0)
    assert body["process_groups"] == {"tp": [4, 5], "pp": [1, 5], "dp": [5, 7]}  # 600 members would not fit
    assert "faults" not in body  # a Monitor's `hello=` adds them (test_hello_fields_join_...)
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


def test_hello_fields_join_the_hello_and_one_the_schema_refuses_is_refused_at_once(records):
    hooks.Monitor(torch.nn.Linear(2, 2), job="chaos", client=records, hello={"faults": ["slow-rank"]}).close()
    assert [r["faults"] for r in records.sent if r["kind"] == "hello"] == [["slow-rank"]]
    with pytest.raises(ValueError, match="invalid hello"):
        hooks.Monitor(torch.nn.Linear(2, 2), job="chaos", client=Records(), hello={"faults": "slow-rank"})
    with pytest.raises(ValueError, match="kind or version"):
        hooks.Monitor(torch.nn.Linear(2, 2), job="chaos", client=Records(), hello={"kind": "step"})


def test_a_steps_sums_and_norms_become_one_checksum_and_one_norm_from_the_host_or_the_device():
    """On a GPU the per-parameter sums and gradient norms come back with the device's values (a list, or a number
    for a one-parameter model) rather than as host tensors: they must make the same checksum and norm."""
    from gpuwatch.trainer.hooks.gradient_stats import combine_measured
    from gpuwatch.trainer.hooks.gradients import checksum_of, norm_of

    from_device = {"param_sums": [1.5, -2.0, 3.25], "grad_norms": [3.0, 4.0], "loss": 2.0}
    combine_measured(from_device)
    assert from_device == {"param_checksum": checksum_of([1.5, -2.0, 3.25]), "grad_norm_of_grads": norm_of([3.0, 4.0]),
                           "loss": 2.0}
    one_parameter = {"param_sums": 1.5, "grad_norms": 5.0}
    combine_measured(one_parameter)
    assert one_parameter == {"param_checksum": checksum_of([1.5]), "grad_norm_of_grads": 5.0}


def test_a_steps_wait_for_a_cpu_is_the_threads_run_queue_delay_from_its_start_to_its_end(records, clock,
                                                                                          monkeypatch, tmp_path):
    """``cpu_seconds`` and ``cpu_wait_seconds``: the first two fields of the thread's schedstat (ns) at the step's end
    less at its start, at most the step; the reader is the kernel's file (``cpu_times.open_reader``), given here
    readings of its layout."""
    readings = iter([b"100 1000000000 5\n", b"900 1250000000 9\n", b"900 1250000000 9\n", b"999 9000000000 12\n"])
    descriptor = os.open(os.devnull, os.O_RDONLY)
    monkeypatch.setattr(monitor_module, "open_reader", lambda: (lambda: next(readings), descriptor))
    monitor = _monitor(records)
    for seconds in (0.5, 0.5):
        with monitor.step():
            clock.advance(seconds)
    monitor.close()
    first, second = records.steps()
    assert (first["cpu_seconds"], first["cpu_wait_seconds"]) == (pytest.approx(800e-9), pytest.approx(0.25))
    assert second["cpu_wait_seconds"] == 0.5  # 7.75 s of readings in a 0.5 s step: never more than the step
    with pytest.raises(OSError):  # the Monitor closed the file with itself
        os.close(descriptor)


def test_the_reader_is_none_where_the_kernel_keeps_no_schedstat(tmp_path):
    assert cpu_times.open_reader(str(tmp_path / "missing")) is None
    (tmp_path / "other").write_text("not the layout\n")
    assert cpu_times.open_reader(str(tmp_path / "other")) is None
    read, descriptor = cpu_times.open_reader()  # this kernel's own (Linux: CI and every supported node)
    try:
        ran, waited = cpu_times.thread_seconds(read(), read())
        assert ran >= 0 and waited >= 0
    finally:
        os.close(descriptor)


def test_a_step_that_shares_its_cpu_with_a_busy_process_waits_for_it(records):
    """The real kernel: the training thread and a spinning process pinned to one CPU take turns on it, so a step of
    0.2 s of the thread's own CPU time waits on the run queue while the other runs (CFS gives each about half). Not
    a timing threshold: the wait is there because the CPU is shared, whatever the machine's speed."""
    cpu = min(os.sched_getaffinity(0))
    allowed = os.sched_getaffinity(0)
    spinner = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}}); print(1, "
                                                      "flush=True)\nwhile True: pass"], stdout=subprocess.PIPE)
    try:
        assert spinner.stdout.readline() == b"1\n"
        os.sched_setaffinity(0, {cpu})  # this (the training) thread only
        monitor = _monitor(records)
        with monitor.step():
            started = time.thread_time()
            while time.thread_time() - started < 0.2:
                pass
        monitor.close()
    finally:
        os.sched_setaffinity(0, allowed)
        spinner.kill()
        spinner.wait()
    (record,) = records.steps()
    assert 0.05 < record["cpu_wait_seconds"] <= record["step_seconds"], record
    assert record["cpu_seconds"] >= 0.2, record  # the thread's own 0.2 s, which schedstat counts as thread_time does
