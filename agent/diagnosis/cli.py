"""``gpuwatch diagnose``: findings with evidence and fixes, from the local node, an agent, a run log or a
whole cluster through Prometheus.

Exit status: 0 when nothing at the ``--fail-on`` level or worse was found, 1 when something was, 2 for
usage, config and source errors (unreachable URL, not an agent, unreadable log).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import click

from gpuwatch.agent.cli import DEFAULT_PORT
from gpuwatch.agent.diagnosis import engine, report
from gpuwatch.agent.diagnosis.facts import Facts
from gpuwatch.agent.diagnosis.registry import REGISTRY, Severity
from gpuwatch.agent.diagnosis.sources import HTTP_TIMEOUT, SourceError, agent, httpconfig, local, prometheus, run_log
from gpuwatch.agent.diagnosis.sources.httpconfig import HttpConfig
from gpuwatch.plan import calibrate

#: Where ``gpuwatch diagnose`` without a source looks for the node's agent (ranks' environment and telemetry).
DEFAULT_AGENT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
DEFAULT_AGENT_TIMEOUT = 1.0
FAIL_ON = ("critical", "warning", "info", "never")


def _codes(value: str | None) -> list[str]:
    return [code for code in (value or "").split(",") if code.strip()]


def _local_with_agent_ranks(sysfs_root: Path) -> Facts:
    """This node, plus the running ranks the local agent knows of when one answers at the default address."""
    facts = local.collect(sysfs_root)
    node = next(iter(facts.nodes))
    try:
        from_agent = agent.fetch(DEFAULT_AGENT_URL, timeout=DEFAULT_AGENT_TIMEOUT)
    except SourceError as exc:
        facts.notes.append(f"no local agent ({exc}): training ranks unknown")
        return facts
    facts.ranks = [dataclasses.replace(rank, node=node) for rank in from_agent.ranks]
    facts.sources += from_agent.sources
    return facts


@dataclasses.dataclass(frozen=True)
class PromQLAccess:
    """How ``--prometheus`` reaches its engine and fetches: the http config, the query timeout, the fetch mode,
    and the thresholds the outlier selectors compare with."""

    config: HttpConfig
    timeout: float
    fetch: str
    overrides: engine.Overrides


def gather(agent_urls: tuple[str, ...], run_log_path: Path | None, prometheus_url: str | None, preflight: bool,
            sysfs_root: Path, access: PromQLAccess) -> Facts:
    """The facts of every source given, merged (the local node when none is): also what ``gpuwatch report`` reads."""
    loaders: list[Callable[[], Facts]] = []
    if preflight:
        loaders.append(lambda: local.collect(sysfs_root, env=os.environ))
    for url in agent_urls:  # one per node: a job's ranks across the nodes, judged together
        loaders.append(functools.partial(agent.fetch, url))
    if prometheus_url:
        loaders.append(lambda: prometheus.fetch(prometheus_url, access.timeout, access.config, access.fetch,
                                                access.overrides))
    if run_log_path:
        loaders.append(lambda: run_log.read(run_log_path))
    if not loaders:
        loaders.append(lambda: _local_with_agent_ranks(sysfs_root))
    facts = Facts()
    for load in loaders:
        facts.merge(load())
    return facts


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
