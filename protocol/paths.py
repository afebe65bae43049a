"""Where the agent listens and where ranks send, agreed without configuration.

Both sides honour ``GPUWATCH_SOCKET``. Without it there are two well-known places, tried in order:

* ``/run/gpuwatch/telemetry.sock`` — the node agent run by root or by a service user that owns
  ``/run/gpuwatch`` (systemd ``RuntimeDirectory=gpuwatch``), which is how it is deployed;
* ``/tmp/gpuwatch-<uid>/telemetry.sock`` — an agent run by an unprivileged user (a workstation,
  a CI job). ``/tmp`` is spelled out rather than taken from ``TMPDIR``, which schedulers such as
  Slurm set per job, so the agent and the ranks would disagree.

The agent listens on the first place it can create; a client sends to the first one that exists
(``socket_path_candidates``), so a non-root training job finds a root agent and a workstation
agent alike.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ENV_VAR = "GPUWATCH_SOCKET"
SYSTEM_SOCKET = Path("/run/gpuwatch/telemetry.sock")
#: sun_path holds 108 bytes including the terminating NUL.
MAX_PATH_BYTES = 107


def user_socket_path(uid: int | None = None) -> Path:
    return Path("/tmp") / f"gpuwatch-{os.geteuid() if uid is None else uid}" / "telemetry.sock"


def socket_path_candidates(environ: Mapping[str, str] = os.environ) -> tuple[Path, ...]:
    """The places a client looks for the agent, most specific first."""
    if environ.get(ENV_VAR):
        return (Path(environ[ENV_VAR]),)
    return SYSTEM_SOCKET, user_socket_path()


def default_socket_path(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the agent listens unless told otherwise: the first candidate it may create."""
    candidates = socket_path_candidates(environ)
    if len(candidates) == 1:
        return candidates[0]
    directory = SYSTEM_SOCKET.parent
    writable = os.access(directory, os.W_OK) if directory.exists() else os.access(directory.parent, os.W_OK)
    return SYSTEM_SOCKET if writable else user_socket_path()
