"""When each rank's process exits, to the millisecond: a pidfd per process (Linux 5.3+, `os.pidfd_open`), readable
once the process is gone, waited on by one thread with `select.poll`.

Which rank died first is what a crash's diagnosis needs: a launcher (torchrun, `gpuwatch train`) ends every other
rank of the job within moments of the first death, so a check once per sampling round would find them all gone at
once. The thread sleeps in `poll` until a process exits or a new one is watched: no cost while ranks live. Where
pidfds are not available (an older kernel, another OS), `available` is False and the telemetry collector checks
/proc once a round instead.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Callable, Iterable


class ExitWatcher:
    """Calls `on_exit(pid, wall_time)` once for each watched process, from its own thread, as the process exits."""

    def __init__(self, on_exit: Callable[[int, float], None]) -> None:
        self._on_exit = on_exit
        self.available = hasattr(os, "pidfd_open")
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}  # pidfd -> pid
        self._watched: set[int] = set()
        self._poll = select.poll()
        self._wake_read, self._wake_write = os.pipe()
        self._poll.register(self._wake_read, select.POLLIN)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="telemetry-exits", daemon=True)
        self._thread.start()

    def watch(self, pids: Iterable[int]) -> None:
        """Watch the processes not watched yet; one already gone is reported at once (a pid is watched again once
        its process has exited and been reported: the kernel may give it to another process)."""
        if not self.available:
            return
        added = False
        with self._lock:
            for pid in pids:
                if pid in self._watched:
                    continue
                self._watched.add(pid)
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    self._on_exit(pid, time.time())
                    continue
                except OSError:  # ENOSYS: a kernel without pidfds
                    self.available = False
                    return
                self._fds[fd] = pid
                self._poll.register(fd, select.POLLIN)
                added = True
        if added:
            os.write(self._wake_write, b"x")

    def _run(self) -> None:
        while True:
            events = self._poll.poll()
            if self._closed:
                return
            now = time.time()
            for fd, _ in events:
                if fd == self._wake_read:
                    os.read(self._wake_read, 4096)
                    continue
                with self._lock:
                    pid = self._fds.pop(fd, None)
                    self._poll.unregister(fd)
                    self._watched.discard(pid)  # the pid may be a later process's: watched again when it is
                os.close(fd)
                if pid is not None:
                    self._on_exit(pid, now)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_write, b"x")
        self._thread.join(2)
        with self._lock:
            for fd in self._fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fds.clear()
        os.close(self._wake_read)
        os.close(self._wake_write)
