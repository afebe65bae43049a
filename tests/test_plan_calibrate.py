"""Calibration (gpuwatch.plan.calibrate, `gpuwatch calibrate`, `gpuwatch plan --calibration`): the file's round
trip, every malformed file refused in one line, a probe's run log read onto the planner's links, and measured
figures moving the predicted step the way they must. Structure and proportion only: no assertion depends on how
fast this machine is."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from gpuwatch.cli.main import main
from gpuwatch.plan import calibrate
from gpuwatch.plan.calibrate import CalibrationError
from gpuwatch.plan.compute import layer_matmul_flops
from gpuwatch.plan.gpus import Calibration, Cluster, preset
from gpuwatch.plan.model import from_reference
from gpuwatch.plan.planner import predict
from gpuwatch.plan.run import Layout, Run, numerics
from gpuwatch.trainer.config import ModelConfig

TINY = ModelConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4)
CALIBRATION = Calibration(2e11, {"nvlink": ((1024, 1e8), (1 << 20, 5e9)), "ib": ((4096, 1e9),)},
                          ((1e6, 1e11), (1e8, 3e11)), "bf16", {"device": "cuda", "shapes": [[16, 32, 96]]})


def probe_record(nodes: int = 1) -> dict:
    """A probe record as `gpuwatch probe --run-log` writes it (trainer/probe.py's probe_record)."""
    return {"v": 1, "kind": "probe", "job": "probe", "rank": 0, "time": 1.0, "hostname": "n0", "nodes": nodes,
            "hostnames": ["n0"], "world_size": 2, "ranks_per_node": 2, "backend": "gloo", "device": "cpu",
            "interconnect": "loopback", "dtype": "float32",
            "results": [{"op": op, "bytes": size, "seconds": 1e-3, "algbw_bytes_per_second": size / 1e-3,
                         "busbw_bytes_per_second": size / 1e-3 * (1 if op == "all_reduce" else 0.5)}
                        for op in ("all_reduce", "all_gather") for size in (4096, 1024, 65536)]}


def test_a_calibration_round_trips(tmp_path):
    path = tmp_path / "calibration.json"
    calibrate.write(CALIBRATION, path)
    assert json.loads(path.read_text())["schema"] == "gpuwatch.calibration/1"
    assert calibrate.read(path) == CALIBRATION


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not JSON"),
    ("[]", "not a JSON object"),
    ('{"schema": "gpuwatch.calibration/2"}', "schema 'gpuwatch.calibration/2', expected 'gpuwatch.calibration/1'"),
    ({"matmul_flops": -1}, "matmul_flops must be a positive number or null"),
    ({"matmul_flops": True}, "matmul_flops must be a positive number or null"),
    ({"precision": "fp8"}, "precision must be one of"),
    ({"bus_bandwidth": []}, "bus_bandwidth must be an object of links"),
    ({"bus_bandwidth": {"pcie": [[1, 1.0]]}}, "unknown link 'pcie'"),
    ({"bus_bandwidth": {"nvlink": []}}, "bus_bandwidth.nvlink must be a non-empty list"),
    ({"bus_bandwidth": {"nvlink": [[1, 2, 3]]}}, "is not a [size, rate] pair"),
    ({"bus_bandwidth": {"nvlink": [[1.5, 2.0]]}}, "needs a positive integer size"),
    ({"bus_bandwidth": {"nvlink": [[2, 1.0], [1, 1.0]]}}, "sizes must be distinct and ascending"),
    ({"flops_by_work": [[1e6, 0]]}, "flops_by_work: [1000000.0, 0] needs a positive size and a positive rate"),
    ({"flops_by_work": {}}, "flops_by_work must be a list"),
    ({"measured": []}, "measured must be an object"),
])
def test_a_malformed_calibration_is_one_line(tmp_path, content, message):
    path = tmp_path / "calibration.json"
    if isinstance(content, dict):
        content = json.dumps({"schema": calibrate.SCHEMA, **content})
    path.write_text(content)
    with pytest.raises(CalibrationError) as error:
        calibrate.read(path)
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)
    assert len(str(error.value).splitlines()) == 1


def test_a_missing_calibration_file_is_one_line(tmp_path):
    with pytest.raises(CalibrationError, match="No such file or directory"):
        calibrate.read(tmp_path / "missing.json")


def test_a_probe_run_log_fills_the_link_it_measured(tmp_path):
    """The last probe record of a JSONL run log; its all-reduce points, ascending; one node is the intra-node
    link, several the inter-node one."""
    path = tmp_path / "probe.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ({"kind": "hello"}, probe_record(2), probe_record(1))) + "\n")
    link, points, source = calibrate.read_probe(path)
    assert link == "nvlink" and source["interconnect"] == "loopback"
    assert points == ((1024, 1024 / 1e-3), (4096, 4096 / 1e-3), (65536, 65536 / 1e-3))
    (tmp_path / "ib.json").write_text(json.dumps(probe_record(2), indent=1))  # one pretty-printed record
    assert calibrate.read_probe(tmp_path / "ib.json")[0] == "ib"
    assert calibrate.read_probe(path, "all_gather")[1][0] == (1024, 1024 / 1e-3 * 0.5)


@pytest.mark.parametrize(("records", "message"), [
    ([{"kind": "hello"}], "no probe record"),
    ([{**probe_record(), "nodes": 0}], "nodes must be a positive integer"),
    ([{**probe_record(), "results": [{"op": "all_reduce", "bytes": 0, "busbw_bytes_per_second": 1.0}]}],
     "needs a positive integer size"),
    ([{**probe_record(), "results": []}], "measured no all_reduce"),
])
def test_a_bad_probe_file_is_one_line(tmp_path, records, message):
    path = tmp_path / "probe.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    with pytest.raises(CalibrationError, match=message):
        calibrate.read_probe(path)


def test_the_model_shapes_add_up_to_the_planners_matmul_work():
    """2·m·k·n over a layer's matmuls is what the planner looks the FLOP/s up by: layer_matmul_flops × tokens / t."""
    shape = from_reference(TINY)
    for tp in (1, 2, 4):
        assert calibrate.work(calibrate.model_shapes(shape, 64, tp)) == layer_matmul_flops(shape) * 64 / tp


def _step(calibration: Calibration, layout: Layout) -> float:
    run = Run(8, TINY.seq_len, numerics("fp32", reference=True), sequence_parallel=False)
    cluster = Cluster(layout.tp * layout.pp * layout.dp, 8, preset("h100-80gb"), calibration=calibration)
    return predict(from_reference(TINY), cluster, run, layout).step_seconds


def test_measured_flops_scale_the_compute_and_bandwidth_the_communication():
    """Compute time is inversely proportional to the FLOP/s (no communication on one rank); halving a link's
    measured bus bandwidth doubles the TP collectives' time."""
    one = Layout(1, 1, 1, 1)
    assert _step(Calibration(1e9), one) == pytest.approx(2 * _step(Calibration(2e9), one))
    tp = Layout(2, 1, 1, 1)
    slow, fast = (Calibration(1e12, {"nvlink": ((1, rate),)}) for rate in (1e8, 2e8))
    compute = _step(Calibration(1e12, {"nvlink": ((1, 1e30),)}), tp)
    assert _step(slow, tp) - compute == pytest.approx(2 * (_step(fast, tp) - compute))


def test_the_sweep_gives_each_micro_batch_its_own_speed():
    """With FLOP/s by work, a layout of smaller micro-batches runs at the slower figure of its smaller matmuls."""
    shape = from_reference(TINY)
    big, small = (calibrate.work(calibrate.model_shapes(shape, TINY.seq_len * size)) for size in (8, 1))
    sweep = Calibration(1e9, flops_by_work=((small, 1e9), (big, 4e9)))
    assert _step(sweep, Layout(1, 1, 1, 8)) == pytest.approx(_step(Calibration(1e9), Layout(1, 1, 1, 8)))
    assert _step(sweep, Layout(1, 1, 1, 1)) == pytest.approx(_step(Calibration(4e9), Layout(1, 1, 1, 1)))


def test_measure_times_the_matmuls_and_keeps_how(tmp_path):
    """A real (tiny) measurement on the CPU: positive figures, one per swept size, the probe's link, provenance."""
    probe = tmp_path / "probe.jsonl"
    probe.write_text(json.dumps(probe_record()))
    shape = from_reference(TINY)
    result = calibrate.measure(calibrate.model_shapes(shape, 16), repeats=2, probes=[probe],
                               sweep=calibrate.sweep_shapes(shape, 16, (1, 2)))
    assert result.matmul_flops > 0 and len(result.measured["flops_samples"]) == 2
    assert [size for size, _ in result.flops_by_work] == sorted(
        calibrate.work(s) for s in calibrate.sweep_shapes(shape, 16, (1, 2)))
    assert set(result.bus_bandwidth) == {"nvlink"} and result.precision == "fp32"
    assert result.measured["threads"] == 1 and result.measured["probes"][0]["file"] == str(probe)


def _reference_plan(*args: str):
    return CliRunner().invoke(main, ["plan", "--reference", "--layers", "4", "--hidden", "32", "--heads", "4",
                                     "--vocab", "64", "--seq-len", "16", "--gpus", "2", "--gpus-per-node", "2",
                                     "--global-batch", "8", "--precision", "fp32", "--format", "json",
                                     "--top", "100", *args])


def test_plan_with_a_calibration_predicts_at_the_measured_speed(tmp_path):
    """Every layout's compute follows the file's FLOP/s: ten times the FLOP/s, a tenth of the compute; the JSON
    says which figures were used."""
    times = {}
    for flops in (1e9, 1e10):
        path = tmp_path / f"{flops:g}.json"
        calibrate.write(Calibration(flops, {"nvlink": ((1, 1e9),)}, precision="fp32"), path)
        result = _reference_plan("--calibration", str(path))
        assert result.exit_code == 0, result.output
        document = json.loads(result.stdout)
        assert document["cluster"]["calibration"]["matmul_flops"] == flops
        times[flops] = {json.dumps(entry["layout"]): entry["compute_seconds"] for entry in document["feasible"]}
    assert times[1e9].keys() == times[1e10].keys()
    for layout, seconds in times[1e9].items():
        assert seconds == pytest.approx(10 * times[1e10][layout]), layout
    assert json.loads(_reference_plan().stdout)["cluster"]["calibration"] is None


@pytest.mark.parametrize(("args", "message"), [
    (("--calibration", "{missing}"), "missing.json: No such file or directory"),
    (("--calibration", "{bad}"), "bad.json: not JSON"),
    (("--calibration", "{bf16}"), "timed bf16 matmuls, and the plan is for --precision fp32"),
])
def test_plan_refuses_a_bad_calibration_in_one_line(tmp_path, args, message):
    (tmp_path / "bad.json").write_text("{")
    calibrate.write(Calibration(1e9, precision="bf16"), tmp_path / "bf16.json")
    files = {"{missing}": str(tmp_path / "missing.json"), "{bad}": str(tmp_path / "bad.json"),
             "{bf16}": str(tmp_path / "bf16.json")}
    result = _reference_plan(*(files.get(arg, arg) for arg in args))
    assert result.exit_code == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("gpuwatch plan: "), result.stderr
    assert message in result.stderr


def test_calibrate_writes_a_file_plan_reads(tmp_path):
    probe, out = tmp_path / "probe.jsonl", tmp_path / "calibration.json"
    probe.write_text(json.dumps(probe_record()) + "\n")
    result = CliRunner().invoke(main, ["calibrate", "--reference", "--layers", "4", "--hidden", "32", "--heads",
                                       "4", "--vocab", "64", "--seq-len", "16", "--repeats", "1", "--sweep", "1,2",
                                       "--probe", str(probe), "-o", str(out)])
    assert result.exit_code == 0, result.output
    calibration = calibrate.read(out)
    assert calibration.precision == "fp32" and len(calibration.flops_by_work) == 2
    assert calibration.measured["shapes"][0] == [16, 32, 96]  # a micro-batch of one 16-token sequence, QKV
    assert _reference_plan("--calibration", str(out)).exit_code == 0


@pytest.mark.parametrize(("args", "message"), [
    (("--reference",), "Missing option '-o' / '--output'"),
    (("--reference", "-o", "{out}", "--probe", "{missing}"), "missing.jsonl: No such file or directory"),
    (("--reference", "-o", "{out}", "--probe", "{hello}"), "no probe record"),
    (("--reference", "-o", "{out}", "--sweep", "1,x"), "invalid literal for int()"),
    (("--reference", "-o", "{out}", "--tp", "0"), "must be at least 1"),
    (("--layers", "2", "-o", "{out}"), "no model: give --model config.json, --reference"),
    (("--reference", "-o", "{out}", "--device", "tpu"), "'tpu' is not one of 'cpu', 'cuda'"),
])
def test_calibrate_refuses_bad_input_in_one_line(tmp_path, args, message):
    (tmp_path / "hello.jsonl").write_text(json.dumps({"kind": "hello"}))
    files = {"{out}": str(tmp_path / "out.json"), "{missing}": str(tmp_path / "missing.jsonl"),
             "{hello}": str(tmp_path / "hello.jsonl")}
    result = CliRunner().invoke(main, ["calibrate", *(files.get(arg, arg) for arg in args)])
    assert result.exit_code == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("gpuwatch calibrate: "), result.stderr
    assert message in result.stderr
    assert not (tmp_path / "out.json").exists()


def test_calibration_imports_no_torch_until_it_measures():
    """Reading and writing a calibration (the planner, the diagnosis) need no torch."""
    code = ("import sys, gpuwatch.plan.calibrate, gpuwatch.plan.cli; "
            "assert 'torch' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
