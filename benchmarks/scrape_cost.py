"""Scrape and sampling cost of the agent on a simulated dgx-h100 node, measured side by side.

Prints, for the same metric families (a node without ranks: the per-rank families are written by the
telemetry collector itself, see ``agent_cost.py`` for 64 ranks): prometheus-client's ``generate_latest``
against gpuwatch's cached renderer (the ratio is the point: absolute times wander on shared machines); the
same round's series built and rendered anew as prometheus-client's ``GaugeMetricFamily``/``CounterMetricFamily``
and as the collectors' row families (``exposition.RowFamily``), interleaved, every value changed as counters
change between rounds; the cost of one sampling round per collector, the round itself (collection only) and the
render of a fresh snapshot (what its first scrape pays), and /metrics latency over HTTP from a running agent.

    python benchmarks/scrape_cost.py [--rounds 50]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from _harness import load_average, machine, spread
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuwatch.agent.collectors import REGISTRY, CollectorContext
from gpuwatch.agent.exposition import CounterFamily, GaugeFamily, Renderer, RowFamily
from gpuwatch.agent.sampler import Sampler
from gpuwatch.agent.server import AgentHTTPServer, serve_in_thread
from gpuwatch.agent.simulate import PRESETS, Simulation


def _median_ms(function, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        function()
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _as_prometheus_client(family: Metric) -> Metric:
    """A row family's series as a prometheus-client family (its samples built once); any other family as it is."""
    if not isinstance(family, RowFamily):
        return family
    copy = Metric(family.name, family.documentation, family.type)
    copy.samples = family.samples
    return copy


def _rebuild(families: Sequence[Metric], row_types: bool, step: int) -> list[Metric]:
    """The row families among ``families`` built anew, every value moved by ``step``: as the collectors' row
    families, or as prometheus-client's."""
    gauge, counter = (GaugeFamily, CounterFamily) if row_types else (GaugeMetricFamily, CounterMetricFamily)
    built: list[Metric] = []
    for family in families:
        if isinstance(family, RowFamily):
            copy = (counter if family.type == "counter" else gauge)(family.name, family.documentation,
                                                                  labels=family.label_names)
            for labels, value in family.rows:
                copy.add_metric(labels, value + step)
            built.append(copy)
    return built


def _fresh_families(families: Sequence[Metric], rounds: int) -> dict[str, list[float]]:
    """ms to build and render the row families anew, as prometheus-client's and as rows, interleaved, each
    with a renderer that holds the previous round (as the agent's does)."""
    times: dict[str, list[float]] = {"prometheus-client families": [], "row families (the agent's)": []}
    renderers = {name: Renderer() for name in times}
    for step in range(rounds + 1):
        for (name, spent), row_types in zip(times.items(), (False, True), strict=True):
            started = time.perf_counter()
            renderers[name].render(_rebuild(families, row_types, step))
            if step:  # the first fills the renderer's cache
                spent.append((time.perf_counter() - started) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--preset", default="dgx-h100", choices=sorted(PRESETS))
    args = parser.parse_args()
    print(f"machine: {machine()}")
    print(f"load average before: {load_average()}", flush=True)

    with tempfile.TemporaryDirectory() as workdir:
        simulation = Simulation(PRESETS[args.preset], Path(workdir))
        context = CollectorContext(sysfs_root=simulation.sysfs_root, nvml=simulation.nvml, simulated=True,
                                   telemetry_socket=Path(workdir) / "telemetry.sock")
        collectors = [cls(context) for cls in REGISTRY.values()]
        simulation.advance()
        families = [family for c in collectors for family in c.collect().families]
        reference = [_as_prometheus_client(family) for family in families]
        samples = sum(len(family.samples) for family in reference)

        class _Static:
            def collect(self) -> list[Metric]:
                return reference

        registry = CollectorRegistry()
        registry.register(_Static())
        renderer = Renderer()
        assert renderer.render(families) == generate_latest(registry)  # same bytes, or the ratio means nothing
        generic = _median_ms(lambda: generate_latest(registry), args.rounds)
        cached = _median_ms(lambda: renderer.render(families), args.rounds)
        print(f"{args.preset}: {len(families)} families, {samples} samples")
        print(f"  render  prometheus_client.generate_latest  {generic:7.2f} ms (median of {args.rounds})")
        print(f"  render  gpuwatch Renderer, nothing changed {cached:6.2f} ms   ratio {generic / cached:5.1f}x "
              "(every family reused; a fresh snapshot's render is below)")
        fresh = _fresh_families(families, args.rounds)
        rows = sum(len(family.rows) for family in families if isinstance(family, RowFamily))
        print(f"  built and rendered anew, {rows} series, every value changed (min / median / max of {args.rounds}):")
        for name, spent in fresh.items():
            print(f"    {name:<28} {spread(spent, ' ms')}")

        for collector in collectors:
            print(f"  collect {collector.name:<12} {_median_ms(collector.collect, args.rounds):7.2f} ms")
        print(f"  simulation advance (the stand-in's cost, not the agent's) "
              f"{_median_ms(simulation.advance, args.rounds):7.2f} ms")

        sampler = Sampler(collectors, interval=1.0, node="bench", mode="simulated")
        round_ms = _median_ms(sampler.sample_once, args.rounds)
        fresh_ms = _median_ms(lambda: sampler.sample_once().metrics(), args.rounds) - round_ms
        print(f"  sampling round (all collectors; nobody scrapes: no render) {round_ms:7.2f} ms")
        print(f"  render of a new snapshot (for its first scrape)             {fresh_ms:7.2f} ms")

        server = AgentHTTPServer(("127.0.0.1", 0), lambda: sampler.snapshot, stale_after=60)
        serve_in_thread(server)
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        latencies = []
        stop = threading.Event()

        def keep_sampling() -> None:
            while not stop.wait(1.0):
                sampler.sample_once()

        threading.Thread(target=keep_sampling, daemon=True).start()
        for _ in range(max(args.rounds * 4, 200)):
            started = time.perf_counter()
            with urllib.request.urlopen(url) as response:
                response.read()
            latencies.append((time.perf_counter() - started) * 1e3)
        stop.set()
        server.shutdown()
        server.server_close()
        sampler.close()
        print(f"  /metrics over HTTP while sampling at 1 s: p50 {_percentile(latencies, 0.5):.2f} ms, "
              f"p99 {_percentile(latencies, 0.99):.2f} ms ({len(latencies)} scrapes)")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
