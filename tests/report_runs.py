"""Run logs of real gloo runs of the reference trainer with planted faults, made once per test session, for
`gpuwatch report`'s tests (tests/test_report.py, tests/test_report_browser.py): a straggler (rank 2 of tp1 × pp2 ×
dp2 computes 8x slower), a pipeline left to idle (pp4 with one micro-batch: a 75 % bubble in theory), and a hang
(the last rank blocks before its all-reduce of step 4; the job is killed once its peers' run logs say whom they wait
for). `gpuwatch train` as test_e2e_faults.py and test_e2e_hangs.py run it, without an agent: the run log is the source.

tests/conftest.py makes them the session's fixtures (``straggler_log``, ``bubble_log``, ``hang_log``): defined there
once, each run is made once a session (in one xdist worker: conftest keeps their tests together), where a fixture
imported into each test module is that module's own and made again for each.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_e2e_hangs import _stop, _train

from gpuwatch.trainer.cli import train

from conftest import wait_until

STEPS = 10
STRAGGLER = 2  # of tp1 × pp2 × dp2: stage 1, whose peer is rank 3
HUNG = 3  # the last rank of tp1 × pp2 × dp2 (hang-rank's default --fault-rank)
#: Long enough for the hooks' watchdog (3 s floor, 5 × the median step) to write its peers' progress records.
HANG_TIMEOUT_S = 90.0
#: How long every rank must have been stalled in its last progress record: past HANG001's stall_seconds (5).
STALLED_S = 7.0


def finished_run(directory: Path, job: str, *args: str) -> Path:
    result = CliRunner().invoke(train, [*args, "--steps", str(STEPS), "--job", job, "--run-log", str(directory),
                                        "--telemetry-socket", str(directory / "no-agent.sock")])
    assert result.exit_code == 0, result.output
    return directory


def straggler_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return finished_run(tmp_path_factory.mktemp("straggler"), "straggler", "--tp", "1", "--pp", "2", "--dp", "2",
                        "--fault", "slow-rank", "--fault-rank", str(STRAGGLER))


def bubble_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return finished_run(tmp_path_factory.mktemp("bubble"), "bubble", "--tp", "1", "--pp", "4", "--dp", "1",
                        "--micro-batches", "1")


def _waiting(directory: Path) -> bool:
    """Every rank has written a progress record stalled past HANG001's 5 s (the others from inside a collective,
    the hung one with its stack)."""
    logs = {int(path.stem.split("-")[1]): path.read_text() for path in directory.glob("rank-*.jsonl")}
    if len(logs) != HUNG + 1:
        return False
    for rank, text in logs.items():
        # complete lines only: the rank may be writing its last one as it is read
        complete = text[:text.rfind("\n") + 1].splitlines()
        progress = [json.loads(line) for line in complete if '"kind":"progress"' in line]
        if not progress or progress[-1]["stalled_seconds"] < STALLED_S:
            return False
        if "collective" not in progress[-1] and rank != HUNG:
            return False
    return True


def hang_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hang")
    run_log = directory / "log"
    no_agent = types.SimpleNamespace(telemetry_socket=directory / "no-agent.sock")
    process = _train(no_agent, "hang", run_log, "--tp", "1", "--pp", "2", "--dp", "2", "--fault", "hang-rank",
                     "--fault-step", "4")
    try:
        wait_until(lambda: _waiting(run_log), timeout=HANG_TIMEOUT_S, what="the hung job's progress records")
    finally:
        _stop(process)
    return run_log
