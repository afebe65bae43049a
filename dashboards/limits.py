"""The limits the dashboards draw (threshold lines, red above), in one place.

Where a `gpuwatch diagnose` rule judges the plotted figure, the limit is that rule's threshold, read from the rule
registry: a panel turns red where the rule and its alert (alerts/rules.py reads the same thresholds) fire, and
changing a threshold moves the line at the next ``python -m gpuwatch.dashboards.generate``. Limits no rule has are
named constants below, each with where its number comes from.
"""

from __future__ import annotations

from gpuwatch.diagnosis import rules as _catalogue  # noqa: F401 - importing registers every rule
from gpuwatch.diagnosis.registry import REGISTRY


def _threshold(code: str, name: str) -> float:
    return REGISTRY[code].thresholds[name].value


def percent(share: float) -> str:
    """A share as panel descriptions write it: 0.2 as "20 %"."""
    return f"{round(share * 100, 10):g} %"


#: PERF002: a rank busy this many times its stage's median, by at least this share of the job's median step.
STRAGGLER_RATIO = _threshold("PERF002", "straggler_ratio")
STRAGGLER_MIN_STEP_SHARE = _threshold("PERF002", "min_step_share")
#: PERF001: the measured pipeline bubble above which a stage is flagged.
MAX_BUBBLE_RATIO = _threshold("PERF001", "max_bubble_ratio")
#: PERF003: the share of the step spent waiting for input above which the loader is flagged.
MAX_INPUT_WAIT_SHARE = _threshold("PERF003", "max_wait_share")
#: MEM002: a rank's CUDA peak over its GPU's memory above which it runs near capacity.
MAX_PEAK_SHARE = _threshold("MEM002", "max_peak_share")
#: MEM001: reserved-but-unallocated share above which (with allocation retries) memory is fragmented.
MIN_UNUSED_SHARE = _threshold("MEM001", "min_unused_share")
#: CONV003: relative spread of the replicas' parameter checksums above which they disagree.
REPLICA_TOLERANCE = _threshold("CONV003", "relative_tolerance")
#: CONV002: a gradient norm above this has exploded, as has one this many times its running median.
MAX_GRAD_NORM = _threshold("CONV002", "max_grad_norm")
GRAD_SPIKE_FACTOR = _threshold("CONV002", "spike_factor")
#: CONV005: a mean gradient cosine below the low bound means skewed data, above the high one a batch too large.
LOW_COSINE = _threshold("CONV005", "low_cosine")
HIGH_COSINE = _threshold("CONV005", "high_cosine")
#: HANG001-003: a rank without progress this long is stalled (the three rules share the threshold).
STALL_SECONDS = _threshold("HANG001", "stall_seconds")

#: No rule: drift drawn yellow from a tenth of CONV003's tolerance, so it shows before the rule fires (rounded to
#: 12 digits: a tenth of 1e-5 is 1.0000000000000002e-06 in floating point).
REPLICA_DRIFT = float(f"{REPLICA_TOLERANCE / 10:.12g}")
#: No rule: device memory used (not a rank's peak, which MEM002 judges) drawn yellow a step below MEM002's bound.
MEMORY_USED_WARN = 0.9
#: No rule: CONV004 flags duplicated data at a cosine of 0.99999 on every rank, which a panel cannot tell from 1;
#: the red band starts at 0.999, where the line visibly sits on the axis' top.
COSINE_NEAR_ONE = 0.999
#: No rule (HW005 judges the slowdown, not the temperature): NVIDIA data-center GPUs report their slowdown temperature
#: (`nvidia-smi -q`, "GPU Slowdown Temp") in the high 80s; yellow from 80 °C, red from 87 °C.
TEMPERATURE_WARM_CELSIUS = 80
TEMPERATURE_HOT_CELSIUS = 87
#: No rule: a link or port carrying more than 80 % of its rated rate is near saturation (PERF005 judges delivered
#: bandwidth against the rate, not the share drawn here).
LINK_BUSY_SHARE = 0.8
#: No rule: HW003 counts errors over diagnosis's window; the panel plots their rate, red from one error per 100 s.
PORT_ERRORS_PER_SECOND = 0.01
#: No rule: MEM001 reads the allocator's retries as any at all; the panel plots their rate, red from one per 1000 s.
ALLOC_RETRIES_PER_SECOND = 0.001
