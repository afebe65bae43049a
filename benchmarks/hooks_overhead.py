"""What the training hooks cost: their fixed cost per step on a tiny model, then the reference trainer with the
hooks off and on, step by step.

**Fixed cost** (`--part fixed`): a step of ~1-2 ms (a two-layer MLP on a fixed batch, SGD), in one process (a
plain model) and as plain DDP over 2 ranks (gloo), where the hooks' own work is largest against the step; with
`--bucket-hook`, DDP with `Monitor(bucket_hook=True)` as well. The loop is a user's DDP tutorial's:
`monitor.data(batches)`, `with monitor.step(samples=...)`, `step.compute()` around forward and backward,
`step.optimizer()` around the update, `step.report(loss=loss.detach(), lr=...)`. Blocks of `--fixed-steps`
steps alternate hooks off (a second, identical model without a Monitor) and on (a Monitor with every default
signal: similarity and checksum every 10 steps); each round is one block of each, the first a warm-up. Per step and
round: the CPU time of the training thread (`time.thread_time`), of the whole process (`time.process_time`, which
includes the telemetry client's thread: each block ends with a pause for it to send what it was handed, so that its
work lands in its own block) and wall time; printed as off, on and their difference, min / median / max over the
rounds, with the machine (CPU, cores, load average before and after). CPU time is what the hooks take from the
training thread whatever else the machine runs; wall time on a shared machine wanders.

**Reference trainer** (`--part trainer`): each configuration runs in several rounds, the configurations
taking turns, so that a shared machine's changing load falls on all of them; within a run the steps
alternate hooks off (no Monitor, no collective timer) and on, so drift hits both alike (the first 20 steps
are warm-up). Printed per configuration, over all rounds: rank 0's median step time off and on as the
trainer times it, their ratio (and its range over the rounds) and difference, and the same for the CPU time
the training thread used per step, which other processes' load barely disturbs.

* none: the hooks off on both sides: the noise floor of this machine, now;
* default: what `gpuwatch train` runs: every signal, similarity and checksum every 10 steps;
* bare: a Monitor with no optional signal (step phases, loss and friends, tokens, the record, the send);
* then one signal at a time on top of bare; similarity and checksum on *every* step, which shows
  their whole per-measurement cost (divide by N for the amortised cost).

On-steps are every other step, so "every N" is configured as every 2N: the hooks measure one
on-step in N, as in a real run. No agent needs to run: a thread here reads the records off the
socket and drops them, so a send costs what it costs with an agent.

    python benchmarks/hooks_overhead.py [--part fixed|trainer|all] [--fixed-rounds 200 --fixed-steps 10]
        [--bucket-hook] [--rounds 5 --steps 120] [--tp 2 --pp 2 --dp 2] [--only default]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _harness import load_average, machine
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gpuwatch.protocol.schema import MAX_RECORD_BYTES
from gpuwatch.trainer import hooks
from gpuwatch.trainer.config import TrainConfig
from gpuwatch.trainer.hooks import DEFAULT_EVERY, SIGNALS
from gpuwatch.trainer.launch import launch
from gpuwatch.trainer.parallel import comm
from gpuwatch.trainer.parallel.groups import build_grid
from gpuwatch.trainer.telemetry import BATCH_SECONDS
from gpuwatch.trainer.train import Trainer, instrument

WARMUP_STEPS = 20
#: The fixed-cost model: width of the MLP's hidden layer and the batch (~2 ms a step here; `--width` to tune).
FIXED_WIDTH, FIXED_BATCH = 512, 64
#: The fixed cost's three identical models, each one block of steps per round in this order (`_fixed_cost`).
ARMS = ("off", "on", "floor")
#: name -> (signals, or None for hooks off on both sides; measure one on-step in N)
CONFIGS = {
    "none (noise floor)": (None, DEFAULT_EVERY),
    "default": (SIGNALS, DEFAULT_EVERY),
    "bare": ((), DEFAULT_EVERY),
    "+collectives": (("collectives",), DEFAULT_EVERY),
    "+pipeline": (("pipeline",), DEFAULT_EVERY),
    "+memory": (("memory",), DEFAULT_EVERY),
    "+grad_similarity (every step)": (("grad_similarity",), 1),
    "+checksum (every step)": (("checksum",), 1),
}


def _fixed_cost(device, rounds: int, steps: int, width: int, bucket_hook: bool = False) -> dict[str, Any]:
    """Per round, µs per step of this rank's training thread and wall clock for three identical models: one
    without a Monitor ("off"), one with ("on") and a second one without ("floor": its difference from "off" is
    the noise floor of this very run); a round is one block of `steps` steps of each, in turn, the first round a
    warm-up. And the CPU time the telemetry client's thread took per "on" step, read from its own clock. DDP with
    more than one rank (the launcher makes a process group of one for a single rank too: that one trains a plain
    model)."""
    distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1

    def model() -> nn.Module:
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(128, width), nn.ReLU(), nn.Linear(width, 16))
        return DistributedDataParallel(mlp) if distributed else mlp

    models = {arm: model() for arm in ARMS}
    optimizers = {arm: torch.optim.SGD(m.parameters(), lr=0.01) for arm, m in models.items()}
    batches = [(torch.randn(FIXED_BATCH, 128), torch.randint(16, (FIXED_BATCH,)))] * steps
    monitor = hooks.Monitor(models["on"], job="hooks-overhead", bucket_hook=bucket_hook)
    client_thread = monitor.client._thread.ident
    assert client_thread is not None
    client_clock = time.pthread_getcpuclockid(client_thread)

    def bare(arm: str) -> None:
        network, optimizer = models[arm], optimizers[arm]
        for inputs, targets in batches:
            loss = F.cross_entropy(network(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    def watched() -> None:
        network, optimizer = models["on"], optimizers["on"]
        for inputs, targets in monitor.data(batches):
            with monitor.step(samples=len(inputs)) as step:
                with step.compute():
                    loss = F.cross_entropy(network(inputs), targets)
                    loss.backward()
                with step.optimizer():
                    optimizer.step()
                    optimizer.zero_grad()
                step.report(loss=loss.detach(), lr=0.01)

    blocks: dict[str, Callable[[], None]] = {
        "off": partial(bare, "off"), "on": watched, "floor": partial(bare, "floor")}
    out: dict[str, Any] = {clock: {arm: [] for arm in ARMS} for clock in ("thread", "wall")}
    client = 0.0
    for round_ in range(rounds + 1):
        if round_ == 1:  # after the warm-up round, whose records the client's thread may still be sending
            time.sleep(2 * BATCH_SECONDS)
            client = time.clock_gettime(client_clock)
        for arm in ARMS:
            thread, wall = time.thread_time(), time.perf_counter()
            blocks[arm]()
            wall = time.perf_counter() - wall
            if round_ > 0:
                out["thread"][arm].append((time.thread_time() - thread) / steps * 1e6)
                out["wall"][arm].append(wall / steps * 1e6)
    time.sleep(2 * BATCH_SECONDS)  # the client's thread sends the last records
    client_seconds = time.clock_gettime(client_clock) - client
    monitor.close()
    out["client_us_per_step"] = client_seconds / (rounds * steps) * 1e6
    return out


def machine_and_load() -> str:
    """The lines the script's figures start with: the machine, torch's version, the load average before."""
    return f"machine: {machine(f'torch {torch.__version__}')}\nload average before: {load_average()}"


def _spread(values: list[float]) -> str:
    return f"{min(values):7.1f} {statistics.median(values):7.1f} {max(values):7.1f}"


def fixed_cost(rounds: int, steps: int, width: int, bucket_hook: bool = False) -> None:
    """Print the hooks' fixed cost per step, in one process and on rank 0 of 2-rank DDP (and with the bucket
    hook, if asked)."""
    print(f"fixed cost: MLP 128-{width}-16, batch {FIXED_BATCH}, SGD; default signals (similarity and checksum "
          f"every {DEFAULT_EVERY} steps); {rounds} rounds of {steps} steps each: off, on, off again (the floor), "
          f"after a warm-up round\n{machine_and_load()}", flush=True)
    print(f"{'µs per step':28} {'off':>7} {'on':>7}   {'on - off: min  median    max':>28}   {'floor (median)':>14}")
    layouts = [("one process", 1, False), ("DDP, 2 ranks (rank 0)", 2, False)]
    if bucket_hook:
        layouts.append(("DDP, 2 ranks, bucket_hook=True (rank 0)", 2, True))
    for name, ranks, hooked in layouts:
        result = launch(_fixed_cost, ranks, rounds, steps, width, hooked, device="cpu", timeout=3600)[0]
        print(name)
        for clock in ("thread", "wall"):
            times = result[clock]
            cost = [on - off for off, on in zip(times["off"], times["on"], strict=True)]
            floor = [again - off for off, again in zip(times["off"], times["floor"], strict=True)]
            print(f"  {clock + ' (training thread)' if clock == 'thread' else clock:26} "
                  f"{statistics.median(times['off']):7.1f} {statistics.median(times['on']):7.1f}   "
                  f"{_spread(cost):>28}   {statistics.median(floor):14.1f}", flush=True)
        print(f"  telemetry client's thread: {result['client_us_per_step']:.1f} µs of CPU per step", flush=True)
    print(f"load average after: {load_average()}")


def _alternating(device, cfg: TrainConfig, signals) -> dict[bool, list[tuple[float, float]]]:
    """(wall, CPU) seconds of each step with the hooks off (False) and on (True), after the warm-up."""
    grid = build_grid(cfg.tp, cfg.pp, cfg.dp)
    trainer = Trainer(cfg, grid, device)
    monitor = instrument(trainer, signals or ())
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    while trainer.step < cfg.steps:
        odd = trainer.step % 2 == 1
        on = odd and signals is not None
        trainer.monitor = monitor if on else None
        comm.set_timer(monitor.collective if on else None)
        cpu = time.thread_time()
        result = trainer.train_step()
        if trainer.step > WARMUP_STEPS:
            times[odd].append((result.step_time_s, time.thread_time() - cpu))
    comm.set_timer(None)
    monitor.close()
    return times


def _drain(path: Path) -> None:
    """Stand in for the node agent: read every record sent to `path` and drop it."""
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(path))

    def read_forever() -> None:
        while True:
            sink.recv(MAX_RECORD_BYTES)

    threading.Thread(target=read_forever, daemon=True).start()


def _medians_ms(samples: list[tuple[float, float]]) -> tuple[float, float]:
    return (statistics.median(sample[0] for sample in samples) * 1e3,
            statistics.median(sample[1] for sample in samples) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("fixed", "trainer", "all"), default="all")
    parser.add_argument("--fixed-rounds", type=int, default=200, help="Rounds of the fixed-cost measurement.")
    parser.add_argument("--fixed-steps", type=int, default=DEFAULT_EVERY,
                        help="Steps per block of the fixed-cost measurement (one measuring period by default).")
    parser.add_argument("--width", type=int, default=FIXED_WIDTH, help="Hidden width of the fixed-cost model.")
    parser.add_argument("--bucket-hook", action="store_true",
                        help="Measure DDP with Monitor(bucket_hook=True) too (fixed cost).")
    parser.add_argument("--rounds", type=int, default=5, help="Runs per trainer configuration, taking turns.")
    parser.add_argument("--steps", type=int, default=120, help="Steps per trainer run, off and on together.")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8, help="As `gpuwatch train`.")
    parser.add_argument("--only", choices=CONFIGS, action="append", help="Run only these trainer configurations.")
    args = parser.parse_args()
    agent = Path(tempfile.mkdtemp()) / "agent.sock"
    _drain(agent)
    os.environ["GPUWATCH_SOCKET"] = str(agent)
    if args.part in ("fixed", "all"):
        fixed_cost(args.fixed_rounds, args.fixed_steps, args.width, args.bucket_hook)
    if args.part in ("trainer", "all"):
        trainer_overhead(args)


def trainer_overhead(args: argparse.Namespace) -> None:
    """Print the reference trainer's step time and CPU time with the hooks off and on, per configuration."""
    names = args.only or list(CONFIGS)
    layout = dict(tp=args.tp, pp=args.pp, dp=args.dp, micro_batches=args.micro_batches)
    print(f"tp {args.tp} × pp {args.pp} × dp {args.dp}, {args.micro_batches} micro-batches, the default model; "
          f"{args.rounds} rounds of {args.steps} steps per configuration, alternating off and on\n"
          f"{machine_and_load()}", flush=True)
    pooled: dict[str, dict[bool, list]] = {name: {False: [], True: []} for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            signals, every = CONFIGS[name]
            cfg = TrainConfig(**layout, steps=args.steps, global_batch=16, telemetry=True,
                              grad_similarity_every=2 * every, checksum_every=2 * every)
            times = launch(_alternating, cfg.world_size, cfg, signals, device="cpu")[0]
            for on in (False, True):
                pooled[name][on] += times[on]
            ratios[name].append(_medians_ms(times[True])[0] / _medians_ms(times[False])[0])
    print(f"medians of rank 0, ms per step\n{'configuration':31} {'wall off':>8} {'on':>7} {'on/off':>6} "
          f"{'rounds':>11} {'cost':>6}   {'CPU off':>7} {'on':>7} {'on/off':>6} {'cost':>6}")
    for name in names:
        (wall_off, cpu_off), (wall_on, cpu_on) = _medians_ms(pooled[name][False]), _medians_ms(pooled[name][True])
        spread = f"{min(ratios[name]):.3f}-{max(ratios[name]):.3f}"
        print(f"{name:31} {wall_off:8.2f} {wall_on:7.2f} {wall_on / wall_off:6.3f} {spread:>11} "
              f"{wall_on - wall_off:6.2f}   {cpu_off:7.2f} {cpu_on:7.2f} {cpu_on / cpu_off:6.3f} "
              f"{cpu_on - cpu_off:6.2f}")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
