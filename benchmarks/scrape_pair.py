"""What a highly available Prometheus pair costs the node agent: two servers from two addresses, against the same
scrapes from one address, side by side in one run.

A Prometheus pair scrapes every target twice per interval, at two offsets. The agent renders a round ahead of the
scrape it expects (``snapshot.ScrapeClock``), from each scraper's rhythm: with two addresses it finds both rhythms;
from one address (both servers behind one proxy, or an agent that kept one rhythm for every scraper, as it did
before) the alternating short and long gaps look like no rhythm at all, and it renders ahead rounds nobody reads.
The agent serves the simulated dgx-h100 of ``agent_cost.py`` with 64 ranks stepping once a second; the two arms
alternate within each run. CPU time is the process's CPU-time clock, over whole scrape cycles after two cycles of
warm-up; the simulation's share (the agent's own counter, from the pages at both ends) is left out.

    python benchmarks/scrape_pair.py [--runs 3] [--interval 1] [--every 15] [--apart 3] [--cycles 3]
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import multiprocessing
import tempfile
import time
from pathlib import Path

from _harness import free_port, load_average, machine, spread
from agent_cost import (
    _process,
    _simulation_cpu,
    agent_command,
    process_cpu_seconds,
    send_steps,
)

#: The pair's two source addresses: any of 127/8 is the loopback interface on Linux.
PAIR = ("127.0.0.1", "127.0.0.2")


def scrape(port: int, source: str) -> bytes:
    """/metrics as Prometheus asks for it (gzip), from ``source``; the page decompressed."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=(source, 0))
    try:
        connection.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
        return gzip.decompress(connection.getresponse().read())
    finally:
        connection.close()


def agent_proper(args: argparse.Namespace, sources: tuple[str, str]) -> float:
    """The agent's CPU share without the simulation's, scraped by two servers ``args.apart`` seconds apart every
    ``args.every`` seconds, each from its source address (the same one twice: one scraper's address)."""
    with tempfile.TemporaryDirectory(prefix="gpuwatch-pair-") as tmp:
        sock, port = Path(tmp) / "telemetry.sock", free_port()
        command = agent_command(port, sock, "--simulate", "dgx-h100", "--interval", str(args.interval))
        with _process(command, f"http://127.0.0.1:{port}/healthz") as agent:
            cycles = 2 + args.cycles  # two of warm-up: the agent's first render, and both rhythms seen
            sender = multiprocessing.Process(target=send_steps,
                                             args=(str(sock), args.warmup + cycles * args.every + 30))
            sender.start()
            try:
                time.sleep(args.warmup)
                started = time.monotonic()
                schedule = sorted((cycle * args.every + offset, source) for cycle in range(cycles + 1)
                                  for offset, source in ((0.0, sources[0]), (args.apart, sources[1])))
                schedule = [(at, source) for at, source in schedule if at <= cycles * args.every]
                window_opens, cpu, simulation = 2 * args.every, [], []
                for at, source in schedule:
                    time.sleep(max(0.0, started + at - time.monotonic()))
                    page = scrape(port, source)
                    if at in (window_opens, cycles * args.every):  # just after the scrapes that open and close it
                        cpu.append((process_cpu_seconds(agent.pid), time.monotonic()))
                        simulation.append(_simulation_cpu(page))
            finally:
                sender.terminate()
                sender.join()
    (cpu_before, opened), (cpu_after, closed) = cpu
    return ((cpu_after - cpu_before) - (simulation[1] - simulation[0])) / (closed - opened)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="times each arm is measured, alternating")
    parser.add_argument("--interval", type=float, default=1.0, help="the agent's sampling interval")
    parser.add_argument("--every", type=float, default=15.0, help="each server's scrape interval, seconds")
    parser.add_argument("--apart", type=float, default=3.0, help="seconds from the first server's scrape to the "
                        "second's")
    parser.add_argument("--cycles", type=int, default=3, help="scrape intervals measured, after two of warm-up")
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds before the first scrape (ranks registered)")
    args = parser.parse_args()
    if args.runs < 1 or args.cycles < 1:
        parser.error("--runs and --cycles must be at least 1")
    if not 0 < args.apart < args.every:
        parser.error("--apart must be between 0 and --every")

    print(f"machine: {machine()}")
    print(f"load average before: {load_average()}", flush=True)
    arms = {"two addresses (each server's rhythm)": (PAIR[0], PAIR[1]), "one address (one rhythm)": (PAIR[0], PAIR[0])}
    shares: dict[str, list[float]] = {name: [] for name in arms}
    for number in range(1, args.runs + 1):
        for name, sources in arms.items():
            shares[name].append(agent_proper(args, sources) * 100)
            print(f"run {number}, {name}: agent proper {shares[name][-1]:.3f} %, load {load_average()}", flush=True)
    print(f"load average after: {load_average()}")
    print(f"\n{args.runs} run(s), min / median / max. Simulated dgx-h100, 64 ranks stepping once a second, "
          f"{args.interval:g} s sampling, two servers scraping every {args.every:g} s, {args.apart:g} s apart, "
          f"{args.cycles} intervals measured:")
    for name, values in shares.items():
        print(f"  {name:<38} agent proper {spread(values, ' %', 3)}")
    print(f"  ratio one address / two, same run: "
          f"{spread([one / two for two, one in zip(*shares.values(), strict=True)], '×')}")


if __name__ == "__main__":
    main()
