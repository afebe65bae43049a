"""The benchmark scripts at tiny sizes: they run, and what they count is right. Never their speed.

The cluster-scale diagnosis at 16 nodes is also the end-to-end check of ``diagnose --prometheus`` over backfilled
data: exactly the planted faults, none missed, none spurious.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import cluster_diagnosis  # noqa: E402
import false_alarms  # noqa: E402
import foreign  # noqa: E402
import hang_latency  # noqa: E402
import render_instructions  # noqa: E402
import telemetry_ingest  # noqa: E402

from gpuwatch.agent.telemetry.store import TelemetryStore  # noqa: E402
from gpuwatch.protocol.schema import decode  # noqa: E402

from conftest import COLLECTOR_TIMEOUT, require_tool  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture
def generous_collector_timeout(monkeypatch):
    """The agents cluster_diagnosis starts, with the tests' generous collector deadline (conftest): with the
    default one (0.8 × interval), a collector that a loaded machine delays misses the round the template is
    captured from, and its series are missing from it."""
    process = cluster_diagnosis._process

    def with_generous_deadline(command, *args, **kwargs):
        agent = command[1:4] == ["-m", "gpuwatch.cli.main", "agent"]
        return process([*command, *COLLECTOR_TIMEOUT] if agent else command, *args, **kwargs)

    monkeypatch.setattr(cluster_diagnosis, "_process", with_generous_deadline)


@pytest.mark.usefixtures("generous_collector_timeout")
def test_template_series_are_what_the_agent_exports(tmp_path):
    template = cluster_diagnosis.capture_template(tmp_path)
    names = {series.name for series in template}
    assert {"gpuwatch_agent_info", "gpuwatch_nvlink_up", "gpuwatch_ib_port_state_id", "gpuwatch_train_loss",
            "gpuwatch_train_rank_info", "gpuwatch_gpu_job_info"} <= names
    assert sum(series.name == "gpuwatch_nvlink_up" for series in template) == 8 * 18
    assert sum(series.name == "gpuwatch_train_last_step" for series in template) == 8


@pytest.mark.usefixtures("generous_collector_timeout")
def test_sixteen_node_cluster_diagnosis_finds_exactly_the_planted_faults(tmp_path, monkeypatch):
    """The outlier fetch, with the shipped recording rules, finds exactly the planted faults; the full pull runs
    beside it (the bytes' yardstick); the TSDB is backfilled in two chunks of nodes, as large sizes need."""
    require_tool("promtool")
    require_tool("prometheus")
    monkeypatch.setattr(cluster_diagnosis, "BACKFILL_CHUNK", 8)
    template = cluster_diagnosis.capture_template(tmp_path)
    run = cluster_diagnosis.measure(template, 16, repeat=1, workdir=tmp_path, full=True)
    plan = cluster_diagnosis.Plan(16)
    assert run.found == plan.expected()
    assert run.series == 16 * len(template)
    assert run.queries > 0 and run.bytes_received > 0 and run.full_bytes is not None and run.costs
    assert ("NCCL001", cluster_diagnosis.node_name(1)) in run.found  # the environment reaches Prometheus


def test_plan_refuses_clusters_too_small_for_distinct_faults():
    with pytest.raises(ValueError):
        cluster_diagnosis.Plan(8)
    plan = cluster_diagnosis.Plan(16)
    assert len({node for _, node in plan.expected()}) == 6


#: Sent after the benchmark's sender has finished; the store notices it without counting it.
DRAIN_MARKER = b"test_benchmarks: drained"


@pytest.fixture
def drained_receiver(monkeypatch):
    """telemetry_ingest's receiver, closed only once it has stored every datagram sent to it. The benchmark
    gives the last queued datagrams a fixed 0.2 s, which a loaded machine may not meet: here a marker datagram
    goes after the sender's last, and a Unix datagram socket is first in, first out, so once the receiver's
    store has seen the marker it has stored every record before it."""
    drained = threading.Event()
    apply = TelemetryStore._apply  # every datagram received is applied through it, in order

    def apply_or_notice_the_marker(self, datagram, sender_pid):
        if datagram == DRAIN_MARKER:
            drained.set()
            return None
        return apply(self, datagram, sender_pid)

    receiver = telemetry_ingest._receiver

    @contextlib.contextmanager
    def draining(interval):
        with receiver(interval) as (path, collector):
            yield path, collector
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as marker:
                marker.sendto(DRAIN_MARKER, str(path))
            assert drained.wait(60), "the receiver never got to the marker"

    monkeypatch.setattr(TelemetryStore, "_apply", apply_or_notice_the_marker)
    monkeypatch.setattr(telemetry_ingest, "_receiver", draining)


def test_offered_load_loses_nothing_it_sent(drained_receiver):
    """How many records the paced sender offers in its 0.5 s depends on how often a loaded machine wakes it:
    only that it sent some, and that the receiver stored or rejected every one it sent."""
    result = telemetry_ingest.offered_load(ranks=4, seconds=0.5, interval=0.2, rate=500)
    assert result.sent > 0
    assert result.lost_in_agent == 0


#: benchmarks/agent_cost.py at tiny sizes, its agents with the tests' generous collector deadline (conftest), so
#: that a loaded machine cannot make the telemetry collector miss the round whose ranks it counts.
AGENT_COST = f"""
import sys
sys.path.insert(0, {str(BENCHMARKS)!r})
sys.argv = ["agent_cost.py", "--runs", "2", "--seconds", "2", "--scrape-every", "1", "--scrapes", "5", "--warmup", "3",
            "--fresh-scrapes", "3"]
import agent_cost
command = agent_cost.agent_command
agent_cost.agent_command = lambda *args: [*command(*args), *{COLLECTOR_TIMEOUT!r}]
agent_cost.main()
"""


def test_agent_cost_runs_and_counts_every_rank():
    result = subprocess.run([sys.executable, "-c", AGENT_COST], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "64 ranks reporting" in result.stdout and "rejected 0" in result.stdout
    assert result.stdout.startswith("machine: ") and "load average before" in result.stdout
    assert "run 1: " in result.stdout and "run 2: " in result.stdout and "2 run(s), min / median / max" in result.stdout
    assert "agent CPU" in result.stdout and "of which simulation" in result.stdout and "agent proper" in result.stdout
    assert "idle agent" in result.stdout and "/metrics back to back  p50" in result.stdout
    assert "/metrics every 1 s" in result.stdout and "load average after" in result.stdout


def test_render_instructions_feeds_the_clients_folds_and_applies_every_step(tmp_path, capsys):
    """benchmarks/render_instructions.py without valgrind (the count is valgrind's): each round holds one or two
    folded datagrams of every rank, and its child applies all of their steps and renders them."""
    rounds = render_instructions.WARM_ROUNDS + 1
    hellos, per_round = render_instructions.datagrams(rounds, ranks=4)
    assert len(hellos) == 4 and [len(batch) for batch in per_round[:2]] == [4, 8]  # steps 1-15: one fold; 16-30: two
    records = [decode(datagram) for batch in per_round for datagram in batch]
    assert {len(record.body.as_dict()["folded"]["steps"]) for record in records} == {9}
    workload = tmp_path / "workload.pickle"
    workload.write_bytes(pickle.dumps((hellos, per_round)))
    render_instructions.child("render", 1, workload)
    applied, imported_from = capsys.readouterr().out.splitlines()
    sent = rounds * render_instructions.SCRAPE_SECONDS // 10 * 10  # the steps after the last tenth wait in the client
    assert applied == f"steps applied: {4 * sent}"
    assert Path(imported_from) == render_instructions.ROOT


def test_gzip_cost_checks_and_times_every_writer_on_one_page():
    """benchmarks/gzip_cost.py at tiny sizes: each writer's gzip gave the page back (else it exits non-zero), and each
    is reported beside zlib's."""
    command = [sys.executable, str(BENCHMARKS / "gzip_cost.py"), "--repeats", "2", "--ranks", "4"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("machine: ") and "after" in result.stdout.splitlines()[0]
    assert "page: 4 ranks' telemetry families" in result.stdout
    assert "zlib level 1" in result.stdout and "ISA-L level 1" in result.stdout


def test_scrape_pair_measures_both_arms_side_by_side():
    """benchmarks/scrape_pair.py at tiny sizes: both arms measured in the run, and their ratio (not its value)."""
    command = [sys.executable, str(BENCHMARKS / "scrape_pair.py"), "--runs", "1", "--every", "2", "--apart", "0.5",
               "--cycles", "1", "--warmup", "3"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("machine: ") and "load average after" in result.stdout
    assert "run 1, two addresses (each server's rhythm): agent proper" in result.stdout
    assert "run 1, one address (one rhythm): agent proper" in result.stdout
    assert "ratio one address / two, same run: " in result.stdout


def test_hang_latency_names_the_culprit_through_every_source(tmp_path):
    """benchmarks/hang_latency.py, one run per fault: the agents, Prometheus and the run log all name the rank
    (how fast is the benchmark's to say, not this test's: its sources are polled every second, not every 0.25 s,
    each poll a `gpuwatch diagnose` process of ~0.3 s of CPU)."""
    require_tool("prometheus")
    for fault in hang_latency.EXPECTED:
        results = hang_latency.measure(fault, 1, tmp_path / fault, poll_seconds=1.0)
        assert {source: len(values) for source, values in results.items()} == dict.fromkeys(results, 1), fault
        assert all(value >= 0 for values in results.values() for value in values)


def test_false_alarms_plan_cycles_the_scripts_then_every_framework_job_under_gpuwatch_run():
    """The healthy runs' plan: the user scripts at 1-4 ranks as before, then the framework jobs of
    tests/test_frameworks.py, each variant in turn with its own arguments, 2 ranks, under ``gpuwatch run``."""
    jobs = false_alarms.plan(runs=12, framework_runs=2 * len(false_alarms.VARIANTS), steps=7)
    scripts, frameworks = jobs[:12], jobs[12:]
    assert {(w.script, w.nproc) for _, w in scripts} == {(s, r) for s in foreign.SCRIPTS for r in (1, 2, 3, 4)}
    assert all(w.wrapper == () for _, w in scripts)
    assert [name for name, _ in frameworks] == [*false_alarms.VARIANTS] * 2
    for name, workload in frameworks:
        script, args = false_alarms.VARIANTS[name]
        assert (workload.script, workload.args, workload.nproc) == (script, args, 2)
        assert workload.wrapper == foreign.GPUWATCH_RUN and workload.steps == 7
    assert len({w.job for _, w in jobs}) == len(jobs)  # every run its own job


def test_false_alarms_judges_a_framework_job_through_every_source():
    """benchmarks/false_alarms.py at its smallest: one user-script run and one framework job (the Hugging Face
    Trainer, first of the variants), each judged by the agent, the run log and Prometheus (what they said is the
    benchmark's to report, not this test's)."""
    require_tool("prometheus")
    command = [sys.executable, str(BENCHMARKS / "false_alarms.py"), "--runs", "1", "--framework-runs", "1",
               "--steps", "6", "--latency-repeats", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.startswith("machine: ") and "load average after" in out
    assert "RUN FAILED" not in out, out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and "%)" in line}
    for workload in ("ddp_tutorial", "hf_trainer"):
        assert rows[workload].count("/1 (") == len(false_alarms.SOURCES), out  # judged once by each source
    assert "all framework jobs" in out and "per rule (runs it fired on):" in out
    assert "hf_trainer 2r" in out  # its ranks' noise, from the run log


def test_framework_cost_times_both_arms_of_a_round():
    """benchmarks/framework_cost.py at its smallest: one round of the Hugging Face job unmeasured and under
    ``gpuwatch run`` (which must have measured every rank's every step, else the script fails), both arms timed
    and their ratios printed; not their values."""
    command = [sys.executable, str(BENCHMARKS / "framework_cost.py"), "--rounds", "1", "--steps", "4", "--warmup",
               "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.startswith("machine: ") and "transformers " in out.splitlines()[0]
    assert "load average before" in out and "load average after" in out
    assert "round 1   off then on" in out
    assert "whole job (wall), min / median / max: off " in out and "ratio of the medians" in out
    assert "training (the job's train_runtime)" in out


def test_the_agent_cost_gate_refuses_a_workload_other_than_its_baselines():
    result = subprocess.run([sys.executable, str(BENCHMARKS / "render_instructions.py"), "--gate", "--ranks", "8"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--gate compares with a baseline of 64 ranks and 6 rounds" in result.stderr
