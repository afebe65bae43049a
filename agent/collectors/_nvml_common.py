"""What the nvml and nvlink collectors share: an NVML session (lazy ``nvmlInit``, retried with a growing
back-off until it succeeds), the device handles, and NVML's error conventions.

Error classes and constants come from ``pynvml`` itself: the simulated node's stand-in module raises
the very same classes, so one ``except`` clause serves the real and the simulated path. Only the
functions are called through the module the collector was given.
"""

from __future__ import annotations

import ctypes
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pynvml

from gpuwatch.agent.collectors.base import CollectorError

#: Errors that mean "this device or driver does not have that value": they cost the value only.
ABSENT = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound, pynvml.NVMLLibraryMismatchError)

_FIELD_VALUE_MEMBER = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}


@dataclasses.dataclass
class Device:
    """One GPU as NVML enumerates it. ``handle`` is None when NVML gave none at start (``error`` says
    why); such a GPU is reported lost until the agent restarts."""

    index: int
    handle: Any
    error: str | None = None

    @property
    def label(self) -> str:
        return str(self.index)


#: Seconds before the first retry of a failed ``nvmlInit``; each failure doubles it, up to RETRY_MAX_SECONDS.
RETRY_FIRST_SECONDS = 2.0
RETRY_MAX_SECONDS = 300.0


class NvmlSession:
    """One collector's ``nvmlInit`` (NVML reference-counts them) and device handles.

    Initialisation happens on the first ``devices()`` call. When it fails it is retried after 2 s, then 4, 8 …
    up to 5 minutes, and in between ``devices()`` raises the last error again without calling NVML: a node
    without a driver pays for one failed ``nvmlInit`` every 5 minutes, not every round (it cost ~0.9 % of a core at
    1 s sampling), and an agent started before the driver finished loading still recovers by itself.
    """

    def __init__(self, nvml: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.nvml = nvml if nvml is not None else pynvml
        self._devices: list[Device] | None = None
        self._clock = clock
        self._failure: CollectorError | None = None
        self._retry_at = 0.0
        self._backoff = RETRY_FIRST_SECONDS

    def devices(self) -> list[Device]:
        """The node's GPUs; raises ``CollectorError`` when NVML cannot be used at all."""
        if self._devices is None:
            if self._failure is not None and self._clock() < self._retry_at:
                raise CollectorError(f"{self._failure} (next retry in {self._retry_at - self._clock():.0f} s)")
            try:
                self._devices = self._start()
            except CollectorError as failure:
                self._failure, self._retry_at = failure, self._clock() + self._backoff
                self._backoff = min(2 * self._backoff, RETRY_MAX_SECONDS)
                raise
            self._failure, self._backoff = None, RETRY_FIRST_SECONDS
        return self._devices

    def _start(self) -> list[Device]:
        nvml = self.nvml
        try:
            nvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound as exc:
            raise CollectorError("NVML library not found: no NVIDIA driver on this node") from exc
        except pynvml.NVMLError as exc:
            raise CollectorError(f"nvmlInit failed: {exc}") from exc
        try:
            count = nvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            nvml.nvmlShutdown()
            raise CollectorError(f"nvmlDeviceGetCount failed: {exc}") from exc
        devices = []
        for index in range(count):
            try:
                devices.append(Device(index, nvml.nvmlDeviceGetHandleByIndex(index)))
            except pynvml.NVMLError as exc:
                devices.append(Device(index, None, f"no NVML handle: {exc}"))
        return devices

    def close(self) -> None:
        if self._devices is not None:
            self._devices = None
            self.nvml.nvmlShutdown()


class DeviceQuery:
    """Calls NVML getters for one GPU during one collect.

    A value the device or driver lacks (NotSupported, FunctionNotFound) returns None silently; any
    other NVML error also returns None and is noted in ``errors``; GpuIsLost propagates, so that the
    caller reports the whole GPU lost and goes on with the others.
    """

    def __init__(self, device: Device, errors: list[str]) -> None:
        self.device = device
        self.errors = errors

    def __call__(self, getter: Callable[..., Any], *args: Any) -> Any:
        try:
            return getter(*args)
        except pynvml.NVMLError_GpuIsLost:
            raise
        except ABSENT:
            return None
        except pynvml.NVMLError as exc:
            self.errors.append(f"gpu {self.device.index}: {getter.__name__}: {exc}")
            return None


class _FieldValue(ctypes.Structure):
    """``c_nvmlFieldValue_t``'s layout without pynvml's Python ``__getattribute__`` on every member (it
    decodes bytes, which a field value never holds): an 8-GPU node reads ~1,000 field values a round."""

    _fields_ = pynvml.c_nvmlFieldValue_t._fields_


def field_values(values: ctypes.Array) -> list[int | float | None]:
    """The numbers in an array nvmlDeviceGetFieldValues filled; None where NVML could not read the field."""
    raw = (_FieldValue * len(values)).from_buffer(values)
    success, members = pynvml.NVML_SUCCESS, _FIELD_VALUE_MEMBER
    return [getattr(value.value, members[value.valueType]) if value.nvmlReturn == success else None
            for value in raw]


def handle_key(handle: Any) -> int:
    """The address a device handle points to: equal for every copy NVML hands out (event data)."""
    return ctypes.cast(handle, ctypes.c_void_p).value or 0  # ctypes reads NULL as None
