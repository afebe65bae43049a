"""PipelineClock's bubble, proven exactly: two real gloo ranks exchange the real end marker, while each stage's
clock is scripted (`ManualClock`) to an ideal GPipe schedule. The figures are then what the schedule says, on any
machine under any load; tests/test_hooks_trainer.py checks the same fields on a real run, by structure only."""

import pytest
import torch.distributed as dist
from hooks_helpers import ManualClock

from gpuwatch.trainer.hooks import PipelineClock, theoretical_bubble
from gpuwatch.trainer.hooks.safety import Failures
from gpuwatch.trainer.launch import launch

from conftest import wait_until

#: One micro-batch's forward and backward pass, in scripted seconds (a backward costs about two forwards).
FORWARD, BACKWARD = 1.0, 2.0


def gpipe_passes(stage: int, micro_batches: int) -> list[tuple[float, float]]:
    """(start, end) of each pass of `stage` (0 or 1) in a balanced two-stage GPipe schedule starting at 0: every
    forward, stage 1 one slot behind stage 0, then every backward, stage 0 one slot behind stage 1."""
    forwards = [((i + stage) * FORWARD, (i + stage + 1) * FORWARD) for i in range(micro_batches)]
    backwards_start = (micro_batches + 1) * FORWARD + (1 - stage) * BACKWARD
    backwards = [(backwards_start + i * BACKWARD, backwards_start + (i + 1) * BACKWARD) for i in range(micro_batches)]
    return forwards + backwards


def schedule_end(micro_batches: int) -> float:
    """The end of stage 0's last backward: the schedule's last operation anywhere in the pipeline."""
    return gpipe_passes(0, micro_batches)[-1][1]


def _scripted_stage(device, micro_batches: int):
    """One stage of the scripted schedule. Stage 1 calls `stop` as its last pass ends, then its clock moves to
    the schedule's end before stage 0 may send the marker (the barrier): its window must close at the marker's
    arrival, not at its own `stop`."""
    stage = dist.get_rank()
    clock, failures = ManualClock(now=0.0), Failures()
    pipeline = PipelineClock(clock, failures, dist.group.WORLD, micro_batches, device)
    pipeline.start()
    for start, end in gpipe_passes(stage, micro_batches):
        clock.now = start
        with pipeline.busy():
            clock.now = end
    ready_before_the_marker = None
    if stage == 0:
        dist.barrier()
        pipeline.stop()
    else:
        pipeline.stop()
        ready_before_the_marker = pipeline.ready()
        clock.now = schedule_end(micro_batches)
        dist.barrier()
    wait_until(pipeline.ready, timeout=30, what="the end marker")
    return ready_before_the_marker, pipeline.result(), dict(failures.counts)


@pytest.mark.parametrize("micro_batches", [1, 8])
def test_a_balanced_gpipe_schedule_measures_exactly_its_theoretical_bubble_on_every_stage(micro_batches):
    """Both windows run from 0 to stage 0's last backward; each stage is busy m·(F + B) of (m + 1)·(F + B)."""
    first, last = launch(_scripted_stage, 2, micro_batches, device="cpu", timeout=60)
    busy = micro_batches * (FORWARD + BACKWARD)
    window = schedule_end(micro_batches)
    assert window == (micro_batches + 1) * (FORWARD + BACKWARD)
    for _, result, failures in (first, last):
        assert failures == {}
        assert result == {"busy_seconds": busy, "idle_seconds": window - busy, "bubble_ratio": (window - busy) / window,
                          "bubble_ratio_theoretical": theoretical_bubble(2, micro_batches)}
        assert result["bubble_ratio"] == theoretical_bubble(2, micro_batches) == 1 / (micro_batches + 1)
    assert last[0] is False  # stage 1's window stays open until the marker comes

