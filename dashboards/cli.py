"""``gpuwatch dashboards``: hands the shipped Grafana dashboards to users who installed the package."""

from __future__ import annotations

from pathlib import Path

import click

from gpuwatch.dashboards import export


@click.group()
def dashboards() -> None:
    """Grafana dashboards (Cluster overview, Node, Interconnect, Training health)."""


@dashboards.command("export")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def export_command(directory: Path) -> None:
    """Write the dashboards' JSON into DIRECTORY (import them in Grafana, or point file provisioning at it)."""
    for path in export(directory):
        click.echo(path)
