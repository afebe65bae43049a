"""Plumbing the benchmark scripts share: a free loopback port, an HTTP GET, waiting for a condition, a child
process stopped on the way out."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import IO, TypeVar

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
            **popen: object) -> Iterator[subprocess.Popen]:
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
