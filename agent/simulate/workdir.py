"""Where a simulated node's files live, and the removal of those that an agent killed without notice left behind.

A simulated agent writes its sysfs tree to tmpfs when there is one (``/dev/shm``): the counters are rewritten every
round. It removes the tree when it stops, but an agent killed with SIGKILL (a test's timeout, the OOM killer, a
node's cgroup teardown) cannot, and tmpfs keeps its ~2 MB in memory until the next reboot. So each directory names
its agent in an ``.owner`` file: its pid and its start time since boot (field 22 of ``/proc/PID/stat``), which
together name one process even when the pid is later reused (``proc(5)``). A simulated agent starting up removes the
directories whose agent is no longer running. A directory without an owner is left alone: another agent may have
made it a moment ago, or an older version of gpuwatch did.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "gpuwatch-sim-"
OWNER = ".owner"


def process_identity(pid: int) -> str | None:
    """``"PID START"``: the pid and the process's start time in clock ticks since boot; None when no process has
    that pid (or /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()  # the name in parentheses may hold spaces
    except (OSError, ValueError):
        return None
    return f"{pid} {int(fields[19])}" if len(fields) > 19 else None  # starttime: field 22, 20th after the name


def stale_workdirs(parent: Path) -> list[Path]:
    """The simulated nodes' directories in ``parent`` whose agent is no longer running."""
    stale = []
    for directory in sorted(parent.glob(PREFIX + "*")):
        try:
            owner = (directory / OWNER).read_text()
            pid = int(owner.split()[0])
        except (OSError, ValueError, IndexError):
            continue  # being made by another agent, made by an older gpuwatch, or not ours to read
        if process_identity(pid) != owner:
            stale.append(directory)
    return stale


def default_parent() -> Path:
    """tmpfs when there is one the agent may write to, else the system's temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


@contextlib.contextmanager
def workdir(parent: Path | None = None) -> Iterator[Path]:
    """A new directory for a simulated node in ``parent`` (``default_parent()`` when None), owned by this process and
    removed on exit; the directories left there by agents no longer running are removed first."""
    parent = parent or default_parent()
    for directory in stale_workdirs(parent):
        shutil.rmtree(directory, ignore_errors=True)
        log.info("removed %s, left by a simulated agent that is no longer running", directory)
    with tempfile.TemporaryDirectory(prefix=PREFIX, dir=parent) as path:
        identity = process_identity(os.getpid())
        if identity is not None:
            (Path(path) / OWNER).write_text(identity)
        yield Path(path)
