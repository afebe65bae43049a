"""``gpuwatch diagnose``: findings with evidence and fixes, from the local node, an agent, a run log or a
whole cluster through Prometheus.

Exit status: 0 when nothing at the ``--fail-on`` level or worse was found, 1 when something was, 2 for
usage, config and source errors (unreachable URL, not an agent, unreadable log).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NoReturn

import click

from gpuwatch.diagnosis import engine, report
from gpuwatch.diagnosis.registry import REGISTRY, Severity
from gpuwatch.diagnosis.sources import HTTP_TIMEOUT, SourceError, httpconfig, prometheus
from gpuwatch.diagnosis.sources.gather import PromQLAccess, gather
from gpuwatch.diagnosis.sources.httpconfig import HttpConfig
from gpuwatch.plan import calibrate

FAIL_ON = ("critical", "warning", "info", "never")


def _codes(value: str | None) -> list[str]:
    return [code for code in (value or "").split(",") if code.strip()]


def _fail(message: str) -> NoReturn:
    click.echo(f"gpuwatch diagnose: error: {message}", err=True)
    raise click.exceptions.Exit(2)


@click.command()
@click.option("--agent", "agent_urls", metavar="URL", multiple=True,
              help="Read a node agent's /api/v1/state (its node, and the ranks reporting to it); repeat it for the "
              "agents of every node a job runs on, so that its ranks are judged together.")
@click.option("--run-log", "run_log_path", type=click.Path(path_type=Path), metavar="PATH",
              help="Read a run log (JSONL telemetry records written by the hooks), for a post-mortem: a file, or a "
              "directory of them (gpuwatch train --run-log DIR).")
@click.option("--prometheus", "prometheus_url", metavar="URL",
              help="Judge every node and rank a Prometheus server scrapes (instant queries over its HTTP API).")
@click.option("--http.config.file", "http_config_path", type=click.Path(dir_okay=False, path_type=Path),
              metavar="FILE", help="Prometheus' HTTP client config for --prometheus (as promtool's flag of the same "
              "name): basic_auth, authorization, tls_config, http_headers (e.g. X-Scope-OrgID for Mimir).")
@click.option("--query.timeout", "query_timeout", type=click.FloatRange(min=0, min_open=True), default=HTTP_TIMEOUT,
              show_default=True, metavar="SECONDS",
              help="How long the engine may spend on one --prometheus query (sent as its timeout parameter).")
@click.option("--prometheus.fetch", "fetch_mode", type=click.Choice(prometheus.FETCH_MODES), default="auto",
              show_default=True, help="full: pull every series; outliers: aggregate in PromQL and read only deviating "
              f"nodes and one node per job; auto: full up to {prometheus.AUTO_FULL_MAX_NODES} nodes.")
@click.option("--allow-partial", is_flag=True,
              help="Do not let --fail-on count rules that could not run because the source could not answer them "
              "(a timeout, a partial answer).")
@click.option("--preflight", is_flag=True,
              help="Check the current shell's NCCL environment against this node, before launching a job.")
@click.option("--select", metavar="CODES", help="Run only rules whose code starts with one of these (comma-separated).")
@click.option("--ignore", metavar="CODES", help="Skip rules whose code starts with one of these (comma-separated).")
@click.option("--sysfs-root", type=click.Path(file_okay=False, path_type=Path), default=Path("/sys"),
              show_default=True, help="Where sysfs is mounted, for the local node (a fixture tree can stand in).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="YAML file of threshold overrides: thresholds: {PERF002: {straggler_ratio: 1.5}}.")
@click.option("--calibration", "calibration_path", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="This cluster's measured matmul FLOP/s and bus bandwidths (gpuwatch calibrate), which the PLAN "
                   "rules predict the step with instead of a GPU preset's datasheet (and on CPU ranks, which have "
                   "none).")
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="text for people, json (docs/diagnose-report.schema.json) for automation.")
@click.option("--fail-on", type=click.Choice(FAIL_ON), default="critical", show_default=True,
              help="Exit with status 1 when a finding at this severity or worse exists.")
@click.option("--list-rules", is_flag=True, help="Print the rule catalogue and exit.")
@click.option("--explain", metavar="CODE", help="Print one rule's reasoning, thresholds and needs, and exit.")
def diagnose(agent_urls: tuple[str, ...], run_log_path: Path | None, prometheus_url: str | None,
             http_config_path: Path | None, query_timeout: float, fetch_mode: str, allow_partial: bool, preflight: bool,
             select: str | None, ignore: str | None, sysfs_root: Path, config_path: Path | None,
             calibration_path: Path | None, output_format: str, fail_on: str, list_rules: bool,
             explain: str | None) -> None:
    """Find what slows, hangs or derails training, with the evidence and the fix.

    Without a source option it judges this node, with the ranks of the local agent if one answers.
    """
    if explain is not None:
        rule = REGISTRY.get(explain.strip().upper())
        if rule is None:
            _fail(f"unknown rule {explain!r}; known: {', '.join(r.code for r in engine.catalogue())}")
        click.echo(report.render_explanation(rule), nl=False)
        return
    try:
        rules = engine.select(_codes(select), _codes(ignore))
        overrides = engine.load_config(config_path) if config_path else {}
        http_config = httpconfig.load(http_config_path) if http_config_path else HttpConfig()
        calibration = calibrate.read(calibration_path) if calibration_path else None
    except (engine.SelectionError, engine.ConfigError, httpconfig.HttpConfigError, calibrate.CalibrationError) as exc:
        _fail(str(exc))
    if list_rules:
        if output_format == "json":
            click.echo(json.dumps([{"code": r.code, "family": r.family, "severity": r.severity.label,
                                    "title": r.title} for r in rules], indent=2))
        else:
            click.echo(report.render_rules(rules), nl=False)
        return
    try:
        facts = gather(agent_urls, run_log_path, prometheus_url, preflight, sysfs_root,
                        PromQLAccess(http_config, query_timeout, fetch_mode, overrides))
    except SourceError as exc:
        _fail(http_config.redact(str(exc)))
    facts.calibration = calibration
    result = engine.run(facts, rules, overrides)
    if output_format == "json":
        click.echo(json.dumps(report.to_json(result), indent=2, allow_nan=False))
    else:
        click.echo(report.render_text(result), nl=False)
    if fail_on == "never":
        return
    unanswered = [skipped.code for skipped in result.skipped if skipped.cause == "source"]
    if unanswered and not allow_partial:
        click.echo(f"gpuwatch diagnose: {len(unanswered)} rule(s) could not run because the source could not answer "
                   f"({', '.join(unanswered)}): failing, as --fail-on {fail_on} cannot pass what was not judged "
                   "(--allow-partial to accept it)", err=True)
        raise click.exceptions.Exit(1)
    if any(f.severity >= Severity[fail_on.upper()] for f in result.findings):
        raise click.exceptions.Exit(1)
