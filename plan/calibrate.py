"""Calibration: this machine's own figures in place of the datasheet's — the FLOP/s its matmuls achieve, measured
here, and the bus bandwidth per message size that `gpuwatch probe` measured on its links — kept in a small JSON file
(``SCHEMA``, docs/plan.md) that `gpuwatch plan --calibration` and the diagnosis read back.

**Which matmuls.** Achieved FLOP/s depend on the shape: on a CPU a 128 × 64 × 256 matmul runs at a fraction of
what a 2048² one does (per-call dispatch and too little work per cache line), and on a GPU small matmuls leave SMs
idle (NVIDIA's "Matrix Multiplication Background User's Guide": performance depends on the dimensions, wave
quantization, tiling). A single big square matmul would overstate a small model's compute speed, so the default
shapes are the model's own: the matmuls a transformer layer spends most of its FLOPs in, (tokens of a micro-batch)
× hidden × (MLP width / tp) and × (3·hidden / tp) for QKV, forward as the layer runs them (`model_shapes`). The
median of ``repeats`` timed rounds is kept: the median resists a round disturbed by other work on a shared machine.

**Threads.** A rank of the reference trainer on the CPU runs one intra-op thread (gpuwatch.trainer.launch sets
``torch.set_num_threads(1)``), so the CPU is measured with one thread by default: the figure is one rank's, as the
planner's "one GPU" is.

**Links.** The planner knows two links (`Cluster.link`): ``nvlink``, any group within a node, and ``ib``, a group
across nodes. A probe whose ranks lie on one node measured the intra-node path (NVLink, PCIe, or gloo's loopback on
a CPU) and fills ``nvlink``; one across nodes measured the inter-node network (its ring is as slow as its slowest
link) and fills ``ib``. The all-reduce's bus bandwidth is taken by default: the planner's TP and DP traffic is
all-reduces, and nccl-tests' bus bandwidth is made comparable across rank counts (its PERFORMANCE.md).

torch is imported only inside the measuring function: ``gpuwatch.plan`` runs without torch, and reading or writing
a calibration needs none.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuwatch.plan.model import ModelShape
from gpuwatch.protocol.calibration import Calibration

SCHEMA = "gpuwatch.calibration/1"
#: The planner's links (gpus.Cluster.link): within a node, across nodes.
LINKS = ("nvlink", "ib")
#: Element type by the planner's precision names: what the matmuls are timed in.
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: The probe's collectives (protocol/schema.py's PROBE_OPS).
PROBE_OPS = ("all_reduce", "all_gather", "reduce_scatter")
#: Timed rounds and the minimum seconds of one round (enough calls that the timer's resolution and one call's
#: jitter vanish).
REPEATS = 5
ROUND_SECONDS = 0.2

Shape = tuple[int, int, int]


class CalibrationError(ValueError):
    """A calibration or probe file that cannot be used: one line naming the file and what is wrong."""


def model_shapes(shape: ModelShape, tokens: int, tp: int = 1) -> list[Shape]:
    """The (m, k, n) of a layer's weight matmuls, forward, for a micro-batch of ``tokens`` tokens on one rank of a
    TP group of ``tp`` (Megatron's column- then row-parallel split): Q, K and V (h → (h + 2·kv)/t), the output
    projection (h/t → h), the MLP's up projections (h → ffn/t, two when gated) and its down projection (ffn/t → h).
    Their 2·m·k·n add up to `work`, the planner's `compute.layer_matmul_flops` × tokens / t."""
    h = shape.hidden
    qkv, ffn = max(1, (h + 2 * shape.kv_width) // tp), max(1, shape.ffn // tp)
    return [(tokens, h, qkv), (tokens, max(1, h // tp), h), *[(tokens, h, ffn)] * (shape.mlp_matrices - 1),
            (tokens, ffn, h)]


def work(shapes: Sequence[Shape]) -> float:
    """FLOPs of one pass over ``shapes``: 2·m·k·n each."""
    return float(sum(2 * m * k * n for m, k, n in shapes))


def sweep_shapes(shape: ModelShape, seq_len: int, micro_batch_sizes: Sequence[int], tp: int = 1) -> list[list[Shape]]:
    """A layer's matmuls at each micro-batch size: the sweep of `Calibration.flops_by_work`."""
    return [model_shapes(shape, seq_len * size, tp) for size in micro_batch_sizes]


def measure_matmul(shapes: Sequence[Shape], device: str = "cpu", precision: str = "fp32",
                   repeats: int = REPEATS, threads: int | None = 1) -> list[float]:
    """FLOP/s of each of ``repeats`` rounds; a round runs every shape for at least ``ROUND_SECONDS`` and counts
    2·m·k·n FLOPs a matmul. ``threads``: torch's intra-op threads on the CPU (None: leave torch's setting)."""
    import torch

    if precision not in DTYPES:
        raise CalibrationError(f"precision must be one of {', '.join(DTYPES)} (got {precision})")
    dtype = getattr(torch, DTYPES[precision])
    target = torch.device(device)
    if target.type == "cpu" and threads is not None:
        torch.set_num_threads(threads)
    pairs = [(torch.randn(m, k, device=target, dtype=dtype), torch.randn(k, n, device=target, dtype=dtype))
             for m, k, n in shapes]
    flops_per_pass = work(shapes)

    def one_pass() -> None:
        for a, b in pairs:
            torch.matmul(a, b)

    def synchronize() -> None:
        if target.type == "cuda":
            torch.cuda.synchronize(target)

    one_pass()  # warm-up: allocations, cuBLAS's handle and heuristics, the CPU's caches
    synchronize()
    started = time.perf_counter()
    one_pass()
    synchronize()
    calls = max(1, math.ceil(ROUND_SECONDS / max(time.perf_counter() - started, 1e-9)))
    rates = []
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            one_pass()
        synchronize()
        rates.append(flops_per_pass * calls / (time.perf_counter() - started))
    return rates


def read_probe(path: Path, op: str = "all_reduce") -> tuple[str, tuple[tuple[int, float], ...], dict[str, Any]]:
    """The last probe record in ``path`` (`gpuwatch probe --run-log FILE`'s JSONL, or one record as JSON): the
    planner link it measured, its (bytes, bus bandwidth) points of ``op``, ascending, and what it ran on."""
    if op not in PROBE_OPS:
        raise CalibrationError(f"op must be one of {', '.join(PROBE_OPS)} (got {op})")
    text = _read_text(path)
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            try:  # one pretty-printed record
                record = json.loads(text)
            except json.JSONDecodeError as error:
                raise CalibrationError(f"{path}: line {number} is not JSON ({error.msg})") from None
            records = [record]
            break
        records.append(record)
    probes = [r for r in records if isinstance(r, dict) and r.get("kind") == "probe"]
    if not probes:
        raise CalibrationError(f"{path}: no probe record (write one with gpuwatch probe --run-log FILE)")
    probe = probes[-1]
    nodes = probe.get("nodes")
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise CalibrationError(f"{path}: the probe record's nodes must be a positive integer (got {nodes!r})")
    results = probe.get("results")
    if not isinstance(results, list):
        raise CalibrationError(f"{path}: the probe record has no results list")
    points = []
    for result in results:
        if not isinstance(result, dict):
            raise CalibrationError(f"{path}: a probe result is not an object: {result!r}")
        if result.get("op") == op:
            points.append(_point(path, result.get("bytes"), result.get("busbw_bytes_per_second")))
    if not points:
        raise CalibrationError(f"{path}: the probe measured no {op}")
    link = "nvlink" if nodes == 1 else "ib"
    source = {key: probe.get(key) for key in ("interconnect", "backend", "device", "world_size", "nodes", "time")}
    return link, tuple(sorted(points)), {**source, "op": op, "link": link}


def measure(shapes: Sequence[Shape], device: str = "cpu", precision: str = "fp32", repeats: int = REPEATS,
            threads: int | None = 1, probes: Sequence[Path] = (), sweep: Sequence[Sequence[Shape]] = ()
            ) -> Calibration:
    """A calibration of this machine: the median FLOP/s of ``shapes`` on ``device``, that of each set of shapes in
    ``sweep`` by its `work` (`Calibration.flops_by_work`), and the bus bandwidth of each probe file's link;
    ``measured`` says what was measured and how (the file's field of that name)."""
    bandwidth: dict[str, tuple[tuple[int, float], ...]] = {}
    probe_sources = []
    for path in probes:  # read first: a bad file costs no measuring
        link, points, source = read_probe(path)
        if link in bandwidth:
            raise CalibrationError(f"{path}: a second probe of the {link} link")
        bandwidth[link] = points
        probe_sources.append({**source, "file": str(path)})
    rates = measure_matmul(shapes, device, precision, repeats, threads)
    by_work = {work(shapes_at): statistics.median(measure_matmul(shapes_at, device, precision, repeats, threads))
               for shapes_at in sweep}
    measured = {"device": device, "precision": precision, "threads": threads, "shapes": [list(s) for s in shapes],
                "flops_samples": rates, "sweep_shapes": [[list(s) for s in shapes_at] for shapes_at in sweep],
                "probes": probe_sources, "time": time.time()}
    return Calibration(statistics.median(rates), bandwidth, tuple(sorted(by_work.items())), precision, measured)


def as_json(calibration: Calibration) -> dict[str, Any]:
    return {"schema": SCHEMA, "matmul_flops": calibration.matmul_flops, "precision": calibration.precision,
            "flops_by_work": [[size, rate] for size, rate in calibration.flops_by_work],
            "bus_bandwidth": {link: [[size, rate] for size, rate in points]
                              for link, points in calibration.bus_bandwidth.items()},
            "measured": dict(calibration.measured)}


def write(calibration: Calibration, path: Path) -> None:
    """The calibration as ``SCHEMA``'s JSON."""
    Path(path).write_text(json.dumps(as_json(calibration), indent=1) + "\n")


def read(path: Path) -> Calibration:
    """A calibration file back; every malformed one is a one-line CalibrationError naming the file."""
    path = Path(path)
    text = _read_text(path)
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise CalibrationError(f"{path}: not JSON ({error.msg}, line {error.lineno})") from None
    if not isinstance(document, dict):
        raise CalibrationError(f"{path}: not a JSON object")
    if document.get("schema") != SCHEMA:
        raise CalibrationError(f"{path}: schema {document.get('schema')!r}, expected {SCHEMA!r}")
    flops = document.get("matmul_flops")
    if flops is not None and not _positive(flops):
        raise CalibrationError(f"{path}: matmul_flops must be a positive number or null (got {flops!r})")
    precision = document.get("precision")
    if precision is not None and precision not in DTYPES:
        raise CalibrationError(f"{path}: precision must be one of {', '.join(DTYPES)} or null (got {precision!r})")
    links = document.get("bus_bandwidth", {})
    if not isinstance(links, dict):
        raise CalibrationError(f"{path}: bus_bandwidth must be an object of links (got {links!r})")
    bandwidth = {}
    for link, points in links.items():
        if link not in LINKS:
            raise CalibrationError(f"{path}: unknown link {link!r} in bus_bandwidth (one of {', '.join(LINKS)})")
        bandwidth[link] = tuple((int(size), rate) for size, rate in _sweep(path, f"bus_bandwidth.{link}", points,
                                                                           integer=True))
    by_work = _sweep(path, "flops_by_work", document.get("flops_by_work", []), integer=False, empty=True)
    measured = document.get("measured", {})
    if not isinstance(measured, dict):
        raise CalibrationError(f"{path}: measured must be an object")
    return Calibration(None if flops is None else float(flops), bandwidth, by_work, precision, measured)


def _sweep(path: Path, name: str, points: object, integer: bool, empty: bool = False
           ) -> tuple[tuple[float, float], ...]:
    """A list of [size, rate] pairs: positive sizes (integers for bytes), distinct and ascending, positive rates."""
    if not isinstance(points, list) or not (points or empty):
        raise CalibrationError(f"{path}: {name} must be a {'' if empty else 'non-empty '}list of [size, rate] pairs")
    pairs = []
    for point in points:
        if not isinstance(point, list) or len(point) != 2:
            raise CalibrationError(f"{path}: {name}: {point!r} is not a [size, rate] pair")
        size, rate = point
        whole = isinstance(size, int) and not isinstance(size, bool)
        if not _positive(size) or (integer and not whole) or not _positive(rate):
            raise CalibrationError(f"{path}: {name}: {point!r} needs a positive {'integer ' if integer else ''}size "
                                   "and a positive rate")
        pairs.append((size, float(rate)))
    sizes = [size for size, _ in pairs]
    if sizes != sorted(set(sizes)):
        raise CalibrationError(f"{path}: {name}: sizes must be distinct and ascending")
    return tuple(pairs)


def _read_text(path: Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as error:
        raise CalibrationError(f"{path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise CalibrationError(f"{path}: not text (UTF-8)") from None


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _point(path: Path, size: object, rate: object) -> tuple[int, float]:
    """One (bytes, bytes/s) point: a positive integer size and a positive finite rate."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1 or not _positive(rate):
        raise CalibrationError(f"{path}: a bus bandwidth point needs a positive integer size and a positive rate "
                               f"(got {size!r}, {rate!r})")
    assert isinstance(rate, int | float)
    return size, float(rate)
