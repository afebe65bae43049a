"""The typed facts diagnosis rules judge: nodes (GPUs, NVLink, InfiniBand ports, network interfaces, shell
environment) and training ranks (layout, environment, latest step, counters, history).

Sources fill them; rules only read them. A value nobody could observe is ``None``, never 0, so a rule can
tell "no errors" from "not known" and stay silent on the latter. Each part of a node that is ``None`` may
carry the reason in ``NodeFacts.missing`` (a collector down, no NVML), which the report repeats.

Past 500 lines on purpose: every type a rule may read, in one place for whoever writes a rule.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeGuard

from gpuwatch.agent.telemetry.window import WindowSummary
from gpuwatch.protocol.calibration import Calibration
from gpuwatch.protocol.records import GroupTotals, ModelShapeFields, RecorderEntry

#: Clock-event reasons that mean the GPU slowed itself down (not idling, not an application clock setting).
#: ``sw_power_cap`` is left out: a fully loaded GPU sits at its power cap as a matter of course.
SLOWDOWN_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake")


@dataclasses.dataclass(frozen=True)
class Where:
    """Where a number came from, for evidence: any of node, job, rank, GPU, port."""

    node: str | None = None
    job: str | None = None
    rank: int | None = None
    gpu: int | None = None
    port: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}


# -- nodes ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class GpuFacts:
    index: int
    uuid: str | None = None
    model: str | None = None
    lost: bool = False
    utilization_ratio: float | None = None
    sm_active_ratio: float | None = None
    memory_total_bytes: float | None = None
    memory_used_bytes: float | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    sm_clock_hertz: float | None = None
    #: Active clock-event (throttle) reasons, the nvml collector's names; None when unknown.
    clock_event_reasons: tuple[str, ...] | None = None
    pcie_generation: int | None = None
    pcie_max_generation: int | None = None
    pcie_width: int | None = None
    pcie_max_width: int | None = None
    #: Critical Xid events by Xid code, counted since the agent started.
    xid_errors: dict[str, int] | None = None
    ecc_uncorrected: int | None = None  # volatile: since the driver loaded
    remap_pending: bool | None = None
    remap_failure: bool | None = None

    @property
    def busy(self) -> float | None:
        """How busy the GPU is: SM activity where known, else NVML's utilisation rate."""
        return self.sm_active_ratio if self.sm_active_ratio is not None else self.utilization_ratio


@dataclasses.dataclass
class NvlinkFacts:
    """The NVLink links of one GPU: how many answer, which are down, and the rated speed of the up ones."""

    gpu: int
    links: int
    down: tuple[int, ...] = ()
    #: Sum of the rated one-direction speeds of the links that are up; None when unknown.
    up_speed_bytes_per_second: float | None = None


@dataclasses.dataclass
class IbPortFacts:
    device: str
    port: int
    link_layer: str | None = None  # "InfiniBand", or "Ethernet" for RoCE
    #: The HCA model (board_id / PSID, else hca_type); None when unknown.
    hca: str | None = None
    state: str | None = None  # "ACTIVE", "DOWN", ...
    phys_state: str | None = None
    rate_bytes_per_second: float | None = None
    #: Error counter totals by kernel counter name.
    errors: dict[str, int] | None = None
    #: Error counter increases over ``window_seconds`` (needs two samples: Prometheus); None when unknown.
    errors_increase: dict[str, float] | None = None
    window_seconds: float | None = None

    @property
    def name(self) -> str:
        return f"{self.device}/{self.port}"

    @property
    def active(self) -> bool | None:
        return None if self.state is None else self.state == "ACTIVE"

    @property
    def kind(self) -> tuple[str, str | None]:
        """What makes ports peers: the same HCA model (else driver family, ``mlx5_3`` -> ``mlx5``) and link
        layer. A node's 25G frontend ConnectX is no peer of its 400G NDR ones."""
        return self.hca or self.device.rstrip("0123456789").rstrip("_"), self.link_layer

    def describe(self) -> str:
        rate = f", {gbit(self.rate_bytes_per_second)}" if self.rate_bytes_per_second is not None else ""
        return f"{self.name} ({self.link_layer or 'unknown link layer'}{rate})"


@dataclasses.dataclass
class InterfaceFacts:
    name: str
    up: bool
    loopback: bool
    addresses: tuple[str, ...] = ()
    #: The link's negotiated speed (``/sys/class/net/NAME/speed``, through psutil); None when the driver does not say.
    speed_bytes_per_second: float | None = None


class CounterSample(NamedTuple):
    """The traffic counters of a node's interfaces at one moment (wall clock): name -> (bytes received, bytes
    transmitted, errors, drops) since boot."""

    time: float
    interfaces: Mapping[str, tuple[int, int, int, int]]


@dataclasses.dataclass(frozen=True)
class NicTraffic:
    """What one NIC carried between two of its counter samples: bytes each way, errors and drops, over ``seconds``."""

    interface: str
    seconds: float
    receive_bytes: int
    transmit_bytes: int
    errors: int
    drops: int

    @property
    def busiest_bytes_per_second(self) -> float:
        """The rate of the busier direction: what a full-duplex link's rating compares with."""
        return max(self.receive_bytes, self.transmit_bytes) / self.seconds


@dataclasses.dataclass
class NodeFacts:
    name: str
    simulated: bool | None = None
    gpus: list[GpuFacts] | None = None
    nvlinks: list[NvlinkFacts] | None = None
    ib_ports: list[IbPortFacts] | None = None
    interfaces: list[InterfaceFacts] | None = None
    #: Recent traffic counters of the interfaces, oldest first (the agent keeps one sample every few seconds); None
    #: when unknown.
    traffic: list[CounterSample] | None = None
    #: Logical CPUs (host collector); None when unknown.
    cpus: int | None = None
    #: The shell environment a pre-flight check runs in (NCCL_*, ...); None unless ``--preflight``.
    env: dict[str, str] | None = None
    #: Why a part is None: {"gpus": "nvml collector down: ...", ...}.
    missing: dict[str, str] = dataclasses.field(default_factory=dict)

    def gpu(self, uuid: str | None = None, index: int | None = None) -> GpuFacts | None:
        """The GPU with this UUID (authoritative), else with this NVML index."""
        for gpu in self.gpus or ():
            if (uuid is not None and gpu.uuid == uuid) or (uuid is None and index is not None and gpu.index == index):
                return gpu
        return None

    def active_ports(self) -> list[IbPortFacts]:
        return [port for port in self.ib_ports or () if port.active]

    def traffic_between(self, interface: str, start: float, end: float) -> NicTraffic | None:
        """What ``interface`` carried from the first counter sample at or after ``start`` to the last at or before
        ``end`` (wall clock): traffic inside the span only; None with fewer than two samples there."""
        inside = [sample for sample in self.traffic or () if start <= sample.time <= end
                  and interface in sample.interfaces]
        if len(inside) < 2 or inside[-1].time <= inside[0].time:
            return None
        first, last = inside[0].interfaces[interface], inside[-1].interfaces[interface]
        received, transmitted, errors, drops = (after - before for before, after in zip(first, last, strict=True))
        return NicTraffic(interface, inside[-1].time - inside[0].time, received, transmitted, errors, drops)

    def has_nvlink(self) -> bool | None:
        """Whether any GPU has an NVLink link up; None when unknown."""
        if self.nvlinks is None:
            return None
        return any(gpu.links > len(gpu.down) for gpu in self.nvlinks)


# -- ranks ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Layout:
    """A rank's place in the TP × PP × DP grid and its schedule, from its hello."""

    world_size: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_stage: int
    dp_rank: int
    local_rank: int | None = None
    schedule: str | None = None
    micro_batches: int | None = None
    precision: str | None = None
    #: Pipeline stages the rank holds (an interleaved or V-shaped schedule's model chunks); None: unknown, 1 unless the
    #: schedule says otherwise.
    virtual_stages: int | None = None
    #: The modules of the rank's pipeline stage, by name ("layers.2", "output"); None where the hello did not say.
    stage_modules: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a rank trains, from its hello: the model's shape and the batch, which with its layout is what
    `gpuwatch plan` predicts a step from (PLAN rules)."""

    model: ModelShapeFields
    global_batch: int
    seq_len: int


@dataclasses.dataclass
class StepFacts:
    """The rank's latest step, as far as its source knows it: a view of the step record (``protocol.records.Step``),
    its fields named as the record names them and filled by that name (``sources.telemetry.step``; the Prometheus
    source by the exported gauges' fields, ``collectors.read_by``), not a record of its own. A view, not the ``Step``:
    it joins the latest step with the latest memory reading, which an earlier record carried (every N steps), and
    flattens the pipeline and the memory reading into it (the memory reading's ``kind`` as ``memory_kind``); and the
    Prometheus source can fill only part of it (what the agent exports as gauges, as floats: not the exposed collective
    time nor the per-group traffic), so every field but the step number may be absent."""

    step: int
    step_seconds: float | None = None
    #: the step's phases (``schema.STEP_PHASES``), each net of the collectives waited for inside it
    dataloader_wait_seconds: float | None = None
    compute_seconds: float | None = None
    optimizer_seconds: float | None = None
    outside_model_seconds: float | None = None
    exposed_collective_seconds: float | None = None
    cpu_seconds: float | None = None  # CPU ranks: the training thread's time on a core ...
    cpu_wait_seconds: float | None = None  # ... and its wait for one, which busy time is net of (window.BUSY)
    gradient_sync_bytes: float | None = None  # DDP's all-reduce volume, where its calls are not timed
    #: collective calls (not send/recv) made on each process group (hello names) by the step's end
    collective_calls: dict[str, int] | None = None
    #: bytes handed to and seconds waited on each process group's timed calls (hello names), this step
    groups: dict[str, GroupTotals] | None = None
    bubble_ratio: float | None = None
    bubble_ratio_theoretical: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    loss_scale: float | None = None
    memory_kind: str | None = None  # "cuda" or "host_rss"
    peak_bytes: float | None = None
    allocated_bytes: float | None = None
    reserved_bytes: float | None = None
    inactive_split_bytes: float | None = None


@dataclasses.dataclass
class CollectiveFacts:
    """One collective op of one rank since it started: calls, time, bytes and latency quantiles."""

    op: str
    count: int
    seconds: float
    bytes: float | None = None
    p50_seconds: float | None = None
    p99_seconds: float | None = None
    #: calls per latency bucket (``schema.COLLECTIVE_BUCKETS`` and the overflow), where the source keeps them
    buckets: tuple[int, ...] | None = None


@dataclasses.dataclass
class Sampled:
    """A value measured every N steps (parameter checksum, gradient cosine similarity).

    ``step`` is the step it was measured at; where a source cannot tell (Prometheus), ``as_of_step`` is
    the rank's latest step instead: ranks at the same latest step measured at the same step.
    """

    value: float | str
    step: int | None = None
    as_of_step: int | None = None

    @property
    def when(self) -> tuple[str, int | None]:
        return ("step", self.step) if self.step is not None else ("as_of", self.as_of_step)


class StepRow(NamedTuple):
    """One step of a rank as its step record told it, for the per-step views of ``gpuwatch report`` (the heatmap, the
    phases, the curves, the trace): no rule reads it, the rules judge windows. ``time`` is the rank's wall clock when
    the step ended; ``collectives`` the step's calls per op, as (op, count, seconds); ``groups`` the seconds it
    waited on each process group's calls, as (group, seconds). A named tuple: a run log of
    1,024 ranks × 1,000 steps holds a million of them."""

    step: int
    time: float
    step_seconds: float
    dataloader_wait_seconds: float | None = None
    compute_seconds: float | None = None
    optimizer_seconds: float | None = None
    outside_model_seconds: float | None = None
    exposed_collective_seconds: float | None = None
    bubble_ratio: float | None = None
    bubble_ratio_theoretical: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    grad_cosine: float | None = None
    memory_peak_bytes: float | None = None
    collectives: tuple[tuple[str, int, float], ...] = ()
    groups: tuple[tuple[str, float], ...] = ()


@dataclasses.dataclass
class History:
    """Per-step series of one rank, oldest first, as (step, value); only a run log has them whole. ``steps`` holds
    every step record whole (``StepRow``), for the report's views; the rules read the series."""

    loss: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    grad_norm: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    host_rss_bytes: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    steps: list[StepRow] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class InFlightFacts:
    """The collective an overdue rank waits in: op, process group (its hello name and members), this rank's
    sequence number on that group, bytes, and how long it has been in it."""

    op: str
    group: str
    members: tuple[int, ...] | None  # from the rank's hello; None when it does not list the group
    seq: int
    bytes: int | None = None
    seconds: float | None = None

    @property
    def key(self) -> tuple[str, tuple[int, ...] | None]:
        """One process group across ranks: two ranks' "dp" groups are one only with the same members."""
        return self.group, self.members


@dataclasses.dataclass(frozen=True)
class ProgressFacts:
    """What a rank's latest progress record says (schema "progress"): sent only while it is overdue, or when a
    step raised."""

    step: int  # the last step completed
    phase: str
    stalled_seconds: float
    overdue_seconds: float
    collective: InFlightFacts | None = None
    #: the innermost frames of its training thread, "file:line function", innermost last
    stack: tuple[str, ...] = ()
    error: str | None = None  # "Type: message" of the exception a step raised
    time: float | None = None  # the rank's wall clock when it sent the record
    #: phase "closed": the process's CPU time, user and system, as its hooks closed
    cpu_seconds: float | None = None
    #: a second source, where PyTorch's Flight Recorder is on: the oldest collective it has not seen finish
    recorder: RecorderEntry | None = None

    @property
    def stack_top(self) -> str | None:
        """The innermost frame outside threading and torch (where the rank's own code stands), else the innermost."""
        for frame in reversed(self.stack):
            if "/threading.py:" not in frame and "/torch/" not in frame:
                return frame
        return self.stack[-1] if self.stack else None


@dataclasses.dataclass(frozen=True)
class AfterClose:
    """A rank whose hooks closed (it ended its training) and whose process has not exited: whether it still works
    (an evaluation, a checkpoint's upload) or is stuck in its teardown is told by the CPU time it used since."""

    seconds: float  # since its hooks closed, by the source's clock
    cpu_seconds: float  # the process's CPU time, user and system, since then
    pid: int


@dataclasses.dataclass
class RankFacts:
    job: str
    rank: int
    #: The node the rank runs on, as the node facts name it (agent node name, run-log hostname).
    node: str | None = None
    hostname: str | None = None
    layout: Layout | None = None
    workload: Workload | None = None
    gpu_index: int | None = None
    gpu_uuid: str | None = None
    env: dict[str, str] | None = None
    process_groups: dict[str, list[int]] | None = None
    #: CPUs the rank's process may run on, from its hello; the node's count where node facts are unknown.
    cpus: int | None = None
    #: The backend of each process group ("default": the world group's), from the hello; None when unknown.
    backends: dict[str, str] | None = None
    faults: tuple[str, ...] = ()
    #: What the rank, measured from outside (`gpuwatch run`), could not measure (``schema.UNAVAILABLE_FROM_OUTSIDE``).
    unavailable_from_outside: tuple[str, ...] = ()
    #: What the rank's instrumentation found but could not use, a line each (the hello's ``notes``, e.g. a device
    #: mesh `gpuwatch run` cannot place): the report repeats them.
    hello_notes: tuple[str, ...] = ()
    #: How long ago the rank said hello, by the source's clock (the agent's round, the PromQL engine's evaluation): a
    #: rank that has not stepped a moment after its hello is starting, not unmeasured. ``math.inf`` from a run log,
    #: which is read after the run: no step came after the hello. None where the source cannot tell.
    hello_age_seconds: float | None = None
    last: StepFacts | None = None
    #: Robust figures over the rank's recent steps (``telemetry.window``): what the timing rules judge.
    window: WindowSummary | None = None
    #: Signals the rank could not compute at its latest measuring step: signal -> reason code
    #: (``schema.UNAVAILABLE_REASONS``), only where no later step measured them.
    unavailable: dict[str, str] | None = None
    steps: int | None = None
    nonfinite_steps: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    collectives: dict[str, CollectiveFacts] | None = None
    param_checksum: Sampled | None = None
    grad_cosine: Sampled | None = None
    history: History | None = None
    #: while the rank is overdue (or a step raised): its latest progress record
    progress: ProgressFacts | None = None
    #: when its process was found gone (wall clock; the agent only); None while alive or unknown
    exited_at: float | None = None
    #: its hooks closed and its process still runs, as the agent on its node sees it (directly or through
    #: Prometheus); None where it is not closed or is gone, or where no one sees the process (a run log ends at the
    #: close; an agent in another pid namespace knows no pid of it)
    after_close: AfterClose | None = None

    @property
    def where(self) -> Where:
        return Where(node=self.node, job=self.job, rank=self.rank)

    @property
    def died_at(self) -> float | None:
        """When the rank died: the earlier of its error (a step raised) and its process's exit; None if alive."""
        times = [self.exited_at] if self.exited_at is not None else []
        if self.progress is not None and self.progress.error is not None and self.progress.time is not None:
            times.append(self.progress.time)
        return min(times) if times else None

    @property
    def host(self) -> str | None:
        """The machine the rank runs on, for grouping ranks by node."""
        return self.node or self.hostname

    @property
    def uses_nccl(self) -> bool | None:
        """Whether any of the rank's process groups runs on NCCL; None when its hello did not say."""
        return None if self.backends is None else "nccl" in self.backends.values()


# -- measurements -----------------------------------------------------------------------------------


@dataclasses.dataclass
class BandwidthMeasurement:
    """An active interconnect measurement (``gpuwatch probe``, nccl-tests style): the peak bus bandwidth of one
    collective over the message sizes, and the path it took."""

    node: str
    #: As the probe classified the path: one of the telemetry schema's INTERCONNECTS ("nvlink", "infiniband" ...).
    interconnect: str
    op: str
    size_bytes: int | None  # the message size of the peak; None when unknown (Prometheus keeps only the peak)
    busbw_bytes_per_second: float
    ranks: int | None
    gpu: int | None = None
    job: str | None = None
    #: Ranks on the busiest node: how many NICs their traffic can spread over.
    ranks_per_node: int | None = None


#: The node part that rates each interconnect a probe can name; the others ("loopback", "socket", "pcie",
#: "unknown") have no rating a measurement could be judged against.
RATED_BY = {"nvlink": "nvlinks", "infiniband": "ib_ports", "roce": "ib_ports"}


@dataclasses.dataclass
class SourceInfo:
    kind: str  # "local", "preflight", "agent", "run_log", "prometheus"
    location: str
    #: What a query engine cost (Prometheus): how its facts were fetched ("full" or "outliers"), the queries sent,
    #: the bytes received and the nodes it saw (in detail or only through aggregates); None for other sources.
    fetch: str | None = None
    queries: int | None = None
    bytes_received: int | None = None
    nodes: int | None = None


@dataclasses.dataclass(frozen=True)
class Peers:
    """A peer group's yardstick computed where the data is (PromQL), for a source that fetched only some of the
    group's ranks: the median of a window timing over all ``ranks`` ranks that have it judged."""

    median: float
    ranks: int


@dataclasses.dataclass(frozen=True)
class Unjudged:
    """Why a rule cannot be run on what a source fetched: the source could not answer (``source``: a timeout, a
    partial answer; ``--fail-on`` counts it), or the source's way of fetching cannot show what the rule judges."""

    reason: str
    source: bool


@dataclasses.dataclass
class Facts:
    nodes: dict[str, NodeFacts] = dataclasses.field(default_factory=dict)
    ranks: list[RankFacts] = dataclasses.field(default_factory=list)
    #: Interconnect measurements; None when no source could provide any.
    bandwidth: list[BandwidthMeasurement] | None = None
    sources: list[SourceInfo] = dataclasses.field(default_factory=list)
    #: What the sources want the reader to know (bad run-log lines, a collector down).
    notes: list[str] = dataclasses.field(default_factory=list)
    #: Yardsticks of peer groups whose ranks were not all fetched, by (job, pipeline stage or None for the whole
    #: job, window timing); rules comparing a rank with its peers read them where the ranks at hand are fewer.
    peers: dict[tuple[str, int | None, str], Peers] = dataclasses.field(default_factory=dict)
    #: Rules a source says cannot be run on its facts, by code, with the reason.
    unjudged: dict[str, Unjudged] = dataclasses.field(default_factory=dict)
    #: This cluster's measured matmul throughput and bus bandwidths (``--calibration``), which the PLAN rules predict
    #: with in place of a GPU preset's datasheet figures; None when not given.
    calibration: Calibration | None = None

    def jobs(self) -> dict[str, list[RankFacts]]:
        """Ranks by job, each list sorted by rank."""
        jobs: dict[str, list[RankFacts]] = {}
        for rank in sorted(self.ranks, key=lambda r: (r.job, r.rank)):
            jobs.setdefault(rank.job, []).append(rank)
        return jobs

    def spans_nodes(self, job: str | None) -> bool:
        """Whether a job runs on more than one node; True when that cannot be ruled out (some ranks unseen)."""
        ranks = self.jobs().get(job, []) if job is not None else []
        if not ranks or any(rank.host is None for rank in ranks):
            return True
        world = max((rank.layout.world_size for rank in ranks if rank.layout is not None), default=None)
        return len({rank.host for rank in ranks}) > 1 or world is None or len(ranks) < world

    def node_of(self, rank: RankFacts) -> NodeFacts | None:
        return self.nodes.get(rank.node) if rank.node is not None else None

    def gpu_of(self, rank: RankFacts) -> GpuFacts | None:
        node = self.node_of(rank)
        if node is None or (rank.gpu_uuid is None and rank.gpu_index is None):
            return None
        return node.gpu(rank.gpu_uuid, rank.gpu_index)

    def merge(self, other: Facts) -> None:
        """Add another source's facts: new nodes and ranks are added, known ones get the values they lacked."""
        for name, node in other.nodes.items():
            if name in self.nodes:
                _fill(self.nodes[name], node)
            else:
                self.nodes[name] = node
        known = {(rank.job, rank.rank): rank for rank in self.ranks}
        for rank in other.ranks:
            if (rank.job, rank.rank) in known:
                _fill(known[rank.job, rank.rank], rank)
            else:
                self.ranks.append(rank)
        if other.bandwidth is not None:
            self.bandwidth = [*(self.bandwidth or ()), *other.bandwidth]
        self.sources.extend(other.sources)
        self.notes.extend(other.notes)
        self.peers.update(other.peers)
        for code, unjudged in other.unjudged.items():
            self.unjudged.setdefault(code, unjudged)
        self.calibration = self.calibration or other.calibration


def _fill(target: Any, source: Any) -> None:
    """Copy the fields ``target`` lacks (None) from ``source``."""
    for field in dataclasses.fields(target):
        if getattr(target, field.name) is None:
            setattr(target, field.name, getattr(source, field.name))
    if isinstance(target, NodeFacts):
        for part, reason in source.missing.items():
            if getattr(target, part) is None:
                target.missing.setdefault(part, reason)
        target.missing = {part: reason for part, reason in target.missing.items() if getattr(target, part) is None}


# -- small helpers the rules share ------------------------------------------------------------------


def finite(value: float | None) -> TypeGuard[float]:
    return value is not None and math.isfinite(value)


def median(values: Iterable[float]) -> float:
    return statistics.median(values)


def medians_of_others(values: Sequence[float]) -> list[float]:
    """For each value, the median of all the others, from one sort: a straggler is judged against its peers
    without itself, and a job may have thousands of ranks."""
    ranked = sorted(values)
    rest = len(ranked) - 1
    wanted = (rest // 2,) if rest % 2 else (rest // 2 - 1, rest // 2)  # positions among the others
    result = []
    for value in values:
        gone = bisect.bisect_left(ranked, value)  # leave out one copy of value (which copy is immaterial)
        picks = [ranked[k + (k >= gone)] for k in wanted]
        result.append(sum(picks) / len(picks))
    return result


def gbit(bytes_per_second: float) -> str:
    """A link rate as people write it: ``400 Gb/s``."""
    return f"{bytes_per_second * 8 / 1e9:g} Gb/s"


def gib(value: float) -> str:
    return f"{value / 2**30:.1f} GiB"


def may_use_nccl(ranks: Iterable[RankFacts]) -> bool:
    """Whether a job's ranks may run NCCL: one says so, or one's hello did not say which backend it runs."""
    return any(rank.uses_nccl is not False for rank in ranks)


def group_members(groups: Mapping[str, Sequence[int]] | None, world_size: int | None,
                  group: str) -> tuple[int, ...] | None:
    """A process group's members by its hello name: the hello's (or the exported) list, every rank of the job for
    "default"; None when unknown. The one reading of a group's name that every source and rule shares."""
    if groups is not None and group in groups:
        return tuple(groups[group])
    if group == "default" and world_size is not None:
        return tuple(range(world_size))
    return None


def describe_ranks(ranks: Iterable[RankFacts]) -> str:
    """``rank 3``, or ``ranks 0-2,5``."""
    ranks = list(ranks)
    return f"rank {ranks[0].rank}" if len(ranks) == 1 else f"ranks {rank_list(r.rank for r in ranks)}"


def rank_list(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    ordered = sorted(set(ranks))
    spans: list[str] = []
    start = previous = None
    for rank in [*ordered, None]:
        if rank is not None and previous is not None and rank == previous + 1:
            previous = rank
            continue
        if start is not None:
            spans.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = rank
    return ",".join(spans)


def group_by(items: Iterable[Any], key: Any) -> Iterator[tuple[Any, list[Any]]]:
    """Groups in first-seen order, like ``itertools.groupby`` without the sorting requirement."""
    groups: dict[Any, list[Any]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return iter(groups.items())
