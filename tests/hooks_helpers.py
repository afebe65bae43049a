"""Helpers for the hooks' tests: the agent they report to, reading what it and the run log hold, and a clock
the test moves by hand."""

from __future__ import annotations

from pathlib import Path

from telemetry_records import samples

from gpuwatch.protocol.schema import decode
from gpuwatch.trainer.hooks.clock import WallClock

from conftest import wait_until

#: A simulated node's agent, sampling often enough for a test.
AGENT = ("--simulate", "a100-roce", "--interval", "0.5")


def by_rank(text: str, name: str, job: str, **labels: str) -> dict[int, float]:
    """{rank: value} of one series of one job in exposition text, filtered by further labels."""
    out = {}
    for label_set, value in samples(text, name).items():
        found = dict(label_set)
        if found["job"] == job and all(found.get(key) == want for key, want in labels.items()):
            out[int(found["rank"])] = value
    return out


def wait_for_step(agent, job: str, ranks: int, step: int) -> list[dict]:
    """The agent's per-rank state once every rank of `job` has reported `step`."""

    def reported() -> list[dict] | None:
        states = [r for r in agent.state()["facts"]["telemetry"]["ranks"] if r["job"] == job]
        done = len(states) == ranks and all(r["hello"] and (r["last_step"] or {}).get("step") == step for r in states)
        return states if done else None

    return wait_until(reported, timeout=20, what=f"{ranks} ranks of {job} at step {step}")


def read_run_log(directory: Path) -> dict[int, list[dict]]:
    """Every rank's records from a --run-log directory, each checked against the schema as the agent checks it, but
    the last one a closed monitor sends (a progress record, phase "closed": tests/test_hooks_monitor.py holds it),
    so that a rank's records are its hello and its steps."""
    logs = {}
    for path in sorted(directory.glob("rank-*.jsonl")):
        bodies = [decode(line).body.as_dict() for line in path.read_bytes().splitlines()]
        logs[int(path.stem.split("-")[1])] = [body for body in bodies if body.get("phase") != "closed"]
    return logs


class ManualClock(WallClock):
    """The CPU clock of the hooks (`WallClock`), read from a time the test sets instead of `perf_counter`: the
    durations the hooks compute from its marks are exactly what the test scripted, whatever the machine's load."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def mark(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
