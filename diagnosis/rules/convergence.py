"""Convergence: non-finite losses, exploding gradients, replicas out of sync, duplicated or skewed data, a model
that does not learn."""

from __future__ import annotations

import bisect
import math
import types
from collections.abc import Iterator

from gpuwatch.agent.telemetry.window import MIN_WINDOW_STEPS
from gpuwatch.diagnosis import needs
from gpuwatch.diagnosis.coverage import GRADIENTS_ALIKE, NONFINITE_OR_EXPLODING, REPLICAS_DIVERGED, WholeJob
from gpuwatch.diagnosis.facts import (
    Facts,
    RankFacts,
    Where,
    describe_ranks,
    finite,
    group_by,
    median,
    rank_list,
)
from gpuwatch.diagnosis.registry import Evidence, Issue, Severity, Threshold, rule
from gpuwatch.diagnosis.rules.common import capped

FAMILY = "convergence"


def _dp_groups(ranks: list[RankFacts]) -> Iterator[list[RankFacts]]:
    """Data-parallel replicas: ranks of a job holding the same parameters (same TP rank and PP stage)."""
    laid_out = [r for r in ranks if r.layout is not None and r.layout.dp_size > 1]
    for _, group in group_by(laid_out, lambda r: (r.layout.tp_rank, r.layout.pp_stage)):
        yield group


def _first_nonfinite_loss(rank: RankFacts) -> tuple[int, float] | None:
    for step, loss in rank.history.loss if rank.history else ():
        if not math.isfinite(loss):
            return step, loss
    if rank.last is not None and rank.last.loss is not None and not math.isfinite(rank.last.loss):
        return rank.last.step, rank.last.loss
    return None


@rule("CONV001", family=FAMILY, severity=Severity.CRITICAL, title="Non-finite (NaN/Inf) loss", needs=(needs.LOSS,),
      view="curves", coverage=(NONFINITE_OR_EXPLODING,))
def nonfinite_loss(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """A NaN or infinite loss poisons every later update. The classic cause is fp16 training without loss
    scaling: autocast without a GradScaler lets gradients underflow or overflow, and the loss turns NaN
    (PyTorch AMP docs, gradient scaling). The usual checks: is gradient scaling on, is the learning rate
    too high, does the input hold abnormal values. With a loss
    scaler, occasional non-finite *gradients* are expected (the scaler skips the step and lowers the
    scale), so non-finite steps count only when no loss scale is reported; a non-finite loss always
    counts."""
    for job, ranks in facts.jobs().items():
        bad = []
        for rank in ranks:
            first = _first_nonfinite_loss(rank)
            unscaled = bool(rank.nonfinite_steps) and (rank.last is None or rank.last.loss_scale is None)
            if first is None and not unscaled:
                continue
            precision = rank.layout.precision if rank.layout else None
            text = f"rank {rank.rank}: " + (f"loss {first[1]} at step {first[0]}" if first else
                                             "non-finite gradients with no loss scaler")
            text += f"; {rank.nonfinite_steps} non-finite step(s)" if rank.nonfinite_steps else ""
            text += f"; precision {precision}" if precision else ""
            text += "; no loss scaler" if rank.last is not None and rank.last.loss_scale is None else ""
            bad.append((rank, Evidence(text, rank.where, {"step": first[0] if first else None,
                                                          "nonfinite_steps": rank.nonfinite_steps,
                                                          "precision": precision})))
        if not bad:
            continue
        fp16_unscaled = any(r.layout is not None and r.layout.precision == "fp16" and
                            (r.last is None or r.last.loss_scale is None) for r, _ in bad)
        yield Issue(
            title=f"non-finite loss in job {job} on {len(bad)} rank(s)"
                  + (": fp16 without a loss scaler" if fp16_unscaled else ""),
            evidence=capped([e for _, e in bad], what="ranks"),
            fix=("use torch.amp.GradScaler with fp16: scaler.scale(loss).backward(); scaler.step(optimizer); "
                 "scaler.update() (or train in bf16)" if fp16_unscaled else
                 "lower the learning rate or lengthen warm-up, clip the global gradient norm after the all-reduce, "
                 "and check the batch of the first non-finite step for NaN or extreme inputs"),
            reason=("fp16 cannot represent the gradients without loss scaling: they overflow to Inf and the loss "
                    "turns NaN." if fp16_unscaled else
                    "Once the loss is NaN every later update is NaN too; the first bad step points at the cause."),
        )


#: Steps the running median of CONV002 looks back over.
RUNNING_WINDOW = 200


def _first_explosion(series: list[tuple[int, float]],
                     t: types.SimpleNamespace) -> tuple[int, float, float | None] | None:
    """The first (step, norm, running median) above the absolute threshold or the spike factor."""
    window: list[float] = []  # the previous RUNNING_WINDOW norms, sorted
    for index, (step, value) in enumerate(series):
        typical = median(window) if len(window) >= t.min_history else None
        if value > t.max_grad_norm or (typical and value > t.spike_factor * typical):
            return step, value, typical
        bisect.insort(window, value)
        if index >= RUNNING_WINDOW:
            window.pop(bisect.bisect_left(window, series[index - RUNNING_WINDOW][1]))
    return None


@rule("CONV002", family=FAMILY, view="curves", severity=Severity.WARNING, title="Gradient norm explosion",
      needs=(needs.GRAD_NORM,),
      thresholds={
          "max_grad_norm": Threshold(100, "a practitioners' rule of thumb: a gradient norm above 100 has exploded"),
          "spike_factor": Threshold(10, "ten times the running median of the steps before"),
          "min_history": Threshold(20, "steps needed for a meaningful running median"),
      },
      coverage=(NONFINITE_OR_EXPLODING,))
def grad_norm_explosion(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """A gradient norm far above its usual value is the step before a loss spike or a NaN (a common triage
    for a loss jumping from, say, 0.15 to 0.8: first look at the gradient norm; above 100 it exploded). The
    rule flags a norm above the absolute threshold, or, where a run log gives the history, a norm far
    above the running median of the steps before it. Non-finite norms are CONV001's (with a loss scaler
    they are routine overflow steps)."""
    for job, ranks in facts.jobs().items():
        hits = []
        for rank in ranks:
            series = [(s, v) for s, v in (rank.history.grad_norm if rank.history else ()) if math.isfinite(v)]
            if not series and rank.last is not None and finite(rank.last.grad_norm):
                series = [(rank.last.step, rank.last.grad_norm)]
            hit = _first_explosion(series, t)
            if hit is not None:
                hits.append((rank, *hit))
        if not hits:
            continue
        hits.sort(key=lambda hit: hit[1])
        yield Issue(
            title=f"gradient norm explosion in job {job}: {hits[0][2]:.4g} at step {hits[0][1]}",
            evidence=capped([Evidence(f"rank {r.rank}: grad norm {value:.4g} at step {step}"
                                      + (f" ({value / typical:.0f}x the running median {typical:.3g})" if typical
                                         else ""), r.where, {"grad_norm": value, "step": step, "median": typical})
                             for r, step, value, typical in hits], what="ranks"),
            fix="clip the global gradient norm after the all-reduce (torch.nn.utils.clip_grad_norm_(params, 1.0)), "
                "lower the learning rate or lengthen warm-up (e.g. over the first 2 % of the steps)",
            reason="Exploding gradients throw the weights off in one update: the loss spikes or turns NaN next.",
        )


def _differs(value: float | str, reference: float | str, tolerance: float) -> bool:
    if isinstance(value, str) or isinstance(reference, str):
        return value != reference
    return abs(value - reference) > tolerance * max(abs(reference), abs(value), 1e-30)


@rule("CONV003", family=FAMILY, view="curves", severity=Severity.CRITICAL, title="Data-parallel replicas out of sync",
      needs=(needs.CHECKSUM, needs.LAYOUT),
      thresholds={"relative_tolerance": Threshold(
          1e-5, "a practitioners' consistency check: after a restore, every rank's gradient norm agrees to 1e-5")},
      coverage=(REPLICAS_DIVERGED,))
def replicas_out_of_sync(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """Data-parallel replicas must hold identical parameters after every update; a parameter checksum that
    differs between the ranks of a DP group (same TP rank and PP stage) at the same step means a replica
    diverged: a skipped all-reduce, an unsynchronised buffer, a different initialisation. From then on
    each replica trains a different model while the loss curve looks normal (a gradient synchronisation
    failure; a common check after a checkpoint restore is that every rank agrees to 1e-5)."""
    for job, ranks in facts.jobs().items():
        for group in _dp_groups(ranks):
            for when, members in group_by([r for r in group if r.param_checksum is not None],
                                          lambda r: r.param_checksum.when):
                if len(members) < 2 or when[1] is None:
                    continue
                members.sort(key=lambda r: r.layout.dp_rank)
                reference = members[0].param_checksum.value
                odd = [r for r in members[1:] if _differs(r.param_checksum.value, reference, t.relative_tolerance)]
                if not odd:
                    continue
                at = f"step {when[1]}" if when[0] == "step" else f"latest sample (ranks at step {when[1]})"
                layout = members[0].layout
                yield Issue(
                    title=f"DP replicas of job {job} disagree at {at}: ranks {rank_list(r.rank for r in odd)} "
                          f"differ from rank {members[0].rank}",
                    evidence=tuple(Evidence(f"rank {r.rank} (dp {r.layout.dp_rank}): parameter checksum "
                                            f"{r.param_checksum.value}", r.where,
                                            {"checksum": r.param_checksum.value, "dp_rank": r.layout.dp_rank})
                                   for r in members),
                    fix=f"stop and restore the last checkpoint where tp {layout.tp_rank} / stage {layout.pp_stage} "
                        "replicas agreed; check every gradient reaches the all-reduce (unused parameters, "
                        "find_unused_parameters), buffers are broadcast (broadcast_buffers) and all replicas start "
                        "from rank 0's weights",
                    reason="Replicas that disagree train different models; the averaged gradient fits none of them.",
                )


@rule("CONV004", family=FAMILY, severity=Severity.WARNING, title="Duplicated data shards across DP ranks",
      view="curves", needs=(needs.COSINE, needs.LAYOUT),
      thresholds={"min_cosine": Threshold(
          0.99999, "identical batches give cos = 1 up to rounding (exactly 1 in the reference "
                   "trainer); different data agree less, even exploding gradients, which the weights dominate "
                   "(0.9987-0.9990 measured with --fault lr-explode)")},
      coverage=(GRADIENTS_ALIKE,))
def duplicated_shards(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """When every data-parallel rank reads the same samples (no DistributedSampler), their local gradients
    are identical: each one's cosine similarity with the DP mean is 1. Compute is wasted dp_size times
    over and the effective batch is one replica's: the data is trained on repeatedly, a thing worth checking
    first whenever training looks wrong. PyTorch's DistributedSampler gives each process a subset of the
    dataset exclusive to it (PyTorch docs, torch.utils.data)."""
    for job, ranks in facts.jobs().items():
        for group in _dp_groups(ranks):
            # (rank, dp rank, cosine): every rank of a DP group has a layout; a NaN cosine (NaN gradients) is CONV001's
            known = [(r, r.layout.dp_rank, r.grad_cosine.value) for r in group
                     if r.layout is not None and r.grad_cosine is not None and isinstance(r.grad_cosine.value, float)
                     and finite(r.grad_cosine.value)]
            if len(known) < 2 or any(cosine < t.min_cosine for _, _, cosine in known):
                continue
            yield Issue(
                title=f"duplicated data shards in job {job}: DP ranks {rank_list(r.rank for r, _, _ in known)} "
                      "compute identical gradients",
                evidence=tuple(Evidence(f"rank {r.rank} (dp {dp_rank}): gradient cosine similarity "
                                        f"{cosine:.5f} with the DP mean", r.where,
                                        {"grad_cosine_similarity": cosine}) for r, dp_rank, cosine in known),
                fix="every data-parallel rank must draw different data: shard the dataset by data-parallel rank "
                    "(PyTorch: DataLoader(..., sampler=DistributedSampler(dataset, num_replicas=dp_size, "
                    "rank=dp_rank)) and sampler.set_epoch(epoch) every epoch), or, in a loop that samples its own "
                    "batches, seed or offset each rank's sampling by its data-parallel rank",
                reason="Identical batches on every replica waste dp_size − 1 of the GPUs and shrink the effective "
                       "batch to one replica's.",
            )


@rule("CONV005", family=FAMILY, severity=Severity.INFO, title="Gradient agreement out of band (tuning hint)",
      view="curves", needs=(needs.COSINE, needs.LAYOUT),
      thresholds={
          "low_cosine": Threshold(0.85, "one team's reported heuristic: a mean below 0.85 means data skewed across "
                                        "ranks"),
          "high_cosine": Threshold(0.95, "the same heuristic: above 0.95 the batch is larger than useful"),
      },
      coverage=(WholeJob("it averages gradient agreement over every rank of a job"),))
def gradient_agreement(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """One team's tuning heuristic: compute the mean cosine similarity of the ranks' local gradients; below 0.85
    the data is skewed across ranks (temporarily grow the DP group), above 0.95 the batch is larger than
    useful (shrink the micro-batch). It is a hint, never a warning: small per-rank batches are naturally
    noisy, and a healthy run can sit outside the band."""
    for job, ranks in facts.jobs().items():
        values = [(r, r.grad_cosine.value) for r in ranks if r.layout is not None and r.layout.dp_size > 1
                  and r.grad_cosine is not None and isinstance(r.grad_cosine.value, float)
                  and finite(r.grad_cosine.value)]
        if len(values) < 2:
            continue
        mean = sum(value for _, value in values) / len(values)
        if t.low_cosine <= mean <= t.high_cosine:
            continue
        low = mean < t.low_cosine
        yield Issue(
            title=f"mean gradient cosine similarity {mean:.3f} in job {job}: "
                  + ("data may be skewed across ranks" if low else "batch larger than useful"),
            evidence=(Evidence(f"mean {mean:.3f}, min {min(v for _, v in values):.3f}, max "
                               f"{max(v for _, v in values):.3f} over {len(values)} DP ranks", Where(job=job),
                               {"mean": mean, "ranks": len(values)}),),
            fix=("check that shuffling and sharding balance the data across ranks, or try a larger DP group"
                 if low else "try a smaller micro-batch (or global batch) and spend the GPUs elsewhere"),
            reason=("Ranks whose gradients point in different directions see differently distributed data "
                    "(mean below 0.85)." if low else
                    "Gradients this alike add little information per extra sample (mean above 0.95)."),
        )


@rule("CONV006", family=FAMILY, severity=Severity.CRITICAL, title="Model not learning", needs=(needs.LEARNING,),
      view="curves", thresholds={"max_loss_spread": Threshold(
          1e-7, "relative spread of the loss over the window: fp32 rounding (2^-23 = 1.2e-7) is the most two "
                "computations of the same loss differ by; any batch-to-batch change of data moves it far more")},
      coverage=(WholeJob("it judges the spread of losses over every rank of a job"),))
def not_learning(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """A job that runs at full speed and learns nothing wastes all of it, and no timing or hardware signal
    shows it. Over each rank's window of recent steps, three signs, any of which is enough: the loss does not
    move (the same value, to rounding, at every step: successive batches differ, so a model that learns, or
    even one that does not but sees new data, moves it); the gradient norm is zero at every step; the parameter
    checksum does not change between measurements. Usual causes: a loss over a wrongly shaped output
    (cross-entropy over a single class is 0 whatever the weights, so are its gradients), parameters frozen or
    left out of the optimizer, a learning rate of 0, an optimizer that never steps."""
    for job, ranks in facts.jobs().items():
        stuck: list[tuple[RankFacts, Evidence]] = []
        for rank in ranks:
            window = rank.window
            if window is None or window.steps < MIN_WINDOW_STEPS:
                continue
            signs = []
            low, high = window.loss_min, window.loss_max  # both set once a step had a finite loss
            if window.loss_steps >= MIN_WINDOW_STEPS and low is not None and high is not None and \
                    high - low <= t.max_loss_spread * max(abs(low), abs(high)):
                signs.append(f"loss {low:.6g} at all {window.loss_steps} steps")
            if window.grad_norm_steps and window.grad_norm_max == 0:
                signs.append(f"gradient norm 0 at all {window.grad_norm_steps} steps")
            if window.checksums > 1 and window.distinct_checksums == 1:
                signs.append(f"parameter checksum unchanged over {window.checksums} measurements")
            if signs:
                stuck.append((rank, Evidence(f"rank {rank.rank}: {'; '.join(signs)} (window: {window.describe()})",
                                             rank.where, {"signs": signs, "first_step": window.first_step,
                                                          "last_step": window.last_step})))
        if not stuck:
            continue
        yield Issue(
            title=f"job {job} is not learning: {describe_ranks(r for r, _ in stuck)} show no change in loss, "
                  "gradients or parameters",
            evidence=capped([e for _, e in stuck], what="ranks"),
            fix="check the loss is computed on the right output shape (e.g. cross-entropy needs one logit per class, "
                "not a single output), that the parameters require gradients and are all passed to the optimizer, "
                "that the learning rate is not 0 (warm-up from 0, a scheduler stepping too early), and that "
                "optimizer.step() runs on every optimizer step",
            reason="A model whose loss, gradients or weights do not change is not training, however fast its steps.",
        )
