"""The numbers and vocabularies of the telemetry wire format (``schema.py`` documents it): the bounds and choices the
record structs of ``records.py`` are declared with, and the constants the clients, the agent and diagnosis share.

A module of its own because both ``records.py`` (which states each field with them) and ``schema.py`` (which derives
the checks from those statements, and re-exports these names for the many modules that import them from it) need
them, and ``schema.py`` imports ``records.py``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

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
MAX_COUNT = 2**63 - 1
#: What a Prometheus label value taken from a record may hold, and a checksum that is not a float: anchored at both
#: ends for msgspec, which searches its patterns (``\\Z``: ``$`` would also match before a final newline).
LABEL_PATTERN = r"^(?:[A-Za-z0-9_.:+/-]+)\Z"
HEX_PATTERN = r"^(?:[0-9a-fA-F]{1,64})\Z"

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
#: The names a hello's environment may carry, as one pattern (anchored for msgspec, as ``LABEL_PATTERN``): a name of
#: at most 128 characters of ``[A-Z0-9_]`` (not starting with a digit), holding no ENV_DENY word, under an
#: ENV_PREFIXES prefix or one of ENV_NAMES. msgspec checks a hello's names against it; ``env_name_allowed`` is it.
ENV_NAME_PATTERN = (
    r"^(?=[A-Z_][A-Z0-9_]{0,127}\Z)"
    rf"(?!.*(?:{'|'.join(map(re.escape, ENV_DENY))}))"
    rf"(?:{'|'.join(map(re.escape, ENV_PREFIXES))}|(?:{'|'.join(map(re.escape, sorted(ENV_NAMES)))})\Z)"
)
_ENV_NAME_ALLOWED = re.compile(ENV_NAME_PATTERN)


def env_name_allowed(name: str) -> bool:
    """Whether a variable may be copied into a hello: allowlisted and not secret-looking."""
    return _ENV_NAME_ALLOWED.search(name) is not None
