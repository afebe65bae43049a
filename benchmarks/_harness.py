"""Plumbing the benchmark scripts share: a free loopback port, an HTTP GET, waiting for a condition, a child
process stopped on the way out; and how their figures are reported, so that every script's travel the same way: the
machine they were measured on, the load average around them, min / median / max of repeated measurements."""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def wait_until(predicate: Callable[[], T], what: str, timeout: float = 60.0) -> T:
    """The predicate's first true value; connection errors and half-written answers count as not yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if value := predicate():
                return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what}")


@contextlib.contextmanager
def running(command: list[str], stdout: int | IO = subprocess.DEVNULL, grace: float = 15.0,
            **popen: Any) -> Iterator[subprocess.Popen]:
    """``command`` running for the ``with`` block (its stderr with its stdout); SIGTERM at the end, SIGKILL after
    ``grace`` seconds."""
    proc = subprocess.Popen(command, stdout=stdout, stderr=subprocess.STDOUT, **popen)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it ("unknown CPU" where it gives none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def machine(*extra: str) -> str:
    """A benchmark's ``machine:`` line: cores and CPU model, kernel, the Python build, and ``extra`` (the version of
    torch or valgrind a script's figures depend on). Figures are compared between runs with the same line."""
    python = (f"{platform.python_implementation()} {platform.python_version()} "
              f"({', '.join(platform.python_build())}, {platform.python_compiler()})")
    return ", ".join((f"{os.cpu_count()} CPUs ({cpu_model()})", f"Linux {platform.release()}", python, *extra))


def load_average() -> str:
    """The 1, 5 and 15 minute load averages: printed before and after a measurement, to tell a quiet run."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def spread(values: Sequence[float], unit: str = "", digits: int = 2) -> str:
    """min / median / max of repeated measurements, or the one value of a single run."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}{unit}"
    return f"{min(values):.{digits}f} / {statistics.median(values):.{digits}f} / {max(values):.{digits}f}{unit}"
