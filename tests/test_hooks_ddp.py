"""A plain DistributedDataParallel script (examples/ddp_train.py), not the reference trainer, instrumented
through the public API: its ranks' core signals reach a real agent and its run log. By default DDP keeps its
C++ all-reduce (no Python communication hook): the hooks time the tail of each backward that waits for it and,
on measuring steps, compare each rank's own gradient with DDP's average; `bucket_hook=True` times every bucket
as well. Either way, the cosine and the gradient norm equal what the script computes beside DDP, and a missing
cosine says why."""

import contextlib
import importlib.util
import itertools
import time
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
#: How late rank 1 enters each all-reduce in `_ddp_steps`.
RANK_1_LATE_SECONDS = 0.05


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
    # DDP's all-reduce stays DDP's own (no communication hook): no per-call latencies, but its volume, the cosine
    # of every measuring step (every 2nd here), and the time the backward waited for it, measured on every step
    assert not by_rank(text, "gpuwatch_train_collective_seconds_count", "ddp-example")
    assert all(-1 <= value <= 1 for value in series("gpuwatch_train_grad_cosine_similarity").values())
    assert set(series("gpuwatch_train_gradient_sync_bytes").values()) == {
        4 * sum(p.numel() for p in _example().TinyLM(vocab=256, width=64, depth=2).parameters())}
    assert all(value >= 0 for value in series("gpuwatch_train_window_median_seconds",
                                              timing="exposed_collective_seconds").values())
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
            # the backward runs in the compute phase, whose waiting for DDP's all-reduce is taken out of it
            assert 0 < record["exposed_collective_seconds"] <= record["step_seconds"] - record["compute_seconds"]
            assert "collectives" not in record
            assert "unavailable" not in record
            assert ("grad_cosine_similarity" in record) == (record["step"] % 2 == 0)


def _ddp_steps(device, steps: int, run_log: Path, zero_gradient: bool, bucket_hook: bool,
               micro_batches: int = 1, bucket_view: bool = False, signals=hooks.SIGNALS,
               rank_1_late: bool = False) -> dict:
    """A DDP linear model, a few SGD steps reporting the loss only, each over `micro_batches` (all but the last
    under `no_sync`, as gradient accumulation does). Per step, as the script sees them itself: the norm of the
    averaged gradient DDP left in .grad, and the cosine between this rank's own gradient (taken beside DDP, with
    `torch.autograd.grad` on the bare module) and that average; then the communication hooks DDP was given.
    With `zero_gradient`, cross-entropy over a single logit: the loss and every gradient are zero. `bucket_view`:
    DDP's `gradient_as_bucket_view` (the gradients are views of the buckets it averages in place). `rank_1_late`:
    rank 1 starts each step's reduced backward only once rank 0 has entered DDP's all-reduce (its `progress` says
    so, after it marked the end of its computation), and RANK_1_LATE_SECONDS later: rank 0 then waits at least
    that long in every step by causality, however loaded the machine."""
    torch.manual_seed(0)
    classes = 1 if zero_gradient else 3
    model = DistributedDataParallel(torch.nn.Linear(4, classes), gradient_as_bucket_view=bucket_view)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = hooks.Monitor(model, job="ddp-gradients", run_log=run_log, grad_similarity_every=2, checksum_every=2,
                            bucket_hook=bucket_hook, signals=signals)
    rank = torch.distributed.get_rank()
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))  # each rank its own data
    targets = torch.randint(classes, (8,), generator=torch.Generator().manual_seed(rank))
    if rank_1_late and rank == 0:
        _tell_when_in_the_all_reduce(monitor.progress, run_log)
    norms, cosines = [], []
    for index in range(steps):
        with monitor.step(samples=len(inputs)) as step:
            own = torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
            with step.compute():
                for micro in range(micro_batches):
                    rows = slice(micro * 8 // micro_batches, (micro + 1) * 8 // micro_batches)
                    own_loss = F.cross_entropy(model.module(inputs[rows]), targets[rows])
                    own += torch.cat([g.reshape(-1) for g in torch.autograd.grad(
                        own_loss, list(model.module.parameters()))]).double()
                    with contextlib.nullcontext() if micro == micro_batches - 1 else model.no_sync():
                        loss = F.cross_entropy(model(inputs[rows]), targets[rows])
                        if rank == 1 and micro == micro_batches - 1:  # the backward DDP reduces
                            if rank_1_late:
                                _wait_for_file(run_log / f"rank-0-in-all-reduce-{index + 1}")
                            time.sleep(RANK_1_LATE_SECONDS)  # rank 0 waits for it in the all-reduce: a tail
                        loss.backward()
            mean = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
            norms.append(mean.norm().item())
            cosines.append((own @ mean / (own.norm() * mean.norm())).item() if norms[-1] > 0 else None)
            with step.optimizer():
                optimizer.step()
                optimizer.zero_grad()
            step.report(loss=loss.detach())
    comm_hooks = [hook.__name__ for hook, _ in model._comm_hooks]
    monitor.close()
    return {"norms": norms, "cosines": cosines, "comm_hooks": comm_hooks, "failures": dict(monitor.failures.counts)}


def _tell_when_in_the_all_reduce(progress, directory: Path) -> None:
    """Have `progress` touch ``rank-0-in-all-reduce-<n>`` in `directory` as the training thread enters its n-th
    collective (DDP's all-reduce: the hooks marked the end of the computation just before). `Progress` has slots,
    so the object's class is swapped for a subclass with the same layout rather than its method replaced."""
    count = itertools.count(1)

    class Telling(type(progress)):
        __slots__ = ()

        def at(self, phase, collective=None):
            super().at(phase, collective)
            if phase == "collective":
                (directory / f"rank-0-in-all-reduce-{next(count)}").touch()

    progress.__class__ = Telling


def _wait_for_file(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.001)


@pytest.mark.parametrize(("micro_batches", "bucket_view"), [(1, False), (2, False), (1, True), (2, True)])
def test_by_default_ddp_gets_no_communication_hook_the_wait_for_its_all_reduce_is_timed_and_the_cosine_taken(
        tmp_path, monkeypatch, micro_batches, bucket_view):
    monkeypatch.setenv("GPUWATCH_SOCKET", str(tmp_path / "no-agent.sock"))
    ranks = launch(_ddp_steps, 2, 4, tmp_path, False, False, micro_batches, bucket_view, hooks.SIGNALS, True,
                   device="cpu", timeout=120)
    assert [result["comm_hooks"] for result in ranks] == [[], []]  # DDP's C++ all-reduce, untouched
    assert [result["failures"] for result in ranks] == [{}, {}]
    n_params = 4 * 3 + 3
    for rank, records in read_run_log(tmp_path).items():
        steps = records[1:]
        assert [r["step"] for r in steps] == [1, 2, 3, 4]
        for record in steps:
            assert "collectives" not in record  # per-call latencies need the bucket hook
            assert record["gradient_sync_bytes"] == 4 * n_params  # what DDP all-reduces: every fp32 gradient
            assert 0 < record["exposed_collective_seconds"] <= record["step_seconds"] - record["compute_seconds"]
        if rank == 0:  # rank 1 is late by RANK_1_LATE_SECONDS at every all-reduce: waiting, not computing
            assert all(r["exposed_collective_seconds"] >= RANK_1_LATE_SECONDS for r in steps)
        # the measuring steps: this rank's gradient (over all its micro-batches) against DDP's average, as the
        # script computes it beside DDP; the gradient norm is the average's
        assert ["grad_norm" in r for r in steps] == ["grad_cosine_similarity" in r for r in steps] == [
            False, True] * 2
        for record, norm, cosine in zip(steps[1::2], ranks[rank]["norms"][1::2], ranks[rank]["cosines"][1::2],
                                        strict=True):
            assert record["grad_norm"] == pytest.approx(norm, rel=1e-6) and norm > 0
            assert record["grad_cosine_similarity"] == pytest.approx(cosine, abs=1e-6) and cosine < 0.999
            assert "unavailable" not in record
        assert ["param_checksum" in r for r in steps] == [False, True] * 2


def test_without_the_collectives_signal_the_cosine_is_still_taken_on_measuring_steps_and_no_tail_is_timed(
        tmp_path, monkeypatch):
    monkeypatch.setenv("GPUWATCH_SOCKET", str(tmp_path / "no-agent.sock"))
    ranks = launch(_ddp_steps, 2, 4, tmp_path, False, False, 2, False, hooks.SIGNALS - {"collectives"},
                   device="cpu", timeout=120)
    assert [result["failures"] for result in ranks] == [{}, {}]
    for rank, records in read_run_log(tmp_path).items():
        steps = records[1:]
        assert not any("exposed_collective_seconds" in r or "gradient_sync_bytes" in r for r in steps)
        assert ["grad_cosine_similarity" in r for r in steps] == [False, True] * 2
        for record, cosine in zip(steps[1::2], ranks[rank]["cosines"][1::2], strict=True):
            assert record["grad_cosine_similarity"] == pytest.approx(cosine, abs=1e-6) and cosine < 0.999


def test_the_bucket_hook_times_every_bucket_and_measures_the_cosine_and_gradient_norm(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUWATCH_SOCKET", str(tmp_path / "no-agent.sock"))
    ranks = launch(_ddp_steps, 2, 4, tmp_path, False, True, device="cpu", timeout=120)
    assert [result["comm_hooks"] for result in ranks] == [["gpuwatch_comm_hook"]] * 2
    n_params = 4 * 3 + 3
    for rank, records in read_run_log(tmp_path).items():
        steps = records[1:]
        for record in steps:
            all_reduce = record["collectives"]["all_reduce"]  # one bucket: the whole gradient, every step
            assert (all_reduce["count"], all_reduce["bytes"], sum(all_reduce["buckets"])) == (1, 4 * n_params, 1)
            assert "gradient_sync_bytes" not in record  # the calls carry their bytes
            assert 0 <= record["exposed_collective_seconds"] <= record["step_seconds"] - record["compute_seconds"]
        assert ["grad_norm" in r for r in steps] == ["grad_cosine_similarity" in r for r in steps] == [
            False, True, False, True]
        for record, norm, cosine in zip(steps[1::2], ranks[rank]["norms"][1::2], ranks[rank]["cosines"][1::2],
                                        strict=True):
            assert record["grad_norm"] == pytest.approx(norm, rel=1e-6) and norm > 0  # |ḡ|, the mean's norm
            assert record["grad_cosine_similarity"] == pytest.approx(cosine, abs=1e-6) and cosine < 0.999
            assert "unavailable" not in record


@pytest.mark.parametrize("bucket_hook", [True, False])
def test_a_zero_gradient_has_a_zero_gradient_norm_and_no_cosine_and_says_why(tmp_path, monkeypatch, bucket_hook):
    monkeypatch.setenv("GPUWATCH_SOCKET", str(tmp_path / "no-agent.sock"))
    ranks = launch(_ddp_steps, 2, 4, tmp_path, True, bucket_hook, device="cpu", timeout=120)
    assert set(ranks[0]["norms"] + ranks[1]["norms"]) == {0.0}
    for records in read_run_log(tmp_path).values():
        steps = records[1:]
        assert [r.get("unavailable") for r in steps] == [None, {"grad_cosine_similarity": "zero_gradient"}] * 2
        assert [r.get("grad_norm") for r in steps] == [None, 0.0] * 2
        assert all(r["loss"] == 0.0 and "grad_cosine_similarity" not in r for r in steps)
        assert ["param_checksum" in r for r in steps] == [False, True] * 2


def _parameters_after(device, run_log: Path, reduce: str) -> list[str]:
    """A DDP model's parameters (float.hex) after a few SGD steps, each rank on its own data: DDP's own C++
    all-reduce ("native"), under `Monitor(bucket_hook=True)` ("bucket_hook") or PyTorch's Python default hook
    (`default_hooks.allreduce_hook`, "python_default")."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(37, 300), torch.nn.ReLU(),
                                                        torch.nn.Linear(300, 5)))
    monitor = hooks.Monitor(model, job=f"ddp-{reduce}", run_log=run_log, bucket_hook=True) \
        if reduce == "bucket_hook" else None
    if reduce == "python_default":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(4):
        with monitor.step() if monitor is not None else contextlib.nullcontext():
            model(torch.randn(64, 37, generator=generator)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    if monitor is not None:
        monitor.close()
    return [x.hex() for x in torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()]


def test_the_bucket_hook_reduces_bit_for_bit_as_ddps_own_all_reduce_over_three_ranks(tmp_path):
    """DDP's reducer multiplies each gradient by 1/world size, where PyTorch's Python default hook divides: over 3
    ranks the two differ in the last bits. gpuwatch's hook (which gpuwatch run registers on every DDP model) does as
    the reducer does: the parameters are bit for bit those of DDP unmeasured."""
    results = {reduce: launch(_parameters_after, 3, tmp_path, reduce, device="cpu", timeout=120)
               for reduce in ("native", "bucket_hook", "python_default")}
    assert results["bucket_hook"] == results["native"]
    assert results["python_default"] != results["native"]  # the test tells the two apart
