"""The host's CPU time, memory, network traffic and the agent's own resident set from /proc, read as cheaply as the
kernel serves them.

psutil opens, reads, parses and closes a file on every call and builds a named tuple of every field. The host
collector needs three of them every round, in a thread woken once a round with its caches cold: in an idle agent at
1 s sampling ``cpu_times`` took 0.15 ms, ``virtual_memory`` 0.12 ms and the agent's own ``memory_info`` 0.06 ms of
the host round's ~0.45 ms (thread CPU clock), against 24, 47 and 19 µs warm in a loop (benchmarks/CHANGELOG.md, Agent
cost). Here each file is opened once and read again with ``pread(2)`` at offset 0, at which procfs generates it anew
(as the infiniband collector re-reads its sysfs files), and only what the collector exports is parsed. The host
collector falls back to psutil where the files cannot be opened (``open_counters``), and for the memory figures where
``MemAvailable`` is absent, 0 or above ``MemTotal`` (psutil then estimates them as free(1) does: ``psutil_memory``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil

#: Enough for /proc/stat's first line and all of /proc/meminfo and /proc/self/statm.
READ_BYTES = 8192
#: Enough for /proc/net/dev with some 500 interfaces (a line is ~120 bytes).
NET_DEV_BYTES = 65536

#: One interface's counters since boot: bytes received, bytes transmitted, errors and drops (both ways).
NicCounters = tuple[int, int, int, int]
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class ProcCounters:
    """/proc/stat, /proc/meminfo, /proc/self/statm and /proc/net/dev (of the agent's network namespace) under
    ``root``, kept open; ``close`` closes them."""

    def __init__(self, root: Path = Path("/proc")) -> None:
        self._fds: list[int] = []
        try:
            self._stat, self._meminfo, self._statm, self._net_dev = (
                self._open(root / name) for name in ("stat", "meminfo", "self/statm", "net/dev"))
        except OSError:
            self.close()
            raise

    def _open(self, path: Path) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._fds.append(fd)
        return fd

    def cpu_busy_and_total(self) -> tuple[int, int]:
        """Clock ticks of all CPUs, busy and in all, as psutil.cpu_percent counts them: guest time is inside user
        time already (proc(5)), and idle and iowait are not busy."""
        line = os.pread(self._stat, READ_BYTES, 0).split(b"\n", 1)[0]  # cpu user nice system idle iowait ... guest
        ticks = [int(value) for value in line.split()[1:]]
        total = sum(ticks) - sum(ticks[8:10])  # less guest and guest_nice
        return total - sum(ticks[3:5]), total

    def memory(self) -> tuple[int, int, int] | None:
        """Bytes of memory in all, available and used (in all less available, as psutil 7 counts it); None where
        ``MemAvailable`` is absent, 0 or above ``MemTotal``, which psutil treats case by case."""
        fields = {}
        for line in os.pread(self._meminfo, READ_BYTES, 0).splitlines():
            name, _, rest = line.partition(b":")
            if name in (b"MemTotal", b"MemAvailable"):
                fields[name] = int(rest.split()[0]) * 1024
                if len(fields) == 2:
                    break
        total, available = fields.get(b"MemTotal"), fields.get(b"MemAvailable")
        if total is None or not available or available > total:
            return None
        return total, available, total - available

    def own_resident_bytes(self) -> int:
        """The agent's resident set: statm's second field, in pages."""
        return int(os.pread(self._statm, READ_BYTES, 0).split()[1]) * _PAGE_SIZE

    def network_counters(self) -> dict[str, NicCounters]:
        """Each interface's counters (proc(5), /proc/net/dev: after ``name:``, receive bytes packets errs drop fifo
        frame compressed multicast, then transmit bytes packets errs drop ...)."""
        counters = {}
        for line in os.pread(self._net_dev, NET_DEV_BYTES, 0).splitlines()[2:]:
            name, _, rest = line.partition(b":")
            fields = rest.split()
            if len(fields) >= 12:
                counters[name.strip().decode()] = (int(fields[0]), int(fields[8]), int(fields[2]) + int(fields[10]),
                                                   int(fields[3]) + int(fields[11]))
        return counters

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def psutil_memory() -> tuple[int, int, int]:
    """Bytes of memory in all, available and used, as psutil reads them."""
    memory = psutil.virtual_memory()
    return memory.total, memory.available, memory.used


def _busy_and_total(times: Any) -> tuple[float, float]:
    """CPU seconds as psutil.cpu_percent counts them: guest is inside user; idle and iowait are not busy."""
    total = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
    return total - times.idle - getattr(times, "iowait", 0.0), total


class PsutilCounters:
    """``ProcCounters``' readings through psutil, a file opened and parsed per call: where /proc's files cannot be
    opened (another OS, no /proc mounted). CPU time comes in seconds rather than clock ticks: the collector only
    divides differences of it."""

    def __init__(self) -> None:
        self._own = psutil.Process()

    def cpu_busy_and_total(self) -> tuple[float, float]:
        return _busy_and_total(psutil.cpu_times())

    def memory(self) -> tuple[int, int, int]:
        return psutil_memory()

    def own_resident_bytes(self) -> int:
        return int(self._own.memory_info().rss)

    def network_counters(self) -> dict[str, NicCounters]:
        return {name: (c.bytes_recv, c.bytes_sent, c.errin + c.errout, c.dropin + c.dropout)
                for name, c in psutil.net_io_counters(pernic=True).items()}

    def close(self) -> None:
        """Nothing is kept open."""


def open_counters(root: Path = Path("/proc")) -> ProcCounters | PsutilCounters:
    """/proc's files kept open under ``root``, or psutil where they cannot be opened."""
    try:
        return ProcCounters(root)
    except OSError:
        return PsutilCounters()
