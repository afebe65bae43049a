"""PyTorch's Flight Recorder, read as a second source beside the hooks' own account of the collectives.

The Flight Recorder (https://docs.pytorch.org/tutorials/prototype/flight_recorder_tutorial.html) is PyTorch's own
ring buffer of the last N collectives each process started, with their process group, per-group sequence number and
state, kept in C++ by the process group itself (NCCL, and in recent releases every backend: gloo too). Its size is
``TORCH_FR_BUFFER_SIZE``, or by its older name ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (the first of the two that is set,
as torch reads them); 0 turns it off. Unset, the build's default applies: torch 2.13 records 2,000 entries for every
backend (checked on gloo), earlier releases recorded for NCCL only (PyTorch #142260, December 2024) or not at all; a
build that records nothing gives an empty dump, which reads here as no entries.

`FlightRecorder.read` asks torch for the buffer (``torch._C._distributed_c10d._dump_fr_trace_json``, no stack
traces) and `FlightRecorder.parse` turns that JSON into `FlightEntry` tuples: the op (from ``profiling_name``,
"nccl:all_reduce" → "all_reduce"), torch's name and description of its process group ("0" / "default_pg" for the
world, "1" / "dp" for a group made with ``group_desc="dp"``), its sequence number (collectives and point-to-point ops
are numbered apart, per group, from 1), whether it is point-to-point, its state and whether torch has retired it, and
its duration where NCCL timed it (``TORCH_NCCL_ENABLE_TIMING``). What a state means depends on the backend: NCCL
marks an entry "started" and "completed" by querying its CUDA events; gloo has no events, so its entries stay
"scheduled" and only ``retired`` (set when the work ended) says they are over. `FlightEntry.finished` is either.

Nothing here raises: a torch without the function, a dump torch cannot make, a key missing or of another type in an
entry (the dump's ``version`` has moved over releases) give None, no entries, or the field's default. The hooks read
it off the training thread only (the watchdog, when it reports a stalled rank): never per step.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

#: The environment variables that size the recorder's buffer, in the order torch reads them.
BUFFER_SIZE_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: The states torch gives an entry (a later release may add others: they are kept as given).
STATES = ("scheduled", "started", "completed")


class FlightEntry(NamedTuple):
    """One collective (or send/recv) as the Flight Recorder saw it."""

    op: str  # "all_reduce", "broadcast", "send", ... (the profiling name without its backend)
    backend: str  # "nccl", "gloo", ... ("" where the profiling name has no backend)
    group: str  # torch's name of the process group ("0": the default group)
    group_desc: str  # its description ("default_pg", a group_desc given to new_group, "undefined")
    seq: int  # per group: collectives numbered from 1, point-to-point ops apart
    p2p: bool
    state: str  # STATES
    retired: bool  # torch is done with the work (gloo: it ended; NCCL: completed, or timed out)
    duration_seconds: float | None  # NCCL with TORCH_NCCL_ENABLE_TIMING

    @property
    def finished(self) -> bool:
        """Over, as far as the recorder knows: completed (NCCL's events), or retired (gloo has no events)."""
        return self.state == "completed" or self.retired


class FlightRecorder:
    """Whether PyTorch's Flight Recorder is on in this process, and its entries, parsed (see the module's
    docstring). Stateless: every method is a static one, so that a test can call `parse` on a recorded dump."""

    @staticmethod
    def buffer_size(environ: Mapping[str, str] | None = None) -> int | None:
        """The buffer size the environment sets (the first of BUFFER_SIZE_VARIABLES that is set, as torch reads
        them), or None where neither is set (or the value is no integer): then the torch build's default applies."""
        environ = os.environ if environ is None else environ
        for name in BUFFER_SIZE_VARIABLES:
            value = environ.get(name)
            if value is not None and value.strip():
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    @staticmethod
    def enabled(environ: Mapping[str, str] | None = None) -> bool:
        """Whether to read the recorder in this process: where the environment sizes its buffer, a size above 0;
        where it does not, True, as current torch records by default (a build that does not gives an empty dump)."""
        size = FlightRecorder.buffer_size(environ)
        return size is None or size > 0

    @staticmethod
    def read(only_active: bool = False) -> list[FlightEntry] | None:
        """This process's entries, oldest first; None where this torch has no Flight Recorder dump or cannot make
        one. `only_active` leaves out the entries NCCL knows completed (gloo's entries are never marked so: all of
        them stay), which keeps the dump small where only the unfinished ones are wanted."""
        try:
            from torch._C import _distributed_c10d

            dump = getattr(_distributed_c10d, "_dump_fr_trace_json", None)
            if dump is None:
                return None
            text = dump(True, only_active)  # includeCollectives, onlyActive
        except Exception:
            return None
        return FlightRecorder.parse(text)

    @staticmethod
    def read_settled(timeout: float = 5.0) -> list[FlightEntry] | None:
        """`read`, again every few milliseconds for up to `timeout` seconds while an entry is not finished: for the
        end of a job, whose collectives have all returned, since gloo retires a work on its own thread just after
        ``wait()`` returned (NCCL's watchdog thread too, though its completed events read so at once)."""
        deadline = time.monotonic() + timeout
        entries = FlightRecorder.read()
        while entries and not all(entry.finished for entry in entries) and time.monotonic() < deadline:
            time.sleep(0.01)
            entries = FlightRecorder.read()
        return entries

    @staticmethod
    def oldest_unfinished(entries: list[FlightEntry] | None) -> FlightEntry | None:
        """The oldest entry the recorder has not seen finish: where a stalled rank waits, by PyTorch's account."""
        return next((entry for entry in entries or () if not entry.finished), None)

    @staticmethod
    def parse(dump: str | bytes | Mapping[str, Any]) -> list[FlightEntry]:
        """The entries of a Flight Recorder JSON dump (its text, or the object it holds), in the dump's order
        (oldest first); entries that are no JSON object are left out, missing or mistyped keys take defaults."""
        try:
            data = json.loads(dump) if isinstance(dump, str | bytes | bytearray) else dump
        except (ValueError, UnicodeDecodeError):
            return []
        raw = data.get("entries") if isinstance(data, Mapping) else None
        if not isinstance(raw, list):
            return []
        return [_entry(item) for item in raw if isinstance(item, Mapping)]


def _entry(item: Mapping[str, Any]) -> FlightEntry:
    backend, _, op = _string(item.get("profiling_name")).rpartition(":")
    group = item.get("process_group")  # [name, desc]
    if isinstance(group, list | tuple) and len(group) == 2:
        group_name, group_desc = _string(group[0]), _string(group[1])
    else:
        group_name, group_desc = _string(item.get("pg_id")), ""
    p2p = item.get("is_p2p") is True
    seq = item.get("p2p_seq_id" if p2p else "collective_seq_id")
    state = item.get("state")
    duration = item.get("duration_ms")
    seconds = duration / 1000 if isinstance(duration, int | float) and 0 <= duration < math.inf else None
    return FlightEntry(
        op=op or "unknown", backend=backend, group=group_name, group_desc=group_desc,
        seq=seq if type(seq) is int and seq >= 0 else 0, p2p=p2p,
        state=state if isinstance(state, str) and state else "scheduled", retired=item.get("retired") is True,
        duration_seconds=None if isinstance(duration, bool) else seconds)


def _string(value: Any) -> str:
    """A text field as text; an integer (a group's id) as its digits; anything else as nothing."""
    return value if isinstance(value, str) else str(value) if type(value) is int else ""
