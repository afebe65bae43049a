"""``gpuwatch demo``: the whole story on one machine, with or without GPUs, in about a minute.

It starts an agent (a simulated dgx-h100 node unless NVML finds GPUs), runs the reference trainer
(tp 2 × pp 2 × dp 2; gloo on CPU) with one planted fault while its hooks report to that agent, prints
what ``gpuwatch diagnose --agent`` finds, and how to point Prometheus and Grafana at the agent; it ends by writing
the job's ``gpuwatch report`` page (from the job's run log) and printing its path. Every
process it started is stopped on the way out, also on Ctrl-C or SIGTERM: the agent and the trainer run
in sessions of their own, so a terminal's Ctrl-C reaches only the demo, which then ends them in order.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import click

from gpuwatch.report.cli import write_report
from gpuwatch.report.gather import ReportError
from gpuwatch.trainer.config import FAULTS, gpus_present

#: The rule each planted fault is meant to trip (what the demo tells the user to look for).
EXPECTED_RULE = {
    "slow-rank": "PERF002", "duplicate-shards": "CONV004", "shared-pp-dp-group": "TOPO001",
    "lr-explode": "CONV002", "desync": "CONV003", "fp16-no-scaler": "CONV001",
    "hang-rank": "HANG001", "crash-rank": "HANG004", "raise-rank": "HANG004", "skip-collective": "HANG002",
    "fragment-memory": "MEM001",
}
#: Faults whose job never ends by itself (the demo stops it once the agent's diagnosis names the hang), and
#: faults whose job fails, as it should.
HANGS, FAILS = ("hang-rank", "skip-collective"), ("crash-rank", "raise-rank")
#: How long the demo waits for diagnose to name a hang (the hooks report after 3 s overdue, the rules from 5 s).
_HANG_TIMEOUT = 120.0
JOB = "gpuwatch-demo"
_STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)\b")
_STARTUP_TIMEOUT = 30.0
_STOP_TIMEOUT = 10.0


class DemoError(click.ClickException):
    """A step of the demo failed; the message says which and why (exit status 1)."""


class _Terminated(Exception):
    """SIGTERM, turned into an exception so that cleanup runs as for Ctrl-C."""


def _port(requested: int | None) -> int:
    """The requested port if nothing listens on it at 127.0.0.1 (the agent's server sets SO_REUSEADDR, so a
    port in TIME_WAIT is free to it), else a free one the kernel picks."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", requested or 0))
        except OSError as exc:
            raise DemoError(f"port {requested} is taken ({exc.strerror}): choose another with --port, or leave "
                            "--port out for a free one") from None
        return probe.getsockname()[1]


def _get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def _stop(process: subprocess.Popen, name: str) -> None:
    """SIGTERM to the process's whole session (the trainer forks its ranks), SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(_STOP_TIMEOUT)
            return
        except subprocess.TimeoutExpired:
            click.echo(f"{name} did not stop on SIGTERM: killing it", err=True)
    process.wait()


class _Demo:
    """The processes of one demo run and their cleanup."""

    def __init__(self, workdir: Path, port: int, keep_agent: bool) -> None:
        self.workdir = workdir
        self.socket = workdir / "telemetry.sock"
        self.run_log = workdir / "run-log"  # every step of every rank, for the report
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.keep_agent = keep_agent
        self.agent: subprocess.Popen | None = None
        self.trainer: subprocess.Popen | None = None

    def _spawn(self, command: list[str], **kwargs) -> subprocess.Popen:
        env = {**os.environ, "GPUWATCH_SOCKET": str(self.socket)}
        return subprocess.Popen(command, env=env, start_new_session=True, **kwargs)

    def start_agent(self, simulate: bool) -> None:
        log = (self.workdir / "agent.log").open("w")
        command = [sys.executable, "-m", "gpuwatch.cli.main", "agent", "--listen", f"127.0.0.1:{self.port}",
                   "--interval", "1", "--log-level", "warning", *(["--simulate", "dgx-h100"] if simulate else [])]
        with log:
            self.agent = self._spawn(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.agent.poll() is not None:
                raise DemoError(f"the agent exited with status {self.agent.returncode}:\n{self._agent_log()}")
            with contextlib.suppress(OSError):
                _get(self.url + "/healthz")
                return
            time.sleep(0.2)
        raise DemoError(f"the agent did not answer on {self.url} within {_STARTUP_TIMEOUT:.0f} s:\n"
                        f"{self._agent_log()}")

    def _agent_log(self) -> str:
        return "\n".join((self.workdir / "agent.log").read_text().splitlines()[-20:])

    def _start_training(self, options: list[str], steps: int, **output) -> subprocess.Popen:
        command = [sys.executable, "-m", "gpuwatch.cli.main", "train", "--job", JOB, "--steps", str(steps),
                   "--telemetry-socket", str(self.socket), "--run-log", str(self.run_log), *options]
        self.trainer = self._spawn(command, stdin=subprocess.DEVNULL, **output)
        return self.trainer

    def train(self, options: list[str], steps: int, *, fails: bool = False) -> None:
        """Run the job, a progress bar fed by its ``step N/M`` lines; its output is kept for a failure report.
        With `fails`, the job is meant to fail (a rank dies on purpose), and one that does not is the error."""
        trainer = self._start_training(options, steps, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       bufsize=1)
        assert trainer.stdout is not None, "spawned with stdout=PIPE"
        tail = _follow(trainer.stdout, steps)
        if (trainer.wait() != 0) != fails:
            raise DemoError(f"the training job {'ended' if fails else 'failed'} with status {trainer.returncode}:\n"
                            + "".join(tail))

    def train_until(self, options: list[str], steps: int, code: str) -> None:
        """Run a job that hangs on purpose until `gpuwatch diagnose` finds `code` in it, then stop it."""
        trainer = self._start_training(options, steps, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + _HANG_TIMEOUT
        while time.monotonic() < deadline:
            if trainer.poll() is not None:
                raise DemoError(f"the training job ended with status {trainer.returncode} instead of hanging")
            with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
                report = json.loads(subprocess.run(
                    [sys.executable, "-m", "gpuwatch.cli.main", "diagnose", "--agent", self.url, "--select", code,
                     "--format", "json", "--fail-on", "never"], capture_output=True, text=True, timeout=60).stdout)
                if any(finding["code"] == code for finding in report["findings"]):
                    return
            time.sleep(1.0)
        raise DemoError(f"gpuwatch diagnose did not find {code} within {_HANG_TIMEOUT:.0f} s")

    def wait_for_ranks(self, world_size: int, steps: int) -> None:
        """Until the agent's state has every rank's last step: records and the sampling round take a moment."""
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                state = json.loads(_get(self.url + "/api/v1/state"))
                ranks = state["facts"].get("telemetry", {}).get("ranks", [])
                if sum((rank.get("last_step") or {}).get("step") == steps for rank in ranks) >= world_size:
                    return
            time.sleep(0.5)
        raise DemoError(f"the agent at {self.url} did not receive the last step of all {world_size} ranks within "
                        f"{_STARTUP_TIMEOUT:.0f} s; its log:\n{self._agent_log()}")

    def close(self, succeeded: bool) -> None:
        """Stop what was started; a second Ctrl-C or SIGTERM must not cut this short and leave ranks behind."""
        previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._close(succeeded)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _close(self, succeeded: bool) -> None:
        if self.trainer is not None:
            _stop(self.trainer, "the trainer")
        if self.keep_agent and succeeded:
            return  # the agent, its socket and log stay, as asked
        if self.agent is not None:
            _stop(self.agent, "the agent")
        shutil.rmtree(self.workdir, ignore_errors=True)


def _follow(output: IO[str], steps: int) -> list[str]:
    """Advance a progress bar on each ``step N/M`` line; return the last lines of output."""
    tail: collections.deque[str] = collections.deque(maxlen=30)
    done = 0
    # Drawn on a terminal only: elsewhere click would print its label once, a stray line in a log.
    with click.progressbar(length=steps, label="training", file=sys.stderr, hidden=not sys.stderr.isatty()) as bar:
        for line in output:
            tail.append(line)
            if match := _STEP_LINE.match(line):
                step = int(match.group(1))
                bar.update(step - done)
                done = step
    return list(tail)


def _trainer_options(fault: str, tp: int, pp: int, dp: int) -> list[str]:
    options = ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--grad-similarity-every", "2",
               "--checksum-every", "2"]
    if fault != "none":
        options += ["--fault", fault]
    if fault == "fp16-no-scaler":
        options += ["--precision", "fp16"]
    return options


def _diagnose(url: str) -> None:
    result = subprocess.run([sys.executable, "-m", "gpuwatch.cli.main", "diagnose", "--agent", url,
                             "--fail-on", "never"], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise DemoError(f"gpuwatch diagnose --agent {url} failed with status {result.returncode}:\n"
                        f"{result.stderr or result.stdout}")
    click.echo(result.stdout.rstrip())


def _report(run_log: Path, output: Path) -> None:
    """The job's page, from its run log (every step), written before the demo's directory goes."""
    try:
        write_report(run_log, (), None, JOB, output)
    except ReportError as exc:
        raise DemoError(f"gpuwatch report --run-log {run_log} failed: {exc}") from None


def _next_steps(url: str, port: int, kept: _Demo | None) -> None:
    if kept is None:
        click.echo("\nThe agent has stopped. With --keep-agent it keeps running for Prometheus and Grafana:")
    else:
        assert kept.agent is not None, "the demo ran to the end, so it started the agent"
        pid = kept.agent.pid
        click.echo(f"\nThe agent keeps running (pid {pid}; stop it with: kill {pid}); train against it with\n"
                   f"  GPUWATCH_SOCKET={kept.socket} gpuwatch train --fault NAME")
    click.echo(f"""  {url}/metrics (Prometheus exposition), {url}/api/v1/state (JSON facts)
Prometheus: add to prometheus.yml
  scrape_configs:
    - job_name: gpuwatch
      honor_labels: true        # keep the training job's own job label
      static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
  rule_files: [gpuwatch.rules.yml]     # gpuwatch alerts export DIR writes it
Grafana: gpuwatch dashboards export DIR, then import DIR/*.json (Dashboards > New > Import)
Cluster-wide: gpuwatch diagnose --prometheus http://PROMETHEUS:9090""")


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    def interrupt(signum: int, _frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@click.command()
@click.option("--fault", type=click.Choice(["none", *FAULTS]), default="slow-rank", show_default=True,
              help="The failure to plant in the job, each caught by one rule (none: a healthy run; "
                   "gpuwatch train --help describes them).")
@click.option("--steps", type=click.IntRange(min=2), default=12, show_default=True, help="Optimizer steps to train.")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Port of the agent on 127.0.0.1.  [default: a free one]")
@click.option("--keep-agent", is_flag=True, help="Leave the agent running afterwards, for Prometheus and Grafana.")
@click.option("--tp", type=click.IntRange(min=1), default=2, show_default=True, help="Tensor-parallel ranks.")
@click.option("--pp", type=click.IntRange(min=1), default=2, show_default=True, help="Pipeline stages.")
@click.option("--dp", type=click.IntRange(min=1), default=2, show_default=True, help="Data-parallel replicas.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the job's HTML report (gpuwatch report).  [default: a new file in the temp dir]")
def demo(fault: str, steps: int, port: int | None, keep_agent: bool, tp: int, pp: int, dp: int,
         report_path: Path | None) -> None:
    """Run an agent and a short training job with a planted fault, then diagnose it.

    On a machine without GPUs the agent simulates a dgx-h100 node and the job trains on CPU (gloo). The exit
    status is 0 when the demo ran, whatever it found; 1 when a step failed (port taken, job failed); 130 on
    Ctrl-C and 143 on SIGTERM, after stopping every process it started.
    """
    simulate = not gpus_present()
    if simulate and fault == "fragment-memory":
        raise click.UsageError("--fault fragment-memory fragments the CUDA caching allocator: it needs a GPU")
    port = _port(port)  # before the temporary directory, which only _Demo.close removes
    demo_run = _Demo(Path(tempfile.mkdtemp(prefix="gpuwatch-demo-")), port, keep_agent)
    succeeded = False
    with _sigterm_raises():
        try:
            node = "a simulated dgx-h100 node" if simulate else "this node's GPUs"
            click.echo(f"agent: {node} on {demo_run.url}")
            demo_run.start_agent(simulate)
            planted = "no fault (healthy)" if fault == "none" else f"fault {fault}: expect {EXPECTED_RULE[fault]}"
            click.echo(f"training: tp {tp} × pp {pp} × dp {dp}, {steps} steps, {planted}")
            options = _trainer_options(fault, tp, pp, dp)
            if fault in HANGS:
                demo_run.train_until(options, steps, EXPECTED_RULE[fault])  # the diagnosis while it hangs
            elif fault in FAILS:
                demo_run.train(options, steps, fails=True)
                time.sleep(1.0)  # a round of the agent's, which notices the exits
            else:
                demo_run.train(options, steps)
                demo_run.wait_for_ranks(tp * pp * dp, steps)
            click.echo(f"\n$ gpuwatch diagnose --agent {demo_run.url}")
            _diagnose(demo_run.url)
            if report_path is None:
                handle, name = tempfile.mkstemp(prefix="gpuwatch-demo-report-", suffix=".html")
                os.close(handle)
                report_path = Path(name)
            _report(demo_run.run_log, report_path)
            succeeded = True
        except KeyboardInterrupt:
            click.echo("\ninterrupted: stopping the processes the demo started", err=True)
            sys.exit(130)
        except _Terminated:
            click.echo("terminated: stopping the processes the demo started", err=True)
            sys.exit(143)
        finally:
            demo_run.close(succeeded)
    _next_steps(demo_run.url, demo_run.port, demo_run if keep_agent else None)
    click.echo(f"\nThe job's report (findings, every rank's steps and phases; open it in a browser):\n  {report_path}")
