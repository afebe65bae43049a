"""``gpuwatch run [OPTIONS] -- COMMAND…``: run a training command with every Python rank it starts instrumented,
without a line of it changed (gpuwatch.trainer.auto says how). Imports no torch: the wrapper only sets the
environment, starts the command, passes signals on, says in one line what was measured, and returns the command's
exit status.

That line (`summary`) is made from the events each process of the command noted in the run's status directory
(gpuwatch.trainer.auto.status): a job that was not measured, whole or in part, is never passed over in silence, and
the line says where its processes stopped, as far as they could tell."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import click

from gpuwatch.trainer.auto import instrumented_environment, is_launcher, parse_layout
from gpuwatch.trainer.telemetry import new_job_id

#: The signals passed on to the command: a scheduler's or a user's stop (SIGTERM, SIGINT, SIGHUP, SIGQUIT) and the
#: user signals some launchers use for checkpoints before preemption (Slurm's --signal).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--socket", "socket_path", help="The agent's telemetry socket (else GPUWATCH_SOCKET, else the "
              "agent's well-known places).")
@click.option("--job", help="The job id every rank reports (else GPUWATCH_JOB, a Slurm job id, or one made here).")
@click.option("--run-log", help="Also append every record here: a directory (rank-NNNNN.jsonl per rank) or a "
              ".jsonl file, for gpuwatch diagnose --run-log.")
@click.option("--layout", metavar="TP,PP,DP", help="The job's parallel sizes, ranks ordered TP fastest, then DP, "
              "then PP (Megatron's and torchtitan's default), where no framework tells them: diagnosis then compares "
              "data-parallel peers.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(socket_path: str | None, job: str | None, run_log: str | None, layout: str | None,
        command: Sequence[str]) -> None:
    """Run COMMAND (torchrun, srun, python ...) with every PyTorch rank it starts measured: steps, their
    compute, data wait and optimizer time, loss, learning rate, collectives, DDP's all-reduce, gradient
    cosine and norm, memory, and where a stuck rank stands. When COMMAND ends, one line on stderr counts the
    ranks measured and their steps; where fewer were measured than started, or none stepped, it says why
    (python -I, -E or -S; torch never imported; no process group, since only distributed jobs are measured;
    no training forward or optimizer step; an exception inside gpuwatch). Exits with COMMAND's status
    (128+N when a signal N ended it). Example: gpuwatch run -- torchrun --nproc-per-node 8 train.py"""
    if not command:
        click.echo("gpuwatch run: no command given (gpuwatch run [OPTIONS] -- COMMAND [ARGS]...)", err=True)
        sys.exit(2)
    if layout is not None:
        world = os.environ.get("WORLD_SIZE", "")
        try:
            parse_layout(layout, int(world) if world.isdigit() else None)
        except ValueError as error:
            click.echo(f"gpuwatch run: {error}", err=True)
            sys.exit(2)
    ignored = _ignored_by(command)
    if ignored is not None and not is_launcher(command):  # said now: a long job should not learn it at its end
        click.echo(f"gpuwatch run: {ignored}: it runs unmeasured", err=True)
    # The events' directory is private to the user (mkdtemp's 0700) and goes with the run; a process the command
    # left behind may still be writing to it, hence no error from its removal
    with tempfile.TemporaryDirectory(prefix="gpuwatch-run-", ignore_cleanup_errors=True) as status_directory:
        env = instrumented_environment(os.environ, socket_path=socket_path, job=job, run_log=run_log, layout=layout,
                                       status=status_directory, new_job=new_job_id())
        try:
            child = subprocess.Popen(list(command), env=env)
        except OSError as error:
            click.echo(f"gpuwatch run: cannot start {command[0]}: {error.strerror}", err=True)
            sys.exit(127 if isinstance(error, FileNotFoundError) else 126)
        for number in FORWARDED:
            signal.signal(number, lambda received, _frame: _forward(child, received))
        status = child.wait()
        click.echo(f"gpuwatch run: {summary(read_status(Path(status_directory)), command)}", err=True)
    sys.exit(128 - status if status < 0 else status)


def _forward(child: subprocess.Popen, received: int, _frame: FrameType | None = None) -> None:
    """Pass a signal on to the command, except a terminal's Ctrl-C (or Ctrl-\\): the terminal sent it to the whole
    foreground process group, the command included, and a second SIGINT would cut a launcher's own shutdown short."""
    if received in (signal.SIGINT, signal.SIGQUIT) and _in_terminal_foreground():
        return
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(received)


def _in_terminal_foreground() -> bool:
    """Whether this process's group is the foreground group of the terminal on stdin."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):  # no terminal, stdin closed or replaced
        return False


# -- the end-of-run line ------------------------------------------------------------------------------------------

#: A process's events, in the order it noted them (gpuwatch.trainer.auto.status).
Events = Sequence[Mapping[str, Any]]

#: An interpreter's name: python, python3, python3.12.
PYTHON = re.compile(r"python[0-9.]*")
#: The interpreter options that keep gpuwatch's sitecustomize from loading, and why.
IGNORING = {"I": "ignores PYTHONPATH, which holds gpuwatch's start-up code",
            "E": "ignores PYTHONPATH, which holds gpuwatch's start-up code",
            "S": "skips sitecustomize, gpuwatch's start-up code"}
#: The most characters of an exception's text the line quotes.
ERROR_CHARS = 200


def read_status(directory: Path) -> list[list[dict[str, Any]]]:
    """The events of each process from the run's status directory (one `<pid>.jsonl` per process id). A file holds
    several processes where the system gave one id twice: each starts with its "site" event. A line that is not a
    JSON object (a process killed in the middle of its write) is skipped."""
    processes: list[list[dict[str, Any]]] = []
    for path in sorted(directory.glob("*.jsonl")):
        current: list[dict[str, Any]] = []
        for event in _objects(path):
            if event.get("event") == "site" and current:
                processes.append(current)
                current = []
            current.append(event)
        if current:
            processes.append(current)
    return processes


def _objects(path: Path) -> Iterator[dict[str, Any]]:
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            if isinstance(event := json.loads(line), dict):
                yield event


def summary(processes: Sequence[Events], command: Sequence[str]) -> str:
    """The end-of-run line, without its "gpuwatch run: " prefix: how many ranks were measured (a step recorded)
    of how many started on this machine, their steps, and, where fewer were measured or none, why, as far as the
    processes' events tell; an exception inside gpuwatch is named in any case.

    The ranks started are the most of torchrun's `--nproc-per-node` (its launcher notes its command line) and of
    the ranks that made a process group here. The world size is not the count: on several machines most ranks
    are another machine's `gpuwatch run`'s, and the line only shows it beside the count."""
    ranks = _rank_events(processes)
    measured = sorted(rank for rank, events in ranks.items() if "step" in events)
    total = max(_ranks_started(processes) or 0, len(ranks))
    world = max((event["world_size"] for events in processes for event in events
                 if event.get("event") == "process_group" and isinstance(event.get("world_size"), int)), default=0)
    line = "nothing measured" if total == 0 else f"{len(measured)} of {total} {_plural(total, 'rank')} measured"
    if world > total:
        line += f" on this machine, of a world of {world}"
    line += _steps(processes, measured)
    reasons: list[str] = []
    if len(measured) < total or not measured:
        reasons += _stopped_ranks(ranks)
        if (len(ranks) < total or not ranks) and (why := _stopped_processes(processes, command, total - len(ranks))):
            reasons.append(why)
    reasons += _failures(processes)
    return ": ".join([line, "; ".join(reasons)]) if reasons else line


def _rank_events(processes: Sequence[Events]) -> dict[int, set[str]]:
    """{rank: the events noted for it}, over every process that was that rank (torchrun restarts ranks), with
    "failure" where such a process noted one."""
    ranks: dict[int, set[str]] = {}
    for events in processes:
        failed = {"failure"} if _noted(events, "failure") else set()
        for event in events:
            if isinstance(event.get("rank"), int):
                ranks.setdefault(event["rank"], set()).update({str(event.get("event")), *failed})
    return ranks


def _ranks_started(processes: Sequence[Events]) -> int | None:
    """The ranks torchrun's launcher starts on this machine, from its command line: its `--nproc-per-node` (1,
    torchrun's default, where none is given); None without a launcher or for a count it works out itself ("auto",
    "gpu")."""
    counts = [_nproc_per_node(event.get("argv", ())) for events in processes for event in events
              if event.get("event") == "site" and event.get("launcher")]
    return None if not counts or None in counts else max(count for count in counts if count is not None)


def _nproc_per_node(argv: Sequence[str]) -> int | None:
    for index, argument in enumerate(argv):
        name, equals, value = argument.partition("=")
        if name.startswith("--nproc"):  # --nproc-per-node, --nproc_per_node, or as argparse abbreviates them
            value = value if equals else (argv[index + 1] if index + 1 < len(argv) else "")
            return int(value) if value.isdigit() else None
    return 1


def _steps(processes: Sequence[Events], measured: Sequence[int]) -> str:
    """", 10 steps each" for the measured ranks, from the steps each noted when it closed; nothing where a rank did
    not close (killed, or still running past the command's end)."""
    closed: dict[int, int] = {}
    for events in processes:
        for event in events:
            if event.get("event") == "closed" and isinstance(rank := event.get("rank"), int) \
                    and isinstance(event.get("steps"), int):
                closed[rank] = max(closed.get(rank, 0), event["steps"])
    if not measured or any(rank not in closed for rank in measured):
        return ""
    steps = sorted({closed[rank] for rank in measured})
    if len(steps) > 1:
        return f", {steps[0]} to {steps[-1]} steps"
    return f", {steps[0]} {_plural(steps[0], 'step')}{' each' if len(measured) > 1 else ''}"


def _stopped_ranks(ranks: Mapping[int, set[str]]) -> list[str]:
    """Where the ranks that made a process group but recorded no step stopped. A rank whose instrumentation raised
    is left to its failure, which may be why its forward or step went unrecorded."""
    unexplained = {rank: events for rank, events in ranks.items() if "failure" not in events}
    stopped = {"ran no training forward": [r for r, events in unexplained.items() if not events & {"monitor", "step"}],
               "ran no optimizer step": [r for r, events in unexplained.items() if "monitor" in events
                                         and "step" not in events]}
    return [f"{_rank_list(numbers)} {where}" for where, numbers in stopped.items() if numbers]


def _stopped_processes(processes: Sequence[Events], command: Sequence[str], unseen: int) -> str | None:
    """Why `unseen` ranks (or, with none counted, any) made no process group here: how far the furthest of the
    processes without one got, or why no process loaded gpuwatch's start-up code at all; None where processes
    whose instrumentation failed before torch was hooked are left (their failure says why)."""
    if not processes:
        ignored = _ignored_by(command)
        return ignored if ignored is not None else ("no Python process loaded gpuwatch's start-up code: the command "
                                                    "started none, or ran it with -I, -E or -S")
    ungrouped = [events for events in processes if _noted(events, "site") and not _launcher(events)
                 and not any(isinstance(event.get("rank"), int) for event in events) and not _failed_early(events)]
    with_torch = sum(_noted(events, "instrumented") for events in ungrouped)
    if with_torch:
        return (f"{with_torch} {_plural(with_torch, 'process', 'processes')} imported torch but made no process "
                "group: gpuwatch measures distributed jobs (torch.distributed.init_process_group)")
    if ungrouped:
        return f"{len(ungrouped)} Python {_plural(len(ungrouped), 'process', 'processes')} never imported torch"
    if any(map(_failed_early, processes)):
        return None
    if unseen:
        return f"{unseen} {_plural(unseen, 'rank')} never loaded gpuwatch's start-up code"
    return "torchrun's ranks never loaded gpuwatch's start-up code"


def _failures(processes: Sequence[Events]) -> list[str]:
    """The first exception inside gpuwatch, with how many processes raised it and how many others there were."""
    raised: dict[tuple[str, str], set[int]] = {}
    for index, events in enumerate(processes):
        for event in events:
            if event.get("event") == "failure":
                error = (str(event.get("error", "")).splitlines() or [""])[0][:ERROR_CHARS]
                raised.setdefault((str(event.get("where")), error), set()).add(index)
    if not raised:
        return []
    ((where, error), which), *others = raised.items()
    counts = ([f"in {len(which)} processes"] if len(which) > 1 else []) + \
        ([f"{len(others)} other {_plural(len(others), 'failure')}"] if others else [])
    return [f"{where} raised {error}" + (f" ({', '.join(counts)})" if counts else "")]


def _ignored_by(command: Sequence[str]) -> str | None:
    """"python3 -I ignores PYTHONPATH, …" where `command` runs a Python interpreter with an option that keeps
    gpuwatch's sitecustomize from loading (-I, -E, -S, alone or among others as in -uI), before its script, `-c`
    or `-m`; else None."""
    if not command or not PYTHON.fullmatch(os.path.basename(command[0])):
        return None
    arguments = iter(command[1:])
    for argument in arguments:
        if argument in ("-", "--") or not argument.startswith("-"):
            return None
        if argument.startswith("--"):  # --version, --help ...
            continue
        for index, letter in enumerate(argument[1:], start=1):
            if letter in IGNORING:
                return f"{os.path.basename(command[0])} -{letter} {IGNORING[letter]}"
            if letter in "cm":
                return None
            if letter in "WX":  # takes a value: the rest of this argument, else the next one
                if index == len(argument) - 1:
                    next(arguments, None)
                break
    return None


def _noted(events: Events, name: str) -> bool:
    return any(event.get("event") == name for event in events)


def _failed_early(events: Events) -> bool:
    """Whether the process's instrumentation failed before torch was hooked (gpuwatch not importable, the hooks'
    module not loaded): it got no further, for the reason its failure gives."""
    return _noted(events, "failure") and not _noted(events, "instrumented")


def _launcher(events: Events) -> bool:
    return any(event.get("event") == "site" and event.get("launcher") for event in events)


def _rank_list(ranks: Sequence[int]) -> str:
    """"rank 3", "ranks 0-3", "ranks 0, 2, 5-7"."""
    ordered = sorted(ranks)
    runs: list[list[int]] = []  # [first, last] of each run of consecutive ranks
    for rank in ordered:
        if runs and runs[-1][1] == rank - 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)
    return f"{_plural(len(ordered), 'rank')} {text}"


def _plural(count: int, one: str, many: str | None = None) -> str:
    return one if count == 1 else many or f"{one}s"
