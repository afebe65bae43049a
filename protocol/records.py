"""The telemetry records, declared once: every field of each record kind and of its nested objects, by the schema's
name, with its type, whether it is optional (``?`` in the schema: absent or null, ``None`` here) or required, and its
rule: the bounds, lengths and patterns msgspec states (``msgspec.Meta`` in ``Annotated``) and, as markers, what it
cannot (``OneOf``, ``Refused``, ``WhenFinite``, ``KnownKeys``, ``Allowlisted``).

``schema.py`` derives its validation from these declarations, walking the annotations: the reference ``check`` of
each field, which names why a record is refused, and the strict msgspec type that decodes the usual record in C
(``schema.decode``). What it hands back is one of these structs. The agent's store, exposition and state read them by
attribute, and so do the readers of an agent's /api/v1/state (``convert``), so a misspelt field is a type error and a
malformed body one ``msgspec.ValidationError`` naming where, not a ``KeyError`` deep in a rule. A body is written back
as the schema's JSON object by ``as_dict`` (absent fields left out: ``omit_defaults``).

Unknown fields are ignored, as the schema ignores them: a newer agent's state still reads. For the same reason a
choice (``OneOf``) is a plain ``str`` here, held to its values only where a datagram is validated: a newer agent's
new op or phase still reads from its state.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Any, TypeAlias, TypeVar

import msgspec

from gpuwatch.protocol.limits import (
    CLIENT_DROP_REASONS,
    COLLECTIVE_BUCKETS,
    COLLECTIVE_OPS,
    COSINE_TOLERANCE,
    ENV_NAME_PATTERN,
    FRAMEWORKS,
    HEX_PATTERN,
    INTERCONNECTS,
    LABEL_PATTERN,
    MAX_COMMAND_ARG_CHARS,
    MAX_COMMAND_ARGS,
    MAX_COUNT,
    MAX_ENV_VALUE_CHARS,
    MAX_ENV_VARS,
    MAX_FOLDED_STEPS,
    MAX_GROUP_TEXT_CHARS,
    MAX_MODULE_NAME_CHARS,
    MAX_NOTES,
    MAX_PROBE_HOSTNAMES,
    MAX_PROBE_RESULTS,
    MAX_RANK,
    MAX_STACK_FRAMES,
    MAX_STAGE_MODULES,
    MAX_TEXT_CHARS,
    MEMORY_KINDS,
    PHASES,
    PROBE_OPS,
    SCHEMA_VERSION,
    UNAVAILABLE_FROM_OUTSIDE,
    UNAVAILABLE_REASONS,
    UNAVAILABLE_SIGNALS,
)

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


# --- what msgspec cannot state: markers that schema.py reads from the annotations ------------------------------------


@dataclasses.dataclass(frozen=True)
class OneOf:
    """One of ``values`` (a ``str`` field: an op, a phase; ``v``: the schema's version); any other is out of range."""

    values: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Refused:
    """The reason (``schema.REJECT_REASONS``) a value that breaks its constraints is refused for, where it is not
    "out_of_range": a label's "bad_label", which tells a client its string cannot become a Prometheus label."""

    reason: str


@dataclasses.dataclass(frozen=True)
class WhenFinite:
    """The range of a ``MaybeNonFinite``'s finite values (msgspec sets no constraint on a type it does not know); NaN
    and ±Infinity are allowed whatever it says."""

    ge: float = -math.inf
    le: float = math.inf


@dataclasses.dataclass(frozen=True)
class KnownKeys:
    """An object keyed by some of ``keys`` (a step's collectives by op): another key is ignored as an unknown field
    is (dropped, its nesting bounded), not refused, so a newer client's op does not cost the record."""

    keys: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Allowlisted:
    """A mapping whose keys' constraint is an allowlist (a hello's environment names, ``ENV_NAME_PATTERN``): a name
    that breaks it is dropped unread, whatever its value, not refused, so a client that leaks a secret leaks it
    nowhere. msgspec refuses such a record instead, and the checks then judge it."""


def most(items: int) -> msgspec.Meta:
    """At most ``items`` characters of a string, or items of a list or mapping."""
    return msgspec.Meta(max_length=items)


Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=MAX_RANK)]
Size = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANK + 1)]
StepNumber = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
#: A 32-bit-sized dimension of a model or a batch, at least 1.
Dimension = Annotated[int, msgspec.Meta(ge=1, le=2**31)]
#: Seconds, bytes per second, a learning rate: any finite number ≥ 0.
NonNegative = Annotated[float, msgspec.Meta(ge=0.0)]
Seconds = NonNegative
Ratio = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
#: 1..N characters of ``[A-Za-z0-9_.:+/-]`` (with ``most(N)``): a string that may become a Prometheus label, so no
#: quote, backslash, brace or newline reaches the exposition.
Label = Annotated[str, msgspec.Meta(pattern=LABEL_PATTERN), Refused("bad_label")]
#: A variable's name a hello's environment may carry (``limits.env_name_allowed``).
EnvName = Annotated[str, msgspec.Meta(pattern=ENV_NAME_PATTERN)]
Bucketed = Annotated[list[Count], msgspec.Meta(min_length=len(COLLECTIVE_BUCKETS) + 1,
                                                max_length=len(COLLECTIVE_BUCKETS) + 1)]

class Fields(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A record body or one of its objects: fields by keyword, an absent optional field left out when written."""

    def as_dict(self) -> dict[str, Any]:
        """The body as the schema's JSON object (non-finite floats as floats, absent fields left out): what
        /api/v1/state serves (``snapshot.json_safe`` calls it)."""
        body: dict[str, Any] = msgspec.to_builtins(self, enc_hook=_encode_hook)
        return body


class CommonFields(Fields, tag_field="kind"):
    """What every record carries: ``v``, ``kind`` (the struct's tag), ``job``, ``rank`` and the rank's wall clock."""

    v: Annotated[int, OneOf((SCHEMA_VERSION,))]
    job: Annotated[Label, most(128)]
    rank: Rank
    time: Seconds


# --- hello -----------------------------------------------------------------------------------------------------------


class Gpu(Fields):
    """The rank's GPU: NVML's index and its UUID, which is authoritative (CUDA_VISIBLE_DEVICES renumbers)."""

    index: Annotated[int, msgspec.Meta(ge=0, le=1023)]
    uuid: Annotated[Label, most(96)]


class ModelShapeFields(Fields):
    """The transformer a rank trains, as ``gpuwatch plan`` reads a model (gpuwatch.plan.model.ModelShape, which is
    this struct with the planner's defaults for what a description leaves out): what diagnosis predicts the step
    from."""

    layers: Dimension
    hidden: Dimension
    heads: Dimension
    kv_heads: Dimension
    ffn: Dimension
    vocab: Dimension
    tied_embeddings: bool | None = None
    gated: bool | None = None
    norm_params: Annotated[int, msgspec.Meta(ge=1, le=2)] | None = None
    bias: bool | None = None
    positions: Annotated[int, msgspec.Meta(ge=0, le=2**31)] | None = None
    source: Annotated[Label, most(16)] | None = None


class Hello(CommonFields, tag="hello"):
    """A rank's layout and setup, sent at start and again as a heartbeat."""

    local_rank: Rank
    world_size: Size
    tp_size: Size
    pp_size: Size
    dp_size: Size
    tp_rank: Rank
    pp_stage: Rank
    dp_rank: Rank
    hostname: Annotated[Label, most(255)]
    pid: Annotated[int, msgspec.Meta(ge=1, le=2**22)]
    cpus: Annotated[int, msgspec.Meta(ge=1, le=2**20)] | None = None
    schedule: Annotated[Label, most(32)] | None = None
    micro_batches: Size | None = None
    virtual_stages: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None
    stage_modules: Annotated[list[Annotated[str, most(MAX_MODULE_NAME_CHARS)]],
                             most(MAX_STAGE_MODULES)] | None = None
    precision: Annotated[Label, most(32)] | None = None
    gpu: Gpu | None = None
    torch_version: Annotated[Label, most(64)] | None = None
    nccl_version: Annotated[Label, most(64)] | None = None
    process_groups: Annotated[dict[Annotated[Label, most(64)], Annotated[list[Rank], most(65536)]],
                              most(16)] | None = None
    env: Annotated[dict[EnvName, Annotated[str, most(MAX_ENV_VALUE_CHARS)]], most(MAX_ENV_VARS),
                   Allowlisted()] | None = None
    faults: Annotated[list[Annotated[Label, most(64)]], most(32)] | None = None
    backends: Annotated[dict[Annotated[Label, most(64)], Annotated[Label, most(32)]], most(17)] | None = None
    framework: Annotated[str, OneOf(FRAMEWORKS)] | None = None
    command: Annotated[list[Annotated[str, most(MAX_COMMAND_ARG_CHARS)]], most(MAX_COMMAND_ARGS)] | None = None
    unavailable_from_outside: Annotated[list[Annotated[str, OneOf(tuple(UNAVAILABLE_FROM_OUTSIDE))]],
                                        most(len(UNAVAILABLE_FROM_OUTSIDE))] | None = None
    notes: Annotated[list[Annotated[str, most(MAX_TEXT_CHARS)]], most(MAX_NOTES)] | None = None
    model: ModelShapeFields | None = None
    global_batch: Dimension | None = None
    seq_len: Dimension | None = None


# --- step ------------------------------------------------------------------------------------------------------------


class Pipeline(Fields):
    """A pipeline stage's step: busy and idle time, the bubble measured and the schedule's theoretical one."""

    busy_seconds: Seconds
    idle_seconds: Seconds
    bubble_ratio: Ratio
    bubble_ratio_theoretical: Ratio | None = None


class CollectiveTotals(Fields):
    """One collective op's calls: in a step record this step's, in a rank's state the totals since it was first seen
    (``store.OpTotals.as_dict``). ``buckets`` counts calls per latency bucket (``schema.COLLECTIVE_BUCKETS`` and the
    overflow)."""

    count: Count
    bytes: Count
    seconds: Seconds
    buckets: Bucketed


class GroupTotals(Fields):
    """One process group's timed calls in a step: the bytes handed to them and the seconds waited on them."""

    bytes: Count
    seconds: Seconds


class Memory(Fields):
    """A memory reading: the peak since the previous one, allocator state on CUDA (``host_rss``: the peak only)."""

    kind: Annotated[str, OneOf(MEMORY_KINDS)]
    peak_bytes: Count
    allocated_bytes: Count | None = None
    reserved_bytes: Count | None = None
    inactive_split_bytes: Count | None = None
    alloc_retries: Count | None = None
    ooms: Count | None = None


class ClientCounters(Fields):
    """The sending client's cumulative counters: records sent, and dropped by reason."""

    sent: Count
    dropped: Annotated[dict[str, Count], KnownKeys(CLIENT_DROP_REASONS)]


class FoldedPipeline(Fields):
    """What a folded step keeps of its pipeline: the bubble only."""

    bubble_ratio: Ratio


class FoldedStep(Fields):
    """An earlier step folded into a step record: what the agent's window keeps (``schema.FOLDED_STEP_FIELDS``)."""

    step: StepNumber
    time: Seconds
    step_seconds: Seconds
    compute_seconds: Seconds | None = None
    dataloader_wait_seconds: Seconds | None = None
    optimizer_seconds: Seconds | None = None
    outside_model_seconds: Seconds | None = None
    exposed_collective_seconds: Seconds | None = None
    cpu_seconds: Seconds | None = None
    cpu_wait_seconds: Seconds | None = None
    pipeline: FoldedPipeline | None = None
    loss: MaybeNonFinite | None = None
    grad_norm: Annotated[MaybeNonFinite, WhenFinite(ge=0.0)] | None = None


class Folded(Fields):
    """The steps a client folded into a step record, oldest first, and their count-like fields summed."""

    steps: Annotated[list[FoldedStep], most(MAX_FOLDED_STEPS)]
    collectives: Annotated[dict[str, CollectiveTotals], KnownKeys(COLLECTIVE_OPS)] | None = None
    tokens: Count | None = None
    samples: Count | None = None


class Step(CommonFields, tag="step"):
    """One reported step: its timings, this step's counts, and the signals measured every N steps."""

    step: StepNumber
    step_seconds: Seconds
    compute_seconds: Seconds | None = None
    dataloader_wait_seconds: Seconds | None = None
    optimizer_seconds: Seconds | None = None
    outside_model_seconds: Seconds | None = None
    exposed_collective_seconds: Seconds | None = None
    cpu_seconds: Seconds | None = None
    cpu_wait_seconds: Seconds | None = None
    pipeline: Pipeline | None = None
    collectives: Annotated[dict[str, CollectiveTotals], KnownKeys(COLLECTIVE_OPS)] | None = None
    gradient_sync_bytes: Count | None = None
    collective_calls: Annotated[dict[Annotated[Label, most(64)], Count], most(17)] | None = None
    groups: Annotated[dict[Annotated[Label, most(64)], GroupTotals], most(17)] | None = None
    #: A diverging run is data, not an error: NaN and Infinity are allowed.
    loss: MaybeNonFinite | None = None
    grad_norm: Annotated[MaybeNonFinite, WhenFinite(ge=0.0)] | None = None
    nonfinite: bool | None = None
    loss_scale: NonNegative | None = None
    lr: NonNegative | None = None
    #: ± COSINE_TOLERANCE for rounding.
    grad_cosine_similarity: Annotated[float, msgspec.Meta(ge=-1 - COSINE_TOLERANCE,
                                                          le=1 + COSINE_TOLERANCE)] | None = None
    #: A float, or a hex digest for checksums that are not floats.
    param_checksum: float | Annotated[str, msgspec.Meta(pattern=HEX_PATTERN)] | None = None
    memory: Memory | None = None
    tokens: Count | None = None
    samples: Count | None = None
    unavailable: Annotated[dict[Annotated[str, OneOf(UNAVAILABLE_SIGNALS)],
                                Annotated[str, OneOf(tuple(UNAVAILABLE_REASONS))]],
                           most(len(UNAVAILABLE_SIGNALS))] | None = None
    model_flops_per_second: NonNegative | None = None
    mfu: Ratio | None = None
    client: ClientCounters | None = None
    folded: Folded | None = None


# --- probe -----------------------------------------------------------------------------------------------------------


class ProbeResult(Fields):
    """One op and message size of a probe: the slowest rank's mean time and the bandwidths it gives."""

    op: Annotated[str, OneOf(PROBE_OPS)]
    bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
    seconds: Seconds
    algbw_bytes_per_second: NonNegative
    busbw_bytes_per_second: NonNegative


class Probe(CommonFields, tag="probe"):
    """The result of ``gpuwatch probe``, sent once by its rank 0."""

    hostname: Annotated[Label, most(255)]
    nodes: Size
    world_size: Size
    ranks_per_node: Size
    backend: Annotated[Label, most(32)]
    device: Annotated[Label, most(32)]
    interconnect: Annotated[str, OneOf(INTERCONNECTS)]
    results: Annotated[list[ProbeResult], most(MAX_PROBE_RESULTS)]
    hostnames: Annotated[list[Annotated[Label, most(255)]], most(MAX_PROBE_HOSTNAMES)] | None = None
    dtype: Annotated[Label, most(32)] | None = None


# --- progress --------------------------------------------------------------------------------------------------------


class InFlight(Fields):
    """The collective a stalled rank is in: its group, the rank's place in it, its per-group number, its age."""

    op: Annotated[str, OneOf(COLLECTIVE_OPS)]
    group: Annotated[Label, most(64)]
    group_size: Size
    group_rank: Rank
    seq: Annotated[int, msgspec.Meta(ge=1, le=2**53)]
    bytes: Count
    seconds: Seconds


class StackFrame(Fields):
    """One frame of the training thread's stack."""

    file: Annotated[str, most(MAX_TEXT_CHARS)]
    line: Annotated[int, msgspec.Meta(ge=0, le=2**31)]
    function: Annotated[str, most(MAX_TEXT_CHARS)]


class RecorderEntry(Fields):
    """The oldest collective (or send/recv) PyTorch's Flight Recorder has not seen finish on a stalled rank: its op,
    torch's name and description of its process group, its per-group number, whether point-to-point, its state."""

    op: Annotated[Label, most(64)]
    group: Annotated[str, most(MAX_GROUP_TEXT_CHARS)]
    seq: Annotated[int, msgspec.Meta(ge=0, le=2**53)]
    p2p: bool
    state: Annotated[Label, most(32)]
    group_desc: Annotated[str, most(MAX_GROUP_TEXT_CHARS)] | None = None


class StepError(Fields):
    """The exception a step raised."""

    type: Annotated[Label, most(128)]
    message: Annotated[str, most(MAX_TEXT_CHARS)]


class Progress(CommonFields, tag="progress"):
    """What an overdue (or failed, or closed) rank's training thread is doing."""

    step: StepNumber
    phase: Annotated[str, OneOf(PHASES)]
    stalled_seconds: Seconds
    overdue_seconds: Seconds
    collective: InFlight | None = None
    stack: Annotated[list[StackFrame], most(MAX_STACK_FRAMES)] | None = None
    error: StepError | None = None
    flight_recorder: RecorderEntry | None = None
    cpu_seconds: Seconds | None = None



#: A record's body, of any kind: what ``schema.decode`` hands back.
Body: TypeAlias = Hello | Step | Probe | Progress
