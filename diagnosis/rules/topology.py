"""Topology: how the job's process groups map onto communicators and nodes."""

from __future__ import annotations

import types
from collections.abc import Iterator

from gpuwatch.diagnosis import needs
from gpuwatch.diagnosis.coverage import WholeJob
from gpuwatch.diagnosis.facts import Facts, group_by, rank_list
from gpuwatch.diagnosis.registry import Evidence, Issue, Severity, rule
from gpuwatch.diagnosis.rules.common import capped

FAMILY = "topology"


@rule("TOPO001", family=FAMILY, severity=Severity.CRITICAL,
      title="Pipeline and data-parallel traffic share one process group", needs=(needs.PROCESS_GROUPS,),
      coverage=(WholeJob("it compares the process groups of every rank of a job"),))
def shared_pp_dp_group(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """Pipeline stages exchange activations with send/recv while data-parallel replicas all-reduce their
    gradients. On one communicator the two kinds of traffic serialise: a large all-reduce blocks the
    send/recv that another stage waits on, and the job deadlocks until the NCCL timeout (one reported case:
    a 13B model on 32 A100s, PP×DP, NCCL timeouts after 2,000 steps, fixed by creating separate groups with
    new_group for PP and DP). Judged from the members of the groups each rank reports for pipeline
    ("pp") and data-parallel ("dp") traffic: the same members, or a group wider than its dimension,
    means shared."""
    for job, ranks in facts.jobs().items():
        shared = []
        for rank in ranks:
            groups, layout = rank.process_groups, rank.layout
            if groups is None or layout is None or layout.pp_size < 2 or layout.dp_size < 2 \
                    or not {"pp", "dp"} <= groups.keys():
                continue
            pp, dp = set(groups["pp"]), set(groups["dp"])
            if pp == dp or len(pp) > layout.pp_size or len(dp) > layout.dp_size:
                shared.append(Evidence(f"rank {rank.rank}: pipeline group [{rank_list(pp)}] and data-parallel group "
                                       f"[{rank_list(dp)}] for pp={layout.pp_size}, dp={layout.dp_size}", rank.where,
                                       {"pp_group": rank_list(pp), "dp_group": rank_list(dp)}))
        if shared:
            yield Issue(
                title=f"job {job} sends pipeline activations and all-reduces gradients on one process group "
                      f"({len(shared)} rank(s))",
                evidence=capped(shared, what="ranks"),
                fix="create one group per kind of traffic: pp_group = dist.new_group(stage_peers) for send/recv and "
                    "dp_group = dist.new_group(replicas) for the gradient all-reduce (every rank creates every "
                    "group, in the same order)",
                reason="On a shared communicator a large gradient all-reduce blocks the stage-to-stage send/recv "
                       "and the job deadlocks into an NCCL timeout.",
            )


@rule("TOPO002", family=FAMILY, severity=Severity.WARNING, title="Tensor-parallel group spans nodes",
      needs=(needs.HOSTS,),
      coverage=(WholeJob("it compares the placement of every rank of a job"),))
def tp_group_spans_nodes(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """Tensor parallelism communicates inside every layer, forward and backward (Megatron-LM, Shoeybi et al.
    2019: two all-reduces forward and two backward per transformer layer, 384 per iteration for 96 layers),
    so it belongs inside the NVLink domain of one node; across nodes every one of those collectives crosses
    InfiniBand (Narayanan et al., SC'21: tensor parallelism up to the GPUs of a server, pipeline parallelism
    across servers). A TP group is
    the ranks of a job with the same pipeline stage and DP rank; the rule checks where each member runs."""
    for job, ranks in facts.jobs().items():
        placed = [r for r in ranks if r.layout is not None and r.layout.tp_size > 1 and r.host is not None]
        spanning = []
        for (stage, dp), members in group_by(placed, lambda r: (r.layout.pp_stage, r.layout.dp_rank)):
            hosts = dict(group_by(members, lambda r: r.host))
            if len(hosts) > 1:
                spanning.append(Evidence(
                    f"TP group of stage {stage}, dp {dp}: " + ", ".join(
                        f"ranks {rank_list(r.rank for r in on)} on {host}" for host, on in hosts.items()),
                    members[0].where, {"pp_stage": stage, "dp_rank": dp, "nodes": len(hosts)}))
        if spanning:
            layout = placed[0].layout
            assert layout is not None, "placed ranks have a layout"
            tp = layout.tp_size
            yield Issue(
                title=f"{len(spanning)} tensor-parallel group(s) of job {job} span nodes (tp={tp})",
                evidence=capped(spanning, what="groups"),
                fix=f"order ranks with tensor parallel fastest-varying and keep tp ({tp}) at most the GPUs per node "
                    "(torchrun --nproc-per-node ≥ tp), so each TP group stays on one node",
                reason="Tensor parallelism runs collectives inside every layer; across nodes they all cross "
                       "InfiniBand instead of NVLink.",
            )
