"""Every layout of a model on a cluster: each feasible one predicted and ranked by step time, each other one
rejected with its reason.

The step, as predicted: the pipeline runs m/(1 − bubble) slots (`compute.schedule_bubble`: m + p − 1 for GPipe and
1F1B, m + (p − 1)/v interleaved, m for ZB-V), each as long as the slowest stage's micro-batch (its compute at the
GPUs' achieved FLOP/s, plus its TP collectives, which sit on the critical path between a layer's matmuls and are
never overlapped, and the part of its context-parallel ring's transfers that the attention does not hide: ring
attention passes each key/value chunk while computing the attention over the one before (Liu et al. 2023,
arXiv:2310.01889, §3)); each slot also waits for its point-to-point sends (a forward and a backward
transfer, not overlapped: conservative); then the DP gradient reduction, whole after the backward pass (the
reference trainer's way), or with ``Run.dp_overlap`` overlapped with the last micro-batch's backward pass but for
its last bucket. MFU is the model's FLOPs (no recomputation) over the step time × the GPUs' datasheet peak.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from gpuwatch.plan import compute
from gpuwatch.plan.comm import GROUPS, Traffic, boundary_transfers, stage_traffic
from gpuwatch.plan.gpus import GIB, Cluster
from gpuwatch.plan.memory import Memory, in_flight, stage_memory
from gpuwatch.plan.model import ModelShape
from gpuwatch.plan.run import INTERLEAVED, MIN_CONTEXT_TOKENS, RECOMPUTE, ZBV, Layout, Run, stage_layers

#: The share of a micro-batch's compute that is its backward pass (2 of its 3 passes).
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class Stage:
    """One pipeline stage's rank: its layers and parameters, memory at its peak, traffic per step."""

    index: int
    layers: int
    parameters: int
    memory: Memory
    traffic: Traffic


@dataclass(frozen=True)
class Prediction:
    """A feasible layout, predicted. ``heaviest``: the stage whose rank needs the most memory. Seconds per step:
    ``compute_seconds`` the busy time of the slowest stage's rank, ``exposed`` the collectives' time that shows, by
    group."""

    layout: Layout
    micro_batch_size: int
    stages: tuple[Stage, ...]
    heaviest: int
    bubble: float
    compute_seconds: float
    exposed: dict[str, float]
    step_seconds: float
    model_flops: float
    mfu: float

    @property
    def memory(self) -> Memory:
        return self.stages[self.heaviest].memory

    @property
    def traffic_bytes(self) -> dict[str, int]:
        """The most bytes any rank hands each group per step."""
        return {group: max(stage.traffic.bytes_by_group()[group] for stage in self.stages)
                for group in GROUPS}

    @property
    def comm_compute_ratio(self) -> float:
        return sum(self.exposed.values()) / self.compute_seconds

    @property
    def parts(self) -> dict[str, float]:
        """The step's seconds by what takes them: the slowest stage's compute, each group's exposed collectives, and
        the pipeline's bubble (the rest of the step: the stages idle)."""
        bubble = max(0.0, self.step_seconds - self.compute_seconds - sum(self.exposed.values()))
        return {"compute": self.compute_seconds, "bubble": bubble, **self.exposed}

    @property
    def bound(self) -> str:
        """What bounds the step: the part that takes most of it (``parts``)."""
        parts = self.parts
        return max(parts, key=parts.__getitem__)


@dataclass(frozen=True)
class Rejection:
    """A layout that cannot run: ``layout`` is the whole variant for an out-of-memory one, the grid (micro-batches
    1, defaults) for a structural one, which rules out every variant of the grid. ``over_bytes``: how much memory
    is missing."""

    layout: Layout
    code: str
    reason: str
    over_bytes: float | None = None


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    cluster: Cluster
    run: Run
    feasible: tuple[Prediction, ...]
    rejected: tuple[Rejection, ...]


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def structural(shape: ModelShape, run: Run, cluster: Cluster, tp: int, pp: int, dp: int,
               cp: int = 1) -> list[tuple[str, str]]:
    """Why a grid cannot run at all, as (code, reason) pairs; none when it can."""
    checks = [
        (cp == 1 or run.flash_attention, "cp-attention",
         f"cp {cp}: ring attention computes blockwise with flash attention's kernel, off here"),
        (run.seq_len % (2 * cp) == 0, "cp-sequence",
         f"cp {cp}: sequence length {run.seq_len} does not split into 2 × {cp} equal chunks (each rank takes one "
         "from each end, to balance causal attention: Megatron-LM's context parallelism)"),
        (shape.heads % tp == 0, "heads", f"{shape.heads} attention heads are not divisible by tp {tp}"),
        (shape.kv_heads == shape.heads or shape.kv_heads % tp == 0, "kv-heads",
         f"{shape.kv_heads} key/value heads are not divisible by tp {tp}"),
        (tp <= cluster.domain, "tp-across-nodes",
         f"tp {tp} spans NVLink domains of {cluster.domain} GPUs: its per-layer all-reduces would cross "
         "InfiniBand"),
        (pp <= shape.layers, "layers", f"{shape.layers} layers cannot fill pp {pp} stages"),
        (run.global_batch % dp == 0, "batch",
         f"global batch {run.global_batch} is not divisible by dp {dp}"),
    ]
    if shape.source == "reference":  # the reference trainer's own rules (gpuwatch.trainer.config)
        checks += [
            (shape.layers % pp == 0, "layers", f"the reference trainer splits {shape.layers} layers evenly: not "
             f"into pp {pp} stages"),
            (shape.vocab % tp == 0, "vocab", f"the reference trainer splits its vocabulary {shape.vocab} evenly: "
             f"not over tp {tp}"),
        ]
    return [(code, reason) for ok, code, reason in checks if not ok]


def schedules(layers: int, pp: int, micro_batches: int) -> Iterator[tuple[str, int]]:
    """The (schedule, virtual stages) a pipeline of ``pp`` stages of ``layers`` layers can run ``micro_batches``
    with: GPipe and 1F1B always; with pp > 1 and m ≥ p, interleaved 1F1B with each v ≥ 2 that divides a stage's
    layers (`run.stage_layers`: the fewest or the most) and leaves every chunk a layer, and ZB-V where every stage
    has two layers for its two chunks (below m = p the zero-bubble schedule has no bubble formula:
    `compute.schedule_bubble`). A stage's chunks may differ by a layer where the split is uneven (Llama 3 405B's
    126 layers over 16 stages); the planner times the stage's layers, not its chunks."""
    yield "1f1b", 1
    yield "gpipe", 1
    if pp == 1 or micro_batches < pp:
        return
    fewest, most = layers // pp, -(-layers // pp)
    for v in sorted({v for n in (fewest, most) for v in divisors(n) if 2 <= v <= fewest}):
        yield INTERLEAVED, v
    if fewest >= 2:
        yield ZBV, 2


def variants(layout: Layout, run: Run, layers: int | None = None) -> Iterator[Layout]:
    """Every micro-batch count, schedule (with its virtual stages), recomputation and optimizer sharding of a grid
    (ZeRO-1 only with DP; selective recomputation not under flash attention, where it is none). ``layers``: the
    model's, for the schedules that split them into chunks (without it only GPipe and 1F1B)."""
    for m in divisors(run.global_batch // layout.dp):
        for schedule, v in schedules(layers or 1, layout.pp if layers else 1, m):
            for recompute in RECOMPUTE:
                if recompute == "selective" and run.flash_attention:
                    continue  # the same as none: flash attention keeps no scores to spare
                for zero1 in (False, True) if layout.dp > 1 else (False,):
                    yield Layout(layout.tp, layout.pp, layout.dp, m, schedule, recompute, zero1, v, layout.cp)


def stage_parameters(shape: ModelShape, layout: Layout, stage: int, layers: int) -> int:
    """Parameters one rank of ``stage`` holds."""
    params = shape.layer_parameters() * layers
    if stage == 0:
        params += shape.embedding_parameters(layout.tp)
    if stage == layout.last_stage:
        params += shape.head_parameters(layout.tp, 1 if layout.last_stage == 0 else layout.pp)
    return params.on_rank(layout.tp)


def predict(shape: ModelShape, cluster: Cluster, run: Run, layout: Layout) -> Prediction:
    """One layout's prediction (feasible or not: `plan` compares its memory with the GPU's)."""
    batch = layout.micro_batch_size(run.global_batch)
    split = stage_layers(shape.layers, layout.pp)
    stages = []
    # a stage's parameters are its layers' and its edges' (first, last), its traffic theirs and its pipeline sends',
    # its memory theirs and its micro-batches in flight: the middle stages of a deep pipeline share them, counted once
    # (most of a large plan's time went to recounting them)
    parameters_of: dict[tuple[int, bool, bool], int] = {}
    traffic: dict[tuple[int, bool, bool, int], Traffic] = {}
    memory: dict[tuple[int, bool, bool, float], Memory] = {}
    for index, layers in enumerate(split):
        edges = (layers, index == 0, index == layout.last_stage)
        if edges not in parameters_of:
            parameters_of[edges] = stage_parameters(shape, layout, index, layers)
        parameters = parameters_of[edges]
        sends, held = (*edges, boundary_transfers(layout, index)), (*edges, in_flight(layout, index))
        if sends not in traffic:
            traffic[sends] = stage_traffic(shape, run, layout, cluster, index, layers, parameters)
        if held not in memory:
            memory[held] = stage_memory(shape, run, layout, index, layers, parameters)
        stages.append(Stage(index, layers, parameters, memory[held], traffic[sends]))
    tokens = batch * layout.tokens(run.seq_len)
    flops = cluster.achieved_flops(run.numerics.precision, compute.layer_matmul_flops(shape) * tokens / layout.tp)
    slot_compute = [compute.stage_flops_per_token(shape, run.seq_len, s.layers, s.index == layout.last_stage,
                                                  layout.recompute, run.flash_attention) * tokens / layout.tp / flops
                    for s in stages]
    if cluster.shape_model and cluster.gpu.memory_bandwidth:
        sequence_parallel = run.sequence_parallel and layout.tp > 1
        slot_compute = [compute.stage_seconds(
            shape, run.seq_len, batch, s.layers, s.index == layout.last_stage, layout.tp, sequence_parallel,
            layout.recompute, run.flash_attention, run.numerics.activation, flops, cluster.gpu.memory_bandwidth,
            layout.cp) for s in stages]
    m, p = layout.micro_batches, layout.pp
    # the attention a micro-batch's ring transfers hide behind: every pass's QKᵀ and AV, and flash's recomputed QKᵀ
    passes = compute.PASSES + 0.5
    attention = compute.attention_forward_flops(shape, run.seq_len) * passes * tokens / layout.tp / flops
    ring = [max(0.0, s.traffic.cp_seconds / m - s.layers * attention) for s in stages]
    slot = max(c + s.traffic.tp_seconds / m + r for c, s, r in zip(slot_compute, stages, ring, strict=True))
    bubble = compute.schedule_bubble(layout.schedule, p, m, layout.virtual_stages)
    if bubble is None:  # a schedule the planner does not search, at a size it has no formula for: as 1F1B
        bubble = compute.bubble_fraction(p, m)
    slots = m / (1 - bubble)  # m + p − 1 for GPipe and 1F1B, m + (p − 1)/v interleaved, m zero-bubble
    busy = max(slot_compute) * m
    pp_seconds = max(s.traffic.pp_seconds for s in stages) / m * slots
    dp_seconds = max(s.traffic.dp_seconds for s in stages)
    if run.dp_overlap and dp_seconds:
        dp_bytes = max(s.traffic.dp_bytes for s in stages)
        last_bucket = dp_seconds * min(1.0, run.bucket_bytes / dp_bytes)
        dp_seconds = max(last_bucket, dp_seconds - BACKWARD_SHARE * max(slot_compute))
    exposed = {"tp": max(s.traffic.tp_seconds for s in stages) * slots / m, "cp": max(ring) * slots,
               "pp": pp_seconds, "dp": dp_seconds}
    step = slot * slots + pp_seconds + dp_seconds
    model_flops = compute.model_flops_per_token(shape, run.seq_len) * run.global_batch * run.seq_len
    peak = cluster.gpu.peak_flops[run.numerics.precision]
    heaviest = max(range(p), key=lambda index: stages[index].memory.total)
    return Prediction(layout, batch, tuple(stages), heaviest, bubble, busy, exposed, step,
                      model_flops, model_flops / (step * peak * cluster.gpus))


def plan(shape: ModelShape, cluster: Cluster, run: Run) -> Plan:
    """Every grid tp × cp × pp × dp = the cluster's GPUs and every variant of it, ranked fastest first (context
    parallelism where a rank keeps at least ``MIN_CONTEXT_TOKENS`` of a sequence)."""
    feasible: list[Prediction] = []
    rejected: list[Rejection] = []
    for tp in divisors(cluster.gpus):
        for cp in [c for c in divisors(cluster.gpus // tp) if c == 1 or run.seq_len // c >= MIN_CONTEXT_TOKENS]:
            for pp in divisors(cluster.gpus // (tp * cp)):
                grid = Layout(tp, pp, cluster.gpus // (tp * cp * pp), cp=cp)
                reasons = structural(shape, run, cluster, grid.tp, grid.pp, grid.dp, grid.cp)
                if reasons:
                    rejected += [Rejection(grid, code, reason) for code, reason in reasons]
                    continue
                for layout in variants(grid, run, shape.layers):
                    prediction = predict(shape, cluster, run, layout)
                    over = prediction.memory.total - cluster.gpu.memory_bytes
                    if over <= 0:
                        feasible.append(prediction)
                    else:
                        rejected.append(Rejection(
                            layout, "memory", f"out of memory by {over / GIB:.1f} GiB: stage {prediction.heaviest} "
                            f"needs {prediction.memory.total / GIB:.1f} of {cluster.gpu.memory_bytes / GIB:.1f} GiB",
                            over))
    feasible.sort(key=lambda prediction: (prediction.step_seconds, prediction.memory.total))
    return Plan(shape, cluster, run, tuple(feasible), tuple(rejected))
