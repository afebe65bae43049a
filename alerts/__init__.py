"""Prometheus alerting and recording rules of gpuwatch (``gpuwatch.rules.yml``), with their promtool unit tests
in ``tests/`` (repository only) and a runbook section per alert in docs/runbook.md.

The file is generated (``rules.py`` declares the alerts from the diagnose rules' thresholds, ``generate.py`` renders
them: ``gpuwatch alerts generate``) and shipped as generated, so exporting it needs nothing but the package."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

RULES_FILE = "gpuwatch.rules.yml"
#: How the shipped rules point at the runbook; ``export(runbook_base=URL)`` replaces it.
RUNBOOK_PREFIX = "docs/runbook.md#"


def rules_text() -> str:
    """The shipped rule file's text."""
    return (resources.files(__name__) / RULES_FILE).read_text(encoding="utf-8")


def export(directory: Path, runbook_base: str | None = None) -> Path:
    """Write the rule file into ``directory`` (created if missing). With ``runbook_base`` (where the docs are
    served, e.g. a repository's blob URL of docs/runbook.md), the runbook links become absolute URLs."""
    text = rules_text()
    if runbook_base:
        text = text.replace(f"runbook_url: {RUNBOOK_PREFIX}", f"runbook_url: {runbook_base.rstrip('#')}#")
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / RULES_FILE
    target.write_text(text, encoding="utf-8")
    return target
