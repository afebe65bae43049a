"""Hangs: ranks stuck in a collective, who they wait for and what that rank does instead; mismatched collectives;
a transport that stopped; ranks that died; ranks that said hello and never reported a step; every rank stopped
outside any collective.

Every rule reads the ranks' progress records (schema "progress"), which the hooks send only while a rank is overdue:
it has made no progress (no phase, collective or step began or ended) for longer than its own rhythm allows, a
multiple of its median step with a floor (gpuwatch.trainer.hooks.progress). A rank counts as stuck here once it has
also been still for at least `stall_seconds`. For each stuck rank in a collective the members of that collective's
process group (from the hello) say who it waits for: the members not in the same collective, with the same
sequence number on that group. Following those waits from rank to rank leads to the ranks that wait for no one:
the cause. This is the "who is missing" question PyTorch's Flight Recorder answers from its dumps after the
watchdog's timeout (PyTorch docs, "Flight Recorder for Debugging Stuck Jobs"), asked live of every rank's state.
Where every rank is stuck and none is in a collective the hooks know, there are no waits to follow: HANG006 names
each rank's phase, the rank that stopped first and its stack.

A rank that ended its training but whose process never exits (HANG007) keeps its job from ending just as surely.

Past 500 lines on purpose: the HANG rules share what a rank is doing (stuck, dead, closed, in which collective) and
who waits for whom, in one family.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import types
from collections.abc import Iterator

from gpuwatch.diagnosis import needs
from gpuwatch.diagnosis.coverage import CLOSED_NOT_EXITED, NO_STEP_SINCE_HELLO, RANK_OVERDUE_DEAD_OR_FAILED
from gpuwatch.diagnosis.facts import (
    AfterClose,
    Facts,
    InFlightFacts,
    RankFacts,
    Where,
    describe_ranks,
    group_by,
    group_members,
    rank_list,
)
from gpuwatch.diagnosis.registry import Evidence, Issue, Severity, Threshold, rule
from gpuwatch.diagnosis.rules.common import capped, world_size
from gpuwatch.protocol.schema import P2P_OPS

FAMILY = "hangs"

_STALL = {"stall_seconds": Threshold(5.0, "chosen: at least a few heartbeats (1 s) past the hooks' own overdue mark "
                                           "(5x the median step, 3 s at least), far below NCCL's 10-minute watchdog")}


#: Errors a rank raises because a peer went away (gloo: "Connection reset by peer", "Connection closed by peer";
#: NCCL: "remote process exited"): consequences of another rank's death, not a cause.
_PEER_GONE = re.compile(r"connection (reset|closed)|by peer|remote (process|worker|peer)", re.IGNORECASE)


def _peer_gone(rank: RankFacts) -> bool:
    progress = rank.progress
    return progress is not None and progress.error is not None and bool(_PEER_GONE.search(progress.error))


def _stuck(rank: RankFacts, t: types.SimpleNamespace) -> bool:
    progress = rank.progress
    return progress is not None and progress.error is None and progress.stalled_seconds >= max(
        t.stall_seconds, progress.overdue_seconds)


def _closed(rank: RankFacts) -> bool:
    """The rank's hooks were closed: it ended its training, and its process's exit is a normal end."""
    return rank.progress is not None and rank.progress.phase == "closed"


def _dead(rank: RankFacts) -> bool:
    return ((rank.exited_at is not None and not _closed(rank))
            or (rank.progress is not None and rank.progress.error is not None))


def _collective_of(rank: RankFacts | None) -> InFlightFacts | None:
    """The collective a rank's latest progress record has it in (None: none, or the record is a step's error)."""
    progress = rank.progress if rank is not None else None
    return progress.collective if progress is not None and progress.error is None else None


def _collective_text(collective: InFlightFacts) -> str:
    members = f" [{rank_list(collective.members)}]" if collective.members is not None else ""
    return f"{collective.op} #{collective.seq} on {collective.group}{members}"


def _doing(rank: RankFacts) -> str:
    """What a rank does instead of joining, in words."""
    if rank.exited_at is not None:
        return "its process is gone"
    progress = rank.progress
    if progress is not None and progress.error is not None:
        return f"it raised {progress.error}"
    if progress is None:
        last = rank.last.step if rank.last is not None else 0
        return f"it sends nothing: its last record is step {last} (it died without a trace, or stopped reporting)"
    where = f", at {progress.stack_top}" if progress.stack_top else ""
    if progress.collective is not None:
        return f"it waits in {_collective_text(progress.collective)} for {progress.stalled_seconds:.0f} s{where}"
    data = " (the data loader)" if progress.phase == "data" else ""
    return (f"it is in phase {progress.phase}{data} for {progress.stalled_seconds:.0f} s after step "
            f"{progress.step}{where}")


def _in_same(rank: RankFacts | None, collective: InFlightFacts) -> bool:
    other = _collective_of(rank)
    return other is not None and other.key == collective.key and other.seq == collective.seq


def _waits(ranks: dict[int, RankFacts]) -> dict[int, set[int]]:
    """For each overdue rank in a collective whose members are known: the members not in it with it. Ranks not yet
    past the stall threshold count too (a rank that joined the wait a moment ago waits all the same); whether
    the job is hung is judged by the ranks that are (`_stuck`)."""
    waits = {}
    for rank in ranks.values():
        collective = _collective_of(rank)
        if collective is not None and collective.members is not None:
            waits[rank.rank] = {m for m in collective.members
                                if m != rank.rank and not _in_same(ranks.get(m), collective)}
    return waits


def _waits_without_members(ranks: dict[int, RankFacts], t: types.SimpleNamespace) -> dict[int, set[int]]:
    """Where no group's members are known (Prometheus exports the hello's groups for the default group only):
    every stuck rank in a collective waits for the job's stuck ranks outside any collective."""
    outside = {r.rank for r in ranks.values() if _stuck(r, t) and _collective_of(r) is None}
    return {r.rank: set(outside) for r in ranks.values()
            if outside and _stuck(r, t) and _collective_of(r) is not None}


def _in_flight(rank: RankFacts) -> InFlightFacts:
    """The collective of a rank `_waits` found waiting (it has one)."""
    collective = _collective_of(rank)
    assert collective is not None
    return collective


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_list(ranks)}"


def _mismatched(rank: RankFacts | None, collective: InFlightFacts, t: types.SimpleNamespace) -> bool:
    """A stuck rank in another collective on the same group (another sequence number or op): HANG002's."""
    other = _collective_of(rank) if rank is not None and _stuck(rank, t) else None
    return other is not None and other.key == collective.key and (other.seq, other.op) != (collective.seq,
                                                                                        collective.op)


@dataclasses.dataclass(frozen=True)
class _Drift:
    """Members of one process group that disagree on how many collectives they made on it by the end of `step`."""

    group: str
    members: tuple[int, ...]
    step: int
    counts: dict[int, int]  # rank -> calls on the group by the end of `step`, from its step record
    in_call: dict[int, int]  # rank still in `step` -> the call on the group it is in: it makes at least that many
    named: tuple[int, ...]  # the odd ones out: fewer calls than the rest, or off a clear majority's count


def _drifts(ranks: dict[int, RankFacts]) -> list[_Drift]:
    """Every member of a group makes the same collectives on it in the same order, so by the end of a step each
    has made as many as the others: the step records' `collective_calls`, compared between ranks at the same
    step. A rank still in that step that is already in a later call than another member's count at its end
    disagrees too (the count only grows). Send/recv are left out: pairs of ranks, not the group, make them."""
    counted: dict[tuple[str, tuple[int, ...], int], dict[int, int]] = {}
    for rank in ranks.values():
        if rank.last is None or not rank.last.collective_calls:
            continue
        for group, calls in rank.last.collective_calls.items():
            members = group_members(rank.process_groups, rank.layout.world_size if rank.layout else None, group)
            if members is not None and rank.rank in members:
                counted.setdefault((group, members, rank.last.step), {})[rank.rank] = calls
    drifts = []
    for (group, members, step), counts in sorted(counted.items()):
        in_call = {}
        for member in members:
            other = ranks.get(member)
            collective = _collective_of(other)
            if (member not in counts and other is not None and other.progress is not None
                    and other.progress.step == step - 1 and collective is not None
                    and collective.key == (group, members) and collective.op not in P2P_OPS):
                in_call[member] = collective.seq
        low = min(counts.values())
        if len(set(counts.values())) == 1 and all(seq <= low for seq in in_call.values()):
            continue
        usual, agreeing = collections.Counter(counts.values()).most_common(1)[0]
        if len(counts) >= 3 and 2 * agreeing > len(counts):  # a clear majority: the others are odd
            named = [r for r, calls in counts.items() if calls != usual] + [r for r, seq in in_call.items()
                                                                            if seq > usual]
        else:  # two sides, or no majority: the ranks behind (a skipped call is the usual bug)
            named = [r for r, calls in counts.items() if calls == low]
        drifts.append(_Drift(group, members, step, counts, in_call, tuple(sorted(named))))
    return drifts


@rule("HANG001", family=FAMILY, view="hang", severity=Severity.CRITICAL, title="Ranks missing at a collective",
      needs=(needs.TELEMETRY,),
      thresholds=_STALL,
      coverage=(RANK_OVERDUE_DEAD_OR_FAILED,))
def missing_at_collective(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """Ranks wait in a collective that some member of its process group never entered. The waiting ranks are
    not the problem: each waits for the last member to arrive, and a rank waiting elsewhere passes the wait on.
    Following who waits for whom leads to the ranks that wait for no one, which this names with what each does
    instead: its phase, the innermost frame of its own code, or its silence (a rank that died without a trace
    leaves its log at its last step). One finding per job. Ranks that died or raised are HANG004's."""
    for job, members in facts.jobs().items():
        ranks = {r.rank: r for r in members}
        waits = _waits(ranks) or _waits_without_members(ranks, t)
        if not any(_stuck(ranks[w], t) for w in waits):
            continue
        waited_for = set().union(*waits.values())
        drifted = {r for drift in _drifts(ranks) for r in drift.named}  # HANG002's: they skipped a call
        roots = sorted(m for m in waited_for - drifted if m not in waits and not (m in ranks and _dead(ranks[m]))
                       and not any(_mismatched(ranks.get(m), _in_flight(ranks[w]), t) for w in waits if m in waits[w]))
        if not roots:
            continue
        evidence = []
        for root in roots:
            direct = sorted(w for w, missing in waits.items() if root in missing)
            calls: dict[str, list[int]] = {}
            for waiter in direct:
                calls.setdefault(_collective_text(_in_flight(ranks[waiter])), []).append(waiter)
            rank = ranks.get(root)
            doing = _doing(rank) if rank is not None else "the agent knows nothing of it (no record reached it)"
            first = _in_flight(ranks[direct[0]])
            evidence.append(Evidence(
                f"rank {root} never entered "
                + " nor ".join(f"{call} ({_ranks_text(waiters)} wait(s) there)" for call, waiters in calls.items())
                + f": {doing}",
                rank.where if rank is not None else ranks[direct[0]].where,
                {"rank": root, "op": first.op, "group": first.group, "seq": first.seq, "waiting": direct,
                 "phase": rank.progress.phase if rank and rank.progress else None,
                 "stack_top": rank.progress.stack_top if rank and rank.progress else None}))
        chained = sorted(set(waits) - {w for w, missing in waits.items() if missing & set(roots)})
        if chained:
            evidence.append(Evidence(f"{describe_ranks(ranks[w] for w in chained)} wait(s) on ranks that wait in turn"
                                     " (the hang spreads along the pipeline and the other groups)",
                                     values={"waiting": chained}))
        yield Issue(
            title=f"job {job} hangs: {_ranks_text(roots)} missing at a collective that {len(waits)} rank(s) wait in",
            evidence=capped(evidence, what="ranks"),
            fix="look at what the named rank does instead (its stack above): a data loader or a filesystem that "
                "stopped answering, a branch only that rank takes (a condition on rank, data or time that skips a "
                "collective), or an exception swallowed in a background thread; py-spy dump --pid PID shows every "
                "thread; until fixed, set a process-group timeout (init_process_group(timeout=...)) so the job fails "
                "instead of idling",
            reason="a collective completes only when every member of its group has entered it: one rank that never "
                   "comes holds every GPU of the job idle until a watchdog kills it (NCCL's after 10 minutes by "
                   "default)")


_MISMATCH_FIX = ("make every rank of the group issue the same collectives in the same order: look for a collective "
                 "inside a condition that differs between ranks (rank, data, an early exit or a skipped step on one "
                 "rank, an unused parameter under DDP without find_unused_parameters); TORCH_DISTRIBUTED_DEBUG=DETAIL "
                 "checks the calls' order and shapes on every collective")
_MISMATCH_REASON = ("collectives match by order on a group, not by name: after one rank skips a call, every later call "
                    "pairs with the wrong one and the group hangs or exchanges the wrong tensors")


@rule("HANG002", family=FAMILY, severity=Severity.CRITICAL, title="Collective mismatch", needs=(needs.TELEMETRY,),
      view="hang", thresholds=_STALL,
      coverage=(RANK_OVERDUE_DEAD_OR_FAILED,))
def collective_mismatch(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """Ranks of one process group stuck in different collectives on it: another sequence number (a rank
    skipped or added a call, so its count drifted from its peers') or another op at the same number. Each side
    waits for a call the other never makes. This is the desync PyTorch's Flight Recorder analyser reports from
    its dumps after the timeout; here it comes from each rank's own count of the calls it made on the group.
    The counts tell it before any rank is stuck, too: members of a group that made different numbers of calls on
    it by the end of the same step (`_drifts`). A skipped all-reduce whose successor has the same size pairs with
    it silently, and the job runs on with that rank a call behind until its peers wait at the end for a call it
    never makes; in a hybrid-parallel job the drift soon meets another group's traffic and the ranks wait on
    each other in a circle, where no rank is missing and only the counts tell which one skipped."""
    for job, members in facts.jobs().items():
        stuck_groups = set()
        by_group: dict[tuple[str, tuple[int, ...] | None], dict[tuple[int, str], list[RankFacts]]] = {}
        for rank in members:
            collective = _collective_of(rank)
            if collective is not None and _stuck(rank, t):
                by_group.setdefault(collective.key, {}).setdefault((collective.seq, collective.op), []).append(rank)
        for (group, ranks_of_group), calls in sorted(by_group.items(), key=lambda item: str(item[0])):
            if len(calls) < 2:
                continue
            stuck_groups.add((group, ranks_of_group))
            sides = sorted(calls.items())
            text = "; ".join(f"{describe_ranks(side)} in {op} #{seq}" for (seq, op), side in sides)
            members_text = f" [{rank_list(ranks_of_group)}]" if ranks_of_group is not None else ""
            yield Issue(
                title=f"job {job}: collective mismatch on {group}{members_text}: {text}",
                evidence=tuple(Evidence(f"{describe_ranks(side)}: {op} #{seq} on {group}{members_text}, stuck for "
                                        f"{max(r.progress.stalled_seconds for r in side if r.progress):.0f} s",
                                        side[0].where, {"op": op, "seq": seq, "group": group,
                                                        "ranks": [r.rank for r in side]})
                               for (seq, op), side in sides),
                fix=_MISMATCH_FIX,
                reason=_MISMATCH_REASON)
        ranks = {r.rank: r for r in members}
        for drift in _drifts(ranks):
            if (drift.group, drift.members) in stuck_groups:
                continue
            where = f"{drift.group} [{rank_list(drift.members)}]"
            others = sorted((set(drift.counts) | set(drift.in_call)) - set(drift.named))
            evidence = [Evidence(f"rank {r}: {calls} collective call(s) on {where} by the end of step {drift.step}",
                                 ranks[r].where, {"rank": r, "group": drift.group, "step": drift.step, "calls": calls,
                                                  "odd": r in drift.named})
                        for r, calls in sorted(drift.counts.items())]
            evidence += [Evidence(f"rank {r}: still in step {drift.step}, already in call #{seq} on {where}",
                                  ranks[r].where, {"rank": r, "group": drift.group, "step": drift.step,
                                                   "in_call": seq, "odd": r in drift.named})
                         for r, seq in sorted(drift.in_call.items())]
            yield Issue(
                title=f"job {job}: collective mismatch on {where}: {_ranks_text(list(drift.named))} out of step with "
                      f"{_ranks_text(others)} by step {drift.step}, a collective skipped or added",
                evidence=capped(evidence, what="ranks"),
                fix=_MISMATCH_FIX,
                reason=_MISMATCH_REASON)


@rule("HANG003", family=FAMILY, severity=Severity.CRITICAL, title="A collective that every rank entered does not end",
      view="hang", needs=(needs.TELEMETRY,),
      thresholds=_STALL,
      coverage=(RANK_OVERDUE_DEAD_OR_FAILED,))
def collective_stalled(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """Every member of a process group is in the same collective, with the same sequence number, and none
    has made progress: no rank is missing, so the program is not at fault but the transport (a link down,
    an InfiniBand port that fell back or erred, a NCCL communicator stuck). The interconnect findings of the
    nodes involved (HW003, NCCL001-005) say more."""
    for job, members in facts.jobs().items():
        ranks = {r.rank: r for r in members}
        seen: set[tuple[str, tuple[int, ...] | None, int]] = set()
        for rank in members:
            collective = _collective_of(rank)
            if collective is None or not _stuck(rank, t):
                continue
            key = (*collective.key, collective.seq)
            if key in seen or collective.members is None or len(collective.members) < 2:
                continue
            seen.add(key)
            if not all(_in_same(ranks.get(m), collective) and _stuck(ranks[m], t) for m in collective.members):
                continue
            involved = [ranks[m] for m in collective.members]
            nodes = sorted({r.host for r in involved if r.host})
            yield Issue(
                title=f"job {job}: {_collective_text(collective)} does not end, with every member in it",
                evidence=(Evidence(f"{describe_ranks(involved)} in {_collective_text(collective)} for "
                                   f"{min(r.progress.stalled_seconds for r in involved if r.progress):.0f} s or more; "
                                   f"nodes {', '.join(nodes) or 'unknown'}", rank.where,
                                   {"op": collective.op, "group": collective.group, "seq": collective.seq,
                                    "ranks": [r.rank for r in involved]}),),
                fix="check the interconnect of the nodes named (gpuwatch diagnose --agent on each: HW003 ports, "
                    "NCCL00x settings), NCCL_DEBUG=INFO for the communicator's transport, and the NCCL watchdog's "
                    "own report (TORCH_NCCL_DUMP_ON_TIMEOUT=1 writes a Flight Recorder dump)",
                reason="with every member inside the call, nothing in the program is missing: the bytes are not "
                       "moving")


@rule("HANG004", family=FAMILY, view="hang", severity=Severity.CRITICAL, title="A rank died", needs=(needs.TELEMETRY,),
      thresholds={"followed_within_seconds": Threshold(
          0.01, "chosen: ranks whose deaths lie this close (error records, pidfd exit times) died together; the "
                "peers of a dead rank fail milliseconds after it (gloo: connection reset) or are stopped by the "
                "launcher")},
      coverage=(RANK_OVERDUE_DEAD_OR_FAILED,))
def rank_died(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """A rank's process is gone (the agent found its pid missing) or one of its steps raised: which rank, when,
    how, and the ranks left waiting for it. The cause is the first to die that did not die of a peer's death (an
    error about a connection reset or closed by a peer is a consequence); the rest follow it. A process killed by
    a signal (the OOM killer's SIGKILL, a node's failing hardware) leaves no exception: only its absence tells.
    Its peers wait in their next collective until a watchdog ends the job."""
    for job, members in facts.jobs().items():
        ranks = {r.rank: r for r in members}
        dead = [r for r in members if _dead(r)]
        if not dead:
            continue
        if all(_peer_gone(r) for r in dead):  # a run log knows no exits: the silent rank is the one they lost
            dead = [r for r in members if not _dead(r) and r.progress is None] + dead
        # First to die first: a launcher ends the others within moments of the first death. A rank that raised
        # counts from its error; one without an exit time (a run log) last.
        dead.sort(key=lambda r: (_peer_gone(r), r.died_at is None, r.died_at or 0.0, r.rank))
        first_at = dead[0].died_at
        first = [r for r in dead if _peer_gone(r) == _peer_gone(dead[0]) and (
            r.died_at is None or first_at is None or abs(r.died_at - first_at) <= t.followed_within_seconds)]
        followers = [r for r in dead if r not in first]
        waits = _waits(ranks)
        evidence = []
        for rank in first:
            progress = rank.progress
            if progress is not None and progress.error is not None:
                how = f"it raised {progress.error}"
            elif rank.exited_at is not None:
                how = ("its process is gone without an exception (killed by a signal: the OOM killer's SIGKILL, a "
                       "crash in native code)")
            else:
                how = ("it went silent without an exception while its peers lost their connections to it (killed by "
                       "a signal?)")
            after = rank.last.step if rank.last is not None else (progress.step if progress else 0)
            waiting = sorted(w for w, missing in waits.items() if rank.rank in missing)
            evidence.append(Evidence(
                f"rank {rank.rank}: {how}; its last step record: {after}"
                + (f"; {_ranks_text(waiting)} wait(s) for it in {_collective_text(_in_flight(ranks[waiting[0]]))}"
                   if waiting else ""),
                rank.where, {"rank": rank.rank, "step": after, "exited_at": rank.exited_at,
                             "error": progress.error if progress is not None else None, "waiting": waiting}))
        if followers and first_at is not None:
            lag = max(abs((r.died_at or first_at) - first_at) for r in followers)
            evidence.append(Evidence(f"{describe_ranks(followers)} ended within {lag:.3f} s of it, their "
                                     "connections to it broken or stopped by the launcher: consequences",
                                     values={"ranks": [r.rank for r in followers]}))
        yield Issue(
            title=f"job {job}: {describe_ranks(first)} died" + (f", then {len(followers)} more" if followers else ""),
            evidence=capped(evidence, what="ranks"),
            fix="read the rank's own output for the exception or the signal (dmesg for the OOM killer, the "
                "launcher's exit status: -9 is SIGKILL); make the launcher end the whole job when one rank dies "
                "(torchrun does; a process-group timeout bounds the wait) and resume from the last checkpoint",
            reason="the job cannot go on without the rank: its peers wait for it in every collective it belongs to")


def _never_stepped(rank: RankFacts) -> bool:
    """The rank said hello (a rank is known by its hello or a record after it) and reported no step since, and is
    neither dead (HANG004's) nor waiting in a collective (HANG001-003's): it runs, or ran to its end, unmeasured."""
    return rank.last is None and not rank.steps and not _dead(rank) and _collective_of(rank) is None


def _silence(rank: RankFacts) -> tuple[str, float | None]:
    """How sure the silence of a rank without a step is, in words (``{age}``: the oldest hello's age among the ranks
    one evidence line names), and how long ago it said hello where the source knows."""
    age = rank.hello_age_seconds
    if _closed(rank):
        return "hooks closed at the end of the run, no step record before", None
    if age is None:
        return "no step record; when the hello came is unknown to this source", None
    if math.isinf(age):
        return "the run log ends after the hello without a step record", None
    return "no step record since the hello, {age:.0f} s ago (the oldest, by the source's clock)", age


@rule("HANG005", family=FAMILY, view="hang", severity=Severity.WARNING, title="Ranks said hello but reported no step",
      needs=(needs.TELEMETRY,),
      thresholds={"min_age_seconds": Threshold(
          120.0, "twice the hooks' allowance for a first step: until 3 steps have ended, a rank that makes no "
                 "progress for 60 s (compilation, the first collectives' set-up) is reported overdue; a rank that said "
                 "hello twice that long ago and ended no step runs without its steps being seen")},
      coverage=(NO_STEP_SINCE_HELLO,))
def never_stepped(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """A rank whose hello reached the source but no step record after it: the instrumentation runs in the rank's
    process and measured nothing of its training. Under `gpuwatch run` a step is an optimizer step, so a loop that
    never steps a torch optimizer (a hand-written update, a framework's own) ends none; or the rank's steps were not
    seen (its instrumentation failed after the hello). Without this finding the job would look like one with nothing
    to judge: every timing and learning rule silent, "0 steps". A rank that said hello a moment ago is starting, not
    silent: where the source knows the hello's age (the agent, Prometheus) a rank is judged once it said hello
    min_age_seconds ago, by then past the hooks' own allowance for a first step, and the evidence says how long ago;
    a rank whose hooks were closed ended its run without a step, and a run log, read after the run, holds all the
    rank ever sent, so both are certain. A job with a rank waiting in a collective is hung, and a dead rank died:
    HANG001-004 judge those. A rank overdue outside any collective before its first step (its loop moves nothing the
    hooks see, or it compiles for minutes) is named here, with how long it has been still."""
    for job, members in facts.jobs().items():
        if any(_collective_of(r) is not None for r in members):
            continue
        quiet = [r for r in members if _never_stepped(r) and (
            _closed(r) or r.hello_age_seconds is None or r.hello_age_seconds >= t.min_age_seconds)]
        if not quiet:
            continue
        evidence = []
        for (host, how), ranks in group_by(quiet, lambda r: (r.host, _silence(r)[0])):
            ages = [age for r in ranks if (age := _silence(r)[1]) is not None]
            oldest = max(ages, default=None)
            evidence.append(Evidence(
                f"{describe_ranks(ranks)} on {host or 'an unknown node'}: " + how.format(age=oldest),
                Where(node=host, job=job, rank=ranks[0].rank if len(ranks) == 1 else None),
                {"ranks": [r.rank for r in ranks], "hello_age_seconds": oldest}))
        still = [r for r in quiet if r.progress is not None and not _closed(r)]
        if still:
            stalled = max(r.progress.stalled_seconds for r in still if r.progress is not None)
            phases = sorted({r.progress.phase for r in still if r.progress is not None})
            evidence.append(Evidence(
                f"{describe_ranks(still)} overdue: no progress for up to {stalled:.0f} s, in phase {', '.join(phases)} "
                "(a long compilation, or a loop the hooks see nothing of)", Where(job=job),
                {"ranks": [r.rank for r in still], "stalled_seconds": stalled}))
        stepped = [r for r in members if r.last is not None]
        if stepped:
            evidence.append(Evidence(
                f"{describe_ranks(stepped)} of the job reported steps (up to step "
                f"{max(r.last.step for r in stepped if r.last is not None)}): their steps are seen, these ranks' "
                "are not", Where(job=job), {"ranks": [r.rank for r in stepped]}))
        what = f"{describe_ranks(quiet)} of {len(members)}" if stepped else describe_ranks(quiet)
        yield Issue(
            title=f"job {job}: {what} said hello but reported no step"
                  + ("" if stepped else ": gpuwatch measured nothing of its training"),
            evidence=capped(evidence, what="groups of ranks"),
            fix="read the end-of-run line `gpuwatch run` prints (how many ranks were instrumented, and why not: "
                "-I/-E/-S, torch never imported, no process group, an exception in the instrumentation); a loop "
                "that never calls a torch optimizer's step() (a hand-written update, a framework's own) ends no "
                "step `gpuwatch run` can see: mark its steps with the explicit hooks (`with monitor.step():`, "
                "README \"Training hooks\")",
            reason="a rank without step records is measured by no timing, learning or memory rule: the job would "
                   "look healthy only because nothing of it was seen")


#: The innermost frames of the first rank's stack an evidence line shows (the whole stack is in its values).
_STACK_SHOWN = 6


def _stopped_outside(members: list[RankFacts], t: types.SimpleNamespace) -> bool:
    """Every rank of the job the source sees is stuck outside any collective it knows of: none dead (HANG004's) or
    closed (a job that ends: its ranks close one by one), none in a collective (HANG001-003's), none without a step
    yet (HANG005's: before the first step a stall is a compilation or a loop the hooks do not see)."""
    return bool(members) and not any(
        _dead(r) or _closed(r) or _collective_of(r) is not None or _never_stepped(r) or not _stuck(r, t)
        for r in members)


@rule("HANG006", family=FAMILY, severity=Severity.CRITICAL, title="Every rank stopped, none in a known collective",
      view="hang", needs=(needs.TELEMETRY,),
      thresholds={**_STALL, "apart_seconds": Threshold(
          2.0, "progress records come about once a second (the watchdog's interval), each rank's stall measured when "
               "its own record was sent: ranks whose stalls lie less than two intervals apart cannot be ordered")},
      coverage=(RANK_OVERDUE_DEAD_OR_FAILED,))
def all_stopped(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """Every rank of a job has stopped making progress (each overdue by its own rhythm and still for at least
    stall_seconds) and none is inside a collective gpuwatch knows: no one waits in a call whose members say who is
    missing (HANG001), no call is mismatched (HANG002) or stalled with every member in it (HANG003). The job is
    stuck where gpuwatch does not see: a collective its hooks do not wrap (a framework's own communicator, a
    functional collective issued from C++, a barrier through the store; where PyTorch's Flight Recorder is on, the
    ranks' progress records name its oldest unfinished collective, and the finding shows it), a deadlock of the
    program's own (a lock, a queue, a thread it joins), a data loader or filesystem that stopped answering on every
    rank, or a checkpoint or evaluation that takes every rank far past its usual step (which ends: not a hang). The
    finding names each rank's last phase and how long it has been still, the rank that stopped first (the longest
    still: the others stopped after it, most likely waiting for it in what gpuwatch cannot name; stalls closer than
    apart_seconds cannot be ordered, and the finding says so), and its stack from its progress record (the agent and
    a run log carry it; Prometheus does not export stacks). A job with a dead rank is HANG004's, one whose ranks
    closed their hooks ends, and a rank that never stepped is HANG005's. A source that sees fewer ranks than the
    job's world size (an agent on one of its nodes) says so rather than that the whole job stopped: the ranks it
    does not see may be waiting in a collective for these."""
    for job, members in facts.jobs().items():
        if not _stopped_outside(members, t):
            continue
        still = sorted(members, key=lambda r: (-(r.progress.stalled_seconds if r.progress else 0.0), r.rank))
        first = still[0]
        progress = first.progress
        assert progress is not None, "a stuck rank has a progress record"
        tied = [r for r in still[1:] if r.progress is not None
                and progress.stalled_seconds - r.progress.stalled_seconds < t.apart_seconds]
        world = world_size(members)
        partial = world is None or world > len(members)
        evidence = []
        frames = progress.stack[-_STACK_SHOWN:]
        order = (f"{_ranks_text([r.rank for r in tied])} stopped within {t.apart_seconds:g} s of it, which first "
                 "cannot be told" if tied else
                 f"{progress.stalled_seconds - still[1].progress.stalled_seconds:.0f} s before the next"
                 if len(still) > 1 and still[1].progress is not None else "the only rank seen")
        evidence.append(Evidence(
            f"rank {first.rank} stopped first: still for {progress.stalled_seconds:.0f} s ({order}), in phase "
            f"{progress.phase} after step {progress.step}"
            + (f", at {progress.stack_top}; its stack, innermost first: {' ← '.join(reversed(frames))}" if frames else
               "; its stack is not known to this source (the agent and a run log carry it, Prometheus does not)"),
            first.where,
            {"rank": first.rank, "phase": progress.phase, "step": progress.step,
             "stalled_seconds": progress.stalled_seconds, "stack_top": progress.stack_top,
             "stack": list(progress.stack), "tied": [r.rank for r in tied]}))
        for (phase, step), ranks in group_by(sorted(still, key=lambda r: r.rank),
                                             lambda r: (r.progress.phase, r.progress.step) if r.progress else ("", 0)):
            stalls = [r.progress.stalled_seconds for r in ranks if r.progress is not None]
            span = f"{min(stalls):.0f} s" if round(min(stalls)) == round(max(stalls)) else \
                f"{min(stalls):.0f}-{max(stalls):.0f} s"
            data = " (the data loader)" if phase == "data" else ""
            evidence.append(Evidence(
                f"{describe_ranks(ranks)}: in phase {phase}{data} after step {step}, still for {span}",
                Where(job=job, rank=ranks[0].rank if len(ranks) == 1 else None),
                {"ranks": [r.rank for r in ranks], "phase": phase, "step": step,
                 "stalled_seconds": max(stalls), "min_stalled_seconds": min(stalls)}))
        recorded = [(r, r.progress.recorder) for r in still if r.progress is not None and r.progress.recorder]
        for rank, entry in recorded:
            evidence.append(Evidence(
                f"rank {rank.rank}: PyTorch's Flight Recorder has {entry.op} #{entry.seq} on process group "
                f"{entry.group}{f' ({entry.group_desc})' if entry.group_desc else ''} unfinished ({entry.state}): "
                "a collective the hooks did not see", rank.where,
                {"rank": rank.rank, "op": entry.op, "group": entry.group, "group_desc": entry.group_desc,
                 "seq": entry.seq, "state": entry.state, "p2p": entry.p2p}))
        if partial:
            evidence.append(Evidence(
                f"this source sees {len(members)} of the job's " + (f"{world} ranks" if world is not None else
                                                                   "ranks (its world size is unknown to it)")
                + ": the others may be waiting in a collective for these, or still running; diagnose them too "
                  "(--agent on their nodes, a run log of every rank, or --prometheus)",
                Where(job=job), {"ranks_seen": len(members), "world_size": world}))
        shortest = min(r.progress.stalled_seconds for r in still if r.progress is not None)
        what = f"all {len(members)} ranks" if not partial else (
            f"the {len(members)} ranks seen of {world}" if world is not None else f"the {len(members)} ranks seen")
        yield Issue(
            title=f"job {job} stopped: {what} still for {shortest:.0f} s or more, none in a collective gpuwatch "
                  f"sees; {_ranks_text(sorted([first.rank, *(r.rank for r in tied)]))} stopped first",
            evidence=capped(evidence, what="groups of ranks"),
            fix=("the Flight Recorder names the collective the ranks wait in (above): find where the job calls it, "
                 "and why a member of its group does not; " if recorded else "")
                + f"read the stack of rank {first.rank} (above; py-spy dump --pid PID shows every thread): a "
                "collective gpuwatch does not wrap (a framework's own communicator, one issued from C++, a store "
                "barrier) that it waits in, a deadlock of the program's own (a lock, a queue, a thread "
                "joined), or a data loader or filesystem that stopped answering; a checkpoint or an evaluation on "
                "every rank also stills them all and ends by itself. Until fixed, a process-group timeout "
                "(init_process_group(timeout=...)) makes the job fail instead of idling",
            reason="no rank makes progress and none is in a collective whose members would say who is missing: "
                   "the stacks, the first stopped rank's above all, are what is left to tell why")


def _idle_after_close(rank: RankFacts, t: types.SimpleNamespace) -> AfterClose | None:
    """What the source sees of the rank's process after its close, where the hooks closed min_age_seconds ago or
    more, the process has not exited, and it used at most max_cpu_share of a core since; else None."""
    after = rank.after_close
    if after is None or after.seconds < t.min_age_seconds or after.cpu_seconds > t.max_cpu_share * after.seconds:
        return None
    return after


@rule("HANG007", family=FAMILY, view="hang", severity=Severity.WARNING,
      title="A rank ended its training but its process does not exit", needs=(needs.TELEMETRY,),
      thresholds={"min_age_seconds": Threshold(
          60.0, "chosen: a process ends within seconds of its hooks closing (its model freed, "
                "destroy_process_group, the interpreter's exit); one still there a minute later without working is "
                "not ending"),
          "max_cpu_share": Threshold(
              0.02, "chosen: a process blocked on a lock or a thread it joins uses no CPU (both threads of PyTorch "
                    "#56297's deadlock wait); an evaluation, a checkpoint's write or an upload after the close keeps "
                    "its process far busier than 2 % of a core")},
      coverage=(CLOSED_NOT_EXITED,))
def stuck_at_exit(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """A rank whose hooks closed (it ended its training) and whose process, min_age_seconds later, has neither
    exited nor used more than max_cpu_share of a core since: it is stuck in its teardown. Its launcher (torchrun,
    Slurm's srun) waits for every rank's process, so the job never ends and holds its nodes, and nothing reports on
    the rank any more: its hooks are closed. One way there, met in jobs without gpuwatch too: a DDP model freed after
    ``destroy_process_group()`` as the script returns drops the last reference to the gloo process group, whose
    destructor joins its worker threads while holding the GIL, and a worker that needs the GIL to free its last
    tensor never ends (PyTorch issue #56297). Others: a teardown barrier a peer never joins, a non-daemon thread the
    interpreter waits for at exit. A rank still working after its close (an evaluation, a checkpoint's upload) uses
    CPU and is not named; one idle on purpose (waiting on a slow filesystem) is, with how little it used. Only the
    agent on the rank's node sees the process after the close (directly, or exported to Prometheus); a run log ends
    at the close and cannot tell, and an agent in another pid namespace sees no process: those ranks are not
    judged."""
    for job, members in facts.jobs().items():
        stuck = [(r, after) for r in members if (after := _idle_after_close(r, t)) is not None]
        if not stuck:
            continue
        evidence = []
        for rank, after in stuck:
            step = rank.progress.step if rank.progress is not None else 0
            evidence.append(Evidence(
                f"rank {rank.rank} (pid {after.pid} on {rank.host or 'an unknown node'}) closed its hooks "
                f"{after.seconds:.0f} s ago, after step {step}, and has not exited; its process used "
                f"{after.cpu_seconds:.2f} s of CPU since", rank.where,
                {"rank": rank.rank, "pid": after.pid, "step": step, "seconds_since_close": after.seconds,
                 "cpu_seconds_since_close": after.cpu_seconds}))
        ended = [r for r in members if r.exited_at is not None and _closed(r)]
        if ended:
            evidence.append(Evidence(f"{describe_ranks(ended)} of the job closed their hooks and exited",
                                     Where(job=job), {"ranks": [r.rank for r in ended]}))
        working = [r for r in members if r.after_close is not None and _idle_after_close(r, t) is None]
        if working:
            evidence.append(Evidence(
                f"{describe_ranks(working)}: closed too and not exited, but still working (or closed a moment ago): "
                "not named", Where(job=job), {"ranks": [r.rank for r in working]}))
        first = stuck[0][1]
        yield Issue(
            title=f"job {job}: {describe_ranks(r for r, _ in stuck)} ended training but did not exit: idle for "
                  f"{min(after.seconds for _, after in stuck):.0f} s or more since closing its hooks",
            evidence=capped(evidence, what="ranks"),
            fix=f"py-spy dump --native --pid {first.pid} (on its node) shows where it waits. A model that holds a "
                "process group (a DDP model's Reducer) freed after destroy_process_group() can deadlock gloo's "
                "destructor against its worker thread (PyTorch issue #56297): free the model before "
                "destroy_process_group(), or end the rank with os._exit(0) once its results are written; a rank in a "
                "teardown barrier waits for a peer that already left. Until then the launcher waits for it: end "
                "the process (its training is over)",
            reason="the launcher waits for every rank's process: the job never ends and keeps its nodes, and the "
                   "rank reports nothing more, its hooks closed")
