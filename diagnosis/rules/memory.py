"""Memory: CUDA caching-allocator fragmentation, peak memory near capacity, host memory leaks."""

from __future__ import annotations

import itertools
import types
from collections.abc import Iterator

from gpuwatch.diagnosis import needs
from gpuwatch.diagnosis.coverage import ENV_MINORITY, MEMORY_PRESSURE, WholeJob
from gpuwatch.diagnosis.facts import Facts, gib
from gpuwatch.diagnosis.registry import Evidence, Issue, Severity, Threshold, rule
from gpuwatch.diagnosis.rules.common import capped, ratio_text

FAMILY = "memory"


@rule("MEM001", family=FAMILY, view="memory", severity=Severity.WARNING, title="CUDA allocator fragmentation",
      needs=(needs.CUDA_MEMORY,),
      thresholds={"min_unused_share": Threshold(
          0.25, "a reported case: nvidia-smi showed 85 GB in use while torch.cuda.memory_allocated() was 60 GB and new "
                "tensors failed to allocate (29 % of the reserved memory held but unusable)")},
      coverage=(MEMORY_PRESSURE, ENV_MINORITY))
def fragmentation(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """PyTorch's caching allocator keeps freed blocks to reuse them; when they are split into pieces that no
    longer fit the requests, a large share of the reserved memory sits unused while allocations fail: the
    allocator flushes its cache and retries (an alloc retry, slow), and the next peak ends in an OOM
    (one reported case: 85 GB reserved, 60 GB allocated, allocations failing). The rule fires when a rank had
    allocation retries and reserved − allocated is a large share of what it reserved; inactive split
    blocks (the fragments themselves) are shown as evidence. Expandable segments let the allocator grow
    a mapping instead of splitting blocks."""
    for job, ranks in facts.jobs().items():
        fragmented = []
        for rank in ranks:
            last = rank.last
            if last is None or last.memory_kind != "cuda" or not rank.alloc_retries or not last.reserved_bytes \
                    or last.allocated_bytes is None:
                continue
            unused = last.reserved_bytes - last.allocated_bytes
            share = unused / last.reserved_bytes
            if share < t.min_unused_share:
                continue
            split = f", {gib(last.inactive_split_bytes)} of it in inactive split blocks" \
                if last.inactive_split_bytes is not None else ""
            fragmented.append((share, rank, Evidence(
                f"rank {rank.rank}: reserved {gib(last.reserved_bytes)}, allocated {gib(last.allocated_bytes)} "
                f"({gib(unused)}, {ratio_text(share)} held unused{split}); {rank.alloc_retries} allocation "
                "retries", rank.where,
                {"reserved_bytes": last.reserved_bytes, "allocated_bytes": last.allocated_bytes,
                 "inactive_split_bytes": last.inactive_split_bytes, "alloc_retries": rank.alloc_retries})))
        if not fragmented:
            continue
        fragmented.sort(key=lambda item: -item[0])
        conf = next((r.env.get("PYTORCH_CUDA_ALLOC_CONF", "") for _, r, _ in fragmented if r.env is not None), "")
        expandable = "expandable_segments:true" in conf.replace(" ", "").lower()
        yield Issue(
            title=f"CUDA memory fragmentation in job {job}: {len(fragmented)} rank(s) retried allocations with up "
                  f"to {ratio_text(fragmented[0][0])} of reserved memory unused",
            evidence=capped([e for _, _, e in fragmented], what="ranks"),
            fix=("export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" if not expandable else
                 "expandable segments are already on: set max_split_size_mb:128 in PYTORCH_CUDA_ALLOC_CONF and "
                 "preallocate reused buffers (torch.empty once, copy_ into it)"),
            reason="Fragmented cached blocks make allocations fail and retry even though memory is free; "
                   "expandable segments grow one mapping instead of splitting blocks.",
        )


@rule("MEM002", family=FAMILY, view="memory", severity=Severity.WARNING, title="Peak memory near GPU capacity",
      needs=(needs.CUDA_MEMORY, needs.GPU_CAPACITY),
      thresholds={"max_peak_share": Threshold(
          0.95, "a reported case: 78 GB on an 80 GB A100 was just inside the safety line after cutting the batch; "
                "warn before that knife edge")},
      coverage=(MEMORY_PRESSURE,))
def peak_near_capacity(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """A rank whose peak allocation (torch.cuda.max_memory_allocated: the peak, not the current
    allocation, is what counts) comes within a few percent of its GPU's memory is one longer sequence
    or one fragmented cache away from CUDA out-of-memory (one reported case: an MoE model planned at 56 GB peaked
    far higher and ran out of memory; 78 GB of 80 GB was the edge). Memory the allocator merely holds
    in its cache is not counted (that is MEM001's fragmentation). A rank that already had an OOM is
    reported whatever its last peak."""
    for job, ranks in facts.jobs().items():
        tight = []
        for rank in ranks:
            last = rank.last
            if last is None or last.memory_kind != "cuda":
                continue
            gpu = facts.gpu_of(rank)
            capacity = gpu.memory_total_bytes if gpu is not None else None
            peak_bytes = last.peak_bytes
            share: float | None = None
            text = f"rank {rank.rank}: peak unknown"
            if capacity and peak_bytes is not None:
                share = peak_bytes / capacity
                text = f"rank {rank.rank}: peak {gib(peak_bytes)} of {gib(capacity)} ({ratio_text(share)})"
            if not rank.ooms and (share is None or share < t.max_peak_share):
                continue
            text += f", {gib(last.reserved_bytes)} reserved" if last.reserved_bytes is not None else ""
            text += f"; {rank.ooms} OOM(s)" if rank.ooms else ""
            tight.append(((bool(rank.ooms), share or 0.0), Evidence(text, rank.where, {
                "peak_bytes": last.peak_bytes, "reserved_bytes": last.reserved_bytes, "capacity_bytes": capacity,
                "share": share, "ooms": rank.ooms})))
        if not tight:
            continue
        tight.sort(key=lambda item: item[0], reverse=True)
        peak = max(share for (_, share), _ in tight)
        ooms = sum(1 for (oom, _), _ in tight if oom)
        yield Issue(
            title=f"GPU memory near capacity in job {job}: {len(tight)} rank(s), peak up to {ratio_text(peak)} of "
                  "the GPU" + (f", {ooms} with OOMs" if ooms else ""),
            evidence=capped([e for _, e in tight], what="ranks"),
            fix="free memory headroom: activation checkpointing, a smaller micro-batch, sharded optimizer state "
                "(ZeRO / FSDP) or bf16 weights and gradients",
            reason="Within a few percent of capacity, any longer sequence or fragmented cache ends the job in "
                   "CUDA out-of-memory.",
        )


@rule("MEM003", family=FAMILY, view="memory", severity=Severity.WARNING, title="Host memory growing step after step",
      needs=(needs.RSS_HISTORY,),
      thresholds={
          "min_growth_share": Threshold(0.1, "10 % growth over the observed window"),
          "min_rising_share": Threshold(0.8, "rising in at least 80 % of the steps, not a one-off jump"),
          "min_points": Threshold(10, "fewer steps cannot show a trend"),
          "warmup_share": Threshold(0.2, "the first 20 % of the steps (caches filling, workers starting) are left "
                                         "out"),
      },
      coverage=(WholeJob("it reads every rank's host-memory history"),))
def host_memory_leak(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """Host memory (the process's resident set) that grows with every step is a leak: tensors kept alive
    across steps (accumulating ``loss`` instead of ``loss.item()``), Python lists of outputs, data-loader
    workers copying a Python-object dataset page by page. Host RSS (psutil.Process().memory_info().rss)
    belongs among what a training job monitors; left alone, the OOM killer ends
    the job hours in. The rule leaves out the warm-up steps and fires when RSS grew by a good share and
    rose in most steps."""
    for job, ranks in facts.jobs().items():
        leaking = []
        for rank in ranks:
            points = rank.history.host_rss_bytes if rank.history else []
            points = points[int(len(points) * t.warmup_share):]
            if len(points) < t.min_points or points[0][1] <= 0:
                continue
            growth = points[-1][1] - points[0][1]
            deltas = [b[1] - a[1] for a, b in itertools.pairwise(points)]
            rising = sum(delta > 0 for delta in deltas) / len(deltas)
            share = growth / points[0][1]
            if share < t.min_growth_share or rising < t.min_rising_share:
                continue
            leaking.append((share, Evidence(
                f"rank {rank.rank}: host RSS {gib(points[0][1])} → {gib(points[-1][1])} (+{ratio_text(share)}) over "
                f"steps {points[0][0]}–{points[-1][0]}, rising in {ratio_text(rising)} of them", rank.where,
                {"first_bytes": points[0][1], "last_bytes": points[-1][1], "growth_share": share,
                 "rising_share": rising, "first_step": points[0][0], "last_step": points[-1][0]})))
        if not leaking:
            continue
        leaking.sort(key=lambda item: -item[0])
        yield Issue(
            title=f"host memory leak in job {job}: RSS of {len(leaking)} rank(s) grows step after step "
                  f"(up to +{ratio_text(leaking[0][0])})",
            evidence=capped([e for _, e in leaking], what="ranks"),
            fix="find what survives each step: log loss.item() instead of the loss tensor, drop references to "
                "outputs, avoid Python-object datasets in DataLoader workers; locate it with tracemalloc or memray",
            reason="Host memory that grows every step ends with the OOM killer stopping the job.",
        )
