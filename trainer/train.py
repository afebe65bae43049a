"""The training loop. One optimizer step, in order:

    1. forward and backward through the pipeline schedule, micro-batch by micro-batch
       (the tensor-parallel collectives happen inside the layers)
    2. average the gradients over the DP group (bucketed all-reduce)
    3. unscale (fp16), take the global gradient norm over TP and PP, clip
    4. AdamW (skipped when the fp16 scaler saw inf/NaN), then the learning-rate schedule

Each phase is a separate call in Trainer.train_step, where the hooks (`gpuwatch.trainer.hooks`) time
and inspect it: the step and its data / compute / optimizer phases, every collective (through the
comm layer), the pipeline's busy and idle time, and each gradient before and after its DP reduction.

Fault switches (`--fault`) reproduce failures on purpose: `gpuwatch.trainer.faults.apply` changes a built
Trainer's parts, once, before the first step; nothing here knows of them.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TextIO

import torch
import torch._dynamo  # torch.optim imports it lazily (~1.5 s): pay that once, before the fork, not per rank
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gpuwatch.plan.model import from_reference
from gpuwatch.trainer import checkpoint, faults
from gpuwatch.trainer.config import ConfigError, TrainConfig
from gpuwatch.trainer.data import DistributedSampler, SyntheticCorpus
from gpuwatch.trainer.hooks import (
    OFF,
    SIGNALS,
    GradientSimilarity,
    Layout,
    Monitor,
    Step,
    transformer_flops_per_token,
)
from gpuwatch.trainer.hooks.off import Off
from gpuwatch.trainer.model import GPTStage
from gpuwatch.trainer.parallel import comm
from gpuwatch.trainer.parallel.data import all_reduce_gradients, clip_gradients, global_grad_norm, grad_of
from gpuwatch.trainer.parallel.groups import Grid, build_grid, layout
from gpuwatch.trainer.parallel.pipeline import MicroBatch, Pipeline
from gpuwatch.trainer.parallel.tensor import is_tp_split
from gpuwatch.trainer.precision import DynamicLossScaler, autocast

MIN_LR_RATIO = 0.1  # cosine decay ends at 10 % of --lr


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float | None  # mean over the global batch; known on last-stage ranks only
    grad_norm: float  # before clipping
    lr: float
    loss_scale: float
    skipped: bool
    step_time_s: float


def warmup_cosine(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear warm-up to 1, then cosine decay to MIN_LR_RATIO at `total_steps`."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


class Trainer:
    """Everything one rank holds: its model slice, optimizer, schedule, data position."""

    def __init__(self, cfg: TrainConfig, grid: Grid, device: torch.device) -> None:
        self.cfg, self.grid, self.device = cfg, grid, device
        m = cfg.model
        self.model = GPTStage(m, grid, cfg.seed).to(device)
        self.params = list(self.model.parameters())
        self.pipeline = Pipeline(
            self.model, grid, cfg.schedule, (cfg.micro_batch_size, m.seq_len, m.hidden), device,
            partial(autocast, device, cfg.precision),
        )
        self.optimizer = torch.optim.AdamW(
            [  # as nanoGPT: no weight decay on 1-D parameters (biases, norm gains)
                {"params": [p for p in self.params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=cfg.lr, betas=(0.9, 0.95),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_cosine(cfg.warmup_steps, cfg.steps))
        self.scaler = DynamicLossScaler(enabled=cfg.precision == "fp16")
        self.corpus = SyntheticCorpus(m.vocab_size, m.seq_len, cfg.seed)
        self.sampler = DistributedSampler(cfg.corpus_size, cfg.global_batch, grid.dp_rank, grid.dp, cfg.seed)
        #: the DP gradient reduction: reduce_gradients(params, observe=None), as `all_reduce_gradients`
        self.reduce_gradients: Callable[..., None] = partial(all_reduce_gradients, grid=grid,
                                                             bucket_bytes=cfg.bucket_bytes)
        #: the DP sum of the last stage's loss, for the global batch's: reduce_loss(tensor) -> tensor
        self.reduce_loss: Callable[[torch.Tensor], torch.Tensor] = partial(comm.all_reduce, group=grid.dp_group)
        #: each kind of traffic's group ("tp", "pp", "dp"): this rank's peers in it and the handle it goes over
        handles = {"tp": grid.tp_group, "pp": grid.pp_group, "dp": grid.dp_group}
        self.traffic_groups: dict[str, tuple[tuple[int, ...], ProcessGroup]] = {
            kind: (next(tuple(g) for g in members if grid.rank in g), handles[kind])
            for kind, members in layout(cfg.tp, cfg.pp, cfg.dp).items()}
        self.step = 0
        self.monitor: Monitor | None = None  # `instrument` attaches one
        self.tokens_per_step = cfg.micro_batch_size * cfg.micro_batches * m.seq_len  # this DP replica's

    def next_micro_batches(self) -> list[MicroBatch]:
        inputs, targets = self.corpus.batch(self.sampler.next_indices())
        m = self.cfg.micro_batches
        return [
            MicroBatch(i.to(self.device), t.to(self.device))
            for i, t in zip(inputs.chunk(m), targets.chunk(m), strict=True)
        ]

    def train_step(self) -> StepResult:
        start = time.perf_counter()
        with self._measured_step() as step:
            with step.data():
                batches = self.next_micro_batches()
            self.optimizer.zero_grad(set_to_none=True)
            with step.compute():
                clock = step.pipeline_clock(self.grid.pp_group, self.cfg.micro_batches)
                losses = self.pipeline.run(batches, self.scaler.scale, clock)
            self._reduce_gradients(step.similarity)
            self.scaler.unscale(self.params)
            grad_norm = global_grad_norm(self.params, self.grid)
            clip_gradients(self.params, self.cfg.clip_grad, grad_norm)
            lr, loss_scale = self._lr(), self.scaler.scale
            take_step = self.scaler.update(grads_finite=math.isfinite(grad_norm))
            with step.optimizer():
                if take_step:
                    self.optimizer.step()
                self.scheduler.step()
            self.step += 1
            loss = self._global_batch_loss(losses)
            step.report(loss=loss, grad_norm=grad_norm, lr=lr, loss_scale=loss_scale if self.scaler.enabled else None)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the step's time includes its queued kernels
        return StepResult(
            step=self.step, loss=loss, grad_norm=grad_norm, lr=lr, loss_scale=loss_scale,
            skipped=not take_step, step_time_s=time.perf_counter() - start,
        )

    def _lr(self) -> float:
        lr = self.scheduler.get_last_lr()[0]
        assert not isinstance(lr, torch.Tensor), "the optimizer's lr is a float, never a tensor"
        return lr

    def _global_batch_loss(self, losses: list[torch.Tensor]) -> float | None:
        """The mean of the micro-batch losses over the DP replicas (last stage only)."""
        if not self.grid.is_last_stage:
            return None
        loss = self.reduce_loss(torch.stack(losses).mean())
        return loss.item() / self.grid.dp

    def _measured_step(self) -> Step | Off:
        if self.monitor is None:
            return OFF
        return self.monitor.step(tokens=self.tokens_per_step, number=self.step + 1)

    def _reduce_gradients(self, similarity: GradientSimilarity | None) -> None:
        """The DP all-reduce, feeding the gradient similarity (on its steps) each bucket's local and DP-mean
        gradient. The similarity is of the whole replica, summed over its TP and PP shards, so a replicated
        parameter counts on TP rank 0 only; the shards' sums are added up at once, while the ranks are in
        step for the global norm's all-reduces anyway."""
        if similarity is None:
            self.reduce_gradients(self.params)
            return

        def observe(bucket: list[torch.nn.Parameter], mean: torch.Tensor) -> None:
            kept = [is_tp_split(p) or self.grid.tp_rank == 0 for p in bucket]
            if all(kept):
                similarity.observe(torch.cat([grad_of(p).reshape(-1) for p in bucket]), mean)
            elif any(kept):
                means = mean.split([grad_of(p).numel() for p in bucket])
                similarity.observe(torch.cat([grad_of(p).reshape(-1) for p, k in zip(bucket, kept, strict=True) if k]),
                                   torch.cat([m for m, k in zip(means, kept, strict=True) if k]))

        self.reduce_gradients(self.params, observe=observe)
        similarity.reduce()

    def state_dict(self) -> dict:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "step": self.step,
            "rng": torch.get_rng_state(),
        }
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.sampler.load_state_dict(state["sampler"])
        self.step = state["step"]
        torch.set_rng_state(state["rng"])
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)


def model_flops_per_token(trainer: Trainer) -> float:
    """Training FLOPs per token of the whole model, 6·N + 12·L·h·s (gpuwatch.trainer.hooks.flops). N counts
    every parameter outside the embeddings (lookups, not matmuls): split ones on every TP rank, replicated
    ones once, over all stages."""
    grid = trainer.grid
    local = sum(p.numel() for name, p in trainer.model.named_parameters()
                if not name.startswith("embed.") and (is_tp_split(p) or grid.tp_rank == 0))
    count = torch.tensor(float(local), dtype=torch.float64, device=trainer.device)
    comm.all_reduce(comm.all_reduce(count, grid.tp_group), grid.pp_group)
    m = trainer.cfg.model
    return transformer_flops_per_token(int(count.item()), m.layers, m.hidden, m.seq_len)


def instrument(trainer: Trainer, signals: Iterable[str] = SIGNALS) -> Monitor:
    """Attach the hooks to a trainer: a Monitor sending to the node agent, timing the comm layer too.
    Every rank must call it (it agrees on the job id and counts the model's parameters with its peers)."""
    cfg, grid = trainer.cfg, trainer.grid
    groups = {kind: ranks for kind, (ranks, _) in trainer.traffic_groups.items()}
    place = Layout(
        rank=grid.rank, world_size=cfg.world_size, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        tp_size=grid.tp, pp_size=grid.pp, dp_size=grid.dp,
        tp_rank=grid.tp_rank, pp_stage=grid.pp_rank, dp_rank=grid.dp_rank,
        schedule=cfg.schedule, micro_batches=cfg.micro_batches, precision=cfg.precision, process_groups=groups,
        backends={kind: dist.get_backend(handle) for kind, (_, handle) in trainer.traffic_groups.items()},
    )
    monitor = Monitor(
        trainer.model, layout=place, job=cfg.job, device=trainer.device,
        socket_path=cfg.telemetry_socket, run_log=cfg.run_log,
        grad_similarity_every=cfg.grad_similarity_every, checksum_every=cfg.checksum_every,
        memory_every=cfg.memory_every,
        flops_per_token=model_flops_per_token(trainer) / (grid.tp * grid.pp),  # this rank's share
        shard_groups=(grid.tp_group, grid.pp_group), signals=signals,
        # the model's shape and batch too: diagnosis predicts the step from them (PLAN rules, gpuwatch.plan)
        hello={"faults": list(cfg.faults), "model": from_reference(cfg.model).as_record().as_dict(),
               "global_batch": cfg.global_batch, "seq_len": cfg.model.seq_len},
    )
    trainer.monitor = monitor
    comm.set_timer(monitor.collective)
    return monitor


def train(device: torch.device, cfg: TrainConfig) -> list[StepResult]:
    """One rank's whole run; the launcher (or torchrun) calls it once the process group exists.

    Rank 0 of the last stage (tp 0, dp 0) prints each step and writes the JSONL log. With
    `cfg.telemetry` every rank reports every step to the node agent.
    """
    if cfg.needs_cuda and device.type != "cuda":
        raise ConfigError(f"--precision fp16 needs CUDA, and this rank runs on {device.type}; use bf16")
    grid = build_grid(cfg.tp, cfg.pp, cfg.dp)
    trainer = Trainer(cfg, grid, device)
    faults.apply(trainer)
    reporter = grid.is_last_stage and grid.tp_rank == 0 and grid.dp_rank == 0
    if grid.rank == 0:
        print(
            f"{cfg.world_size} ranks: tp {cfg.tp} × pp {cfg.pp} × dp {cfg.dp} on {device.type} "
            f"({dist.get_backend()}), {cfg.schedule} over {cfg.micro_batches} micro-batches of "
            f"{cfg.micro_batch_size} sequences, global batch {cfg.global_batch}, {cfg.precision}",
            flush=True,
        )
    # TrainConfig.validate requires a checkpoint_dir with resume
    resumed = cfg.resume and cfg.checkpoint_dir is not None and checkpoint.load_latest(
        trainer, Path(cfg.checkpoint_dir), grid)
    if grid.rank == 0 and cfg.resume:
        print(f"resumed from step {trainer.step}" if resumed else f"no checkpoint in {cfg.checkpoint_dir}: "
              "starting from step 0", flush=True)
    monitor = instrument(trainer) if cfg.telemetry else None
    results = []
    with open(cfg.log_jsonl, "a" if resumed else "w") if reporter and cfg.log_jsonl else nullcontext() as log:
        while trainer.step < cfg.steps:
            result = trainer.train_step()
            results.append(result)
            if reporter:
                _report(result, cfg.steps, log)
            every = cfg.checkpoint_every and trainer.step % cfg.checkpoint_every == 0
            if cfg.checkpoint_dir and (every or trainer.step == cfg.steps):
                checkpoint.save(trainer, Path(cfg.checkpoint_dir), grid)
    if monitor is not None:
        comm.set_timer(None)
        monitor.close()
    return results


def _report(result: StepResult, total_steps: int, log: TextIO | None) -> None:
    skipped = "  (skipped: inf/NaN gradients)" if result.skipped else ""
    print(
        f"step {result.step:>5}/{total_steps}  loss {result.loss:.4f}  grad-norm {result.grad_norm:.3f}  "
        f"lr {result.lr:.2e}  {result.step_time_s * 1000:.1f} ms{skipped}",
        file=sys.stdout, flush=True,
    )
    if log is not None:
        log.write(json.dumps(asdict(result)) + "\n")
        log.flush()
