"""Training telemetry: the collector that owns the ranks' socket and store, and exports gpuwatch_train_*.

The parts: the receiver thread that drains the socket into the store (``agent.telemetry.receiver``), the store
(``agent.telemetry.store``), what a round reads of it (``agent.telemetry.rounds``), and the exposition: the families'
declarations (``agent.telemetry.metrics``) and the per-rank lines written by hand (``agent.telemetry.series``).

The store is read when a round is first used, not by every round: ``collect`` returns a result whose families and
readings read it on first use (or serves its last result while the store did not change), the series are written
when that round is rendered, and only for ranks whose state moved since the previous render (``RankSeries``).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, NamedTuple

from gpuwatch.agent.collectors.base import (
    Collector,
    CollectorContext,
    CollectorError,
    CollectorResult,
    DeferredFamilies,
    DeferredReadings,
)
from gpuwatch.agent.telemetry import listener
from gpuwatch.agent.telemetry.exits import ExitWatcher
from gpuwatch.agent.telemetry.receiver import Receiver
from gpuwatch.agent.telemetry.rounds import Once, Round, StateReadings
from gpuwatch.agent.telemetry.series import RankSeries, families, probe_families
from gpuwatch.agent.telemetry.store import TelemetryStore
from gpuwatch.protocol.paths import default_socket_path

log = logging.getLogger(__name__)


class _Latest(NamedTuple):
    """The collector's latest result, and the store's changes when it was read (None: not read yet)."""

    result: CollectorResult[Any]
    read: Once
    read_at: int | None = None


def _alive(pid: int) -> bool:
    """Whether a process with this pid exists in the agent's pid namespace (a zombie still counts: it has not been
    reaped, so its exit status is not known here either)."""
    return Path(f"/proc/{pid}").exists()


class TelemetryCollector(Collector):
    """Owns the telemetry socket and the per-rank store; reported down while the socket cannot be
    set up (the reason is its last error), and tries again whenever the sampler runs it (backing off)."""

    name = "telemetry"
    may_block = False  # copies the store: the receiver thread is what waits on the socket

    def __init__(self, context: CollectorContext) -> None:
        super().__init__(context)
        self.path = context.telemetry_socket or default_socket_path()
        self.store = TelemetryStore(ttl=context.telemetry_ttl, max_ranks=context.telemetry_max_ranks,
                                    max_jobs=context.telemetry_max_jobs)
        self._per_rank = RankSeries()
        self._exits = ExitWatcher(self.store.mark_exited)
        self._queue_limit = listener.queue_limit()
        self._state = StateReadings(self.path, self._queue_limit, self.store.ttl)
        self._receiver: Receiver | None = None
        self._error: str | None = None
        self._latest: _Latest | None = None
        self._read_lock = threading.Lock()
        self._listen()

    def _listen(self) -> None:
        """Bind the socket and start receiving; on failure remember why and try again at the next collect."""
        try:
            self._receiver = Receiver(self.path, self.store, self._exits)
        except (listener.SocketSetupError, OSError) as exc:
            if str(exc) != self._error:
                log.error("telemetry socket: %s", exc)
            self._error = str(exc)
            return
        self._error = None
        log.info("receiving telemetry on %s (kernel queue: %s datagrams)", self.path, self._queue_limit)

    def collect(self) -> CollectorResult[Any]:
        """The store's state, read when the round is first used (``_read``): its families when it is rendered (ahead
        of a scrape, or by one), its readings when ``/api/v1/state`` asks. A round nobody uses reads nothing, so
        the datagrams of the rounds between two scrapes are applied in one batch, with warm caches, by the read of
        the round that is scraped (at 5 s sampling and a 15 s scrape interval, one batch of ~96 datagrams instead of
        three of ~32, each costing 2-3x in a round's cold caches). The latest result is served again while nobody
        has used it, and after it was read while nothing was received, expired or exited since."""
        if self._receiver is None:
            self._listen()
            if self._receiver is None:
                raise CollectorError(self._error)
        store, latest = self.store, self._latest
        idle = store.holds_nothing()  # no rank to expire or mark, no datagram to apply: no lock taken
        if not self._exits.available and not idle:  # else the watcher's thread marks them as they exit
            for state in store.note_exits(_alive):  # applies what is queued: a round's read, on such kernels
                log.warning("job %s rank %d: its process (pid %s) is gone", state.job, state.rank, state.sender_pid)
        if latest is not None:
            if latest.read_at is None:
                return latest.result  # nobody used it yet: whoever does first reads the store then
            if not store.has_queued():
                if not idle:
                    self._expire()
                if latest.read_at == store.changes:
                    return latest.result  # nothing came, expired or exited: not a copy of the same state
        # No reference cycle (a result its own read referred to): refcounting frees each round's copies at once, where
        # the cyclic collector, rarely run (``Sampler.run``), let them pile up, +6.5 MB of RSS at 64 ranks.
        read = Once(self._read)
        result: CollectorResult[Any] = CollectorResult(DeferredFamilies(lambda: read().families()),
                                                       DeferredReadings(lambda: read().readings()))
        with self._read_lock:  # not overwritten by a read of the round before, finishing in another thread
            self._latest = _Latest(result, read)
        return result

    def _expire(self) -> None:
        for state in self.store.expire():
            log.info("telemetry of job %s rank %d expired after %.0fs of silence", state.job, state.rank,
                     self.store.ttl)

    def _read(self, once: Once) -> Round:
        """Apply what was queued, expire the silent ranks and copy the store, for the result ``once`` reads, which the
        rounds that follow serve again while the store does not change."""
        with self._read_lock:  # rounds read by a render and a state request at once: one at a time
            self._expire()
            changes = self.store.changes  # before the copy: what is applied after it is news to the next round
            ranks, records = self.store.snapshot()
            probes = self.store.probes()
            latest = self._latest
            if latest is not None and latest.read is once:  # not an older round read late
                self._latest = latest._replace(read_at=changes)
        # Built when used: the ranks are copies and probe bodies are never mutated, so building later is the same.
        return Round(lambda: families(ranks, records, self._per_rank) + probe_families(probes),
                     lambda: self._state(ranks, records, probes))

    def close(self) -> None:
        self._exits.close()
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
