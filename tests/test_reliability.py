"""Reliability and security promises of docs/reliability.md that no other test file owns: the telemetry
socket's group (who may send), and InfiniBand counters reset under a real Prometheus."""

import errno
import grp
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from telemetry_records import hello, samples

from gpuwatch.agent.telemetry import listener
from gpuwatch.cli.main import main
from gpuwatch.protocol.schema import encode

from conftest import FIXTURES, AgentProcess, wait_until

pytestmark = pytest.mark.integration

TELEMETRY_ONLY = ("--no-collector.nvml", "--no-collector.nvlink", "--no-collector.infiniband",
                  "--no-collector.host", "--interval", "0.2")
NOBODY = 65534


def _in_child(uid: int, gid: int, action) -> int:
    """Run ``action`` in a forked child with exactly these credentials (no supplementary groups);
    the child's exit status is 0 on success, else the errno it failed with."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 0
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            action()
        except OSError as exc:
            status = exc.errno or 255
        except BaseException:
            status = 255
        os._exit(status)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.fixture
def shared_tmp():
    """A directory other users can traverse (pytest's tmp_path is private to root), removed after."""
    directory = Path(tempfile.mkdtemp(prefix="gpuwatch-rel-", dir="/tmp"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory)


@pytest.fixture
def group() -> grp.struct_group:
    """A group other than the agent's own: Debian's nogroup."""
    return grp.getgrnam("nogroup")


def test_socket_group_lets_its_members_send_and_nobody_else(start_agent, shared_tmp, group):
    if os.geteuid() != 0:
        pytest.fail("this test switches users in forked children: run the suite as root, as .ci/run does")
    socket_path = shared_tmp / "gpuwatch" / "telemetry.sock"
    agent = start_agent(*TELEMETRY_ONLY, "--telemetry.socket-group", group.gr_name, telemetry_socket=socket_path)
    directory, sock = os.stat(socket_path.parent), os.stat(socket_path)
    assert (directory.st_gid, stat.S_IMODE(directory.st_mode)) == (group.gr_gid, 0o2750)  # setgid: socket inherits
    assert (sock.st_gid, stat.S_IMODE(sock.st_mode)) == (group.gr_gid, 0o660)
    assert directory.st_uid == sock.st_uid == os.geteuid()

    def send() -> None:
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sender.sendto(encode(hello(5)), str(socket_path))

    assert _in_child(NOBODY, group.gr_gid, send) == 0  # a training user in the group
    wait_until(lambda: [r["rank"] for r in agent.state()["facts"]["telemetry"]["ranks"]] == [5], timeout=10,
               what="the group member's hello")
    outsider = grp.getgrnam("daemon").gr_gid
    assert _in_child(NOBODY, outsider, send) == errno.EACCES  # the same user outside the group
    assert agent.state()["facts"]["telemetry"]["records"]["accepted"] == 1


def test_the_socket_group_restarts_cleanly_and_takes_a_bare_gid(start_agent, shared_tmp, group):
    socket_path = shared_tmp / "gpuwatch" / "telemetry.sock"
    first = start_agent(*TELEMETRY_ONLY, "--telemetry.socket-group", str(group.gr_gid), telemetry_socket=socket_path)
    assert first.stop()[0] == 0
    second = start_agent(*TELEMETRY_ONLY, "--telemetry.socket-group", group.gr_name, telemetry_socket=socket_path)
    assert os.stat(socket_path).st_gid == group.gr_gid
    second.stop()
    # A bare gid is taken as is: in containers the training users' gid is often not in /etc/group.
    unnamed = next(gid for gid in range(20000, 30000) if gid not in {g.gr_gid for g in grp.getgrall()})
    start_agent(*TELEMETRY_ONLY, "--telemetry.socket-group", str(unnamed), telemetry_socket=socket_path)
    assert os.stat(socket_path).st_gid == os.stat(socket_path.parent).st_gid == unnamed


def test_an_unknown_group_is_one_line_and_exit_status_1():
    result = CliRunner().invoke(main, ["agent", "--telemetry.socket-group", "no-such-group-here"])
    assert result.exit_code == 1
    assert result.output.splitlines() == ["Error: --telemetry.socket-group: no group 'no-such-group-here' on this host"]


def test_a_group_the_agent_is_not_a_member_of_is_refused_with_the_reason(shared_tmp, group):
    """An unprivileged agent may only give its directory to a group it belongs to."""
    directory = shared_tmp / "gpuwatch"
    directory.mkdir(mode=0o750)
    os.chown(directory, NOBODY, group.gr_gid)

    def prepare() -> None:
        try:
            listener.prepare_directory(directory, 0)  # root's group
        except listener.SocketSetupError as exc:
            assert "a non-root agent must be a member of the group" in str(exc)
            raise PermissionError(errno.EPERM, str(exc)) from None

    assert _in_child(NOBODY, group.gr_gid, prepare) == errno.EPERM
    assert os.stat(directory).st_gid == group.gr_gid  # untouched


def test_an_agent_that_cannot_prepare_the_socket_group_exits_1(shared_tmp, group, caplog):
    """A symlinked socket directory is refused before anything starts (the agent never follows it)."""
    (shared_tmp / "real").mkdir()
    (shared_tmp / "link").symlink_to(shared_tmp / "real")
    result = CliRunner().invoke(main, ["agent", *TELEMETRY_ONLY, "--listen", "127.0.0.1:0",
                                       "--telemetry.socket", str(shared_tmp / "link" / "t.sock"),
                                       "--telemetry.socket-group", group.gr_name])
    assert result.exit_code == 1
    assert "link is not a directory (a symlink is not followed)" in caplog.text
    assert os.stat(shared_tmp / "real").st_gid != group.gr_gid


# -- a training process killed ----------------------------------------------------------------------

RANK_PROCESS = r"""
import sys, time
from telemetry_records import hello, step
from gpuwatch.trainer.telemetry import TelemetryClient
client = TelemetryClient(heartbeat_interval=0)
client.send(hello(int(sys.argv[1])))
number = 0
while True:
    number += 1
    client.send(step(int(sys.argv[1]), number))
    time.sleep(0.05)
"""


def test_a_killed_training_process_expires_after_the_ttl_and_its_series_go(start_agent, tmp_path):
    agent = start_agent(*TELEMETRY_ONLY, "--telemetry.ttl", "1")
    environment = {**os.environ, "GPUWATCH_SOCKET": str(agent.telemetry_socket),
                   "PYTHONPATH": str(Path(__file__).parent)}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_PROCESS, str(rank)], env=environment) for rank in (0, 1)]
    try:
        def exported() -> set[str]:
            series = samples(agent.get("/metrics").decode(), "gpuwatch_train_last_step")
            return {dict(labels)["rank"] for labels in series}

        wait_until(lambda: exported() == {"0", "1"}, timeout=20, what="both ranks exported")
        pids = {p["rank"]: p["pid"] for p in agent.state()["facts"]["telemetry"]["processes"]}
        assert pids == {0: ranks[0].pid, 1: ranks[1].pid}  # the kernel's word, not the hello's
        ranks[0].kill()
        ranks[0].wait()
        wait_until(lambda: exported() == {"1"}, timeout=10, what="the killed rank to expire")
        assert [r["rank"] for r in agent.state()["facts"]["telemetry"]["ranks"]] == [1]
        assert agent.proc.poll() is None
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


# -- counters under a real Prometheus ----------------------------------------------------------------

IB_ONLY = ("--no-collector.nvml", "--no-collector.nvlink", "--no-collector.host", "--no-collector.telemetry",
           "--interval", "0.2")
XMIT = 'gpuwatch_ib_port_transmitted_bytes_total{device="mlx5_0",port="1"}'


def test_agent_restarts_and_hardware_counter_resets_never_make_a_rate_spike(tmp_path, prometheus_server):
    """Raw sysfs values: an agent restart is invisible to rate(), and a hardware reset (perfquery -R) is
    one counter reset that increase() counts from zero, not a jump of the old total."""
    root = tmp_path / "sys"
    shutil.copytree(FIXTURES / "procfs-infiniband" / "sys", root, symlinks=True)
    counter = root / "class/infiniband/mlx5_0/ports/1/counters/port_xmit_data"
    words = 10**12
    counter.write_text(f"{words}\n")
    socket_path = tmp_path / "agent" / "t.sock"
    agent = AgentProcess(*IB_ONLY, "--sysfs-root", str(root), telemetry_socket=socket_path)
    prometheus = prometheus_server([f"127.0.0.1:{agent.port}"], scrape_interval="500ms")
    try:
        def samples_since(start: float) -> int:
            result = prometheus.query(f"count_over_time({XMIT}[{time.time() - start:.0f}s])")
            return int(result[0]["value"][1]) if result else 0

        def advance(seconds: float, per_second: int) -> None:
            nonlocal words
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                words += per_second // 10
                counter.write_text(f"{words}\n")
                time.sleep(0.1)

        start = time.time()
        advance(3, 10_000)
        agent.stop(signal.SIGKILL)  # restarted on the same port while Prometheus keeps scraping
        agent = AgentProcess(*IB_ONLY, "--sysfs-root", str(root), telemetry_socket=socket_path, port=agent.port)
        advance(3, 10_000)
        wait_until(lambda: samples_since(start) >= 8, timeout=20, what="scrapes on both sides of the restart")
        window = f"{time.time() - start + 1:.0f}s"
        assert prometheus.query(f"resets({XMIT}[{window}])")[0]["value"][1] == "0"

        words = 0  # perfquery -R
        counter.write_text("0\n")
        reset_at = time.time()
        advance(3, 10_000)
        wait_until(lambda: samples_since(reset_at) >= 4, timeout=20, what="scrapes after the reset")
        window = f"{time.time() - start + 1:.0f}s"
        assert prometheus.query(f"resets({XMIT}[{window}])")[0]["value"][1] == "1"
        # All the traffic of the run is ~9 s × 40 kB/s; the old total was 4 TB. Extrapolation adds a little.
        increase = float(prometheus.query(f"increase({XMIT}[{window}])")[0]["value"][1])
        assert 0 < increase < 2 * 4 * 10 * 10_000, increase
        peak = prometheus.query(f"max_over_time(rate({XMIT}[2s])[{window}:500ms])")
        assert float(peak[0]["value"][1]) < 4 * 10 * 10_000, peak  # never above 10× the real 40 kB/s
    finally:
        agent.stop()
