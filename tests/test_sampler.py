"""Sampler: one failing or hung collector never takes the others down; snapshots are whole."""

import concurrent.futures
import gzip
import itertools
import json
import subprocess
import sys
import threading
import urllib.request

from prometheus_client.core import GaugeMetricFamily

from gpuwatch.agent import sampler as sampler_module
from gpuwatch.agent import snapshot as snapshot_module
from gpuwatch.agent.collectors.base import (
    Collector,
    CollectorContext,
    CollectorError,
    CollectorResult,
    DeferredFamilies,
)
from gpuwatch.agent.sampler import Sampler
from gpuwatch.agent.server import AgentHTTPServer, serve_in_thread
from gpuwatch.agent.snapshot import CollectorStatus, ScrapeClock

from conftest import wait_until


class _Good(Collector):
    name = "good"

    def collect(self):
        family = GaugeMetricFamily("gpuwatch_good_value", "Good.", value=42)
        return CollectorResult([family], {"value": float("nan")}, ["one item unreadable"])


class _Broken(Collector):
    name = "broken"

    def collect(self):
        raise RuntimeError("device on fire")


class _Hung(Collector):
    name = "hung"

    def __init__(self, context):
        super().__init__(context)
        self.release = threading.Event()
        self.calls = 0

    def collect(self):
        self.calls += 1
        self.release.wait(10)
        return CollectorResult([GaugeMetricFamily("gpuwatch_hung_value", "Hung.", value=1)])


def _sampler(*collectors, deadline=10.0):
    """A round waits at most `deadline` for its collectors: generous, so a loaded machine never makes a healthy
    collector miss it; only a hung one waits it out."""
    return Sampler(collectors, interval=1.0, deadline=deadline, node="n1", mode="simulated")


def test_failing_collector_is_down_with_its_error_and_others_are_served():
    context = CollectorContext()
    snapshot = _sampler(_Good(context), _Broken(context)).sample_once()
    text = snapshot.metrics().decode()
    assert "gpuwatch_good_value 42.0" in text
    assert 'gpuwatch_collector_up{collector="good"} 1.0' in text
    assert 'gpuwatch_collector_up{collector="broken"} 0.0' in text
    assert 'gpuwatch_collector_partial_errors{collector="good"} 1.0' in text
    assert 'gpuwatch_agent_info{mode="simulated",node="n1",version="' in text
    state = json.loads(snapshot.state_json)
    assert state["collectors"]["broken"]["last_error"] == "RuntimeError: device on fire"
    assert state["collectors"]["good"]["partial_errors"] == ["one item unreadable"]
    assert state["facts"]["good"] == {"value": "NaN"}  # strict JSON, as Prometheus's API encodes NaN
    assert "broken" not in state["facts"]


def test_hung_collector_misses_deadline_then_is_not_resubmitted_until_it_returns():
    context = CollectorContext()
    hung = _Hung(context)
    # The first round waits the whole deadline for the hung one: 1 s, still ample for the healthy one under load.
    sampler = _sampler(_Good(context), hung, deadline=1.0)
    try:
        first = sampler.sample_once()
        assert first.collectors["hung"].up is False  # returned before the hung call's 10 s: the deadline cut it
        assert "timed out" in first.collectors["hung"].last_error
        assert first.collectors["good"].up is True
        second = sampler.sample_once()
        assert second.collectors["hung"].last_error == "still blocked in a previous collection"
        assert hung.calls == 1  # no pile-up of threads behind a stuck call
        hung.release.set()
        third = wait_until(lambda: (snapshot := sampler.sample_once()).collectors["hung"].up and snapshot,
                           what="the released collector back up")
        assert "gpuwatch_hung_value 1.0" in third.metrics().decode()
        assert hung.calls == 2  # submitted again only once the stuck call had returned
    finally:
        hung.release.set()
        sampler.close()


class _Counting(_Good):
    """Counts the rounds it was collected in."""

    def __init__(self, context):
        super().__init__(context)
        self.calls = 0

    def collect(self):
        self.calls += 1
        return super().collect()


def test_run_loop_samples_on_interval_and_stops():
    collector = _Counting(CollectorContext())
    sampler = Sampler([collector], interval=0.05, deadline=10.0, node="n", mode="real")
    thread = threading.Thread(target=sampler.run)
    thread.start()
    try:
        wait_until(lambda: collector.calls >= 3, what="three sampling rounds")
        assert "gpuwatch_good_value" in sampler.snapshot.metrics().decode()
    finally:
        sampler.stop()
        thread.join(30)
        sampler.close()
    assert not thread.is_alive()
    assert sampler.snapshot.timestamp > 0


class _Deferred(Collector):
    name = "deferred"

    def __init__(self, context):
        super().__init__(context)
        self.builds = 0

    def _build(self):
        self.builds += 1
        return [GaugeMetricFamily("gpuwatch_deferred_value", "Deferred.", value=self.builds)]

    def collect(self):
        return CollectorResult(DeferredFamilies(self._build))


def test_a_round_renders_nothing_until_its_snapshot_is_scraped():
    """At 1 s sampling and 15 s scrapes, 14 of 15 rounds are never served: they must not pay for rendering."""
    collector = _Deferred(CollectorContext())
    sampler = _sampler(collector)
    first = sampler.sample_once()
    second = sampler.sample_once()
    assert collector.builds == 0 and "_text" not in vars(second)
    assert b"gpuwatch_deferred_value 1.0" in second.metrics()
    assert second.metrics(gzip=True) and collector.builds == 1  # gzip compresses the cached text
    assert b"gpuwatch_deferred_value 2.0" in first.metrics()  # an older snapshot still renders whole
    assert collector.builds == 2


def test_the_gzip_of_a_page_is_the_page_whichever_writer_the_platform_has():
    """ISA-L's gzip where its wheel is installed, else the standard library's (a child without isal): either gives
    back, through the standard gzip reader as Prometheus's Go reader would, exactly the rendered text."""
    snapshot = _sampler(_Deferred(CollectorContext())).sample_once()
    assert gzip.decompress(snapshot.metrics(gzip=True)) == snapshot.metrics()
    fallback = ("import sys; sys.modules['isal'] = None\n"  # import isal raises ImportError
                "import gzip, gpuwatch.agent.snapshot as s\n"
                "page = b'gpuwatch_up 1.0\\n' * 1000\n"
                "assert s.gzip_compress.__module__ == 'gzip', s.gzip_compress.__module__\n"
                "assert gzip.decompress(s.gzip_compress(page, compresslevel=s.GZIP_LEVEL)) == page\n")
    result = subprocess.run([sys.executable, "-c", fallback], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_scrape_clock_expects_the_next_scrape_at_the_last_gap():
    clock = _Clock()
    scrapes = ScrapeClock(clock)
    scrapes.scraped()
    assert not scrapes.due_within(1.0)  # one scrape: no rhythm yet
    clock.now += 15
    scrapes.scraped()
    clock.now += 13.5
    assert not scrapes.due_within(1.0)  # next expected in 1.5 s
    clock.now += 0.6
    assert scrapes.due_within(1.0)
    clock.now += 10
    assert scrapes.due_within(1.0)  # overdue, the scraper may be late
    clock.now += 30
    assert not scrapes.due_within(1.0)  # gone for more than two gaps: stop rendering ahead


def _rounds_rendered_ahead(schedule: dict[str, list[int]], until: int = 60) -> list[float]:
    """Scrapers scraping at the seconds of their ``schedule``, a round (1 s sampling) at each half second: the rounds
    from 20 s on that a scrape is expected within a second of, the ones a sampler renders ahead."""
    clock = _Clock()
    scrapes, start, ahead = ScrapeClock(clock), clock.now, []
    for second in range(until):
        clock.now = start + second
        for scraper, seconds in schedule.items():
            if second in seconds:
                scrapes.scraped(scraper)
        clock.now += 0.5
        if second >= 20 and scrapes.due_within(1.0):
            ahead.append(second + 0.5)
    return ahead


def test_each_scraper_keeps_its_own_rhythm():
    """A highly available Prometheus pair scrapes 3 s apart every 15 s: rounds are rendered ahead just before each
    server's next scrape. One rhythm for both took the 3 s and 12 s gaps for the interval: it rendered ahead the 5
    rounds after each 3 s gap, none of them read, and none of the rounds the pair read."""
    pair = {"10.0.0.1": [0, 15, 30, 45], "10.0.0.2": [3, 18, 33, 48]}
    assert _rounds_rendered_ahead(pair) == [29.5, 32.5, 44.5, 47.5, 59.5]


def test_the_scrape_clock_forgets_the_longest_silent_scraper_past_its_bound():
    """10.0.0.1 scrapes at 0 and 15 s, then others once each at 16 s: with as many as the bound holds its next scrape is
    still expected at 30 s; with one more it is the longest silent, forgotten."""
    kept = {"10.0.0.1": [0, 15], **{f"10.0.1.{n}": [16] for n in range(snapshot_module.MAX_SCRAPERS - 1)}}
    assert _rounds_rendered_ahead(kept, until=31) == [29.5, 30.5]
    forgotten = {"10.0.0.1": [0, 15], **{f"10.0.1.{n}": [16] for n in range(snapshot_module.MAX_SCRAPERS)}}
    assert _rounds_rendered_ahead(forgotten, until=31) == []


def test_the_server_names_each_scraper_by_its_address(monkeypatch):
    """What the scrape clock keeps a rhythm for is the scraper's address, as the HTTP server saw it."""
    seen = []

    class Recording(ScrapeClock):
        def scraped(self, scraper: str = "") -> None:
            seen.append(scraper)
            super().scraped(scraper)

    monkeypatch.setattr(sampler_module, "ScrapeClock", Recording)
    sampler = Sampler([_Good(CollectorContext())], interval=1.0, deadline=10.0, node="n1", mode="simulated")
    server = AgentHTTPServer(("127.0.0.1", 0), lambda: sampler.snapshot, stale_after=3600.0)
    serve_in_thread(server)
    try:
        sampler.sample_once()
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        for headers in ({}, {"Accept-Encoding": "gzip"}):
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
                assert response.status == 200
    finally:
        server.shutdown()
        server.server_close()
        sampler.close()
    assert seen == ["127.0.0.1", "127.0.0.1"]


def test_the_round_a_regular_scraper_will_read_is_rendered_before_it_asks(monkeypatch):
    """Scrapes 0.05 s apart on the sampler's scrape clock (scripted) at a 0.05 s interval: the next round is due."""
    clock = _Clock()
    monkeypatch.setattr(sampler_module, "ScrapeClock", lambda: ScrapeClock(clock))
    collector = _Deferred(CollectorContext())
    sampler = Sampler([collector], interval=0.05, deadline=10.0, node="n1", mode="simulated")
    for _ in range(2):
        assert sampler.sample_once().metrics(gzip=True)  # two scrapes 0.05 s apart: one per round
        clock.now += 0.05
    builds = collector.builds
    ahead = sampler.sample_once()
    assert collector.builds == builds + 1 and "_gzip" in vars(ahead)  # rendered and compressed in the round
    assert b"gpuwatch_deferred_value" in gzip.decompress(ahead.metrics(gzip=True))
    assert collector.builds == builds + 1
    clock.now += 10  # the scraper went away: rounds are no longer rendered ahead
    assert "_gzip" not in vars(sampler.sample_once())


class _Absent(Collector):
    """A source that is not there (no driver) until ``present`` is set; notes when it runs, by the scripted clock."""

    name = "absent"

    def __init__(self, context, clock):
        super().__init__(context)
        self.clock = clock
        self.present = False
        self.runs = []

    def collect(self):
        self.runs.append(self.clock.now)
        if not self.present:
            raise CollectorError("no driver")
        return CollectorResult([GaugeMetricFamily("gpuwatch_absent_value", "Absent.", value=1)])


def _backing_off():
    clock = _Clock()
    absent = _Absent(CollectorContext(), clock)
    return clock, absent, Sampler([absent], interval=1.0, deadline=10.0, node="n1", mode="real", clock=clock)


def test_a_failing_collector_backs_off_until_it_succeeds_then_starts_over():
    """1,000 rounds of 1 s without the source: it runs after 2 s, 4, 8 … then every 5 minutes, and every round reports
    it down with the reason and when it runs next; once the source is there it is up at the next attempt, and a new
    failure backs off from 2 s again."""
    clock, absent, sampler = _backing_off()
    snapshots = []
    for _ in range(1000):
        snapshots.append(sampler.sample_once())
        clock.now += 1.0
    assert [b - a for a, b in itertools.pairwise(absent.runs)] == [2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert snapshots[0].collectors["absent"] == CollectorStatus(False, 0.0, "CollectorError: no driver",
                                                                next_attempt_seconds=2.0)
    # at 105 s: failed at 102 s for the second time, runs again at 106 s
    assert snapshots[5].collectors["absent"] == CollectorStatus(False, 0.0, "CollectorError: no driver",
                                                                next_attempt_seconds=1.0)
    assert 'gpuwatch_collector_up{collector="absent"} 0.0' in snapshots[5].metrics().decode()
    state = json.loads(snapshots[5].state_json)["collectors"]["absent"]
    assert state["last_error"] == "CollectorError: no driver" and state["next_attempt_seconds"] == 1.0

    absent.present = True  # the driver finished loading
    clock.now = absent.runs[-1] + 300
    assert sampler.sample_once().collectors["absent"].up
    absent.present = False
    clock.now += 1.0
    assert sampler.sample_once().collectors["absent"].next_attempt_seconds == 2.0


class _Empty(Collector):
    """A source with nothing on this node (no InfiniBand device), which says so for 60 s."""

    name = "empty"

    def __init__(self, context):
        super().__init__(context)
        self.runs = 0

    def collect(self):
        self.runs += 1
        return CollectorResult(DeferredFamilies(list), unchanged_for_seconds=60.0)


def test_a_result_that_holds_is_served_again_without_running_the_collector():
    clock = _Clock()
    empty = _Empty(CollectorContext())
    sampler = Sampler([empty], interval=1.0, deadline=10.0, node="n1", mode="real", clock=clock)
    first = sampler.sample_once()
    for _ in range(59):
        clock.now += 1.0
        again = sampler.sample_once()
        assert again.collectors["empty"] is first.collectors["empty"] and again.readings == first.readings
    assert empty.runs == 1 and first.collectors["empty"].up
    clock.now += 1.0
    sampler.sample_once()
    assert empty.runs == 2


def test_a_round_with_no_collector_due_runs_nothing_and_builds_nothing(monkeypatch):
    """While one collector backs off and the other's result holds, a round submits no work, waits for none, and
    builds no families: its cost is the snapshot's bookkeeping (their statuses and results, published again)."""
    clock = _Clock()
    absent, empty = _Absent(CollectorContext(), clock), _Empty(CollectorContext())
    sampler = Sampler([absent, empty], interval=1.0, deadline=10.0, node="n1", mode="real", clock=clock)
    sampler.sample_once()  # absent fails and backs off for 2 s; empty holds for 60 s
    submitted, waited = [], []
    for executor in sampler._executors.values():
        monkeypatch.setattr(executor, "submit", lambda *args: submitted.append(args))
    monkeypatch.setattr(concurrent.futures, "wait", lambda *args, **kwargs: waited.append(args))
    clock.now += 1.0
    quiet = sampler.sample_once()
    assert absent.runs == [100.0] and empty.runs == 1 and submitted == [] and waited == []
    assert quiet.readings == {"empty": {}} and len(quiet.families) == 2  # the agent's own families and empty's
    assert all("_families" not in vars(family) for family in quiet.families)  # deferred, unbuilt
    assert "_text" not in vars(quiet)
    assert quiet.collectors["absent"].last_error == "CollectorError: no driver" and quiet.collectors["empty"].up


class _InMemory(_Absent):
    """Reads only the agent's own memory: cannot hang."""

    name = "in_memory"
    may_block = False

    def collect(self):
        self.thread = threading.current_thread()
        return super().collect()


def test_a_collector_that_cannot_block_runs_in_the_samplers_thread_and_fails_like_any_other():
    clock = _Clock()
    in_memory = _InMemory(CollectorContext(), clock)
    sampler = Sampler([in_memory], interval=1.0, deadline=10.0, node="n1", mode="real", clock=clock)
    failed = sampler.sample_once()
    assert in_memory.thread is threading.current_thread()  # no hand-off to a worker
    assert failed.collectors["in_memory"].last_error == "CollectorError: no driver"
    in_memory.present = True
    clock.now += 2.0  # its back-off
    assert "gpuwatch_absent_value 1.0" in sampler.sample_once().metrics().decode()


def test_a_simulated_agent_exports_what_its_simulation_cost_and_a_real_one_does_not():
    spent = iter((0.25, 0.75))
    simulated = Sampler([_Good(CollectorContext())], interval=1.0, node="n1", mode="simulated",
                        simulation_cpu=lambda: next(spent))
    real = Sampler([_Good(CollectorContext())], interval=1.0, node="n1", mode="real")
    try:
        assert b"gpuwatch_agent_simulation_cpu_seconds_total 0.25\n" in simulated.sample_once().metrics()
        assert b"gpuwatch_agent_simulation_cpu_seconds_total 0.75\n" in simulated.sample_once().metrics()
        assert b"simulation_cpu" not in real.sample_once().metrics()
    finally:
        simulated.close()
        real.close()
