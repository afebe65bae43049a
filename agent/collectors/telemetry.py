"""Training telemetry: receives the ranks' records on a Unix datagram socket, exports gpuwatch_train_*.

A receiver thread drains the socket as records arrive (a datagram queue holds only
``net.unix.max_dgram_qlen`` records, so it must not wait for the sampler), queues each for the
``TelemetryStore``, which applies them in a batch before its next read, and has the sender's process watched for
its exit. The store is read when a round is first used, not by every round: ``collect`` returns a result whose
families and readings read it on first use (or serves its last result while the store did not change), the series
are written when that round is rendered, and only for ranks whose state moved since the previous render
(``RankSeries``). Step timings are
gauges of the latest step rather than histograms: the series count stays one per rank, and
straggler detection compares ranks' current figures. Collective latency is a real histogram,
accumulated from the buckets every step record carries.

Ranks are exported once their ``hello`` has arrived (it carries the coordinate labels); until
then, after an agent restart for instance, their counters accumulate unexported, and the
client's hello heartbeat brings them back within its interval.

The variables of a rank's environment that diagnosis rules read (``schema.EXPORTED_ENV``: NCCL_IB_DISABLE,
NCCL_SOCKET_IFNAME, ...) are exported as ``gpuwatch_train_env_info{name, value}``, one series per variable
set, so that ``gpuwatch diagnose --prometheus`` can run the NCCL rules; the full allowlisted environment
stays in /api/v1/state.

The latest ``gpuwatch probe`` of each job is exported as its peak bus bandwidth per op, one series
per (job, op): a series per message size would multiply them by ~20 for no alert or rule that needs
them. The whole sweep stays in /api/v1/state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString

from gpuwatch.agent.collectors.base import (
    Collector,
    CollectorContext,
    CollectorError,
    CollectorResult,
    DeferredFamilies,
    DeferredReadings,
    MetricSpec,
)
from gpuwatch.agent.exposition import CounterFamily, GaugeFamily, TextFamily, format_value, series_prefix
from gpuwatch.agent.telemetry import listener
from gpuwatch.agent.telemetry.exits import ExitWatcher
from gpuwatch.agent.telemetry.store import RankState, TelemetryStore, probe_peaks
from gpuwatch.agent.telemetry.window import BUSY, MEDIAN_SECONDS, WINDOW_SECONDS, WINDOW_STEPS, summarize
from gpuwatch.protocol.paths import default_socket_path
from gpuwatch.protocol.ranks import members_text
from gpuwatch.protocol.schema import COLLECTIVE_BUCKETS, EXPORTED_ENV, MAX_EXPORTED_ENV_VALUE_CHARS

log = logging.getLogger(__name__)

RANK_LABELS = ["job", "rank", "local_rank", "tp_rank", "pp_stage", "dp_rank"]
_LE = [floatToGoString(bound) for bound in COLLECTIVE_BUCKETS] + ["+Inf"]


@dataclasses.dataclass(frozen=True)
class StepGauge(MetricSpec):
    """A gauge of the rank's latest step record, one series per rank where the record has ``field`` (inside
    ``group`` where the schema nests it). Diagnosis' ``StepFacts`` names the quantity as the record does."""

    group: str | None = None


#: The number of the latest step: whether a rank has stepped at all.
LAST_STEP = StepGauge("gpuwatch_train_last_step", "Number of the latest reported step.", "", "step")
STEP_GAUGES: tuple[StepGauge, ...] = (
    StepGauge("gpuwatch_train_step_seconds", "Wall time of the rank's latest reported step.", "seconds",
              "step_seconds"),
    StepGauge("gpuwatch_train_compute_seconds", "Forward and backward time of the latest step, excluding time spent "
              "waiting on collectives.", "seconds", "compute_seconds"),
    StepGauge("gpuwatch_train_dataloader_wait_seconds", "Time the latest step waited for its input batch, excluding "
              "time spent waiting on collectives.", "seconds", "dataloader_wait_seconds"),
    StepGauge("gpuwatch_train_optimizer_seconds", "Optimizer time of the latest step, excluding time spent waiting on "
              "collectives.", "seconds", "optimizer_seconds"),
    StepGauge("gpuwatch_train_outside_model_seconds", "Host time of the latest step outside the model (callbacks, "
              "logging, evaluation, checkpointing), excluding time spent waiting on collectives: with the data, "
              "compute and optimizer time and the exposed collective time it adds up to the step.", "seconds",
              "outside_model_seconds"),
    StepGauge("gpuwatch_train_pipeline_busy_seconds", "Time this pipeline stage computed during the latest step.",
              "seconds", "busy_seconds", "pipeline"),
    StepGauge("gpuwatch_train_pipeline_idle_seconds", "Time this pipeline stage waited during the latest step.",
              "seconds", "idle_seconds", "pipeline"),
    StepGauge("gpuwatch_train_pipeline_bubble_ratio", "Measured pipeline bubble of the latest step: "
              "idle / (busy + idle).", "ratio", "bubble_ratio", "pipeline"),
    StepGauge("gpuwatch_train_pipeline_bubble_ratio_theoretical", "The schedule's ideal bubble, (p-1)/(m+p-1) for p "
              "stages and m micro-batches.", "ratio", "bubble_ratio_theoretical", "pipeline"),
    StepGauge("gpuwatch_train_gradient_sync_bytes", "Bytes DDP all-reduces per step (every gradient), where the "
              "hooks do not time its calls (gpuwatch_train_collective_bytes_total counts those they time).", "bytes",
              "gradient_sync_bytes"),
    StepGauge("gpuwatch_train_loss", "Loss of the latest step; NaN or Inf when it diverged.", "", "loss"),
    StepGauge("gpuwatch_train_grad_norm", "Global gradient norm of the latest step.", "", "grad_norm"),
    StepGauge("gpuwatch_train_loss_scale", "Mixed-precision loss scale of the latest step.", "", "loss_scale"),
    StepGauge("gpuwatch_train_learning_rate", "Learning rate of the latest step.", "", "lr"),
    StepGauge("gpuwatch_train_model_flops_per_second", "Achieved model FLOP/s of the latest step.",
              "flops_per_second", "model_flops_per_second"),
    StepGauge("gpuwatch_train_mfu_ratio", "Model FLOPs utilisation of the latest step: achieved / peak FLOP/s.",
              "ratio", "mfu"),
    LAST_STEP,
    StepGauge("gpuwatch_train_last_step_timestamp_seconds", "Rank's wall clock when it reported its latest step.",
              "seconds", "time"),
)
#: The latest memory reading (every N steps: the hooks' `memory_every`), labelled by the record's memory ``kind``.
MEMORY_GAUGES: tuple[StepGauge, ...] = (
    StepGauge("gpuwatch_train_memory_peak_bytes", "Peak memory since the previous reading (read and reset every N "
              "steps); kind=cuda for the CUDA caching allocator's allocated bytes, kind=host_rss for the process's "
              "resident set.", "bytes", "peak_bytes", "memory"),
    StepGauge("gpuwatch_train_memory_allocated_bytes", "Memory allocated to tensors at the latest reading.",
              "bytes", "allocated_bytes", "memory"),
    StepGauge("gpuwatch_train_memory_reserved_bytes", "Memory the caching allocator holds at the latest reading.",
              "bytes", "reserved_bytes", "memory"),
    StepGauge("gpuwatch_train_memory_inactive_split_bytes", "Reserved memory in inactive split blocks "
              "(fragmentation) at the latest reading.", "bytes", "inactive_split_bytes", "memory"),
)
#: Counters of the rank's records since the agent first saw it, each the ``RankState`` field it names.
COUNTERS: tuple[MetricSpec, ...] = (
    MetricSpec("gpuwatch_train_steps_total", "Step records received from the rank.", "", "steps"),
    MetricSpec("gpuwatch_train_nonfinite_steps_total", "Steps with a NaN/Inf loss or gradient.", "",
               "nonfinite_steps"),
    MetricSpec("gpuwatch_train_tokens_total", "Tokens processed by the rank.", "", "tokens"),
    MetricSpec("gpuwatch_train_samples_total", "Samples (sequences, images, rows) processed by the rank, where its "
               "script counts them.", "", "samples"),
    MetricSpec("gpuwatch_train_alloc_retries_total", "CUDA caching allocator retries (a cache flush and retry after "
               "a failed cudaMalloc).", "", "alloc_retries"),
    MetricSpec("gpuwatch_train_ooms_total", "Out-of-memory errors the CUDA caching allocator reported.", "", "ooms"),
)
_INFO_FIELDS = ("world_size", "tp_size", "pp_size", "dp_size", "schedule", "micro_batches", "precision",
                "torch_version", "nccl_version")
_WINDOW = f"over the rank's window: its last {WINDOW_STEPS} steps within {WINDOW_SECONDS:g} s"
#: Figures of the rank's window of recent steps (``window.summarize``), what the timing and learning rules
#: judge, each the ``WindowSummary`` attribute it names. ``gpuwatch diagnose --prometheus`` reads them back by the
#: same table. Timing medians in seconds are one family, ``WINDOW_MEDIAN``.
WINDOW_GAUGES: tuple[MetricSpec, ...] = (
    MetricSpec("gpuwatch_train_window_steps", f"Steps {_WINDOW}.", "", "steps"),
    MetricSpec("gpuwatch_train_window_first_step", "Number of the oldest step in the rank's window.", "",
               "first_step"),
    MetricSpec("gpuwatch_train_window_last_step", "Number of the newest step in the rank's window.", "", "last_step"),
    MetricSpec("gpuwatch_train_window_span_seconds", "Rank's clock from the oldest to the newest step of its window.",
               "seconds", "seconds"),
    MetricSpec("gpuwatch_train_window_bubble_ratio", f"Median measured pipeline bubble {_WINDOW}.", "ratio",
               "bubble_ratio"),
    MetricSpec("gpuwatch_train_window_loss_steps", f"Steps with a finite loss {_WINDOW}.", "", "loss_steps"),
    MetricSpec("gpuwatch_train_window_loss_min", f"Lowest finite loss {_WINDOW}.", "", "loss_min"),
    MetricSpec("gpuwatch_train_window_loss_max", f"Highest finite loss {_WINDOW}.", "", "loss_max"),
    MetricSpec("gpuwatch_train_window_grad_norm_steps", f"Steps with a finite gradient norm {_WINDOW}.", "",
               "grad_norm_steps"),
    MetricSpec("gpuwatch_train_window_grad_norm_max", f"Largest finite gradient norm {_WINDOW}.", "",
               "grad_norm_max"),
    MetricSpec("gpuwatch_train_window_param_checksums", f"Parameter checksums measured {_WINDOW}.", "", "checksums"),
    MetricSpec("gpuwatch_train_window_param_checksums_distinct", f"Distinct parameter checksums {_WINDOW}: 1 when "
               "several were measured means the parameters did not change.", "", "distinct_checksums"),
)
#: The median timings of the window, one series per timing (label ``timing``: the step record's field, or
#: ``busy_seconds``, the sum of the step's phases: a data-parallel all-reduce evens out whole-step times, and this
#: finds the slow rank).
WINDOW_MEDIAN = "gpuwatch_train_window_median_seconds"
WINDOW_TIMINGS = MEDIAN_SECONDS
#: A signal a measuring step could not compute (labels signal and reason).
UNAVAILABLE = "gpuwatch_train_signal_unavailable"
#: What an overdue rank is doing, from its latest progress record (``schema`` "progress"): gone once it steps again.
STALLED = "gpuwatch_train_stalled_seconds"
PHASE = "gpuwatch_train_phase"
IN_FLIGHT = "gpuwatch_train_in_flight_collective_seq"
EXITED = "gpuwatch_train_rank_exited_timestamp_seconds"
#: The latest step's collective calls per process group (label group: the hello's name, "default" the world)
CALLS = "gpuwatch_train_collective_calls"
#: A step that raised, from the rank's latest progress record (labels type and message: one series per rank at most)
RAISED = "gpuwatch_train_step_raised_timestamp_seconds"


_RANK_INFO = "gpuwatch_train_rank_info"
_ENV_INFO = "gpuwatch_train_env_info"
#: The hello's process groups (labels group and members, ``protocol.ranks.members_text``)
GROUP_INFO = "gpuwatch_train_process_group_info"
#: When the rank said hello, by its clock (the hello's ``time``; its heartbeat repeats that hello)
HELLO_TIME = "gpuwatch_train_hello_timestamp_seconds"
_GPU_JOB = "gpuwatch_gpu_job_info"
_COSINE = "gpuwatch_train_grad_cosine_similarity"
_CHECKSUM = "gpuwatch_train_param_checksum"
_LATENCY = "gpuwatch_train_collective_seconds"
_VOLUME = "gpuwatch_train_collective_bytes"
#: Families with series per rank, in exposition order: (name as a Metric takes it, type, help).
_PER_RANK: tuple[tuple[str, str, str], ...] = (
    (_RANK_INFO, "gauge", "Layout and build of a rank, from its hello."),
    (_ENV_INFO, "gauge", "A variable of the rank's environment that diagnosis reads (NCCL_IB_DISABLE, "
     "NCCL_SOCKET_IFNAME, ...), from its hello; value 1, one series per variable set."),
    (_GPU_JOB, "gauge", "Which job and rank run on which GPU; join it on uuid (or gpu) to label GPU series by job."),
    (GROUP_INFO, "gauge", "A process group of the rank, from its hello (group: its name; members: its ranks as runs, "
     "first-last/stride); value 1."),
    (HELLO_TIME, "gauge", "Rank's wall clock when it said hello (its heartbeat repeats that hello): with no step "
     "reported since, how long it has run without a step being seen."),
    *((gauge.name, "gauge", gauge.help) for gauge in (*STEP_GAUGES, *MEMORY_GAUGES)),
    *((counter.name.removesuffix("_total"), "counter", counter.help) for counter in COUNTERS),
    (_COSINE, "gauge", "Cosine between this data-parallel rank's local gradient and the DP-mean gradient, latest "
     "measurement."),
    (_CHECKSUM, "gauge", "Parameter checksum, latest measurement; data-parallel replicas must agree."),
    *((gauge.name, "gauge", gauge.help) for gauge in WINDOW_GAUGES),
    (WINDOW_MEDIAN, "gauge", f"Median of a step timing {_WINDOW} (timing: {', '.join(WINDOW_TIMINGS)}; "
     f"{BUSY}: the sum of the step's phases, the step without its waits in collectives, by which a straggler is "
     "judged)."),
    (UNAVAILABLE, "gauge", "A signal the rank's latest measuring step could not compute, and why (reason: "
     "zero_gradient, no_data_parallel_group, ...); value: that step's number."),
    (STALLED, "gauge", "Seconds since an overdue rank's training thread last made progress, as its latest progress "
     "record said (sent about every second while a step is overdue); no series while steps flow."),
    (PHASE, "gauge", "The phase an overdue rank is in (phase: data, compute, optimizer, collective, step, idle), "
     "or closed once its hooks were closed (a normal end); value 1."),
    (IN_FLIGHT, "gauge", "Sequence number, on its process group, of the collective an overdue rank is in (op, "
     "group: the hello's process-group name)."),
    (EXITED, "gauge", "When the agent found the rank's process gone (wall clock)."),
    (CALLS, "gauge", "Collective calls (not send/recv) the rank had made on a process group by the end of its latest "
     "step (group: the hello's name, default the world); every member of a group counts the same at the same step."),
    (RAISED, "gauge", "When a step of the rank raised (the rank's wall clock), with the exception's type and message; "
     "gone once the rank steps again."),
    (_LATENCY, "histogram", "Latency of the rank's collective calls."),
    (_VOLUME, "counter", "Bytes the rank's collective calls moved (the rank's buffer size per call)."),
)
#: Where each per-rank family's text sits in a rank's parts.
_FAMILY_INDEX = {name: index for index, (name, _, _) in enumerate(_PER_RANK)}


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


class _RankLines:
    """One rank's exposition lines of every per-rank family, and the label prefixes they start with.

    At 64 ranks these are ~7,700 series, most of the page: writing them straight from the rank's state,
    without a prometheus-client ``Sample`` per series, and only for ranks whose state moved, keeps a scrape
    of a fresh snapshot to a few ms. Prefixes live as long as the rank's hello is the same.
    """

    def __init__(self, hello: dict[str, Any]) -> None:
        self.hello = hello
        self.version = -1
        #: The rank's lines of each per-rank family, in ``_PER_RANK`` order.
        self.parts: list[str] = []
        self._labels = dict(zip(RANK_LABELS, (hello["job"], *(str(hello[name]) for name in RANK_LABELS[1:])),
                                strict=True))
        self._prefixes: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}  # by name and extra labels
        self._ops: dict[str, _OpLines] = {}
        #: The parts of a rank that has reported nothing since its hello: the hello's lines, the rest empty.
        self._hello_parts = [""] * len(_PER_RANK)
        for name, text in self._from_hello().items():
            self._hello_parts[_FAMILY_INDEX[name]] = text
        # The families of one series per rank, with the rank's labels only: (family's index, prefix, what it exports).
        self._counters = [(_FAMILY_INDEX[counter.name.removesuffix("_total")], self._prefix(counter.name),
                           counter.field) for counter in COUNTERS]
        self._window = [(_FAMILY_INDEX[gauge.name], self._prefix(gauge.name), gauge.field) for gauge in WINDOW_GAUGES]
        self._steps = [(_FAMILY_INDEX[gauge.name], self._prefix(gauge.name), gauge.field, gauge.group)
                       for gauge in STEP_GAUGES]
        self._sampled = [(_FAMILY_INDEX[family], self._prefix(family), name)
                         for family, name in ((_COSINE, "grad_cosine_similarity"), (_CHECKSUM, "param_checksum"))]
        self._medians = [(timing, self._prefix(WINDOW_MEDIAN, (("timing", timing),))) for timing in WINDOW_TIMINGS]
        #: Each memory ``kind``'s lines: (family's index, prefix, what it exports), made when the kind first reports.
        self._memory: dict[str, list[tuple[int, str, str]]] = {}

    def _from_hello(self) -> dict[str, str]:
        """The lines that depend on the hello only: written once per hello."""
        hello = self.hello
        info = (*((name, str(hello.get(name, ""))) for name in _INFO_FIELDS),
                ("backend", hello.get("backends", {}).get("default", "")),
                ("faults", ",".join(hello.get("faults", ()))),
                ("unavailable_from_outside", ",".join(hello.get("unavailable_from_outside", ()))))
        lines = {_RANK_INFO: f"{self._prefix(_RANK_INFO, info)}1.0\n",
                 HELLO_TIME: f"{self._prefix(HELLO_TIME)}{format_value(hello['time'])}\n"}
        environment = hello.get("env", {})
        lines[_ENV_INFO] = "".join(
            f"{self._prefix(_ENV_INFO, (('name', name), ('value', environment[name])))}1.0\n"
            for name in EXPORTED_ENV
            if name in environment and len(environment[name]) <= MAX_EXPORTED_ENV_VALUE_CHARS)
        groups = {name: members_text(ranks) for name, ranks in hello.get("process_groups", {}).items()}
        lines[GROUP_INFO] = "".join(f"{self._prefix(GROUP_INFO, (('group', name), ('members', text)))}1.0\n"
                                    for name, text in sorted(groups.items()) if text is not None)
        if "gpu" in hello:  # labelled by GPU, job and rank only
            gpu = {"gpu": str(hello["gpu"]["index"]), "uuid": hello["gpu"]["uuid"], "job": hello["job"],
                   "rank": self._labels["rank"]}
            lines[_GPU_JOB] = f"{series_prefix(_GPU_JOB, gpu)}1.0\n"
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
            prefixes = [*(self._prefix(_LATENCY + "_bucket", (("le", le), *key)) for le in _LE),
                        self._prefix(_LATENCY + "_count", key), self._prefix(_LATENCY + "_sum", key)]
            lines = self._ops[op] = _OpLines(_template(prefixes, ".0\n"), _template(prefixes, "\n"),
                                             self._prefix(_VOLUME + "_total", key))
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
        parts[_FAMILY_INDEX[_LATENCY]], parts[_FAMILY_INDEX[_VOLUME]] = "".join(latency), "".join(volume)
        for index, prefix, name in self._sampled:
            value = state.sampled.get(name, (None, None))[1]
            if isinstance(value, float):  # a hex-digest checksum stays in /api/v1/state
                parts[index] = f"{prefix}{format_value(value)}\n"
        parts[_FAMILY_INDEX[UNAVAILABLE]] = "".join(
            line(UNAVAILABLE, at, extra=(("signal", signal), ("reason", reason)))
            for signal, (at, reason) in sorted(state.unavailable.items())
            if at >= state.sampled.get(signal, (-1, None))[0])  # not measured again since
        window = summarize(state.window.points())
        if window is not None:
            for index, prefix, field in self._window:
                value = getattr(window, field)
                if value is not None:
                    parts[index] = f"{prefix}{format_value(value)}\n"
            medians = window.medians
            parts[_FAMILY_INDEX[WINDOW_MEDIAN]] = "".join(
                f"{prefix}{format_value(medians[timing])}\n" for timing, prefix in self._medians if timing in medians)
        progress = state.progress
        if progress is not None:
            parts[_FAMILY_INDEX[STALLED]] = line(STALLED, progress["stalled_seconds"])
            parts[_FAMILY_INDEX[PHASE]] = line(PHASE, 1, extra=(("phase", progress["phase"]),))
            collective = progress.get("collective")
            if collective is not None:
                parts[_FAMILY_INDEX[IN_FLIGHT]] = line(
                    IN_FLIGHT, collective["seq"], extra=(("op", collective["op"]), ("group", collective["group"])))
            error = progress.get("error")
            if error is not None:
                parts[_FAMILY_INDEX[RAISED]] = line(
                    RAISED, progress["time"], extra=(("type", error["type"]), ("message", error["message"])))
        if state.exited_time is not None:
            parts[_FAMILY_INDEX[EXITED]] = line(EXITED, state.exited_time)
        step = state.last_step
        if step is not None:
            for index, prefix, field, group in self._steps:
                value = (step if group is None else step.get(group, {})).get(field)
                if value is not None:
                    parts[index] = f"{prefix}{format_value(value)}\n"
            parts[_FAMILY_INDEX[CALLS]] = "".join(line(CALLS, calls, extra=(("group", group),))
                                                  for group, calls in sorted(step.get("collective_calls", {}).items()))
        memory = state.sampled.get("memory", (None, None))[1]
        if memory is not None:
            for index, prefix, field in self._memory_lines(memory["kind"]):
                value = memory.get(field)
                if value is not None:
                    parts[index] = f"{prefix}{format_value(value)}\n"
        self.parts = parts
        self.version = state.version


class RankSeries:
    """The per-rank families of successive store snapshots, rewriting only the ranks that changed.

    Thread-safe: snapshots build their families lazily, possibly from concurrent scrapes."""

    def __init__(self) -> None:
        self._ranks: dict[tuple[str, int], _RankLines] = {}
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
                    cached = _RankLines(state.hello)
                if cached.version != state.version:
                    cached.update(state)
                current[key] = cached
            self._ranks = current  # a rank that expired is forgotten with its lines
            # Joined under the lock: a concurrent render of another snapshot may rewrite a rank's lines.
            columns = zip(*(rank.parts for rank in current.values()), strict=True)  # a family's lines of every rank
            texts = map("".join, columns) if current else [""] * len(_PER_RANK)
            return [TextFamily(name, doc, typ, text) for (name, typ, doc), text in zip(_PER_RANK, texts, strict=True)]


def families(ranks: Sequence[RankState], records: dict[tuple[str, str], int],
             per_rank: RankSeries | None = None) -> list[Metric]:
    """The metric families of one store snapshot (ranks sorted by job and rank, as the store gives them)."""
    received = CounterFamily(
        "gpuwatch_telemetry_records_total", "Telemetry records by outcome: accepted or rejected by the agent "
        "(reason: why), or dropped by the ranks' clients before sending (reason: no_agent, busy, ...).",
        labels=["result", "reason"])
    for (result, reason), count in sorted(records.items()):
        received.add_metric([result, reason], count)
    tracked = GaugeFamily("gpuwatch_telemetry_ranks", "Ranks the agent holds telemetry state for.",
                          labels=["job"])
    per_job: dict[str, int] = {}
    for state in ranks:
        per_job[state.job] = per_job.get(state.job, 0) + 1
    for job, count in per_job.items():
        tracked.add_metric([job], count)
    return [received, tracked, *(per_rank or RankSeries()).families(ranks)]


def probe_families(probes: Sequence[dict[str, Any]]) -> list[Metric]:
    """The metric families of the latest probe of each job (record bodies as the store keeps them)."""
    bandwidth = GaugeFamily(
        "gpuwatch_probe_bus_bandwidth_bytes_per_second", "Peak bus bandwidth over the message sizes of the job's "
        "latest gpuwatch probe, per collective (nccl-tests' busbw: comparable with a link's rated speed whatever "
        "the rank count).", labels=["job", "op", "interconnect"])
    info = GaugeFamily("gpuwatch_probe_info", "Shape of the job's latest gpuwatch probe; value 1.",
                       labels=["job", "interconnect", "backend", "device", "world_size", "nodes",
                               "ranks_per_node"])
    finished = GaugeFamily("gpuwatch_probe_timestamp_seconds", "When the job's latest gpuwatch probe "
                           "finished, by the prober's clock: how old its bandwidth figures are.", labels=["job"])
    for probe in probes:
        job, interconnect = probe["job"], probe["interconnect"]
        for op, row in sorted(probe_peaks(probe).items()):
            bandwidth.add_metric([job, op, interconnect], row["busbw_bytes_per_second"])
        info.add_metric([job, interconnect, probe["backend"], probe["device"],
                         *(str(probe[name]) for name in ("world_size", "nodes", "ranks_per_node"))], 1)
        finished.add_metric([job], probe["time"])
    return [bandwidth, info, finished]


def _rank_readings(state: RankState) -> dict[str, Any]:
    """A rank's state as /api/v1/state serves it, read back by ``diagnosis.sources.telemetry.rank_facts``."""
    return {
        "job": state.job,
        "rank": state.rank,
        "hello": state.hello,
        "last_step": state.last_step,
        "counters": state.counters(),
        "collectives": {op: totals.as_dict() for op, totals in state.collectives.items()},
        "sampled": {name: {"step": step, "value": value} for name, (step, value) in state.sampled.items()},
        "unavailable": {signal: {"step": step, "reason": reason}
                        for signal, (step, reason) in state.unavailable.items()},
        "window": state.window.points(),  # StepPoints: written as JSON only when /api/v1/state is asked for
        "sender_pid": state.sender_pid,
        "last_seen": state.last_seen_time,
        "progress": state.progress,
        "exited": state.exited_time,
    }


def _alive(pid: int) -> bool:
    """Whether a process with this pid exists in the agent's pid namespace (a zombie still counts: it has not been
    reaped, so its exit status is not known here either)."""
    return Path(f"/proc/{pid}").exists()


class _Receiver:
    """The thread draining the socket into the store, and the socket's lifetime."""

    def __init__(self, path: Path, store: TelemetryStore, exits: ExitWatcher) -> None:
        self.path = path
        self._socket, self._identity = listener.bind(path)
        self._store = store
        self._exits = exits
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="telemetry-receiver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        receive, queue, watch = self._socket.recvmsg, self._store.receive, self._exits.watch
        while True:
            try:
                datagram, ancillary, _, _ = receive(listener.RECV_BYTES, listener.CREDENTIALS_SPACE)
            except OSError as exc:
                if self._closing.is_set():
                    return
                log.warning("receiving telemetry failed: %s", exc)
                self._closing.wait(1.0)
                continue
            if self._closing.is_set():  # woken by close()
                return
            pid = listener.sender_pid(ancillary)
            queue(datagram, pid)  # applied in a batch by the store's next reader
            if pid is not None:  # its exit timed from the first record on, whenever the store is read
                watch((pid,))

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)  # wakes the blocked recv()
        self._thread.join(5)
        self._socket.close()
        listener.unlink_if_ours(self.path, self._identity)


class _Round(NamedTuple):
    """One read of the store: its families, built when rendered, and its readings, built when /api/v1/state asks."""

    families: Callable[[], list[Metric]]
    readings: Callable[[], dict[str, Any]]


class _Latest(NamedTuple):
    """The collector's latest result, and the store's changes when it was read (None: not read yet)."""

    result: CollectorResult[Any]
    read: _Once
    read_at: int | None = None


class _Once:
    """``read(self)`` called once, by whichever thread first needs its value; the others wait for it."""

    def __init__(self, read: Callable[[_Once], _Round]) -> None:
        self._read = read
        self._lock = threading.Lock()
        self._value: _Round | None = None

    def __call__(self) -> _Round:
        with self._lock:
            if self._value is None:
                self._value = self._read(self)
            return self._value


class TelemetryCollector(Collector):
    """Owns the telemetry socket and the per-rank store; reported down while the socket cannot be
    set up (the reason is its last error), and tries again whenever the sampler runs it (backing off)."""

    name = "telemetry"
    may_block = False  # copies the store: the receiver thread is what waits on the socket

    def __init__(self, context: CollectorContext) -> None:
        super().__init__(context)
        self.path = context.telemetry_socket or default_socket_path()
        self.store = TelemetryStore(ttl=context.telemetry_ttl, max_ranks=context.telemetry_max_ranks,
                                    max_jobs=context.telemetry_max_jobs)
        self._per_rank = RankSeries()
        self._exits = ExitWatcher(self.store.mark_exited)
        self._queue_limit = listener.queue_limit()
        self._receiver: _Receiver | None = None
        self._error: str | None = None
        self._latest: _Latest | None = None
        self._read_lock = threading.Lock()
        #: Each rank's readings with the store's copy they were made from: the store hands out the same copy while
        #: the rank does not change, and its readings are then the same too.
        self._readings: dict[tuple[str, int], tuple[RankState, dict[str, Any]]] = {}
        self._listen()

    def _listen(self) -> None:
        """Bind the socket and start receiving; on failure remember why and try again at the next collect."""
        try:
            self._receiver = _Receiver(self.path, self.store, self._exits)
        except (listener.SocketSetupError, OSError) as exc:
            if str(exc) != self._error:
                log.error("telemetry socket: %s", exc)
            self._error = str(exc)
            return
        self._error = None
        log.info("receiving telemetry on %s (kernel queue: %s datagrams)", self.path, self._queue_limit)

    def collect(self) -> CollectorResult[Any]:
        """The store's state, read when the round is first used (``_read``): its families when it is rendered (ahead
        of a scrape, or by one), its readings when ``/api/v1/state`` asks. A round nobody uses reads nothing, so
        the datagrams of the rounds between two scrapes are applied in one batch, with warm caches, by the read of
        the round that is scraped (at 5 s sampling and a 15 s scrape interval, one batch of ~96 datagrams instead of
        three of ~32, each costing 2-3x in a round's cold caches). The latest result is served again while nobody
        has used it, and after it was read while nothing was received, expired or exited since."""
        if self._receiver is None:
            self._listen()
            if self._receiver is None:
                raise CollectorError(self._error)
        store, latest = self.store, self._latest
        idle = store.holds_nothing()  # no rank to expire or mark, no datagram to apply: no lock taken
        if not self._exits.available and not idle:  # else the watcher's thread marks them as they exit
            for state in store.note_exits(_alive):  # applies what is queued: a round's read, on such kernels
                log.warning("job %s rank %d: its process (pid %s) is gone", state.job, state.rank, state.sender_pid)
        if latest is not None:
            if latest.read_at is None:
                return latest.result  # nobody used it yet: whoever does first reads the store then
            if not store.has_queued():
                if not idle:
                    self._expire()
                if latest.read_at == store.changes:
                    return latest.result  # nothing came, expired or exited: not a copy of the same state
        # No reference cycle (a result its own read referred to): refcounting frees each round's copies at once, where
        # the cyclic collector, rarely run (``Sampler.run``), let them pile up, +6.5 MB of RSS at 64 ranks.
        read = _Once(self._read)
        result: CollectorResult[Any] = CollectorResult(DeferredFamilies(lambda: read().families()),
                                                       DeferredReadings(lambda: read().readings()))
        with self._read_lock:  # not overwritten by a read of the round before, finishing in another thread
            self._latest = _Latest(result, read)
        return result

    def _expire(self) -> None:
        for state in self.store.expire():
            log.info("telemetry of job %s rank %d expired after %.0fs of silence", state.job, state.rank,
                     self.store.ttl)

    def _read(self, once: _Once) -> _Round:
        """Apply what was queued, expire the silent ranks and copy the store, for the result ``once`` reads, which the
        rounds that follow serve again while the store does not change. Hello, step and probe bodies are the telemetry
        record schema's (``protocol.schema``), so they stay as the schema defines them rather than typed again here."""
        with self._read_lock:  # rounds read by a render and a state request at once: one at a time
            self._expire()
            changes = self.store.changes  # before the copy: what is applied after it is news to the next round
            ranks, records = self.store.snapshot()
            probes = self.store.probes()
            latest = self._latest
            if latest is not None and latest.read is once:  # not an older round read late
                self._latest = latest._replace(read_at=changes)
        # Built when used: the ranks are copies and probe bodies are never mutated, so building later is the same.
        return _Round(lambda: families(ranks, records, self._per_rank) + probe_families(probes),
                      lambda: self._readings_of(ranks, records, probes))

    def _readings_of(self, ranks: Sequence[RankState], records: dict[tuple[str, str], int],
                     probes: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "socket": str(self.path),
            "queue_limit": self._queue_limit,
            "ttl_seconds": self.store.ttl,
            "records": {
                "accepted": records["accepted", ""],
                **{result: {reason: count for (kind, reason), count in records.items() if kind == result}
                   for result in ("rejected", "dropped")},
            },
            # For per-process attribution (host RSS): the senders' pids as the kernel reported them, in the
            # agent's pid namespace; the pid in a hello is the rank's view, wrong across containers.
            "processes": [{"pid": s.sender_pid, "job": s.job, "rank": s.rank} for s in ranks if s.sender_pid],
            "ranks": self._ranks_readings(ranks),
            "probes": probes,
        }

    def _ranks_readings(self, ranks: Sequence[RankState]) -> list[dict[str, Any]]:
        """Each rank's readings, made again only for the ranks whose copy is new. Read and replaced whole, never
        mutated: rounds' readings built at once in two threads at worst leave the cache one round old."""
        readings = {}
        for state in ranks:
            key = (state.job, state.rank)
            last = self._readings.get(key)
            readings[key] = last if last is not None and last[0] is state else (state, _rank_readings(state))
        self._readings = readings  # a rank that expired is forgotten
        return [rank for _, rank in readings.values()]

    def close(self) -> None:
        self._exits.close()
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
