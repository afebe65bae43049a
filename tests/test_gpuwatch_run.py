"""``gpuwatch run -- COMMAND…``: a user's script with no gpuwatch import (tests/workloads/plain_ddp.py), measured from
outside, under torchrun with gloo on the CPU, reporting to a real simulated agent and a run log (tests/foreign.py).

What must hold: every rank reports one step record per optimizer step (gradient accumulation included), with the loss
the script computed and its learning rate; the script's losses are bit for bit those of a run without gpuwatch; the
diagnosis names a planted straggler, duplicated shards and a stuck rank as it does for an instrumented script; an
exception inside the injected code never reaches training; the wrapper passes signals on and exits with the
command's status; the injected sitecustomize imports no torch of its own and still runs the one it hides. No test
looks at a timing.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import foreign
import pytest
import torch
from foreign import GPUWATCH_RUN, Run, Workload, launched, ranks_named, simulated_agent
from test_e2e_faults import by_rank

from gpuwatch.protocol.schema import MAX_COMMAND_ARG_CHARS, MAX_COMMAND_ARGS, UNAVAILABLE_FROM_OUTSIDE
from gpuwatch.trainer.auto import SITE_DIRECTORY, instrumented_environment, is_launcher
from gpuwatch.trainer.auto import layout as layout_module
from gpuwatch.trainer.telemetry import captured_command

from conftest import VERDICT_POLL_S, sharing, wait_until

pytestmark = pytest.mark.integration

#: Three gradient-similarity samples (every 10 steps) and an LR drop (StepLR every 10 steps) in a run.
STEPS = 30
#: Long enough for the watchdog (3 s floor, 5 × the median step) plus the rules' 5 s and a few rounds.
FOUND_TIMEOUT_S = 90.0
#: Plants an exception in the injected code, then runs the script given as its first argument as __main__; at exit
#: writes what the instrumentation counted to $FAILURES_DIR/rank-R.json.
RAISING_DRIVER = '''
import atexit, json, os, runpy, sys
import torch
from gpuwatch.trainer.auto import instrument

def planted(losses):
    raise RuntimeError("planted in the injected code")

instrument._total = planted
counts = instrument.active.failures.counts
out = os.path.join(os.environ["FAILURES_DIR"], "rank-" + os.environ["RANK"] + ".json")
atexit.register(lambda: open(out, "w").write(json.dumps(dict(counts))))
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as python3 SCRIPT sets it: its siblings import
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def _plain(steps: int = STEPS, fault: str = "none", fault_rank: int | None = None, *args: str,
           wrapped: bool = True, more_faults: tuple[str, ...] = ()) -> Workload:
    return Workload("plain_ddp", 2, steps, fault, fault_rank, args=args, wrapper=GPUWATCH_RUN if wrapped else (),
                    more_faults=more_faults)


def _sleeping_on_the_same_data() -> Workload:
    """Rank 0 sleeps 0.3 s a step, and both ranks train on the same data: one run for two faults whose rules read
    different evidence (timings; gradients), each named on its own."""
    return _plain(STEPS, "sleep-rank", 0, more_faults=("same-data",))


def _losses(directory: Path) -> dict[int, list[float]]:
    """{rank: the losses the script computed, exactly}, from its --losses directory."""
    return {int(path.stem.split("-")[1]): [float.fromhex(text) for text in json.loads(path.read_text())]
            for path in sorted(directory.glob("rank-*.json"))}


@pytest.fixture(scope="module")
def runs(agent, workdir) -> Callable[..., Run]:
    """``runs(workload_key, workload)``: the finished run, made on first use and shared by the tests, which are
    marked as its (``shares``, conftest's ``sharing``): under pytest-xdist each run's tests go to one worker."""
    made: dict[str, Run] = {}

    def get(key: str, workload: Workload) -> Run:
        if key not in made:
            made[key] = foreign.run(workload, agent, workdir)
        return made[key]

    return get


def _with_losses(workdir: Path, name: str, steps: int = STEPS, *args: str, wrapped: bool = True) -> Workload:
    return _plain(steps, "none", None, "--losses", str(workdir / name), *args, wrapped=wrapped)


@pytest.mark.parametrize("accumulate", sharing("gpuwatch_run", [1, 3], lambda accumulate: f"healthy-{accumulate}"))
def test_every_rank_reports_each_optimizer_step_with_the_scripts_loss(runs, workdir, accumulate):
    run = runs(f"healthy-{accumulate}", _with_losses(workdir, f"losses-{accumulate}", STEPS, "--accumulate",
                                                     str(accumulate)))
    assert [r["rank"] for r in run.ranks] == [0, 1]
    for rank in run.ranks:  # the agent took the hello's new fields
        assert rank["hello"]["framework"] == "plain"
        assert any(a.endswith("workloads/plain_ddp.py") for a in rank["hello"]["command"])  # the rank's own
        # a DDP model over every rank: the layout is plain data parallelism, the Monitor's own, and each rank holds
        # its replica's whole gradient
        # gpuwatch's communication hook times DDP's buckets
        assert set(rank["hello"]["unavailable_from_outside"]) == \
            set(UNAVAILABLE_FROM_OUTSIDE) - {"layout", "gradients", "ddp_bucket_latency"}
    computed = _losses(workdir / f"losses-{accumulate}")
    steps = run.run_log_steps()
    assert sorted(steps) == [0, 1]
    for rank, records in steps.items():
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # one per optimizer step
        reported = [r["loss"] for r in records]
        if accumulate == 1:  # the tensor backward() was called on, as the script read it
            assert reported == computed[rank]
        else:  # the sum of the micro-batches' divided losses: in float32 here, in float64 in the script
            assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(reported, computed[rank], strict=True))
        assert [r["lr"] for r in records] == [0.1] * 10 + [0.05] * 10 + [0.025] * 10  # StepLR, read in the hook
        # DDP's all-reduce timed per bucket (its one bucket, each micro-batch's backward under no_sync reduces
        # nothing) on its group, every step; the script's logging all_reduce timed, after each optimizer step
        gradient_bytes = 4 * (32 * 64 + 64 + 64 + 1)  # float32: Linear(32, 64), Linear(64, 1)
        assert all("gradient_sync_bytes" not in r and "compute_seconds" in r for r in records)
        assert [r["collectives"]["all_reduce"]["count"] for r in records] == [1] + [2] * (STEPS - 1)
        assert [r["groups"]["default"]["bytes"] for r in records] == \
            [gradient_bytes] + [gradient_bytes + 4] * (STEPS - 1)
        assert all(r["groups"]["default"]["seconds"] > 0 for r in records)
        assert all("dataloader_wait_seconds" in r for r in records[1:])
        assert [r["step"] for r in records if "grad_cosine_similarity" in r] == [10, 20, 30]
        assert [r["step"] for r in records if "grad_norm" in r] == [10, 20, 30]


@pytest.mark.shares("gpuwatch_run:healthy-1")
def test_losses_are_bit_identical_with_and_without_gpuwatch_run(runs, agent, workdir):
    runs("healthy-1", _with_losses(workdir, "losses-1", STEPS, "--accumulate", "1"))
    bare = _with_losses(workdir, "losses-bare", STEPS, wrapped=False)
    with launched(bare, agent, workdir) as (process, _):
        assert process.wait(foreign.RUN_TIMEOUT_S) == 0
    measured, unmeasured = _losses(workdir / "losses-1"), _losses(workdir / "losses-bare")
    assert sorted(unmeasured) == [0, 1] and len(unmeasured[0]) == STEPS
    assert [[x.hex() for x in measured[r]] for r in (0, 1)] == [[x.hex() for x in unmeasured[r]] for r in (0, 1)]


@pytest.mark.shares("gpuwatch_run:healthy-1")
def test_a_users_own_comm_hook_runs_inside_gpuwatchs_and_the_losses_stay_bit_for_bit(runs, agent, workdir):
    """DDP takes one communication hook, once; gpuwatch run registers its own, which times each bucket. A script's
    own hook (PyTorch's fp16_compress_hook), registered before gpuwatch's Monitor is made (right after the DDP model)
    or after (past the first forward), runs inside it: no error, the script's losses bit for bit those of the same
    script unmeasured (and not those of a run without the hook), DDP's buckets still timed on their group."""
    healthy = runs("healthy-1", _with_losses(workdir, "losses-1", STEPS, "--accumulate", "1"))
    bare = _with_losses(workdir, "losses-hook-bare", STEPS, "--comm-hook", "before", wrapped=False)
    with launched(bare, agent, workdir) as (process, _):
        assert process.wait(foreign.RUN_TIMEOUT_S) == 0
    unmeasured = _losses(workdir / "losses-hook-bare")
    assert sorted(unmeasured) == [0, 1] and len(unmeasured[0]) == STEPS
    assert unmeasured != _losses(workdir / "losses-1")  # the script's hook is the one that reduced
    for when in ("before", "after"):
        run = runs(f"hook-{when}", _with_losses(workdir, f"losses-hook-{when}", STEPS, "--comm-hook", when))
        measured = _losses(workdir / f"losses-hook-{when}")
        assert [[x.hex() for x in measured[r]] for r in (0, 1)] == [[x.hex() for x in unmeasured[r]] for r in (0, 1)]
        steps = run.run_log_steps()
        assert sorted(steps) == [0, 1] and all(len(records) == STEPS for records in steps.values())
        for records in steps.values():  # DDP's one bucket a step (and the logging all-reduce) on the world group
            assert [r["collectives"]["all_reduce"]["count"] for r in records] == [1] + [2] * (STEPS - 1)
            assert all(r["groups"]["default"]["seconds"] > 0 for r in records)
        assert "raised" not in run.output and "raised" not in healthy.output, run.output[-2000:]


@pytest.mark.shares("gpuwatch_run:healthy-1")
def test_an_exception_inside_the_injected_code_is_counted_and_never_reaches_training(runs, agent, workdir):
    runs("healthy-1", _with_losses(workdir, "losses-1", STEPS, "--accumulate", "1"))
    driver, failures = workdir / "raising_driver.py", workdir / "failures"
    driver.write_text(RAISING_DRIVER)
    failures.mkdir()
    script = str(foreign.WORKLOADS / "plain_ddp.py")
    command = [*GPUWATCH_RUN, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(driver), script, "--steps", str(STEPS), "--losses", str(workdir / "losses-raising")]
    result = subprocess.run(command, env={**os.environ, "FAILURES_DIR": str(failures)}, capture_output=True,
                            text=True, timeout=foreign.RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    assert _losses(workdir / "losses-raising") == _losses(workdir / "losses-1")
    for rank in (0, 1):
        counts = json.loads((failures / f"rank-{rank}.json").read_text())
        assert counts == {"AutoMonitor._after_optimizer_step": STEPS}
    log, summary = result.stderr.rstrip("\n").rsplit("\n", 1)
    assert log.count("RuntimeError: planted in the injected code") == 2  # logged once per rank, not per step
    # every step's record failed: nothing was measured, and the end-of-run line says why
    assert summary == ("gpuwatch run: 0 of 2 ranks measured: AutoMonitor._after_optimizer_step raised RuntimeError: "
                       "planted in the injected code (in 2 processes)")


@pytest.mark.shares("gpuwatch_run:sleep-same-data")
def test_a_sleeping_rank_is_named_as_the_straggler(runs):
    run = runs("sleep-same-data", _sleeping_on_the_same_data())
    for source in ("agent", "run_log"):
        diagnosis = run.diagnosis(source)
        (straggler,) = diagnosis.serious().get("PERF002", [None])
        assert straggler is not None, diagnosis.describe()
        assert ranks_named(straggler) == {0}, straggler


@pytest.mark.shares("gpuwatch_run:sleep-same-data")
def test_duplicated_shards_are_named_on_every_rank(runs):
    run = runs("sleep-same-data", _sleeping_on_the_same_data())
    for source in ("agent", "run_log"):
        diagnosis = run.diagnosis(source)
        found = diagnosis.serious().get("CONV004", [])
        assert found, diagnosis.describe()
        assert set().union(*map(ranks_named, found)) == {0, 1}, found


def test_a_stuck_rank_is_named_live_and_post_mortem(tmp_path):
    workload = _plain(1000, "stuck-rank", 1)
    with simulated_agent(tmp_path) as agent, launched(workload, agent, tmp_path) as (_, run_log):
        def found() -> dict | None:
            findings = foreign.diagnose(workload.job, "agent", agent.url).serious().get("HANG001")
            return findings[0] if findings else None

        finding = wait_until(found, timeout=FOUND_TIMEOUT_S, interval=VERDICT_POLL_S,
                             what="HANG001 for the unmodified DDP script")
        evidence = by_rank(finding)[1]
        assert (evidence["op"], evidence["group"], evidence["waiting"]) == ("all_reduce", "default", [0])
        assert evidence["phase"] == "compute"
        assert evidence["stack_top"].split(":")[0].endswith("workloads/plain_ddp.py")
        assert evidence["stack_top"].endswith(" wait_for_a_lock_nobody_releases")
    post_mortem = foreign.diagnose(workload.job, "run_log", run_log).serious().get("HANG001")
    assert post_mortem and set(by_rank(post_mortem[0])) == {1}


# -- the wrapper ------------------------------------------------------------------------------------------------

#: A command that says it is ready once its SIGTERM handler (exit 7) is in place, or, with "default", without one.
WAITER = ("import signal, sys, time\n"
          "if sys.argv[1] == 'handle': signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
          "print('ready', flush=True)\n"
          "time.sleep(120)\n")


@pytest.mark.parametrize(("disposition", "status"), [("handle", 7), ("default", 128 + signal.SIGTERM)])
def test_sigterm_reaches_the_command_and_its_status_is_the_wrappers(disposition, status):
    wrapper = subprocess.Popen([*GPUWATCH_RUN, sys.executable, "-c", WAITER, disposition], stdout=subprocess.PIPE,
                               text=True)
    try:
        assert wrapper.stdout is not None and wrapper.stdout.readline() == "ready\n"
        wrapper.send_signal(signal.SIGTERM)
        assert wrapper.wait(60) == status
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait()


def test_the_commands_own_exit_status_is_returned():
    assert subprocess.run([*GPUWATCH_RUN, sys.executable, "-c", "raise SystemExit(3)"], timeout=60).returncode == 3


@pytest.mark.parametrize(("command", "status", "message"), [
    ((), 2, "gpuwatch run: no command given"),
    (("/nonexistent/train",), 127, "gpuwatch run: cannot start /nonexistent/train"),
])
def test_bad_input_is_one_line_and_a_nonzero_exit(command, status, message):
    result = subprocess.run([*GPUWATCH_RUN[:-1], *(("--", *command) if command else ())], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == status
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr


def test_the_environment_puts_the_site_first_and_keeps_the_rest():
    env = instrumented_environment({"PYTHONPATH": "/a:/b", "SLURM_JOB_ID": "42"}, socket_path="/s.sock",
                                   run_log="/runs", new_job="made")
    assert env["PYTHONPATH"] == f"{SITE_DIRECTORY}:/a:/b"
    assert (env["GPUWATCH_AUTO"], env["GPUWATCH_SOCKET"], env["GPUWATCH_RUN_LOG"]) == ("1", "/s.sock", "/runs")
    assert "GPUWATCH_JOB" not in env  # Slurm's job id stands
    assert instrumented_environment({}, new_job="made")["GPUWATCH_JOB"] == "made"
    assert instrumented_environment({}, job="mine", new_job="made")["GPUWATCH_JOB"] == "mine"


@pytest.mark.parametrize(("argv", "launcher"), [
    (["python3", "-m", "torch.distributed.run", "--standalone", "train.py"], True),
    (["/usr/bin/python3", "/usr/local/bin/torchrun", "--nproc-per-node", "8", "train.py"], True),
    (["python3", "-m", "torch.distributed.launch", "train.py"], True),
    (["python3", "-u", "train.py", "--launcher", "torchrun"], False),
    (["python3", "-m", "gpuwatch.trainer.cli", "--tp", "2"], False),
])
def test_torchruns_launcher_is_left_alone_and_its_ranks_are_not(argv, launcher):
    """torchrun's launcher imports torch but trains nothing: it gets no hooks, even idle ones."""
    assert is_launcher(argv) is launcher


def test_the_hellos_command_line_withholds_secrets_and_fits_its_datagram():
    argv = ["python3", "train.py", "--hf-token", "hf_abc", "--api-key=sk-1", "--use-auth", "--lr", "0.1"]
    assert captured_command(argv) == ["python3", "train.py", "--hf-token", "<redacted>", "--api-key=<redacted>",
                                      "--use-auth", "--lr", "0.1"]
    long = captured_command(["python3", "x" * 1000, *["--flag"] * 100])
    assert len(long) == MAX_COMMAND_ARGS and len(long[1]) == MAX_COMMAND_ARG_CHARS


def test_the_hidden_sitecustomize_still_runs_and_no_torch_is_imported(tmp_path):
    """A user's own sitecustomize further down PYTHONPATH runs; a process that never imports torch gets none."""
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    probe = ("import os, sys\n"
             "from gpuwatch.trainer import auto\n"
             "print(os.environ.get('USER_SITECUSTOMIZE'), 'torch' in sys.modules,"
             " any(type(f).__name__ == '_AfterTorchImport' for f in sys.meta_path))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([*GPUWATCH_RUN, sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.stdout.split() == ["ran", "False", "True"], result.stderr


def test_a_rule_short_of_what_gpuwatch_run_cannot_see_says_so():
    """NCCL005 needs per-call collective timings; ranks measured from outside under a built-in C++ DDP hook have
    DDP's all-reduce only as a tail per backward, and their hello says so: the reason it did not run names that, not a
    generic gap."""
    from diagnose_facts import facts, rank

    from gpuwatch.diagnosis import needs

    outside = facts(ranks=[rank(r, dp=2, unavailable_from_outside=("ddp_bucket_latency",)) for r in (0, 1)])
    reason = needs.COLLECTIVES.available(outside)
    assert reason is not None and "ranks 0-1 of job job-1 measured from outside (gpuwatch run)" in reason
    assert UNAVAILABLE_FROM_OUTSIDE["ddp_bucket_latency"] in reason
    inside = needs.COLLECTIVES.available(facts(ranks=[rank(r, dp=2) for r in (0, 1)]))
    assert inside is not None and "gpuwatch run" not in inside


def _train(run_log: Path | None, steps: int, losses: Path) -> tuple[list[str], dict[int, list[dict]]]:
    """`gpuwatch train --no-telemetry` (pp=2: two forked ranks, the last stage computing the loss), under `gpuwatch
    run --run-log run_log` unless None, its per-step results written to `losses` (`--log-jsonl`): its printed steps
    without their timings, and the step records by rank."""
    train = [sys.executable, "-m", "gpuwatch.cli.main", "train", "--tp", "1", "--pp", "2", "--dp", "1", "--steps",
             str(steps), "--no-telemetry", "--log-jsonl", str(losses)]
    command = [*GPUWATCH_RUN[:-1], "--run-log", str(run_log), "--", *train] if run_log is not None else train
    result = subprocess.run(command, capture_output=True, text=True, timeout=foreign.RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    printed = [line.rsplit(" lr ", 1)[0] for line in result.stdout.splitlines() if line.startswith("step ")]
    records: dict[int, list[dict]] = {}
    for path in sorted(run_log.glob("*.jsonl")) if run_log is not None else ():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["kind"] == "step":
                records.setdefault(record["rank"], []).append(record)
    return printed, records


def test_the_reference_trainer_without_its_telemetry_is_measured_from_outside_and_unchanged(tmp_path):
    """The reference trainer's own launcher forks its ranks and ends each in os._exit: every step still arrives (the
    Monitor is closed as the process group is destroyed), the last stage's loss is the one it prints, and its losses
    and gradient norms are bit-identical with and without gpuwatch run."""
    steps = 10  # the first measuring step (checksum) is the 10th
    measured, records = _train(tmp_path / "log", steps, tmp_path / "measured.jsonl")
    unmeasured, _ = _train(None, steps, tmp_path / "unmeasured.jsonl")
    assert len(measured) == steps and measured == unmeasured

    def exact(path: Path) -> list[tuple[str, str]]:  # each step's loss and gradient norm, every bit
        return [(float(r["loss"]).hex(), float(r["grad_norm"]).hex())
                for r in map(json.loads, path.read_text().splitlines())]

    assert exact(tmp_path / "measured.jsonl") == exact(tmp_path / "unmeasured.jsonl")
    assert sorted(records) == [0, 1]
    assert all([r["step"] for r in records[rank]] == list(range(1, steps + 1)) for rank in (0, 1))
    assert all("loss" not in r for r in records[0])  # the first stage's backward starts from activations
    printed_losses = [line.split(" loss ")[1].split()[0] for line in measured]
    assert [f"{r['loss']:.4f}" for r in records[1]] == printed_losses
    # No DDP model spans the ranks, so their layout is not known from outside: the two pipeline stages hold
    # different weights and do different work, and are not compared as replicas or peers (no CONV003, no PERF002)
    report = json.loads(subprocess.run(
        [sys.executable, "-m", "gpuwatch.cli.main", "diagnose", "--run-log", str(tmp_path / "log"), "--format", "json",
         "--fail-on", "never"], capture_output=True, text=True, timeout=120, check=True).stdout)
    assert [f["code"] for f in report["findings"] if f["severity"] in ("warning", "critical")] == []
    not_run = {entry["code"]: entry["reason"] for entry in report["not_run"]}
    assert all("gpuwatch run" in not_run[code] and "layout" in not_run[code] for code in ("CONV003", "PERF002"))


def test_the_overhead_benchmark_runs_every_arm():
    """benchmarks/run_overhead.py at a tiny size: it prints the machine, and off, on and the floor for the step."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "run_overhead.py"
    result = subprocess.run([sys.executable, str(script), "--rounds", "1", "--steps", "5", "--only", "small"],
                            capture_output=True, text=True, timeout=foreign.RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert lines[1].startswith("machine: ") and lines[2].startswith("load average before: ")
    assert any(line.startswith("MLP 128-512-16, batch 64, 5 steps a run") for line in lines), result.stdout
    assert sum(line.strip().startswith(("on - off", "floor - off")) for line in lines) == 2, result.stdout
    assert lines[-1].startswith("load average after: ")


# -- the layout ---------------------------------------------------------------------------------------------------

#: Stand-ins for Megatron-LM's parallel state and torchtitan's ParallelDims (tests/workloads/standins/README.md).
STANDINS = foreign.WORKLOADS / "standins"
LAYOUT_STEPS = 12


def _records(run_log: Path) -> tuple[dict[int, dict], dict[int, list[dict]]]:
    """{rank: its last hello} and {rank: its step records} from a run log directory."""
    hellos: dict[int, dict] = {}
    steps: dict[int, list[dict]] = {}
    for path in sorted(run_log.glob("*.jsonl")):
        for record in map(json.loads, path.read_text().splitlines()):
            if record["kind"] == "hello":
                hellos[record["rank"]] = record
            elif record["kind"] == "step":
                steps.setdefault(record["rank"], []).append(record)
    return hellos, steps


def _run_logged(run_log: Path, options: tuple[str, ...], script: str, nproc: int, *args: str,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`gpuwatch run --run-log run_log OPTIONS -- torchrun --standalone --nproc-per-node N tests/workloads/SCRIPT`."""
    command = [*GPUWATCH_RUN[:-1], "--run-log", str(run_log), *options, "--", sys.executable, "-m",
               "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(foreign.WORKLOADS / script), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=foreign.RUN_TIMEOUT_S,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.mark.parametrize(("groups", "options", "framework"), [
    ("plain", ("--layout", "2,1,2"), "plain"),
    ("megatron", (), "megatron"),
    ("torchtitan", (), "torchtitan"),
])
def test_the_layout_is_known_from_the_option_megatron_or_a_device_mesh(tmp_path, groups, options, framework):
    """A tp=2 × dp=2 job with no DDP model: its layout comes from `--layout`, from Megatron's parallel state or from
    torchtitan's world mesh, each rank's hello carries it (sizes, coordinates, groups), and the rules that compare
    peers run (no 'parallel layout' among their reasons not to). No rank holds a whole gradient: the hello says so."""
    env = {"PYTHONPATH": os.pathsep.join([str(STANDINS), os.environ.get("PYTHONPATH", "")])}
    _run_logged(tmp_path / "log", options, "parallel_layouts.py", 4, "--groups", groups, "--steps",
                str(LAYOUT_STEPS), env=env)
    hellos, steps = _records(tmp_path / "log")
    assert sorted(hellos) == sorted(steps) == [0, 1, 2, 3]
    for rank, hello in hellos.items():
        tp_rank, dp_rank = rank % 2, rank // 2  # TP fastest, then DP
        assert (hello["tp_size"], hello["pp_size"], hello["dp_size"]) == (2, 1, 2), hello
        assert (hello["tp_rank"], hello["pp_stage"], hello["dp_rank"]) == (tp_rank, 0, dp_rank), hello
        assert hello["process_groups"] == {"tp": [2 * dp_rank, 2 * dp_rank + 1], "dp": [tp_rank, tp_rank + 2],
                                           "pp": [rank]}, hello
        assert hello["framework"] == framework
        assert "layout" not in hello["unavailable_from_outside"]
        assert "gradients" in hello["unavailable_from_outside"]
        assert [r["step"] for r in steps[rank]] == list(range(1, LAYOUT_STEPS + 1))
        assert all("loss" in r for r in steps[rank])
        assert not any("grad_cosine_similarity" in r or "param_checksum" in r for r in steps[rank])
        # the TP pair's all-reduce and the DP pair's, each step after the first forward, named by the hello's groups
        assert steps[rank][-1]["collective_calls"] == {"tp": LAYOUT_STEPS, "dp": LAYOUT_STEPS}, steps[rank][-1]
    report = json.loads(subprocess.run(
        [sys.executable, "-m", "gpuwatch.cli.main", "diagnose", "--run-log", str(tmp_path / "log"), "--format",
         "json", "--fail-on", "never"], capture_output=True, text=True, timeout=120, check=True).stdout)
    not_run = {entry["code"]: entry["reason"] for entry in report["not_run"]}
    for code in ("PERF001", "PERF002", "CONV003", "CONV004", "CONV005"):
        assert "parallel layout" not in not_run.get(code, ""), (code, not_run[code])
    assert [f["code"] for f in report["findings"] if f["severity"] in ("warning", "critical")] == []


def test_a_layout_that_does_not_match_the_world_is_left_unknown(tmp_path):
    """`--layout 1,1,4` on 2 ranks (no WORLD_SIZE for the wrapper to check it against): each rank says so once and
    leaves its layout unknown rather than half right; training runs on."""
    result = _run_logged(tmp_path / "log", ("--layout", "1,1,4"), "plain_ddp.py", 2, "--steps", "3")
    assert result.stderr.count("--layout 1,1,4 multiplies to 4, but the job has 2 ranks") == 2, result.stderr
    hellos, steps = _records(tmp_path / "log")
    assert all("layout" in hello["unavailable_from_outside"] for hello in hellos.values())
    assert sorted(steps) == [0, 1] and all(len(records) == 3 for records in steps.values())


@pytest.mark.parametrize(("layout", "world", "message"), [
    ("2,x,1", None, "gpuwatch run: --layout takes tp,pp,dp: three positive integers such as 2,1,4 (got '2,x,1')"),
    ("0,1,1", None, "gpuwatch run: --layout takes tp,pp,dp"),
    ("2,2", None, "gpuwatch run: --layout takes tp,pp,dp"),
    ("2,1,2", "8", "gpuwatch run: --layout 2,1,2: tp × pp × dp = 4, but WORLD_SIZE is 8"),
])
def test_a_bad_layout_is_one_line_and_a_nonzero_exit(layout, world, message):
    env = {key: value for key, value in os.environ.items() if key != "WORLD_SIZE"}
    if world is not None:
        env["WORLD_SIZE"] = world
    result = subprocess.run([*GPUWATCH_RUN[:-1], "--layout", layout, "--", sys.executable, "-c", "pass"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr


# -- side by side with the explicit API ---------------------------------------------------------------------------

#: What a step record says about the step's work, not its timing: equal from outside and through the explicit API.
WORK_FIELDS = ("step", "loss", "lr", "gradient_sync_bytes", "collective_calls", "grad_norm", "grad_cosine_similarity",
               "param_checksum")


def test_gpuwatch_run_sees_what_the_explicit_monitor_sees(tmp_path):
    """The same deterministic DDP training (tests/workloads/twin_ddp.py, 2 gloo ranks) measured once from outside and
    once through the explicit API (monitored_twin.py): per rank the same steps, the same losses bit for bit, the same
    collectives (count and bytes per op, calls per group) and the same gradient measurements."""
    _run_logged(tmp_path / "outside", (), "twin_ddp.py", 2, "--steps", str(STEPS))
    explicit = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(foreign.WORKLOADS / "monitored_twin.py"), "--steps", str(STEPS)]
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPUWATCH_")}
    result = subprocess.run(explicit, capture_output=True, text=True, timeout=foreign.RUN_TIMEOUT_S,
                            env={**env, "GPUWATCH_RUN_LOG": str(tmp_path / "inside"), "GPUWATCH_JOB": "explicit"})
    assert result.returncode == 0, result.stderr[-4000:]
    (_, outside), (_, inside) = _records(tmp_path / "outside"), _records(tmp_path / "inside")
    assert sorted(outside) == sorted(inside) == [0, 1]
    for rank in (0, 1):
        assert len(outside[rank]) == len(inside[rank]) == STEPS

        def work(record: dict) -> dict:
            counts = {op: (c["count"], c["bytes"]) for op, c in record.get("collectives", {}).items()}
            return {**{name: record.get(name) for name in WORK_FIELDS}, "collectives": counts}

        assert [work(r) for r in outside[rank]] == [work(r) for r in inside[rank]]
        assert all(isinstance(r["loss"], float) and r["groups"]["default"]["bytes"] > 0 for r in outside[rank])
        # DDP's buckets, then the logging all-reduce
        assert all(r["collectives"]["all_reduce"]["count"] > 1 for r in outside[rank])
        assert [r["step"] for r in outside[rank] if "grad_cosine_similarity" in r] == [10, 20, 30]


def test_a_grad_scalers_loss_is_reported_unscaled_with_its_scale_and_the_clipped_norm(tmp_path):
    """plain_ddp.py --scaler: backward() runs on GradScaler.scale(loss), yet the loss reported is the loss the script
    computed, bit for bit (not the scaled one divided back), with the scaler's scale beside it; the norm
    clip_grad_norm_ returned is the step's gradient norm, every step."""
    steps = 12
    _run_logged(tmp_path / "log", (), "plain_ddp.py", 2, "--steps", str(steps), "--scaler", "--losses",
                str(tmp_path / "losses"))
    computed = _losses(tmp_path / "losses")
    _, steps_by_rank = _records(tmp_path / "log")
    assert sorted(steps_by_rank) == [0, 1]
    for rank, records in steps_by_rank.items():
        assert [r["loss"] for r in records] == computed[rank]
        assert [r["loss_scale"] for r in records] == [65536.0] * steps  # GradScaler's initial scale, no overflow
        assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in records)


@pytest.mark.parametrize(("framework", "detected"), [("huggingface", "transformers"), ("lightning", "lightning")])
def test_a_framework_adapter_counts_each_optimizer_steps_samples(tmp_path, framework, detected):
    """The Hugging Face and Lightning adapters (stand-in base classes with the real hook points) count the samples of
    each optimizer step (two micro-batches of 16), the first step's included (counted before its first forward);
    the hello no longer lists samples as unavailable from outside."""
    env = {"PYTHONPATH": os.pathsep.join([str(STANDINS), os.environ.get("PYTHONPATH", "")])}
    _run_logged(tmp_path / "log", (), "framework_callbacks.py", 2, "--framework", framework, "--steps", "6", env=env)
    hellos, steps = _records(tmp_path / "log")
    assert sorted(hellos) == sorted(steps) == [0, 1]
    for rank in (0, 1):
        assert hellos[rank]["framework"] == detected
        assert "samples" not in hellos[rank]["unavailable_from_outside"]
        assert [(r["step"], r["samples"]) for r in steps[rank]] == [(step, 32) for step in range(1, 7)]


@pytest.mark.parametrize("clipping", [(), ("--as-torchtitan",)])
def test_an_fsdp_models_gradient_norm_is_the_clipped_one_and_the_rest_is_said_unavailable(tmp_path, clipping):
    """FSDP2 (fully_shard, gloo) on its default mesh, one dimension without names over the world: data parallel. No
    rank holds a whole gradient or the whole parameters, so no gradient cosine or
    checksum is measured (they would be a shard's) and the hello says why; the norm clip_grad_norm_ returned (whole:
    FSDP reduced it), or the one clip_grads_with_norm_ was given (torchtitan's way), is each step's grad_norm, bit for
    bit what the script read; the rules needing the rest say so."""
    steps = 6
    _run_logged(tmp_path / "log", (), "fsdp_clip.py", 2, "--steps", str(steps), "--norms", str(tmp_path / "norms"),
                *clipping)
    hellos, records = _records(tmp_path / "log")
    assert sorted(hellos) == sorted(records) == [0, 1]
    for rank in (0, 1):
        assert "gradients" in hellos[rank]["unavailable_from_outside"]
        assert "layout" not in hellos[rank]["unavailable_from_outside"]
        assert (hellos[rank]["dp_size"], hellos[rank]["dp_rank"], hellos[rank]["tp_size"]) == (2, rank, 1)
        norms = json.loads((tmp_path / "norms" / f"rank-{rank}.json").read_text())
        assert [float(r["grad_norm"]).hex() for r in records[rank]] == norms
        assert all("loss" in r and "grad_cosine_similarity" not in r and "param_checksum" not in r
                   for r in records[rank])
    report = json.loads(subprocess.run(
        [sys.executable, "-m", "gpuwatch.cli.main", "diagnose", "--run-log", str(tmp_path / "log"), "--format",
         "json", "--fail-on", "never"], capture_output=True, text=True, timeout=120, check=True).stdout)
    reasons = [entry["reason"] for entry in report["not_run"]]
    assert any("gradient cosine" in r and UNAVAILABLE_FROM_OUTSIDE["gradients"] in r for r in reasons), reasons
    assert any("parameter checksums" in r and UNAVAILABLE_FROM_OUTSIDE["gradients"] in r for r in reasons), reasons


def test_the_reference_trainer_under_torchrun_with_its_layout_given_reports_every_step_at_the_agent(agent, tmp_path):
    """`gpuwatch run --layout 1,2,1 -- torchrun --standalone --nproc-per-node 2 -m gpuwatch.trainer.cli --pp 2
    --no-telemetry`: the reference trainer's two pipeline stages, measured from outside only, each report every step
    to the agent, with the layout given (stage 0 and 1 of one pipeline, no data-parallel peers); diagnosis judges
    them as that (no rule left out for want of the layout) and finds nothing wrong."""
    steps, job = 10, f"reference-torchrun-{os.getpid()}"
    command = [*GPUWATCH_RUN[:-1], "--socket", str(agent.telemetry_socket), "--job", job, "--layout", "1,2,1", "--",
               sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "gpuwatch.trainer.cli", "--tp", "1", "--pp", "2", "--dp", "1", "--steps", str(steps), "--no-telemetry"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPUWATCH_")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=foreign.RUN_TIMEOUT_S, env=env)
    assert result.returncode == 0, result.stderr[-4000:]

    def settled() -> list[dict] | None:
        ranks = foreign.job_ranks(agent, job)
        return ranks if len(ranks) == 2 and all((r.get("last_step") or {}).get("step") == steps
                                                for r in ranks) else None

    ranks = wait_until(settled, timeout=foreign.SETTLE_TIMEOUT_S, what=f"the agent to hold job {job}'s last steps")
    for rank in ranks:
        hello = rank["hello"]
        assert (hello["tp_size"], hello["pp_size"], hello["dp_size"], hello["pp_stage"]) == (1, 2, 1, rank["rank"])
        assert hello["process_groups"]["pp"] == [0, 1] and "layout" not in hello["unavailable_from_outside"]
    diagnosis = foreign.diagnose(job, "agent", agent.url)
    assert diagnosis.serious() == {}, diagnosis.describe()
    assert not any("parallel layout" in reason for reason in diagnosis.not_run().values()), diagnosis.not_run()


def _mesh(names: tuple[str, ...], shape: tuple[int, ...], coordinate: list[int]) -> SimpleNamespace:
    """What detect_layout reads of a DeviceMesh (its public `mesh`, `mesh_dim_names`, `get_coordinate()`)."""
    return SimpleNamespace(mesh=torch.arange(math.prod(shape)).reshape(shape), mesh_dim_names=names,
                           get_coordinate=lambda: coordinate)


def test_a_meshs_replicate_and_shard_dimensions_make_one_data_parallel_group(monkeypatch):
    """torchtitan's HSDP mesh ("pp", "dp_replicate", "dp_shard", "tp") of 16 ranks: dp is replicate × shard, the
    replicate index the slower; a mesh with context parallelism is no tp × pp × dp layout and is left unknown."""
    monkeypatch.setattr(layout_module.dist, "get_backend", lambda group=None: "gloo")
    names, shape = ("pp", "dp_replicate", "dp_shard", "tp"), (2, 2, 2, 2)
    found = layout_module._from_mesh(_mesh(names, shape, [1, 1, 0, 1]), 13, 16, 5)
    assert found is not None
    assert (found.tp_size, found.pp_size, found.dp_size) == (2, 2, 4)
    assert (found.tp_rank, found.pp_stage, found.dp_rank, found.local_rank) == (1, 1, 2, 5)
    assert found.process_groups == {"tp": (12, 13), "pp": (5, 13), "dp": (9, 11, 13, 15)}
    with_cp = _mesh(("dp_shard", "cp", "tp"), (2, 2, 2), [0, 0, 0])
    assert layout_module._from_mesh(with_cp, 0, 8, 0) is None
    assert layout_module._from_mesh(_mesh(("dp_shard",), (2,), [0]), 0, 4, 0) is None  # not the whole world
