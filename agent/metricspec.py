"""One exported metric family, declared once: its name, HELP text, unit, kind, labels and the reading field it exports.

Every family the agent exports is a ``MetricSpec`` beside the code that exports it (a collector's table, the
sampler's self-metrics, ``telemetry.metrics`` for the ranks' families), and whoever reads a family back names it by
its declaration: ``gpuwatch diagnose --prometheus`` (``f"{SPEC}"`` in PromQL reads the family's name), the outlier
fetch, and the tests that hold the alerts and dashboards to what the agent exports
(``tests/test_metric_families.py``). A rename is then one edit, and a family diagnosis reads but the agent no longer
exports fails a test instead of turning into a silent "no data".

Its own module, not ``collectors.base``, because both the collectors and ``telemetry.metrics`` declare families and
``collectors.base`` imports the telemetry store: each imports this leaf instead of the other.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Iterable, Iterator
from typing import Any, Literal

from gpuwatch.agent.exposition import CounterFamily, GaugeFamily, RowFamily

Kind = Literal["gauge", "counter", "info", "histogram"]

#: The suffixes of the series a family of each kind exposes (text format 0.0.4, as prometheus-client writes it).
_SAMPLE_SUFFIXES: dict[str, tuple[str, ...]] = {
    "gauge": ("",), "info": ("",), "counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
#: The TYPE each kind is exposed as: 0.0.4 has no info type, so an info family is a gauge whose series are all 1.
_EXPOSED_TYPES: dict[str, str] = {"gauge": "gauge", "info": "gauge", "counter": "counter", "histogram": "histogram"}


#: Prometheus' base units (https://prometheus.io/docs/practices/naming/#base-units), the clock frequency and power
#: the GPU reports in (hertz, watts), and FLOPs for a model's throughput; a unit is one of them or one per second.
BASE_UNITS = frozenset({"seconds", "bytes", "ratio", "celsius", "volts", "amperes", "joules", "grams", "meters",
                        "hertz", "watts", "flops"})
#: Units that are not base units, with the one to use: promtool rejects some, and a reader would have to convert.
NON_BASE_UNITS = {"bits": "bytes", "milliseconds": "seconds", "microseconds": "seconds", "nanoseconds": "seconds",
                  "minutes": "seconds", "hours": "seconds", "percent": "ratio", "kilobytes": "bytes",
                  "megabytes": "bytes", "gigabytes": "bytes", "kibibytes": "bytes", "mebibytes": "bytes",
                  "gibibytes": "bytes", "fahrenheit": "celsius", "millivolts": "volts", "milliwatts": "watts",
                  "megahertz": "hertz"}


def _unit_problem(name: str, unit: str) -> str | None:
    """Why ``unit`` (or, unitless, the name's last word) is not a base unit, or None."""
    words = unit.split("_per_") if unit else [name.removesuffix("_total").rsplit("_", 1)[-1]]
    for word in words:
        if word in NON_BASE_UNITS:
            return f"{word} is not a Prometheus base unit: use {NON_BASE_UNITS[word]}"
    if unit and (len(words) > 2 or words[0] not in BASE_UNITS or words[1:] not in ([], ["second"])):
        return f"{unit} is not a Prometheus base unit ({', '.join(sorted(BASE_UNITS))}) or one per second"
    return None


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    """One exported family. ``name`` is the family's name as Prometheus' metadata lists it (a counter's without
    ``_total``, a histogram's without ``_bucket``); ``sample_names`` are the series a query selects. ``unit`` is the
    base unit of the value ("" for counts and plain numbers), which Prometheus naming puts in the name; ``field``
    names the reading (or telemetry record field) the value comes from, "" where no single one does; ``labels`` are
    the family's label names (a rank's coordinates included).

    ``str(spec)`` is the name, so that PromQL is written ``f"rate({SPEC}_total[5m])"`` and a rename follows."""

    name: str
    help: str
    unit: str = ""
    field: str = ""
    kind: Kind = dataclasses.field(default="gauge", kw_only=True)
    labels: tuple[str, ...] = dataclasses.field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        if (problem := _unit_problem(self.name, self.unit)) is not None:
            raise ValueError(f"{self.name}: {problem}")
        if self.unit and f"_{self.unit}" not in self.name:
            raise ValueError(f"{self.name} does not name its unit {self.unit}")
        if self.kind == "counter" and self.name.endswith("_total"):
            raise ValueError(f"{self.name}: a counter is declared without _total, which its series add")
        if self.kind == "info" and not self.name.endswith("_info"):
            raise ValueError(f"{self.name}: an info family's name ends in _info")

    def __str__(self) -> str:
        return self.name

    @property
    def sample_names(self) -> tuple[str, ...]:
        """The names of the family's series: a counter's ``_total``, a histogram's ``_bucket``, ``_count``, ``_sum``."""
        return tuple(self.name + suffix for suffix in _SAMPLE_SUFFIXES[self.kind])

    @property
    def exposed_type(self) -> str:
        """The family's ``# TYPE`` in the exposition."""
        return _EXPOSED_TYPES[self.kind]

    def family(self, value: float | None = None) -> RowFamily:
        """The family to fill with ``add_metric`` (one row per label values, in ``labels`` order), or, unlabelled,
        holding its one ``value`` (none when ``value`` is None). A histogram's lines are written by its exporter."""
        if self.kind == "histogram":
            raise ValueError(f"{self.name}: a histogram's lines are written by its exporter, not as rows")
        family_type = CounterFamily if self.kind == "counter" else GaugeFamily
        return family_type(self.name, self.help, value=value, labels=list(self.labels) if self.labels else None)


def by_field(specs: Iterable[MetricSpec], field: str) -> MetricSpec:
    """The declaration among ``specs`` (a collector's or the ranks' table) that exports ``field``: how a reader names
    one family of a table by the quantity it holds, so that a renamed family is still found and a removed one fails
    at import."""
    found = [spec for spec in specs if spec.field == field]
    if len(found) != 1:
        raise LookupError(f"{len(found)} declarations export {field!r}")
    return found[0]


def _specs_in(value: Any) -> Iterator[MetricSpec]:
    """The declarations ``value`` holds: itself, or the members of a table (a tuple, list or dict of them)."""
    if isinstance(value, MetricSpec):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _specs_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _specs_in(item)


def declared(package: str = "gpuwatch.agent") -> dict[str, tuple[str, MetricSpec]]:
    """Every family a module of ``package`` declares (alone, or in a table), by name: the declaring module and the
    declaration, in module order. What the families check holds to a simulated agent's scrape and the docs' families
    table is made from; a name declared by two different declarations raises (a family is declared in one place)."""
    found: dict[str, tuple[str, MetricSpec]] = {}
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, f"{package}."):
        for value in vars(importlib.import_module(info.name)).values():
            for spec in _specs_in(value):
                module, known = found.setdefault(spec.name, (info.name, spec))
                if known is not spec and known != spec:
                    raise ValueError(f"{spec.name} is declared twice: in {module} and {info.name}")
    return found
