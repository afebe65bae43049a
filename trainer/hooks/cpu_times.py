"""How long the training thread ran on a CPU and waited for one, per step: Linux's schedstat.

Ranks that compute on CPUs (gloo: a test, a demo, a CPU job) share the host's cores with each other and everything
else on it. A rank that is ready to run but has no core is not working, yet its wall-clock phases grow as if it
were, and on a host with more runnable threads than CPUs healthy ranks drift several times apart that way. The
kernel counts that wait per thread: ``/proc/thread-self/schedstat`` holds the thread's time on a CPU, its time
waiting on a run queue, and its time slices, in nanoseconds (the kernel's Documentation/scheduler/sched-stats.rst;
the figures ``perf sched`` and delay accounting read). A step record carries both between its start and its end
(``cpu_seconds``, ``cpu_wait_seconds``), and diagnosis judges a rank's busy time net of the wait: the host's shortage
of cores, not the rank's work (``window.BUSY`` says how much of it, and why the time on a CPU bounds it).

Only where every mark is a wall-clock reading (CPU ranks): on a GPU a step's times are the device's, and the host
thread's waits are not comparable to them. The file is opened once, by the thread that makes the Monitor (the one
that runs the training loop, as the watchdog assumes too), and read with ``os.pread`` bound in a
``functools.partial``: ~2 µs and no Python frame on the hot path, where opening it each time costs ~16 µs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

#: The calling thread's scheduler statistics: "<ns on a CPU> <ns waiting on a run queue> <time slices>".
SCHEDSTAT = "/proc/thread-self/schedstat"

Reading = bytes  # the file's raw text, parsed off the training thread (`thread_seconds`)


def open_reader(path: str = SCHEDSTAT) -> tuple[Callable[[], Reading], int] | None:
    """A reader of this thread's statistics and its file descriptor (for `close`); None where the kernel keeps no
    such file (not Linux, or a kernel without schedstats), so records leave ``cpu_wait_seconds`` out."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    read = functools.partial(os.pread, descriptor, 64, 0)
    try:
        thread_seconds(read(), read())
    except (OSError, ValueError, IndexError):  # present but not in the layout above
        os.close(descriptor)
        return None
    return read, descriptor


def thread_seconds(start: Reading, end: Reading) -> tuple[float, float]:
    """The thread's time on a CPU and its run-queue wait between two readings, in seconds."""
    (ran_from, waited_from), (ran_to, waited_to) = (map(int, reading.split()[:2]) for reading in (start, end))
    return max(0, ran_to - ran_from) / 1e9, max(0, waited_to - waited_from) / 1e9
