"""What each process under `gpuwatch run` says of its instrumentation, so that a job gpuwatch did not measure is
never passed over in silence.

`gpuwatch run` makes a directory for the run and names it in STATUS_VARIABLE; every process the command starts then
appends one JSON line per event to `<pid>.jsonl` there (`note`): "site" when it loads gpuwatch's start-up code,
"instrumented" once torch is hooked, "process_group", "monitor" (its first forward: measuring began), "step" (its
first step record), "closed", and "failure" for an exception in the instrumentation. When the command ends,
`gpuwatch run` reads them all and says in one line how many ranks were measured, and where the others stopped.

This module is imported at every Python start under `gpuwatch run` (and loaded by path by a sitecustomize that
cannot import gpuwatch), so it imports nothing but the standard library, and `note` writes nothing without the
variable: a process outside `gpuwatch run` pays one dictionary look-up.
"""

from __future__ import annotations

import json
import os
import time

#: The directory, made by `gpuwatch run` for one run, that the command's processes note their events in.
STATUS_VARIABLE = "GPUWATCH_RUN_STATUS"


def note(event: str, **fields: object) -> None:
    """Append `{"event", "pid", "time", **fields}` as one line to `$GPUWATCH_RUN_STATUS/<pid>.jsonl`; nothing without
    the variable. Never raises: an OSError (the directory gone because `gpuwatch run` ended before a straggling
    process, a full disk) is swallowed, since observability never breaks training. One `write` of the whole line
    on a file opened to append: a forked child's events, or another thread's, are never interleaved with it."""
    directory = os.environ.get(STATUS_VARIABLE)
    if not directory:
        return
    pid = os.getpid()
    line = json.dumps({"event": event, "pid": pid, "time": time.time(), **fields}, default=str) + "\n"
    try:
        descriptor = os.open(os.path.join(directory, f"{pid}.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(descriptor, line.encode())
        finally:
            os.close(descriptor)
    except OSError:
        pass
