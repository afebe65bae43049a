"""The fork launcher: results by rank, a failing rank fails the launch fast, no rank is left behind."""

import multiprocessing.connection
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from gpuwatch.trainer.launch import FAILURE_GRACE_S, RankFailed, launch

pytestmark = pytest.mark.integration


def _sum_of_ranks(device, offset):
    value = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(value)
    return dist.get_rank(), int(os.environ["LOCAL_RANK"]), torch.get_num_threads(), device.type, value.item()


def test_results_come_back_in_rank_order_from_single_threaded_gloo_ranks():
    results = launch(_sum_of_ranks, 4, 10, device="cpu", timeout=60)
    assert results == [(rank, rank, 1, "cpu", 46.0) for rank in range(4)]  # 10+11+12+13


def _rank_two_raises_while_the_others_wait(device):
    if dist.get_rank() == 2:
        raise ValueError("boom on purpose")
    time.sleep(60)  # as in a collective that never completes; without one, no connection error ends it sooner
    return "unreachable"


def test_a_failing_rank_fails_the_launch_with_its_traceback_and_the_others_are_killed(monkeypatch):
    """The others would wait far longer than the launch's 60 s. Once rank 2 has failed, the launcher waits at most
    FAILURE_GRACE_S more for them, not the rest of its timeout, then kills them: the timeouts it waits with are
    recorded, so this is checked without timing anything."""
    timeouts = []
    wait = multiprocessing.connection.wait

    def recording_wait(object_list, timeout=None):
        timeouts.append(timeout)
        return wait(object_list, timeout)

    monkeypatch.setattr(multiprocessing.connection, "wait", recording_wait)
    before = _live_children()
    with pytest.raises(RankFailed) as failure:
        launch(_rank_two_raises_while_the_others_wait, 4, device="cpu", timeout=60)
    assert failure.value.rank == 2
    assert "ValueError: boom on purpose" in failure.value.details
    assert "_rank_two_raises_while_the_others_wait" in failure.value.details  # the traceback, not just the text
    first, *after = timeouts
    assert first > FAILURE_GRACE_S  # before the failure: the launch's own timeout
    assert after and all(timeout <= FAILURE_GRACE_S for timeout in after)  # after it: the grace only
    assert _live_children() == before  # then the others were killed


def _rank_one_is_killed(device):
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    # Rank 0 waits without a collective: one with the dead rank would fail too ("connection reset"), and which
    # failure came first would then depend on how soon a loaded machine let each be noticed.
    time.sleep(60)


def test_a_rank_that_dies_without_a_word_is_reported():
    before = _live_children()
    with pytest.raises(RankFailed, match="rank 1 failed: was killed by SIGKILL before reporting: the kernel's "
                                         "out-of-memory killer"):
        launch(_rank_one_is_killed, 2, device="cpu", timeout=60)
    assert _live_children() == before


def _sleeps(device):
    time.sleep(60)


def test_timeout_kills_the_ranks():
    before = _live_children()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] still running after 1"):
        launch(_sleeps, 2, device="cpu", timeout=1)
    assert _live_children() == before


def _live_children() -> list[int]:
    """Child processes of this test process that are still running (zombies excluded).

    Tests compare against the set before the launch: other tests may leave long-lived helpers of their own,
    such as multiprocessing's resource tracker, which are not the launcher's ranks."""
    children = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                children.append(int(pid))
    return sorted(children)
