"""The telemetry records of ``schema.py`` as typed structs: what a validated record body holds, read by attribute.

``schema.decode`` judges a datagram against the fields' rules (``_Field``: ranges, labels, lengths, the reason a
record is refused) and hands back its body as one of these structs: every field of each record kind and of its
nested objects, by the schema's name, with its type, and optional (``?`` in the schema: absent or null, ``None``
here) or required. The agent's store, exposition and state read them by attribute, and so do the readers of an
agent's /api/v1/state (``convert``), so a misspelt field is a type error and a malformed body one
``msgspec.ValidationError`` naming where, not a ``KeyError`` deep in a rule. A body is written back as the schema's
JSON object by ``as_dict`` (absent fields left out: ``omit_defaults``).

They live beside, not inside, ``schema.py``: its line budget is spent on the wire format and the checks that enforce
it. tests/test_telemetry_schema.py holds these structs to the schema's field specs, field by field (names, required
or optional, nesting), so that the two cannot drift.

Unknown fields are ignored, as the schema ignores them: a newer agent's state still reads.
"""

from __future__ import annotations

import math
from typing import Any, TypeAlias, TypeVar

import msgspec

T = TypeVar("T")


class MaybeNonFinite(float):
    """A float that may be NaN or ±Infinity (``loss``, ``grad_norm``): on the wire a JSON ``NaN``/``Infinity``; in
    /api/v1/state the strings "NaN", "+Inf" and "-Inf" (Prometheus's HTTP API form, strict JSON). A float subclass
    only so that msgspec hands its values to ``decode_hook``: it compares, adds and prints as the float it is."""


_NON_FINITE_TEXT = {"NaN": math.nan, "+Inf": math.inf, "-Inf": -math.inf}


def decode_hook(wanted: type, value: Any) -> Any:
    """msgspec's ``dec_hook`` for the types it does not know: ``MaybeNonFinite`` from a number or its JSON text."""
    if wanted is MaybeNonFinite:
        if type(value) in (int, float, MaybeNonFinite):
            return MaybeNonFinite(value)
        if isinstance(value, str) and value in _NON_FINITE_TEXT:
            return MaybeNonFinite(_NON_FINITE_TEXT[value])
        raise TypeError(f"expected a number or one of {', '.join(_NON_FINITE_TEXT)}, got {value!r}")
    raise NotImplementedError(f"no decoding into {wanted}")


def convert(value: Any, into: type[T]) -> T:
    """``value`` (a record body, or JSON holding some) as the typed ``into``; ``msgspec.ValidationError`` when it does
    not fit, its message naming the path."""
    return msgspec.convert(value, into, dec_hook=decode_hook)


def _encode_hook(value: Any) -> Any:
    """msgspec's ``enc_hook``: a ``MaybeNonFinite`` is written as the float it is."""
    if isinstance(value, MaybeNonFinite):
        return float(value)
    raise NotImplementedError(f"no encoding of {type(value)}")


class Fields(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A record body or one of its objects: fields by keyword, an absent optional field left out when written."""

    def as_dict(self) -> dict[str, Any]:
        """The body as the schema's JSON object (non-finite floats as floats, absent fields left out): what
        /api/v1/state serves (``snapshot.json_safe`` calls it)."""
        body: dict[str, Any] = msgspec.to_builtins(self, enc_hook=_encode_hook)
        return body


class CommonFields(Fields, tag_field="kind"):
    """What every record carries: ``v``, ``kind`` (the struct's tag), ``job``, ``rank`` and the rank's wall clock."""

    v: int
    job: str
    rank: int
    time: float


# --- hello -----------------------------------------------------------------------------------------------------------


class Gpu(Fields):
    """The rank's GPU: NVML's index and its UUID, which is authoritative (CUDA_VISIBLE_DEVICES renumbers)."""

    index: int
    uuid: str


class ModelShapeFields(Fields):
    """The transformer a rank trains, as ``gpuwatch plan`` reads a model (gpuwatch.plan.model.ModelShape): what
    diagnosis predicts the step from."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied_embeddings: bool | None = None
    gated: bool | None = None
    bias: bool | None = None
    norm_params: int | None = None
    positions: int | None = None
    source: str | None = None


class Hello(CommonFields, tag="hello"):
    """A rank's layout and setup, sent at start and again as a heartbeat."""

    local_rank: int
    world_size: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_stage: int
    dp_rank: int
    hostname: str
    pid: int
    cpus: int | None = None
    schedule: str | None = None
    micro_batches: int | None = None
    virtual_stages: int | None = None
    stage_modules: list[str] | None = None
    precision: str | None = None
    gpu: Gpu | None = None
    torch_version: str | None = None
    nccl_version: str | None = None
    process_groups: dict[str, list[int]] | None = None
    env: dict[str, str] | None = None
    faults: list[str] | None = None
    backends: dict[str, str] | None = None
    framework: str | None = None
    command: list[str] | None = None
    unavailable_from_outside: list[str] | None = None
    notes: list[str] | None = None
    model: ModelShapeFields | None = None
    global_batch: int | None = None
    seq_len: int | None = None


# --- step ------------------------------------------------------------------------------------------------------------


class Pipeline(Fields):
    """A pipeline stage's step: busy and idle time, the bubble measured and the schedule's theoretical one."""

    busy_seconds: float
    idle_seconds: float
    bubble_ratio: float
    bubble_ratio_theoretical: float | None = None


class CollectiveTotals(Fields):
    """One collective op's calls: in a step record this step's, in a rank's state the totals since it was first seen
    (``store.OpTotals.as_dict``). ``buckets`` counts calls per latency bucket (``schema.COLLECTIVE_BUCKETS`` and the
    overflow)."""

    count: int
    bytes: int
    seconds: float
    buckets: list[int]


class GroupTotals(Fields):
    """One process group's timed calls in a step: the bytes handed to them and the seconds waited on them."""

    bytes: int
    seconds: float


class Memory(Fields):
    """A memory reading: the peak since the previous one, allocator state on CUDA (``host_rss``: the peak only)."""

    kind: str
    peak_bytes: int
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    inactive_split_bytes: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None


class ClientCounters(Fields):
    """The sending client's cumulative counters: records sent, and dropped by reason."""

    sent: int
    dropped: dict[str, int]


class FoldedPipeline(Fields):
    """What a folded step keeps of its pipeline: the bubble only."""

    bubble_ratio: float


class FoldedStep(Fields):
    """An earlier step folded into a step record: what the agent's window keeps (``schema.FOLDED_STEP_FIELDS``)."""

    step: int
    time: float
    step_seconds: float
    compute_seconds: float | None = None
    dataloader_wait_seconds: float | None = None
    optimizer_seconds: float | None = None
    outside_model_seconds: float | None = None
    exposed_collective_seconds: float | None = None
    pipeline: FoldedPipeline | None = None
    loss: MaybeNonFinite | None = None
    grad_norm: MaybeNonFinite | None = None


class Folded(Fields):
    """The steps a client folded into a step record, oldest first, and their count-like fields summed."""

    steps: list[FoldedStep]
    collectives: dict[str, CollectiveTotals] | None = None
    tokens: int | None = None
    samples: int | None = None


class Step(CommonFields, tag="step"):
    """One reported step: its timings, this step's counts, and the signals measured every N steps."""

    step: int
    step_seconds: float
    compute_seconds: float | None = None
    dataloader_wait_seconds: float | None = None
    optimizer_seconds: float | None = None
    outside_model_seconds: float | None = None
    exposed_collective_seconds: float | None = None
    pipeline: Pipeline | None = None
    collectives: dict[str, CollectiveTotals] | None = None
    gradient_sync_bytes: int | None = None
    collective_calls: dict[str, int] | None = None
    groups: dict[str, GroupTotals] | None = None
    loss: MaybeNonFinite | None = None
    grad_norm: MaybeNonFinite | None = None
    nonfinite: bool | None = None
    loss_scale: float | None = None
    lr: float | None = None
    grad_cosine_similarity: float | None = None
    param_checksum: float | str | None = None
    memory: Memory | None = None
    tokens: int | None = None
    samples: int | None = None
    unavailable: dict[str, str] | None = None
    model_flops_per_second: float | None = None
    mfu: float | None = None
    client: ClientCounters | None = None
    folded: Folded | None = None


# --- probe -----------------------------------------------------------------------------------------------------------


class ProbeResult(Fields):
    """One op and message size of a probe: the slowest rank's mean time and the bandwidths it gives."""

    op: str
    bytes: int
    seconds: float
    algbw_bytes_per_second: float
    busbw_bytes_per_second: float


class Probe(CommonFields, tag="probe"):
    """The result of ``gpuwatch probe``, sent once by its rank 0."""

    hostname: str
    nodes: int
    world_size: int
    ranks_per_node: int
    backend: str
    device: str
    interconnect: str
    results: list[ProbeResult]
    hostnames: list[str] | None = None
    dtype: str | None = None


# --- progress --------------------------------------------------------------------------------------------------------


class InFlight(Fields):
    """The collective a stalled rank is in: its group, the rank's place in it, its per-group number, its age."""

    op: str
    group: str
    group_size: int
    group_rank: int
    seq: int
    bytes: int
    seconds: float


class StackFrame(Fields):
    """One frame of the training thread's stack."""

    file: str
    line: int
    function: str


class RecorderEntry(Fields):
    """The oldest collective (or send/recv) PyTorch's Flight Recorder has not seen finish on a stalled rank: its op,
    torch's name and description of its process group, its per-group number, whether point-to-point, its state."""

    op: str
    group: str
    seq: int
    p2p: bool
    state: str
    group_desc: str | None = None


class StepError(Fields):
    """The exception a step raised."""

    type: str
    message: str


class Progress(CommonFields, tag="progress"):
    """What an overdue (or failed, or closed) rank's training thread is doing."""

    step: int
    phase: str
    stalled_seconds: float
    overdue_seconds: float
    collective: InFlight | None = None
    stack: list[StackFrame] | None = None
    error: StepError | None = None
    flight_recorder: RecorderEntry | None = None



#: A record's body, of any kind: what ``schema.decode`` hands back.
Body: TypeAlias = Hello | Step | Probe | Progress
