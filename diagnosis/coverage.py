"""How each rule is covered at cluster scale: the words a rule's ``@rule(..., coverage=...)`` declares it with.

Above 64 nodes ``gpuwatch diagnose --prometheus`` reads only some nodes in detail (``sources/outliers.py``): those a
*selector* picks (a PromQL expression answering one row per node or job where a rule could find something), those
of ranks whose environment differs from their job's majority, and one node per job. A rule judged on those nodes
alone must be sure that what it looks for is among them, so each rule says how: the selectors that pick its nodes
or jobs (with ``ENV_MINORITY`` where it judges an environment setting), or ``WholeJob`` (with why) where no
selector can narrow its judgement down (a trend or a spread over every rank of a job: the outlier fetch then
reports it as not run). The declaration sits in the rule's ``@rule``, so a rule cannot be added without one
(``registry.Rule`` refuses it), and the outlier fetch derives what it asks from the registry.

A selector compares with the rule's own ``Threshold`` (``t(code)``, ``--config`` overrides applied), and is a
superset of what its rules flag, never a second copy of their judgement. It reads the outlier fetch's yardsticks
and threshold-free signals by their recording rule's name (``y[name]``: ``outliers.RECORDED``). Where a selector is
a superset: HW003's peers are narrowed to the link layer (not the HCA model); PERF002's ratio is the smaller of its
two (a CPU job's larger one is the rule's to apply); HANG002's mismatch is fetched through the ranks it leaves
overdue; CONV003's checksums through any shard whose replicas disagree, at whatever step.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping

from gpuwatch.agent.telemetry.metrics import (
    CLOSED,
    ENV_INFO,
    EXITED,
    PROBE_INFO,
    RAISED,
    STALLED,
)

#: What a selector answers one row per (its ``by``): a node, whose series are then read in detail...
INSTANCE = "instance"
#: ... or a training job, every node of which is then read. Like the alerts, the outlier fetch reads the training
#: job from ``job``: the agents are scraped with ``honor_labels: true`` (alerts/gpuwatch.rules.yml says why).
JOB = "job"
#: A rank's identity in its series.
RANK = "instance, job, rank"

#: A rule's thresholds by its code, ``--config`` overrides applied (``t("PERF002").straggler_ratio``).
Thresholds = Callable[[str], types.SimpleNamespace]
#: The outlier fetch's yardsticks and signals by recording rule name: the recorded series, or its expression.
Yardsticks = Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class Selector:
    """A PromQL expression answering one row per node (``by = INSTANCE``) or job (``by = JOB``) where the rules
    covered by it could find something; built from their thresholds (``t(code)``) and the yardsticks (``y``).
    ``what`` says which nodes or jobs it picks, in the report's note and when the engine cannot answer it."""

    what: str
    expr: Callable[[Thresholds, Yardsticks], str]
    by: str = INSTANCE


@dataclasses.dataclass(frozen=True)
class EnvMinority:
    """The nodes of ranks whose exported environment differs from their job's majority: a setting the whole job
    shares is seen on the one node per job read in detail, so these are the ones a rule judging a setting needs."""

    what: str


@dataclasses.dataclass(frozen=True)
class WholeJob:
    """No selector narrows the rule's judgement down: it needs every rank of a job, so the outlier fetch does not
    run it and says ``why``."""

    why: str


#: One part of a rule's coverage. A rule's coverage is one or more ``Selector``s and ``ENV_MINORITY``, or exactly one
#: ``WholeJob`` alone (``registry.Rule`` holds it to that).
CoveragePart = Selector | EnvMinority | WholeJob

ENV_MINORITY = EnvMinority("environments differing from their job's majority")

# The selectors, in the order the outlier fetch asks them and so credits a node several pick to the first in the
# report's note: hardware faults before the symptoms they cause.
GPU_FAULTY = Selector("GPUs lost, with Xids, uncorrectable ECC errors or pending row remaps",
                      lambda t, y: y["gpuwatch:gpu_faulty:by_instance"])
PCIE_BELOW_MAX = Selector("PCIe links below their maximum", lambda t, y: y["gpuwatch:gpu_pcie_below_max:by_instance"])
GPU_SLOWDOWN = Selector("GPUs slowing themselves down", lambda t, y: y["gpuwatch:gpu_slowdown:by_instance"])
NVLINK_DOWN = Selector("NVLink links down", lambda t, y: y["gpuwatch:nvlink_down:by_instance"])
#: A node whose collector is down shows none of what the hardware rules look for: it is read, so that they say so.
COLLECTORS_DOWN = Selector("collectors down", lambda t, y: y["gpuwatch:collector_down:by_instance"])
IB_PORT_UNHEALTHY = Selector(
    "InfiniBand/RoCE ports not ACTIVE beside an ACTIVE peer, slower than the node's fastest, or erring",
    lambda t, y: y["gpuwatch:ib_port_unhealthy:by_instance"])
NONFINITE_OR_EXPLODING = Selector(
    "ranks with a non-finite loss or gradient norm, or an exploding one",
    lambda t, y: f'{y["gpuwatch:train_nonfinite:by_instance"]} or '
                 f'{y["gpuwatch:train_grad_norm:max_by_instance"]} > {t("CONV002").max_grad_norm:g}')
MEMORY_PRESSURE = Selector(
    "ranks that retried allocations or ran out of memory, or peak near their GPU's capacity",
    lambda t, y: f'{y["gpuwatch:train_alloc_trouble:by_instance"]} or '
                 f'{y["gpuwatch:train_cuda_peak_share:max_by_instance"]} > {t("MEM002").max_peak_share:g}')
STRAGGLERS = Selector(
    "ranks busy beyond k × their stage's median",
    lambda t, y: f'{y["gpuwatch:train_busy_over_stage_median:max_by_instance"]} > '
                 f"{min(t('PERF002').straggler_ratio, t('PERF002').shared_cpu_ratio):g}")
INPUT_WAIT = Selector(
    "ranks waiting on input for a large share of their step",
    lambda t, y: f'{y["gpuwatch:train_input_wait_share:max_by_instance"]} > {t("PERF003").max_wait_share:g}')
COLLECTIVE_TAIL = Selector(
    "jobs with a heavy collective latency tail (read whole: a tail on some ranks only is a wait on the others)",
    lambda t, y: f'{y["gpuwatch:train_collective_tail:max_by_job"]} > {t("NCCL005").tail_ratio:g}', by=JOB)
NCCL_SOCKET_IFNAME = Selector("ranks that name NCCL's socket interface",
                              lambda t, y: f'{ENV_INFO}{{name="NCCL_SOCKET_IFNAME"}}')
GRADIENTS_ALIKE = Selector(
    "ranks with gradients too alike across data-parallel replicas",
    lambda t, y: f'{y["gpuwatch:train_grad_cosine:max_by_instance"]} > {t("CONV004").min_cosine:g}')
RANK_OVERDUE_DEAD_OR_FAILED = Selector("jobs with an overdue, dead or failed rank",
                                       lambda t, y: f"{STALLED} or {EXITED} or {RAISED}", by=JOB)
CLOSED_NOT_EXITED = Selector(
    "jobs with a rank whose hooks closed long ago and whose process has not exited",
    lambda t, y: f'(time() - {CLOSED} >= {t("HANG007").min_age_seconds:g}) unless {EXITED}', by=JOB)
NO_STEP_SINCE_HELLO = Selector(
    "jobs with ranks that said hello long ago, or ended, and reported no step",
    lambda t, y: f'time() - {y["gpuwatch:train_hello_without_step:min_by_job"]} >= {t("HANG005").min_age_seconds:g}'
                 f' or {y["gpuwatch:train_closed_without_step:by_job"]}', by=JOB)
REPLICAS_DIVERGED = Selector(
    "jobs whose replicas of one shard hold different parameter checksums",
    lambda t, y: f'{y["gpuwatch:train_param_checksum:distinct_by_shard"]} > 1', by=JOB)
PIPELINE_BUBBLE = Selector(
    "jobs whose median pipeline bubble is high",
    lambda t, y: f'{y["gpuwatch:train_window_bubble_ratio:median_by_job"]} > {t("PERF001").max_bubble_ratio:g}',
    by=JOB)
#: A superset of PERF006's: a stage's median busy time beyond its ratio times the job's least busy rank, in jobs of
#: more than one stage (the rule compares a stage's lower median, at most its median, with the other stages' lower
#: medians, each at least the least busy rank's).
PIPELINE_STAGES_UNBALANCED = Selector(
    "jobs whose busiest pipeline stage is busy well beyond their least busy rank",
    lambda t, y: f'(max by (job) ({y["gpuwatch:train_window_busy_seconds:median_by_stage"]}) > '
                 f"{min(t('PERF006').stage_ratio, t('PERF006').stage_shared_cpu_ratio):g} * "
                 f'{y["gpuwatch:train_window_busy_seconds:min_by_job"]}) and on (job) '
                 f'(count by (job) ({y["gpuwatch:train_window_busy_seconds:median_by_stage"]}) > 1)',
    by=JOB)
PROBE_RAN = Selector("nodes that ran an interconnect probe", lambda t, y: PROBE_INFO.name)

#: Every selector declared above, in declaration order (the order the outlier fetch asks them in).
DECLARED: tuple[Selector, ...] = tuple(value for value in tuple(globals().values()) if isinstance(value, Selector))
