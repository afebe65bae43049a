"""The training thread's progress and the watchdog that reports it while a step is overdue: injected clocks, so
the verdicts are the decisions themselves, never the machine's speed."""

from __future__ import annotations

import threading

import torch

from gpuwatch.protocol.schema import decode, encode
from gpuwatch.trainer import hooks
from gpuwatch.trainer.hooks import progress as progress_module
from gpuwatch.trainer.hooks.progress import InFlight, Progress, Watchdog, error_record


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watchdog(progress: Progress, clock: Clock) -> Watchdog:
    return Watchdog(progress, lambda record: None, "job", 3, threading.get_ident(), clock=clock, wall=lambda: 1.0)


def test_silent_while_steps_flow_then_a_valid_record_once_overdue_by_the_jobs_own_rhythm():
    clock = Clock()
    progress = Progress(clock)
    watchdog = _watchdog(progress, clock)
    clock.now += progress_module.STARTUP_SECONDS - 1
    assert watchdog.check() is None  # before MIN_STEPS steps: the start-up allowance
    progress.durations.extend([2.0, 2.0, 2.0])  # a 2 s rhythm: overdue after 5 x 2 s
    assert watchdog.overdue_seconds() == 10.0
    progress.since, progress.step, progress.phase = clock.now, 7, "collective"
    progress.collective = InFlight("all_reduce", "dp", 4, 1, 12, 4096, clock.now)
    clock.now += 9.9
    assert watchdog.check() is None
    clock.now += 0.2
    record = watchdog.check()
    body = decode(encode(record)).body.as_dict()  # what the agent takes
    assert (body["step"], body["phase"], body["overdue_seconds"]) == (7, "collective", 10.0)
    assert body["collective"] == {"op": "all_reduce", "group": "dp", "group_size": 4, "group_rank": 1, "seq": 12,
                                  "bytes": 4096, "seconds": body["stalled_seconds"]}
    # stalled past STACK_AFTER_SECONDS: this thread's own stack, innermost last, this test's function in it
    assert body["stack"][-1]["function"] in ("check", "thread_stack") or any(
        frame["function"] == "test_silent_while_steps_flow_then_a_valid_record_once_overdue_by_the_jobs_own_rhythm"
        for frame in body["stack"])


def test_on_a_gpu_a_collective_the_host_has_left_is_in_flight_until_the_device_passes_its_mark():
    """NCCL queues a collective and the host goes on; if the device hangs in it, the host stops later, elsewhere
    (here in the data phase): the watchdog still names the collective, asking the device without waiting."""
    clock = Clock()
    progress = Progress(clock)
    passed: set[str] = set()
    progress.device_done = lambda mark: mark in passed  # as CudaClock.ready: an event's query()
    watchdog = _watchdog(progress, clock)
    progress.durations.extend([1.0] * 3)
    all_reduce = InFlight("all_reduce", "dp", 4, 1, 12, 4096, clock.now)
    progress.on_device = (all_reduce, "event after the all-reduce")
    progress.phase, progress.collective, progress.since = "data", None, clock.now  # the host left the collective
    clock.now += 30
    record = watchdog.check()
    assert record is not None and record["phase"] == "data"
    assert (record["collective"]["op"], record["collective"]["seq"]) == ("all_reduce", 12)
    passed.add("event after the all-reduce")  # the device finished it: the host is stuck elsewhere
    assert "collective" not in watchdog.check()
    progress.device_done = lambda mark: 1 / 0  # a device that cannot be asked tells nothing
    passed.clear()
    assert "collective" not in watchdog.check()


def test_the_floor_keeps_a_fast_job_from_being_overdue_at_once():
    clock = Clock()
    progress = Progress(clock)
    progress.durations.extend([0.001] * 5)
    assert _watchdog(progress, clock).overdue_seconds() == progress_module.OVERDUE_FLOOR_SECONDS


def test_an_error_record_names_the_exception_and_passes_the_schema():
    record = error_record("job", 0, Progress(), RuntimeError("boom " * 200))
    body = decode(encode(record)).body.as_dict()
    assert body["error"]["type"] == "RuntimeError" and body["error"]["message"].startswith("boom")


def test_the_monitor_tracks_phases_collectives_per_group_and_steps(monkeypatch):
    sent = []

    class Client:
        def send(self, record):
            sent.append(record)

        def submit(self, build):
            pass

        def close(self):
            pass

    monitor = hooks.Monitor(torch.nn.Linear(2, 2), job="j", client=Client())
    seen = []
    with monitor.step() as step, step.compute():
        seen.append(monitor.progress.phase)
        with monitor.collective("all_reduce", 8):
            inflight = monitor.progress.collective
            seen.append((monitor.progress.phase, inflight.group, inflight.seq))
        with monitor.collective("all_reduce", 8):
            seen.append(monitor.progress.collective.seq)
        seen.append((monitor.progress.phase, monitor.progress.collective))
    seen.append((monitor.progress.phase, monitor.progress.step))
    try:
        with monitor.step():
            raise ValueError("a bad batch")
    except ValueError:
        pass
    monitor.close()
    assert seen == ["compute", ("collective", "default", 1), 2, ("compute", None), ("idle", 1)]
    errors = [r for r in sent if r["kind"] == "progress"]
    assert [r["error"] for r in errors] == [{"type": "ValueError", "message": "a bad batch"}]
