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
That thread also folds submitted step records: a plain step waits up to ``FOLD_SECONDS`` on the client
and goes out folded into a later one (the schema's ``folded``), so that one datagram carries a rank's
steps of seconds; the run log still gets every record at once, whole.

Imports nothing from torch: the hooks build the records, this module only carries them.

Past 500 lines on purpose: one class, ``TelemetryClient``, whose send path, backlog, folding thread, heartbeat and
run log share one socket, one lock and one set of counters.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import math
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
    FOLDED_COUNTS,
    FOLDED_STEP_FIELDS,
    MAX_COMMAND_ARG_CHARS,
    MAX_COMMAND_ARGS,
    MAX_ENV_VALUE_CHARS,
    MAX_ENV_VARS,
    MAX_FOLDED_STEPS,
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
#: How long a submitted step record may wait on the client, to reach the agent folded into a later one (the schema's
#: ``folded``: one datagram carries up to 1 + MAX_FOLDED_STEPS steps). The agent pays per datagram far more than per
#: step (waking its receiver, decoding, applying with cold caches): 64 ranks stepping once a second cost it ~0.4 % of
#: a core as 64 datagrams a second, ~0.25 % as ~15 folded ones, and another ~0.08 % less as ~7 (benchmarks/CHANGELOG.md,
#: Agent cost). 10 s is shorter than the shortest usual scrape interval (15 s), so every scrape still finds each
#: stepping rank moved since the one before, and no alert or rule looks closer than a minute. The first step after a
#: quiet spell goes at once; a step carrying news (``_plain``: a memory reading, a sampled signal, ``unavailable``, a
#: non-finite value) and any other record (a stalled rank's progress) go at once, after the steps held.
FOLD_SECONDS = 10.0
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


#: Step fields measured every N steps or only when something went wrong: a step carrying one is news, not held.
_NEWS = ("memory", "grad_cosine_similarity", "param_checksum", "unavailable", "nonfinite")


def _plain(step: Mapping[str, Any]) -> bool:
    """Whether a step record carries no news (``_NEWS``, a non-finite loss or gradient norm): one the client may hold
    and fold into a later step."""
    if any(step.get(name) for name in _NEWS):
        return False
    return all(type(value) in (int, float) and math.isfinite(value)
               for value in (step.get("loss", 0.0), step.get("grad_norm", 0.0)))


def fold_steps(latest: Mapping[str, Any], earlier: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``latest`` with ``earlier`` (plain steps, oldest first) folded into it, as the schema's ``folded`` says: what
    the agent keeps of each, and their count-like fields (``FOLDED_COUNTS``) summed."""
    points = []
    ops: dict[str, dict[str, Any]] = {}
    counts: dict[str, Any] = {}
    for step in earlier:
        point = {name: step[name] for name in FOLDED_STEP_FIELDS if step.get(name) is not None}
        if "pipeline" in point:
            point["pipeline"] = {"bubble_ratio": point["pipeline"]["bubble_ratio"]}
        points.append(point)
        for op, calls in (step.get("collectives") or {}).items():
            total = ops.get(op)
            ops[op] = dict(calls) if total is None else {
                "count": total["count"] + calls["count"], "bytes": total["bytes"] + calls["bytes"],
                "seconds": total["seconds"] + calls["seconds"],
                "buckets": [a + b for a, b in zip(total["buckets"], calls["buckets"], strict=True)]}
        for name in FOLDED_COUNTS:
            if name != "collectives" and step.get(name) is not None:  # the integers: tokens, samples
                counts[name] = counts.get(name, 0) + step[name]
    if ops:
        counts["collectives"] = ops
    return {**latest, "folded": {"steps": points, **counts}}


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
    threads and sends at once; ``submit`` is for one thread (the training loop's), and folds step records
    for up to ``fold_seconds`` (``FOLD_SECONDS``; 0 sends each at once).
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        run_log: str | os.PathLike[str] | None = None,
        *,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        fold_seconds: float = FOLD_SECONDS,
    ) -> None:
        self.sent = 0
        self._drops: collections.Counter[str] = collections.Counter()
        self._inbox: collections.deque[Callable[[], Mapping[str, Any] | None]] = collections.deque()
        self._inbox_overflow = 0  # submissions dropped for a full inbox; written by the submitting thread only
        self.heartbeat_interval = heartbeat_interval
        self.fold_seconds = fold_seconds
        self.batch_seconds = BATCH_SECONDS
        self._candidates = (Path(socket_path),) if socket_path else socket_path_candidates()
        self._path = self._find_agent()
        self._address = os.fsencode(self._path)
        self._next_search = 0.0
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)
        self._lock = threading.Lock()
        self._backlog: collections.deque[tuple[bytes, int]] = collections.deque()  # (datagram, records in it)
        self._held: list[tuple[Mapping[str, Any], bytes]] = []  # submitted step records held to fold, oldest first
        self._steps_sent_at = -math.inf  # when a datagram of step records last went (monotonic clock)
        self._hello: bytes | None = None
        self._replay_hello = False
        self._agent_socket: tuple[int, int] | None = None  # inode and ctime of the agent's socket at the last datagram
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
                        self._send_locked(record, hold=True)
                    except Exception as exc:  # as in `send`
                        self._count_drop("error", exc)

    def _send(self, record: Mapping[str, Any]) -> None:
        with self._lock:
            self._send_locked(record)

    def _send_locked(self, record: Mapping[str, Any], hold: bool = False) -> None:
        """`_send` with the lock held; with ``hold``, a plain step record may be held to fold (``FOLD_SECONDS``). The
        background thread sends a batch of steps through here in a row while the training loop runs: the less
        Python per record, the less it takes the GIL from the training thread."""
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
            self._write_log(payload)  # every record whole, whether held, folded or sent alone
        if len(payload) > MAX_RECORD_BYTES:
            self._count_drop("too_large", f"{len(payload)} bytes > {MAX_RECORD_BYTES}")
            return
        if kind == "step":
            if hold and self._hold(record, payload):
                return
            self._send_steps(record, payload)
            return
        self._send_held()  # the steps before it first: the agent sees a rank's records in order
        if kind == "hello":
            self._hello = payload
            self._hello_sent_at = time.monotonic()
        self._deliver(payload)

    def _hold(self, record: Mapping[str, Any], payload: bytes) -> bool:
        """Hold a plain step record to fold it into a later one, unless no step went for ``fold_seconds`` (the first
        after a quiet spell goes at once). Sends what is held once it is as much as a datagram folds."""
        if not _plain(record) or (not self._held and time.monotonic() >= self._fold_due()):
            return False
        self._held.append((record, payload))
        if len(self._held) > MAX_FOLDED_STEPS:
            self._send_held()
        return True

    def _fold_due(self) -> float:
        """When held steps go (monotonic clock): ``fold_seconds`` after the last datagram of steps."""
        return self._steps_sent_at + self.fold_seconds

    def _send_held(self) -> None:
        """Send the held steps now, the newest with the others folded into it."""
        if self._held:
            record, payload = self._held.pop()
            self._send_steps(record, payload)

    def _send_steps(self, record: Mapping[str, Any], payload: bytes) -> None:
        """Send a step record with the held ones folded into it: alone when nothing is held, one by one in the rare
        case the folded datagram would not fit."""
        held, self._held = self._held, []
        self._steps_sent_at = time.monotonic()
        if held:
            folded = _encode(fold_steps(record, [step for step, _ in held]))
            if len(folded) <= MAX_RECORD_BYTES:
                self._deliver(folded, 1 + len(held))
                return
            for _, alone in held:
                self._deliver(alone)
        self._deliver(payload)

    def _deliver(self, payload: bytes, records: int = 1) -> None:
        """Send a datagram of ``records`` records, or queue it behind the backlog; a new agent gets the hello first."""
        if payload is not self._hello and self._hello is not None and (self._replay_hello or self._agent_replaced()):
            self._offer_hello()
        if not self._backlog:  # the usual case: straight out, the backlog untouched
            try:
                self._socket.sendto(payload, self._address)
            except OSError:
                pass  # `_flush` tells why, and keeps the record or drops it
            else:
                self.sent += records
                return
        self._backlog.append((payload, records))
        self._flush()

    def _flush(self) -> None:
        """Send the backlog oldest first (so the agent sees a rank's records in order) until the
        agent's queue is full; drop everything if the agent is gone."""
        while self._backlog:
            reason = self._send_datagram(self._backlog[0][0])
            if reason is None:
                self.sent += self._backlog.popleft()[1]
            elif reason == "busy":
                while len(self._backlog) > BACKLOG_RECORDS:
                    self._count_drop("busy", records=self._backlog.popleft()[1])
                self._wake.set()  # the background thread retries soon
                return
            else:
                for _, records in self._backlog:
                    self._count_drop(reason, records=records)
                self._backlog.clear()
                if reason == "no_agent":
                    self._replay_hello = True
                return

    def _agent_replaced(self) -> bool:
        """Whether the socket at the agent's path is another one than when a datagram last went: an agent restarted
        while this client sent nothing (its steps held, or a rank stepping slower than the agent restarts), which no
        failed send told. One stat a datagram; the creation time too, since a file system reuses a freed inode's
        number at once."""
        try:
            info = os.stat(self._address)
        except OSError:
            return False  # no agent: the send fails and says so
        identity = info.st_ino, info.st_ctime_ns
        replaced, self._agent_socket = self._agent_socket not in (None, identity), identity
        return replaced

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

    def _count_drop(self, reason: str, detail: object = None, records: int = 1) -> None:
        self._drops[reason] += records
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
                if self._held:  # wake when they are due
                    due = max(0.0, self._fold_due() - time.monotonic())
                    timeout = due if timeout is None else min(timeout, due)
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
                    if self._held and time.monotonic() >= self._fold_due():
                        self._send_held()
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
        with self._lock:
            self._send_held()
        while True:
            with self._lock:
                self._flush()
                if not self._backlog or time.monotonic() >= deadline:
                    break
            time.sleep(RETRY_SECONDS)
        with self._lock:
            for _, records in self._backlog:
                self._count_drop("busy", records=records)
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
