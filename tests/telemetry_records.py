"""Telemetry test helpers: valid records built the way the hooks build them (tp=2, pp=2, dp=2), and a
reader for the series they turn into."""

from __future__ import annotations

import re
import time
from typing import Any

from gpuwatch.protocol.schema import COLLECTIVE_BUCKETS, SCHEMA_VERSION, bucket_index

JOB = "job-42"


def hello(rank: int = 0, job: str = JOB, **fields: Any) -> dict[str, Any]:
    record = {
        "v": SCHEMA_VERSION, "kind": "hello", "job": job, "rank": rank, "local_rank": rank % 4,
        "world_size": 8, "tp_size": 2, "pp_size": 2, "dp_size": 2,
        "tp_rank": rank % 2, "dp_rank": rank // 2 % 2, "pp_stage": rank // 4,
        "schedule": "1f1b", "micro_batches": 4, "precision": "bf16", "hostname": "node-1", "pid": 4000 + rank,
        "gpu": {"index": rank % 4, "uuid": f"GPU-0000000{rank}-1111-2222-3333-444444444444"},
        "torch_version": "2.13.0+cpu", "nccl_version": "2.21.5",
        "process_groups": {"tp": [rank - rank % 2, rank - rank % 2 + 1]},
        "env": {"NCCL_DEBUG": "WARN", "CUDA_VISIBLE_DEVICES": "0,1,2,3"},
        "faults": ["slow_rank"], "time": time.time(),
    }
    record.update(fields)
    return record


def collectives(latencies: dict[str, list[float]]) -> dict[str, Any]:
    """Per-op stats of one step, pre-bucketed as the client does; 1 MiB per call."""
    out = {}
    for op, seconds in latencies.items():
        buckets = [0] * (len(COLLECTIVE_BUCKETS) + 1)
        for value in seconds:
            buckets[bucket_index(value)] += 1
        out[op] = {"count": len(seconds), "bytes": len(seconds) << 20, "seconds": sum(seconds), "buckets": buckets}
    return out


def step(rank: int = 0, number: int = 1, job: str = JOB, **fields: Any) -> dict[str, Any]:
    """A healthy step of a model that learns: its loss and parameter checksum move from step to step."""
    record = {
        "v": SCHEMA_VERSION, "kind": "step", "job": job, "rank": rank, "step": number, "time": time.time(),
        "step_seconds": 0.5, "compute_seconds": 0.3, "dataloader_wait_seconds": 0.01, "optimizer_seconds": 0.02,
        "pipeline": {"busy_seconds": 0.4, "idle_seconds": 0.1, "bubble_ratio": 0.2,
                     "bubble_ratio_theoretical": 0.2},
        "collectives": collectives({"all_reduce": [0.0015, 0.003], "send": [0.00004]}),
        "loss": 2.5 - 0.001 * (number - 1), "grad_norm": 1.25, "nonfinite": False, "loss_scale": 1024.0, "lr": 0.001,
        "grad_cosine_similarity": 0.9, "param_checksum": 1234.5 + (number - 1),
        "memory": {"kind": "cuda", "peak_bytes": 3 << 30, "allocated_bytes": 2 << 30, "reserved_bytes": 4 << 30,
                   "inactive_split_bytes": 1 << 20, "alloc_retries": 1, "ooms": 0},
        "tokens": 4096, "model_flops_per_second": 1.5e12, "mfu": 0.25,
    }
    record.update(fields)
    return record


def plain_step(rank: int = 0, number: int = 1, job: str = JOB, **fields: Any) -> dict[str, Any]:
    """A step with nothing sampled or non-finite in it (no memory reading, gradient similarity or checksum): what the
    hooks send on most steps, and what a client folds into a later step (``TelemetryClient``'s ``fold_seconds``)."""
    record = step(rank, number, job, **fields)
    for news in ("memory", "grad_cosine_similarity", "param_checksum", "nonfinite"):
        record.pop(news, None)
    return record


def probe(job: str = JOB, interconnect: str = "infiniband", busbw: float = 40e9, **fields: Any) -> dict[str, Any]:
    """A probe record of 2 ranks, one per node: all-reduce and all-gather at 1 and 64 MiB; the 64 MiB all-reduce
    peaks at ``busbw``, all-gather at 90 % of it (n=2: busbw = algbw for all-reduce, algbw / 2 for all-gather)."""
    results = []
    for op, factor, share in (("all_reduce", 1.0, 1.0), ("all_gather", 0.5, 0.9)):
        for size, ramp in ((1 << 20, 0.25), (64 << 20, 1.0)):
            bus = busbw * share * ramp
            results.append({"op": op, "bytes": size, "seconds": size * factor / bus,
                            "algbw_bytes_per_second": bus / factor, "busbw_bytes_per_second": bus})
    record = {
        "v": SCHEMA_VERSION, "kind": "probe", "job": job, "rank": 0, "time": time.time(), "hostname": "node-1",
        "nodes": 2, "hostnames": ["node-1", "node-2"], "world_size": 2, "ranks_per_node": 1, "backend": "nccl",
        "device": "cuda", "interconnect": interconnect, "dtype": "float32", "results": results,
    }
    record.update(fields)
    return record


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str) -> dict[frozenset, float]:
    """{frozenset of (label, value): value} for one series name in exposition text."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name):].rsplit(" ", 1)
            out[frozenset(_LABEL.findall(labels))] = float(value)
    return out


def coordinates(rank: int, **extra: str) -> frozenset:
    """The label set of a rank of telemetry_records' tp=2 pp=2 dp=2 layout."""
    labels = {"job": JOB, "rank": str(rank), "local_rank": str(rank % 4), "tp_rank": str(rank % 2),
              "dp_rank": str(rank // 2 % 2), "pp_stage": str(rank // 4), **extra}
    return frozenset(labels.items())


def progress(rank: int = 0, job: str = JOB, stalled: float = 10.0, collective: dict[str, Any] | None = None,
             **fields: Any) -> dict[str, Any]:
    """An overdue rank's progress record: in `collective` (op, group, seq ...) if given, else in its compute."""
    record: dict[str, Any] = {
        "v": SCHEMA_VERSION, "kind": "progress", "job": job, "rank": rank, "time": time.time(), "step": 3,
        "phase": "collective" if collective else "compute", "stalled_seconds": stalled, "overdue_seconds": 3.0}
    if collective is not None:
        record["collective"] = {"op": "all_reduce", "group": "dp", "group_size": 2, "group_rank": 0, "seq": 7,
                                "bytes": 1024, "seconds": stalled, **collective}
    record.update(fields)
    return record


def closed(rank: int = 0, job: str = JOB, **fields: Any) -> dict[str, Any]:
    """The progress record of a rank whose hooks closed (``fields``: its ``time``, its process's ``cpu_seconds``)."""
    return progress(rank, job, stalled=0.0, phase="closed", overdue_seconds=0.0, **fields)
