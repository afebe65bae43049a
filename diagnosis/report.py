"""Report output: text grouped by severity for people (styled; click strips the styles off a non-TTY), and
JSON with a stable schema for automation (docs/diagnose-report.schema.json, ``REPORT_SCHEMA_VERSION``)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import click

from gpuwatch.agent import __version__
from gpuwatch.agent.snapshot import json_safe
from gpuwatch.diagnosis.engine import Report
from gpuwatch.diagnosis.facts import group_by
from gpuwatch.diagnosis.registry import Finding, Rule, Severity

#: Bumped only for incompatible changes of the JSON report; new fields may appear without a bump.
REPORT_SCHEMA_VERSION = 1

_COLOURS = {Severity.CRITICAL: "red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}


def counts(report: Report) -> dict[str, int]:
    totals = {severity.label: 0 for severity in sorted(Severity, reverse=True)}
    for finding in report.findings:
        totals[finding.severity.label] += 1
    return totals


def to_json(report: Report) -> dict[str, Any]:
    """The report as the JSON schema describes it (non-finite numbers as "NaN"/"+Inf"/"-Inf" strings)."""
    facts = report.facts
    return json_safe({
        "schema_version": REPORT_SCHEMA_VERSION,
        "gpuwatch_version": __version__,
        "generated_at": time.time(),
        "sources": [{key: value for key, value in dataclasses.asdict(source).items() if value is not None}
                    for source in facts.sources],
        "summary": {**counts(report), "rules_run": len(report.ran), "rules_not_run": len(report.skipped),
                    "nodes": len(facts.nodes), "ranks": len(facts.ranks)},
        "findings": [_finding_json(finding) for finding in report.findings],
        "not_run": [{"code": skipped.code, "reason": skipped.reason, "cause": skipped.cause}
                    for skipped in report.skipped],
        "notes": report.notes,
    })


def _finding_json(finding: Finding) -> dict[str, Any]:
    return {
        "code": finding.code,
        "family": finding.family,
        "severity": finding.severity.label,
        "title": finding.title,
        "evidence": [{"text": e.text, "where": e.where.as_dict(), "values": dict(e.values)} for e in finding.evidence],
        "fix": finding.fix,
        "reason": finding.reason,
    }


def render_text(report: Report) -> str:
    """Findings grouped by severity, worst first; then the rules that did not run and the sources' notes."""
    facts = report.facts
    totals = counts(report)
    sources = ", ".join(f"{source.kind} {source.location}" for source in facts.sources) or "none"
    summary = ", ".join(click.style(f"{count} {label}", fg=_COLOURS[Severity[label.upper()]], bold=count > 0)
                        for label, count in totals.items())
    known = sum(source.nodes or 0 for source in facts.sources if source.fetch == "outliers")
    aggregated = f" in detail, {known} through the engine's aggregates" if known else ""
    lines = [f"gpuwatch diagnose: {summary}",
             f"  {len(facts.nodes)} node(s), {len(facts.ranks)} rank(s){aggregated} from {sources}; "
             f"{len(report.ran)} rule(s) run, {len(report.skipped)} not run", ""]
    for severity in sorted(Severity, reverse=True):
        findings = [finding for finding in report.findings if finding.severity is severity]
        if not findings:
            continue
        lines.append(click.style(severity.name, fg=_COLOURS[severity], bold=True))
        for finding in findings:
            lines.append(f"  {click.style(finding.code, fg=_COLOURS[severity], bold=True)}  {finding.title}")
            lines += [f"      evidence  {evidence.text}" for evidence in finding.evidence]
            lines.append(f"      fix       {click.style(finding.fix, bold=True)}")
            lines.append(f"      why       {finding.reason}")
            lines.append("")
    if not report.findings:
        lines += ["No findings.", ""]
    if report.skipped:
        lines.append(click.style(f"Not run ({len(report.skipped)}):", dim=True))
        for (reason, cause), skipped in group_by(report.skipped, lambda s: (s.reason, s.cause)):
            marker = "the source could not answer: " if cause == "source" else ""
            lines.append(f"  {', '.join(s.code for s in skipped)}: {marker}{reason}")
        lines.append("")
    if report.notes:
        lines.append("Notes:")
        lines += [f"  {note}" for note in report.notes]
    return "\n".join(lines).rstrip() + "\n"


def render_rules(rules: list[Rule]) -> str:
    """``--list-rules``: the catalogue, one rule a line."""
    lines = [f"{'code':<8} {'severity':<9} {'family':<15} title"]
    lines += [f"{rule.code:<8} {rule.severity.label:<9} {rule.family:<15} {rule.title}" for rule in rules]
    return "\n".join(lines) + "\n"


def render_explanation(rule: Rule) -> str:
    """``--explain CODE``: reasoning, thresholds with their source, and what the rule needs."""
    lines = [f"{rule.code}: {rule.title}", f"family: {rule.family}    severity: {rule.severity.label}", "",
             rule.explanation, ""]
    if rule.thresholds:
        lines.append("Thresholds (override in --config under thresholds: {" + rule.code + ": {name: value}}):")
        lines += [f"  {name} = {threshold.value:g}  — {threshold.source}"
                  for name, threshold in rule.thresholds.items()]
        lines.append("")
    if rule.needs:
        lines.append("Needs: " + ", ".join(need.name for need in rule.needs))
    return "\n".join(lines).rstrip() + "\n"
