"""Helpers several rule families share: environment scopes, job placement, evidence lists that stay short."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence

from gpuwatch.agent.diagnosis.facts import Facts, RankFacts, Where, group_by, rank_list
from gpuwatch.agent.diagnosis.registry import Evidence

#: Evidence lines per finding; the rest are summarised, so a 1,024-node cluster gets a readable report.
MAX_EVIDENCE = 10


@dataclasses.dataclass
class EnvScope:
    """One environment and who runs with it: the pre-flight shell of a node, or ranks of a job on a node."""

    node: str | None
    env: dict[str, str]
    job: str | None = None
    ranks: list[RankFacts] = dataclasses.field(default_factory=list)

    @property
    def where(self) -> Where:
        single = self.ranks[0].rank if len(self.ranks) == 1 else None
        return Where(node=self.node, job=self.job, rank=single)

    def __str__(self) -> str:
        if not self.ranks:
            return f"the pre-flight shell on {self.node}"
        return f"{describe_ranks(self.ranks)} of job {self.job} on {self.node or 'an unknown node'}"


def env_scopes(facts: Facts) -> list[EnvScope]:
    """Shell environments (``--preflight``), then ranks grouped by job, node and identical environment."""
    scopes = [EnvScope(node.name, node.env) for node in facts.nodes.values() if node.env is not None]
    with_env = [rank for rank in facts.ranks if rank.env is not None]
    for (job, node, _), ranks in group_by(with_env, lambda r: (r.job, r.host, tuple(sorted(r.env.items())))):
        scopes.append(EnvScope(node, ranks[0].env, job, ranks))
    return scopes


def env_flag(env: dict[str, str], name: str) -> bool:
    """NCCL reads its switches as integers: set and non-zero means on."""
    try:
        return int(env.get(name, "0").strip() or "0") != 0
    except ValueError:
        return False


def job_spans_nodes(facts: Facts, job: str | None) -> bool:
    """Whether a job runs on more than one node; True when that cannot be ruled out (some ranks unseen)."""
    ranks = facts.jobs().get(job, []) if job is not None else []
    if not ranks or any(rank.host is None for rank in ranks):
        return True
    world = max((rank.layout.world_size for rank in ranks if rank.layout is not None), default=None)
    return len({rank.host for rank in ranks}) > 1 or world is None or len(ranks) < world


def cpu_sharing(facts: Facts, ranks: Iterable[RankFacts]) -> list[Evidence]:
    """One line for each node where more of ``ranks`` (a job's) compute on the CPU than it has CPUs. There a
    rank that waits for a CPU looks slow or idle, so its timings measure the node's CPU shortage as much as
    the rank. Ranks with a GPU compute there; other jobs' ranks are not counted (a source may still list
    ranks that have ended); nodes whose CPUs are unknown are not judged."""
    placed = [rank for rank in ranks if rank.host is not None and rank.gpu_uuid is None and rank.gpu_index is None]
    on_node = collections.Counter(rank.host for rank in placed)
    evidence = []
    for host in sorted(on_node):
        node = facts.nodes.get(host)
        if node is not None and node.cpus and on_node[host] > node.cpus:
            evidence.append(Evidence(f"node {host} runs {on_node[host]} CPU ranks on {node.cpus} CPUs: their "
                                     "timings include waiting for a CPU", Where(node=host, job=placed[0].job),
                                     {"ranks": on_node[host], "cpus": node.cpus}))
    return evidence


def capped(evidence: Sequence[Evidence], total: int | None = None, what: str = "more") -> tuple[Evidence, ...]:
    """The first ``MAX_EVIDENCE`` items (callers put the worst first) and a line counting the rest."""
    total = len(evidence) if total is None else total
    kept = tuple(evidence[:MAX_EVIDENCE])
    if total > len(kept):
        kept += (Evidence(f"... and {total - len(kept)} {what}"),)
    return kept


def ratio_text(value: float) -> str:
    return f"{value:.0%}"


def describe_ranks(ranks: Iterable[RankFacts]) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0].rank}" if len(ranks) == 1 else f"ranks {rank_list(r.rank for r in ranks)}"
