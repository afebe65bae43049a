"""A user's Lightning job that knows nothing of gpuwatch, its first import the Lightning package it is given
(``--package lightning``: ``import lightning.pytorch``; ``--package pytorch_lightning``: the standalone package): a
``LightningModule`` around the tiny language model of framework_job (plain torch), ``Trainer(accelerator="cpu",
devices=2, strategy="ddp", accumulate_grad_batches=K)`` (``--accumulate 1|2``), ``max_steps`` optimizer steps over
micro-batches of 4 of synthetic token sequences, automatic optimization (the last accumulated batch's forward and
backward run inside the closure Lightning hands to ``optimizer.step``), no logger, checkpoint or progress bar.

    gpuwatch run -- torchrun --standalone --nproc-per-node 2 tests/workloads/lightning_fit.py --package lightning \
        --accumulate 2 --steps 12

The framework's own per-step loss (``--out``) is what Lightning back-propagates in an optimizer step: the sum over
its accumulated batches of the loss ``on_train_batch_end`` is given (``training_step``'s loss divided by
``accumulate_grad_batches``), in float32, per rank.

Faults (framework_job.FAULTS): ``slow-data`` in the data set's ``__getitem__``; ``slow-compute`` in the model's
forward; ``slow-outside`` in a ``Callback``'s ``on_train_batch_end`` after each optimizer step; ``slow-optimizer`` in
the optimizer's ``step``, after the closure and the update; ``--never-learns``: a learning rate of 0.
"""

# ruff: noqa: E402 (the Lightning package is imported first, chosen by an argument: the imports after it wait)
from __future__ import annotations

# isort: split
import importlib
import sys

#: The Lightning package to train with, read before anything else is imported: it is the script's first import.
PACKAGE = next((a.split("=", 1)[1] if "=" in a else sys.argv[i + 1]
                for i, a in enumerate(sys.argv) if a.split("=", 1)[0] == "--package"), "lightning")
pl = importlib.import_module("lightning.pytorch" if PACKAGE == "lightning" else "pytorch_lightning")

# isort: split
import os
import warnings

import torch
import torch.distributed as dist
from clean_exit import run_then_exit
from framework_job import Fault, TinyLM, Tokens, next_token_loss, parameters_hash, parser, slow_optimizer, write_results
from torch.utils.data import DataLoader

MICRO_BATCH = 4


class LitTinyLM(pl.LightningModule):
    def __init__(self, fault: Fault, accumulate: int) -> None:
        super().__init__()
        self.model = TinyLM(fault.delay / accumulate if fault.slows("compute") else 0.0)
        self.fault = fault
        self.lr = 0.0 if fault.never_learns else 1e-3

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return next_token_loss(self.model(batch), batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return slow_optimizer(torch.optim.AdamW, self.fault)(self.parameters(), lr=self.lr)


class StepLosses(pl.Callback):
    """Each optimizer step's loss as Lightning back-propagates it, and ``slow-outside``'s sleep after the step."""

    def __init__(self, fault: Fault, accumulate: int) -> None:
        self.fault, self.accumulate = fault, accumulate
        self.losses: list[float] = []
        self._step = torch.zeros(())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._step += outputs["loss"].detach()
        if (batch_idx + 1) % self.accumulate == 0:
            self.losses.append(self._step.item())
            self._step = torch.zeros(())
            self.fault.sleep("outside")


def main() -> object:
    parser_ = parser(__doc__)
    parser_.add_argument("--package", choices=("lightning", "pytorch_lightning"), default="lightning")
    parser_.add_argument("--accumulate", type=int, choices=(1, 2), default=1)
    args = parser_.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fault = Fault(args, rank)
    pl.seed_everything(0, verbose=False)
    module = LitTinyLM(fault, args.accumulate)
    losses = StepLosses(fault, args.accumulate)
    data = Tokens(args.steps * args.accumulate * MICRO_BATCH * world, fault, MICRO_BATCH * args.accumulate)
    trainer = pl.Trainer(accelerator="cpu", devices=world, num_nodes=1, strategy="ddp", max_steps=args.steps,
                         accumulate_grad_batches=args.accumulate, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
                         num_sanity_val_steps=0, deterministic=True)
    trainer.fit(module, DataLoader(data, batch_size=MICRO_BATCH, shuffle=True))
    write_results(args.out, rank, losses.losses, parameters_hash(module.model.parameters()))
    if dist.is_initialized():
        dist.destroy_process_group()
    return trainer


if __name__ == "__main__":
    run_then_exit(main)
