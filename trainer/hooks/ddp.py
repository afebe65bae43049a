"""Watching DistributedDataParallel: the time the training thread waits for DDP's gradient all-reduce, and each
rank's own gradient against DDP's average.

Without a communication hook (`DdpWatch`): a hook after one parameter's gradient accumulation queues an autograd
final callback once per backward DDP reduces, which marks the end of the backward's computation (every gradient
computed, every bucket launched) and queues a second one behind DDP's own final callback, which waits for the
buckets; between the two marks is the tail the training thread waited for (`exposed_collective_seconds`, every
step). Three Python calls per backward against ~50 µs per bucket for a Python communication hook, which DDP calls
on the training thread for every bucket on the CPU. On measuring steps only, the first callback copies this rank's
gradients (DDP copied them into its buckets and averages those; `.grad` keeps the local values until DDP's own
callback copies the averages back), and the second compares the copies with DDP's averages (the gradient cosine
similarity). A DDP model whose gradients are views of its buckets (`gradient_as_bucket_view=True`) averages them
in place as the buckets complete: there a hook after each parameter's gradient accumulation copies it first.

`Monitor(bucket_hook=True)` adds a communication hook instead (`BucketHook`: DDP's all-reduce with a callback per
bucket) for what only it sees: each bucket's latency and bytes on DDP's process group (the record's `collectives`
and `groups`). `gpuwatch run` uses it for every DDP model, keeping a hook the user registers inside it.

Both are handed the Monitor's `step.StepContext` (its clock, progress, numbering of collectives and the step open
now, which a backward's times go to), never the Monitor itself. Every hook here runs inside autograd or DDP, and never
raises into them: a failure is counted in the context's `failures`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from gpuwatch.trainer.hooks.clock import Mark
from gpuwatch.trainer.hooks.collectives import Call
from gpuwatch.trainer.hooks.progress import InFlight
from gpuwatch.trainer.hooks.safety import guarded

if TYPE_CHECKING:
    from gpuwatch.trainer.hooks.step import Step, StepContext

#: Autograd's engine, whose final callbacks (`queue_callback`) run once a backward's graph is done, in the order
#: queued; DDP's reducer queues the one that waits for its buckets when the last bucket is launched.
_ENGINE = torch.autograd.Variable._execution_engine


class DdpWatch:
    """A DDP model that reduces its gradients in C++ (no communication hook), watched through autograd: its
    all-reduce tail on every step (`watch_backward`), and on measuring steps this rank's gradients against DDP's
    averages (`watch_gradients`)."""

    def __init__(self, context: StepContext, ddp: DistributedDataParallel) -> None:
        self._context = context
        self.failures = context.failures
        self.ddp = ddp
        # What every backward reads, one attribute away (only the step open now is read through the context)
        self._mark, self._progress, self._clock = context.mark, context.progress, context.clock
        self._in_flight, self._on_host, self._times_collectives = (context.in_flight, context.on_host,
                                                                   context.times_collectives)
        #: the parameters that get gradients, and the bytes DDP all-reduces per synchronising backward
        self._params = [p for p in ddp.parameters() if p.requires_grad]
        self.sync_bytes = sum(p.numel() * p.element_size() for p in self._params)
        #: on a measuring step, this rank's own gradient of each parameter, by index, kept until DDP averaged them
        self._local_grads: dict[int, torch.Tensor] = {}
        #: a measuring step's: copy the gradients at the backward's first callback (`_keep_local_gradients`)
        self.keep_at_tail = False
        self._handles: list[Any] = []  # the tail's hooks on the model, removed by close()
        self.grad_handles: list[Any] = []  # a measuring step's hooks on every gradient, removed when it is taken
        # The backward whose tail is being timed (`tail`): 0 none, 1 its callback queued, 2 the computation's end
        # marked (`_tail_start`, in `_tail_step`) and the second callback queued. Reset as a step starts.
        self.tail_stage = 0
        self._tail_start: Mark | None = None
        self._tail_in_flight: InFlight | None = None
        self._tail_step: Step | None = None

    # -- DDP's all-reduce tail, every step -----------------------------------------------------------

    def watch_backward(self) -> None:
        """Time DDP's all-reduce tail on every step (`tail`, queued from `_tail_hooks`)."""
        self._handles += self._tail_hooks()

    def _tail_hooks(self) -> list[Any]:
        """Hooks that queue `tail` in every backward that accumulates gradients (not in `torch.autograd.grad`,
        which DDP does not reduce): after the accumulation of one parameter's gradient, since every one gets a
        gradient in every backward unless DDP is told to find unused ones, and then of the first and the last (one
        of them is used, in any model that has an input and an output layer). Such a hook runs before DDP's own
        hook there, so the callback it queues comes before the one DDP queues with its last bucket."""
        params = self._params
        hooked = params[:1] + params[-1:] if self.ddp.find_unused_parameters else params[-1:]
        return [param.register_post_accumulate_grad_hook(self.tail) for param in {id(p): p for p in hooked}.values()]

    def tail(self, param: torch.Tensor | None = None) -> None:
        """One method in three roles, one code object for a training loop to keep warm (three cost ~5 µs more
        per step there). As the hook after a parameter's gradient accumulation (`param` given), inside the
        backward: queue itself as a final callback, once per backward. As that callback: every gradient is
        computed and, unless under `no_sync`, every bucket launched; mark it (and on a measuring step copy this
        rank's gradients), and queue itself again, now behind DDP's callback, which waits for the buckets. As
        that second callback: DDP's all-reduce is done, and the time since the mark is what the training thread
        waited for it, counted in the step and phase the backward ran in. Never raises into autograd."""
        try:
            stage = self.tail_stage
            if param is not None:
                if stage == 0:
                    _ENGINE.queue_callback(self.tail)
                    self.tail_stage = 1
            elif stage == 1:
                ddp = self.ddp
                if not ddp.require_backward_grad_sync:  # under no_sync DDP reduces nothing
                    self.tail_stage = 0
                    return
                self._tail_start = self._mark()
                self._tail_step = self._context.current
                self.tail_stage = 2
                _ENGINE.queue_callback(self.tail)
                if self.keep_at_tail:
                    self._keep_local_gradients()
                # the training thread waits in DDP's all-reduce from here
                self._tail_in_flight = self._in_flight("all_reduce", self.sync_bytes, ddp.process_group)
                self._progress.at("collective", self._tail_in_flight)
            elif stage == 2:
                self.tail_stage = 0
                step_now = self._context.current
                self._progress.at((step_now.phase or "step") if step_now is not None else "idle")
                step = self._tail_step
                self._tail_step = None
                if step is not step_now:  # a backward outside any step, or one the step has outlived
                    step = None
                if step is not None and self._times_collectives:
                    end = self._mark()
                    step.waits.append((step.phase, self._tail_start, end))
                    if self._progress.device_done is not None and self._tail_in_flight is not None:
                        self._progress.on_device = (self._tail_in_flight, end)  # done once the device passes it
                elif not self._on_host:
                    self._clock.release([self._tail_start])
                if self._local_grads:
                    self._compare_gradients(step)
        except Exception as error:
            self.tail_stage, self._tail_step = 0, None
            self.failures.record("DdpWatch.tail", error)

    # -- each rank's own gradient against DDP's average, on measuring steps --------------------------

    @guarded
    def watch_gradients(self) -> None:
        """For one measuring step, keep this rank's own gradients until DDP has averaged them. Where `.grad` is
        DDP's own (the default), copy them all at the first callback of the backward DDP reduces
        (`_keep_local_gradients`; with the tail's hooks for this step if the tail is not timed on every step).
        Where `.grad` is a view of a bucket, a hook after each parameter's gradient accumulation, which runs
        before DDP's own hook there adds the gradient to its bucket to be averaged in place. Registered and
        removed per measuring step: a Python call per parameter and backward is a cost the other steps do not
        pay (~60 µs a measuring step for 4 parameters on a 2-core EPYC VM, against one copy of them all)."""
        if self.ddp.gradient_as_bucket_view:
            keep = self._keep_local_gradient
            self.grad_handles = [param.register_post_accumulate_grad_hook(partial(keep, index))
                                 for index, param in enumerate(self._params)]
            return
        self.keep_at_tail = True
        if not self._times_collectives:
            self.grad_handles = self._tail_hooks()

    def _keep_local_gradients(self) -> None:
        """Copy every gradient of this rank, at the first callback of a backward DDP reduces: every one is
        computed and in DDP's buckets, and `.grad` holds the local values (summed over the step's micro-batches)
        until DDP's callback copies the averages back. One `torch._foreach_add` for them all."""
        self.keep_at_tail = False
        kept = [(index, param.grad) for index, param in enumerate(self._params) if param.grad is not None]
        if kept:
            copies = torch._foreach_add([grad.detach() for _, grad in kept], 0)
            self._local_grads = {index: copy for (index, _), copy in zip(kept, copies, strict=True)}

    def _keep_local_gradient(self, index: int, param: torch.Tensor) -> None:
        """Copy this rank's gradient of one parameter, in a backward DDP reduces (not under `no_sync`, where the
        step's gradient is still being summed), and queue `tail`, which compares the copies with DDP's averages
        once DDP is done. Never raises into autograd."""
        try:
            if self.ddp.require_backward_grad_sync and param.grad is not None:
                self._local_grads[index] = param.grad.detach().clone()
                self.tail(param)
        except Exception as error:
            self.failures.record("DdpWatch._keep_local_gradient", error)

    def _compare_gradients(self, step: Step | None) -> None:
        """Feed the step's GradientSimilarity each kept gradient and DDP's average of it, now in `.grad` (a few
        `torch._foreach_*` calls for them all), then drop the copies and the hooks."""
        kept, self._local_grads = self._local_grads, {}
        self._unwatch_gradients()
        similarity = step.similarity if step is not None else None
        if similarity is None:
            return
        locals_, means = [], []
        for index, local in kept.items():
            mean = self._params[index].grad
            if mean is not None:
                locals_.append(local)
                means.append(mean.detach())
        if locals_:
            similarity.observe_each(locals_, means)

    @guarded
    def drop_gradients(self) -> None:
        """Forget a measuring step DDP never averaged (its backward failed): the copies, and the hooks."""
        self._local_grads, self.keep_at_tail = {}, False
        self._unwatch_gradients()

    @guarded
    def _unwatch_gradients(self) -> None:
        while self.grad_handles:
            self.grad_handles.pop().remove()

    @guarded
    def close(self) -> None:
        """Take every hook off the model."""
        self._unwatch_gradients()
        while self._handles:
            self._handles.pop().remove()


class BucketHook:
    """A communication hook that times each bucket's all-reduce (launch to completion, in the callback), numbers it
    on DDP's process group as the collective in flight (the hang diagnosis), and feeds the gradient similarity from
    the buckets: `Monitor(bucket_hook=True)`, and `gpuwatch run` for every DDP model.

    DDP takes one communication hook, once. So the hook registered is always this one, and a hook of the user's
    runs inside it (`compose`): given to the Monitor (`comm_hook`), or registered with DDP's `register_comm_hook`
    later, which `gpuwatch run` routes here (`of` finds the model's). Made before any Monitor (`context=None`:
    a hook the user registered before gpuwatch run's Monitor was made), it only hands the buckets to the user's
    hook until a Monitor attaches its steps' context (`attach`), where the step open now and the clock are."""

    def __init__(self, context: StepContext | None) -> None:
        self.context = context
        #: the user's hook and its state, which DDP's buckets go through; None: DDP's own all-reduce of the mean
        self.inner: tuple[Callable, Any] | None = None

    @staticmethod
    def of(model: DistributedDataParallel) -> BucketHook | None:
        """The BucketHook registered on `model`, if any."""
        return model.__dict__.get(_ATTRIBUTE)

    def attach(self, context: StepContext) -> None:
        self.context = context

    def compose(self, hook: Callable | None, state: Any) -> None:
        """From now on the buckets go through the user's `hook` (None: DDP's own all-reduce of the mean)."""
        self.inner = None if hook is None else (hook, state)

    def register(self, model: DistributedDataParallel, hook: Callable | None, state: Any,
                 register: Callable | None = None) -> None:
        """Register the hook on `model` (with `register`: DDP's own `register_comm_hook`, where gpuwatch run wraps
        it). Without a hook of the user's, DDP's all-reduce of the mean as its C++ reducer computes it, bit for bit
        (each gradient times 1/world size, then the sum), with our callback as its only one: a Python callback per
        bucket costs the training loop, and DDP needs one anyway to take the tensor out of the list. With one, the
        user's hook with our callback after it."""
        self.compose(hook, state)
        group = model.process_group
        size = group.size()
        scale = 1.0 / size  # DDP's reducer multiplies by the reciprocal, where its default hook divides

        def gpuwatch_comm_hook(_, bucket):  # unannotated: DDP compares annotations with its own classes
            if isinstance(bucket, tuple):  # DDP's Python reducer (compiled autograd) hands (grad, param): untimed
                return _python_reducer(self.inner, group, bucket)
            tensor = bucket.buffer()
            started = self._started(tensor, group) if self.context is not None else None
            inner = self.inner
            if inner is not None:
                future = inner[0](inner[1], bucket)
                return future if started is None else future.then(partial(self._done, *started))
            tensor.mul_(scale)  # before the sum, as DDP does: fp16 would overflow after
            # dist.all_reduce(tensor, group=group, async_op=True), without its Python checks: they and
            # the second callback cost ~20 µs a bucket in a training loop
            work = group.allreduce([torch.view_as_real(tensor) if tensor.is_complex() else tensor])
            return work.get_future().then(_mean if started is None else partial(self._done, *started))

        gpuwatch_comm_hook.gpuwatch = True  # type: ignore[attr-defined]  # gpuwatch run's wrapper lets it through
        (register or type(model).register_comm_hook)(model, None, gpuwatch_comm_hook)
        model.__dict__[_ATTRIBUTE] = self

    def _started(self, buffer: torch.Tensor,
                 group: Any) -> tuple[Step, Call | None, torch.Tensor | None, InFlight | None] | None:
        context = self.context
        try:
            assert context is not None
            step = context.current
            if step is None:
                return None
            call = in_flight = None
            if context.times_collectives:
                # numbered on DDP's group, as the collective in flight: once the backward's computation is done the
                # training thread waits for the last one launched (HANG001 names it)
                in_flight = context.in_flight("all_reduce", buffer.nbytes, group)
                call = Call("all_reduce", buffer.nbytes, context.clock.mark(), blocking=False, phase=step.phase,
                            group=None if in_flight is None else in_flight.group)
                step.calls.append(call)
                context.progress.collective = in_flight
            local = buffer.clone() if step.similarity is not None else None  # the all-reduce works in place
            return None if call is None and local is None else (step, call, local, in_flight)
        except Exception as error:
            context.failures.record("BucketHook._started", error)  # type: ignore[union-attr]
            return None

    def _done(self, step: Step, call: Call | None, local: torch.Tensor | None, in_flight: InFlight | None,
              future: Any) -> torch.Tensor:
        mean = _mean(future)  # a failed all-reduce raises here, into DDP, as it would without the hooks
        self._observed(step, call, local, in_flight, mean)
        return mean

    def _observed(self, step: Step, call: Call | None, local: torch.Tensor | None, in_flight: InFlight | None,
                  mean: torch.Tensor) -> None:
        context = self.context
        try:
            assert context is not None
            if call is not None:
                call.end = context.clock.mark()  # on CUDA: a stream ordered after the all-reduce
                progress = context.progress
                if progress.collective is in_flight:  # the last launched is done: none in flight
                    progress.collective = None
                if progress.device_done is not None and in_flight is not None:
                    progress.on_device = (in_flight, call.end)  # done once the device passes it
            if local is not None:
                if local.is_cuda:
                    local.record_stream(torch.cuda.current_stream())  # allocated on the backward's stream
                if step.similarity is not None:  # a local copy is taken only for a step that measures similarity
                    step.similarity.observe(local, mean)
        except Exception as error:
            context.failures.record("BucketHook._observed", error)  # type: ignore[union-attr]


#: Where a DDP model keeps its BucketHook.
_ATTRIBUTE = "_gpuwatch_bucket_hook"


def _python_reducer(inner: tuple[Callable, Any] | None, group: Any, grad_param: tuple) -> Any:
    """What DDP's Python reducer (under compiled autograd) does with one gradient: the user's hook, else, as DDP does
    without a hook, the gradient over the world size all-reduced and copied back."""
    if inner is not None:
        return inner[0](inner[1], grad_param)
    from torch.distributed._functional_collectives import all_reduce

    grad = grad_param[0]
    grad.copy_(all_reduce(grad / group.size(), "sum", group))
    return None


def _mean(future: Any) -> torch.Tensor:
    """The reduced bucket of an all-reduce's future: its one tensor (a work's future holds a list of them)."""
    value = future.value()
    return value[0] if isinstance(value, list) else value
