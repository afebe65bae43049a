"""What the node collectors read, typed: the one contract between the collectors and what reads their output.

A collector returns its readings in ``CollectorResult.readings``; /api/v1/state writes them as JSON through
``as_dict`` (under the state's ``facts`` key, the name its readers have always used), and diagnosis reads them by
attribute, whether they come from the collectors run in this process (``gpuwatch diagnose`` on the node) or back
from an agent's state (``from_dict``, the one way from JSON to each type).

They live here, together, rather than each in its collector's module: diagnosis depends on this contract, not on
the collectors' code (NVML sessions, sysfs scans), and one generic ``from_dict`` rebuilds every type from its field
annotations, so a field added to a reading travels to /api/v1/state and back with no other edit. Field names are
the quantities' names everywhere: the JSON keys, the diagnosis facts' fields where diagnosis reads the same quantity,
and the ``field`` of the metric declarations (``base.MetricSpec``) that export them.

A value the collector could not read is ``None`` (written as ``null``). The telemetry collector's output is not
here: it is the telemetry store's state, typed for its readers in ``agent/telemetry/readings.py``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

R = TypeVar("R", bound="Reading")


class Reading:
    """Base of every reading: ``as_dict`` for the state's JSON, ``from_dict`` back from it."""

    __slots__ = ()

    if typing.TYPE_CHECKING:
        # Every reading type is a dataclass: what dataclasses.fields asks of its argument (no attribute at run time).
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def as_dict(self) -> dict[str, Any]:
        """The fields by name, nested readings as they are: the state's JSON writer (``snapshot.json_safe``) asks
        each for its own dict, and only when /api/v1/state is requested, so a round nobody reads converts nothing."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        """The reading whose JSON ``as_dict`` wrote. Nested readings and tuples are rebuilt from the field types;
        a key the JSON lacks takes the field's default (an agent that could not read the value, or an older one
        that left it out); a key the type lacks is ignored (a newer agent's)."""
        return cls(**{name: convert(data[name]) for name, convert in _converters(cls) if name in data})


# Each reading type's converters, built on its first from_dict. A dict rather than functools.cache, whose arguments
# typeshed types as Hashable, which mypy does not see a class as (python/mypy#11470).
_CONVERTERS: dict[type[Reading], tuple[tuple[str, Callable[[Any], Any]], ...]] = {}


def _converters(cls: type[Reading]) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    converters = _CONVERTERS.get(cls)
    if converters is None:
        hints = typing.get_type_hints(cls)
        converters = tuple((field.name, _converter(hints[field.name])) for field in dataclasses.fields(cls))
        _CONVERTERS[cls] = converters
    return converters


def _converter(hint: Any) -> Callable[[Any], Any]:
    """How a JSON value becomes a value of type ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):  # X | None: the only unions readings use
        (inner,) = (arg for arg in args if arg is not type(None))
        convert = _converter(inner)
        return lambda value: None if value is None else convert(value)
    if origin is tuple:  # tuple[X, ...]
        item = _converter(args[0])
        return lambda value: tuple(item(element) for element in value)
    if origin is dict:  # dict[str, int]: counters by name
        return dict
    if isinstance(hint, type) and issubclass(hint, Reading):
        return hint.from_dict
    if hint is float:  # the state writes non-finite floats as "NaN", "+Inf", "-Inf"
        return lambda value: float(value) if isinstance(value, str) else value
    return lambda value: value


# -- nvml ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class PcieReading(Reading):
    """The GPU's PCIe link: as trained now and the most GPU and slot allow, and its replay count."""

    current_generation: int | None = None
    max_generation: int | None = None
    current_width: int | None = None
    max_width: int | None = None
    replays: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class EccReading(Reading):
    """ECC error counts of one scope (volatile: since the driver loaded; aggregate: the GPU's lifetime)."""

    corrected: int | None = None
    uncorrected: int | None = None

    def counts(self) -> dict[str, int]:
        """The counts read, by error kind: the ``error`` label of the ECC families."""
        return {error: count for error, count in (("corrected", self.corrected), ("uncorrected", self.uncorrected))
                if count is not None}


@dataclasses.dataclass(frozen=True, slots=True)
class RemappedRowsReading(Reading):
    """Memory rows remapped by cause, and whether a remap waits for a reset (pending) or failed: 1 or 0."""

    correctable: int | None = None
    uncorrectable: int | None = None
    pending: int | None = None
    failure: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class GpuProcessReading(Reading):
    """A compute process on the GPU and the device memory it uses (None where the driver cannot tell)."""

    pid: int
    used_memory_bytes: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class GpuReading(Reading):
    """One GPU in one collect. A lost GPU has ``lost`` set, its identity (if it was ever read) and its Xid counts."""

    index: int
    lost: bool = False
    uuid: str | None = None
    pci_bus_id: str | None = None
    model: str | None = None
    #: Where the SM activity comes from: "gpm", or "utilization" where GPM is unsupported.
    activity_source: str | None = None
    utilization_ratio: float | None = None
    memory_copy_utilization_ratio: float | None = None
    sm_active_ratio: float | None = None
    sm_occupancy_ratio: float | None = None
    tensor_active_ratio: float | None = None
    dram_active_ratio: float | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    power_watts: float | None = None
    temperature_celsius: float | None = None
    sm_clock_hertz: float | None = None
    memory_clock_hertz: float | None = None
    #: Clock-event (throttle) reasons holding the clocks down now, by the collector's names.
    clock_event_reasons: tuple[str, ...] | None = None
    pcie: PcieReading | None = None
    ecc_volatile: EccReading | None = None
    ecc_aggregate: EccReading | None = None
    remapped_rows: RemappedRowsReading | None = None
    processes: tuple[GpuProcessReading, ...] | None = None
    #: Whether critical Xid events of this GPU are watched (then the fault Xids are exported from 0).
    xid_watched: bool = False
    #: Critical Xid events by Xid code, counted since the agent started.
    xid_errors: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class NvmlReadings(Reading):
    """The nvml collector's readings: the driver and every GPU."""

    driver_version: str = ""
    gpus: tuple[GpuReading, ...] = ()


# -- nvlink -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class NvlinkReading(Reading):
    """One NVLink link of one GPU; ``up`` is None when its state is unknown."""

    gpu: int
    link: int
    up: bool | None = None
    #: Rated data rate, one direction.
    speed_bytes_per_second: int | None = None
    tx_bytes: int | None = None
    rx_bytes: int | None = None
    #: Data-link error counts by kind (crc, replay, recovery), those the driver reports.
    errors: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class NvlinkReadings(Reading):
    """The nvlink collector's readings: every link of every GPU that has NVLink."""

    links: tuple[NvlinkReading, ...] = ()


# -- infiniband ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class IbDeviceReading(Reading):
    """An HCA's sysfs attributes ("" where the file is absent)."""

    device: str
    board_id: str = ""
    fw_ver: str = ""
    hca_type: str = ""
    node_guid: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class IbPortReading(Reading):
    """One InfiniBand or RoCE port: states, rate and counters as read (traffic in the unit its name says)."""

    device: str
    port: int
    link_layer: str = "unknown"  # "InfiniBand", or "Ethernet" for RoCE
    state: str | None = None
    state_id: int | None = None
    phys_state: str | None = None
    phys_state_id: int | None = None
    rate_bytes_per_second: float | None = None
    transmitted_bytes: int | None = None
    received_bytes: int | None = None
    transmitted_packets: int | None = None
    received_packets: int | None = None
    transmitted_unicast_packets: int | None = None
    received_unicast_packets: int | None = None
    transmitted_multicast_packets: int | None = None
    received_multicast_packets: int | None = None
    transmit_wait_ticks: int | None = None
    #: Error counters by kernel counter name.
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Fixed-width counters stuck at their maximum (not exported until reset).
    saturated: tuple[str, ...] = ()
    #: Driver counters from hw_counters/, by file name.
    hw_counters: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class InfinibandReadings(Reading):
    """The infiniband collector's readings: every HCA and every port."""

    devices: tuple[IbDeviceReading, ...] = ()
    ports: tuple[IbPortReading, ...] = ()


# -- host ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessReading(Reading):
    """A watched process: the agent (job and rank empty) or a training rank."""

    pid: int
    name: str
    job: str
    rank: str
    rss_bytes: int
    cpu_seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class AddressReading(Reading):
    """One address of an interface."""

    family: str  # "ipv4", "ipv6", "link"
    address: str


@dataclasses.dataclass(frozen=True, slots=True)
class InterfaceReading(Reading):
    """A network interface, for diagnosis to check NCCL_SOCKET_IFNAME against."""

    name: str
    up: bool
    is_loopback: bool = False
    mtu: int | None = None
    speed_mbps: int | None = None  # None when the driver does not know it
    addresses: tuple[AddressReading, ...] = ()

    @property
    def ip_addresses(self) -> tuple[str, ...]:
        """Its IP addresses (not its link-layer one): what makes it reach other hosts."""
        return tuple(a.address for a in self.addresses if a.family != "link")

    @property
    def speed_bytes_per_second(self) -> float | None:
        """The negotiated speed in bytes/s; None when the driver does not know it."""
        return self.speed_mbps * 1e6 / 8 if self.speed_mbps else None


@dataclasses.dataclass(frozen=True, slots=True)
class InterfaceTrafficReading(Reading):
    """One network interface's counters since boot (/proc/net/dev): bytes each way, errors and drops both ways."""

    name: str
    receive_bytes: int
    transmit_bytes: int
    errors: int = 0
    drops: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class TrafficSample(Reading):
    """The traffic counters of the non-loopback interfaces at one moment (``time``: the wall clock, which the ranks'
    step records also carry, so that diagnosis reads a NIC's traffic over a job's step window)."""

    time: float
    interfaces: tuple[InterfaceTrafficReading, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class HostReadings(Reading):
    """The host collector's readings; ``cpu_ratio`` is None on the first collect (no previous sample)."""

    cpu_ratio: float | None = None
    cpu_count: int | None = None
    load_average: tuple[float, ...] = ()  # 1, 5 and 15 minutes
    memory_total_bytes: int | None = None
    memory_available_bytes: int | None = None
    memory_used_bytes: int | None = None
    processes: tuple[ProcessReading, ...] = ()
    network_interfaces: tuple[InterfaceReading, ...] = ()
    #: The traffic counters of recent rounds, oldest first, the latest last (``host.TRAFFIC_SAMPLES`` of them).
    network_traffic: tuple[TrafficSample, ...] = ()


# -- a node -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class NodeReadings(Reading):
    """The node collectors' readings by collector name, as the state's ``facts`` object holds them; None for a
    collector that is down or not enabled."""

    nvml: NvmlReadings | None = None
    nvlink: NvlinkReadings | None = None
    infiniband: InfinibandReadings | None = None
    host: HostReadings | None = None
