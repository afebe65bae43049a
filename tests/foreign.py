"""Foreign workloads: users' own training scripts (``tests/workloads/``), not gpuwatch's reference trainer, run the
way a user runs them and diagnosed the way a user diagnoses them.

Why a harness of its own: the reference trainer's end-to-end tests (test_e2e_faults.py) fork ranks from inside
pytest and know gpuwatch's internals; a user's script meets gpuwatch only through the documented hooks, under
``torchrun``, with its own timings and habits. A workload here is ``python3 -m torch.distributed.run --standalone
--nproc-per-node N tests/workloads/X.py`` with gloo on the CPU, reporting to a real ``gpuwatch agent --simulate
dgx-h100 --interval 1`` through its own telemetry socket (``GPUWATCH_SOCKET``), under a unique ``GPUWATCH_JOB``,
writing its records to a per-run ``GPUWATCH_RUN_LOG`` directory. Once the agent holds every rank's last step,
``gpuwatch diagnose --agent URL`` and ``gpuwatch diagnose --run-log DIR`` (``--format json``: the same command in
this process, or as its own process where its start-up is part of what is measured) judge it, and only the run's
own job is kept from their findings.

Shared by tests/test_foreign_workloads.py (does the diagnosis name the planted fault, and nothing on a healthy
run?) and benchmarks/false_alarms.py (how often does it cry wolf, and how soon does it see a straggler?).
Every process started here is stopped on the way out, torchrun's workers included (they run in sessions of
their own, out of reach of a process-group signal). Each script ends through ``clean_exit.run_then_exit``: torch's
gloo can abort a finished DDP process at interpreter exit, with or without gpuwatch (that module says why).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from click.testing import CliRunner

from gpuwatch.diagnosis.cli import diagnose as diagnose_command

from conftest import AgentProcess, PrometheusServer, wait_until

WORKLOADS = Path(__file__).resolve().parent / "workloads"
#: The user-style scripts, each runnable as ``torchrun ... X.py [--steps S] [--fault F] [--fault-rank R]``.
SCRIPTS = ("ddp_tutorial", "grad_accumulation", "tiny_lm")
#: Scripts with no gpuwatch import, measured only from outside (run under GPUWATCH_RUN), same options.
UNMODIFIED_SCRIPTS = ("plain_ddp",)
#: Jobs on the real frameworks (Hugging Face Trainer, accelerate, Lightning, FSDP2), no gpuwatch import either, run
#: under GPUWATCH_RUN: the same options, their faults those of workloads/framework_job.py (tests/test_frameworks.py).
FRAMEWORK_SCRIPTS = ("hf_trainer", "accelerate_loop", "lightning_fit", "fsdp2_loop")
#: Hybrid parallelism from PyTorch's own parts (DTensor tensor parallelism, FSDP2, torch.distributed.pipelining), no
#: gpuwatch import, run under GPUWATCH_RUN: ``--layout L`` among their arguments, their own faults
#: (workloads/hybrid_job.py; tests/test_hybrid_parallel.py).
HYBRID_SCRIPTS = ("hybrid_job",)
#: The command a workload runs under to be measured from outside.
GPUWATCH_RUN = (sys.executable, "-m", "gpuwatch.cli.main", "run", "--")
#: A finding at these severities on a healthy run is a false alarm.
SERIOUS = ("warning", "critical")
#: The node the user's agent ran on: a simulated DGX H100 (8 GPUs, NVLink, 8 active InfiniBand ports).
AGENT_ARGS = ("--simulate", "dgx-h100", "--interval", "1", "--log-level", "warning")
#: A whole workload (torchrun start, rendezvous, the steps, shutdown); far above the ~5-10 s one takes.
RUN_TIMEOUT_S = 300.0
#: How long the agent may take to show a finished run's last steps: a few of its 1 s sampling rounds.
SETTLE_TIMEOUT_S = 20.0


@contextlib.contextmanager
def simulated_agent(workdir: Path) -> Iterator[AgentProcess]:
    """``gpuwatch agent --simulate dgx-h100 --interval 1`` on a free port, its telemetry socket in ``workdir``
    (kept short: a Unix socket path holds at most 107 bytes)."""
    agent = AgentProcess(*AGENT_ARGS, telemetry_socket=workdir / "telemetry.sock")
    try:
        yield agent
    finally:
        agent.stop()


@dataclass
class Diagnosis:
    """One ``gpuwatch diagnose --format json`` report, seen from one job: ``report`` is None when diagnose could
    not judge the source at all (``error`` says why, e.g. a run log directory the hooks never wrote to)."""

    source: str  # "agent" or "run_log"
    job: str
    report: dict | None
    error: str | None = None

    def findings(self) -> list[dict]:
        """The findings about this job, plus those that name no job at all (the node's own, e.g. hardware):
        a finding about another job sharing the agent is not this run's."""
        if self.report is None:
            return []
        return [f for f in self.report["findings"]
                if not (jobs := {e["where"]["job"] for e in f["evidence"] if "job" in e["where"]})
                or self.job in jobs]

    def serious(self) -> dict[str, list[dict]]:
        """Warning and critical findings by rule code."""
        by_code: dict[str, list[dict]] = {}
        for finding in self.findings():
            if finding["severity"] in SERIOUS:
                by_code.setdefault(finding["code"], []).append(finding)
        return by_code

    def codes(self) -> set[str]:
        """Codes of every finding about this job, info included."""
        return {f["code"] for f in self.findings()}

    def not_run(self) -> dict[str, str]:
        """Rules that did not run, with the reason diagnose gave."""
        return {item["code"]: item["reason"] for item in (self.report or {}).get("not_run", ())}

    def describe(self) -> str:
        """For assertion messages: what diagnose said, in a line per finding."""
        if self.report is None:
            return f"{self.source}: no report: {self.error}"
        lines = [f"{self.source}: {len(self.findings())} finding(s) for job {self.job}"]
        lines += [f"  {f['severity']:8} {f['code']} {f['title']}" for f in self.findings()]
        return "\n".join(lines)


def ranks_named(finding: dict) -> set[int]:
    """The ranks a finding's evidence points at."""
    return {e["where"]["rank"] for e in finding["evidence"] if "rank" in e["where"]}


#: The diagnose option of each source a run is judged through.
OPTIONS = {"agent": "--agent", "run_log": "--run-log", "prometheus": "--prometheus"}


def diagnose(job: str, source: str, location: str | Path, *, process: bool = False,
             options: Sequence[str] = ()) -> Diagnosis:
    """``gpuwatch diagnose --agent URL`` (source "agent"), ``--run-log DIR`` ("run_log") or ``--prometheus URL``
    ("prometheus") ``--format json``, and ``options`` (``--config FILE``); exit
    status 2 (the source could not be read) gives a Diagnosis without a report. In this process through click's
    test runner by default: the same command and arguments, without a Python start per verdict (~0.5 s on the CI
    machine, dozens of verdicts a test run); ``process=True`` runs it as its own process, as a user polls it."""
    args = [OPTIONS[source], str(location), "--format", "json", "--fail-on", "never", *options]
    if process:
        result = subprocess.run([sys.executable, "-m", "gpuwatch.cli.main", "diagnose", *args],
                                capture_output=True, text=True, timeout=120)
        status, output, error = result.returncode, result.stdout, result.stderr
    else:
        invoked = CliRunner().invoke(diagnose_command, args)
        if invoked.exception is not None and not isinstance(invoked.exception, SystemExit):
            raise invoked.exception
        status, output, error = invoked.exit_code, invoked.stdout, invoked.stderr
    if status != 0:
        return Diagnosis(source, job, None, (error or output).strip() or f"exit {status}")
    return Diagnosis(source, job, json.loads(output))


def preflight(sysfs_root: Path, env: Mapping[str, str]) -> dict:
    """``gpuwatch diagnose --preflight`` (the check a Slurm prolog runs before launch) on a node whose sysfs is
    ``sysfs_root``, with ``env`` added to its environment."""
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatch.cli.main", "diagnose", "--preflight", "--sysfs-root", str(sysfs_root),
         "--format", "json", "--fail-on", "never"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@dataclass
class Workload:
    """One run of a user's script: what to launch, and where its job id and run log are."""

    script: str
    nproc: int
    steps: int
    fault: str = "none"
    fault_rank: int | None = None
    env: dict[str, str] = field(default_factory=dict)  # added to the ranks' environment (e.g. NCCL_IB_DISABLE)
    job: str = ""
    args: tuple[str, ...] = ()  # more of the script's own arguments
    wrapper: tuple[str, ...] = ()  # what torchrun runs under, e.g. GPUWATCH_RUN
    #: Faults planted as well as ``fault`` (the user-style scripts take ``--fault`` more than once): one run for
    #: several faults whose rules do not read each other's evidence, e.g. a sleeping rank and duplicated data.
    more_faults: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        known = SCRIPTS + UNMODIFIED_SCRIPTS + FRAMEWORK_SCRIPTS + HYBRID_SCRIPTS
        if self.script not in known:
            raise ValueError(f"unknown workload {self.script!r}; known: {', '.join(known)}")
        faults = "+".join((self.fault, *self.more_faults))
        self.job = self.job or f"{self.script}-{self.nproc}r-{faults}-{uuid.uuid4().hex[:6]}"

    @property
    def slow_rank(self) -> int | None:
        """The rank that sleeps in its compute, for ``sleep-rank``: the last unless told otherwise."""
        if self.fault != "sleep-rank":
            return None
        return self.nproc - 1 if self.fault_rank is None else self.fault_rank

    def command(self) -> list[str]:
        command = [*self.wrapper, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(self.nproc), str(WORKLOADS / f"{self.script}.py"), "--steps", str(self.steps), *self.args]
        for fault in (self.fault, *self.more_faults):
            if fault != "none":
                command += ["--fault", fault]
        if self.fault_rank is not None:
            command += ["--fault-rank", str(self.fault_rank)]
        return command


@dataclass
class Run:
    """A finished workload: its ranks' state in the agent at the end, and where its run log is."""

    workload: Workload
    agent_url: str
    run_log: Path
    output: str
    ranks: list[dict]  # the agent's /api/v1/state entries of the job, by rank
    prometheus_url: str | None = None  # a Prometheus server that scraped the agent until it held the run's end

    @property
    def job(self) -> str:
        return self.workload.job

    def diagnosis(self, source: str) -> Diagnosis:
        """Diagnose this run from the agent ("agent"), its run log ("run_log") or Prometheus ("prometheus")."""
        location = {"agent": self.agent_url, "run_log": self.run_log, "prometheus": self.prometheus_url}[source]
        assert location is not None, f"run {self.job} was not scraped by a Prometheus server"
        return diagnose(self.job, source, location)

    def run_log_steps(self) -> dict[int, list[dict]]:
        """{rank: its step records} from the run log directory (empty when the hooks wrote none)."""
        return self._run_log_records("step")

    def run_log_hellos(self) -> dict[int, list[dict]]:
        """{rank: its hellos} from the run log directory (a rank says hello again when its layout changes)."""
        return self._run_log_records("hello")

    def _run_log_records(self, kind: str) -> dict[int, list[dict]]:
        records: dict[int, list[dict]] = {}
        for path in sorted(self.run_log.glob("*.jsonl")):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if record.get("kind") == kind and record.get("job") == self.job:
                        records.setdefault(record["rank"], []).append(record)
        return records


class Made:
    """Runs made on first use and shared by every test that reads them, by a key of the caller's: a run that failed
    is not retried, it fails each of those tests alike."""

    def __init__(self) -> None:
        self._made: dict[object, Run | Exception] = {}

    def get(self, key: object, make: Callable[[], Run]) -> Run:
        if key not in self._made:
            try:
                self._made[key] = make()
            except Exception as error:  # kept, and raised again for every test of this run
                self._made[key] = error
        made = self._made[key]
        if isinstance(made, Exception):
            raise made
        return made


@contextlib.contextmanager
def launched(workload: Workload, agent: AgentProcess, workdir: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """The workload running under torchrun for the ``with`` block, reporting to ``agent``; yields the torchrun
    process and the run log directory. torchrun, and any worker it leaves behind, is stopped on the way out."""
    run_log = workdir / workload.job
    run_log.mkdir(parents=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPUWATCH_")}
    env.update(workload.env, GPUWATCH_SOCKET=str(agent.telemetry_socket), GPUWATCH_JOB=workload.job,
               GPUWATCH_RUN_LOG=str(run_log))
    with open(workdir / f"{workload.job}.out", "w") as output:
        proc = subprocess.Popen(workload.command(), stdout=output, stderr=subprocess.STDOUT, env=env,
                                cwd=workdir)
        try:
            yield proc, run_log
        finally:
            _stop(proc)


def _stop(torchrun: subprocess.Popen) -> None:
    """SIGTERM to torchrun (or the wrapper it runs under), which passes it on to its workers; SIGKILL after a grace
    period; then any worker still alive, by its pid (torchrun starts each in a session of its own, so no group signal
    reaches them)."""
    if torchrun.poll() is not None:
        return
    try:
        workers = psutil.Process(torchrun.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        workers = []
    torchrun.send_signal(signal.SIGTERM)
    try:
        torchrun.wait(15)
    except subprocess.TimeoutExpired:
        torchrun.kill()
        torchrun.wait()
    for worker in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.kill()  # psutil checks the pid still names the same process
    psutil.wait_procs(workers, timeout=10)


def job_ranks(agent: AgentProcess, job: str) -> list[dict]:
    """The agent's state of each rank of ``job`` (hello, last step, counters, ...), by rank."""
    ranks = agent.state()["facts"].get("telemetry", {}).get("ranks", ())
    return sorted((r for r in ranks if r["job"] == job), key=lambda r: r["rank"])


def run(workload: Workload, agent: AgentProcess, workdir: Path, prometheus: PrometheusServer | None = None) -> Run:
    """Run ``workload`` to its end and wait for the agent (and ``prometheus``, scraping it) to hold every rank's
    last step; a failed run raises with its output."""
    with launched(workload, agent, workdir) as (proc, run_log):
        try:
            returncode = proc.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            returncode = None
        output = (workdir / f"{workload.job}.out").read_text()
        if returncode != 0:
            raise RuntimeError(f"{' '.join(workload.command())} "
                               f"{'timed out' if returncode is None else f'exited {returncode}'}:\n{output[-4000:]}")
        if not any(path.stat().st_size for path in run_log.glob("*.jsonl")):  # the agent cannot hold what was not sent
            raise RuntimeError(f"{' '.join(workload.command())} ended, but no rank wrote a record to its run log "
                               f"(not measured):\n{output[-4000:]}")

    def settled() -> list[dict] | None:
        ranks = job_ranks(agent, workload.job)
        done = len(ranks) == workload.nproc and all((r.get("last_step") or {}).get("step") == workload.steps
                                                     for r in ranks)
        return ranks if done else None

    # polled every half second: each poll reads the agent's whole state, every job of the module in it
    ranks = wait_until(settled, timeout=SETTLE_TIMEOUT_S, interval=0.5,
                       what=f"the agent to hold job {workload.job}'s last steps")
    if prometheus is not None:
        def scraped() -> bool:  # every rank's window ends at the last step (the job label is exported_job there)
            ends = prometheus.query(f'gpuwatch_train_window_last_step{{exported_job="{workload.job}"}}')
            return len(ends) == workload.nproc and all(float(e["value"][1]) == workload.steps for e in ends)

        wait_until(scraped, timeout=SETTLE_TIMEOUT_S, interval=0.5,
                   what=f"Prometheus to hold job {workload.job}'s last steps")
    return Run(workload, agent.url, run_log, output, ranks, prometheus.url if prometheus is not None else None)


def busy_ratios(series: Mapping[int, list[float]]) -> dict[int, float]:
    """{rank: its median busy time (its steps' phases summed) / the median of the other ranks' medians}: the noise a
    straggler rule must see through on a healthy run (1.0 everywhere on a perfectly even machine)."""
    medians = {rank: statistics.median(values) for rank, values in series.items() if values}
    ratios = {}
    for rank, own in medians.items():
        others = [m for r, m in medians.items() if r != rank]
        if others and statistics.median(others) > 0:
            ratios[rank] = own / statistics.median(others)
    return ratios


def straggler_closeness(busy: Mapping[int, list[float]], step: Mapping[int, list[float]], ratio: float,
                        share: float) -> dict[int, float]:
    """{rank: how close PERF002 came to naming it}, from per-step busy and step times: a straggler must be
    ``ratio`` times its peers' median *and* slower by ``share`` of the job's median step, so closeness is the
    smaller of (own / peers) / ratio and (own - peers) / (share × step). Below 1 on every rank of a healthy run
    means silent; how far below is the margin the noise leaves."""
    medians = {rank: statistics.median(values) for rank, values in busy.items() if values}
    steps = [statistics.median(values) for values in step.values() if values]
    if len(medians) < 2 or not steps:
        return {}
    job_step = statistics.median(steps)
    closeness = {}
    for rank, own in medians.items():
        peers = statistics.median(m for r, m in medians.items() if r != rank)
        if peers > 0:
            closeness[rank] = max(0.0, min((own / peers) / ratio, (own - peers) / (share * job_step)))
    return closeness
