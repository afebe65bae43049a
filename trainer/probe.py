"""`gpuwatch probe`: an active check of the interconnect, in the spirit of nccl-tests' all_reduce_perf.

Every rank sweeps message sizes through all-reduce, all-gather and reduce-scatter over torch.distributed
(NCCL on GPUs, gloo on CPUs), launched like the trainer: forked on this machine (``--nproc``) or as one rank
under torchrun. Per op and size: warm-up calls, a barrier, then ``--iters`` timed calls (CUDA events on a
GPU; wall time on a CPU, where gloo calls return once done). The figure kept is the slowest rank's mean: a
collective is over when its last rank is.

Rank 0 prints the table and hands the results to the node agent as a ``probe`` record (and to
``--run-log``), so ``gpuwatch diagnose`` can compare the achieved bus bandwidth with the links' rated speed
(rule PERF005). See docs/probe.md.

torch is imported only inside the functions that run the ranks: ``gpuwatch`` lists its commands on nodes
without torch.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gpuwatch.protocol.interconnect import NodeLinks, classify
from gpuwatch.protocol.schema import (
    MAX_PROBE_HOSTNAMES,
    MAX_PROBE_RESULTS,
    PROBE_OPS,
    SCHEMA_VERSION,
    RecordRejected,
    decode,
    encode,
)
from gpuwatch.trainer.config import DEVICES, ConfigError, torchrun_world_size
from gpuwatch.trainer.telemetry import TelemetryClient

if TYPE_CHECKING:
    import torch

DTYPE = "float32"
ITEMSIZE = 4  # bytes per float32 element
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def bus_factor(op: str, ranks: int) -> float:
    """busbw / algbw: how much of the data crosses each rank's link in a ring. Reduce-scatter and all-gather
    move (n−1)/n of it; all-reduce is one then the other, 2(n−1)/n. Scaled so, the bus bandwidth compares
    with a link's speed whatever the rank count (nccl-tests' PERFORMANCE.md)."""
    once = (ranks - 1) / ranks
    return 2 * once if op == "all_reduce" else once


def sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Message sizes from ``min_bytes``, each ``factor`` times the last, up to ``max_bytes``."""
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def element_count(op: str, size: int, ranks: int) -> int:
    """Elements of a ``size``-byte message: nccl-tests' convention, the whole buffer (the gathered output of
    all-gather, the input of reduce-scatter), rounded down to a multiple of the ranks where it is split."""
    count = size // ITEMSIZE
    return count if op == "all_reduce" else count // ranks * ranks


@dataclasses.dataclass(frozen=True)
class Result:
    """One op at one message size."""

    op: str
    bytes: int
    count: int
    seconds: float  # the slowest rank's mean per call
    ranks: int

    @property
    def algbw(self) -> float:
        """Bytes per second as the application sees them: message size over time."""
        return self.bytes / self.seconds

    @property
    def busbw(self) -> float:
        """Bytes per second on each rank's link: comparable with the link's rated speed."""
        return self.algbw * bus_factor(self.op, self.ranks)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What every rank returns, the same on all: the sweep, and the job that ran it."""

    results: list[Result]
    hostnames: list[str]  # by rank
    backend: str
    device: str
    interconnect: str

    @property
    def world_size(self) -> int:
        return len(self.hostnames)

    @property
    def ranks_per_node(self) -> int:
        """Ranks on the busiest host."""
        return max(collections.Counter(self.hostnames).values())


@dataclasses.dataclass(frozen=True)
class Plan:
    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    iters: int
    warmup: int
    sysfs_root: Path


# -- inside a rank ----------------------------------------------------------------------------------


def measure(device: torch.device, plan: Plan) -> Measurement:
    """One rank's part of the probe, called by the launcher once the process group exists."""
    import torch
    import torch.distributed as dist

    from gpuwatch.trainer.parallel.comm import barrier

    ranks = dist.get_world_size()
    backend = str(dist.get_backend())
    hostnames: list[Any] = [None] * ranks
    dist.all_gather_object(hostnames, socket.gethostname())
    interconnect = _agreed_path(backend, hostnames, plan.sysfs_root)

    # Zeros: sums stay finite however often they run. Allocated once at the largest size, as nccl-tests does.
    first = torch.zeros(max(plan.sizes) // ITEMSIZE, dtype=getattr(torch, DTYPE), device=device)
    second = torch.zeros_like(first)
    timed = _cuda_seconds if device.type == "cuda" else _wall_seconds
    shapes, means = [], []
    for op in plan.ops:
        for size in plan.sizes:
            count = element_count(op, size, ranks)
            if not count:
                continue
            call = _collective(op, first, second, count, ranks)
            for _ in range(plan.warmup):
                call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            barrier()
            means.append(timed(call, plan.iters))
            shapes.append((op, count))
    slowest = torch.tensor(means, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    results = [Result(op, count * ITEMSIZE, count, seconds, ranks)
               for (op, count), seconds in zip(shapes, slowest.tolist(), strict=True)]
    return Measurement(results, hostnames, backend, device.type, interconnect)


def _agreed_path(backend: str, hostnames: list[str], sysfs_root: Path) -> str:
    """Every rank classifies its own path; ranks that disagree (mixed nodes) make it "unknown"."""
    import torch.distributed as dist

    node = _node_links(sysfs_root) if backend == "nccl" else None
    paths: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(paths, classify(backend, hostnames, os.environ, node))
    return paths[0] if len(set(paths)) == 1 else "unknown"


def _node_links(sysfs_root: Path) -> NodeLinks:
    """This node's NVLink and InfiniBand links, read by the agent's collectors (measurement only: no diagnosis);
    a part that cannot be read here (no driver, no sysfs) is None."""
    import pynvml

    from gpuwatch.agent.collectors import REGISTRY, CollectorContext

    context = CollectorContext(sysfs_root=sysfs_root, node=socket.gethostname(), nvml=pynvml)
    readings = {}
    for name in ("nvlink", "infiniband"):
        collector = REGISTRY[name](context)
        try:
            readings[name] = collector.collect().readings
        except Exception:  # a part this node cannot read stays unknown
            readings[name] = None
        finally:
            collector.close()
    links, ports = readings["nvlink"], readings["infiniband"]
    return NodeLinks(
        nvlink_up=None if links is None else any(link.up for link in links.links),
        active_link_layers=None if ports is None else frozenset(
            port.link_layer for port in ports.ports if port.state == "ACTIVE" and port.link_layer))


def _collective(op: str, first: torch.Tensor, second: torch.Tensor, count: int, ranks: int) -> Callable[[], Any]:
    """One call of ``op`` on ``count`` elements, on views of the two preallocated buffers."""
    import torch.distributed as dist

    if op == "all_reduce":
        return functools.partial(dist.all_reduce, first[:count])
    shard = count // ranks
    # torch 2.13 renamed these to *_single and deprecated the old names; older torch has only those.
    if op == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return functools.partial(gather, first[:count], second[:shard])
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return functools.partial(scatter, second[:shard], first[:count])


def _wall_seconds(call: Callable[[], Any], iters: int) -> float:
    """Mean wall time per call: gloo's CPU collectives return once complete."""
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - start) / iters


def _cuda_seconds(call: Callable[[], Any], iters: int) -> float:
    """Mean GPU time per call, between events on the current stream, which every NCCL call makes wait for it."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


# -- reporting (rank 0) -----------------------------------------------------------------------------


def table(measurement: Measurement, plan: Plan) -> str:
    """The results as nccl-tests prints them: one block per op, then the average bus bandwidth."""
    m = measurement
    lines = [f"# gpuwatch probe: {m.world_size} ranks on {len(set(m.hostnames))} node(s) ({m.ranks_per_node} per "
             f"node), {m.backend} on {m.device}, interconnect: {m.interconnect}",
             f"# {DTYPE} sum, {plan.warmup} warm-up + {plan.iters} timed calls per size; time: the slowest rank's mean"]
    averages = {}
    for op in plan.ops:
        rows = [r for r in m.results if r.op == op]
        formula = "2(n-1)/n" if op == "all_reduce" else "(n-1)/n"
        lines += ["#", f"# {op}: busbw = algbw x {formula} = algbw x {bus_factor(op, m.world_size):g}",
                  f"#{'size':>12} {'count':>12} {'type':>8} {'time':>10} {'algbw':>8} {'busbw':>8}",
                  f"#{'(B)':>12} {'(elements)':>12} {'':>8} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8}"]
        lines += [f" {r.bytes:>12} {r.count:>12} {DTYPE:>8} {r.seconds * 1e6:>10.1f} {r.algbw / 1e9:>8.3f} "
                  f"{r.busbw / 1e9:>8.3f}" for r in rows]
        if rows:
            averages[op] = sum(r.busbw for r in rows) / len(rows) / 1e9
    overall = sum(r.busbw for r in m.results) / len(m.results) / 1e9
    per_op = ", ".join(f"{op} {value:.3f}" for op, value in averages.items())
    lines += ["#", f"# Avg bus bandwidth    : {overall:.3f} GB/s ({per_op})"]
    return "\n".join(lines)


def _rounded(value: float) -> float:
    """Four significant digits: finer than run-to-run noise, and 90 rows still fit one datagram."""
    return float(f"{value:.4g}")


def probe_record(measurement: Measurement, job: str) -> dict[str, Any]:
    """The ``probe`` telemetry record (protocol/schema.py) of a measurement."""
    m = measurement
    hosts = sorted(set(m.hostnames))
    return {
        "v": SCHEMA_VERSION, "kind": "probe", "job": job, "rank": 0, "time": time.time(),
        "hostname": m.hostnames[0], "nodes": len(hosts), "hostnames": hosts[:MAX_PROBE_HOSTNAMES],
        "world_size": m.world_size, "ranks_per_node": m.ranks_per_node, "backend": m.backend, "device": m.device,
        "interconnect": m.interconnect, "dtype": DTYPE,
        "results": [{"op": r.op, "bytes": r.bytes, "seconds": _rounded(r.seconds),
                     "algbw_bytes_per_second": _rounded(r.algbw), "busbw_bytes_per_second": _rounded(r.busbw)}
                    for r in m.results],
    }


def _report(measurement: Measurement, plan: Plan, job: str, run_log: Path | None) -> None:
    click.echo(table(measurement, plan))
    record = probe_record(measurement, job)
    try:
        decode(encode(record))  # the agent's own check: a record it would reject is not sent
    except RecordRejected as rejected:
        raise click.ClickException(f"the probe record is not valid ({rejected}): nothing sent") from None
    with TelemetryClient(run_log=run_log, heartbeat_interval=0) as client:
        client.send(record)
    if client.sent:
        click.echo(f"# sent to the agent at {client.socket_path}")
    else:
        click.echo(f"# not sent to the agent at {client.socket_path}: {', '.join(client.drops)}")
    if run_log is not None:
        click.echo(f"# appended to {run_log}")


# -- command line -----------------------------------------------------------------------------------


class ByteSize(click.ParamType):
    """A byte count, with nccl-tests' binary suffixes: 8, 64K, 256M, 1G."""

    name = "BYTES"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().upper()
        number, unit = (text[:-1], text[-1]) if text[-1:] in _UNITS else (text, "")
        if not number.isdigit() or int(number) < 1:
            self.fail(f"{value!r} is not a byte count (e.g. 8, 64K, 256M, 1G)", param, ctx)
        return int(number) * _UNITS[unit]


def _ops(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    ops = tuple(dict.fromkeys(op.strip() for op in value.split(",") if op.strip()))
    unknown = [op for op in ops if op not in PROBE_OPS]
    if unknown or not ops:
        raise click.BadParameter(f"{', '.join(unknown) or 'none given'}: choose from {', '.join(PROBE_OPS)}")
    return ops


def _plan(ops: Sequence[str], min_bytes: int, max_bytes: int, factor: int, iters: int, warmup: int,
          sysfs_root: Path, ranks: int) -> Plan:
    """The sweep, or a UsageError saying what to change."""
    if min_bytes > max_bytes:
        raise click.UsageError(f"--min-bytes {min_bytes} is larger than --max-bytes {max_bytes}")
    if max_bytes < ITEMSIZE * ranks:
        raise click.UsageError(f"--max-bytes must hold at least one {DTYPE} per rank: {ITEMSIZE * ranks} bytes")
    sizes = sweep(min_bytes, max_bytes, factor)
    if len(sizes) * len(ops) > MAX_PROBE_RESULTS:
        raise click.UsageError(f"{len(sizes)} sizes x {len(ops)} ops = {len(sizes) * len(ops)} results, more than "
                               f"one probe record carries ({MAX_PROBE_RESULTS}): raise --factor or narrow the sizes")
    return Plan(tuple(ops), tuple(sizes), iters, warmup, sysfs_root)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--nproc", type=click.IntRange(min=1), default=2, show_default=True,
              help="Ranks to fork on this machine (under torchrun, its WORLD_SIZE decides).")
@click.option("--ops", default=",".join(PROBE_OPS), show_default=True, callback=_ops,
              help="Collectives to sweep, comma-separated.")
@click.option("--min-bytes", type=ByteSize(), default="1K", show_default=True,
              help="Smallest message; suffixes K, M, G are powers of 1024.")
@click.option("--max-bytes", type=ByteSize(), default="256M", show_default=True, help="Largest message.")
@click.option("--factor", type=click.IntRange(min=2), default=2, show_default=True,
              help="Each message size is the previous one times this.")
@click.option("--iters", type=click.IntRange(min=1), default=20, show_default=True,
              help="Timed calls per op and size.")
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True,
              help="Untimed calls before them (connection set-up, caches).")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="auto: each rank's GPU when CUDA works (NCCL), else the CPU (gloo).")
@click.option("--job", default="probe", show_default=True, envvar=["GPUWATCH_JOB", "SLURM_JOB_ID"], show_envvar=True,
              help="Job label of the results; the agent keeps the latest probe of each job.")
@click.option("--run-log", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Also append the probe record to this JSONL run log (gpuwatch diagnose --run-log).")
@click.option("--sysfs-root", type=click.Path(file_okay=False, path_type=Path), default=Path("/sys"),
              show_default=True, help="Where sysfs is mounted (InfiniBand ports, to name the interconnect).")
def probe(nproc: int, ops: tuple[str, ...], min_bytes: int, max_bytes: int, factor: int, iters: int, warmup: int,
          device: str, job: str, run_log: Path | None, sysfs_root: Path) -> None:
    """Measure the interconnect: an nccl-tests style sweep of collectives.

    Each rank runs all-reduce, all-gather and reduce-scatter on messages from --min-bytes to --max-bytes
    (NCCL on GPUs, gloo on CPUs). Started directly it forks --nproc ranks on this machine; under torchrun
    (torchrun --nnodes N --nproc-per-node G -m gpuwatch.trainer.probe ...) it runs as one of the job's
    ranks. Rank 0 prints the table and sends the results to the node agent ($GPUWATCH_SOCKET, else the
    agent's well-known socket) and to --run-log, where gpuwatch diagnose (rule PERF005) compares them with
    the links' rated speed.

    \b
    time   the slowest rank's mean time per call
    algbw  message size / time: the speed the application sees
    busbw  algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather and
           reduce-scatter: the bytes each rank's link carries per second,
           comparable with a link's rated speed whatever the rank count n

    Small messages measure latency, large ones bandwidth: read busbw at the large sizes. See docs/probe.md.
    """
    world = torchrun_world_size()
    plan = _plan(ops, min_bytes, max_bytes, factor, iters, warmup, sysfs_root, world or nproc)

    from gpuwatch.trainer.launch import RankFailed, launch, run_rank

    try:
        if world is None:
            measurement = launch(measure, nproc, plan, device=device)[0]
        else:
            measurement = run_rank(measure, (plan,), device)
    except ConfigError as error:  # no GPU for a rank, found inside it
        raise click.UsageError(str(error)) from None
    except RankFailed as error:
        raise click.ClickException(str(error)) from None
    if world is None or int(os.environ["RANK"]) == 0:
        _report(measurement, plan, job, run_log)


if __name__ == "__main__":
    probe()
