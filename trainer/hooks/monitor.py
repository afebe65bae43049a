"""`Monitor`, one per rank, and the `Step`s it measures; each step becomes one telemetry record.

A step's measurements are marks (`clock`) and device tensors taken without waiting for the device.
The record is built once they are resolved: at once on the CPU, a step or two later on a GPU, when
the device has passed the step's last mark. Steps wait in a short queue until then, so the training
loop never synchronises for the hooks' sake.

Every entry point the training loop calls is guarded (`_safety`): an exception inside the hooks is
counted in `Monitor.failures` and logged once, and training goes on. The user's own code inside a
`with step.compute():` is not guarded: its exceptions pass through untouched.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gpuwatch.agent.telemetry.schema import SCHEMA_VERSION
from gpuwatch.trainer.hooks._safety import Failures, guarded
from gpuwatch.trainer.hooks.clock import Clock, Mark, clock_for
from gpuwatch.trainer.hooks.collectives import Call, exposed_seconds, histogram, resolve
from gpuwatch.trainer.hooks.flops import peak_flops
from gpuwatch.trainer.hooks.gradients import GradientSimilarity, cosine, parameter_checksum
from gpuwatch.trainer.hooks.identity import Layout, hello_record, resolve_job
from gpuwatch.trainer.hooks.memory import memory_for
from gpuwatch.trainer.hooks.off import OFF, Off
from gpuwatch.trainer.hooks.pipeline import PipelineClock
from gpuwatch.trainer.telemetry import TelemetryClient

T = TypeVar("T")
#: What a Monitor can measure besides step times, loss and throughput; each can be left out (`signals=`).
SIGNALS = frozenset({"collectives", "pipeline", "memory", "grad_similarity", "checksum"})
#: Gradient similarity and the parameter checksum run every this many steps by default.
DEFAULT_EVERY = 10
#: Steps waiting for the device; beyond this the oldest is resolved by waiting for it (a stalled device).
MAX_PENDING = 16
CLOSE_TIMEOUT_S = 5.0


class Monitor:
    """Measures one rank's training steps and sends them to the node agent.

    `model`: the module being trained (its parameters feed the checksum, its device picks the clock);
    a DistributedDataParallel model also gets a communication hook that times each bucket's all-reduce
    and feeds the gradient similarity (`comm_hook`/`comm_state`: your own hook to wrap instead of DDP's
    default all-reduce). `layout`: the rank's place in the job (default: plain data parallelism over
    the default process group). `job`: else GPUWATCH_JOB, SLURM_JOB_ID, TORCHELASTIC_RUN_ID or a
    generated id (`resolve_job`). `client`: where records go (default: a TelemetryClient on
    GPUWATCH_SOCKET or the agent's well-known socket); the monitor closes it. `flops_per_token`: this
    rank's model FLOPs per token it processes (`transformer_flops_per_token`, divided by tp·pp), for
    FLOP/s and MFU. `shard_groups`: the groups one data-parallel replica is sharded over (TP, PP),
    where the gradient similarity's sums are added up. `faults`: injected faults, for the hello.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        layout: Layout | None = None,
        job: str | None = None,
        device: torch.device | None = None,
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
        self.failures = Failures()
        self.layout = layout or Layout.data_parallel()
        self.params = list(model.parameters()) if model is not None else []
        self.device = device or (self.params[0].device if self.params else _default_device())
        self.client = client if client is not None else TelemetryClient()
        self.signals = frozenset(signals) & SIGNALS
        self.every = {"grad_similarity": grad_similarity_every, "checksum": checksum_every}
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

    def step(self, tokens: int | None = None, number: int | None = None) -> Step:
        """The next training step, as a context manager around all of it. `number` defaults to one more
        than the last; pass the trainer's own (a resumed run) so every rank agrees on measuring steps."""
        self._last_number = self._last_number + 1 if number is None else number
        return Step(self, self._last_number, tokens)

    def data(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from `iterable`, timing each wait for the next item as the data-loader wait of the step
        it feeds (the next `step()`, whose time then starts with that wait)."""
        iterator = iter(iterable)
        while True:
            start = self._mark()
            try:
                item = next(iterator)
            except StopIteration:
                return
            end = self._mark()
            self._data_wait = (start, end) if start is not None and end is not None else None
            yield item

    def collective(self, op: str, nbytes: int) -> _Collective | Off:
        """A context manager timing one blocking collective call of this step (op: schema.COLLECTIVE_OPS).
        The reference trainer routes its comm layer through it (`comm.set_timer(monitor.collective)`)."""
        step = self._current
        if step is None or "collectives" not in self.signals:
            return OFF
        return _Collective(self, step, op, nbytes)

    def close(self) -> None:
        """Send the steps still waiting for the device (at most CLOSE_TIMEOUT_S), then close the client.
        Not for the training loop: this one may wait."""
        self._flush(timeout=CLOSE_TIMEOUT_S)
        self._close_memory()
        self.client.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- step life cycle ---------------------------------------------------------------------------

    @guarded
    def _begin(self, step: Step) -> None:
        step.start = self._clock.mark()
        if self._data_wait is not None:  # measured by data() just before this step
            step.start = self._data_wait[0]
            step.phases["data"] = [self._data_wait]
            self._data_wait = None
        if self._memory is not None:
            self._memory.reset()
        self._current = step

    def _end(self, step: Step, failed: bool) -> None:
        self._current = None
        if failed:  # the training loop raised: no record, and no collective of ours to wait in
            return
        step.end = self._mark()
        if step.similarity is not None:
            # A collective over the shard groups unless the training loop made it already: every rank
            # makes it on every measuring step, whatever else fails here, or its peers would wait forever.
            sums = step.similarity.reduce()
            if sums is not None:
                step.values["similarity"] = sums
        self._conclude(step)
        self._flush()

    @guarded
    def _conclude(self, step: Step) -> None:
        """Take what the record needs before the next step changes it; nothing here waits for the device."""
        if self._due("checksum", step) and self.params:
            self._checksum(step)
        if self._memory is not None:
            step.memory = self._read_memory()
        step.time = time.time()
        step.host = _HostValues(step.values, self._clock)
        self._pending.append(step)

    def _due(self, signal: str, step: Step) -> bool:
        every = self.every[signal]
        return signal in self.signals and every > 0 and step.number % every == 0

    @guarded
    def _flush(self, timeout: float = 0.0) -> None:
        """Send the pending steps the device has finished, oldest first. With a timeout, wait up to that
        long for the rest, then send them with whatever is resolved (a pipeline end that never came is
        left out)."""
        deadline = time.monotonic() + timeout
        while self._pending:
            step = self._pending[0]
            overdue = len(self._pending) > MAX_PENDING or (timeout > 0 and time.monotonic() >= deadline)
            if not step.ready() and not overdue:
                if timeout == 0:
                    return
                time.sleep(0.005)
                continue
            self._pending.popleft()
            if not step.ready() and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # a stalled device: the rare wait that bounds the queue
            record = self._record(step)
            if record is not None:
                self.client.send(record)
            self._clock.release(step.marks())

    @guarded
    def _record(self, step: Step) -> dict[str, Any] | None:
        """The step record (gpuwatch.agent.telemetry.schema) of a resolved step."""
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
        if "compute" in phases:
            waited = exposed_seconds(calls, "compute", step.phases["compute"][-1][1], clock)
            record["compute_seconds"] = max(0.0, phases["compute"] - waited)
        for phase, field in (("data", "dataloader_wait_seconds"), ("optimizer", "optimizer_seconds")):
            if phase in phases:
                record[field] = phases[phase]
        pipeline = step.pipeline.result() if step.pipeline is not None else None
        if pipeline is not None:
            record["pipeline"] = pipeline
        if calls:
            record["collectives"] = histogram(calls)
        values = step.host.read()
        record.update(_scalars(values))
        if "similarity" in values:
            similarity = cosine(*values["similarity"])
            if similarity is not None:
                record["grad_cosine_similarity"] = similarity
        if math.isfinite(values.get("param_checksum", math.nan)):
            record["param_checksum"] = values["param_checksum"]
        if step.memory is not None:
            record["memory"] = step.memory
        if step.tokens is not None:
            record["tokens"] = step.tokens
            if self.flops_per_token and step_seconds > 0:
                flops = self.flops_per_token * step.tokens / step_seconds
                record["model_flops_per_second"] = flops
                if self.peak_flops and flops <= self.peak_flops:  # above peak: a wrong flops_per_token
                    record["mfu"] = flops / self.peak_flops
        return record

    # -- data-parallel communication hook ------------------------------------------------------------

    def _watch_ddp(self, model: DistributedDataParallel, hook: Callable | None, state: Any) -> None:
        inner, inner_state = (hook, state) if hook is not None else (default_hooks.allreduce_hook, model.process_group)

        def gpuwatch_comm_hook(_, bucket):  # unannotated: DDP compares annotations with its own classes
            started = self._bucket_started(bucket)
            future = inner(inner_state, bucket)
            return future if started is None else future.then(partial(self._bucket_done, *started))

        model.register_comm_hook(None, gpuwatch_comm_hook)

    @guarded
    def _bucket_started(self, bucket: Any) -> tuple[Step, Call | None, torch.Tensor | None] | None:
        step = self._current
        if step is None:
            return None
        buffer = bucket.buffer()
        call = None
        if "collectives" in self.signals:
            call = Call("all_reduce", buffer.numel() * buffer.element_size(), self._clock.mark(), blocking=False,
                        phase=step.phase)
            step.calls.append(call)
        local = buffer.clone() if step.similarity is not None else None  # DDP's hook reduces in place
        return None if call is None and local is None else (step, call, local)

    def _bucket_done(self, step: Step, call: Call | None, local: torch.Tensor | None, future: Any) -> torch.Tensor:
        mean = future.value()  # a failed all-reduce raises here, into DDP, as it would without the hooks
        self._bucket_observed(step, call, local, mean)
        return mean

    @guarded
    def _bucket_observed(self, step: Step, call: Call | None, local: torch.Tensor | None, mean: torch.Tensor) -> None:
        if call is not None:
            call.end = self._clock.mark()  # on CUDA: a stream ordered after the all-reduce
        if local is not None:
            if local.is_cuda:
                local.record_stream(torch.cuda.current_stream())  # allocated on the backward's stream
            step.similarity.observe(local, mean)

    # -- helpers -----------------------------------------------------------------------------------

    @guarded
    def _checksum(self, step: Step) -> None:
        step.values["param_checksum"] = parameter_checksum(self.params)

    @guarded
    def _read_memory(self) -> dict[str, Any]:
        return self._memory.read()

    @guarded
    def _mark(self) -> Mark:
        return self._clock.mark()

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

    def __init__(self, monitor: Monitor, number: int, tokens: int | None) -> None:
        self.monitor, self.number, self.tokens = monitor, number, tokens
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
        measures = monitor._due("grad_similarity", self) and monitor.layout.dp_size > 1
        #: this step's GradientSimilarity, or None when the step does not measure it
        self.similarity = (GradientSimilarity(monitor.device, monitor.shard_groups, monitor.failures, monitor._stream)
                           if measures else None)

    def __enter__(self) -> Step:
        self.monitor._begin(self)
        return self

    def __exit__(self, exc_type: type | None, *exc_info: object) -> bool:
        self.monitor._end(self, failed=exc_type is not None)
        return False

    def data(self) -> _Phase:
        """Waiting for the input batch."""
        return _Phase(self, "data")

    def compute(self) -> _Phase:
        """Forward and backward; time spent waiting on collectives inside it is taken out."""
        return _Phase(self, "compute")

    def optimizer(self) -> _Phase:
        """The optimizer's update."""
        return _Phase(self, "optimizer")

    @guarded
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
        reported = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "loss_scale": loss_scale}
        self.values.update((name, value) for name, value in reported.items() if value is not None)

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
        return (self.host is not None and self.host.ready()
                and (self.pipeline is None or self.pipeline.ready())
                and all(call.end is not None for call in self.calls))

    def marks(self) -> list[Mark]:
        marks = [self.start, self.end] + [m for ms in self.phases.values() for pair in ms for m in pair]
        marks += [m for call in self.calls for m in (call.start, call.end)]
        marks += self.pipeline.marks() if self.pipeline is not None else []
        marks += [self.host.mark] if self.host is not None and self.host.mark is not None else []
        return [m for m in marks if m is not None]


class _Phase:
    """`with step.compute():` and the like; phases may repeat within a step (their times add up)."""

    __slots__ = ("failures", "name", "outer", "start", "step")

    def __init__(self, step: Step, name: str) -> None:
        self.step, self.name, self.failures = step, name, step.failures
        self.start = self.outer = None

    @guarded
    def __enter__(self) -> None:
        self.outer, self.step.phase = self.step.phase, self.name
        self.start = self.step.monitor._clock.mark()

    def __exit__(self, *exc_info: object) -> bool:
        self._close()
        return False

    @guarded
    def _close(self) -> None:
        if self.start is not None:
            self.step.phases.setdefault(self.name, []).append((self.start, self.step.monitor._clock.mark()))
        self.step.phase = self.outer


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

    def __exit__(self, *exc_info: object) -> bool:
        try:
            if self.start is not None:
                step = self.step
                step.calls.append(Call(self.op, self.nbytes, self.start, True, step.phase, self.clock.mark()))
        except Exception as error:
            self.failures.record("_Collective.__exit__", error)
        return False


class _HostValues:
    """A step's values, some of them device tensors, brought to the host without a sync: one
    non-blocking copy into pinned memory, read once the device has passed the mark after it."""

    def __init__(self, values: dict[str, float | torch.Tensor], clock: Clock) -> None:
        self._clock = clock
        self._values = {name: _plain(v) for name, v in values.items() if not _on_gpu(v)}
        on_gpu = {name: v.detach().reshape(-1).double() for name, v in values.items() if _on_gpu(v)}
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


def _on_gpu(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.is_cuda


def _plain(value: float | torch.Tensor) -> float | list[float]:
    """A number, or a CPU tensor's value(s) (reading a CPU tensor needs no device sync)."""
    if not isinstance(value, torch.Tensor):
        return float(value)
    values = value.detach().reshape(-1).double().tolist()
    return values[0] if len(values) == 1 else values


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
