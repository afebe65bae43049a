"""Per-rank telemetry state in the agent: latest records and accumulated counters, bounded and expiring.

One ``TelemetryStore`` is written by the receiver thread (``receive``) and read by the telemetry collector
(``expire`` then ``snapshot``, when a sampling round is first used). The receiver only queues each datagram: decoding
and applying them is done in a batch by the next reader, under the store's lock and before it reads, so every reader
(``sender_pids`` excepted) sees every record received before it, in order, as if each had been applied on arrival.
Applied one at a time as they arrive (64 ranks' records spread over a second, each a wake-up of a thread with cold
caches) a step record cost ~90 µs of the receiver's CPU; in a batch, ~57 µs with the schema checked in Python, ~40 µs
since msgspec checks it in C (benchmarks/CHANGELOG.md, Agent cost). Past ``MAX_PENDING_BYTES`` the receiver applies the
oldest itself.

Memory is bounded by ``max_ranks`` × one record of each kind (records are at most ``MAX_RECORD_BYTES``), the
datagrams not yet applied (``MAX_PENDING_BYTES``) and a window of recent steps (``window.StepWindow``), whatever
senders do: a new (job, rank) beyond the caps first makes room by forgetting the job that ended longest ago
(every rank's hooks closed and its process gone: a normal end, which no diagnosis needs kept), and is rejected as
``cardinality`` only when no job has ended so; a rank silent for ``ttl`` seconds is forgotten, so its series
disappear from /metrics. A job that died (a rank gone without closing its hooks) is kept until its TTL: who died
is what a hang's diagnosis needs. A rank whose hooks closed sends nothing more, yet is not forgotten while its
process (its sender pid, watched) has not exited: a process stuck in its teardown keeps its job from ending, and
HANG007 needs it seen. Probe records are kept apart from the ranks: the latest per job, for at most
``max_jobs`` jobs (a new job's probe pushes out the oldest), without a TTL.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import math
import operator
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import msgspec

from gpuwatch.agent.telemetry.readings import SampledSignals
from gpuwatch.agent.telemetry.window import StepWindow
from gpuwatch.protocol.records import (
    CollectiveTotals,
    Folded,
    FoldedStep,
    Hello,
    Probe,
    ProbeResult,
    Progress,
    Step,
)
from gpuwatch.protocol.schema import (
    CLIENT_DROP_REASONS,
    COLLECTIVE_BUCKETS,
    REJECT_REASONS,
    Record,
    RecordRejected,
    decode,
)

log = logging.getLogger(__name__)

DEFAULT_TTL = 120.0
DEFAULT_MAX_RANKS = 1024
DEFAULT_MAX_JOBS = 16
#: Bytes of datagrams received and not yet applied beyond which the receiver applies the oldest of them itself
#: (``RECEIVER_APPLY_BYTES`` at a time). Below it the store's next reader applies everything received since the last
#: read in one batch: the telemetry collector reads when a round is first used (a render ahead of a scrape, a scrape, a
#: state request), so at a 15 s scrape interval 64 ranks folding their steps leave ~96 datagrams, ~350 KB, applied one
#: after another with warm caches at ~85–100 µs of CPU each, against ~200–250 µs in the receiver's batches of ~11 when
#: it applied past 32 KiB (benchmarks/CHANGELOG.md, Agent cost). 1 MiB is ~45 s of those 64 ranks' records: more than a
#: 30 s scrape interval.
MAX_PENDING_BYTES = 1024 * 1024
#: What the receiver applies at a time past ``MAX_PENDING_BYTES``. Small, because the receiver does not drain the
#: socket while it applies and the kernel queues only ``net.unix.max_dgram_qlen`` datagrams (10 by default): ~30
#: step records take ~2 ms, the time 10 records take to arrive at 5,000 a second. Applying all of 1 MiB at once,
#: non-waiting senders offered 5,000 records a second lost 16 % of them to a full queue, against 3 % here.
RECEIVER_APPLY_BYTES = 32 * 1024
#: Step fields measured every N steps only: their latest value is kept with the step it belongs to (the memory
#: reading is the record's ``memory`` object whole). Named once, by the typed state diagnosis reads them back as.
SAMPLED_FIELDS: tuple[str, ...] = SampledSignals.__struct_fields__
#: A step record's SAMPLED_FIELDS, read in one call (None where the step did not measure one).
_SAMPLED_VALUES = operator.attrgetter(*SAMPLED_FIELDS)


#: The index of each bucket of an op's histogram, the last the +Inf bucket.
_BUCKET_INDICES = range(len(COLLECTIVE_BUCKETS) + 1)


class OpTotals(NamedTuple):
    """One collective op's calls since the rank was first seen, as a cumulative histogram feeds on. A named tuple: a
    step record adds to ~8 (its own ops and the folded steps'), and ``plus`` executes 10,200 instructions (valgrind,
    one op of 21 buckets, its calls in one), against 16,000 when it added every bucket and 19,300 for a frozen
    dataclass, whose ``__init__`` sets each field through ``object.__setattr__``. The count of calls is ``calls``: a
    tuple's ``count`` is its method."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    buckets: tuple[int, ...] = (0,) * (len(COLLECTIVE_BUCKETS) + 1)

    def plus(self, step: CollectiveTotals) -> OpTotals:
        """These totals with one step's (or folded steps') calls of the op added: the record's ``count``, ``bytes``,
        ``seconds`` and ``buckets`` (as long as these: the schema checks). An op's calls fall in one bucket or a few,
        so only the buckets that got calls are added to, found in C (``compress``)."""
        added = step.buckets
        buckets = [*self.buckets]
        for index in itertools.compress(_BUCKET_INDICES, added):
            buckets[index] += added[index]
        return tuple.__new__(OpTotals, (self.calls + step.count, self.bytes + step.bytes,  # no Python __new__
                                        self.seconds + step.seconds, tuple(buckets)))

    def as_dict(self) -> dict[str, Any]:
        """The totals under the step record's names (``count``, ``bytes``, ``seconds``, ``buckets``), as
        /api/v1/state serves them and the diagnosis facts read them."""
        return {"count": self.calls, "bytes": self.bytes, "seconds": self.seconds, "buckets": self.buckets}


#: An op not called yet (immutable, so shared: a default made per call cost ~0.7 µs, four times a step record).
_NO_CALLS = OpTotals()


@dataclasses.dataclass(slots=True)
class RankState:
    """What the agent knows about one (job, rank). ``hello``, ``last_step`` and ``progress`` are validated
    record bodies (``protocol.records``), replaced whole and never mutated, so a shallow copy is a consistent view."""

    job: str
    rank: int
    last_seen: float  # the store's clock (monotonic), for the TTL
    last_seen_time: float  # wall clock, for people
    #: pid of the process that sent the latest record, from the kernel (None: not visible to the agent)
    sender_pid: int | None = None
    hello: Hello | None = None
    last_step: Step | None = None
    steps: int = 0
    nonfinite_steps: int = 0
    tokens: int = 0
    alloc_retries: int = 0
    ooms: int = 0
    collectives: dict[str, OpTotals] = dataclasses.field(default_factory=dict)
    #: field → (step, value) for SAMPLED_FIELDS
    sampled: dict[str, tuple[int, Any]] = dataclasses.field(default_factory=dict)
    #: signal → (step, reason) of the latest step that could not compute a signal due (``unavailable``)
    unavailable: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    #: the latest steps, for the timing rules' medians
    window: StepWindow = dataclasses.field(default_factory=StepWindow)
    samples: int = 0
    #: the client's cumulative drop counters as last reported, to turn them into increments
    client_dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    #: the latest progress record body, while it is news: a later step record (the rank moved on) clears it
    progress: Progress | None = None
    #: wall clock when the agent found the rank's process gone (its sender pid no longer exists), else None
    exited_time: float | None = None
    #: records applied so far: readers that cache what they derive from a rank rebuild it when this moves
    version: int = 0

    def copy(self) -> RankState:
        """A copy whose containers are copies too. Made from the fields in order (``_FIELD_VALUES``), not by
        ``dataclasses.replace``, whose walk of the fields by name is Python: a snapshot copies every rank that moved."""
        copied = RankState(*_FIELD_VALUES(self))
        copied.collectives, copied.sampled = dict(self.collectives), dict(self.sampled)
        copied.unavailable, copied.client_dropped = dict(self.unavailable), dict(self.client_dropped)
        copied.window = self.window.copy()
        return copied

    def closed_and_running(self) -> bool:
        """Its hooks closed, and its process, whose exit the agent watches (its pid known), has not exited."""
        progress = self.progress
        return (progress is not None and progress.phase == "closed" and self.sender_pid is not None
                and self.exited_time is None)

    def counters(self) -> dict[str, int]:
        return {"steps": self.steps, "nonfinite_steps": self.nonfinite_steps, "tokens": self.tokens,
                "samples": self.samples, "alloc_retries": self.alloc_retries, "ooms": self.ooms}


#: A rank's fields, in the order ``RankState`` takes them.
_FIELD_VALUES = operator.attrgetter(*(field.name for field in dataclasses.fields(RankState)))


def _finite(step: Step | FoldedStep) -> bool:
    """Whether the step's loss and gradient norm, where it reported them, are finite."""
    loss, grad_norm = step.loss, step.grad_norm
    return (loss is None or math.isfinite(loss)) and (grad_norm is None or math.isfinite(grad_norm))


def _count_step(state: RankState, step: Step | FoldedStep, flagged: bool | None = None) -> None:
    """One more step of the rank: a step record's body, or a step folded into one. Non-finite by the client's flag
    (a step record's ``nonfinite``), or by a non-finite loss/grad norm it forgot to flag."""
    state.steps += 1
    state.nonfinite_steps += bool(flagged) or not _finite(step)
    state.window.add(step)


def _add_counts(state: RankState, counts: Step | Folded) -> None:
    """A step record's count-like fields (this step's increments), or the sums of the steps folded into it."""
    state.tokens += counts.tokens or 0
    state.samples += counts.samples or 0
    if counts.collectives is not None:
        for op, stats in counts.collectives.items():
            state.collectives[op] = state.collectives.get(op, _NO_CALLS).plus(stats)


class TelemetryStore:
    """Thread-safe per-rank state plus the ``gpuwatch_telemetry_records_total`` counts."""

    def __init__(
        self,
        *,
        ttl: float = DEFAULT_TTL,
        max_ranks: int = DEFAULT_MAX_RANKS,
        max_jobs: int = DEFAULT_MAX_JOBS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self.max_ranks = max_ranks
        self.max_jobs = max_jobs
        self._clock = clock
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], RankState] = {}
        self._ranks_per_job: collections.Counter[str] = collections.Counter()
        self._probes: dict[str, Probe] = {}  # job -> latest probe body, least recently received first
        # Every known (result, reason) starts at 0, so rate() sees the first increment.
        self._records: dict[tuple[str, str], int] = {("accepted", ""): 0}
        self._records.update(dict.fromkeys((("rejected", reason) for reason in REJECT_REASONS), 0))
        self._records.update(dict.fromkeys((("dropped", reason) for reason in CLIENT_DROP_REASONS), 0))
        #: Moves with every datagram applied, rank expired and exit marked: a reader that saw this number has seen
        #: everything the store holds while it stays the same.
        self.changes = 0
        # Datagrams received, not yet applied, with their sender's pid; their bytes. Under their own lock, which
        # the receiver holds only to append: it never waits for a batch being applied.
        self._pending: list[tuple[bytes, int | None]] = []
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        #: Each rank's state and the copy the last ``snapshot`` handed out, handed out again while that state's version
        #: stands: with steps folded, most ranks move only every few seconds, and a copy of each every round was most
        #: of a round at 64 ranks (a copy holds the rank's window and totals; readers never mutate it).
        self._copies: dict[tuple[str, int], tuple[RankState, RankState]] = {}

    def receive(self, datagram: bytes, sender_pid: int | None = None) -> None:
        """Queue one datagram, to be applied by the next reader (past MAX_PENDING_BYTES, the oldest now)."""
        with self._pending_lock:
            self._pending.append((datagram, sender_pid))
            self._pending_bytes += len(datagram)
            full = self._pending_bytes > MAX_PENDING_BYTES
        if full and self._lock.acquire(blocking=False):  # a reader applying or reading now: it is not waited for
            try:
                self._apply_pending(RECEIVER_APPLY_BYTES)
            finally:
                self._lock.release()

    def ingest(self, datagram: bytes, sender_pid: int | None = None) -> str | None:
        """Decode and apply one datagram now, after those received before it; return the rejection reason, or
        None when accepted."""
        with self._current():
            return self._apply(datagram, sender_pid)

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        """The store's lock, held with every datagram received so far applied: what each reader reads under."""
        with self._lock:
            self._apply_pending()
            yield

    def _apply_pending(self, at_most_bytes: int | None = None) -> None:
        """Apply the datagrams received so far, in order: every one, or the oldest up to ``at_most_bytes`` (at least
        one). With ``_lock`` held, so batches never interleave."""
        with self._pending_lock:
            taken, size = len(self._pending), self._pending_bytes
            if at_most_bytes is not None:
                taken, size = 0, 0
                for datagram, _ in self._pending:
                    if taken and size + len(datagram) > at_most_bytes:
                        break
                    taken, size = taken + 1, size + len(datagram)
            pending, self._pending = self._pending[:taken], self._pending[taken:]
            self._pending_bytes -= size
        for datagram, sender_pid in pending:
            try:
                self._apply(datagram, sender_pid)
            except Exception:  # one record must not cost the others; decode() raises only RecordRejected
                log.exception("telemetry record could not be stored")

    def _apply(self, datagram: bytes, sender_pid: int | None) -> str | None:
        self.changes += 1  # rejected ones are counted too
        try:
            record = decode(datagram)
        except RecordRejected as rejected:
            self._records["rejected", rejected.reason] += 1
            return rejected.reason
        body = record.body
        if isinstance(body, Probe):
            self._keep_probe(body)
            self._records["accepted", ""] += 1
            return None
        state = self._state_for(record)
        if state is None:
            self._records["rejected", "cardinality"] += 1
            return "cardinality"
        state.last_seen = self._clock()
        state.last_seen_time = time.time()
        state.sender_pid = sender_pid
        state.version += 1
        if isinstance(body, Hello):
            # A hello opens a process's story: what an earlier process of this rank said or did (its last
            # progress, its exit) is not about this one, a restarted rank.
            state.hello, state.progress, state.exited_time = body, None, None
        elif isinstance(body, Progress):
            state.progress = body
        else:
            self._apply_step(state, body)
        self._records["accepted", ""] += 1
        return None

    def _state_for(self, record: Record) -> RankState | None:
        key = (record.job, record.rank)
        state = self._ranks.get(key)
        if state is not None:
            return state
        while len(self._ranks) >= self.max_ranks or (
                record.job not in self._ranks_per_job and len(self._ranks_per_job) >= self.max_jobs):
            if not self._forget_an_ended_job():
                return None
        state = self._ranks[key] = RankState(record.job, record.rank, 0.0, 0.0)
        self._ranks_per_job[record.job] += 1
        return state

    def _forget_an_ended_job(self) -> bool:
        """Forget the job that ended normally longest ago (its last record the oldest); False when none has."""
        ended: dict[str, float] = {}
        live: set[str] = set()
        for state in self._ranks.values():
            progress = state.progress
            if state.exited_time is not None and progress is not None and progress.phase == "closed":
                ended[state.job] = max(ended.get(state.job, state.last_seen), state.last_seen)
            else:
                live.add(state.job)
        candidates = {job: last for job, last in ended.items() if job not in live}
        if not candidates:
            return False
        oldest = min(candidates, key=candidates.__getitem__)
        for key in [key for key in self._ranks if key[0] == oldest]:
            del self._ranks[key]
        del self._ranks_per_job[oldest]
        return True

    def _keep_probe(self, probe: Probe) -> None:
        self._probes.pop(probe.job, None)
        self._probes[probe.job] = probe
        if len(self._probes) > self.max_jobs:
            del self._probes[next(iter(self._probes))]

    def _apply_step(self, state: RankState, body: Step) -> None:
        folded = body.folded  # the earlier steps come first; the record kept is the step's own
        if folded is not None:
            for point in folded.steps:
                _count_step(state, point)
            _add_counts(state, folded)
            body = msgspec.structs.replace(body, folded=None)
        state.last_step = body
        number, progress = body.step, state.progress
        if progress is not None and number > progress.step:
            # Newer than the progress record: the rank moved on. A step record of the step the progress record
            # already counts (queued on the rank's sender thread while an error record went out at once) is
            # older news and must not erase that error.
            state.progress = None
        _count_step(state, body, body.nonfinite)
        _add_counts(state, body)
        memory = body.memory
        if memory is not None:
            state.alloc_retries += memory.alloc_retries or 0
            state.ooms += memory.ooms or 0
        for name, value in zip(SAMPLED_FIELDS, _SAMPLED_VALUES(body), strict=True):
            if value is not None:
                state.sampled[name] = (number, value)
        if body.unavailable is not None:
            for signal, reason in body.unavailable.items():
                state.unavailable[signal] = (number, reason)
        client = body.client
        if client is not None and (reported := client.dropped) != state.client_dropped:  # else adds 0s
            for reason, total in reported.items():
                previous = state.client_dropped.get(reason, 0)
                # A smaller total means the rank's process restarted: its counter began again at 0.
                self._records["dropped", reason] += total - previous if total >= previous else total
            state.client_dropped = reported

    def has_queued(self) -> bool:
        """Whether datagrams wait to be applied by the next reader. Read without the locks, one lookup."""
        return bool(self._pending)

    def holds_nothing(self) -> bool:
        """No rank and no datagram waiting: nothing can expire, exit or be applied. Read without the locks, one lookup
        each: a datagram queued a moment later is its next reader's."""
        return not self._ranks and not self._pending

    def expire(self) -> list[RankState]:
        """Forget ranks silent for longer than the TTL, but those closed whose process has not exited; return what
        was forgotten."""
        deadline = self._clock() - self.ttl
        with self._current():
            expired = [state for state in self._ranks.values()
                       if state.last_seen < deadline and not state.closed_and_running()]
            self.changes += bool(expired)
            for state in expired:
                del self._ranks[state.job, state.rank]
                self._ranks_per_job[state.job] -= 1
                if not self._ranks_per_job[state.job]:
                    del self._ranks_per_job[state.job]
        return expired

    def mark_exited(self, pid: int, when: float) -> None:
        """The process `pid` exited at `when` (wall clock): every rank it sent for (``exits.ExitWatcher``)."""
        with self._current():
            self._mark_exited([state for state in self._ranks.values()
                               if state.sender_pid == pid and state.exited_time is None], when)

    def note_exits(self, alive: Callable[[int], bool]) -> list[RankState]:
        """Mark the ranks whose sending process is gone (``alive(pid)`` false) with the time the agent noticed;
        return the newly exited. A rank that exited is kept until its TTL: who died is what a hang's diagnosis
        needs most."""
        now = time.time()
        with self._current():
            gone = [state for state in self._ranks.values()
                    if state.exited_time is None and state.sender_pid is not None and not alive(state.sender_pid)]
            self._mark_exited(gone, now)
        return gone

    def _mark_exited(self, states: list[RankState], when: float) -> None:
        """Mark ``states`` exited at ``when``: news to every reader that caches what it derives from a rank."""
        self.changes += bool(states)
        for state in states:
            state.exited_time = when
            state.version += 1

    def snapshot(self) -> tuple[list[RankState], dict[tuple[str, str], int]]:
        """Copies of every rank's state, sorted by (job, rank), and the record counts. Copies are shared between
        snapshots while their rank does not change: read them, never write them."""
        with self._current():
            copies: dict[tuple[str, int], tuple[RankState, RankState]] = {}
            for key in sorted(self._ranks):
                state, last = self._ranks[key], self._copies.get(key)
                # a new version, or a new state (a rank forgotten and back starts again at version 0)
                if last is None or last[0] is not state or last[1].version != state.version:
                    last = state, state.copy()
                copies[key] = last
            self._copies = copies
            return [copy for _, copy in copies.values()], dict(self._records)

    def sender_pids(self) -> dict[int, tuple[str, int]]:
        """pid -> (job, rank) of every rank whose records carried the sender's pid (in the agent's namespace) and
        whose process has not exited: an exited rank's pid may be another process's next. As of the last read: the
        datagrams queued since are left to the next reader (the host collector asks every round, and applying them
        there would apply them every round, in another thread, with cold caches)."""
        with self._lock:
            return {s.sender_pid: (s.job, s.rank) for s in self._ranks.values()
                    if s.sender_pid is not None and s.exited_time is None}

    def probes(self) -> list[Probe]:
        """The latest probe record body of each job, sorted by job; bodies are replaced whole, never mutated."""
        with self._current():
            return [self._probes[job] for job in sorted(self._probes)]


def probe_peaks(probe: Probe) -> dict[str, ProbeResult]:
    """Each op's result row with the highest bus bandwidth (the first of them): what the path delivers once messages
    are large enough to hide latency, the figure to compare with a link's rating."""
    peaks: dict[str, ProbeResult] = {}
    for row in probe.results:
        best = peaks.get(row.op)
        if best is None or row.busbw_bytes_per_second > best.busbw_bytes_per_second:
            peaks[row.op] = row
    return peaks
