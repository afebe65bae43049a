"""A plain DDP loop that knows nothing of gpuwatch (no import of it), written so that the same training can run
measured from outside (``gpuwatch run -- torchrun … twin_ddp.py``) or through the explicit API
(``monitored_twin.py``, which passes a ``hooks.Monitor`` as ``seams``): the side-by-side measure of issue 17. Every
call of the explicit API sits where the global hooks see the same thing: the step from one optimizer step to the
next, its compute from the first forward, the loss the tensor ``backward()`` is called on, the logging all-reduce of
the loss between the backward and the optimizer step (the common place for it), the learning rate the step used.

The model, data and schedule are plain_ddp.py's.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from clean_exit import run_then_exit
from plain_ddp import FEATURES, random_dataset
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler


class NoSeams:
    """The explicit API's calls the loop makes, doing nothing: the script as a user wrote it."""

    def data(self, loader: Iterable[Any]) -> Iterator[Any]:
        return iter(loader)

    def step(self) -> NoSeams:
        return self

    def __enter__(self) -> NoSeams:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def compute(self) -> AbstractContextManager[None]:
        return nullcontext()

    optimizer = compute

    def report(self, **values: Any) -> None:
        return None

    def collective(self, op: str, nbytes: int, group: Any = None) -> AbstractContextManager[None]:
        return nullcontext()


def train(steps: int, seams_for: Callable[[nn.Module], Any] = lambda model: NoSeams()) -> nn.Module:
    """`steps` optimizer steps of plain_ddp.py's model on 2+ gloo ranks, through `seams_for(model)`'s calls."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    dataset = random_dataset(32 * 10 * dist.get_world_size())
    sampler = DistributedSampler(dataset)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    seams = seams_for(model)
    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for inputs, labels in seams.data(DataLoader(dataset, batch_size=32, sampler=sampler)):
            with seams.step() as measured:
                with measured.compute():
                    loss = F.binary_cross_entropy_with_logits(model(inputs), labels)
                    loss.backward()
                    logged = loss.detach().reshape(1).clone()
                    with seams.collective("all_reduce", logged.numel() * logged.element_size()):
                        dist.all_reduce(logged)  # the mean loss over the ranks, for the log
                with measured.optimizer():
                    optimizer.step()
                measured.report(loss=loss, lr=optimizer.param_groups[0]["lr"])
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step == steps:
                break
        epoch += 1
    dist.destroy_process_group()
    return model


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    run_then_exit(train, parser.parse_args().steps)
