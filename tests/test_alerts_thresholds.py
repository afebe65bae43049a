"""Each alert's numbers and class lists are the diagnose rules' own: the rule registry is the source of truth, and
this test fails when an alert in alerts/gpuwatch.rules.yml says something else.

The alert file stays hand-written YAML (operators read and adapt it; a generated file of templated PromQL reads
worse), so the contract is held here: every number or class an alert shares with a rule is listed once below,
read out of the alert's expression, and compared with the registry.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from gpuwatch.agent.diagnosis import engine  # noqa: F401 - importing registers every rule
from gpuwatch.agent.diagnosis.facts import SLOWDOWN_REASONS
from gpuwatch.agent.diagnosis.registry import REGISTRY
from gpuwatch.agent.diagnosis.rules.hardware import APPLICATION_XIDS
from gpuwatch.agent.telemetry.window import MIN_WINDOW_STEPS

RULES = Path(__file__).parent.parent / "alerts" / "gpuwatch.rules.yml"


def _threshold(code: str, name: str) -> float:
    return REGISTRY[code].thresholds[name].value


def _number(pattern: str) -> Callable[[str], float]:
    def read(expr: str) -> float:
        found = re.findall(pattern, expr)
        assert len(found) == 1, f"{pattern!r} matches {len(found)} times in {expr!r}"
        return float(found[0])

    return read


def _classes(pattern: str) -> Callable[[str], frozenset[str]]:
    def read(expr: str) -> frozenset[str]:
        (listed,) = re.findall(pattern, expr)
        return frozenset(listed.split("|"))

    return read


#: (alert or recording rule, what it shares, how to read it from the expression, the registry's value).
PARITY = [
    ("TrainingStraggler", "PERF002 straggler_ratio", _number(r"median_by_stage > ([\d.]+)"),
     _threshold("PERF002", "straggler_ratio")),
    ("TrainingStraggler", "PERF002 min_step_share", _number(r"group_left \(\) ([\d.]+) \* gpuwatch:train_window_step"),
     _threshold("PERF002", "min_step_share")),
    ("gpuwatch:train_window_busy_seconds:judged", "the fewest steps a window is judged on",
     _number(r"gpuwatch_train_window_steps >= (\d+)"), MIN_WINDOW_STEPS),
    ("TrainingPipelineBubbleHigh", "PERF001 max_bubble_ratio", _number(r"\) > ([\d.]+)"),
     _threshold("PERF001", "max_bubble_ratio")),
    ("TrainingReplicasOutOfSync", "CONV003 relative_tolerance", _number(r"> ([\d.e-]+)\s*$"),
     _threshold("CONV003", "relative_tolerance")),
    ("TrainingGpuMemoryNearCapacity", "MEM002 max_peak_share", _number(r"> ([\d.]+)\s*$"),
     _threshold("MEM002", "max_peak_share")),
    ("TrainingMemoryFragmented", "MEM001 min_unused_share", _number(r"> ([\d.]+)\n"),
     _threshold("MEM001", "min_unused_share")),
    ("InfinibandErrorsRising", "HW003 max_error_increase", _number(r"> (\d+)$"),
     _threshold("HW003", "max_error_increase")),
    ("GpuThermalThrottling", "HW005 min_load", _number(r"utilization_ratio > ([\d.]+)"),
     _threshold("HW005", "min_load")),
    ("GpuThermalThrottling", "HW005's slowdown reasons", _classes(r'reason=~"([^"]+)"'), frozenset(SLOWDOWN_REASONS)),
    ("gpuwatch:gpu_slowdown:by_instance", "HW005's slowdown reasons", _classes(r'reason=~"([^"]+)"'),
     frozenset(SLOWDOWN_REASONS)),
    ("GpuXidError", "HW004's application Xids (not paged)", _classes(r'xid!~"([^"]+)"'), APPLICATION_XIDS),
    ("TrainingRankMissingAtCollective", "HANG001 stall_seconds", _number(r"gpuwatch_train_stalled_seconds >= ([\d.]+)"),
     _threshold("HANG001", "stall_seconds")),
    ("TrainingCollectiveStalled", "HANG003 stall_seconds", _number(r"gpuwatch_train_stalled_seconds >= ([\d.]+)"),
     _threshold("HANG003", "stall_seconds")),
]


def _expressions() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule.get("alert") or rule["record"]: rule["expr"].strip() for group in groups for rule in group["rules"]}


@pytest.mark.parametrize(("name", "shared", "read", "expected"), PARITY, ids=[f"{n}: {s}" for n, s, _, _ in PARITY])
def test_alert_agrees_with_the_rule_registry(name, shared, read, expected):
    assert read(_expressions()[name]) == expected, f"{name} disagrees with {shared}"


def test_a_changed_threshold_is_caught():
    """The reader finds the number it compares: a copy of the straggler alert with another ratio disagrees."""
    expr = _expressions()["TrainingStraggler"].replace("median_by_stage > 1.25", "median_by_stage > 1.5")
    assert _number(r"median_by_stage > ([\d.]+)")(expr) != _threshold("PERF002", "straggler_ratio")
