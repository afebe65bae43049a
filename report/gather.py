"""Gather: the facts ``gpuwatch diagnose`` reads (its own sources, through ``diagnosis.sources.gather``: a run log, the
agents, a PromQL engine) and the findings its engine judges on them, for one job. The report reads; it never judges:
every finding on the page is one the engine made, on the same facts as ``gpuwatch diagnose`` would."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuwatch.diagnosis import engine
from gpuwatch.diagnosis.facts import RankFacts
from gpuwatch.diagnosis.sources import HTTP_TIMEOUT, SourceError
from gpuwatch.diagnosis.sources.gather import PromQLAccess, gather
from gpuwatch.diagnosis.sources.httpconfig import HttpConfig
from gpuwatch.report.model import ReportModel, build

#: ``gpuwatch plan --format json``'s schema (docs/plan.md) the ``--plan`` overlay reads.
PLAN_SCHEMA = "gpuwatch.plan/1"


class ReportError(Exception):
    """Input the report cannot be made from; the message is the one line the command prints."""


def read_plan(path: Path) -> dict[str, Any]:
    try:
        plan = json.loads(path.read_text())
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ReportError(f"{path} is not JSON: {exc}") from None
    if not isinstance(plan, dict) or plan.get("schema") != PLAN_SCHEMA or not isinstance(plan.get("feasible"), list):
        raise ReportError(f"{path} is not `gpuwatch plan --format json` output (schema {PLAN_SCHEMA})")
    return plan


def choose_job(jobs: list[str], job: str | None) -> str:
    """The job asked for, or the only one; an unknown job, none, or several without ``--job`` is an error."""
    if not jobs:
        raise ReportError("the source holds no training rank (no hello or step record)")
    if job is not None:
        if job not in jobs:
            raise ReportError(f"unknown job {job!r}; the source holds: {', '.join(jobs)}")
        return job
    if len(jobs) > 1:
        raise ReportError(f"the source holds {len(jobs)} jobs ({', '.join(jobs)}): choose one with --job")
    return jobs[0]


@dataclasses.dataclass(frozen=True)
class Gathered:
    """The engine's report on the sources' facts, and the job the page is about."""

    report: engine.Report
    job: str

    @property
    def ranks(self) -> list[RankFacts]:
        return self.report.facts.jobs()[self.job]

    def model(self, plan: Mapping[str, Any] | None = None) -> ReportModel:
        sources = [f"{source.kind} {source.location}" for source in self.report.facts.sources]
        return build(self.report, self.job, plan, time.time(), sources)


def collect(run_log: Path | None, agents: tuple[str, ...], prometheus: str | None, job: str | None) -> Gathered:
    """The facts of the sources given (at least one), judged, and the job chosen."""
    if run_log is None and not agents and prometheus is None:
        raise ReportError("give a source: --run-log DIR, --agent URL or --prometheus URL")
    access = PromQLAccess(HttpConfig(), HTTP_TIMEOUT, "full", {})  # the page shows every rank: a full pull
    try:
        facts = gather(agents, run_log, prometheus, False, Path("/sys"), access)
    except SourceError as exc:
        raise ReportError(str(exc)) from None
    return Gathered(engine.run(facts), choose_job(list(facts.jobs()), job))
