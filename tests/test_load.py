"""Load: 50 concurrent scrapers on /metrics plus 64 ranks × 20 step records/s from real TelemetryClients,
against a simulated full node (8 GPUs, 144 NVLinks, 8 IB ports), on loopback, for a bounded time.

Asserts what docs/reliability.md promises under load, none of it a speed: every scrape is a complete, parseable
page with the expected series; every scraper is served; every record offered is either sent or counted as a
client drop, and the agent loses none it was sent; the agent's memory stays flat. How fast it all goes (scrape
p50/p99, send latency, the share of client drops) depends on the machine: it is printed, the figures that
docs/reliability.md quotes, and benchmarks/ measure it; it is never asserted.
"""

import gzip
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import wait_until

pytestmark = pytest.mark.integration

RANKS = 64
RECORDS_PER_SECOND = 20  # per rank
SENDER_PROCESSES = 4
SCRAPERS = 50
SCRAPE_INTERVAL = 1.0  # per scraper: 50 scrapes/s in all, Prometheus-style keep-alive connections
WARM_UP = 4.0
LOAD_SECONDS = 15.0
TESTS = Path(__file__).parent

# One process drives RANKS / SENDER_PROCESSES real clients, each rank paced at RECORDS_PER_SECOND, and
# prints what its clients counted.
SENDER = r"""
import json, sys, time
from telemetry_records import hello, step
from gpuwatch.trainer.telemetry import TelemetryClient

first, count, rate, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
clients = [TelemetryClient() for _ in range(count)]  # GPUWATCH_SOCKET, as a rank finds the agent
layout = {"world_size": 64, "tp_size": 2, "dp_size": 2, "pp_size": 16}
for offset, client in enumerate(clients):
    client.send(hello(first + offset, job="load", **layout))
start, number, durations = time.monotonic(), 0, []
while time.monotonic() - start < seconds:
    number += 1
    for offset, client in enumerate(clients):
        record = step(first + offset, number, job="load")
        send_start = time.perf_counter()
        client.send(record)
        durations.append(time.perf_counter() - send_start)
    time.sleep(max(0.0, start + number / rate - time.monotonic()))
for client in clients:
    client.close(timeout=2.0)
print(json.dumps({"sent": sum(c.sent for c in clients), "offered": count * (number + 1),
                  "drops": sum(c.dropped for c in clients), "send_seconds": durations}))
"""


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _spread(seconds: list[float], scale: float, unit: str) -> str:
    """p50, p99 and max of some durations, printed in `unit` (`scale` of them to a second)."""
    if not seconds:
        return "none measured"
    ordered = sorted(seconds)
    p50, p99, top = statistics.median(ordered), ordered[int(0.99 * (len(ordered) - 1))], ordered[-1]
    return f"p50 {p50 * scale:.1f} {unit}, p99 {p99 * scale:.1f} {unit}, max {top * scale:.1f} {unit}"


class Scraper(threading.Thread):
    """One Prometheus-like scraper: a keep-alive connection, gzip, one scrape per interval; checks every
    page is complete and keeps its latencies."""

    def __init__(self, port: int, stop: threading.Event, phase: float) -> None:
        super().__init__(daemon=True)
        self.port, self.stop, self.phase = port, stop, phase
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.last_page = ""

    def run(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        next_at = time.monotonic() + self.phase
        while not self.stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += SCRAPE_INTERVAL
            started = time.monotonic()
            try:
                connection.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
                response = connection.getresponse()
                body = response.read()
            except (OSError, http.client.HTTPException) as exc:
                self.failures.append(repr(exc))
                connection.close()
                continue
            self.latencies.append(time.monotonic() - started)
            page = gzip.decompress(body).decode()
            if response.status != 200 or not page.endswith("\n") or "gpuwatch_agent_info{" not in page:
                self.failures.append(f"status {response.status}, {len(page)} bytes")
            self.last_page = page
        connection.close()


def test_fifty_scrapers_and_64_ranks_at_20_records_per_second(start_agent, capsys):
    agent = start_agent("--simulate", "dgx-h100", "--interval", "1")
    environment = {**os.environ, "GPUWATCH_SOCKET": str(agent.telemetry_socket),
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    per_process = RANKS // SENDER_PROCESSES
    senders = [subprocess.Popen([sys.executable, "-c", SENDER, str(first), str(per_process),
                                 str(RECORDS_PER_SECOND), str(WARM_UP + LOAD_SECONDS)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
               for first in range(0, RANKS, per_process)]
    stop = threading.Event()
    scrapers = [Scraper(agent.port, stop, phase=i * SCRAPE_INTERVAL / SCRAPERS) for i in range(SCRAPERS)]
    try:
        for scraper in scrapers:
            scraper.start()
        time.sleep(WARM_UP)
        rss_start = _rss_bytes(agent.proc.pid)
        for scraper in scrapers:  # only the loaded window counts in the printed latencies
            scraper.latencies.clear()
        results = []
        for sender in senders:
            output, errors = sender.communicate(timeout=LOAD_SECONDS + 30)
            assert sender.returncode == 0, errors
            results.append(json.loads(output))
    finally:
        stop.set()
        for scraper in scrapers:
            scraper.join(30)
    rss_end = _rss_bytes(agent.proc.pid)

    sent = sum(r["sent"] for r in results)
    drops = sum(r["drops"] for r in results)
    offered = sum(r["offered"] for r in results)
    wait_until(lambda: agent.state()["facts"]["telemetry"]["records"]["accepted"] >= sent, timeout=30,
               what="the agent to drain its socket")
    records = agent.state()["facts"]["telemetry"]["records"]
    latencies = [latency for scraper in scrapers for latency in scraper.latencies]
    sends = [seconds for result in results for seconds in result["send_seconds"]]
    with capsys.disabled():
        print(f"\nload: {SCRAPERS} scrapers x {1 / SCRAPE_INTERVAL:.0f}/s, {RANKS} ranks x {RECORDS_PER_SECOND}/s "
              f"for {LOAD_SECONDS:.0f} s after {WARM_UP:.0f} s warm-up\n"
              f"  scrapes: {len(latencies)}, {_spread(latencies, 1e3, 'ms')}\n"
              f"  records: offered {offered}, sent {sent}, accepted by the agent {records['accepted']}, "
              f"dropped by clients {drops}, rejected {sum(records['rejected'].values())}\n"
              f"  TelemetryClient.send: {_spread(sends, 1e6, 'us')}\n"
              f"  agent RSS: {rss_start / 2**20:.1f} MiB after warm-up, {rss_end / 2**20:.1f} MiB at the end")

    assert [f for scraper in scrapers for f in scraper.failures] == []
    assert all(scraper.last_page for scraper in scrapers)  # nobody starved: every scraper got complete pages
    families = {family.name: family for family in text_string_to_metric_families(scrapers[0].last_page)}
    ranks = {sample.labels["rank"] for sample in families["gpuwatch_train_step_seconds"].samples}
    assert ranks == {str(rank) for rank in range(RANKS)}
    assert len(families["gpuwatch_gpu_utilization_ratio"].samples) == 8

    assert records["accepted"] == sent > 0 and sum(records["rejected"].values()) == 0  # nothing sent is lost
    assert sent + drops == offered  # every record offered is accounted for: sent, or a counted drop
    assert rss_end - rss_start < 16 << 20  # flat: no growth with records or scrapes
