"""Users' own scripts, not the reference trainer: does ``gpuwatch diagnose`` stay quiet on healthy ones and name
the bug on faulty ones?

Why: a user ran a plain DDP tutorial (a tiny model, 2 ranks, gloo, steps of ~2 ms) with the README's hooks against
``gpuwatch agent --simulate dgx-h100`` and got a straggler warning on 7 of 10 healthy runs, a communication-bound
warning on every run, a critical NCCL finding on a job that never used NCCL, and nothing at all for a model that
could not learn. The reference trainer's end-to-end tests never saw any of it: its steps are slower, its ranks
forked, its hooks wired by gpuwatch itself. Here three scripts in the styles users write (tests/workloads/: a DDP
tutorial, gradient accumulation with ``no_sync`` and an LR schedule, a tiny LM sampling its own batches per rank)
run under torchrun at 1-4 ranks, each judged through the agent, its run log and a real Prometheus scraping the agent
(tests/foreign.py): the same verdict from all three.

A healthy run must raise nothing at warning level or worse, from either source: that is where false alarms are
judged. A planted fault must be named by its rule, on the right ranks; what else the report says about a faulty run
is left to the healthy runs to judge, so that one noisy rule does not hide whether the others find their fault.

Each run is made once and shared by the tests of its sources (``runs``), which are marked as its (``sharing``):
under pytest-xdist they run in one worker, each run's in whichever worker is free; one agent and one Prometheus serve
the module in each. The machine
has 2 CPUs, so 3-4 ranks oversubscribe it, as they did for the user. No test looks at a timing, only at what the
diagnosis says about which rank.
"""

from __future__ import annotations

from collections.abc import Callable

import foreign
import pytest
from foreign import Run, Workload, preflight, ranks_named

from gpuwatch.agent.simulate import PRESETS
from gpuwatch.agent.simulate.sysfs import SimulatedSysfs

from conftest import PrometheusServer, sharing

pytestmark = pytest.mark.integration

SOURCES = ("agent", "run_log", "prometheus")
#: Steps of a run: three gradient-similarity samples (every 10 steps), a window of medians for the timing rules.
STEPS = 30

#: (script, ranks) of the healthy runs: every script, every rank count from 1 to 4.
HEALTHY = [("ddp_tutorial", 1), ("ddp_tutorial", 2), ("grad_accumulation", 2), ("grad_accumulation", 3),
           ("tiny_lm", 2), ("tiny_lm", 4)]
#: The healthy run whose environment also holds NCCL_IB_DISABLE=1, a setting that cannot hurt a gloo job (its own
#: test reads the run too, rather than a job of its own: CI time).
NCCL_IB_DISABLED = ("ddp_tutorial", 2)


def _healthy_run(workload: tuple[str, int]) -> str:
    """The name of a healthy run, which its tests share (conftest's ``sharing``)."""
    return f"{workload[0]}-{workload[1]}-none"


@pytest.fixture(scope="module")
def prometheus(agent, tmp_path_factory):
    """A real Prometheus scraping the agent every second: the third source every run is judged through."""
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), [f"127.0.0.1:{agent.port}"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def runs(agent, prometheus, tmp_path_factory) -> Callable[..., Run]:
    """``runs(script, nproc, fault=..., fault_rank=...)``: that workload's finished run, made on first use and
    shared by the tests of every source (a failed run is not retried: it fails each of them alike)."""
    workdir = tmp_path_factory.mktemp("runs")
    made = foreign.Made()

    def get(script: str, nproc: int, fault: str = "none", fault_rank: int | None = None) -> Run:
        env = {"NCCL_IB_DISABLE": "1"} if (script, nproc, fault) == (*NCCL_IB_DISABLED, "none") else {}
        workload = Workload(script, nproc, STEPS, fault, fault_rank, env,
                            more_faults=("same-data",) if fault == "sleep-rank" else ())
        return made.get((script, nproc, fault, fault_rank), lambda: foreign.run(workload, agent, workdir, prometheus))

    return get


def _judged(run: Run, source: str):
    """The run's diagnosis from ``source``, which must have read the run (a missing run log fails here)."""
    diagnosis = run.diagnosis(source)
    assert diagnosis.report is not None, diagnosis.describe()
    assert diagnosis.report["summary"]["ranks"] >= run.workload.nproc, diagnosis.describe()
    return diagnosis


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize(("script", "nproc"), sharing("foreign", HEALTHY, _healthy_run,
                                                      ids=[f"{s}-{n}" for s, n in HEALTHY]))
def test_a_healthy_run_raises_no_warning(runs, script, nproc, source):
    run = runs(script, nproc)
    assert [r["rank"] for r in run.ranks] == list(range(nproc))
    diagnosis = _judged(run, source)
    if nproc > 1:  # the straggler rule did look at this job's ranks: the silence below means something
        assert "PERF002" not in diagnosis.not_run(), diagnosis.not_run()
    assert diagnosis.serious() == {}, diagnosis.describe()


#: (script, ranks, the sleeping rank or None for the last) of the runs with a straggler: one rank sleeps 0.3 s a step.
#: Every rank of these runs also trains on the same data (``same-data``): one run for two faults whose rules read
#: different evidence (timings; gradients), each named on its own (a run each would cost CI ~8 s of CPU more).
SLOW = [("ddp_tutorial", 2, 0), ("grad_accumulation", 3, 1), ("tiny_lm", 3, None)]
SLOW_RUNS = sharing("foreign", SLOW, lambda w: f"{w[0]}-{w[1]}-sleep-rank", ids=[f"{s}-{n}" for s, n, _ in SLOW])


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize(("script", "nproc", "fault_rank"), SLOW_RUNS)
def test_a_sleeping_rank_is_named_as_the_straggler(runs, script, nproc, fault_rank, source):
    run = runs(script, nproc, "sleep-rank", fault_rank)
    diagnosis = _judged(run, source)
    found = diagnosis.serious()
    assert "PERF002" in found, diagnosis.describe()
    (straggler,) = found["PERF002"]
    assert ranks_named(straggler) == {run.workload.slow_rank}, straggler


def _named_on_every_rank(run: Run, code: str, source: str) -> None:
    diagnosis = _judged(run, source)
    found = diagnosis.serious()
    assert code in found, diagnosis.describe()
    assert set().union(*map(ranks_named, found[code])) == set(range(run.workload.nproc)), found[code]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize(("script", "nproc", "fault_rank"), SLOW_RUNS)
def test_the_same_data_on_every_rank_is_a_duplicated_shard_on_every_rank(runs, script, nproc, fault_rank, source):
    """A sampler without its replicas, or the rank left out of a seed (``same-data``, in the runs with a sleeping
    rank): CONV004 on every rank."""
    _named_on_every_rank(runs(script, nproc, "sleep-rank", fault_rank), "CONV004", source)


#: (script, ranks) of the runs with a loss over a single logit (``bad-loss-shape``: loss 0, gradients 0).
BAD_LOSS_SHAPE = [("ddp_tutorial", 1), ("grad_accumulation", 2), ("tiny_lm", 2)]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize(("script", "nproc"), sharing("foreign", BAD_LOSS_SHAPE,
                                                      lambda w: f"{w[0]}-{w[1]}-bad-loss-shape",
                                                      ids=[f"{s}-{n}" for s, n in BAD_LOSS_SHAPE]))
def test_a_model_that_does_not_learn_is_named_on_every_rank(runs, script, nproc, source):
    """CONV006 on every rank."""
    _named_on_every_rank(runs(script, nproc, "bad-loss-shape"), "CONV006", source)


@pytest.mark.shares(f"foreign:{_healthy_run(NCCL_IB_DISABLED)}")
@pytest.mark.parametrize("source", SOURCES)
def test_nccl_ib_disable_on_a_gloo_job_is_no_nccl_finding(runs, source):
    """NCCL_IB_DISABLE=1 in a single-node gloo job's environment (a healthy run's, which must raise no warning
    either): NCCL never runs, so its settings cannot hurt. No NCCL rule may speak, and NCCL001 must say why it did
    not judge (not run, with a reason)."""
    run = runs(*NCCL_IB_DISABLED)
    assert all(r["hello"]["env"].get("NCCL_IB_DISABLE") == "1" for r in run.ranks)  # the agent did see it
    diagnosis = _judged(run, source)
    assert not {code for code in diagnosis.codes() if code.startswith("NCCL")}, diagnosis.describe()
    assert diagnosis.not_run().get("NCCL001"), diagnosis.not_run()


def test_preflight_still_reports_nccl_ib_disable_on_a_node_with_active_ib_ports(tmp_path):
    """Before launch nothing says the job will use gloo: on the agent's node (a simulated dgx-h100, whose 8
    InfiniBand ports are active) the pre-flight check with NCCL_IB_DISABLE=1 is still critical, and quiet without."""
    sysfs = SimulatedSysfs(PRESETS["dgx-h100"], tmp_path / "sys")
    disabled = preflight(sysfs.root, {"NCCL_IB_DISABLE": "1"})
    (finding,) = [f for f in disabled["findings"] if f["code"] == "NCCL001"]
    assert finding["severity"] == "critical"
    ports = {e["where"]["port"] for e in finding["evidence"] if "port" in e["where"]}
    assert ports == {f"mlx5_{i}/1" for i in range(PRESETS["dgx-h100"].ib_ports)}, finding
    allowed = preflight(sysfs.root, {"NCCL_IB_DISABLE": "0"})
    assert "NCCL001" not in {f["code"] for f in allowed["findings"]}


def test_the_harness_keeps_the_runs_own_findings_and_the_nodes():
    """Judging one run on a shared agent rests on this filter: another job's findings are dropped, the run's own
    and those naming no job (the node's hardware) are kept. And the noise figure is each rank against its peers."""
    def finding(code: str, *wheres: dict) -> dict:
        return {"code": code, "severity": "warning", "title": code,
                "evidence": [{"text": "", "where": where, "values": {}} for where in wheres]}

    report = {"findings": [finding("PERF002", {"job": "mine", "rank": 1}), finding("CONV004", {"job": "other"}),
                           finding("HW003", {"node": "vm", "port": "mlx5_0/1"})], "not_run": []}
    diagnosis = foreign.Diagnosis("agent", "mine", report)
    assert diagnosis.codes() == {"PERF002", "HW003"}
    assert ranks_named(diagnosis.serious()["PERF002"][0]) == {1}
    assert foreign.busy_ratios({0: [1.0, 1.0, 9.0], 1: [2.0, 2.0], 2: [1.0]}) == {0: 1 / 1.5, 1: 2.0, 2: 1 / 1.5}
    # PERF002's two conditions: rank 1 is 2x its peer (1.6 of the 1.25 needed) and 1 s slower in a 10 s step (1.0
    # of the tenth needed): the margin decides, exactly at the bar; the faster rank is nowhere near
    assert foreign.straggler_closeness({0: [1.0, 1.0], 1: [2.0, 2.0]}, {0: [10.0], 1: [10.0]}, 1.25, 0.1) == \
        {0: 0.0, 1: 1.0}
