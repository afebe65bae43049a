"""Training health: convergence (loss, gradients), parallelism costs (bubble, collectives, input), memory and
per-rank timing of the jobs the hooks report."""

from __future__ import annotations

from gpuwatch.agent.metricspec import MetricSpec, by_field
from gpuwatch.agent.telemetry.metrics import (
    COSINE,
    COUNTERS,
    IN_FLIGHT,
    LATENCY,
    MEMORY_GAUGES,
    MEMORY_PEAK,
    PHASE,
    STALLED,
    STEP_GAUGES,
    VOLUME,
    WINDOW_MEDIAN,
)
from gpuwatch.agent.telemetry.window import BUSY
from gpuwatch.dashboards.limits import (
    ALLOC_RETRIES_PER_SECOND,
    COSINE_NEAR_ONE,
    GRAD_SPIKE_FACTOR,
    HIGH_COSINE,
    LOW_COSINE,
    MAX_BUBBLE_RATIO,
    MAX_GRAD_NORM,
    MAX_INPUT_WAIT_SHARE,
    MIN_UNUSED_SHARE,
    STALL_SECONDS,
    STRAGGLER_RATIO,
    percent,
)
from gpuwatch.dashboards.panels import (
    BYTES,
    BYTES_PER_SECOND,
    NONE,
    PER_SECOND,
    PERCENT,
    RANKS,
    RED,
    SECONDS,
    YELLOW,
    Dashboard,
    PanelBuilder,
    Query,
    dashboard,
    datasource_variable,
    job_variable,
    node_variable,
    rank_variable,
    red_above,
    state_timeline,
    thresholds,
    timeseries,
)
from gpuwatch.protocol.schema import STEP_PHASES

UID = "gpuwatch-training"
PER_RANK = "{{job}} rank {{rank}}"
#: The families of tables the panels plot, each by the quantity it holds.
_LOSS, _GRAD_NORM, _LOSS_SCALE, _MFU, _STEP_SECONDS, _DATALOADER_WAIT, _BUBBLE, _BUBBLE_THEORETICAL = (
    by_field(STEP_GAUGES, field) for field in ("loss", "grad_norm", "loss_scale", "mfu", "step_seconds",
                                               "dataloader_wait_seconds", "bubble_ratio", "bubble_ratio_theoretical"))
_MEMORY_RESERVED, _MEMORY_ALLOCATED, _MEMORY_INACTIVE_SPLIT = (
    by_field(MEMORY_GAUGES, field) for field in ("reserved_bytes", "allocated_bytes", "inactive_split_bytes"))
_ALLOC_RETRIES = by_field(COUNTERS, "alloc_retries")


def _per_rank(series: MetricSpec) -> Query:
    return Query(f"{series}{{{RANKS}}}", PER_RANK)


def _convergence() -> list[PanelBuilder]:
    loss = f"{_LOSS}{{{RANKS}}}"
    return [
        timeseries("Loss", NONE, "Loss of each rank's latest step (NaN or Inf: CONV001).",
                   _per_rank(_LOSS), width=8),
        timeseries("Loss spread across ranks", NONE, "Max minus min and standard deviation of the ranks' loss: "
                   "ranks of one job should agree closely.",
                   Query(f"max by (job) ({loss}) - min by (job) ({loss})", "{{job}} max - min"),
                   Query(f"stddev by (job) ({loss})", "{{job}} stddev"), width=8),
        timeseries("Gradient norm", NONE, "Global gradient norm (CONV002 above "
                   f"{MAX_GRAD_NORM:g} or {GRAD_SPIKE_FACTOR:g}x its running median).",
                   _per_rank(_GRAD_NORM), width=8, limits=red_above(MAX_GRAD_NORM)),
        timeseries("Gradient cosine similarity", NONE, "Cosine between each data-parallel rank's local gradient "
                   "and the DP mean: ~1 on every rank means duplicated data (CONV004); a mean below "
                   f"{LOW_COSINE:g} skewed data, above {HIGH_COSINE:g} a batch larger than useful (CONV005).",
                   _per_rank(COSINE), width=8, minimum=-1, maximum=1,
                   limits=thresholds((None, YELLOW), (LOW_COSINE, "green"), (HIGH_COSINE, YELLOW),
                                     (COSINE_NEAR_ONE, RED))),
        timeseries("Loss scale", NONE, "Mixed-precision loss scale: a collapse toward 1 means overflow every step.",
                   _per_rank(_LOSS_SCALE), width=8),
        timeseries("Model FLOPs utilisation", PERCENT, "Achieved over peak FLOP/s per rank.",
                   _per_rank(_MFU), width=8, minimum=0, maximum=1),
    ]


def _quantile(q: float) -> Query:
    return Query(f"histogram_quantile({q}, sum by (job, op, le) (rate({LATENCY}_bucket"
                 f"{{{RANKS}}}[$__rate_interval])))", f"{{{{job}}}} {{{{op}}}} p{round(q * 100)}")


def _parallelism() -> list[PanelBuilder]:
    return [
        timeseries("Pipeline bubble per stage", PERCENT, "Measured bubble, idle / (busy + idle), of each stage "
                   f"against the schedule's theory (p-1)/(m+p-1): PERF001 above {percent(MAX_BUBBLE_RATIO)}.",
                   Query(f"max by (job, pp_stage) ({_BUBBLE}{{{RANKS}}})",
                         "{{job}} stage {{pp_stage}} measured"),
                   Query(f"max by (job, pp_stage) ({_BUBBLE_THEORETICAL}{{{RANKS}}})",
                         "{{job}} stage {{pp_stage}} theory"),
                   width=8, minimum=0, maximum=1, limits=red_above(MAX_BUBBLE_RATIO)),
        timeseries("Collective latency p50 / p99", SECONDS, "Latency quantiles of the ranks' collective calls by "
                   "op; a p99 far above p50 on a ring is NCCL005's tail.", _quantile(0.5), _quantile(0.99),
                   width=8),
        timeseries("Collective traffic", BYTES_PER_SECOND, "Bytes per second the ranks' collectives move, by op.",
                   Query(f"sum by (job, op) (rate({VOLUME}_total{{{RANKS}}}"
                         "[$__rate_interval]))", "{{job}} {{op}}"), width=8),
        timeseries("Data-loader wait", SECONDS, "Time each rank's latest step waited for its batch.",
                   _per_rank(_DATALOADER_WAIT), width=12),
        timeseries("Data-loader wait share", PERCENT,
                   f"Input wait over step time: PERF003 above {percent(MAX_INPUT_WAIT_SHARE)}.",
                   Query(f"{_DATALOADER_WAIT}{{{RANKS}}} / {_STEP_SECONDS}{{{RANKS}}}",
                         PER_RANK), width=12, minimum=0, maximum=1, limits=red_above(MAX_INPUT_WAIT_SHARE)),
    ]


def _memory() -> list[PanelBuilder]:
    def series(name: MetricSpec, what: str) -> Query:
        return Query(f'{name}{{{RANKS}, kind="cuda"}}', f"{PER_RANK} {what}")

    reserved = f'{_MEMORY_RESERVED}{{{RANKS}, kind="cuda"}}'
    allocated = f'{_MEMORY_ALLOCATED}{{{RANKS}, kind="cuda"}}'
    return [
        timeseries("CUDA memory: peak, reserved, allocated", BYTES, "The caching allocator's peak of the latest "
                   "step, what it holds, and what tensors use (MEM002: peak near the GPU's capacity).",
                   series(MEMORY_PEAK, "peak"),
                   series(_MEMORY_RESERVED, "reserved"),
                   series(_MEMORY_ALLOCATED, "allocated"), width=8),
        timeseries("Fragmentation", PERCENT, "Reserved but unallocated share of the caching allocator's memory, "
                   "and the inactive split blocks' share (MEM001 above "
                   f"{percent(MIN_UNUSED_SHARE)} with allocation retries).",
                   Query(f"({reserved} - {allocated}) / {reserved}", f"{PER_RANK} unallocated"),
                   Query(f'{_MEMORY_INACTIVE_SPLIT}{{{RANKS}, kind="cuda"}} / {reserved}',
                         f"{PER_RANK} inactive split"), width=8, minimum=0, maximum=1,
                   limits=red_above(MIN_UNUSED_SHARE)),
        timeseries("Allocation retries", PER_SECOND, "Caching-allocator retries per second (a cache flush and "
                   "retry after a failed cudaMalloc): each stalls the step.",
                   Query(f"rate({_ALLOC_RETRIES}_total{{{RANKS}}}[$__rate_interval])", PER_RANK),
                   width=8, limits=red_above(ALLOC_RETRIES_PER_SECOND)),
    ]


def _timing() -> list[PanelBuilder]:
    return [
        timeseries("Step time per rank", SECONDS, "Wall time of each rank's latest step; data-parallel "
                   "all-reduce evens these out.", _per_rank(_STEP_SECONDS), width=8),
        timeseries("Busy time per rank", SECONDS, "Median over each rank's window of its step without its waits "
                   "in collectives (the sum of its phases): the straggler the others wait for shows here (PERF002, "
                   f"{STRAGGLER_RATIO:g}x its stage's median).",
                   Query(f'{WINDOW_MEDIAN}{{{RANKS}, timing="{BUSY}"}}', PER_RANK),
                   width=8),
        timeseries("Phases per rank", SECONDS, "Each rank's latest step split into data, compute, optimizer and "
                   "the host's work outside the model (callbacks, logging, checkpointing), each without collective "
                   "waits: the phase where a straggler's extra time is says where to look (PERF002).",
                   *(Query(f"{by_field(STEP_GAUGES, field)}{{{RANKS}}}", f"{PER_RANK} {phase.replace('_', ' ')}")
                     for phase, field in STEP_PHASES.items()),
                   width=8),
    ]


#: The phases of a progress record (gpuwatch.protocol.schema.PHASES), as the state timeline numbers them.
_PHASES = {"data": (1, "data", YELLOW), "compute": (2, "compute", "blue"), "optimizer": (3, "optimizer", "purple"),
           "collective": (4, "collective", RED), "step": (5, "step", "orange"), "idle": (6, "idle", "green"),
           "closed": (7, "closed (ended)", "text")}


def _progress() -> list[PanelBuilder]:
    phase = " or ".join(f'({PHASE}{{{RANKS}, phase="{name}"}} * {number})'
                        for name, (number, _, _) in _PHASES.items())
    return [
        state_timeline("Phase of overdue ranks", "What each rank that has stopped making progress is in (its "
                       "hooks report it about every second once a step is overdue; nothing while steps flow): ranks "
                       "in a collective wait, the rank in another phase is the one they wait for (HANG001).",
                       Query(f"max by (job, rank) ({phase})", PER_RANK),
                       {number: (text, colour) for number, text, colour in _PHASES.values()}, width=12),
        timeseries("In-flight collective", NONE, "Sequence number, on its process group, of the collective each "
                   "overdue rank waits in: ranks of one group at different numbers are a mismatch (HANG002).",
                   Query(f"{IN_FLIGHT}{{{RANKS}}}",
                         "{{job}} rank {{rank}} {{op}} on {{group}}"), width=6),
        timeseries("Stalled for", SECONDS, "Seconds since each overdue rank last made progress (HANG001-003 from "
                   f"{STALL_SECONDS:g} s).", _per_rank(STALLED), width=6,
                   limits=red_above(STALL_SECONDS)),
    ]


def build() -> Dashboard:
    """The Training health dashboard."""
    return dashboard(
        UID, "gpuwatch / Training health",
        "Convergence, parallelism overheads, memory and per-rank timing of the training jobs the hooks report.",
        [datasource_variable(), job_variable(), node_variable(), rank_variable()],
        [
            ("Convergence", _convergence()),
            ("Pipeline, collectives and input", _parallelism()),
            ("Memory", _memory()),
            ("Per-rank timing", _timing()),
            ("Progress of stalled ranks (hangs)", _progress()),
        ],
    )
