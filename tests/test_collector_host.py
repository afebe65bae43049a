"""Host collector: real psutil values in range, CPU ratio arithmetic, watched pids, network interfaces and their
traffic."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpuwatch.agent.collectors import host
from gpuwatch.agent.collectors._procfs import ProcCounters, PsutilCounters
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


def _procfs(root: Path, cpu_ticks: list[int], meminfo: bytes | None = None) -> Path:
    """A /proc with the files the host collector keeps open: /proc/stat's cpu line with ``cpu_ticks`` (user nice system
    idle iowait irq softirq steal guest guest_nice), this machine's /proc/meminfo (or ``meminfo``) and a statm."""
    (root / "self").mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text("cpu  " + " ".join(map(str, cpu_ticks)) + "\ncpu0 " + " ".join(map(str, cpu_ticks))
                               + "\nintr 1 2 3\n")  # rewritten in place: the collector's open file sees it
    (root / "meminfo").write_bytes(Path("/proc/meminfo").read_bytes() if meminfo is None else meminfo)
    (root / "self" / "statm").write_text("51234 12800 2400 1 0 9000 0\n")
    (root / "net").mkdir(exist_ok=True)
    (root / "net" / "dev").write_bytes(Path("/proc/net/dev").read_bytes())
    return root


def test_cpu_ratio_is_busy_share_since_the_previous_sample(tmp_path):
    procfs = _procfs(tmp_path, [100, 0, 50, 800, 50, 0, 0, 0, 20, 0])
    collector = HostCollector(CollectorContext(), procfs=procfs)
    _procfs(tmp_path, [160, 0, 70, 860, 70, 0, 0, 0, 40, 0])  # +80 busy, +80 idle/iowait; +20 guest
    result = collector.collect()
    # Guest time is already inside user time: counted once. Busy 60+20, idle+iowait 60+20.
    assert only(result, "gpuwatch_host_cpu_utilization_ratio") == pytest.approx(0.5)
    assert result.readings.cpu_ratio == pytest.approx(0.5)
    rss = values(result, "gpuwatch_host_process_resident_bytes")
    assert list(rss.values()) == [12800 * os.sysconf("SC_PAGE_SIZE")]  # statm's resident pages


def test_proc_files_read_what_psutil_reads_from_the_same_files(tmp_path, monkeypatch):
    procfs = _procfs(tmp_path, [4705, 150, 1120, 95021, 311, 0, 59, 7, 12, 3])
    through_psutil = PsutilCounters()  # its own process found on the real /proc
    monkeypatch.setattr(psutil, "PROCFS_PATH", str(procfs))
    counters = ProcCounters(procfs)
    try:
        virtual = psutil.virtual_memory()
        assert counters.memory() == (virtual.total, virtual.available, virtual.used)
        busy, total = counters.cpu_busy_and_total()
        psutil_busy, psutil_total = through_psutil.cpu_busy_and_total()
        ticks = os.sysconf("SC_CLK_TCK")
        assert (busy / ticks, total / ticks) == (pytest.approx(psutil_busy), pytest.approx(psutil_total))
        assert counters.network_counters() == through_psutil.network_counters()  # the same /proc/net/dev
    finally:
        counters.close()
    monkeypatch.undo()  # psutil back on the real /proc
    live = ProcCounters()
    try:  # this process's resident set, read twice: the same pages, give or take an allocation
        assert live.own_resident_bytes() == pytest.approx(psutil.Process().memory_info().rss, abs=4 << 20)
    finally:
        live.close()


@pytest.mark.parametrize("available", [None, 0, 10**9])
def test_memory_without_a_usable_memavailable_is_left_to_psutil(tmp_path, available):
    lines = [b"MemTotal:        1000000 kB", b"MemFree:          200000 kB"]
    if available is not None:
        lines.append(b"MemAvailable:    %d kB" % available)
    procfs = _procfs(tmp_path, [1] * 10, b"\n".join(lines) + b"\n")
    counters = ProcCounters(procfs)
    try:
        assert counters.memory() is None  # absent, 0 (a kernel bug psutil works around) or above the total
    finally:
        counters.close()
    readings = HostCollector(CollectorContext(), procfs=procfs).collect().readings
    assert readings.memory_total_bytes == psutil.virtual_memory().total  # psutil's, from this machine's /proc


def test_without_the_proc_files_the_collector_reads_through_psutil(tmp_path):
    collector = HostCollector(CollectorContext(), procfs=tmp_path / "no-proc")
    result = collector.collect()
    assert result.errors == []
    assert only(result, "gpuwatch_host_memory_total_bytes") == psutil.virtual_memory().total
    own = (str(os.getpid()), psutil.Process().name(), "", "")
    assert values(result, "gpuwatch_host_process_resident_bytes")[own] > 1e6


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


NET_DEV = b"""Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier
    lo: %d 10 0 0 0 0 0 0 %d 10 0 0 0 0 0 0
  eth0: %d 900 2 1 0 0 0 0 %d 800 3 4 0 0 0 0
 veth9: 5 1 0 0 0 0 0 0 6 1 0 0 0 0 0 0
"""


def test_traffic_history_keeps_a_sample_every_spacing_the_latest_always_and_exports_counters(tmp_path, monkeypatch):
    """One round a second for 40 s, eth0 receiving 1 MB and sending 2 MB a second: samples 5 s apart (and the latest)
    with /proc/net/dev's counters, loopback left out, interfaces with an address first; the latest exported."""
    procfs = _procfs(tmp_path, [1] * 10)
    now = [1000.0]
    monkeypatch.setattr(host, "_network_interfaces", lambda: (
        host.InterfaceReading("eth0", True, addresses=(AddressReading("ipv4", "10.0.0.1"),), speed_mbps=25000),
        host.InterfaceReading("lo", True, is_loopback=True), host.InterfaceReading("veth9", True)))
    collector = HostCollector(CollectorContext(), clock=lambda: now[0], procfs=procfs, wall_clock=lambda: now[0])
    for second in range(41):
        (procfs / "net" / "dev").write_bytes(NET_DEV % (7, 7, 10**6 * second, 2 * 10**6 * second))
        result = collector.collect()
        now[0] += 1.0
    history = result.readings.network_traffic
    assert [sample.time for sample in history] == [1000.0, 1005.0, 1010.0, 1015.0, 1020.0, 1025.0, 1030.0, 1035.0,
                                                   1040.0]
    assert [i.name for i in history[-1].interfaces] == ["eth0", "veth9"]
    eth0 = history[-1].interfaces[0]
    assert (eth0.receive_bytes, eth0.transmit_bytes, eth0.errors, eth0.drops) == (40 * 10**6, 80 * 10**6, 5, 5)
    assert values(result, "gpuwatch_network_transmit_bytes_total") == {("eth0",): 80e6, ("veth9",): 6.0}
    assert values(result, "gpuwatch_network_drops_total")[("eth0",)] == 5
    assert values(result, "gpuwatch_network_speed_bytes_per_second") == {("eth0",): 25e9 / 8}
    assert values(result, "gpuwatch_network_interface_info") == {
        ("eth0", "up", "false", "10.0.0.1"): 1, ("lo", "up", "true", ""): 1, ("veth9", "up", "false", ""): 1}
    state = json.loads(Snapshot(0.0, [], {}, {"host": result.readings}, {}).state_json)
    assert HostReadings.from_dict(state["facts"]["host"]).network_traffic == history
    for _ in range(host.TRAFFIC_SAMPLES * 6):  # bounded: a sample every 5 s, TRAFFIC_SAMPLES of them
        now[0] += 1.0
        collector.collect()
    assert len(collector.collect().readings.network_traffic) == host.TRAFFIC_SAMPLES
