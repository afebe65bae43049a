"""A scripted stand-in for the ``pynvml`` module, for machines without GPUs (simulated node, tests).

It has pynvml's function names and signatures for everything the collectors call, raises pynvml's own
error classes where the C library would return an error code, re-exports pynvml's constants, error
classes and ctypes structs, and returns the same struct types as pynvml. Values move with
``advance()``; the scripting hooks (the public methods not named ``nvml…``) inject what a real node
shows on a bad day: no driver, a lost GPU, a link down, Xid events, throttling, a degraded PCIe link,
ECC errors, an unsupported or failing call, a call that hangs in the driver.

Past 500 lines on purpose: one stand-in for one module's API, ``FakeNvml``, a method per pynvml function the
collectors call, in pynvml's order of subjects.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import random
import threading
import time
import types
import uuid
from collections.abc import Callable
from typing import Any

import pynvml
from pynvml import NVMLError

from gpuwatch.agent.simulate import Preset

# Activity the fake models, as the GPM metrics that report it (percent).
_BUSY = pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL
_SM_ACTIVE = pynvml.NVML_GPM_METRIC_SM_UTIL
_SM_OCCUPANCY = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
_TENSOR_ACTIVE = pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL
_DRAM_ACTIVE = pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
# Share of "busy" each activity shows in a typical bf16 transformer training step.
_ACTIVITY_SHARE = {_BUSY: 1.0, _SM_ACTIVE: 0.9, _SM_OCCUPANCY: 0.45, _TENSOR_ACTIVE: 0.55, _DRAM_ACTIVE: 0.5}

# Max SM and memory clocks (MHz); the first key found in the preset's model name applies.
_CLOCKS_MHZ = {"H100": (1980, 2619), "A100": (1410, 1215)}

_XID_EVENT = pynvml.nvmlEventTypeXidCriticalError
_SUPPORTED_EVENTS = (_XID_EVENT | pynvml.nvmlEventTypeSingleBitEccError
                     | pynvml.nvmlEventTypeDoubleBitEccError | pynvml.nvmlEventTypePState
                     | pynvml.nvmlEventTypeClock)
_SLOWDOWN_REASONS = (pynvml.nvmlClocksEventReasonHwSlowdown | pynvml.nvmlClocksEventReasonHwThermalSlowdown
                     | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
                     | pynvml.nvmlClocksEventReasonSwThermalSlowdown)

_ULL = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
_UINT = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
_ECC_FIELDS = {  # (corrected?, volatile?) -> field
    (True, True): pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL,
    (False, True): pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL,
    (True, False): pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL,
    (False, False): pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL,
}
# Device-wide fields the fake answers, with the value type NVML reports them in.
_DEVICE_FIELDS = {
    **dict.fromkeys(_ECC_FIELDS.values(), _ULL),
    pynvml.NVML_FI_DEV_REMAPPED_COR: _UINT,
    pynvml.NVML_FI_DEV_REMAPPED_UNC: _UINT,
    pynvml.NVML_FI_DEV_REMAPPED_PENDING: _UINT,
    pynvml.NVML_FI_DEV_REMAPPED_FAILURE: _UINT,
    pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER: _UINT,
}
_LINK_ERROR_FIELDS = (pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC, pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY,
                      pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY)


def _address(pointer: Any) -> int:
    return ctypes.cast(pointer, ctypes.c_void_p).value or 0  # ctypes reads NULL as None


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _nvml_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a pynvml stand-in: scripted hang, init check, lost GPU and scripted error come first. The CPU time of
    each outermost call (its thread's, so collectors calling at once are told apart; a scripted hang sleeps and
    costs none) adds to ``FakeNvml.cpu_seconds``: the simulation's share of the agent's CPU."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(self: FakeNvml, *args: Any, **kwargs: Any) -> Any:
        calls = self._calls
        outermost = not getattr(calls, "inside", False)  # else called by another scripted function: its time
        if outermost:
            calls.inside, started = True, self._cpu_clock()
        try:
            self._enter(name, args[0] if args else None)
            return fn(self, *args, **kwargs)
        finally:
            if outermost:
                calls.inside = False
                spent = self._cpu_clock() - started
                with self._cpu_lock:
                    self.cpu_seconds += spent

    return call


@dataclasses.dataclass
class FakeLink:
    up: bool = True
    tx_bytes: float = 0.0
    rx_bytes: float = 0.0
    errors: dict[int, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(_LINK_ERROR_FIELDS, 0))


@dataclasses.dataclass
class FakeGpu:
    """The scripted state of one GPU."""

    index: int
    handle: Any
    uuid: str
    pci_bus_id: str
    gpm_supported: bool
    pcie_generation: int
    pcie_width: int
    links: list[FakeLink]
    lost: bool = False
    #: Current activity and its integral over the simulated clock (percent, percent·seconds), by GPM metric.
    activity: dict[int, float] = dataclasses.field(default_factory=dict)
    activity_integral: dict[int, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(_ACTIVITY_SHARE, 0.0))
    memory_used: int = 0
    power_mw: int = 0
    temperature: int = 0
    sm_clock_mhz: int = 0
    clock_event_reasons: int = 0
    fields: dict[int, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(_DEVICE_FIELDS, 0))


@dataclasses.dataclass
class _EventSet:
    buffer: Any  # the handle's pointee, kept alive while the set exists
    registered: dict[int, int] = dataclasses.field(default_factory=dict)  # GPU index -> event mask
    pending: collections.deque = dataclasses.field(default_factory=collections.deque)


class FakeNvml:
    """A module-like object standing in for ``pynvml`` on one simulated node of ``preset``."""

    def __init__(self, preset: Preset, seed: int = 0, library_missing: bool = False,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self.preset = preset
        #: While true, ``nvmlInit`` fails as on a node without the NVIDIA driver.
        self.library_missing = library_missing
        self._rng = random.Random(seed)
        models = [model for model in _CLOCKS_MHZ if model in preset.gpu_model]
        self._max_sm_mhz, self._memory_mhz = _CLOCKS_MHZ[models[0] if models else "H100"]
        self._reserved_bytes = 512 * 1024**2
        self._initialised = 0
        #: CPU seconds spent in the scripted functions (``_nvml_function``)
        self.cpu_seconds = 0.0
        self._cpu_clock = cpu_clock  # the calling thread's CPU time
        self._cpu_lock = threading.Lock()
        self._calls = threading.local()
        self._clock = 0.0  # simulated seconds, moved by advance()
        self._last_advance = time.monotonic()
        self._hangs: dict[str, float] = {}
        self._failures: dict[tuple[str, int | None], int] = {}
        self._event_sets: dict[int, _EventSet] = {}
        # GPM sample address -> (its buffer, (clock, activity integrals, activity) once taken, else None)
        self._gpm_samples: dict[int, tuple[Any, Any]] = {}
        self.gpus = [self._new_gpu(index) for index in range(preset.gpu_count)]
        self._by_address = {_address(gpu.handle): gpu for gpu in self.gpus}

    def __getattr__(self, name: str) -> Any:
        """pynvml's constants, error classes and structs; its functions are never forwarded."""
        value = getattr(pynvml, name)
        if isinstance(value, types.FunctionType):
            raise AttributeError(f"FakeNvml does not implement {name}")
        return value

    def _new_gpu(self, index: int) -> FakeGpu:
        preset = self.preset
        gpu = FakeGpu(
            index=index,
            handle=ctypes.pointer(pynvml.struct_c_nvmlDevice_t()),
            uuid=f"GPU-{uuid.UUID(int=self._rng.getrandbits(128), version=4)}",
            pci_bus_id=f"00000000:{0x18 + 0x11 * index:02X}:00.0",
            gpm_supported=preset.gpm_supported,
            pcie_generation=preset.pcie_max_generation,
            pcie_width=preset.pcie_max_width,
            links=[FakeLink() for _ in range(preset.nvlinks_per_gpu)],
        )
        self._settle(gpu, busy=90.0)
        return gpu

    # -- simulation -------------------------------------------------------------------------------

    def advance(self, seconds: float | None = None) -> None:
        """Move the node forward by the wall time since the last call (or by ``seconds``)."""
        now = time.monotonic()
        elapsed = now - self._last_advance if seconds is None else seconds
        self._last_advance = now
        self._clock += elapsed
        link_rate = self.preset.nvlink_speed_mbps * 1e6
        for gpu in self.gpus:
            if gpu.lost:
                continue
            for metric, percent in gpu.activity.items():
                gpu.activity_integral[metric] += percent * elapsed
            load = gpu.activity[_BUSY] / 100 * 0.5  # collectives keep the links about half busy
            for link in gpu.links:
                if link.up:
                    link.tx_bytes += link_rate * load * elapsed
                    link.rx_bytes += link_rate * load * self._rng.uniform(0.95, 1.0) * elapsed
            self._settle(gpu, busy=gpu.activity[_BUSY] + self._rng.gauss(0, 2))

    def _settle(self, gpu: FakeGpu, busy: float) -> None:
        """Derive every gauge from how busy the GPU is, with a little noise."""
        busy = _clamp(busy, 70.0, 99.0)
        gpu.activity = {metric: busy * share for metric, share in _ACTIVITY_SHARE.items()}
        total = self.preset.gpu_memory_bytes - self._reserved_bytes
        gpu.memory_used = int(total * _clamp(0.8 + self._rng.gauss(0, 0.02), 0.6, 0.95))
        gpu.power_mw = int(self.preset.power_limit_watts * (0.35 + 0.6 * busy / 100) * 1000)
        gpu.temperature = int(40 + 0.35 * busy + self._rng.gauss(0, 1))
        slowed = gpu.clock_event_reasons & _SLOWDOWN_REASONS
        gpu.sm_clock_mhz = self._max_sm_mhz // 2 if slowed else self._max_sm_mhz

    # -- scripting hooks --------------------------------------------------------------------------

    def lose_gpu(self, gpu: int) -> None:
        """The GPU falls off the bus: every later call on it raises NVMLError_GpuIsLost."""
        self.gpus[gpu].lost = True

    def set_gpm_supported(self, supported: bool, gpu: int | None = None) -> None:
        for state in self.gpus if gpu is None else [self.gpus[gpu]]:
            state.gpm_supported = supported

    def set_nvlink_up(self, gpu: int, link: int, up: bool) -> None:
        self.gpus[gpu].links[link].up = up

    def inject_nvlink_errors(self, gpu: int, link: int, crc: int = 0, replay: int = 0,
                             recovery: int = 0) -> None:
        errors = self.gpus[gpu].links[link].errors
        for field, count in zip(_LINK_ERROR_FIELDS, (crc, replay, recovery), strict=True):
            errors[field] += count

    def inject_xid(self, gpu: int, xid: int) -> None:
        """A critical Xid on ``gpu``, delivered through every event set registered for Xid on it."""
        state = self.gpus[gpu]
        for event_set in self._event_sets.values():
            if event_set.registered.get(gpu, 0) & _XID_EVENT:
                event_set.pending.append((state, _XID_EVENT, xid))

    def listens_for_xid(self, gpu: int) -> bool:
        """Whether an event set is registered for Xid events on ``gpu``: an Xid injected before is seen by no one."""
        return any(event_set.registered.get(gpu, 0) & _XID_EVENT for event_set in self._event_sets.values())

    def fail_row_remap(self, gpu: int) -> None:
        """A row remap failed: the GPU ran out of spare rows (NVML_FI_DEV_REMAPPED_FAILURE)."""
        self.gpus[gpu].fields[pynvml.NVML_FI_DEV_REMAPPED_FAILURE] = 1

    def inject_ecc(self, gpu: int, corrected: int = 0, uncorrected: int = 0) -> None:
        """ECC errors; an uncorrectable one leaves a row remap pending until the GPU is reset."""
        fields = self.gpus[gpu].fields
        for volatile in (True, False):
            fields[_ECC_FIELDS[True, volatile]] += corrected
            fields[_ECC_FIELDS[False, volatile]] += uncorrected
        if uncorrected:
            fields[pynvml.NVML_FI_DEV_REMAPPED_PENDING] = 1

    def set_clock_event_reasons(self, gpu: int, reasons: int) -> None:
        """``reasons``: a mask of pynvml's nvmlClocksEventReason* bits; slowdowns halve the SM clock."""
        state = self.gpus[gpu]
        state.clock_event_reasons = reasons
        self._settle(state, busy=state.activity[_BUSY])

    def set_pcie_link(self, gpu: int, generation: int | None = None, width: int | None = None) -> None:
        """Train the GPU's PCIe link down (or back up) to ``generation`` / ``width`` lanes."""
        state = self.gpus[gpu]
        state.pcie_generation = generation or state.pcie_generation
        state.pcie_width = width or state.pcie_width

    def hang(self, function: str, seconds: float) -> None:
        """Every later call of ``function`` blocks for ``seconds`` first (0 ends it), like a stuck driver."""
        self._hangs[function] = seconds

    def fail(self, function: str, error: int | None, gpu: int | None = None) -> None:
        """Later calls of ``function`` (on ``gpu``, or on any) fail with NVML return code ``error``
        (e.g. ``NVML_ERROR_NOT_SUPPORTED``); ``None`` lifts it."""
        if error is None:
            self._failures.pop((function, gpu), None)
        else:
            self._failures[function, gpu] = error

    # -- call plumbing ----------------------------------------------------------------------------

    def _enter(self, name: str, first_argument: Any) -> None:
        delay = self._hangs.get(name)
        if delay:
            time.sleep(delay)
        if not self._initialised and name != "nvmlInit":
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        gpu = self._gpu(first_argument) if isinstance(first_argument, pynvml.c_nvmlDevice_t) else None
        if gpu is not None and gpu.lost:
            raise NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        error = self._failures.get((name, gpu.index if gpu else None)) or self._failures.get((name, None))
        if error:
            raise NVMLError(error)

    def _gpu(self, handle: Any) -> FakeGpu:
        gpu = self._by_address.get(_address(handle))
        if gpu is None:
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu

    # -- pynvml functions -------------------------------------------------------------------------

    @_nvml_function
    def nvmlInit(self) -> None:
        if self.library_missing:
            raise NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        self._initialised += 1

    @_nvml_function
    def nvmlShutdown(self) -> None:
        self._initialised -= 1

    @_nvml_function
    def nvmlSystemGetDriverVersion(self) -> str:
        return self.preset.driver_version

    @_nvml_function
    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    @_nvml_function
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not 0 <= index < len(self.gpus):
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        if gpu.lost:
            raise NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu.handle

    @_nvml_function
    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self.preset.gpu_model

    @_nvml_function
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._gpu(handle).uuid

    @_nvml_function
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        bus_id = self._gpu(handle).pci_bus_id
        info = pynvml.nvmlPciInfo_t()
        info.busId = bus_id.encode()
        info.busIdLegacy = bus_id[4:].encode()
        info.bus = int(bus_id.split(":")[1], 16)
        return info

    @_nvml_function
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        activity = self._gpu(handle).activity
        return pynvml.c_nvmlUtilization_t(gpu=round(activity[_BUSY]), memory=round(activity[_DRAM_ACTIVE]))

    @_nvml_function
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        gpu = self._gpu(handle)
        total, reserved = self.preset.gpu_memory_bytes, self._reserved_bytes
        free = total - reserved - gpu.memory_used
        if not version:  # v1 counts the reserved memory as used
            return pynvml.c_nvmlMemory_t(total=total, free=free, used=gpu.memory_used + reserved)
        return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=reserved, free=free,
                                        used=gpu.memory_used)

    @_nvml_function
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._gpu(handle).power_mw

    @_nvml_function
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu(handle).temperature

    @_nvml_function
    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        if type in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
            return self._gpu(handle).sm_clock_mhz
        if type == pynvml.NVML_CLOCK_MEM:
            return self._memory_mhz
        raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    @_nvml_function
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._gpu(handle).clock_event_reasons

    @_nvml_function
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        return self._gpu(handle).clock_event_reasons

    @_nvml_function
    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        return self._gpu(handle).pcie_generation

    @_nvml_function
    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        return self.preset.pcie_max_generation

    @_nvml_function
    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        return self._gpu(handle).pcie_width

    @_nvml_function
    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        return self.preset.pcie_max_width

    @_nvml_function
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        gpu = self._gpu(handle)
        process = pynvml.c_nvmlProcessInfo_t(pid=4242 + gpu.index, usedGpuMemory=gpu.memory_used,
                                             gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
        return [pynvml.nvmlStructToFriendlyObject(process)]

    @_nvml_function
    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        gpu = self._gpu(handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for value, field in zip(values, fieldIds, strict=True):
            field_id, scope = field if isinstance(field, tuple) else (field, 0)
            value.fieldId, value.scopeId = field_id, scope
            value.nvmlReturn, value.valueType, number = self._field(gpu, field_id, scope)
            setattr(value.value, "uiVal" if value.valueType == _UINT else "ullVal", number)
        return values

    def _field(self, gpu: FakeGpu, field: int, scope: int) -> tuple[int, int, int]:
        """(return code, value type, value) of one field, as NVML fills a c_nvmlFieldValue_t."""
        if field in _DEVICE_FIELDS:
            return pynvml.NVML_SUCCESS, _DEVICE_FIELDS[field], gpu.fields[field]
        if not gpu.links:
            return pynvml.NVML_ERROR_NOT_SUPPORTED, _ULL, 0
        if field == pynvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON:
            return pynvml.NVML_SUCCESS, _UINT, self.preset.nvlink_speed_mbps
        if scope >= len(gpu.links):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT, _ULL, 0
        link = gpu.links[scope]
        if field == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX:
            return pynvml.NVML_SUCCESS, _ULL, int(link.tx_bytes) // 1024
        if field == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX:
            return pynvml.NVML_SUCCESS, _ULL, int(link.rx_bytes) // 1024
        if field in link.errors:
            return pynvml.NVML_SUCCESS, _ULL, link.errors[field]
        if field == pynvml.NVML_FI_DEV_NVLINK_GET_SPEED:
            return pynvml.NVML_SUCCESS, _UINT, self.preset.nvlink_speed_mbps if link.up else 0
        if field == pynvml.NVML_FI_DEV_NVLINK_GET_STATE:
            state = pynvml.NVML_NVLINK_STATE_ACTIVE if link.up else pynvml.NVML_NVLINK_STATE_INACTIVE
            return pynvml.NVML_SUCCESS, _UINT, state
        return pynvml.NVML_ERROR_NOT_SUPPORTED, _ULL, 0

    @_nvml_function
    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        links = self._gpu(device).links
        if not links:
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(links):
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED if links[link].up else pynvml.NVML_FEATURE_DISABLED

    @_nvml_function
    def nvmlEventSetCreate(self) -> Any:
        event_set = ctypes.pointer(pynvml.struct_c_nvmlEventSet_t())
        self._event_sets[_address(event_set)] = _EventSet(event_set)
        return event_set

    @_nvml_function
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        if eventTypes & ~_SUPPORTED_EVENTS:
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        registered = self._event_set(eventSet).registered
        index = self._gpu(handle).index
        registered[index] = registered.get(index, 0) | eventTypes

    @_nvml_function
    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        pending = self._event_set(eventSet).pending
        if not pending:
            time.sleep(timeoutms / 1000)
            raise NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        gpu, event_type, data = pending.popleft()
        return pynvml.c_nvmlEventData_t(device=gpu.handle, eventType=event_type, eventData=data,
                                        gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)

    @_nvml_function
    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self._event_sets.pop(_address(eventSet), None)

    def _event_set(self, event_set: Any) -> _EventSet:
        found = self._event_sets.get(_address(event_set))
        if found is None:
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return found

    @_nvml_function
    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any:
        return pynvml.c_nvmlGpmSupport_t(version=pynvml.NVML_GPM_SUPPORT_VERSION,
                                         isSupportedDevice=int(self._gpu(device).gpm_supported))

    @_nvml_function
    def nvmlGpmSampleAlloc(self) -> Any:
        sample = ctypes.pointer(pynvml.struct_c_nvmlGpmSample_t())
        self._gpm_samples[_address(sample)] = (sample, None)  # the dict keeps the buffer alive
        return sample

    @_nvml_function
    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        self._gpm_samples.pop(_address(gpmSample), None)

    @_nvml_function
    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> Any:
        gpu = self._gpu(device)
        if not gpu.gpm_supported:
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        key = _address(gpmSample)
        if key not in self._gpm_samples:
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._gpm_samples[key] = (gpmSample, (self._clock, dict(gpu.activity_integral), dict(gpu.activity)))
        return gpmSample

    @_nvml_function
    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        """Each metric is the average activity between the two samples, as GPM computes it."""
        if metricsGet.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        first = self._gpm_samples.get(_address(metricsGet.sample1), (None, None))[1]
        second = self._gpm_samples.get(_address(metricsGet.sample2), (None, None))[1]
        if first is None or second is None:
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        (t1, integral1, _), (t2, integral2, current) = first, second
        for metric in metricsGet.metrics[:metricsGet.numMetrics]:
            if metric.metricId not in current:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            metric.nvmlReturn = pynvml.NVML_SUCCESS
            metric.value = ((integral2[metric.metricId] - integral1[metric.metricId]) / (t2 - t1)
                            if t2 > t1 else current[metric.metricId])
        return metricsGet
