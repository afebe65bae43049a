"""benchmarks/hooks_overhead.py's fixed-cost measurement at a tiny size: it runs both ways (one process, 2-rank DDP)
and prints every figure it promises, with the machine. Never its speed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import hooks_overhead

pytestmark = pytest.mark.integration


def test_fixed_cost_prints_thread_wall_and_client_cost_with_the_noise_floor_for_both_layouts(capsys, tmp_path,
                                                                                             monkeypatch):
    monkeypatch.setenv("GPUWATCH_SOCKET", str(tmp_path / "no-agent.sock"))
    hooks_overhead.fixed_cost(rounds=2, steps=10, width=16)
    out = capsys.readouterr().out
    assert "machine: " in out and " CPUs (" in out and "torch " in out  # the cores, CPU model and torch it ran on
    assert "load average before: " in out and "load average after: " in out
    for layout in ("one process", "DDP, 2 ranks (rank 0)"):
        section = out.split(layout, 1)[1].splitlines()[1:4]
        assert [line.split()[0] for line in section] == ["thread", "wall", "telemetry"]
        for line in section[:2]:
            off, on, low, median, high, _floor = map(float, line.split()[-6:])
            assert off > 0 and on > 0 and low <= median <= high
        assert float(section[2].split(":")[1].split()[0]) > 0  # the client's thread sent the records
