"""What `gpuwatch run` injects into a rank, once torch is imported: a `hooks.Monitor` fed from PyTorch's global hooks
instead of the training loop's own calls, so the records, the DDP watching, the progress and the watchdog are the
Monitor's, and every rule judges both alike.

Idle until the process has a process group (`torch.distributed.init_process_group` returns, or an optimizer step
finds one that came another way, as from `init_device_mesh`); then the first forward of a module makes the Monitor
with that module (a DistributedDataParallel model gets the Monitor's DDP watching: the all-reduce tail every step,
the gradient cosine and norm on measuring steps). From then on one step per optimizer step:

* the step runs from the end of one `optimizer.step()` to the end of the next (`register_optimizer_step_pre_hook`,
  `register_optimizer_step_post_hook`, global: https://pytorch.org/docs/stable/optim.html); with several optimizers,
  the first one that steps sets the steps. Gradient accumulation is one step per optimizer step;
* its data wait runs from the start to the first module forward (`register_module_forward_pre_hook`, global:
  https://pytorch.org/docs/stable/generated/torch.nn.modules.module.register_module_forward_pre_hook.html),
  registered for one call a step so that the model's own modules run their forwards without it; compute from there
  to the optimizer step, optimizer the step itself;
* its loss is the sum of the one-element tensors `backward()` was called on in it (`torch.autograd.backward`,
  wrapped, which `Tensor.backward` calls):
  the loss itself with one backward a step, the step's mean loss where each micro-batch's loss is divided by the
  micro-batches, as gradient accumulation does. Under AMP's loss scaling the tensor backward() runs on is
  `GradScaler.scale(loss)` (wrapped): the loss reported is the one it was given, bit for bit, and the scaler's scale
  is the record's `loss_scale`. Read as the Monitor reads a reported tensor: on the CPU with the record, on a GPU
  copied without a sync and read a step or two later;
* its learning rate is the optimizer's first parameter group's `lr`;
* its gradient norm, where the job clips, is the norm `torch.nn.utils.clip_grad_norm_` returns (FSDP1's
  `clip_grad_norm_` method too) or the one `clip_grads_with_norm_` is given, where it is whole on the rank;
* blocking collectives called through `torch.distributed` (`all_reduce`, `broadcast`, `all_gather`,
  `reduce_scatter`, `barrier`, `send`, `recv` and their tensor variants) are timed as `Monitor.collective` times
  them, which also makes each the collective in flight on its group, numbered, for the hang diagnosis. Calls with
  `async_op=True` return before the transfer and are left alone, as are the calls one collective makes inside another;
* a framework adapter (gpuwatch.trainer.auto.adapters) may add the step's samples (`count`).

The Monitor is made with the job's layout where one is known (gpuwatch.trainer.auto.layout: `--layout`, Megatron's
parallel state, a device mesh over every rank from `init_device_mesh`, wrapped, or a DDP model over every rank).
What this cannot see is listed in the hello (`unavailable_from_outside`, UNAVAILABLE_FROM_OUTSIDE): the layout where
none is known (then diagnosis compares no ranks as peers: a pipeline's stages differ in work, tensor-parallel ranks
see the same data), and "gradients" where no DDP model holds each replica's whole gradient (FSDP shards it, tensor
and pipeline parallelism split it): the gradient cosine and the parameter checksum would be a shard's, so they are
not measured. The hello also carries the framework found and the rank's command line. Every hook is guarded: an
exception inside it is counted in `failures` and logged once, and training goes on untouched.
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing.util
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from gpuwatch.protocol.schema import UNAVAILABLE_FROM_OUTSIDE
from gpuwatch.trainer.auto.layout import detect_layout
from gpuwatch.trainer.hooks._safety import Failures
from gpuwatch.trainer.hooks.identity import Layout
from gpuwatch.trainer.hooks.monitor import SIGNALS, Monitor, Step, _Collective, _Phase
from gpuwatch.trainer.telemetry import captured_command

#: The torch.distributed functions timed, and the op (schema.COLLECTIVE_OPS) each counts as.
COLLECTIVES: Mapping[str, str] = {
    "all_reduce": "all_reduce", "broadcast": "broadcast", "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather", "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "barrier": "barrier", "send": "send", "recv": "recv",
}
#: The module a framework is known by, in the order they are told apart (Hugging Face's Trainer imports accelerate,
#: Lightning may import transformers): the hello's `framework`, "plain" when none is loaded.
FRAMEWORK_MODULES = (("torchtitan", "torchtitan"), ("megatron", "megatron"), ("lightning", "lightning"),
                     ("pytorch_lightning", "lightning"), ("transformers", "transformers"),
                     ("accelerate", "accelerate"))

#: The one instrumentation of this process, made by `install`.
active: AutoMonitor | None = None


def install() -> AutoMonitor:
    """Hook torch's global entry points in this process, once."""
    global active
    if active is None:
        active = AutoMonitor()
        active.install()
    return active



def unavailable_from_outside(layout: Layout | None, whole_gradients: bool, counted: Iterable[str] = ()) -> list[str]:
    """The hello's `unavailable_from_outside`: every entry of UNAVAILABLE_FROM_OUTSIDE, but "layout" where the
    layout is known (gpuwatch.trainer.auto.layout), "gradients" where the Monitor sees whole gradients, and what a
    framework adapter counts (`counted`: "samples", "tokens")."""
    seen = set(counted) | ({"layout"} if layout is not None else set())
    seen |= {"gradients"} if whole_gradients else set()
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
    process group exists), `phase` its phase open now; `losses` the tensors backward() was called on in it."""

    def __init__(self) -> None:
        self.failures = Failures()
        self.monitor: Monitor | None = None
        self.step: Step | None = None
        self.phase: _Phase | None = None
        self.losses: list[torch.Tensor] = []
        #: the optimizer whose steps are the steps (the first to step), and how many it has made
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizer_steps = 0
        self._first_forward: RemovableHandle | None = None  # registered while the next forward is awaited
        self._in_collective = False  # inside a timed collective: the collectives it calls are its own
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

    def install(self) -> None:
        register_optimizer_step_pre_hook(self._before_optimizer_step)
        register_optimizer_step_post_hook(self._after_optimizer_step)
        torch.autograd.backward = self._wrap_backward(torch.autograd.backward)  # Tensor.backward calls it too
        if dist.is_available():
            self._patch(dist.distributed_c10d, "init_process_group", self._wrap_init_process_group)
            self._patch(dist.distributed_c10d, "destroy_process_group", self._wrap_destroy_process_group)
            for name, op in COLLECTIVES.items():
                self._patch(dist.distributed_c10d, name, functools.partial(self._wrap_collective, op))
            from torch.distributed import device_mesh  # imported by torch.distributed already: no cost

            self._patch(device_mesh, "init_device_mesh", self._wrap_init_device_mesh)
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

    # -- process group and first forward -----------------------------------------------------------

    def _wrap_init_process_group(self, init_process_group: Callable) -> Callable:
        @functools.wraps(init_process_group)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = init_process_group(*args, **kwargs)
            self._await_forward()
            return result

        return wrapper

    def _wrap_destroy_process_group(self, destroy_process_group: Callable) -> Callable:
        @functools.wraps(destroy_process_group)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not args and kwargs.get("group") is None:  # the default group: training is over
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
        except Exception as error:
            self.failures.record("AutoMonitor._close", error)

    def _await_forward(self) -> None:
        """Have the next module forward call `_on_first_forward`."""
        try:
            if self._first_forward is None:
                self._first_forward = register_module_forward_pre_hook(self._on_first_forward)
        except Exception as error:
            self.failures.record("AutoMonitor._await_forward", error)

    def _on_first_forward(self, module: nn.Module, inputs: Any) -> None:
        """The step's first forward: the data wait ends and compute begins. The very first makes the Monitor, with
        the module called (the outermost: a DDP model where there is one), and opens the first step."""
        try:
            if self._first_forward is not None:
                self._first_forward.remove()
                self._first_forward = None
            if self.monitor is None:
                self.monitor = self._make_monitor(module)
                # A multiprocessing child (a launcher's forked or spawned rank) ends in os._exit, past atexit: its
                # last steps would be lost without closing at multiprocessing's own exit
                multiprocessing.util.Finalize(self.monitor, self.monitor.close, exitpriority=0)
                self._open_step()
            if self.step is not None:
                self._enter(self.step.compute())
        except Exception as error:
            self.failures.record("AutoMonitor._on_first_forward", error)

    def _make_monitor(self, model: nn.Module) -> Monitor:
        """The Monitor of `model`, the outermost module of the first forward, with the job's layout where it is
        known; without whole gradients, no gradient similarity or checksum (see `whole_gradients`)."""
        try:
            layout, _ = detect_layout(model, self.meshes)
        except Exception as error:  # a framework's state not as expected: measure on, the layout unknown
            self.failures.record("AutoMonitor.detect_layout", error)
            layout = None
        whole = whole_gradients(model, layout)
        fsdp = sys.modules.get("torch.distributed.fsdp")  # FSDP1 clips through its own method; loaded if used
        if fsdp is not None and isinstance(model, fsdp.FullyShardedDataParallel):
            self._patch(type(model), "clip_grad_norm_", self._wrap_clip_grad_norm)
        signals = SIGNALS if whole else SIGNALS - {"grad_similarity", "checksum"}
        return Monitor(model, layout=layout, signals=signals,
                       hello={"framework": detect_framework(), "command": captured_command(sys.orig_argv),
                              "unavailable_from_outside": unavailable_from_outside(layout, whole, self.counted)})

    def _wrap_init_device_mesh(self, init_device_mesh: Callable) -> Callable:
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
        clips, whole even where the gradients are sharded (FSDP2 returns it replicated), at no cost of its own."""
        @functools.wraps(clip_grad_norm)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            norm = clip_grad_norm(*args, **kwargs)
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

    # -- steps ---------------------------------------------------------------------------------------

    def _open_step(self) -> Step:
        assert self.monitor is not None
        early, self._early = self._early, {}
        self.step = self.monitor.step(number=self.optimizer_steps + 1, **early).__enter__()
        return self.step

    def _enter(self, phase: _Phase) -> None:
        """Close the phase open now and open `phase`."""
        self._close_phase()
        phase.__enter__()
        self.phase = phase

    def _close_phase(self) -> None:
        phase, self.phase = self.phase, None
        if phase is not None:
            phase.__exit__(None, None, None)

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            if self.optimizer is None:
                self.optimizer = optimizer
            if optimizer is self.optimizer and self.step is not None:
                self._enter(self.step.optimizer())
        except Exception as error:
            self.failures.record("AutoMonitor._before_optimizer_step", error)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The step ends: its loss and learning rate reported, its record handed over; the next step opens, waiting
        for data until its first forward."""
        try:
            if optimizer is not self.optimizer:
                return
            self.optimizer_steps += 1
            step = self.step
            if step is None:  # no Monitor yet: a process group made without init_process_group starts it
                if dist.is_available() and dist.is_initialized():
                    self._await_forward()
                return
            self._close_phase()
            losses, self.losses = self.losses, []
            step.report(loss=_total(losses), lr=_learning_rate(optimizer), grad_norm=self._grad_norm,
                        loss_scale=self._loss_scale)
            self._scaled, self._loss_scale, self._grad_norm = [], None, None
            self.step = None
            step.__exit__(None, None, None)
            self._enter(self._open_step().data())
            self._await_forward()
        except Exception as error:
            self.failures.record("AutoMonitor._after_optimizer_step", error)

    def _wrap_backward(self, backward: Callable) -> Callable:
        """`torch.autograd.backward`, keeping a loss: the one one-element tensor a backward starts from with the
        implicit gradient 1 (`loss.backward()`, or a pipeline's last stage calling autograd itself); a backward
        from activations and their gradients (a pipeline's other stages) is no loss."""
        @functools.wraps(backward)
        def wrapper(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> Any:
            try:
                if self.step is not None and grad_tensors is None:
                    loss = tensors[0] if isinstance(tensors, (list, tuple)) and len(tensors) == 1 else tensors
                    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                        self.losses.append(self._unscaled(loss))
            except Exception as error:
                self.failures.record("AutoMonitor.backward", error)
            return backward(tensors, grad_tensors, *args, **kwargs)

        return wrapper

    # -- collectives ---------------------------------------------------------------------------------

    def _wrap_collective(self, op: str, collective: Callable) -> Callable:
        place = {name: index for index, name in enumerate(inspect.signature(collective).parameters)}

        @functools.wraps(collective)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            timer = self._timer(op, place, args, kwargs)
            if timer is None:
                return collective(*args, **kwargs)
            self._in_collective = True
            try:
                with timer:
                    return collective(*args, **kwargs)
            finally:
                self._in_collective = False

        return wrapper

    def _timer(self, op: str, place: Mapping[str, int], args: tuple, kwargs: Mapping[str, Any]) -> _Collective | None:
        """The Monitor's timer for this call, or None for a call left alone (no step open, an async call, a call
        inside a timed one)."""
        try:
            if self.step is None or self._in_collective or _argument("async_op", place, args, kwargs):
                return None
            assert self.monitor is not None
            first = args[0] if args else next(iter(kwargs.values()), None)
            timer = self.monitor.collective(op, _nbytes(first), _argument("group", place, args, kwargs))
            return timer if isinstance(timer, _Collective) else None
        except Exception as error:
            self.failures.record("AutoMonitor._timer", error)
            return None


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


def _learning_rate(optimizer: torch.optim.Optimizer) -> float | None:
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    return float(lr) if isinstance(lr, (int, float)) else None
