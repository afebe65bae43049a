"""A user's hybrid-parallel job built only from PyTorch's own parts, as torchtitan writes one, knowing nothing of
gpuwatch (no import of it): a tiny Llama-style transformer (an embedding, blocks of attention and a SwiGLU feed
forward with their norms, a norm and a head over the vocabulary; hidden 32) trained with AdamW on synthetic token
sequences, 2 to 8 CPU ranks with gloo.

    gpuwatch run -- torchrun --standalone --nproc-per-node 2 tests/workloads/hybrid_job.py --layout tp --steps 12

``--layout`` says how the model is split (the world size must be the layout's):

* ``tp`` (2 ranks): ``init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))`` and ``parallelize_module`` with the
  plan of pytorch/examples' distributed/tensor_parallelism (fsdp_tp_example.py): the embedding row-parallel into a
  sequence shard, ``SequenceParallel`` norms, ``PrepareModuleInput`` gathering the sequence before attention and
  the feed forward, their input projections ``ColwiseParallel``, their output projections ``RowwiseParallel`` back
  into a sequence shard, the head column-parallel into replicated logits;
* ``fsdp_tp`` (4 ranks): a (2, 2) mesh ``("dp", "tp")``, TP as above on "tp", then FSDP2 ``fully_shard`` over
  ``mesh["dp"]``, each block, then the root (torchtitan's ``apply_fsdp``);
* ``pp_gpipe``, ``pp_1f1b`` (2 ranks): ``torch.distributed.pipelining``: the model split by hand into 2 stages
  (torchtitan's ``pipeline_module_split``: a copy of the whole model per stage, with the layers and ends that are not
  the stage's deleted), a ``PipelineStage`` each, ``ScheduleGPipe`` / ``Schedule1F1B`` over 4 micro-batches with a
  ``loss_fn``;
* ``pp_interleaved`` (2 ranks): 2 virtual stages per rank (4 stages; rank r holds stages r and r + 2, torchtitan's
  "loop" style), ``ScheduleInterleaved1F1B``;
* ``pp_tp_dp`` (8 ranks): a (2, 2, 2) mesh ``("pp", "dp", "tp")``: each stage split as for ``pp_1f1b``, TP on "tp",
  FSDP2 over "dp", ``Schedule1F1B`` over "pp".

Data: ``framework_job.Tokens`` from a DataLoader with a DistributedSampler over the data-parallel replicas (the ranks
of one replica, its tensor-parallel peers and pipeline stages, read the same batches), 8 sequences a step. The loss is
logged as torchtitan logs it: ``loss.item()`` of the one backward per step without a pipeline; with one, the last
stage's mean of the micro-batch losses ``schedule.step(..., target=..., losses=losses)`` collected.

Rank 0 ends by printing its training loop's wall time and its training thread's CPU time per optimizer step
(``{'train_runtime': ..., 'train_thread_cpu_per_step': ...}``, read by benchmarks/framework_cost.py).

``--out DIR``: each rank writes DIR/rank-R.json (framework_job's results file): ``losses`` (per optimizer step, as
logged above, ``float.hex``; none on a pipeline stage that is not the last), ``microbatch_losses`` (per step, the
last stage's micro-batch losses, ``float.hex``), ``params`` (a SHA-256 of the rank's parameters: its TP and FSDP
shards, of its own stages), and ``mesh`` ({dimension: size}).

``--fault`` (on ``--fault-rank R``, default the last rank; ``--delay D`` default 0.2 s; ``--fault-step N`` default
4):

* ``straggler``: rank R sleeps D per optimizer step inside its model's forward (training mode only), spread evenly
  over the forwards of its step (each micro-batch of each of its stages);
* ``slow-stage`` (pipeline layouts): ``--fault-rank`` is the *pipeline rank* here (the stage index, for a schedule
  of one stage per rank; default the last): every rank of that pipeline rank sleeps D per optimizer step in its stage
  modules' forwards, spread over the micro-batches;
* ``hang``: at step N rank R stops for good (``stop_forever``, a sleep in a loop) inside its forward: without a
  pipeline, in a forward pre-hook of the first block's row-parallel ``feed_forward.w2``, just before the collective
  that reduces its output, so its tensor-parallel peer waits in that collective; with one, in its first stage's
  forward of the step's first micro-batch, before the activations are sent on;
* ``hang-dp`` (``fsdp_tp``): at step N rank R stops for good between two optimizer steps, outside the model, so its
  data-parallel peer waits in FSDP2's all-gather of the next forward (and the others behind it).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from clean_exit import run_then_exit
from framework_job import VOCAB, Tokens, next_token_loss, parameters_hash
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, DistributedSampler

HIDDEN, HEADS, LAYERS = 32, 4, 4
#: Sequences per optimizer step (per data-parallel replica), split into MICRO_BATCHES by a pipeline schedule.
BATCH, MICRO_BATCHES = 8, 4
FAULTS = ("none", "straggler", "slow-stage", "hang", "hang-dp")


@dataclass(frozen=True)
class Layout:
    """A ``--layout``: its mesh (dimension names and sizes, outermost first), its schedule, stages per rank."""

    mesh: tuple[tuple[str, int], ...]
    schedule: type | None = None
    virtual_stages: int = 1

    @property
    def world(self) -> int:
        return math.prod(size for _, size in self.mesh)

    def size(self, dimension: str) -> int:
        return dict(self.mesh).get(dimension, 1)


LAYOUTS = {
    "tp": Layout((("tp", 2),)),
    "fsdp_tp": Layout((("dp", 2), ("tp", 2))),
    "pp_gpipe": Layout((("pp", 2),), ScheduleGPipe),
    "pp_1f1b": Layout((("pp", 2),), Schedule1F1B),
    "pp_interleaved": Layout((("pp", 2),), ScheduleInterleaved1F1B, virtual_stages=2),
    "pp_tp_dp": Layout((("pp", 2), ("dp", 2), ("tp", 2)), Schedule1F1B),
}


# -- the model: torchtitan's Llama, tiny ----------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, sequence, _ = x.shape
        # -1 heads: under tensor parallelism a rank's projections hold its share of the heads
        q, k, v = (w(x).view(batch, sequence, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, sequence, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False), nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.w2 = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(HIDDEN), Attention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(HIDDEN), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """The model, or one pipeline stage of it: a stage keeps its own layers (a ModuleDict, so that their names stay
    those of the whole model) and has None for the ends it does not hold. In training mode its forward first sleeps
    ``delay`` seconds (the ``straggler`` and ``slow-stage`` faults: inside the model's forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(HIDDEN)
        self.output: nn.Linear | None = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.delay = 0.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.training and self.delay:
            time.sleep(self.delay)
        h = self.tok_embeddings(h) if self.tok_embeddings is not None else h
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def split_stage(model: Transformer, stage: int, stages: int) -> Transformer:
    """Pipeline stage ``stage`` of ``stages``: a copy of the whole model keeping its share of the layers, the
    embedding on the first stage only, the norm and head on the last only (torchtitan's manual split)."""
    module = copy.deepcopy(model)
    per_stage = LAYERS // stages
    keep = {str(i) for i in range(stage * per_stage, (stage + 1) * per_stage)}
    for name in list(module.layers):
        if name not in keep:
            del module.layers[name]
    if stage != 0:
        module.tok_embeddings = None
    if stage != stages - 1:
        module.norm = module.output = None
    return module


def tensor_parallel(model: Transformer, mesh: DeviceMesh) -> None:
    """pytorch/examples' sequence-parallel Llama plan, for the ends this model (or stage) holds."""
    ends: dict[str, object] = {}
    if model.tok_embeddings is not None:
        ends["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.output is not None:
        ends["norm"] = SequenceParallel()
        ends["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if ends:
        parallelize_module(model, mesh, ends)
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def data_parallel(model: Transformer, mesh: DeviceMesh) -> None:
    """FSDP2 over the data-parallel dimension: each block, then the root (torchtitan's apply_fsdp)."""
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


# -- the faults -----------------------------------------------------------------------------------------------------

def stop_forever() -> None:
    """Where a hung rank stands, for good: nothing on this rank will ever return."""
    while True:
        time.sleep(1)


class Fault:
    """The fault planted on this rank (``none`` where it is not planted). ``step`` is the optimizer step running."""

    def __init__(self, args: argparse.Namespace, rank: int, pp_rank: int, layout: Layout) -> None:
        if args.fault == "slow-stage":
            target = layout.size("pp") - 1 if args.fault_rank is None else args.fault_rank
            planted = pp_rank == target
        else:
            planted = rank == (layout.world - 1 if args.fault_rank is None else args.fault_rank)
        self.name = args.fault if planted else "none"
        self.delay, self.fault_step = args.delay, args.fault_step
        self.step = 0

    def forward_delay(self, forwards_per_step: int) -> float:
        """Seconds each training forward of this rank's model sleeps (``straggler``, ``slow-stage``)."""
        return self.delay / forwards_per_step if self.name in ("straggler", "slow-stage") else 0.0

    def hang_before_collective(self, module: nn.Module, inputs: tuple) -> None:
        """A forward pre-hook: ``hang`` stops here at its step (hooked before a collective, or a stage's send)."""
        if self.name == "hang" and self.step == self.fault_step and module.training:
            stop_forever()

    def hang_between_steps(self) -> None:
        """``hang-dp`` stops here, after the optimizer step before its step."""
        if self.name == "hang-dp" and self.step == self.fault_step - 1:
            stop_forever()


# -- training -------------------------------------------------------------------------------------------------------

def mesh_of(layout: Layout) -> DeviceMesh:
    names, sizes = zip(*layout.mesh, strict=True)
    return init_device_mesh("cpu", sizes, mesh_dim_names=names)


def loader(mesh: DeviceMesh, layout: Layout, steps: int) -> DataLoader:
    """Each data-parallel replica its own batches; every rank of a replica the same ones."""
    replicas = layout.size("dp")
    replica = mesh.get_local_rank("dp") if replicas > 1 else 0
    data = Tokens(steps * BATCH * replicas)
    return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, replicas, replica, seed=0))


def build(layout: Layout, mesh: DeviceMesh, fault: Fault) -> list[tuple[int, Transformer]]:
    """This rank's (stage index, module) pairs, parallelized: one, the whole model, without a pipeline."""
    torch.manual_seed(0)  # the same whole model on every rank, before any split or shard
    model = Transformer()
    if layout.schedule is None:
        modules = [(0, model)]
    else:
        pp_rank, stages = mesh.get_local_rank("pp"), layout.size("pp") * layout.virtual_stages
        modules = [(index, split_stage(model, index, stages))
                   for index in range(pp_rank, stages, layout.size("pp"))]
    forwards = len(modules) * (MICRO_BATCHES if layout.schedule is not None else 1)
    for _, module in modules:
        module.delay = fault.forward_delay(forwards)
        if layout.size("tp") > 1:
            tensor_parallel(module, mesh["tp"])
        if layout.size("dp") > 1:
            data_parallel(module, mesh["dp"])
    first = modules[0][1]
    if layout.schedule is None:  # before the row-parallel w2's reduce-scatter; a stage: before its send
        first.layers["0"].feed_forward.w2.register_forward_pre_hook(fault.hang_before_collective)
    else:
        first.register_forward_pre_hook(fault.hang_before_collective)
    return modules


def train(args: argparse.Namespace) -> None:
    layout = LAYOUTS[args.layout]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != layout.world:
        raise SystemExit(f"--layout {args.layout} needs {layout.world} ranks, not {world}")
    if args.fault == "slow-stage" and layout.schedule is None:
        raise SystemExit(f"--fault slow-stage needs a pipeline layout, not {args.layout}")
    if args.fault == "hang-dp" and layout.size("dp") == 1:
        raise SystemExit(f"--fault hang-dp needs a data-parallel dimension, which {args.layout} has not")
    mesh = mesh_of(layout)
    pp_rank = mesh.get_local_rank("pp") if layout.size("pp") > 1 else 0
    fault = Fault(args, rank, pp_rank, layout)
    modules = build(layout, mesh, fault)
    parameters = [p for _, module in modules for p in module.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=1e-2)
    step_fn = plain_step(modules[0][1]) if layout.schedule is None else pipeline_step(layout, mesh, modules)

    losses: list[float] = []
    microbatch_losses: list[list[float]] = []
    for _, module in modules:
        module.train()
    started, thread_started = time.perf_counter(), time.thread_time()
    for fault.step, tokens in enumerate(loader(mesh, layout, args.steps), start=1):
        loss, parts = step_fn(tokens)
        optimizer.step()
        optimizer.zero_grad()
        if loss is not None:
            losses.append(loss)
            microbatch_losses.append(parts)
            if fault.step % 4 == 0:
                print(f"rank {rank} step {fault.step}: loss {loss:.4f}", flush=True)
        fault.hang_between_steps()
        if fault.step == args.steps:
            break
    if rank == 0:  # the training loop's own timing, for benchmarks/framework_cost.py
        print({"train_runtime": time.perf_counter() - started,
               "train_thread_cpu_per_step": (time.thread_time() - thread_started) / args.steps}, flush=True)
    write_results(args.out, rank, losses, microbatch_losses, parameters_hash(parameters), layout)
    dist.destroy_process_group()


StepFn = Callable[[torch.Tensor], tuple[float | None, list[float]]]


def plain_step(model: Transformer) -> StepFn:
    """One forward and backward of the whole batch: the loss is what backward() was called on."""

    def step(tokens: torch.Tensor) -> tuple[float | None, list[float]]:
        loss = next_token_loss(model(tokens), tokens)
        loss.backward()
        return loss.item(), []

    return step


def pipeline_step(layout: Layout, mesh: DeviceMesh, modules: list[tuple[int, Transformer]]) -> StepFn:
    """The schedule's step over MICRO_BATCHES: the first stage feeds the tokens, the last one the targets and
    collects each micro-batch's loss; the step's loss is their mean (torchtitan's), on the last stage only."""
    group, stages = mesh.get_group("pp"), layout.size("pp") * layout.virtual_stages
    pipeline = [PipelineStage(module, index, stages, torch.device("cpu"), group=group) for index, module in modules]
    if layout.virtual_stages > 1:
        schedule = layout.schedule(pipeline, n_microbatches=MICRO_BATCHES, loss_fn=next_token_loss)
    else:
        (stage,) = pipeline
        schedule = layout.schedule(stage, n_microbatches=MICRO_BATCHES, loss_fn=next_token_loss)
    first, last = modules[0][0] == 0, modules[-1][0] == stages - 1

    def step(tokens: torch.Tensor) -> tuple[float | None, list[float]]:
        collected: list[torch.Tensor] = []
        if first and last:
            schedule.step(tokens, target=tokens, losses=collected)
        elif first:
            schedule.step(tokens)
        elif last:
            schedule.step(target=tokens, losses=collected)
        else:
            schedule.step()
        if not last:
            return None, []
        return torch.mean(torch.stack(collected)).item(), [part.item() for part in collected]

    return step


def write_results(out: Path | None, rank: int, losses: list[float], microbatch_losses: list[list[float]],
                  params: str, layout: Layout) -> None:
    """DIR/rank-R.json (``--out``): framework_job's results file, with the micro-batch losses and the mesh."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    results = {"losses": [x.hex() for x in losses], "params": params,
               "microbatch_losses": [[x.hex() for x in parts] for parts in microbatch_losses],
               "mesh": dict(layout.mesh)}
    (out / f"rank-{rank}.json").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", choices=LAYOUTS, required=True)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps")
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-rank", type=int, default=None,
                        help="the rank the fault is planted on (slow-stage: the pipeline rank; default the last)")
    parser.add_argument("--fault-step", type=int, default=4, help="the step a hang stops at")
    parser.add_argument("--delay", type=float, default=0.2, help="seconds a straggler or slow stage adds per step")
    parser.add_argument("--out", type=Path, default=None, help="write each rank's losses and parameter hash here")
    train(parser.parse_args())


if __name__ == "__main__":
    run_then_exit(main)
