"""Who a rank is: its place in the job (`Layout`), the job's id, and the `hello` record that tells the agent."""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gpuwatch.protocol.schema import SCHEMA_VERSION, RecordRejected, decode, encode
from gpuwatch.trainer.telemetry import captured_environment, new_job_id

#: Where the job id comes from when none is given, in order. torchrun's run id is "none" unless set.
JOB_VARIABLES = ("GPUWATCH_JOB", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
#: Larger groups are left out of the hello, which must fit one datagram; a group of every rank needs no list.
MAX_GROUP_MEMBERS = 512
_NOT_LABEL = re.compile(r"[^A-Za-z0-9_.:+/-]")


def label(text: str, max_chars: int = 128) -> str:
    """`text` made a valid Prometheus label value for the agent: other characters become "_"."""
    return _NOT_LABEL.sub("_", text)[:max_chars] or "_"


@dataclass(frozen=True)
class Layout:
    """Where this rank sits in the job. The defaults describe one process; `data_parallel` plain DDP."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    tp_rank: int = 0
    pp_stage: int = 0
    dp_rank: int = 0
    schedule: str | None = None
    micro_batches: int | None = None
    precision: str | None = None
    #: the process groups this rank belongs to, by name, with their members' global ranks
    process_groups: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: the backend of each of those groups by the same names ("gloo", "nccl", ...; `dist.get_backend(group)`):
    #: diagnosis judges NCCL settings only where NCCL carries the traffic
    backends: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def data_parallel(cls, precision: str | None = None) -> Layout:
        """Every rank of the default process group a data-parallel replica, as under plain DDP."""
        if not _distributed():
            return cls(precision=precision)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        return cls(rank=rank, world_size=world_size, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                   dp_size=world_size, dp_rank=rank, precision=precision,
                   process_groups={"dp": tuple(range(world_size))}, backends={"dp": dist.get_backend()})


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def resolve_job(explicit: str | None = None, environ: Mapping[str, str] = os.environ) -> str:
    """The job id every rank reports: `explicit`, else the first of JOB_VARIABLES that is set, else
    one generated on rank 0 and broadcast (a collective: every rank must call this together)."""
    for candidate in (explicit, *(environ.get(name) for name in JOB_VARIABLES)):
        if candidate and candidate != "none":
            return label(candidate)
    job = [new_job_id()]
    if _distributed() and dist.get_world_size() > 1:
        dist.broadcast_object_list(job, src=0)
    return job[0]


def gpu_identity(device: torch.device) -> dict[str, Any] | None:
    """NVML index and UUID of the rank's GPU (None on the CPU). The UUID is what the agent joins on;
    the index is NVML's where NVML answers, which differs from torch's ordinal under CUDA_VISIBLE_DEVICES."""
    if device.type != "cuda":
        return None
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"  # torch drops NVML's prefix
    index = _nvml_index(uuid)
    if index is None:
        index = torch.cuda.current_device() if device.index is None else device.index
    return {"index": index, "uuid": label(uuid, 96)}


def _nvml_index(uuid: str) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver library, a MIG instance, an old NVML: torch's ordinal will do
        return None


def _nccl_version(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _cpus() -> int | None:
    """CPUs this process may run on (its affinity, which a container or `taskset` narrows), else the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count()


def hello_record(job: str, layout: Layout, device: torch.device) -> dict[str, Any]:
    """The rank's `hello` (gpuwatch.protocol.schema): layout, build, GPU, environment."""
    record: dict[str, Any] = {
        "v": SCHEMA_VERSION, "kind": "hello", "job": job, "rank": layout.rank, "time": time.time(),
        "local_rank": layout.local_rank, "world_size": layout.world_size,
        "tp_size": layout.tp_size, "pp_size": layout.pp_size, "dp_size": layout.dp_size,
        "tp_rank": layout.tp_rank, "pp_stage": layout.pp_stage, "dp_rank": layout.dp_rank,
        "hostname": label(socket.gethostname(), 255), "pid": os.getpid(), "cpus": _cpus(),
        "schedule": layout.schedule, "micro_batches": layout.micro_batches, "precision": layout.precision,
        "gpu": gpu_identity(device), "torch_version": label(torch.__version__, 64),
        "nccl_version": _nccl_version(device),
        "process_groups": {name: list(members) for name, members in layout.process_groups.items()
                           if len(members) <= MAX_GROUP_MEMBERS},
        "env": captured_environment(),
        "backends": _backends(layout),
    }
    return {name: value for name, value in record.items() if value is not None}



def hello_with(record: dict[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """The hello with the caller's `fields` added (`Monitor(hello=...)`); ValueError, naming the field, when the
    schema refuses it."""
    if "kind" in fields or "v" in fields:
        raise ValueError("Monitor(hello=...) may not set the record's kind or version")
    merged = {**record, **fields}
    try:
        decode(encode(merged))
    except RecordRejected as error:
        raise ValueError(f"Monitor(hello=...) makes an invalid hello: {error}") from None
    except (TypeError, ValueError) as error:  # not JSON
        raise ValueError(f"Monitor(hello=...) makes an invalid hello: {error}") from None
    return merged

def _backends(layout: Layout) -> dict[str, str] | None:
    """The hello's `backends`: the layout's, plus the default group's as "default"; None without torch.distributed.
    Made labels: a group with a backend per device reports "cpu:gloo,cuda:nccl", and "," is no label character."""
    if not _distributed():
        return None
    return {name: label(backend, 32) for name, backend in {"default": dist.get_backend(), **layout.backends}.items()}
