"""Ingest capacity of the agent's telemetry receiver: step records per second one receiver thread takes.

Prints two figures for full step records (every field, three collective ops, as the hooks send them):

* decode + store in-process, no socket: the CPU cost of validation and bookkeeping;
* end to end: a separate sender process pushes the records through the Unix datagram socket into a
  ``TelemetryCollector`` whose receiver thread decodes and stores them, while the sampler thread
  renders the store every ``--interval`` seconds as in the agent. The sender blocks when the
  socket's queue is full (a rank never would: its client drops instead), so the rate is the
  receiver's, with no record lost.

    python benchmarks/telemetry_ingest.py [--seconds 3] [--ranks 64]
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import tempfile
import threading
import time
from pathlib import Path

from gpuwatch.agent.collectors.base import CollectorContext
from gpuwatch.agent.collectors.telemetry import TelemetryCollector
from gpuwatch.agent.exposition import Renderer
from gpuwatch.agent.telemetry.schema import COLLECTIVE_BUCKETS, encode
from gpuwatch.agent.telemetry.store import TelemetryStore


def step_record(rank: int, number: int) -> bytes:
    buckets = [0] * (len(COLLECTIVE_BUCKETS) + 1)
    buckets[7] = 4
    ops = {op: {"count": 4, "bytes": 4 << 20, "seconds": 0.006, "buckets": buckets}
           for op in ("all_reduce", "send", "recv")}
    return encode({
        "v": 1, "kind": "step", "job": "bench", "rank": rank, "step": number, "time": time.time(),
        "step_seconds": 0.5, "compute_seconds": 0.3, "dataloader_wait_seconds": 0.01, "optimizer_seconds": 0.02,
        "pipeline": {"busy_seconds": 0.4, "idle_seconds": 0.1, "bubble_ratio": 0.2, "bubble_ratio_theoretical": 0.2},
        "collectives": ops, "loss": 2.5, "grad_norm": 1.2, "nonfinite": False, "loss_scale": 1024.0, "lr": 1e-3,
        "grad_cosine_similarity": 0.93, "param_checksum": 12.5,
        "memory": {"kind": "cuda", "peak_bytes": 3 << 30, "allocated_bytes": 2 << 30, "reserved_bytes": 4 << 30,
                   "inactive_split_bytes": 1 << 20, "alloc_retries": 0, "ooms": 0},
        "tokens": 4096, "model_flops_per_second": 1.5e12, "mfu": 0.3,
        "client": {"sent": number, "dropped": {}},
    })


def hello_record(rank: int) -> bytes:
    return encode({"v": 1, "kind": "hello", "job": "bench", "rank": rank, "local_rank": rank, "world_size": 4096,
                   "tp_size": 1, "pp_size": 1, "dp_size": 4096, "tp_rank": 0, "pp_stage": 0, "dp_rank": rank,
                   "hostname": "bench", "pid": 1000 + rank, "time": time.time()})


def in_process(ranks: int, seconds: float) -> float:
    store = TelemetryStore()
    for rank in range(ranks):
        store.ingest(hello_record(rank))
    records = [step_record(rank, 1) for rank in range(ranks)]
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for record in records:
            store.ingest(record)
        done += len(records)
    return done / (time.perf_counter() - started)


def _send(path: str, ranks: int, seconds: float) -> None:
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    for rank in range(ranks):
        sender.sendto(hello_record(rank), path)
    records = [step_record(rank, 1) for rank in range(ranks)]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for record in records:
            sender.sendto(record, path)


def end_to_end(ranks: int, seconds: float, interval: float) -> tuple[float, int]:
    with tempfile.TemporaryDirectory(prefix="gw-bench-") as workdir:
        path = Path(workdir) / "telemetry.sock"
        collector = TelemetryCollector(CollectorContext(telemetry_socket=path))
        stop = threading.Event()

        def sample() -> None:  # what the sampler does every interval
            renderer = Renderer()
            while not stop.wait(interval):
                renderer.render(collector.collect().families)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        sender = multiprocessing.get_context("spawn").Process(target=_send, args=(str(path), ranks, seconds))
        sender.start()
        sender.join()
        time.sleep(0.2)  # the last queued datagrams
        stop.set()
        sampler.join()
        _, records = collector.store.snapshot()
        collector.close()
    accepted = records["accepted", ""] - ranks
    rejected = sum(count for (result, _), count in records.items() if result == "rejected")
    return accepted / seconds, rejected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--interval", type=float, default=1.0, help="sampling interval while receiving")
    args = parser.parse_args()
    print(f"step record: {len(step_record(0, 1))} bytes")
    print(f"decode + store, in-process:           {in_process(args.ranks, args.seconds):8.0f} records/s")
    rate, rejected = end_to_end(args.ranks, args.seconds, args.interval)
    print(f"socket -> receiver thread -> store:   {rate:8.0f} records/s ({args.ranks} ranks, {rejected} rejected)")


if __name__ == "__main__":
    main()
