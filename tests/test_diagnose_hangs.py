"""The hang rules on facts built by hand: who waits for whom, mismatched sequence numbers, a transport that stopped,
deaths and their consequences, ranks that said hello and never stepped, every rank stopped outside any collective,
a rank whose process never exits after its training ended, and what must stay quiet (a pause shorter than the stall
threshold, a job whose ranks all moved on)."""

from __future__ import annotations

import dataclasses
import math

from diagnose_facts import facts, rank, step
from telemetry_records import hello
from telemetry_records import progress as progress_record
from telemetry_records import step as step_record
from test_diagnose_rules import fired, not_run, silent

from gpuwatch.diagnosis import engine
from gpuwatch.diagnosis.facts import AfterClose, InFlightFacts, ProgressFacts, RankFacts
from gpuwatch.diagnosis.sources import run_log
from gpuwatch.protocol.records import RecorderEntry
from gpuwatch.trainer.telemetry import TelemetryClient

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


def counted(number: int, calls: int, at_step: int = 100, groups=None, **fields):
    """A rank whose step `at_step` ended with `calls` calls on its dp group (members: its hello's, or the world's)."""
    return rank(number, dp=4, last=step(step=at_step, collective_calls={"dp": calls, "tp": 5 * at_step}),
                process_groups=groups if groups is not None else {"dp": list(DP)}, **fields)


def test_hang002_a_rank_whose_count_of_calls_on_a_group_fell_behind_its_peers_at_the_same_step():
    """The job still runs: a skipped all-reduce paired with the next one of the same size."""
    (finding,) = fired("HANG002", facts(ranks=[counted(0, 201), counted(1, 201), counted(2, 200), counted(3, 201)]))
    assert finding.title == ("job job-1: collective mismatch on dp [0-3]: rank 2 out of step with ranks 0-1,3 by "
                             "step 100, a collective skipped or added")
    assert {e.where.rank: (e.values["calls"], e.values["odd"]) for e in finding.evidence} == {
        0: (201, False), 1: (201, False), 2: (200, True), 3: (201, False)}


def test_hang002_with_two_ranks_the_one_behind_is_named():
    pair = {"dp": [0, 1]}
    (finding,) = fired("HANG002", facts(ranks=[counted(0, 9, groups=pair), counted(1, 8, groups=pair)]))
    assert [e.where.rank for e in finding.evidence if e.values["odd"]] == [1]


def test_hang002_a_peer_still_in_the_step_already_past_a_ranks_count_at_its_end():
    """The skipper finished the step; its peer, still in it, is in a call past the skipper's whole count: a
    circle of waits across groups, where no rank is missing (HANG001 stays quiet) and only the counts tell."""
    pair = {"dp": [2, 3]}
    ahead = rank(2, dp=4, last=step(step=3, collective_calls={"dp": 6}), process_groups=pair,
                 progress=ProgressFacts(step=3, phase="collective", stalled_seconds=30, overdue_seconds=3,
                                        collective=InFlightFacts("all_reduce", "dp", (2, 3), 8)))
    behind = rank(3, dp=4, last=step(step=4, collective_calls={"dp": 6}), process_groups=pair,
                  progress=ProgressFacts(step=4, phase="collective", stalled_seconds=30, overdue_seconds=3,
                                         collective=InFlightFacts("all_reduce", "pp", (1, 3), 50)))
    (finding,) = fired("HANG002", facts(ranks=[ahead, behind]))
    assert finding.evidence[0].where.rank == 3 and finding.evidence[0].values["odd"]
    assert (finding.evidence[1].where.rank, finding.evidence[1].values["in_call"]) == (2, 8)


def test_the_drift_rule_stays_quiet_on_a_healthy_job_and_where_it_cannot_compare():
    silent("HANG002", facts(ranks=[counted(n, 201) for n in DP]))
    # ranks a step apart, as a running job's often are: counts at different steps are not compared
    silent("HANG002", facts(ranks=[counted(0, 201), counted(1, 203, at_step=101), counted(2, 201), counted(3, 201)]))
    # a group whose members are unknown (no hello lists it) is not compared
    silent("HANG002", facts(ranks=[counted(n, 200 + n, groups={}) for n in DP]))
    # the dp groups of two pipeline stages share a name, not members: each is compared within itself
    stages = [counted(n, 10 if n < 2 else 20, groups={"dp": [0, 1] if n < 2 else [2, 3]}) for n in DP]
    silent("HANG002", facts(ranks=stages))
    # a peer in a call the rank's count covers is no disagreement
    in_time = rank(1, dp=4, last=step(step=99, collective_calls={"dp": 199}), process_groups={"dp": [0, 1]},
                   progress=ProgressFacts(step=99, phase="collective", stalled_seconds=30, overdue_seconds=3,
                                          collective=InFlightFacts("all_reduce", "dp", (0, 1), 200)))
    silent("HANG002", facts(ranks=[counted(0, 200, groups={"dp": [0, 1]}), in_time]))


def test_hang001_leaves_a_rank_behind_in_its_count_to_hang002():
    """At the end of a job whose rank skipped a call: its peers wait in a call it never makes, and it has ended."""
    pair = {"default": [0, 1]}
    waiting_peer = rank(0, dp=2, last=step(step=9, collective_calls={"default": 9}), process_groups=pair,
                        progress=ProgressFacts(step=9, phase="collective", stalled_seconds=30, overdue_seconds=3,
                                               collective=InFlightFacts("all_reduce", "default", (0, 1), 10)))
    finished = rank(1, dp=2, last=step(step=10, collective_calls={"default": 9}), process_groups=pair,
                    progress=ProgressFacts(step=10, phase="closed", stalled_seconds=0, overdue_seconds=0))
    (finding,) = fired("HANG002", facts(ranks=[waiting_peer, finished]))
    assert [e.where.rank for e in finding.evidence if e.values["odd"]] == [1]
    silent("HANG001", facts(ranks=[waiting_peer, finished]))


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


def unmeasured(number: int, age: float | None = 300.0, **fields):
    """A rank whose hello reached the source ``age`` seconds ago and no step after it."""
    return rank(number, dp=4, last=None, window=None, steps=0, hello_age_seconds=age, **fields)


def test_hang005_a_job_that_said_hello_and_never_stepped_is_not_silent():
    (finding,) = fired("HANG005", facts(ranks=[unmeasured(n, age=300.0 - n) for n in DP]))
    assert finding.severity.label == "warning"
    assert finding.title == ("job job-1: ranks 0-3 said hello but reported no step: gpuwatch measured nothing of its "
                             "training")
    (evidence,) = finding.evidence
    assert evidence.text == ("ranks 0-3 on node-a: no step record since the hello, 300 s ago (the oldest, by the "
                             "source's clock)")
    assert evidence.values == {"ranks": [0, 1, 2, 3], "hello_age_seconds": 300.0}
    assert "`gpuwatch run`" in finding.fix and "monitor.step()" in finding.fix


def test_hang005_waits_for_a_first_step_after_a_recent_hello():
    silent("HANG005", facts(ranks=[unmeasured(n, age=119.0) for n in DP]))  # starting: under the threshold
    silent("HANG005", facts(ranks=[rank(n, dp=4) for n in DP]))  # stepping


def test_hang005_is_certain_when_the_run_ended_and_says_when_the_age_is_unknown():
    closed = ProgressFacts(step=0, phase="closed", stalled_seconds=0, overdue_seconds=0)
    ranks = [unmeasured(0, age=5.0, progress=closed), unmeasured(1, age=math.inf), unmeasured(2, age=None)]
    (finding,) = fired("HANG005", facts(ranks=ranks))
    assert [e.text for e in finding.evidence] == [
        "rank 0 on node-a: hooks closed at the end of the run, no step record before",
        "rank 1 on node-a: the run log ends after the hello without a step record",
        "rank 2 on node-a: no step record; when the hello came is unknown to this source"]
    assert all(e.values["hello_age_seconds"] is None for e in finding.evidence)


def test_hang005_names_the_ranks_whose_steps_are_not_seen_beside_those_stepping():
    (finding,) = fired("HANG005", facts(ranks=[rank(0, dp=4), rank(1, dp=4), unmeasured(2), unmeasured(3)]))
    assert finding.title == "job job-1: ranks 2-3 of 4 said hello but reported no step"
    assert finding.evidence[-1].values == {"ranks": [0, 1]}
    assert "up to step 100" in finding.evidence[-1].text


def test_hang005_leaves_hung_and_dead_ranks_to_the_other_hang_rules():
    """A job with ranks waiting in a collective is hung (HANG001 names who they wait for), a dead rank died (HANG004);
    a rank overdue outside any collective, and no one waiting for it, has no other rule: HANG005 says how still."""
    in_collective = ProgressFacts(step=0, phase="collective", stalled_seconds=90, overdue_seconds=60,
                                  collective=InFlightFacts("all_reduce", "dp", DP, 1))
    outside = ProgressFacts(step=0, phase="compute", stalled_seconds=90, overdue_seconds=60)
    hung = [unmeasured(n, progress=in_collective) for n in (0, 1, 2)] + [unmeasured(3, progress=outside)]
    silent("HANG005", facts(ranks=hung))
    assert fired("HANG001", facts(ranks=hung))
    silent("HANG005", facts(ranks=[unmeasured(0, exited_at=1000.0)]))
    (finding,) = fired("HANG005", facts(ranks=[unmeasured(0, progress=outside), unmeasured(1)]))
    assert finding.evidence[-1].text == ("rank 0 overdue: no progress for up to 90 s, in phase compute (a long "
                                         "compilation, or a loop the hooks see nothing of)")
    assert finding.evidence[-1].values == {"ranks": [0], "stalled_seconds": 90}


def test_hang005_not_run_without_telemetry():
    not_run("HANG005", facts(), "no training telemetry")


def stopped(number: int, phase: str = "compute", stalled: float = 30.0, world: int = 4, **fields):
    """A rank of a job of ``world`` ranks (dp) that stepped, then stopped ``stalled`` s ago outside any collective."""
    return rank(number, dp=world, progress=ProgressFacts(
        step=41, phase=phase, stalled_seconds=stalled, overdue_seconds=3.0,
        stack=("/app/train.py:88 main", f"/app/model.py:{40 + number} forward",
               "/site-packages/torch/nn/modules/module.py:1750 _call_impl")), **fields)


def test_hang006_every_rank_stopped_outside_any_collective_names_phases_the_first_and_its_stack():
    """The observed case: rank 0 still for 30 s in compute, rank 1 in step, no collective in flight."""
    (finding,) = fired("HANG006", facts(ranks=[stopped(0, "compute", 30.0, world=2),
                                               stopped(1, "step", 25.0, world=2)]))
    assert finding.severity.label == "critical"
    assert finding.title == ("job job-1 stopped: all 2 ranks still for 25 s or more, none in a collective gpuwatch "
                             "sees; rank 0 stopped first")
    first, *phases = finding.evidence
    assert first.where.rank == 0 and first.values["stalled_seconds"] == 30.0
    assert first.values["stack_top"] == "/app/model.py:40 forward"  # its own code, not torch's
    assert first.values["stack"][-1].endswith("_call_impl") and "5 s before the next" in first.text
    assert [(e.values["ranks"], e.values["phase"]) for e in phases] == [([0], "compute"), ([1], "step")]
    assert "read the stack of rank 0" in finding.fix
    for code in ("HANG001", "HANG002", "HANG003", "HANG004", "HANG005"):
        silent(code, facts(ranks=[stopped(0, world=2), stopped(1, "step", world=2)]))


def test_hang006_names_the_collective_pytorchs_flight_recorder_has_unfinished():
    """A second source: where the Flight Recorder is on, a rank's progress record carries the oldest collective it has
    not seen finish, one the hooks did not see (a communicator's own, one issued from C++); the finding shows it."""
    def recorded(number: int, stalled: float) -> RankFacts:
        ranked = stopped(number, "compute", stalled, world=2)
        entry = RecorderEntry(op="all_reduce", group="1", seq=7, p2p=False, state="scheduled", group_desc="mesh_tp")
        assert ranked.progress is not None
        return dataclasses.replace(ranked, progress=dataclasses.replace(ranked.progress, recorder=entry))

    (finding,) = fired("HANG006", facts(ranks=[recorded(0, 30.0), stopped(1, "step", 25.0, world=2)]))
    (line,) = [e for e in finding.evidence if "Flight Recorder" in e.text]
    assert line.where.rank == 0 and line.values["seq"] == 7 and line.values["group_desc"] == "mesh_tp"
    assert "all_reduce #7 on process group 1 (mesh_tp) unfinished (scheduled)" in line.text
    assert finding.fix.startswith("the Flight Recorder names the collective the ranks wait in")
    (plain,) = fired("HANG006", facts(ranks=[stopped(0, world=2), stopped(1, "step", world=2)]))
    assert not any("Flight Recorder" in e.text for e in plain.evidence) and "Flight Recorder" not in plain.fix


def test_hang006_ranks_stopped_within_a_heartbeat_are_not_ordered():
    (finding,) = fired("HANG006", facts(ranks=[stopped(n, stalled=30.0 - n * 0.5) for n in range(4)]))
    assert finding.title.endswith("ranks 0-3 stopped first")
    assert "ranks 1-3 stopped within 2 s of it, which first cannot be told" in finding.evidence[0].text
    # one phase and step for all: one line for them
    assert [e.values["ranks"] for e in finding.evidence[1:]] == [[0, 1, 2, 3]]


def test_hang006_from_a_partial_view_says_so():
    """An agent on one node of two: it sees ranks 0-1 of 4 stopped; the others may wait for them in a collective."""
    (finding,) = fired("HANG006", facts(ranks=[stopped(0), stopped(1)]))
    assert "the 2 ranks seen of 4" in finding.title and "all 2 ranks" not in finding.title
    assert finding.evidence[-1].values == {"ranks_seen": 2, "world_size": 4}
    assert "the others may be waiting in a collective for these" in finding.evidence[-1].text


def test_hang006_quiet_on_healthy_finished_partly_moving_or_other_hang_rules_jobs():
    silent("HANG006", facts(ranks=[rank(n, dp=4) for n in DP]))  # steps flow
    silent("HANG006", facts(ranks=[stopped(0), stopped(1), stopped(2), rank(3, dp=4)]))  # rank 3 moves
    silent("HANG006", facts(ranks=[stopped(n, stalled=4.0) for n in DP]))  # below the stall threshold
    closed = ProgressFacts(step=100, phase="closed", stalled_seconds=0, overdue_seconds=0)
    silent("HANG006", facts(ranks=[rank(n, dp=4, progress=closed, exited_at=1000.0) for n in DP]))  # it ended
    silent("HANG006", facts(ranks=[stopped(0), stopped(1), stopped(2), rank(3, dp=4, progress=closed)]))  # ending
    silent("HANG006", facts(ranks=[waiting(0), waiting(1), waiting(2), elsewhere(3)]))  # HANG001's
    silent("HANG006", facts(ranks=[stopped(0), stopped(1), stopped(2), stopped(3, exited_at=1000.0)]))  # HANG004's
    never = rank(3, dp=4, last=None, window=None, steps=0, hello_age_seconds=300.0, progress=ProgressFacts(
        step=0, phase="compute", stalled_seconds=90, overdue_seconds=60))
    silent("HANG006", facts(ranks=[stopped(0), stopped(1), stopped(2), never]))  # HANG005's
    # a rank in phase collective without the call's details (DDP's all-reduce) is in no collective gpuwatch names
    assert fired("HANG006", facts(ranks=[stopped(n, "collective") for n in DP]))


def test_hang006_from_prometheus_without_stacks_or_overdue_marks():
    bare = [rank(n, dp=2, progress=ProgressFacts(step=41, phase="step", stalled_seconds=12.0 + n,
                                                 overdue_seconds=0.0)) for n in range(2)]
    (finding,) = fired("HANG006", facts(ranks=bare))
    assert "its stack is not known to this source" in finding.evidence[0].text
    assert finding.evidence[0].where.rank == 1


def test_hang006_not_run_without_telemetry():
    not_run("HANG006", facts(), "no training telemetry")


def test_hang006_and_perf006_from_a_run_log_of_records(tmp_path):
    """Facts read back from records as the hooks write them: a run log of two stages (stage 1 computing twice as long,
    its hellos naming its modules) whose ranks then stopped outside any collective."""
    layout = {"world_size": 2, "tp_size": 1, "pp_size": 2, "dp_size": 1, "tp_rank": 0, "dp_rank": 0,
              "process_groups": {"pp": [0, 1]}, "schedule": "interleaved_1f1b", "virtual_stages": 2}
    modules = {0: ["tok_embeddings", "layers.0", "layers.1"], 1: ["layers.2", "layers.3", "norm", "output"]}
    path = tmp_path / "run.jsonl"
    with TelemetryClient(tmp_path / "no-agent.sock", run_log=path, heartbeat_interval=0) as client:
        for r in range(2):
            client.send(hello(r, local_rank=r, pp_stage=r, stage_modules=modules[r], **layout))
        for number in range(1, 11):
            for r in range(2):
                client.send(step_record(r, number, compute_seconds=0.27 if r else 0.134, optimizer_seconds=0.0,
                                        dataloader_wait_seconds=0.0, exposed_collective_seconds=0.01 if r else 0.18))
        for r in range(2):
            client.send(progress_record(r, stalled=30.0 - 3 * r, step=10, phase="compute" if r == 0 else "step",
                                        stack=[{"file": "/app/train.py", "line": 88, "function": "main"}]))
    facts = run_log.read(path)
    assert [r.layout.stage_modules for r in facts.ranks] == [tuple(modules[0]), tuple(modules[1])]
    assert [r.layout.virtual_stages for r in facts.ranks] == [2, 2]
    findings = {f.code: f for f in engine.run(facts).findings}
    assert findings["HANG006"].evidence[0].values["rank"] == 0
    assert findings["HANG006"].evidence[0].values["stack"] == ["/app/train.py:88 main"]
    assert findings["PERF006"].evidence[0].values["modules"] == modules[1]


CLOSED = ProgressFacts(step=100, phase="closed", stalled_seconds=0, overdue_seconds=0)


def after_close(number: int, seconds: float, cpu_seconds: float) -> RankFacts:
    """A rank whose hooks closed ``seconds`` ago and whose process, not exited, used ``cpu_seconds`` since."""
    return rank(number, dp=4, progress=CLOSED, after_close=AfterClose(seconds, cpu_seconds, pid=4000 + number))


def test_hang007_names_the_rank_whose_process_idles_after_its_close_and_not_the_others():
    """Rank 3 closed 90 s ago and used 0.01 s of CPU since; rank 0 exited; rank 1 still works (30 s of CPU: an
    evaluation); rank 2 closed 10 s ago."""
    ended = rank(0, dp=4, progress=CLOSED, exited_at=1000.0)
    (finding,) = fired("HANG007", facts(ranks=[ended, after_close(1, 90, 30.0), after_close(2, 10, 0.0),
                                               after_close(3, 90, 0.01)]))
    assert finding.evidence[0].where.rank == 3
    assert finding.evidence[0].values == {"rank": 3, "pid": 4003, "step": 100, "seconds_since_close": 90,
                                          "cpu_seconds_since_close": 0.01}
    assert "closed its hooks 90 s ago, after step 100, and has not exited" in finding.evidence[0].text
    assert finding.evidence[1].values == {"ranks": [0]}  # ended normally
    assert finding.evidence[2].values == {"ranks": [1, 2]}  # working, or closed a moment ago: not named
    assert finding.title.startswith("job job-1: rank 3 ended training but did not exit")
    assert "py-spy dump --native --pid 4003" in finding.fix and "#56297" in finding.fix


def test_hang007_judges_cpu_against_the_time_since_the_close():
    """2 % of a core: 1.2 s of CPU in a minute is idle, 1.3 s is work."""
    assert fired("HANG007", facts(ranks=[after_close(0, 60, 1.2)]))
    silent("HANG007", facts(ranks=[after_close(0, 60, 1.3)]))
    silent("HANG007", facts(ranks=[after_close(0, 59, 0.0)]))


def test_hang007_quiet_on_a_job_that_ended_or_where_the_source_cannot_see_the_process():
    silent("HANG007", facts(ranks=[rank(n, dp=4, progress=CLOSED, exited_at=1000.0) for n in DP]))  # ended
    silent("HANG007", facts(ranks=[rank(n, dp=4, progress=CLOSED) for n in DP]))  # a run log: no process seen
    silent("HANG007", facts(ranks=[rank(n, dp=4) for n in DP]))  # training
