"""Facts built in tests: a DGX-like node (8 GPUs, 18 NVLinks each, 4 NDR ports) and ranks of a tp × pp × dp
grid, each with healthy defaults that a test overrides where it wants a rule to fire."""

from __future__ import annotations

from gpuwatch.agent.telemetry.window import BUSY, CPU_SECONDS, CPU_WAIT, PHASE_TIMINGS, TIMINGS, WindowSummary, net_busy
from gpuwatch.diagnosis.facts import (
    Facts,
    GpuFacts,
    IbPortFacts,
    InterfaceFacts,
    Layout,
    NodeFacts,
    NvlinkFacts,
    RankFacts,
    StepFacts,
)

GIB = 2**30
NDR = 400e9 / 8  # bytes/s


def gpu(index: int, **fields) -> GpuFacts:
    values = dict(uuid=f"GPU-{index}", model="NVIDIA H100 80GB HBM3", utilization_ratio=0.9, sm_active_ratio=0.85,
                  memory_total_bytes=80 * GIB, clock_event_reasons=(), pcie_generation=5, pcie_max_generation=5,
                  pcie_width=16, pcie_max_width=16, xid_errors={}, ecc_uncorrected=0, remap_pending=False,
                  remap_failure=False)
    values.update(fields)
    return GpuFacts(index=index, **values)


def port(device: str, state: str = "ACTIVE", rate: float = NDR, link_layer: str = "InfiniBand",
         **fields) -> IbPortFacts:
    return IbPortFacts(device=device, port=1, link_layer=link_layer, state=state,
                       phys_state="LinkUp" if state == "ACTIVE" else "Disabled", rate_bytes_per_second=rate,
                       errors={}, **fields)


def node(name: str = "node-a", **parts) -> NodeFacts:
    defaults = dict(gpus=[gpu(i) for i in range(8)], nvlinks=[NvlinkFacts(i, 18, (), 18 * 26.5e9) for i in range(8)],
                    ib_ports=[port(f"mlx5_{i}") for i in range(4)],
                    interfaces=[InterfaceFacts("eth0", True, False, ("10.0.0.1",)),
                                InterfaceFacts("lo", True, True, ("127.0.0.1",)),
                                InterfaceFacts("docker0", True, False, ("172.17.0.1",)),
                                InterfaceFacts("eth1", False, False, ())])
    defaults.update(parts)
    return NodeFacts(name=name, **defaults)


def rank(number: int, *, tp: int = 1, pp: int = 1, dp: int = 1, host: str = "node-a", job: str = "job-1",
         env: dict | None = None, micro_batches: int | None = None, precision: str = "bf16", **fields) -> RankFacts:
    """A rank of a tp × pp × dp grid, TP fastest, then DP, then PP (the reference trainer's order)."""
    layout = Layout(world_size=tp * pp * dp, tp_size=tp, pp_size=pp, dp_size=dp, tp_rank=number % tp,
                    dp_rank=number // tp % dp, pp_stage=number // (tp * dp), micro_batches=micro_batches,
                    precision=precision)
    values = dict(node=host, hostname=host, layout=layout, gpu_index=number % 8, gpu_uuid=f"GPU-{number % 8}",
                  env=env, last=StepFacts(step=100, step_seconds=0.5, compute_seconds=0.3, loss=2.0, grad_norm=1.0,
                                          loss_scale=None),
                  steps=100, nonfinite_steps=0, alloc_retries=0, ooms=0)
    values.update(fields)
    if "window" not in fields:  # a healthy window whose timings are those of the latest step
        values["window"] = window(values["last"]) if values["last"] is not None else None
    return RankFacts(job=job, rank=number, **values)


def window(last: StepFacts | None = None, steps: int = 20, **fields) -> WindowSummary:
    """A rank's window of ``steps`` steps whose medians are ``last``'s timings (its busy time the sum of its phases
    less its wait for a CPU, never below its time on one, as ``window.summarize`` takes it), of a model that learns
    (the loss moves, gradients are not zero, parameters change), unless ``fields`` say otherwise."""
    medians = {name: value for name in TIMINGS if (value := getattr(last, name, None)) is not None}
    if phases := [medians[field] for field in PHASE_TIMINGS if field in medians]:
        medians[BUSY] = sum(phases)
        if CPU_WAIT in medians and CPU_SECONDS in medians:
            medians[BUSY] = net_busy(medians[BUSY], medians[CPU_WAIT], medians[CPU_SECONDS])
    values = dict(steps=steps, first_step=100 - steps + 1, last_step=100, seconds=steps * 0.5, medians=medians,
                  loss_steps=steps, loss_min=1.9, loss_max=2.1, grad_norm_steps=steps, grad_norm_max=1.0, checksums=2,
                  distinct_checksums=2)
    values.update(fields)
    return WindowSummary(**values)


def step(**fields) -> StepFacts:
    values = dict(step=100, step_seconds=0.5, compute_seconds=0.3, loss=2.0, grad_norm=1.0)
    values.update(fields)
    return StepFacts(**values)


def facts(nodes=(), ranks=(), **kw) -> Facts:
    return Facts(nodes={n.name: n for n in nodes}, ranks=list(ranks), **kw)
