"""What the training hooks cost: the reference trainer with the hooks off and on, step by step.

Each configuration runs in several rounds, the configurations taking turns, so that a shared
machine's changing load falls on all of them; within a run the steps alternate hooks off (no
Monitor, no collective timer) and on, so drift hits both alike (the first 20 steps are warm-up).
Printed per configuration, over all rounds: rank 0's median step time off and on as the trainer
times it, their ratio (and its range over the rounds) and difference, and the same for the CPU time
the training thread used per step, which other processes' load barely disturbs.

* none: the hooks off on both sides: the noise floor of this machine, now;
* default: what `gpuwatch train` runs: every signal, similarity and checksum every 10 steps;
* bare: a Monitor with no optional signal (step phases, loss and friends, tokens, the record, the send);
* then one signal at a time on top of bare; similarity and checksum on *every* step, which shows
  their whole per-measurement cost (divide by N for the amortised cost).

On-steps are every other step, so "every N" is configured as every 2N: the hooks measure one
on-step in N, as in a real run. No agent needs to run: a thread here reads the records off the
socket and drops them, so a send costs what it costs with an agent.

    python benchmarks/hooks_overhead.py [--rounds 5 --steps 120] [--tp 2 --pp 2 --dp 2] [--only default]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from gpuwatch.agent.telemetry.schema import MAX_RECORD_BYTES
from gpuwatch.trainer.config import TrainConfig
from gpuwatch.trainer.hooks import DEFAULT_EVERY, SIGNALS
from gpuwatch.trainer.launch import launch
from gpuwatch.trainer.parallel import comm
from gpuwatch.trainer.parallel.groups import build_grid
from gpuwatch.trainer.train import Trainer, instrument

WARMUP_STEPS = 20
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
    parser.add_argument("--rounds", type=int, default=5, help="Runs per configuration, taking turns.")
    parser.add_argument("--steps", type=int, default=120, help="Steps per run, off and on together.")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8, help="As `gpuwatch train`.")
    parser.add_argument("--only", choices=CONFIGS, action="append", help="Run only these configurations.")
    args = parser.parse_args()
    agent = Path(tempfile.mkdtemp()) / "agent.sock"
    _drain(agent)
    os.environ["GPUWATCH_SOCKET"] = str(agent)
    names = args.only or list(CONFIGS)
    layout = dict(tp=args.tp, pp=args.pp, dp=args.dp, micro_batches=args.micro_batches)
    print(f"tp {args.tp} × pp {args.pp} × dp {args.dp}, {args.micro_batches} micro-batches, the default model; "
          f"{args.rounds} rounds of {args.steps} steps per configuration, alternating off and on", flush=True)
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


if __name__ == "__main__":
    main()
