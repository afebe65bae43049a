"""End to end: jobs that hang or lose a rank, for real (forked gloo ranks of `gpuwatch train`, and a user's DDP script
under torchrun), reporting to a real agent, then `gpuwatch diagnose` names the rank that is missing or died, the
collective the others wait in and, for a hang, where the missing rank stands (a stack line in the fault's code);
live through the agent, and after the job was killed from its run log. Healthy runs raising none of these findings
is held by the healthy tests of test_e2e_faults.py and test_foreign_workloads.py, which allow no warning at all.

No timing assertion: a test waits (with a generous deadline) until diagnose says what it must, then checks what.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from foreign import Workload, diagnose, launched, simulated_agent
from test_e2e_faults import by_rank, findings, serious

from gpuwatch.trainer.cli import train

from conftest import VERDICT_POLL_S, AgentProcess, wait_until

pytestmark = pytest.mark.integration

#: Long enough for the hooks' watchdog (3 s floor, 5 × the median step) plus the rules' 5 s and a few rounds.
FOUND_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    agent = AgentProcess("--simulate", "dgx-h100", "--interval", "0.5",
                         telemetry_socket=tmp_path_factory.mktemp("agent") / "telemetry.sock")
    yield agent
    agent.stop()


def _train(agent: AgentProcess, job: str, run_log: Path, *args: str) -> subprocess.Popen:
    """`gpuwatch train` in the background, in a session of its own (so that its ranks can be stopped together)."""
    command = [sys.executable, "-m", "gpuwatch.cli.main", "train", "--steps", "1000", "--job", job,
               "--telemetry-socket", str(agent.telemetry_socket), "--run-log", str(run_log), *args]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)


def _verdict(predicate: Callable[[], dict | None], what: str) -> dict:
    """``predicate``'s first finding, polled as a user polls diagnose (conftest's VERDICT_POLL_S), FOUND_TIMEOUT_S at
    most."""
    return wait_until(predicate, timeout=FOUND_TIMEOUT_S, interval=VERDICT_POLL_S, what=what)


def _found(job: str, code: str, option: str, location: str, *options: str) -> dict | None:
    """The first `code` finding about `job` from `gpuwatch diagnose OPTION LOCATION [OPTIONS]`; None before there is
    one (or while the source cannot be read yet: a Prometheus server before its first scrape)."""
    source = {"--agent": "agent", "--run-log": "run_log", "--prometheus": "prometheus"}[option]
    found = diagnose(job, source, location, options=options).serious().get(code)
    return found[0] if found else None


def _death_told(job: str, option: str, location: str, culprit: int, raised: bool) -> dict | None:
    """The HANG004 finding about `job` once it tells all the source will know of the culprit's death: its exit time
    and, when it raised, its error. Before that a finding may stand on less (the peers' errors arrive before the
    agent's next round watches the culprit's pid), which is right then but not what these tests check."""
    finding = _found(job, "HANG004", option, location)
    died = by_rank(finding).get(culprit) if finding is not None else None
    if died is None or died["exited_at"] is None or (raised and died["error"] is None):
        return None
    return finding


@pytest.mark.parametrize(("shape", "world"), [
    (("--tp", "1", "--pp", "2", "--dp", "2"), 4),
    (("--tp", "2", "--pp", "2", "--dp", "2"), 8),
], ids=["pp2-dp2", "tp2-pp2-dp2"])
def test_a_hanging_rank_is_named_with_the_collective_its_peers_wait_in_and_its_stack(agent, tmp_path, shape, world):
    job, culprit = f"hang-{world}", world - 1
    run_log = tmp_path / "log"
    process = _train(agent, job, run_log, *shape, "--fault", "hang-rank", "--fault-step", "4")
    try:
        finding = _verdict(lambda: _found(job, "HANG001", "--agent", agent.url), what=f"HANG001 for job {job}")
        assert set(serious(findings(job, "--agent", agent.url))) == {"HANG001"}
        named = by_rank(finding)
        assert set(named) == {culprit}, finding
        evidence = named[culprit]
        assert evidence["phase"] == "step" and evidence["op"] == "all_reduce"
        assert evidence["stack_top"].split(":")[0].endswith("trainer/faults.py")
        assert evidence["stack_top"].endswith(" _hang_before_all_reduce")
        # the collective named is the one a waiting rank is in, by the agent's own state
        ranks = {r["rank"]: r for r in agent.state()["facts"]["telemetry"]["ranks"] if r["job"] == job}
        waiting = ranks[evidence["waiting"][0]]["progress"]["collective"]
        assert (waiting["op"], waiting["group"], waiting["seq"]) == (evidence["op"], evidence["group"], evidence["seq"])
        assert culprit in ranks[evidence["waiting"][0]]["hello"]["process_groups"][evidence["group"]]
    finally:
        _stop(process)
    # post-mortem: the job was killed; its run log still says who was waiting for whom
    post_mortem = _found(job, "HANG001", "--run-log", str(run_log))
    assert post_mortem is not None and set(by_rank(post_mortem)) == {culprit}


@pytest.mark.parametrize(("shape", "world"), [
    (("--tp", "1", "--pp", "2", "--dp", "2"), 4),
    (("--tp", "2", "--pp", "2", "--dp", "2"), 8),
], ids=["pp2-dp2", "tp2-pp2-dp2"])
def test_a_rank_that_skipped_its_collectives_is_named_by_its_count_of_calls(agent, tmp_path, prometheus_server, shape,
                                                                            world):
    """skip-collective: the last rank leaves out its DP all-reduces of step 4. Its next ones pair with its DP peer's
    of step 4, the drift meets the pipeline's traffic, and the ranks wait on each other in a circle: nobody is
    missing (no HANG001), and only the counts of calls on the DP group say who skipped. Live through the agent and
    Prometheus, and from the run log once the job is killed."""
    server = prometheus_server([f"127.0.0.1:{agent.port}"])
    job, culprit, run_log = f"skip-{world}", world - 1, tmp_path / "log"
    process = _train(agent, job, run_log, *shape, "--fault", "skip-collective", "--fault-step", "4")

    def named(option: str, location: str) -> dict:
        finding = _verdict(lambda: _found(job, "HANG002", option, location),
                           what=f"HANG002 for job {job} through {option}")
        odd = [e for e in finding["evidence"] if e["values"]["odd"]]
        assert [e["where"]["rank"] for e in odd] == [culprit], finding
        assert (odd[0]["values"]["group"], odd[0]["values"]["step"]) == ("dp", 4)
        return finding

    try:
        named("--agent", agent.url)
        named("--prometheus", server.url)
        assert "HANG001" not in serious(findings(job, "--agent", agent.url))
    finally:
        _stop(process)
    named("--run-log", str(run_log))


@pytest.mark.parametrize(("fault", "error", "shape"), [
    ("crash-rank", None, ("--tp", "1", "--pp", "2", "--dp", "2")),
    ("raise-rank", "InjectedFailure", ("--tp", "1", "--pp", "2", "--dp", "2")),
    ("crash-rank", None, ("--tp", "2", "--pp", "2", "--dp", "2")),
], ids=["crash-pp2-dp2", "raise-pp2-dp2", "crash-tp2-pp2-dp2"])
def test_a_rank_that_dies_is_named_first_and_its_peers_as_consequences(agent, tmp_path, fault, error, shape):
    world = 2 * 2 * int(shape[1])
    job, culprit = f"{fault}-{world}", world - 1
    run_log = tmp_path / "log"
    result = CliRunner().invoke(train, [*shape, "--steps", "20", "--job", job,
                                        "--telemetry-socket", str(agent.telemetry_socket), "--run-log", str(run_log),
                                        "--fault", fault, "--fault-step", "4"])
    assert result.exit_code == 1 and f"rank {culprit} failed" in result.output  # the launcher names it too
    finding = _verdict(lambda: _death_told(job, "--agent", agent.url, culprit, error is not None),
                       what=f"HANG004 for job {job} with rank {culprit}'s exit")
    assert set(by_rank(finding)) == {culprit}, finding
    died = by_rank(finding)[culprit]
    if error is None:
        assert died["error"] is None  # a signal: only its absence tells
    else:
        assert died["error"].startswith(error)
    assert finding["title"].startswith(f"job {job}: rank {culprit} died")
    post_mortem = _found(job, "HANG004", "--run-log", str(run_log))  # no exit times there: errors and silence
    assert post_mortem is not None and set(by_rank(post_mortem)) == {culprit}, post_mortem


@pytest.mark.parametrize(("shape", "world"), [
    (("--tp", "1", "--pp", "2", "--dp", "2"), 4),
    (("--tp", "2", "--pp", "2", "--dp", "2"), 8),
], ids=["pp2-dp2", "tp2-pp2-dp2"])
def test_a_hanging_rank_is_named_through_prometheus(agent, tmp_path, prometheus_server, shape, world):
    """Prometheus has no hello groups but the default one: the rank stuck outside any collective while the others
    wait (in its DP group, at a pipeline neighbour's send/recv, in their TP group) is the one named."""
    server = prometheus_server([f"127.0.0.1:{agent.port}"])
    job, culprit = f"hang-prometheus-{world}", world - 1
    process = _train(agent, job, tmp_path / "log", *shape, "--fault", "hang-rank", "--fault-step", "4")
    try:
        finding = _verdict(lambda: _found(job, "HANG001", "--prometheus", server.url),
                           what=f"HANG001 for job {job} through Prometheus")
        assert set(by_rank(finding)) == {culprit}
        waiting = set(by_rank(finding)[culprit]["waiting"])  # the others, as each passes the stall threshold
        assert waiting and waiting <= set(range(world)) - {culprit}
    finally:
        _stop(process)


@pytest.mark.parametrize(("fault", "error"), [("crash-rank", None), ("raise-rank", "InjectedFailure")])
def test_a_rank_that_dies_is_named_through_prometheus(agent, tmp_path, prometheus_server, fault, error):
    """Through Prometheus as through the agent: each rank's exit time and the error of a step that raised
    (`gpuwatch_train_step_raised_timestamp_seconds{type,message}`) tell the rank that died first from its peers,
    whose errors say they lost their connection to it."""
    server = prometheus_server([f"127.0.0.1:{agent.port}"])
    job, culprit = f"{fault}-prometheus", 3
    result = CliRunner().invoke(train, ["--tp", "1", "--pp", "2", "--dp", "2", "--steps", "20", "--job", job,
                                        "--telemetry-socket", str(agent.telemetry_socket), "--fault", fault,
                                        "--fault-step", "4"])
    assert result.exit_code == 1 and f"rank {culprit} failed" in result.output
    finding = _verdict(lambda: _death_told(job, "--prometheus", server.url, culprit, error is not None),
                       what=f"HANG004 for job {job} through Prometheus with its exit")
    assert set(by_rank(finding)) == {culprit}, finding
    died = by_rank(finding)[culprit]
    assert died["error"] is None if error is None else died["error"].startswith(error)
    assert finding["title"].startswith(f"job {job}: rank {culprit} died")


def test_a_users_ddp_script_with_a_stuck_rank_is_named_live_and_post_mortem(tmp_path, prometheus_server):
    workload = Workload("ddp_tutorial", nproc=2, steps=1000, fault="stuck-rank", fault_rank=1)
    with simulated_agent(tmp_path) as agent, launched(workload, agent, tmp_path) as (_, run_log):
        server = prometheus_server([f"127.0.0.1:{agent.port}"])
        finding = _verdict(lambda: _found(workload.job, "HANG001", "--agent", agent.url),
                           what="HANG001 for the DDP script")
        evidence = by_rank(finding)[1]
        assert (evidence["op"], evidence["group"], evidence["waiting"]) == ("all_reduce", "default", [0])
        assert evidence["phase"] == "compute"  # the script's own compute phase, where it stands
        assert evidence["stack_top"].split(":")[0].endswith("workloads/ddp_tutorial.py")
        assert evidence["stack_top"].endswith(" wait_for_a_lock_nobody_releases")
        through_prometheus = _verdict(lambda: _found(workload.job, "HANG001", "--prometheus", server.url),
                                      what="HANG001 for the DDP script via Prometheus")
        assert by_rank(through_prometheus)[1]["waiting"] == [0]
    post_mortem = _found(workload.job, "HANG001", "--run-log", str(run_log))
    assert post_mortem is not None and set(by_rank(post_mortem)) == {1}


def test_a_rank_stuck_as_it_exits_is_named_and_one_still_working_is_not(tmp_path, prometheus_server):
    """After training and destroy_process_group() rank 1 of a user's DDP script waits on a lock for good (its hooks
    closed, its process never exits) and rank 0 evaluates until stopped: HANG007 names rank 1 alone, by its pid,
    live through the agent and through Prometheus. Its minute is lowered to 10 s (``--config``); the process has
    used no CPU worth the name since the close, rank 0 a share of a core. A run log ends at the close: it cannot
    tell, and names no one."""
    workload = Workload("ddp_tutorial", nproc=2, steps=10, fault="stuck-at-exit", fault_rank=1)
    config = tmp_path / "minute.yaml"
    config.write_text("thresholds: {HANG007: {min_age_seconds: 10}}\n")
    with simulated_agent(tmp_path) as agent, launched(workload, agent, tmp_path) as (_, run_log):
        server = prometheus_server([f"127.0.0.1:{agent.port}"])
        for option, location in (("--agent", agent.url), ("--prometheus", server.url)):
            finding = _verdict(lambda option=option, location=location: _found(
                workload.job, "HANG007", option, location, "--config", str(config)), what=f"HANG007 {option}")
            named = {e["where"]["rank"]: e["values"] for e in finding["evidence"] if e["where"].get("rank") is not None}
            assert set(named) == {1}, finding
            stuck = named[1]
            assert stuck["seconds_since_close"] >= 10 and stuck["cpu_seconds_since_close"] <= 0.2, stuck
            assert "ddp_tutorial.py" in Path(f"/proc/{stuck['pid']}/cmdline").read_text(), stuck  # rank 1's process
        assert _found(workload.job, "HANG007", "--run-log", str(run_log), "--config", str(config)) is None
