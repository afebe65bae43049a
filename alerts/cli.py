"""``gpuwatch alerts``: hands the shipped Prometheus rules to users who installed the package."""

from __future__ import annotations

from pathlib import Path

import click

from gpuwatch.alerts import export


@click.group()
def alerts() -> None:
    """Prometheus alerting and recording rules."""


@alerts.command("export")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--runbook-base", metavar="URL",
              help="Where docs/runbook.md is served (e.g. https://git.example.com/org/gpuwatch/blob/main/"
                   "docs/runbook.md); the alerts' runbook_url links are rewritten to it.")
def export_command(directory: Path, runbook_base: str | None) -> None:
    """Write gpuwatch.rules.yml into DIRECTORY, for Prometheus's rule_files."""
    click.echo(export(directory, runbook_base))
