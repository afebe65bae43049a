"""Host collector: real psutil values in range, CPU ratio arithmetic, watched pids, network interfaces."""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from gpuwatch.agent.collectors import host
from gpuwatch.agent.collectors.base import CollectorContext
from gpuwatch.agent.collectors.host import MAX_WATCHED_PIDS, HostCollector
from gpuwatch.agent.collectors.readings import AddressReading, HostReadings
from gpuwatch.agent.snapshot import Snapshot


def values(result, sample_name):
    return {tuple(s.labels.values()): s.value
            for family in result.families for s in family.samples if s.name == sample_name}


def only(result, sample_name):
    (value,) = values(result, sample_name).values()
    return value


@pytest.fixture
def collector():
    return HostCollector(CollectorContext())


def test_memory_load_and_own_process_are_present_and_in_range(collector):
    result = collector.collect()
    assert result.errors == []
    total = only(result, "gpuwatch_host_memory_total_bytes")
    assert total == psutil.virtual_memory().total
    assert 0 < only(result, "gpuwatch_host_memory_available_bytes") <= total
    assert 0 < only(result, "gpuwatch_host_memory_used_bytes") <= total
    assert only(result, "gpuwatch_host_cpus") == psutil.cpu_count()
    load = values(result, "gpuwatch_host_load_average")
    assert set(load) == {("1m",), ("5m",), ("15m",)} and all(v >= 0 for v in load.values())
    rss = values(result, "gpuwatch_host_process_resident_bytes")
    own = (str(os.getpid()), psutil.Process().name(), "", "")
    assert list(rss) == [own] and 1e6 < rss[own] < psutil.virtual_memory().total
    assert values(result, "gpuwatch_host_process_cpu_seconds_total")[own] > 0
    assert result.readings.memory_total_bytes == total and result.readings.cpu_count == psutil.cpu_count()
    state = json.loads(Snapshot(0.0, [], {}, {"host": result.readings}, {}).state_json)
    assert HostReadings.from_dict(state["facts"]["host"]) == result.readings


def test_cpu_ratio_is_busy_share_since_the_previous_sample(monkeypatch):
    scputimes = type(psutil.cpu_times())
    samples = iter([
        dict(user=100, system=50, idle=800, iowait=50, guest=20),
        dict(user=160, system=70, idle=860, iowait=70, guest=40),  # +80 busy, +80 idle/iowait; +20 guest
    ])

    def cpu_times():
        times = next(samples)
        return scputimes(*(float(times.get(name, 0)) for name in scputimes._fields))

    monkeypatch.setattr(host.psutil, "cpu_times", cpu_times)
    result = HostCollector(CollectorContext()).collect()
    # Guest time is already inside user time: counted once. Busy 60+20, idle+iowait 60+20.
    assert only(result, "gpuwatch_host_cpu_utilization_ratio") == pytest.approx(0.5)
    assert result.readings.cpu_ratio == pytest.approx(0.5)


def test_real_cpu_ratio_is_in_range(collector):
    collector.collect()
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # busy, so clock ticks pass and some are busy
        pass
    result = collector.collect()
    assert 0.0 < only(result, "gpuwatch_host_cpu_utilization_ratio") <= 1.0


def test_ranks_are_exported_with_their_job_and_rank_and_dropped_when_they_exit(collector):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        collector.watch_ranks(lambda: {child.pid: ("llm", 3), 2**22 + 12345: ("llm", 4)})  # the second is gone
        result = collector.collect()
        rss = values(result, "gpuwatch_host_process_resident_bytes")
        assert rss[(str(child.pid), psutil.Process(child.pid).name(), "llm", "3")] > 0
        assert len(rss) == 2 and result.errors == []
        assert (str(child.pid), psutil.Process(child.pid).name(), "llm", "3") in values(
            result, "gpuwatch_host_process_cpu_seconds_total")
        assert {p.pid for p in result.readings.processes} == {os.getpid(), child.pid}
    finally:
        child.kill()
        child.wait()
    result = collector.collect()
    watched = values(result, "gpuwatch_host_process_resident_bytes")
    assert [labels[0] for labels in watched] == [str(os.getpid())]
    assert result.errors == []


def test_watched_ranks_are_bounded(collector):
    collector.watch_ranks(lambda: {pid: ("j", pid) for pid in range(10**7, 10**7 + MAX_WATCHED_PIDS + 5)})
    result = collector.collect()
    assert result.errors == [f"5 pids beyond the limit of {MAX_WATCHED_PIDS} not watched"]
    collector.watch_ranks(dict)
    assert collector.collect().errors == []


def test_network_interfaces_include_loopback_marked_as_such(collector):
    interfaces = {i.name: i for i in collector.collect().readings.network_interfaces}
    loopbacks = [i for i in interfaces.values() if i.is_loopback]
    assert [i.name for i in loopbacks] == ["lo"]
    assert interfaces["lo"].up is True
    assert AddressReading(family="ipv4", address="127.0.0.1") in interfaces["lo"].addresses
    assert set(interfaces) == set(psutil.net_if_stats())


def test_interfaces_and_cpu_count_are_read_again_only_after_the_refresh_period(monkeypatch):
    """Listing interfaces was half the collector's round; they and the CPU count are read once per
    STATIC_REFRESH_SECONDS, and a changed count is reported from the next refresh on."""
    now = [100.0]
    collector = HostCollector(CollectorContext(), clock=lambda: now[0])
    reads, cpus, counts = [], [4], []
    monkeypatch.setattr(host, "_network_interfaces", lambda: (reads.append(now[0]), ())[1])
    monkeypatch.setattr(host.psutil, "cpu_count", lambda: cpus[0])
    for second in range(121):  # two minutes of 1 s rounds; a CPU comes online after 30 s
        if second == 30:
            cpus[0] = 5
        counts.append(collector.collect().readings.cpu_count)
        now[0] += 1.0
    assert reads == [100.0, 100.0 + host.STATIC_REFRESH_SECONDS, 100.0 + 2 * host.STATIC_REFRESH_SECONDS]
    assert counts == [4] * 60 + [5] * 61
