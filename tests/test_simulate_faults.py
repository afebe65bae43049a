"""``gpuwatch agent --simulate PRESET --simulate.faults FILE``: every fault kind a file can plant shows in the agent's
series, and a file that cannot be planted is one line naming the problem and a non-zero exit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from telemetry_records import samples

from gpuwatch.agent.simulate import PRESETS
from gpuwatch.agent.simulate.faults import KINDS, FaultsError, load
from gpuwatch.cli.main import main

from conftest import wait_until

#: One fault of every kind, and the series (name, labels, value) each must show on the agent's /metrics.
PLANTED = [
    ({"fault": "xid", "gpu": 3, "xid": 79}, ("gpuwatch_gpu_xid_errors_total", {"gpu": "3", "xid": "79"}, 1)),
    ({"fault": "nvlink_down", "gpu": 0, "link": 2}, ("gpuwatch_nvlink_up", {"gpu": "0", "link": "2"}, 0)),
    ({"fault": "ib_port_down", "device": "mlx5_1", "phys_state": "Polling"},
     ("gpuwatch_ib_port_physical_state_id", {"device": "mlx5_1", "port": "1"}, 2)),
    ({"fault": "ib_errors", "device": "mlx5_2", "counter": "symbol_error", "count": 50},
     ("gpuwatch_ib_port_errors_total", {"device": "mlx5_2", "port": "1", "counter": "symbol_error"}, 50)),
    ({"fault": "pcie", "gpu": 1, "generation": 3, "width": 8},
     ("gpuwatch_gpu_pcie_link_width", {"gpu": "1", "kind": "current"}, 8)),
    ({"fault": "clock_slowdown", "gpu": 2, "reasons": ["hw_thermal_slowdown"]},
     ("gpuwatch_gpu_clock_event_active", {"gpu": "2", "reason": "hw_thermal_slowdown"}, 1)),
    ({"fault": "ecc", "gpu": 4, "uncorrected": 2},
     ("gpuwatch_gpu_ecc_volatile_errors_total", {"gpu": "4", "error": "uncorrected"}, 2)),
    ({"fault": "row_remap_failure", "gpu": 5}, ("gpuwatch_gpu_row_remap_failure", {"gpu": "5"}, 1)),
    ({"fault": "gpu_lost", "gpu": 6}, ("gpuwatch_gpu_lost", {"gpu": "6"}, 1)),
]
#: Series that stay at their healthy values beside the planted ones: a fault touches only what it names.
UNTOUCHED = [("gpuwatch_nvlink_up", {"gpu": "0", "link": "3"}, 1), ("gpuwatch_gpu_lost", {"gpu": "7"}, 0),
             ("gpuwatch_ib_port_physical_state_id", {"device": "mlx5_0", "port": "1"}, 5),
             ("gpuwatch_gpu_pcie_link_generation", {"gpu": "0", "kind": "current"}, 5)]


def test_every_fault_kind_is_planted_by_one_file():
    assert {fault["fault"] for fault, _ in PLANTED} == set(KINDS), "add the new fault kind to PLANTED"


def _value(text: str, name: str, labels: dict[str, str]) -> float | None:
    return samples(text, name).get(frozenset(labels.items()))


def test_each_planted_fault_shows_in_the_agents_series(start_agent, tmp_path):
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"faults": [fault for fault, _ in PLANTED]}))
    agent = start_agent("--simulate", "dgx-h100", "--simulate.faults", str(faults), "--interval", "0.5")
    expected = [series for _, series in PLANTED] + UNTOUCHED

    def shown() -> bool:
        text = agent.get("/metrics").decode()
        return all(_value(text, name, labels) == value for name, labels, value in expected)

    # The Xid arrives once the nvml collector listens for Xid events: wait for a round that shows all of them.
    wait_until(shown, timeout=30, what="every planted fault in /metrics")
    text = agent.get("/metrics").decode()
    assert _value(text, "gpuwatch_ib_port_state_id", {"device": "mlx5_1", "port": "1"}) == 1  # DOWN
    assert _value(text, "gpuwatch_gpu_pcie_link_generation", {"gpu": "1", "kind": "current"}) == 3
    assert _value(text, "gpuwatch_gpu_row_remap_pending", {"gpu": "4"}) == 1  # an uncorrectable error leaves one
    code, log = agent.stop()
    assert code == 0 and "simulated fault planted: xid(gpu=3, xid=79)" in log, log


@pytest.mark.parametrize("document, message", [
    ("not json", "not valid JSON"),
    ([], "expected an object with a 'faults' list"),
    ({"faults": [], "extra": 1}, "unknown key(s) extra"),
    ({"faults": ["xid"]}, "fault 0 is str, not an object of fields"),
    ({"faults": [{"fault": "meltdown"}]}, "fault 0 'fault' is 'meltdown', not one of xid, nvlink_down"),
    ({"faults": [{"fault": "xid", "gpu": 8, "xid": 79}]}, "gpu 8 out of range (the dgx-h100 preset has GPUs 0-7)"),
    ({"faults": [{"fault": "xid", "gpu": 0, "xid": 79}, {"fault": "xid", "gpu": 0}]}, "fault 1 (xid) lacks 'xid'"),
    ({"faults": [{"fault": "xid", "gpu": "0", "xid": 79}]}, "'gpu' is '0', not an int"),
    ({"faults": [{"fault": "xid", "gpu": True, "xid": 79}]}, "'gpu' is True, not an int"),
    ({"faults": [{"fault": "nvlink_down", "gpu": 0, "link": 18}]}, "link 18 out of range"),
    ({"faults": [{"fault": "nvlink_down", "gpu": 0, "link": 1, "state": "up"}]}, "unknown field(s) state"),
    ({"faults": [{"fault": "ib_port_down", "device": "mlx5_9"}]}, "no HCA 'mlx5_9'"),
    ({"faults": [{"fault": "ib_port_down", "device": "mlx5_0", "phys_state": "LinkUp"}]},
     "unknown physical state 'LinkUp'"),
    ({"faults": [{"fault": "ib_errors", "device": "mlx5_0", "counter": "port_xmit_data", "count": 1}]},
     "unknown counter 'port_xmit_data'"),
    ({"faults": [{"fault": "pcie", "gpu": 0, "generation": 6}]}, "PCIe generation 6 out of range"),
    ({"faults": [{"fault": "pcie", "gpu": 0, "width": 12}]}, "PCIe width 12 not one of"),
    ({"faults": [{"fault": "pcie", "gpu": 0}]}, "sets neither 'generation' nor 'width'"),
    ({"faults": [{"fault": "clock_slowdown", "gpu": 0, "reasons": ["overclocked"]}]},
     "unknown clock event reason 'overclocked'"),
    ({"faults": [{"fault": "ecc", "gpu": 0}]}, "counts no error"),
])
def test_a_bad_faults_file_is_one_line_and_a_non_zero_exit(tmp_path, document, message):
    faults = tmp_path / "faults.json"
    faults.write_text(document if isinstance(document, str) else json.dumps(document))
    result = CliRunner().invoke(main, ["agent", "--simulate", "dgx-h100", "--simulate.faults", str(faults),
                                       "--listen", "127.0.0.1:0"])
    assert result.exit_code == 1, result.output
    assert message in result.output and str(faults) in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_faults_are_checked_against_the_preset_and_need_a_simulated_node(tmp_path):
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"faults": [{"fault": "nvlink_down", "gpu": 0, "link": 0}]}))
    assert load(faults, PRESETS["dgx-h100"])[0].fields == {"gpu": 0, "link": 0}
    with pytest.raises(FaultsError, match="the a100-roce preset has no NVLink"):
        load(faults, PRESETS["a100-roce"])
    with pytest.raises(FaultsError, match="cannot read it"):
        load(tmp_path / "missing.json", PRESETS["dgx-h100"])
    result = CliRunner().invoke(main, ["agent", "--simulate.faults", str(faults), "--listen", "127.0.0.1:0"])
    assert result.exit_code == 1 and "--simulate.faults plants faults into a simulated node" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_the_docs_name_every_fault_kind():
    docs = (Path(__file__).resolve().parent.parent / "docs" / "agent.md").read_text()
    assert "--simulate.faults" in docs
    assert all(f"`{kind}`" in docs for kind in KINDS), [kind for kind in KINDS if f"`{kind}`" not in docs]
