"""What the training hooks cost: their fixed cost per step on a tiny model, then the reference trainer with the
hooks off and on, step by step.

**Fixed cost** (`--part fixed`): a step of ~2 ms (a two-layer MLP on a fixed batch, SGD), in one process and
as plain DDP over 2 ranks (gloo), where the hooks' own work is largest against the step. Blocks of
`--fixed-steps` steps alternate hooks off (a second, identical model without a Monitor) and on (a Monitor
with every default signal: similarity and checksum every 10 steps, reporting loss, lr and samples); each
round is one block of each, the first a warm-up. Per step and round: the CPU time of the training thread
(`time.thread_time`), of the whole process (`time.process_time`, which includes the telemetry client's
thread: each block ends with a pause for it to send what it was handed, so that its work lands in its
own block) and wall time; printed as off, on and their difference, min / median / max over the rounds,
with the machine (CPU, cores, load average before and after). CPU time is what the hooks take from the
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

    python benchmarks/hooks_overhead.py [--part fixed|trainer|all] [--fixed-rounds 20 --fixed-steps 100]
        [--rounds 5 --steps 120] [--tp 2 --pp 2 --dp 2] [--only default]
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
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


def _fixed_cost(device, rounds: int, steps: int, width: int) -> dict[str, dict[bool, list[float]]]:
    """Per round, µs per step of this rank's training thread, process and wall clock, hooks off (False) and
    on (True); a round is one block of `steps` steps each way, the first round a warm-up."""
    distributed = torch.distributed.is_initialized()

    def model() -> nn.Module:
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(128, width), nn.ReLU(), nn.Linear(width, 16))
        return DistributedDataParallel(mlp) if distributed else mlp

    plain, watched = model(), model()
    optimizers = {m: torch.optim.SGD(m.parameters(), lr=0.01) for m in (plain, watched)}
    batches = [(torch.randn(FIXED_BATCH, 128), torch.randint(16, (FIXED_BATCH,)))] * steps
    monitor = hooks.Monitor(watched, job="hooks-overhead")

    def off() -> None:
        optimizer = optimizers[plain]
        for inputs, targets in batches:
            loss = F.cross_entropy(plain(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    def on() -> None:
        optimizer = optimizers[watched]
        for inputs, targets in monitor.data(batches):
            with monitor.step(samples=len(inputs)) as step:
                with step.compute():
                    loss = F.cross_entropy(watched(inputs), targets)
                    loss.backward()
                with step.optimizer():
                    optimizer.step()
                    optimizer.zero_grad()
                step.report(loss=loss.detach(), lr=0.01)

    out: dict[str, dict[bool, list[float]]] = {clock: {False: [], True: []} for clock in ("thread", "process", "wall")}
    for round_ in range(rounds + 1):
        for hooked, block in ((False, off), (True, on)):
            thread, process, wall = time.thread_time(), time.process_time(), time.perf_counter()
            block()
            wall = time.perf_counter() - wall
            time.sleep(2 * BATCH_SECONDS)  # the client's thread sends this block's records now, not in the next
            if round_ > 0:
                for clock, seconds in (("thread", time.thread_time() - thread),
                                       ("process", time.process_time() - process), ("wall", wall)):
                    out[clock][hooked].append(seconds / steps * 1e6)
    monitor.close()
    return out


def _machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown CPU")
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"


def _load() -> str:
    return " ".join(f"{load:.2f}" for load in os.getloadavg())


def _spread(values: list[float]) -> str:
    return f"{min(values):7.1f} {statistics.median(values):7.1f} {max(values):7.1f}"


def fixed_cost(rounds: int, steps: int, width: int) -> None:
    """Print the hooks' fixed cost per step, in one process and on rank 0 of 2-rank DDP."""
    print(f"fixed cost: MLP 128-{width}-16, batch {FIXED_BATCH}, SGD; default signals (similarity and checksum "
          f"every {DEFAULT_EVERY} steps); {rounds} rounds of {steps} steps off, then on (after a warm-up round)\n"
          f"machine: {_machine()}\nload average before: {_load()}", flush=True)
    print(f"{'µs per step':24} {'off (median)':>12} {'on (median)':>12}   {'on - off:  min  median     max':>30}")
    for name, ranks in (("one process", 1), ("DDP, 2 ranks (rank 0)", 2)):
        result = launch(_fixed_cost, ranks, rounds, steps, width, device="cpu", timeout=3600)[0]
        print(name)
        for clock in ("thread", "process", "wall"):
            off, on = result[clock][False], result[clock][True]
            cost = [b - a for a, b in zip(off, on, strict=True)]
            print(f"  {clock:22} {statistics.median(off):12.1f} {statistics.median(on):12.1f}   {_spread(cost):>30}",
                  flush=True)
    print(f"load average after: {_load()}")


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
    return tuple(statistics.median(sample[i] for sample in samples) * 1e3 for i in (0, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("fixed", "trainer", "all"), default="all")
    parser.add_argument("--fixed-rounds", type=int, default=20, help="Rounds of the fixed-cost measurement.")
    parser.add_argument("--fixed-steps", type=int, default=100, help="Steps per block of the fixed-cost measurement.")
    parser.add_argument("--width", type=int, default=FIXED_WIDTH, help="Hidden width of the fixed-cost model.")
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
        fixed_cost(args.fixed_rounds, args.fixed_steps, args.width)
    if args.part in ("trainer", "all"):
        trainer_overhead(args)


def trainer_overhead(args: argparse.Namespace) -> None:
    """Print the reference trainer's step time and CPU time with the hooks off and on, per configuration."""
    names = args.only or list(CONFIGS)
    layout = dict(tp=args.tp, pp=args.pp, dp=args.dp, micro_batches=args.micro_batches)
    print(f"tp {args.tp} × pp {args.pp} × dp {args.dp}, {args.micro_batches} micro-batches, the default model; "
          f"{args.rounds} rounds of {args.steps} steps per configuration, alternating off and on\n"
          f"machine: {_machine()}\nload average before: {_load()}", flush=True)
    pooled = {name: {False: [], True: []} for name in names}
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
    print(f"load average after: {_load()}")


if __name__ == "__main__":
    main()
