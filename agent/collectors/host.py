"""The host around the GPUs, via psutil and, for what it reads every round, /proc files kept open (``_procfs``): CPU,
load, memory, resident memory of watched processes, and the network interfaces: their state, addresses and link speed
(diagnosis checks NCCL_SOCKET_IFNAME against them and rates a socket path by the speed) and their traffic counters
(diagnosis reads what a job's NICs carried over its step window from a short history of them, ``network_traffic``).

Which processes are training ranks is not the host's to know: the agent's own process is always
watched, and whoever learns the ranks' pids (the telemetry collector, from the kernel's credentials on each
record) is asked for them every round through ``watch_ranks`` (the ranks as of the store's last read: a rank is
watched from the first round rendered after its hello).
"""

from __future__ import annotations

import collections
import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil
from prometheus_client.core import Metric

from gpuwatch.agent.collectors._procfs import open_counters, psutil_memory
from gpuwatch.agent.collectors.base import (
    Collector,
    CollectorContext,
    CollectorResult,
    DeferredFamilies,
)
from gpuwatch.agent.collectors.readings import (
    AddressReading,
    HostReadings,
    InterfaceReading,
    InterfaceTrafficReading,
    ProcessReading,
    TrafficSample,
)
from gpuwatch.agent.metricspec import MetricSpec

#: Bounds gpuwatch_host_process_*: a buggy feeder cannot create unbounded series.
MAX_WATCHED_PIDS = 256

#: Seconds between two reads of what changes when an administrator, a driver or a hot-plug changes it, not from one
#: second to the next: the network interfaces (an ioctl per interface and address: half of the host collector's
#: round, 150 of 300 µs; only diagnosis reads them, NCCL_SOCKET_IFNAME against them, no series) and the count of
#: logical CPUs (a sysfs file: ~37 µs of an idle agent's ~550 µs round, measured in the agent's thread).
STATIC_REFRESH_SECONDS = 60.0

#: At most this many interfaces' traffic is kept and exported: the non-loopback ones, those with an address first (a
#: Kubernetes node has a veth per pod, none of which carries a job's collectives across nodes).
MAX_TRAFFIC_INTERFACES = 16
#: The traffic history keeps a sample at least this many seconds apart (and always the latest) ...
TRAFFIC_SPACING_SECONDS = 5.0
#: ... this many of them: 64 × 5 s covers a rank's longest step window (``telemetry.window.WINDOW_SECONDS``, 300 s).
TRAFFIC_SAMPLES = 64

#: pid -> (job, rank) of the training ranks running on this host.
RankPids = Mapping[int, tuple[str, int]]

_FAMILIES = {socket.AF_INET: "ipv4", socket.AF_INET6: "ipv6", psutil.AF_LINK: "link"}

#: Host gauges, each of the HostReadings field it names; ``diagnose --prometheus`` reads the CPU count by CPUS.
CPU_UTILIZATION = MetricSpec("gpuwatch_host_cpu_utilization_ratio",
                             "Share of CPU time, all CPUs, not idle or in iowait since the previous sample.",
                             "ratio", "cpu_ratio")
CPUS = MetricSpec("gpuwatch_host_cpus", "Logical CPUs.", "", "cpu_count")
MEMORY_GAUGES = tuple(MetricSpec(f"gpuwatch_host_memory_{kind}_bytes",
                                 f"Host memory {kind} (/proc/meminfo; used: total less available).", "bytes",
                                 f"memory_{kind}_bytes") for kind in ("total", "available", "used"))
LOAD_AVERAGE = MetricSpec("gpuwatch_host_load_average", "Run-queue load average over the window.", labels=("window",))
#: The agent's process and the ranks', one series each.
_PROCESS_LABELS = ("pid", "name", "job", "rank")
PROCESS_RESIDENT = MetricSpec("gpuwatch_host_process_resident_bytes", "Resident set size of the agent (job and rank "
                              "empty) and of the training ranks that report to it.", "bytes", "rss_bytes",
                              labels=_PROCESS_LABELS)
PROCESS_CPU = MetricSpec("gpuwatch_host_process_cpu_seconds", "CPU time, user and system, of the agent (job and rank "
                         "empty) and of the training ranks that report to it.", "seconds", "cpu_seconds",
                         kind="counter", labels=_PROCESS_LABELS)

#: The network interfaces: identity and state (static, as the interface list), link speed, and traffic counters.
_INTERFACE = ("interface",)
NETWORK_INFO = MetricSpec("gpuwatch_network_interface_info", "A network interface: state (up/down), whether it is "
                          "the loopback, its IP addresses (space-separated); value 1.", kind="info",
                          labels=("interface", "state", "loopback", "addresses"))
NETWORK_SPEED = MetricSpec("gpuwatch_network_speed_bytes_per_second", "Negotiated link speed of the interface "
                           "(/sys/class/net/NAME/speed), where the driver reports one.", "bytes_per_second",
                           labels=_INTERFACE)
NETWORK_RECEIVED = MetricSpec("gpuwatch_network_receive_bytes", "Bytes the interface received (/proc/net/dev).",
                              "bytes", "receive_bytes", kind="counter", labels=_INTERFACE)
NETWORK_TRANSMITTED = MetricSpec("gpuwatch_network_transmit_bytes", "Bytes the interface transmitted "
                                 "(/proc/net/dev).", "bytes", "transmit_bytes", kind="counter", labels=_INTERFACE)
NETWORK_ERRORS = MetricSpec("gpuwatch_network_errors", "Receive and transmit errors of the interface "
                            "(/proc/net/dev).", "", "errors", kind="counter", labels=_INTERFACE)
NETWORK_DROPS = MetricSpec("gpuwatch_network_drops", "Packets the interface dropped, receiving and transmitting "
                           "(/proc/net/dev).", "", "drops", kind="counter", labels=_INTERFACE)
_TRAFFIC_COUNTERS = (NETWORK_RECEIVED, NETWORK_TRANSMITTED, NETWORK_ERRORS, NETWORK_DROPS)


class HostCollector(Collector):
    """CPU, load, memory, and the resident memory and CPU time of the agent and of the training ranks that
``watch_ranks`` names."""

    name = "host"

    def __init__(self, context: CollectorContext, clock: Callable[[], float] = time.monotonic,
                 procfs: Path = Path("/proc"), wall_clock: Callable[[], float] = time.time) -> None:
        super().__init__(context)
        self._clock = clock
        self._wall_clock = wall_clock
        self._traffic: collections.deque[TrafficSample] = collections.deque(maxlen=TRAFFIC_SAMPLES)
        self._counters = open_counters(procfs)
        self._static: tuple[int | None, tuple[InterfaceReading, ...]] = (None, ())  # CPU count, interfaces
        self._static_read_at: float | None = None
        # Own baseline instead of psutil.cpu_percent's per-thread one: same "since the last call"
        # semantics, independent of which thread samples.
        self._last_cpu = self._counters.cpu_busy_and_total()
        self._own_pid = os.getpid()
        self._own_name = psutil.Process(self._own_pid).name()
        self._ranks: Callable[[], RankPids] = dict
        self._processes: dict[int, psutil.Process] = {}

    def watch_ranks(self, ranks: Callable[[], RankPids]) -> None:
        """Ask ``ranks`` every round which processes are training ranks (pid -> job and rank)."""
        self._ranks = ranks

    def collect(self) -> CollectorResult[HostReadings]:
        errors: list[str] = []
        busy, total = self._counters.cpu_busy_and_total()
        last_busy, last_total = self._last_cpu
        self._last_cpu = busy, total
        # Clamped: iowait in /proc/stat can step backwards (a known kernel quirk psutil also works around).
        cpu_ratio = None
        if total > last_total:
            cpu_ratio = min(1.0, max(0.0, (busy - last_busy) / (total - last_total)))
        memory_total, memory_available, memory_used = self._counters.memory() or psutil_memory()
        cpu_count, interfaces = self._static_facts()
        readings = HostReadings(
            cpu_ratio=cpu_ratio,
            cpu_count=cpu_count,
            load_average=tuple(psutil.getloadavg()),
            memory_total_bytes=memory_total,
            memory_available_bytes=memory_available,
            memory_used_bytes=memory_used,
            processes=self._processes_rss(errors),
            network_interfaces=interfaces,
            network_traffic=self._traffic_history(interfaces),
        )
        # Deferred to the render, like the other collectors': rounds nobody renders never build them.
        return CollectorResult(DeferredFamilies(lambda: _families(readings)), readings, errors)

    def close(self) -> None:
        self._counters.close()

    def _static_facts(self) -> tuple[int | None, tuple[InterfaceReading, ...]]:
        """The CPU count and the network interfaces as read at most STATIC_REFRESH_SECONDS ago."""
        now = self._clock()
        if self._static_read_at is None or now - self._static_read_at >= STATIC_REFRESH_SECONDS:
            self._static, self._static_read_at = (psutil.cpu_count(), _network_interfaces()), now
        return self._static

    def _traffic_history(self, interfaces: tuple[InterfaceReading, ...]) -> tuple[TrafficSample, ...]:
        """This round's traffic counters added to the history, whose latest sample is always this round's: in place
        of the latest until that is TRAFFIC_SPACING_SECONDS after the one before it, which it then stays."""
        loopbacks = {i.name for i in interfaces if i.is_loopback} | {"lo"}
        with_address = {i.name for i in interfaces if i.ip_addresses}
        counters = self._counters.network_counters()
        kept = sorted((name for name in counters if name not in loopbacks),
                      key=lambda name: (name not in with_address, name))[:MAX_TRAFFIC_INTERFACES]
        sample = TrafficSample(self._wall_clock(), tuple(
            InterfaceTrafficReading(name, *counters[name]) for name in sorted(kept)))
        history = self._traffic
        if len(history) >= 2 and history[-1].time - history[-2].time < TRAFFIC_SPACING_SECONDS:
            history[-1] = sample
        else:
            history.append(sample)
        return tuple(history)

    def _processes_rss(self, errors: list[str]) -> tuple[ProcessReading, ...]:
        """RSS and CPU time of the agent and the ranks' processes; a process that exited is dropped, not an
        error. At most MAX_WATCHED_PIDS ranks, lowest pids first."""
        ranks = dict(self._ranks())
        ranks.pop(self._own_pid, None)
        if len(ranks) > MAX_WATCHED_PIDS:
            errors.append(f"{len(ranks) - MAX_WATCHED_PIDS} pids beyond the limit of {MAX_WATCHED_PIDS} not watched")
        pids = sorted(ranks)[:MAX_WATCHED_PIDS]
        for gone in self._processes.keys() - set(pids):
            del self._processes[gone]
        rows = [self._own_reading()]
        for pid in pids:
            job, rank = ranks[pid]
            try:
                # Made once per pid: the telemetry collector stops naming a rank's pid once its process exits, so a
                # pid reused by another process is not met here. (``is_running``, which also catches reuse, read
                # /proc/PID/stat a second time each round: a quarter of an idle agent's host collection.)
                process = self._processes.get(pid)
                if process is None:
                    process = self._processes[pid] = psutil.Process(pid)
                with process.oneshot():
                    times = process.cpu_times()
                    rows.append(ProcessReading(pid=pid, name=process.name(), job=job, rank=str(rank),
                                               rss_bytes=process.memory_info().rss,
                                               cpu_seconds=times.user + times.system))
            except psutil.NoSuchProcess:
                self._processes.pop(pid, None)
            except psutil.Error as exc:
                errors.append(f"pid {pid}: {exc}")
        return tuple(rows)

    def _own_reading(self) -> ProcessReading:
        """The agent's own row: its CPU time from times(2), the same clock ticks /proc/self/stat holds, its resident
        set from /proc/self/statm kept open (``_procfs``), and its name read once. Through psutil's ``oneshot`` (a
        parse of /proc/self/stat) the row cost an idle agent's host round ~190 µs of its ~550; then ~80 of ~360
        (thread CPU time, 1 s rounds)."""
        times = os.times()
        return ProcessReading(pid=self._own_pid, name=self._own_name, job="", rank="",
                              rss_bytes=self._counters.own_resident_bytes(), cpu_seconds=times.user + times.system)


def _families(readings: HostReadings) -> list[Metric]:
    families: list[Metric] = []
    if readings.cpu_ratio is not None:
        families.append(CPU_UTILIZATION.family(readings.cpu_ratio))
    families.append(CPUS.family(readings.cpu_count))
    load = LOAD_AVERAGE.family()
    for window, value in zip(("1m", "5m", "15m"), readings.load_average, strict=True):
        load.add_metric([window], value)
    families.append(load)
    families += [spec.family(getattr(readings, spec.field)) for spec in MEMORY_GAUGES]
    rss, cpu = PROCESS_RESIDENT.family(), PROCESS_CPU.family()
    for process in readings.processes:
        names = [str(process.pid), process.name, process.job, process.rank]
        rss.add_metric(names, process.rss_bytes)
        cpu.add_metric(names, process.cpu_seconds)
    return [*families, rss, cpu, *_network_families(readings)]


def _network_families(readings: HostReadings) -> list[Metric]:
    """Each interface's identity and speed, and the traffic counters of those the history keeps."""
    info, speed = NETWORK_INFO.family(), NETWORK_SPEED.family()
    for interface in readings.network_interfaces:
        info.add_metric([interface.name, "up" if interface.up else "down", str(interface.is_loopback).lower(),
                         " ".join(interface.ip_addresses)], 1)
        if interface.speed_bytes_per_second:
            speed.add_metric([interface.name], interface.speed_bytes_per_second)
    counters = [spec.family() for spec in _TRAFFIC_COUNTERS]
    for traffic in readings.network_traffic[-1].interfaces if readings.network_traffic else ():
        for spec, family in zip(_TRAFFIC_COUNTERS, counters, strict=True):
            family.add_metric([traffic.name], getattr(traffic, spec.field))
    return [info, speed, *counters]


def _network_interfaces() -> tuple[InterfaceReading, ...]:
    addresses = psutil.net_if_addrs()
    return tuple(
        InterfaceReading(
            name=name,
            up=stat.isup,
            is_loopback="loopback" in getattr(stat, "flags", "").split(","),
            mtu=stat.mtu,
            speed_mbps=stat.speed or None,  # psutil reports 0 when the speed is unknown
            addresses=tuple(AddressReading(_FAMILIES.get(address.family, str(address.family)), address.address)
                            for address in addresses.get(name, [])),
        )
        for name, stat in sorted(psutil.net_if_stats().items())
    )
