"""The agent's end of the telemetry socket: created safely, removed only if still ours.

The path is in a directory the agent owns and nobody else may write (created 0750 when missing),
so no other user can swap the socket. With a socket group (``--telemetry.socket-group``) the
directory is given to that group and made setgid, so the socket bound in it belongs to the group
too (mode 0660): the training users in that group may send, nobody else may. What may already be
at the path is handled explicitly:

* nothing — bind;
* a socket nobody listens on (left by a killed agent) — removed, then bind;
* a socket another live process listens on — refused: two agents would steal each other's records;
* a symlink, a regular file, anything else — refused and left alone: it is not ours to delete.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import struct
from pathlib import Path

from gpuwatch.protocol.paths import MAX_PATH_BYTES
from gpuwatch.protocol.schema import MAX_RECORD_BYTES

log = logging.getLogger(__name__)

DIRECTORY_MODE = 0o750
#: Owner and group may send: the directory's group, the agent's or --telemetry.socket-group.
SOCKET_MODE = 0o660
#: One byte more than a record may have: an oversized datagram arrives truncated but still
#: longer than the limit, and is rejected as too_large.
RECV_BYTES = MAX_RECORD_BYTES + 1
_QUEUE_LIMIT_FILE = Path("/proc/sys/net/unix/max_dgram_qlen")
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
#: Ancillary buffer for recvmsg: the sender's credentials, which SO_PASSCRED makes the kernel attach.
CREDENTIALS_SPACE = socket.CMSG_SPACE(_UCRED.size)


class SocketSetupError(Exception):
    """The socket cannot be created at this path; the message says why and what to do."""


def queue_limit() -> int | None:
    """How many datagrams the kernel queues for the receiver before senders get EAGAIN.

    For AF_UNIX datagrams this count, not SO_RCVBUF, is the limit (queued bytes are charged to
    the sender's SO_SNDBUF): raising SO_RCVBUF does nothing, raising the sysctl does."""
    try:
        return int(_QUEUE_LIMIT_FILE.read_text())
    except (OSError, ValueError):
        return None


def prepare_directory(directory: Path, group: int | None = None) -> None:
    """Create the socket's directory if missing and check that only the agent can write it; with
    ``group``, hand it to that group, setgid, so that sockets created in it get the group."""
    try:
        os.mkdir(directory, DIRECTORY_MODE)
        os.chmod(directory, DIRECTORY_MODE)  # mkdir's mode is filtered through the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise SocketSetupError(f"cannot create directory {directory}: {exc.strerror}") from None
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise SocketSetupError(f"{directory} is not a directory (a symlink is not followed)")
    if info.st_uid != os.geteuid():
        raise SocketSetupError(f"directory {directory} belongs to uid {info.st_uid}, not to the agent "
                               f"(uid {os.geteuid()}): use a directory the agent owns")
    if info.st_mode & 0o022:
        raise SocketSetupError(f"directory {directory} is writable by group or others "
                               f"(mode {info.st_mode & 0o777:o}): another user could replace the socket")
    if group is None:
        return
    try:
        # Not following a symlink: lstat above proved it is a directory, and we are its owner.
        os.chown(directory, -1, group, follow_symlinks=False)
        os.chmod(directory, DIRECTORY_MODE | stat.S_ISGID)
    except OSError as exc:
        hint = " (a non-root agent must be a member of the group)" if exc.errno == errno.EPERM else ""
        raise SocketSetupError(f"cannot give directory {directory} to gid {group}: {exc.strerror}{hint}") from None


def _is_listening(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        return False
    finally:
        probe.close()
    return True


def _clear_path(path: Path) -> None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise SocketSetupError(f"{path} is a symlink; refusing to follow or remove it")
    if not stat.S_ISSOCK(info.st_mode):
        raise SocketSetupError(f"{path} exists and is not a socket; not touching it, remove it or choose "
                               "another --telemetry.socket")
    if info.st_uid != os.geteuid():
        raise SocketSetupError(f"{path} is a socket of uid {info.st_uid}; not removing another user's socket")
    if _is_listening(path):
        raise SocketSetupError(f"another process is already listening on {path} (a second agent?)")
    log.info("removing stale telemetry socket %s", path)
    os.unlink(path)


def bind(path: Path) -> tuple[socket.socket, tuple[int, int]]:
    """A bound, blocking datagram socket at ``path`` and the (device, inode) identity of its file."""
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise SocketSetupError(f"socket path {path} is longer than the {MAX_PATH_BYTES} bytes a Unix socket "
                               "address holds")
    prepare_directory(path.parent)
    _clear_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(str(path))
        os.chmod(path, SOCKET_MODE)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        info = os.lstat(path)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise SocketSetupError(f"{path} appeared while binding (another agent starting?)") from None
        raise SocketSetupError(f"cannot bind {path}: {exc.strerror or exc}") from None
    return sock, (info.st_dev, info.st_ino)


def sender_pid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    """The sending process's pid from recvmsg's ancillary data, as the kernel vouches for it and in
    the agent's pid namespace (unlike the pid a hello claims, seen from inside the rank's container);
    None when the sender is not visible from the agent's namespace."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            return _UCRED.unpack_from(data)[0] or None
    return None


def unlink_if_ours(path: Path, identity: tuple[int, int]) -> None:
    """Remove the socket file only if it is still the one we bound (not a successor's)."""
    with contextlib.suppress(OSError):
        info = os.lstat(path)
        if (info.st_dev, info.st_ino) == identity:
            os.unlink(path)

