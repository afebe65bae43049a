"""Cluster overview: is the fleet healthy, how fast do the jobs train, and which findings' signals are lit."""

from __future__ import annotations

from gpuwatch.agent.collectors.nvml import GPU_INFO, GPU_LOST
from gpuwatch.agent.metricspec import by_field
from gpuwatch.agent.sampler import COLLECTOR_UP
from gpuwatch.agent.telemetry.metrics import (
    CHECKSUM,
    COUNTERS,
    STEP_GAUGES,
    TRACKED_RANKS,
    WINDOW_GAUGES,
    WINDOW_MEDIAN,
)
from gpuwatch.agent.telemetry.window import BUSY
from gpuwatch.alerts.generate import promql_number
from gpuwatch.dashboards.limits import (
    MAX_BUBBLE_RATIO,
    REPLICA_DRIFT,
    REPLICA_TOLERANCE,
    STRAGGLER_MIN_STEP_SHARE,
    STRAGGLER_RATIO,
    percent,
)
from gpuwatch.dashboards.panels import (
    COUNT,
    FLOPS,
    JOBS,
    NODE,
    NONE,
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
    heatmap,
    job_variable,
    node_variable,
    rank_variable,
    red_above,
    stat,
    thresholds,
    timeseries,
)

UID = "gpuwatch-cluster"
#: The families of tables the panels plot, each by the quantity it holds.
_STEP_SECONDS, _MODEL_FLOPS, _MFU, _BUBBLE_THEORETICAL = (
    by_field(STEP_GAUGES, field) for field in ("step_seconds", "model_flops_per_second", "mfu",
                                               "bubble_ratio_theoretical"))
_TOKENS, _NONFINITE_STEPS = by_field(COUNTERS, "tokens"), by_field(COUNTERS, "nonfinite_steps")
_WINDOW_BUBBLE = by_field(WINDOW_GAUGES, "bubble_ratio")


def _fleet() -> list[PanelBuilder]:
    return [
        stat("Nodes up", COUNT, "Agents Prometheus scraped successfully (scrape job `gpuwatch`).",
             Query(f'sum(up{{job="gpuwatch", {NODE}}})')),
        stat("Nodes down", COUNT, "Agents Prometheus failed to scrape: their GPUs and ranks are unobserved.",
             Query(f'count(up{{job="gpuwatch", {NODE}}} == 0) or vector(0)'), limits=red_above(1)),
        stat("GPUs", COUNT, "GPUs the agents see through NVML.", Query(f"count({GPU_INFO}{{{NODE}}})")),
        stat("GPUs lost", COUNT, "GPUs NVML reports fallen off the bus (Xid 79); see the GpuLost runbook.",
             Query(f"sum({GPU_LOST}{{{NODE}}})"), limits=red_above(1)),
        stat("Collectors down", COUNT, "Agent collectors failing every round; the reason is in /api/v1/state.",
             Query(f"count({COLLECTOR_UP}{{{NODE}}} == 0) or vector(0)"), limits=red_above(1)),
        stat("Ranks reporting", COUNT, "Training ranks whose telemetry the agents hold.",
             Query(f"sum({TRACKED_RANKS}{{{JOBS}, {NODE}}})")),
    ]


def _jobs() -> list[PanelBuilder]:
    return [
        timeseries("Step time", SECONDS, "Wall time of the latest step of the job's slowest rank: synchronous "
                   "training runs at its pace.",
                   Query(f"max by (job) ({_STEP_SECONDS}{{{RANKS}}})", "{{job}}"), width=6),
        timeseries("Throughput", "suffix: tokens/s", "Tokens per second, all ranks of the job together.",
                   Query(f"sum by (job) (rate({_TOKENS}_total{{{RANKS}}}[$__rate_interval]))",
                         "{{job}}"), width=6),
        timeseries("Achieved model FLOP/s", FLOPS, "Model FLOP/s of the latest step, summed over the job's ranks.",
                   Query(f"sum by (job) ({_MODEL_FLOPS}{{{RANKS}}})", "{{job}}"), width=6),
        timeseries("Model FLOPs utilisation", PERCENT, "Achieved over peak FLOP/s (MFU), mean of the job's ranks.",
                   Query(f"avg by (job) ({_MFU}{{{RANKS}}})", "{{job}}"), width=6,
                   minimum=0, maximum=1),
    ]


def _findings() -> list[PanelBuilder]:
    checksum = f"{CHECKSUM}{{{RANKS}}}"
    window_busy = f'{WINDOW_MEDIAN}{{{RANKS}, timing="{BUSY}"}}'
    replicas = "by (job, tp_rank, pp_stage)"
    return [
        timeseries("Straggler ratio", NONE, "Slowest rank's median busy time (its step without its waits in "
                   "collectives) over its window of recent steps, against the median of its pipeline stage (PERF002 "
                   f"and the TrainingStraggler alert fire above {STRAGGLER_RATIO:g} when the excess is also "
                   f"{percent(STRAGGLER_MIN_STEP_SHARE)} of the job's median step).",
                   Query(f"max by (job) ({window_busy} / on (job, pp_stage) group_left () "
                         f"quantile by (job, pp_stage) (0.5, {window_busy}))", "{{job}}"),
                   width=6, limits=red_above(STRAGGLER_RATIO)),
        timeseries("Pipeline bubble", PERCENT, "Largest measured bubble of any stage against the schedule's "
                   f"theory, (p-1)/(m+p-1) (PERF001 above {percent(MAX_BUBBLE_RATIO)}).",
                   Query(f"max by (job) ({_WINDOW_BUBBLE}{{{RANKS}}})", "{{job}} measured"),
                   Query(f"max by (job) ({_BUBBLE_THEORETICAL}{{{RANKS}}})",
                         "{{job}} theory"),
                   width=6, minimum=0, maximum=1, limits=red_above(MAX_BUBBLE_RATIO)),
        timeseries("Non-finite steps", COUNT, "Steps with a NaN or Inf loss or gradient (CONV001), all ranks.",
                   Query(f"sum by (job) ({_NONFINITE_STEPS}_total{{{RANKS}}})", "{{job}}"),
                   width=6, limits=red_above(1)),
        timeseries("Replica desync", NONE, "Largest relative spread of the parameter checksums of data-parallel "
                   f"replicas (CONV003 above {promql_number(REPLICA_TOLERANCE)}; 0 when in sync).",
                   Query(f"max by (job) ((max {replicas} ({checksum}) - min {replicas} ({checksum})) "
                         f"/ max {replicas} (abs({checksum})))", "{{job}}"),
                   width=6, limits=thresholds((None, "green"), (REPLICA_DRIFT, YELLOW), (REPLICA_TOLERANCE, RED))),
    ]


def build() -> Dashboard:
    """The Cluster overview dashboard."""
    return dashboard(
        UID, "gpuwatch / Cluster overview",
        "Fleet health, job speed and the diagnosis signals of every training job gpuwatch agents observe.",
        [datasource_variable(), job_variable(), node_variable(), rank_variable()],
        [
            ("Fleet", _fleet()),
            ("Jobs", _jobs()),
            ("Findings' signals", _findings()),
            ("Achieved FLOP/s per rank", [
                heatmap("Achieved model FLOP/s per rank", FLOPS,
                        "One row per rank, time across, colour the rank's achieved model FLOP/s: a slow rank or "
                        "node is a dark row, a stall a dark column.",
                        Query(f"sum by (job, rank) ({_MODEL_FLOPS}{{{RANKS}}})",
                              "{{job}} rank {{rank}}")),
            ]),
        ],
    )
