"""The planner's formulas against the papers' published figures and Megatron-LM's estimator on the same inputs.

Published figures: Narayanan et al. 2021 (arXiv:2104.04473) Table 1's parameter counts and §5.1's FLOPs formula;
Korthikanti et al. 2022 (arXiv:2205.05198) Table 2's activation forms and §4.2's savings of selective recomputation
(70 % for GPT-3, 65 % for MT-NLG); ZeRO's 7.5 B-parameter example (Rajbhandari et al. 2020, arXiv:1910.02054,
Figure 1: 120 GB, 31.4 GB with the optimizer states partitioned over 64 ranks); the bubble of GPipe (Huang et al.
2019, arXiv:1811.06965: (K − 1)/(M + K − 1)) and of Narayanan et al. ((p − 1)/m of the ideal time).

Megatron-LM's estimator (megatron/training/theoretical_memory_usage.py, read at commit 00caa53a; its figures are
worked out by hand below from its formulas, its code not run): equal where both count the same, and where not, the
difference is asserted to be exactly the term we count otherwise.
"""

from dataclasses import replace

import pytest

from gpuwatch.plan import compute
from gpuwatch.plan.gpus import Cluster, preset
from gpuwatch.plan.memory import layer_activation_bytes, state_bytes
from gpuwatch.plan.model import ModelShape
from gpuwatch.plan.planner import predict
from gpuwatch.plan.run import Layout, Run, numerics


def gpt(layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048) -> ModelShape:
    """Narayanan et al.'s and Korthikanti et al.'s GPT: LayerNorm, biases, a 4h GELU MLP, learned positions, tied
    embeddings."""
    return ModelShape(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=vocab,
                      tied_embeddings=True, gated=False, norm_params=2, bias=True, positions=seq)


# Narayanan et al. 2021, Table 1: heads, hidden, layers -> billions of parameters.
@pytest.mark.parametrize(("heads", "hidden", "layers", "billions"), [
    (24, 2304, 24, 1.7), (32, 3072, 30, 3.6), (32, 4096, 36, 7.5), (48, 6144, 40, 18.4), (64, 8192, 48, 39.1),
    (80, 10240, 60, 76.1), (96, 12288, 80, 145.6), (128, 16384, 96, 310.1), (128, 20480, 105, 529.6),
    (160, 25600, 128, 1008.0)])
def test_parameter_counts_are_narayanan_table_1(heads, hidden, layers, billions):
    assert round(gpt(layers, hidden, heads).total_parameters() / 1e9, 1) == billions


@pytest.mark.parametrize(("layers", "hidden", "heads"), [(96, 12288, 96), (105, 20480, 128), (128, 25600, 160)])
def test_flops_are_narayanans_formula(layers, hidden, heads):
    """§5.1: 96·B·s·l·h²(1 + s/(6h) + V/(16lh)) a step with full recomputation; 72·…(… + V/(12lh)) without."""
    shape, s, v, batch = gpt(layers, hidden, heads), 2048, 51200, 1536
    h = hidden
    with_recompute = 96 * batch * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    model = 72 * batch * s * layers * h**2 * (1 + s / (6 * h) + v / (12 * layers * h))
    hardware = compute.stage_flops_per_token(shape, s, layers, last=True, recompute="full",
                                             flash_attention=False) * batch * s
    assert hardware == pytest.approx(with_recompute, rel=1e-12)
    assert compute.model_flops_per_token(shape, s) * batch * s == pytest.approx(model, rel=1e-12)


def test_activation_forms_are_korthikanti_table_2():
    """Korthikanti et al. keep the attention scores (no flash attention: it came out the same year)."""
    shape, s, b, t = gpt(96, 12288, 96), 2048, 1, 8
    sbh, score = s * b * 12288, 5 * 96 * s / 12288

    def kept(tp, sp, recompute):
        return layer_activation_bytes(shape, s, b, tp, sp, recompute, flash_attention=False)

    assert kept(1, False, "none") == sbh * (34 + score)
    assert kept(t, False, "none") == pytest.approx(sbh * (10 + 24 / t + score / t))
    assert kept(t, True, "none") == pytest.approx(sbh / t * (34 + score))
    assert kept(t, True, "selective") == pytest.approx(sbh / t * 34)
    assert kept(t, False, "full") == 2 * sbh
    assert kept(t, True, "full") == 2 * sbh / t


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (8, False), (8, True)])
def test_flash_attention_keeps_no_scores_but_one_softmax_statistic(tp, sp):
    """Dao et al. 2022 (arXiv:2205.14135) §3.1: no s × s scores kept, the log-sum-exp (fp32, 4 bytes a head and
    token, split over TP with the heads) in their place: selective recomputation's form plus 4·a·s·b/t, whatever the
    recomputation asked for but full (which keeps only the layer's input)."""
    shape, s, b = gpt(96, 12288, 96), 2048, 2
    statistic = 4 * 96 * s * b / tp
    selective = layer_activation_bytes(shape, s, b, tp, sp, "selective", flash_attention=False)
    for recompute in ("none", "selective"):
        assert layer_activation_bytes(shape, s, b, tp, sp, recompute) == pytest.approx(selective + statistic)
    assert layer_activation_bytes(shape, s, b, tp, sp, "full") == layer_activation_bytes(
        shape, s, b, tp, sp, "full", flash_attention=False)
    # GPT-3 at tp 8 with sequence parallelism: the scores were 80/(34 + 80) = 70 % of a layer's activations.
    kept = layer_activation_bytes(shape, s, b, 8, True, "none", flash_attention=False)
    assert 1 - layer_activation_bytes(shape, s, b, 8, True, "none") / kept == pytest.approx(0.70, abs=0.005)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_flash_attention_adds_the_backwards_recomputed_scores_to_the_hardware_flops(recompute):
    """Dao et al. 2022, Algorithm 4: the backward pass recomputes S = QKᵀ, one matmul of 2sh FLOPs a token and
    layer on the hardware (half the attention's forward 4sh); selective recomputation, which would recompute the
    attention's 4sh, has nothing to recompute; the model's FLOPs (MFU) do not change."""
    shape, s, layers = gpt(96, 12288, 96), 2048, 96
    plain = compute.stage_flops_per_token(shape, s, layers, True, recompute, flash_attention=False)
    flash = compute.stage_flops_per_token(shape, s, layers, True, recompute, flash_attention=True)
    none = compute.stage_flops_per_token(shape, s, layers, True, "none", flash_attention=False)
    expected = none + layers * 2 * s * 12288 + (plain - none if recompute == "full" else 0.0)
    assert flash == pytest.approx(expected, rel=1e-12)
    assert compute.model_flops_per_token(shape, s) * 3 == pytest.approx(
        compute.stage_flops_per_token(shape, s, layers, True, "none", flash_attention=False) * 3)


@pytest.mark.parametrize(("shape", "saving"), [(gpt(96, 12288, 96), 0.70), (gpt(105, 20480, 128), 0.65)])
def test_selective_recomputation_saves_what_korthikanti_publish(shape, saving):
    """§4.2: with tensor and sequence parallelism, selective recomputation cuts GPT-3's activation memory by 70 %
    and MT-NLG's by 65 % (5as/h = 80 and 64 against 34)."""
    full = layer_activation_bytes(shape, 2048, 1, 8, True, "none", flash_attention=False)
    selective = layer_activation_bytes(shape, 2048, 1, 8, True, "selective", flash_attention=False)
    assert round(1 - selective / full, 2) == saving


def test_zero_bytes_per_parameter_are_the_zero_papers_example():
    """ZeRO, Figure 1: Ψ = 7.5 B, mixed-precision Adam: 16Ψ = 120 GB; optimizer states over N_d = 64: 31.4 GB."""
    zero = numerics("bf16", main_grads_fp32=False)
    assert sum(state_bytes(7_500_000_000, zero, 64, zero1=False)) == 120e9
    assert round(sum(state_bytes(7_500_000_000, zero, 64, zero1=True)) / 1e9, 1) == 31.4
    assert numerics("bf16").per_parameter == 18  # Megatron-LM's fp32 main gradients
    assert numerics("fp32").per_parameter == 16


@pytest.mark.parametrize(("pp", "m"), [(4, 8), (8, 32), (2, 1)])
def test_bubble_is_gpipes_and_narayananss(pp, m):
    fraction = compute.bubble_fraction(pp, m)
    assert fraction == (pp - 1) / (m + pp - 1)  # GPipe's (K - 1)/(M + K - 1), a share of the step
    ideal = (pp - 1) / m  # Narayanan et al.: bubble time over the ideal time
    assert fraction == pytest.approx(ideal / (1 + ideal))


@pytest.mark.parametrize(("schedule", "pp", "m", "v", "expected"), [
    ("gpipe", 4, 8, None, 3 / 11), ("1f1b", 4, 8, 2, 3 / 11), (None, 4, 8, None, 3 / 11),
    ("interleaved_1f1b", 4, 8, 2, 3 / 19), ("looped_bfs", 4, 8, 4, 3 / 35), ("interleaved_1f1b", 4, 8, None, None),
    ("zbv_zero_bubble", 4, 4, 2, 0.0), ("interleaved_zero_bubble", 4, 8, 2, 0.0), ("zbv_zero_bubble", 4, 2, 2, None),
    ("dualpipev", 4, 8, 2, None), ("my_schedule", 4, 8, None, None), ("interleaved_1f1b", 1, 8, 2, 0.0),
])
def test_the_bubble_follows_the_schedule_as_a_share_of_the_step(schedule, pp, m, v, expected):
    """Interleaved over v chunks: Narayanan et al.'s (p − 1)/(v·m) of the ideal time, as a share of the step; the
    zero-bubble schedules nothing once m ≥ p; what is not modelled, None."""
    assert compute.schedule_bubble(schedule, pp, m, v) == (pytest.approx(expected) if expected is not None else None)
    if expected and v:
        ideal = (pp - 1) / ((v if schedule in compute.INTERLEAVED_SCHEDULES else 1) * m)
        assert expected == pytest.approx(ideal / (1 + ideal))


@pytest.mark.parametrize(("pp", "bubble", "v"), [(4, 0.2, 1), (8, 0.2, 1), (4, 0.2, 2), (8, 0.1, 4)])
def test_micro_batches_for_is_the_fewest_under_the_bubble(pp, bubble, v):
    m = compute.micro_batches_for(pp, bubble, v)
    assert compute.bubble_fraction(pp, m, v) <= bubble + 1e-12
    assert m == 1 or compute.bubble_fraction(pp, m - 1, v) > bubble


# --- Megatron-LM's estimator on the same inputs -------------------------------------------------------------------

LLAMA_7B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000, tied_embeddings=False)
H100 = preset("h100-80gb")


def states(shape: ModelShape, layout: Layout, run: Run) -> tuple[int, float]:
    """(parameters, weight + gradient + optimizer bytes) of the heaviest stage's rank by those bytes."""
    prediction = predict(shape, Cluster(layout.tp * layout.pp * layout.dp, 8, H100), run, layout)
    stage = max(prediction.stages, key=lambda stage: stage.parameters)
    memory = stage.memory
    return stage.parameters, memory.parameters + memory.gradients + memory.optimizer


def test_weights_and_optimizer_equal_megatrons_without_model_parallelism():
    """compute_weight_and_optimizer_memory, swiglu, RMSNorm, untied, tp = pp = dp = 1, no distributed optimizer:
    a layer 2h(1.5·ffn + 1) + 2h²(1 + 1) = 8192 × 16513 + 4 × 4096² = 202,383,360; the block 32 layers + the final
    norm 4096 = 6,476,271,616; embeddings 2 × 4096 × 32000 = 262,144,000; 6,738,415,616 parameters × 18 bytes."""
    run = Run(8, 4096, numerics("bf16"))
    assert states(LLAMA_7B, Layout(1, 1, 1), run) == (6_738_415_616, 6_738_415_616 * 18)


def test_weights_and_optimizer_differ_from_megatrons_by_the_replicated_norms():
    """tp 2, pp 4, dp 8, distributed optimizer: Megatron's most loaded shard is (block/pp + embedding)/tp =
    (6,476,271,616/4 + 131,072,000)/2 = 875,069,952 parameters at 6 + 12/8 = 7.5 bytes. Ours is the last stage,
    875,106,304: the norms are replicated on every TP rank, not split (8 layers × 2 norms × 4096 / 2 = 32,768 more),
    and the final norm is whole on the last stage, not spread over the stages and split (4096 − 4096/8 = 3,584)."""
    run = Run(512, 4096, numerics("bf16"))
    parameters, nbytes = states(LLAMA_7B, Layout(2, 4, 8, micro_batches=4, zero1=True), run)
    assert parameters == 875_069_952 + 32_768 + 3_584
    assert nbytes == parameters * 7.5


def test_activations_differ_from_megatrons_by_the_final_norms_output_bytes():
    """compute_activation_memory (sequence parallel, selective), GPT-3 175B, s 2048, b 1, tp 8, pp 1:
    layers 96 × sbh(18 + 4·4) = 96 × 34 × 25,165,824 = 82,141,249,536; the embedding's 8sb + sbh = 25,182,208; the
    output 4sbh(1 + V/h) = 520,093,696; all / 8 = 10,335,815,680. Ours counts the final norm's output at the
    activations' 2 bytes, Megatron at 4: 2sbh/8 = 6,291,456 less."""
    shape = gpt(96, 12288, 96)
    run = Run(8, 2048, numerics("bf16"), flash_attention=False)
    memory = predict(shape, Cluster(64, 8, H100), run, Layout(8, 1, 8, 1, recompute="selective")).memory
    assert memory.activations + memory.embeddings_logits == 10_335_815_680 - 6_291_456
    # flash attention with no recomputation: the same, and the softmax statistic, 4·a·s·b/t a layer
    flash = predict(shape, Cluster(64, 8, H100), replace(run, flash_attention=True), Layout(8, 1, 8, 1)).memory
    assert flash.activations + flash.embeddings_logits == 10_335_815_680 - 6_291_456 + 96 * 4 * 96 * 2048 / 8


@pytest.mark.parametrize("pp", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 32])
def test_the_planners_bubble_is_the_one_the_trainers_step_records_carry(pp, m):
    """The reference trainer's step records give each stage's measured bubble beside `theoretical_bubble` (the hooks'
    PipelineClock): the same (p − 1)/(m + p − 1) as the planner's, p − 1 idle slots of m + p − 1, for GPipe and 1F1B
    alike. The measured ratio is timing, so it is compared in benchmarks/plan_ranking.py, not here."""
    from gpuwatch.trainer.hooks.pipeline import theoretical_bubble

    assert compute.bubble_fraction(pp, m) == theoretical_bubble(pp, m) == (pp - 1) / (m + pp - 1)
