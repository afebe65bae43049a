"""The planner's pipeline schedules, compute model and pipeline sends against their formulas (structure and
proportion: no timing).

* Interleaved 1F1B (Narayanan et al. 2021, arXiv:2104.04473, §2.2.2): bubble (p − 1)/(v·m) of the ideal time, v
  times the point-to-point traffic, and on the first stage p + (p − 1)/v stages' worth of activations — Megatron-LM's
  estimator's penalty 1 + (p − 1)/(pv) (megatron/training/theoretical_memory_usage.py).
* ZB-V (Qi et al. 2024, arXiv:2401.10241; torch.distributed.pipelining.ScheduleZBVZeroBubble): no bubble with
  m ≥ p, two chunks a rank in a V (the first rank holds the first and the last), 1F1B's first-stage activations on
  every rank.
* The shape model: each matmul on the roofline (Williams et al. 2009), elementwise work at the HBM's bandwidth.
* Pipeline sends split over TP: sequence parallelism, or Narayanan et al. §4.1's scatter/gather between nodes.
"""

from dataclasses import replace

import pytest

from gpuwatch.plan import compute
from gpuwatch.plan.comm import boundary_transfers
from gpuwatch.plan.gpus import GEMM_EFFICIENCY, Cluster, preset
from gpuwatch.plan.memory import in_flight
from gpuwatch.plan.model import ModelShape
from gpuwatch.plan.planner import plan, predict, schedules, variants
from gpuwatch.plan.run import Layout, Run, numerics

SHAPE = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000, tied_embeddings=False)
H100 = preset("h100-80gb")
A100 = preset("a100-80gb")
RUN = Run(256, 4096, numerics("bf16"))


def gpt(layers: int, hidden: int, heads: int) -> ModelShape:
    return ModelShape(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=51200,
                      tied_embeddings=True, gated=False, norm_params=2, bias=True, positions=2048)


@pytest.mark.parametrize(("schedule", "v", "expected"), [
    ("1f1b", 1, 3 / (8 + 3)), ("gpipe", 1, 3 / (8 + 3)), ("interleaved_1f1b", 2, 3 / (16 + 3)),
    ("interleaved_1f1b", 4, 3 / (32 + 3)), ("zbv_zero_bubble", 2, 0.0)])
def test_the_step_is_the_ideal_compute_over_one_minus_the_schedules_bubble(schedule, v, expected):
    """tp 1: a slot is the slowest stage's compute, and the step is m slots / (1 − bubble) plus the sends and the
    DP reduction: m + p − 1 slots under 1F1B, m + (p − 1)/v interleaved, m under ZB-V."""
    layout = Layout(1, 4, 2, 8, schedule, virtual_stages=v)
    prediction = predict(SHAPE, Cluster(8, 8, H100), RUN, layout)
    assert prediction.bubble == pytest.approx(expected)
    assert prediction.bubble == pytest.approx(compute.schedule_bubble(schedule, 4, 8, v))
    pipeline = prediction.step_seconds - prediction.exposed["pp"] - prediction.exposed["dp"]
    assert pipeline == pytest.approx(prediction.compute_seconds / (1 - expected))


def test_interleaving_cuts_the_bubble_by_v_and_multiplies_the_sends_by_v():
    p, m = 4, 8
    plain = predict(SHAPE, Cluster(8, 8, H100), RUN, Layout(1, p, 2, m))
    for v in (2, 4):
        interleaved = predict(SHAPE, Cluster(8, 8, H100), RUN, Layout(1, p, 2, m, "interleaved_1f1b", virtual_stages=v))
        ideal = compute.bubble_fraction(p, m) / (1 - compute.bubble_fraction(p, m))  # (p − 1)/m
        assert interleaved.bubble / (1 - interleaved.bubble) == pytest.approx(ideal / v)  # (p − 1)/(v·m)
        for stage in range(1, p - 1):  # inner stages: v times the sends and receives
            assert interleaved.stages[stage].traffic.pp_bytes - 4 == v * (plain.stages[stage].traffic.pp_bytes - 4)
        # the edge stages: their first (last) chunk has no previous (next) one
        assert boundary_transfers(interleaved.layout, 0) == boundary_transfers(interleaved.layout, p - 1) == 4 * v - 2


@pytest.mark.parametrize(("p", "v", "m"), [(4, 2, 8), (8, 4, 16), (16, 2, 32), (4, 2, 2)])
def test_interleaved_first_stage_holds_megatrons_penalty(p, v, m):
    """Megatron-LM's estimator: the first stage holds p micro-batches × (1 + (p − 1)/(pv)) with m ≥ p; we count
    min(v·m, 2(p − 1) + (v − 1)p + 1) chunks of 1/v stage, the same when v·m is the larger."""
    layout = Layout(1, p, 1, m, "interleaved_1f1b", virtual_stages=v)
    if v * m >= 2 * (p - 1) + (v - 1) * p + 1:
        assert in_flight(layout, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))
    else:
        assert in_flight(layout, 0) == m
    assert in_flight(replace(layout, virtual_stages=1), 0) == min(m, p)  # v = 1 is 1F1B
    assert all(in_flight(layout, k) >= in_flight(layout, k + 1) for k in range(p - 1))


def test_zbv_runs_a_v_with_the_head_on_the_first_rank_and_1f1bs_memory_everywhere():
    p = 4
    layout = Layout(1, p, 2, 8, "zbv_zero_bubble")
    assert layout.chunks == 2 and layout.last_stage == 0
    assert [layout.chunk_stage(c) for c in range(2 * p)] == [0, 1, 2, 3, 3, 2, 1, 0]
    # twice 1F1B's sends and receives on every rank (two chunks each); the turn at rank p − 1 stays local
    assert [boundary_transfers(layout, k) for k in range(p)] == [2 * boundary_transfers(Layout(1, p, 2, 8), k)
                                                               for k in range(p)] == [4, 8, 8, 4]
    assert [in_flight(layout, k) for k in range(p)] == [p] * p
    prediction = predict(SHAPE, Cluster(8, 8, H100), RUN, layout)
    plain = predict(SHAPE, Cluster(8, 8, H100), RUN, Layout(1, p, 2, 8))
    head = SHAPE.head_parameters(1, 1).on_rank(1)
    assert prediction.stages[0].parameters == plain.stages[0].parameters + head
    assert prediction.stages[p - 1].parameters == plain.stages[p - 1].parameters - head
    assert prediction.stages[0].memory.embeddings_logits > plain.stages[0].memory.embeddings_logits


def test_tied_embeddings_need_no_embedding_all_reduce_when_zbv_puts_both_ends_on_one_rank():
    shape = gpt(8, 1024, 16)
    run = Run(64, 2048, numerics("bf16"))
    zbv = predict(shape, Cluster(8, 8, H100), run, Layout(1, 4, 2, 8, "zbv_zero_bubble")).stages[0]
    plain = predict(shape, Cluster(8, 8, H100), run, Layout(1, 4, 2, 8)).stages[0]
    activation = 2048 * 4 * 1024 * 2  # s·b·h, 16-bit
    assert zbv.traffic.pp_bytes == 8 * 4 * activation + 4
    assert plain.traffic.pp_bytes == 8 * 2 * activation + 4 + shape.vocab * 1024 * 4  # sends + the embedding's


def test_the_planner_searches_interleaved_and_zero_bubble_schedules_where_they_apply():
    assert list(schedules(32, 1, 8)) == [("1f1b", 1), ("gpipe", 1)]
    assert list(schedules(32, 4, 2)) == [("1f1b", 1), ("gpipe", 1)]  # m < p
    assert list(schedules(32, 4, 8)) == [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2),
                                         ("interleaved_1f1b", 4), ("interleaved_1f1b", 8), ("zbv_zero_bubble", 2)]
    # Llama 3 405B: 126 layers over 16 stages, 7 or 8 a stage
    assert [v for schedule, v in schedules(126, 16, 32) if schedule == "interleaved_1f1b"] == [2, 4, 7]
    found = {(layout.schedule, layout.virtual_stages) for layout in variants(Layout(1, 4, 2), RUN, SHAPE.layers)}
    assert ("interleaved_1f1b", 8) in found and ("zbv_zero_bubble", 2) in found
    assert not any(layout.recompute == "selective" for layout in variants(Layout(1, 4, 2), RUN, SHAPE.layers))
    assert any(layout.recompute == "selective"
               for layout in variants(Layout(1, 4, 2), replace(RUN, flash_attention=False), SHAPE.layers))
    best = plan(SHAPE, Cluster(32, 8, H100, efficiency=None), RUN).feasible
    assert {p.layout.schedule for p in best} >= {"1f1b", "gpipe", "interleaved_1f1b", "zbv_zero_bubble"}
    assert "interleaved_1f1b v" in next(p.layout.name for p in best if p.layout.schedule == "interleaved_1f1b")


# --- the shape model ------------------------------------------------------------------------------------------------

def test_a_matmul_runs_on_the_roofline():
    rate, bandwidth = 312e12 * GEMM_EFFICIENCY, 2039e9
    big = compute.gemm_seconds(8192, 8192, 8192, rate, bandwidth, 2)
    assert big == 2 * 8192**3 / rate  # compute-bound
    # one head's QKᵀ at s 2048, head dimension 128: 2·s²·d FLOPs over (2sd + s²)·2 bytes (114 a byte), below
    # H100's ridge (989 TFLOP/s × the efficiency over 3.35 TB/s: 207)
    rate, bandwidth = H100.peak_flops["bf16"] * GEMM_EFFICIENCY, H100.memory_bandwidth
    qk = compute.gemm_seconds(2048, 128, 2048, rate, bandwidth, 2)
    assert qk == pytest.approx((2048 * 128 * 2 + 2048 * 2048) * 2 / bandwidth)
    assert qk > 2 * 2048 * 128 * 2048 / rate


def test_bigger_layers_reach_a_bigger_share_of_the_peak():
    """Narayanan et al. 2021, Table 1's trend (44 % of the peak at h 2,304, 52 % at h 25,600): elementwise bytes grow
    with h, matmul FLOPs with h²."""
    rate = A100.peak_flops["bf16"] * GEMM_EFFICIENCY
    shares = []
    for layers, hidden, heads, tp in [(24, 2304, 24, 1), (40, 6144, 48, 8), (128, 25600, 160, 8)]:
        shape = gpt(layers, hidden, heads)
        seconds = compute.stage_seconds(shape, 2048, 1, 1, False, tp, False, "full", False, 2, rate,
                                        A100.memory_bandwidth)
        flops = compute.stage_flops_per_token(shape, 2048, 1, False, "full", flash_attention=False) * 2048 / tp
        shares.append(flops / seconds / A100.peak_flops["bf16"])
    assert shares == sorted(shares) and shares[-1] < GEMM_EFFICIENCY
    assert shares[0] < 0.8 * GEMM_EFFICIENCY


def test_elementwise_bytes_follow_the_ops_and_what_tp_and_sequence_parallelism_split():
    shape, s = gpt(1, 4096, 32), 2048
    whole, split = 10 * 4096 * 2 + 2 * 4096, 2 * 4 * 4096 * 2
    scores = 4 * 32 * s * 2 + 32 * s
    assert compute.layer_elementwise_bytes(shape, s, 1, False) == whole + split
    assert compute.layer_elementwise_bytes(shape, s, 1, False, flash_attention=False) == whole + split + scores
    assert compute.layer_elementwise_bytes(shape, s, 8, False) == whole + split / 8
    assert compute.layer_elementwise_bytes(shape, s, 8, True) == (whole + split) / 8


def test_the_cli_plans_with_the_shape_model_and_a_flat_efficiency_only_when_asked():
    cluster = Cluster(8, 8, H100, efficiency=None)
    assert cluster.shape_model and cluster.achieved_flops("bf16") == H100.peak_flops["bf16"] * GEMM_EFFICIENCY
    flat = Cluster(8, 8, H100, efficiency=0.5)
    assert not flat.shape_model
    layout = Layout(1, 1, 8, 1)
    slow, fast = (predict(SHAPE, Cluster(8, 8, H100, efficiency=e), RUN, layout) for e in (0.25, 0.5))
    assert slow.compute_seconds == pytest.approx(2 * fast.compute_seconds)  # flat: inversely proportional


# --- pipeline sends split over TP -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("sequence_parallel", "scatter_gather", "per_node", "split"), [
    (False, True, 8, True), (False, False, 8, False), (True, False, 8, True), (False, True, 64, False)])
def test_pipeline_sends_split_over_the_tp_ranks_where_they_can(sequence_parallel, scatter_gather, per_node, split):
    """Each TP rank sends 1/t of the activation: with sequence parallelism always, else between nodes with the
    scatter/gather (one NIC per GPU); within a node (per_node 64: the whole job) the whole activation."""
    run = replace(RUN, sequence_parallel=sequence_parallel, pp_scatter_gather=scatter_gather)
    layout = Layout(8, 2, 4, 8)
    stage = predict(SHAPE, Cluster(64, per_node, H100), run, layout).stages[0]
    activation = 4096 * 256 // (4 * 8) * 4096 * 2  # s·b·h of one micro-batch, 16-bit
    assert stage.traffic.pp_bytes == 8 * 2 * (activation / 8 if split else activation) + 4
    if split and not sequence_parallel:  # the receiving stage all-gathers the slices over NVLink
        whole = predict(SHAPE, Cluster(64, per_node, H100), replace(run, pp_scatter_gather=False), layout).stages[0]
        assert stage.traffic.tp_bytes == whole.traffic.tp_bytes + 8 * 1 * activation / 8
        assert stage.traffic.pp_seconds < whole.traffic.pp_seconds / 4
