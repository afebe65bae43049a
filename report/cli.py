"""``gpuwatch report``: the page of one job, and optionally its trace. Exit status 0 when written, 2 for bad input
(an unreadable or empty source, an unknown job, a plan that is not ``gpuwatch plan --format json``), in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NoReturn

import click

from gpuwatch.report.gather import ReportError, collect, read_plan
from gpuwatch.report.render import render
from gpuwatch.report.trace import trace


def _fail(message: str) -> NoReturn:
    click.echo(f"gpuwatch report: error: {message}", err=True)
    raise click.exceptions.Exit(2)


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        _fail(f"cannot write {path}: {exc.strerror or exc}")


def write_report(run_log: Path | None, agents: tuple[str, ...], prometheus: str | None, job: str | None,
                 output: Path, plan_path: Path | None = None, trace_path: Path | None = None) -> None:
    """Gather, build, render and write; ``ReportError`` for input the page cannot be made from. The demo calls it."""
    plan = read_plan(plan_path) if plan_path else None
    gathered = collect(run_log, agents, prometheus, job)
    _write(output, render(gathered.model(plan)))
    if trace_path is not None:
        _write(trace_path, json.dumps(trace(gathered.ranks), separators=(",", ":")))


@click.command()
@click.option("--run-log", "run_log", type=click.Path(path_type=Path), metavar="DIR",
              help="A run log (gpuwatch train --run-log DIR, or one JSONL file): every step of every rank.")
@click.option("--agent", "agents", metavar="URL", multiple=True,
              help="A node agent's /api/v1/state (its ranks' latest windows); repeat it for every node of the job.")
@click.option("--prometheus", metavar="URL", help="A PromQL engine scraping the agents (the ranks' latest windows).")
@click.option("--job", metavar="ID", help="The job to show, where the source holds several.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=Path("report.html"),
              show_default=True, help="The HTML page to write (self-contained: no network needed to open it).")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="`gpuwatch plan --format json` output: its prediction for the job's layout is overlaid.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Also write the per-rank phases and collectives as a Chrome/Perfetto trace (Trace Event Format).")
def report(run_log: Path | None, agents: tuple[str, ...], prometheus: str | None, job: str | None, output: Path,
           plan_path: Path | None, trace_path: Path | None) -> None:
    """Write one HTML page of a job: findings first, then every rank's steps, phases, bubble and collectives."""
    try:
        write_report(run_log, agents, prometheus, job, output, plan_path, trace_path)
    except ReportError as exc:
        _fail(str(exc))
    click.echo(str(output))
    if trace_path is not None:
        click.echo(str(trace_path))
