"""Training telemetry: receives the ranks' records on a Unix datagram socket, exports gpuwatch_train_*.

A receiver thread drains the socket as records arrive (a datagram queue holds only
``net.unix.max_dgram_qlen`` records, so it must not wait for the sampler) and applies each to a
``TelemetryStore``; ``collect`` only expires silent ranks and renders the store. Step timings are
gauges of the latest step rather than histograms: the series count stays one per rank, and
straggler detection compares ranks' current figures. Collective latency is a real histogram,
accumulated from the buckets every step record carries.

Ranks are exported once their ``hello`` has arrived (it carries the coordinate labels); until
then, after an agent restart for instance, their counters accumulate unexported, and the
client's hello heartbeat brings them back within its interval.

The latest ``gpuwatch probe`` of each job is exported as its peak bus bandwidth per op, one series
per (job, op): a series per message size would multiply them by ~20 for no alert or rule that needs
them. The whole sweep stays in /api/v1/state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from gpuwatch.agent.collectors.base import Collector, CollectorContext, CollectorError, CollectorResult
from gpuwatch.agent.telemetry import listener
from gpuwatch.agent.telemetry.paths import default_socket_path
from gpuwatch.agent.telemetry.schema import COLLECTIVE_BUCKETS
from gpuwatch.agent.telemetry.store import RankState, TelemetryStore, probe_peaks

log = logging.getLogger(__name__)

RANK_LABELS = ["job", "rank", "local_rank", "tp_rank", "pp_stage", "dp_rank"]
_LE = [floatToGoString(bound) for bound in COLLECTIVE_BUCKETS] + ["+Inf"]

# (series, help, path into the latest step record): one gauge per rank when the field is present.
_STEP_GAUGES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("gpuwatch_train_step_seconds", "Wall time of the rank's latest reported step.", ("step_seconds",)),
    ("gpuwatch_train_compute_seconds", "Forward and backward time of the latest step, excluding time spent "
     "waiting on collectives (a data-parallel all-reduce evens out whole-step times; this finds the slow "
     "rank).", ("compute_seconds",)),
    ("gpuwatch_train_dataloader_wait_seconds", "Time the latest step waited for its input batch.",
     ("dataloader_wait_seconds",)),
    ("gpuwatch_train_optimizer_seconds", "Optimizer time of the latest step.", ("optimizer_seconds",)),
    ("gpuwatch_train_pipeline_busy_seconds", "Time this pipeline stage computed during the latest step.",
     ("pipeline", "busy_seconds")),
    ("gpuwatch_train_pipeline_idle_seconds", "Time this pipeline stage waited during the latest step.",
     ("pipeline", "idle_seconds")),
    ("gpuwatch_train_pipeline_bubble_ratio", "Measured pipeline bubble of the latest step: "
     "idle / (busy + idle).", ("pipeline", "bubble_ratio")),
    ("gpuwatch_train_pipeline_bubble_ratio_theoretical", "The schedule's ideal bubble, (p-1)/(m+p-1) for p "
     "stages and m micro-batches.", ("pipeline", "bubble_ratio_theoretical")),
    ("gpuwatch_train_loss", "Loss of the latest step; NaN or Inf when it diverged.", ("loss",)),
    ("gpuwatch_train_grad_norm", "Global gradient norm of the latest step.", ("grad_norm",)),
    ("gpuwatch_train_loss_scale", "Mixed-precision loss scale of the latest step.", ("loss_scale",)),
    ("gpuwatch_train_learning_rate", "Learning rate of the latest step.", ("lr",)),
    ("gpuwatch_train_model_flops_per_second", "Achieved model FLOP/s of the latest step.",
     ("model_flops_per_second",)),
    ("gpuwatch_train_mfu_ratio", "Model FLOPs utilisation of the latest step: achieved / peak FLOP/s.",
     ("mfu",)),
    ("gpuwatch_train_last_step", "Number of the latest reported step.", ("step",)),
    ("gpuwatch_train_last_step_timestamp_seconds", "Rank's wall clock when it reported its latest step.",
     ("time",)),
)
_MEMORY_GAUGES = (
    ("gpuwatch_train_memory_peak_bytes", "Peak memory of the latest step (reset every step); kind=cuda for "
     "the CUDA caching allocator's allocated bytes, kind=host_rss for the process's resident set.",
     "peak_bytes"),
    ("gpuwatch_train_memory_allocated_bytes", "Memory allocated to tensors after the latest step.",
     "allocated_bytes"),
    ("gpuwatch_train_memory_reserved_bytes", "Memory the caching allocator holds after the latest step.",
     "reserved_bytes"),
    ("gpuwatch_train_memory_inactive_split_bytes", "Reserved memory in inactive split blocks (fragmentation) "
     "after the latest step.", "inactive_split_bytes"),
)
_COUNTERS: tuple[tuple[str, str, Callable[[RankState], int]], ...] = (
    ("gpuwatch_train_steps_total", "Step records received from the rank.", lambda s: s.steps),
    ("gpuwatch_train_nonfinite_steps_total", "Steps with a NaN/Inf loss or gradient.",
     lambda s: s.nonfinite_steps),
    ("gpuwatch_train_tokens_total", "Tokens processed by the rank.", lambda s: s.tokens),
    ("gpuwatch_train_alloc_retries_total", "CUDA caching allocator retries (a cache flush and retry after a "
     "failed cudaMalloc).", lambda s: s.alloc_retries),
    ("gpuwatch_train_ooms_total", "Out-of-memory errors the CUDA caching allocator reported.",
     lambda s: s.ooms),
)
_INFO_FIELDS = ("world_size", "tp_size", "pp_size", "dp_size", "schedule", "micro_batches", "precision",
                "torch_version", "nccl_version")


def _lookup(body: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        body = body.get(key)
        if body is None:
            return None
    return body


def _rank_labels(hello: dict[str, Any]) -> list[str]:
    return [hello["job"], *(str(hello[name]) for name in RANK_LABELS[1:])]


def families(ranks: Sequence[RankState], records: dict[tuple[str, str], int]) -> list[Metric]:
    """The metric families of one store snapshot."""
    received = CounterMetricFamily(
        "gpuwatch_telemetry_records_total", "Telemetry records by outcome: accepted or rejected by the agent "
        "(reason: why), or dropped by the ranks' clients before sending (reason: no_agent, busy, ...).",
        labels=["result", "reason"])
    for (result, reason), count in sorted(records.items()):
        received.add_metric([result, reason], count)
    tracked = GaugeMetricFamily("gpuwatch_telemetry_ranks", "Ranks the agent holds telemetry state for.",
                                labels=["job"])
    per_job: dict[str, int] = {}
    for state in ranks:
        per_job[state.job] = per_job.get(state.job, 0) + 1
    for job, count in per_job.items():
        tracked.add_metric([job], count)

    gauges = [GaugeMetricFamily(name, doc, labels=RANK_LABELS) for name, doc, _ in _STEP_GAUGES]
    memory = [GaugeMetricFamily(name, doc, labels=[*RANK_LABELS, "kind"]) for name, doc, _ in _MEMORY_GAUGES]
    counters = [CounterMetricFamily(name, doc, labels=RANK_LABELS) for name, doc, _ in _COUNTERS]
    cosine = GaugeMetricFamily("gpuwatch_train_grad_cosine_similarity", "Cosine between this data-parallel "
                               "rank's local gradient and the DP-mean gradient, latest measurement.",
                               labels=RANK_LABELS)
    checksum = GaugeMetricFamily("gpuwatch_train_param_checksum", "Parameter checksum, latest measurement; "
                                 "data-parallel replicas must agree.", labels=RANK_LABELS)
    latency = HistogramMetricFamily("gpuwatch_train_collective_seconds", "Latency of the rank's collective "
                                    "calls.", labels=[*RANK_LABELS, "op"])
    volume = CounterMetricFamily("gpuwatch_train_collective_bytes_total", "Bytes the rank's collective calls "
                                 "moved (the rank's buffer size per call).", labels=[*RANK_LABELS, "op"])
    rank_info = GaugeMetricFamily("gpuwatch_train_rank_info", "Layout and build of a rank, from its hello.",
                                  labels=[*RANK_LABELS, *_INFO_FIELDS, "faults"])
    gpu_job = GaugeMetricFamily("gpuwatch_gpu_job_info", "Which job and rank run on which GPU; join it on "
                                "uuid (or gpu) to label GPU series by job.",
                                labels=["gpu", "uuid", "job", "rank"])

    for state in ranks:
        hello = state.hello
        if hello is None:
            continue
        labels = _rank_labels(hello)
        rank_info.add_metric([*labels, *(str(hello.get(name, "")) for name in _INFO_FIELDS),
                              ",".join(hello.get("faults", ()))], 1)
        if "gpu" in hello:
            gpu_job.add_metric([str(hello["gpu"]["index"]), hello["gpu"]["uuid"], hello["job"], labels[1]], 1)
        for family, (_, _, read) in zip(counters, _COUNTERS, strict=True):
            family.add_metric(labels, read(state))
        for op, totals in sorted(state.collectives.items()):
            cumulative, buckets = 0, []
            for le, count in zip(_LE, totals.buckets, strict=True):
                cumulative += count
                buckets.append((le, cumulative))
            latency.add_metric([*labels, op], buckets, totals.seconds)
            volume.add_metric([*labels, op], totals.bytes)
        for family, name in ((cosine, "grad_cosine_similarity"), (checksum, "param_checksum")):
            value = state.sampled.get(name, (None, None))[1]
            if isinstance(value, float):  # a hex-digest checksum stays in /api/v1/state
                family.add_metric(labels, value)
        step = state.last_step
        if step is None:
            continue
        for family, (_, _, path) in zip(gauges, _STEP_GAUGES, strict=True):
            value = _lookup(step, path)
            if value is not None:
                family.add_metric(labels, value)
        if "memory" in step:
            for family, (_, _, field) in zip(memory, _MEMORY_GAUGES, strict=True):
                if field in step["memory"]:
                    family.add_metric([*labels, step["memory"]["kind"]], step["memory"][field])
    return [received, tracked, rank_info, gpu_job, *gauges, *memory, *counters, cosine, checksum,
            latency, volume]


def probe_families(probes: Sequence[dict[str, Any]]) -> list[Metric]:
    """The metric families of the latest probe of each job (record bodies as the store keeps them)."""
    bandwidth = GaugeMetricFamily(
        "gpuwatch_probe_bus_bandwidth_bytes_per_second", "Peak bus bandwidth over the message sizes of the job's "
        "latest gpuwatch probe, per collective (nccl-tests' busbw: comparable with a link's rated speed whatever "
        "the rank count).", labels=["job", "op", "interconnect"])
    info = GaugeMetricFamily("gpuwatch_probe_info", "Shape of the job's latest gpuwatch probe; value 1.",
                             labels=["job", "interconnect", "backend", "device", "world_size", "nodes",
                                     "ranks_per_node"])
    finished = GaugeMetricFamily("gpuwatch_probe_timestamp_seconds", "When the job's latest gpuwatch probe "
                                 "finished, by the prober's clock: how old its bandwidth figures are.", labels=["job"])
    for probe in probes:
        job, interconnect = probe["job"], probe["interconnect"]
        for op, row in sorted(probe_peaks(probe).items()):
            bandwidth.add_metric([job, op, interconnect], row["busbw_bytes_per_second"])
        info.add_metric([job, interconnect, probe["backend"], probe["device"],
                         *(str(probe[name]) for name in ("world_size", "nodes", "ranks_per_node"))], 1)
        finished.add_metric([job], probe["time"])
    return [bandwidth, info, finished]


def _rank_facts(state: RankState) -> dict[str, Any]:
    return {
        "job": state.job,
        "rank": state.rank,
        "hello": state.hello,
        "last_step": state.last_step,
        "counters": state.counters(),
        "collectives": {op: dataclasses.asdict(totals) for op, totals in state.collectives.items()},
        "sampled": {name: {"step": step, "value": value} for name, (step, value) in state.sampled.items()},
        "sender_pid": state.sender_pid,
        "last_seen": state.last_seen_time,
    }


class _Receiver:
    """The thread draining the socket into the store, and the socket's lifetime."""

    def __init__(self, path: Path, store: TelemetryStore) -> None:
        self.path = path
        self._socket, self._identity = listener.bind(path)
        self._store = store
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="telemetry-receiver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        receive, ingest = self._socket.recvmsg, self._store.ingest
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
            try:
                ingest(datagram, listener.sender_pid(ancillary))
            except Exception:  # the store must never stop the receiver; decode() raises only RecordRejected
                log.exception("telemetry record could not be stored")

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)  # wakes the blocked recv()
        self._thread.join(5)
        self._socket.close()
        listener.unlink_if_ours(self.path, self._identity)


class TelemetryCollector(Collector):
    """Owns the telemetry socket and the per-rank store; reported down while the socket cannot be
    set up (the reason is its last error), and retries every sampling round."""

    name = "telemetry"

    def __init__(self, context: CollectorContext) -> None:
        super().__init__(context)
        self.path = context.telemetry_socket or default_socket_path()
        self.store = TelemetryStore(ttl=context.telemetry_ttl, max_ranks=context.telemetry_max_ranks,
                                    max_jobs=context.telemetry_max_jobs)
        self._queue_limit = listener.queue_limit()
        self._receiver: _Receiver | None = None
        self._error: str | None = None
        self._listen()

    def _listen(self) -> None:
        """Bind the socket and start receiving; on failure remember why and retry next round."""
        try:
            self._receiver = _Receiver(self.path, self.store)
        except (listener.SocketSetupError, OSError) as exc:
            if str(exc) != self._error:
                log.error("telemetry socket: %s", exc)
            self._error = str(exc)
            return
        self._error = None
        log.info("receiving telemetry on %s (kernel queue: %s datagrams)", self.path, self._queue_limit)

    def collect(self) -> CollectorResult:
        if self._receiver is None:
            self._listen()
            if self._receiver is None:
                raise CollectorError(self._error)
        for state in self.store.expire():
            log.info("telemetry of job %s rank %d expired after %.0fs of silence", state.job, state.rank,
                     self.store.ttl)
        ranks, records = self.store.snapshot()
        probes = self.store.probes()
        facts = {
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
            "ranks": [_rank_facts(state) for state in ranks],
            "probes": probes,
        }
        return CollectorResult(families(ranks, records) + probe_families(probes), facts)

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
