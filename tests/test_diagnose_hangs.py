"""The hang rules on facts built by hand: who waits for whom, mismatched sequence numbers, a transport that stopped,
deaths and their consequences, and what must stay quiet (a pause shorter than the stall threshold, a job whose
ranks all moved on)."""

from __future__ import annotations

from diagnose_facts import facts, rank
from test_diagnose_rules import fired, silent

from gpuwatch.agent.diagnosis.facts import InFlightFacts, ProgressFacts

DP = (0, 1, 2, 3)


def waiting(number: int, seq: int = 7, op: str = "all_reduce", stalled: float = 30.0, members=DP):
    return rank(number, dp=4, progress=ProgressFacts(
        step=3, phase="collective", stalled_seconds=stalled, overdue_seconds=3.0,
        collective=InFlightFacts(op=op, group="dp", members=members, seq=seq, bytes=1024, seconds=stalled),
        stack=("/site-packages/torch/distributed/distributed_c10d.py:3252 all_reduce",)))


def elsewhere(number: int, phase: str = "data", stalled: float = 30.0, **fields):
    return rank(number, dp=4, progress=ProgressFacts(
        step=3, phase=phase, stalled_seconds=stalled, overdue_seconds=3.0,
        stack=("/app/train.py:88 main", "/app/data.py:40 read_shard", "/usr/lib/python3.11/threading.py:327 wait")),
        **fields)


def test_hang001_names_the_rank_that_never_came_and_where_it_stands():
    (finding,) = fired("HANG001", facts(ranks=[waiting(0), waiting(1), waiting(2), elsewhere(3)]))
    (evidence, *_) = finding.evidence
    assert evidence.where.rank == 3 and evidence.values["waiting"] == [0, 1, 2]
    assert (evidence.values["op"], evidence.values["group"], evidence.values["seq"]) == ("all_reduce", "dp", 7)
    assert evidence.values["stack_top"] == "/app/data.py:40 read_shard"  # its own code, not threading's
    assert "phase data (the data loader)" in evidence.text


def test_hang001_follows_a_chain_of_waits_to_its_end():
    """Rank 1 waits on a pp group for rank 2, which waits on dp for rank 3, which waits for no one."""
    pp = rank(1, dp=4, progress=ProgressFacts(step=3, phase="collective", stalled_seconds=30, overdue_seconds=3,
                                              collective=InFlightFacts("recv", "pp", (1, 2), 40)))
    (finding,) = fired("HANG001", facts(ranks=[waiting(0, members=(0, 2, 3)), pp, waiting(2, members=(0, 2, 3)),
                                               elsewhere(3)]))
    roots = [e.where.rank for e in finding.evidence if e.where.rank is not None]
    assert roots == [3]
    assert finding.evidence[-1].values["waiting"] == [1]  # waits in turn


def test_a_pause_below_the_stall_threshold_and_a_job_that_moved_on_are_quiet():
    silent("HANG001", facts(ranks=[waiting(0, stalled=4), waiting(1, stalled=4), elsewhere(3, stalled=4),
                                   waiting(2, stalled=4)]))
    silent("HANG001", facts(ranks=[rank(n, dp=4) for n in DP]))  # no progress records: steps flow
    silent("HANG004", facts(ranks=[rank(n, dp=4) for n in DP]))


def test_hang002_a_rank_a_call_ahead_of_its_group_is_a_mismatch_not_a_missing_rank():
    ranks = [waiting(0), waiting(1), waiting(2), waiting(3, seq=8)]
    (finding,) = fired("HANG002", facts(ranks=ranks))
    assert {e.values["seq"]: e.values["ranks"] for e in finding.evidence} == {7: [0, 1, 2], 8: [3]}
    silent("HANG001", facts(ranks=ranks))


def test_hang003_every_member_inside_the_same_call_points_at_the_transport():
    (finding,) = fired("HANG003", facts(ranks=[waiting(n) for n in DP]))
    assert finding.evidence[0].values["ranks"] == [0, 1, 2, 3]
    silent("HANG001", facts(ranks=[waiting(n) for n in DP]))


def test_hang004_the_first_death_is_the_cause_and_broken_connections_its_consequences():
    killed = rank(3, dp=4, exited_at=1000.0)
    reset = [rank(n, dp=4, exited_at=1000.2, progress=ProgressFacts(
        step=3, phase="collective", stalled_seconds=0, overdue_seconds=0, time=999.99,
        error="RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:32482")) for n in (0, 1, 2)]
    (finding,) = fired("HANG004", facts(ranks=[*reset, killed]))
    assert finding.title == "job job-1: rank 3 died, then 3 more"
    assert finding.evidence[0].values["error"] is None and finding.evidence[-1].values["ranks"] == [0, 1, 2]


def test_hang004_from_a_run_log_the_silent_rank_is_the_one_its_peers_lost():
    reset = [rank(n, dp=4, progress=ProgressFacts(
        step=3, phase="collective", stalled_seconds=0, overdue_seconds=0, time=999.99,
        error="RuntimeError: Connection reset by peer")) for n in (0, 1, 2)]
    (finding,) = fired("HANG004", facts(ranks=[*reset, rank(3, dp=4)]))
    assert finding.evidence[0].where.rank == 3 and "went silent" in finding.evidence[0].text


def test_a_rank_that_closed_its_hooks_and_exited_ended_normally():
    ended = [rank(n, dp=4, exited_at=1000.0 + n, progress=ProgressFacts(
        step=100, phase="closed", stalled_seconds=0, overdue_seconds=0)) for n in DP]
    silent("HANG004", facts(ranks=ended))
    silent("HANG001", facts(ranks=ended))


def test_a_rank_just_joining_the_wait_is_not_taken_for_the_missing_one():
    """Rank 1 entered the all-reduce a moment ago (below the stall threshold): it waits too; rank 3 is missing."""
    (finding,) = fired("HANG001", facts(ranks=[waiting(0), waiting(1, stalled=1.0), waiting(2), elsewhere(3)]))
    assert [e.where.rank for e in finding.evidence if e.where.rank is not None] == [3]
