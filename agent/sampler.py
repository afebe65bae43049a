"""Runs the collectors on the agent's own interval and publishes one immutable Snapshot per round.

A round only collects; its exposition is rendered (with the sampler's one ``Renderer``, which reuses
what did not change) when the round is about to be scraped at the scraper's rhythm, or else on the
scrape that asks for it: rounds nobody scrapes are never rendered.

Each collector runs in its own worker thread with a deadline: a collector that hangs (an NVML
call stuck in the driver) is reported down and skipped until it returns, while the others keep
being sampled. A collector that fails (no driver, no socket) is reported down and backs off: it runs
again after 2 s, then 4, 8 … up to 5 minutes, until it succeeds. Scrapes never trigger collection;
they read ``Sampler.snapshot``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client.core import Metric

from gpuwatch.agent import __version__
from gpuwatch.agent.collectors.base import Collector, CollectorResult, DeferredFamilies
from gpuwatch.agent.exposition import Renderer
from gpuwatch.agent.metricspec import MetricSpec
from gpuwatch.agent.snapshot import CollectorStatus, ScrapeClock, Snapshot

log = logging.getLogger(__name__)

#: Seconds a collector that failed waits before it runs again; each further failure doubles the wait, up to
#: BACKOFF_MAX_SECONDS, and a success resets it. An absent source (no NVIDIA driver, a socket that cannot be bound)
#: then costs one failed attempt every 5 minutes instead of one per round (a failed nvmlInit every round cost
#: ~0.9 % of a core at 1 s sampling), and one that appears later (a driver that finished loading) is still picked up.
BACKOFF_FIRST_SECONDS = 2.0
BACKOFF_MAX_SECONDS = 300.0


#: The agent's own families, beside the collectors': what it is, and how each collector's last run went.
AGENT_INFO = MetricSpec("gpuwatch_agent_info", "Agent build and mode; mode=simulated marks a scripted stand-in node, "
                        "never real hardware.", kind="info", labels=("version", "mode", "node"))
COLLECTOR_UP = MetricSpec("gpuwatch_collector_up", "1 when the collector's last run succeeded.",
                          labels=("collector",))
COLLECTOR_DURATION = MetricSpec("gpuwatch_collector_duration_seconds", "Wall time of the collector's last run.",
                                "seconds", labels=("collector",))
COLLECTOR_PARTIAL_ERRORS = MetricSpec("gpuwatch_collector_partial_errors", "Items (GPUs, files, ports) the collector "
                                      "could not read in its last run.", labels=("collector",))
#: Exported by a simulated agent only.
SIMULATION_CPU = MetricSpec("gpuwatch_agent_simulation_cpu_seconds", "CPU time the agent process spent on "
                            "--simulate's scripted node (advancing it, and inside the scripted NVML's functions), "
                            "which a real node does not pay: the agent's own cost is the process's CPU time without "
                            "it.", "seconds", kind="counter")


@dataclasses.dataclass(frozen=True)
class _Failing:
    """A collector whose last run raised: why, how long it waits, and until when (on the sampler's clock)."""

    error: str
    wait: float
    retry_at: float

    @staticmethod
    def after(previous: _Failing | None, error: str, now: float) -> _Failing:
        """The back-off after a failure at ``now``: the first wait, or twice the ``previous`` one up to the cap."""
        wait = BACKOFF_FIRST_SECONDS if previous is None else min(2 * previous.wait, BACKOFF_MAX_SECONDS)
        return _Failing(error, wait, now + wait)


@dataclasses.dataclass(frozen=True)
class _Unchanged:
    """A collector's last result, served again until ``until`` (on the sampler's clock) without running it."""

    until: float
    status: CollectorStatus
    result: CollectorResult


class Sampler:
    def __init__(
        self,
        collectors: Sequence[Collector],
        *,
        interval: float,
        node: str,
        mode: str,
        deadline: float | None = None,
        before_round: Callable[[], None] | None = None,
        simulation_cpu: Callable[[], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.collectors = list(collectors)
        self.interval = interval
        self.deadline = deadline if deadline is not None else max(0.5, 0.8 * interval)
        self.agent_info: dict[str, Any] = {"version": __version__, "mode": mode, "node": node,
                                           "interval_seconds": interval}
        self._before_round = before_round
        self._simulation_cpu = simulation_cpu
        self._clock = clock
        self._renderer = Renderer()
        self._scrapes = ScrapeClock()
        self._executors = {
            c.name: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"collector-{c.name}")
            for c in self.collectors
        }
        self._pending: dict[str, concurrent.futures.Future[tuple[CollectorResult, float]]] = {}
        self._last_success: dict[str, float] = {}
        self._failing: dict[str, _Failing] = {}
        self._unchanged: dict[str, _Unchanged] = {}
        self._stop = threading.Event()
        self.snapshot = Snapshot(timestamp=0.0, families=(), collectors={}, readings={}, agent=self.agent_info,
                                 renderer=self._renderer, scrapes=self._scrapes)

    def sample_once(self) -> Snapshot:
        """Run every collector that is due once (each under the deadline) and publish the new snapshot.

        A collector still stuck in an earlier call, backing off after a failure, or whose last result holds for a
        while yet (``CollectorResult.unchanged_for_seconds``) is not run: a round in which no collector is due runs
        nothing and publishes their last statuses and results again."""
        if self._before_round is not None:
            self._before_round()
        started = self._clock()
        due = [collector for collector in self.collectors if self._due(collector.name, started)]
        futures = {collector.name: self._executors[collector.name].submit(self._timed, collector)
                   for collector in due if collector.may_block}
        for collector in due:
            if not collector.may_block:
                futures[collector.name] = self._run_here(collector)
        if futures:
            concurrent.futures.wait(futures.values(), timeout=self.deadline)

        families: list[Sequence[Metric]] = []
        readings: dict[str, object] = {}
        statuses: dict[str, CollectorStatus] = {}
        now = time.time()
        for collector in self.collectors:
            unchanged = self._unchanged.get(collector.name)
            result: CollectorResult | None
            if collector.name not in futures and unchanged is not None and started < unchanged.until:
                status, result = unchanged.status, unchanged.result
            else:
                status, result = self._status_of(collector.name, futures.get(collector.name), now, started)
            statuses[collector.name] = status
            if result is not None:
                families.append(result.families)
                readings[collector.name] = result.readings
        families.insert(0, DeferredFamilies(lambda: self._self_metrics(statuses)))  # built if rendered
        snapshot = Snapshot(timestamp=now, families=families, collectors=statuses, readings=readings,
                            agent=self.agent_info, renderer=self._renderer, scrapes=self._scrapes)
        if self._scrapes.due_within(self.interval):  # a scrape will read this round: render it before it asks
            snapshot.render()
        self.snapshot = snapshot  # one reference swap: readers see the old or the new one, whole
        return snapshot

    def _due(self, name: str, now: float) -> bool:
        pending = self._pending.get(name)
        if pending is not None and not pending.done():
            return False  # still stuck in last round's call: do not pile up threads behind it
        failing, unchanged = self._failing.get(name), self._unchanged.get(name)
        backing_off = failing is not None and now < failing.retry_at
        return not backing_off and (unchanged is None or now >= unchanged.until)

    def _status_of(self, name: str, future: concurrent.futures.Future[tuple[CollectorResult, float]] | None,
                   now: float, started: float) -> tuple[CollectorStatus, CollectorResult | None]:
        last_success = self._last_success.get(name)
        if future is None:
            failing = self._failing.get(name)
            if failing is not None and started < failing.retry_at:
                return CollectorStatus(False, 0.0, failing.error, last_success_timestamp=last_success,
                                       next_attempt_seconds=failing.retry_at - started), None
            waited = self._clock() - started
            return CollectorStatus(False, waited, "still blocked in a previous collection",
                                   last_success_timestamp=last_success), None
        if not future.done():
            self._pending[name] = future
            self._unchanged.pop(name, None)
            log.warning("collector %s missed its %.1fs deadline", name, self.deadline)
            return CollectorStatus(False, self.deadline, f"timed out after {self.deadline:.1f}s",
                                   last_success_timestamp=last_success), None
        self._pending.pop(name, None)
        try:
            result, duration = future.result()
        except Exception as exc:  # a failing collector is reported, never propagated
            log.debug("collector %s failed", name, exc_info=True)
            message = f"{type(exc).__name__}: {exc}"
            failing = self._failing[name] = _Failing.after(self._failing.get(name), message, started)
            self._unchanged.pop(name, None)
            return CollectorStatus(False, 0.0, message, last_success_timestamp=last_success,
                                   next_attempt_seconds=failing.wait), None
        self._failing.pop(name, None)
        self._last_success[name] = now
        status = CollectorStatus(True, duration, None, tuple(result.errors), now)
        if result.unchanged_for_seconds is None:
            self._unchanged.pop(name, None)
        else:
            self._unchanged[name] = _Unchanged(started + result.unchanged_for_seconds, status, result)
        return status, result

    def _run_here(self, collector: Collector) -> concurrent.futures.Future[tuple[CollectorResult, float]]:
        """Run a collector that cannot block in the sampler's thread, its outcome as a worker's would be."""
        future: concurrent.futures.Future[tuple[CollectorResult, float]] = concurrent.futures.Future()
        try:
            future.set_result(self._timed(collector))
        except Exception as exc:  # reported as the collector's failure, like a worker's
            future.set_exception(exc)
        return future

    @staticmethod
    def _timed(collector: Collector) -> tuple[CollectorResult, float]:
        started = time.perf_counter()
        result = collector.collect()
        return result, time.perf_counter() - started

    def _self_metrics(self, statuses: dict[str, CollectorStatus]) -> list[Metric]:
        info = AGENT_INFO.family()
        info.add_metric([__version__, self.agent_info["mode"], self.agent_info["node"]], 1)
        up, duration, partial = COLLECTOR_UP.family(), COLLECTOR_DURATION.family(), COLLECTOR_PARTIAL_ERRORS.family()
        for name, status in statuses.items():
            up.add_metric([name], 1.0 if status.up else 0.0)
            duration.add_metric([name], status.duration_seconds)
            partial.add_metric([name], len(status.partial_errors))
        families: list[Metric] = [info, up, duration, partial]
        if self._simulation_cpu is not None:
            families.append(SIMULATION_CPU.family(self._simulation_cpu()))
        return families

    def run(self) -> None:
        """Sample every ``interval`` seconds until ``stop`` is called.

        This is the agent process's main loop, so it also tunes the process's garbage collector: the objects
        alive at start-up (modules, collectors, caches) live as long as the process and are frozen out of the
        collector's scans, and the young generation is collected less often. A round creates ~10^4 short-lived
        objects that reference counting frees; at the default thresholds the cyclic collector took a tenth of
        the agent's CPU time re-scanning the long-lived ones. What a read of 64 ranks' telemetry keeps until the next
        one (~5,000 objects: the ranks' copies, their steps) still set off a young collection of 1.6–7.8 ms every
        ~30 s at a threshold of 5,000, and 50,000 set off none in 2 minutes (the cycles they found were a few
        ctypes array types a round, which wait for the next collection harmlessly).
        """
        gc.freeze()
        gc.set_threshold(50_000, 20, 20)
        next_round = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:  # the loop must survive anything a round throws
                log.exception("sampling round failed")
            next_round += self.interval
            now = time.monotonic()
            if next_round < now:  # a round overran: skip the missed ticks instead of bursting
                next_round = now + self.interval
            self._stop.wait(next_round - now)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.stop()
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
        for collector in self.collectors:
            try:
                collector.close()
            except Exception:
                log.warning("closing collector %s failed", collector.name, exc_info=True)
