"""NVML collector: what each GPU is, how busy, hot and healthy it is, and what runs on it.

Per GPU and collect: utilisation; SM activity, SM occupancy and tensor activity from NVML GPM on
Hopper and newer (averaged between this collect's GPM sample and the previous one, so collect never
sleeps), else the coarse utilisation rate; memory, power, temperature, clocks, clock-event (throttle)
reasons, PCIe link, ECC / row-remap / PCIe-replay counts (one batched field-value read), Xid events
(drained without blocking) and compute processes. What cannot change while the agent runs (name,
UUID, bus id, PCIe maximum) is read once.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, cast

import pynvml
from prometheus_client.core import Metric

from gpuwatch.agent.collectors._nvml_common import Device, DeviceQuery, NvmlSession, field_values, handle_key
from gpuwatch.agent.collectors.base import (
    Collector,
    CollectorContext,
    CollectorResult,
    DeferredFamilies,
)
from gpuwatch.agent.collectors.readings import (
    EccReading,
    GpuProcessReading,
    GpuReading,
    NvmlReadings,
    PcieReading,
    RemappedRowsReading,
)
from gpuwatch.agent.metricspec import MetricSpec

# GPM metric -> GpuReading field; NVML reports percentages, the readings and metrics hold ratios.
_GPM_METRICS = (
    (pynvml.NVML_GPM_METRIC_SM_UTIL, "sm_active_ratio"),
    (pynvml.NVML_GPM_METRIC_SM_OCCUPANCY, "sm_occupancy_ratio"),
    (pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, "tensor_active_ratio"),
    (pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL, "dram_active_ratio"),
)

_CLOCKS = (("sm_clock_hertz", pynvml.NVML_CLOCK_SM), ("memory_clock_hertz", pynvml.NVML_CLOCK_MEM))

#: NVML's clock event reason bits by the ``reason`` label they are exported as (the simulated node's faults name them).
CLOCK_EVENT_REASONS = (
    (pynvml.nvmlClocksEventReasonGpuIdle, "gpu_idle"),
    (pynvml.nvmlClocksEventReasonApplicationsClocksSetting, "applications_clocks_setting"),
    (pynvml.nvmlClocksEventReasonSwPowerCap, "sw_power_cap"),
    (pynvml.nvmlClocksEventReasonHwSlowdown, "hw_slowdown"),
    (pynvml.nvmlClocksEventReasonSyncBoost, "sync_boost"),
    (pynvml.nvmlClocksEventReasonSwThermalSlowdown, "sw_thermal_slowdown"),
    (pynvml.nvmlClocksEventReasonHwThermalSlowdown, "hw_thermal_slowdown"),
    (pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown, "hw_power_brake"),
    (pynvml.nvmlClocksEventReasonDisplayClockSetting, "display_clocks_setting"),
)

# Read in one nvmlDeviceGetFieldValues call per GPU: (field, GpuReading field, field of that reading).
_FIELDS = (
    (pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL, "ecc_volatile", "corrected"),
    (pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, "ecc_volatile", "uncorrected"),
    (pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL, "ecc_aggregate", "corrected"),
    (pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL, "ecc_aggregate", "uncorrected"),
    (pynvml.NVML_FI_DEV_REMAPPED_COR, "remapped_rows", "correctable"),
    (pynvml.NVML_FI_DEV_REMAPPED_UNC, "remapped_rows", "uncorrectable"),
    (pynvml.NVML_FI_DEV_REMAPPED_PENDING, "remapped_rows", "pending"),
    (pynvml.NVML_FI_DEV_REMAPPED_FAILURE, "remapped_rows", "failure"),
    (pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER, "pcie", "replays"),
)
_FIELD_IDS = [field for field, _, _ in _FIELDS]
#: The readings the grouped fields fill, beside ``pcie`` (which the link state fills too).
_FIELD_GROUPS = (("ecc_volatile", EccReading), ("ecc_aggregate", EccReading), ("remapped_rows", RemappedRowsReading))

#: The label of every per-GPU family: the GPU's index.
_GPU = ("gpu",)
#: Per-GPU gauges labelled {gpu} only, each the GpuReading field of its name; ``diagnose --prometheus`` reads
#: those diagnosis uses back by this table.
GPU_GAUGES = (
    MetricSpec("gpuwatch_gpu_utilization_ratio",
               "Share of the last sample period in which any kernel ran (nvmlDeviceGetUtilizationRates).",
               "ratio", "utilization_ratio", labels=_GPU),
    MetricSpec("gpuwatch_gpu_memory_copy_utilization_ratio",
               "Share of the last sample period in which device memory was read or written.",
               "ratio", "memory_copy_utilization_ratio", labels=_GPU),
    MetricSpec("gpuwatch_gpu_sm_active_ratio",
               "Share of SMs busy (GPM), or the utilisation rate where GPM is unsupported "
               "(see gpuwatch_gpu_activity_source).", "ratio", "sm_active_ratio", labels=_GPU),
    MetricSpec("gpuwatch_gpu_sm_occupancy_ratio",
               "Resident warps over the theoretical maximum, between the last two GPM samples.",
               "ratio", "sm_occupancy_ratio", labels=_GPU),
    MetricSpec("gpuwatch_gpu_tensor_active_ratio",
               "Share of time the SMs ran any tensor-core instruction, between the last two GPM samples.",
               "ratio", "tensor_active_ratio", labels=_GPU),
    MetricSpec("gpuwatch_gpu_dram_active_ratio",
               "Device memory bandwidth used over its peak, between the last two GPM samples.",
               "ratio", "dram_active_ratio", labels=_GPU),
    MetricSpec("gpuwatch_gpu_memory_total_bytes", "Installed device memory.", "bytes", "memory_total_bytes",
               labels=_GPU),
    MetricSpec("gpuwatch_gpu_memory_used_bytes", "Device memory allocated by processes.", "bytes",
               "memory_used_bytes", labels=_GPU),
    MetricSpec("gpuwatch_gpu_memory_reserved_bytes", "Device memory reserved by the driver and firmware.", "bytes",
               "memory_reserved_bytes", labels=_GPU),
    MetricSpec("gpuwatch_gpu_power_watts", "Power draw of the GPU board.", "watts", "power_watts", labels=_GPU),
    MetricSpec("gpuwatch_gpu_temperature_celsius", "GPU core temperature.", "celsius", "temperature_celsius",
               labels=_GPU),
    MetricSpec("gpuwatch_gpu_sm_clock_hertz", "Current SM clock.", "hertz", "sm_clock_hertz", labels=_GPU),
    MetricSpec("gpuwatch_gpu_memory_clock_hertz", "Current memory clock.", "hertz", "memory_clock_hertz",
               labels=_GPU),
)

#: The other per-GPU families, each labelled by its GPU first.
GPU_INFO = MetricSpec("gpuwatch_gpu_info", "GPU identity; always 1.", kind="info",
                      labels=(*_GPU, "uuid", "pci_bus_id", "model", "driver_version"))
GPU_LOST = MetricSpec("gpuwatch_gpu_lost", "1 when NVML reports the GPU lost (fallen off the bus).", labels=_GPU)
ACTIVITY_SOURCE = MetricSpec("gpuwatch_gpu_activity_source", "Where the SM activity series come from: gpm, or "
                             "utilization where GPM is unsupported; always 1.", labels=(*_GPU, "source"))
CLOCK_EVENT_ACTIVE = MetricSpec("gpuwatch_gpu_clock_event_active", "1 while this clock-event (throttle) reason holds "
                                "the clocks down.", labels=(*_GPU, "reason"))
PCIE_LINK_GENERATION = MetricSpec("gpuwatch_gpu_pcie_link_generation", "PCIe link generation: as trained now, and "
                                  "the most GPU and slot allow.", labels=(*_GPU, "kind"))
PCIE_LINK_WIDTH = MetricSpec("gpuwatch_gpu_pcie_link_width", "PCIe link width in lanes: as trained now, and the most "
                             "GPU and slot allow.", labels=(*_GPU, "kind"))
PCIE_REPLAYS = MetricSpec("gpuwatch_gpu_pcie_replays", "PCIe replays (link-level retransmissions).", kind="counter",
                          labels=_GPU)
ECC_VOLATILE_ERRORS = MetricSpec("gpuwatch_gpu_ecc_volatile_errors", "ECC errors since the driver loaded.",
                                 kind="counter", labels=(*_GPU, "error"))
ECC_AGGREGATE_ERRORS = MetricSpec("gpuwatch_gpu_ecc_aggregate_errors", "ECC errors over the GPU's lifetime.",
                                  kind="counter", labels=(*_GPU, "error"))
REMAPPED_ROWS = MetricSpec("gpuwatch_gpu_remapped_rows", "Memory rows remapped, by what caused it.",
                           labels=(*_GPU, "cause"))
ROW_REMAP_PENDING = MetricSpec("gpuwatch_gpu_row_remap_pending", "1 when a row remap waits for a GPU reset.",
                               labels=_GPU)
ROW_REMAP_FAILURE = MetricSpec("gpuwatch_gpu_row_remap_failure", "1 when a row remap failed: the GPU needs service.",
                               labels=_GPU)
XID_ERRORS = MetricSpec("gpuwatch_gpu_xid_errors", "Critical Xid errors seen since the agent started.",
                        kind="counter", labels=(*_GPU, "xid"))
PROCESS_MEMORY = MetricSpec("gpuwatch_gpu_process_memory_bytes", "Device memory used by a compute process.", "bytes",
                            labels=(*_GPU, "pid"))

# Xids that mean a hardware or driver fault (ECC, row remap, NVLink, off the bus, GSP). A watched GPU
# exports them from 0, so that increase() sees their first occurrence; others appear when they happen.
_FAULT_XIDS = ("48", "63", "64", "74", "79", "92", "94", "95", "119", "120")

#: Events drained per collect at most, so an Xid storm cannot stall the collector.
_MAX_EVENTS_PER_COLLECT = 1000


@dataclasses.dataclass
class _Gpm:
    """Two GPM sample buffers used in turn, and the request reused for every metrics query."""

    samples: tuple[Any, Any]
    request: Any
    previous: int | None = None  # which buffer holds the previous collect's sample


@dataclasses.dataclass
class _GpuState:
    """What the collector keeps about one GPU between collects."""

    identity: dict[str, str] | None = None  # GpuReading's uuid, pci_bus_id and model: read once
    pcie_max: dict[str, int | None] = dataclasses.field(default_factory=dict)
    activity_source: str | None = None  # "gpm" or "utilization", decided on the first read
    gpm: _Gpm | None = None
    xid_watched: bool = False
    xid_errors: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)


def _ratio(percent: float) -> float:
    return min(max(percent / 100, 0.0), 1.0)


def _put(fields: dict[str, Any], key: str, value: float | None, scale: float = 1) -> None:
    if value is not None:
        fields[key] = value * scale


class NvmlCollector(Collector):
    name = "nvml"

    def __init__(self, context: CollectorContext) -> None:
        super().__init__(context)
        self._session = NvmlSession(context.nvml)
        self._nvml = self._session.nvml
        self._states: dict[int, _GpuState] | None = None
        self._driver_version = ""
        self._event_set: Any = None
        self._xid_states: dict[int, _GpuState] = {}  # device handle address -> state

    def collect(self) -> CollectorResult[NvmlReadings]:
        devices = self._session.devices()
        states = self._states if self._states is not None else self._start(devices)
        errors: list[str] = []
        self._drain_xid_events(errors)
        readings = NvmlReadings(self._driver_version,
                                tuple(self._sample(device, states[device.index], errors) for device in devices))
        # Deferred to the render, like the other collectors': rounds nobody renders never build them.
        return CollectorResult(DeferredFamilies(lambda: _families(readings)), readings, errors)

    def close(self) -> None:
        nvml = self._nvml
        for state in (self._states or {}).values():
            for sample in state.gpm.samples if state.gpm else ():
                with contextlib.suppress(pynvml.NVMLError):
                    nvml.nvmlGpmSampleFree(sample)
        if self._event_set is not None:
            with contextlib.suppress(pynvml.NVMLError):
                nvml.nvmlEventSetFree(self._event_set)
        self._states, self._event_set = None, None
        self._xid_states.clear()
        self._session.close()

    # -- start-up ---------------------------------------------------------------------------------

    def _start(self, devices: list[Device]) -> dict[int, _GpuState]:
        self._driver_version = self._nvml.nvmlSystemGetDriverVersion()
        self._states = states = {device.index: _GpuState() for device in devices}
        self._event_set = self._watch_xid_events(devices, states)
        return states

    def _watch_xid_events(self, devices: list[Device], states: dict[int, _GpuState]) -> Any:
        """One event set for all GPUs, registered for critical Xid errors where the GPU supports it."""
        nvml = self._nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
        except pynvml.NVMLError:
            return None
        for device in devices:
            if device.handle is None:
                continue
            try:
                nvml.nvmlDeviceRegisterEvents(device.handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
            except pynvml.NVMLError:
                continue
            state = states[device.index]
            state.xid_watched = True
            self._xid_states[handle_key(device.handle)] = state
        return event_set

    def _drain_xid_events(self, errors: list[str]) -> None:
        if self._event_set is None:
            return
        for _ in range(_MAX_EVENTS_PER_COLLECT):
            try:
                event = self._nvml.nvmlEventSetWait_v2(self._event_set, 0)
            except pynvml.NVMLError_Timeout:
                return
            except pynvml.NVMLError as exc:
                errors.append(f"Xid events: {exc}")
                return
            state = self._xid_states.get(handle_key(event.device))
            if state is not None and event.eventType & pynvml.nvmlEventTypeXidCriticalError:
                state.xid_errors[event.eventData] += 1

    # -- one GPU ----------------------------------------------------------------------------------

    def _sample(self, device: Device, state: _GpuState, errors: list[str]) -> GpuReading:
        """The GPU's reading; a lost GPU keeps its identity and Xid counts and is marked ``lost``."""
        xids: dict[str, Any] = {"xid_watched": state.xid_watched,
                                "xid_errors": {str(xid): count for xid, count in state.xid_errors.items()}}
        lost_reason = device.error
        if lost_reason is None:
            try:
                return GpuReading(index=device.index, **self._read(device, state, DeviceQuery(device, errors)), **xids)
            except pynvml.NVMLError_GpuIsLost as exc:
                lost_reason = str(exc)
        errors.append(f"gpu {device.index}: {lost_reason}")
        identity: dict[str, Any] = state.identity or {}
        return GpuReading(index=device.index, lost=True, **identity, **xids)

    def _read(self, device: Device, state: _GpuState, get: DeviceQuery) -> dict[str, Any]:
        """The values of a GPU that answers, as GpuReading fields; what it or its driver lacks is left out."""
        nvml, handle = self._nvml, device.handle
        if state.identity is None:
            state.identity, state.pcie_max = self._identity(handle, get)
        fields: dict[str, Any] = dict(state.identity)
        self._read_activity(handle, state, fields, get)
        memory = get(nvml.nvmlDeviceGetMemoryInfo, handle, pynvml.nvmlMemory_v2) or get(
            nvml.nvmlDeviceGetMemoryInfo, handle)  # drivers before R510 have no v2 (no reserved)
        if memory is not None:
            fields["memory_total_bytes"] = memory.total
            fields["memory_used_bytes"] = memory.used
            _put(fields, "memory_reserved_bytes", getattr(memory, "reserved", None))
        _put(fields, "power_watts", get(nvml.nvmlDeviceGetPowerUsage, handle), 1e-3)  # mW
        temperature = get(nvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU)
        _put(fields, "temperature_celsius", temperature)
        for key, clock in _CLOCKS:
            _put(fields, key, get(nvml.nvmlDeviceGetClockInfo, handle, clock), 1e6)  # MHz
        # The "throttle" name is all that drivers before R535 know.
        reasons = get(nvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
        if reasons is None:
            reasons = get(nvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
        if reasons is not None:
            fields["clock_event_reasons"] = tuple(name for bit, name in CLOCK_EVENT_REASONS if reasons & bit)
        values = get(nvml.nvmlDeviceGetFieldValues, handle, _FIELD_IDS)
        groups: dict[str, dict[str, int]] = {}
        # Every field in _FIELDS is integer-typed (counters and flags).
        numbers = cast("list[int | None]", field_values(values)) if values is not None else [None] * len(_FIELDS)
        for (_, group, key), number in zip(_FIELDS, numbers, strict=True):
            if number is not None:
                groups.setdefault(group, {})[key] = number
        fields["pcie"] = PcieReading(
            current_generation=get(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
            max_generation=state.pcie_max["generation"],
            current_width=get(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
            max_width=state.pcie_max["width"],
            **groups.get("pcie", {}),
        )
        fields.update((group, reading(**groups[group])) for group, reading in _FIELD_GROUPS if group in groups)
        processes = get(nvml.nvmlDeviceGetComputeRunningProcesses, handle)
        if processes is not None:
            fields["processes"] = tuple(GpuProcessReading(p.pid, p.usedGpuMemory) for p in processes)
        return fields

    def _identity(self, handle: Any, get: DeviceQuery) -> tuple[dict[str, str], dict[str, int | None]]:
        nvml = self._nvml
        pci = get(nvml.nvmlDeviceGetPciInfo, handle)
        identity = {
            "uuid": get(nvml.nvmlDeviceGetUUID, handle) or "",
            "pci_bus_id": pci.busId if pci is not None else "",
            "model": get(nvml.nvmlDeviceGetName, handle) or "",
        }
        pcie_max = {
            "generation": get(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
            "width": get(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
        }
        return identity, pcie_max

    def _read_activity(self, handle: Any, state: _GpuState, fields: dict[str, Any], get: DeviceQuery) -> None:
        utilization = get(self._nvml.nvmlDeviceGetUtilizationRates, handle)
        if utilization is not None:
            fields["utilization_ratio"] = _ratio(utilization.gpu)
            fields["memory_copy_utilization_ratio"] = _ratio(utilization.memory)
        if state.activity_source is None:
            state.gpm = self._start_gpm(handle, get)
            state.activity_source = "gpm" if state.gpm is not None else "utilization"
        fields["activity_source"] = state.activity_source
        if state.gpm is not None:
            fields.update(self._gpm_ratios(handle, state.gpm, get))
        elif utilization is not None:
            fields["sm_active_ratio"] = fields["utilization_ratio"]

    def _start_gpm(self, handle: Any, get: DeviceQuery) -> _Gpm | None:
        nvml = self._nvml
        support = get(nvml.nvmlGpmQueryDeviceSupport, handle)
        if support is None or not support.isSupportedDevice:
            return None
        samples = (get(nvml.nvmlGpmSampleAlloc), get(nvml.nvmlGpmSampleAlloc))
        if None in samples:
            return None
        request = pynvml.c_nvmlGpmMetricsGet_t(version=pynvml.NVML_GPM_METRICS_GET_VERSION,
                                               numMetrics=len(_GPM_METRICS))
        for slot, (metric, _) in zip(request.metrics, _GPM_METRICS, strict=False):
            slot.metricId = metric
        return _Gpm(samples, request)

    def _gpm_ratios(self, handle: Any, gpm: _Gpm, get: DeviceQuery) -> dict[str, float]:
        """Metrics between the previous collect's GPM sample and one taken now (none on the first)."""
        nvml = self._nvml
        current = 0 if gpm.previous == 1 else 1
        if get(nvml.nvmlGpmSampleGet, handle, gpm.samples[current]) is None:
            gpm.previous = None
            return {}
        previous, gpm.previous = gpm.previous, current
        if previous is None:
            return {}
        gpm.request.sample1, gpm.request.sample2 = gpm.samples[previous], gpm.samples[current]
        if get(nvml.nvmlGpmMetricsGet, gpm.request) is None:
            return {}
        metrics = zip(_GPM_METRICS, gpm.request.metrics, strict=False)
        return {key: _ratio(metric.value) for (_, key), metric in metrics
                if metric.nvmlReturn == pynvml.NVML_SUCCESS}


# -- exposition -----------------------------------------------------------------------------------


def _families(readings: NvmlReadings) -> list[Metric]:
    info, lost, source = GPU_INFO.family(), GPU_LOST.family(), ACTIVITY_SOURCE.family()
    gauges = [(spec.field, spec.family()) for spec in GPU_GAUGES]
    reasons, generation, width = CLOCK_EVENT_ACTIVE.family(), PCIE_LINK_GENERATION.family(), PCIE_LINK_WIDTH.family()
    replays, ecc_volatile, ecc_aggregate = (PCIE_REPLAYS.family(), ECC_VOLATILE_ERRORS.family(),
                                            ECC_AGGREGATE_ERRORS.family())
    remapped, remap_pending, remap_failure = (REMAPPED_ROWS.family(), ROW_REMAP_PENDING.family(),
                                              ROW_REMAP_FAILURE.family())
    xid, processes = XID_ERRORS.family(), PROCESS_MEMORY.family()
    for reading in readings.gpus:
        gpu = str(reading.index)
        if reading.uuid is not None:  # its identity was read once, all of it
            assert reading.pci_bus_id is not None and reading.model is not None
            info.add_metric([gpu, reading.uuid, reading.pci_bus_id, reading.model, readings.driver_version], 1)
        lost.add_metric([gpu], int(reading.lost))
        seen = reading.xid_errors
        for code in _FAULT_XIDS if reading.xid_watched else ():
            if code not in seen:
                xid.add_metric([gpu, code], 0)
        for code, count in seen.items():
            xid.add_metric([gpu, code], count)
        if reading.lost:
            continue
        assert reading.activity_source is not None, "a GPU that answers has one"
        source.add_metric([gpu, reading.activity_source], 1)
        for field, family in gauges:
            value = getattr(reading, field)
            if value is not None:
                family.add_metric([gpu], value)
        active = reading.clock_event_reasons
        if active is not None:
            for _, reason in CLOCK_EVENT_REASONS:
                reasons.add_metric([gpu, reason], int(reason in active))
        pcie = reading.pcie
        if pcie is not None:
            for kind, link_generation, link_width in (("current", pcie.current_generation, pcie.current_width),
                                                      ("max", pcie.max_generation, pcie.max_width)):
                if link_generation is not None:
                    generation.add_metric([gpu, kind], link_generation)
                if link_width is not None:
                    width.add_metric([gpu, kind], link_width)
            if pcie.replays is not None:
                replays.add_metric([gpu], pcie.replays)
        for ecc_family, ecc in ((ecc_volatile, reading.ecc_volatile), (ecc_aggregate, reading.ecc_aggregate)):
            for error, count in ecc.counts().items() if ecc is not None else ():
                ecc_family.add_metric([gpu, error], count)
        rows = reading.remapped_rows
        if rows is not None:
            for cause, rows_count in (("correctable", rows.correctable), ("uncorrectable", rows.uncorrectable)):
                if rows_count is not None:
                    remapped.add_metric([gpu, cause], rows_count)
            for family, flag in ((remap_pending, rows.pending), (remap_failure, rows.failure)):
                if flag is not None:
                    family.add_metric([gpu], flag)
        for process in reading.processes or ():
            if process.used_memory_bytes is not None:
                processes.add_metric([gpu, str(process.pid)], process.used_memory_bytes)
    families = [info, lost, source, *(family for _, family in gauges), reasons, generation, width, replays,
                ecc_volatile, ecc_aggregate, remapped, remap_pending, remap_failure, xid, processes]
    return [family for family in families if family.rows]
