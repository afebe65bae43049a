"""``gpuwatch run [OPTIONS] -- COMMAND…``: run a training command with every Python rank it starts instrumented,
without a line of it changed (gpuwatch.trainer.auto says how). Imports no torch: the wrapper only sets the
environment, starts the command, passes signals on and returns its exit status."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType

import click

from gpuwatch.trainer.auto import instrumented_environment, parse_layout
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
    cosine and norm, memory, and where a stuck rank stands. Exits with COMMAND's status (128+N when a
    signal N ended it). Example: gpuwatch run -- torchrun --nproc-per-node 8 train.py"""
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
    env = instrumented_environment(os.environ, socket_path=socket_path, job=job, run_log=run_log, layout=layout,
                                   new_job=new_job_id())
    try:
        child = subprocess.Popen(list(command), env=env)
    except OSError as error:
        click.echo(f"gpuwatch run: cannot start {command[0]}: {error.strerror}", err=True)
        sys.exit(127 if isinstance(error, FileNotFoundError) else 126)
    for number in FORWARDED:
        signal.signal(number, lambda received, _frame: _forward(child, received))
    status = child.wait()
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
