"""InfiniBand and RoCE ports, read from ``<sysfs_root>/class/infiniband/<device>/ports/<port>``.

The layout, the counter names and their bit widths are the kernel's (drivers/infiniband/core/sysfs.c):
``counters/`` holds the PortCounters attribute of the IB spec, whose fixed-width counters saturate
(stick at all ones) instead of wrapping. When the HCA advertises extended width, the data and packet
counters come from PortCountersExtended (64-bit) instead; ``unicast_*``/``multicast_*`` exist only in
that case. Kernels before 4.5 put the 64-bit ones in ``counters_ext/`` under other names.

Every value costs only itself: a file that reads ``N/A (no PMA)`` or fails with EINVAL/EIO/ENOSYS
(real driver quirks) is left out and listed in ``result.errors``; the port, the device and the other
ports are still exported. A device removed between the listing and its read is skipped, not an error.

Counters are exported exactly as read, never accumulated by the agent: a reset (``perfquery -R``, a
driver reload) is a decrease, which ``rate()`` and ``increase()`` treat as a counter reset, and an
agent restart changes no value at all.

The ~50 attributes of a port stay open between collects (``SysfsFiles``), its directories' listings are reused
while the directories stand, and the families are built from the readings only when the round is rendered: what
collecting costs is one pread(2) per value and one stat(2) per directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import resource
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import Metric

from gpuwatch.agent.collectors.base import (
    Collector,
    CollectorContext,
    CollectorError,
    CollectorResult,
    DeferredFamilies,
)
from gpuwatch.agent.collectors.readings import IbDeviceReading, IbPortReading, InfinibandReadings
from gpuwatch.agent.metricspec import MetricSpec

CLASS_DIR = "class/infiniband"

#: Logical port state (IB PortState), as the kernel prints it in ``state``: "4: ACTIVE".
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
ACTIVE = 4
#: Physical port state (IB PortPhysicalState), as the kernel prints it in ``phys_state``: "5: LinkUp".
PHYS_STATES = {
    0: "<unknown>", 1: "Sleep", 2: "Polling", 3: "Disabled", 4: "PortConfigurationTraining",
    5: "LinkUp", 6: "LinkErrorRecovery", 7: "Phy Test",
}

#: Bit width of each ``counters/`` file as the PortCounters attribute defines it.
PORT_COUNTER_BITS = {
    "symbol_error": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16,
    "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16,
    "port_xmit_constraint_errors": 8,
    "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
    "VL15_dropped": 16,
    "port_xmit_data": 32,
    "port_rcv_data": 32,
    "port_xmit_packets": 32,
    "port_rcv_packets": 32,
    "port_xmit_wait": 32,
}
#: 64-bit in the extended group, where the kernel takes them from PortCountersExtended.
EXTENDED_COUNTERS = frozenset({"port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets"})
#: Only in the extended (IETF) group: their presence proves the data and packet counters are 64-bit.
IETF_COUNTERS = (
    "unicast_xmit_packets", "unicast_rcv_packets", "multicast_xmit_packets", "multicast_rcv_packets",
)
#: Pre-4.5 kernels' ``counters_ext/`` names for the 64-bit counters; preferred over ``counters/``.
LEGACY_EXT_COUNTERS = {
    "port_xmit_data_64": "port_xmit_data",
    "port_rcv_data_64": "port_rcv_data",
    "port_xmit_packets_64": "port_xmit_packets",
    "port_rcv_packets_64": "port_rcv_packets",
    "port_unicast_xmit_packets": "unicast_xmit_packets",
    "port_unicast_rcv_packets": "unicast_rcv_packets",
    "port_multicast_xmit_packets": "multicast_xmit_packets",
    "port_multicast_rcv_packets": "multicast_rcv_packets",
}

#: Traffic counters: file -> (IbPortReading field, also the family's name after gpuwatch_ib_port_; HELP;
#: multiplier to the unit).
TRAFFIC_COUNTERS = {
    # The data counters count 4-byte words (IB spec: octets divided by 4).
    "port_xmit_data": ("transmitted_bytes", "Bytes transmitted by the port (port_xmit_data x 4).", 4),
    "port_rcv_data": ("received_bytes", "Bytes received by the port (port_rcv_data x 4).", 4),
    "port_xmit_packets": ("transmitted_packets", "Packets transmitted by the port, all VLs.", 1),
    "port_rcv_packets": ("received_packets", "Packets received by the port, all VLs, errors included.", 1),
    "unicast_xmit_packets": ("transmitted_unicast_packets", "Unicast packets transmitted.", 1),
    "unicast_rcv_packets": ("received_unicast_packets", "Unicast packets received.", 1),
    "multicast_xmit_packets": ("transmitted_multicast_packets", "Multicast packets transmitted.", 1),
    "multicast_rcv_packets": ("received_multicast_packets", "Multicast packets received.", 1),
    "port_xmit_wait": ("transmit_wait_ticks", "Ticks in which the port had data to send but no flow-control "
                       "credits (congestion); the tick length is the HCA's.", 1),
}
#: Everything else in ``counters/`` is an error counter (what ibqueryerrors reports).
ERROR_COUNTERS = tuple(name for name in PORT_COUNTER_BITS if name not in TRAFFIC_COUNTERS)
_COUNTER_FILES = (*PORT_COUNTER_BITS, *IETF_COUNTERS)
#: ``hw_counters/lifespan`` is the driver's cache period in ms, not a counter.
HW_COUNTER_SKIP = frozenset({"lifespan"})

_GBIT = 1e9 / 8
#: An HCA's sysfs attributes: the files read, the labels of gpuwatch_ib_device_info and IbDeviceReading's fields.
_DEVICE_ATTRS = ("board_id", "fw_ver", "hca_type", "node_guid")


#: Seconds a node without InfiniBand devices is not looked at again: an HCA appears with a driver load or a hot-plug,
#: rarely, and its series a minute later is soon enough; until then the collector costs the sampler nothing.
RESCAN_ABSENT_SECONDS = 60.0

#: Read errors after which an open attribute is reopened: its device went away (and may be back).
_GONE = frozenset({errno.ENODEV, errno.ENOENT, errno.ESTALE, errno.EBADF})
#: At most this many attributes stay open (a DGX H100 reads ~420), fewer under a low RLIMIT_NOFILE.
MAX_OPEN_FILES = 1024
#: Seconds a directory's listing is reused while the directory's inode and mtime stand. Listing a port's directories
#: (getdents and an inode per name, ~40 directories) was half of the collector's round on a simulated DGX H100 (0.55
#: of 1.1 ms); a stat(2) is a few µs. sysfs does not always move a directory's mtime when an attribute is added to an
#: existing one, so a listing is also renewed at this age.
LISTING_TTL_SECONDS = 60.0
#: A directory modified less than this long ago is listed again every round: a change within the file system's
#: timestamp granularity (a jiffy on many) would leave its mtime as it was (git's "racily clean" entries, same cure).
RACY_SECONDS = 2.0


def _decoded(data: bytes) -> str:
    """An attribute's text without its newline (``int()`` takes the bytes as they are)."""
    return data.decode("utf-8", "replace").strip()


class SysfsFiles:
    """Sysfs attributes kept open and re-read with ``pread(fd, 4096, 0)``.

    sysfs regenerates an attribute on every read at offset 0, so an open file reads a fresh value
    without an open(2) and close(2) per value and round. A file is reopened when its directory
    entry names another inode (trees outside sysfs, like the simulated one, replace files) or when
    a read fails as it does once the device is gone (ENODEV, ENOENT, ESTALE, EBADF). Files not read
    in a round are closed at ``sweep``; beyond ``limit`` open files, a file is opened per read.
    Directory listings are kept the same way, each while its directory's inode and mtime stand (and for at most
    LISTING_TTL_SECONDS by ``clock``).
    """

    def __init__(self, limit: int = MAX_OPEN_FILES, clock: Callable[[], float] = time.monotonic) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        # Half the soft limit at most: the agent's sockets and NVML need the rest.
        self.limit = limit if soft == resource.RLIM_INFINITY else min(limit, soft // 2)
        self._clock = clock
        self._kept: dict[str, tuple[int, int | None]] = {}  # path -> (fd, inode), open since an earlier round
        self._read: dict[str, tuple[int, int | None]] = {}  # the same, read in this round
        self._listings: dict[str, _Listing] = {}  # directory -> its listing, made in an earlier round
        self._listed: dict[str, _Listing] = {}  # the same, used in this round

    def listdir(self, path: str) -> dict[str, int]:
        """Names in a directory and their inodes (from getdents: no stat(2) per name), as listed last while the
        directory's inode and mtime are the same, it was not modified just before, and the listing is young."""
        stat = os.stat(path)
        now = self._clock()
        listing = self._listings.pop(path, None) or self._listed.get(path)
        if listing is None or listing.stamp != (stat.st_ino, stat.st_mtime_ns) or now >= listing.renew_at:
            with os.scandir(path) as entries:
                names = {entry.name: entry.inode() for entry in entries}
            racy = time.time_ns() - stat.st_mtime_ns < RACY_SECONDS * 1e9
            listing = _Listing((stat.st_ino, stat.st_mtime_ns), now if racy else now + LISTING_TTL_SECONDS, names)
        self._listed[path] = listing
        return listing.names

    def read(self, path: str, inode: int | None) -> bytes:
        """What the attribute reads now; ``inode`` is what its directory listed (None: not listed)."""
        entry = self._kept.pop(path, None) or self._read.pop(path, None)
        if entry is not None:
            fd, opened = entry
            if opened == inode:
                try:
                    data = os.pread(fd, 4096, 0)
                except OSError as exc:
                    if exc.errno not in _GONE:  # EINVAL, EIO: the driver's answer, the file is fine
                        self._read[path] = entry
                        raise
                else:
                    self._read[path] = entry
                    return data
            _close([entry])
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.pread(fd, 4096, 0)
        except OSError:
            os.close(fd)
            raise
        if len(self._kept) + len(self._read) < self.limit:
            self._read[path] = (fd, inode)
        else:
            os.close(fd)
        return data

    def sweep(self) -> None:
        """Close the files this round did not read and forget the directories it did not list (ports and devices
        that went away)."""
        _close(self._kept.values())
        self._kept, self._read = self._read, {}
        self._listings, self._listed = self._listed, {}

    def close(self) -> None:
        _close([*self._kept.values(), *self._read.values()])
        self._kept, self._read = {}, {}


@dataclasses.dataclass(frozen=True, slots=True)
class _Listing:
    """A directory's names and their inodes, as listed when the directory had ``stamp`` (inode, mtime in ns)."""

    stamp: tuple[int, int]
    renew_at: float  # on SysfsFiles' clock
    names: dict[str, int]


def _close(entries: Iterable[tuple[int, int | None]]) -> None:
    for fd, _ in entries:
        with contextlib.suppress(OSError):  # EBADF: a descriptor the kernel already invalidated
            os.close(fd)


def parse_state(text: str) -> tuple[int, str]:
    """``"4: ACTIVE"`` -> ``(4, "ACTIVE")``."""
    number, sep, name = text.partition(":")
    if not sep:
        raise ValueError(f"expected 'ID: NAME', got {text!r}")
    return int(number), name.strip()


def parse_rate(text: str) -> float:
    """``"100 Gb/sec (4X EDR)"`` -> 12.5e9 bytes/s (the kernel always prints Gb/sec, maybe "2.5")."""
    parts = text.split()
    if len(parts) < 2 or parts[1] != "Gb/sec":
        raise ValueError(f"expected 'N Gb/sec (...)', got {text!r}")
    return float(parts[0]) * _GBIT


def _state_help(what: str, states: dict[int, str]) -> str:
    return f"{what}: " + ", ".join(f"{number} {name}" for number, name in states.items()) + "."


class InfinibandCollector(Collector):
    """One sample of every port under ``class/infiniband``; no device there means no ports, not an error."""

    name = "infiniband"

    def __init__(self, context: CollectorContext) -> None:
        super().__init__(context)
        self._files = SysfsFiles()

    def collect(self) -> CollectorResult[InfinibandReadings]:
        class_dir = os.path.join(self.context.sysfs_root, CLASS_DIR)
        try:
            devices = sorted(os.listdir(class_dir))
        except FileNotFoundError:
            devices = []
        except OSError as exc:
            raise CollectorError(f"cannot list {class_dir}: {exc.strerror}") from exc
        scan = _Scan(self._files)
        try:
            for device in devices:
                scan.device(device, f"{class_dir}/{device}")
        finally:
            self._files.sweep()
        readings = InfinibandReadings(tuple(scan.devices), tuple(scan.ports))
        # Deferred to the render: ~500 samples' families, built only for rounds that are rendered.
        return CollectorResult(DeferredFamilies(lambda: _families(readings)), readings, scan.errors,
                               unchanged_for_seconds=None if devices else RESCAN_ABSENT_SECONDS)

    def close(self) -> None:
        self._files.close()


class _Scan:
    """The readings and errors of one collect."""

    def __init__(self, files: SysfsFiles) -> None:
        self.files = files
        self.devices: list[IbDeviceReading] = []
        self.ports: list[IbPortReading] = []
        self.errors: list[str] = []

    # -- reading helpers: each failure costs one value and is recorded ----------------------------

    def _text(self, path: str, inode: int | None, optional: bool = False) -> str | None:
        try:
            return _decoded(self.files.read(path, inode))
        except OSError as exc:
            if not (optional and exc.errno == errno.ENOENT):
                self.errors.append(f"{path}: {exc.strerror or exc}")
            return None

    def _parsed(self, path: str, inode: int | None, parse: Callable[[str], Any]) -> Any:
        text = self._text(path, inode)
        if text is None:
            return None
        try:
            return parse(text)
        except ValueError:
            self.errors.append(f"{path}: unexpected content {text!r}")
            return None

    def _numbers(self, directory: str, listing: dict[str, int], names: Iterable[str]) -> dict[str, int]:
        """Integer attributes of one directory, by name; one loop, as they are most of the reads."""
        read, numbers = self.files.read, {}
        for name in names:
            path = f"{directory}/{name}"
            try:
                data = read(path, listing[name])
                numbers[name] = int(data)
            except OSError as exc:
                self.errors.append(f"{path}: {exc.strerror or exc}")
            except ValueError:
                self.errors.append(f"{path}: unexpected content {_decoded(data)!r}")
        return numbers

    def _listdir(self, path: str) -> dict[str, int]:
        """Names and inodes in a directory; absent (no ``counters_ext``, a device just removed) means empty."""
        try:
            return self.files.listdir(path)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            self.errors.append(f"{path}: {exc.strerror or exc}")
            return {}

    # -- devices and ports -------------------------------------------------------------------------

    def device(self, device: str, path: str) -> None:
        try:
            ports = sorted((p for p in os.listdir(f"{path}/ports") if p.isdigit()), key=int)
        except FileNotFoundError:
            return  # removed (hot unplug, driver reload) since the class directory was listed: gone, not broken
        except OSError as exc:
            self.errors.append(f"{path}/ports: {exc.strerror or exc}")
            ports = []
        listing = self._listdir(path)
        attrs = {attr: self._text(f"{path}/{attr}", listing.get(attr), optional=True) or ""
                 for attr in _DEVICE_ATTRS}
        self.devices.append(IbDeviceReading(device, **attrs))
        for port in ports:
            self.port(device, port, f"{path}/ports/{port}")

    def port(self, device: str, port: str, path: str) -> None:
        listing = self._listdir(path)
        link_layer = self._text(f"{path}/link_layer", listing.get("link_layer")) or "unknown"
        state_id, state = self._parsed(f"{path}/state", listing.get("state"), parse_state) or (None, None)
        phys_state_id, phys_state = self._parsed(f"{path}/phys_state", listing.get("phys_state"),
                                                 parse_state) or (None, None)
        rate = self._parsed(f"{path}/rate", listing.get("rate"), parse_rate)
        values, saturated = self._counters(path, listing)
        traffic = {key: None if (value := values.get(file)) is None else value * multiplier
                   for file, (key, _, multiplier) in TRAFFIC_COUNTERS.items()}
        self.ports.append(IbPortReading(
            device=device, port=int(port), link_layer=link_layer, state=state, state_id=state_id,
            phys_state=phys_state, phys_state_id=phys_state_id, rate_bytes_per_second=rate, **traffic,
            errors={name: values[name] for name in ERROR_COUNTERS if name in values}, saturated=tuple(saturated),
            hw_counters=self._hw_counters(path, listing)))

    def _counters(self, path: str, listing: dict[str, int]) -> tuple[dict[str, int], list[str]]:
        """The port's counters by ``counters/`` name, 64-bit sources first, and the saturated ones."""
        legacy = self._listdir(f"{path}/counters_ext") if "counters_ext" in listing else {}
        legacy_values = self._numbers(f"{path}/counters_ext", legacy, [f for f in LEGACY_EXT_COUNTERS if f in legacy])
        values = {LEGACY_EXT_COUNTERS[file]: value for file, value in legacy_values.items()}
        present = self._listdir(f"{path}/counters")
        extended = not present.keys().isdisjoint(IETF_COUNTERS)
        saturated: list[str] = []
        names = [name for name in _COUNTER_FILES if name in present and name not in values]
        for name, value in self._numbers(f"{path}/counters", present, names).items():
            bits = 64 if extended and name in EXTENDED_COUNTERS else PORT_COUNTER_BITS.get(name, 64)
            if bits < 64 and value == (1 << bits) - 1:
                saturated.append(name)
            else:
                values[name] = value
        return values, saturated

    def _hw_counters(self, path: str, listing: dict[str, int]) -> dict[str, int]:
        present = self._listdir(f"{path}/hw_counters") if "hw_counters" in listing else {}
        return self._numbers(f"{path}/hw_counters", present, sorted(present.keys() - HW_COUNTER_SKIP))


_PORT = ("device", "port")
DEVICE_INFO = MetricSpec("gpuwatch_ib_device_info", "InfiniBand/RoCE HCA (from sysfs); value 1.", kind="info",
                         labels=("device", *_DEVICE_ATTRS))
PORT_UP = MetricSpec("gpuwatch_ib_port_up", "1 when the port's logical state is ACTIVE; link_layer Ethernet is RoCE.",
                     labels=(*_PORT, "link_layer"))
PORT_STATE = MetricSpec("gpuwatch_ib_port_state_id", _state_help("Logical port state (IB PortState)", PORT_STATES),
                        "", "state_id", labels=_PORT)
PORT_PHYSICAL_STATE = MetricSpec("gpuwatch_ib_port_physical_state_id",
                                 _state_help("Physical port state (IB PortPhysicalState)", PHYS_STATES), "",
                                 "phys_state_id", labels=_PORT)
PORT_RATE = MetricSpec("gpuwatch_ib_port_rate_bytes_per_second", "Data rate the port's link trained to, in bytes/s.",
                       "bytes_per_second", "rate_bytes_per_second", labels=(*_PORT, "link_layer"))
#: The traffic counters, each the IbPortReading field of its name (``TRAFFIC_COUNTERS``).
PORT_TRAFFIC = tuple(MetricSpec(f"gpuwatch_ib_port_{key}", help_text, "", key, kind="counter", labels=_PORT)
                     for key, help_text, _ in TRAFFIC_COUNTERS.values())
PORT_ERRORS = MetricSpec("gpuwatch_ib_port_errors", "Port error counters (IB PortCounters), by kernel counter name.",
                         kind="counter", labels=(*_PORT, "counter"))
PORT_HW_COUNTERS = MetricSpec("gpuwatch_ib_port_hw_counters", "Driver counters from the port's hw_counters/, by file "
                              "name.", kind="counter", labels=(*_PORT, "counter"))
PORT_COUNTER_SATURATED = MetricSpec("gpuwatch_ib_port_counter_saturated", "1 for a fixed-width counter stuck at its "
                                    "maximum (it stopped counting, so it is not exported); reset it with perfquery "
                                    "-R.", labels=(*_PORT, "counter"))


def _families(readings: InfinibandReadings) -> list[Metric]:
    """The collect's families, built from its readings when the round is rendered."""
    info, up, state, phys_state, rate = (spec.family() for spec in (DEVICE_INFO, PORT_UP, PORT_STATE,
                                                                     PORT_PHYSICAL_STATE, PORT_RATE))
    traffic = [(spec.field, spec.family()) for spec in PORT_TRAFFIC]
    errors, hw, saturated = PORT_ERRORS.family(), PORT_HW_COUNTERS.family(), PORT_COUNTER_SATURATED.family()

    for reading in readings.devices:
        info.add_metric([reading.device, *(getattr(reading, attr) for attr in _DEVICE_ATTRS)], 1)
    for port in readings.ports:
        device, number, link_layer = port.device, str(port.port), port.link_layer
        labels = [device, number]
        if port.state_id is not None:
            state.add_metric(labels, port.state_id)
            up.add_metric([device, number, link_layer], 1 if port.state_id == ACTIVE else 0)
        if port.phys_state_id is not None:
            phys_state.add_metric(labels, port.phys_state_id)
        if port.rate_bytes_per_second is not None:
            rate.add_metric([device, number, link_layer], port.rate_bytes_per_second)
        for key, family in traffic:
            value = getattr(port, key)
            if value is not None:
                family.add_metric(labels, value)
        for family, values in ((errors, port.errors), (hw, port.hw_counters)):
            for name, value in values.items():
                family.add_metric([device, number, name], value)
        for name in port.saturated:
            saturated.add_metric([device, number, name], 1)
    return [info, up, state, phys_state, rate, *(family for _, family in traffic), errors, hw, saturated]
