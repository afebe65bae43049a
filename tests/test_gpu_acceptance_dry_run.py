"""benchmarks/gpu_acceptance.py without a GPU: the dry run end to end (simulated node, CPU), its report, its timeout
and budget paths, and its refusals of bad input. What the checks find on a real GPU: tests/gpu/."""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import gpuwatch.trainer.config

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu_acceptance  # noqa: E402

NAMES = [check.name for check in gpu_acceptance.CHECKS]
#: What only a GPU can show: skipped in the dry run, with the reason.
GPU_ONLY = {"agent-load", "diagnose-fragmentation", "hooks-overhead", "frameworks-gpu", "plan"}


@pytest.mark.integration
def test_dry_run_runs_every_check_for_real(tmp_path):
    out = tmp_path / "report"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_acceptance.py"), "--dry-run", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(path.name for path in out.iterdir()) == ["raw.tar.gz", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True and summary["budget_seconds"] == gpu_acceptance.BUDGET_SECONDS
    checks = {check["name"]: check for check in summary["checks"]}
    assert [check["name"] for check in summary["checks"]] == NAMES
    for name in GPU_ONLY:
        assert checks[name]["status"] == "skip" and checks[name]["reason"].startswith("dry run:"), checks[name]
    assert "ratio" in checks["hooks-overhead"]["figures"]  # measured on the CPU, not judged
    plan = checks["plan"]["figures"]  # predicted and measured on the CPU, not judged
    assert {name for name, *_ in gpu_acceptance.PLAN_LAYOUTS} <= plan.keys()
    assert all(plan[name]["predicted_step_seconds"] > 0 and plan[name]["measured_peak_bytes"] is None
               for name, *_ in gpu_acceptance.PLAN_LAYOUTS)
    passed = {name for name, check in checks.items() if check["status"] == "pass"}
    assert passed == set(checks) - GPU_ONLY, {name: checks[name].get("reason") for name in set(checks) - passed}
    assert checks["diagnose-fp16"]["figures"]["findings"].keys() == {"CONV001"}
    assert checks["diagnose-healthy"]["figures"]["findings"] == {}
    assert len(checks["agent-nvml"]["figures"]["gpus"]) == 8  # the simulated dgx-h100
    for window in ("1s", "5s"):  # the agent proper, the simulation's own share taken out
        cost = checks["agent-cost"]["figures"][window]
        assert 0 <= cost["cpu_percent"] < 100 and cost["rss_max_mb"] > 0, cost
    with tarfile.open(out / "raw.tar.gz") as archive:
        members = set(archive.getnames())
    assert {f"raw/agent-nvml/{name}" for name in ("state.json", "metrics.txt", "promtool.txt", "agent.log")} <= members
    assert {f"raw/{name}/check.log" for name in NAMES} <= members
    for name in NAMES:
        assert f"\n{name} " in result.stdout, name  # a row of the table for each


def test_a_hanging_check_is_killed_at_its_timeout_and_the_run_goes_on(tmp_path):
    """The kit's own hanging check (never run by default), and a real one after it."""
    out = tmp_path / "report"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_acceptance.py"), "--dry-run", "--out", str(out),
                             "--only", "self-test-hang", "--only", "environment", "--timeout", "self-test-hang=2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr  # the timeout is a failure of the run
    checks = {check["name"]: check for check in json.loads((out / "summary.json").read_text())["checks"]}
    hung, environment = checks["self-test-hang"], checks["environment"]
    assert hung["status"] == "timeout"
    assert "no result within 2 s: killed with every process it started" in hung["reason"]
    assert environment["status"] == "pass", environment
    assert "self-test-hang" not in NAMES  # never part of a real run


def test_a_spent_budget_leaves_the_remaining_checks_reported_as_not_started(tmp_path, capsys):
    out = tmp_path / "report"
    assert gpu_acceptance.main(["--dry-run", "--out", str(out), "--budget", "1", "--only", "probe"]) == 1
    (check,) = json.loads((out / "summary.json").read_text())["checks"]
    assert check["name"] == "probe" and check["status"] == "timeout"
    assert check["reason"] == "not started: the run's budget of 1 s was spent"


@pytest.mark.parametrize(("args", "message"), [
    (["--dry-run", "--timeout", "no-such-check=3"], "--timeout no-such-check=3: no check 'no-such-check'"),
    (["--dry-run", "--timeout", "probe=soon"], "--timeout probe=soon: SECONDS must be a number"),
    (["--dry-run", "--timeout", "probe=0"], "--timeout probe=0: SECONDS must be positive"),
    ([], "no GPU here (NVML finds none): run it on a GPU machine, or with --dry-run"),
])
def test_bad_input_is_refused_in_one_line(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpuwatch.trainer.config, "gpus_present", lambda: False)  # as on a machine without GPUs
    with pytest.raises(SystemExit) as exit_info:
        gpu_acceptance.main([*args, "--out", str(tmp_path / "report")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("gpu_acceptance.py: error: ") and message in error, error
    assert not (tmp_path / "report").exists()


def test_a_report_directory_in_use_is_refused(tmp_path, capsys):
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        gpu_acceptance.main(["--dry-run", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"--out {tmp_path} exists and is not an empty directory" in capsys.readouterr().err
