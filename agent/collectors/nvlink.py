"""NVLink collector: per GPU and link, the state, data and error counters, and the rated speed.

State, counters and speed of all links of one GPU come from a single nvmlDeviceGetFieldValues call,
with the link as the field's scopeId (Hopper dropped the per-lane ``…_L0``–``…_L11`` fields; these
scoped ones, R525 and newer, replace them): one driver call per GPU instead of one per link and value.
nvmlDeviceGetNvLinkState tells once per GPU which links exist, and gives the state on drivers without
the state field. nvmlDeviceGetNvLinkUtilizationCounter is deprecated and not used.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pynvml
from prometheus_client.core import Metric

from gpuwatch.agent.collectors._nvml_common import Device, DeviceQuery, NvmlSession, field_values
from gpuwatch.agent.collectors.base import Collector, CollectorContext, CollectorResult, DeferredFamilies
from gpuwatch.agent.collectors.readings import NvlinkReading, NvlinkReadings
from gpuwatch.agent.metricspec import MetricSpec

# Read for every link, in this order; throughput counts KiB, speed is in MB/s (10^6 bytes).
_LINK_FIELDS = (
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
    pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC,
    pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY,
    pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY,
    pynvml.NVML_FI_DEV_NVLINK_GET_SPEED,
    pynvml.NVML_FI_DEV_NVLINK_GET_STATE,
)
_ERRORS = ("crc", "replay", "recovery")
# A sleeping link is trained and wakes with traffic: up. Inactive, or active with traffic disabled: down.
_UP_STATES = (pynvml.NVML_NVLINK_STATE_ACTIVE, pynvml.NVML_NVLINK_STATE_SLEEP)


@dataclasses.dataclass
class _Links:
    """The links one GPU has, and its field-value request: built once, reused every collect."""

    links: list[int]
    field_ids: list[tuple[int, int]]


def _discover(nvml: Any, handle: Any) -> _Links:
    """Links that answer nvmlDeviceGetNvLinkState, up or down; none where NVLink is unsupported."""
    links = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            nvml.nvmlDeviceGetNvLinkState(handle, link)
        except pynvml.NVMLError_GpuIsLost:
            raise
        except pynvml.NVMLError:
            continue  # NotSupported (no NVLink) or InvalidArgument (no such link)
        links.append(link)
    field_ids = [(field, link) for link in links for field in _LINK_FIELDS]
    # Drivers without per-link speed still report the speed all links share.
    field_ids.append((pynvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON, 0))
    return _Links(links, field_ids)


class NvlinkCollector(Collector):
    name = "nvlink"

    def __init__(self, context: CollectorContext) -> None:
        super().__init__(context)
        self._session = NvmlSession(context.nvml)
        self._nvml = self._session.nvml
        self._links: dict[int, _Links] = {}  # by GPU index

    def collect(self) -> CollectorResult[NvlinkReadings]:
        errors: list[str] = []
        links: list[NvlinkReading] = []
        for device in self._session.devices():
            if device.handle is None:
                errors.append(f"gpu {device.index}: {device.error}")
                continue
            try:
                links.extend(self._read(device, DeviceQuery(device, errors)))
            except pynvml.NVMLError_GpuIsLost as exc:
                errors.append(f"gpu {device.index}: {exc}")
        readings = NvlinkReadings(tuple(links))
        # Deferred to the render: 144 links' families, built only for rounds that are rendered.
        return CollectorResult(DeferredFamilies(lambda: _families(readings)), readings, errors)

    def close(self) -> None:
        self._links.clear()
        self._session.close()

    def _read(self, device: Device, get: DeviceQuery) -> list[NvlinkReading]:
        nvml, handle = self._nvml, device.handle
        gpu = self._links.get(device.index)
        if gpu is None:
            gpu = self._links[device.index] = _discover(nvml, handle)
        if not gpu.links:
            return []
        values = get(nvml.nvmlDeviceGetFieldValues, handle, gpu.field_ids)
        # Every NVLink field read is integer-typed (counters, a speed in MB/s, a state).
        numbers = [None] * len(gpu.field_ids) if values is None else cast("list[int | None]", field_values(values))
        common_speed = numbers[-1]
        readings = []
        width = len(_LINK_FIELDS)
        for position, link in enumerate(gpu.links):
            tx, rx, crc, replay, recovery, speed, state = numbers[position * width:(position + 1) * width]
            up: bool | None
            if state is not None:
                up = state in _UP_STATES
            else:
                enabled = get(nvml.nvmlDeviceGetNvLinkState, handle, link)
                up = None if enabled is None else enabled == pynvml.NVML_FEATURE_ENABLED
            speed = speed if speed is not None else common_speed
            errors = zip(_ERRORS, (crc, replay, recovery), strict=True)
            readings.append(NvlinkReading(
                gpu=device.index,
                link=link,
                up=up,
                speed_bytes_per_second=None if speed is None else speed * 1_000_000,
                tx_bytes=None if tx is None else tx * 1024,
                rx_bytes=None if rx is None else rx * 1024,
                errors={name: count for name, count in errors if count is not None},
            ))
        return readings


#: Every NVLink family, one series per link (labels gpu and link).
_LINK = ("gpu", "link")
LINK_UP = MetricSpec("gpuwatch_nvlink_up", "1 when the NVLink link is active.", "", "up", labels=_LINK)
LINK_SPEED = MetricSpec("gpuwatch_nvlink_speed_bytes_per_second", "Rated data rate of the link, one direction.",
                        "bytes_per_second", "speed_bytes_per_second", labels=_LINK)
LINK_ERRORS = MetricSpec("gpuwatch_nvlink_errors", "Data-link errors on the link: CRC errors, replays and link "
                         "recoveries.", kind="counter", labels=(*_LINK, "error"))
NVLINK_FAMILIES = (
    LINK_UP,
    LINK_SPEED,
    MetricSpec("gpuwatch_nvlink_transmitted_bytes", "Payload bytes sent over the link.", "bytes", "tx_bytes",
               kind="counter", labels=_LINK),
    MetricSpec("gpuwatch_nvlink_received_bytes", "Payload bytes received over the link.", "bytes", "rx_bytes",
               kind="counter", labels=_LINK),
    LINK_ERRORS,
)


def _families(readings: NvlinkReadings) -> list[Metric]:
    up, speed, transmitted, received, errors = (spec.family() for spec in NVLINK_FAMILIES)
    for link in readings.links:
        key = [str(link.gpu), str(link.link)]
        for family, value in ((up, link.up), (speed, link.speed_bytes_per_second),
                              (transmitted, link.tx_bytes), (received, link.rx_bytes)):
            if value is not None:
                family.add_metric(key, value)
        for name, count in link.errors.items():
            errors.add_metric([*key, name], count)
    return [family for family in (up, speed, transmitted, received, errors) if family.rows]
