"""``gpuwatch demo`` end to end: a real agent and a real 8-rank gloo job on CPU, diagnosed; and what it leaves behind
when it fails or is interrupted (nothing: no process, no bound port)."""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from gpuwatch.cli import demo as demo_module
from gpuwatch.cli.demo import EXPECTED_RULE
from gpuwatch.trainer.config import FAULTS

from conftest import free_port, http_get, wait_until

pytestmark = pytest.mark.integration


def demo(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuwatch.cli.main", "demo", *args], capture_output=True,
                          text=True, timeout=timeout)


def port_free(port: int) -> bool:
    """Nothing listens on it: a new agent could bind it (SO_REUSEADDR, as the agent's server sets, passes over the
    TIME_WAIT its closed connections leave)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_every_fault_names_the_rule_that_catches_it():
    assert set(EXPECTED_RULE) == set(FAULTS)


def test_a_fault_that_needs_a_gpu_is_refused_in_one_line_on_a_simulated_node(monkeypatch):
    monkeypatch.setattr(demo_module, "gpus_present", lambda: False)  # as on a machine without GPUs
    result = CliRunner().invoke(demo_module.demo, ["--fault", "fragment-memory"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == ("Error: --fault fragment-memory fragments the CUDA caching "
                                                      "allocator: it needs a GPU")


def test_healthy_run_has_no_warning_and_stops_its_agent():
    port = free_port()
    result = demo("--fault", "none", "--steps", "3", "--port", str(port))
    assert result.returncode == 0, result.stderr
    assert "no fault (healthy)" in result.stdout
    assert "gpuwatch diagnose: 0 critical, 0 warning" in result.stdout
    assert "8 rank(s) from agent" in result.stdout
    assert f'targets: ["127.0.0.1:{port}"]' in result.stdout and "The agent has stopped" in result.stdout
    assert port_free(port)
    assert "training" not in result.stderr.splitlines()  # the progress bar is drawn on a terminal only
    # it ends with the job's report: a page of every rank (tp2 × pp2 × dp2), from the job's run log
    report = Path(result.stdout.strip().splitlines()[-1].strip())
    try:
        assert result.stdout.strip().splitlines()[-2].startswith("The job's report")
        assert report.suffix == ".html" and '"job":"gpuwatch-demo"' in report.read_text()
    finally:
        report.unlink(missing_ok=True)


def test_keep_agent_leaves_only_the_agent_running_and_says_how_to_stop_it():
    port = free_port()
    result = demo("--fault", "none", "--steps", "2", "--port", str(port), "--keep-agent")
    assert result.returncode == 0, result.stderr
    pid = int(re.search(r"The agent keeps running \(pid (\d+); stop it with: kill \1\)", result.stdout).group(1))
    agent = psutil.Process(pid)
    try:
        assert "agent" in agent.cmdline() and f"127.0.0.1:{port}" in agent.cmdline()
        assert http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200
        socket_path = Path(re.search(r"GPUWATCH_SOCKET=(\S+) gpuwatch train", result.stdout).group(1))
        assert socket_path.is_socket()  # kept with the agent, for more jobs to report to it
    finally:
        agent.terminate()
        agent.wait(15)
    shutil.rmtree(socket_path.parent)
    assert port_free(port)


def test_planted_fault_is_named_by_its_rule():
    """A fault whose finding does not depend on how fast the machine runs the ranks (identical gradients), so
    the verdict is the demo's, not the load's. Finding slow-rank from real timings: tests/test_e2e_faults.py."""
    result = demo("--fault", "duplicate-shards", "--steps", "3")
    assert result.returncode == 0, result.stderr
    assert f"fault duplicate-shards: expect {EXPECTED_RULE['duplicate-shards']}" in result.stdout
    report = result.stdout.split("$ gpuwatch diagnose", 1)[1]
    assert f"{EXPECTED_RULE['duplicate-shards']}  duplicated data shards in job gpuwatch-demo" in report


def test_a_planted_hang_is_named_while_the_job_hangs_and_the_job_is_stopped():
    port = free_port()
    result = demo("--fault", "hang-rank", "--port", str(port), timeout=300)
    assert result.returncode == 0, result.stderr
    report = result.stdout.split("$ gpuwatch diagnose", 1)[1]
    assert "HANG001  job gpuwatch-demo hangs: rank 7 missing at a collective" in report
    assert "_hang_before_all_reduce" in report  # where the missing rank stands
    assert port_free(port)


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_stops_every_process_it_started(signum, status):
    port = free_port()
    # SIGINT at its default in the demo whoever runs the suite: a shell starting it as a background job ignores SIGINT,
    # and a child that starts with SIGINT ignored keeps ignoring it (Python installs no KeyboardInterrupt handler).
    process = subprocess.Popen([sys.executable, "-m", "gpuwatch.cli.main", "demo", "--steps", "100000",
                                "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    parent = psutil.Process(process.pid)
    try:
        # The agent, the trainer and its eight ranks.
        started = wait_until(lambda: (children := parent.children(recursive=True)) and len(children) >= 10
                             and children, timeout=120, what="the agent, the trainer and its ranks")
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:  # failed: nothing it started outlives the test to load the ones after it
            for child in [*parent.children(recursive=True), parent]:
                with contextlib.suppress(psutil.Error):
                    child.kill()
    assert process.returncode == status, stderr
    assert "stopping the processes the demo started" in stderr
    _, alive = psutil.wait_procs(started, timeout=30)  # a generous wait: the demo stops them before it exits
    assert alive == [], [p.cmdline() for p in alive]
    assert port_free(port)


def test_taken_port_is_refused_with_a_clear_message():
    with socket.socket() as occupant:
        occupant.bind(("127.0.0.1", 0))
        occupant.listen()
        port = occupant.getsockname()[1]
        result = demo("--port", str(port), timeout=60)
    assert result.returncode == 1
    assert f"port {port} is taken" in result.stderr


def test_failing_job_is_reported_and_its_agent_stopped():
    port = free_port()
    result = demo("--fault", "slow-rank", "--tp", "1", "--dp", "1", "--port", str(port), timeout=120)
    assert result.returncode == 1
    assert "the training job failed with status 2" in result.stderr
    assert "--fault slow-rank needs peers" in result.stderr
    assert port_free(port)
