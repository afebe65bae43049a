"""Telemetry record schema, version 1: one JSON object per Unix datagram, rank → node agent.

Every record carries ``v`` (``SCHEMA_VERSION``), ``kind``, ``job``, ``rank`` and ``time`` (the
rank's wall clock, Unix seconds). Fields marked ``?`` may be absent or null; everything else is
required. Unknown fields are ignored (and not stored), so a newer client can add fields without a
new version; ``v`` changes only for incompatible changes. The agent validates every datagram with
``decode`` and rejects a bad one whole, with a stable reason code (``REJECT_REASONS``).

``hello`` — once per rank at start, and again as a heartbeat (the client re-sends it, so an agent
that restarted learns the rank's layout and a hung-but-alive rank does not expire)::

    job                 label        the training job (Slurm job id, Kubernetes job name, ...)
    rank, local_rank    int          global rank, rank on this node
    world_size          int
    tp_size, pp_size, dp_size        int   parallel sizes (1 when a dimension is unused)
    tp_rank, pp_stage, dp_rank       int   this rank's coordinates, each below its size
    hostname            label
    pid                 int          the rank's process id (in its own pid namespace)
    cpus?               int          CPUs the rank's process may run on (its affinity): with the ranks per
                                     host, whether CPU ranks wait for a CPU (diagnosis without node facts)
    schedule?           label        pipeline schedule (``PIPELINE_SCHEDULES``: torch.distributed.pipelining's
                                     schedule classes in snake case, "gpipe", "1f1b", "interleaved_1f1b", ...);
                                     another label is kept, and diagnosis knows no theoretical bubble for it
    micro_batches?      int
    virtual_stages?     int ≥ 1      pipeline stages this rank holds (an interleaved or V-shaped schedule's
                                     model chunks: 2 for interleaved 1F1B with 2 virtual stages); absent: 1
    stage_modules?      [text]       the names of the modules this rank's pipeline stage holds ("layers.2",
                                     "norm", "output"), at most MAX_STAGE_MODULES of MAX_MODULE_NAME_CHARS: which
                                     layers a slow stage could give away (PERF006)
    precision?          label        "fp32", "bf16", "fp16", ...
    gpu?                {index: int, uuid: label}   NVML index and UUID of the rank's GPU; null on CPU.
                                     The UUID is authoritative: torch's device ordinal differs from
                                     NVML's index under CUDA_VISIBLE_DEVICES.
    torch_version?, nccl_version?    label
    process_groups?     {name: [rank, ...]}   the groups this rank belongs to and their members
    env?                {NAME: str}  captured environment (``env_name_allowed``); the agent drops
                                     any other name again, so a client that leaks one leaks nowhere
    faults?             [label]      fault switches the reference trainer injected on purpose
    backends?           {name: label}  the backend ("nccl", "gloo", ...) of each process group the rank
                                     uses, by the names of ``process_groups``, plus "default" for the
                                     default (world) group: NCCL rules judge only jobs that use NCCL
    framework?          label        the training framework loaded, as ``gpuwatch run`` tells it
                                     (``FRAMEWORKS``: torchtitan, megatron, lightning, transformers,
                                     accelerate, plain)
    command?            [str]        the rank's command line (``sys.orig_argv``), as ``gpuwatch run`` reports it:
                                     at most MAX_COMMAND_ARGS arguments of MAX_COMMAND_ARG_CHARS, the value of
                                     an option whose name holds an ENV_DENY word replaced by REDACTED
    unavailable_from_outside?  [signal]  what a rank instrumented from outside (``gpuwatch run``) cannot
                                     measure, signals of ``UNAVAILABLE_FROM_OUTSIDE``: the rules that need
                                     them say so instead of judging
    notes?              [str]        what the instrumentation found but could not use, a line each (at most
                                     MAX_NOTES of MAX_TEXT_CHARS), e.g. a device mesh it cannot place: diagnosis
                                     from an agent or a run log repeats them in its notes
    model?              {layers, hidden, heads, kv_heads, ffn, vocab: int ≥ 1, tied_embeddings?, gated?,
                         bias?: bool, norm_params?: 1..2, positions?: int, source?: label}   the
                                     transformer's shape, as ``gpuwatch plan`` takes it (gpuwatch.plan.model
                                     .ModelShape; ``source`` "reference" for the reference trainer's GPT): with the
                                     layout, ``global_batch`` and ``seq_len``, diagnosis predicts the step (PLAN
                                     rules)
    global_batch?       int ≥ 1      sequences per optimizer step, over all data-parallel replicas
    seq_len?            int ≥ 1      tokens per sequence

``step`` — one per reported step. Count-like fields (collectives, tokens, alloc_retries, ooms) are
*this step's* increments; the agent accumulates them into counters::

    step                int          the step number
    step_seconds        float ≥ 0    wall time of the whole step
    compute_seconds?, dataloader_wait_seconds?, optimizer_seconds?, outside_model_seconds?   float ≥ 0
                                     the step's phases (STEP_PHASES), each net of the collectives waited
                                     for inside it: the time in the data loader's ``__next__``; forward and
                                     backward (one run inside an optimizer closure too); the update; and
                                     outside the model, the rest of the host's time (callbacks, logging,
                                     evaluation, checkpointing). With ``exposed_collective_seconds`` they
                                     sum to ``step_seconds``.
    exposed_collective_seconds?  float ≥ 0   time the training thread waited on collectives this step:
                                     blocking calls whole, overlapped ones (DDP buckets) from the last
                                     launch to the end of the phase. Waiting for late peers and the
                                     transfer itself together; diagnosis splits them across ranks.
    cpu_seconds?, cpu_wait_seconds?   float ≥ 0   CPU ranks: the training thread's time on a CPU, and its
                                     time ready to run but waiting for one, from the step's start to its end
                                     (Linux's /proc/thread-self/schedstat): the wait is the host's shortage of
                                     cores, not the rank's work, and diagnosis takes it out of the busy time,
                                     never below the time on a CPU (window.BUSY)
    pipeline?           {busy_seconds, idle_seconds: float ≥ 0,
                         bubble_ratio, bubble_ratio_theoretical?: 0..1}
    collectives?        {op: {count, bytes: int, seconds: float,
                              buckets: [int] × (len(COLLECTIVE_BUCKETS) + 1)}}
                        op in COLLECTIVE_OPS (others ignored); buckets[i] counts calls with
                        latency ≤ COLLECTIVE_BUCKETS[i] not counted in an earlier bucket, the
                        last one the overflow; sum(buckets) == count. Pre-bucketing on the rank
                        (``bucket_index``) keeps a datagram small whatever the call rate.
    gradient_sync_bytes?  int        bytes DDP all-reduces in a step (every gradient), where no hook
                                     times its calls (no ``collectives`` for them); the step's volume
    collective_calls?   {group: int}  collective calls (not send/recv) the rank made on each process
                                     group (hello names, "default" the world) since its hooks began, as of
                                     the step's end: every member of a group counts the same at the same
                                     step, unless one skipped or added a call
    groups?             {group: {bytes: int, seconds: float ≥ 0}}   this step's timed collective calls (send/recv
                                     included) by process group (hello names): the bytes handed to them and the
                                     seconds the training thread waited on them (as ``exposed_collective_seconds``
                                     counts them): what a plan's traffic and exposed time per group are checked
                                     against
    loss?               float        NaN/±Infinity allowed: a diverging run is data, not an error
    grad_norm?          float ≥ 0    NaN/Infinity allowed, as for loss
    nonfinite?          bool         a non-finite loss or gradient was seen this step
    loss_scale?         float ≥ 0    the AMP grad scaler's scale
    lr?                 float ≥ 0
    grad_cosine_similarity?  -1..1   (± COSINE_TOLERANCE for rounding) every N steps
    param_checksum?     float or hex string   every N steps, compared across DP replicas
    memory?             {kind: "cuda" | "host_rss", peak_bytes: int,
                         allocated_bytes?, reserved_bytes?, inactive_split_bytes?: int,
                         alloc_retries?, ooms?: int}   every N steps: the peak, retries and OOMs since the
                                     previous reading, the rest at this step (host_rss has only peak_bytes)
    tokens?             int          tokens processed by this rank this step
    samples?            int          samples (sequences, images, rows) processed by this rank this step
    unavailable?        {signal: reason}  why a signal due this step could not be computed: signal in
                                     UNAVAILABLE_SIGNALS, reason in UNAVAILABLE_REASONS (e.g.
                                     {"grad_cosine_similarity": "zero_gradient"}); diagnosis repeats it
    model_flops_per_second?  float ≥ 0
    mfu?                0..1
    client?             {sent: int, dropped: {reason: int}}   the client's cumulative send
                                     counters, added by ``TelemetryClient`` (CLIENT_DROP_REASONS)
    folded?             {steps: [{step, time, step_seconds, compute_seconds?, dataloader_wait_seconds?,
                                  optimizer_seconds?, outside_model_seconds?, exposed_collective_seconds?,
                                  cpu_seconds?, cpu_wait_seconds?,
                                  pipeline?: {bubble_ratio}, loss?, grad_norm?}],
                         collectives?, tokens?, samples?}
                        earlier steps the client folded into this record, oldest first (at most
                        MAX_FOLDED_STEPS, each numbered below the next and below this record's step): what the
                        agent keeps of each (its window's timings, loss and gradient norm), and their count-like
                        fields summed (``collectives`` as above, bucket sums included). The agent counts them as
                        steps before this one; every other field of theirs is superseded by this record's. A
                        client folds only plain steps (no ``memory``, sampled signal, ``unavailable`` or
                        non-finite value): one that carries news ends the fold. One datagram then carries the
                        steps of seconds: the agent's cost is per datagram far more than per step. An agent
                        older than this field ignores it, as any unknown field, and counts only the record's
                        own step: upgrade agents before the ranks' clients.

``probe`` — the result of ``gpuwatch probe``, an nccl-tests style sweep of collectives, sent once by
the probe's rank 0; the agent keeps the latest per job, with no TTL (it is a one-off measurement,
judged long after the probe exits)::

    hostname            label        the reporting rank's host
    nodes               int          hosts the probe's ranks ran on, at most world_size
    hostnames?          [label]      the first MAX_PROBE_HOSTNAMES of them, sorted; at most ``nodes``
    world_size          int          ranks in the probe; rank < world_size
    ranks_per_node      int          ranks on the busiest host, at most world_size
    backend             label        "nccl", "gloo", ...
    device              label        "cuda", "cpu", ...
    interconnect        INTERCONNECTS  the path the traffic took, as the prober classified it: "loopback"
                                     (one host, gloo), "socket" (TCP between hosts), "nvlink", "pcie",
                                     "infiniband", "roce", or "unknown" when it could not tell
    dtype?              label        element type of the buffers ("float32")
    results             [{op: PROBE_OPS, bytes: int ≥ 1, seconds: float ≥ 0,
                          algbw_bytes_per_second, busbw_bytes_per_second: float ≥ 0}]
                        1..MAX_PROBE_RESULTS rows, one per op and message size: the slowest rank's
                        mean time, algbw = bytes / seconds, busbw = algbw × the op's bus factor

``progress`` — what a rank is doing, sent by the hooks' watchdog thread (not the training thread) about once
a second while a step is overdue, and once when a step raised: silent while steps flow. What diagnosis needs to
name a hang (who waits in which collective, who never came, what it does instead); and once when the hooks are
closed (phase "closed"), so that a rank's exit after it is a normal end, not a death::

    step                int          the last step the rank completed (0: none yet)
    phase               PHASES       what the training thread is in: "data", "compute", "optimizer",
                                     "collective" (a blocking call or DDP's all-reduce), "step" (inside a
                                     step, between phases), "idle" (between steps) or "closed" (the hooks were
                                     closed: the rank ended its training, and its process may exit)
    stalled_seconds     float ≥ 0    since the training thread last made progress (entered or left a phase,
                                     a collective or a step), on the rank's own clock
    overdue_seconds     float ≥ 0    the threshold it passed: a multiple of its median step, with a floor
    collective?         {op: COLLECTIVE_OPS, group: label, group_size: int ≥ 1, group_rank: int,
                         seq: int, bytes: int, seconds: float ≥ 0}   the collective in flight: its process
                                     group (the name in the hello's ``process_groups``), this rank's
                                     place in it, the per-group sequence number (1 for the first call
                                     on the group; send/recv numbered apart from the collectives, as
                                     ``collective_calls`` counts these), and how long it has been in it
    stack?              [{file: text, line: int, function: text}]   the training thread's Python stack,
                                     outermost first, at most MAX_STACK_FRAMES (the innermost kept), no
                                     locals; once the rank has stalled for a few seconds
    error?              {type: label, message: text}   the exception a step raised (the rank may be
                                     about to die)
    flight_recorder?    {op: label, group: text, group_desc?: text, seq: int, p2p: bool, state: label}
                                     a second source, where PyTorch's Flight Recorder is on: the oldest
                                     collective (or send/recv) it has not seen finish on this rank, by
                                     torch's own account: op ("all_reduce"), torch's name ("0" the
                                     world) and description ("default_pg", a ``group_desc``) of its
                                     process group (at most MAX_GROUP_TEXT_CHARS), its per-group
                                     number (torch's: every call on the group since it was made,
                                     collectives and send/recv apart, so it may run ahead of
                                     ``collective.seq``), its state ("scheduled", "started"; gloo's
                                     stay "scheduled")
    cpu_seconds?        float ≥ 0    with phase "closed": the process's CPU time, user and system, as its hooks
                                     closed (``time.process_time()``): a process that uses none after it and
                                     does not exit is stuck in its teardown, not still at work

Types are strict: an int field takes only JSON integers, a float field integers or floats, never
strings or booleans. Non-finite numbers are written as ``json.dumps`` writes them by default
(``NaN``, ``Infinity``, ``-Infinity``) and are rejected everywhere except ``loss`` and
``grad_norm``; a number too large for a float (``1e999``) counts as infinite. Strings that become
Prometheus labels (``label`` above) are 1..N characters of ``[A-Za-z0-9_.:+/-]``: no quotes,
backslashes, braces or newlines can reach the exposition.

Past 500 lines on purpose: the wire format is documented here (the first ~180 lines) beside the checks that
enforce it, so the two are read and changed together.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
import operator
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Literal

import msgspec

from gpuwatch.protocol.records import (
    Allowlisted,
    Body,
    CollectiveTotals,
    Fields,
    Folded,
    FoldedStep,
    Hello,
    KnownKeys,
    MaybeNonFinite,
    Memory,
    OneOf,
    Probe,
    Progress,
    Refused,
    Step,
    WhenFinite,
    convert,
)

#: The wire format's constants live in ``limits.py`` (``records.py`` declares the fields with them); they are
#: re-exported here, where the clients, the agent and diagnosis import them from.
__all__ = [
    "CLIENT_DROP_REASONS",
    "COLLECTIVE_BUCKETS",
    "COLLECTIVE_OPS",
    "COSINE_TOLERANCE",
    "ENV_DENY",
    "ENV_NAMES",
    "ENV_PREFIXES",
    "EXPORTED_ENV",
    "FOLDED_COUNTS",
    "FOLDED_STEP_FIELDS",
    "FRAMEWORKS",
    "INTERCONNECTS",
    "MAX_COMMAND_ARGS",
    "MAX_COMMAND_ARG_CHARS",
    "MAX_ENV_VALUE_CHARS",
    "MAX_ENV_VARS",
    "MAX_EXPORTED_ENV_VALUE_CHARS",
    "MAX_FOLDED_STEPS",
    "MAX_GROUP_TEXT_CHARS",
    "MAX_MODULE_NAME_CHARS",
    "MAX_NOTES",
    "MAX_PROBE_HOSTNAMES",
    "MAX_PROBE_RESULTS",
    "MAX_RANK",
    "MAX_RECORD_BYTES",
    "MAX_STACK_FRAMES",
    "MAX_STAGE_MODULES",
    "MAX_TEXT_CHARS",
    "MAX_UNKNOWN_DEPTH",
    "MEMORY_COUNTS",
    "MEMORY_KINDS",
    "OVERDUE_FACTOR",
    "OVERDUE_FLOOR_SECONDS",
    "P2P_OPS",
    "PHASES",
    "PIPELINE_SCHEDULES",
    "PROBE_OPS",
    "REDACTED",
    "REJECT_REASONS",
    "SCHEMA_VERSION",
    "STEP_PHASES",
    "UNAVAILABLE_FROM_OUTSIDE",
    "UNAVAILABLE_REASONS",
    "UNAVAILABLE_SIGNALS",
    "Record",
    "RecordRejected",
    "bucket_index",
    "decode",
    "encode",
    "env_name_allowed",
]
from gpuwatch.protocol.limits import (
    CLIENT_DROP_REASONS,
    COLLECTIVE_BUCKETS,
    COLLECTIVE_OPS,
    COSINE_TOLERANCE,
    ENV_DENY,
    ENV_NAMES,
    ENV_PREFIXES,
    EXPORTED_ENV,
    FRAMEWORKS,
    INTERCONNECTS,
    MAX_COMMAND_ARG_CHARS,
    MAX_COMMAND_ARGS,
    MAX_ENV_VALUE_CHARS,
    MAX_ENV_VARS,
    MAX_EXPORTED_ENV_VALUE_CHARS,
    MAX_FOLDED_STEPS,
    MAX_GROUP_TEXT_CHARS,
    MAX_MODULE_NAME_CHARS,
    MAX_NOTES,
    MAX_PROBE_HOSTNAMES,
    MAX_PROBE_RESULTS,
    MAX_RANK,
    MAX_RECORD_BYTES,
    MAX_STACK_FRAMES,
    MAX_STAGE_MODULES,
    MAX_TEXT_CHARS,
    MAX_UNKNOWN_DEPTH,
    MEMORY_KINDS,
    OVERDUE_FACTOR,
    OVERDUE_FLOOR_SECONDS,
    P2P_OPS,
    PHASES,
    PIPELINE_SCHEDULES,
    PROBE_OPS,
    REDACTED,
    REJECT_REASONS,
    SCHEMA_VERSION,
    STEP_PHASES,
    UNAVAILABLE_FROM_OUTSIDE,
    UNAVAILABLE_REASONS,
    UNAVAILABLE_SIGNALS,
    env_name_allowed,
)


class RecordRejected(Exception):
    """A datagram that is not a valid record. ``reason`` is one of REJECT_REASONS."""

    def __init__(self, reason: str, field: str = "") -> None:
        super().__init__(f"{reason}: {field}" if field else reason)
        self.reason = reason
        self.field = field

    def within(self, name: str) -> RecordRejected:
        """The same rejection, with the enclosing field's name prefixed to the path."""
        return RecordRejected(self.reason, f"{name}.{self.field}" if self.field else name)


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """A validated record. ``body`` is its typed struct (``protocol.records``), read by attribute: the known fields
    only, normalised (ints as floats where a float is expected)."""

    kind: str
    job: str
    rank: int
    body: Body


def bucket_index(seconds: float) -> int:
    """Index into a record's ``buckets`` list for one collective's latency."""
    return bisect.bisect_left(COLLECTIVE_BUCKETS, seconds)


def encode(record: Mapping[str, Any]) -> bytes:
    """Serialise a record for one datagram; non-finite floats as ``NaN``/``Infinity``.

    Raises TypeError/ValueError for what JSON cannot carry; the size limit is the caller's to check.
    """
    return json.dumps(record, separators=(",", ":")).encode()


# --- validation: derived from the record structs, each rule in two forms --------------------------------------------
#
# A step record is checked 64 times a second on a node of 64 ranks. ``check``, in Python, costs ~16 µs a step record;
# msgspec (https://jcristharif.com/msgspec/), which parses and checks against a type in C, ~5 µs
# (benchmarks/CHANGELOG.md, Agent cost), straight into the typed body (``protocol.records``). Each field's rule is
# declared once, in its struct's annotation (``protocol/records.py``), and ``_rule`` derives both forms from it: a
# record msgspec accepts is one ``check`` accepts, decoded to the same body; anything msgspec refuses, ``check`` judges
# whole, and its verdict (and reason code) stands, its body then converted to the same struct.
# tests/test_telemetry_schema.py holds the two forms to that, tests/test_telemetry_records.py the declarations to the
# verdicts.


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    """One field's rule. ``check`` validates a parsed JSON value and returns it normalised (ints as floats where a
    float is expected, unknown fields and null optional ones dropped), or raises RecordRejected saying why.
    ``type`` is the same rule as a msgspec type (None for a record's ``kind``, its struct's tag, which ``decode``
    checks itself). It may refuse more than ``check`` (an unknown field, ``NaN``, a number past a double's range, a
    variable off the environment's allowlist, which ``check`` drops): such a record is judged by ``check`` alone."""

    check: Callable[[Any], Any]
    type: Any = None


def _range(low: float, high: float) -> msgspec.Meta:
    """A msgspec constraint for ``low <= value <= high``; an infinite bound is no bound."""
    return msgspec.Meta(ge=low if math.isfinite(low) else None, le=high if math.isfinite(high) else None)


def _integer(low: int, high: int) -> _Field:
    def check(value: Any) -> int:
        if type(value) is not int:
            raise RecordRejected("bad_type")
        if not low <= value <= high:
            raise RecordRejected("out_of_range")
        return value

    return _Field(check, Annotated[int, _range(low, high)])


def _number(low: float, high: float, *, nonfinite_ok: bool = False) -> _Field:
    def check(value: Any) -> float:
        if type(value) is int:
            if not low <= value <= high:  # before float(): a huge int would overflow it
                raise RecordRejected("out_of_range")
            return float(value)
        if type(value) is not float:
            raise RecordRejected("bad_type")
        if not math.isfinite(value):
            if nonfinite_ok:
                return value
            raise RecordRejected("not_finite")
        if not low <= value <= high:
            raise RecordRejected("out_of_range")
        return value

    # JSON as msgspec reads it has no NaN or Infinity: a non-finite value always goes to ``check``.
    return _Field(check, Annotated[float, _range(low, high)])


def _string(pattern: str | None, max_chars: int | None, refused: str) -> _Field:
    """A string of at most ``max_chars`` matching ``pattern`` (each where given), else refused for ``refused``: a
    label's "bad_label", a long text's or a malformed digest's "out_of_range"."""
    regex = None if pattern is None else re.compile(pattern)

    def check(value: Any) -> str:
        if type(value) is not str:
            raise RecordRejected("bad_type")
        if (max_chars is not None and len(value) > max_chars) or (regex is not None and not regex.search(value)):
            raise RecordRejected(refused)
        return value

    return _Field(check, Annotated[str, msgspec.Meta(pattern=pattern, max_length=max_chars)])


def _check_boolean(value: Any) -> bool:
    if type(value) is not bool:
        raise RecordRejected("bad_type")
    return value


_BOOLEAN = _Field(_check_boolean, bool)


def _choice(allowed: tuple[Any, ...]) -> _Field:
    """One of ``allowed``, all of one type (the strings of an op or a phase; ``v``'s version)."""
    of_type = type(allowed[0])

    def check(value: Any) -> Any:
        if type(value) is not of_type:
            raise RecordRejected("bad_type")
        if value not in allowed:
            raise RecordRejected("out_of_range")
        return value

    return _Field(check, Literal.__getitem__(allowed))


def _list(item: _Field, max_items: int) -> _Field:
    def check(value: Any) -> list[Any]:
        if type(value) is not list:
            raise RecordRejected("bad_type")
        if len(value) > max_items:
            raise RecordRejected("out_of_range")
        out = []
        for index, element in enumerate(value):
            try:
                out.append(item.check(element))
            except RecordRejected as rejected:
                raise rejected.within(str(index)) from None
        return out

    return _Field(check, Annotated[types.GenericAlias(list, item.type), msgspec.Meta(max_length=max_items)])


def _counts(items: int, item: _Field, low: int, high: int) -> _Field:
    """Exactly ``items`` integers of ``item`` (``low..high``: the collective buckets), as ``_list`` checks each, with
    no Python call per item when all pass: they are most of the numbers in a step record."""
    def check(value: Any) -> list[int]:
        if type(value) is not list:
            raise RecordRejected("bad_type")
        if len(value) != items:
            raise RecordRejected("out_of_range")
        if not ({*map(type, value)} == {int} and min(value) >= low and max(value) <= high):
            for index, element in enumerate(value):
                try:
                    item.check(element)
                except RecordRejected as rejected:
                    raise rejected.within(str(index)) from None
        return value

    typed = types.GenericAlias(list, item.type)
    return _Field(check, Annotated[typed, msgspec.Meta(min_length=items, max_length=items)])


def _mapping(key: _Field, item: _Field, max_items: int, *, allowlist: bool = False) -> _Field:
    """A JSON object of at most ``max_items`` names, each a ``key``, to values, each an ``item``. Where the key's rule
    is an ``allowlist`` (the environment's names), a name it refuses is dropped unread, which msgspec cannot state:
    its form refuses the record instead, for ``check`` to judge."""
    def check(value: Any) -> dict[str, Any]:
        if type(value) is not dict:
            raise RecordRejected("bad_type")
        if len(value) > max_items:
            raise RecordRejected("out_of_range")
        out = {}
        for name, element in value.items():
            if allowlist and not _passes(key, name):
                continue
            try:
                out[key.check(name)] = item.check(element)
            except RecordRejected as rejected:
                raise rejected.within(name) from None
        return out

    return _Field(check, Annotated[types.GenericAlias(dict, (key.type, item.type)), msgspec.Meta(max_length=max_items)])


def _passes(rule: _Field, value: Any) -> bool:
    """Whether ``rule`` takes ``value``: an allowlist's verdict, which drops a name instead of refusing the record."""
    try:
        rule.check(value)
    except RecordRejected:
        return False
    return True


def _check_nesting(value: Any, levels_left: int) -> None:
    if type(value) is dict:
        value = value.values()
    elif type(value) is not list:
        return
    if levels_left == 0:
        raise RecordRejected("too_deep")
    for item in value:
        _check_nesting(item, levels_left - 1)


def _fields(fields: Mapping[str, _Field], required: Iterable[str]) -> Callable[[Any], dict[str, Any]]:
    """The check of a JSON object with these fields; a null optional field counts as absent; unknown fields are
    checked for nesting depth and dropped. The fields present are walked, not the schema's: a step record has ~15 of
    the ~35 fields it may carry."""
    required = tuple(required)

    def check(value: Any) -> dict[str, Any]:
        if type(value) is not dict:
            raise RecordRejected("bad_type")
        out = {}
        name = ""
        try:
            for name in required:
                if name not in value:
                    raise RecordRejected("missing_field")
            for name, element in value.items():
                field = fields.get(name)
                if field is None:
                    _check_nesting(element, MAX_UNKNOWN_DEPTH)  # unknown: only its depth matters
                elif element is not None or name in required:
                    out[name] = field.check(element)
        except RecordRejected as rejected:
            raise rejected.within(name) from None
        return out

    return check


def _unchecked(value: Any) -> Any:
    """For ``kind``, validated before the fields are (the tag that names a record's struct)."""
    return value


@functools.cache
def _object(struct: type[Fields]) -> _Field:
    """A JSON object read as ``struct``, each field by the rule its annotation declares. Its msgspec form is a
    subclass of ``struct`` whose fields carry their rules and which refuses unknown fields (``check`` judges those
    records): decoded, the body *is* a ``struct``. A tagged struct (a record kind) keeps its tag, so that one decoder
    tells records apart by it in C; the tag itself is checked by ``decode`` before the fields are."""
    config = struct.__struct_config__
    hints = typing.get_type_hints(struct, include_extras=True)
    members = msgspec.structs.fields(struct)
    rules = {field.name: _rule(_without_none(hints[field.name])) for field in members}
    required = [field.name for field in members if field.required]
    tag = {} if config.tag_field is None else {config.tag_field: _Field(_unchecked)}
    typed = msgspec.defstruct(
        struct.__name__,
        [(field.name, rules[field.name].type) if field.required else (field.name, rules[field.name].type | None, None)
         for field in members],
        bases=(struct,), kw_only=True, forbid_unknown_fields=True, tag=config.tag,
    )
    return _Field(_fields({**tag, **rules}, [*tag, *required]), typed)


def _keyed(keys: tuple[str, ...], item: _Field) -> _Field:
    """A JSON object of some of ``keys``, each an ``item`` (an op's calls, a drop reason's count), read as a dict;
    unknown keys are checked for nesting depth and dropped, as an object's unknown fields are."""
    typed = types.GenericAlias(dict, (Literal.__getitem__(keys), item.type))
    return _Field(_fields(dict.fromkeys(keys, item), ()), typed)


def _without_none(hint: Any) -> Any:
    """``X`` of an optional field's ``X | None``: absent or null is the object's to judge, not the value's."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return members[0] if len(members) == 1 else typing.Union.__getitem__(tuple(members))
    return hint


def _parts(hint: Any) -> tuple[Any, dict[str, Any], dict[type, Any]]:
    """An annotation's type, its msgspec constraints (every ``msgspec.Meta`` of it, merged) and its markers by type."""
    base, marks = hint, list[Any]()
    if typing.get_origin(hint) is Annotated:
        base, *marks = typing.get_args(hint)
    meta = {name: value for mark in marks if isinstance(mark, msgspec.Meta) for name in _CONSTRAINTS
            if (value := getattr(mark, name)) is not None}
    return base, meta, {type(mark): mark for mark in marks if not isinstance(mark, msgspec.Meta)}


_CONSTRAINTS = ("ge", "le", "min_length", "max_length", "pattern")


def _rule(hint: Any) -> _Field:
    """The rule a struct field's annotation declares: its type, msgspec's constraints and the markers of
    ``protocol.records`` for what msgspec cannot state. A declaration it cannot read is a TypeError on import."""
    base, meta, marker = _parts(hint)
    origin, args = typing.get_origin(base), typing.get_args(base)
    if OneOf in marker:
        return _choice(marker[OneOf].values)
    if isinstance(base, type) and issubclass(base, Fields):
        return _object(base)
    if base is bool:
        return _BOOLEAN
    if base is int:
        if not {"ge", "le"} <= meta.keys():
            raise TypeError(f"{hint!r}: an integer field declares its range")
        return _integer(meta["ge"], meta["le"])
    if base is float:
        return _number(meta.get("ge", -math.inf), meta.get("le", math.inf))
    if base is MaybeNonFinite:
        bounds = marker.get(WhenFinite, WhenFinite())
        return _number(bounds.ge, bounds.le, nonfinite_ok=True)
    if base is str:
        return _string(meta.get("pattern"), meta.get("max_length"), marker.get(Refused, Refused("out_of_range")).reason)
    if origin is list:
        item = _rule(args[0])
        if "min_length" in meta:  # a fixed number of counts
            _, bounds, _ = _parts(args[0])
            return _counts(meta["min_length"], item, bounds["ge"], bounds["le"])
        return _list(item, meta["max_length"])
    if origin is dict:
        if KnownKeys in marker:
            return _keyed(marker[KnownKeys].keys, _rule(args[1]))
        return _mapping(_rule(args[0]), _rule(args[1]), meta["max_length"], allowlist=Allowlisted in marker)
    if origin in (typing.Union, types.UnionType):
        return _either(*map(_rule, args))
    raise TypeError(f"no rule for {hint!r}")


def _either(number: _Field, text: _Field) -> _Field:
    """A number, or a string of its own rule (a checksum: a float, or a hex digest for checksums that are not)."""
    def check(value: Any) -> Any:
        return text.check(value) if type(value) is str else number.check(value)

    return _Field(check, number.type | text.type)


_KINDS = {str(struct.__struct_config__.tag): _object(struct) for struct in (Hello, Step, Probe, Progress)}

#: What a folded step keeps of its record (``folded.steps``): what the agent's window of recent steps reads. Of
#: ``pipeline``, only ``bubble_ratio``.
FOLDED_STEP_FIELDS = FoldedStep.__struct_fields__
#: The count-like fields of a step, summed over the folded steps (``folded``).
FOLDED_COUNTS = tuple(name for name in Folded.__struct_fields__ if name != "steps")
#: Optional memory fields: allocator state on CUDA; host_rss reports only peak_bytes.
MEMORY_COUNTS = tuple(field.name for field in msgspec.structs.fields(Memory) if not field.required)




def _check_coordinates(hello: Hello) -> None:
    """Each coordinate must lie inside its dimension, or the labels would lie."""
    pairs = (("rank", hello.rank, hello.world_size), ("local_rank", hello.local_rank, hello.world_size),
             ("tp_rank", hello.tp_rank, hello.tp_size), ("pp_stage", hello.pp_stage, hello.pp_size),
             ("dp_rank", hello.dp_rank, hello.dp_size))
    for coordinate, value, size in pairs:
        if value >= size:
            raise RecordRejected("out_of_range", coordinate)


def _check_probe(probe: Probe) -> None:
    """Counts that contradict each other, and a probe that measured nothing, are not a measurement."""
    if not probe.results:
        raise RecordRejected("out_of_range", "results")
    size = probe.world_size
    for field, value, most in (("rank", probe.rank, size - 1), ("nodes", probe.nodes, size),
                               ("ranks_per_node", probe.ranks_per_node, size)):
        if value > most:
            raise RecordRejected("out_of_range", field)
    if len(probe.hostnames or ()) > probe.nodes:
        raise RecordRejected("out_of_range", "hostnames")


def _check_step(step: Step) -> None:
    """Each op's buckets add up to its call count; the steps folded into the record come before it, in order."""
    _check_buckets(step.collectives, "collectives")
    folded = step.folded
    if folded is not None:
        _check_buckets(folded.collectives, "folded.collectives")
        numbers = [point.step for point in folded.steps] + [step.step]
        if any(map(operator.ge, numbers, numbers[1:])):  # an earlier number not below the next
            raise RecordRejected("out_of_range", "folded.steps")


def _check_buckets(collectives: Mapping[str, CollectiveTotals] | None, path: str) -> None:
    for op, calls in (collectives or {}).items():
        if sum(calls.buckets) != calls.count:
            raise RecordRejected("out_of_range", f"{path}.{op}.buckets")


#: Every kind's msgspec form, in one decoder that tells them apart by their ``kind`` tag.
_TYPED = msgspec.json.Decoder(functools.reduce(operator.or_, [spec.type for spec in _KINDS.values()]))


def _parse(datagram: bytes) -> Any:
    """The datagram's JSON value, by msgspec in C; what it refuses that the protocol allows (``NaN`` and
    ``Infinity``, which ``encode`` writes for a diverged loss, integers beyond 64 bits), and anything else it refuses,
    is parsed by the standard library, whose verdict stands."""
    try:
        return msgspec.json.decode(datagram)
    except msgspec.DecodeError:
        return json.loads(datagram.decode("utf-8"))


def _checked(datagram: bytes) -> Body:
    """The record's body as the fields' ``check`` judge it: the reference, which names why a record is refused. The
    body it accepts is converted to its kind's struct, told by its ``kind`` (a check accepts only what the struct
    holds)."""
    try:
        value = _parse(datagram)
    except RecursionError:
        raise RecordRejected("too_deep") from None
    except ValueError:  # UnicodeDecodeError, JSONDecodeError, an integer with too many digits
        raise RecordRejected("not_json") from None
    if type(value) is not dict:
        raise RecordRejected("not_object")
    version = value.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise RecordRejected("bad_version", "v")
    kind = value.get("kind")
    if type(kind) is not str or (spec := _KINDS.get(kind)) is None:
        raise RecordRejected("bad_kind", "kind")
    body: Body = convert(spec.check(value), Body)  # type: ignore[arg-type]  # a union of structs, not one type
    return body


def decode(datagram: bytes) -> Record:
    """Validate one datagram; raise RecordRejected with a stable reason code when it is not a record.

    msgspec's typed decoding takes the usual record; whatever it refuses is judged by the fields' ``check``."""
    if len(datagram) > MAX_RECORD_BYTES:
        raise RecordRejected("too_large")
    try:
        body: Body = _TYPED.decode(datagram)
    except msgspec.DecodeError:  # and its ValidationError
        body = _checked(datagram)
    return _record(body)


def _record(body: Body) -> Record:
    """The record of a body whose fields passed, once the checks across its fields pass."""
    if isinstance(body, Step):
        _check_step(body)
    elif isinstance(body, Hello):
        _check_coordinates(body)
    elif isinstance(body, Probe):
        _check_probe(body)
    return Record(str(body.__struct_config__.tag), body.job, body.rank, body)
