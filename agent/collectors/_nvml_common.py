"""What the nvml and nvlink collectors share: an NVML session (lazy ``nvmlInit``, tried again on a later round
when it fails: the sampler backs off a failing collector), the device handles, and NVML's error conventions.

Error classes and constants come from ``pynvml`` itself: the simulated node's stand-in module raises
the very same classes, so one ``except`` clause serves the real and the simulated path. Only the
functions are called through the module the collector was given.
"""

from __future__ import annotations

import ctypes
import dataclasses
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


class NvmlSession:
    """One collector's ``nvmlInit`` (NVML reference-counts them) and device handles.

    Initialisation happens on the first ``devices()`` call and, while it fails, on every later one: how often that
    is, is the sampler's back-off (``gpuwatch.agent.sampler``), so a node without a driver pays for one failed
    ``nvmlInit`` every few minutes, and an agent started before the driver finished loading recovers by itself.
    """

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml if nvml is not None else pynvml
        self._devices: list[Device] | None = None

    def devices(self) -> list[Device]:
        """The node's GPUs; raises ``CollectorError`` when NVML cannot be used at all."""
        if self._devices is None:
            self._devices = self._start()
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
