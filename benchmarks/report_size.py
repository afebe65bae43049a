"""`gpuwatch report`'s page: its size for 64 ranks × 1,000 steps (budget 2 MB) and 1,024 ranks × 1,000 steps (budget
10 MB), and how long it takes to open in headless Chromium (budget 2 s), from navigation to the page's script having
drawn every view (``body[data-ready]``).

The ranks are synthetic (tp 8 × pp 4 × dp N, every step's phases, bubble, loss, gradient norm, learning rate, memory
and three collective ops, one straggler): reading a real run log of a million step records is the run-log source's
cost, not the page's. The model and page are the command's own (``model.build``, ``render.render``); the heatmap is
downsampled past 65,536 cells (the slowest step of each bin kept), the curves past 1,000 points (bin medians).

    python3 benchmarks/report_size.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from _harness import load_average, machine, spread

from gpuwatch.diagnosis.engine import Report
from gpuwatch.diagnosis.facts import CollectiveFacts, Facts, History, Layout, RankFacts, StepRow
from gpuwatch.report.model import build
from gpuwatch.report.render import render

STEPS = 1_000
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


def facts(world: int, steps: int = STEPS) -> Facts:
    rng = random.Random(world)
    tp, pp = 8, 4
    dp = world // (tp * pp)
    ops = (("all_reduce", 4), ("send", 8), ("recv", 8))
    ranks = []
    for rank in range(world):
        slow = 3.0 if rank == world // 3 else 1.0
        rows = []
        for step in range(1, steps + 1):
            compute = 0.2 * slow * rng.uniform(0.95, 1.05)
            rows.append(StepRow(step, 1e9 + step, 0.3, 0.004, compute, 0.02, 0.01, 0.3 - compute if slow == 1 else 0.0,
                                rng.uniform(0.1, 0.14), 0.11, 5 / step ** 0.3, rng.uniform(0.8, 1.2), 3e-4,
                                rng.uniform(0.9, 1.0), 60e9, tuple((op, n, 0.001 * n) for op, n in ops)))
        layout = Layout(world, tp, pp, dp, rank % tp, (rank // tp) % pp, rank // (tp * pp), schedule="1f1b",
                        micro_batches=16)
        collectives = {op: CollectiveFacts(op, n * steps, 0.001 * n * steps, buckets=tuple(
            rng.randrange(0, 50) for _ in range(20))) for op, n in ops}
        ranks.append(RankFacts("bench", rank, node=f"node{rank // 8}", layout=layout, collectives=collectives,
                               history=History(steps=rows)))
    return Facts(ranks=ranks)


def open_times(page_path: Path, repeat: int) -> list[float]:
    from playwright.sync_api import sync_playwright

    times = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for _ in range(repeat):
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            start = time.perf_counter()
            page.goto(page_path.as_uri())
            page.wait_for_selector("body[data-ready]", timeout=60_000)
            times.append(time.perf_counter() - start)
            page.close()
        browser.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    load_before = load_average()
    with tempfile.TemporaryDirectory() as directory:
        for world, budget in ((64, 2e6), (1024, 10e6)):
            report = Report(facts(world), findings=[], ran=[], skipped=[])
            renders = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                text = render(build(report, "bench", None, time.time(), ["synthetic"]))
                renders.append(time.perf_counter() - start)
            path = Path(directory) / f"report-{world}.html"
            path.write_text(text)
            size = path.stat().st_size
            opened = open_times(path, args.repeat)
            print(f"{world} ranks × {STEPS} steps: {size / 1e6:.2f} MB (budget {budget / 1e6:.0f} MB: "
                  f"{'ok' if size <= budget else 'OVER'}); build and render {spread(renders, ' s')}; "
                  f"open in headless Chromium {spread(opened, ' s')} (budget 2 s: "
                  f"{'ok' if statistics.median(opened) <= 2 else 'OVER'})")
    print(f"machine: {machine()}; load {load_before} before, {load_average()} after")


if __name__ == "__main__":
    main()
