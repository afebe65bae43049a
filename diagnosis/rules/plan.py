"""Plan: the running job against what `gpuwatch plan` predicts for its model, layout and cluster.

A job whose hellos carry its model's shape and batch (``RankFacts.workload``: the reference trainer's do) is
predicted by the planner (gpuwatch.plan) with the GPUs it runs on: a calibration (``--calibration``, this cluster's
measured matmul throughput and bus bandwidths) or, without one, the datasheet preset of the ranks' GPUs (NVML's
name) at the planner's default efficiency. The rules compare the measured step with the prediction term by term and
name the term that deviates most, so that a slow job is told where its time went against where it should go.

The terms sum to the predicted step (gpuwatch.plan.planner): compute (the slowest stage's forward and backward),
the exposed TP collectives, the pipeline's wait (its point-to-point transfers and the schedule's idle slots: p − 1
for GPipe and 1F1B, (p − 1)/v interleaved, none zero-bubble, which the hooks see as time waited in receives), the
exposed DP gradient reduction, and the phases the plan does not model and so predicts none of (data wait, optimizer,
outside the model).
"""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from gpuwatch.diagnosis import needs
from gpuwatch.diagnosis.coverage import WholeJob
from gpuwatch.diagnosis.facts import Facts, RankFacts, Where, describe_ranks, gib
from gpuwatch.diagnosis.registry import Evidence, Issue, Need, Severity, Threshold, rule
from gpuwatch.diagnosis.rules.common import window_text, windowed
from gpuwatch.plan.calibrate import LINKS
from gpuwatch.plan.gpus import DEFAULT_EFFICIENCY, Cluster, GpuSpec, preset_for
from gpuwatch.plan.model import ModelError, from_record
from gpuwatch.plan.planner import Prediction, predict
from gpuwatch.plan.run import INTERLEAVED, PRECISIONS, SCHEDULES, Layout, Run, RunError, numerics

FAMILY = "plan"

#: The step's phases the plan does not model, by the name evidence gives them: it predicts none of their time.
UNMODELLED = {"dataloader_wait_seconds": "data wait", "optimizer_seconds": "optimizer",
              "outside_model_seconds": "outside the model"}
#: The process groups whose exposed time the plan predicts, by the hello's names, as evidence names them.
GROUP_NAMES = {"tp": "TP collectives", "pp": "pipeline wait (transfers and bubble)", "dp": "DP gradient reduction"}


@dataclass(frozen=True)
class Term:
    """One part of the step: its seconds measured (`terms` says on which rank) and predicted."""

    name: str
    measured: float
    predicted: float

    @property
    def excess(self) -> float:
        return self.measured - self.predicted


@dataclass(frozen=True)
class JobPlan:
    """A job's prediction, and the basis of the figures it was predicted with (what evidence says it assumed)."""

    job: str
    ranks: list[RankFacts]
    prediction: Prediction
    basis: str


def cluster_for(facts: Facts, ranks: list[RankFacts]) -> tuple[Cluster, str] | str:
    """The cluster a job runs on, as the planner takes it, and the basis of its figures; else why there is none."""
    world = ranks[0].layout.world_size if ranks[0].layout else len(ranks)
    per_node = max(Counter(rank.host for rank in ranks).values())
    gpus = [(gpu.model, gpu.memory_total_bytes) for rank in ranks
            if (gpu := facts.gpu_of(rank)) is not None and gpu.model is not None]
    spec = preset_for(*gpus[0]) if gpus else None
    calibration = facts.calibration
    if calibration is not None:
        timed = ranks[0].layout.precision if ranks[0].layout else None
        if calibration.precision is not None and timed is not None and calibration.precision != timed:
            return (f"the calibration timed its matmuls in {calibration.precision}, and the job trains in {timed}: "
                    f"calibrate again with --precision {timed}")
        flops = calibration.matmul_flops or max((rate for _, rate in calibration.flops_by_work), default=None)
        if flops is not None:
            if spec is None:  # the CPU, or a GPU without a preset: the calibration's figures stand for one
                measured = {link: points[-1][1] for link, points in calibration.bus_bandwidth.items() if points}
                if not measured:
                    return "the calibration has no bus bandwidth (calibrate with --probe) and the GPUs no preset"
                spec = GpuSpec("calibrated", 0, dict.fromkeys(PRECISIONS, flops),
                               {link: measured.get(link, min(measured.values())) for link in LINKS}, ())
            return Cluster(world, per_node, spec, calibration=calibration), "the calibration given (--calibration)"
    if spec is None:
        seen = sorted({model for model, _ in gpus})
        return ("no figures to predict with: " + (f"no GPU preset for {', '.join(seen)}" if seen else
                "the ranks' GPUs are unknown (CPU ranks, or no NVML facts)") +
                "; give --calibration (gpuwatch calibrate)")
    return (Cluster(world, per_node, spec),
            f"the {spec.name} datasheet at {DEFAULT_EFFICIENCY:.0%} of its peak FLOP/s")


def job_plans(facts: Facts) -> Iterator[JobPlan | tuple[str, str]]:
    """Each job that says what it trains, predicted; or (job, why not) for one the planner cannot predict."""
    for job, ranks in facts.jobs().items():
        described = [rank for rank in ranks if rank.workload is not None and rank.layout is not None]
        if not described:
            continue
        first = described[0]
        assert first.workload is not None and first.layout is not None
        work, place = first.workload, first.layout
        found = cluster_for(facts, ranks)
        if isinstance(found, str):
            yield job, found
            continue
        cluster, basis = found
        try:
            shape = from_record(work.model)
            run = Run(work.global_batch, work.seq_len,
                      numerics(place.precision or "fp32", reference=shape.source == "reference"),
                      sequence_parallel=shape.source != "reference")
        except (ModelError, RunError) as error:
            yield job, f"its hello's model cannot be planned: {error}"
            continue
        schedule = place.schedule if place.schedule in SCHEDULES else SCHEDULES[0]
        layout = Layout(place.tp_size, place.pp_size, place.dp_size, place.micro_batches or 1, schedule,
                        virtual_stages=place.virtual_stages or 1 if schedule == INTERLEAVED else 1)
        yield JobPlan(job, ranks, predict(shape, cluster, run, layout), basis)


def _predictable(facts: Facts) -> str | None:
    """A job the planner can predict, else why none is (each job that says what it trains, and why not)."""
    reasons = []
    for plan in job_plans(facts):
        if not isinstance(plan, tuple):
            return None
        reasons.append(f"job {plan[0]}: {plan[1]}")
    return "; ".join(reasons) or None  # no job says what it trains: WORKLOAD says so


PREDICTABLE = Need("figures to predict the step with (a calibration or a GPU preset)", _predictable)


def terms(plan: JobPlan) -> list[Term]:
    """The step's terms against the prediction's. A rank's own time (compute, the unmodelled phases) is the job's
    worst rank's window median; a group's exposed collectives are the latest step's of the rank that waited least on
    it: every member waits for the last to arrive, so the least-waiting member's time is the transfer's (plus the
    schedule's idle slots, for the pipeline), and a late peer shows as its compute, not as the others' wait."""
    prediction, ranks = plan.prediction, plan.ranks
    layout = prediction.layout
    # the schedule's idle slots: a bubble b of the step is compute × b/(1 − b), (p − 1) slots for GPipe and 1F1B
    idle = prediction.compute_seconds * prediction.bubble / (1 - prediction.bubble)
    predicted = {"tp": prediction.exposed["tp"], "pp": prediction.exposed["pp"] + idle, "dp": prediction.exposed["dp"]}
    found = [Term("compute", _most([windowed(rank, "compute_seconds") for rank in ranks]),
                  prediction.compute_seconds)]
    for group, name in GROUP_NAMES.items():
        if getattr(layout, group) == 1:
            continue
        waited = [totals.seconds for rank in ranks if rank.last is not None and rank.last.groups
                  and (totals := rank.last.groups.get(group)) is not None]
        found.append(Term(name, min(waited, default=0.0), predicted[group]))
    found += [Term(name, _most([windowed(rank, field) for rank in ranks]), 0.0) for field, name in UNMODELLED.items()]
    return found


def _most(values: list[float | None]) -> float:
    return max((value for value in values if value is not None), default=0.0)


@rule("PLAN001", family=FAMILY, severity=Severity.WARNING, title="Step slower than the plan predicts",
      needs=(needs.WORKLOAD, PREDICTABLE, needs.STEP_TIME),
      thresholds={"max_step_ratio": Threshold(
          1.5, "planners that model the step as the planner does (compute at the achieved FLOP/s, collectives on "
               "their links, the pipeline's slots) predict it within 3-15 % (Proteus 3 %, vTrain 8-15 %, Lumos "
               "3.3 % on 512 H100): a step half again as long as predicted is a fault, not the model's error")},
      coverage=(WholeJob("it predicts the step from the model's shape and the layout of the whole job, which the "
                         "outlier fetch does not read"),))
def step_over_plan(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """The planner (`gpuwatch plan`) predicts a job's step from its model, layout and GPUs: compute at the
    GPUs' achieved FLOP/s, the TP collectives between a layer's matmuls, the pipeline's transfers and bubble, the
    DP gradient reduction. A job whose median step is `max_step_ratio` × the prediction or more has lost time
    somewhere the plan did not expect. The rule compares each term of the step with its prediction (a rank's own
    time on the job's slowest rank, a group's collectives on the member that waited least, so that a late peer is
    named as the compute it is and not as the others' wait for it) and names the one that exceeds it most: a DP
    reduction exposed far beyond its predicted time on a congested or mis-routed network, a slow stage's compute,
    a bubble past the schedule's, or time the plan does not model at all (data wait, the optimizer, callbacks).
    Quiet while the step holds to the plan."""
    for plan in job_plans(facts):
        if isinstance(plan, tuple):
            continue
        steps = [(value, rank) for rank in plan.ranks if (value := windowed(rank, "step_seconds")) is not None]
        if not steps:
            continue
        measured, slowest = max(steps, key=lambda pair: pair[0])
        predicted = plan.prediction.step_seconds
        ratio = measured / predicted
        if ratio < t.max_step_ratio:
            continue
        found = terms(plan)
        worst = max(found, key=lambda term: term.excess)
        title = (f"step {ratio:.1f}× predicted in job {plan.job}: {worst.name} {worst.measured:.3g} s against "
                 f"{worst.predicted:.3g} s predicted")
        evidence = [Evidence(
            f"{describe_ranks([slowest])} steps in {measured:.3g} s ({window_text(slowest)}); the plan for "
            f"{plan.prediction.layout.name} predicts {predicted:.3g} s with {plan.basis}",
            Where(job=plan.job, rank=slowest.rank),
            {"measured_seconds": measured, "predicted_seconds": predicted, "ratio": ratio})]
        evidence += [Evidence(f"{term.name}: {term.measured:.3g} s measured, {term.predicted:.3g} s "
                              "predicted" + (" (not modelled)" if term.name in UNMODELLED.values() else ""),
                              Where(job=plan.job), {"term": term.name, "measured_seconds": term.measured,
                                                    "predicted_seconds": term.predicted})
                     for term in sorted(found, key=lambda term: -term.excess)]
        yield Issue(title, tuple(evidence), fix=_FIXES.get(worst.name, _FIX_COMPUTE), reason=(
            f"{worst.name} takes {worst.excess:.3g} s a step more than the plan allows, the largest excess of the "
            "step's terms"))


_FIX_COMPUTE = ("Compare the slow stage's GPUs with their peers (PERF002 names a straggler, HW rules a throttled "
                "GPU); if every rank is slow, calibrate (gpuwatch calibrate) and plan again with --calibration.")
_FIXES = {
    GROUP_NAMES["dp"]: "Check the DP group's links (gpuwatch probe against the rating, HW003 for ports); overlap the "
                       "reduction with the backward pass (DDP buckets), or shard the optimizer (ZeRO-1) to halve "
                       "its volume.",
    GROUP_NAMES["tp"]: "Keep tensor parallelism inside a node (NVLink); check NVLink links (HW001) and NCCL's "
                       "transport (NCCL_P2P_DISABLE, NCCL_SHM_DISABLE unset).",
    GROUP_NAMES["pp"]: "Balance the stages' layers (the slowest stage sets every slot) and raise the micro-batches "
                       "per step (the bubble is (p − 1)/(m + p − 1)); check the links between stages.",
    UNMODELLED["dataloader_wait_seconds"]: "Feed the step faster: more DataLoader workers, pinned memory, "
                                           "prefetching (PERF003).",
    UNMODELLED["optimizer_seconds"]: "Use a fused or foreach optimizer (torch.optim.AdamW(fused=True)), or shard "
                                     "its states (ZeRO-1).",
    UNMODELLED["outside_model_seconds"]: "Move logging, evaluation and checkpointing off the step's critical path "
                                         "(less often, asynchronous, or on a rank of its own).",
}


@rule("PLAN002", family=FAMILY, severity=Severity.WARNING, title="Peak memory above the plan",
      needs=(needs.WORKLOAD, PREDICTABLE, needs.CUDA_MEMORY),
      thresholds={"max_memory_ratio": Threshold(
          1.10, "the plan's tensor memory is exact for parameters, gradients and optimizer states (tests hold it to "
                "what the reference trainer allocates) and follows Korthikanti et al. 2022 for activations, whose "
                "own measurements differ from their formula by under 2 %: 10 % above it is memory the plan does "
                "not know of")},
      coverage=(WholeJob("it predicts each stage's memory from the model's shape and the layout of the whole "
                         "job, which the outlier fetch does not read"),))
def memory_over_plan(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """The planner predicts each pipeline stage's tensors: parameters, gradients and optimizer states (exact for
    the layout), the activations its schedule keeps in flight (Korthikanti et al. 2022; GPipe all m micro-batches,
    1F1B p − k on stage k), and the edge stages' embeddings and logits. A rank whose CUDA allocator peaked at
    `max_memory_ratio` × its stage's prediction or more holds memory the plan does not know of: activations kept
    longer than the schedule needs (a reference to the loss or the outputs held across micro-batches), more
    micro-batches in flight, extra copies of the parameters or states. The allowance for the CUDA context, NCCL and
    fragmentation is left out of the comparison: the allocator's peak counts tensors only."""
    for plan in job_plans(facts):
        if isinstance(plan, tuple):
            continue
        for stage in plan.prediction.stages:
            memory = stage.memory
            predicted = memory.total - memory.allowance
            peaks = [(rank.last.peak_bytes, rank) for rank in plan.ranks
                     if rank.layout is not None and rank.layout.pp_stage == stage.index and rank.last is not None
                     and rank.last.memory_kind == "cuda" and rank.last.peak_bytes is not None]
            if not peaks:
                continue
            peak, heaviest = max(peaks, key=lambda pair: pair[0])
            if peak < t.max_memory_ratio * predicted:
                continue
            parts = ", ".join(f"{name} {gib(value)}" for name, value in memory.as_dict().items()
                              if name not in ("allowance", "total"))
            yield Issue(
                f"{describe_ranks([heaviest])} of job {plan.job} (stage {stage.index}) peaks at {gib(peak)}, "
                f"{peak / predicted:.2f}× the {gib(predicted)} its plan predicts",
                (Evidence(f"CUDA allocator peak {gib(peak)}; predicted tensors for stage {stage.index} of "
                          f"{plan.prediction.layout.name}: {parts}", heaviest.where,
                          {"peak_bytes": peak, "predicted_bytes": predicted, "stage": stage.index}),),
                fix="Look for tensors kept beyond their use (torch.cuda.memory_snapshot() at the peak): outputs or "
                    "losses held across micro-batches, a second copy of the parameters or optimizer states; with "
                    "the layout's prediction as the budget, plan again (gpuwatch plan) if the model changed.",
                reason=f"{gib(peak - predicted)} above the prediction, which counts every tensor the layout needs")
