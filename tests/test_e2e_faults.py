"""End to end: each fault switch of the reference trainer, run for real (forked gloo ranks, `gpuwatch train`)
with its telemetry going to a real agent (`--simulate dgx-h100`), then `gpuwatch diagnose --agent URL`
names the cause with the right evidence, and nothing else at warning level or worse. A healthy run of
the same shape stays quiet.

Runs are short (10 steps of a tiny model, tp1 × pp2 × dp2 where tensor parallelism plays no part) and share
one agent; each run has its own job id, and only that job's findings are judged. The CI machine has two
CPUs, so four ranks oversubscribe it: the diagnosis knows (the agent reports the node's CPUs) and asks
more of a straggler there (3x its peers' busy time), and the slow rank computes 8x.
"""

import json
import statistics

import pytest
from click.testing import CliRunner

from gpuwatch.agent.telemetry.window import PHASE_TIMINGS
from gpuwatch.diagnosis.cli import diagnose
from gpuwatch.diagnosis.rules.performance import micro_batches_for
from gpuwatch.trainer.cli import train

from conftest import AgentProcess, wait_until

pytestmark = pytest.mark.integration

SHAPE = ("--tp", "1", "--pp", "2", "--dp", "2")
STEPS = 10  # the gradient similarity and the replica checksum are measured at step 10 (every 10 by default)
SERIOUS = {"warning", "critical"}


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    agent = AgentProcess("--simulate", "dgx-h100", "--interval", "0.2",
                         telemetry_socket=tmp_path_factory.mktemp("agent") / "telemetry.sock")
    yield agent
    agent.stop()


def _ranks(agent: AgentProcess, job: str) -> list[dict]:
    return [r for r in agent.state()["facts"].get("telemetry", {}).get("ranks", ()) if r["job"] == job]


def run(agent: AgentProcess, job: str, *args: str, steps: int = STEPS, world: int = 4) -> list[dict]:
    """`gpuwatch train` with `args`, reporting to `agent` as `job`; returns the job's ranks once the agent
    has every rank's last step."""
    result = CliRunner().invoke(train, [*args, "--steps", str(steps), "--job", job,
                                        "--telemetry-socket", str(agent.telemetry_socket)])
    assert result.exit_code == 0, result.output
    wait_until(lambda: len(ranks := _ranks(agent, job)) == world
               and all((r.get("last_step") or {}).get("step") == steps for r in ranks), timeout=10,
               what=f"the agent to have job {job}'s last step")
    return sorted(_ranks(agent, job), key=lambda r: r["rank"])


def findings(job: str, *source: str) -> list[dict]:
    """`gpuwatch diagnose --format json` on `source`: the findings about `job`."""
    result = CliRunner().invoke(diagnose, [*source, "--format", "json", "--fail-on", "never"])
    assert result.exit_code == 0, result.output
    return [f for f in json.loads(result.output)["findings"]
            if any(e["where"].get("job") == job for e in f["evidence"])]


def serious(found: list[dict]) -> dict[str, list[dict]]:
    """Warning and critical findings by rule code."""
    by_code: dict[str, list[dict]] = {}
    for finding in found:
        if finding["severity"] in SERIOUS:
            by_code.setdefault(finding["code"], []).append(finding)
    return by_code


def by_rank(finding: dict) -> dict[int, dict]:
    return {e["where"]["rank"]: e["values"] for e in finding["evidence"] if "rank" in e["where"]}


@pytest.mark.parametrize(("shape", "micro_batches"), [
    (SHAPE, 8),  # the default: m ≥ 4p keeps the theoretical bubble at 11 %
    (("--tp", "1", "--pp", "4", "--dp", "1", "--micro-batches", "16"), 16),  # 16 %
], ids=["pp2-dp2", "pp4"])
def test_a_healthy_run_is_quiet(agent, shape, micro_batches):
    job = f"healthy-pp{shape[3]}"
    ranks = run(agent, job, *shape)
    assert all(r["hello"]["faults"] == [] and r["hello"]["micro_batches"] == micro_batches for r in ranks)
    assert serious(findings(job, "--agent", agent.url)) == {}


def test_slow_rank_is_named_from_its_busy_time_with_its_extra_time_in_compute(agent):
    ranks = run(agent, "slow-rank", *SHAPE, "--fault", "slow-rank", "--fault-rank", "2")
    assert all(r["hello"]["faults"] == ["slow-rank"] for r in ranks)
    found = serious(findings("slow-rank", "--agent", agent.url))
    assert set(found) == {"PERF002"}, found
    (straggler,) = found["PERF002"]
    slow = by_rank(straggler)
    assert set(slow) == {2}  # stage 1, whose other rank is rank 3
    assert slow[2]["ratio"] >= 3, straggler  # faults.SLOWDOWN is 8; 4 ranks on 2 CPUs: 3x is the bar
    # judged over the window of the last steps: its peer's median busy time there (each step's phases summed, less
    # its wait for a CPU but never below its time on one), and the window's size; the extra is in its forward and
    # backward
    def busy(point: dict) -> float:
        phases = sum(point[field] for field in PHASE_TIMINGS if field in point)
        if "cpu_wait_seconds" not in point:
            return phases
        return max(phases - point["cpu_wait_seconds"], min(phases, point["cpu_seconds"]))

    assert slow[2]["median_seconds"] == pytest.approx(statistics.median(map(busy, ranks[3]["window"])))
    assert slow[2]["window_steps"] == STEPS
    assert slow[2]["phase"] == "compute" and "HW005" in straggler["fix"]


def test_duplicate_shards_give_identical_gradients(agent):
    run(agent, "duplicate-shards", *SHAPE, "--fault", "duplicate-shards")
    found = serious(findings("duplicate-shards", "--agent", agent.url))
    assert set(found) == {"CONV004"}, found
    assert len(found["CONV004"]) == 2  # both DP groups: ranks 0-1 (stage 0) and 2-3 (stage 1)
    cosines = {rank: values["grad_cosine_similarity"] for f in found["CONV004"] for rank, values in by_rank(f).items()}
    assert set(cosines) == {0, 1, 2, 3}
    assert min(cosines.values()) > 0.99999


def test_desync_shows_as_replicas_with_different_checksums(agent):
    run(agent, "desync", *SHAPE, "--fault", "desync")
    found = serious(findings("desync", "--agent", agent.url))
    assert set(found) == {"CONV003"}, found
    for finding in found["CONV003"]:  # one per DP group: the last replica (dp 1) differs from dp 0
        checksums = by_rank(finding)
        (first, last) = sorted(checksums)
        assert checksums[last]["dp_rank"] == 1 and checksums[first]["checksum"] != checksums[last]["checksum"]
        assert f"at step {STEPS}" in finding["title"]
    assert len(found["CONV003"]) == 2


def test_lr_explode_makes_the_gradient_norm_explode(agent):
    run(agent, "lr-explode", *SHAPE, "--fault", "lr-explode")
    found = serious(findings("lr-explode", "--agent", agent.url))
    assert set(found) == {"CONV002"}, found
    norms = by_rank(found["CONV002"][0])
    assert set(norms) == {0, 1, 2, 3} and all(v["grad_norm"] > 100 and v["step"] == STEPS for v in norms.values())


def test_a_run_log_finds_the_first_explosion_after_the_job(agent, tmp_path):
    """After the job: `gpuwatch train --run-log DIR` kept every step, so the first explosion is found. Two
    tensor-parallel ranks: a run log does not tell the node's CPUs, and on a CPU-starved machine a pipeline
    idles and a tiny model's data-parallel all-reduce outlasts its compute for real (PERF001, PERF004)."""
    run(agent, "lr-explode-log", "--tp", "2", "--pp", "1", "--dp", "1", "--fault", "lr-explode", "--run-log",
        str(tmp_path), world=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-00000.jsonl", "rank-00001.jsonl"]
    found = serious(findings("lr-explode-log", "--run-log", str(tmp_path)))
    assert set(found) == {"CONV002"}, found
    first = by_rank(found["CONV002"][0])
    assert set(first) == {0, 1} and all(v["grad_norm"] > 100 and v["step"] <= 4 for v in first.values()), first


def test_fp16_without_a_scaler_turns_the_loss_nan(agent):
    ranks = run(agent, "fp16-no-scaler", *SHAPE, "--precision", "fp16", "--fault", "fp16-no-scaler")
    assert {r["hello"]["precision"] for r in ranks} == {"fp16"}
    assert all("loss_scale" not in r["last_step"] for r in ranks)
    found = serious(findings("fp16-no-scaler", "--agent", agent.url))
    assert set(found) == {"CONV001"}, found
    (nan,) = found["CONV001"]
    assert "fp16 without a loss scaler" in nan["title"] and "GradScaler" in nan["fix"]
    evidence = by_rank(nan)
    assert set(evidence) == {0, 1, 2, 3}
    assert all(v["precision"] == "fp16" and v["nonfinite_steps"] == STEPS for v in evidence.values())


def test_shared_pp_dp_group_is_seen_in_the_reported_groups(agent):
    ranks = run(agent, "shared-group", *SHAPE, "--fault", "shared-pp-dp-group")
    assert all(r["hello"]["process_groups"]["pp"] == r["hello"]["process_groups"]["dp"] == [0, 1, 2, 3]
               for r in ranks)
    found = serious(findings("shared-group", "--agent", agent.url))
    assert set(found) == {"TOPO001"}, found
    groups = by_rank(found["TOPO001"][0])
    assert groups == {rank: {"pp_group": "0-3", "dp_group": "0-3"} for rank in range(4)}


def test_too_few_micro_batches_leave_a_measured_bubble(agent):
    run(agent, "pp4-m1", "--tp", "1", "--pp", "4", "--dp", "1", "--micro-batches", "1")
    found = serious(findings("pp4-m1", "--agent", agent.url))
    assert set(found) == {"PERF001"}, found
    (bubble,) = found["PERF001"]
    job = bubble["evidence"][0]["values"]
    assert job["bubble_ratio_theoretical"] == 0.75
    assert job["bubble_ratio"] > 0.5  # measured: each stage idles while the other three work
    assert f"to at least {micro_batches_for(4, 0.2)}" in bubble["fix"]

