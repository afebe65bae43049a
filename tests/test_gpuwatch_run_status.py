"""`gpuwatch run`'s end-of-run line: instrumenting nothing is never silent.

Every process under `gpuwatch run` notes how far its instrumentation got (gpuwatch.trainer.auto.status); when the
command ends, `gpuwatch run` prints one line on stderr: the ranks measured of those started and their steps, and,
where fewer were measured or none, the reason. The summary is tested on hand-made events, then each reason on real
processes: `python -I/-E/-S`, a command that is no Python, an interpreter that cannot import gpuwatch, torch never
imported, torch without a process group, a process group without a forward or an optimizer step, an exception in the
instrumentation, and torchrun jobs (gloo, CPU) measured whole and in part. No test looks at a timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import foreign
import pytest
from foreign import GPUWATCH_RUN

from gpuwatch.cli.run import _ignored_by, read_status, summary
from gpuwatch.trainer.auto import instrumented_environment, status

PYTHON = os.path.basename(sys.executable)
#: The reason a run with no process group gives.
NO_PROCESS_GROUP = ("imported torch but made no process group: gpuwatch measures distributed jobs "
                    "(torch.distributed.init_process_group)")


# -- the summary, on hand-made events ------------------------------------------------------------------------------

def _launcher(nproc: str | None = "2") -> list[dict[str, Any]]:
    """torchrun's launcher's "site" event, started with `--nproc-per-node nproc` (none given: None)."""
    options = ["--nproc-per-node", nproc] if nproc is not None else []
    return [{"event": "site", "argv": [PYTHON, "/usr/bin/torchrun", "--standalone", *options, "train.py"],
             "launcher": True}]


def _rank(rank: int, *, world_size: int = 2, upto: str = "closed", steps: int = 10) -> list[dict[str, Any]]:
    """A rank's events, as far as `upto` ("site", "instrumented", "process_group", "monitor", "step", "closed")."""
    events = [{"event": "site", "argv": [PYTHON, "-u", "train.py"], "launcher": False}, {"event": "instrumented"},
              {"event": "process_group", "rank": rank, "world_size": world_size},
              {"event": "monitor", "rank": rank, "framework": "plain"}, {"event": "step", "rank": rank, "step": 1},
              {"event": "closed", "rank": rank, "steps": steps}]
    return events[:[event["event"] for event in events].index(upto) + 1]


def _failure(where: str, error: str) -> dict[str, Any]:
    return {"event": "failure", "where": where, "error": error}


@pytest.mark.parametrize(("processes", "line"), [
    ([_launcher(), _rank(0), _rank(1)], "2 of 2 ranks measured, 10 steps each"),
    ([_launcher("1"), _rank(0, world_size=1, steps=1)], "1 of 1 rank measured, 1 step"),
    ([_rank(0, world_size=1, steps=3)], "1 of 1 rank measured, 3 steps"),
    ([_launcher(None), _rank(0, world_size=1)], "1 of 1 rank measured, 10 steps"),  # torchrun's default: 1
    ([_launcher(), _rank(0, steps=8), _rank(1)], "2 of 2 ranks measured, 8 to 10 steps"),
    ([_launcher(), _rank(0, upto="step"), _rank(1)], "2 of 2 ranks measured"),  # rank 0 never closed: no count
    ([_launcher(), _rank(2, world_size=4), _rank(3, world_size=4)],
     "2 of 2 ranks measured on this machine, of a world of 4, 10 steps each"),
    # a spawned helper (a DataLoader worker) that imported torch is no rank: nothing is missing
    ([_launcher(), _rank(0), _rank(1), _rank(0, upto="instrumented")], "2 of 2 ranks measured, 10 steps each"),
])
def test_a_run_measured_whole_says_how_many_ranks_and_steps(processes, line):
    assert summary(processes, ["torchrun", "train.py"]) == line


@pytest.mark.parametrize(("processes", "line"), [
    ([], "nothing measured: no Python process loaded gpuwatch's start-up code: the command started none, or ran "
         "it with -I, -E or -S"),
    ([_launcher()], "0 of 2 ranks measured: 2 ranks never loaded gpuwatch's start-up code"),
    ([_launcher("auto")], "nothing measured: torchrun's ranks never loaded gpuwatch's start-up code"),
    ([_rank(0, upto="site")], "nothing measured: 1 Python process never imported torch"),
    ([_rank(0, upto="site"), _rank(0, upto="site")], "nothing measured: 2 Python processes never imported torch"),
    ([_rank(0, upto="site"), _rank(0, upto="instrumented")],  # the furthest a process got is the reason
     f"nothing measured: 1 process {NO_PROCESS_GROUP}"),
    ([_launcher(), _rank(0), _rank(1, upto="process_group")],
     "1 of 2 ranks measured, 10 steps: rank 1 ran no training forward"),
    ([_launcher("4"), _rank(0, world_size=4, upto="process_group"), _rank(1, world_size=4, upto="process_group"),
      _rank(3, world_size=4, upto="monitor"), _rank(2, world_size=4)],
     "1 of 4 ranks measured, 10 steps: ranks 0-1 ran no training forward; rank 3 ran no optimizer step"),
    ([_launcher(), _rank(0), _rank(1, upto="instrumented")],
     f"1 of 2 ranks measured, 10 steps: 1 process {NO_PROCESS_GROUP}"),
    ([_launcher(), _rank(0)], "1 of 2 ranks measured, 10 steps: 1 rank never loaded gpuwatch's start-up code"),
    ([[{"event": "site", "argv": [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node=3", "train.py"],
        "launcher": True}], _rank(0, world_size=3)],
     "1 of 3 ranks measured, 10 steps: 2 ranks never loaded gpuwatch's start-up code"),
])
def test_a_run_measured_in_part_or_not_at_all_says_why(processes, line):
    assert summary(processes, ["torchrun", "train.py"]) == line


def test_an_exception_inside_gpuwatch_is_named_whether_or_not_ranks_were_measured():
    planted = _failure("AutoMonitor._timer", "RuntimeError: planted\nTraceback: more lines")
    other = _failure("AutoMonitor.backward", "ValueError: another")
    processes = [_launcher(), [*_rank(0), planted], [*_rank(1), planted, other]]
    assert summary(processes, ["torchrun"]) == ("2 of 2 ranks measured, 10 steps each: AutoMonitor._timer raised "
                                                "RuntimeError: planted (in 2 processes, 1 other failure)")
    # a rank whose step went unrecorded for a failure is not said to have made none
    stepped_unrecorded = [*_rank(1, upto="monitor"), _failure("AutoMonitor.step", "RuntimeError: planted")]
    assert summary([_launcher(), _rank(0), stepped_unrecorded], ["torchrun"]) == \
        "1 of 2 ranks measured, 10 steps: AutoMonitor.step raised RuntimeError: planted"
    # an instrumentation that failed before torch was hooked is the reason, not "never imported torch"
    failed = [*_rank(0, upto="site"), _failure("instrumenting torch", "ImportError: no hooks")]
    assert summary([failed], ["python3"]) == "nothing measured: instrumenting torch raised ImportError: no hooks"
    unimportable = [_failure("importing gpuwatch in /venv/bin/python", "ModuleNotFoundError: No module named 'x'")]
    assert summary([unimportable], ["python3"]) == ("nothing measured: importing gpuwatch in /venv/bin/python raised "
                                                    "ModuleNotFoundError: No module named 'x'")


@pytest.mark.parametrize(("command", "flag"), [
    ([PYTHON, "-I", "train.py"], "-I"),
    (["/usr/bin/python3.12", "-uS", "train.py"], "-S"),
    (["python", "-X", "importtime", "-W", "ignore", "-E", "-c", "pass"], "-E"),
    (["python3", "-Wignore", "-bI", "train.py"], "-I"),
    (["python3", "-c", "-I"], None),  # -c's code
    (["python3", "-mIS"], None),  # -m's module
    (["python3", "train.py", "-I"], None),  # the script's option
    (["python3", "-X", "-I", "train.py"], None),  # -X's value
    (["bash", "-I"], None),
    (["torchrun", "-I"], None),
])
def test_an_interpreter_option_that_skips_gpuwatch_is_found_in_the_command_line(command, flag):
    found = _ignored_by(command)
    assert (found.split()[1] if found is not None else None) == flag, found
    if found is not None:
        assert found.startswith(os.path.basename(command[0]))


def test_the_status_directory_is_read_one_process_per_start_and_a_torn_line_is_skipped(tmp_path):
    (tmp_path / "100.jsonl").write_text(
        '{"event": "site", "launcher": false}\n{"event": "instrumented"}\n'
        '{"event": "site", "launcher": false}\n{"event": "proc')  # pid 100 given twice; the second killed mid-line
    (tmp_path / "101.jsonl").write_text('{"event": "process_group", "rank": 0, "world_size": 1}\n[1]\n')
    (tmp_path / "notes.txt").write_text("not an event file\n")
    assert [[event["event"] for event in events] for events in read_status(tmp_path)] == \
        [["site", "instrumented"], ["site"], ["process_group"]]


def test_a_note_is_one_json_line_per_event_and_nothing_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(status.STATUS_VARIABLE, raising=False)
    status.note("site", launcher=False)
    monkeypatch.setenv(status.STATUS_VARIABLE, str(tmp_path))
    status.note("step", rank=3, step=1)
    status.note("failure", where="here", error=ValueError("not JSON"))
    (path,) = tmp_path.iterdir()
    assert path.name == f"{os.getpid()}.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [{k: v for k, v in event.items() if k != "time"} for event in events] == [
        {"event": "step", "pid": os.getpid(), "rank": 3, "step": 1},
        {"event": "failure", "pid": os.getpid(), "where": "here", "error": "not JSON"}]
    monkeypatch.setenv(status.STATUS_VARIABLE, str(tmp_path / "gone"))  # gpuwatch run ended before this process
    status.note("closed", rank=3, steps=1)
    assert not (tmp_path / "gone").exists()


def test_the_commands_environment_names_the_status_directory():
    assert instrumented_environment({}, status="/tmp/run", new_job="j")[status.STATUS_VARIABLE] == "/tmp/run"
    assert status.STATUS_VARIABLE not in instrumented_environment({}, new_job="j")


# -- each reason, on real processes --------------------------------------------------------------------------------

#: A process group of one rank, made in the process (no launcher, no network).
PROCESS_GROUP = ("import torch, torch.distributed as dist\n"
                 "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
                 "model = torch.nn.Linear(4, 1)\n"
                 "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n")
#: A tiny model's forward and backward.
FORWARD = "model(torch.ones(2, 4)).sum().backward()\n"
#: Three optimizer steps, then the process group's end.
TRAIN = ("for _ in range(3):\n"
         "    model(torch.ones(2, 4)).sum().backward()\n"
         "    optimizer.step()\n"
         "    optimizer.zero_grad()\n"
         "dist.destroy_process_group()\n")


def _run(*command: str, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """`gpuwatch run -- COMMAND`: its exit status and the lines on stderr, whose last is the end-of-run line."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith("GPUWATCH_")}
    result = subprocess.run([*GPUWATCH_RUN, *command], capture_output=True, text=True, timeout=foreign.RUN_TIMEOUT_S,
                            env={**clean, **(env or {})})
    lines = result.stderr.splitlines()
    assert lines and lines[-1].startswith("gpuwatch run: "), result.stderr[-4000:]
    return result.returncode, lines


@pytest.mark.integration
@pytest.mark.parametrize(("flag", "why"), [("-I", "ignores PYTHONPATH"), ("-E", "ignores PYTHONPATH"),
                                           ("-S", "skips sitecustomize")])
def test_an_interpreter_that_skips_gpuwatch_is_named_up_front_and_at_the_end(flag, why):
    status_code, lines = _run(sys.executable, flag, "-c", "raise SystemExit(4)")
    assert status_code == 4  # the command's own
    reason = f"{PYTHON} {flag} {why}"
    assert lines[0].startswith(f"gpuwatch run: {reason}") and lines[0].endswith(": it runs unmeasured"), lines
    assert lines[-1].startswith(f"gpuwatch run: nothing measured: {reason}") and len(lines) == 2, lines


@pytest.mark.integration
def test_a_command_that_is_no_python_is_said_to_have_loaded_nothing():
    assert _run("true") == (0, ["gpuwatch run: nothing measured: no Python process loaded gpuwatch's start-up code: "
                                "the command started none, or ran it with -I, -E or -S"])


@pytest.mark.integration
def test_an_interpreter_that_cannot_import_gpuwatch_is_named_with_its_error(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=120)
    python = str(tmp_path / "venv" / "bin" / "python")
    _, lines = _run(python, "-c", "pass", env={"PYTHONPATH": ""})
    assert lines[-1] == (f"gpuwatch run: nothing measured: importing gpuwatch in {python} raised "
                         "ModuleNotFoundError: No module named 'gpuwatch'"), lines


@pytest.mark.integration
@pytest.mark.parametrize(("code", "line"), [
    ("import json", "nothing measured: 1 Python process never imported torch"),
    ("import torch", f"nothing measured: 1 process {NO_PROCESS_GROUP}"),
    (PROCESS_GROUP, "0 of 1 rank measured: rank 0 ran no training forward"),
    (PROCESS_GROUP + FORWARD, "0 of 1 rank measured: rank 0 ran no optimizer step"),
    (PROCESS_GROUP + TRAIN, "1 of 1 rank measured, 3 steps"),
    ("import sys\nsys.modules['gpuwatch.trainer.auto.instrument'] = None\n" + PROCESS_GROUP + TRAIN,
     "nothing measured: instrumenting torch raised ModuleNotFoundError: import of "
     "gpuwatch.trainer.auto.instrument halted; None in sys.modules"),
    ("import torch\n"  # instrumented as torch is imported
     "from gpuwatch.trainer.auto import instrument\n"
     "def planted(losses): raise RuntimeError('planted in the injected code')\n"
     "instrument._total = planted\n" + PROCESS_GROUP + TRAIN,
     "0 of 1 rank measured: AutoMonitor._after_optimizer_step raised RuntimeError: planted in the injected code"),
])
def test_each_place_a_process_stops_is_the_reason_given(code, line):
    assert _run(sys.executable, "-c", code)[1][-1] == f"gpuwatch run: {line}"


#: Under torchrun: every rank makes the process group, only rank 0 trains.
RANK_0_TRAINS = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.integration
@pytest.mark.parametrize(("script", "line"), [
    ((str(foreign.WORKLOADS / "plain_ddp.py"), "--steps", "5"), "2 of 2 ranks measured, 5 steps each"),
    (None, "1 of 2 ranks measured, 3 steps: rank 1 ran no training forward"),
])
def test_a_torchrun_job_counts_the_ranks_its_launcher_started(tmp_path, script, line):
    """The unmodified DDP script, measured whole; and a job whose rank 1 never trains, measured in part."""
    if script is None:
        script = (str(tmp_path / "rank_0_trains.py"),)
        Path(script[0]).write_text(RANK_0_TRAINS)
    status_code, lines = _run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              *script)
    assert (status_code, lines[-1]) == (0, f"gpuwatch run: {line}"), lines
