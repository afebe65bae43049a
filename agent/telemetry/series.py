"""The exposition of the ranks' telemetry: each rank's lines of the per-rank families, written by hand, and the
families of the store and of the probes.

At 64 ranks the per-rank series are ~7,700, most of a page: each rank's lines are written straight from its state
(``RankLines``), without a prometheus-client ``Sample`` per series, and only for ranks whose state moved since the
previous render (``RankSeries``), which keeps a scrape of a fresh snapshot to a few ms. The families are declared in
``metrics``.

Ranks are exported once their ``hello`` has arrived (it carries the coordinate labels); until then, after an agent
restart for instance, their counters accumulate unexported, and the client's hello heartbeat brings them back
within its interval.

The latest ``gpuwatch probe`` of each job is exported as its peak bus bandwidth per op, one series per (job, op): a
series per message size would multiply them by ~20 for no alert or rule that needs them. The whole sweep stays in
/api/v1/state.
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString

from gpuwatch.agent.exposition import TextFamily, format_value, series_prefix
from gpuwatch.agent.telemetry.metrics import (
    CALLS,
    CHECKSUM,
    CLOSED,
    CLOSED_CPU,
    COSINE,
    COUNTERS,
    ENV_INFO,
    EXITED,
    GPU_JOB,
    GROUP_INFO,
    HELLO_TIME,
    IN_FLIGHT,
    LATENCY,
    MEMORY_GAUGES,
    MODEL_INFO,
    MODEL_INFO_FIELDS,
    PER_RANK,
    PHASE,
    PROBE_BANDWIDTH,
    PROBE_INFO,
    PROBE_TIME,
    RAISED,
    RANK_INFO,
    RANK_INFO_FIELDS,
    RANK_LABELS,
    RECORDS,
    STALLED,
    STEP_GAUGES,
    TRACKED_RANKS,
    UNAVAILABLE,
    VOLUME,
    WINDOW_GAUGES,
    WINDOW_MEDIAN,
    WINDOW_TIMINGS,
)
from gpuwatch.agent.telemetry.store import RankState, probe_peaks
from gpuwatch.agent.telemetry.window import summarize
from gpuwatch.protocol.ranks import members_text
from gpuwatch.protocol.records import Hello, Probe
from gpuwatch.protocol.schema import COLLECTIVE_BUCKETS, EXPORTED_ENV, MAX_EXPORTED_ENV_VALUE_CHARS

_LE = [floatToGoString(bound) for bound in COLLECTIVE_BUCKETS] + ["+Inf"]
#: Where each per-rank family's text sits in a rank's parts.
_FAMILY_INDEX = {spec.name: index for index, spec in enumerate(PER_RANK)}
#: Each per-rank family's name, HELP and TYPE, as its ``TextFamily`` takes them.
_HEADERS = [(spec.name, spec.help, spec.exposed_type) for spec in PER_RANK]
#: A hello's coordinate labels after the job, and its ``RANK_INFO_FIELDS``, each read in one call.
_COORDINATES = operator.attrgetter(*RANK_LABELS[1:])
_INFO_VALUES = operator.attrgetter(*RANK_INFO_FIELDS)
#: The figures of a probe that label its info series after its interconnect, backend and device.
_PROBE_SIZES = operator.attrgetter("world_size", "nodes", "ranks_per_node")


def _label_text(value: object) -> str:
    """A hello field as a label: absent as empty, a flag as PromQL's ``true``/``false``, a number as written."""
    return "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


class _OpLines(NamedTuple):
    """One op's lines of a rank, as templates: the latency histogram's lines (its buckets, count and sum) with an empty
    place for each value, which the render fills in C (a slice assignment, a join) rather than formatting ~23 lines
    one by one in Python: ~11,000 fewer instructions an op (valgrind, a rank's lines with 4 ops, 800,000 -> 757,000)."""

    #: For counts below 1e6, written as ``str`` writes them, the template adding format_value's ".0"
    small_counts: list[str]
    #: For any counts, written by format_value
    any_counts: list[str]
    volume: str  # the prefix of the op's bytes line


def _template(prefixes: list[str], count_end: str) -> list[str]:
    """Lines with an empty place for each value: each prefix after the previous line's end (``count_end`` after a
    count, the last line's a sum of seconds that format_value writes whole)."""
    ends = ["", *([count_end] * (len(prefixes) - 1))]
    places = ((end + prefix, "") for end, prefix in zip(ends, prefixes, strict=True))
    return [*itertools.chain.from_iterable(places), "\n"]


#: Where an op's template takes its counts (the buckets' then the calls) and its sum of seconds.
_OP_COUNTS = slice(1, 2 * (len(_LE) + 1), 2)
_OP_SUM = 2 * (len(_LE) + 1) + 1


class RankLines:
    """One rank's exposition lines of every per-rank family, and the label prefixes they start with. Prefixes live as
    long as the rank's hello is the same."""

    def __init__(self, hello: Hello) -> None:
        self.hello = hello
        self.version = -1
        #: The rank's lines of each per-rank family, in ``PER_RANK`` order.
        self.parts: list[str] = []
        self._labels = dict(zip(RANK_LABELS, (hello.job, *map(str, _COORDINATES(hello))), strict=True))
        self._prefixes: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}  # by name and extra labels
        self._ops: dict[str, _OpLines] = {}
        #: The parts of a rank that has reported nothing since its hello: the hello's lines, the rest empty.
        self._hello_parts = [""] * len(PER_RANK)
        for name, text in self._from_hello().items():
            self._hello_parts[_FAMILY_INDEX[name]] = text
        # The families of one series per rank, with the rank's labels only: (family's index, prefix, what it exports).
        self._counters = [(_FAMILY_INDEX[counter.name], self._prefix(f"{counter.name}_total"), counter.field)
                          for counter in COUNTERS]
        self._window = [(_FAMILY_INDEX[gauge.name], self._prefix(gauge.name), gauge.field) for gauge in WINDOW_GAUGES]
        self._steps = [(_FAMILY_INDEX[gauge.name], self._prefix(gauge.name), gauge.field, gauge.group)
                       for gauge in STEP_GAUGES]
        self._sampled = [(_FAMILY_INDEX[family.name], self._prefix(family.name), family.field)
                         for family in (COSINE, CHECKSUM)]
        self._medians = [(timing, self._prefix(WINDOW_MEDIAN.name, (("timing", timing),)))
                         for timing in WINDOW_TIMINGS]
        #: Each memory ``kind``'s lines: (family's index, prefix, what it exports), made when the kind first reports.
        self._memory: dict[str, list[tuple[int, str, str]]] = {}

    def _from_hello(self) -> dict[str, str]:
        """The lines that depend on the hello only: written once per hello."""
        hello = self.hello
        info = (*((name, "" if value is None else str(value))
                  for name, value in zip(RANK_INFO_FIELDS, _INFO_VALUES(hello), strict=True)),
                ("backend", (hello.backends or {}).get("default", "")),  # the default group's, by its schema name
                ("faults", ",".join(hello.faults or ())),
                ("unavailable_from_outside", ",".join(hello.unavailable_from_outside or ())))
        lines = {RANK_INFO.name: f"{self._prefix(RANK_INFO.name, info)}1.0\n",
                 HELLO_TIME.name: f"{self._prefix(HELLO_TIME.name)}{format_value(hello.time)}\n"}
        environment = hello.env or {}
        lines[ENV_INFO.name] = "".join(
            f"{self._prefix(ENV_INFO.name, (('name', name), ('value', environment[name])))}1.0\n"
            for name in EXPORTED_ENV
            if name in environment and len(environment[name]) <= MAX_EXPORTED_ENV_VALUE_CHARS)
        groups = {name: members_text(ranks) for name, ranks in (hello.process_groups or {}).items()}
        lines[GROUP_INFO.name] = "".join(f"{self._prefix(GROUP_INFO.name, (('group', name), ('members', text)))}1.0\n"
                                    for name, text in sorted(groups.items()) if text is not None)
        if hello.model is not None and hello.global_batch is not None and hello.seq_len is not None:
            model = (*((name, _label_text(getattr(hello.model, name))) for name in MODEL_INFO_FIELDS),
                     ("global_batch", str(hello.global_batch)), ("seq_len", str(hello.seq_len)))
            lines[MODEL_INFO.name] = f"{self._prefix(MODEL_INFO.name, model)}1.0\n"
        if hello.gpu is not None:  # labelled by GPU, job and rank only
            gpu = {"gpu": str(hello.gpu.index), "uuid": hello.gpu.uuid, "job": hello.job, "rank": str(hello.rank)}
            lines[GPU_JOB.name] = f"{series_prefix(GPU_JOB.name, gpu)}1.0\n"
        return lines

    def _prefix(self, name: str, extra: tuple[tuple[str, str], ...] = ()) -> str:
        return series_prefix(name, {**self._labels, **dict(extra)})

    def _line(self, name: str, value: Any, extra: tuple[tuple[str, str], ...] = ()) -> str:
        """One sample of a series with the rank's labels and ``extra`` labels (from bounded sets: signals and reasons,
        phases, groups)."""
        key = (name, extra)
        prefix = self._prefixes.get(key)
        if prefix is None:
            prefix = self._prefixes[key] = self._prefix(name, extra)
        return f"{prefix}{format_value(value)}\n"

    def _memory_lines(self, kind: str) -> list[tuple[int, str, str]]:
        lines = self._memory.get(kind)
        if lines is None:  # a kind of the schema's two (cuda, host_rss)
            lines = self._memory[kind] = [(_FAMILY_INDEX[gauge.name], self._prefix(gauge.name, (("kind", kind),)),
                                           gauge.field) for gauge in MEMORY_GAUGES]
        return lines

    def _op(self, op: str) -> _OpLines:
        lines = self._ops.get(op)
        if lines is None:
            key = (("op", op),)
            bucket, count, total = LATENCY.sample_names
            prefixes = [*(self._prefix(bucket, (("le", le), *key)) for le in _LE),
                        self._prefix(count, key), self._prefix(total, key)]
            lines = self._ops[op] = _OpLines(_template(prefixes, ".0\n"), _template(prefixes, "\n"),
                                             self._prefix(f"{VOLUME.name}_total", key))
        return lines

    def update(self, state: RankState) -> None:
        """Rewrite the lines from ``state`` (whose hello is this one's): each family's text at its index, one line for
        most, the lines joined for the few with several series a rank."""
        line = self._line
        parts = self._hello_parts.copy()
        for index, prefix, field in self._counters:
            parts[index] = f"{prefix}{format_value(getattr(state, field))}\n"
        latency, volume = [], []
        for op, totals in sorted(state.collectives.items()):
            lines_of = self._op(op)
            counts = [*itertools.accumulate(totals.buckets), totals.calls]  # the buckets' cumulative counts, then all
            if totals.calls < 1_000_000:  # the largest: every count is written as format_value's fast path does
                op_parts = lines_of.small_counts.copy()
                op_parts[_OP_COUNTS] = map(str, counts)  # and ".0" follows each in the template
            else:
                op_parts = lines_of.any_counts.copy()
                op_parts[_OP_COUNTS] = map(format_value, counts)
            op_parts[_OP_SUM] = format_value(totals.seconds)
            latency.append("".join(op_parts))
            volume.append(f"{lines_of.volume}{format_value(totals.bytes)}\n")
        parts[_FAMILY_INDEX[LATENCY.name]], parts[_FAMILY_INDEX[VOLUME.name]] = "".join(latency), "".join(volume)
        for index, prefix, name in self._sampled:
            value = state.sampled.get(name, (None, None))[1]
            if isinstance(value, float):  # a hex-digest checksum stays in /api/v1/state
                parts[index] = f"{prefix}{format_value(value)}\n"
        parts[_FAMILY_INDEX[UNAVAILABLE.name]] = "".join(
            line(UNAVAILABLE.name, at, extra=(("signal", signal), ("reason", reason)))
            for signal, (at, reason) in sorted(state.unavailable.items())
            if at >= state.sampled.get(signal, (-1, None))[0])  # not measured again since
        window = summarize(state.window.points())
        if window is not None:
            for index, prefix, field in self._window:
                value = getattr(window, field)
                if value is not None:
                    parts[index] = f"{prefix}{format_value(value)}\n"
            medians = window.medians
            parts[_FAMILY_INDEX[WINDOW_MEDIAN.name]] = "".join(
                f"{prefix}{format_value(medians[timing])}\n" for timing, prefix in self._medians if timing in medians)
        progress = state.progress
        if progress is not None:
            parts[_FAMILY_INDEX[STALLED.name]] = line(STALLED.name, getattr(progress, STALLED.field))
            parts[_FAMILY_INDEX[PHASE.name]] = line(PHASE.name, 1, extra=(("phase", progress.phase),))
            collective = progress.collective
            if collective is not None:
                parts[_FAMILY_INDEX[IN_FLIGHT.name]] = line(
                    IN_FLIGHT.name, collective.seq, extra=(("op", collective.op), ("group", collective.group)))
            error = progress.error
            if error is not None:
                parts[_FAMILY_INDEX[RAISED.name]] = line(
                    RAISED.name, progress.time, extra=(("type", error.type), ("message", error.message)))
            if progress.phase == "closed":
                parts[_FAMILY_INDEX[CLOSED.name]] = line(CLOSED.name, progress.time)
                if progress.cpu_seconds is not None:
                    parts[_FAMILY_INDEX[CLOSED_CPU.name]] = line(CLOSED_CPU.name, progress.cpu_seconds)
        if state.exited_time is not None:
            parts[_FAMILY_INDEX[EXITED.name]] = line(EXITED.name, state.exited_time)
        step = state.last_step
        if step is not None:
            for index, prefix, field, group in self._steps:
                holder = step if group is None else getattr(step, group)
                value = None if holder is None else getattr(holder, field)
                if value is not None:
                    parts[index] = f"{prefix}{format_value(value)}\n"
            parts[_FAMILY_INDEX[CALLS.name]] = "".join(line(CALLS.name, calls, extra=(("group", group),))
                                                  for group, calls in sorted((step.collective_calls or {}).items()))
        memory = state.sampled.get("memory", (None, None))[1]
        if memory is not None:
            for index, prefix, field in self._memory_lines(memory.kind):
                value = getattr(memory, field)
                if value is not None:
                    parts[index] = f"{prefix}{format_value(value)}\n"
        self.parts = parts
        self.version = state.version


class RankSeries:
    """The per-rank families of successive store snapshots, rewriting only the ranks that changed.

    Thread-safe: snapshots build their families lazily, possibly from concurrent scrapes."""

    def __init__(self) -> None:
        self._ranks: dict[tuple[str, int], RankLines] = {}
        self._lock = threading.Lock()

    def families(self, ranks: Sequence[RankState]) -> list[Metric]:
        with self._lock:
            current = {}
            for state in ranks:
                if state.hello is None:
                    continue  # exported once its hello gives the coordinate labels
                key = (state.job, state.rank)
                cached = self._ranks.get(key)
                if cached is None or (cached.hello is not state.hello and cached.hello != state.hello):
                    cached = RankLines(state.hello)
                if cached.version != state.version:
                    cached.update(state)
                current[key] = cached
            self._ranks = current  # a rank that expired is forgotten with its lines
            # Joined under the lock: a concurrent render of another snapshot may rewrite a rank's lines.
            columns = zip(*(rank.parts for rank in current.values()), strict=True)  # a family's lines of every rank
            texts = map("".join, columns) if current else [""] * len(PER_RANK)
            return [TextFamily(name, doc, typ, text) for (name, doc, typ), text in zip(_HEADERS, texts, strict=True)]


def families(ranks: Sequence[RankState], records: dict[tuple[str, str], int],
             per_rank: RankSeries | None = None) -> list[Metric]:
    """The metric families of one store snapshot (ranks sorted by job and rank, as the store gives them)."""
    received = RECORDS.family()
    for (result, reason), count in sorted(records.items()):
        received.add_metric([result, reason], count)
    tracked = TRACKED_RANKS.family()
    per_job: dict[str, int] = {}
    for state in ranks:
        per_job[state.job] = per_job.get(state.job, 0) + 1
    for job, count in per_job.items():
        tracked.add_metric([job], count)
    return [received, tracked, *(per_rank or RankSeries()).families(ranks)]


def probe_families(probes: Sequence[Probe]) -> list[Metric]:
    """The metric families of the latest probe of each job (record bodies as the store keeps them)."""
    bandwidth, info, finished = PROBE_BANDWIDTH.family(), PROBE_INFO.family(), PROBE_TIME.family()
    for probe in probes:
        job, interconnect = probe.job, probe.interconnect
        for op, row in sorted(probe_peaks(probe).items()):
            bandwidth.add_metric([job, op, interconnect], getattr(row, PROBE_BANDWIDTH.field))
        info.add_metric([job, interconnect, probe.backend, probe.device, *map(str, _PROBE_SIZES(probe))], 1)
        finished.add_metric([job], getattr(probe, PROBE_TIME.field))
    return [bandwidth, info, finished]
