"""The reference trainer's correctness bar: a TP × PP × DP run equals a single-process run.

Every layout trains the same model (same initial weights: each is drawn by parameter name, then
sliced) on the same sequences (global batch 8, seed=0) for 6 AdamW steps, with warm-up, cosine
decay and global-norm clipping all active (the first step's norm is above --clip-grad).

Tolerances, fp32:
* per-step losses: 1e-5 absolute (losses are ~4; observed differences ≤ 5e-7, from summation order);
* per-step global gradient norms before clipping: 1e-5 relative;
* step-1 gradients (after the DP reduction and clipping, before any update): max |Δ| ≤ 1e-5 · max |g|
  per tensor (observed ≤ 1e-6);
* gradients of steps 2-6: max |Δ| ≤ 1e-4 · max |g|. Adam divides by √v, so the ~1e-7 noise in
  near-zero gradient entries becomes ~lr-sized weight differences (observed ≤ 1e-5 relative);
  the weights themselves are not compared.
"""

import pytest
import torch

from gpuwatch.trainer.config import ModelConfig, TrainConfig
from gpuwatch.trainer.launch import launch
from gpuwatch.trainer.parallel.groups import build_grid
from gpuwatch.trainer.parallel.tensor import unshard
from gpuwatch.trainer.train import Trainer

MODEL = ModelConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4)
STEPS = 6
LOSS_ATOL = 1e-5
NORM_RTOL = 1e-5
FIRST_GRAD_RTOL = 1e-5
LATER_GRAD_RTOL = 1e-4


def _train(device, cfg: TrainConfig):
    """Per step: the loss (last stage) and every gradient of this rank's slice."""
    grid = build_grid(cfg.tp, cfg.pp, cfg.dp)
    trainer = Trainer(cfg, grid, device)
    losses, norms, grads = [], [], []
    for _ in range(STEPS):
        result = trainer.train_step()
        losses.append(result.loss)
        norms.append(result.grad_norm)
        grads.append({name: p.grad.clone() for name, p in trainer.model.named_parameters()})
    splits = {name: getattr(p, "tp_split", None) for name, p in trainer.model.named_parameters()}
    return {"tp_rank": grid.tp_rank, "dp_rank": grid.dp_rank, "losses": losses, "norms": norms, "grads": grads,
            "splits": splits}


def run(tp=1, pp=1, dp=1, micro_batches=1, schedule="1f1b"):
    cfg = TrainConfig(model=MODEL, tp=tp, pp=pp, dp=dp, micro_batches=micro_batches, schedule=schedule,
                      global_batch=8, steps=STEPS, warmup_steps=2, lr=1e-2)
    cfg.validate()
    ranks = launch(_train, cfg.world_size, cfg, device="cpu", timeout=120)
    losses = next(r["losses"] for r in ranks if r["losses"][0] is not None)
    assert all(r["norms"] == ranks[0]["norms"] for r in ranks)  # every rank clips by the same global norm
    return losses, ranks[0]["norms"], [_full_gradients(ranks, step) for step in range(STEPS)]


def _full_gradients(ranks, step) -> dict[str, torch.Tensor]:
    """Whole-model gradients of one step, with TP slices put back together (DP replica 0)."""
    full = {}
    replica = sorted((r for r in ranks if r["dp_rank"] == 0), key=lambda r: r["tp_rank"])
    for name in {name for r in replica for name in r["grads"][step]}:
        holders = [r for r in replica if name in r["grads"][step]]
        split = holders[0]["splits"][name]
        slices = [r["grads"][step][name] for r in holders]
        full[name] = unshard(slices, *split) if split else slices[0]
    return full


@pytest.fixture(scope="module")
def single_process():
    return run()


LAYOUTS = {
    "1x1x1-4mb": dict(micro_batches=4),  # gradient accumulation over micro-batches only
    "tp2": dict(tp=2),
    "pp2-gpipe": dict(pp=2, micro_batches=4, schedule="gpipe"),
    "pp2-1f1b": dict(pp=2, micro_batches=4, schedule="1f1b"),
    "dp2": dict(dp=2),
    "pp4-1f1b-2mb": dict(pp=4, micro_batches=2),  # fewer micro-batches than stages
    "tp2-pp2-dp2-gpipe": dict(tp=2, pp=2, dp=2, micro_batches=4, schedule="gpipe"),
    "tp2-pp2-dp2-1f1b": dict(tp=2, pp=2, dp=2, micro_batches=4, schedule="1f1b"),
}


@pytest.mark.integration
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_parallel_run_equals_the_single_process_run(layout, single_process):
    reference_losses, reference_norms, reference_grads = single_process
    losses, norms, grads = run(**layout)

    assert len(losses) == STEPS
    for step, (loss, reference) in enumerate(zip(losses, reference_losses, strict=True), start=1):
        assert abs(loss - reference) <= LOSS_ATOL, f"step {step}: loss {loss} vs {reference}"
    assert losses[-1] < losses[0] - 0.1  # it trained, and the steps really differ
    # Clipping and Adam both undo a wrong gradient scale (say, a DP sum not divided by dp): the norm
    # before clipping is where such a bug shows.
    for step, (norm, reference) in enumerate(zip(norms, reference_norms, strict=True), start=1):
        assert abs(norm - reference) <= NORM_RTOL * reference, f"step {step}: grad norm {norm} vs {reference}"

    for step, (got, want) in enumerate(zip(grads, reference_grads, strict=True), start=1):
        assert got.keys() == want.keys()
        rtol = FIRST_GRAD_RTOL if step == 1 else LATER_GRAD_RTOL
        for name in want:
            assert got[name].shape == want[name].shape, name
            error = (got[name] - want[name]).abs().max().item()
            assert error <= rtol * want[name].abs().max().item(), f"step {step} {name}: max |Δ| {error:.2e}"
