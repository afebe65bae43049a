"""``gpuwatch plan`` on the issue's example: a Llama-7B-like config.json on 64 H100s in nodes of 8, global batch 512
of 4096 tokens; text and JSON, the ranking sorted, rejections with their reasons, bad input in one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from gpuwatch.cli.main import main

LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000,
            "tie_word_embeddings": False}
EXAMPLE = ("--gpus", "64", "--gpus-per-node", "8", "--gpu", "h100-80gb", "--global-batch", "512", "--seq-len", "4096")


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_7B))
    return path


def plan(*args: str):
    return CliRunner().invoke(main, ["plan", *args])


def test_json_ranks_every_feasible_layout_and_gives_every_rejection_a_reason(config):
    result = plan("--model", str(config), *EXAMPLE, "--format", "json", "--top", "100000")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["schema"] == "gpuwatch.plan/1"
    assert document["model"]["parameters"] == 6_738_415_616
    feasible = document["feasible"]
    assert len(feasible) == document["feasible_count"] > 0
    steps = [entry["step_seconds"] for entry in feasible]
    assert steps == sorted(steps)
    assert [entry["rank"] for entry in feasible] == list(range(1, len(feasible) + 1))
    capacity = document["cluster"]["memory_bytes"]
    for entry in feasible:
        layout = entry["layout"]
        assert layout["tp"] * layout["pp"] * layout["dp"] == 64
        assert layout["tp"] <= 8
        memory = entry["memory"]
        assert memory["total"] <= capacity
        assert memory["total"] == pytest.approx(sum(memory[key] for key in (
            "parameters", "gradients", "optimizer", "activations", "embeddings_logits", "allowance")))
        assert 0 < entry["mfu"] < 1 and 0 <= entry["bubble"] < 1
        assert set(entry["communication"]) == {"tp", "cp", "pp", "dp"}
    codes = {rejection["code"] for rejection in document["rejected"]}
    assert {"memory", "tp-across-nodes", "layers", "heads"} <= codes
    assert all(rejection["reason"] for rejection in document["rejected"])
    oom = [rejection for rejection in document["rejected"] if rejection["code"] == "memory"]
    assert all(rejection["over_bytes"] > 0 and "out of memory by" in rejection["reason"] for rejection in oom)


def test_each_layout_says_what_bounds_its_step(config):
    """A layout's step is its parts (compute, the bubble, each group's exposed collectives) and the largest of them
    names what bounds it: on the example most layouts are compute-bound, those with few micro-batches bubble-bound,
    the widest TP ones TP-bound, so a user sees why the best wins."""
    result = plan("--model", str(config), *EXAMPLE, "--format", "json", "--top", "100000")
    feasible = json.loads(result.output)["feasible"]
    for row in feasible:
        parts = row["parts_seconds"]
        assert sum(parts.values()) == pytest.approx(row["step_seconds"])
        assert set(parts) == {"compute", "bubble", "tp", "cp", "pp", "dp"}
        assert row["bound"] == max(parts, key=parts.get)
    assert {row["bound"] for row in feasible} >= {"compute", "bubble", "tp"}
    assert feasible[0]["bound"] == "compute"


def test_top_limits_what_json_lists(config):
    document = json.loads(plan("--model", str(config), *EXAMPLE, "--format", "json", "--top", "3").stdout)
    assert len(document["feasible"]) == 3 < document["feasible_count"]


def test_text_shows_the_fastest_with_their_memory_and_the_rejections(config):
    result = plan("--model", str(config), *EXAMPLE, "--top", "4")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    ranked = [line for line in lines if re.match(r" *\d+  tp", line)]
    assert [int(line[:3]) for line in ranked] == [1, 2, 3, 4]
    assert sum("stage" in line and "optimizer" in line and "allowance" in line for line in lines) == 4
    assert "tp16 pp1 dp4: tp 16 spans NVLink domains of 8 GPUs" in result.stdout
    assert "tp1 pp64 dp1: 32 layers cannot fill pp 64 stages" in result.stdout
    assert "out of memory by" in result.stdout


def test_an_nvlink_domain_larger_than_a_node_lets_tensor_parallelism_span_it():
    """A 70B-class model (64 heads, 64 key/value heads) on 144 GPUs: on H100 nodes of 8, tp 16 would cross InfiniBand
    and is refused; on GB200 NVL72 (compute trays of 4 GPUs, one NVLink domain of 72) it stays on NVLink and is
    planned. The same trays without the rack's NVLink Switch (--nvlink-domain 4) refuse it again."""
    model_70b = ("--layers", "80", "--hidden", "8192", "--heads", "64", "--kv-heads", "64", "--ffn", "28672",
                 "--vocab", "128256", "--seq-len", "4096", "--global-batch", "576", "--gpus", "144")

    def layouts(*cluster: str) -> tuple[dict, dict]:
        result = plan(*model_70b, *cluster, "--format", "json", "--top", "100000")
        assert result.exit_code == 0, result.output
        document = json.loads(result.output)
        grid = (lambda row: (row["layout"]["tp"], row["layout"]["pp"], row["layout"]["dp"]))  # noqa: E731
        refused: dict[tuple[int, int, int], list[str]] = {}
        for row in document["rejected"]:
            refused.setdefault(grid(row), []).append(row["reason"])
        return {grid(row): row for row in document["feasible"]}, refused

    h100, h100_refused = layouts("--gpu", "h100-80gb", "--gpus-per-node", "8")
    nvl72, _ = layouts("--gpu", "gb200-nvl72", "--gpus-per-node", "4")
    trays, trays_refused = layouts("--gpu", "gb200-nvl72", "--gpus-per-node", "4", "--nvlink-domain", "4")
    assert not any(tp == 16 for tp, _, _ in h100)
    assert any("spans NVLink domains of 8 GPUs" in reason for reason in h100_refused[16, 1, 9])
    assert any(tp == 16 for tp, _, _ in nvl72) and not any(tp > 4 for tp, _, _ in trays)
    assert any("spans NVLink domains of 4 GPUs" in reason for reason in trays_refused[16, 1, 9])
    assert set(h100) != set(nvl72)  # where the layouts differ: the wider tensor-parallel grids


def test_a_reference_trainer_plan_knows_its_rules():
    result = plan("--reference", "--layers", "6", "--gpus", "4", "--gpus-per-node", "4", "--global-batch", "8",
                  "--format", "json", "--top", "100")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["model"]["source"] == "reference"
    assert {(r["layout"]["pp"], r["code"]) for r in document["rejected"]} >= {(4, "layers")}  # 6 layers, 4 stages


@pytest.mark.parametrize(("args", "message"), [
    (("--model", "missing.json", *EXAMPLE), "missing.json: No such file or directory"),
    (("--model", "{bad}", *EXAMPLE), "not JSON"),
    (("--model", "{partial}", *EXAMPLE), "no num_hidden_layers or n_layer"),
    (("--model", "{config}", *EXAMPLE[:5], "h999", *EXAMPLE[6:]), "unknown GPU preset 'h999'"),
    (("--model", "{config}", "--gpus", "-8", *EXAMPLE[2:]), "--gpus and --gpus-per-node must be at least 1"),
    (("--model", "{config}", "--gpus", "12", *EXAMPLE[2:]), "not a whole number of nodes"),
    (("--model", "{config}", *EXAMPLE[:7], "-1", *EXAMPLE[8:]), "--global-batch and --seq-len must be at least 1"),
    (("--model", "{config}", *EXAMPLE, "--top", "0"), "--top must be at least 1"),
    (("--model", "{config}", *EXAMPLE, "--efficiency", "abc"), "'abc' is not a valid float"),
    (("--layers", "2", *EXAMPLE), "no model: give --model config.json, --reference, or --hidden, --heads, --vocab"),
    (("--model", "{config}", "--global-batch", "8", "--seq-len", "64"), "give --gpus N, or --agent URL"),
    (("--model", "{config}", *EXAMPLE, "--agent", "http://127.0.0.1:1"), "cannot reach http://127.0.0.1:1/api/v1/state"),
])
def test_bad_input_is_one_line_and_status_2(tmp_path, config, args, message):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "partial.json").write_text(json.dumps({"hidden_size": 64}))
    files = {"{bad}": str(tmp_path / "bad.json"), "{partial}": str(tmp_path / "partial.json"),
             "{config}": str(config)}
    result = plan(*(files.get(arg, arg) for arg in args))
    assert result.exit_code == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("gpuwatch plan: ") and message in result.stderr, result.stderr
    assert isinstance(result.exception, SystemExit)  # an exit, not an exception's traceback


def test_the_planner_imports_no_torch():
    """It runs wherever gpuwatch does: the agent's nodes have no torch."""
    code = "import sys, gpuwatch.plan.cli; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.integration
def test_agents_give_the_plan_their_nodes_gpus(start_agent, config):
    """--agent reads the GPUs of real (simulated) agents' nodes: two DGX H100 nodes plan exactly as --gpus 16
    --gpus-per-node 8 --gpu h100-80gb does, and say where the figures came from; an A100 PCIe node has no preset
    (its peaks differ), so it needs --gpu, which wins over the agent's; nodes of two kinds are refused."""
    h100 = [start_agent("--simulate", "dgx-h100", "--node", f"h100-{index}") for index in range(2)]
    a100 = start_agent("--simulate", "a100-roce", "--node", "a100")
    run = ("--model", str(config), "--global-batch", "512", "--seq-len", "4096", "--format", "json")

    from_agents = plan(*run, *(flag for agent in h100 for flag in ("--agent", agent.url)))
    assert from_agents.exit_code == 0, from_agents.stderr
    assert from_agents.stdout == plan(*run, "--gpus", "16", "--gpus-per-node", "8", "--gpu", "h100-80gb").stdout
    assert from_agents.stderr == ("gpuwatch plan: 16 GPUs (NVIDIA H100 80GB HBM3), at most 8 a node, from 2 agent(s): "
                                  "planned for 16 × h100-80gb, 8 a node\n")

    no_preset = plan(*run, "--agent", a100.url)
    assert no_preset.exit_code == 2 and no_preset.stdout == ""
    assert no_preset.stderr == ("gpuwatch plan: no preset matches the agents' GPU 'NVIDIA A100-PCIE-40GB': give --gpu "
                                "(one of the presets) or --calibration\n")
    chosen = plan(*run, "--agent", a100.url, "--gpu", "a100-40gb")
    assert chosen.exit_code == 0
    assert chosen.stdout == plan(*run, "--gpus", "4", "--gpus-per-node", "4", "--gpu", "a100-40gb").stdout

    mixed = plan(*run, "--agent", h100[0].url, "--agent", a100.url)
    assert mixed.exit_code == 2
    assert "the agents' nodes hold different GPUs (NVIDIA A100-PCIE-40GB, NVIDIA H100 80GB HBM3)" in mixed.stderr
