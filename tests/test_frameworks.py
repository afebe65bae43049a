"""The real frameworks under ``gpuwatch run``: Hugging Face ``Trainer`` (transformers) and an ``accelerate`` loop,
Lightning through both ``lightning`` and ``pytorch_lightning`` with ``accumulate_grad_batches`` 1 and 2, and a
hand-written FSDP2 loop on ``fully_shard``'s default mesh, each as a user runs it: ``gpuwatch run -- torchrun
--standalone --nproc-per-node 2 tests/workloads/X.py``, its first import the framework, no gpuwatch import, 2 CPU
ranks with gloo, tiny models built from configs, synthetic data, nothing downloaded (tests/workloads/framework_job.py
says what the scripts share, each script what it trains). Each run reports to a real ``gpuwatch agent --simulate
dgx-h100`` and writes a run log (tests/foreign.py), and is judged through both.

What must hold for every framework:

* one step record per optimizer step, and its loss the framework's own: per rank, what the framework back-propagates
  in the step (the micro-batches' losses divided by the accumulation, summed), equal to float rounding where the
  step sums several, exactly where it has one backward; the Hugging Face Trainer logs only the mean over the ranks of
  that per-rank sum (it all-gathers it), so there the mean of the two ranks' reported losses is compared with the
  logged loss;
* the framework named in the hello (transformers, accelerate, lightning; "plain" for the FSDP2 loop);
* the phases (data, compute, optimizer, outside the model, exposed communication) sum to the step, and hold the time
  where it went: one rank sleeps 0.2 s per optimizer step in one phase (in the data set's ``__getitem__``, in the
  model's forward, in a framework callback or logging call between steps, in the optimizer's ``step``), and on that
  rank that phase's median is the largest by far, while its peer's wait for it is exposed communication;
* a healthy run raises no warning or critical finding, through the agent and the run log;
* a rank slowed in a callback, in its forward or in its data is named by PERF002, with the phase its extra time is in;
* a model that never learns (a learning rate of 0; for FSDP2, whose shards give no parameter checksum, a loss over a
  single logit) is named by CONV006 on every rank; it is planted in one of each job's slowed runs, on every rank
  (a run per planted fault would cost a job, ~10 s of CPU, each), and both are named;
* the losses and final parameters are bit for bit those of the same run without gpuwatch.

Every run is made once and shared by the tests that read it (``runs``), which are marked as its (``sharing``): under
pytest-xdist they run in one worker, each run's in whichever worker is free; one agent serves the module in each. Timing
assertions are structural (which phase holds a 0.2 s sleep), not thresholds on how fast a step is.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

import foreign
import pytest
from foreign import GPUWATCH_RUN, Run, Workload, launched, ranks_named

from conftest import sharing

pytestmark = pytest.mark.integration

#: A job on a framework: (script in tests/workloads/, its arguments). Lightning's accumulation is in its name.
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "hf_trainer": ("hf_trainer", ()),
    "accelerate": ("accelerate_loop", ()),
    "lightning-1": ("lightning_fit", ("--package", "lightning", "--accumulate", "1")),
    "lightning-2": ("lightning_fit", ("--package", "lightning", "--accumulate", "2")),
    "pytorch_lightning-1": ("lightning_fit", ("--package", "pytorch_lightning", "--accumulate", "1")),
    "pytorch_lightning-2": ("lightning_fit", ("--package", "pytorch_lightning", "--accumulate", "2")),
    "fsdp2": ("fsdp2_loop", ()),
}
#: The hello's `framework` for each.
FRAMEWORK = {"hf_trainer": "transformers", "accelerate": "accelerate", "lightning-1": "lightning",
             "lightning-2": "lightning", "pytorch_lightning-1": "lightning", "pytorch_lightning-2": "lightning",
             "fsdp2": "plain"}
#: Backward passes per optimizer step: one, and the reported loss is bit for bit the framework's.
BACKWARDS = {"hf_trainer": 2, "accelerate": 2, "lightning-1": 1, "lightning-2": 2, "pytorch_lightning-1": 1,
             "pytorch_lightning-2": 2, "fsdp2": 1}
#: A healthy run: 3 evaluations and checkpoints of the Trainer (every 4 steps), a window of medians for the rules.
STEPS = 12
#: A slowed run: 0.2 s a step on one rank; 8 steps show it plainly (the rules judge from 5).
SLOW_STEPS, DELAY = 8, 0.2
#: How far below a sleep's time the record of a phase holding it may fall: the two clocks' reads and the
#: rounding of a delay spread over a step's samples.
CLOCK_SLACK = 0.001
#: A slowed run whose model also never learns: the parameter checksum is measured every 10 steps, and CONV006 needs
#: two of them.
NEVER_STEPS = 20
#: The slowed rank.
SLOW_RANK, PEER = 1, 0

#: A step record's phases (the schema's STEP_PHASES and the exposed communication), by the fault's phase name.
PHASES = {"data": "dataloader_wait_seconds", "compute": "compute_seconds", "optimizer": "optimizer_seconds",
          "outside": "outside_model_seconds", "collective": "exposed_collective_seconds"}
#: The phase as PERF002's evidence may name it: the schema's phase name or its record field.
PHASE_NAMES = {"data": ("data", "dataloader_wait_seconds"), "compute": ("compute", "compute_seconds"),
               "optimizer": ("optimizer", "optimizer_seconds"),
               "outside": ("outside_model", "outside_model_seconds")}

#: Which phases are slowed, on which jobs (every framework's data path, forward and callbacks; the optimizer where
#: Lightning's closure puts a forward and backward inside `optimizer.step`, with and without accumulation).
SLOWED = [("hf_trainer", "data"), ("hf_trainer", "compute"), ("hf_trainer", "outside"),
          ("accelerate", "data"), ("accelerate", "compute"), ("accelerate", "outside"),
          ("lightning-2", "data"), ("lightning-2", "compute"), ("lightning-2", "outside"),
          ("lightning-2", "optimizer"), ("pytorch_lightning-1", "compute"), ("pytorch_lightning-1", "outside"),
          ("pytorch_lightning-1", "optimizer"), ("fsdp2", "data"), ("fsdp2", "compute"), ("fsdp2", "outside")]
#: The slowed runs whose model also never learns (``--never-learns``, every rank): one per framework.
NEVER_LEARNS = [("hf_trainer", "data"), ("accelerate", "compute"), ("lightning-2", "optimizer"), ("fsdp2", "outside")]
SOURCES = ("agent", "run_log")
#: The parameters of the tests of each run, marked as that run's (conftest's ``sharing``).
HEALTHY = sharing("frameworks", VARIANTS, lambda variant: f"{variant}-none")


def _workload(variant: str, workdir: Path, name: str, fault: str, steps: int, fault_rank: int | None,
              wrapped: bool, never_learns: bool = False) -> Workload:
    script, args = VARIANTS[variant]
    return Workload(script, 2, steps, fault, fault_rank,
                    args=(*args, "--out", str(workdir / name), *(("--never-learns",) if never_learns else ())),
                    wrapper=GPUWATCH_RUN if wrapped else ())


@pytest.fixture(scope="module")
def runs(agent, workdir) -> Callable[..., Run]:
    """``runs(variant, fault="none")``: that job's finished run under ``gpuwatch run`` (a slow-* fault on rank 1, and
    a model that never learns on every rank where NEVER_LEARNS says so), made on first use and shared by the tests (a
    failed run is not retried: it fails each of them alike). Its results are in ``workdir / f"{variant}-{fault}"``."""
    made = foreign.Made()

    def make(variant: str, fault: str) -> Run:
        slowed = fault.startswith("slow-")
        never_learns = slowed and (variant, fault.removeprefix("slow-")) in NEVER_LEARNS
        steps = NEVER_STEPS if never_learns else SLOW_STEPS if slowed else STEPS
        workload = _workload(variant, workdir, f"{variant}-{fault}", fault, steps, SLOW_RANK if slowed else None,
                             wrapped=True, never_learns=never_learns)
        run = foreign.run(workload, agent, workdir)
        # judged at once: the agent forgets a rank silent for its TTL (120 s), sooner than the module's later runs
        # are done
        JUDGED.update({(run.job, source): run.diagnosis(source) for source in SOURCES})
        return run

    def get(variant: str, fault: str = "none") -> Run:
        return made.get((variant, fault), lambda: make(variant, fault))

    return get


def _results(directory: Path) -> dict[int, dict]:
    """{rank: {"losses": [float], "params": hash, ...}} from a run's --out directory."""
    results = {}
    for path in sorted(directory.glob("rank-*.json")):
        data = json.loads(path.read_text())
        results[int(path.stem.split("-")[1])] = {**data, "losses": [float.fromhex(x) for x in data["losses"]]}
    return results


#: Each run's diagnosis by (job, source), made as the run ended (`runs`).
JUDGED: dict[tuple[str, str], foreign.Diagnosis] = {}


def _judged(run: Run, source: str) -> foreign.Diagnosis:
    diagnosis = JUDGED[run.job, source]
    assert diagnosis.report is not None, diagnosis.describe()
    assert diagnosis.report["summary"]["ranks"] >= run.workload.nproc, diagnosis.describe()
    return diagnosis


def _phase_statistic(records: list[dict], statistic: Callable[[list[float]], float]) -> dict[str, float]:
    """Each phase's ``statistic`` over a rank's steps after the first (which holds the job's start), 0 where absent."""
    return {phase: statistic([r.get(field, 0.0) for r in records[1:]]) for phase, field in PHASES.items()}


def _phases_sum_to_the_step(records: list[dict]) -> None:
    for record in records:
        total = sum(record.get(field, 0.0) for field in PHASES.values())
        assert math.isclose(total, record["step_seconds"], rel_tol=1e-6, abs_tol=1e-6), record
        assert all(record.get(field, 0.0) >= 0 for field in PHASES.values()), record


# -- healthy runs ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", HEALTHY)
def test_each_optimizer_step_is_one_step_with_the_frameworks_own_loss(runs, workdir, variant):
    run = runs(variant)
    steps = run.run_log_steps()
    assert sorted(steps) == [0, 1], run.output[-2000:]
    assert all([r["step"] for r in records] == list(range(1, STEPS + 1)) for records in steps.values())
    framework = _results(workdir / f"{variant}-none")
    assert sorted(framework) == [0, 1] and all(len(r["losses"]) == STEPS for r in framework.values())
    reported = {rank: [r.get("loss") for r in records] for rank, records in steps.items()}
    assert all(isinstance(loss, float) for losses in reported.values() for loss in losses), reported
    if variant == "hf_trainer":
        # with its evaluations and checkpoints (every 4 steps) inside the measured steps
        assert all((r["evaluations"], r["checkpoints"]) == (STEPS // 4, STEPS // 4) for r in framework.values())
        # The Trainer logs, per optimizer step, the mean over the ranks of each rank's sum of its micro-batches'
        # losses (all-gathered in float32): the mean of what the two ranks reported, to float32 rounding.
        logged = framework[0]["losses"]
        assert framework[1]["losses"] == logged  # every rank logs the same mean
        means = [(a + b) / 2 for a, b in zip(reported[0], reported[1], strict=True)]
        assert all(math.isclose(m, x, rel_tol=1e-6) for m, x in zip(means, logged, strict=True)), (means, logged)
    else:
        for rank in (0, 1):
            own = framework[rank]["losses"]
            if BACKWARDS[variant] == 1:  # the very tensor backward() was called on
                assert reported[rank] == own
            else:  # the micro-batches' divided losses summed, in float32 both, maybe in another order
                assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(reported[rank], own, strict=True)), \
                    (reported[rank], own)


@pytest.mark.parametrize("variant", HEALTHY)
def test_the_framework_is_named_in_the_hello(runs, variant):
    run = runs(variant)
    assert [r["hello"]["framework"] for r in run.ranks] == [FRAMEWORK[variant]] * 2  # the agent's
    hellos = run.run_log_hellos()
    assert sorted(hellos) == [0, 1]
    assert {h["framework"] for hs in hellos.values() for h in hs} == {FRAMEWORK[variant]}  # the run log's


@pytest.mark.parametrize("variant", HEALTHY)
def test_the_hello_says_what_the_job_trains_where_the_model_says_it(runs, variant):
    """After its first whole step a rank's hello says what it trains (gpuwatch.trainer.auto.workload), for the PLAN
    rules: the Hugging Face job's Llama from its config, the global batch (micro-batches of 4, 2 accumulated, 2 ranks)
    and the sequence length; the other jobs' model (blocks without attention) is no transformer the planner reads,
    and their hellos' notes say so, with no shape."""
    sequence = 16  # workloads/framework_job.py's SEQUENCE
    run = runs(variant)
    hellos = run.run_log_hellos()
    latest = {rank: said[-1] for rank, said in hellos.items()}
    agents = {r["rank"]: r["hello"] for r in run.ranks}
    if variant == "hf_trainer":
        for hello in (*latest.values(), *agents.values()):
            assert hello["model"] == {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 128,
                                      "tied_embeddings": False, "gated": True, "norm_params": 1, "bias": False,
                                      "positions": 0, "source": "hf"}, hello
            assert (hello["global_batch"], hello["seq_len"]) == (4 * 2 * 2, sequence), hello
    else:
        for rank, said in hellos.items():
            assert all("model" not in hello for hello in said), rank
            notes = [note for hello in said for note in hello.get("notes", ())]
            assert any(note.startswith("the model's shape is not known (no attention module") for note in notes), notes


@pytest.mark.parametrize("variant", HEALTHY)
def test_the_phases_sum_to_the_step(runs, variant):
    steps = runs(variant).run_log_steps()
    for rank, records in steps.items():
        _phases_sum_to_the_step(records)
        # after the first step (whose first batch was read before the Monitor existed) every phase is measured
        missing = [(r["step"], field) for r in records[1:] for field in PHASES.values() if field not in r]
        assert not missing, (rank, missing)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("variant", HEALTHY)
def test_a_healthy_run_raises_no_warning(runs, variant, source):
    diagnosis = _judged(runs(variant), source)
    assert "PERF002" not in diagnosis.not_run(), diagnosis.not_run()  # the straggler rule did compare the ranks
    assert diagnosis.serious() == {}, diagnosis.describe()


@pytest.mark.parametrize("variant", HEALTHY)
def test_the_losses_and_parameters_are_bit_for_bit_those_of_the_unmeasured_run(runs, agent, workdir, variant):
    runs(variant)
    bare = _workload(variant, workdir, f"{variant}-bare", "none", STEPS, None, wrapped=False)
    with launched(bare, agent, workdir) as (process, _):
        assert process.wait(foreign.RUN_TIMEOUT_S) == 0, (workdir / f"{bare.job}.out").read_text()[-4000:]
    measured, unmeasured = _results(workdir / f"{variant}-none"), _results(workdir / f"{variant}-bare")
    assert sorted(unmeasured) == [0, 1] and all(len(r["losses"]) == STEPS for r in unmeasured.values())
    for rank in (0, 1):
        assert [x.hex() for x in measured[rank]["losses"]] == [x.hex() for x in unmeasured[rank]["losses"]]
        assert measured[rank] == unmeasured[rank]  # the final parameters' hash too


# -- planted faults -------------------------------------------------------------------------------------------------

def _slowed_run(slowed: tuple[str, str]) -> str:
    variant, phase = slowed
    return f"{variant}-slow-{phase}"


@pytest.mark.parametrize(("variant", "phase"), sharing("frameworks", SLOWED, _slowed_run))
def test_a_slowed_phase_holds_the_time(runs, variant, phase):
    """Rank 1 sleeps 0.2 s per optimizer step in one phase, and the record puts the sleep there.

    The verdict rests on what a sleep guarantees, not on how fast the machine is: a sleep lasts at least its time, so
    the slowed phase's median step holds the whole of it; a phase that held even half of it would in every step, so
    every other phase (and the peer's same phase) has a step with less. A loaded machine stretches the phases' own
    work, never that bound (CI once saw a loaded 2-core machine take 0.07 s over a phase of this tiny model's).
    Rank 0 waits for rank 1 in a collective (exposed communication), not in that phase of its own."""
    run = runs(variant, f"slow-{phase}")
    steps = run.run_log_steps()
    assert sorted(steps) == [0, 1]
    for records in steps.values():
        assert [r["step"] for r in records] == list(range(1, run.workload.steps + 1))
        _phases_sum_to_the_step(records)
    slowed, slowed_least = (_phase_statistic(steps[SLOW_RANK], statistic) for statistic in (statistics.median, min))
    peer, peer_least = (_phase_statistic(steps[PEER], statistic) for statistic in (statistics.median, min))
    assert slowed[phase] >= DELAY - CLOCK_SLACK, f"rank {SLOW_RANK}, slowed in {phase}: medians {slowed}"
    holding_half = {name: least for name, least in slowed_least.items() if name != phase and least >= DELAY / 2}
    assert not holding_half, f"rank {SLOW_RANK}, slowed in {phase}, has the sleep elsewhere: least {slowed_least}"
    assert peer_least[phase] < DELAY / 2 and peer["collective"] >= DELAY / 2, \
        f"rank {PEER}, waiting for rank {SLOW_RANK}: medians {peer}, least {peer_least}"


#: The straggler runs: each slowed phase but the optimizer's (one rank's slow update is named the same way).
STRAGGLERS = [(v, p) for v, p in SLOWED if p != "optimizer"]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize(("variant", "phase"), sharing("frameworks", STRAGGLERS, _slowed_run))
def test_a_slowed_rank_is_named_as_the_straggler_with_its_phase(runs, variant, phase, source):
    """PERF002 names rank 1, whatever phase holds its extra time, and its evidence about rank 1 names that phase
    (``values["phase"]``: the phase, or its record field)."""
    diagnosis = _judged(runs(variant, f"slow-{phase}"), source)
    (straggler,) = diagnosis.serious().get("PERF002", [None])
    assert straggler is not None, diagnosis.describe()
    assert ranks_named(straggler) == {SLOW_RANK}, straggler
    named = {e["values"].get("phase") for e in straggler["evidence"] if e["where"].get("rank") == SLOW_RANK}
    assert named & set(PHASE_NAMES[phase]), (f"PERF002 should name the {phase} phase", straggler)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize(("variant", "phase"), sharing("frameworks", NEVER_LEARNS, _slowed_run))
def test_a_model_that_never_learns_is_named_on_every_rank(runs, variant, phase, source):
    """Named by CONV006 on both ranks, though one of them is also slowed."""
    diagnosis = _judged(runs(variant, f"slow-{phase}"), source)
    found = diagnosis.serious().get("CONV006", [])
    assert found, diagnosis.describe()
    assert set().union(*map(ranks_named, found)) == {0, 1}, found
