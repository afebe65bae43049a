"""Bytes each rank hands its collectives per step, by process group, and their time on the link they cross.

Volumes (Narayanan et al. 2021, arXiv:2104.04473, §3.2 and §4.1; Shoeybi et al. 2019, §3):
* TP: per layer and micro-batch two all-reduces of the s·b·h activations forward (after attention and after the
  MLP) and two of their gradients backward (before them), Megatron-style; with sequence parallelism an all-gather
  and a reduce-scatter replace each all-reduce, the same bus volume. Full recomputation repeats the forward two.
  The vocabulary-parallel embedding all-reduces its output forward, the head its input's gradient backward, and the
  vocabulary-parallel cross-entropy exchanges three s·b fp32 figures per token (its maximum, sum of exponentials
  and target logit).
* PP: per micro-batch, s·b·h activations forward and their gradient backward over each boundary between model
  chunks on different ranks: a stage sends to and receives from each neighbour it has, once per chunk it holds —
  v times as much under interleaved 1F1B (Narayanan et al. 2021, §2.2.2: "the amount of communication also
  increases by v"); ZB-V's turn at the last rank stays on that rank (`run.Layout.chunk_stage`). Where TP splits
  the activation, each TP rank sends only its 1/t: with sequence parallelism the tensor between stages is already
  split along the sequence (Megatron-LM sends it so); without it, where the stages are on different nodes, the
  scatter/gather of Narayanan et al. §4.1 (``Run.pp_scatter_gather``) sends 1/t from each of the t TP ranks, each
  over its own NIC — assuming one NIC per GPU, as the presets' DGX systems have — and the receiving stage
  all-gathers the slices over NVLink (that all-gather's bytes are counted on TP, its time in the pipeline's).
  Tied embeddings on separate stages add the embedding gradient's all-reduce between the first and the last stage
  (Megatron-LM's embedding group), counted here; none where ZB-V puts both on one rank.
* CP (ring attention, Liu et al. 2023, arXiv:2310.01889; Megatron-LM's context parallelism): per layer and
  micro-batch each rank receives the other cp − 1 ranks' key and value chunks forward, and again with their
  gradients backward (the keys and values, then dK and dV passed on: twice the forward's), 3 passes' worth, 4 with
  full recomputation; a chunk is the rank's s/cp tokens × the keys' and values' width (/t with TP). Sends to the ring's
  next rank, overlapped with the attention over the chunk before (`planner.predict` shows what is not).
* DP: the gradients of the stage's parameters, all-reduced once per step over the DP and CP ranks (with ZeRO-1,
  reduce-scattered, and the updated weights all-gathered: the same bus volume for 16-bit weights and 16-bit
  gradients).
* Per step, the gradient norm's one fp32 scalar over the TP and the PP group, and the loss's over DP on the last
  stage.

Bytes are the sizes of the tensors handed to each call (what gpuwatch's hooks count: each transfer's sends and
receives). Times use nccl-tests' bus-bandwidth convention (https://github.com/NVIDIA/nccl-tests/blob/master/doc/
PERFORMANCE.md): an all-reduce of S bytes over n ranks moves 2(n − 1)/n · S per rank, an all-gather or
reduce-scatter (n − 1)/n · S, a send S.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gpuwatch.plan.gpus import Cluster
from gpuwatch.plan.model import ModelShape
from gpuwatch.plan.run import Layout, Run

#: The gradient norm's and the loss's one fp32 value; the cross-entropy's three fp32 values per token.
SCALAR_BYTES = 4
CROSS_ENTROPY_BYTES = 3 * 4
#: The process groups traffic is counted on, in the order the reports list them.
GROUPS = ("tp", "cp", "pp", "dp")


@dataclass(frozen=True)
class Traffic:
    """One rank's bytes per step on each group, and the seconds they take on their links (not yet net of any
    overlap: the planner decides what shows)."""

    tp_bytes: int
    cp_bytes: int
    pp_bytes: int
    dp_bytes: int
    tp_seconds: float
    cp_seconds: float
    pp_seconds: float
    dp_seconds: float

    def bytes_by_group(self) -> dict[str, int]:
        return {"tp": self.tp_bytes, "cp": self.cp_bytes, "pp": self.pp_bytes, "dp": self.dp_bytes}

    def seconds_by_group(self) -> dict[str, float]:
        return {"tp": self.tp_seconds, "cp": self.cp_seconds, "pp": self.pp_seconds, "dp": self.dp_seconds}


def ring_factor(ranks: int) -> float:
    """What each rank moves of an all-reduce's buffer, on a ring: 2(n − 1)/n."""
    return 2 * (ranks - 1) / ranks


def spans(layout: Layout) -> dict[str, int]:
    """How many consecutive ranks each group's members lie within (TP fastest, then CP, then DP, then PP); the
    gradients' reduction spans the DP and CP ranks together."""
    t, c = layout.tp, layout.cp
    return {"tp": t, "cp": t * (c - 1) + 1, "dp": t * (c * layout.dp - 1) + 1,
            "pp": t * c * layout.dp * (layout.pp - 1) + 1}


def kv_chunk_bytes(shape: ModelShape, run: Run, layout: Layout) -> float:
    """One rank's keys and values of a micro-batch on one layer: what it passes around the context-parallel ring."""
    batch = layout.micro_batch_size(run.global_batch)
    return 2 * shape.kv_width * batch * layout.tokens(run.seq_len) / layout.tp * run.numerics.activation


def context_parallel_bytes(shape: ModelShape, run: Run, layout: Layout, layers: int) -> float:
    """Key and value bytes one rank receives around the context-parallel ring per micro-batch (module docstring)."""
    if layout.cp == 1:
        return 0.0
    passes = 4 if layout.recompute == "full" else 3
    return layers * passes * (layout.cp - 1) * kv_chunk_bytes(shape, run, layout)


def stage_traffic(shape: ModelShape, run: Run, layout: Layout, cluster: Cluster, stage: int, layers: int,
                  parameters: int) -> Traffic:
    """Stage ``stage``'s rank: ``layers`` layers and ``parameters`` parameters on it."""
    n = run.numerics
    batch = layout.micro_batch_size(run.global_batch)
    m, t, p, d = layout.micro_batches, layout.tp, layout.pp, layout.replicas
    first, last = stage == 0, stage == layout.last_stage
    tokens = layout.tokens(run.seq_len)
    sbh = tokens * batch * shape.hidden
    link = {group: cluster.link(span) for group, span in spans(layout).items()}

    tp_bytes = tp_seconds = 0.0
    if t > 1:
        # each call's size and how many of it a micro-batch makes (the layers' calls come in two sizes)
        calls = [(sbh * n.activation, 2 * layers * (2 if layout.recompute == "full" else 1)),
                 (sbh * n.residual, 2 * layers)]
        if first:
            calls.append((sbh * n.weight, 1))
        if last:
            calls += [(sbh * n.residual, 1), (CROSS_ENTROPY_BYTES * tokens * batch, 1)]
        tp_bytes = m * sum(size * count for size, count in calls) + SCALAR_BYTES
        tp_seconds = m * sum(count * all_reduce_seconds(cluster, link["tp"], size, t) for size, count in calls)

    ring = context_parallel_bytes(shape, run, layout, layers)
    cp_bytes = m * ring
    cp_seconds = cp_bytes / cluster.bus_bandwidth(link["cp"], int(kv_chunk_bytes(shape, run, layout))) if ring else 0.0

    pp_bytes = pp_seconds = 0.0
    if p > 1:
        activation = sbh * n.residual
        transfers = boundary_transfers(layout, stage)
        gather = t > 1 and not run.sequence_parallel and run.pp_scatter_gather and link["pp"] == "ib"
        send = activation / t if t > 1 and (run.sequence_parallel or gather) else activation
        pp_bytes = m * transfers * send + SCALAR_BYTES
        pp_seconds = m * transfers * send / cluster.bus_bandwidth(link["pp"], int(send))
        if gather:  # each received slice all-gathered over the TP group's NVLink
            tp_bytes += m * transfers / 2 * send
            pp_seconds += m * transfers / 2 * (t - 1) * send / cluster.bus_bandwidth(link["tp"], int(activation))
        if shape.tied_embeddings and (first or last) and layout.last_stage != 0:
            embedding = shape.vocab_per_rank(t) * shape.hidden * n.grad
            pp_bytes += embedding
            pp_seconds += all_reduce_seconds(cluster, link["pp"], embedding, 2)

    dp_bytes = dp_seconds = 0.0
    if d > 1:
        gradients = parameters * n.grad
        if layout.zero1:
            dp_bytes = gradients + parameters * n.weight
            dp_seconds = (d - 1) / d * (gradients + parameters * n.weight) / cluster.bus_bandwidth(
                link["dp"], gradients)
        else:
            dp_bytes = gradients
            dp_seconds = all_reduce_seconds(cluster, link["dp"], gradients, d)
        dp_bytes += SCALAR_BYTES if last else 0
    return Traffic(int(tp_bytes), int(cp_bytes), int(pp_bytes), int(dp_bytes), tp_seconds, cp_seconds, pp_seconds,
                   dp_seconds)


def boundary_transfers(layout: Layout, stage: int) -> int:
    """Sends and receives of one micro-batch's activation or gradient by the rank of ``stage``: for each of its
    chunks, the forward send and backward receive to the next chunk and the forward receive and backward send from
    the previous one, where that chunk is on another rank."""
    return _boundary_transfers(Layout(1, layout.pp, 1, schedule=layout.schedule, virtual_stages=layout.virtual_stages),
                               stage)


@functools.lru_cache(maxsize=4096)
def _boundary_transfers(layout: Layout, stage: int) -> int:
    """``boundary_transfers`` of a pipeline's shape alone (its stages, schedule and chunks), which is all it reads:
    counted once per shape, not per layout (it walks every chunk of the pipeline)."""
    total = layout.pp * layout.chunks
    count = 0
    for chunk in range(total):
        if layout.chunk_stage(chunk) != stage:
            continue
        count += 2 * (chunk + 1 < total and layout.chunk_stage(chunk + 1) != stage)
        count += 2 * (chunk > 0 and layout.chunk_stage(chunk - 1) != stage)
    return count


def all_reduce_seconds(cluster: Cluster, link: str, nbytes: float, ranks: int) -> float:
    return ring_factor(ranks) * nbytes / cluster.bus_bandwidth(link, int(nbytes))
