"""alerts/gpuwatch.rules.yml is generated from alerts/rules.py and the diagnose rules' registry: the committed file is
what the generator gives, and every number an alert shares with a diagnose rule follows the rule's threshold.

The pairs (rule threshold, alerts comparing with it) are found, not listed: each threshold of the registry is changed
in turn and the generated file compared with the unchanged one. The alerts that change must be exactly those whose
templates read that threshold, and no alert may carry a number equal to one of its rule's thresholds that it does not
read from the rule (a copied literal would stay put when the threshold moves).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from gpuwatch.alerts import RULES_FILE
from gpuwatch.alerts.generate import fill, render, severity, template_values
from gpuwatch.alerts.rules import GROUPS, METRIC_FAMILIES, Alert
from gpuwatch.cli.main import main
from gpuwatch.diagnosis.registry import REGISTRY, Severity, Threshold

COMMITTED = Path(__file__).resolve().parents[1] / "alerts" / RULES_FILE
ALERTS = {alert.name: alert for group in GROUPS for alert in group.alerts}
THRESHOLDS = [(code, name) for code, rule in sorted(REGISTRY.items()) for name in rule.thresholds]
#: A PromQL number literal standing alone (not part of a name, a duration such as 10m, or a label value).
NUMBER = re.compile(r"(?<![\w.\"])\d+(?:\.\d+)?(?:e-?\d+)?(?![\w.\"])")


def _rules(text: str) -> dict[str, dict[str, Any]]:
    """{alert or record name: its rule} of a rule file's text."""
    return {rule.get("alert") or rule["record"]: rule
            for group in yaml.safe_load(text)["groups"] for rule in group["rules"]}


@contextlib.contextmanager
def _perturbed(code: str, name: str) -> Iterator[None]:
    """The registry with ``code``'s threshold ``name`` changed (doubled; 1 where it is 0)."""
    with pytest.MonkeyPatch.context() as patch:
        rule = REGISTRY[code]
        old = rule.thresholds[name]
        patch.setitem(REGISTRY, code, dataclasses.replace(
            rule, thresholds={**rule.thresholds, name: Threshold(old.value * 2 or 1, old.source)}))
        yield


@pytest.fixture(scope="module")
def perturbed() -> dict[tuple[str, str], dict[str, dict[str, Any]]]:
    """{(rule code, threshold name): the generated file's rules with that threshold changed}."""
    found = {}
    for code, name in THRESHOLDS:
        with _perturbed(code, name):
            found[(code, name)] = _rules(render())
    return found


@pytest.fixture(scope="module")
def changed_by(perturbed) -> dict[tuple[str, str], set[str]]:
    """{(rule code, threshold name): names of the rules of the generated file that change with it}."""
    baseline = _rules(render())
    assert all(rules.keys() == baseline.keys() for rules in perturbed.values())
    return {pair: {name for name in baseline if rules[name] != baseline[name]} for pair, rules in perturbed.items()}


def _reads(alert: Alert) -> set[str]:
    """The thresholds of its rule that ``alert``'s templates name (as ``${name}`` or ``${name_percent}``)."""
    placeholders = set(re.findall(r"\$\{(\w+)\}", alert.expr + alert.description + alert.comment))
    thresholds = REGISTRY[alert.mirrors].thresholds if alert.mirrors else {}
    return {name for name in thresholds if {name, f"{name}_percent"} & placeholders}


def test_committed_file_is_the_generated_one():
    assert COMMITTED.read_text(encoding="utf-8") == render(), "run `gpuwatch alerts generate` and commit the file"


def test_a_threshold_changes_exactly_the_alerts_reading_it(changed_by):
    expected = {(code, name): {alert.name for alert in ALERTS.values()
                               if alert.mirrors == code and name in _reads(alert)}
                for code, name in THRESHOLDS}
    assert changed_by == expected
    # The search finds pairs at all: the straggler alert follows both of PERF002's bounds it compares with.
    assert "TrainingStraggler" in changed_by[("PERF002", "straggler_ratio")]
    assert "TrainingStraggler" in changed_by[("PERF002", "min_step_share")]


def test_no_alert_copies_a_threshold_of_its_rule_as_a_literal(perturbed):
    """With a threshold changed, its old value is gone from the expressions of the alerts of its rule: where it stays,
    the alert wrote the number out instead of reading it."""
    copies = {}
    for (code, name), rules in perturbed.items():
        old = REGISTRY[code].thresholds[name].value
        for alert in ALERTS.values():
            if alert.mirrors == code and old in {float(n) for n in NUMBER.findall(rules[alert.name]["expr"])}:
                copies[alert.name] = f"{code} {name} = {old:g}"
    assert copies == {}, "use ${name} in the template, not the number"


def test_literal_search_sees_a_copied_threshold():
    """The check above finds a copied number: the straggler ratio written out stands in the expression."""
    literals = {float(n) for n in NUMBER.findall('x{a="1.25"} / y[10m] > 1.25 and z2 > 0.5')}
    assert literals == {1.25, 0.5}


def test_unknown_placeholder_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"TrainingStraggler: no value for \$\{straggler_ration\}"):
        fill("x > ${straggler_ration}", {"straggler_ratio": "1.25"}, "TrainingStraggler")


def test_every_family_placeholder_is_selected_and_none_is_shadowed():
    """METRIC_FAMILIES holds the families the alerts select, no more; an alert's own value named as one of them would
    change what its expression selects, and is an error."""
    used = {name for alert in ALERTS.values()
            for name in re.findall(r"\$\{(\w+)\}", alert.expr + alert.description + alert.comment)}
    assert METRIC_FAMILIES.keys() - used == set()
    assert template_values(ALERTS["GpuLost"])["GPU_LOST"] == str(METRIC_FAMILIES["GPU_LOST"])
    with pytest.raises(ValueError, match="GpuLost: GPU_LOST names both a value and a family"):
        template_values(dataclasses.replace(ALERTS["GpuLost"], values={"GPU_LOST": "up"}))


def test_severity_is_the_rule_s_unless_overridden_with_a_reason():
    plain = Alert("X", "PERF002", "x > 1", summary="s", description="d")
    assert severity(plain) is REGISTRY["PERF002"].severity
    with pytest.raises(ValueError, match="severity_reason"):
        severity(dataclasses.replace(plain, severity=Severity.CRITICAL))
    with pytest.raises(ValueError, match="its own severity"):
        severity(dataclasses.replace(plain, mirrors=None))


def test_generate_writes_the_committed_file(tmp_path):
    result = CliRunner().invoke(main, ["alerts", "generate", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / RULES_FILE).read_text(encoding="utf-8") == COMMITTED.read_text(encoding="utf-8")


def test_check_passes_on_the_committed_file():
    result = CliRunner().invoke(main, ["alerts", "generate", "--check", str(COMMITTED.parent)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("edit", [lambda text: text.replace("> 1.25", "> 1.5"), None],
                         ids=["hand-edited", "missing"])
def test_check_fails_in_one_line_on_a_stale_or_missing_file(tmp_path, edit):
    if edit is not None:
        edited = edit(COMMITTED.read_text(encoding="utf-8"))
        assert edited != COMMITTED.read_text(encoding="utf-8")
        (tmp_path / RULES_FILE).write_text(edited, encoding="utf-8")
    result = CliRunner().invoke(main, ["alerts", "generate", "--check", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and "gpuwatch alerts generate" in result.output
