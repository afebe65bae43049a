"""twin_ddp.py's training through the explicit API: a ``hooks.Monitor`` of the DDP model is the loop's seams, closed
by the Monitor's own exit handler once the loop has ended."""

from __future__ import annotations

import argparse

from clean_exit import run_then_exit
from torch import nn
from twin_ddp import train

from gpuwatch.trainer import hooks


def monitor_of(model: nn.Module) -> hooks.Monitor:
    return hooks.Monitor(model, bucket_hook=True)  # as gpuwatch run watches a DDP model: a hook times its buckets


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    run_then_exit(train, parser.parse_args().steps, monitor_of)
