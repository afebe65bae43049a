"""Telemetry client of a training rank: one JSON record per Unix datagram to the node agent.

Observability must never hurt training, so ``TelemetryClient.send`` never blocks and never raises.
When the agent is absent or restarting the record is dropped and counted. When it is slow — its
kernel queue is full: Linux queues only ``net.unix.max_dgram_qlen`` datagrams (10 by default)
per receiving socket, whatever its buffer size, and a step's burst from many ranks fills that —
the record waits in a small backlog that a background thread retries every ``RETRY_SECONDS`` and
later sends flush first; only what overflows the backlog is dropped (in the load test of
docs/reliability.md it turns 24 % drops into none). Every step record carries
the client's counters (``client``), so the agent reports drops as
``gpuwatch_telemetry_records_total{result="dropped"}``.

The same thread re-sends the rank's hello every ``heartbeat_interval`` seconds, and the next send
after the agent comes back re-sends it at once: a restarted agent relearns the rank's layout, and
a rank that is alive but stuck (a hung collective) does not expire from the agent.

The training loop hands its step records over with ``submit`` instead: a callable that builds the
record, queued (never waiting, not even for the client's lock) and run on that thread, so building
the record, encoding it, the run log's write and the datagram cost the training thread nothing.

Imports nothing from torch: the hooks build the records, this module only carries them.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from gpuwatch.protocol.paths import socket_path_candidates
from gpuwatch.protocol.schema import (
    ENV_DENY,
    MAX_COMMAND_ARG_CHARS,
    MAX_COMMAND_ARGS,
    MAX_ENV_VALUE_CHARS,
    MAX_ENV_VARS,
    MAX_RECORD_BYTES,
    REDACTED,
    encode,
    env_name_allowed,
)

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 30.0  # well inside the agent's default 120 s TTL
RETRY_SECONDS = 0.02
#: Half a datagram for the hello's environment, whatever the job's environment holds.
ENV_BUDGET_BYTES = MAX_RECORD_BYTES // 2
#: Records held while the agent's queue is full; more are dropped oldest first.
BACKLOG_RECORDS = 64
#: Records submitted and not yet built; more are dropped (counted as "busy": the sending side cannot keep up).
INBOX_RECORDS = 256
#: How long submitted records gather before the background thread takes them all at once. Every turn of that
#: thread takes the GIL from the training thread, and each hand-over costs both threads CPU: one turn per
#: batch instead of one per step is most of what moving the records off the training thread saves.
BATCH_SECONDS = 0.05
#: How much lower than the training thread's the client thread's priority is (nice value; Linux only).
THREAD_NICENESS = 10
#: The name each rank's file takes in a run log directory (global rank, 5 digits), as `gpuwatch diagnose` reads it.
RANK_LOG_NAME = "rank-{rank:05d}.jsonl"
_NO_AGENT = frozenset({errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR})
#: `schema.encode` with its encoder made once: json.dumps makes a new one on every call with these separators.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def _encode(record: Mapping[str, Any]) -> bytes:
    return _ENCODER.encode(record).encode()

_BUSY = frozenset({errno.EAGAIN, errno.ENOBUFS})


def captured_command(argv: Sequence[str]) -> list[str]:
    """A hello's `command`: `argv` with each option's value withheld where the option's name holds a word of
    ``schema.ENV_DENY`` (`--hf-token X`, `--api-key=X`: command lines carry secrets as often as environments do),
    then bounded by ``MAX_COMMAND_ARGS`` and ``MAX_COMMAND_ARG_CHARS`` so the hello fits its datagram."""
    def secret(option: str) -> bool:
        return option.startswith("-") and any(word in option.upper() for word in ENV_DENY)

    kept: list[str] = []
    for index, argument in enumerate(argv[:MAX_COMMAND_ARGS]):
        name, equals, _ = argument.partition("=")
        if equals and secret(name):
            argument = f"{name}={REDACTED}"
        elif index > 0 and secret(argv[index - 1]) and "=" not in argv[index - 1] and not argument.startswith("-"):
            argument = REDACTED
        kept.append(argument[:MAX_COMMAND_ARG_CHARS])
    return kept


def captured_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment variables a hello reports: NCCL_*, TORCH_*, PYTORCH_*, CUDA_* and the
    launcher's (MASTER_ADDR, WORLD_SIZE, LOCAL_RANK, ...; ``schema.ENV_NAMES``), never a name
    containing KEY, TOKEN, SECRET, PASSW, CREDENTIAL, AUTH or COOKIE, even under those prefixes.
    Bounded by ``ENV_BUDGET_BYTES`` so the hello always fits its datagram."""
    kept: dict[str, str] = {}
    budget = ENV_BUDGET_BYTES
    for name, value in sorted(environ.items()):
        if not env_name_allowed(name) or len(value) > MAX_ENV_VALUE_CHARS:
            continue
        cost = len(encode({name: value}))
        if cost <= budget:
            kept[name] = value
            budget -= cost
            if len(kept) == MAX_ENV_VARS:
                break
    return kept


def new_job_id() -> str:
    """A job id for a job that has none from its launcher: the time it started and 6 random hex digits."""
    return f"gpuwatch-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def run_log_file(path: str | os.PathLike[str], rank: int) -> Path:
    """Where `rank` appends its records in the run log `path`: `path` itself when it names a ``.jsonl`` file
    (ranks may share one: each record is one appended line carrying its rank), else the file
    ``RANK_LOG_NAME`` in the directory `path`, created if need be. A directory that cannot be created is
    left to the client, whose open then fails with a warning and leaves the run log out."""
    path = Path(path)
    if path.suffix != ".jsonl":
        path = path / RANK_LOG_NAME.format(rank=rank)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _yield_to_training() -> None:
    """Lower the calling thread's priority by THREAD_NICENESS (Linux, where a thread has its own nice value; elsewhere
    nothing). The client's thread builds and sends a batch of records at a time while the training loop runs, and
    at the training thread's priority the scheduler lets it preempt that thread on its core, whose CPU time then
    grows by about as much again (cold caches, GIL hand-overs): ~+40-60 µs per step at 1-2 ms steps (2-rank DDP on
    2 CPUs, benchmarks/hooks_overhead.py), against ~+10 µs at nice 10. It still gets a tenth of a contended core,
    where it needs under a tenth at a step per millisecond, and all of an idle one."""
    if not sys.platform.startswith("linux") or not THREAD_NICENESS:
        return
    with contextlib.suppress(OSError, AttributeError):
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + THREAD_NICENESS))


def _present(path: Path) -> bool:
    """Whether something is at ``path``. A root agent's socket that this user may not even look at
    counts as present: sending to it then fails with a warning that says why, where falling back to
    another place would only report "no agent"."""
    try:
        path.lstat()
    except PermissionError:
        return True
    except OSError:
        return False
    return True


class TelemetryClient:
    """Sends records to the node agent; ``sent``, ``dropped`` and ``drops`` (by reason) count them.

    ``socket_path`` defaults to ``GPUWATCH_SOCKET``, else the agent's well-known places
    (``gpuwatch.protocol.paths``). ``run_log``, when given, receives every record as one
    JSON line, flushed, whether or not the agent got it: the post-mortem copy for diagnosis.
    ``heartbeat_interval=0`` turns the hello heartbeat off. ``send`` is safe to share between
    threads; ``submit`` is for one thread (the training loop's).
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        run_log: str | os.PathLike[str] | None = None,
        *,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
    ) -> None:
        self.sent = 0
        self._drops: collections.Counter[str] = collections.Counter()
        self._inbox: collections.deque[Callable[[], Mapping[str, Any] | None]] = collections.deque()
        self._inbox_overflow = 0  # submissions dropped for a full inbox; written by the submitting thread only
        self.heartbeat_interval = heartbeat_interval
        self.batch_seconds = BATCH_SECONDS
        self._candidates = (Path(socket_path),) if socket_path else socket_path_candidates()
        self._path = self._find_agent()
        self._address = os.fsencode(self._path)
        self._next_search = 0.0
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)
        self._lock = threading.Lock()
        self._backlog: collections.deque[bytes] = collections.deque()
        self._hello: bytes | None = None
        self._replay_hello = False
        self._warned: set[str] = set()
        self._hello_sent_at = 0.0
        self._log: BinaryIO | None = None
        if run_log is not None:
            try:
                self._log = open(run_log, "ab")  # noqa: SIM115 - lives as long as the client
            except OSError as exc:
                log.warning("telemetry run log %s disabled: %s", run_log, exc)
        self._closed = threading.Event()
        self._closing = False  # `_closed` as a plain flag, for `submit` (one call fewer on the training thread)
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._background, name="telemetry-client", daemon=True)
        self._thread.start()

    @property
    def drops(self) -> collections.Counter[str]:
        """Records dropped so far, by reason (``schema.CLIENT_DROP_REASONS``)."""
        drops = collections.Counter(self._drops)
        drops["busy"] += self._inbox_overflow
        return +drops  # without zero counts

    @property
    def dropped(self) -> int:
        return sum(self.drops.values())

    @property
    def socket_path(self) -> Path:
        return self._path

    def send(self, record: Mapping[str, Any]) -> None:
        """Send one record (a dict as ``gpuwatch.protocol.schema`` describes); never raises."""
        try:
            self._send(record)
        except Exception as exc:  # a bug here must cost a record, never the training run
            self._count_drop("error", exc)

    def submit(self, build: Callable[[], Mapping[str, Any] | None]) -> None:
        """Queue a record for the background thread, which calls ``build`` and sends what it returns (None:
        nothing to send), in the order submitted. Never blocks and never raises: when ``INBOX_RECORDS``
        submissions wait already this one is dropped and counted as "busy"; ``close`` sends what waits."""
        waiting = len(self._inbox)
        if waiting >= INBOX_RECORDS or self._closing:
            self._inbox_overflow += 1
            return
        self._inbox.append(build)
        # The first of a batch wakes the background thread, which then lets the batch gather; half a full inbox
        # cuts that short. (The thread empties the inbox whenever it takes from it, so the first finds it empty.)
        if waiting == 0 or waiting == INBOX_RECORDS // 2:
            self._wake.set()

    def _send_submitted(self) -> None:
        """Build and send the submitted records, oldest first; on the background thread, or in ``close``. All that
        wait are built before any is sent: building is pure Python, and sending lets go of the GIL."""
        while self._inbox:
            records = []
            while self._inbox:
                build = self._inbox.popleft()
                try:
                    record = build()
                except Exception as exc:  # the builder's bug costs its record only
                    self._count_drop("error", exc)
                    continue
                if record is not None:
                    records.append(record)
            with self._lock:  # once for the batch
                for record in records:
                    try:
                        self._send_locked(record)
                    except Exception as exc:  # as in `send`
                        self._count_drop("error", exc)

    def _send(self, record: Mapping[str, Any]) -> None:
        with self._lock:
            self._send_locked(record)

    def _send_locked(self, record: Mapping[str, Any]) -> None:
        """`_send` with the lock held. The background thread sends a batch of steps through here in a row while
        the training loop runs: the less Python per record, the less it takes the GIL from the training thread."""
        kind = record.get("kind")
        if kind != "hello" and self._replay_hello and self._hello is not None:
            self._offer_hello()
        if kind == "step":
            dropped = dict(self._drops)  # as `drops`, without its Counter arithmetic: once per record
            if self._inbox_overflow:
                dropped["busy"] = dropped.get("busy", 0) + self._inbox_overflow
            record = {**record, "client": {"sent": self.sent, "dropped": dropped}}
        try:
            payload = _encode(record)
        except (TypeError, ValueError) as exc:
            self._count_drop("encode_error", exc)
            return
        if self._log is not None:
            self._write_log(payload)
        if len(payload) > MAX_RECORD_BYTES:
            self._count_drop("too_large", f"{len(payload)} bytes > {MAX_RECORD_BYTES}")
            return
        if kind == "hello":
            self._hello = payload
            self._hello_sent_at = time.monotonic()
        if not self._backlog:  # the usual case: straight out, the backlog untouched
            try:
                self._socket.sendto(payload, self._address)
            except OSError:
                pass  # `_flush` tells why, and keeps the record or drops it
            else:
                self.sent += 1
                return
        self._backlog.append(payload)
        self._flush()

    def _flush(self) -> None:
        """Send the backlog oldest first (so the agent sees a rank's records in order) until the
        agent's queue is full; drop everything if the agent is gone."""
        while self._backlog:
            reason = self._send_datagram(self._backlog[0])
            if reason is None:
                self._backlog.popleft()
                self.sent += 1
            elif reason == "busy":
                while len(self._backlog) > BACKLOG_RECORDS:
                    self._backlog.popleft()
                    self._count_drop("busy")
                self._wake.set()  # the background thread retries soon
                return
            else:
                for _ in range(len(self._backlog)):
                    self._count_drop(reason)
                self._backlog.clear()
                if reason == "no_agent":
                    self._replay_hello = True
                return

    def _offer_hello(self) -> None:
        """Re-send the hello unless records wait before it. A failed re-send loses nothing new,
        so it is not counted as a drop."""
        if not self._backlog and self._hello is not None and self._send_datagram(self._hello) is None:
            self.sent += 1
            self._replay_hello = False
            self._hello_sent_at = time.monotonic()

    def _send_datagram(self, payload: bytes) -> str | None:
        """None when sent, else the drop reason. The path is resolved by the kernel on every
        call, so a restarted agent (a new socket at the same path) is found again."""
        try:
            self._socket.sendto(payload, self._address)
        except OSError as exc:
            if exc.errno in _BUSY:
                return "busy"
            if exc.errno in _NO_AGENT:
                self._search_agent()
                return "no_agent"
            if exc.errno == errno.EMSGSIZE:
                return "too_large"
            self._warn_once("error", f"sending to {self._path}: {exc}")
            return "error"
        return None

    def _find_agent(self) -> Path:
        return next((path for path in self._candidates if _present(path)), self._candidates[0])

    def _search_agent(self) -> None:
        """Look again at the well-known places, at most once a second, in case the agent moved."""
        now = time.monotonic()
        if len(self._candidates) > 1 and now >= self._next_search:
            self._next_search = now + 1.0
            self._path = self._find_agent()
            self._address = os.fsencode(self._path)

    def _count_drop(self, reason: str, detail: object = None) -> None:
        self._drops[reason] += 1
        if detail is not None:
            self._warn_once(reason, f"{detail}")

    def _warn_once(self, reason: str, message: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("telemetry record dropped (%s): %s; further drops are only counted", reason, message)

    def _write_log(self, payload: bytes) -> None:
        if self._log is None:
            return
        try:
            self._log.write(payload + b"\n")
            self._log.flush()
        except (OSError, ValueError) as exc:
            log.warning("telemetry run log disabled after a failed write: %s", exc)
            log_file, self._log = self._log, None
            with contextlib.suppress(OSError):  # the buffered bytes cannot be written either
                log_file.close()

    def _background(self) -> None:
        """Send what was submitted; retry a backlog the agent had no room for; re-send the hello as a
        heartbeat. Sleeps without a timeout when there is none of these. Runs at a lower priority
        (`_yield_to_training`)."""
        _yield_to_training()
        while True:
            with self._lock:
                timeout = RETRY_SECONDS if self._backlog else (self.heartbeat_interval or None)
            self._wake.wait(timeout)
            self._wake.clear()  # before looking at the inbox: a submission from now on sets it again
            if self._closed.is_set():
                return  # close sends the rest, in order
            if self._inbox:
                self._wake.wait(self.batch_seconds)
                self._wake.clear()
                if self._closed.is_set():
                    return
                self._send_submitted()
            try:
                with self._lock:
                    if self._backlog:
                        self._flush()
                    elif (self._hello is not None and self.heartbeat_interval
                          and time.monotonic() - self._hello_sent_at >= self.heartbeat_interval):
                        self._offer_hello()
            except Exception as exc:
                self._count_drop("error", exc)

    def close(self, timeout: float = 1.0) -> None:
        """Stop the background thread, send what was submitted, give the backlog up to ``timeout`` seconds to
        reach the agent (the last steps of a run matter; what stays is counted as dropped), release the
        socket and the run log. Not for the training loop: this one may wait."""
        self._closing = True
        self._closed.set()
        self._wake.set()
        self._thread.join(1.0)
        if not self._thread.is_alive():  # else it is stuck in a write of the run log, and sends the rest itself
            self._send_submitted()
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                self._flush()
                if not self._backlog or time.monotonic() >= deadline:
                    break
            time.sleep(RETRY_SECONDS)
        with self._lock:
            for _ in range(len(self._backlog)):
                self._count_drop("busy")
            self._backlog.clear()
            self._socket.close()
            if self._log is not None:
                try:
                    self._log.close()
                except OSError as exc:
                    log.warning("closing the telemetry run log failed: %s", exc)
                self._log = None

    def __enter__(self) -> TelemetryClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
