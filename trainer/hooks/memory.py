"""Memory: the CUDA caching allocator's figures on a GPU, the process's peak resident set on the CPU.

A peak is the peak since the previous reading (each reading resets it; the monitor reads every `memory_every`
steps), so a step that needs more than its predecessors shows in the next reading instead of hiding under the
run's all-time high, and no step's peak is missed between readings. Nothing here waits for the device: the
allocator's statistics are host-side bookkeeping of what the host has already asked for.
"""

from __future__ import annotations

import os
import resource
from functools import partial
from typing import Any

import torch

PROC_STATUS = "/proc/self/status"
#: Writing "5" resets the process's peak RSS (VmHWM) to its current RSS (proc(5), Linux 4.0+).
PROC_CLEAR_REFS = "/proc/self/clear_refs"


class CudaMemory:
    """Peak allocated bytes since the previous reading, with allocated, reserved, inactive-split bytes at the
    reading; allocation retries (a cache flush and retry after a failed cudaMalloc) and OOMs as increments since
    the previous reading."""

    kind = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        stats = torch.cuda.memory_stats(device)
        self._retries, self._ooms = stats.get("num_alloc_retries", 0), stats.get("num_ooms", 0)
        self.reset()

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> dict[str, Any]:
        stats = torch.cuda.memory_stats(self.device)
        retries, ooms = stats.get("num_alloc_retries", 0), stats.get("num_ooms", 0)
        record = {
            "kind": self.kind,
            "peak_bytes": stats.get("allocated_bytes.all.peak", 0),
            "allocated_bytes": stats.get("allocated_bytes.all.current", 0),
            "reserved_bytes": stats.get("reserved_bytes.all.current", 0),
            "inactive_split_bytes": stats.get("inactive_split_bytes.all.current", 0),
            "alloc_retries": retries - self._retries,
            "ooms": ooms - self._ooms,
        }
        self._retries, self._ooms = retries, ooms
        return record

    def close(self) -> None:
        pass


class HostMemory:
    """The process's peak resident set since the previous reading (VmHWM), labelled kind="host_rss". Where clear_refs
    cannot be written (an old kernel, a locked-down /proc) the peak is the process's since it started.

    Read from getrusage's ru_maxrss where that is exact, else from /proc/self/status, which costs ~10 µs
    against ~1 µs (RUSAGE_THREAD: the same ru_maxrss, without adding up the CPU times of every thread;
    measured on a 2-core EPYC VM). ru_maxrss is the larger of the peak that clear_refs resets and a floor the
    kernel folded in (the peak of the process that exec'd it, a launcher say, or of a thread that exited).
    The floor cannot be read by itself, only bounded: a reading above `_floor_bound` is the peak itself;
    one at or below it is checked against status once, which tells either that the reading is the floor
    (status shows a lower peak: the bound stays) or that the floor lies below it (the bound drops). Where
    the floor lies below the loop's peaks (a GPU rank, or any rank larger than its launcher) the bound soon
    sits under the smallest peak the loop reaches, and status is read on the few steps whose peak is a new
    low; where a rank's peaks stay under the floor (a tiny model in a rank forked from a Python process as
    large as itself), on most steps (benchmarks/CHANGELOG.md, "Training hooks").
    """

    kind = "host_rss"

    def __init__(self) -> None:
        # Opened here, in the rank's own process: /proc/self is resolved at open time, so a descriptor
        # inherited through fork would describe the parent.
        self._status = os.open(PROC_STATUS, os.O_RDONLY)
        try:
            self._clear_refs: int | None = os.open(PROC_CLEAR_REFS, os.O_WRONLY)
        except OSError:
            self._clear_refs = None
        self.reset()
        self._rusage = partial(resource.getrusage, resource.RUSAGE_THREAD)
        self._floor_bound = self._rusage().ru_maxrss  # the floor is at most this: ru_maxrss just after a reset

    def reset(self) -> None:
        if self._clear_refs is not None:
            os.write(self._clear_refs, b"5")

    def read(self) -> dict[str, Any]:
        kib = self._rusage().ru_maxrss
        if kib <= self._floor_bound:  # perhaps the floor: only status tells
            status = os.pread(self._status, 8192, 0)
            peak = int(status.split(b"VmHWM:", 1)[1].split(None, 1)[0])
            if peak >= kib:  # the reading was the peak: the floor lies below it
                self._floor_bound = kib - 1
            kib = peak
        return {"kind": self.kind, "peak_bytes": kib * 1024}

    def close(self) -> None:
        for fd in (self._status, self._clear_refs):
            if fd is not None:
                os.close(fd)


def memory_for(device: torch.device) -> CudaMemory | HostMemory:
    return CudaMemory(device) if device.type == "cuda" else HostMemory()
