"""`Monitor`, one per rank, and the `Step`s it measures; each step becomes one telemetry record.

A step's measurements are marks (`clock`) and device tensors taken without waiting for the device.
The record is built once they are resolved: at once on the CPU, a step or two later on a GPU, when
the device has passed the step's last mark. Steps wait in a short queue until then, so the training
loop never synchronises for the hooks' sake. A resolved step is handed to the telemetry client's
thread (`TelemetryClient.submit`), which builds its record, encodes and sends it: the training
thread only takes the marks and the few values that would change under it.

Cost on the training thread, per step with every default signal: see benchmarks/README.md ("Training
hooks"). What stays here is what cannot wait: the marks, the phase bookkeeping, the memory peak (the
next step resets it), reading the values the user reported (the next step may change them) and, on
measuring steps, the checksum (the next update changes the parameters).

Every entry point the training loop calls is guarded (`_safety`): an exception inside the hooks is
counted in `Monitor.failures` and logged once, and training goes on. The user's own code inside a
`with step.compute():` is not guarded: its exceptions pass through untouched.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from gpuwatch.protocol.schema import SCHEMA_VERSION
from gpuwatch.trainer.hooks._safety import Failures, guarded
from gpuwatch.trainer.hooks.clock import Clock, Mark, clock_for
from gpuwatch.trainer.hooks.collectives import Call, exposed_seconds, histogram, resolve
from gpuwatch.trainer.hooks.flops import peak_flops
from gpuwatch.trainer.hooks.gradients import GradientSimilarity, gradient_norm, parameter_checksum, similarity_of
from gpuwatch.trainer.hooks.identity import Layout, hello_record, resolve_job
from gpuwatch.trainer.hooks.memory import memory_for
from gpuwatch.trainer.hooks.off import OFF, Off
from gpuwatch.trainer.hooks.pipeline import PipelineClock
from gpuwatch.trainer.telemetry import TelemetryClient, run_log_file

T = TypeVar("T")
#: What a Monitor can measure besides step times, loss and throughput; each can be left out (`signals=`).
SIGNALS = frozenset({"collectives", "pipeline", "memory", "grad_similarity", "checksum"})
#: Gradient similarity and the parameter checksum run every this many steps by default.
DEFAULT_EVERY = 10
#: Steps waiting for the device; beyond this the oldest is resolved by waiting for it (a stalled device).
MAX_PENDING = 16
CLOSE_TIMEOUT_S = 5.0
#: Where records are also appended when `Monitor(run_log=...)` is not given: a directory or a .jsonl file.
RUN_LOG_VARIABLE = "GPUWATCH_RUN_LOG"


class Monitor:
    """Measures one rank's training steps and sends them to the node agent.

    `model`: the module being trained (its parameters feed the checksum, its device picks the clock);
    a DistributedDataParallel model also gets a communication hook that times each bucket's all-reduce
    and feeds the gradient similarity (`comm_hook`/`comm_state`: your own hook to wrap instead of DDP's
    default all-reduce). `layout`: the rank's place in the job (default: plain data parallelism over
    the default process group). `job`: else GPUWATCH_JOB, SLURM_JOB_ID, TORCHELASTIC_RUN_ID or a
    generated id (`resolve_job`). `socket_path`: the agent's telemetry socket (default: GPUWATCH_SOCKET,
    else the agent's well-known places). `run_log` (default: GPUWATCH_RUN_LOG): every record is also
    appended there, whether or not an agent listens, for `gpuwatch diagnose --run-log`; a directory
    (this rank writes DIR/rank-NNNNN.jsonl, NNNNN its global rank) or a file ending in .jsonl.
    `client`: a client of your own instead (for tests; `send`, `submit` and `close` as TelemetryClient
    has them), which the monitor closes. `grad_similarity_every`, `checksum_every`: the measuring steps
    (0: never). `flops_per_token`: this rank's model FLOPs per token it processes
    (`transformer_flops_per_token`, divided by tp·pp), for FLOP/s and MFU. `shard_groups`: the groups
    one data-parallel replica is sharded over (TP, PP), where the gradient similarity's sums are added
    up. `faults`: injected faults, for the hello. `signals`: a subset of SIGNALS to measure.

    On a measuring step where the user reports no `grad_norm`, the monitor reports the norm of the
    gradient the optimizer sees: sqrt(|ḡ|²) from the gradient similarity's sums with data parallelism
    (free; divided by a reported `loss_scale`, since DDP's buckets carry scaled gradients), else the
    parameters' .grad as `step.optimizer()` finds them (one `torch._foreach_norm` pass: call it after a
    loss scaler's `unscale_`). A sharded replica without data parallelism has neither, and says so
    (`unavailable`), as does every other signal due on a step that could not be computed.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        layout: Layout | None = None,
        job: str | None = None,
        device: torch.device | None = None,
        socket_path: str | os.PathLike[str] | None = None,
        run_log: str | os.PathLike[str] | None = None,
        client: TelemetryClient | None = None,
        grad_similarity_every: int = DEFAULT_EVERY,
        checksum_every: int = DEFAULT_EVERY,
        flops_per_token: float | None = None,
        peak_flops_per_second: float | None = None,
        shard_groups: Iterable[ProcessGroup] = (),
        faults: Iterable[str] = (),
        comm_hook: Callable | None = None,
        comm_state: Any = None,
        signals: Iterable[str] = SIGNALS,
    ) -> None:
        if client is not None and (socket_path is not None or run_log is not None):
            raise ValueError("socket_path and run_log configure the monitor's own client: give them to yours")
        self.failures = Failures()
        self.layout = layout or Layout.data_parallel()
        self.params = list(model.parameters()) if model is not None else []
        self.device = device or (self.params[0].device if self.params else _default_device())
        run_log = run_log if run_log is not None else os.environ.get(RUN_LOG_VARIABLE) or None
        self.client = client if client is not None else TelemetryClient(
            socket_path, run_log_file(run_log, self.layout.rank) if run_log is not None else None)
        self.signals = frozenset(signals) & SIGNALS
        self._times_collectives = "collectives" in self.signals
        self._every = {signal: every if signal in self.signals and every > 0 else 0
                       for signal, every in (("grad_similarity", grad_similarity_every), ("checksum", checksum_every))}
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops_per_second or peak_flops(self.device)
        self.shard_groups = tuple(shard_groups)
        self.job = resolve_job(job)
        self._clock = clock_for(self.device)
        self._stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self._memory = self._open_memory() if "memory" in self.signals else None
        self._current: Step | None = None
        self._pending: deque[Step] = deque()
        self._data_wait: tuple[Mark, Mark] | None = None
        self._last_number = 0
        self._send_hello(tuple(faults))
        if isinstance(model, DistributedDataParallel):
            self._watch_ddp(model, comm_hook, comm_state)

    # -- the training loop's side ------------------------------------------------------------------

    def step(self, tokens: int | None = None, *, samples: int | None = None, number: int | None = None) -> Step:
        """The next training step, as a context manager around all of it. `tokens` and `samples` (sequences,
        images, rows: for models that do not count tokens) this rank processes in it. `number` defaults to
        one more than the last; pass the trainer's own (a resumed run) so every rank agrees on measuring
        steps."""
        self._last_number = self._last_number + 1 if number is None else number
        return Step(self, self._last_number, tokens, samples)

    def data(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from `iterable`, timing each wait for the next item as the data-loader wait of the step
        it feeds (the next `step()`, whose time then starts with that wait)."""
        iterator, mark = iter(iterable), self._clock.mark
        while True:
            start = _guarded_mark(mark, self.failures)
            try:
                item = next(iterator)
            except StopIteration:
                return
            end = _guarded_mark(mark, self.failures)
            self._data_wait = None if start is None or end is None else (start, end)
            yield item

    def collective(self, op: str, nbytes: int) -> _Collective | Off:
        """A context manager timing one blocking collective call of this step (op: schema.COLLECTIVE_OPS).
        The reference trainer routes its comm layer through it (`comm.set_timer(monitor.collective)`)."""
        step = self._current
        if step is None or not self._times_collectives:
            return OFF
        return _Collective(self, step, op, nbytes)

    def close(self) -> None:
        """Send the steps still waiting for the device (at most CLOSE_TIMEOUT_S), then close the client, which
        sends every record handed to it. Not for the training loop: this one may wait."""
        self._flush(timeout=CLOSE_TIMEOUT_S)
        self._close_memory()
        self.client.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- step life cycle ---------------------------------------------------------------------------

    def _end(self, step: Step, failed: bool) -> None:
        """The step's end mark and what the record needs before the next step changes it, then the hand-over;
        nothing here waits for the device. Guarded inline, in parts (the hot path, as `Step.__enter__`)."""
        self._current = None
        if failed:  # the training loop raised: no record, and no collective of ours to wait in
            return
        step.end = _guarded_mark(self._clock.mark, self.failures)
        if step.similarity is not None:
            # A collective over the shard groups unless the training loop made it already: every rank
            # makes it on every measuring step, whatever else fails here, or its peers would wait forever.
            sums = step.similarity.reduce()
            if sums is not None:
                step.values["similarity"] = sums
        try:
            if step.checksum_due and self.params:
                self._checksum(step)
            if self._memory is not None:
                step.memory = self._read_memory()
            step.time = time.time()
            step.host = _HostValues(step.values, self._clock)
            self._pending.append(step)
        except Exception as error:
            self.failures.record("Monitor._end", error)
        self._flush()

    def _due(self, signal: str, number: int) -> bool:
        every = self._every[signal]
        return every > 0 and number % every == 0

    @guarded
    def _flush(self, timeout: float = 0.0) -> None:
        """Hand the pending steps the device has finished to the client's thread, oldest first. With a timeout,
        wait up to that long for the rest, then hand them over with whatever is resolved (a pipeline end
        that never came is left out)."""
        pending, deadline = self._pending, None
        while pending:
            step = pending[0]
            if not step.ready():
                if len(pending) <= MAX_PENDING:  # else overdue: a stalled device
                    if timeout == 0:
                        return
                    deadline = time.monotonic() + timeout if deadline is None else deadline
                    if time.monotonic() < deadline:
                        time.sleep(0.005)
                        continue
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the rare wait that bounds the queue
            pending.popleft()
            self.client.submit(partial(self._finish, step))

    @guarded
    def _finish(self, step: Step) -> dict[str, Any] | None:
        """The record of a resolved step, its marks then free for reuse; on the client's thread."""
        try:
            return self._record(step)
        finally:
            self._clock.release(step.marks())

    def _record(self, step: Step) -> dict[str, Any] | None:
        """The step record (gpuwatch.protocol.schema) of a resolved step."""
        clock = self._clock
        if step.start is None or step.end is None:
            return None
        step_seconds = clock.seconds(step.start, step.end)
        record: dict[str, Any] = {
            "v": SCHEMA_VERSION, "kind": "step", "job": self.job, "rank": self.layout.rank, "time": step.time,
            "step": step.number, "step_seconds": step_seconds,
        }
        phases = {name: sum(clock.seconds(start, end) for start, end in marks) for name, marks in step.phases.items()}
        calls = [call for call in step.calls if call.end is not None]
        resolve(calls, clock)
        exposed = exposed_seconds(calls, {name: marks[-1][1] for name, marks in step.phases.items()}, clock)
        if "compute" in phases:
            record["compute_seconds"] = max(0.0, phases["compute"] - exposed.get("compute", 0.0))
        for phase, field in (("data", "dataloader_wait_seconds"), ("optimizer", "optimizer_seconds")):
            if phase in phases:
                record[field] = phases[phase]
        pipeline = step.pipeline.result() if step.pipeline is not None else None
        if pipeline is not None:
            record["pipeline"] = pipeline
        if calls:
            record["collectives"] = histogram(calls)
            record["exposed_collective_seconds"] = sum(exposed.values())
        assert step.host is not None  # set when the step ended; only ended steps are recorded
        values = step.host.read()
        unavailable: dict[str, str] = {}
        if step.similarity_due:
            self._gradient_fields(values, record, unavailable)
        record.update(_scalars(values))
        if step.checksum_due:
            if not self.params:
                unavailable["param_checksum"] = "no_parameters"
            elif math.isfinite(values.get("param_checksum", math.nan)):
                record["param_checksum"] = values["param_checksum"]
        if unavailable:
            record["unavailable"] = unavailable
        if step.memory is not None:
            record["memory"] = step.memory
        if step.samples is not None:
            record["samples"] = step.samples
        if step.tokens is not None:
            record["tokens"] = step.tokens
            if self.flops_per_token and step_seconds > 0:
                flops = self.flops_per_token * step.tokens / step_seconds
                record["model_flops_per_second"] = flops
                if self.peak_flops and flops <= self.peak_flops:  # above peak: a wrong flops_per_token
                    record["mfu"] = flops / self.peak_flops
        return record

    def _gradient_fields(self, values: dict[str, Any], record: dict[str, Any], unavailable: dict[str, str]) -> None:
        """On a gradient-similarity step: the cosine, else why not; and the gradient norm when the user reported
        none (into `values`, where the user's would be), else why not."""
        if self.layout.dp_size <= 1:
            unavailable["grad_cosine_similarity"] = "no_data_parallel_group"
            if "grad_norm" not in values:
                if "grad_norm_of_grads" in values:  # as step.optimizer() found them
                    values["grad_norm"] = values["grad_norm_of_grads"]
                else:
                    unavailable["grad_norm"] = "no_data_parallel_group" if self.shard_groups else "no_gradient_seen"
            return
        if "similarity" not in values:  # the reduction failed, which is counted in failures
            return
        similarity, reason = similarity_of(values["similarity"])
        if similarity is not None:
            record["grad_cosine_similarity"] = similarity
        elif reason is not None:
            unavailable["grad_cosine_similarity"] = reason
        if "grad_norm" not in values:
            mean_squared, seen = values["similarity"][2], values["similarity"][3]
            if seen > 0:
                scale = values.get("loss_scale", math.nan)
                values["grad_norm"] = math.sqrt(mean_squared) / (scale if math.isfinite(scale) and scale > 0 else 1)
            else:
                unavailable["grad_norm"] = "no_gradient_seen"

    # -- data-parallel communication hook ------------------------------------------------------------

    def _watch_ddp(self, model: DistributedDataParallel, hook: Callable | None, state: Any) -> None:
        """A communication hook that times each bucket's all-reduce (launch to completion, in the callback) and
        feeds the gradient similarity. Without a hook of the user's it is DDP's default all-reduce of the
        mean (`default_hooks.allreduce_hook`) with our callback as its only one: a Python callback per
        bucket costs the training loop, and DDP needs one anyway to take the tensor out of the list."""
        if hook is None:
            group = model.process_group
            size = group.size()

            def gpuwatch_comm_hook(_, bucket):  # unannotated: DDP compares annotations with its own classes
                tensor = bucket.buffer()
                started = self._bucket_started(tensor)
                tensor.div_(size)  # before the sum, as DDP's hook does: fp16 would overflow after
                # dist.all_reduce(tensor, group=group, async_op=True), without its Python checks: they and
                # the second callback cost ~20 µs a bucket in a training loop
                work = group.allreduce([torch.view_as_real(tensor) if tensor.is_complex() else tensor])
                return work.get_future().then(_mean if started is None else partial(self._bucket_done, *started))
        else:
            def gpuwatch_comm_hook(_, bucket):
                started = self._bucket_started(bucket.buffer())
                future = hook(state, bucket)
                return future if started is None else future.then(partial(self._bucket_done, *started))

        model.register_comm_hook(None, gpuwatch_comm_hook)

    @guarded
    def _bucket_started(self, buffer: torch.Tensor) -> tuple[Step, Call | None, torch.Tensor | None] | None:
        step = self._current
        if step is None:
            return None
        call = None
        if self._times_collectives:
            call = Call("all_reduce", buffer.nbytes, self._clock.mark(), blocking=False, phase=step.phase)
            step.calls.append(call)
        local = buffer.clone() if step.similarity is not None else None  # the all-reduce works in place
        return None if call is None and local is None else (step, call, local)

    def _bucket_done(self, step: Step, call: Call | None, local: torch.Tensor | None, future: Any) -> torch.Tensor:
        mean = _mean(future)  # a failed all-reduce raises here, into DDP, as it would without the hooks
        self._bucket_observed(step, call, local, mean)
        return mean

    @guarded
    def _bucket_observed(self, step: Step, call: Call | None, local: torch.Tensor | None, mean: torch.Tensor) -> None:
        if call is not None:
            call.end = self._clock.mark()  # on CUDA: a stream ordered after the all-reduce
        if local is not None:
            if local.is_cuda:
                local.record_stream(torch.cuda.current_stream())  # allocated on the backward's stream
            if step.similarity is not None:  # a local copy is taken only for a step that measures similarity
                step.similarity.observe(local, mean)

    # -- helpers -----------------------------------------------------------------------------------

    @guarded
    def _checksum(self, step: Step) -> None:
        step.values["param_checksum"] = parameter_checksum(self.params)

    @guarded
    def _measure_gradient_norm(self, step: Step) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            step.values["grad_norm_of_grads"] = gradient_norm(grads)

    @guarded
    def _read_memory(self) -> dict[str, Any] | None:
        return self._memory.read() if self._memory is not None else None

    @guarded
    def _send_hello(self, faults: tuple[str, ...]) -> None:
        self.client.send(hello_record(self.job, self.layout, self.device, faults))

    @guarded
    def _open_memory(self):
        return memory_for(self.device)

    @guarded
    def _close_memory(self) -> None:
        if self._memory is not None:
            self._memory.close()


class Step:
    """One training step: a context manager around it, with phases inside (`data`, `compute`,
    `optimizer`) and the values only the training loop knows (`report`)."""

    __slots__ = ("_measures_grads", "calls", "checksum_due", "end", "failures", "host", "memory", "monitor", "number",
                 "phase", "phases", "pipeline", "samples", "similarity", "similarity_due", "start", "time", "tokens",
                 "values")

    def __init__(self, monitor: Monitor, number: int, tokens: int | None, samples: int | None = None) -> None:
        self.monitor, self.number, self.tokens, self.samples = monitor, number, tokens, samples
        self.failures = monitor.failures
        self.start: Mark | None = None
        self.end: Mark | None = None
        self.phase: str | None = None  # the phase open now, which collective calls are attributed to
        self.phases: dict[str, list[tuple[Mark, Mark]]] = {}
        self.calls: list[Call] = []
        self.values: dict[str, float | torch.Tensor] = {}
        self.pipeline: PipelineClock | None = None
        self.memory: dict[str, Any] | None = None
        self.time = 0.0
        self.host: _HostValues | None = None
        self.checksum_due = monitor._due("checksum", number)
        self.similarity_due = monitor._due("grad_similarity", number)
        data_parallel = monitor.layout.dp_size > 1
        #: this step's GradientSimilarity, or None when the step does not measure it
        self.similarity = (GradientSimilarity(monitor.device, monitor.shard_groups, monitor.failures, monitor._stream)
                           if self.similarity_due and data_parallel else None)
        # Without data parallelism the gradient norm comes from .grad, where an unsharded replica has it whole.
        self._measures_grads = self.similarity_due and not data_parallel and not monitor.shard_groups

    def __enter__(self) -> Step:
        # The hot path guards itself inline (as `_Collective` does): a `guarded` wrapper per call adds up here.
        monitor = self.monitor
        try:
            wait, monitor._data_wait = monitor._data_wait, None
            if wait is None:
                self.start = monitor._clock.mark()
            else:  # measured by data() just before this step, which then starts with it
                self.start = wait[0]
                self.phases["data"] = [wait]
            if monitor._memory is not None:
                monitor._memory.reset()
            monitor._current = self
        except Exception as error:
            self.failures.record("Step.__enter__", error)
        return self

    def __exit__(self, exc_type: type | None, *exc_info: object) -> Literal[False]:
        self.monitor._end(self, failed=exc_type is not None)
        return False

    def data(self) -> _Phase:
        """Waiting for the input batch."""
        return _Phase(self, "data")

    def compute(self) -> _Phase:
        """Forward and backward; time spent waiting on collectives inside it is taken out."""
        return _Phase(self, "compute")

    def optimizer(self) -> _Phase:
        """The optimizer's update. On a measuring step without data parallelism, the gradient norm is taken from
        .grad here, before the update and before zero_grad (and not timed as the optimizer's)."""
        if self._measures_grads:
            self._measures_grads = False
            self.monitor._measure_gradient_norm(self)
        return _Phase(self, "optimizer")

    def report(
        self,
        *,
        loss: float | torch.Tensor | None = None,
        grad_norm: float | torch.Tensor | None = None,
        lr: float | None = None,
        loss_scale: float | torch.Tensor | None = None,
    ) -> None:
        """Values of this step; tensors are read later without a sync. A non-finite loss or gradient norm
        sets the record's `nonfinite` flag."""
        values = self.values
        try:
            if loss is not None:
                values["loss"] = loss
            if grad_norm is not None:
                values["grad_norm"] = grad_norm
            if lr is not None:
                values["lr"] = lr
            if loss_scale is not None:
                values["loss_scale"] = loss_scale
        except Exception as error:  # guarded inline, as in __enter__
            self.failures.record("Step.report", error)

    def pipeline_clock(self, group: ProcessGroup, micro_batches: int) -> PipelineClock | Off:
        """A clock for this step's pipeline schedule over `group` (the stage's pipeline, its rank 0 the first
        stage), or OFF when the pipeline signal is off or there is one stage. Every stage must ask on
        the same steps and call its `start`, `busy` and `stop` (`PipelineClock`)."""
        try:
            if "pipeline" in self.monitor.signals and torch.distributed.get_world_size(group) > 1:
                self.pipeline = PipelineClock(self.monitor._clock, self.failures, group, micro_batches,
                                              self.monitor.device)
                return self.pipeline
        except Exception as error:
            self.failures.record("Step.pipeline_clock", error)
        return OFF

    def ready(self) -> bool:
        """Whether the device has passed every mark, so the record can be built without waiting."""
        if self.host is None or not self.host.ready() or (self.pipeline is not None and not self.pipeline.ready()):
            return False
        return not any(call.end is None for call in self.calls)

    def marks(self) -> list[Mark]:
        marks = [self.start, self.end] + [m for ms in self.phases.values() for pair in ms for m in pair]
        marks += [m for call in self.calls for m in (call.start, call.end)]
        marks += self.pipeline.marks() if self.pipeline is not None else []
        marks += [self.host.mark] if self.host is not None and self.host.mark is not None else []
        return [m for m in marks if m is not None]


class _Phase:
    """`with step.compute():` and the like; phases may repeat within a step (their times add up)."""

    __slots__ = ("name", "outer", "start", "step")

    def __init__(self, step: Step, name: str) -> None:
        self.step, self.name = step, name
        self.start: Mark | None = None
        self.outer: str | None = None

    def __enter__(self) -> None:
        step = self.step  # guarded inline, as Step.__enter__
        try:
            self.outer, step.phase = step.phase, self.name
            self.start = step.monitor._clock.mark()
        except Exception as error:
            step.failures.record("_Phase.__enter__", error)

    def __exit__(self, *exc_info: object) -> Literal[False]:
        step = self.step
        try:
            if self.start is not None:
                end = step.monitor._clock.mark()
                marks = step.phases.get(self.name)
                if marks is None:
                    step.phases[self.name] = [(self.start, end)]
                else:
                    marks.append((self.start, end))
            step.phase = self.outer
        except Exception as error:
            step.failures.record("_Phase.__exit__", error)
        return False


class _Collective:
    """One blocking collective call, timed by `Monitor.collective`. On the hot path (a tensor-parallel
    layer makes several calls per micro-batch), so it guards itself inline rather than with `guarded`."""

    __slots__ = ("clock", "failures", "nbytes", "op", "start", "step")

    def __init__(self, monitor: Monitor, step: Step, op: str, nbytes: int) -> None:
        self.step, self.clock, self.failures = step, monitor._clock, monitor.failures
        self.op, self.nbytes, self.start = op, nbytes, None

    def __enter__(self) -> None:
        try:
            self.start = self.clock.mark()
        except Exception as error:
            self.failures.record("_Collective.__enter__", error)

    def __exit__(self, *exc_info: object) -> Literal[False]:
        try:
            if self.start is not None:
                step = self.step
                step.calls.append(Call(self.op, self.nbytes, self.start, True, step.phase, self.clock.mark()))
        except Exception as error:
            self.failures.record("_Collective.__exit__", error)
        return False


class _HostValues:
    """A step's values, some of them device tensors, brought to the host without a sync: one
    non-blocking copy into pinned memory, read once the device has passed the mark after it. Values
    on the CPU are read at once: a tensor the user reported may change in the next step."""

    __slots__ = ("_clock", "_host", "_sizes", "_values", "mark")

    def __init__(self, values: dict[str, float | torch.Tensor], clock: Clock) -> None:
        self._clock = clock
        self._values: dict[str, float | list[float]] = {}
        on_gpu: dict[str, torch.Tensor] = {}
        for name, value in values.items():
            if type(value) is float:
                self._values[name] = value
            elif isinstance(value, torch.Tensor) and value.is_cuda:
                on_gpu[name] = value.detach().reshape(-1).double()
            else:
                self._values[name] = _plain(value)
        self._sizes = {name: t.numel() for name, t in on_gpu.items()}
        self._host: torch.Tensor | None = None
        self.mark: Mark | None = None
        if on_gpu:
            flat = torch.cat(list(on_gpu.values()))
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self.mark = clock.mark()

    def ready(self) -> bool:
        return self.mark is None or self._clock.ready(self.mark)

    def read(self) -> dict[str, Any]:
        """name → float, or a list of floats for a tensor of several elements."""
        values = dict(self._values)
        if self._host is not None:
            flat = self._host.tolist()
            for name, size in self._sizes.items():
                values[name], flat = (flat[0] if size == 1 else flat[:size]), flat[size:]
        return values


def _plain(value: float | torch.Tensor) -> float | list[float]:
    """A number, or a CPU tensor's value(s) (reading a CPU tensor needs no device sync)."""
    if not isinstance(value, torch.Tensor):
        return float(value)
    if value.numel() == 1:  # every value but the similarity's sums
        return float(value.item())
    return value.detach().reshape(-1).double().tolist()


def _guarded_mark(mark: Callable[[], Mark], failures: Failures) -> Mark | None:
    """A mark, or None (the failure recorded) when taking it failed; for marks taken outside a guarded method."""
    try:
        return mark()
    except Exception as error:
        failures.record("Clock.mark", error)
        return None


def _mean(future: Any) -> torch.Tensor:
    """The reduced bucket of an all-reduce's future: its one tensor (a work's future holds a list of them)."""
    value = future.value()
    return value[0] if isinstance(value, list) else value


def _scalars(values: dict[str, Any]) -> dict[str, Any]:
    """loss, grad_norm, lr, loss_scale and the nonfinite flag, as the schema takes them."""
    out: dict[str, Any] = {}
    for name in ("loss", "grad_norm"):
        if name in values:
            out[name] = values[name]
    if out:
        out["nonfinite"] = not all(math.isfinite(value) for value in out.values())
    for name in ("lr", "loss_scale"):  # finite and non-negative, or left out
        if math.isfinite(values.get(name, math.nan)) and values[name] >= 0:
            out[name] = values[name]
    return out


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
