"""A simulated node's directory: owned by its agent, removed when the agent stops, and removed by the next simulated
agent when its own agent was killed without notice (SIGKILL leaves it in tmpfs, in memory, until a reboot)."""

import os
import signal
from pathlib import Path

from gpuwatch.agent.simulate.workdir import OWNER, PREFIX, default_parent, process_identity, stale_workdirs, workdir


def _no_such_pid() -> int:
    """A pid no process can have: pid_max is one more than the highest pid the kernel hands out."""
    return int(Path("/proc/sys/kernel/pid_max").read_text())


def _directory(parent: Path, name: str, owner: str | None) -> Path:
    directory = parent / name
    (directory / "sys").mkdir(parents=True)
    if owner is not None:
        (directory / OWNER).write_text(owner)
    return directory


def test_identity_names_a_running_process_by_pid_and_start_time():
    mine = process_identity(os.getpid())
    assert mine is not None and mine.split()[0] == str(os.getpid())
    assert process_identity(os.getpid()) == mine  # the same process, the same identity
    assert process_identity(1) != mine
    assert process_identity(_no_such_pid()) is None


def test_only_directories_of_agents_no_longer_running_are_stale(tmp_path):
    me = process_identity(os.getpid())
    assert me is not None
    dead = _directory(tmp_path, PREFIX + "dead", f"{_no_such_pid()} 12345")
    reused = _directory(tmp_path, PREFIX + "reused", f"{os.getpid()} 0")  # this pid, another process's start
    _directory(tmp_path, PREFIX + "live", me)
    _directory(tmp_path, PREFIX + "unowned", None)  # being made, or left by an older gpuwatch
    _directory(tmp_path, PREFIX + "garbled", "not a pid")
    _directory(tmp_path, "someone-else", f"{_no_such_pid()} 12345")
    assert stale_workdirs(tmp_path) == [dead, reused]


def test_workdir_is_owned_removed_on_exit_and_removes_what_killed_agents_left(tmp_path):
    dead = _directory(tmp_path, PREFIX + "dead", f"{_no_such_pid()} 12345")
    unowned = _directory(tmp_path, PREFIX + "unowned", None)
    with workdir(tmp_path) as path:
        assert path.parent == tmp_path and path.name.startswith(PREFIX)
        assert (path / OWNER).read_text() == process_identity(os.getpid())
        assert stale_workdirs(tmp_path) == []
        assert not dead.exists() and unowned.exists()
    assert not path.exists()


def _owned_by(pid: int) -> list[Path]:
    parent = default_parent()
    return [path for path in parent.glob(PREFIX + "*")
            if (path / OWNER).is_file() and (path / OWNER).read_text().split()[0] == str(pid)]


def test_the_next_simulated_agent_removes_what_a_killed_one_left(start_agent):
    killed = start_agent("--simulate", "a100-roce", "--interval", "0.5")
    left = _owned_by(killed.proc.pid)
    assert len(left) == 1 and (left[0] / "sys").is_dir()
    killed.stop(signal.SIGKILL)
    assert left[0].is_dir()  # nothing ran to remove it

    successor = start_agent("--simulate", "a100-roce", "--interval", "0.5")
    assert not left[0].exists()
    assert len(_owned_by(successor.proc.pid)) == 1
    code, output = successor.stop()
    assert code == 0, output
    assert _owned_by(successor.proc.pid) == []
