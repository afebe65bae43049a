"""`Monitor`, one per rank: the rank-wide state its steps share, from the training loop's `step()` to the record sent.

A step's measurements are marks (`clock`) and device tensors taken without waiting for the device.
The record is built once they are resolved: at once on the CPU, a step or two later on a GPU, when
the device has passed the step's last mark. Steps wait in a short queue until then, so the training
loop never synchronises for the hooks' sake. A resolved step is handed to the telemetry client's
thread (`TelemetryClient.submit`), which builds its record (`Step.finish`, `record.step_record`), encodes and sends
it: the training thread only takes the marks and the few values that would change under it.

A step's life cycle, from start to record, is the `Step`'s own (`step.py`), with what the Monitor hands it: one
`StepContext` per rank (the clock, client, progress, gradient statistics, memory, the queue of pending steps and its
`flush`, the step open now). The Monitor owns that state and sets it up; the step and the parts below read and write
the context, never the Monitor, directly on the hot path rather than through methods (a Python frame per step or
phase adds up). The other parts, each readable alone: the record (`record.py`), DistributedDataParallel watched
(`ddp.py`), the gradient statistics of measuring steps (`gradient_stats.py`), memory (`memory.py`), the hang watchdog
(`progress.py`) and who the rank is (`identity.py`).

Cost on the training thread, per step with every default signal: see benchmarks/README.md ("Training
hooks"). What stays on it is what cannot wait: the marks, the phase bookkeeping, reading the values the
user reported (the next step may change them) and, on measuring steps, the memory peak since the last
reading (reset as it is read), the checksum and the gradient norm (the next update changes the parameters).

Every entry point the training loop calls is guarded (`safety`): an exception inside the hooks is
counted in `Monitor.failures` and logged once, and training goes on; so is every hook that runs inside
autograd or DDP. The user's own code inside a `with step.compute():` is not guarded: its exceptions pass
through untouched.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from gpuwatch.protocol.schema import P2P_OPS
from gpuwatch.trainer.hooks.clock import WallClock, clock_for
from gpuwatch.trainer.hooks.cpu_times import open_reader
from gpuwatch.trainer.hooks.ddp import BucketHook, DdpWatch
from gpuwatch.trainer.hooks.flops import peak_flops
from gpuwatch.trainer.hooks.gradient_stats import GradientStatistics
from gpuwatch.trainer.hooks.identity import Layout, hello_record, hello_with, resolve_job
from gpuwatch.trainer.hooks.memory import CudaMemory, HostMemory, memory_for
from gpuwatch.trainer.hooks.off import OFF, Off
from gpuwatch.trainer.hooks.progress import InFlight, Progress, Watchdog, closed_record
from gpuwatch.trainer.hooks.safety import Failures, guarded
from gpuwatch.trainer.hooks.step import CollectiveTimer, Step, StepContext, new
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

    `model`: the module being trained (its parameters feed the checksum, its device picks the clock). A
    DistributedDataParallel model gets a hook on a parameter's gradient (`ddp.DdpWatch`) that
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
        self.device = device or (self.params[0].device if self.params else _default_device())
        run_log = run_log if run_log is not None else os.environ.get(RUN_LOG_VARIABLE) or None
        self.client = client if client is not None else TelemetryClient(
            socket_path, run_log_file(run_log, self.layout.rank) if run_log is not None else None)
        self.signals = frozenset(signals) & SIGNALS
        #: whether collectives are timed (blocking calls, DDP's all-reduce tail, the buckets)
        self.times_collectives = "collectives" in self.signals
        self._every = {signal: every if signal in self.signals and every > 0 else 0
                       for signal, every in (("grad_similarity", grad_similarity_every), ("checksum", checksum_every),
                                             ("memory", memory_every))}
        self._similarity_every, self._checksum_every = self._every["grad_similarity"], self._every["checksum"]
        self._memory_every = self._every["memory"]
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops_per_second or peak_flops(self.device)
        self.shard_groups = tuple(shard_groups)
        self.job = resolve_job(job)
        # The rank-wide state handed to every step (`StepContext`, made below), not settings.
        self.clock = clock_for(self.device)
        self.mark = self.clock.mark  # on the CPU time.perf_counter itself: no Python frame per mark
        self.on_host = isinstance(self.clock, WallClock)  # every mark ready when taken: no queue
        #: ended steps waiting for the device (`flush`)
        self.pending: deque[Step] = deque()
        self.memory = self._open_memory() if self._memory_every else None
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.gradients = GradientStatistics(self.params, self.device, self.layout.dp_size, self.shard_groups,
                                            self.failures, self.on_host, stream)
        #: a DDP model that reduces its gradients in C++ (no bucket hook), watched through autograd (`DdpWatch`)
        self.ddp_watch: DdpWatch | None = None
        self._last_number = 0
        self._hello_fields = dict(hello or {})
        self._hello = hello_with(hello_record(self.job, self.layout, self.device), self._hello_fields)
        self._send_hello()
        #: the training thread's place (this thread's: the one that makes the Monitor runs the loop), and the
        #: watchdog that reports it while a step is overdue; collectives numbered per process group
        self.progress = Progress()
        if not self.on_host:  # a collective the host has left may still run on the device
            self.progress.device_done = self.clock.ready
        #: collectives (not send/recv) numbered per group: every member of a group counts the same at the end of
        #: the same step, unless one skipped or added a call (the step record's `collective_calls`); send/recv
        #: are numbered apart, as pairs of ranks, not the whole group, take part in them (a pipeline's middle
        #: stages make twice as many as its ends)
        self.collective_counts: dict[str, int] = {}
        self._p2p_counts: dict[str, int] = {}
        self._group_names: dict[Any, tuple[str, int, int]] = {}
        #: the training thread's time on a CPU and wait for one, read as each step starts and ends (CPU ranks only:
        #: `cpu_times`)
        cpu_times = open_reader() if self.on_host else None
        self._cpu_times_descriptor = cpu_times[1] if cpu_times is not None else None
        #: what each step is handed, and the step open now, which collectives are counted in (`StepContext`)
        self.step_context = StepContext(
            failures=self.failures, clock=self.clock, mark=self.mark, on_host=self.on_host, progress=self.progress,
            client=self.client, job=self.job, rank=self.layout.rank, device=self.device, signals=self.signals,
            times_collectives=self.times_collectives, params=self.params, gradients=self.gradients,
            memory=self.memory, flops_per_token=self.flops_per_token, peak_flops=self.peak_flops,
            collective_counts=self.collective_counts, in_flight=self.in_flight, group_name=self.group_name,
            pending=self.pending, flush=self.flush,
            read_cpu_times=cpu_times[0] if cpu_times is not None else None)
        self._watchdog = Watchdog(self.progress, self.client.send, self.job, self.layout.rank, threading.get_ident())
        self._watchdog.start()
        self._closed = False
        atexit.register(self.close)  # a script that never closes the monitor still ends normally
        ddp = model if isinstance(model, DistributedDataParallel) else None
        registered = BucketHook.of(ddp) if ddp is not None else None  # gpuwatch run's, holding a user's hook
        self.bucket_hook = ddp is not None and (bucket_hook or comm_hook is not None or registered is not None)
        if registered is not None:
            registered.attach(self.step_context)
            if comm_hook is not None:
                registered.compose(comm_hook, comm_state)
        elif ddp is not None and self.bucket_hook:
            BucketHook(self.step_context).register(ddp, comm_hook, comm_state)
        elif ddp is not None:
            self.ddp_watch = self.step_context.ddp_watch = DdpWatch(self.step_context, ddp)
            if self.times_collectives:
                self.ddp_watch.watch_backward()

    # -- the training loop's side ------------------------------------------------------------------

    def step(self, tokens: int | None = None, *, samples: int | None = None, number: int | None = None) -> Step:
        """The next training step, as a context manager around all of it. `tokens` and `samples` (sequences,
        images, rows: for models that do not count tokens) this rank processes in it. `number` defaults to
        one more than the last; pass the trainer's own (a resumed run) so every rank agrees on measuring
        steps."""
        self._last_number = number = self._last_number + 1 if number is None else number
        # Made here rather than in a Step.__init__: one Python frame fewer on the hot path.
        step = new(Step)
        step.monitor, step.context, step.failures, step.number = self, self.step_context, self.failures, number
        step.tokens, step.samples = tokens, samples
        step.start = step.end = step.phase = step.pipeline = step.memory = step.scalars = step.host = None
        step.measured = step.similarity = step.reported = step.collective_calls = None
        step.cpu_at_start = step.cpu_at_end = None
        step.phases, step.calls, step.waits, step.values, step.time = [], [], [], {}, 0.0
        every = self._checksum_every
        step.checksum_due = every > 0 and number % every == 0
        every = self._memory_every
        step.memory_due = every > 0 and number % every == 0
        every = self._similarity_every
        step.similarity_due = due = every > 0 and number % every == 0
        step.norm_from_grads = False
        if due:
            self.gradients.start(step)
            if step.similarity is not None and self.ddp_watch is not None:
                self.ddp_watch.watch_gradients()
        return step

    def data(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from `iterable`, timing each wait for the next item as the data-loader wait of the step
        it feeds (the next `step()`, whose time then starts with that wait)."""
        iterator, mark, failures, context = iter(iterable), self.mark, self.failures, self.step_context
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
                context.data_wait = None if start is None else (start, end)
            except Exception as error:
                failures.record("Clock.mark", error)
                context.data_wait = None
            yield item

    def collective(self, op: str, nbytes: int, group: Any = None) -> CollectiveTimer | Off:
        """A context manager timing one blocking collective call of this step (op: schema.COLLECTIVE_OPS) on
        `group` (a ProcessGroup; None: the default group), which is the collective in flight while it lasts.
        The reference trainer routes its comm layer through it (`comm.set_timer(monitor.collective)`)."""
        context = self.step_context
        step = context.current
        if step is None or not self.times_collectives:
            return OFF
        return CollectiveTimer(context, step, op, nbytes, self.in_flight(op, nbytes, group))

    def in_flight(self, op: str, nbytes: int, group: Any) -> InFlight | None:
        """The collective about to start, numbered on its group: the group's name in the hello (`process_groups`,
        "default" for the world), its size and this rank's place in it. None when it cannot be told."""
        try:
            identity = self._group_names.get(group)
            if identity is None:
                identity = self._group_names[group] = self._identify(group)
            name, size, place = identity
            counts = self._p2p_counts if op in P2P_OPS else self.collective_counts
            seq = counts[name] = counts.get(name, 0) + 1
            return InFlight(op, name, size, place, seq, nbytes, time.monotonic())
        except Exception as error:
            self.failures.record("Monitor.in_flight", error)
            return None

    def group_name(self, group: Any) -> str:
        """A process group's name in the hello (`process_groups`; "default" for the world)."""
        identity = self._group_names.get(group)
        if identity is None:
            identity = self._group_names[group] = self._identify(group)
        return identity[0]

    def _identify(self, group: Any) -> tuple[str, int, int]:
        """A group's name in the hello, its size and this rank's place in it. The world is "default", unless the
        tensor or pipeline dimension spans it (a one-dimensional device mesh over the world hands out the default
        group as its dimension's): then it is that dimension's."""
        if group is None or group is dist.GroupMember.WORLD or not dist.is_initialized():
            size = dist.get_world_size() if dist.is_initialized() else 1
            spanning = (name for name in ("tp", "pp") if len(self.layout.process_groups.get(name, ())) == size > 1)
            return next(spanning, "default"), size, self.layout.rank
        ranks = tuple(dist.get_process_group_ranks(group))
        name = next((name for name, members in self.layout.process_groups.items() if tuple(members) == ranks),
                    None)
        if name is None:
            name = "default" if len(ranks) == self.layout.world_size else f"ranks-{ranks[0]}-{ranks[-1]}"
        return name, len(ranks), ranks.index(self.layout.rank) if self.layout.rank in ranks else 0

    @guarded
    def relayout(self, layout: Layout, hello: Mapping[str, Any]) -> None:
        """The job's layout as learnt after the Monitor was made (`gpuwatch run` learns a pipeline's schedule from
        its first step), with fields for the hello: said again, so the agent and the run log have it. A hello the
        schema refuses leaves both as they were (counted in `failures`)."""
        fields = {**self._hello_fields, **hello}
        self._hello = hello_with(hello_record(self.job, layout, self.device), fields)
        self._hello_fields, self.layout = fields, layout
        self._group_names.clear()  # groups are named by the layout's process_groups
        self._send_hello()

    def close(self) -> None:
        """Send the steps still waiting for the device (at most CLOSE_TIMEOUT_S), then close the client, which
        sends every record handed to it, and take the hooks off the model. Not for the training loop: this
        one may wait."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._watchdog.close()
        self.flush(timeout=CLOSE_TIMEOUT_S)
        self._close_memory()
        if self._cpu_times_descriptor is not None:
            self.step_context.read_cpu_times = None  # a step after the close reads nothing
            os.close(self._cpu_times_descriptor)
        if self.ddp_watch is not None:
            self.ddp_watch.close()
        self._send_closed()
        self.client.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the steps' queue --------------------------------------------------------------------------

    @guarded
    def flush(self, timeout: float = 0.0) -> None:
        """Hand the pending steps the device has finished to the client's thread, oldest first. With a timeout,
        wait up to that long for the rest, then hand them over with whatever is resolved (a pipeline end
        that never came is left out)."""
        pending, deadline = self.pending, None
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
            self.client.submit(step.finish)

    # -- opening and closing -----------------------------------------------------------------------

    @guarded
    def _send_closed(self) -> None:
        """Handed over like a step, so that it goes out after the last steps (a step record after it would read
        as the rank going on)."""
        if not self.step_context.raised:
            self.client.submit(partial(closed_record, self.job, self.layout.rank, self.progress))

    @guarded
    def _send_hello(self) -> None:
        self.client.send(self._hello)

    @guarded
    def _open_memory(self) -> CudaMemory | HostMemory:
        return memory_for(self.device)

    @guarded
    def _close_memory(self) -> None:
        if self.memory is not None:
            self.memory.close()


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
