"""Performance: pipeline bubbles, stragglers, input stalls, communication-bound data parallelism, and
interconnects that deliver less than they are rated for.

Past 500 lines on purpose: the PERF rules, each with the evidence helpers only it uses, in one family.
"""

from __future__ import annotations

import dataclasses
import statistics
import types
from collections.abc import Iterator

from gpuwatch.agent.telemetry.window import BUSY, CPU_WAIT, PHASE_TIMINGS
from gpuwatch.diagnosis import needs
from gpuwatch.diagnosis.coverage import (
    INPUT_WAIT,
    PIPELINE_BUBBLE,
    PIPELINE_STAGES_UNBALANCED,
    PROBE_RAN,
    STRAGGLERS,
    WholeJob,
)
from gpuwatch.diagnosis.facts import (
    RATED_BY,
    BandwidthMeasurement,
    Facts,
    RankFacts,
    Where,
    describe_ranks,
    gbit,
    group_by,
    median,
    medians_of_others,
    rank_list,
)
from gpuwatch.diagnosis.registry import Evidence, Issue, Severity, Threshold, rule
from gpuwatch.diagnosis.rules import paths
from gpuwatch.diagnosis.rules.common import (
    capped,
    cpu_sharing,
    partial_view,
    ratio_text,
    window_text,
    windowed,
    world_size,
)
from gpuwatch.plan.compute import ZERO_BUBBLE_SCHEDULES, micro_batches_for, schedule_bubble
from gpuwatch.protocol.schema import STEP_PHASES

FAMILY = "performance"


#: What PERF001 and PERF006 share: when one pipeline stage is busy beyond the others, PERF006 names it, and PERF001
#: does not report the bubble that stage causes a second time.
_STAGES = {
    "stage_ratio": Threshold(
        1.3, "a pipeline runs at the pace of its slowest stage: a stage busy 1.3x the others leaves them idle "
             "1 - 1/1.3 = 23 % of their schedule beyond the bubble, more than PERF001's 20 %; and one layer more "
             "than the others, the split a layer count not divisible by p forces (plan.run.stage_layers), is at most "
             "1.25x for stages of 4 layers or more, so 1.3 is beyond what rounding the split causes"),
    "stage_min_step_share": Threshold(
        0.1, "as PERF002's min_step_share: the stage's extra busy time must cost a tenth of the job's median step, "
             "below which a difference on a shared CPU is noise and a real one costs too little to act on"),
    "stage_shared_cpu_ratio": Threshold(
        3.0, "as PERF002's shared_cpu_ratio: ranks computing on CPUs share cores, and healthy ranks measured up to "
             "1.9x apart (benchmarks/false_alarms.py)"),
}


@rule("PERF001", family=FAMILY, view="bubble", severity=Severity.WARNING, title="Pipeline bubble ratio high",
      needs=(needs.PIPELINE,),
      thresholds={"max_bubble_ratio": Threshold(
          0.2, "GPipe (Huang et al. 2019): the bubble is (p−1)/(m+p−1), so p=8 stages and m=4 micro-batches idle "
               "64 %; m ≥ 4p, where GPipe found the bubble negligible, keeps it under 0.2 for any p"), **_STAGES},
      coverage=(PIPELINE_BUBBLE,))
def pipeline_bubble(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """A pipeline of p stages fed m micro-batches per step idles (p − 1)/(m + p − 1) of the step at best under
    GPipe and 1F1B: the first stage waits for the pipeline to drain, the last for it to fill (GPipe, Huang et al.
    2019; PipeDream-Flush, Narayanan et al. 2021 §2.2.1; p=8, m=4 idles 7/11 = 64 %, m=32 idles 18 %). The
    theoretical bubble follows the schedule the hellos name (gpuwatch.plan.compute.schedule_bubble, with its
    sources): interleaved 1F1B with v model chunks per rank idles (p − 1)/(v·m + p − 1) (Narayanan et al. 2021
    §2.2.2), the zero-bubble schedules (Qi et al. 2024) about nothing once m ≥ p; where the schedule's is not
    modelled (DualPipeV, a framework's own), the one the ranks report (bubble_ratio_theoretical) stands in. The rule
    takes each job's measured bubble (median over its ranks), falls back to the theoretical one when nothing is
    measured, and compares it with the threshold. When the schedule itself is the cause (theoretical above the
    threshold) it says how many micro-batches bring the bubble under it; when the measured bubble is far above the
    theoretical one, the stages are unbalanced or waiting on communication, and more micro-batches will not help:
    where one stage is busy beyond the others by PERF006's margins (the same thresholds here, stage_*), PERF006 names
    that stage and this rule says nothing more. On a node with more ranks than CPUs (CPU ranks, a test machine) a
    stage that waits for a CPU counts as idle, so a measured bubble above a sound schedule's is only reported as
    information there, and so on CPU ranks (gloo), where a send or receive between stages is a far larger share
    of a micro-batch than on a GPU."""
    for job, ranks in facts.jobs().items():
        piped = [rank for rank in ranks if rank.layout is not None and rank.layout.pp_size > 1]
        if not piped:
            continue
        layout = piped[0].layout
        assert layout is not None, "piped ranks have a layout"
        stages, micro = layout.pp_size, layout.micro_batches
        bubbles = {r.rank: b for r in piped if (b := windowed(r, "bubble_ratio")) is not None}
        measured = [rank for rank in piped if rank.rank in bubbles]
        theory = schedule_bubble(layout.schedule, stages, micro, layout.virtual_stages) if micro else None
        if theory is None:
            theory = next((r.last.bubble_ratio_theoretical for r in piped if r.last is not None
                           and r.last.bubble_ratio_theoretical is not None), None)
        bubble = median(bubbles.values()) if measured else theory
        if bubble is None or bubble <= t.max_bubble_ratio:
            continue
        values = {"pp_size": stages, "micro_batches": micro, "bubble_ratio": bubble,
                  "bubble_ratio_theoretical": theory, "threshold": t.max_bubble_ratio}
        shape = f"p={stages}, m={micro}" if micro else f"p={stages}"
        what = f"measured bubble {ratio_text(bubble)} (median of {len(measured)} ranks' {window_text(measured[0])})" \
            if measured else f"theoretical bubble {ratio_text(bubble)} (nothing measured)"
        evidence = [Evidence(f"job {job}: {what}, theoretical {ratio_text(theory)} for {shape}"
                             if theory is not None else f"job {job}: {what} for {shape}", Where(job=job), values)]
        for stage, members in group_by(sorted(measured, key=lambda r: r.layout.pp_stage), lambda r: r.layout.pp_stage):
            stage_bubble = median(bubbles[r.rank] for r in members)
            evidence.append(Evidence(f"stage {stage}: bubble {ratio_text(stage_bubble)}",
                                     Where(job=job, rank=members[0].rank), {"pp_stage": stage,
                                                                            "bubble_ratio": stage_bubble}))
        sharing = cpu_sharing(facts, ranks) if measured else []
        evidence += sharing
        against = f" against {ratio_text(theory)} in theory" if theory is not None else ""
        if theory is not None and theory > t.max_bubble_ratio:
            chunks = layout.virtual_stages or 1
            zero_bubble = layout.schedule in ZERO_BUBBLE_SCHEDULES
            needed = stages if zero_bubble else micro_batches_for(stages, t.max_bubble_ratio, chunks)
            formula = "(p−1)/(v·m+p−1)" if chunks > 1 else "(p−1)/(m+p−1)"
            yield Issue(
                title=f"pipeline bubble {ratio_text(bubble)} in job {job} ({shape}): too few micro-batches",
                evidence=tuple(evidence),
                fix=f"raise the micro-batches per step from {micro or 'the current count'} to at least {needed} "
                    + ("(a zero-bubble schedule fills its idle slots once m ≥ p)" if zero_bubble else
                       f"(bubble ≤ {ratio_text(t.max_bubble_ratio)}; the rule of thumb m ≥ 4p = {4 * stages})")
                    + ", keeping the micro-batch size (e.g. --micro-batches)",
                reason=(f"With p={stages} stages a zero-bubble schedule idles unless m ≥ p" if zero_bubble else
                        f"With p={stages} stages the pipeline idles {formula} of every step")
                       + "; more micro-batches shrink that share.",
            )
        elif sharing:
            yield Issue(
                title=f"pipeline bubble {ratio_text(bubble)} in job {job}{against}, on a node with fewer CPUs than "
                      "ranks",
                evidence=tuple(evidence),
                fix="measure the bubble where every rank has a CPU (or a GPU) to itself; here the schedule is sound",
                reason="A stage waiting for a CPU counts as idle, so on an oversubscribed node the measured bubble "
                       "shows the CPU shortage rather than unbalanced stages.",
                severity=Severity.INFO,
            )
        elif measured and all(r.gpu_uuid is None and r.gpu_index is None for r in measured):
            yield Issue(
                title=f"pipeline bubble {ratio_text(bubble)} in job {job}{against}, on CPU ranks",
                evidence=tuple(evidence),
                fix="judge the bubble on the GPUs the job trains on; on the CPU the schedule is sound",
                reason="On CPU ranks (gloo) a send or receive between stages and the schedule's own work between "
                       "passes are a far larger share of a micro-batch than on a GPU, so the stages wait on each "
                       "other above the schedule's bubble without a fault of the pipeline's; a stage slower than "
                       "the others is PERF006's.",
                severity=Severity.INFO,
            )
        elif not _slow_stages(facts, job, ranks, t):  # else PERF006 names the slow stage
            yield Issue(
                title=f"pipeline bubble {ratio_text(bubble)} in job {job}{against}: "
                      "stages unbalanced or waiting on communication",
                evidence=tuple(evidence),
                fix="rebalance layers across pipeline stages (give the slowest stage fewer layers) and check the "
                    "stage-to-stage send/recv time",
                reason="The schedule allows a small bubble, so the extra idle time comes from a slow stage or "
                       "slow activation transfers, not from too few micro-batches.",
            )


def _waiting(ranks: list[RankFacts]) -> tuple[float, RankFacts, dict[int, float]] | None:
    """Split the ranks' exposed collective time (``exposed_collective_seconds``: what each training thread
    waited on collectives per step, window medians) into transfer and waiting for late peers.

    A collective ends for everyone once the last rank has arrived and the data has moved, so the rank that
    arrives last waits for no one: its exposed time is the transfer alone, and every other rank's excess
    over it is waiting. The estimate needs no clock shared across nodes (arrival times would) and no barrier
    before each collective (which would cost a round trip): it is exact when one rank is late, and an upper
    bound on the transfer when arrivals are spread. Returns (transfer, the rank that waited least, waiting by
    rank), or None with fewer than two ranks measured."""
    exposed = {r.rank: e for r in ranks if (e := windowed(r, "exposed_collective_seconds")) is not None}
    if len(exposed) < 2:
        return None
    last = min((r for r in ranks if r.rank in exposed), key=lambda r: exposed[r.rank])
    transfer = exposed[last.rank]
    return transfer, last, {rank: seconds - transfer for rank, seconds in exposed.items()}


#: Where a straggler's extra time can be, by phase (``schema.STEP_PHASES``): the words a finding names it with, and
#: the fix there ({who}: the slow ranks or node; {node}: the node to take out, where the device is the cause).
_PHASE_ADVICE = {
    "data": ("loading its data",
             "look at the input of {who}: its DataLoader workers (num_workers, prefetch_factor), the storage it reads "
             "from (a slower or remote disk, a cold page cache: `iostat`) and whether its shard is larger or slower to "
             "decode than the others'; their input keeps up, so the job's input pipeline is not the cause"),
    "compute": ("compute (forward and backward)",
                "check the GPU(s) of {who} for throttling (HW005), a degraded PCIe link (HW002) and competing "
                "processes (`nvidia-smi`, `top`); replace or exclude {node} if it persists"),
    "optimizer": ("the optimizer step",
                  "compare the optimizer step of {who} with its peers': an optimizer, precision or offload setting "
                  "that differs there (optimizer state offloaded to the CPU, another optimizer), or a slower host for "
                  "an offloaded update"),
    "outside_model": ("work outside the model (callbacks, logging, evaluation, checkpointing)",
                      "look at what {who} does between steps besides the model: callbacks, logging, evaluation or "
                      "checkpointing that only it runs (rank-0-only work is the usual case); move it off the critical "
                      "path (a background thread, asynchronous checkpointing), do it less often, or share it among "
                      "the ranks"),
}
_PHASE_OF = {field: phase for phase, field in STEP_PHASES.items()}


@dataclasses.dataclass(frozen=True)
class _Straggler:
    """A rank busy beyond its peers, with each phase it reports: (its median, its peers' median of that phase; 0 for
    a phase none of its peers reports)."""

    rank: RankFacts
    busy: float
    typical: float
    phases: dict[str, tuple[float, float]]  # by step record field

    @property
    def ratio(self) -> float:
        return self.busy / self.typical

    @property
    def field(self) -> str:
        """The phase holding most of its extra time: the one whose median exceeds its peers' by the most."""
        return max(self.phases, key=lambda field: self.phases[field][0] - self.phases[field][1])

    @property
    def phase(self) -> str:
        return _PHASE_OF[self.field]


def _peer_medians(facts: Facts, job: str, stage: int, peers: list[RankFacts], timing: str) -> dict[int, float]:
    """Each peer's yardstick for a window ``timing``, by rank: the median of the other peers' medians, or the stage's
    median over all its ranks where the source fetched only some of them (``facts.peers``: then it includes the
    judged rank). Ranks that do not report the timing, or have no peer that does, have none."""
    values = {r.rank: v for r in peers if (v := windowed(r, timing)) is not None}
    whole = facts.peers.get((job, stage, timing))
    if whole is not None and whole.ranks > len(values):
        return dict.fromkeys(values, whole.median)
    if len(values) < 2:
        return {}
    return dict(zip(values, medians_of_others(list(values.values())), strict=True))


@rule("PERF002", family=FAMILY, view="heatmap", severity=Severity.WARNING, title="Straggler rank or node",
      needs=(needs.BUSY, needs.LAYOUT),
      thresholds={
          "straggler_ratio": Threshold(
              1.25, "a rank busy 25 % longer than the median of its peers holds every synchronous step back by that "
                    "much"),
          "min_step_share": Threshold(
              0.1, "the straggler's extra busy time must cost a tenth of the job's median step: below that, a "
                   "sub-millisecond difference on a shared CPU is noise (benchmarks/false_alarms.py), and a "
                   "real one costs too little to act on"),
          "shared_cpu_ratio": Threshold(
              3.0, "ranks that compute on CPUs share the cores with each other and everything else on the host, so "
                   "their timings include waiting for a core: healthy ranks, 4 or 8 to a 2-CPU node, measured up "
                   "to 1.9x apart, and users' scripts on a busy 2-CPU machine up to 1.36x over their window medians "
                   "(benchmarks/false_alarms.py)"),
      },
      coverage=(STRAGGLERS,))
def straggler(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """A straggler is the rank the others wait for. In synchronous training every rank's step takes as long as the
    slowest rank's, since the others wait for it in the next collective, so whole-step times come out even; a
    straggler is found from each rank's busy time instead: its step without the time it waited in collectives (the
    sum of its phases: data, compute, optimizer, and the host's work outside the model, each net of the collectives
    waited for inside it; a rank that reports only some phases, an older client's compute alone, is busy for
    those). Each rank's median busy time over its window of recent steps is compared with the median of its peers,
    the other ranks doing the same work (the same pipeline stage of the same job: stages differ in layers). A
    straggler must be slower by a ratio (straggler_ratio) and by a margin that matters against the step
    (min_step_share of the job's median step time). Whatever phase holds its extra time, it holds the job back; the
    finding names the phase whose median exceeds the peers' median of that phase by the most, and the fix follows
    it: compute is the device (throttling, PCIe, competing processes), data that rank's own loader or storage,
    outside the model that rank's own callbacks, logging, evaluation or checkpointing (rank-0-only work), optimizer
    that rank's update. One finding per phase. When every rank of a node is slow, the node is named instead: a node
    reading from slow disks, or a slow GPU, sets the pace of the whole job. The other ranks' waiting for it in
    collectives (their exposed collective time beyond the straggler's) is its evidence, not a network problem. Ranks
    that compute on CPUs (no GPU: a test, a demo, a CPU job) share the host's cores, so their timings include
    waiting for one, and only a larger gap (shared_cpu_ratio) tells a straggler from that noise; where the kernel
    counts that wait (``cpu_wait_seconds``) it comes out of their busy time, never below their time on a CPU
    (``window.BUSY``). Ranks whose layout
    is unknown (measured by `gpuwatch run` without a DDP model over every rank) have no known peers and are not
    compared."""
    for job, ranks in facts.jobs().items():
        busy = {r.rank: b for r in ranks  # peers only where the layout says which ranks do the same work
                if r.layout is not None and (b := windowed(r, BUSY)) is not None and b > 0}
        timed = [r for r in ranks if r.rank in busy]
        step_times = [s for r in timed if (s := windowed(r, "step_seconds")) is not None]
        if not step_times:
            continue
        # A source that fetched only some of the job's ranks (--prometheus's outlier fetch) brings the yardsticks
        # of all of them, computed where the data is (facts.peers): the median then includes the judged rank.
        whole_step = facts.peers.get((job, None, "step_seconds"))
        step = whole_step.median if whole_step is not None and whole_step.ranks > len(step_times) \
            else median(step_times)
        sharing = cpu_sharing(facts, ranks)
        on_cpus = all(r.gpu_uuid is None and r.gpu_index is None for r in timed)
        if on_cpus and not sharing:
            sharing = [Evidence(f"the ranks of job {job} compute on CPUs, whose cores they share with each other and "
                                "the rest of the host: their timings include waiting for a core", Where(job=job),
                                {"cpu_ranks": len(timed)})]
        threshold = max(t.straggler_ratio, t.shared_cpu_ratio) if sharing else t.straggler_ratio
        slow: list[_Straggler] = []
        for stage, peers in group_by(timed, lambda r: r.layout.pp_stage):
            typicals = _peer_medians(facts, job, stage, peers, BUSY)
            by_phase = {field: _peer_medians(facts, job, stage, peers, field) for field in PHASE_TIMINGS}
            for rank in peers:
                own, typical = busy[rank.rank], typicals.get(rank.rank)
                if typical is None or own < threshold * typical or own - typical < t.min_step_share * step:
                    continue
                phases = {field: (seconds, by_phase[field].get(rank.rank, 0.0)) for field in PHASE_TIMINGS
                          if (seconds := windowed(rank, field)) is not None}
                slow.append(_Straggler(rank, own, typical, phases))
        if not slow:
            continue
        slow.sort(key=lambda s: -s.ratio)
        waiting = _waiting_evidence(job, ranks, {s.rank.rank for s in slow})
        # the outlier fetch reads some ranks in detail on purpose, and brings the whole job's yardsticks (whole_step)
        seen = [partial] if whole_step is None and (partial := partial_view(job, ranks)) is not None else []
        for phase, members in group_by(slow, lambda s: s.phase):
            yield _straggler_issue(job, ranks, timed, phase, members, step,
                                   [*waiting, *sharing, *_cpu_wait_evidence(job, timed), *seen])


def _cpu_wait_evidence(job: str, timed: list[RankFacts]) -> list[Evidence]:
    """CPU ranks' waits for a core (``window.BUSY`` takes them out of the busy times judged), where reported."""
    waits = [w for r in timed if (w := windowed(r, CPU_WAIT)) is not None]
    if not waits:
        return []
    return [Evidence("busy times are net of each rank's wait for a CPU, never below its time on one: the ranks "
                     f"waited for one (Linux's run-queue delay) a median {median(waits):.3g} s per step, up to "
                     f"{max(waits):.3g} s", Where(job=job), {"cpu_wait_seconds": median(waits), "ranks": len(waits)})]


def _waiting_evidence(job: str, ranks: list[RankFacts], slow: set[int]) -> list[Evidence]:
    """The other ranks' wait in collectives for the slow ones (their exposed time beyond the least), if measured."""
    split = _waiting(ranks)
    if split is None:
        return []
    _, _, waits = split
    waiting = [r for r in ranks if r.rank not in slow and waits.get(r.rank, 0) > 0]
    if not waiting:
        return []
    typical = median(waits[r.rank] for r in waiting)
    return [Evidence(f"{describe_ranks(waiting)} wait a median {typical:.3g} s per step in collectives for the slow "
                     "rank(s): waiting, not transfer", Where(job=job),
                     {"wait_seconds": typical, "ranks": [r.rank for r in waiting]})]


def _straggler_issue(job: str, ranks: list[RankFacts], timed: list[RankFacts], phase: str,
                     members: list[_Straggler], step: float, context: list[Evidence]) -> Issue:
    """One finding for the ranks of a job slow in the same phase: each with its busy time and phases, the node when
    all its ranks are among them, the fix of that phase."""
    by_node = {host: nodes for host, nodes in group_by(timed, lambda r: r.host) if host is not None}
    named = {s.rank.rank for s in members}
    whole_nodes = [host for host, on_node in by_node.items()
                   if len(on_node) > 1 and {r.rank for r in on_node} <= named]
    where, fix = _PHASE_ADVICE[phase]
    evidence = []
    for straggler in members:
        r = straggler.rank
        own, usual = straggler.phases[straggler.field]
        values: dict[str, float | int | str | None] = {
            "busy_seconds": straggler.busy, "median_seconds": straggler.typical, "ratio": straggler.ratio,
            "step_seconds": step, "window_steps": r.window.steps if r.window else None, "phase": phase}
        for field, (seconds, peers) in straggler.phases.items():
            values[field], values[f"peers_{field}"] = seconds, peers
        evidence.append(Evidence(
            f"rank {r.rank} ({r.host or 'unknown node'}"
            + (f", stage {r.layout.pp_stage}" if r.layout and r.layout.pp_size > 1 else "")
            + f") is busy {straggler.busy:.3g} s per step ({window_text(r)}), {straggler.ratio:.2f}x the median "
              f"{straggler.typical:.3g} s of its peers, in a {step:.3g} s step; the extra is in {where}: {own:.3g} s "
              f"against {usual:.3g} s", r.where, values))
    first = members[0]
    culprit = f"node {', '.join(whole_nodes)}" if whole_nodes else \
        f"rank {first.rank.rank} on {first.rank.host or 'an unknown node'}" if len(members) == 1 else \
        f"{len(members)} ranks"
    who = culprit if whole_nodes else describe_ranks(s.rank for s in members)
    return Issue(
        title=f"straggler in job {job}: {culprit} is busy up to {first.ratio:.2f}x the median, the extra in {where}",
        evidence=(*capped(evidence, what="slow ranks"), *context),
        fix=fix.format(who=who, node=culprit if whole_nodes else "the node"),
        reason=f"Synchronous training runs at the pace of its slowest rank: all {world_size(ranks) or len(ranks)} "
               "ranks of the job wait for it at every collective, whichever phase holds its extra time.",
    )


@rule("PERF003", family=FAMILY, view="phases", severity=Severity.WARNING, title="Input pipeline stall",
      needs=(needs.DATALOADER,),
      thresholds={
          "max_wait_share": Threshold(0.2, "a fifth of the step spent waiting for input is worth fixing before "
                                           "anything else"),
          "min_wait_seconds": Threshold(0.002, "below ~2 ms the wait is per-batch Python overhead (fetching and "
                                               "collating a batch; handing one over from a worker process costs as "
                                               "much), which more loader workers do not remove"),
          "low_sm_active": Threshold(0.3, "GPU activity below 30 % while the process mostly waits for data: the "
                                          "GPU starves"),
          "rank_share": Threshold(0.5, "a job's input pipeline (the same loader code, data set and storage on every "
                                       "rank) slows most of its ranks alike; a wait on half of the ranks of a stage "
                                       "or fewer, while the others do not wait, is those ranks' own loader or "
                                       "storage, and it makes them stragglers the others wait for: PERF002 names "
                                       "them, with their extra time in loading data"),
      },
      coverage=(INPUT_WAIT,))
def input_stall(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """When the data loader cannot keep up, the GPU idles at the start of every step. The rule measures each
    rank's data-loader wait as a share of its step (medians over its window of recent steps; a wait shorter than
    min_wait_seconds is overhead no loader setting removes), and adds the rank's GPU activity as corroboration where
    the node's GPUs are known. A stall of the job's input pipeline is shared: it must hold for more than rank_share
    of the ranks doing the same work (a pipeline stage of the job; the whole job where the layout is unknown), since
    in pipeline parallelism only the first stage loads data. One rank or a few waiting while their peers do not are
    stragglers, PERF002's finding with the phase data, and their own loader is the fix, not the job's. Where CPU
    ranks outnumber their node's CPUs, a rank that waits for a CPU while it fetches its batch counts as waiting for
    input, so a stall is only reported as information there."""
    for job, ranks in facts.jobs().items():
        stalled = []
        for _, peers in group_by(ranks, lambda r: r.layout.pp_stage if r.layout is not None else None):
            judged = [(r, wait, step) for r in peers
                      if (wait := windowed(r, "dataloader_wait_seconds")) is not None
                      and (step := windowed(r, "step_seconds"))]
            waiting = [(r, wait, step) for r, wait, step in judged
                       if wait / step >= t.max_wait_share and wait >= t.min_wait_seconds]
            if len(waiting) > t.rank_share * len(judged):
                stalled += [(wait / step, _stall_evidence(facts, r, wait, step, t)) for r, wait, step in waiting]
        if not stalled:
            continue
        stalled.sort(key=lambda item: -item[0])
        sharing = cpu_sharing(facts, ranks)
        yield Issue(
            title=f"input pipeline stall in job {job}: {len(stalled)} of {len(ranks)} rank(s) wait up to "
                  f"{ratio_text(stalled[0][0])} of the step for data"
                  + (", on a node with fewer CPUs than ranks" if sharing else ""),
            evidence=capped([e for _, e in stalled], what="ranks") + tuple(sharing),
            fix="load batches in parallel and ahead of the step: worker processes (PyTorch: DataLoader(num_workers=N, "
                "pin_memory=True, persistent_workers=True, prefetch_factor=4)); move preprocessing out of the training "
                "loop (precompute it) and keep the data on fast local storage",
            reason="The GPU sits idle while the step waits for its batch; a faster input pipeline converts that "
                   "wait directly into throughput.",
            severity=Severity.INFO if sharing else None,
        )


def _stall_evidence(facts: Facts, rank: RankFacts, wait: float, step: float, t: types.SimpleNamespace) -> Evidence:
    share = wait / step
    gpu = facts.gpu_of(rank)
    activity = "" if gpu is None or gpu.busy is None else \
        f"; its GPU is {ratio_text(gpu.busy)} busy" + (" (low)" if gpu.busy < t.low_sm_active else "")
    return Evidence(f"rank {rank.rank}: waits {wait:.3g} s for input in a {step:.3g} s step ({ratio_text(share)}, "
                    f"{window_text(rank)}){activity}", rank.where,
                    {"dataloader_wait_seconds": wait, "step_seconds": step, "share": share,
                     "gpu_busy": gpu.busy if gpu else None})


def _bytes_per_step(rank: RankFacts) -> float | None:
    """The bytes the rank's collectives moved per step: from the totals of the calls the hooks timed, else the
    volume of DDP's all-reduce its latest step reported (`gradient_sync_bytes`); None when unknown."""
    moved = [op.bytes for op in (rank.collectives or {}).values() if op.bytes is not None]
    if moved and rank.steps:
        return sum(moved) / rank.steps
    return rank.last.gradient_sync_bytes if rank.last is not None else None


#: The fix of a heavy job, by its kind of data parallelism (PyTorch docs: DistributedDataParallel's no_sync and
#: bucket_cap_mb, its communication hooks; FSDP2's fully_shard(reshard_after_forward), set_modules_to_forward_prefetch
#: and a 2-D DeviceMesh for hybrid sharding), or by the dimension of a hybrid job whose group dominates (Megatron-LM,
#: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM": tensor
#: parallelism inside a node's NVLink domain, pipeline parallelism across nodes with enough micro-batches).
_HEAVY_FIX: dict[bool | str, str] = {
    "tp": "keep tensor parallelism inside a node's NVLink domain (tp at most the GPUs of a node: every layer's "
          "all-reduce or all-gather and reduce-scatter is on the critical path, and across nodes they cross the "
          "network), overlap it with compute (sequence parallelism, asynchronous tensor parallelism as torchtitan "
          "enables it), or move part of the degree to pipeline or data parallelism",
    "pp": "send less often for more compute: more micro-batches per step (each send smaller, hidden behind the other "
          "micro-batches' compute), an interleaved schedule, or fewer pipeline stages (part of the degree to tensor "
          "parallelism inside a node or to data parallelism)",
    False: "give each all-reduce more compute (a larger per-GPU batch, or gradient accumulation with the all-reduce "
           "only on the last micro-batch: DDP no_sync), overlap it with the backward pass (DDP's gradient buckets, "
           "bucket_cap_mb), compress it (a DDP communication hook: bf16_compress_hook, PowerSGD), or move to hybrid "
           "parallelism (tensor parallel inside the node, data parallel across nodes)",
    True: "the job shards its parameters (FSDP/ZeRO-3: all-gathers and reduce-scatters): keep the parameters gathered "
          "from forward to backward (FSDP2 fully_shard(reshard_after_forward=False), FSDP1 SHARD_GRAD_OP), prefetch "
          "the next all-gather (FSDP2 set_modules_to_forward_prefetch / set_modules_to_backward_prefetch), shard "
          "inside a node and replicate across nodes (hybrid sharding: fully_shard over a 2-D DeviceMesh, FSDP1 "
          "HYBRID_SHARD), or, where the model, its gradients and optimizer state fit one GPU, do not shard it (DDP "
          "all-reduces once a step what FSDP gathers twice and reduce-scatters once)",
}


@rule("PERF004", family=FAMILY, view="collectives", severity=Severity.WARNING, title="Communication-bound job",
      needs=(needs.EXPOSED_COLLECTIVES, needs.COMPUTE),
      thresholds={
          "max_ccr": Threshold(0.5, "a practitioners' rule of thumb: above a communication-to-computation ratio of "
                                    "0.5, pure data parallelism stops scaling, since the all-reduce grows with the "
                                    "model while each GPU's compute does not"),
          "min_step_share": Threshold(0.2, "the transfer must take a fifth of the job's median step to be worth "
                                           "restructuring the job for"),
          "min_bytes_per_step": Threshold(
              2**20, "below about 1 MiB a collective's time is its latency, not its bandwidth (nccl-tests' bus "
                     "bandwidth only nears the link's at megabytes), and neither more GPUs nor hybrid parallelism "
                     "changes a latency: a tiny model's few-KiB all-reduce over gloo takes 1-2 ms against 0.5 ms of "
                     "compute (benchmarks/false_alarms.py) and is not what this rule is about"),
          "min_path_fraction": Threshold(
              0.25, "a healthy NCCL bus bandwidth reaches 75-95 % of line rate (nccl-tests' PERFORMANCE.md; PERF005's "
                    "0.7), and a job's own figure, its bytes over its exposed collective time, overstates what the "
                    "path gave (overlap with the backward pass hides part of the transfer): below a quarter of the "
                    "path's rating the path, not the job's volume, is the cause"),
      },
      coverage=(WholeJob("it splits each job's exposed collective time over all its ranks"),))
def communication_bound(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """The communication-to-computation ratio (CCR) of a data-parallel job is the time its collectives take to
    transfer per step over its compute time per step: above 0.5 the collectives, not the GPUs, set the pace, and
    adding GPUs stops paying off. Transfer is not waiting: a rank that waits in the all-reduce for a late peer is
    not communicating, so the transfer is taken from the rank that waited least (see ``_waiting``), and a late rank
    is PERF002's finding. Only the collective time the training thread actually waited for counts (DDP overlaps
    bucket all-reduces with the backward pass), only when it matters against the step (a fifth of it or more), and
    only for collectives large enough to be bound by bandwidth (min_bytes_per_step). Judged with window medians
    (compute: the median over the job's ranks); a hybrid job (tp or pp > 1) only where its steps say which process
    group the time went to (``groups``), whose dimension, the one with the most seconds, chooses the fix.

    Slow network or heavy job: the finding states the bus bandwidth each process group achieved (its bytes over its
    seconds, nccl-tests' conventions: algbw × 2(n−1)/n for all-reduce, × (n−1)/n for all-gather and reduce-scatter;
    https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md) against what the group's path is rated for:
    across nodes, InfiniBand/RoCE from the ports' rate for NCCL, else the sockets over each node's NIC, rated at its
    link speed (/sys/class/net/NAME/speed, the NIC NCCL_SOCKET_IFNAME or GLOO_SOCKET_IFNAME names); inside a node,
    NVLink for NCCL; across nodes whose links give no rating, the best bus bandwidth the job's own `gpuwatch probe`
    measured across them. It names the nodes and NICs, and, from the agents' counter samples, what each node's NIC
    carried over the step window (the group's cross-node part) and the slow side where the counters single one out
    (``paths.slow_side``: the only NIC with errors or drops, or one far busier against its own speed). Below
    min_path_fraction of the rating the network is slow, and the fix is the link, the NIC or the transport (a fallback
    to sockets), not the job; else the job is heavy, and the fix follows its kind of data parallelism: DDP (buckets,
    no_sync) or sharded (FSDP/ZeRO-3: reshard_after_forward, prefetch, hybrid sharding, not sharding a model that fits).

    Never judged from a partial view: a source that sees fewer of the job's ranks than its world size (the
    hellos' layout; an agent on one node of several) cannot tell transfer from waiting for a rank it does not see,
    and gives information instead: how long the ranks it sees wait, for which ranks, and how to see them all.

    Worked example (tests/test_multinode_netns.py, docs/runbook.md): a 4-rank DDP job on two nodes, gloo over a 10 Gb/s
    veth whose node-b side a tbf qdisc holds to 50 Mb/s, moves 4.51 MiB of gradients a step in ~1.1 s of exposed
    all-reduce: algbw 4.51 MiB / 1.12 s = 33.8 Mb/s, busbw × 2(4−1)/4 = 50.7 Mb/s, 1 % of the NIC's rated 10 Gb/s: below
    a quarter of it, a slow network (the fix: the link, `tc qdisc show`, `ethtool`, `gpuwatch probe`). Each veth's
    counters show 7.1 MiB a step each way, the ring's 2(4−1)/4 × 4.51 MiB plus TCP/IP headers, at the same rate on both
    nodes: a ring moves in lockstep, so they name no slow side. Had the group delivered 8 Gb/s, 80 % of its rating, at
    the same CCR, the job would be heavy on a healthy path, and the fix its shape (a larger batch, no_sync, buckets,
    hybrid parallelism). A straggler (rank 3 sleeping 0.5 s a forward) is neither: the rank that waits least waits
    little, so the transfer is small, and PERF002 names rank 3."""
    for job, ranks in facts.jobs().items():
        pure = [r for r in ranks if r.layout is not None and r.layout.world_size > 1]
        hybrid = any(r.layout is not None and (r.layout.tp_size > 1 or r.layout.pp_size > 1) for r in pure)
        if hybrid and not any(r.last is not None and r.last.groups for r in pure):
            continue  # which dimension communicates is unknown without per-group timing
        split = _waiting(pure)
        computes = [c for r in pure if (c := windowed(r, "compute_seconds"))]
        steps = [s for r in pure if (s := windowed(r, "step_seconds"))]
        volumes = [v for r in pure if (v := _bytes_per_step(r)) is not None]
        if split is None or not computes or not steps:
            continue
        transfer, last, waits = split
        compute, step = median(computes), median(steps)
        volume = median(volumes) if volumes else None
        ccr = transfer / compute
        if ccr <= t.max_ccr or transfer < t.min_step_share * step or (
                volume is not None and volume < t.min_bytes_per_step):
            continue
        exposed = {rank: wait + transfer for rank, wait in waits.items()}
        partial = paths.waits_for_unseen(pure, exposed)
        if partial is not None:
            yield _partial_view(facts, job, pure, exposed, partial)
            continue
        layout = pure[0].layout
        assert layout is not None, "the judged ranks have a layout"
        groups = paths.achieved(last, pure, transfer, volume)
        judged = [(group, paths.path_of(facts, pure, group)) for group in groups]
        # a group moving less than min_bytes_per_step (a logged loss's all-reduce) is bound by latency, not the path
        slow = [(g, p) for g, p in judged if p.rating and g.bytes >= t.min_bytes_per_step
                and g.busbw < t.min_path_fraction * p.rating]
        moved = f", {volume / 2**20:.3g} MiB per step" if volume is not None else ""
        evidence = [
            Evidence(f"transfer {transfer:.3g} s per step{moved}: the exposed collective time of rank "
                     f"{last.rank}, which waits least ({window_text(last)})", last.where,
                     {"transfer_seconds": transfer, "rank": last.rank, "bytes_per_step": volume}),
            Evidence(f"compute {compute:.3g} s per step (median over {len(computes)} ranks), in a {step:.3g} s "
                     f"step: transfer is {ratio_text(transfer / step)} of it", Where(job=job),
                     {"compute_seconds": compute, "step_seconds": step, "ccr": ccr}),
            Evidence(f"the other ranks wait up to {max(waits.values()):.3g} s more per step for late peers (not "
                     "counted as transfer)", Where(job=job), {"max_wait_seconds": max(waits.values())}),
            *(_bandwidth_evidence(job, group, path) for group, path in judged),
        ]
        crossing = next(((g, p) for g, p in (slow or judged) if p.crosses), None)
        side = None
        if crossing is not None:
            traffic_evidence, side = _traffic_evidence(facts, job, pure, *crossing)
            evidence += traffic_evidence
        if slow:
            group, path = slow[0]
            assert path.rating is not None
            yield Issue(
                title=f"job {job} is communication-bound on a slow network: {path.describe()} delivers "
                      f"{paths.rate_text(group.busbw)} bus bandwidth of its rated {paths.rate_text(path.rating)} "
                      f"({ratio_text(group.busbw / path.rating)}) to group {group.group}, CCR {ccr:.2f}"
                      + (f"; the slow side is {side}" if side else ""),
                evidence=tuple(evidence),
                fix=f"repair the path, not the job: check the links between {', '.join(path.nodes)} "
                    + (f"({', '.join(path.links)}) " if path.links else "")
                    + (f"(first {side}'s) " if side else "")
                    + "for a lower negotiated speed (`ethtool`), errors and drops (`ip -s link`, HW003), a shaping "
                      "or policing qdisc (`tc qdisc show`) and a congested or misconfigured switch port; check that "
                      "the collectives use the fast fabric (NCCL_DEBUG=INFO prints NET/IB or NET/Socket: a fallback "
                      "to sockets, NCCL_IB_DISABLE or NCCL_NET=Socket, NCCL001; NCCL_SOCKET_IFNAME / "
                      "GLOO_SOCKET_IFNAME naming the fast NIC); measure the path alone with `gpuwatch probe` across "
                      "the nodes (PERF005 judges it)",
                reason="The job moves no more than a healthy path carries easily: the path delivers a small part "
                       "of its rating, so the collectives wait on the network, and restructuring the job would only "
                       "hide a fault that a repair removes.",
            )
            continue
        heavy = "heavy job on a healthy path" if any(p.rating for _, p in judged) else \
            "heavy job (the path's rating is unknown: " + "; ".join(p.how for _, p in judged[:1]) + ")" \
            if judged else "heavy job (its bandwidth is unknown: no bytes per step)"
        sharded_job = paths.sharded(pure)
        dimension = _dimension(groups[0].group) if hybrid and groups else "dp"
        if hybrid:
            dominant = f"most of it on group {groups[0].group} ({_DIMENSION_NAMES[dimension]})" if groups else ""
            shape = f"{dominant} of a tp {layout.tp_size} × pp {layout.pp_size} × dp {layout.dp_size} job"
        else:
            shape = f"{'sharded ' if sharded_job else 'pure '}data parallelism over {layout.dp_size} ranks"
        # A hybrid job's tensor and pipeline collectives, every layer's, over gloo against a CPU's compute: a
        # property of CPU ranks (a test rig), not of the job's shape on the GPUs it trains on.
        on_cpus = hybrid and all(r.gpu_uuid is None and r.gpu_index is None for r in pure)
        yield Issue(
            title=f"job {job} is communication-bound: CCR {ccr:.2f} (collective transfer / compute) with {shape}, "
                  f"a {heavy}" + (", on CPU ranks" if on_cpus else ""),
            evidence=tuple(evidence),
            fix=_HEAVY_FIX[sharded_job] if dimension == "dp" else _HEAVY_FIX[dimension],
            reason="Above a CCR of 0.5 the collectives, not the GPUs, set the step time, and adding data-parallel "
                   "ranks makes it worse; the path delivers what it is rated for, so the job's volume is the cause."
                   + (" On CPU ranks (gloo) each layer's tensor or pipeline collective is a far larger share of "
                      "the step than on GPUs: judge the job's shape on the GPUs it trains on." if on_cpus else ""),
            severity=Severity.INFO if on_cpus else Severity.WARNING,
        )


def _dimension(group: str) -> str:
    """The parallelism a process group serves, from its name (the hellos' and device meshes' names: "tp", "pp",
    "dp", "dp_shard", "default"): tensor and pipeline groups by name, the rest data parallel."""
    return "tp" if "tp" in group else "pp" if "pp" in group else "dp"


_DIMENSION_NAMES = {"tp": "tensor parallelism", "pp": "pipeline parallelism", "dp": "data parallelism"}


def _traffic_evidence(facts: Facts, job: str, ranks: list[RankFacts], group: paths.Achieved,
                      path: paths.Path) -> tuple[list[Evidence], str | None]:
    """What the NICs of a path across nodes carried over the job's step window (the agents' counter samples): the
    group's cross-node share, seen from each side; and the node they single out as the slow side, if any."""
    traffic = paths.traffic_on(facts, ranks, path)
    evidence = [Evidence(
        f"NIC counters: {t.describe()}", Where(job=job, node=t.node),
        {"node": t.node, "interface": t.traffic.interface, "seconds": t.traffic.seconds,
         "transmit_bytes": t.traffic.transmit_bytes, "receive_bytes": t.traffic.receive_bytes,
         "errors": t.traffic.errors, "drops": t.traffic.drops, "steps": t.steps, "utilization": t.utilization,
         "bytes_per_step": max(t.traffic.transmit_bytes, t.traffic.receive_bytes) / t.steps})
        for t in traffic]
    if len(traffic) < 2:
        return evidence, None
    side = paths.slow_side(traffic)
    ring = group.busbw * group.seconds
    share = f"group {group.group}'s ring moves {ring / 2**20:.3g} MiB a step through each member's link " \
            f"(busbw × seconds); what crosses a node's NIC is its cross-node part"
    if side is None:
        evidence.append(Evidence(
            f"{share}. Every node's NIC carries about the same rate: a collective moves in lockstep, so a link slowed "
            "by shaping, a congested switch port or a bad cable shows alike on both sides, and the counters do not "
            "tell which side is slow", Where(job=job), {"slow_side": None, "ring_bytes_per_step": ring}))
        return evidence, None
    node, why = side
    evidence.append(Evidence(f"{share}. The counters single out {node}: {why}", Where(job=job, node=node),
                             {"slow_side": node, "ring_bytes_per_step": ring}))
    return evidence, node


def _bandwidth_evidence(job: str, group: paths.Achieved, path: paths.Path) -> Evidence:
    """A group's achieved bus bandwidth against its path's rating, where the path is named."""
    n = len(group.members)
    factor = f"{'' if group.sharded else '2'}({n}−1)/{n}"
    rated = f", {ratio_text(group.busbw / path.rating)} of its rated {paths.rate_text(path.rating)} ({path.how})" \
        if path.rating else f"; {path.how}"
    return Evidence(
        f"group {group.group} (ranks {rank_list(group.members)}) over {path.describe()}: bus bandwidth "
        f"{paths.rate_text(group.busbw)} (algbw {paths.rate_text(group.algbw)} × {factor}; {group.source}){rated}",
        Where(job=job, node=path.nodes[0] if len(path.nodes) == 1 else None),
        {"group": group.group, "ranks": n, "bytes": group.bytes, "seconds": group.seconds,
         "algbw_bytes_per_second": group.algbw, "busbw_bytes_per_second": group.busbw,
         "rated_bytes_per_second": path.rating, "path": path.name, "nodes": list(path.nodes),
         "crosses_nodes": path.crosses, "links": list(path.links)})


def _partial_view(facts: Facts, job: str, ranks: list[RankFacts], exposed: dict[int, float],
                  partial: tuple[float, list[int], int]) -> Issue:
    """What a source that sees only some of a job's ranks can say: how long those wait, for whom, how to see all."""
    typical, missing, world = partial
    seen = [r for r in ranks if r.rank in exposed]
    nodes = sorted({r.host for r in seen if r.host is not None})
    agents = [s.location.removesuffix("/api/v1/state") for s in facts.sources if s.kind == "agent"]
    unseen = paths.unseen_text(ranks, missing)
    return Issue(
        title=f"job {job}: {describe_ranks(seen)} wait a median {typical:.3g} s a step in collectives, with "
              f"{unseen}: transfer or waiting cannot be told apart from this partial view",
        evidence=(Evidence(
            f"{describe_ranks(seen)} on {', '.join(nodes) or 'an unknown node'} wait a median {typical:.3g} s a step "
            f"in collectives for {unseen} or for the transfer; this source sees {len(exposed)} of the job's {world} "
            "ranks, and a rank waiting for a peer it cannot see is no evidence of transfer time", Where(job=job),
            {"wait_seconds": typical, "ranks": sorted(exposed), "missing_ranks": missing, "world_size": world}),),
        fix="judge the job from all nodes: `gpuwatch diagnose "
            + " ".join(f"--agent {a}" for a in agents) + (" " if agents else "")
            + "--agent URL ...` (one for each node the job runs on) or `--prometheus URL`",
        reason="Whether the ranks seen here wait for a slow network, a heavy all-reduce or a straggler elsewhere "
               "depends on the ranks this source does not see.",
        severity=Severity.INFO,
    )


#: Port link layer of each network a probe can name.
_LINK_LAYERS = {"infiniband": "InfiniBand", "roce": "Ethernet"}
_PATH_NAMES = {"nvlink": "NVLink", "infiniband": "InfiniBand", "roce": "RoCE"}


def _rated(facts: Facts, measurement: BandwidthMeasurement) -> tuple[float, str] | None:
    """What the probed path is rated for, and how that was reckoned; None when the node's links are unknown."""
    node = facts.nodes.get(measurement.node)
    if node is None:
        return None
    if measurement.interconnect == "nvlink":
        speeds = [g.up_speed_bytes_per_second for g in node.nvlinks or ()
                  if g.up_speed_bytes_per_second and (measurement.gpu is None or g.gpu == measurement.gpu)]
        return (min(speeds), "the slowest GPU's NVLink links together") if speeds else None
    layer = _LINK_LAYERS[measurement.interconnect]
    rates = [p.rate_bytes_per_second for p in node.active_ports() if p.link_layer == layer and p.rate_bytes_per_second]
    if not rates:
        return None
    rails = min(measurement.ranks_per_node or 1, len(rates))
    return min(rates) * rails, f"{rails} active {layer} port(s) of {gbit(min(rates))}"


def _measured(measurement: BandwidthMeasurement, rated: float) -> Evidence:
    size = f" at {measurement.size_bytes / 2**20:g} MiB" if measurement.size_bytes is not None else ""
    ranks = f" over {measurement.ranks} ranks" if measurement.ranks is not None else ""
    busbw = measurement.busbw_bytes_per_second
    return Evidence(f"{measurement.op}: peak bus bandwidth {gbit(busbw)} ({ratio_text(busbw / rated)} of rated){size}"
                    f"{ranks}",
                    Where(node=measurement.node, job=measurement.job, gpu=measurement.gpu),
                    {"busbw_bytes_per_second": busbw, "rated_bytes_per_second": rated, "fraction": busbw / rated,
                     "size_bytes": measurement.size_bytes, "ranks": measurement.ranks})


@rule("PERF005", family=FAMILY, severity=Severity.WARNING, title="Interconnect far below its rated bandwidth",
      view="collectives", needs=(needs.BANDWIDTH,),
      thresholds={"min_fraction": Threshold(
          0.7, "a reported case: NVLink measured at only 63 % of its rated bandwidth was the problem that forced a "
               "redesign; 0.7 flags that case while a healthy NCCL bus bandwidth reaches 75-95 % of line rate")},
      coverage=(PROBE_RAN,))
def bandwidth_below_rating(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """An active measurement (nccl-tests style bus bandwidth, from gpuwatch probe) is compared with what the
    path is rated for. In one reported case NVLink delivered only 63 % of its theoretical bandwidth, and
    that, not the model, decided the parallel layout. A path far below its rating points at a degraded link,
    a wrong topology (traffic through PCIe or the CPU) or an NCCL setting.

    Bus bandwidth is algbw × 2(n−1)/n for all-reduce and × (n−1)/n for all-gather and reduce-scatter: the
    data each rank's link carries, so it compares with one link's speed whatever the rank count. The rating
    of NVLink is the slowest GPU's up links together (a GPU's links all carry its share); of InfiniBand or
    RoCE, the node's slowest active port of that link layer times the ports the node's ranks drive at once
    (NCCL gives each GPU its nearest NIC, so bus bandwidth across nodes grows with min(ranks per node,
    ports)). The best op's peak over the message sizes is judged: a path that delivers its rating on any
    collective is not degraded. Loopback, sockets, PCIe and unclassified paths have no rating to judge
    against, and the rule reports itself not run for them."""
    judged = [m for m in facts.bandwidth or () if m.interconnect in RATED_BY]
    for (_, node, path, _), measurements in group_by(judged, lambda m: (m.job, m.node, m.interconnect, m.gpu)):
        rated = _rated(facts, measurements[0])
        if rated is None:
            continue
        rating, how = rated
        best: dict[str, BandwidthMeasurement] = {}  # per op: one probe may reach us through several sources
        for measurement in sorted(measurements, key=lambda m: -m.busbw_bytes_per_second):
            best.setdefault(measurement.op, measurement)
        fraction = max(m.busbw_bytes_per_second for m in best.values()) / rating
        if fraction >= t.min_fraction:
            continue
        yield Issue(
            title=f"{_PATH_NAMES[path]} on {node} delivers {ratio_text(fraction)} of its rated bandwidth",
            evidence=(Evidence(f"rated {gbit(rating)}: {how}", Where(node=node), {"rated_bytes_per_second": rating}),
                      *(_measured(m, rating) for m in best.values())),
            fix="check the topology (`nvidia-smi topo -m`), link states (HW001, HW003) and NCCL_P2P/NCCL_IB settings; "
                "rerun the probe with NCCL_DEBUG=INFO to see which transport NCCL picked",
            reason="Collectives cannot beat the bandwidth the path actually delivers; far below its rating, it "
                   "is degraded or bypassed.",
        )


@dataclasses.dataclass(frozen=True)
class _Stage:
    """One pipeline stage of a job as its ranks with a busy time show it: ``busy`` the lower median of their window
    medians (see PERF006 for why the lower)."""

    stage: int
    ranks: list[RankFacts]
    busy: float

    def median_of(self, timing: str) -> float | None:
        values = [v for r in self.ranks if (v := windowed(r, timing)) is not None]
        return median(values) if values else None


@dataclasses.dataclass(frozen=True)
class _Unbalanced:
    """A job's stages, the ones busy beyond the others (slowest first, each with the median of the other stages'
    busy times), its median step and the evidence that its ranks share CPUs."""

    stages: dict[int, _Stage]
    slow: list[tuple[_Stage, float]]
    step: float
    sharing: list[Evidence]


def _stages(ranks: list[RankFacts]) -> dict[int, _Stage]:
    """The job's pipeline stages with a busy time, by stage number."""
    busy = {r.rank: b for r in ranks if r.layout is not None and r.layout.pp_size > 1
            and (b := windowed(r, BUSY)) is not None and b > 0}
    timed = sorted((r for r in ranks if r.rank in busy), key=lambda r: (r.layout.pp_stage if r.layout else 0, r.rank))
    return {stage: _Stage(stage, members, statistics.median_low(busy[r.rank] for r in members))
            for stage, members in group_by(timed, lambda r: r.layout.pp_stage)}


def _slow_stages(facts: Facts, job: str, ranks: list[RankFacts], t: types.SimpleNamespace) -> _Unbalanced | None:
    """The stages of a job busy beyond the median of the others by ``stage_ratio`` (``stage_shared_cpu_ratio`` where
    its ranks share CPUs) and by ``stage_min_step_share`` of its median step; None when none is, or fewer than two
    stages are known."""
    stages = _stages(ranks)
    if len(stages) < 2:
        return None
    steps = [s for stage in stages.values() for r in stage.ranks if (s := windowed(r, "step_seconds")) is not None]
    if not steps:
        return None
    step = median(steps)
    timed = [r for stage in stages.values() for r in stage.ranks]
    sharing = cpu_sharing(facts, ranks)
    if not sharing and all(r.gpu_uuid is None and r.gpu_index is None for r in timed):
        sharing = [Evidence(f"the ranks of job {job} compute on CPUs, whose cores they share with each other and the "
                            "rest of the host: their timings include waiting for a core", Where(job=job),
                            {"cpu_ranks": len(timed)})]
    ratio = max(t.stage_ratio, t.stage_shared_cpu_ratio) if sharing else t.stage_ratio
    busy = [stage.busy for stage in stages.values()]
    slow = [(stage, others) for stage, others in zip(stages.values(), medians_of_others(busy), strict=True)
            if stage.busy > ratio * others and stage.busy - others >= t.stage_min_step_share * step
            and _extra_phase(stage, [other for other in stages.values() if other is not stage]) != "data"]
    if not slow:
        return None
    slow.sort(key=lambda pair: -pair[0].busy / pair[1])
    return _Unbalanced(stages, slow, step, sharing)


def _holds(stage: _Stage) -> tuple[str, ...] | None:
    """The modules a stage holds, from the first of its ranks whose hello names them."""
    return next((r.layout.stage_modules for r in stage.ranks if r.layout and r.layout.stage_modules is not None), None)


def _modules_text(modules: tuple[str, ...]) -> str:
    shown = ", ".join(modules[:12])
    return f"{shown}, ... ({len(modules)} modules)" if len(modules) > 12 else shown


def _phase_extras(slow: _Stage, others: list[_Stage]) -> list[tuple[float, str, float, float]]:
    """Each phase a slow stage reports: (its extra over the other stages' median of that phase, the phase, its
    median there, the other stages' median)."""
    found = []
    for field in PHASE_TIMINGS:
        own = slow.median_of(field)
        theirs = [v for stage in others if (v := stage.median_of(field)) is not None]
        if own is not None:
            usual = median(theirs) if theirs else 0.0
            found.append((own - usual, _PHASE_OF[field], own, usual))
    return found


def _extra_phase(slow: _Stage, others: list[_Stage]) -> str | None:
    """The phase holding most of a slow stage's extra time; None when it reports none."""
    found = _phase_extras(slow, others)
    return max(found)[1] if found else None


@rule("PERF006", family=FAMILY, view="heatmap", severity=Severity.WARNING, title="Pipeline stages unbalanced",
      needs=(needs.BUSY, needs.LAYOUT),
      thresholds=_STAGES,
      coverage=(PIPELINE_STAGES_UNBALANCED,))
def stages_unbalanced(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """A pipeline runs at the pace of its slowest stage: every micro-batch passes through each stage in turn, so a
    stage busy longer than the others makes its neighbours wait for its activations (forward) and gradients
    (backward) in their receives, every micro-batch, and the whole pipeline idles the difference on every other
    stage. The usual cause is the split: the layers (and the embedding on the first stage, the output layer and the
    loss on the last) are not spread by their cost. Each stage's busy time (the step without its waits in
    collectives, as PERF002 judges a straggler: its window median) is the lower median over its ranks, its tensor-
    and data-parallel peers, which do the same work; a stage whose figure exceeds the median of the other stages' by
    stage_ratio and by stage_min_step_share of the job's median step is named, with its ranks, its busy time against
    the others', the wait of the other stages in collectives (their receives from it among them), the phase its
    extra time is in, and the modules it holds where its hellos say (``stage_modules``). The fix is to move layers
    from it to the others. A stage whose extra time is mostly its wait for data (in pipeline parallelism the first
    stage loads the input) is not named: moving layers does not speed a loader, and a wait most ranks of a stage
    share is PERF003's (the input pipeline).

    Kept apart from a straggler (PERF002): the stage's figure is the lower median of its ranks' busy times, so one
    slow rank or one slow data-parallel replica does not move it where the stage has three or more ranks (dp ≥ 3,
    or a tensor-parallel group per replica), and with two ranks (dp = 2, tp = 1) it is the faster one's: a stage
    is named only when all its replicas are slow alike, which a slow device does not do to two replicas at once;
    one slow rank of two is PERF002's (peers: the same stage). A stage of one rank (tp = dp = 1) cannot be told
    from a slow device on that rank: the finding says to check the device where the extra is not in compute
    proportional to its layers. Kept apart from the bubble (PERF001): where a stage is named here, PERF001 does not
    also report a measured bubble above the schedule's (it shares these thresholds to know). Ranks computing on
    CPUs share cores and only a larger gap (stage_shared_cpu_ratio) counts. A source that sees only some stages of
    a job (an agent on one node of several) compares the stages it sees, and says so."""
    for job, ranks in facts.jobs().items():
        found = _slow_stages(facts, job, ranks, t)
        if found is None:
            continue
        stages = found.stages
        slowest, others_busy = found.slow[0]
        others = [stage for number, stage in stages.items() if number != slowest.stage]
        layout = slowest.ranks[0].layout
        assert layout is not None, "staged ranks have a layout"
        evidence = []
        for stage, theirs in found.slow:
            holds = _holds(stage)
            evidence.append(Evidence(
                f"stage {stage.stage} ({describe_ranks(stage.ranks)}) is busy {stage.busy:.3g} s per step "
                f"({window_text(stage.ranks[0])}, the lower median of its {len(stage.ranks)} rank(s)), "
                f"{stage.busy / theirs:.2f}x the {theirs:.3g} s median of the other stages, in a {found.step:.3g} s "
                "step" + (f"; it holds {_modules_text(holds)}" if holds else ""),
                Where(job=job, rank=stage.ranks[0].rank if len(stage.ranks) == 1 else None),
                {"pp_stage": stage.stage, "ranks": [r.rank for r in stage.ranks], "busy_seconds": stage.busy,
                 "others_seconds": theirs, "ratio": stage.busy / theirs, "step_seconds": found.step,
                 "modules": list(holds) if holds else None}))
        extras = _phase_extras(slowest, others)
        if extras:
            _, phase, own, theirs_phase = max(extras)
            evidence.append(Evidence(
                f"stage {slowest.stage}'s extra time is in {_PHASE_ADVICE[phase][0]}: {own:.3g} s against the "
                f"other stages' {theirs_phase:.3g} s", Where(job=job),
                {"pp_stage": slowest.stage, "phase": phase, "seconds": own, "others_seconds": theirs_phase}))
        for stage in others:
            if any(stage is slow for slow, _ in found.slow):
                continue
            wait, bubble, holds = stage.median_of("exposed_collective_seconds"), stage.median_of("bubble_ratio"), \
                _holds(stage)
            evidence.append(Evidence(
                f"stage {stage.stage} ({describe_ranks(stage.ranks)}): busy {stage.busy:.3g} s"
                + (f", waits {wait:.3g} s a step in collectives (its receives from the slow stage among them)"
                   if wait is not None else "")
                + (f", idle {ratio_text(bubble)} of its schedule" if bubble is not None else "")
                + (f"; holds {len(holds)} module(s)" if holds else ""),
                Where(job=job, rank=stage.ranks[0].rank if len(stage.ranks) == 1 else None),
                {"pp_stage": stage.stage, "busy_seconds": stage.busy, "wait_seconds": wait, "bubble_ratio": bubble,
                 "modules": len(holds) if holds else None}))
        if len(stages) < layout.pp_size:
            evidence.append(Evidence(
                f"only stage(s) {', '.join(str(s) for s in sorted(stages))} of the job's {layout.pp_size} are seen "
                "by this source (busy times over a full window): the others are not compared", Where(job=job),
                {"stages_seen": len(stages), "pp_size": layout.pp_size}))
        if not _holds(slowest):
            evidence.append(Evidence("which modules each stage holds is unknown: the hellos carry no stage_modules",
                                     Where(job=job)))
        evidence += found.sharing
        first_or_last = ("the first stage also holds the embedding and loads the data" if slowest.stage == 0 else
                         "the last stage also holds the output layer and the loss"
                         if slowest.stage == layout.pp_size - 1 else "")
        holds = _holds(slowest)
        yield Issue(
            title=f"pipeline stage {slowest.stage} of job {job} is busy {slowest.busy / others_busy:.2f}x the other "
                  "stages: they wait for it every micro-batch",
            evidence=capped(evidence, what="stages"),
            fix=f"move layers from stage {slowest.stage}"
                + (f" ({_modules_text(holds)})" if holds else "")
                + " to the other stages" + (f" ({first_or_last}: give it fewer layers)" if first_or_last else "")
                + ": in torchtitan, pipeline_parallel_split_points ([parallelism] of its job config: the module each "
                  "stage after the first starts with); in Megatron-LM, --decoder-first-pipeline-num-layers and "
                  "--decoder-last-pipeline-num-layers (uneven first and last stages); with torch.distributed."
                  "pipelining's own split, fewer modules in that stage's PipelineStage. Where its extra time is not "
                  "in compute (the phase above), moving layers does not help: that phase's own cause does (its "
                  "data loader, its callbacks); and a stage of one rank slow on its own may be its device (HW005, "
                  "HW002 on its node)",
            reason="A pipeline runs at the pace of its slowest stage: every other stage waits for it in its receives "
                   "on every micro-batch, so its extra time is idle time on every other GPU of the pipeline.",
        )
