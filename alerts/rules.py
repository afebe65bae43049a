"""The alerting and recording rules of ``gpuwatch.rules.yml``, declared; ``alerts/generate.py`` renders the file.

Why declared rather than written as YAML: an alert that pages for a ``gpuwatch diagnose`` rule compares with that
rule's own thresholds and reads counters over diagnosis's own window. Its expression, comment and description are
templates whose ``${name}`` placeholders are filled at generation from the mirrored rule's thresholds in the
registry (``${straggler_ratio}``, or ``${max_bubble_ratio_percent}`` as "20 %"), from the shared window
(``${window}`` as a PromQL range, ``${window_minutes}``) and from the alert's own ``for`` (``${for_minutes}``): a
threshold is stated once, in its rule, and changing it changes the alerts with it (tests/test_alerts_generated.py
perturbs every threshold and checks that exactly the alerts mirroring it change).

The metric families the templates select are placeholders too, in upper case (``${GPU_LOST}``,
``${XID_ERRORS}_total``): ``METRIC_FAMILIES`` maps each to the family's declaration (``agent.metricspec.MetricSpec``),
so that a family is named only where the agent declares it and a renamed one renames the alerts with it. The texts
that are no templates (the alerts' recording rules, the headings) interpolate the declarations as f-strings.

The recording rules are the outlier fetch's (``RECORDED`` in diagnosis/sources/outliers.py), in its order
with its version sentinel last, plus the ones only the alerts read (``ALERT_RECORDS``).

Numbers an alert has that no diagnose rule has are named constants here, each a ``Threshold`` with its source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from gpuwatch.agent.collectors.host import PROCESS_CPU
from gpuwatch.agent.collectors.infiniband import PORT_ERRORS, PORT_UP
from gpuwatch.agent.collectors.nvlink import LINK_ERRORS, LINK_UP
from gpuwatch.agent.collectors.nvml import (
    CLOCK_EVENT_ACTIVE,
    ECC_VOLATILE_ERRORS,
    GPU_GAUGES,
    GPU_INFO,
    GPU_LOST,
    PCIE_LINK_WIDTH,
    ROW_REMAP_FAILURE,
    ROW_REMAP_PENDING,
    XID_ERRORS,
)
from gpuwatch.agent.metricspec import MetricSpec, by_field
from gpuwatch.agent.sampler import COLLECTOR_UP
from gpuwatch.agent.telemetry.metrics import (
    CHECKSUM,
    CLOSED,
    CLOSED_CPU,
    COUNTERS,
    EXITED,
    GPU_JOB,
    IN_FLIGHT,
    LAST_STEP,
    MEMORY_GAUGES,
    MEMORY_PEAK,
    PHASE,
    RAISED,
    RANK_INFO,
    STALLED,
    STEP_GAUGES,
    WINDOW_GAUGES,
)
from gpuwatch.agent.telemetry.window import WINDOW_STEPS
from gpuwatch.diagnosis.facts import SLOWDOWN_REASONS
from gpuwatch.diagnosis.registry import Severity, Threshold
from gpuwatch.diagnosis.rules.hardware import APPLICATION_XIDS
from gpuwatch.protocol.schema import OVERDUE_FACTOR, OVERDUE_FLOOR_SECONDS


@dataclasses.dataclass(frozen=True)
class Alert:
    """An alert. ``expr``, ``description`` and ``comment`` are templates (the module docstring lists their
    placeholders); the runbook section is ``docs/runbook.md#<name in lower case>``."""

    name: str
    #: The diagnose rule the alert pages for: its thresholds fill the templates, its severity is the alert's.
    mirrors: str | None
    expr: str
    summary: str
    description: str
    for_minutes: int | None = None
    #: Above the expression in the file: why it is written so.
    comment: str = ""
    #: Above the alert in the file: a section heading for the alerts that follow.
    heading: str = ""
    #: The alert's severity where it differs from its rule's, or where it mirrors none (then required).
    severity: Severity | None = None
    #: Why the severity differs from the mirrored rule's (required with ``severity`` when ``mirrors`` is set).
    severity_reason: str = ""
    #: Placeholders of the alert's own: numbers no diagnose rule has (each with a source), class lists.
    values: Mapping[str, str | float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Record:
    """A recording rule the alerts read that the outlier fetch does not."""

    name: str
    expr: str


@dataclasses.dataclass(frozen=True)
class Group:
    """A rule group of the file: its alerts, after the recording rules where ``records`` is set."""

    name: str
    alerts: tuple[Alert, ...]
    comment: str = ""
    #: Whether the recording rules go first in this group (the alerts below read them in the same round).
    records: bool = False


#: NvlinkErrorsRising's bound: HW001 judges link state, not error counts, so the alert keeps its own number.
NVLINK_MAX_ERROR_INCREASE = Threshold(10, "chosen as HW003's for InfiniBand ports: a healthy link's bit error rate "
                                          "gives a handful of corrected errors in the window, not more")
#: TrainingMemoryFragmented's ``for``, and the span over which it counts the allocator's retries: fragmentation
#: matters only while it makes allocations fail, so the retries must recur over the time the alert waits.
FRAGMENTATION_MINUTES = 15

#: The alerts' own class lists, from the modules that define them for the diagnose rules.
_XIDS = sorted(APPLICATION_XIDS, key=int)
_SLOWDOWNS = "|".join(SLOWDOWN_REASONS)

#: The metric families the alerts' templates select, by placeholder (``${GPU_LOST}``): the name of a module's
#: declaration, or of the quantity a table's family holds.
METRIC_FAMILIES: Mapping[str, MetricSpec] = {
    "COLLECTOR_UP": COLLECTOR_UP,
    "GPU_LOST": GPU_LOST,
    "XID_ERRORS": XID_ERRORS,
    "ECC_VOLATILE_ERRORS": ECC_VOLATILE_ERRORS,
    "ROW_REMAP_PENDING": ROW_REMAP_PENDING,
    "ROW_REMAP_FAILURE": ROW_REMAP_FAILURE,
    "CLOCK_EVENT_ACTIVE": CLOCK_EVENT_ACTIVE,
    "PCIE_LINK_WIDTH": PCIE_LINK_WIDTH,
    "GPU_TEMPERATURE": by_field(GPU_GAUGES, "temperature_celsius"),
    "GPU_UTILIZATION": by_field(GPU_GAUGES, "utilization_ratio"),
    "GPU_MEMORY_TOTAL": by_field(GPU_GAUGES, "memory_total_bytes"),
    "LINK_UP": LINK_UP,
    "LINK_ERRORS": LINK_ERRORS,
    "PORT_UP": PORT_UP,
    "PORT_ERRORS": PORT_ERRORS,
    "STALLED": STALLED,
    "IN_FLIGHT": IN_FLIGHT,
    "RANK_INFO": RANK_INFO,
    "EXITED": EXITED,
    "CLOSED": CLOSED,
    "CLOSED_CPU": CLOSED_CPU,
    "PROCESS_CPU": PROCESS_CPU,
    "PHASE": PHASE,
    "RAISED": RAISED,
    "LAST_STEP": LAST_STEP,
    "LOSS": by_field(STEP_GAUGES, "loss"),
    "BUBBLE_THEORETICAL": by_field(STEP_GAUGES, "bubble_ratio_theoretical"),
    "WINDOW_BUBBLE": by_field(WINDOW_GAUGES, "bubble_ratio"),
    "CHECKSUM": CHECKSUM,
    "MEMORY_PEAK": MEMORY_PEAK,
    "MEMORY_RESERVED": by_field(MEMORY_GAUGES, "reserved_bytes"),
    "MEMORY_ALLOCATED": by_field(MEMORY_GAUGES, "allocated_bytes"),
    "ALLOC_RETRIES": by_field(COUNTERS, "alloc_retries"),
}

#: Recording rules only the alerts read.
ALERT_RECORDS = (
    Record("gpuwatch:gpu_rank:info", f"""
        max by (instance, gpu, uuid, job, rank) (
          {GPU_JOB} * on (instance, uuid) group_left (gpu) {GPU_INFO}
        )
    """),
)

#: Comments above recording rules, by the rule they precede (section headings of the training group).
RECORD_HEADINGS = {
    "gpuwatch:train_window_busy_seconds:judged": "Each rank's median busy time over its window of recent steps "
        f"(the agent keeps the last {WINDOW_STEPS} steps): the sum of its step's phases, the step without its waits in "
        "collectives (the others' steps wait for a straggler, and come out as long as its own). For ranks whose "
        "window holds the steps a median needs; and its stage's median of those: the straggler alert's yardstick, "
        "as PERF002's. One step is too noisy a sample to judge.",
    "gpuwatch:train_window_busy_seconds:count_by_stage": "Yardsticks of `gpuwatch diagnose --prometheus URL "
        "--prometheus.fetch outliers` (used when present, computed in its queries otherwise): how many ranks each "
        "stage's median is over, each stage's median of each phase (where a straggler's extra time is), the job's "
        "median step time (a straggler's extra busy time must matter against it), ranks per job, and each job's "
        "count of ranks per exported environment value (a rank whose value differs from its job's majority is read "
        "in detail). The expressions are diagnosis/sources/outliers.py's RECORDED.",
    "gpuwatch:gpu_faulty:by_instance": "Threshold-free signals that keep only the nodes with something wrong "
        "(sparse: the outlier fetch reads a few series instead of scanning 18 NVLinks, a dozen clock-event reasons "
        "and 8 ports per GPU or node). Last, the version of these rules: the fetch uses them only when the whole "
        "set is loaded, so that an empty sparse signal means nothing wrong.",
    "gpuwatch:train_busy_over_stage_median:max_by_instance": "Each node's largest per-rank figure that a rule "
        "compares with a threshold (the fetch holds the threshold): one series per node instead of one per rank or "
        "histogram bucket.",
    "gpuwatch:train_rank_info:one_by_job": "Per job: one of its ranks, and per shard (tensor rank × stage) the "
        "distinct parameter checksums of its data-parallel replicas: what the fetch would otherwise scan every "
        "rank for.",
    "gpuwatch:train_window_bubble_ratio:median_by_job": "Per job, what the whole-job selectors compare: its median "
        "pipeline bubble, the earliest hello of its ranks that reported no step, and whether one of those closed its "
        "hooks (the fetch holds the thresholds): one series per job instead of one per rank.",
    "gpuwatch:gpu_rank:info": "Which job and rank run on which GPU of a node, by the node's own GPU index: the "
        f"agent's {GPU_JOB} carries the rank's view of the index (CUDA_VISIBLE_DEVICES renumbers), the UUID joins "
        "it to the node's.",
}

GROUPS = (
    Group("gpuwatch.agent", (
        Alert("GpuwatchAgentDown", None, 'up{job="gpuwatch"} == 0', for_minutes=2, severity=Severity.CRITICAL,
              summary="gpuwatch agent on {{ $labels.instance }} is down",
              description="Prometheus has failed to scrape the gpuwatch agent on {{ $labels.instance }} for "
                          "${for_minutes} minutes (up = {{ $value }}): the node's GPUs, links and training ranks "
                          "are unobserved."),
        Alert("GpuwatchCollectorDown", None, "${COLLECTOR_UP} == 0", for_minutes=5, severity=Severity.WARNING,
              summary="gpuwatch collector {{ $labels.collector }} on {{ $labels.instance }} is down",
              description="The {{ $labels.collector }} collector of the agent on {{ $labels.instance }} has failed "
                          "every sampling round for ${for_minutes} minutes (up = {{ $value }}); its series are "
                          "missing. The reason is in the agent's /api/v1/state."),
    )),
    Group("gpuwatch.gpu", (
        Alert("GpuLost", "HW004", "${GPU_LOST} == 1", for_minutes=1,
              summary="GPU {{ $labels.gpu }} on {{ $labels.instance }} has fallen off the bus",
              description="NVML reports GPU {{ $labels.gpu }} on {{ $labels.instance }} lost (${GPU_LOST} = "
                          "{{ $value }}). Every job using it is stuck or dead; the node needs a drain and a GPU "
                          "reset or reboot."),
        Alert("GpuXidError", "HW004",
              'increase(${XID_ERRORS}_total{xid!~"${application_xids}"}[${window}]) > 0',
              comment="Application Xids (${application_xids_listed}: a bad kernel or an out-of-bounds access) are "
                      "the program's fault, not the GPU's, and stay out of a page.",
              values={"application_xids": "|".join(_XIDS), "application_xids_listed": ", ".join(_XIDS)},
              summary="Xid {{ $labels.xid }} on GPU {{ $labels.gpu }} of {{ $labels.instance }}",
              description="GPU {{ $labels.gpu }} on {{ $labels.instance }} reported Xid {{ $labels.xid }} "
                          "{{ $value | humanize }} times in the last ${window_minutes} minutes."),
        Alert("GpuUncorrectableEccErrors", "HW004",
              'increase(${ECC_VOLATILE_ERRORS}_total{error="uncorrected"}[${window}]) > 0',
              summary="Uncorrectable ECC errors on GPU {{ $labels.gpu }} of {{ $labels.instance }}",
              description="GPU {{ $labels.gpu }} on {{ $labels.instance }} counted {{ $value | humanize }} "
                          "uncorrectable (double-bit) ECC errors in the last ${window_minutes} minutes; results "
                          "computed on it may be corrupt."),
        Alert("GpuRowRemapPending", "HW004",
              "${ROW_REMAP_PENDING} == 1 or ${ROW_REMAP_FAILURE} == 1", for_minutes=5,
              severity=Severity.WARNING,
              severity_reason="HW004 is critical for a GPU lost or erring; a pending remap waits for the next "
                              "drain's GPU reset, nothing is wrong with results meanwhile",
              summary="GPU {{ $labels.gpu }} on {{ $labels.instance }} needs a reset for row remapping",
              description="GPU {{ $labels.gpu }} on {{ $labels.instance }} has a row remap pending or failed (flag "
                          "= {{ $value }}): its memory is not fully healthy until a GPU reset, or it must be "
                          "replaced when remapping failed."),
        Alert("GpuThermalThrottling", "HW005", """
            ${GPU_TEMPERATURE}
              and on (instance, gpu)
                (max by (instance, gpu) (${CLOCK_EVENT_ACTIVE}{reason=~"${slowdown_reasons}"}) == 1)
              and on (instance, gpu) (${GPU_UTILIZATION} > ${min_load})
            """, for_minutes=5,
              comment="Thermal and hardware slowdowns while the GPU is busy (an idle GPU lowers its clocks on "
                      "purpose).",
              values={"slowdown_reasons": _SLOWDOWNS},
              summary="GPU {{ $labels.gpu }} on {{ $labels.instance }} is throttled under load",
              description="GPU {{ $labels.gpu }} on {{ $labels.instance }} has held its clocks down for a thermal "
                          "or hardware slowdown for ${for_minutes} minutes while busy; it runs at {{ $value }} °C. "
                          "Every synchronous job on it runs at its pace."),
        Alert("GpuPcieLinkDegraded", "HW002",
              '${PCIE_LINK_WIDTH}{kind="current"} < ignoring (kind) ${PCIE_LINK_WIDTH}{kind="max"}',
              for_minutes=10,
              summary="PCIe link of GPU {{ $labels.gpu }} on {{ $labels.instance }} runs narrower than its maximum",
              description="GPU {{ $labels.gpu }} on {{ $labels.instance }} has trained its PCIe link at "
                          "x{{ $value }}, below its maximum width, for ${for_minutes} minutes: host transfers and "
                          "GPUDirect traffic through it are slower."),
    )),
    Group("gpuwatch.interconnect", (
        Alert("NvlinkDown", "HW001", "${LINK_UP} == 0", for_minutes=2, severity=Severity.CRITICAL,
              severity_reason="HW001 also reports links that are merely degraded; a link down makes NCCL fall back "
                              "or fail, which pages",
              summary="NVLink {{ $labels.link }} of GPU {{ $labels.gpu }} on {{ $labels.instance }} is down",
              description="NVLink {{ $labels.link }} of GPU {{ $labels.gpu }} on {{ $labels.instance }} has been "
                          "inactive for ${for_minutes} minutes (up = {{ $value }}): NCCL falls back to slower "
                          "paths or fails."),
        Alert("NvlinkErrorsRising", "HW001",
              "sum by (instance, gpu, link) (increase(${LINK_ERRORS}_total[${window}])) "
              "> ${nvlink_max_error_increase}", for_minutes=5,
              values={"nvlink_max_error_increase": NVLINK_MAX_ERROR_INCREASE.value},
              summary="NVLink {{ $labels.link }} of GPU {{ $labels.gpu }} on {{ $labels.instance }} counts errors",
              description="NVLink {{ $labels.link }} of GPU {{ $labels.gpu }} on {{ $labels.instance }} counted "
                          "{{ $value | humanize }} CRC/replay/recovery errors in the last ${window_minutes} "
                          "minutes."),
        Alert("InfinibandPortDown", "HW003", "${PORT_UP} == 0", for_minutes=2,
              summary="{{ $labels.link_layer }} port {{ $labels.device }}/{{ $labels.port }} on "
                      "{{ $labels.instance }} is down",
              description="Port {{ $labels.port }} of {{ $labels.device }} on {{ $labels.instance }} has not been "
                          "ACTIVE for ${for_minutes} minutes (up = {{ $value }}): cross-node collectives lose a "
                          "rail or hang."),
        Alert("InfinibandErrorsRising", "HW003",
              "sum by (instance, device, port) (increase(${PORT_ERRORS}_total[${window}])) "
              "> ${max_error_increase}", for_minutes=5, severity=Severity.WARNING,
              severity_reason="HW003 is critical for a port down; errors on a port still up are a warning of it",
              summary="InfiniBand port {{ $labels.device }}/{{ $labels.port }} on {{ $labels.instance }} counts "
                      "errors",
              description="Port {{ $labels.port }} of {{ $labels.device }} on {{ $labels.instance }} counted "
                          "{{ $value | humanize }} errors (symbol, link recovery, receive, discards, ...) in the "
                          "last ${window_minutes} minutes, more than a healthy link's bit error rate gives."),
    )),
    Group("gpuwatch.training", records=True,
          comment="Recording rules first: rules of one group are evaluated in order, so the alerts below see this "
                  "round's values (groups run concurrently, and an alert reading another group's record would lag "
                  "it by a round).",
          alerts=(
        Alert("TrainingRankMissingAtCollective", "HANG001", """
            (${STALLED} >= ${stall_seconds})
              unless on (instance, job, rank) ${IN_FLIGHT}
            and on (job) (count by (job) (${IN_FLIGHT}) > 0)
            """,
              heading="Hangs (HANG001, HANG003, HANG004, HANG006). A rank's hooks report its progress about every "
                      f"second once it has made none for {OVERDUE_FACTOR:g}x its median step "
                      f"({OVERDUE_FLOOR_SECONDS:g} s at least); these series exist only "
                      "while a rank is overdue.",
              comment="The culprit: a rank stuck outside any collective while others of its job wait in one.",
              summary="Training job {{ $labels.job }} hangs: rank {{ $labels.rank }} is missing at a collective",
              description="Rank {{ $labels.rank }} of job {{ $labels.job }} has made no progress for "
                          "{{ $value | humanizeDuration }} outside any collective while other ranks of the job wait "
                          "in one: they wait for it. gpuwatch diagnose names what it is doing (its phase and "
                          "stack)."),
        Alert("TrainingCollectiveStalled", "HANG003", """
            count by (job) (
              (${STALLED} >= ${stall_seconds})
                and on (instance, job, rank) ${IN_FLIGHT}
            )
              == count by (job) (${RANK_INFO})
            """,
              comment="Every rank of the job is inside a collective and none progresses: the transport, not the "
                      "program.",
              summary="Training job {{ $labels.job }}: every rank waits in a collective that does not end",
              description="All {{ $value }} ranks of job {{ $labels.job }} are inside a collective and none has "
                          "made progress: no rank is missing, the interconnect or the communicator is stuck."),
        Alert("TrainingRankDied", "HANG004", """
            bottomk by (job) (1, ${EXITED}
              unless on (instance, job, rank) ${PHASE}{phase="closed"})
            """,
              comment="The first rank of the job whose process the agent found gone before its hooks were closed (a "
                      "normal end closes them): the others usually follow it.",
              summary="Training job {{ $labels.job }}: rank {{ $labels.rank }} died",
              description="The process of rank {{ $labels.rank }} of job {{ $labels.job }} is gone since "
                          "{{ $value | humanizeTimestamp }} (the first of the job's ranks to go): gpuwatch diagnose "
                          "says how (its exception, or a signal)."),
        Alert("TrainingAllRanksStopped", "HANG006", """
            count by (job) (${STALLED} >= ${stall_seconds})
              == count by (job) (${RANK_INFO})
            unless on (job) ${IN_FLIGHT}
            unless on (job) ${PHASE}{phase="closed"}
            unless on (job) ${EXITED}
            unless on (job) ${RAISED}
            unless on (job) (${RANK_INFO} unless on (instance, job, rank) ${LAST_STEP})
            """, for_minutes=1,
              comment="Every rank of the job is still and none is in a collective gpuwatch knows (those are the "
                      "alerts above), none died, none closed its hooks (a job that ends), and every rank has "
                      "stepped (before its first step a stall is a compilation). For a minute: a checkpoint or an "
                      "evaluation on every rank stills them all for seconds and ends by itself; gpuwatch diagnose "
                      "names the stop at once.",
              summary="Training job {{ $labels.job }} stopped: every rank is still, none in a known collective",
              description="All {{ $value }} ranks of job {{ $labels.job }} have made no progress for "
                          "${for_minutes} minute(s) or more, and none is inside a collective gpuwatch sees: a "
                          "deadlock, a collective its hooks do not wrap, or a data loader that stopped. gpuwatch "
                          "diagnose names each rank's phase, the rank that stopped first and its stack."),
        Alert("TrainingRankNotExiting", "HANG007", """
            (time() - ${CLOSED} >= ${min_age_seconds})
              unless on (instance, job, rank) ${EXITED}
            and on (instance, job, rank) (
              ${PROCESS_CPU}_total - on (instance, job, rank) ${CLOSED_CPU}
                <= on (instance, job, rank) ${max_cpu_share} * (time() - ${CLOSED})
            )
            """,
              comment="A rank whose hooks closed (its training ended) and whose process, a while later, has not "
                      "exited and has used almost no CPU since: stuck in its teardown, its launcher waiting on it. "
                      "The CPU time since the close is the host collector's of the rank's process less its own as "
                      "its hooks closed.",
              summary="Training job {{ $labels.job }}: rank {{ $labels.rank }} ended training but does not exit",
              description="Rank {{ $labels.rank }} of job {{ $labels.job }} closed its hooks "
                          "{{ $value | humanizeDuration }} ago and its process has neither exited nor worked since: "
                          "the job does not end. py-spy dump --native --pid PID on its node shows where it waits."),
        Alert("TrainingLossNotFinite", "CONV001",
              "count by (job) ((${LOSS} != ${LOSS}) or (abs(${LOSS}) == +Inf)) > 0", for_minutes=1,
              summary="Training job {{ $labels.job }} has a NaN or Inf loss",
              description="{{ $value }} rank(s) of job {{ $labels.job }} report a NaN or Inf loss at their latest "
                          "step: training diverged and further steps are wasted."),
        Alert("TrainingReplicasOutOfSync", "CONV003", """
            (
              max by (job, tp_rank, pp_stage) (${CHECKSUM})
              - min by (job, tp_rank, pp_stage) (${CHECKSUM})
            ) / max by (job, tp_rank, pp_stage) (abs(${CHECKSUM})) > ${relative_tolerance}
            """, for_minutes=10,
              summary="Data-parallel replicas of job {{ $labels.job }} disagree",
              description="The parameter checksums of the data-parallel replicas of job {{ $labels.job }} (stage "
                          "{{ $labels.pp_stage }}, tp rank {{ $labels.tp_rank }}) have differed by a relative "
                          '{{ $value | printf "%.2g" }} for ${for_minutes} minutes: the replicas train different '
                          "models."),
        Alert("TrainingStraggler", "PERF002", """
            (
              gpuwatch:train_window_busy_seconds:judged
                / on (job, pp_stage) group_left () gpuwatch:train_window_busy_seconds:median_by_stage
              > ${straggler_ratio}
            )
            and
            (
              gpuwatch:train_window_busy_seconds:judged
                - on (job, pp_stage) group_left () gpuwatch:train_window_busy_seconds:median_by_stage
              > on (job) group_left () ${min_step_share} * gpuwatch:train_window_step_seconds:median_by_job
            )
            """, for_minutes=10,
              comment="PERF002's thresholds: ${straggler_ratio}x the stage's median busy time, and the excess at "
                      "least ${min_step_share_percent} of the job's median step.",
              summary="Rank {{ $labels.rank }} of job {{ $labels.job }} is a straggler",
              description="Rank {{ $labels.rank }} of job {{ $labels.job }} on {{ $labels.instance }} is busy "
                          '{{ $value | printf "%.2f" }}x the median of its pipeline stage\'s ranks (its step '
                          "without its waits in collectives); every synchronous step waits for it. gpuwatch "
                          "diagnose says in which phase its extra time is."),
        Alert("TrainingPipelineBubbleHigh", "PERF001",
              "max by (job, pp_stage) (${WINDOW_BUBBLE}) > ${max_bubble_ratio}", for_minutes=15,
              summary="Pipeline stage {{ $labels.pp_stage }} of job {{ $labels.job }} idles in bubbles",
              description="Pipeline stage {{ $labels.pp_stage }} of job {{ $labels.job }} has been idle "
                          "{{ $value | humanizePercentage }} of its step for ${for_minutes} minutes (threshold "
                          "${max_bubble_ratio_percent}); compare ${BUBBLE_THEORETICAL}, (p-1)/(m+p-1)."),
        Alert("TrainingGpuMemoryNearCapacity", "MEM002", """
            max by (instance, job, rank) (${MEMORY_PEAK}{kind="cuda"})
              / on (instance, job, rank)
            max by (instance, job, rank) (
              ${GPU_MEMORY_TOTAL} * on (instance, gpu) group_right () gpuwatch:gpu_rank:info
            )
              > ${max_peak_share}
            """, for_minutes=5,
              summary="Rank {{ $labels.rank }} of job {{ $labels.job }} peaks near its GPU's memory",
              description="Rank {{ $labels.rank }} of job {{ $labels.job }} on {{ $labels.instance }} peaks at "
                          "{{ $value | humanizePercentage }} of its GPU's memory: the next larger batch or longer "
                          "sequence runs out of memory."),
        Alert("TrainingMemoryFragmented", "MEM001", """
            (
              ${MEMORY_RESERVED}{kind="cuda"} - ${MEMORY_ALLOCATED}{kind="cuda"}
            ) / ${MEMORY_RESERVED}{kind="cuda"} > ${min_unused_share}
              and on (instance, job, rank) increase(${ALLOC_RETRIES}_total[${for_minutes}m]) > 0
            """, for_minutes=FRAGMENTATION_MINUTES,
              summary="CUDA memory of rank {{ $labels.rank }} of job {{ $labels.job }} is fragmented",
              description="Rank {{ $labels.rank }} of job {{ $labels.job }} on {{ $labels.instance }} holds "
                          "{{ $value | humanizePercentage }} of its reserved memory unallocated while the caching "
                          "allocator keeps retrying failed allocations."),
    )),
)
