"""``gpuwatch alerts``: hands the shipped Prometheus rules to users who installed the package, and regenerates them
from the diagnose rules' thresholds in a checkout."""

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


@alerts.command("generate")
@click.argument("directory", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option("--check", is_flag=True,
              help="Write nothing; exit 1 when DIRECTORY's gpuwatch.rules.yml is not what would be generated.")
def generate_command(directory: Path | None, check: bool) -> None:
    """Generate gpuwatch.rules.yml into DIRECTORY (default: the package's alerts folder, alerts/ in a checkout)
    from alerts/rules.py and the thresholds of the gpuwatch diagnose rules."""
    from gpuwatch.alerts import generate  # the registry and its rules load only for this command

    target = directory or generate.PACKAGE_DIR
    if check:
        reason = generate.stale(target)
        if reason:
            raise click.ClickException(reason)
        click.echo(f"{target / generate.RULES_FILE} is up to date")
        return
    click.echo(generate.write(target))
