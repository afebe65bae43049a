"""Ingest capacity of the agent's telemetry receiver: step records per second one receiver thread takes.

Prints three figures for full step records (every field, three collective ops, as the hooks send them):

* decode + store in-process, no socket: the CPU cost of validation and bookkeeping;
* end to end: a separate sender process pushes the records through the Unix datagram socket into a
  ``TelemetryCollector`` whose receiver thread queues them, applied in batches (by the receiver past
  ``MAX_PENDING_BYTES``, or by the sampler thread as a round's render reads the store), while the sampler thread
  renders a round every ``--interval`` seconds as in the agent. The sender blocks when the
  socket's queue is full (a rank never would: its client drops instead), so the rate is the
  receiver's, with no record lost.

* offered load: a paced sender that never blocks, as the ranks' TelemetryClient (a full socket queue is a drop),
  at rising rates, to show where drops start and that nothing sent is lost inside the agent. The kernel queues
  only ``net.unix.max_dgram_qlen`` datagrams per socket (10 by default, 512 where systemd's sysctl defaults
  apply): the client's short backlog absorbs some bursts, this sender does not, so its drop point is a floor.

    python benchmarks/telemetry_ingest.py [--seconds 3] [--ranks 64] [--rates 500,1000,2000,5000,10000,20000,40000]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpuwatch.agent.collectors.base import CollectorContext
from gpuwatch.agent.collectors.telemetry import TelemetryCollector
from gpuwatch.agent.exposition import Renderer
from gpuwatch.agent.telemetry.listener import queue_limit
from gpuwatch.agent.telemetry.store import TelemetryStore
from gpuwatch.protocol.schema import COLLECTIVE_BUCKETS, encode


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


@contextlib.contextmanager
def _receiver(interval: float) -> Iterator[tuple[Path, TelemetryCollector]]:
    """A TelemetryCollector receiving on a fresh socket, with a thread collecting and rendering it every
    ``interval`` seconds, as when every sampling round is scraped (rendering competes with the receiver for the
    GIL)."""
    with tempfile.TemporaryDirectory(prefix="gw-bench-") as workdir:
        path = Path(workdir) / "telemetry.sock"
        collector = TelemetryCollector(CollectorContext(telemetry_socket=path))
        stop = threading.Event()

        def sample() -> None:
            renderer = Renderer()
            while not stop.wait(interval):
                renderer.render(collector.collect().families)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            yield path, collector
        finally:
            time.sleep(0.2)  # the last queued datagrams
            stop.set()
            sampler.join()
            collector.close()


def _outcomes(collector: TelemetryCollector, ranks: int) -> tuple[int, int]:
    """Step records accepted (the hellos left out) and records rejected."""
    _, records = collector.store.snapshot()
    rejected = sum(count for (result, _), count in records.items() if result == "rejected")
    return records["accepted", ""] - ranks, rejected


def end_to_end(ranks: int, seconds: float, interval: float) -> tuple[float, int]:
    with _receiver(interval) as (path, collector):
        sender = multiprocessing.get_context("spawn").Process(target=_send, args=(str(path), ranks, seconds))
        sender.start()
        sender.join()
    accepted, rejected = _outcomes(collector, ranks)
    return accepted / seconds, rejected


def _send_paced(path: str, ranks: int, seconds: float, rate: float, counts) -> None:
    """Offer ``rate`` records/s the way a rank's TelemetryClient sends, non-blocking: a full socket queue (EAGAIN)
    is a drop, never a wait. Pre-encoded records and a raw socket keep the sender cheap, so the figure is the
    receiver's, not the client's encoding; sends are spread over 1 ms ticks as 64 ranks' steps would be."""
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    for rank in range(ranks):
        sender.sendto(hello_record(rank), path)
    sender.setblocking(False)
    records = [step_record(rank, 1) for rank in range(ranks)]
    sent = dropped = 0
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds:
        for index in range(sent + dropped, int(rate * (elapsed + 0.001))):
            try:
                sender.sendto(records[index % ranks], path)
                sent += 1
            except BlockingIOError:
                dropped += 1
        time.sleep(0.001)
    counts[0], counts[1], counts[2] = sent, dropped, time.monotonic() - started


@dataclass
class Offered:
    rate: float
    sent: int
    dropped: int
    accepted_per_second: float
    lost_in_agent: int


def offered_load(ranks: int, seconds: float, interval: float, rate: float) -> Offered:
    context = multiprocessing.get_context("spawn")
    counts = context.Array("d", 3)
    with _receiver(interval) as (path, collector):
        sender = context.Process(target=_send_paced, args=(str(path), ranks, seconds, rate, counts))
        sender.start()
        sender.join()
    accepted, rejected = _outcomes(collector, ranks)
    sent, dropped, elapsed = int(counts[0]), int(counts[1]), counts[2]
    return Offered(rate, sent, dropped, accepted / elapsed, sent - accepted - rejected)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--interval", type=float, default=1.0, help="sampling interval while receiving")
    parser.add_argument("--rates", default="500,1000,2000,5000,10000,20000,40000",
                        help="offered step records per second, comma-separated, to find where drops start")
    args = parser.parse_args()
    print(f"step record: {len(step_record(0, 1))} bytes")
    print(f"decode + store, in-process:           {in_process(args.ranks, args.seconds):8.0f} records/s")
    rate, rejected = end_to_end(args.ranks, args.seconds, args.interval)
    print(f"socket -> receiver thread -> store:   {rate:8.0f} records/s ({args.ranks} ranks, {rejected} rejected)")
    print("\noffered load, non-blocking sender (a full socket queue is a drop, as in TelemetryClient):")
    print(f"  {'offered/s':>10} {'sent':>9} {'dropped':>8} {'accepted/s':>11}  lost after send")
    first_drop = None
    for offered in (int(r) for r in args.rates.split(",")):
        result = offered_load(args.ranks, args.seconds, args.interval, offered)
        print(f"  {offered:10,d} {result.sent:9,d} {result.dropped:8,d} {result.accepted_per_second:11,.0f}  "
              f"{result.lost_in_agent}")
        if result.dropped and first_drop is None:
            first_drop = offered
    print(f"drops start at: {f'{first_drop:,d} records/s offered' if first_drop else 'none of the rates offered'}"
          f" (socket queue: net.unix.max_dgram_qlen = {queue_limit()}); target: over 20,000 records/s with no loss")


if __name__ == "__main__":
    main()
