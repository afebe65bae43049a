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
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Literal

import msgspec

from gpuwatch.protocol.records import (
    Body,
    ClientCounters,
    CollectiveTotals,
    Fields,
    Folded,
    FoldedPipeline,
    FoldedStep,
    Gpu,
    GroupTotals,
    Hello,
    InFlight,
    Memory,
    ModelShapeFields,
    Pipeline,
    Probe,
    ProbeResult,
    Progress,
    RecorderEntry,
    StackFrame,
    Step,
    StepError,
    convert,
)

SCHEMA_VERSION = 1
#: Larger datagrams are rejected unread. A step record is ~1.5 KiB; a hello with a few dozen
#: environment variables and process-group members for a 1,000-way DP group stays well below.
MAX_RECORD_BYTES = 16 * 1024
#: Steps a step record may carry folded (``folded``): with the record itself, 16 steps a datagram, which a rank of
#: the usual shape fills in well under 16 KiB.
MAX_FOLDED_STEPS = 15
#: How deep an *unknown* field may nest; known fields have a fixed shape.
MAX_UNKNOWN_DEPTH = 4

#: Upper bounds (seconds, ``le``) of the collective latency histogram: 1-2-5 per decade from
#: 10 µs (a small intra-node all-reduce) to 10 s (a stalled collective); the overflow bucket is +Inf.
COLLECTIVE_BUCKETS: tuple[float, ...] = (
    1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3,
    0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather",
                  "scatter", "barrier", "send", "recv")
#: The point-to-point ops among them: pairs of ranks, not the whole group, take part (not in ``collective_calls``).
P2P_OPS = frozenset({"send", "recv"})
MEMORY_KINDS = ("cuda", "host_rss")
#: What a rank's training thread can be in, as a progress record says.
PHASES = ("data", "compute", "optimizer", "collective", "step", "idle", "closed")
#: A step record's phases, in the order they are listed: each field's seconds, net of the collectives waited for
#: inside it; with ``exposed_collective_seconds`` they sum to ``step_seconds``.
STEP_PHASES = {"data": "dataloader_wait_seconds", "compute": "compute_seconds", "optimizer": "optimizer_seconds",
               "outside_model": "outside_model_seconds"}
#: A rank's hooks send progress records once its step is overdue: no progress for this many times its median step ...
OVERDUE_FACTOR = 5.0
#: ... and for at least this long (seconds): a pause of a second or two is scheduling, not a hang.
OVERDUE_FLOOR_SECONDS = 3.0
#: The innermost frames of a stalled rank's stack that a progress record carries, and a frame's text fields.
MAX_STACK_FRAMES = 32
MAX_TEXT_CHARS = 512
#: A progress record's ``flight_recorder``: the longest process-group name or description it carries.
MAX_GROUP_TEXT_CHARS = 128
#: The most notes a hello carries.
MAX_NOTES = 8
#: The pipeline schedules the instrumentation names in a hello's ``schedule``: torch.distributed.pipelining's
#: schedule classes in snake case (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS,
#: ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV). Not enforced: a framework's own
#: schedule is sent under its own label, whose theoretical bubble diagnosis then does not know.
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble",
                      "dualpipev")
#: A hello's ``stage_modules``: at most this many module names, each at most this long.
MAX_STAGE_MODULES = 64
MAX_MODULE_NAME_CHARS = 128
#: Optional memory fields: allocator state on CUDA; host_rss reports only peak_bytes.
MEMORY_COUNTS = ("allocated_bytes", "reserved_bytes", "inactive_split_bytes", "alloc_retries", "ooms")
#: Why a client dropped a record instead of sending it.
CLIENT_DROP_REASONS = ("no_agent", "busy", "too_large", "encode_error", "error")
REJECT_REASONS = (
    "too_large", "not_json", "too_deep", "not_object", "bad_version", "bad_kind",
    "missing_field", "bad_type", "out_of_range", "not_finite", "bad_label",
    "cardinality",  # raised by the agent's store, not by decode: too many jobs or ranks
)
COSINE_TOLERANCE = 1e-3
#: Signals a step record may report as not computable (``unavailable``), and why; the reason's text is what
#: ``gpuwatch diagnose`` prints for a rule that could not run for want of that signal.
UNAVAILABLE_SIGNALS = ("grad_cosine_similarity", "grad_norm", "param_checksum")
UNAVAILABLE_REASONS: Mapping[str, str] = {
    "zero_gradient": "every gradient element was zero, so there is no direction to compare (the model does "
                     "not learn: see CONV006)",
    "nonfinite_gradient": "the gradients held NaN or Inf",
    "no_gradient_seen": "no gradient reached the hooks this step (no backward, or no DDP bucket was reduced)",
    "no_data_parallel_group": "the rank has no data-parallel peers (data-parallel size 1)",
    "no_parameters": "the Monitor was given no model, so it has no parameters to read",
}
#: The frameworks ``gpuwatch run`` tells apart (a hello's ``framework``), "plain" for a loop of the user's own.
FRAMEWORKS = ("torchtitan", "megatron", "lightning", "transformers", "accelerate", "plain")
#: What a rank instrumented from outside (``gpuwatch run``, no code of the user's calling gpuwatch) cannot measure,
#: and why: its hello lists them (``unavailable_from_outside``).
UNAVAILABLE_FROM_OUTSIDE: Mapping[str, str] = {
    "tokens": "the tokens a step processes are known to the training loop only",
    "samples": "the samples a step processes are known to the training loop only",
    "mfu": "model FLOP/s and MFU need the tokens per step and the model's FLOPs per token",
    "loss_scale": "an AMP loss scale is seen only from torch.amp.GradScaler.scale (a framework's own scaler is not "
                  "seen, and the loss reported is then the scaled tensor backward() was called on)",
    "pipeline": "a pipeline schedule's busy and idle time needs the schedule's own marks",
    "ddp_bucket_latency": "under a built-in C++ communication hook (registered before gpuwatch's), DDP's all-reduce "
                          "is timed as one tail per backward, not per bucket",
    "layout": "which ranks are data-parallel replicas doing the same work is known only from gpuwatch run --layout, "
              "Megatron's parallel state, a device mesh over every rank (torchtitan's) or a DDP model spanning "
              "every rank, so ranks are not compared as peers",
    "gradients": "each rank's whole gradient and parameters are seen only under a DistributedDataParallel model: a "
                 "sharded (FSDP) or model-parallel rank holds a shard, so the gradient cosine similarity and the "
                 "parameter checksum are not measured, and the gradient norm only where the job clips it "
                 "(torch.nn.utils.clip_grad_norm_ returns it)",
}
#: What ``gpuwatch probe`` measures, and how it names the path its traffic took.
PROBE_OPS = ("all_reduce", "all_gather", "reduce_scatter")
INTERCONNECTS = ("nvlink", "pcie", "infiniband", "roce", "socket", "loopback", "unknown")
#: A probe record must fit one datagram: 90 rows (3 ops × 30 sizes) of ~125 bytes and 8 long hostnames do.
MAX_PROBE_RESULTS = 90
MAX_PROBE_HOSTNAMES = 8

MAX_RANK = 2**20 - 1
_MAX_COUNT = 2**63 - 1
_LABEL = re.compile(r"[A-Za-z0-9_.:+/-]+")
_HEX = re.compile(r"[0-9a-fA-F]{1,64}")

# The environment a hello may carry: names under these prefixes, plus a few launcher variables,
# minus anything that looks like a secret even under an allowed prefix. Deliberately coarse:
# NCCL_IB_PKEY is dropped with the rest for containing KEY.
ENV_PREFIXES = ("NCCL_", "TORCH_", "PYTORCH_", "CUDA_")
ENV_NAMES = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
})
ENV_DENY = ("KEY", "TOKEN", "SECRET", "PASSW", "CREDENTIAL", "AUTH", "COOKIE")
MAX_ENV_VARS = 128
MAX_COMMAND_ARGS = 64
MAX_COMMAND_ARG_CHARS = 256
REDACTED = "<redacted>"
MAX_ENV_VALUE_CHARS = 1024
#: The part of a hello's environment the agent exports as ``gpuwatch_train_env_info`` series: the variables
#: diagnosis rules read, so that ``gpuwatch diagnose --prometheus`` can judge them. A fixed list keeps it to at
#: most this many series per rank; values longer than MAX_EXPORTED_ENV_VALUE_CHARS are not exported (a cut
#: interface list would read as another setting), they stay in /api/v1/state.
EXPORTED_ENV = ("NCCL_ALGO", "NCCL_IB_DISABLE", "NCCL_IB_GID_INDEX", "NCCL_NET", "NCCL_P2P_DISABLE",
                "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE", "NCCL_SOCKET_IFNAME", "PYTORCH_CUDA_ALLOC_CONF")
MAX_EXPORTED_ENV_VALUE_CHARS = 128
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")


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


def env_name_allowed(name: str) -> bool:
    """Whether a variable may be copied into a hello: allowlisted and not secret-looking."""
    if not _ENV_NAME.fullmatch(name) or any(word in name for word in ENV_DENY):
        return False
    return name in ENV_NAMES or name.startswith(ENV_PREFIXES)


def bucket_index(seconds: float) -> int:
    """Index into a record's ``buckets`` list for one collective's latency."""
    return bisect.bisect_left(COLLECTIVE_BUCKETS, seconds)


def encode(record: Mapping[str, Any]) -> bytes:
    """Serialise a record for one datagram; non-finite floats as ``NaN``/``Infinity``.

    Raises TypeError/ValueError for what JSON cannot carry; the size limit is the caller's to check.
    """
    return json.dumps(record, separators=(",", ":")).encode()


# --- validation: small composable fields, each stated once in two forms --------------------------------------------
#
# A step record is checked 64 times a second on a node of 64 ranks. ``check``, in Python, costs ~16 µs a step record;
# msgspec (https://jcristharif.com/msgspec/), which parses and checks against a type in C, ~5 µs
# (benchmarks/CHANGELOG.md, Agent cost), straight into the typed body (``protocol.records``). Each field below states
# its rule once and yields both forms: a record msgspec accepts is one ``check`` accepts, decoded to the same body;
# anything msgspec refuses, ``check`` judges whole, and its verdict (and reason code) stands, its body then converted
# to the same struct.
# tests/test_telemetry_schema.py holds the two to that.


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    """One field's rule. ``check`` validates a parsed JSON value and returns it normalised (ints as floats where a
    float is expected, unknown fields and null optional ones dropped), or raises RecordRejected saying why.
    ``type`` is the same rule as a msgspec type, or None where msgspec cannot state it (the environment's allowlist
    drops names instead of refusing them). It may refuse more than ``check`` (an unknown field, ``NaN``, a number
    past a double's range): such a record is judged by ``check`` alone."""

    check: Callable[[Any], Any]
    type: Any = None
    #: The structure, which ``protocol/records.py``'s typed structs restate and tests/test_telemetry_records.py holds
    #: them to: an object's fields and which are required; a list's items' or a mapping's values' rule.
    fields: Mapping[str, _Field] | None = None
    required: frozenset[str] = frozenset()
    item: _Field | None = None


def _range(low: float, high: float) -> msgspec.Meta:
    """A msgspec constraint for ``low <= value <= high``; an infinite bound is no bound."""
    return msgspec.Meta(ge=low if math.isfinite(low) else None, le=high if math.isfinite(high) else None)


def _matching(regex: re.Pattern[str], max_length: int | None = None) -> msgspec.Meta:
    """A msgspec constraint for ``regex.fullmatch``: msgspec searches its pattern, so it is anchored at both ends
    (``\\Z``: ``$`` would also match before a final newline)."""
    return msgspec.Meta(pattern=f"^(?:{regex.pattern})\\Z", max_length=max_length)


def _integer(low: int = 0, high: int = _MAX_COUNT) -> _Field:
    def check(value: Any) -> int:
        if type(value) is not int:
            raise RecordRejected("bad_type")
        if not low <= value <= high:
            raise RecordRejected("out_of_range")
        return value

    return _Field(check, Annotated[int, _range(low, high)])


def _number(low: float = 0.0, high: float = math.inf, *, nonfinite_ok: bool = False) -> _Field:
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


def _label(max_chars: int) -> _Field:
    def check(value: Any) -> str:
        if type(value) is not str:
            raise RecordRejected("bad_type")
        if len(value) > max_chars or not _LABEL.fullmatch(value):
            raise RecordRejected("bad_label")
        return value

    return _Field(check, Annotated[str, _matching(_LABEL, max_chars)])


def _text(max_chars: int) -> _Field:
    """A string never made a label (a file path, a message): any characters, bounded."""
    def check(value: Any) -> str:
        if type(value) is not str:
            raise RecordRejected("bad_type")
        if len(value) > max_chars:
            raise RecordRejected("out_of_range")
        return value

    return _Field(check, Annotated[str, msgspec.Meta(max_length=max_chars)])


def _check_boolean(value: Any) -> bool:
    if type(value) is not bool:
        raise RecordRejected("bad_type")
    return value


_BOOLEAN = _Field(_check_boolean, bool)


def _choice(*allowed: str) -> _Field:
    def check(value: Any) -> str:
        if type(value) is not str:
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

    typed = None if item.type is None else types.GenericAlias(list, item.type)
    return _Field(check, None if typed is None else Annotated[typed, msgspec.Meta(max_length=max_items)], item=item)


def _counts(items: int) -> _Field:
    """Exactly ``items`` counts (the collective buckets), as ``_list(_COUNT, items)`` checks each, with no Python
    call per item when all pass: they are most of the numbers in a step record."""
    def check(value: Any) -> list[int]:
        if type(value) is not list:
            raise RecordRejected("bad_type")
        if len(value) != items:
            raise RecordRejected("out_of_range")
        if not ({*map(type, value)} == {int} and min(value) >= 0 and max(value) <= _MAX_COUNT):
            for index, element in enumerate(value):
                try:
                    _COUNT.check(element)
                except RecordRejected as rejected:
                    raise rejected.within(str(index)) from None
        return value

    typed = types.GenericAlias(list, _COUNT.type)
    return _Field(check, Annotated[typed, msgspec.Meta(min_length=items, max_length=items)], item=_COUNT)


def _mapping(key: _Field, item: _Field, max_items: int) -> _Field:
    def check(value: Any) -> dict[str, Any]:
        if type(value) is not dict:
            raise RecordRejected("bad_type")
        if len(value) > max_items:
            raise RecordRejected("out_of_range")
        out = {}
        for name, element in value.items():
            try:
                out[key.check(name)] = item.check(element)
            except RecordRejected as rejected:
                raise rejected.within(name) from None
        return out

    typed = None if key.type is None or item.type is None else types.GenericAlias(dict, (key.type, item.type))
    return _Field(check, None if typed is None else Annotated[typed, msgspec.Meta(max_length=max_items)], item=item)


def _check_nesting(value: Any, levels_left: int) -> None:
    if type(value) is dict:
        value = value.values()
    elif type(value) is not list:
        return
    if levels_left == 0:
        raise RecordRejected("too_deep")
    for item in value:
        _check_nesting(item, levels_left - 1)


def _object(struct: type[Fields] | None, required: Mapping[str, _Field],
            optional: Mapping[str, _Field] | None = None) -> _Field:
    """A JSON object with these fields, read as ``struct``; a null optional field counts as absent; unknown fields are
    checked for nesting depth and dropped. The fields present are walked, not the schema's: a step record has ~15 of
    the ~35 fields it may carry. Its msgspec form is a subclass of ``struct`` whose fields carry their rules and which
    refuses unknown fields (``check`` judges those records): decoded, the body *is* a ``struct``. A tagged struct (a
    record kind) keeps its tag, so that one decoder tells records apart by it in C."""
    optional = optional or {}
    fields = {**optional, **required}

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

    spec = _Field(check, fields=fields, required=frozenset(required))
    if struct is None:
        return spec
    config = struct.__struct_config__
    members = {name: field for name, field in fields.items() if name != config.tag_field}
    if any(field.type is None for field in members.values()):
        return spec
    typed = msgspec.defstruct(
        struct.__name__,
        [(name, field.type) if name in required else (name, field.type | None, None)
         for name, field in members.items()],
        bases=(struct,), kw_only=True, forbid_unknown_fields=True, tag=config.tag,
    )
    return dataclasses.replace(spec, type=typed)


def _keyed(keys: Iterable[str], item: _Field) -> _Field:
    """A JSON object of some of ``keys``, each an ``item`` (an op's calls, a drop reason's count), read as a dict;
    unknown keys are checked for nesting depth and dropped, as an object's unknown fields are."""
    keys = tuple(keys)
    typed = None if item.type is None else types.GenericAlias(dict, (Literal.__getitem__(keys), item.type))
    return _Field(_object(None, {}, dict.fromkeys(keys, item)).check, typed, item=item)


def _check_environment(value: Any) -> dict[str, str]:
    """Allowed names only: anything else is dropped unread, whatever the client sent."""
    if type(value) is not dict:
        raise RecordRejected("bad_type")
    if len(value) > MAX_ENV_VARS:
        raise RecordRejected("out_of_range")
    out = {}
    for name, text in value.items():
        if not env_name_allowed(name):
            continue
        if type(text) is not str:
            raise RecordRejected("bad_type", name)
        if len(text) > MAX_ENV_VALUE_CHARS:
            raise RecordRejected("out_of_range", name)
        out[name] = text
    return out


def _check_checksum(value: Any) -> float | str:
    """A float, or a hex digest for checksums that are not floats."""
    if type(value) is not str:
        return _ANY_FINITE.check(value)
    if not _HEX.fullmatch(value):
        raise RecordRejected("out_of_range")
    return value


def _unchecked(value: Any) -> Any:
    """For ``v`` and ``kind``, validated before the fields are."""
    return value


_COUNT = _integer()
_SECONDS = _number()
_RATIO = _number(0.0, 1.0)
_ANY_FINITE = _number(-math.inf, math.inf)
_RANK = _integer(0, MAX_RANK)
_SIZE = _integer(1, MAX_RANK + 1)
_CHECKSUM = _Field(_check_checksum, _ANY_FINITE.type | Annotated[str, _matching(_HEX)])

#: One op's calls in a step: a bucket per bound plus the overflow (adding up to the count: ``_check_step``).
_COLLECTIVE = _object(CollectiveTotals, {
    "count": _COUNT, "bytes": _COUNT, "seconds": _SECONDS,
    "buckets": _counts(len(COLLECTIVE_BUCKETS) + 1),
})
_COLLECTIVES = _keyed(COLLECTIVE_OPS, _COLLECTIVE)
#: A diverging run is data, not an error: NaN and Infinity are allowed.
_LOSS = _number(-math.inf, math.inf, nonfinite_ok=True)
_GRAD_NORM = _number(nonfinite_ok=True)

#: ``v`` and ``kind`` are checked by ``decode`` before the fields are; their msgspec form states them.
_COMMON = {"v": _Field(_unchecked, Literal[SCHEMA_VERSION]), "kind": _Field(_unchecked), "job": _label(128),
           "rank": _RANK, "time": _number()}


def _kind(struct: type[Fields], required: Mapping[str, _Field], optional: Mapping[str, _Field]) -> _Field:
    """A record of the kind ``struct`` is tagged with: the common fields and its own."""
    return _object(struct, {**_COMMON, **required}, optional)


_HELLO = _kind(
    Hello,
    {
        "local_rank": _RANK, "world_size": _SIZE,
        "tp_size": _SIZE, "pp_size": _SIZE, "dp_size": _SIZE,
        "tp_rank": _RANK, "pp_stage": _RANK, "dp_rank": _RANK,
        "hostname": _label(255), "pid": _integer(1, 2**22),
    },
    {
        "cpus": _integer(1, 2**20),
        "schedule": _label(32), "micro_batches": _integer(1, MAX_RANK + 1), "precision": _label(32),
        "virtual_stages": _integer(1, 1024),
        "stage_modules": _list(_text(MAX_MODULE_NAME_CHARS), MAX_STAGE_MODULES),
        "gpu": _object(Gpu, {"index": _integer(0, 1023), "uuid": _label(96)}),
        "torch_version": _label(64), "nccl_version": _label(64),
        "process_groups": _mapping(_label(64), _list(_RANK, 65536), 16),
        "env": _Field(_check_environment),
        "faults": _list(_label(64), 32),
        "backends": _mapping(_label(64), _label(32), 17),
        "framework": _choice(*FRAMEWORKS),
        "command": _list(_text(MAX_COMMAND_ARG_CHARS), MAX_COMMAND_ARGS),
        "unavailable_from_outside": _list(_choice(*UNAVAILABLE_FROM_OUTSIDE), len(UNAVAILABLE_FROM_OUTSIDE)),
        "notes": _list(_text(MAX_TEXT_CHARS), MAX_NOTES),
        "model": _object(
            ModelShapeFields,
            dict.fromkeys(("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"), _integer(1, 2**31)),
            {"tied_embeddings": _BOOLEAN, "gated": _BOOLEAN, "bias": _BOOLEAN, "norm_params": _integer(1, 2),
             "positions": _integer(0, 2**31), "source": _label(16)},
        ),
        "global_batch": _integer(1, 2**31), "seq_len": _integer(1, 2**31),
    },
)

_STEP_REQUIRED = {"step": _integer(0, 2**53), "step_seconds": _SECONDS}
_STEP_OPTIONAL = {
    "compute_seconds": _SECONDS, "dataloader_wait_seconds": _SECONDS, "optimizer_seconds": _SECONDS,
    "outside_model_seconds": _SECONDS, "exposed_collective_seconds": _SECONDS,
    "pipeline": _object(
        Pipeline, {"busy_seconds": _SECONDS, "idle_seconds": _SECONDS, "bubble_ratio": _RATIO},
        {"bubble_ratio_theoretical": _RATIO},
    ),
    "collectives": _COLLECTIVES,
    "gradient_sync_bytes": _COUNT,
    "collective_calls": _mapping(_label(64), _COUNT, 17),
    "groups": _mapping(_label(64), _object(GroupTotals, {"bytes": _COUNT, "seconds": _SECONDS}), 17),
    "loss": _LOSS,
    "grad_norm": _GRAD_NORM,
    "nonfinite": _BOOLEAN,
    "loss_scale": _number(),
    "lr": _number(),
    "grad_cosine_similarity": _number(-1.0 - COSINE_TOLERANCE, 1.0 + COSINE_TOLERANCE),
    "param_checksum": _CHECKSUM,
    "memory": _object(
        Memory, {"kind": _choice(*MEMORY_KINDS), "peak_bytes": _COUNT},
        dict.fromkeys(MEMORY_COUNTS, _COUNT),
    ),
    "tokens": _COUNT,
    "samples": _COUNT,
    "unavailable": _mapping(_choice(*UNAVAILABLE_SIGNALS), _choice(*UNAVAILABLE_REASONS), len(UNAVAILABLE_SIGNALS)),
    "model_flops_per_second": _number(),
    "mfu": _RATIO,
    "client": _object(ClientCounters, {"sent": _COUNT, "dropped": _keyed(CLIENT_DROP_REASONS, _COUNT)}),
}
#: What a folded step keeps of its record (``folded.steps``): what the agent's window of recent steps reads. Of
#: ``pipeline``, only ``bubble_ratio``.
FOLDED_STEP_FIELDS = ("step", "time", "step_seconds", "compute_seconds", "dataloader_wait_seconds",
                      "optimizer_seconds", "outside_model_seconds", "exposed_collective_seconds", "pipeline", "loss",
                      "grad_norm")
#: The count-like fields of a step, summed over the folded steps (``folded``).
FOLDED_COUNTS = ("collectives", "tokens", "samples")
_FOLDED_STEP_REQUIRED = ("step", "time", "step_seconds")
_FOLDED_STEP_SPECS = {**_COMMON, **_STEP_REQUIRED, **_STEP_OPTIONAL,
                      "pipeline": _object(FoldedPipeline, {"bubble_ratio": _RATIO})}
_FOLDED = _object(
    Folded,
    {"steps": _list(_object(FoldedStep, {name: _FOLDED_STEP_SPECS[name] for name in _FOLDED_STEP_REQUIRED},
                            {name: _FOLDED_STEP_SPECS[name] for name in FOLDED_STEP_FIELDS
                             if name not in _FOLDED_STEP_REQUIRED}),
                    MAX_FOLDED_STEPS)},
    {name: _STEP_OPTIONAL[name] for name in FOLDED_COUNTS},
)
_STEP = _kind(Step, _STEP_REQUIRED, {**_STEP_OPTIONAL, "folded": _FOLDED})

_PROBE = _kind(
    Probe,
    {
        "hostname": _label(255), "nodes": _SIZE, "world_size": _SIZE, "ranks_per_node": _SIZE,
        "backend": _label(32), "device": _label(32), "interconnect": _choice(*INTERCONNECTS),
        "results": _list(_object(ProbeResult, {
            "op": _choice(*PROBE_OPS), "bytes": _integer(1), "seconds": _SECONDS,
            "algbw_bytes_per_second": _number(), "busbw_bytes_per_second": _number(),
        }), MAX_PROBE_RESULTS),
    },
    {"hostnames": _list(_label(255), MAX_PROBE_HOSTNAMES), "dtype": _label(32)},
)

_PROGRESS = _kind(
    Progress,
    {
        "step": _integer(0, 2**53), "phase": _choice(*PHASES), "stalled_seconds": _SECONDS,
        "overdue_seconds": _SECONDS,
    },
    {
        "collective": _object(InFlight, {
            "op": _choice(*COLLECTIVE_OPS), "group": _label(64), "group_size": _SIZE, "group_rank": _RANK,
            "seq": _integer(1, 2**53), "bytes": _COUNT, "seconds": _SECONDS,
        }),
        "stack": _list(_object(StackFrame, {"file": _text(MAX_TEXT_CHARS), "line": _integer(0, 2**31),
                                "function": _text(MAX_TEXT_CHARS)}), MAX_STACK_FRAMES),
        "error": _object(StepError, {"type": _label(128), "message": _text(MAX_TEXT_CHARS)}),
        "flight_recorder": _object(RecorderEntry, {
            "op": _label(64), "group": _text(MAX_GROUP_TEXT_CHARS), "seq": _integer(0, 2**53), "p2p": _BOOLEAN,
            "state": _label(32),
        }, {"group_desc": _text(MAX_GROUP_TEXT_CHARS)}),
    },
)

_KINDS = {"hello": _HELLO, "step": _STEP, "probe": _PROBE, "progress": _PROGRESS}


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


#: The kinds whose every field has a msgspec form (not the hello: its environment's allowlist drops names), in one
#: decoder that tells them apart by their ``kind`` tag.
_TYPED = msgspec.json.Decoder(functools.reduce(operator.or_, [spec.type for spec in _KINDS.values() if spec.type]))


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
