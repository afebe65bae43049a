"""A DDP job whose loop a framework owns, reduced to the events the framework calls on its callbacks, with gpuwatch's
adapter callback added (the one line a user adds; the rest knows nothing of gpuwatch). plain_ddp.py's model and data,
two micro-batches of 16 per optimizer step.

* ``--framework huggingface``: as `transformers.Trainer` does, `on_step_begin` once per optimizer step before its
  micro-batches, `on_substep_end` after each but the last, `on_step_end` after the optimizer step;
* ``--framework lightning``: as Lightning's fit loop does, `on_train_batch_start` before each batch's forward,
  `on_before_optimizer_step` before the step, `on_train_batch_end` after each batch.

The frameworks' modules are stand-ins (tests/workloads/standins/, on PYTHONPATH), with the real hook points.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from clean_exit import run_then_exit
from plain_ddp import FEATURES, random_dataset
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from gpuwatch.trainer.auto.adapters import huggingface_callback, lightning_callback

MICRO_BATCH, ACCUMULATE = 16, 2


def main() -> object:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--framework", choices=("huggingface", "lightning"), required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    dataset = random_dataset(MICRO_BATCH * ACCUMULATE * args.steps * dist.get_world_size())
    batches = iter(DataLoader(dataset, batch_size=MICRO_BATCH, sampler=DistributedSampler(dataset)))
    model = DistributedDataParallel(nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.framework == "huggingface":
        from transformers import TrainingArguments

        callback, hf_args = huggingface_callback(), TrainingArguments(MICRO_BATCH, ACCUMULATE)
    else:
        callback, hf_args = lightning_callback(), None
    state, control = SimpleNamespace(global_step=0), SimpleNamespace()
    for step in range(args.steps):
        if hf_args is not None:
            callback.on_step_begin(hf_args, state, control)
        for micro in range(ACCUMULATE):
            inputs, labels = next(batches)
            index = step * ACCUMULATE + micro
            if hf_args is None:
                callback.on_train_batch_start(None, model, (inputs, labels), index)
            F.binary_cross_entropy_with_logits(model(inputs), labels).backward()
            if hf_args is not None and micro < ACCUMULATE - 1:
                callback.on_substep_end(hf_args, state, control)
            if hf_args is None and micro == ACCUMULATE - 1:
                callback.on_before_optimizer_step(None, model, optimizer)
            if micro == ACCUMULATE - 1:
                optimizer.step()
                optimizer.zero_grad()
            if hf_args is None:
                callback.on_train_batch_end(None, model, None, (inputs, labels), index)
        state.global_step += 1
        if hf_args is not None:
            callback.on_step_end(hf_args, state, control)
    dist.destroy_process_group()
    return model


if __name__ == "__main__":
    run_then_exit(main)
