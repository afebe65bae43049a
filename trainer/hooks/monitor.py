"""`Monitor`, one per rank, and the `Step`s it measures; each step becomes one telemetry record.

A step's measurements are marks (`clock`) and device tensors taken without waiting for the device.
The record is built once they are resolved: at once on the CPU, a step or two later on a GPU, when
the device has passed the step's last mark. Steps wait in a short queue until then, so the training
loop never synchronises for the hooks' sake. A resolved step is handed to the telemetry client's
thread (`TelemetryClient.submit`), which builds its record, encodes and sends it: the training
thread only takes the marks and the few values that would change under it.

Under DistributedDataParallel the time the training thread waits for DDP's gradient all-reduce is taken
without a communication hook: a hook after one parameter's gradient accumulation queues an autograd final
callback once per backward DDP reduces, which marks the end of the backward's computation (every gradient
computed, every bucket launched) and queues a second one behind DDP's own final callback, which waits for
the buckets; between
the two marks is the tail the training thread waited for (`exposed_collective_seconds`, every step). Three
Python calls per backward against ~50 µs per bucket for a Python communication hook, which DDP calls on
the training thread for every bucket on the CPU. On measuring steps only, the first callback copies this rank's
gradients (DDP copied them into its buckets and averages those; `.grad` keeps the local values until DDP's own
callback copies the averages back), and the second compares the copies with DDP's averages (the gradient cosine
similarity). A DDP model whose gradients are views of its buckets (`gradient_as_bucket_view=True`) averages
them in place as the buckets complete: there a hook after each parameter's gradient accumulation copies it
first. `Monitor(bucket_hook=True)`
adds a communication hook (DDP's all-reduce with a callback per bucket) for what only it sees: each bucket's
latency (the record's `collectives`).

Cost on the training thread, per step with every default signal: see benchmarks/README.md ("Training
hooks"). What stays here is what cannot wait: the marks, the phase bookkeeping, reading the values the
user reported (the next step may change them) and, on measuring steps, the memory peak since the last
reading (reset as it is read), the checksum and the gradient norm (the next update changes the parameters).

Every entry point the training loop calls is guarded (`_safety`): an exception inside the hooks is
counted in `Monitor.failures` and logged once, and training goes on; so is every hook that runs inside
autograd or DDP. The user's own code inside a `with step.compute():` is not guarded: its exceptions pass
through untouched.
"""

from __future__ import annotations

import atexit
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from gpuwatch.protocol.schema import P2P_OPS, SCHEMA_VERSION, STEP_PHASES, RecordRejected, decode, encode
from gpuwatch.trainer.hooks._safety import Failures, guarded
from gpuwatch.trainer.hooks.clock import Clock, Mark, WallClock, clock_for
from gpuwatch.trainer.hooks.collectives import Call, exposed_seconds, histogram, resolve
from gpuwatch.trainer.hooks.flops import peak_flops
from gpuwatch.trainer.hooks.gradients import (
    GradientSimilarity,
    checksum_of,
    gradient_norms,
    norm_of,
    parameter_sums,
    similarity_of,
)
from gpuwatch.trainer.hooks.identity import Layout, hello_record, resolve_job
from gpuwatch.trainer.hooks.memory import memory_for
from gpuwatch.trainer.hooks.off import OFF, Off
from gpuwatch.trainer.hooks.pipeline import PipelineClock
from gpuwatch.trainer.hooks.progress import InFlight, Progress, Watchdog, closed_record, error_record
from gpuwatch.trainer.telemetry import TelemetryClient, run_log_file

T = TypeVar("T")
#: What a Monitor can measure besides step times, loss and throughput; each can be left out (`signals=`).
SIGNALS = frozenset({"collectives", "pipeline", "memory", "grad_similarity", "checksum"})
#: Gradient similarity and the parameter checksum run every this many steps by default.
DEFAULT_EVERY = 10
#: Steps waiting for the device; beyond this the oldest is resolved by waiting for it (a stalled device).
MAX_PENDING = 16
CLOSE_TIMEOUT_S = 5.0
#: On the CPU, parameters up to this size are copied for the checksum, which the client's thread then takes.
COPY_CHECKSUM_BYTES = 32 << 20
#: Where records are also appended when `Monitor(run_log=...)` is not given: a directory or a .jsonl file.
RUN_LOG_VARIABLE = "GPUWATCH_RUN_LOG"
#: Autograd's engine, whose final callbacks (`queue_callback`) run once a backward's graph is done, in the order
#: queued; DDP's reducer queues the one that waits for its buckets when the last bucket is launched.
_ENGINE = torch.autograd.Variable._execution_engine


class Monitor:
    """Measures one rank's training steps and sends them to the node agent.

    `model`: the module being trained (its parameters feed the checksum, its device picks the clock). A
    DistributedDataParallel model gets a hook on a parameter's gradient (see the module's docstring) that
    times, every step, the tail of the backward the training thread waits for DDP's gradient all-reduce
    (`exposed_collective_seconds`, taken out of `compute_seconds`); DDP keeps its own C++ all-reduce.
    On measuring steps it also compares each rank's own gradient with DDP's average (the cosine).
    `bucket_hook=True` registers a Python communication hook instead, as DDP's default all-reduce with a
    callback per bucket (~50 µs of the training thread per bucket and step on the CPU, where DDP runs it
    on the training thread): it times each bucket's all-reduce (the record's `collectives`: count, bytes,
    a latency histogram) and feeds the gradient cosine similarity from the buckets.
    `comm_hook`/`comm_state`: your own communication hook, which the bucket hook wraps instead of DDP's
    all-reduce (implies `bucket_hook=True`). `layout`: the rank's place in the job (default: plain data
    parallelism over the default process group). `job`: else GPUWATCH_JOB,
    SLURM_JOB_ID, TORCHELASTIC_RUN_ID or a generated id (`resolve_job`). `socket_path`: the agent's
    telemetry socket (default: GPUWATCH_SOCKET, else the agent's well-known places). `run_log` (default:
    GPUWATCH_RUN_LOG): every record is also appended there, whether or not an agent listens, for
    `gpuwatch diagnose --run-log`; a directory (this rank writes DIR/rank-NNNNN.jsonl, NNNNN its global
    rank) or a file ending in .jsonl. `client`: a client of your own instead (for tests; `send`, `submit`
    and `close` as TelemetryClient has them), which the monitor closes. `grad_similarity_every`,
    `checksum_every`: the measuring steps (0: never). `memory_every`: the steps that read memory (0: never);
    the peak read is the peak since the previous reading, so no step's peak is missed, and a reading costs
    the training thread ~10 µs on the CPU (more for `torch.cuda.memory_stats` on a GPU) once per N steps.
    `flops_per_token`: this rank's model FLOPs per token it processes (`transformer_flops_per_token`, divided
    by tp·pp), for FLOP/s and MFU. `shard_groups`: the groups one data-parallel replica is sharded over (TP,
    PP), where the gradient similarity's sums are added up. `hello`: fields added to this rank's hello
    (gpuwatch.protocol.schema), such as `{"faults": [...]}` for what a chaos test injects on purpose, so no one
    takes the run for a healthy one; a hello they make invalid is a ValueError here. `signals`: a subset of
    SIGNALS to measure (without "collectives" a DDP model's backward is watched on measuring steps only).

    On a measuring step where the user reports no `grad_norm`, the monitor reports the norm of the
    gradient the optimizer sees: sqrt(|ḡ|²) from the gradient similarity's sums where those are taken
    (the bucket hook, the reference trainer; free; divided by a reported `loss_scale`, since DDP's
    buckets carry scaled gradients), else the parameters' .grad as `step.optimizer()` finds them (one
    `torch._foreach_norm` pass: call it after a loss scaler's `unscale_`; under DDP that is the average
    DDP left there). A sharded replica without the similarity's sums has neither, and says so
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
        memory_every: int = DEFAULT_EVERY,
        flops_per_token: float | None = None,
        peak_flops_per_second: float | None = None,
        shard_groups: Iterable[ProcessGroup] = (),
        hello: Mapping[str, Any] | None = None,
        comm_hook: Callable | None = None,
        comm_state: Any = None,
        bucket_hook: bool = False,
        signals: Iterable[str] = SIGNALS,
    ) -> None:
        if client is not None and (socket_path is not None or run_log is not None):
            raise ValueError("socket_path and run_log configure the monitor's own client: give them to yours")
        self.failures = Failures()
        self.layout = layout or Layout.data_parallel()
        self.params = list(model.parameters()) if model is not None else []
        self._param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self.device = device or (self.params[0].device if self.params else _default_device())
        run_log = run_log if run_log is not None else os.environ.get(RUN_LOG_VARIABLE) or None
        self.client = client if client is not None else TelemetryClient(
            socket_path, run_log_file(run_log, self.layout.rank) if run_log is not None else None)
        self.signals = frozenset(signals) & SIGNALS
        self._times_collectives = "collectives" in self.signals
        self._every = {signal: every if signal in self.signals and every > 0 else 0
                       for signal, every in (("grad_similarity", grad_similarity_every), ("checksum", checksum_every),
                                             ("memory", memory_every))}
        self._similarity_every, self._checksum_every = self._every["grad_similarity"], self._every["checksum"]
        self._memory_every = self._every["memory"]
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops_per_second or peak_flops(self.device)
        self.shard_groups = tuple(shard_groups)
        self.job = resolve_job(job)
        self._clock = clock_for(self.device)
        self._mark = self._clock.mark  # on the CPU time.perf_counter itself: no Python frame per mark
        self._on_host = isinstance(self._clock, WallClock)  # every mark ready when taken: no queue
        self._stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self._memory = self._open_memory() if self._memory_every else None
        self._current: Step | None = None
        self._pending: deque[Step] = deque()
        self._data_wait: tuple[Mark, Mark] | None = None
        self._last_number = 0
        ddp = model if isinstance(model, DistributedDataParallel) else None
        self.bucket_hook = ddp is not None and (bucket_hook or comm_hook is not None)
        #: A DDP model that reduces its gradients in C++ (no bucket hook), watched through autograd instead
        self._ddp = ddp if not self.bucket_hook else None
        #: its parameters that get gradients, the bytes DDP all-reduces per synchronising backward, and on a
        #: measuring step this rank's own gradient of each, by index, kept until DDP has averaged them
        self._grad_params = [p for p in self._ddp.parameters() if p.requires_grad] if self._ddp is not None else []
        self._gradient_sync_bytes = sum(p.numel() * p.element_size() for p in self._grad_params)
        self._local_grads: dict[int, torch.Tensor] = {}
        #: a measuring step's: copy the gradients at the backward's first callback (`_keep_local_gradients`)
        self._keep_at_tail = False
        self._handles: list[Any] = []  # the hooks on the model, removed by close()
        self._grad_handles: list[Any] = []  # a measuring step's hooks on every gradient, removed when it is taken
        # The backward whose tail is being timed (`_backward_tail`): 0 none, 1 its callback queued, 2 the
        # computation's end marked (`_tail_start`, in `_tail_step`) and the second callback queued.
        self._tail_stage = 0
        self._tail_start: Mark | None = None
        self._tail_in_flight: InFlight | None = None
        self._tail_step: Step | None = None
        self._hello = _hello_with(hello_record(self.job, self.layout, self.device), hello or {})
        self._send_hello()
        #: the training thread's place (this thread's: the one that makes the Monitor runs the loop), and the
        #: watchdog that reports it while a step is overdue; collectives numbered per process group
        self.progress = Progress()
        if not self._on_host:  # a collective the host has left may still run on the device
            self.progress.device_done = self._clock.ready
        #: collectives (not send/recv) numbered per group: every member of a group counts the same at the end of
        #: the same step, unless one skipped or added a call (the step record's `collective_calls`); send/recv
        #: are numbered apart, as pairs of ranks, not the whole group, take part in them (a pipeline's middle
        #: stages make twice as many as its ends)
        self._sequences: dict[str, int] = {}
        self._p2p_sequences: dict[str, int] = {}
        self._group_names: dict[Any, tuple[str, int, int]] = {}
        self._watchdog = Watchdog(self.progress, self.client.send, self.job, self.layout.rank, threading.get_ident())
        self._watchdog.start()
        self._closed = False
        self._raised = False  # a step raised: its error record stands, no "closed" follows it
        atexit.register(self.close)  # a script that never closes the monitor still ends normally
        if ddp is not None and self.bucket_hook:
            self._watch_ddp(ddp, comm_hook, comm_state)
        elif self._ddp is not None and self._times_collectives:
            self._watch_backward()

    # -- the training loop's side ------------------------------------------------------------------

    def step(self, tokens: int | None = None, *, samples: int | None = None, number: int | None = None) -> Step:
        """The next training step, as a context manager around all of it. `tokens` and `samples` (sequences,
        images, rows: for models that do not count tokens) this rank processes in it. `number` defaults to
        one more than the last; pass the trainer's own (a resumed run) so every rank agrees on measuring
        steps."""
        self._last_number = number = self._last_number + 1 if number is None else number
        # Made here rather than in a Step.__init__: one Python frame fewer on the hot path.
        step = _new(Step)
        step.monitor, step.failures, step.number = self, self.failures, number
        step.tokens, step.samples = tokens, samples
        step.start = step.end = step.phase = step.pipeline = step.memory = step.scalars = step.host = None
        step.measured = step.similarity = step.reported = step.collective_calls = None
        step.phases, step.calls, step.waits, step.values, step.time = [], [], [], {}, 0.0
        every = self._checksum_every
        step.checksum_due = every > 0 and number % every == 0
        every = self._memory_every
        step.memory_due = every > 0 and number % every == 0
        every = self._similarity_every
        step.similarity_due = due = every > 0 and number % every == 0
        step._measures_grads = False
        if due:
            # The gradient similarity where there are replicas to compare; else the gradient norm comes from
            # .grad, where the replica has it whole.
            replicated = self.layout.dp_size > 1
            if replicated:
                step.similarity = GradientSimilarity(self.device, self.shard_groups, self.failures, self._stream)
                if self._ddp is not None:
                    self._watch_gradients()
            step._measures_grads = not replicated and not self.shard_groups
        return step

    def data(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from `iterable`, timing each wait for the next item as the data-loader wait of the step
        it feeds (the next `step()`, whose time then starts with that wait)."""
        iterator, mark, failures = iter(iterable), self._mark, self.failures
        while True:
            try:  # guarded inline, as Step.__enter__
                start = mark()
            except Exception as error:
                failures.record("Clock.mark", error)
                start = None
            try:
                item = next(iterator)
            except StopIteration:
                return
            try:
                end = mark()
                self._data_wait = None if start is None else (start, end)
            except Exception as error:
                failures.record("Clock.mark", error)
                self._data_wait = None
            yield item

    def collective(self, op: str, nbytes: int, group: Any = None) -> _Collective | Off:
        """A context manager timing one blocking collective call of this step (op: schema.COLLECTIVE_OPS) on
        `group` (a ProcessGroup; None: the default group), which is the collective in flight while it lasts.
        The reference trainer routes its comm layer through it (`comm.set_timer(monitor.collective)`)."""
        step = self._current
        if step is None or not self._times_collectives:
            return OFF
        return _Collective(self, step, op, nbytes, self._in_flight(op, nbytes, group))

    def _in_flight(self, op: str, nbytes: int, group: Any) -> InFlight | None:
        """The collective about to start, numbered on its group: the group's name in the hello (`process_groups`,
        "default" for the world), its size and this rank's place in it. None when it cannot be told."""
        try:
            identity = self._group_names.get(group)
            if identity is None:
                identity = self._group_names[group] = self._identify(group)
            name, size, place = identity
            sequences = self._p2p_sequences if op in P2P_OPS else self._sequences
            seq = sequences[name] = sequences.get(name, 0) + 1
            return InFlight(op, name, size, place, seq, nbytes, time.monotonic())
        except Exception as error:
            self.failures.record("Monitor._in_flight", error)
            return None

    def _identify(self, group: Any) -> tuple[str, int, int]:
        if group is None or group is dist.GroupMember.WORLD or not dist.is_initialized():
            size = dist.get_world_size() if dist.is_initialized() else 1
            return "default", size, self.layout.rank
        ranks = tuple(dist.get_process_group_ranks(group))
        name = next((name for name, members in self.layout.process_groups.items() if tuple(members) == ranks),
                    None)
        if name is None:
            name = "default" if len(ranks) == self.layout.world_size else f"ranks-{ranks[0]}-{ranks[-1]}"
        return name, len(ranks), ranks.index(self.layout.rank) if self.layout.rank in ranks else 0

    def close(self) -> None:
        """Send the steps still waiting for the device (at most CLOSE_TIMEOUT_S), then close the client, which
        sends every record handed to it, and take the hooks off the model. Not for the training loop: this
        one may wait."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._watchdog.close()
        self._flush(timeout=CLOSE_TIMEOUT_S)
        self._close_memory()
        self._remove_hooks()
        self._send_closed()
        self.client.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- step life cycle ---------------------------------------------------------------------------

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
        """The record of a resolved step, its marks then free for reuse (CUDA events; numbers need no release);
        on the client's thread."""
        try:
            return self._record(step)
        finally:
            if not self._on_host:
                pending = self.progress.on_device
                kept = pending[1] if pending is not None else None  # the watchdog may still ask about it
                self._clock.release([mark for mark in step.marks() if mark is not kept])

    def _record(self, step: Step) -> dict[str, Any] | None:
        """The step record (gpuwatch.protocol.schema) of a resolved step. On the client's thread, beside the training
        loop: the less Python here, the less it takes the GIL from the training thread (wall-clock marks are
        subtracted inline, not through `Clock.seconds`)."""
        if step.start is None or step.end is None:
            return None
        clock, on_host = self._clock, self._on_host
        step_seconds = max(0.0, step.end - step.start) if on_host else clock.seconds(step.start, step.end)
        record: dict[str, Any] = {
            "v": SCHEMA_VERSION, "kind": "step", "job": self.job, "rank": self.layout.rank, "time": step.time,
            "step": step.number, "step_seconds": step_seconds,
        }
        phases: dict[str, float] = {}
        phase_ends: dict[str, Mark] = {}
        for name, start, end in step.phases:
            phases[name] = phases.get(name, 0.0) + (max(0.0, end - start) if on_host else clock.seconds(start, end))
            phase_ends[name] = end
        calls = [call for call in step.calls if call.end is not None] if step.calls else None
        exposed: dict[str | None, float] = {}
        if calls:
            resolve(calls, clock)
            exposed = exposed_seconds(calls, phase_ends, clock)
        for phase, start, end in step.waits:  # DDP's all-reduce tail, waited for whole
            exposed[phase] = exposed.get(phase, 0.0) + (
                max(0.0, end - start) if on_host else clock.seconds(start, end))
        # Each phase net of the collectives waited for inside it, and outside the model the rest of the step:
        # with the exposed collectives they sum to the step (schema.STEP_PHASES)
        accounted = sum(exposed.values())
        for phase, field in STEP_PHASES.items():
            if phase in phases:
                record[field] = seconds = max(0.0, phases[phase] - exposed.get(phase, 0.0))
                accounted += seconds
        if phases:
            record["outside_model_seconds"] = max(0.0, step_seconds - accounted)
        if step.pipeline is not None:
            pipeline = step.pipeline.result()
            if pipeline is not None:
                record["pipeline"] = pipeline
        if calls:
            record["collectives"] = histogram(calls)
        if calls or step.waits:
            record["exposed_collective_seconds"] = sum(exposed.values())
        if step.waits and self._ddp is not None:  # DDP's all-reduce, whose calls no hook sees: its volume
            record["gradient_sync_bytes"] = self._gradient_sync_bytes
        if step.collective_calls:
            record["collective_calls"] = step.collective_calls
        assert step.scalars is not None  # set when the step ended; only ended steps are recorded
        values: dict[str, Any] = dict(step.scalars)
        if step.reported is not None:
            self._read_reported(step.reported, values)
        if step.host is not None:
            values.update(step.host.read())
        if step.measured is not None:  # the monitor's own tensors on the host, final since it made them
            measured = step.measured
            copies = measured.pop("param_copies", None)
            if isinstance(copies, list):  # summed here rather than on the training thread
                measured["param_sums"] = parameter_sums(copies)
            values.update({name: [t.item() for t in value] if isinstance(value, list) else value.tolist()
                           for name, value in measured.items()})
            if "param_sums" in values:
                values["param_checksum"] = checksum_of(values.pop("param_sums"))
            if "grad_norms" in values:
                values["grad_norm_of_grads"] = norm_of(values.pop("grad_norms"))
        unavailable: dict[str, str] = {}
        if step.similarity_due:
            self._gradient_fields(values, record, unavailable)
        # loss, grad_norm, lr, loss_scale and the nonfinite flag, as the schema takes them
        loss, grad_norm = values.get("loss"), values.get("grad_norm")
        if loss is not None:
            record["loss"] = loss
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        if loss is not None or grad_norm is not None:
            record["nonfinite"] = not ((loss is None or math.isfinite(loss))
                                       and (grad_norm is None or math.isfinite(grad_norm)))
        for name in ("lr", "loss_scale"):  # finite and non-negative, or left out
            value = values.get(name)
            if value is not None and math.isfinite(value) and value >= 0:
                record[name] = value
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

    def _read_reported(self, reported: dict[str, tuple[torch.Tensor, int]], values: dict[str, Any]) -> None:
        """The host tensors the user reported, read now (on the client's thread) where they have not changed since
        the step ended; one that has is left out, and counted as a failure (report a copy, or a number)."""
        for name, (tensor, version) in reported.items():
            value = _plain(tensor)
            if tensor._version == version:  # after the read: unchanged until then, so the value is the step's
                values[name] = value
            else:
                self.failures.record("Step.report", RuntimeError(
                    f"the tensor reported as {name} changed before the record read it: report a copy or a number"))

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

    # -- data parallelism: DDP's all-reduce tail, every step ----------------------------------------

    def _watch_backward(self) -> None:
        """Time DDP's all-reduce tail on every step (`_backward_tail`, queued from `_tail_hooks`)."""
        self._handles += self._tail_hooks()

    def _tail_hooks(self) -> list[Any]:
        """Hooks that queue `_backward_tail` in every backward that accumulates gradients (not in
        `torch.autograd.grad`, which DDP does not reduce): after the accumulation of one parameter's gradient,
        since every one gets a gradient in every backward unless DDP is told to find unused ones, and then of the
        first and the last (one of them is used, in any model that has an input and an output layer). Such a
        hook runs before DDP's own hook there, so the callback it queues comes before the one DDP queues with
        its last bucket."""
        assert self._ddp is not None
        params = self._grad_params
        hooked = params[:1] + params[-1:] if self._ddp.find_unused_parameters else params[-1:]
        return [param.register_post_accumulate_grad_hook(self._backward_tail)
                for param in {id(p): p for p in hooked}.values()]

    def _backward_tail(self, param: torch.Tensor | None = None) -> None:
        """One method in three roles, one code object for a training loop to keep warm (three cost ~5 µs more
        per step there). As the hook after a parameter's gradient accumulation (`param` given), inside the
        backward: queue itself as a final callback, once per backward. As that callback: every gradient is
        computed and, unless under `no_sync`, every bucket launched; mark it (and on a measuring step copy this
        rank's gradients), and queue itself again, now behind DDP's callback, which waits for the buckets. As
        that second callback: DDP's all-reduce is done, and the time since the mark is what the training thread
        waited for it, counted in the step and phase the backward ran in. Never raises into autograd."""
        try:
            stage = self._tail_stage
            if param is not None:
                if stage == 0:
                    _ENGINE.queue_callback(self._backward_tail)
                    self._tail_stage = 1
            elif stage == 1:
                ddp = self._ddp
                if ddp is None or not ddp.require_backward_grad_sync:  # under no_sync DDP reduces nothing
                    self._tail_stage = 0
                    return
                self._tail_start = self._mark()
                self._tail_step = self._current
                self._tail_stage = 2
                _ENGINE.queue_callback(self._backward_tail)
                if self._keep_at_tail:
                    self._keep_local_gradients()
                # the training thread waits in DDP's all-reduce from here
                self._tail_in_flight = self._in_flight("all_reduce", self._gradient_sync_bytes, ddp.process_group)
                self.progress.at("collective", self._tail_in_flight)
            elif stage == 2:
                self._tail_stage = 0
                step_now = self._current
                self.progress.at((step_now.phase or "step") if step_now is not None else "idle")
                step = self._tail_step
                self._tail_step = None
                if step is not self._current:  # a backward outside any step, or one the step has outlived
                    step = None
                if step is not None and self._times_collectives:
                    end = self._mark()
                    step.waits.append((step.phase, self._tail_start, end))
                    if self.progress.device_done is not None and self._tail_in_flight is not None:
                        self.progress.on_device = (self._tail_in_flight, end)  # done once the device passes it
                elif not self._on_host:
                    self._clock.release([self._tail_start])
                if self._local_grads:
                    self._compare_gradients(step)
        except Exception as error:
            self._tail_stage, self._tail_step = 0, None
            self.failures.record("Monitor._backward_tail", error)

    # -- data parallelism: each rank's own gradient against DDP's average, on measuring steps --------

    @guarded
    def _watch_gradients(self) -> None:
        """For one measuring step, keep this rank's own gradients until DDP has averaged them. Where `.grad` is
        DDP's own (the default), copy them all at the first callback of the backward DDP reduces
        (`_keep_local_gradients`; with the tail's hooks for this step if the tail is not timed on every step).
        Where `.grad` is a view of a bucket, a hook after each parameter's gradient accumulation, which runs
        before DDP's own hook there adds the gradient to its bucket to be averaged in place. Registered and
        removed per measuring step: a Python call per parameter and backward is a cost the other steps do not
        pay (~60 µs a measuring step for 4 parameters on a 2-core EPYC VM, against one copy of them all)."""
        assert self._ddp is not None
        if self._ddp.gradient_as_bucket_view:
            keep = self._keep_local_gradient
            self._grad_handles = [param.register_post_accumulate_grad_hook(partial(keep, index))
                                  for index, param in enumerate(self._grad_params)]
            return
        self._keep_at_tail = True
        if not self._times_collectives:
            self._grad_handles = self._tail_hooks()

    def _keep_local_gradients(self) -> None:
        """Copy every gradient of this rank, at the first callback of a backward DDP reduces: every one is
        computed and in DDP's buckets, and `.grad` holds the local values (summed over the step's micro-batches)
        until DDP's callback copies the averages back. One `torch._foreach_add` for them all."""
        self._keep_at_tail = False
        kept = [(index, param.grad) for index, param in enumerate(self._grad_params) if param.grad is not None]
        if kept:
            copies = torch._foreach_add([grad.detach() for _, grad in kept], 0)
            self._local_grads = {index: copy for (index, _), copy in zip(kept, copies, strict=True)}

    def _keep_local_gradient(self, index: int, param: torch.Tensor) -> None:
        """Copy this rank's gradient of one parameter, in a backward DDP reduces (not under `no_sync`, where the
        step's gradient is still being summed), and queue `_backward_tail`, which compares the copies with
        DDP's averages once DDP is done. Never raises into autograd."""
        try:
            ddp = self._ddp
            if ddp is not None and ddp.require_backward_grad_sync and param.grad is not None:
                self._local_grads[index] = param.grad.detach().clone()
                self._backward_tail(param)
        except Exception as error:
            self.failures.record("Monitor._keep_local_gradient", error)

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
            mean = self._grad_params[index].grad
            if mean is not None:
                locals_.append(local)
                means.append(mean.detach())
        if locals_:
            similarity.observe_each(locals_, means)

    @guarded
    def _unwatch_gradients(self) -> None:
        while self._grad_handles:
            self._grad_handles.pop().remove()

    # -- data parallelism: the bucket hook (bucket_hook=True) ------------------------------------------

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
        """Each parameter's sum now (the next update changes them); the weighted sum with the record
        (`checksum_of`). On the CPU, a model of at most COPY_CHECKSUM_BYTES is copied instead and summed with the
        record, on the client's thread: a copy costs the training thread a fraction of the fp64 sums (~30 against
        ~110 µs for 68 k parameters in a training loop)."""
        if self._on_host and self._param_bytes <= COPY_CHECKSUM_BYTES:
            step.measure("param_copies", [p.detach().clone() for p in self.params])
        else:
            step.measure("param_sums", parameter_sums(self.params))

    @guarded
    def _measure_gradient_norm(self, step: Step) -> None:
        """Each gradient's norm now (zero_grad and the next backward change them); their norm with the record
        (`norm_of`)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            step.measure("grad_norms", gradient_norms(grads))

    @guarded
    def _send_closed(self) -> None:
        """Handed over like a step, so that it goes out after the last steps (a step record after it would read
        as the rank going on)."""
        if not self._raised:
            self.client.submit(partial(closed_record, self.job, self.layout.rank, self.progress))

    @guarded
    def _send_hello(self) -> None:
        self.client.send(self._hello)

    @guarded
    def _open_memory(self):
        return memory_for(self.device)

    @guarded
    def _close_memory(self) -> None:
        if self._memory is not None:
            self._memory.close()

    @guarded
    def _remove_hooks(self) -> None:
        self._unwatch_gradients()
        while self._handles:
            self._handles.pop().remove()


class Step:
    """One training step: a context manager around it, with phases inside (`data`, `compute`,
    `optimizer`) and the values only the training loop knows (`report`)."""

    __slots__ = ("_measures_grads", "calls", "checksum_due", "collective_calls", "end", "failures", "host", "measured",
                 "memory", "memory_due", "monitor", "number", "phase", "phases", "pipeline", "reported", "samples",
                 "scalars", "similarity", "similarity_due", "start", "time", "tokens", "values", "waits")

    # Made by Monitor.step (no __init__: a Python frame fewer on the hot path). What each slot holds:
    monitor: Monitor
    failures: Failures
    number: int
    tokens: int | None
    samples: int | None
    start: Mark | None
    end: Mark | None
    phase: str | None  # the phase open now, which collective calls are attributed to
    phases: list[tuple[str, Mark, Mark]]  # (name, start, end) of each interval, in order
    calls: list[Call]  # timed collective calls (the comm layer's, the bucket hook's)
    collective_calls: dict[str, int] | None  # the monitor's count per group as the step ended
    waits: list[tuple[str | None, Mark, Mark]]  # DDP's all-reduce tails: (phase, start, end)
    values: dict[str, float | torch.Tensor]  # what the user reported
    #: tensors the monitor made on a measuring step (a tensor, or one per parameter), read with the record
    measured: dict[str, torch.Tensor | list[torch.Tensor]] | None
    pipeline: PipelineClock | None
    memory: dict[str, Any] | None
    time: float
    scalars: dict[str, float | list[float]] | None  # the values read on the host, at the end
    reported: dict[str, tuple[torch.Tensor, int]] | None  # the user's host tensors and their versions, at the end
    host: _HostValues | None  # the values on the device, copied to the host without a sync
    checksum_due: bool
    memory_due: bool
    similarity_due: bool
    #: this step's GradientSimilarity, or None when the step does not measure it (or nothing would feed it)
    similarity: GradientSimilarity | None
    _measures_grads: bool  # whether step.optimizer() takes the gradient norm from .grad

    def __enter__(self) -> Step:
        # The hot path guards itself inline (as `_Collective` does): a `guarded` wrapper per call adds up here.
        monitor = self.monitor
        try:
            wait, monitor._data_wait = monitor._data_wait, None
            if wait is None:
                self.start = monitor._mark()
            else:  # measured by data() just before this step, which then starts with it
                self.start = wait[0]
                self.phases.append(("data", wait[0], wait[1]))
            monitor._current = self
            monitor._tail_stage = 0  # a backward that raised never ran its callbacks
            progress = monitor.progress
            progress.at("step")
            progress.step_started = progress.since
        except Exception as error:
            self.failures.record("Step.__enter__", error)
        return self

    def __exit__(self, exc_type: type | None, *exc_info: object) -> Literal[False]:
        """The step's end mark and what the record needs before the next step changes it, then the hand-over;
        nothing here waits for the device. Guarded inline, in parts (the hot path, as `__enter__`)."""
        monitor = self.monitor
        monitor._current = None
        if monitor._grad_handles or monitor._keep_at_tail:  # a measuring step DDP never averaged (a failed backward)
            monitor._local_grads, monitor._keep_at_tail = {}, False
            monitor._unwatch_gradients()
        progress = monitor.progress
        if exc_type is not None:  # the training loop raised: no step record, and no collective of ours to wait in
            error = exc_info[0]
            if isinstance(error, BaseException):  # said at once: the rank may be about to die, its peers to wait
                try:
                    monitor._raised = True
                    monitor.client.send(error_record(monitor.job, monitor.layout.rank, progress, error))
                except Exception as failure:
                    self.failures.record("Step.__exit__", failure)
            return False
        progress.step = self.number
        progress.at("idle")
        if progress.step_started is not None:
            progress.durations.append(progress.since - progress.step_started)
        monitor._raised = False  # a step that raised was caught, and training went on
        try:
            self.end = monitor._mark()
        except Exception as error:
            self.failures.record("Clock.mark", error)
        if monitor._sequences:
            self.collective_calls = monitor._sequences.copy()
        if self.similarity is not None:
            # A collective over the shard groups unless the training loop made it already: every rank
            # makes it on every measuring step, whatever else fails here, or its peers would wait forever.
            sums = self.similarity.reduce()
            if sums is not None:
                self.measure("similarity", sums)
        if self.checksum_due and monitor.params:
            monitor._checksum(self)
        if self.memory_due and monitor._memory is not None:
            try:
                self.memory = monitor._memory.read()
                monitor._memory.reset()  # the next reading's peak starts here
            except Exception as error:
                self.failures.record("Monitor._read_memory", error)
        try:
            self.time = time.time()
            # The user's values: numbers as they are; tensors on the host read with the record, on the client's
            # thread, if they have not changed by then (their version counter says: the next step may change a
            # tensor the user reported); tensors on the device copied to the host without a sync (`_HostValues`),
            # with those the monitor made there. The monitor's own host tensors never change: read with the record.
            scalars: dict[str, float | list[float]] = {}
            on_device: dict[str, torch.Tensor] | None = None
            for name, value in self.values.items():
                if type(value) is float:
                    scalars[name] = value
                elif not isinstance(value, torch.Tensor):
                    scalars[name] = float(value)
                elif value.is_cuda:
                    if on_device is None:
                        on_device = {}
                    on_device[name] = value
                else:
                    try:
                        version = value._version
                    except RuntimeError:  # an inference tensor has no version counter: read it now
                        scalars[name] = _plain(value)
                        continue
                    if self.reported is None:
                        self.reported = {}
                    self.reported[name] = (value, version)
            self.scalars = scalars
            if self.measured is not None and not monitor._on_host:
                on_device = {**(on_device or {}), **{name: torch.stack(value) if isinstance(value, list) else value
                                                     for name, value in self.measured.items()}}
                self.measured = None
            if on_device is not None:
                self.host = _HostValues(on_device, monitor._clock)
            if monitor._on_host and not monitor._pending and self.pipeline is None:  # resolved: hand it over
                monitor.client.submit(partial(monitor._finish, self))
                return False
            monitor._pending.append(self)
        except Exception as error:
            self.failures.record("Monitor._end", error)
        monitor._flush()
        return False

    # The phases are made by hand: `_Phase(self, name)` would cost an `__init__` frame more on the hot path.

    def data(self) -> _Phase:
        """Waiting for the input batch."""
        phase = _new(_Phase)
        phase.step, phase.name, phase.start = self, "data", None
        return phase

    def compute(self) -> _Phase:
        """Forward and backward; time spent waiting on collectives inside it is taken out."""
        phase = _new(_Phase)
        phase.step, phase.name, phase.start = self, "compute", None
        return phase

    def optimizer(self) -> _Phase:
        """The optimizer's update. On a measuring step without the gradient similarity's sums, the gradient norm
        is taken from .grad here, before the update and before zero_grad (and not timed as the optimizer's)."""
        if self._measures_grads:
            self._measures_grads = False
            self.monitor._measure_gradient_norm(self)
        phase = _new(_Phase)
        phase.step, phase.name, phase.start = self, "optimizer", None
        return phase

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

    def measure(self, name: str, value: torch.Tensor | list[torch.Tensor]) -> None:
        """Keep a tensor the monitor made (or one per parameter) for the record."""
        if self.measured is None:
            self.measured = {}
        self.measured[name] = value

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
        if self.scalars is None or (self.host is not None and not self.host.ready()) or (
                self.pipeline is not None and not self.pipeline.ready()):
            return False
        if any(call.end is None for call in self.calls):
            return False
        ready = self.monitor._clock.ready
        return all(ready(end) for _, _, end in self.waits)

    def marks(self) -> list[Mark]:
        marks = [self.start, self.end] + [m for _, start, end in self.phases for m in (start, end)]
        marks += [m for call in self.calls for m in (call.start, call.end)]
        marks += [m for _, start, end in self.waits for m in (start, end)]
        marks += self.pipeline.marks() if self.pipeline is not None else []
        marks += [self.host.mark] if self.host is not None and self.host.mark is not None else []
        return [m for m in marks if m is not None]


class _Phase:
    """`with step.compute():` and the like; phases may repeat within a step (their times add up). Made by
    `Step.data`, `compute` and `optimizer`, without an `__init__`."""

    __slots__ = ("name", "outer", "start", "step")
    step: Step
    name: str
    start: Mark | None
    outer: str | None  # the phase this one is inside, restored as it ends

    def __enter__(self) -> None:
        step = self.step  # guarded inline, as Step.__enter__
        try:
            self.outer, step.phase = step.phase, self.name
            step.monitor.progress.at(self.name)
            self.start = step.monitor._mark()
        except Exception as error:
            self.start = None
            step.failures.record("_Phase.__enter__", error)

    def __exit__(self, *exc_info: object) -> Literal[False]:
        step = self.step
        try:
            if self.start is not None:
                step.phases.append((self.name, self.start, step.monitor._mark()))
            step.phase = self.outer
            step.monitor.progress.at(self.outer or "step")
        except Exception as error:
            step.failures.record("_Phase.__exit__", error)
        return False


_new = object.__new__


class _Collective:
    """One blocking collective call, timed by `Monitor.collective`. On the hot path (a tensor-parallel
    layer makes several calls per micro-batch), so it guards itself inline rather than with `guarded`."""

    __slots__ = ("clock", "failures", "in_flight", "nbytes", "op", "progress", "start", "step")

    def __init__(self, monitor: Monitor, step: Step, op: str, nbytes: int, in_flight: InFlight | None) -> None:
        self.step, self.clock, self.failures, self.progress = step, monitor._clock, monitor.failures, monitor.progress
        self.op, self.nbytes, self.start, self.in_flight = op, nbytes, None, in_flight

    def __enter__(self) -> None:
        try:
            self.progress.at("collective", self.in_flight)
            self.start = self.clock.mark()
        except Exception as error:
            self.failures.record("_Collective.__enter__", error)

    def __exit__(self, *exc_info: object) -> Literal[False]:
        try:
            step = self.step
            if self.start is not None:
                end = self.clock.mark()
                step.calls.append(Call(self.op, self.nbytes, self.start, True, step.phase, end))
                if self.progress.device_done is not None and self.in_flight is not None:
                    self.progress.on_device = (self.in_flight, end)  # done once the device passes it
            self.progress.at(step.phase or "step")
        except Exception as error:
            self.failures.record("_Collective.__exit__", error)
        return False


class _HostValues:
    """A step's values, some of them device tensors, brought to the host without a sync: one
    non-blocking copy into pinned memory, read once the device has passed the mark after it. Values
    on the CPU are read at once: a tensor the user reported may change in the next step."""

    __slots__ = ("_clock", "_host", "_sizes", "_values", "mark")

    def __init__(self, values: Mapping[str, float | torch.Tensor], clock: Clock) -> None:
        self._clock = clock
        self._host: torch.Tensor | None = None
        self.mark: Mark | None = None
        self._values: dict[str, float | list[float]] = {}
        on_gpu: dict[str, torch.Tensor] | None = None
        for name, value in values.items():
            if type(value) is float:
                self._values[name] = value
            elif isinstance(value, torch.Tensor) and value.is_cuda:
                if on_gpu is None:
                    on_gpu = {}
                on_gpu[name] = value.detach().reshape(-1).double()
            else:
                self._values[name] = _plain(value)
        self._sizes: dict[str, int] = {}
        if on_gpu:
            self._sizes = {name: t.numel() for name, t in on_gpu.items()}
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


def _mean(future: Any) -> torch.Tensor:
    """The reduced bucket of an all-reduce's future: its one tensor (a work's future holds a list of them)."""
    value = future.value()
    return value[0] if isinstance(value, list) else value


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _hello_with(record: dict[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """The hello with the caller's `fields` added; ValueError, naming the field, when the schema refuses it."""
    if "kind" in fields or "v" in fields:
        raise ValueError("Monitor(hello=...) may not set the record's kind or version")
    merged = {**record, **fields}
    try:
        decode(encode(merged))
    except RecordRejected as error:
        raise ValueError(f"Monitor(hello=...) makes an invalid hello: {error}") from None
    except (TypeError, ValueError) as error:  # not JSON
        raise ValueError(f"Monitor(hello=...) makes an invalid hello: {error}") from None
    return merged
