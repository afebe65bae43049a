"""The benchmark scripts at tiny sizes: they run, and what they count is right. Never their speed.

The cluster-scale diagnosis at 16 nodes is also the end-to-end check of ``diagnose --prometheus`` over backfilled
data: exactly the planted faults, none missed, none spurious.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import cluster_diagnosis  # noqa: E402
import telemetry_ingest  # noqa: E402

from conftest import require_tool  # noqa: E402

pytestmark = pytest.mark.integration


def test_template_series_are_what_the_agent_exports(tmp_path):
    template = cluster_diagnosis.capture_template(tmp_path)
    names = {series.name for series in template}
    assert {"gpuwatch_agent_info", "gpuwatch_nvlink_up", "gpuwatch_ib_port_state_id", "gpuwatch_train_loss",
            "gpuwatch_train_rank_info", "gpuwatch_gpu_job_info"} <= names
    assert sum(series.name == "gpuwatch_nvlink_up" for series in template) == 8 * 18
    assert sum(series.name == "gpuwatch_train_last_step" for series in template) == 8


def test_sixteen_node_cluster_diagnosis_finds_exactly_the_planted_faults(tmp_path):
    require_tool("promtool")
    require_tool("prometheus")
    template = cluster_diagnosis.capture_template(tmp_path)
    run = cluster_diagnosis.measure(template, 16, repeat=1, workdir=tmp_path)
    plan = cluster_diagnosis.Plan(16)
    assert run.found == plan.expected()
    assert run.series == 16 * len(template)
    assert ("NCCL001", cluster_diagnosis.node_name(1)) in run.found  # the environment reaches Prometheus


def test_plan_refuses_clusters_too_small_for_distinct_faults():
    with pytest.raises(ValueError):
        cluster_diagnosis.Plan(8)
    plan = cluster_diagnosis.Plan(16)
    assert len({node for _, node in plan.expected()}) == 6


def test_offered_load_loses_nothing_it_sent():
    result = telemetry_ingest.offered_load(ranks=4, seconds=0.5, interval=0.2, rate=500)
    assert result.sent + result.dropped >= 200
    assert result.lost_in_agent == 0


def test_agent_cost_runs_and_counts_every_rank():
    result = subprocess.run([sys.executable, str(BENCHMARKS / "agent_cost.py"), "--seconds", "2", "--scrapes", "5",
                             "--warmup", "3", "--fresh-scrapes", "3"], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "64 ranks reporting" in result.stdout and "rejected 0" in result.stdout
    assert "agent CPU" in result.stdout and "/metrics       p50" in result.stdout
    assert "of which simulation" in result.stdout and "/metrics every 1 s p50" in result.stdout
