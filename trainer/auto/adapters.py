"""Framework adapters for `gpuwatch run`: what the global hooks cannot see and a framework's callbacks tell.

The hooks see a framework's steps, loss, collectives and memory by themselves; what they cannot see is how much work a
step did (the samples or tokens the data loader handed over, inside the framework's loop), so a job under
Hugging Face's `Trainer` or Lightning has no throughput and its hello lists "samples" as unavailable from outside.
One callback each counts the samples of each optimizer step, a few lines, added where the job builds its trainer:

    from gpuwatch.trainer.auto.adapters import huggingface_callback, lightning_callback
    Trainer(model, args, train_dataset=data, callbacks=[huggingface_callback()])   # transformers
    L.Trainer(callbacks=[lightning_callback()])                                     # lightning

Outside `gpuwatch run` the callbacks do nothing. They are made on call, from the installed framework's base class
(`transformers.TrainerCallback`, `lightning.pytorch.Callback` or `pytorch_lightning.Callback`), so gpuwatch needs
neither framework installed and imports one only when asked for its callback.

Where each framework calls them (the hook points the tests' stand-ins keep, tests/workloads/standins/):
* transformers: `on_step_begin(args, state, control, **kwargs)`, once per optimizer step, before its first
  micro-batch's forward (https://huggingface.co/docs/transformers/main_classes/callback): the step's samples are
  `args.per_device_train_batch_size * args.gradient_accumulation_steps` (a short last batch of an epoch is counted
  full: the Trainer does not pass the batch to callbacks);
* Lightning: `on_train_batch_start(trainer, pl_module, batch, batch_idx)`, before each batch's forward
  (https://lightning.ai/docs/pytorch/stable/extensions/callbacks.html): the batch's first tensor's first dimension,
  added up over the batches an optimizer step accumulates.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from gpuwatch.trainer.auto import instrument


def count_samples(samples: Callable[[], int]) -> None:
    """Add `samples()` to the step open now in this rank's `gpuwatch run` instrumentation (none: nothing). Called
    from a framework's loop: an exception is counted and logged once, never raised into training."""
    active = instrument.active
    if active is None:
        return
    try:
        active.count(samples=samples())
    except Exception as error:
        active.failures.record("adapters.count_samples", error)


def _counting() -> None:
    """An adapter exists: the hello will not list samples as unavailable."""
    if instrument.active is not None:
        instrument.active.counted.add("samples")


def batch_size(batch: Any) -> int:
    """The first dimension of the first tensor in a batch (a tensor, a sequence or a mapping of them); 0 if none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 0
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return next((size for size in map(batch_size, items) if size), 0)


def _base(*candidates: tuple[str, str]) -> type:
    """The first of (module, class) that imports; ImportError naming them all when none does."""
    for module, name in candidates:
        try:
            return getattr(importlib.import_module(module), name)
        except ImportError:
            continue
    raise ImportError(f"none of {', '.join(f'{module}.{name}' for module, name in candidates)} is installed")


def huggingface_callback() -> Any:
    """A `transformers.TrainerCallback` that counts each optimizer step's samples."""

    class GpuwatchCallback(_base(("transformers", "TrainerCallback"))):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            count_samples(lambda: args.per_device_train_batch_size * args.gradient_accumulation_steps)

    _counting()
    return GpuwatchCallback()


def lightning_callback() -> Any:
    """A Lightning `Callback` that counts each batch's samples into the optimizer step it belongs to."""

    class GpuwatchCallback(_base(("lightning.pytorch", "Callback"), ("pytorch_lightning", "Callback"))):  # type: ignore[misc]
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            count_samples(lambda: batch_size(batch))

    _counting()
    return GpuwatchCallback()
