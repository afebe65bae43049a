"""The rule registry and engine: stable unique codes, the whole catalogue, linter-style selection, config
overrides, rules that cannot run or fail."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner
from diagnose_facts import facts, rank, step

from gpuwatch.cli.main import main
from gpuwatch.diagnosis import cli as diagnose_cli
from gpuwatch.diagnosis import engine
from gpuwatch.diagnosis.facts import Facts
from gpuwatch.diagnosis.registry import REGISTRY, Issue, Severity, rule

#: The codes are a contract (dashboards, alerts, --select in users' scripts); so are families.
CATALOGUE = {
    "NCCL001": ("network config", "critical"), "NCCL002": ("network config", "warning"),
    "NCCL003": ("network config", "critical"), "NCCL004": ("network config", "warning"),
    "NCCL005": ("network config", "warning"),
    "HW001": ("hardware", "warning"), "HW002": ("hardware", "warning"), "HW003": ("hardware", "critical"),
    "HW004": ("hardware", "critical"), "HW005": ("hardware", "warning"),
    "PERF001": ("performance", "warning"), "PERF002": ("performance", "warning"),
    "PERF003": ("performance", "warning"), "PERF004": ("performance", "warning"),
    "PERF005": ("performance", "warning"), "PERF006": ("performance", "warning"),
    "MEM001": ("memory", "warning"), "MEM002": ("memory", "warning"), "MEM003": ("memory", "warning"),
    "CONV001": ("convergence", "critical"), "CONV002": ("convergence", "warning"),
    "CONV003": ("convergence", "critical"), "CONV004": ("convergence", "warning"),
    "CONV005": ("convergence", "info"), "CONV006": ("convergence", "critical"),
    "TOPO001": ("topology", "critical"), "TOPO002": ("topology", "warning"),
    "HANG001": ("hangs", "critical"), "HANG002": ("hangs", "critical"), "HANG003": ("hangs", "critical"),
    "HANG004": ("hangs", "critical"), "HANG005": ("hangs", "warning"), "HANG006": ("hangs", "critical"),
    "HANG007": ("hangs", "warning"),
    "PLAN001": ("plan", "warning"), "PLAN002": ("plan", "warning"),
}


def test_catalogue_codes_families_and_severities_are_the_contract():
    assert {r.code: (r.family, r.severity.label) for r in engine.catalogue()} == CATALOGUE
    assert [r.code for r in engine.catalogue()][:6] == ["NCCL001", "NCCL002", "NCCL003", "NCCL004", "NCCL005", "HW001"]


def test_every_rule_documents_itself():
    for entry in engine.catalogue():
        assert entry.title and "\n" not in entry.title, entry.code
        assert len(entry.explanation) > 100, entry.code  # the --explain text: why, with the numbers
        assert entry.needs, f"{entry.code} declares no needs: the engine could not say why it did not run"
        for name, threshold in entry.thresholds.items():
            assert name.isidentifier() and threshold.source, (entry.code, name)


def test_a_code_registers_once():
    before = dict(REGISTRY)
    with pytest.raises(ValueError, match="PERF002 registered twice"):
        rule("PERF002", family="performance", severity=Severity.INFO, title="again")(lambda f, t: ())
    with pytest.raises(ValueError, match="docstring"):
        rule("ZZZ999", family="x", severity=Severity.INFO, title="undocumented")(lambda f, t: ())
    assert before == REGISTRY


def _codes(*prefixes: str) -> list[str]:
    """The catalogue's codes with one of ``prefixes``, in its order: the expected selections follow the contract
    above, so a rule added to it (docs/architecture.md, "Add a rule") needs no edit here."""
    return [code for code in CATALOGUE if code.startswith(prefixes)]


@pytest.mark.parametrize(("selected", "ignored", "expected"), [
    (["NCCL"], [], _codes("NCCL")),
    (["perf001", " MEM "], [], ["PERF001", *_codes("MEM")]),
    (["CONV00"], ["CONV005"], [code for code in _codes("CONV00") if code != "CONV005"]),
    (["ALL"], ["NCCL", "HW", "PERF", "MEM", "CONV", "HANG", "PLAN"], _codes("TOPO")),
    ([], ["TOPO"], [c for c in CATALOGUE if not c.startswith("TOPO")]),
    (["HW001"], ["HW"], []),
])
def test_select_and_ignore_are_prefix_matches(selected, ignored, expected):
    assert [r.code for r in engine.select(selected, ignored)] == expected


def test_unknown_selector_is_an_error():
    with pytest.raises(engine.SelectionError, match="unknown rule selector 'XYZ'"):
        engine.select(["XYZ"])
    with pytest.raises(engine.SelectionError, match="'PERF9'"):
        engine.select([], ["PERF9"])


def test_config_overrides_a_threshold(tmp_path):
    config = tmp_path / "diagnose.yaml"
    config.write_text("thresholds:\n  perf002: {straggler_ratio: 2.5}\n  PERF001:\n    max_bubble_ratio: 0.3\n")
    overrides = engine.load_config(config)
    assert overrides == {"PERF002": {"straggler_ratio": 2.5}, "PERF001": {"max_bubble_ratio": 0.3}}
    ranks = [rank(r, dp=4, last=step(compute_seconds=0.6 if r == 1 else 0.3)) for r in range(4)]
    assert [f.code for f in engine.run(facts(ranks=ranks), engine.select(["PERF002"])).findings] == ["PERF002"]
    assert engine.run(facts(ranks=ranks), engine.select(["PERF002"]), overrides).findings == []


@pytest.mark.parametrize(("text", "error"), [
    ("thresholds:\n  NOPE001: {x: 1}\n", "unknown rule 'NOPE001'"),
    ("thresholds:\n  PERF002: {ratio: 1}\n",
     "has no threshold 'ratio' (it has: straggler_ratio, min_step_share, shared_cpu_ratio)"),
    ("thresholds:\n  PERF002: {straggler_ratio: fast}\n", "must be a finite number"),
    ("thresholds:\n  PERF002: {straggler_ratio: .nan}\n", "must be a finite number"),
    ("thresholds:\n  PERF002: 3\n", "must be a mapping"),
    ("rules: {}\n", "one key, 'thresholds'"),
    ("thresholds: [unclosed\n", "not valid YAML"),
])
def test_bad_config_is_an_error(tmp_path, text, error):
    config = tmp_path / "diagnose.yaml"
    config.write_text(text)
    with pytest.raises(engine.ConfigError, match=error.replace("(", r"\(").replace(")", r"\)")):
        engine.load_config(config)


def test_missing_config_file_is_an_error(tmp_path):
    with pytest.raises(engine.ConfigError, match="cannot read"):
        engine.load_config(tmp_path / "absent.yaml")


def _broken(f: Facts, t) -> list[Issue]:
    """Fails on purpose."""
    raise KeyError("gpu")


def test_findings_sorted_by_severity_and_a_rule_that_fails_is_a_finding_of_its_severity():
    """A crashing rule has not cleared anything: its failure is a finding at the rule's own severity, with the
    exception, and the other rules' findings stand."""
    failing = dataclasses.replace(REGISTRY["CONV001"], code="CONV999", title="broken", check=_broken)
    ranks = [rank(r, dp=2, last=step(grad_norm=500.0, loss=float("nan"))) for r in range(2)]
    result = engine.run(facts(ranks=ranks), [*engine.select(["CONV002", "CONV001"]), failing])
    assert [(f.code, f.severity.label) for f in result.findings] == [
        ("CONV001", "critical"), ("CONV999", "critical"), ("CONV002", "warning")]
    assert result.ran == ["CONV001", "CONV002", "CONV999"] and result.skipped == []
    failure = result.findings[1]
    assert failure.title == "rule CONV999 failed and could not judge: KeyError: 'gpu'"
    assert failure.evidence[0].text == "CONV999 (broken) raised KeyError: 'gpu'"


def test_a_failing_critical_rule_fails_the_command(monkeypatch):
    """`--fail-on critical` must not exit 0 when a critical rule crashed instead of judging."""
    monkeypatch.setitem(REGISTRY, "CONV001", dataclasses.replace(REGISTRY["CONV001"], check=_broken))
    monkeypatch.setattr(diagnose_cli, "gather", lambda *args: facts(ranks=[rank(0)]))
    result = CliRunner().invoke(main, ["diagnose", "--select", "CONV001", "--fail-on", "critical"])
    assert result.exit_code == 1, result.output
    assert "rule CONV001 failed and could not judge: KeyError: 'gpu'" in result.output


def test_no_facts_means_every_rule_not_run_and_no_findings():
    result = engine.run(Facts())
    assert result.findings == [] and result.ran == []
    assert sorted(s.code for s in result.skipped) == sorted(CATALOGUE)


def test_what_a_ranks_instrumentation_noted_in_its_hello_is_in_the_report_once_per_job_and_note():
    note = "a device mesh over the 8 ranks with dimensions (dp_shard=2, cp=2, tp=2) is no tp × pp × dp layout"
    ranks = [rank(r, dp=2, hello_notes=(note,)) for r in (0, 1)] + [rank(0, dp=1, job="job-2")]
    report = engine.run(facts(ranks=ranks), rules=[])
    assert report.notes == [f"job job-1, ranks 0-1: {note}"]
    assert engine.run(facts(ranks=ranks), rules=[]).notes == report.notes  # judging twice adds nothing
