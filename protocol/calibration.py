"""A cluster's measured figures (`gpuwatch calibrate`'s file): what the planner predicts with instead of a datasheet,
and what diagnosis hands its PLAN rules. Declared here, beside the records both sides of the wire agree on, because
the planner, its calibration file and diagnosis all read it, and diagnosis' facts import nothing of the planner."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Calibration:
    """Figures measured on the machine, used in place of the datasheet's: the achieved matmul FLOP/s (the
    efficiency is then 1: it is measured in), and per link the bus bandwidth at each message size, as
    (bytes, bytes/s) pairs (`gpuwatch probe`'s sweep). ``flops_by_work``: the achieved FLOP/s swept over the work
    of one layer's matmuls (forward FLOPs per micro-batch on one rank), as (FLOPs, FLOP/s) pairs, ascending: small
    matmuls run far below big ones, so a layout's micro-batch size and TP degree move its speed, as a message's size
    moves its bus bandwidth. ``precision``: the element type the matmuls were timed in (None: not said);
    ``measured``: how and where (free-form provenance, gpuwatch.plan.calibrate writes it)."""

    matmul_flops: float | None = None
    bus_bandwidth: Mapping[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    flops_by_work: tuple[tuple[float, float], ...] = ()
    precision: str | None = None
    measured: Mapping[str, Any] = field(default_factory=dict)
