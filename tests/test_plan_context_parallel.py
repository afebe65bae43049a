"""Context parallelism in the planner: what a rank holds and sends under ring attention (Liu et al. 2023,
arXiv:2310.01889; Megatron-LM's --context-parallel-size), worked out by hand here, and when the planner finds it
pays: for 128K-token sequences, not for 4K ones."""

from dataclasses import replace

import pytest

from gpuwatch.plan.comm import stage_traffic
from gpuwatch.plan.gpus import Cluster, preset
from gpuwatch.plan.memory import stage_memory
from gpuwatch.plan.model import ModelShape
from gpuwatch.plan.planner import plan, predict, structural
from gpuwatch.plan.run import MIN_CONTEXT_TOKENS, Layout, Run, numerics

#: Llama 3 8B's shape (Dubey et al. 2024, arXiv:2407.21783, Table 3): grouped-query attention, 8 key/value heads.
LLAMA3_8B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
H100 = preset("h100-80gb")


def test_a_rank_keeps_one_cp_th_of_the_activations_and_the_same_weights():
    run = Run(8, 32768, numerics("bf16"))
    whole = stage_memory(LLAMA3_8B, run, Layout(2, 1, 1, 1), 0, 32, 10**9)
    split = stage_memory(LLAMA3_8B, run, Layout(2, 1, 1, 1, cp=4), 0, 32, 10**9)
    assert split.activations == pytest.approx(whole.activations / 4)
    assert split.embeddings_logits == pytest.approx(whole.embeddings_logits / 4)
    assert (split.parameters, split.gradients, split.optimizer) == (whole.parameters, whole.gradients, whole.optimizer)
    sharded = stage_memory(LLAMA3_8B, run, Layout(2, 1, 1, 1, zero1=True, cp=4), 0, 32, 10**9)
    assert sharded.optimizer == pytest.approx(whole.optimizer / 4)  # ZeRO-1 over the DP × CP ranks


def test_the_ring_moves_each_other_ranks_keys_and_values_three_passes_a_layer():
    """cp 4, tp 2, one sequence of 32,768 tokens in 2 micro-batches of 1: a key/value chunk is 2 (K and V) × 1,024
    (8 heads × 128) × 8,192 tokens / 2 TP × 2 bytes = 16 MiB; each layer receives 3 of the other ranks' chunks in each
    of 3 passes (forward, and keys with their gradients backward)."""
    run = Run(2, 32768, numerics("bf16"))
    layout = Layout(2, 1, 1, 2, cp=4)
    chunk = 2 * 1024 * 8192 // 2 * 2
    assert chunk == 16 * 2**20
    traffic = stage_traffic(LLAMA3_8B, run, layout, Cluster(8, 8, H100), 0, 32, 10**9)
    assert traffic.cp_bytes == 2 * 32 * 3 * 3 * chunk
    recomputed = stage_traffic(LLAMA3_8B, run, replace(layout, recompute="full"), Cluster(8, 8, H100), 0, 32, 10**9)
    assert recomputed.cp_bytes == traffic.cp_bytes * 4 // 3  # the recomputed forward passes them again
    assert stage_traffic(LLAMA3_8B, run, Layout(2, 1, 4, 2), Cluster(8, 8, H100), 0, 32, 10**9).cp_bytes == 0


def test_the_attention_hides_the_ring_at_long_sequences_and_not_at_short_ones():
    """A chunk's attention grows with its tokens squared, its transfer with its tokens: over InfiniBand (a ring of 4
    nodes, TP 8 inside each) the attention hides 32K-token chunks' transfers whole, and not 512-token chunks'."""
    cluster = Cluster(32, 8, H100)
    long = predict(LLAMA3_8B, cluster, Run(4, 131072, numerics("bf16")), Layout(8, 1, 1, 4, cp=4))
    short = predict(LLAMA3_8B, cluster, Run(4, 2048, numerics("bf16")), Layout(8, 1, 1, 4, cp=4))
    assert long.traffic_bytes["cp"] > 0 and long.exposed["cp"] == 0.0
    assert short.exposed["cp"] > 0.0


def test_the_planner_picks_context_parallelism_for_128k_token_sequences_only():
    cluster = Cluster(64, 8, H100)
    long = plan(LLAMA3_8B, cluster, Run(16, 131072, numerics("bf16")))
    assert long.feasible and long.feasible[0].layout.cp > 1
    whole = [prediction for prediction in long.feasible if prediction.layout.cp == 1]
    # 128K tokens a rank fit only when every layer is recomputed: a third more work than the ring's
    assert whole and {prediction.layout.recompute for prediction in whole} == {"full"}
    assert whole[0].step_seconds > long.feasible[0].step_seconds
    assert long.feasible[0].layout.recompute == "none"
    assert any(r.layout.cp == 1 and r.layout.recompute == "none" and r.code == "memory" for r in long.rejected)
    searched = {c for c in (1, 2, 4, 8, 16, 32, 64) if 131072 // c >= MIN_CONTEXT_TOKENS}
    assert {p.layout.cp for p in long.feasible} == searched == {1, 2, 4, 8, 16, 32}
    assert "cp" in long.feasible[0].layout.grid

    short = plan(LLAMA3_8B, cluster, Run(256, 4096, numerics("bf16")))
    assert short.feasible and {p.layout.cp for p in short.feasible} == {1}  # not searched: 4K tokens pay no ring
    assert "cp" not in short.feasible[0].layout.grid


@pytest.mark.parametrize(("run", "code"), [
    (Run(8, 32768, numerics("bf16"), flash_attention=False), "cp-attention"),
    (Run(8, 32764, numerics("bf16")), "cp-sequence"),
])
def test_a_ring_needs_flash_attention_and_a_sequence_in_2cp_equal_chunks(run, code):
    assert [found for found, _ in structural(LLAMA3_8B, run, Cluster(8, 8, H100), 1, 1, 2, 4)] == [code]
    assert structural(LLAMA3_8B, run, Cluster(8, 8, H100), 1, 1, 8, 1) == []
