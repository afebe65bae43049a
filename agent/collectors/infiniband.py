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
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gpuwatch.agent.collectors.base import Collector, CollectorError, CollectorResult

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

#: Traffic counters: file -> (family and fact name, HELP, multiplier to the unit).
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
_DEVICE_ATTRS = ("board_id", "fw_ver", "hca_type", "node_guid")


def read_sysfs(path: str) -> str:
    """One read(2) of a sysfs attribute, stripped: sysfs reports a bogus size, and show() emits it whole."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096).decode("utf-8", "replace").strip()
    finally:
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

    def collect(self) -> CollectorResult:
        class_dir = os.path.join(self.context.sysfs_root, CLASS_DIR)
        try:
            devices = sorted(os.listdir(class_dir))
        except FileNotFoundError:
            devices = []
        except OSError as exc:
            raise CollectorError(f"cannot list {class_dir}: {exc.strerror}") from exc
        scan = _Scan()
        for device in devices:
            scan.device(device, f"{class_dir}/{device}")
        return scan.result()


class _Scan:
    """The families, facts and errors of one collect."""

    def __init__(self) -> None:
        port_labels = ["device", "port"]
        self.info = GaugeMetricFamily(
            "gpuwatch_ib_device_info", "InfiniBand/RoCE HCA (from sysfs); value 1.",
            labels=["device", "board_id", "fw_ver", "hca_type", "node_guid"])
        self.up = GaugeMetricFamily(
            "gpuwatch_ib_port_up", "1 when the port's logical state is ACTIVE; link_layer Ethernet is RoCE.",
            labels=["device", "port", "link_layer"])
        self.state = GaugeMetricFamily(
            "gpuwatch_ib_port_state_id", _state_help("Logical port state (IB PortState)", PORT_STATES),
            labels=port_labels)
        self.phys_state = GaugeMetricFamily(
            "gpuwatch_ib_port_physical_state_id",
            _state_help("Physical port state (IB PortPhysicalState)", PHYS_STATES), labels=port_labels)
        self.rate = GaugeMetricFamily(
            "gpuwatch_ib_port_rate_bytes_per_second", "Data rate the port's link trained to, in bytes/s.",
            labels=["device", "port", "link_layer"])
        self.traffic = {
            file: CounterMetricFamily(f"gpuwatch_ib_port_{key}", help_text, labels=port_labels)
            for file, (key, help_text, _) in TRAFFIC_COUNTERS.items()
        }
        self.errors_family = CounterMetricFamily(
            "gpuwatch_ib_port_errors", "Port error counters (IB PortCounters), by kernel counter name.",
            labels=["device", "port", "counter"])
        self.hw = CounterMetricFamily(
            "gpuwatch_ib_port_hw_counters", "Driver counters from the port's hw_counters/, by file name.",
            labels=["device", "port", "counter"])
        self.saturated = GaugeMetricFamily(
            "gpuwatch_ib_port_counter_saturated",
            "1 for a fixed-width counter stuck at its maximum (it stopped counting, so it is not exported); "
            "reset it with perfquery -R.", labels=["device", "port", "counter"])
        self.devices: list[dict[str, Any]] = []
        self.ports: list[dict[str, Any]] = []
        self.errors: list[str] = []

    def result(self) -> CollectorResult:
        families = [self.info, self.up, self.state, self.phys_state, self.rate, *self.traffic.values(),
                    self.errors_family, self.hw, self.saturated]
        return CollectorResult(families, {"devices": self.devices, "ports": self.ports}, self.errors)

    # -- reading helpers: each failure costs one value and is recorded ----------------------------

    def _text(self, path: str, optional: bool = False) -> str | None:
        try:
            return read_sysfs(path)
        except OSError as exc:
            if not (optional and exc.errno == errno.ENOENT):
                self.errors.append(f"{path}: {exc.strerror or exc}")
            return None

    def _parsed(self, path: str, parse: Callable[[str], Any]) -> Any:
        text = self._text(path)
        if text is None:
            return None
        try:
            return parse(text)
        except ValueError:
            self.errors.append(f"{path}: unexpected content {text!r}")
            return None

    def _listdir(self, path: str) -> set[str]:
        """Names in an optional directory (``hw_counters``, ``counters_ext``); absent means empty."""
        try:
            return set(os.listdir(path))
        except FileNotFoundError:
            return set()
        except OSError as exc:
            self.errors.append(f"{path}: {exc.strerror or exc}")
            return set()

    # -- devices and ports -------------------------------------------------------------------------

    def device(self, device: str, path: str) -> None:
        try:
            ports = sorted((p for p in os.listdir(f"{path}/ports") if p.isdigit()), key=int)
        except FileNotFoundError:
            return  # removed (hot unplug, driver reload) since the class directory was listed: gone, not broken
        except OSError as exc:
            self.errors.append(f"{path}/ports: {exc.strerror or exc}")
            ports = []
        attrs = {attr: self._text(f"{path}/{attr}", optional=True) or "" for attr in _DEVICE_ATTRS}
        self.info.add_metric([device, *attrs.values()], 1)
        self.devices.append({"device": device, **attrs})
        for port in ports:
            self.port(device, port, f"{path}/ports/{port}")

    def port(self, device: str, port: str, path: str) -> None:
        labels = [device, port]
        link_layer = self._text(f"{path}/link_layer") or "unknown"
        fact: dict[str, Any] = {"device": device, "port": int(port), "link_layer": link_layer,
                                "state": None, "state_id": None, "phys_state": None, "phys_state_id": None}
        state = self._parsed(f"{path}/state", parse_state)
        if state is not None:
            fact["state_id"], fact["state"] = state
            self.state.add_metric(labels, state[0])
            self.up.add_metric([device, port, link_layer], 1 if state[0] == ACTIVE else 0)
        phys_state = self._parsed(f"{path}/phys_state", parse_state)
        if phys_state is not None:
            fact["phys_state_id"], fact["phys_state"] = phys_state
            self.phys_state.add_metric(labels, phys_state[0])
        fact["rate_bytes_per_second"] = rate = self._parsed(f"{path}/rate", parse_rate)
        if rate is not None:
            self.rate.add_metric([device, port, link_layer], rate)

        values, saturated = self._counters(path)
        for file, (key, _, multiplier) in TRAFFIC_COUNTERS.items():
            value = values.get(file)
            if value is not None:
                value *= multiplier
                self.traffic[file].add_metric(labels, value)
            fact[key] = value
        errors = {name: values[name] for name in ERROR_COUNTERS if name in values}
        for name, value in errors.items():
            self.errors_family.add_metric([device, port, name], value)
        for name in saturated:
            self.saturated.add_metric([device, port, name], 1)
        hw_counters = self._hw_counters(path)
        for name, value in hw_counters.items():
            self.hw.add_metric([device, port, name], value)
        fact.update(errors=errors, saturated=saturated, hw_counters=hw_counters)
        self.ports.append(fact)

    def _counters(self, path: str) -> tuple[dict[str, int], list[str]]:
        """The port's counters by ``counters/`` name, 64-bit sources first, and the saturated ones."""
        values: dict[str, int] = {}
        legacy = self._listdir(f"{path}/counters_ext")
        for file, name in LEGACY_EXT_COUNTERS.items():
            if file in legacy and (value := self._parsed(f"{path}/counters_ext/{file}", int)) is not None:
                values[name] = value
        present = self._listdir(f"{path}/counters")
        extended = not present.isdisjoint(IETF_COUNTERS)
        saturated: list[str] = []
        for name in _COUNTER_FILES:
            if name not in present or name in values:
                continue
            value = self._parsed(f"{path}/counters/{name}", int)
            if value is None:
                continue
            bits = 64 if extended and name in EXTENDED_COUNTERS else PORT_COUNTER_BITS.get(name, 64)
            if bits < 64 and value == (1 << bits) - 1:
                saturated.append(name)
            else:
                values[name] = value
        return values, saturated

    def _hw_counters(self, path: str) -> dict[str, int]:
        counters: dict[str, int] = {}
        for name in sorted(self._listdir(f"{path}/hw_counters") - HW_COUNTER_SKIP):
            value = self._parsed(f"{path}/hw_counters/{name}", int)
            if value is not None:
                counters[name] = value
        return counters
