"""The Prometheus rules in alerts/: promtool accepts them, their unit tests pass (and can fail), every alert
is complete (severity, summary, a description with the live value, a runbook section naming a diagnose rule),
and ``gpuwatch alerts export`` hands them out."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from gpuwatch.alerts import RULES_FILE, RUNBOOK_PREFIX
from gpuwatch.alerts.generate import render
from gpuwatch.cli.main import main
from gpuwatch.diagnosis.engine import catalogue
from gpuwatch.diagnosis.registry import REGISTRY, Threshold

from conftest import require_tool

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "alerts" / RULES_FILE
UNIT_TESTS = sorted((ROOT / "alerts" / "tests").glob("*.test.yml"))
RUNBOOK = ROOT / "docs" / "runbook.md"


def _alerts() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def _runbook_sections() -> dict[str, str]:
    """{GitHub-style anchor: section text} of the runbook's level-2 headings."""
    sections = re.split(r"^## ", RUNBOOK.read_text(), flags=re.MULTILINE)[1:]
    return {re.sub(r"[^a-z0-9 -]", "", s.split("\n", 1)[0].strip().lower()).replace(" ", "-"): s for s in sections}


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([require_tool("promtool"), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.integration
def test_promtool_accepts_the_rules():
    result = _promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    groups = yaml.safe_load(RULES.read_text())["groups"]
    records = [rule for group in groups for rule in group["rules"] if "record" in rule]
    assert f"SUCCESS: {len(_alerts()) + len(records)} rules found" in result.stdout


@pytest.mark.integration
def test_promtool_unit_tests_pass():
    result = _promtool("test", "rules", *map(str, UNIT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(UNIT_TESTS)


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    firing, quiet = set(), set()
    for path in UNIT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {alert["alert"] for alert in _alerts()}
    assert names - firing == set(), "alerts never shown to fire"
    assert names - quiet == set(), "alerts never shown to stay quiet"


@pytest.mark.integration
def test_unit_tests_fail_when_a_threshold_changes(tmp_path, monkeypatch):
    """The unit tests pin the thresholds: the file generated with PERF002's straggler ratio doubled fails them."""
    rule = REGISTRY["PERF002"]
    ratio = rule.thresholds["straggler_ratio"]
    monkeypatch.setitem(REGISTRY, "PERF002", dataclasses.replace(
        rule, thresholds={**rule.thresholds, "straggler_ratio": Threshold(ratio.value * 2, ratio.source)}))
    (tmp_path / RULES_FILE).write_text(render())
    (tmp_path / "tests").mkdir()
    for path in UNIT_TESTS:
        (tmp_path / "tests" / path.name).write_text(path.read_text())
    result = _promtool("test", "rules", *(str(tmp_path / "tests" / p.name) for p in UNIT_TESTS))
    assert result.returncode != 0
    assert "TrainingStraggler" in result.stdout + result.stderr


@pytest.mark.parametrize("alert", _alerts(), ids=lambda alert: alert["alert"])
def test_alert_is_complete(alert):
    assert alert["labels"]["severity"] in {"critical", "warning"}
    annotations = alert["annotations"]
    assert set(annotations) == {"summary", "description", "runbook_url"}
    assert "$value" in annotations["description"], "the description shows the live value"
    assert "$labels" in annotations["summary"], "the summary says where"
    assert annotations["runbook_url"].startswith(RUNBOOK_PREFIX)
    anchor = annotations["runbook_url"].removeprefix(RUNBOOK_PREFIX)
    sections = _runbook_sections()
    assert anchor in sections, f"docs/runbook.md has no section for #{anchor}"
    assert sections[anchor].startswith(alert["alert"])


def test_runbook_sections_name_existing_diagnose_rules():
    known = {rule.code for rule in catalogue()}
    sections = _runbook_sections()
    for alert in _alerts():
        text = sections[alert["annotations"]["runbook_url"].removeprefix(RUNBOOK_PREFIX)]
        codes = set(re.findall(r"\*\*([A-Z]+[0-9]{3})\*\*", text))
        if alert["alert"] == "GpuwatchAgentDown":  # the agent is the data source: no rule can see it down
            assert "Diagnose rule: none" in text
            continue
        if alert["alert"] == "GpuwatchCollectorDown":
            codes = set(re.findall(r"HW00[1-5]", text))
        assert codes, f"{alert['alert']}: its runbook section names no gpuwatch diagnose rule"
        assert codes <= known, f"{alert['alert']}: unknown rule codes {codes - known}"


@pytest.mark.integration
def test_export_writes_loadable_rules_with_absolute_runbook_links(tmp_path):
    base = "https://docs.example.org/gpuwatch/runbook.html"
    result = CliRunner().invoke(main, ["alerts", "export", str(tmp_path / "rules"), "--runbook-base", base])
    assert result.exit_code == 0, result.output
    exported = tmp_path / "rules" / RULES_FILE
    assert result.output.strip() == str(exported)
    urls = [a["annotations"]["runbook_url"] for g in yaml.safe_load(exported.read_text())["groups"]
            for a in g["rules"] if "alert" in a]
    assert urls and all(url.startswith(base + "#") for url in urls)
    assert _promtool("check", "rules", str(exported)).returncode == 0


def test_export_without_base_ships_the_rules_unchanged(tmp_path):
    result = CliRunner().invoke(main, ["alerts", "export", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / RULES_FILE).read_text() == RULES.read_text()


def test_the_outlier_fetch_records_what_the_rule_file_records():
    """The outlier fetch uses the shipped recording rules when the engine has them and their expressions when it
    has not: the two must be the same text, or the fetch would judge differently with and without the rules."""
    from gpuwatch.diagnosis.sources.outliers import RECORDED

    document = yaml.safe_load((Path(__file__).parent.parent / "alerts" / "gpuwatch.rules.yml").read_text())
    recorded = {rule["record"]: " ".join(rule["expr"].split())
                for group in document["groups"] for rule in group["rules"] if "record" in rule}
    assert {name: " ".join(expr.split()) for name, expr in RECORDED.items()} == \
        {name: recorded.get(name) for name in RECORDED}
