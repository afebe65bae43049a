"""Failures the reference trainer reproduces on purpose (`gpuwatch train --fault NAME`), so that `gpuwatch
diagnose` can be shown to find them on real runs. They are an overlay: the trainer is built without them, then
`apply` changes the parts a fault lives in (the model's weights or output, the pipeline's pace or group, the
optimizer's learning rate, the loss scaler, the sampler, the gradient reduction). Each function below is one
fault; its docstring names the real failure it stands for. Every rank lists its faults in its telemetry hello,
so no one takes a faulty demo for a real run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gpuwatch.trainer.config import ConfigError
from gpuwatch.trainer.parallel import comm
from gpuwatch.trainer.parallel.data import grad_of
from gpuwatch.trainer.parallel.groups import Grid
from gpuwatch.trainer.precision import DynamicLossScaler

if TYPE_CHECKING:  # train.py imports this module
    from gpuwatch.trainer.train import Trainer

#: slow-rank: the slow rank's forward and backward passes take this many times as long; more than a throttled GPU
#: loses, so that one step's scheduling noise on a small CPU-only machine (up to 2x) cannot hide it.
SLOWDOWN = 8.0
#: lr-explode: the peak learning rate, 2,000x what this model trains with (--lr 1e-2).
EXPLODING_LR = 20.0
#: desync: standard deviation of the noise added to the last replica's weights (theirs start at 0.02).
DESYNC_NOISE = 1e-3
#: fp16-no-scaler: the factor that takes the logits past fp16's largest value, 65504 (any above 1/256 overflows).
FP16_OVERFLOW = 2.0**24
#: fragment-memory: what the odd-sized blocks add up to, and the free room left under the allocator's cap. The blocks
#: are 1-10 MiB, the sizes the caching allocator carves out of shared 20 MiB segments (PyTorch's CUDA memory notes),
#: so a freed block leaves a hole in a segment that a live neighbour keeps from being released.
FRAGMENTS_BYTES = 256 * 2**20
CAP_HEADROOM_BYTES = 32 * 2**20
#: fragment-memory: a cached block freed whole, that only a flush of the cache gives back to the request after it.
SPARE_BYTES = 64 * 2**20


def explode_learning_rate(trainer: Trainer) -> None:
    """lr-explode: a learning rate far too high for the model (a typo'd exponent, a linear-scaling rule
    applied to a huge batch). AdamW moves every weight by about the learning rate each step whatever the
    gradient, so the weights grow large and the gradient norm, measured before clipping, explodes
    (past 100, where CONV002 calls it exploded). The schedule is made anew around the new peak."""
    for group in trainer.optimizer.param_groups:
        group["lr"] = group["initial_lr"] = EXPLODING_LR
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, trainer.scheduler.lr_lambdas)


class _SlowPass:
    """One forward or backward pass made SLOWDOWN times as long: when it ends, it sleeps SLOWDOWN - 1 times
    what it computed, so the extra time lands in the rank's measured compute, not in a collective. On the
    CPU that is the pass's CPU time (waits for tensor-parallel peers and for a CPU are not stretched); on
    a GPU, its wall time once the device has finished it."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time()

    def __enter__(self) -> None:
        self.start = self._now()

    def __exit__(self, *exc_info: object) -> None:
        time.sleep((SLOWDOWN - 1) * (self._now() - self.start))


def slow_rank(trainer: Trainer) -> None:
    """slow-rank: one rank computes SLOWDOWN times slower than its peers, as a GPU that throttles (heat,
    power brake), sits on a degraded PCIe link or shares its node with another job does. Every other rank
    waits for it at each collective, so step times come out even; only compute times show the straggler.
    The pipeline wraps each of that rank's forward and backward passes in a `_SlowPass`."""
    if trainer.grid.rank == trainer.cfg.faulty_rank:
        trainer.pipeline.pace = partial(_SlowPass, trainer.device)


def desync(trainer: Trainer) -> None:
    """desync: the last data-parallel replica starts from other weights than the rest, as when rank 0's
    weights are never broadcast and each replica initialises from its own seed, or a replica loads another
    checkpoint. The DP all-reduce keeps the gradients equal, so the replicas stay apart for good while the
    loss curve looks normal; only a comparison of the replicas' parameters shows it."""
    if trainer.grid.dp_rank != trainer.grid.dp - 1:
        return
    # the same on every TP rank, so that replicated weights agree
    generator = torch.Generator().manual_seed(trainer.cfg.seed + 1)
    with torch.no_grad():
        for param in trainer.model.parameters():
            noise = torch.randn(param.shape, generator=generator) * DESYNC_NOISE
            param.add_(noise.to(param.device))


def overflow_fp16(trainer: Trainer) -> None:
    """fp16-no-scaler: fp16 training without a loss scaler, the way it ends when a value leaves fp16's
    range (largest 65504): inf logits, a NaN loss, NaN gradients, and with no scaler to skip the step the
    optimizer writes NaN into every weight (torch.amp.GradScaler would skip a step whose gradients hold
    inf or NaN). This small model's logits never get there by themselves, so the last stage's LM head
    emits them in fp16 at FP16_OVERFLOW times their size, as a larger model's activations grow; the
    trainer runs without its DynamicLossScaler and reports no loss scale."""
    trainer.scaler = DynamicLossScaler(enabled=False)
    head = getattr(trainer.model, "head", None)
    if head is not None:
        head.register_forward_hook(lambda module, inputs, logits: (logits * FP16_OVERFLOW).half())


class Fragmenter:
    """fragment-memory: the CUDA caching allocator left holding memory it cannot use, as a long run does whose
    tensors change size from step to step (variable sequence lengths, odd-sized buffers freed out of order): freed
    blocks sit in segments that live neighbours keep from being released, reserved memory grows far past what is
    allocated, and a request larger than any hole only succeeds after the allocator has flushed its cache and
    retried (`num_alloc_retries`; PyTorch's CUDA memory notes, torch.cuda.memory_stats).

    On the first gradient reduction, inside the step whose record reports it: odd-sized blocks (FRAGMENTS_BYTES in
    all, 1-10 MiB each) with every other one freed and the rest kept for the run; a SPARE_BYTES block allocated and
    freed whole; the allocator capped (set_per_process_memory_fraction) CAP_HEADROOM_BYTES above what it reserves;
    then one block larger than the headroom and than any cached block, which the cap refuses until the cache is
    flushed (one alloc retry). The cap is lifted again, so the rest of the run trains as it would."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kept: list[torch.Tensor] = []  # the live neighbours that pin the holes, for the whole run

    def fragment(self) -> None:
        device = self.device
        blocks = []
        total, size = 0, 2**20 + 4099  # odd sizes: not multiples of the allocator's 512-byte rounding
        while total < FRAGMENTS_BYTES:
            blocks.append(torch.empty(size, dtype=torch.uint8, device=device))
            total += size
            size = 2**20 + (size * 7919) % (9 * 2**20)
        self.kept = blocks[::2]
        del blocks
        spare = torch.empty(SPARE_BYTES, dtype=torch.uint8, device=device)
        del spare
        capacity = torch.cuda.get_device_properties(device).total_memory
        cap = torch.cuda.memory_reserved(device) + CAP_HEADROOM_BYTES
        torch.cuda.set_per_process_memory_fraction(min(cap / capacity, 1.0), device)
        try:
            retried = torch.empty(SPARE_BYTES + CAP_HEADROOM_BYTES // 2, dtype=torch.uint8, device=device)
            del retried
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)


def fragment_memory(trainer: Trainer) -> None:
    """fragment-memory (Fragmenter): every rank fragments its GPU's caching allocator during its first step.
    The CUDA allocator is what it breaks, so a rank on the CPU refuses it (TrainConfig refuses --device cpu
    before any rank starts; this covers `auto` resolved inside a rank)."""
    if trainer.device.type != "cuda":
        raise ConfigError(f"--fault fragment-memory fragments the CUDA caching allocator, and this rank runs on "
                          f"{trainer.device.type}: it needs a GPU")
    fragmenter = Fragmenter(trainer.device)
    reduce = trainer.reduce_gradients

    def fragment_then_reduce(params: list[torch.nn.Parameter], observe: Callable | None = None) -> None:
        if not fragmenter.kept:
            fragmenter.fragment()
        reduce(params, observe=observe)

    trainer.reduce_gradients = fragment_then_reduce


def duplicate_shards(trainer: Trainer) -> None:
    """duplicate-shards: every DP rank reads the same data, as a job without a distributed sampler (or with
    one not told the rank and the number of replicas) does: each takes the first slice of the global batch,
    so the replicas' gradients agree exactly and the job trains on 1/dp of the data it pays for."""
    trainer.sampler.offset = 0


class SharedGroup:
    """shared-pp-dp-group: pipeline send/recv and the data-parallel gradient all-reduce on one process group,
    as a job that uses the default group for both instead of one new_group per kind of traffic. On NCCL the
    two kinds of traffic serialise on one communicator, and a large all-reduce blocks the send/recv that
    another stage waits for: in one reported case a 13B model on 32 A100s hit NCCL timeouts after 2,000
    steps.

    The shared group is every rank with this rank's TP rank (all its stages and replicas; the whole world
    when tp = 1). It still trains exactly: the all-reduce carries one slice per pipeline stage, each rank
    fills its own stage's slice and zeros elsewhere, so every slice sums over that stage's replicas only.
    The small reductions (loss, gradient norm) stay on their own groups.
    """

    def __init__(self, grid: Grid, params: list[torch.nn.Parameter], device: torch.device) -> None:
        self.grid = grid
        world = dist.get_world_size()
        for tp_rank in range(grid.tp):  # every rank creates every group, in the same order
            ranks = list(range(tp_rank, world, grid.tp))
            group = dist.new_group(ranks)
            if tp_rank == grid.tp_rank:
                self.group: ProcessGroup = group
                self.ranks = tuple(ranks)
        local_sizes = torch.zeros(grid.pp, dtype=torch.int64, device=device)
        local_sizes[grid.pp_rank] = sum(p.numel() for p in params)
        sizes = comm.all_reduce(local_sizes, grid.pp_group).tolist()
        self.offset, self.size, self.total = sum(sizes[: grid.pp_rank]), sizes[grid.pp_rank], sum(sizes)

    def all_reduce_gradients(
        self,
        params: list[torch.nn.Parameter],
        observe: Callable[[list[torch.nn.Parameter], torch.Tensor], None] | None = None,
    ) -> None:
        """`gpuwatch.trainer.parallel.data.all_reduce_gradients` over the shared group, in one bucket."""
        params = [p for p in params if p.grad is not None]
        first = grad_of(params[0])
        flat = torch.zeros(self.total, dtype=first.dtype, device=first.device)
        mine = flat[self.offset:self.offset + self.size]
        mine.copy_(torch.cat([grad_of(p).reshape(-1) for p in params]))
        comm.all_reduce(flat, self.group)
        mine.div_(self.grid.dp)
        if observe is not None:
            observe(params, mine)
        for param, reduced in zip(params, mine.split([p.numel() for p in params]), strict=True):
            grad = grad_of(param)
            grad.copy_(reduced.view_as(grad))


def shared_group(trainer: Trainer) -> None:
    """shared-pp-dp-group (SharedGroup): the pipeline's send/recv and the gradient reduction move to one group,
    and the hello names it as both. Collective: every rank calls it."""
    shared = SharedGroup(trainer.grid, trainer.params, trainer.device)
    trainer.pipeline.group = shared.group
    trainer.reduce_gradients = shared.all_reduce_gradients
    trainer.traffic_groups |= {"pp": (shared.ranks, shared.group), "dp": (shared.ranks, shared.group)}


def _hang_before_all_reduce() -> None:
    """Where the hang-rank fault's rank stops: its stack names this function."""
    threading.Event().wait()


def hang_rank(trainer: Trainer) -> None:
    """hang-rank: one rank stops before the data-parallel all-reduce of step --fault-step and never comes, as a rank
    stuck in a deadlocked data-loader worker, a filesystem that stopped answering, or a branch only it took does.
    Its peers wait in the all-reduce until a watchdog (NCCL's, after 10 minutes by default) kills the job."""
    _before_reduction(trainer, _hang_before_all_reduce)


def crash_rank(trainer: Trainer) -> None:
    """crash-rank: one rank is killed (SIGKILL) at step --fault-step, as the kernel's OOM killer or a node's failing
    hardware does: no exception, no exit handler, its peers left waiting for it."""
    _before_reduction(trainer, lambda: os.kill(os.getpid(), signal.SIGKILL))


class InjectedFailure(RuntimeError):
    """What the raise-rank fault raises."""


def _raise() -> None:
    raise InjectedFailure("raise-rank: the failure --fault raise-rank injects")


def raise_rank(trainer: Trainer) -> None:
    """raise-rank: one rank raises at step --fault-step (a bad sample, a shape error on one shard) and exits, while
    its peers wait for it in the all-reduce."""
    _before_reduction(trainer, _raise)


def skip_collective(trainer: Trainer) -> None:
    """skip-collective: one rank leaves out its data-parallel all-reduces of step --fault-step (the gradients' and the
    loss's), as a rank does that skips a step on a condition only it sees (a non-finite loss of its own, a batch it
    filters out). Collectives pair by their order on a group, not by step: its next all-reduces meet its peers' of
    the step it skipped, the job runs on with that rank's gradients a step apart from its peers', and its calls on
    the group stay one step's worth behind theirs until its peers wait at the end in an all-reduce it never makes."""
    cfg = trainer.cfg
    if trainer.grid.rank != cfg.faulty_rank:
        return
    reduce_gradients, reduce_loss = trainer.reduce_gradients, trainer.reduce_loss

    def gradients_unless_skipped(params: list[torch.nn.Parameter], observe: Callable | None = None) -> None:
        if trainer.step + 1 != cfg.fault_step:
            reduce_gradients(params, observe=observe)

    def loss_unless_skipped(loss: torch.Tensor) -> torch.Tensor:  # after the step's count went up
        return loss if trainer.step == cfg.fault_step else reduce_loss(loss)

    trainer.reduce_gradients, trainer.reduce_loss = gradients_unless_skipped, loss_unless_skipped


def _before_reduction(trainer: Trainer, strike: Callable[[], None]) -> None:
    """Call `strike` on the fault's rank just before the DP all-reduce of step --fault-step."""
    cfg = trainer.cfg
    if trainer.grid.rank != cfg.faulty_rank:
        return
    reduce = trainer.reduce_gradients

    def reduce_or_strike(params: list[torch.nn.Parameter], observe: Callable | None = None) -> None:
        if trainer.step + 1 == cfg.fault_step:
            strike()
        reduce(params, observe=observe)

    trainer.reduce_gradients = reduce_or_strike


#: Each fault of `gpuwatch.trainer.config.FAULTS` and what injects it, applied in this order (shared-pp-dp-group
#: first: it is collective, and every rank gets there before any other fault can differ between them).
INJECTORS: dict[str, Callable[[Trainer], None]] = {
    "shared-pp-dp-group": shared_group,
    "desync": desync,
    "fp16-no-scaler": overflow_fp16,
    "fragment-memory": fragment_memory,
    "duplicate-shards": duplicate_shards,
    "slow-rank": slow_rank,
    "lr-explode": explode_learning_rate,
    "hang-rank": hang_rank,
    "crash-rank": crash_rank,
    "raise-rank": raise_rank,
    "skip-collective": skip_collective,
}


def apply(trainer: Trainer) -> None:
    """Inject the run's faults (`cfg.faults`) into a trainer built without them: the one place where they enter.
    Every rank calls it; rank 0 says which faults it injects."""
    names = trainer.cfg.faults
    for name, inject in INJECTORS.items():
        if name in names:
            inject(trainer)
    if names and trainer.grid.rank == 0:
        print(f"FAULTS INJECTED: {', '.join(names)}", flush=True)
