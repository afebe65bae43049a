"""The run being planned: its batch, sequence length and numerics, and the layouts' shape (`Layout`).

Bytes per parameter follow the mixed-precision Adam accounting of Rajbhandari et al. 2020 ("ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", arXiv:1910.02054, §3.1): 2 bytes of 16-bit weights,
2 of 16-bit gradients and 12 of optimizer state (an fp32 master copy, Adam's momentum and variance) — 16 bytes a
parameter, K = 12. Megatron-LM keeps fp32 main gradients instead of 16-bit ones (4 bytes: 18 a parameter,
megatron/training/theoretical_memory_usage.py), and that is the default here; fp32 training holds 4 + 4 + 8.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gpuwatch.plan.gpus import GIB

#: The pipeline schedules the planner searches (protocol.schema.PIPELINE_SCHEDULES' names): GPipe and 1F1B with one
#: model chunk per rank, interleaved 1F1B with ``Layout.virtual_stages`` chunks (Narayanan et al. 2021, §2.2.2:
#: Megatron-LM's --num-layers-per-virtual-pipeline-stage, torch's ScheduleInterleaved1F1B), and the zero-bubble V
#: schedule as PyTorch ships it (torch.distributed.pipelining.ScheduleZBVZeroBubble; Qi et al. 2024,
#: arXiv:2401.10241, §6): two chunks a rank in a V, the first rank holding the first and the last chunk.
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zbv_zero_bubble")
#: Schedules whose ranks hold several model chunks.
INTERLEAVED = "interleaved_1f1b"
ZBV = "zbv_zero_bubble"
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp16", "fp32")
#: The allowance for what no tensor formula counts: the CUDA context with cuBLAS' workspace (about 0.5 GiB under
#: PyTorch), NCCL's buffers (NCCL_BUFFSIZE, 4 MiB per channel and peer: up to 256 MiB per communicator of 32
#: channels × 2 ring peers, and a rank has 3-4 communicators), about 1.5 GiB together, rounded up to 2 ...
ALLOWANCE_BYTES = 2 * GIB
#: ... and the caching allocator's fragmentation, 5 % of the tensors (Megatron-LM's estimator adds 5 % for "buffer
#: for optimizer and miscellaneous temporaries").
ALLOWANCE_FRACTION = 0.05


class RunError(ValueError):
    """Run settings that cannot be planned: the message names the flag and what is wrong."""


@dataclass(frozen=True)
class Numerics:
    """Bytes per element: of each weight, gradient and optimizer state (per parameter), of the activations the
    layers keep and exchange (``activation``: matmul outputs), and of the residual stream between layers and stages
    and its gradient (``residual``). ``precision`` picks the GPU's peak FLOP/s."""

    precision: str
    weight: int
    grad: int
    optimizer: int
    activation: int
    residual: int

    @property
    def per_parameter(self) -> int:
        return self.weight + self.grad + self.optimizer


def numerics(precision: str, main_grads_fp32: bool = True, reference: bool = False) -> Numerics:
    """Mixed precision (bf16/fp16 weights, fp32 master copy and Adam states, fp32 main gradients unless
    ``main_grads_fp32`` is off: 18 or ZeRO's 16 bytes a parameter) or fp32 (4 + 4 + 8). The reference trainer
    (``reference``) keeps fp32 parameters, gradients and residual stream under autocast whatever the precision:
    only its matmul outputs are 16-bit (gpuwatch.trainer.precision)."""
    if precision not in PRECISIONS:
        raise RunError(f"--precision must be one of {', '.join(PRECISIONS)} (got {precision})")
    low = 4 if precision == "fp32" else 2
    if reference or precision == "fp32":
        return Numerics(precision, weight=4, grad=4, optimizer=8, activation=low, residual=4)
    return Numerics(precision, weight=2, grad=4 if main_grads_fp32 else 2, optimizer=12, activation=2, residual=2)


@dataclass(frozen=True)
class Run:
    """What is trained: ``global_batch`` sequences of ``seq_len`` tokens a step. ``sequence_parallel``: TP with
    Megatron-LM's sequence parallelism (Korthikanti et al. 2022). ``dp_overlap``: the DP gradient reduction
    overlaps the last micro-batch's backward pass, as DDP's buckets do (else it runs after it, as in the reference
    trainer). ``bucket_bytes``: the size of a gradient bucket (DDP's and the reference trainer's 25 MiB).
    ``flash_attention``: attention by a fused kernel that keeps no s × s scores and recomputes them in the backward
    pass (Dao et al. 2022, arXiv:2205.14135; PyTorch SDPA's default on current GPUs); off, the scores are kept
    (Korthikanti et al.'s 5as/h term). ``pp_scatter_gather``: pipeline sends between nodes split over the TP
    group's NICs and all-gathered over NVLink at the receiver (Narayanan et al. 2021, §4.1), assuming one NIC per
    GPU; off, the whole activation crosses one NIC (sequence parallelism splits the sends either way)."""

    global_batch: int
    seq_len: int
    numerics: Numerics
    sequence_parallel: bool = True
    dp_overlap: bool = False
    bucket_bytes: int = 25 * 2**20
    flash_attention: bool = True
    pp_scatter_gather: bool = True
    allowance_bytes: int = ALLOWANCE_BYTES
    allowance_fraction: float = ALLOWANCE_FRACTION

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.seq_len < 1:
            raise RunError(f"--global-batch and --seq-len must be at least 1 (got {self.global_batch}, "
                           f"{self.seq_len})")
        if self.allowance_bytes < 0 or self.allowance_fraction < 0 or self.bucket_bytes < 1:
            raise RunError("the memory allowance must not be negative, the bucket size at least 1 byte")


#: Context parallelism is searched only where each rank keeps at least this many tokens of a sequence: its ring
#: passes every key/value chunk to every rank, hidden behind the attention only while a chunk's attention (∝ its
#: tokens squared) outlasts the chunk's transfer (∝ its tokens); on H100s over InfiniBand at 50 GB/s a GPU that takes
#: a few thousand tokens (`comm.context_parallel_bytes`, `planner.predict`). Llama 3 used it only for its 128K-token
#: stage (Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783, §3.3.2).
MIN_CONTEXT_TOKENS = 4096


@dataclass(frozen=True)
class Layout:
    """One way to run: tp × cp × pp × dp ranks (ranks ordered TP fastest, then CP, then DP, then PP: Megatron-LM's
    order and the reference trainer's), ``micro_batches`` per step per DP replica, the pipeline ``schedule``,
    activation ``recompute`` and a sharded optimizer (``zero1``: ZeRO stage 1, Megatron's distributed optimizer,
    sharded over the DP and CP ranks, which hold the same parameters). ``virtual_stages``: model chunks per rank under
    interleaved 1F1B (v; 1 is plain 1F1B); the ZB-V schedule always has 2. ``cp``: context parallelism, each
    sequence split over ``cp`` ranks that pass the keys and values around a ring for the attention (ring attention:
    Liu et al. 2023, arXiv:2310.01889; Megatron-LM's --context-parallel-size, torchtitan's context_parallel)."""

    tp: int
    pp: int
    dp: int
    micro_batches: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"
    zero1: bool = False
    virtual_stages: int = 1
    cp: int = 1

    def micro_batch_size(self, global_batch: int) -> int:
        """Sequences per micro-batch (the layout is only valid when global_batch divides evenly)."""
        return global_batch // (self.dp * self.micro_batches)

    def tokens(self, seq_len: int) -> int:
        """Tokens of each sequence a rank holds: its 1/cp share."""
        return seq_len // self.cp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters, over which gradients are reduced and ZeRO-1 shards: DP × CP."""
        return self.dp * self.cp

    @property
    def grid(self) -> str:
        context = f" cp{self.cp}" if self.cp > 1 else ""
        return f"tp{self.tp}{context} pp{self.pp} dp{self.dp}"

    @property
    def name(self) -> str:
        zero = " zero1" if self.zero1 else ""
        chunks = f" v{self.virtual_stages}" if self.schedule == INTERLEAVED and self.virtual_stages > 1 else ""
        return f"{self.grid} m{self.micro_batches} {self.schedule}{chunks} recompute={self.recompute}{zero}"

    @property
    def chunks(self) -> int:
        """Model chunks per rank: v interleaved, 2 in ZB-V's V, else 1."""
        if self.schedule == ZBV:
            return 2
        return self.virtual_stages if self.schedule == INTERLEAVED else 1

    def chunk_stage(self, chunk: int) -> int:
        """The pipeline rank that runs model chunk ``chunk`` of the pp × chunks in order: round-robin when
        interleaved (chunk c on rank c mod p), down and back up in ZB-V (c, then 2p − 1 − c)."""
        if self.schedule == ZBV:
            return chunk if chunk < self.pp else 2 * self.pp - 1 - chunk
        return chunk % self.pp

    @functools.cached_property
    def last_stage(self) -> int:
        """The rank that runs the model's last chunk (the head and the loss): the first one in ZB-V's V. Cached: the
        planner asks it for every stage of every layout (a tenth of a large plan's time, profiled)."""
        return self.chunk_stage(self.pp * self.chunks - 1)


def stage_layers(layers: int, pp: int) -> tuple[int, ...]:
    """Layers per pipeline stage: even where they divide, else the later stages take one more each (a 1F1B
    first stage holds the most micro-batches in flight and the embeddings, so it gets the fewest layers)."""
    base, extra = divmod(layers, pp)
    return tuple(base + (stage >= pp - extra) for stage in range(pp))
