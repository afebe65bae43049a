"""What the training hooks cost: the reference trainer with the hooks off and on, interleaved.

One launch per configuration. Its steps alternate in blocks of BLOCK: hooks off (no Monitor, no
collective timer), then on, so a shared machine's drift hits both alike; the first pair of blocks is
warm-up. A block of 10 holds one step of every 10, so "every 10" signals are measured in each
on-block just as often as in a real run. Printed per configuration: the median step time off and
on (rank 0's, as the trainer times it), their ratio, and the difference.

* default: what `gpuwatch train` runs, every signal, similarity and checksum every 10 steps;
* bare: a Monitor with no optional signal (step phases, loss and friends, tokens, the record, the send);
* then one signal at a time on top of bare; similarity and checksum on *every* step, which shows
  their full per-measurement cost (divide by N for the amortised cost).

No agent needs to run: records to an absent agent cost the same system call as records delivered.

    python benchmarks/hooks_overhead.py [--steps 400] [--tp 2 --pp 2 --dp 2] [--only default]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from gpuwatch.trainer.config import TrainConfig
from gpuwatch.trainer.hooks import SIGNALS
from gpuwatch.trainer.launch import launch
from gpuwatch.trainer.parallel import comm
from gpuwatch.trainer.parallel.groups import build_grid
from gpuwatch.trainer.train import Trainer, instrument

BLOCK = 10
#: name -> (signals, measure every N steps)
CONFIGS = {
    "none (noise floor)": (None, 10),
    "default": (SIGNALS, 10),
    "bare": ((), 10),
    "+collectives": (("collectives",), 10),
    "+pipeline": (("pipeline",), 10),
    "+memory": (("memory",), 10),
    "+grad_similarity (every step)": (("grad_similarity",), 1),
    "+checksum (every step)": (("checksum",), 1),
}


def _alternating(device, cfg: TrainConfig, signals) -> dict[bool, list[float]]:
    """Step times with the hooks off (False) and on (True), warm-up blocks dropped. signals=None: off in
    both, to show the noise floor."""
    grid = build_grid(cfg.tp, cfg.pp, cfg.dp)
    trainer = Trainer(cfg, grid, device)
    monitor = instrument(trainer, signals or ())
    times: dict[bool, list[float]] = {False: [], True: []}
    while trainer.step < cfg.steps:
        block = trainer.step // BLOCK % 2 == 1
        on = block and signals is not None
        trainer.monitor = monitor if on else None
        comm.set_timer(monitor.collective if on else None)
        result = trainer.train_step()
        if trainer.step > 2 * BLOCK:
            times[block].append(result.step_time_s)
    comm.set_timer(None)
    monitor.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="Steps per configuration, off and on together.")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--only", choices=CONFIGS, action="append", help="Run only these configurations.")
    args = parser.parse_args()
    os.environ["GPUWATCH_SOCKET"] = str(Path(tempfile.mkdtemp()) / "no-agent.sock")
    layout = dict(tp=args.tp, pp=args.pp, dp=args.dp, micro_batches=args.micro_batches)
    print(f"tp {args.tp} × pp {args.pp} × dp {args.dp}, {args.micro_batches} micro-batches, default model, "
          f"{args.steps} steps per configuration in blocks of {BLOCK} (off, on, ...)")
    print(f"{'configuration':32} {'off ms':>8} {'on ms':>8} {'on/off':>7} {'cost ms':>8}")
    for name in args.only or CONFIGS:
        signals, every = CONFIGS[name]
        cfg = TrainConfig(**layout, steps=args.steps, global_batch=16, telemetry=True,
                          grad_similarity_every=every, checksum_every=every)
        times = launch(_alternating, cfg.world_size, cfg, signals, device="cpu")[0]
        off, on = statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3
        print(f"{name:32} {off:8.2f} {on:8.2f} {on / off:7.3f} {on - off:8.3f}", flush=True)


if __name__ == "__main__":
    main()
