"""The gpuwatch_train_* families the agent exports from the ranks' telemetry: their names, help and what each reads.

Declared once here, and read by whoever names them: the per-rank exposition writer (``series``) and diagnosis'
sources, which read them back from Prometheus (``diagnosis.sources.prometheus`` and ``outliers``) by the same
tables.

Step timings are gauges of the latest step rather than histograms: the series count stays one per rank, and
straggler detection compares ranks' current figures. Collective latency is a real histogram, accumulated from the
buckets every step record carries.

The variables of a rank's environment that diagnosis rules read (``schema.EXPORTED_ENV``: NCCL_IB_DISABLE,
NCCL_SOCKET_IFNAME, ...) are exported as ``gpuwatch_train_env_info{name, value}``, one series per variable set, so
that ``gpuwatch diagnose --prometheus`` can run the NCCL rules; the full allowlisted environment stays in
/api/v1/state.
"""

from __future__ import annotations

import dataclasses

import msgspec

from gpuwatch.agent.metricspec import Kind, MetricSpec
from gpuwatch.agent.telemetry.window import BUSY, MEDIAN_SECONDS, WINDOW_SECONDS, WINDOW_STEPS
from gpuwatch.protocol.records import ModelShapeFields

#: The labels of every per-rank series: the rank's coordinates, from its hello.
RANK_LABELS = ("job", "rank", "local_rank", "tp_rank", "pp_stage", "dp_rank")


def _per_rank(name: str, help_text: str, unit: str = "", field: str = "", *, kind: Kind = "gauge",
              extra: tuple[str, ...] = ()) -> MetricSpec:
    """A family with series per rank: labelled by the rank's coordinates, then by ``extra``."""
    return MetricSpec(name, help_text, unit, field, kind=kind, labels=(*RANK_LABELS, *extra))


@dataclasses.dataclass(frozen=True)
class StepGauge(MetricSpec):
    """A gauge of the rank's latest step record, one series per rank where the record has ``field`` (inside
    ``group`` where the schema nests it). Diagnosis' ``StepFacts`` names the quantity as the record does."""

    group: str | None = None
    labels: tuple[str, ...] = dataclasses.field(default=RANK_LABELS, kw_only=True)


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
_MEMORY_LABELS = (*RANK_LABELS, "kind")
MEMORY_PEAK = StepGauge("gpuwatch_train_memory_peak_bytes", "Peak memory since the previous reading (read and reset "
                        "every N steps); kind=cuda for the CUDA caching allocator's allocated bytes, kind=host_rss for "
                        "the process's resident set.", "bytes", "peak_bytes", "memory", labels=_MEMORY_LABELS)
MEMORY_GAUGES: tuple[StepGauge, ...] = (
    MEMORY_PEAK,
    StepGauge("gpuwatch_train_memory_allocated_bytes", "Memory allocated to tensors at the latest reading.",
              "bytes", "allocated_bytes", "memory", labels=_MEMORY_LABELS),
    StepGauge("gpuwatch_train_memory_reserved_bytes", "Memory the caching allocator holds at the latest reading.",
              "bytes", "reserved_bytes", "memory", labels=_MEMORY_LABELS),
    StepGauge("gpuwatch_train_memory_inactive_split_bytes", "Reserved memory in inactive split blocks "
              "(fragmentation) at the latest reading.", "bytes", "inactive_split_bytes", "memory",
              labels=_MEMORY_LABELS),
)
#: Counters of the rank's records since the agent first saw it, each the ``RankState`` field it names.
COUNTERS: tuple[MetricSpec, ...] = (
    _per_rank("gpuwatch_train_steps", "Step records received from the rank.", "", "steps", kind="counter"),
    _per_rank("gpuwatch_train_nonfinite_steps", "Steps with a NaN/Inf loss or gradient.", "",
              "nonfinite_steps", kind="counter"),
    _per_rank("gpuwatch_train_tokens", "Tokens processed by the rank.", "", "tokens", kind="counter"),
    _per_rank("gpuwatch_train_samples", "Samples (sequences, images, rows) processed by the rank, where its "
              "script counts them.", "", "samples", kind="counter"),
    _per_rank("gpuwatch_train_alloc_retries", "CUDA caching allocator retries (a cache flush and retry after "
              "a failed cudaMalloc).", "", "alloc_retries", kind="counter"),
    _per_rank("gpuwatch_train_ooms", "Out-of-memory errors the CUDA caching allocator reported.", "", "ooms",
              kind="counter"),
)
#: The hello's fields gpuwatch_train_rank_info carries as labels (with its backend, faults and what is unavailable).
RANK_INFO_FIELDS = ("world_size", "tp_size", "pp_size", "dp_size", "schedule", "micro_batches", "virtual_stages",
                    "precision", "torch_version", "nccl_version")
_WINDOW = f"over the rank's window: its last {WINDOW_STEPS} steps within {WINDOW_SECONDS:g} s"
#: Figures of the rank's window of recent steps (``window.summarize``), what the timing and learning rules
#: judge, each the ``WindowSummary`` attribute it names. ``gpuwatch diagnose --prometheus`` reads them back by the
#: same table. Timing medians in seconds are one family, ``WINDOW_MEDIAN``.
WINDOW_GAUGES: tuple[MetricSpec, ...] = (
    _per_rank("gpuwatch_train_window_steps", f"Steps {_WINDOW}.", "", "steps"),
    _per_rank("gpuwatch_train_window_first_step", "Number of the oldest step in the rank's window.", "",
              "first_step"),
    _per_rank("gpuwatch_train_window_last_step", "Number of the newest step in the rank's window.", "", "last_step"),
    _per_rank("gpuwatch_train_window_span_seconds", "Rank's clock from the oldest to the newest step of its window.",
              "seconds", "seconds"),
    _per_rank("gpuwatch_train_window_bubble_ratio", f"Median measured pipeline bubble {_WINDOW}.", "ratio",
              "bubble_ratio"),
    _per_rank("gpuwatch_train_window_loss_steps", f"Steps with a finite loss {_WINDOW}.", "", "loss_steps"),
    _per_rank("gpuwatch_train_window_loss_min", f"Lowest finite loss {_WINDOW}.", "", "loss_min"),
    _per_rank("gpuwatch_train_window_loss_max", f"Highest finite loss {_WINDOW}.", "", "loss_max"),
    _per_rank("gpuwatch_train_window_grad_norm_steps", f"Steps with a finite gradient norm {_WINDOW}.", "",
              "grad_norm_steps"),
    _per_rank("gpuwatch_train_window_grad_norm_max", f"Largest finite gradient norm {_WINDOW}.", "",
              "grad_norm_max"),
    _per_rank("gpuwatch_train_window_param_checksums", f"Parameter checksums measured {_WINDOW}.", "", "checksums"),
    _per_rank("gpuwatch_train_window_param_checksums_distinct", f"Distinct parameter checksums {_WINDOW}: 1 when "
              "several were measured means the parameters did not change.", "", "distinct_checksums"),
)
#: The median timings of the window, one series per timing (label ``timing``: the step record's field, or
#: ``busy_seconds``, the sum of the step's phases: a data-parallel all-reduce evens out whole-step times, and this
#: finds the slow rank).
#: The median timings of the window, one series per timing (label ``timing``: the step record's field, or
#: ``busy_seconds``, the sum of the step's phases: a data-parallel all-reduce evens out whole-step times, and this
#: finds the slow rank).
WINDOW_TIMINGS = MEDIAN_SECONDS
WINDOW_MEDIAN = _per_rank(
    "gpuwatch_train_window_median_seconds",
    f"Median of a step timing {_WINDOW} (timing: {', '.join(WINDOW_TIMINGS)}; {BUSY}: the sum of the step's "
    "phases, the step without its waits in collectives, on CPU ranks less the wait for a CPU but never below the time "
    "on one, by which a straggler is judged).", "seconds",
    extra=("timing",))
#: A signal a measuring step could not compute (labels signal and reason).
UNAVAILABLE = _per_rank("gpuwatch_train_signal_unavailable", "A signal the rank's latest measuring step could not "
                        "compute, and why (reason: zero_gradient, no_data_parallel_group, ...); value: that step's "
                        "number.", extra=("signal", "reason"))
#: What an overdue rank is doing, from its latest progress record (``schema`` "progress"): gone once it steps again.
STALLED = _per_rank("gpuwatch_train_stalled_seconds", "Seconds since an overdue rank's training thread last made "
                    "progress, as its latest progress record said (sent about every second while a step is overdue); "
                    "no series while steps flow.", "seconds", "stalled_seconds")
PHASE = _per_rank("gpuwatch_train_phase", "The phase an overdue rank is in (phase: data, compute, optimizer, "
                  "collective, step, idle), or closed once its hooks were closed (a normal end); value 1.",
                  extra=("phase",))
IN_FLIGHT = _per_rank("gpuwatch_train_in_flight_collective_seq", "Sequence number, on its process group, of the "
                      "collective an overdue rank is in (op, group: the hello's process-group name).",
                      extra=("op", "group"))
EXITED = _per_rank("gpuwatch_train_rank_exited_timestamp_seconds", "When the agent found the rank's process gone "
                   "(wall clock).", "seconds")
#: A rank whose hooks closed, from its closed progress record: when, and its process's CPU time then (beside
#: gpuwatch_host_process_cpu_seconds, whether a process that has not exited still works: HANG007)
CLOSED = _per_rank("gpuwatch_train_closed_timestamp_seconds", "When the rank's hooks closed (its wall clock): it ended "
                   "its training; without an exit timestamp, its process still runs.", "seconds")
CLOSED_CPU = _per_rank("gpuwatch_train_closed_process_cpu_seconds", "CPU time, user and system, of the rank's process "
                       "as its hooks closed: what gpuwatch_host_process_cpu_seconds adds after it is the work the "
                       "process still does.", "seconds", "cpu_seconds")
#: The latest step's collective calls per process group (label group: the hello's name, "default" the world)
CALLS = _per_rank("gpuwatch_train_collective_calls", "Collective calls (not send/recv) the rank had made on a process "
                  "group by the end of its latest step (group: the hello's name, default the world); every member of "
                  "a group counts the same at the same step.", extra=("group",))
#: A step that raised, from the rank's latest progress record (labels type and message: one series per rank at most)
RAISED = _per_rank("gpuwatch_train_step_raised_timestamp_seconds", "When a step of the rank raised (the rank's wall "
                   "clock), with the exception's type and message; gone once the rank steps again.", "seconds",
                   extra=("type", "message"))
#: The rank's layout and build, from its hello (labels ``RANK_INFO_FIELDS``, its backend, faults and what is
#: unavailable from outside)
RANK_INFO = MetricSpec("gpuwatch_train_rank_info", "Layout and build of a rank, from its hello.", kind="info",
                       labels=(*RANK_LABELS, *RANK_INFO_FIELDS, "backend", "faults", "unavailable_from_outside"))
#: The hello's model block (``records.ModelShapeFields``, each of its fields a label) and batch: what ``gpuwatch plan``
#: predicts the rank's step from, which ``gpuwatch diagnose --prometheus`` then can (PLAN rules).
MODEL_INFO_FIELDS = tuple(field.name for field in msgspec.structs.fields(ModelShapeFields))
MODEL_INFO = MetricSpec("gpuwatch_train_model_info", "The model a rank trains and its batch, from its hello (what "
                        "gpuwatch plan predicts its step from); value 1.", kind="info",
                        labels=(*RANK_LABELS, *MODEL_INFO_FIELDS, "global_batch", "seq_len"))
ENV_INFO = MetricSpec("gpuwatch_train_env_info", "A variable of the rank's environment that diagnosis reads "
                      "(NCCL_IB_DISABLE, NCCL_SOCKET_IFNAME, ...), from its hello; value 1, one series per variable "
                      "set.", kind="info", labels=(*RANK_LABELS, "name", "value"))
GPU_JOB = MetricSpec("gpuwatch_gpu_job_info", "Which job and rank run on which GPU; join it on uuid (or gpu) to "
                     "label GPU series by job.", kind="info", labels=("gpu", "uuid", "job", "rank"))
#: The hello's process groups (labels group and members, ``protocol.ranks.members_text``)
GROUP_INFO = MetricSpec("gpuwatch_train_process_group_info", "A process group of the rank, from its hello (group: "
                        "its name; members: its ranks as runs, first-last/stride); value 1.", kind="info",
                        labels=(*RANK_LABELS, "group", "members"))
#: When the rank said hello, by its clock (the hello's ``time``; its heartbeat repeats that hello)
HELLO_TIME = _per_rank("gpuwatch_train_hello_timestamp_seconds", "Rank's wall clock when it said hello (its "
                       "heartbeat repeats that hello): with no step reported since, how long it has run without a "
                       "step being seen.", "seconds", "time")
#: Measured every N steps (the hooks' sampling), each the sampled signal it names.
COSINE = _per_rank("gpuwatch_train_grad_cosine_similarity", "Cosine between this data-parallel rank's local "
                   "gradient and the DP-mean gradient, latest measurement.", "", "grad_cosine_similarity")
CHECKSUM = _per_rank("gpuwatch_train_param_checksum", "Parameter checksum, latest measurement; data-parallel "
                     "replicas must agree.", "", "param_checksum")
LATENCY = _per_rank("gpuwatch_train_collective_seconds", "Latency of the rank's collective calls.", "seconds",
                    kind="histogram", extra=("op",))
VOLUME = _per_rank("gpuwatch_train_collective_bytes", "Bytes the rank's collective calls moved (the rank's buffer "
                   "size per call).", "bytes", kind="counter", extra=("op",))
#: Families with series per rank, in exposition order.
PER_RANK: tuple[MetricSpec, ...] = (
    RANK_INFO, MODEL_INFO, ENV_INFO, GPU_JOB, GROUP_INFO, HELLO_TIME, *STEP_GAUGES, *MEMORY_GAUGES, *COUNTERS, COSINE,
    CHECKSUM, *WINDOW_GAUGES, WINDOW_MEDIAN, UNAVAILABLE, STALLED, PHASE, IN_FLIGHT, EXITED, CLOSED, CLOSED_CPU,
    CALLS, RAISED, LATENCY, VOLUME,
)

#: The store's own families and the probes', beside the ranks'.
RECORDS = MetricSpec("gpuwatch_telemetry_records", "Telemetry records by outcome: accepted or rejected by the agent "
                     "(reason: why), or dropped by the ranks' clients before sending (reason: no_agent, busy, ...).",
                     kind="counter", labels=("result", "reason"))
TRACKED_RANKS = MetricSpec("gpuwatch_telemetry_ranks", "Ranks the agent holds telemetry state for.", labels=("job",))
PROBE_BANDWIDTH = MetricSpec(
    "gpuwatch_probe_bus_bandwidth_bytes_per_second", "Peak bus bandwidth over the message sizes of the job's latest "
    "gpuwatch probe, per collective (nccl-tests' busbw: comparable with a link's rated speed whatever the rank "
    "count).", "bytes_per_second", "busbw_bytes_per_second", labels=("job", "op", "interconnect"))
PROBE_INFO = MetricSpec("gpuwatch_probe_info", "Shape of the job's latest gpuwatch probe; value 1.", kind="info",
                        labels=("job", "interconnect", "backend", "device", "world_size", "nodes", "ranks_per_node"))
PROBE_TIME = MetricSpec("gpuwatch_probe_timestamp_seconds", "When the job's latest gpuwatch probe finished, by the "
                        "prober's clock: how old its bandwidth figures are.", "seconds", "time", labels=("job",))
