"""Prometheus text exposition (format 0.0.4), re-rendering only what changed since the last render.

prometheus-client's ``generate_latest`` re-escapes and re-joins every label set on every call;
for a full node (~9,600 samples with 64 ranks) that is tens of ms. Here each family remembers its
last rendering: a family whose samples are unchanged is reused whole, and in one whose label sets
are unchanged only the lines whose value changed are formatted again. The families are
prometheus-client's own ``Metric`` objects, so its types and naming rules still apply, and the
output is byte-identical to ``generate_latest``. The collectors' gauges and counters are ``GaugeFamily`` and
``CounterFamily``: prometheus-client's families without a ``Sample`` per series, whose lines the renderer keys by
their label values (``RowFamily``); the per-rank telemetry writes its lines itself (``TextFamily``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Exposition type and the suffix the family name takes, as prometheus-client's generate_latest does.
_TYPE_AND_SUFFIX = {
    "counter": ("counter", "_total"),
    "info": ("gauge", "_info"),
    "stateset": ("gauge", ""),
    "gaugehistogram": ("histogram", ""),
    "unknown": ("untyped", ""),
}


def _escape_label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def series_prefix(name: str, labels: dict[str, str]) -> str:
    """``name{labels} ``: a sample line up to its value, labels sorted and escaped as generate_latest does."""
    if not labels:
        return name + " "
    body = ",".join(f'{k}="{_escape_label_value(str(v))}"' for k, v in sorted(labels.items()))
    return f"{name}{{{body}}} "


#: Integers below this are floats exactly (2**53), and below 1e16 repr writes a float without an exponent.
_EXACT_INTEGERS = 2**53


def format_value(value: Any) -> str:
    """``floatToGoString``, with fast paths for the small integers counters and buckets mostly hold, for floats
    below 1e6 (a rank's timings and ratios), and for the values from 1e6 up that Go writes with an exponent: the
    integers of byte counts (a rank's memory and collective volumes) and the floats of clocks and FLOP/s: ~140 values
    a rank, ~9,000 a render at 64 ranks."""
    if type(value) is int:
        if -1_000_000 < value < 1_000_000:
            return f"{value}.0"  # what repr(float(value)) gives; from 1e6 up Go switches to exponents
        if 0 < value < _EXACT_INTEGERS:  # repr(float(value)) is its digits and ".0"
            digits = str(value)
            return _go_exponent(digits, len(digits) - 1)
    elif type(value) is float:
        if -1e300 < value < 1_000_000.0:  # finite (NaN compares false) and below 1e6
            return repr(value)  # what floatToGoString writes: it rewrites only positive values from 1e6 up
        if 1_000_000.0 <= value < 1e16:  # repr writes its digits without an exponent
            whole, fraction = repr(value).split(".")
            return _go_exponent(whole + fraction, len(whole) - 1)
    return floatToGoString(value)


def _go_exponent(digits: str, exponent: int) -> str:
    """Go's form of a number from 1e6 up, from its decimal ``digits`` (the point after the first ``exponent + 1``):
    one digit before the point, no trailing zeros, a two-digit exponent at least."""
    return f"{(digits[0] + '.' + digits[1:]).rstrip('0.')}e+{exponent:02d}"


class TextFamily(Metric):
    """A family whose sample lines its collector wrote itself, with ``series_prefix`` and ``format_value`` (so
    the text is what generate_latest would write): for collectors that keep lines per entity across rounds
    and rewrite only the entities that changed. Name and type are checked as for any ``Metric``."""

    def __init__(self, name: str, documentation: str, typ: str, text: str) -> None:
        super().__init__(name, documentation, typ)
        self.text = text


class RowFamily(Metric):
    """A family whose series are rows of label values and a value, with prometheus-client's ``add_metric``: no
    ``Sample`` and no label dict per series, and the renderer compares and keys its cached lines by the label
    values. An 8-GPU node's NVML, NVLink, InfiniBand and host families are ~1,800 series a round: built and
    rendered anew as prometheus-client families, a median of 3.5–3.7 ms, as rows 1.6–1.7 ms
    (``benchmarks/scrape_cost.py``, side by side). ``samples`` gives prometheus-client's samples of the rows, built
    when asked (``generate_latest``, tests)."""

    #: The suffix the family's samples take (a counter's ``_total``).
    suffix = ""

    def __init__(self, name: str, documentation: str, typ: str, value: float | None = None,
                 labels: Sequence[str] | None = None) -> None:
        if labels is not None and value is not None:
            raise ValueError("Can only specify at most one of value and labels.")  # as prometheus-client says
        super().__init__(name, documentation, typ)
        self.label_names = tuple(labels or ())
        self.rows: list[tuple[tuple[str, ...], Any]] = [] if value is None else [((), value)]

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        self.rows.append((tuple(labels), value))

    def labelled(self, labels: tuple[str, ...]) -> dict[str, str]:
        """A row's label values by label name."""
        return dict(zip(self.label_names, labels, strict=True))

    def line_prefix(self, labels: tuple[str, ...]) -> str:
        """``name{labels} `` of a row's line (``series_prefix``)."""
        return series_prefix(self.name + self.suffix, self.labelled(labels))

    @property  # type: ignore[override]
    def samples(self) -> list[Sample]:
        name = self.name + self.suffix
        return [Sample(name, self.labelled(labels), value) for labels, value in self.rows]

    @samples.setter
    def samples(self, samples: list[Sample]) -> None:
        """``Metric.__init__`` gives every family an empty ``samples``: a row family's series are its rows."""
        if samples:
            raise TypeError("a RowFamily takes its series through add_metric")


class GaugeFamily(RowFamily):
    """prometheus-client's ``GaugeMetricFamily``, as rows."""

    def __init__(self, name: str, documentation: str, value: float | None = None,
                 labels: Sequence[str] | None = None) -> None:
        super().__init__(name, documentation, "gauge", value, labels)


class CounterFamily(RowFamily):
    """prometheus-client's ``CounterMetricFamily`` (its name without ``_total``, its samples with), as rows."""

    suffix = "_total"

    def __init__(self, name: str, documentation: str, value: float | None = None,
                 labels: Sequence[str] | None = None) -> None:
        super().__init__(name.removesuffix("_total"), documentation, "counter", value, labels)


@dataclasses.dataclass(slots=True)
class _Family:
    """One family's last rendering: what it was rendered from and the text, line by line."""

    header_key: tuple[str, str]
    header: str
    keys: list[Any]  # of each line: (sample name, labels), or a row family's label values
    prefixes: list[str]  # 'name{labels} ' of each line
    values: list[Any]
    lines: list[str]
    text: str  # the lines, joined: the page is each family's header and text in turn, copied once, by the join


class Renderer:
    """Renders metric families to exposition bytes, reusing the previous render where nothing changed.

    Only the families of the latest render are remembered, so series that disappear (an expired
    rank, a lost GPU) do not leak memory. Thread-safe: lazily rendered snapshots may be rendered
    from concurrent scrapes.
    """

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}
        self._lock = threading.Lock()

    def render(self, families: Iterable[Metric]) -> bytes:
        with self._lock:
            previous, current = self._families, {}
            texts: list[str] = []
            for family in families:
                rendered = current[family.name] = self._render(family, previous.get(family.name))
                texts += (rendered.header, rendered.text)
            self._families = current
            return "".join(texts).encode()

    def _render(self, family: Metric, cached: _Family | None) -> _Family:
        header_key = (family.type, family.documentation)
        if isinstance(family, TextFamily):
            header = cached.header if cached is not None and cached.header_key == header_key else self._header(family)
            return _Family(header_key, header, [], [], [], [], family.text)
        keys: list[Any]
        prefix_of: Callable[[Any], str]
        if isinstance(family, RowFamily):
            keys = [labels for labels, _ in family.rows]
            values = [value for _, value in family.rows]
            prefix_of = family.line_prefix
        else:
            samples = family.samples
            keys = [(sample.name, sample.labels) for sample in samples]
            values = [sample.value for sample in samples]

            def prefix_of(key: tuple[str, dict[str, str]]) -> str:
                return series_prefix(*key)
        if cached is None or cached.keys != keys:
            prefixes = [prefix_of(key) for key in keys]
            lines = [f"{prefix}{format_value(value)}\n" for prefix, value in zip(prefixes, values, strict=True)]
        elif cached.values == values and cached.header_key == header_key:
            return cached
        else:
            prefixes = cached.prefixes
            lines = [line if value == old else f"{prefix}{format_value(value)}\n"
                     for prefix, value, old, line in zip(prefixes, values, cached.values, cached.lines, strict=True)]
        header = cached.header if cached is not None and cached.header_key == header_key else self._header(family)
        return _Family(header_key, header, keys, prefixes, values, lines, "".join(lines))

    @staticmethod
    def _header(family: Metric) -> str:
        exposed_type, suffix = _TYPE_AND_SUFFIX.get(family.type, (family.type, ""))
        name = family.name + suffix
        return f"# HELP {name} {_escape_help(family.documentation)}\n# TYPE {name} {exposed_type}\n"
