"""The facts of the sources a diagnosis reads, merged: one library function that ``gpuwatch diagnose`` and
``gpuwatch report`` both call (the local node, node agents, a Prometheus server, a run log)."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from pathlib import Path

from gpuwatch.agent.server import DEFAULT_PORT
from gpuwatch.diagnosis import engine
from gpuwatch.diagnosis.facts import Facts
from gpuwatch.diagnosis.sources import SourceError, agent, local, prometheus, run_log
from gpuwatch.diagnosis.sources.httpconfig import HttpConfig

#: Where ``gpuwatch diagnose`` without a source looks for the node's agent (ranks' environment and telemetry).
DEFAULT_AGENT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
DEFAULT_AGENT_TIMEOUT = 1.0


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
