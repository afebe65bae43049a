"""Helpers several rule families share: environment scopes, job placement, evidence lists that stay short."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from gpuwatch.agent.telemetry.window import MIN_WINDOW_STEPS
from gpuwatch.diagnosis.facts import Facts, RankFacts, Where, describe_ranks, group_by, may_use_nccl, rank_list
from gpuwatch.diagnosis.registry import Evidence

#: Evidence lines per finding; the rest are summarised, so a 1,024-node cluster gets a readable report.
MAX_EVIDENCE = 10


@dataclasses.dataclass
class EnvScope:
    """One environment and who runs with it: the pre-flight shell of a node, or the ranks of a job that share it
    (on one node or several: a job and a cause make one finding, never one per rank)."""

    env: dict[str, str]
    node: str | None = None  # the node of a pre-flight shell
    job: str | None = None
    ranks: list[RankFacts] = dataclasses.field(default_factory=list)

    @property
    def nodes(self) -> list[str]:
        """The nodes this environment runs on, as the node facts name them."""
        if self.node is not None:
            return [self.node]
        return sorted({rank.host for rank in self.ranks if rank.host is not None})

    @property
    def where(self) -> Where:
        single = self.ranks[0].rank if len(self.ranks) == 1 else None
        nodes = self.nodes
        return Where(node=nodes[0] if len(nodes) == 1 else None, job=self.job, rank=single)

    def __str__(self) -> str:
        if not self.ranks:
            return f"the pre-flight shell on {self.node}"
        return f"{describe_ranks(self.ranks)} of job {self.job} on {', '.join(self.nodes) or 'an unknown node'}"


def env_scopes(facts: Facts, *, across_nodes: bool = False) -> list[EnvScope]:
    """Shell environments (``--preflight``, judged whatever the job: before launch nothing is known of it), then
    the ranks of each job that may use NCCL grouped by identical environment; with ``across_nodes``, only jobs
    that span nodes (NCCL uses InfiniBand, RoCE and the socket interface only between nodes)."""
    scopes = [EnvScope(node.env, node=node.name) for node in facts.nodes.values() if node.env is not None]
    for job, ranks in facts.jobs().items():
        if not may_use_nccl(ranks) or (across_nodes and not facts.spans_nodes(job)):
            continue
        with_env = [rank for rank in ranks if rank.env is not None]
        for _, same in group_by(with_env, lambda r: tuple(sorted(r.env.items()))):
            scopes.append(EnvScope(same[0].env, job=job, ranks=same))
    return scopes


def cpu_sharing(facts: Facts, ranks: Iterable[RankFacts]) -> list[Evidence]:
    """One line for each node where more of ``ranks`` (a job's) compute on the CPU than it has CPUs. There a
    rank that waits for a CPU looks slow or idle, so its timings measure the node's CPU shortage as much as
    the rank. Ranks with a GPU compute there; other jobs' ranks are not counted (a source may still list
    ranks that have ended). A node's CPUs come from its node facts (the agent), else from the ranks' hellos (the
    CPUs each rank's process may run on: a run log knows no node); a node whose CPUs are unknown is not judged."""
    placed = [rank for rank in ranks if rank.host is not None and rank.gpu_uuid is None and rank.gpu_index is None]
    evidence = []
    for host, on_node in group_by(sorted(placed, key=lambda r: r.host or ""), lambda r: r.host):
        node = facts.nodes.get(host)
        cpus = node.cpus if node is not None and node.cpus else max((r.cpus for r in on_node if r.cpus), default=None)
        if cpus and len(on_node) > cpus:
            evidence.append(Evidence(f"node {host} runs {len(on_node)} CPU ranks on {cpus} CPUs: their "
                                     "timings include waiting for a CPU", Where(node=host, job=placed[0].job),
                                     {"ranks": len(on_node), "cpus": cpus}))
    return evidence


def capped(evidence: Sequence[Evidence], total: int | None = None, what: str = "more") -> tuple[Evidence, ...]:
    """The first ``MAX_EVIDENCE`` items (callers put the worst first) and a line counting the rest."""
    total = len(evidence) if total is None else total
    kept = tuple(evidence[:MAX_EVIDENCE])
    if total > len(kept):
        kept += (Evidence(f"... and {total - len(kept)} {what}"),)
    return kept


def ratio_text(value: float) -> str:
    """A share in whole percent, below 1 % in two significant digits: a link at 0.49 % of its rating is not "0%"."""
    return f"{value:.0%}" if abs(value) >= 0.01 else f"{value * 100:.2g}%"


def windowed(rank: RankFacts, timing: str) -> float | None:
    """The median of ``timing`` (``window.TIMINGS``) over the rank's window of recent steps, once the window holds
    enough steps to judge (``MIN_WINDOW_STEPS``); None before, or when the rank does not report it."""
    window = rank.window
    if window is None or window.steps < MIN_WINDOW_STEPS:
        return None
    return window.median(timing)


def window_text(rank: RankFacts) -> str:
    """The window a figure was judged over, for evidence: ``median of 12 steps (41-52, 3.1 s)``."""
    return f"median of {rank.window.describe()}" if rank.window is not None else "latest step"


def world_size(ranks: Iterable[RankFacts]) -> int | None:
    """A job's world size, as its ranks' hellos give it; None where no hello says."""
    return max((r.layout.world_size for r in ranks if r.layout is not None), default=None)


def partial_view(job: str, ranks: Sequence[RankFacts]) -> Evidence | None:
    """Where a source sees fewer of a job's ranks than its world size (an agent on one node of several): which ranks
    a comparison among them was made over, and how to see them all; None where every rank is seen."""
    world = world_size(ranks)
    seen = sorted({r.rank for r in ranks})
    if world is None or len(seen) >= world:
        return None
    missing = sorted(set(range(world)) - set(seen))
    return Evidence(
        f"judged among the {len(seen)} of the job's {world} ranks this source sees ({rank_list(seen)}); ranks "
        f"{rank_list(missing)} are not reporting here: `gpuwatch diagnose --agent URL` for every node of the job, "
        "or `--prometheus URL`, compares them all", Where(job=job),
        {"ranks_seen": len(seen), "world_size": world, "missing_ranks": missing})
