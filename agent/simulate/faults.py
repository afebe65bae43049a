"""Hardware and host faults planted into a simulated node from a file (``gpuwatch agent --simulate PRESET
--simulate.faults FILE``): what a real node shows on a bad day, from the agent's start, through the same scripting
hooks the collector tests use (``FakeNvml``, ``SimulatedSysfs``).

The file is JSON: an object with a ``faults`` list, each entry naming its ``fault`` kind and the kind's fields::

    {"faults": [
      {"fault": "xid", "gpu": 3, "xid": 79},
      {"fault": "nvlink_down", "gpu": 0, "link": 2},
      {"fault": "ib_port_down", "device": "mlx5_1", "phys_state": "Polling"},
      {"fault": "ib_errors", "device": "mlx5_2", "counter": "symbol_error", "count": 50},
      {"fault": "pcie", "gpu": 1, "generation": 3, "width": 8},
      {"fault": "clock_slowdown", "gpu": 2, "reasons": ["hw_thermal_slowdown"]},
      {"fault": "ecc", "gpu": 4, "uncorrected": 2},
      {"fault": "row_remap_failure", "gpu": 5},
      {"fault": "gpu_lost", "gpu": 6}
    ]}

Every entry is checked against the preset (GPU, link and HCA numbers, the PCIe maximum, counter and reason names)
before the agent starts: a bad file is one error naming the entry and the problem (``FaultsError``). A planted Xid
arrives once the nvml collector listens for Xid events (``Simulation.advance``), as a real one would; an error
counter burst counts once, so the port's errors rise over the first rounds.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gpuwatch.agent.collectors.infiniband import ERROR_COUNTERS, PHYS_STATES
from gpuwatch.agent.collectors.nvml import CLOCK_EVENT_REASONS
from gpuwatch.agent.simulate import Preset

#: The clock event reasons a fault may set, by the name the nvml collector exports (``reason`` label).
CLOCK_REASONS: dict[str, int] = {name: bit for bit, name in CLOCK_EVENT_REASONS}
#: The physical states a down port may report: the cable or peer gone (Polling) or administratively down.
DOWN_PHYS_STATES = tuple(name for name in PHYS_STATES.values() if name in ("Polling", "Disabled"))


class FaultsError(ValueError):
    """A faults file that cannot be planted: the message names the file, the entry and the problem."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One planted fault: its kind and its checked fields."""

    kind: str
    fields: Mapping[str, Any]

    def describe(self) -> str:
        return f"{self.kind}(" + ", ".join(f"{name}={value}" for name, value in self.fields.items()) + ")"


@dataclasses.dataclass(frozen=True)
class _Field:
    kind: type
    required: bool = True
    default: Any = None
    check: Callable[[Any, Preset], str | None] = lambda value, preset: None


def _gpu(value: int, preset: Preset) -> str | None:
    return None if 0 <= value < preset.gpu_count else \
        f"gpu {value} out of range (the {preset.name} preset has GPUs 0-{preset.gpu_count - 1})"


def _link(value: int, preset: Preset) -> str | None:
    if not preset.nvlinks_per_gpu:
        return f"the {preset.name} preset has no NVLink"
    return None if 0 <= value < preset.nvlinks_per_gpu else \
        f"link {value} out of range (the {preset.name} preset has links 0-{preset.nvlinks_per_gpu - 1} per GPU)"


def _device(value: str, preset: Preset) -> str | None:
    devices = [f"mlx5_{index}" for index in range(preset.ib_ports)]
    return None if value in devices else f"no HCA {value!r} (the {preset.name} preset has {', '.join(devices)})"


def _one_of(names: tuple[str, ...] | list[str], what: str) -> Callable[[Any, Preset], str | None]:
    def check(value: Any, preset: Preset) -> str | None:
        values = value if isinstance(value, list) else [value]
        unknown = [item for item in values if item not in names]
        if not values:
            return f"no {what} given"
        return f"unknown {what} {', '.join(map(repr, unknown))} (one of {', '.join(names)})" if unknown else None
    return check


def _generation(value: int, preset: Preset) -> str | None:
    return None if 1 <= value <= preset.pcie_max_generation else \
        f"PCIe generation {value} out of range (1-{preset.pcie_max_generation} on the {preset.name} preset)"


def _width(value: int, preset: Preset) -> str | None:
    return None if value in (1, 2, 4, 8, 16) and value <= preset.pcie_max_width else \
        f"PCIe width {value} not one of x1, x2, x4, x8, x16 up to the {preset.name} preset's x{preset.pcie_max_width}"


def _positive(value: int, preset: Preset) -> str | None:
    return None if value > 0 else f"{value} is not a positive count"


def _count(value: int, preset: Preset) -> str | None:
    return None if value >= 0 else f"{value} is a negative count"


#: Each fault kind's fields: type, whether required (else its default), and the check against the preset.
KINDS: dict[str, dict[str, _Field]] = {
    "xid": {"gpu": _Field(int, check=_gpu), "xid": _Field(int, check=_positive)},
    "nvlink_down": {"gpu": _Field(int, check=_gpu), "link": _Field(int, check=_link)},
    "ib_port_down": {"device": _Field(str, check=_device),
                     "phys_state": _Field(str, False, "Disabled", _one_of(DOWN_PHYS_STATES, "physical state"))},
    "ib_errors": {"device": _Field(str, check=_device),
                  "counter": _Field(str, check=_one_of(ERROR_COUNTERS, "counter")),
                  "count": _Field(int, check=_positive)},
    "pcie": {"gpu": _Field(int, check=_gpu), "generation": _Field(int, False, check=_generation),
             "width": _Field(int, False, check=_width)},
    "clock_slowdown": {"gpu": _Field(int, check=_gpu),
                       "reasons": _Field(list, check=_one_of(tuple(CLOCK_REASONS), "clock event reason"))},
    "ecc": {"gpu": _Field(int, check=_gpu), "corrected": _Field(int, False, 0, _count),
            "uncorrected": _Field(int, False, 0, _count)},
    "row_remap_failure": {"gpu": _Field(int, check=_gpu)},
    "gpu_lost": {"gpu": _Field(int, check=_gpu)},
}


def _entry(raw: Any, preset: Preset) -> Fault:
    if not isinstance(raw, dict):
        raise FaultsError(f"is {type(raw).__name__}, not an object of fields")
    kind = raw.get("fault")
    if kind not in KINDS:
        raise FaultsError(f"'fault' is {kind!r}, not one of {', '.join(KINDS)}")
    spec = KINDS[kind]
    unknown = sorted(set(raw) - set(spec) - {"fault"})
    if unknown:
        raise FaultsError(f"({kind}) unknown field(s) {', '.join(unknown)} (fields: {', '.join(spec)})")
    fields: dict[str, Any] = {}
    for name, field in spec.items():
        if name not in raw:
            if field.required:
                raise FaultsError(f"({kind}) lacks {name!r}")
            fields[name] = field.default
            continue
        value = raw[name]
        if not isinstance(value, field.kind) or isinstance(value, bool):
            raise FaultsError(f"({kind}) {name!r} is {value!r}, not {'an' if field.kind is int else 'a'} "
                              f"{field.kind.__name__}")
        problem = field.check(value, preset)
        if problem is not None:
            raise FaultsError(f"({kind}) {problem}")
        fields[name] = value
    if kind == "pcie" and fields["generation"] is None and fields["width"] is None:
        raise FaultsError("(pcie) sets neither 'generation' nor 'width'")
    if kind == "ecc" and not (fields["corrected"] or fields["uncorrected"]):
        raise FaultsError("(ecc) counts no error ('corrected' and 'uncorrected' both 0)")
    return Fault(kind, fields)


def load(path: Path, preset: Preset) -> list[Fault]:
    """The faults in the JSON file ``path``, checked against ``preset``."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise FaultsError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FaultsError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(document, dict) or not isinstance(document.get("faults"), list):
        raise FaultsError(f"{path}: expected an object with a 'faults' list")
    unknown = sorted(set(document) - {"faults"})
    if unknown:
        raise FaultsError(f"{path}: unknown key(s) {', '.join(unknown)} (only 'faults')")
    faults = []
    for index, raw in enumerate(document["faults"]):
        try:
            faults.append(_entry(raw, preset))
        except FaultsError as exc:
            raise FaultsError(f"{path}: fault {index} {exc}") from None
    return faults
