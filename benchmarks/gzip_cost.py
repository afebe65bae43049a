"""gzip of a 64-rank /metrics page by the standard library's zlib and by ISA-L (python-isal), side by side.

Why: Prometheus asks for gzip, and the agent compresses each page it renders ahead of a scrape (``Snapshot._gzip``).
With 64 ranks the page is ~1.3 MB, and zlib's fastest level took ~3 ms of the ~30 ms a render costs. ISA-L's
deflate writes the same format (RFC 1952, read by Go's compress/gzip in Prometheus) at a similar ratio for a fraction of
the CPU. The page is the telemetry collector's, rendered from the ranks' datagrams as ``render_instructions.py`` makes
them; each compressor's output is checked to decompress to it.

Every compressor runs ``--repeats`` times, interleaved (one of each in turn, so a slow moment of the machine costs them
alike), and is reported as min / median / max, with the machine and its load before and after.

    python benchmarks/gzip_cost.py [--repeats 50] [--ranks 64]
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _harness import load_average, machine, spread
from render_instructions import WARM_ROUNDS, datagrams

from gpuwatch.agent.collectors.base import CollectorContext
from gpuwatch.agent.collectors.telemetry import TelemetryCollector
from gpuwatch.agent.exposition import Renderer


def page(ranks: int) -> bytes:
    """The telemetry families' exposition after ``WARM_ROUNDS`` scrape intervals of ``ranks`` ranks' datagrams."""
    hellos, per_round = datagrams(WARM_ROUNDS, ranks)
    with tempfile.TemporaryDirectory() as tmp:
        collector = TelemetryCollector(CollectorContext(telemetry_socket=Path(tmp) / "telemetry.sock"))
        try:
            for datagram in itertools.chain(hellos, *per_round):
                collector.store.receive(datagram)
            return Renderer().render(itertools.chain(collector.collect().families))
        finally:
            collector.close()


def compressors() -> dict[str, Callable[[bytes], bytes]]:
    """Each gzip writer at the level the agent could use, by name; ISA-L's where it is installed."""
    found: dict[str, Callable[[bytes], bytes]] = {"zlib level 1": lambda data: gzip.compress(data, compresslevel=1)}
    try:
        from isal import igzip
    except ImportError:
        print("isal is not installed (pip install isal): zlib only")
        return found
    for level in (0, 1, 2):
        found[f"ISA-L level {level}"] = lambda data, level=level: igzip.compress(data, compresslevel=level)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50, help="compressions of the page by each writer")
    parser.add_argument("--ranks", type=int, default=64, help="ranks reporting (default 64)")
    args = parser.parse_args()
    if args.repeats < 1 or args.ranks < 1:
        parser.error("--repeats and --ranks must be at least 1")
    load_before = load_average()
    text = page(args.ranks)
    writers = compressors()
    times: dict[str, list[float]] = {name: [] for name in writers}
    sizes = {}
    for name, compress in writers.items():
        compressed = compress(text)
        if gzip.decompress(compressed) != text:
            raise SystemExit(f"gzip_cost: {name} did not give the page back")
        sizes[name] = len(compressed)
    for _ in range(args.repeats):
        for name, compress in writers.items():
            started = time.perf_counter()
            compress(text)
            times[name].append((time.perf_counter() - started) * 1e3)
    print(f"machine: {machine()}; load {load_before} before, {load_average()} after")
    print(f"page: {args.ranks} ranks' telemetry families, {len(text) / 1e6:.2f} MB; {args.repeats} compressions each, "
          "interleaved; ms min / median / max")
    baseline = statistics.median(times["zlib level 1"])
    for name, samples in times.items():
        print(f"  {name:13s} {spread(samples, ' ms')}   {len(text) / sizes[name]:4.1f}x smaller   "
              f"median {statistics.median(samples) / baseline:.2f}x zlib's")


if __name__ == "__main__":
    main()
