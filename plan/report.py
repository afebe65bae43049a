"""A plan as JSON (the schema docs/plan.md documents, ``SCHEMA`` naming its version) and as text for a terminal.

The JSON lists every feasible layout and every rejected one; the text shows the ``top`` fastest with their memory,
and the rejections a grid at a time (every variant of a grid that does not fit, by its closest miss).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict
from typing import Any

import msgspec

from gpuwatch.plan import calibrate
from gpuwatch.plan.comm import GROUPS
from gpuwatch.plan.gpus import GEMM_EFFICIENCY, GIB, Cluster
from gpuwatch.plan.planner import Plan, Prediction, Rejection
from gpuwatch.plan.run import MIN_CONTEXT_TOKENS
from gpuwatch.protocol.calibration import Calibration

SCHEMA = "gpuwatch.plan/1"
#: The assumptions every figure rests on, said in the output itself (docs/plan.md gives the sources).
ASSUMPTIONS = {
    "bubble": "the share of the step the pipeline idles: (p - 1)/(m + p - 1) GPipe and 1F1B, (p - 1)/(v m + p - 1) "
              "interleaved 1F1B with v virtual stages (Narayanan et al. 2021), 0 ZB-V with m >= p (Qi et al. 2024)",
    "attention": "flash attention (Dao et al. 2022) unless --no-flash-attention: no s x s scores kept, the backward "
                 "recomputes QK^T (2sh FLOPs a token and layer)",
    "compute": "the shape model unless --efficiency or --calibration: each matmul on the roofline at the GEMM "
               "efficiency of the peak, elementwise work at the HBM bandwidth",
    "pipeline sends": "1/t of the activation per TP rank with sequence parallelism, or between nodes with "
                      "--pp-scatter-gather (one NIC per GPU assumed; Narayanan et al. 2021 section 4.1)",
    "flops": "Narayanan et al. 2021: per token 3 passes x (2 FLOPs per matmul weight + 4sh attention per layer + "
             "2hV head); model FLOPs without recomputation, hardware FLOPs with it",
    "step": "(m + p - 1) slots of the slowest stage's micro-batch (compute + TP collectives, never overlapped) + "
            "pipeline sends (not overlapped) + the DP reduction (after the backward pass, or overlapped with the "
            "last micro-batch's backward pass but its last bucket with --dp-overlap)",
    "memory": "the heaviest pipeline stage's rank; activations after Korthikanti et al. 2022, over the rank's 1/cp of "
              "each sequence",
    "context parallel": "ring attention (Liu et al. 2023): each rank receives the other cp - 1 ranks' keys and values "
                        "per layer, 3 passes' worth, overlapped with the attention over the chunk before; searched "
                        f"where a rank keeps at least {MIN_CONTEXT_TOKENS} tokens of a sequence",
    "communication": "bytes each rank hands its collectives per step (the heaviest rank per group); seconds on the "
                     "link the group crosses at the nccl-tests bus bandwidth",
}


def prediction_json(rank: int, prediction: Prediction) -> dict[str, Any]:
    seconds = {group: max(stage.traffic.seconds_by_group()[group] for stage in prediction.stages)
               for group in GROUPS}
    return {
        "rank": rank,
        "layout": {**asdict(prediction.layout), "micro_batch_size": prediction.micro_batch_size},
        "step_seconds": prediction.step_seconds,
        "compute_seconds": prediction.compute_seconds,
        "bubble": prediction.bubble,
        "mfu": prediction.mfu,
        "model_flops": prediction.model_flops,
        "communication": {group: {"bytes": prediction.traffic_bytes[group], "seconds": seconds[group],
                                  "exposed_seconds": prediction.exposed[group]} for group in GROUPS},
        "comm_compute_ratio": prediction.comm_compute_ratio,
        "parts_seconds": prediction.parts,
        "bound": prediction.bound,
        "memory": {"stage": prediction.heaviest, **prediction.memory.as_dict()},
    }


def rejection_json(rejection: Rejection) -> dict[str, Any]:
    return {"layout": asdict(rejection.layout), "code": rejection.code, "reason": rejection.reason,
            "over_bytes": rejection.over_bytes}


def as_json(plan: Plan, top: int | None = None) -> dict[str, Any]:
    """The whole plan: inputs, assumptions, the ``top`` fastest feasible layouts (all by default), every
    rejection."""
    gpu = plan.cluster.gpu
    shown = plan.feasible if top is None else plan.feasible[:top]
    return {
        "schema": SCHEMA,
        "model": {**msgspec.structs.asdict(plan.shape), "parameters": plan.shape.total_parameters()},
        "cluster": {"gpus": plan.cluster.gpus, "gpus_per_node": plan.cluster.gpus_per_node,
                    "nvlink_domain": plan.cluster.domain, "gpu": gpu.name,
                    "memory_bytes": gpu.memory_bytes, "peak_flops": dict(gpu.peak_flops),
                    "bus_bandwidth": dict(gpu.bus_bandwidth), "efficiency": plan.cluster.efficiency,
                    "sources": list(gpu.sources), "calibration": calibration_json(plan.cluster.calibration)},
        "run": asdict(plan.run),
        "assumptions": ASSUMPTIONS,
        "feasible_count": len(plan.feasible),
        "feasible": [prediction_json(rank, prediction) for rank, prediction in enumerate(shown, 1)],
        "rejected": [rejection_json(rejection) for rejection in plan.rejected],
    }


def calibration_json(calibration: Calibration) -> dict[str, Any] | None:
    """The measured figures the plan used (gpuwatch.calibration/1's fields but its schema), or None."""
    if calibration == Calibration():
        return None
    document = calibrate.as_json(calibration)
    del document["schema"]
    return document


def matmul_speed(cluster: Cluster) -> str:
    calibration = cluster.calibration
    if calibration.flops_by_work:
        rates = [rate for _, rate in calibration.flops_by_work]
        return f"matmuls at {min(rates) / 1e12:.3g}-{max(rates) / 1e12:.3g} TFLOP/s measured by size"
    if calibration.matmul_flops is not None:
        return f"matmuls at {calibration.matmul_flops / 1e12:.3g} TFLOP/s measured"
    if cluster.efficiency is None:
        return (f"matmuls on the roofline at {GEMM_EFFICIENCY:.0%} of peak, elementwise at "
                f"{cluster.gpu.memory_bandwidth / 1e12:.2f} TB/s")
    return f"matmuls at {cluster.efficiency:.0%} of peak"


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def as_text(plan: Plan, top: int) -> str:
    shape, cluster, run = plan.shape, plan.cluster, plan.run
    lines = [
        f"model: {shape.total_parameters() / 1e9:.2f} B parameters, {shape.layers} layers, hidden {shape.hidden}, "
        f"{shape.heads} heads ({shape.kv_heads} kv), ffn {shape.ffn}, vocabulary {shape.vocab} ({shape.source})",
        f"cluster: {cluster.gpus} × {cluster.gpu.name} ({cluster.gpus_per_node} a node"
        + (f", NVLink domains of {cluster.domain}" if cluster.domain != min(cluster.gpus, cluster.gpus_per_node)
           else "") + "), "
        f"{_gib(cluster.gpu.memory_bytes)} GiB each, {matmul_speed(cluster)}",
        f"run: global batch {run.global_batch} × {run.seq_len} tokens, {run.numerics.precision}, "
        f"sequence parallel {'on' if run.sequence_parallel else 'off'}, flash attention "
        f"{'on' if run.flash_attention else 'off'}",
        f"{len(plan.feasible)} feasible layouts, {len(plan.rejected)} rejected; the {min(top, len(plan.feasible))} "
        "fastest (memory of the heaviest stage's rank, GiB; bytes a rank sends per step, GB, and exposed seconds; what "
        "takes most of the step: compute, the bubble, or a group's exposed collectives):",
        f"{'#':>3}  {'layout':<54} {'mbs':>4} {'step s':>8} {'MFU':>6} {'bubble':>6} {'mem':>6}  "
        f"{'TP GB/s':>13} {'CP GB/s':>13} {'PP GB/s':>13} {'DP GB/s':>13} {'comm/comp':>9} {'bound':>7}",
    ]
    for rank, p in enumerate(plan.feasible[:top], 1):
        comm = "  ".join(f"{p.traffic_bytes[g] / 1e9:6.2f}/{p.exposed[g]:6.3f}" for g in GROUPS)
        lines.append(f"{rank:>3}  {p.layout.name:<54} {p.micro_batch_size:>4} {p.step_seconds:>8.3f} "
                     f"{p.mfu:>6.1%} {p.bubble:>6.1%} {_gib(p.memory.total):>6}  {comm} {p.comm_compute_ratio:>9.2f} "
                     f"{p.bound:>7}")
        memory = p.memory
        lines.append(f"     stage {p.heaviest}: parameters {_gib(memory.parameters)}, gradients "
                     f"{_gib(memory.gradients)}, optimizer {_gib(memory.optimizer)}, activations "
                     f"{_gib(memory.activations)}, embeddings/logits {_gib(memory.embeddings_logits)}, allowance "
                     f"{_gib(memory.allowance)}")
    lines += ["rejected:", *rejected_text(plan.rejected)]
    return "\n".join(lines)


def rejected_text(rejected: tuple[Rejection, ...]) -> list[str]:
    """Structural rejections one line each; out-of-memory variants one line a grid, with the closest miss."""
    lines = []
    memory: dict[str, list[Rejection]] = defaultdict(list)
    for rejection in rejected:
        if rejection.over_bytes is None:
            lines.append(f"  {rejection.layout.grid}: {rejection.reason}")
        else:
            memory[rejection.layout.grid].append(rejection)
    for grid, misses in memory.items():
        closest = min(misses, key=lambda rejection: rejection.over_bytes or 0.0)
        lines.append(f"  {grid}: {len(misses)} variants out of memory, the closest ({closest.layout.name}) "
                     f"{closest.reason}")
    return lines
