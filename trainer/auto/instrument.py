"""What `gpuwatch run` injects into a rank, once torch is imported: a `hooks.Monitor` fed from PyTorch's global hooks
instead of the training loop's own calls, so the records, the DDP watching, the progress and the watchdog are the
Monitor's, and every rule judges both alike.

Idle until the process has a process group (`torch.distributed.init_process_group` returns, or an optimizer step
finds one that came another way, as from `init_device_mesh`); then the first forward of a module in training mode
makes the Monitor with that module (a DistributedDataParallel model gets the Monitor's DDP watching through a
communication hook of gpuwatch's, `hooks.ddp.BucketHook`: each bucket's all-reduce timed on DDP's process group, bit
for bit DDP's own, a hook of the user's kept inside it, `register_comm_hook` wrapped; the gradient cosine and norm on
measuring steps). From then on one step per optimizer step, from
the end of one `optimizer.step()` to the end of the next (`register_optimizer_step_pre_hook`,
`register_optimizer_step_post_hook`, global: https://pytorch.org/docs/stable/optim.html); with several optimizers,
the first one that steps sets the steps. Gradient accumulation is one step per optimizer step.

Each phase is measured where it happens, whatever framework runs the loop (the schema's STEP_PHASES):

* *data*: the time inside a DataLoader iterator's `__next__` (`_BaseDataLoaderIter`, which Hugging Face's and
  accelerate's loaders and Lightning's fetchers all call) while the model trains; a loader read while the model is
  in eval mode (an evaluation) is not the step's input;
* *compute*: from a forward of the model in training mode (a pre-hook on the Monitor's model, the first of its
  pre-hooks, so the job's own count as compute) to the end of the backward (`torch.autograd.backward`, wrapped,
  which `Tensor.backward` calls), including a forward and backward run
  inside the closure an optimizer step is given (Lightning's automatic optimization): the closure is wrapped, and
  only the step's time outside it is the update;
* *optimizer*: `optimizer.step()` outside its closure, and gradient clipping (`clip_grad_norm_`, wrapped);
* the collectives waited for inside each phase are taken out of it (the Monitor's exposed communication), and
  *outside the model* is the rest of the step: callbacks, logging, evaluation (a forward in eval mode), checkpoints.

Values:

* its loss is the sum of the one-element tensors `backward()` was called on in it: the loss itself with one backward
  a step, the step's mean loss where each micro-batch's loss is divided by the micro-batches, as gradient
  accumulation does. Under AMP's loss scaling the tensor backward() runs on is `GradScaler.scale(loss)` (wrapped):
  the loss reported is the one it was given, bit for bit, and the scaler's scale is the record's `loss_scale`. Read
  as the Monitor reads a reported tensor: on the CPU with the record, on a GPU copied without a sync and read a
  step or two later;
* its learning rate is the optimizer's first parameter group's `lr`;
* its gradient norm, where the job clips, is the norm `torch.nn.utils.clip_grad_norm_` returns (FSDP1's
  `clip_grad_norm_` method too) or the one `clip_grads_with_norm_` is given, where it is whole on the rank;
* every collective `torch.distributed` exports is timed as `Monitor.collective` times it, which also makes it the
  collective in flight on its group, numbered, for the hang diagnosis: the set is read from the installed torch
  (`collective_functions`: every public function taking `async_op`, `*_single`, `*_into_tensor` and `*_coalesced`
  among them, and the point-to-point calls), not a hand list. A blocking call is timed whole; an asynchronous one
  (`async_op=True`, `isend`, `irecv`: FSDP2's all-gathers and reduce-scatters) is numbered when launched and timed
  while its `Work.wait()` blocks the training thread; calls one collective makes inside another are its own;
* so is every functional collective (DTensor's, tensor and sequence parallelism's: gpuwatch.trainer.auto.collectives),
  numbered when launched and timed while `wait_tensor` blocks on its output;
* a `torch.distributed.pipelining` schedule is read when its `step()` runs (gpuwatch.trainer.auto.pipelining): its
  shape goes into the hello, its window on this rank is the step's pipeline clock, and the step's loss is the mean of
  the micro-batch losses its last stage computed;
* a framework adapter (gpuwatch.trainer.auto.adapters) may add the step's samples (`count`);
* what the job trains (gpuwatch.trainer.auto.workload): the model's shape from its Hugging Face config or its parts,
  the global batch and sequence length from the first whole step's batches of token ids, said in the hello after that
  step, so that the PLAN rules can predict the step; a model whose shape cannot be read is said in the hello's notes.

The Monitor is made with the job's layout where one is known (gpuwatch.trainer.auto.layout: `--layout`, Megatron's
parallel state, a device mesh over every rank from `init_device_mesh`, wrapped, or a DDP model over every rank).
What this cannot see is listed in the hello (`unavailable_from_outside`, UNAVAILABLE_FROM_OUTSIDE): the layout where
none is known (then diagnosis compares no ranks as peers: a pipeline's stages differ in work, tensor-parallel ranks
see the same data), and "gradients" where no DDP model holds each replica's whole gradient (FSDP shards it, tensor
and pipeline parallelism split it): the gradient cosine and the parameter checksum would be a shard's, so they are
not measured. The hello also carries the framework found and the rank's command line. Every hook is guarded: an
exception inside it is counted in `failures` and logged once, and training goes on untouched. What the process went
through (instrumented, a process group, measuring, its first step, a failure, closed) is noted for `gpuwatch run`'s
end-of-run line (gpuwatch.trainer.auto.status).

Past 500 lines on purpose: one class, ``AutoMonitor``, whose wrappers of PyTorch's functions all feed the one step
open now and read each other's flags (the phase, the optimizer and its closure, a collective in flight); split,
each part would set the others' state.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import multiprocessing.util
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import dataloader
from torch.utils.hooks import RemovableHandle

from gpuwatch.plan.model import ModelShape
from gpuwatch.protocol.schema import MAX_NOTES, MAX_TEXT_CHARS, UNAVAILABLE_FROM_OUTSIDE
from gpuwatch.trainer.auto import pipelining, status
from gpuwatch.trainer.auto.collectives import (
    ASYNCHRONOUS_POINT_TO_POINT,
    collective_functions,
    time_functional_collectives,
)
from gpuwatch.trainer.auto.layout import detect_layout
from gpuwatch.trainer.auto.workload import batch_shape, model_shape
from gpuwatch.trainer.hooks.ddp import BucketHook
from gpuwatch.trainer.hooks.identity import Layout
from gpuwatch.trainer.hooks.monitor import SIGNALS, Monitor
from gpuwatch.trainer.hooks.pipeline import WindowClock
from gpuwatch.trainer.hooks.safety import Failures
from gpuwatch.trainer.hooks.step import CollectiveTimer, Phase, Step
from gpuwatch.trainer.telemetry import captured_command

#: The module a framework is known by, in the order they are told apart (Hugging Face's Trainer imports accelerate,
#: Lightning may import transformers): the hello's `framework`, "plain" when none is loaded.
FRAMEWORK_MODULES = (("torchtitan", "torchtitan"), ("megatron", "megatron"), ("lightning", "lightning"),
                     ("pytorch_lightning", "lightning"), ("transformers", "transformers"),
                     ("accelerate", "accelerate"))

#: Functional collectives launched and never waited for (a job that drops an output) that are kept before the freed
#: ones are forgotten: far above the few a step has in flight.
MAX_UNWAITED = 256
#: A DDP model's flag: a built-in (C++) communication hook of the job's is registered, and no hook of gpuwatch's.
_BUILTIN_HOOK = "_gpuwatch_builtin_comm_hook"
#: The one instrumentation of this process, made by `install`.
active: AutoMonitor | None = None


def install() -> AutoMonitor:
    """Hook torch's global entry points in this process, once."""
    global active
    if active is None:
        active = AutoMonitor()
        active.install()
        status.note("instrumented")
    return active


def unavailable_from_outside(layout: Layout | None, whole_gradients: bool, counted: Iterable[str] = (),
                             buckets_timed: bool = False) -> list[str]:
    """The hello's `unavailable_from_outside`: every entry of UNAVAILABLE_FROM_OUTSIDE, but "layout" where the
    layout is known (gpuwatch.trainer.auto.layout), "gradients" where the Monitor sees whole gradients, what a
    framework adapter counts (`counted`: "samples", "tokens"), and "ddp_bucket_latency" where gpuwatch's
    communication hook times a DDP model's buckets (`buckets_timed`)."""
    seen = set(counted) | ({"layout"} if layout is not None else set())
    seen |= {"gradients"} if whole_gradients else set()
    seen |= {"ddp_bucket_latency"} if buckets_timed else set()
    return [signal for signal in UNAVAILABLE_FROM_OUTSIDE if signal not in seen]


def whole_gradients(model: nn.Module, layout: Layout | None) -> bool:
    """Whether this rank holds its replica's whole gradient and parameters, as the gradient cosine similarity, its
    norm and the parameter checksum need: a DDP model of a replica that no tensor or pipeline parallelism splits.
    A sharded model (FSDP) or one a framework splits holds a shard: measured, those would be wrong, not missing."""
    return (isinstance(model, nn.parallel.DistributedDataParallel)
            and (layout is None or layout.tp_size == layout.pp_size == 1))


def detect_framework(modules: Mapping[str, object] = sys.modules) -> str:
    """The training framework loaded in this process, by the modules imported."""
    return next((name for module, name in FRAMEWORK_MODULES if module in modules), "plain")


class AutoMonitor:
    """Drives a Monitor's step, phases and report from torch's global hooks (see the module's docstring).

    Its state moves with the training thread: `step` is the step open now (None until the first forward after a
    process group exists), `phase` its phase open now (None: outside the model); `losses` the tensors backward() was
    called on in it."""

    def __init__(self) -> None:
        self.failures = Failures(on_first=_note_failure)
        self.monitor: Monitor | None = None
        self.model: nn.Module | None = None
        self.step: Step | None = None
        self.phase: Phase | None = None
        self.losses: list[torch.Tensor] = []
        #: the optimizer whose steps are the steps (the first to step), and how many it has made
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizer_steps = 0
        self._noted_step = False  # the first step record told to gpuwatch run's status
        #: inside that optimizer's step(), and inside the closure it was given: the update is the step's time
        #: outside the closure
        self._in_optimizer = False
        self._in_closure = False
        #: by id, whether a dataset's batches were last fed to the model training (True) or evaluating; the dataset
        #: of the latest batch read
        self._feeds: dict[int, bool] = {}
        self._fetched: int | None = None
        self._first_forward: RemovableHandle | None = None  # registered while the first forward is awaited
        self._in_collective = False  # inside a timed collective: the collectives it calls are its own
        #: asynchronous collectives launched and not yet waited for: their timers, started by Work.wait()
        self._launched: weakref.WeakKeyDictionary[Any, CollectiveTimer] = weakref.WeakKeyDictionary()
        #: functional collectives launched and not yet waited for, by their outputs' storage (what `wait_tensor` is
        #: given is another tensor on the same storage: the AsyncCollectiveTensor's), with a weak reference that
        #: tells a storage freed and its address reused; a coalesced call's outputs share a timer, timed once
        self._launched_storages: dict[int, tuple[CollectiveTimer, StorageWeakRef]] = {}
        self._group_by_name: dict[str, Any] = {}  # a functional collective's group name → its ProcessGroup
        #: torch.distributed.pipelining: whether its classes are patched; the schedule whose step() runs now (a
        #: training one, not an eval), and the micro-batch losses its last stage computed in the step open now
        self._pipelining_patched = False
        self._schedule: Any = None
        self._pipeline_shape: pipelining.PipelineShape | None = None
        self._micro_batch_losses: list[torch.Tensor] = []
        self._layout_known = False  # the Monitor's layout came from the job (gpuwatch.trainer.auto.layout)
        #: the device meshes init_device_mesh made (a framework's world mesh among them: the layout)
        self.meshes: list[Any] = []
        #: this step's losses scaled by a GradScaler: (the scaled tensor, the loss before scaling, the scale)
        self._scaled: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._loss_scale: torch.Tensor | None = None
        self._grad_norm: torch.Tensor | None = None  # this step's clip_grad_norm_ result
        #: what a framework adapter (gpuwatch.trainer.auto.adapters) counts, and its counts made before the first
        #: forward, for the first step
        self.counted: set[str] = set()
        self._early: dict[str, int] = {}
        #: whether gpuwatch's communication hook times the Monitor's DDP model's buckets (`_make_monitor`)
        self._buckets_timed = False
        #: the model's shape (`workload.model_shape`), until the hello says it with the batch; the (sequences, tokens)
        #: of each training batch of the step being read for it (None: not reading), the first whole step's
        self._shape: ModelShape | None = None
        self._batches: list[tuple[int, int]] | None = None

    def install(self) -> None:
        register_optimizer_step_pre_hook(self._before_optimizer_step)
        register_optimizer_step_post_hook(self._after_optimizer_step)
        torch.autograd.backward = self._wrap_backward(torch.autograd.backward)  # Tensor.backward calls it too
        self._patch(dataloader._BaseDataLoaderIter, "__next__", self._wrap_next_batch)
        if dist.is_available():
            self._patch(dist.distributed_c10d, "init_process_group", self._wrap_init_process_group)
            self._patch(dist.distributed_c10d, "destroy_process_group", self._wrap_destroy_process_group)
            for name, op in collective_functions().items():
                self._patch(dist.distributed_c10d, name, functools.partial(self._wrap_collective, name, op))
            self._patch(dist.Work, "wait", self._wrap_wait)
            time_functional_collectives(self._launch_functional, self._wait_functional)
            self._patch_pipelining()
            from torch.distributed import device_mesh  # imported by torch.distributed already: no cost

            self._patch(device_mesh, "init_device_mesh", self._wrap_init_device_mesh)
            # torchtitan 0.3.0 makes a one-dimensional "world" mesh and unflattens it into its named dimensions
            self._patch(device_mesh.DeviceMesh, "_unflatten", self._wrap_init_device_mesh)
            ddp = nn.parallel.DistributedDataParallel
            self._patch(ddp, "register_comm_hook", self._wrap_register_comm_hook)
            self._patch(ddp, "_register_builtin_comm_hook", self._wrap_register_builtin_comm_hook)
        self._patch(torch.amp.grad_scaler.GradScaler, "scale", self._wrap_scale)
        self._patch(torch.nn.utils, "clip_grad_norm_", self._wrap_clip_grad_norm)
        self._patch(torch.nn.utils, "clip_grads_with_norm_", self._wrap_clip_grads_with_norm)

    @staticmethod
    def _patch(module: Any, name: str, wrap: Callable[[Callable], Callable]) -> None:
        """Replace `module.name` (a module's function or a class's method) with its wrapped self, and the name
        torch.distributed or torch.nn.utils re-exports it under too."""
        original = getattr(module, name, None)
        if original is None:
            return
        wrapped = wrap(original)
        setattr(module, name, wrapped)
        for namespace in (dist, torch.nn.utils, torch.nn.utils.clip_grad):
            if getattr(namespace, name, None) is original:
                setattr(namespace, name, wrapped)

    # -- process group, the model, shutdown ----------------------------------------------------------

    def _wrap_init_process_group(self, init_process_group: Callable) -> Callable:
        @functools.wraps(init_process_group)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = init_process_group(*args, **kwargs)
            self._await_forward()
            return result

        return wrapper

    def _wrap_destroy_process_group(self, destroy_process_group: Callable) -> Callable:
        place = _places(destroy_process_group)

        @functools.wraps(destroy_process_group)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _argument("group", place, args, kwargs) is None:  # the default group, however given: training is over
                self._close()
            return destroy_process_group(*args, **kwargs)

        return wrapper

    def _close(self) -> None:
        """Send the last steps and close the Monitor while the process still runs: a launcher's rank may end in
        os._exit right after (the reference trainer's does), past atexit and multiprocessing's finalizers."""
        try:
            monitor, self.monitor = self.monitor, None
            self.step = None
            self._close_phase()
            if self._first_forward is not None:
                self._first_forward.remove()
                self._first_forward = None
            if monitor is not None:
                monitor.close()
                status.note("closed", rank=monitor.layout.rank, steps=self.optimizer_steps)
        except Exception as error:
            self.failures.record("AutoMonitor._close", error)

    def _await_forward(self) -> None:
        """Have the next module forward in training mode call `_on_first_forward`."""
        try:
            self._patch_pipelining()
            if self._first_forward is None and self.monitor is None:
                status.note("process_group", rank=dist.get_rank(), world_size=dist.get_world_size())
                self._first_forward = register_module_forward_pre_hook(self._on_first_forward)
        except Exception as error:
            self.failures.record("AutoMonitor._await_forward", error)

    def _on_first_forward(self, module: nn.Module, inputs: Any) -> None:
        """The first forward of a module in training mode after a process group exists: the Monitor, made with the
        module called (the outermost: a DDP model where there is one), which from now on is the model whose
        forwards are the compute; the first step opens. A forward in eval mode (Lightning's sanity check) waits."""
        try:
            if not _training(module):
                return
            if self._first_forward is not None:
                self._first_forward.remove()
                self._first_forward = None
            self._patch_pipelining()
            self.monitor = self._make_monitor(module)
            self.model = module
            # first among the model's own pre-hooks: the time a job's hooks take is the model's compute
            module.register_forward_pre_hook(self._on_forward, prepend=True)
            # A multiprocessing child (a launcher's forked or spawned rank) ends in os._exit, past atexit: its
            # last steps would be lost without closing at multiprocessing's own exit
            multiprocessing.util.Finalize(self.monitor, self.monitor.close, exitpriority=0)
            status.note("monitor", rank=self.monitor.layout.rank, framework=detect_framework())
            self._open_step()
            if self._schedule is not None:  # the first forward inside a pipeline schedule's first step
                self._enter_schedule()
            self._on_forward(module, inputs)
        except Exception as error:
            self.failures.record("AutoMonitor._on_first_forward", error)

    def _wrap_register_comm_hook(self, register: Callable) -> Callable:
        """DDP's `register_comm_hook`, which takes one hook, once: the user's hook is kept inside gpuwatch's
        (`BucketHook`, which times each bucket's all-reduce), registered now if the model has none yet, composed
        into it if it has. A second hook of the user's is refused as DDP refuses it."""
        @functools.wraps(register)
        def wrapper(model: nn.parallel.DistributedDataParallel, state: object, hook: Callable) -> None:
            if getattr(hook, "gpuwatch", False) or model.__dict__.get(_BUILTIN_HOOK):
                return register(model, state, hook)  # gpuwatch's own; or DDP's refusal after a built-in hook
            bucket = BucketHook.of(model)
            if bucket is None:  # before the Monitor: the user's hook inside ours, which times nothing yet
                model._check_comm_hook(hook)
                BucketHook(None).register(model, hook, state, register)
            elif bucket.inner is not None:
                register(model, state, hook)  # a second hook: DDP's own error, as without gpuwatch run
                return None
            else:
                model._check_comm_hook(hook)
                bucket.compose(hook, state)
            try:
                if model.logger is not None:
                    model.logger._set_comm_hook_name(hook.__qualname__)
            except Exception as error:
                self.failures.record("AutoMonitor.register_comm_hook", error)
            return None

        return wrapper

    def _wrap_register_builtin_comm_hook(self, register: Callable) -> Callable:
        """DDP's `_register_builtin_comm_hook` (C++ hooks): before gpuwatch's hook, as it is (the Monitor then times
        DDP's all-reduce as one tail per backward); after it, the built-in all-reduce is gpuwatch's own, and FP16
        compression its Python twin (`default_hooks.fp16_compress_hook`)."""
        @functools.wraps(register)
        def wrapper(model: nn.parallel.DistributedDataParallel, comm_hook_type: Any) -> Any:
            bucket = BucketHook.of(model)
            if bucket is None or bucket.inner is not None:
                model.__dict__[_BUILTIN_HOOK] = True
                return register(model, comm_hook_type)
            if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                bucket.compose(default_hooks.fp16_compress_hook, model.process_group)
            elif comm_hook_type != dist.BuiltinCommHookType.ALLREDUCE:
                return register(model, comm_hook_type)  # DDP's own error for a type it does not know
            return None

        return wrapper

    def _make_monitor(self, model: nn.Module) -> Monitor:
        """The Monitor of `model`, the outermost module of the first forward, with the job's layout where it is
        known; without whole gradients, no gradient similarity or checksum (see `whole_gradients`)."""
        notes: list[str] = []
        try:
            layout, _ = detect_layout(model, self.meshes, notes=notes)
        except Exception as error:  # a framework's state not as expected: measure on, the layout unknown
            self.failures.record("AutoMonitor.detect_layout", error)
            layout = None
        self._shape, read = model_shape(model)
        if self._shape is None:
            notes.append(f"the model's shape is not known ({read}): the PLAN rules cannot predict its step")
        self._layout_known = layout is not None
        whole = whole_gradients(model, layout)
        fsdp = sys.modules.get("torch.distributed.fsdp")  # FSDP1 clips through its own method; loaded if used
        if fsdp is not None and isinstance(model, fsdp.FullyShardedDataParallel):
            self._patch(type(model), "clip_grad_norm_", self._wrap_clip_grad_norm)
        signals = SIGNALS if whole else SIGNALS - {"grad_similarity", "checksum"}
        # DDP's all-reduce timed per bucket on its group by a communication hook of gpuwatch's (BucketHook), unless
        # a built-in C++ hook of the job's is registered already: then as one tail per backward (DdpWatch)
        self._buckets_timed = (isinstance(model, nn.parallel.DistributedDataParallel)
                               and not model.__dict__.get(_BUILTIN_HOOK))
        hello: dict[str, Any] = {"framework": detect_framework(), "command": captured_command(sys.orig_argv),
                                 "unavailable_from_outside": unavailable_from_outside(layout, whole, self.counted,
                                                                                      self._buckets_timed)}
        if notes:
            hello["notes"] = [note[:MAX_TEXT_CHARS] for note in notes[:MAX_NOTES]]
        monitor = Monitor(model, layout=layout, signals=signals, hello=hello, bucket_hook=self._buckets_timed)
        monitor.failures.on_first = _note_failure
        return monitor

    def _wrap_init_device_mesh(self, init_device_mesh: Callable) -> Callable:
        """`init_device_mesh`, or a mesh's `_unflatten`: the meshes made before the first forward, for the layout."""
        @functools.wraps(init_device_mesh)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            mesh = init_device_mesh(*args, **kwargs)
            if self.monitor is None:
                self.meshes.append(mesh)
            return mesh

        return wrapper

    def count(self, **counts: int) -> None:
        """An adapter's `samples` or `tokens` (Step's fields), added to the step open now; before the first forward
        (a framework's batch-start callback of the first step), kept for the first step."""
        try:
            for name, value in counts.items():
                if self.step is None:
                    self._early[name] = self._early.get(name, 0) + value
                else:
                    setattr(self.step, name, (getattr(self.step, name) or 0) + value)
        except Exception as error:
            self.failures.record("AutoMonitor.count", error)

    # -- AMP and gradient clipping ---------------------------------------------------------------------

    def _wrap_scale(self, scale: Callable) -> Callable:
        """`GradScaler.scale`, remembering the loss it scaled: backward() is then called on the scaled tensor, and
        the loss reported must be the one the job computed, bit for bit, not the scaled one divided back."""
        @functools.wraps(scale)
        def wrapper(scaler: Any, outputs: Any) -> Any:
            scaled = scale(scaler, outputs)
            try:
                factor = getattr(scaler, "_scale", None)
                if (self.step is not None and isinstance(outputs, torch.Tensor) and isinstance(scaled, torch.Tensor)
                        and scaled is not outputs and isinstance(factor, torch.Tensor)):
                    self._scaled.append((scaled, outputs.detach(), factor.detach().clone()))
            except Exception as error:
                self.failures.record("AutoMonitor.scale", error)
            return scaled

        return wrapper

    def _wrap_clip_grad_norm(self, clip_grad_norm: Callable) -> Callable:
        """`torch.nn.utils.clip_grad_norm_`, keeping the total norm it returns: the gradient norm of a job that
        clips, whole even where the gradients are sharded (FSDP2 returns it replicated), at no cost of its own.
        Clipping is part of the update: timed as the optimizer's."""
        @functools.wraps(clip_grad_norm)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            outer = self._enter_named("optimizer")
            try:
                norm = clip_grad_norm(*args, **kwargs)
            finally:
                self._enter_named(outer)
            self._keep_grad_norm(norm)
            return norm

        return wrapper

    def _wrap_clip_grads_with_norm(self, clip_grads_with_norm: Callable) -> Callable:
        """`torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)`, keeping `total_norm`: the
        second half of clipping, which a framework that computes the norm itself calls (torchtitan's
        `clip_grad_norm_` calls it with the norm it made whole)."""
        @functools.wraps(clip_grads_with_norm)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._keep_grad_norm(kwargs.get("total_norm", args[2] if len(args) > 2 else None))
            return clip_grads_with_norm(*args, **kwargs)

        return wrapper

    def _keep_grad_norm(self, norm: Any) -> None:
        """This step's gradient norm, where it is whole on this rank: a tensor, or a DTensor replicated on every
        rank (its local tensor). A partial DTensor is left alone: reading it would be a collective of the hooks'."""
        try:
            if self.step is None or not isinstance(norm, torch.Tensor):
                return
            placements = getattr(norm, "placements", None)
            if placements is None:
                self._grad_norm = norm.detach()
            elif all(placement.is_replicate() for placement in placements):
                self._grad_norm = norm.to_local().detach()  # type: ignore[attr-defined]
        except Exception as error:
            self.failures.record("AutoMonitor._keep_grad_norm", error)

    def _unscaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the job computed for a tensor backward() is called on: the one GradScaler.scale was given for
        its result (its scale kept for the record), else the tensor itself."""
        for scaled, unscaled, factor in self._scaled:
            if scaled is loss:
                self._loss_scale = factor
                return unscaled
        return loss.detach()

    # -- steps and phases ------------------------------------------------------------------------------

    def _open_step(self) -> Step:
        assert self.monitor is not None
        early, self._early = self._early, {}
        self.step = self.monitor.step(number=self.optimizer_steps + 1, **early).__enter__()
        return self.step

    def _enter_named(self, name: str | None) -> str | None:
        """Close the phase open now and open the phase `name` ("data", "compute", "optimizer"; None: outside the
        model, no phase) in the step open now; the name of the phase that was open, to come back to."""
        outer = self.phase.name if self.phase is not None else None
        step = self.step
        if step is None or name == outer:
            return outer
        self._close_phase()
        if name is not None:
            phase = step.data() if name == "data" else step.compute() if name == "compute" else step.optimizer()
            phase.__enter__()
            self.phase = phase
        return outer

    def _resume(self) -> None:
        """Back to the phase the training thread is in between a fetch or a backward and what comes next: compute
        inside a pipeline schedule's step (which runs the model: its passes, its loss, its sends and receives), the
        update inside the optimizer's step (outside its closure), else outside the model."""
        self._enter_named("compute" if self._schedule is not None else
                          "optimizer" if self._in_optimizer and not self._in_closure else None)

    def _close_phase(self) -> None:
        phase, self.phase = self.phase, None
        if phase is not None:
            phase.__exit__(None, None, None)

    def _on_forward(self, module: nn.Module, inputs: Any) -> None:
        """A forward of the model: compute begins, unless the model evaluates (eval mode: outside the model)."""
        try:
            training = _training(module)
            if self._fetched is not None:
                self._feeds[self._fetched] = training
            if training:
                self._enter_named("compute")
        except Exception as error:
            self.failures.record("AutoMonitor._on_forward", error)

    def _wrap_next_batch(self, next_batch: Callable) -> Callable:
        """A DataLoader iterator's `__next__`: the step's input when its dataset feeds the training, not when it
        feeds an evaluation (`_feeds`); a dataset not seen yet by a forward by the model's mode now (Hugging Face's
        Trainer reads the next step's batches before it puts the model back in training mode after evaluating)."""
        @functools.wraps(next_batch)
        def wrapper(iterator: Any) -> Any:
            model = self.model
            if self.step is None or model is None or self._in_collective:
                return next_batch(iterator)
            self._fetched = dataset = id(getattr(iterator, "_dataset", iterator))
            if not self._feeds.get(dataset, _training(model)):
                return next_batch(iterator)
            outer = self._phase_safely("data")
            try:
                batch = next_batch(iterator)
            finally:
                self._back_safely(outer)
            if self._batches is not None:
                self._read_batch(batch)
            return batch

        return wrapper

    def _read_batch(self, batch: Any) -> None:
        """A training batch of the step read for the hello's global batch and sequence length."""
        try:
            shape = batch_shape(batch)
            if shape is not None and self._batches is not None:
                self._batches.append(shape)
        except Exception as error:
            self.failures.record("AutoMonitor._read_batch", error)

    def _say_workload(self, monitor: Monitor) -> None:
        """Once the model's shape is known, read the batches of the first whole step (the first one's first batch
        comes before the Monitor) and say in the hello what the job trains: the shape, the sequence length and, where
        the job's layout is known, the global batch (this rank's sequences a step × its data-parallel replicas; with
        the layout unknown the replicas would be a guess, and the PLAN rules then say the job gives no batch)."""
        if self._shape is None:
            return
        if self._batches is None:
            self._batches = []
            return
        batches, self._batches = self._batches, None
        if batches and len({tokens for _, tokens in batches}) == 1:
            said: dict[str, Any] = {"model": self._shape.as_record().as_dict(), "seq_len": batches[0][1]}
            if self._layout_known:
                said["global_batch"] = sum(sequences for sequences, _ in batches) * monitor.layout.dp_size
            monitor.relayout(monitor.layout, said)
        self._shape = None

    def _phase_safely(self, name: str) -> str | None:
        try:
            return self._enter_named(name)
        except Exception as error:
            self.failures.record("AutoMonitor._enter_named", error)
            return None

    def _back_safely(self, outer: str | None) -> None:
        """Back to the phase a fetch or a backward interrupted: compute where a forward's time is (a batch read
        inside a forward), else wherever the training thread now is (`_resume`)."""
        try:
            if outer == "compute":
                self._enter_named(outer)
            else:
                self._resume()
        except Exception as error:
            self.failures.record("AutoMonitor._resume", error)

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any,
                               kwargs: Any) -> tuple[Any, Any] | None:
        """The update begins, unless the step was given a closure: then the update is what the step does outside
        the closure (`_wrap_closure`), and the closure's forward and backward are compute."""
        try:
            if self.optimizer is None:
                self.optimizer = optimizer
            if optimizer is not self.optimizer or self.step is None:
                return None
            self._in_optimizer = True
            # `args` begins with the optimizer itself: step(self, closure=None)
            closure = args[1] if len(args) > 1 else kwargs.get("closure")
            if not callable(closure):
                self._enter_named("optimizer")
                return None
            self._close_phase()
            wrapped = self._wrap_closure(closure)
            return ((args[0], wrapped, *args[2:]), kwargs) if len(args) > 1 else (args, {**kwargs, "closure": wrapped})
        except Exception as error:
            self.failures.record("AutoMonitor._before_optimizer_step", error)
            return None

    def _wrap_closure(self, closure: Callable) -> Callable:
        @functools.wraps(closure)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._in_closure = True
            self._close_phase_safely()
            try:
                return closure(*args, **kwargs)
            finally:
                self._in_closure = False
                self._back_safely(None)

        return wrapper

    def _close_phase_safely(self) -> None:
        try:
            self._close_phase()
        except Exception as error:
            self.failures.record("AutoMonitor._close_phase", error)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The step ends: its loss and learning rate reported, its record handed over; the next step opens, outside
        the model until its first batch or forward."""
        try:
            if optimizer is not self.optimizer:
                return
            self._in_optimizer = False
            self.optimizer_steps += 1
            step = self.step
            if step is None:  # no Monitor yet: a process group made without init_process_group starts it
                if dist.is_available() and dist.is_initialized():
                    self._await_forward()
                return
            self._close_phase()
            losses, self.losses = self.losses, []
            micro_batch_losses, self._micro_batch_losses = self._micro_batch_losses, []
            loss = _mean(micro_batch_losses) if micro_batch_losses else _total(losses)
            step.report(loss=loss, lr=_learning_rate(optimizer), grad_norm=self._grad_norm,
                        loss_scale=self._loss_scale)
            self._scaled, self._loss_scale, self._grad_norm = [], None, None
            self.step = None
            step.__exit__(None, None, None)
            self._say_workload(step.monitor)
            if not self._noted_step:
                self._noted_step = True
                status.note("step", rank=step.monitor.layout.rank, step=step.number)
            self._open_step()
        except Exception as error:
            self.failures.record("AutoMonitor._after_optimizer_step", error)

    def _wrap_backward(self, backward: Callable) -> Callable:
        """`torch.autograd.backward`: compute until it returns, and a loss kept: the one one-element tensor a
        backward starts from with the implicit gradient 1 (`loss.backward()`, or a pipeline's last stage calling
        autograd itself); a backward from activations and their gradients (a pipeline's other stages) is no loss,
        and inside a torch.distributed.pipelining schedule the losses are the schedule's (`_wrap_compute_loss`)."""
        @functools.wraps(backward)
        def wrapper(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> Any:
            if self.step is None:
                return backward(tensors, grad_tensors, *args, **kwargs)
            try:
                if grad_tensors is None and self._schedule is None:  # a schedule's losses are its micro-batches'
                    loss = tensors[0] if isinstance(tensors, (list, tuple)) and len(tensors) == 1 else tensors
                    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                        self.losses.append(self._unscaled(loss))
            except Exception as error:
                self.failures.record("AutoMonitor.backward", error)
            self._phase_safely("compute")
            try:
                return backward(tensors, grad_tensors, *args, **kwargs)
            finally:
                self._back_safely(None)

        return wrapper

    # -- collectives ---------------------------------------------------------------------------------

    def _wrap_collective(self, name: str, op: str, collective: Callable) -> Callable:
        place = _places(collective)
        asynchronous_always = name in ASYNCHRONOUS_POINT_TO_POINT

        @functools.wraps(collective)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            first = args[0] if args else next(iter(kwargs.values()), None)
            timer = self._timer(op, _argument("group", place, args, kwargs), first)
            if timer is None:
                return collective(*args, **kwargs)
            if asynchronous_always or _argument("async_op", place, args, kwargs):
                work = collective(*args, **kwargs)
                self._launch(work, timer)
                return work
            self._in_collective = True
            try:
                with timer:
                    return collective(*args, **kwargs)
            finally:
                self._in_collective = False

        return wrapper

    def _timer(self, op: str, group: Any, first: Any) -> CollectiveTimer | None:
        """The Monitor's timer for a call of `op` on `group` whose first argument is `first` (its bytes), numbered on
        its group now, or None for a call left alone (no step open, a call inside a timed one)."""
        try:
            if self.step is None or self._in_collective:
                return None
            assert self.monitor is not None
            timer = self.monitor.collective(op, _nbytes(first), group)
            return timer if isinstance(timer, CollectiveTimer) else None
        except Exception as error:
            self.failures.record("AutoMonitor._timer", error)
            return None

    def _launch(self, work: Any, timer: CollectiveTimer) -> None:
        """An asynchronous collective launched: timed when its Work is waited for (a call whose Work is never
        waited for, or that returned none, stays numbered but untimed)."""
        try:
            if work is not None:
                self._launched[work] = timer
        except Exception as error:
            self.failures.record("AutoMonitor._launch", error)

    def _wrap_wait(self, wait: Callable) -> Callable:
        """`Work.wait()`: for an asynchronous collective launched in a step, the time the training thread waits for
        it, in the step and phase open now; it is the collective in flight while it waits."""
        @functools.wraps(wait)
        def wrapper(work: Any, *args: Any, **kwargs: Any) -> Any:
            timer = self._waited(work)
            if timer is None:
                return wait(work, *args, **kwargs)
            self._in_collective = True
            try:
                with timer:
                    return wait(work, *args, **kwargs)
            finally:
                self._in_collective = False

        return wrapper

    def _waited(self, work: Any) -> CollectiveTimer | None:
        try:
            if not self._launched or self._in_collective:
                return None
            timer = self._launched.pop(work, None)
            if timer is None or self.step is None:
                return None
            timer.step = self.step  # waited for in the step open now, whichever launched it
            return timer
        except Exception as error:
            self.failures.record("AutoMonitor._waited", error)
            return None


    def _launch_functional(self, op: str, group_name: str | None, args: tuple, kwargs: dict,
                           launch: Callable[..., Any]) -> Any:
        """A functional collective launched (DTensor's, tensor parallelism's: gpuwatch.trainer.auto.collectives):
        numbered on its group now, timed while `wait_tensor` blocks on its output."""
        timer = self._functional_timer(op, group_name, args[0] if args else None)
        output = launch(*args, **kwargs)
        if timer is not None:
            try:
                launched = self._launched_storages
                if len(launched) >= MAX_UNWAITED:  # outputs never waited for: forget those already freed
                    for key in [key for key, (_, alive) in launched.items() if alive.expired()]:
                        del launched[key]
                for tensor in output if isinstance(output, (list, tuple)) else (output,):
                    if isinstance(tensor, torch.Tensor):
                        storage = tensor.untyped_storage()
                        launched[storage._cdata] = (timer, StorageWeakRef(storage))
            except Exception as error:
                self.failures.record("AutoMonitor._launch_functional", error)
        return output

    def _functional_timer(self, op: str, group_name: str | None, first: Any) -> CollectiveTimer | None:
        """The timer of a functional collective on the group it names (by its name: torch's registry of groups
        resolves it); None for a call left alone, or one whose group cannot be told."""
        if self.step is None or self._in_collective:
            return None
        try:
            group = self._group_by_name.get(group_name) if group_name is not None else None
            if group is None and group_name is not None:
                group = self._group_by_name[group_name] = dist.distributed_c10d._resolve_process_group(
                    group_name)  # type: ignore[arg-type]
        except Exception as error:
            self.failures.record("AutoMonitor._functional_timer", error)
            return None
        return self._timer(op, group, first)

    def _wait_functional(self, args: tuple, kwargs: dict, wait: Callable[..., Any]) -> Any:
        """`wait_tensor`: the time the training thread waits for a functional collective launched in a step, in the
        step and phase open now; it is the collective in flight while it waits."""
        timer = self._waited_tensor(args[0] if args else kwargs.get("tensor"))
        if timer is None:
            return wait(*args, **kwargs)
        self._in_collective = True
        try:
            with timer:
                return wait(*args, **kwargs)
        finally:
            self._in_collective = False

    def _waited_tensor(self, tensor: Any) -> CollectiveTimer | None:
        try:
            if not self._launched_storages or self._in_collective or not isinstance(tensor, torch.Tensor):
                return None
            launched = self._launched_storages.pop(tensor.untyped_storage()._cdata, None)
            if launched is None or launched[1].expired() or self.step is None:
                return None
            timer = launched[0]
            if timer.start is not None:  # a coalesced call's later output
                return None
            timer.step = self.step
            return timer
        except Exception as error:
            self.failures.record("AutoMonitor._waited_tensor", error)
            return None

    # -- torch.distributed.pipelining ------------------------------------------------------------------

    def _patch_pipelining(self) -> None:
        """Wrap torch.distributed.pipelining's schedules (gpuwatch.trainer.auto.pipelining), once, where the job has
        imported it: importing it here would cost every job that does not pipeline."""
        schedules = sys.modules.get(pipelining.SCHEDULES_MODULE)
        if self._pipelining_patched or schedules is None:
            return
        self._pipelining_patched = True
        base = schedules._PipelineSchedule
        for schedule_class in {base, *_subclasses(base)}:
            if "step" in vars(schedule_class):
                self._patch(schedule_class, "step", self._wrap_schedule_step)
        self._patch(base, "_compute_loss", self._wrap_compute_loss)

    def _wrap_schedule_step(self, schedule_step: Callable) -> Callable:
        """A training schedule's `step()`: the pipeline's window on this rank and the losses computed in it. A
        schedule step inside another (a subclass calling its base's) is the outer one's."""
        @functools.wraps(schedule_step)
        def wrapper(schedule: Any, *args: Any, **kwargs: Any) -> Any:
            if self._schedule is not None or not getattr(schedule, "_has_backward", True):
                return schedule_step(schedule, *args, **kwargs)
            self._schedule = schedule
            self._enter_schedule()
            try:
                return schedule_step(schedule, *args, **kwargs)
            finally:
                self._schedule = None
                self._leave_schedule()

        return wrapper

    def _enter_schedule(self) -> None:
        """The schedule running now opens this step's pipeline window (the first schedule step of an optimizer step
        opens it, the last closes it); the layout and hello told the pipeline's shape the first time it is seen or
        changes. Before the first step (the first schedule step makes the model's first forward, which makes the
        Monitor) that forward calls this again."""
        try:
            shape = pipelining.read_schedule(self._schedule)
            if shape is None or self.step is None or self.monitor is None:
                return
            if shape != self._pipeline_shape:
                self._pipeline_shape = shape
                self._describe_pipeline(shape)
            self.step.window_clock(shape.group, shape.bubble_theoretical).start()
            self._enter_named("compute")
        except Exception as error:
            self.failures.record("AutoMonitor._enter_schedule", error)

    def _leave_schedule(self) -> None:
        try:
            if self.step is not None and isinstance(self.step.pipeline, WindowClock):
                self.step.pipeline.stop()
            self._resume()
        except Exception as error:
            self.failures.record("AutoMonitor._leave_schedule", error)

    def _describe_pipeline(self, shape: pipelining.PipelineShape) -> None:
        """The Monitor's layout and hello with the pipeline's shape: the schedule, micro-batches, stages a rank and
        the modules of this rank's stages; the layout known where only the pipeline tells it."""
        assert self.monitor is not None
        layout = _pipeline_layout(self.monitor.layout, shape, known=self._layout_known)
        self._layout_known = True
        unavailable = [name for name in unavailable_from_outside(layout, False, self.counted, self._buckets_timed)
                       if name != "pipeline"]
        hello = {"virtual_stages": shape.virtual_stages, "stage_modules": list(shape.modules),
                 "unavailable_from_outside": unavailable}
        self.monitor.relayout(layout, hello)

    def _wrap_compute_loss(self, compute_loss: Callable) -> Callable:
        """A micro-batch's loss on the last stage, kept for the step's (their mean)."""
        @functools.wraps(compute_loss)
        def wrapper(schedule: Any, *args: Any, **kwargs: Any) -> Any:
            loss = compute_loss(schedule, *args, **kwargs)
            if self._schedule is not None and isinstance(loss, torch.Tensor) and loss.numel() == 1:
                self._micro_batch_losses.append(loss.detach())
            return loss

        return wrapper


def _training(module: nn.Module) -> bool:
    """Whether a model trains: a DDP wrapper by the module it wraps, whose mode a framework sets (Lightning puts
    the LightningModule in eval mode to validate and back, and leaves the wrapper as it is)."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return module.module.training
    return module.training


def _note_failure(where: str, error: BaseException) -> None:
    status.note("failure", where=where, error=f"{type(error).__name__}: {error}")


def _places(function: Callable) -> dict[str, int]:
    """Each parameter's position in `function`'s signature."""
    return {name: index for index, name in enumerate(inspect.signature(function).parameters)}


def _argument(name: str, place: Mapping[str, int], args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """The argument `name` of a call, given by keyword or by position (`place`); None when not given."""
    if name in kwargs:
        return kwargs[name]
    index = place.get(name)
    return args[index] if index is not None and index < len(args) else None


def _nbytes(value: Any) -> int:
    """The bytes of a call's first argument: a tensor, or a list of them (all_gather's outputs); 0 for anything else
    (barrier's group)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(t.numel() * t.element_size() for t in value if isinstance(t, torch.Tensor))
    return 0


def _total(losses: list[torch.Tensor]) -> torch.Tensor | None:
    """The step's loss: the one backward()'s tensor, or the sum of several (one op, no sync)."""
    if not losses:
        return None
    if len(losses) == 1:
        return losses[0]
    return torch.stack([loss.reshape(()) for loss in losses]).sum()


def _mean(losses: list[torch.Tensor]) -> torch.Tensor:
    """A pipeline step's loss: the mean of its micro-batches' (one op, no sync)."""
    return torch.stack([loss.reshape(()) for loss in losses]).mean()


def _learning_rate(optimizer: torch.optim.Optimizer) -> float | None:
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    return float(lr) if isinstance(lr, (int, float)) else None


def _subclasses(cls: type) -> set[type]:
    """Every subclass of `cls` defined so far, at any depth."""
    found: set[type] = set()
    sub: type
    for sub in cls.__subclasses__():
        found |= {sub, *_subclasses(sub)}
    return found


def _pipeline_layout(layout: Layout, shape: pipelining.PipelineShape, known: bool) -> Layout:
    """The layout with the pipeline's shape: its schedule and micro-batches; where no layout was `known` (no device
    mesh, no --layout) and the pipeline spans the world, a pipeline of `shape.ranks` stages with this rank at its
    place."""
    layout = dataclasses.replace(layout, schedule=shape.schedule, micro_batches=shape.micro_batches)
    if not known and shape.ranks == layout.world_size > 1:
        members = tuple(dist.get_process_group_ranks(shape.group)) if shape.group is not None else tuple(
            range(layout.world_size))
        layout = dataclasses.replace(
            layout, pp_size=shape.ranks, pp_stage=shape.rank, dp_size=1, dp_rank=0, tp_size=1, tp_rank=0,
            process_groups={"pp": members, "tp": (layout.rank,), "dp": (layout.rank,)},
            backends=dict.fromkeys(("pp", "tp", "dp"), dist.get_backend(shape.group)))
    return layout
