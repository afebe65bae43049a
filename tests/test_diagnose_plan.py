"""The PLAN rules on facts whose timings are injected: a job measured exactly as its plan predicts is quiet, and a
fault planted into each term of the step (compute, each group's exposed collectives, the phases the plan does not
model) or into a stage's memory is named, with its term. The prediction the facts are built from is the planner's
own (gpuwatch.plan.planner.predict) for the cluster the rules must infer: the ranks' H100s at the default
efficiency, eight to a node, or a calibration."""

from __future__ import annotations

import dataclasses

import pytest
from diagnose_facts import facts, gpu, node, rank, window

from gpuwatch.diagnosis import engine
from gpuwatch.diagnosis.facts import Facts, StepFacts, Workload
from gpuwatch.diagnosis.rules.plan import GROUP_NAMES, UNMODELLED
from gpuwatch.plan.gpus import Calibration, Cluster, preset
from gpuwatch.plan.model import ModelShape, from_record, from_reference
from gpuwatch.plan.planner import Prediction, predict
from gpuwatch.plan.run import Layout, Run, numerics
from gpuwatch.protocol.records import GroupTotals, Hello, ModelShapeFields
from gpuwatch.protocol.schema import SCHEMA_VERSION, decode, encode
from gpuwatch.trainer.config import ModelConfig

SHAPE = ModelShape(layers=8, hidden=2048, heads=16, kv_heads=16, ffn=8192, vocab=32000)
WORK = Workload(SHAPE.as_record(), global_batch=64, seq_len=2048)
LAYOUT = Layout(tp=2, pp=2, dp=2, micro_batches=8, schedule="1f1b")
RUN = Run(WORK.global_batch, WORK.seq_len, numerics("bf16"))


def expected(cluster: Cluster | None = None) -> Prediction:
    return predict(SHAPE, cluster or Cluster(8, 8, preset("h100-80gb")), RUN, LAYOUT)


def job(prediction: Prediction, *, extra: dict[str, float] | None = None, memory: dict[int, float] | None = None,
        slow_rank: int | None = 5, **nodes) -> Facts:
    """Eight ranks on one H100 node, each measured as ``prediction`` says; ``extra`` seconds added to terms of
    ``slow_rank``'s step (phase fields, or groups), of every rank's with ``slow_rank`` None; ``memory`` a stage's
    peak as a multiple of its prediction."""
    extra, memory = extra or {}, memory or {}
    slot = prediction.compute_seconds / LAYOUT.micro_batches
    groups = {"tp": prediction.exposed["tp"], "pp": prediction.exposed["pp"] + (LAYOUT.pp - 1) * slot,
              "dp": prediction.exposed["dp"]}
    ranks = []
    for number in range(8):
        added = extra if slow_rank in (number, None) else {}
        stage = number // 4
        tensors = prediction.stages[stage].memory.total - prediction.stages[stage].memory.allowance
        last = StepFacts(
            step=100, step_seconds=prediction.step_seconds + sum(added.values()),
            compute_seconds=prediction.compute_seconds + added.get("compute_seconds", 0.0),
            **{field: added.get(field, 0.0) for field in UNMODELLED},
            groups={name: GroupTotals(bytes=prediction.traffic_bytes[name], seconds=seconds + added.get(name, 0.0))
                    for name, seconds in groups.items()},
            memory_kind="cuda", peak_bytes=tensors * memory.get(stage, 1.0))
        ranks.append(rank(number, tp=2, pp=2, dp=2, micro_batches=LAYOUT.micro_batches, precision="bf16",
                          last=last, window=window(last), workload=WORK))
    for number, fact in enumerate(ranks):
        fact.layout = dataclasses.replace(fact.layout, schedule=LAYOUT.schedule)
        fact.gpu_index, fact.gpu_uuid = number, f"GPU-{number}"
    return facts([node(**nodes)], ranks)


def run(code: str, f: Facts) -> engine.Report:
    return engine.run(f, engine.select([code]))


def test_a_job_measured_as_its_plan_predicts_is_quiet():
    healthy = job(expected())
    for code in ("PLAN001", "PLAN002"):
        report = run(code, healthy)
        assert report.ran == [code], report.skipped
        assert report.findings == []


@pytest.mark.parametrize(("term", "named"), [
    ("compute_seconds", "compute"),
    *((group, name) for group, name in GROUP_NAMES.items()),
    *((field, name) for field, name in UNMODELLED.items()),
])
def test_a_fault_in_each_term_of_the_step_is_named_with_its_term(term, named):
    """A rank's own time on one rank (a slow GPU, its data loader, its callbacks); a group's on every member (a slow
    link: every member of a group waits for the transfer)."""
    prediction = expected()
    own = term not in GROUP_NAMES
    report = run("PLAN001", job(prediction, extra={term: prediction.step_seconds}, slow_rank=5 if own else None))
    assert [finding.code for finding in report.findings] == ["PLAN001"]
    finding = report.findings[0]
    assert finding.title.startswith(f"step 2.0× predicted in job job-1: {named} ")  # the step doubled
    assert finding.evidence[0].where.rank == (5 if own else 0)
    assert finding.evidence[1].values["term"] == named  # the largest excess first
    assert finding.evidence[1].values["measured_seconds"] == pytest.approx(
        finding.evidence[1].values["predicted_seconds"] + prediction.step_seconds)


def test_a_late_rank_is_named_as_its_compute_not_as_its_peers_wait_for_it():
    """Rank 5 computes a step longer; its DP peers wait that long for it in the gradient reduction (and it does
    not): the excess is its compute."""
    prediction = expected()
    late = job(prediction, extra={"compute_seconds": prediction.step_seconds})
    for fact in late.ranks:
        if fact.rank != 5 and fact.last is not None and fact.last.groups is not None:
            waited = fact.last.groups["dp"]
            fact.last.groups["dp"] = GroupTotals(waited.bytes, waited.seconds + prediction.step_seconds)
    assert run("PLAN001", late).findings[0].title.startswith("step 2.0× predicted in job job-1: compute ")


def test_a_step_within_the_threshold_stays_quiet_whatever_its_terms():
    prediction = expected()
    report = run("PLAN001", job(prediction, extra={"dp": 0.4 * prediction.step_seconds}, slow_rank=None))  # 1.4×
    assert report.ran == ["PLAN001"] and report.findings == []


def test_a_stage_holding_more_memory_than_planned_is_named_and_one_within_the_plan_is_not():
    report = run("PLAN002", job(expected(), memory={1: 1.3, 0: 1.05}))
    assert [(finding.code, finding.evidence[0].values["stage"]) for finding in report.findings] == [("PLAN002", 1)]
    assert "1.30× the" in report.findings[0].title


def test_without_a_preset_or_a_calibration_the_rules_say_why_they_did_not_run():
    unknown = job(expected(), gpus=[gpu(i, model="Tesla T4") for i in range(8)])
    for code in ("PLAN001", "PLAN002"):
        skipped = run(code, unknown).skipped
        assert [s.code for s in skipped] == [code]
        assert "no GPU preset for Tesla T4" in skipped[0].reason and "--calibration" in skipped[0].reason


def test_a_calibration_replaces_the_datasheet_and_judges_cpu_ranks_too():
    calibration = Calibration(matmul_flops=2e11, bus_bandwidth={"nvlink": ((1, 5e9), (2**20, 2e10))})
    prediction = expected(Cluster(8, 8, dataclasses.replace(preset("h100-80gb")), calibration=calibration))
    assert prediction.step_seconds > expected().step_seconds  # 200 GFLOP/s is far below an H100's half peak
    on_cpu = job(prediction, gpus=None)
    on_cpu.calibration = calibration
    assert run("PLAN001", on_cpu).findings == []
    slow = job(prediction, extra={"compute_seconds": prediction.step_seconds}, gpus=None)
    slow.calibration = calibration
    assert run("PLAN001", slow).findings[0].title.startswith("step 2.0× predicted in job job-1: compute ")
    not_calibrated = job(prediction, gpus=None)
    assert "ranks' GPUs are unknown" in run("PLAN001", not_calibrated).skipped[0].reason


def test_a_job_whose_hellos_do_not_say_what_it_trains_is_not_judged_and_says_so():
    anonymous = job(expected())
    for fact in anonymous.ranks:
        fact.workload = None
    skipped = run("PLAN001", anonymous).skipped
    assert "model's shape" in skipped[0].reason


def test_the_hello_carries_every_field_of_a_model_shape_and_reads_back_the_same_shape():
    """The planner's ModelShape is the hello's record (protocol.records.ModelShapeFields) with defaults: a shape sent
    in a hello, defaults included, decodes back to the same shape."""
    for shape in (SHAPE, from_reference(ModelConfig()),
                  ModelShape(layers=2, hidden=64, heads=8, kv_heads=2, ffn=96, vocab=100, tied_embeddings=True,
                             source="hf")):
        assert from_record(decode_hello_model(shape.as_record().as_dict())) == shape


def decode_hello_model(body: dict) -> ModelShapeFields:
    """The model as an agent or a run log reads it from a hello: through the schema's own decoder."""
    hello = {"v": SCHEMA_VERSION, "kind": "hello", "job": "j", "rank": 0, "time": 1.0, "local_rank": 0,
             "world_size": 1, "tp_size": 1, "pp_size": 1, "dp_size": 1, "tp_rank": 0, "pp_stage": 0, "dp_rank": 0,
             "hostname": "h", "pid": 1, "model": body, "global_batch": 8, "seq_len": 16}
    decoded = decode(encode(hello)).body
    assert isinstance(decoded, Hello) and decoded.model is not None
    return decoded.model
