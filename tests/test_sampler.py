"""Sampler: one failing or hung collector never takes the others down; snapshots are whole."""

import json
import threading
import time

from prometheus_client.core import GaugeMetricFamily

from gpuwatch.agent.collectors.base import Collector, CollectorContext, CollectorResult
from gpuwatch.agent.sampler import Sampler


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


def _sampler(*collectors, deadline=0.2):
    return Sampler(collectors, interval=1.0, deadline=deadline, node="n1", mode="simulated")


def test_failing_collector_is_down_with_its_error_and_others_are_served():
    context = CollectorContext()
    snapshot = _sampler(_Good(context), _Broken(context)).sample_once()
    text = snapshot.metrics_text.decode()
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
    sampler = _sampler(_Good(context), hung)
    try:
        started = time.monotonic()
        first = sampler.sample_once()
        assert time.monotonic() - started < 2.0
        assert first.collectors["hung"].up is False
        assert "timed out" in first.collectors["hung"].last_error
        assert first.collectors["good"].up is True
        second = sampler.sample_once()
        assert second.collectors["hung"].last_error == "still blocked in a previous collection"
        assert hung.calls == 1  # no pile-up of threads behind a stuck call
        hung.release.set()
        time.sleep(0.05)
        third = sampler.sample_once()
        assert third.collectors["hung"].up is True
        assert "gpuwatch_hung_value 1.0" in third.metrics_text.decode()
    finally:
        hung.release.set()
        sampler.close()


def test_run_loop_samples_on_interval_and_stops():
    context = CollectorContext()
    sampler = Sampler([_Good(context)], interval=0.05, deadline=0.5, node="n", mode="real")
    thread = threading.Thread(target=sampler.run)
    thread.start()
    time.sleep(0.3)
    sampler.stop()
    thread.join(2)
    assert not thread.is_alive()
    assert sampler.snapshot.timestamp > 0
    assert "gpuwatch_good_value" in sampler.snapshot.metrics_text.decode()
