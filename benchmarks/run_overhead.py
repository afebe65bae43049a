"""What `gpuwatch run` costs a training step: the CPU time of rank 0's training thread per step of a plain DDP
loop with no gpuwatch import (2 ranks, gloo), run by torchrun without instrumentation ("off"), under
`gpuwatch run --` ("on") and without again ("floor": its difference from "off" is the noise between two runs of
the same thing). The global hooks cannot be switched off inside a process, so each arm is a run of its own; the
arms take turns, round after round, so that a shared machine's changing load falls on all of them. Per arm and
round: `time.thread_time` over `--steps` steps after `--warmup` steps, per step; printed as off, on, and the
difference on - off and floor - off per round (min / median / max), with the machine (CPU, cores, load average
before and after). Two step sizes: an MLP 128-512-16 on batches of 64 (~2 ms a step) and 128-16384-16 on batches
of 256 (≥ 50 ms). No agent listens: the records are dropped at the socket, as the client counts them; building and
sending them is on the client's thread, not the training thread measured here.

    python benchmarks/run_overhead.py [--rounds 6] [--steps 400] [--only small|large]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import load_average

#: name → (hidden width, batch, steps measured, warm-up steps): a ~2 ms step and a ≥ 50 ms one on 2 CPU cores.
SIZES = {"small": (512, 64, 400, 50), "large": (16384, 256, 40, 5)}
ARMS = ("off", "on", "floor")
#: A run that fails is run again, this many times: gloo on the CPU now and then aborts a rank as it shuts down
#: ("terminate called without an active exception"), with or without gpuwatch; the failure is printed.
RETRIES = 2
GPUWATCH_RUN = (sys.executable, "-m", "gpuwatch.cli.main", "run", "--")


def worker(width: int, batch: int, steps: int, warmup: int, out: Path) -> None:
    """One rank of the measured loop, as a user writes it (no gpuwatch here); rank 0 writes its figures to `out`."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(128, width), nn.ReLU(), nn.Linear(width, 16)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(batch, 128), torch.randint(16, (batch,))
    thread = wall = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            thread, wall = time.thread_time(), time.perf_counter()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    thread, wall = time.thread_time() - thread, time.perf_counter() - wall
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"thread_us": thread / steps * 1e6, "wall_us": wall / steps * 1e6}))
    dist.barrier()  # both ranks done before gloo is torn down
    dist.destroy_process_group()


def _arm(arm: str, size: str, steps: int, scratch: Path) -> dict[str, float]:
    width, batch, default_steps, warmup = SIZES[size]
    out = scratch / f"{size}-{arm}.json"
    command = [*(GPUWATCH_RUN if arm == "on" else ()), sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", __file__, "--worker", str(out), "--width", str(width), "--batch", str(batch),
               "--steps", str(steps or default_steps), "--warmup", str(warmup)]
    env = {name: value for name, value in os.environ.items() if not name.startswith("GPUWATCH_")}
    env["GPUWATCH_SOCKET"] = str(scratch / "nobody-listens.sock")
    for attempt in range(RETRIES + 1):
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode == 0:
            return json.loads(out.read_text())
        print(f"  ({arm} run of {size}, attempt {attempt + 1}, exited {result.returncode}: "
              f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'no output'})", flush=True)
    raise RuntimeError(f"the {arm} run of {size} failed {RETRIES + 1} times:\n{result.stderr[-3000:]}")


def _spread(values: list[float]) -> str:
    return f"{min(values):8.1f} {statistics.median(values):8.1f} {max(values):8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=0, help="steps measured per run (default: per size)")
    parser.add_argument("--only", choices=tuple(SIZES), default=None)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.width, args.batch, args.steps, args.warmup, args.worker)
        return

    from hooks_overhead import machine_and_load

    print(f"gpuwatch run overhead: plain DDP loop, 2 ranks (gloo), rank 0's training thread; {args.rounds} rounds "
          f"of off / on / off again\n{machine_and_load()}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        for size in ([args.only] if args.only else SIZES):
            width, batch, steps, _ = SIZES[size]
            runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
            for _round in range(args.rounds):
                for arm in ARMS:
                    runs[arm].append(_arm(arm, size, args.steps, Path(scratch)))
            thread = {arm: [r["thread_us"] for r in runs[arm]] for arm in ARMS}
            cost = [on - off for off, on in zip(thread["off"], thread["on"], strict=True)]
            floor = [again - off for off, again in zip(thread["off"], thread["floor"], strict=True)]
            wall = statistics.median(r["wall_us"] for r in runs["off"])
            off, on = statistics.median(thread["off"]), statistics.median(thread["on"])
            print(f"MLP 128-{width}-16, batch {batch}, {args.steps or steps} steps a run; step ~{wall / 1000:.1f} ms "
                  f"wall (off, median)\n  µs of training-thread CPU per step: off {off:.1f}, on {on:.1f}\n"
                  f"  on - off    (min median max): {_spread(cost)}\n"
                  f"  floor - off (min median max): {_spread(floor)}", flush=True)
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
