"""``gpuwatch plan``: the command line of the planner. It reads the model, the cluster and the run from flags,
prints the plan, and turns every bad input into one line on stderr and exit status 2."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import click

from gpuwatch.plan import calibrate
from gpuwatch.plan.calibrate import CalibrationError
from gpuwatch.plan.gpus import (
    DEFAULT_EFFICIENCY,
    GEMM_EFFICIENCY,
    GIB,
    PRESETS,
    Calibration,
    Cluster,
    ClusterError,
    preset,
)
from gpuwatch.plan.model import ModelConfig, ModelError, ModelShape, from_reference, read_hf_config
from gpuwatch.plan.planner import plan as make_plan
from gpuwatch.plan.report import as_json, as_text
from gpuwatch.plan.run import PRECISIONS, Run, RunError, numerics


class OneLineCommand(click.Command):
    """A command whose usage errors (a flag's bad value, a missing one) are one line, like its own."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as error:
            fail(error.format_message(), ctx.info_name)  # the status says it: 2, as click's own usage errors


def fail(message: str, command: str | None = None) -> NoReturn:
    """One line on stderr, exit status 2, in the name of ``command`` (default: the one running, plan or
    calibrate)."""
    context = click.get_current_context(silent=True)
    name = command or (context.info_name if context else None) or "plan"
    click.echo(f"gpuwatch {name}: {message}", err=True)
    sys.exit(2)


def model_shape(model: str | None, reference: bool, seq_len: int | None, flags: dict[str, int | None]) -> ModelShape:
    """The shape from --model, --reference (the reference trainer's GPT, its ModelConfig's defaults for any
    figure not given) or the flags."""
    given = {name: value for name, value in flags.items() if value is not None}
    if model is not None:
        if given or reference:
            raise ModelError("--model reads the shape from its config.json: give neither --reference nor "
                             "--layers, --hidden, --heads, --kv-heads, --ffn, --vocab with it")
        return read_hf_config(Path(model))
    if reference:
        defaults = ModelConfig()
        return from_reference(ModelConfig(
            vocab_size=given.get("vocab", defaults.vocab_size), seq_len=seq_len or defaults.seq_len,
            hidden=given.get("hidden", defaults.hidden), heads=given.get("heads", defaults.heads),
            layers=given.get("layers", defaults.layers)))
    missing = [name for name in ("layers", "hidden", "heads", "vocab") if name not in given]
    if missing:
        raise ModelError(f"no model: give --model config.json, --reference, or --{', --'.join(missing)}")
    hidden, heads = given["hidden"], given["heads"]
    return ModelShape(layers=given["layers"], hidden=hidden, heads=heads, kv_heads=given.get("kv_heads", heads),
                      ffn=given.get("ffn", 4 * hidden), vocab=given["vocab"])


def model_options(command: Callable[..., None]) -> Callable[..., None]:
    """The model's flags, shared by `plan` and `calibrate`."""
    for option in reversed((
        click.option("--model", type=str, help="A Hugging Face config.json (Llama-style: num_hidden_layers, "
                     "hidden_size, num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, "
                     "tie_word_embeddings)."),
        click.option("--reference", is_flag=True, help="The reference trainer's GPT (gpuwatch train), with "
                     "--layers, --hidden, --heads, --vocab, --seq-len or its defaults."),
        click.option("--layers", type=int, help="Transformer layers (without --model)."),
        click.option("--hidden", type=int, help="Hidden size."),
        click.option("--heads", type=int, help="Attention heads."),
        click.option("--kv-heads", type=int, help="Key/value heads (grouped-query attention; default: --heads)."),
        click.option("--ffn", type=int, help="MLP width (default 4 × --hidden; a SwiGLU MLP with flags)."),
        click.option("--vocab", type=int, help="Vocabulary size."),
        click.option("--seq-len", type=int, help="Tokens per sequence (required but with --reference)."),
    )):
        command = option(command)
    return command


def sequence_length(shape: ModelShape, seq_len: int | None) -> int:
    length = seq_len if seq_len is not None else shape.positions or None
    if length is None:
        raise RunError("--seq-len is required")
    return length


#: The default GPU preset and node size, where neither the flags nor an agent (``gpuwatch plan --agent``) give them.
DEFAULT_GPU = "h100-80gb"
DEFAULT_GPUS_PER_NODE = 8


def plan_options(command: Callable[..., None]) -> Callable[..., None]:
    """The planner's flags: the model's, the cluster's and the run's (``gpuwatch plan``, whose command is the CLI's:
    it may also take the cluster from agents, which the planner may not import)."""
    for option in reversed((
        click.option("--gpus", type=int, default=None, help="GPUs in the job (with --agent: the agents' GPUs)."),
        click.option("--gpus-per-node", type=int, default=None,
                     help=f"[default: the agents', else {DEFAULT_GPUS_PER_NODE}]"),
        click.option("--gpu", default=None,
                     help=f"A preset: {', '.join(PRESETS)} [default: the agents', else {DEFAULT_GPU}]."),
        click.option("--nvlink-domain", type=int, default=None, metavar="GPUS",
                     help="GPUs one NVLink domain joins, where it is larger than a node (a GB200 NVL72 rack: 72); "
                          "[default: the preset's, else --gpus-per-node]"),
        click.option("--global-batch", type=int, required=True, help="Sequences per optimizer step."),
        click.option("--precision", type=click.Choice(PRECISIONS), default="bf16", show_default=True),
        click.option("--main-grads", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
                     help="Gradient dtype with bf16/fp16 (fp32: Megatron-LM's 18 bytes a parameter; bf16: ZeRO's "
                          "16)."),
        click.option("--sequence-parallel/--no-sequence-parallel", default=True, show_default=True),
        click.option("--dp-overlap", is_flag=True,
                     help="The DP reduction overlaps the last backward pass (DDP buckets)."),
        click.option("--efficiency", type=float, default=None,
                     help=f"A flat share of the peak FLOP/s for all of a layer's work (the planner's old default: "
                          f"{DEFAULT_EFFICIENCY}); default: the shape model, matmuls on the roofline at "
                          f"{GEMM_EFFICIENCY:.0%} of the peak and elementwise work at the HBM's bandwidth."),
        click.option("--flash-attention/--no-flash-attention", default=True, show_default=True,
                     help="Attention keeps no s × s scores and recomputes them in the backward pass (Dao et al. "
                          "2022)."),
        click.option("--pp-scatter-gather/--no-pp-scatter-gather", default=True, show_default=True,
                     help="Pipeline sends between nodes split over the TP group's NICs (one NIC per GPU assumed) and "
                          "all-gathered over NVLink (Narayanan et al. 2021, §4.1)."),
        click.option("--calibration", type=str, metavar="FILE",
                     help="Figures measured on the machine (gpuwatch calibrate): its matmuls' FLOP/s and bus "
                          "bandwidth per size in place of the preset's peak × --efficiency and link speeds."),
        click.option("--allowance-gib", type=float, default=2.0, show_default=True,
                     help="Memory for the CUDA context, NCCL and the like, per GPU."),
        click.option("--top", type=int, default=10, show_default=True, help="Feasible layouts shown."),
        click.option("--format", "output", type=click.Choice(["text", "json"]), default="text", show_default=True),
    )):
        command = option(command)
    return model_options(command)


def run_plan(model: str | None, reference: bool, layers: int | None, hidden: int | None, heads: int | None,
             kv_heads: int | None, ffn: int | None, vocab: int | None, seq_len: int | None, gpus: int | None,
             gpus_per_node: int | None, gpu: str | None, nvlink_domain: int | None, global_batch: int, precision: str,
             main_grads: str, sequence_parallel: bool, dp_overlap: bool, efficiency: float | None,
             flash_attention: bool, pp_scatter_gather: bool, calibration: str | None, allowance_gib: float, top: int,
             output: str) -> None:
    """``gpuwatch plan`` once its flags are read: every feasible layout ranked, every rejected one with its reason,
    as text or JSON on stdout; a bad figure is one line on stderr and exit status 2."""
    flags = {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "ffn": ffn, "vocab": vocab}
    try:
        if top < 1:
            raise RunError(f"--top must be at least 1 (got {top})")
        if gpus is None:
            raise ClusterError("give --gpus N, or --agent URL to plan for the GPUs of the agents' nodes")
        shape = model_shape(model, reference, seq_len, flags)
        length = sequence_length(shape, seq_len)
        measured = Calibration() if calibration is None else calibrate.read(Path(calibration))
        if measured.precision not in (None, precision):
            raise RunError(f"{calibration} timed {measured.precision} matmuls, and the plan is for --precision "
                           f"{precision}: give --precision {measured.precision}, or calibrate in {precision}")
        cluster = Cluster(gpus, gpus_per_node or DEFAULT_GPUS_PER_NODE, preset(gpu or DEFAULT_GPU),
                          efficiency=efficiency, calibration=measured, nvlink_domain=nvlink_domain)
        run = Run(global_batch, length, numerics(precision, main_grads == "fp32", shape.source == "reference"),
                  sequence_parallel=sequence_parallel and shape.source != "reference", dp_overlap=dp_overlap,
                  flash_attention=flash_attention, pp_scatter_gather=pp_scatter_gather,
                  allowance_bytes=int(allowance_gib * GIB))
    except (ModelError, ClusterError, RunError, CalibrationError) as error:
        fail(str(error))
    result = make_plan(shape, cluster, run)
    if output == "json":
        click.echo(json.dumps(as_json(result, top), indent=1))
    else:
        click.echo(as_text(result, top))


@click.command(cls=OneLineCommand)
@model_options
@click.option("-o", "--output", "output", type=str, required=True, metavar="FILE",
              help="The calibration file to write (gpuwatch.calibration/1).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True,
              help="The matmuls' element type (the plan's --precision must match).")
@click.option("--micro-batch-size", type=int, default=1, show_default=True,
              help="Sequences of the micro-batch whose matmul shapes give matmul_flops.")
@click.option("--tp", type=int, default=1, show_default=True, help="The TP degree the shapes are sliced by.")
@click.option("--sweep", type=str, default="1,2,4,8", show_default=True,
              help="Micro-batch sizes to sweep for flops_by_work, comma-separated ('' for none).")
@click.option("--probe", "probes", type=str, multiple=True, metavar="FILE",
              help="A gpuwatch probe --run-log file: its all-reduce bus bandwidth per size (repeatable: one "
                   "probe within a node, one across nodes).")
@click.option("--repeats", type=int, default=calibrate.REPEATS, show_default=True, help="Timed rounds (median).")
@click.option("--threads", type=int, default=1, show_default=True,
              help="CPU threads (a reference trainer rank runs one).")
def calibrate_command(model: str | None, reference: bool, layers: int | None, hidden: int | None,
                      heads: int | None, kv_heads: int | None, ffn: int | None, vocab: int | None,
                      seq_len: int | None, output: str, device: str, precision: str, micro_batch_size: int, tp: int,
                      sweep: str, probes: tuple[str, ...], repeats: int, threads: int) -> None:
    """Measure this machine for gpuwatch plan --calibration: the FLOP/s its matmuls achieve at the model's shapes
    (a micro-batch's tokens × the layer's weights, sliced by --tp), swept over micro-batch sizes, and the bus
    bandwidth per size of gpuwatch probe's results (docs/plan.md). Example: gpuwatch calibrate --reference
    --device cpu --probe probe.jsonl -o calibration.json"""
    flags = {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "ffn": ffn, "vocab": vocab}
    try:
        shape = model_shape(model, reference, seq_len, flags)
        length = sequence_length(shape, seq_len)
        sizes = [int(size) for size in sweep.split(",") if size.strip()] if sweep.strip() else []
        if min([micro_batch_size, tp, repeats, threads, *sizes]) < 1:
            raise RunError("--micro-batch-size, --tp, --repeats, --threads and the --sweep sizes must be at least 1")
        for path in probes:
            calibrate.read_probe(Path(path))  # a bad file is said before minutes of measuring
        result = calibrate.measure(calibrate.model_shapes(shape, length * micro_batch_size, tp), device, precision,
                                   repeats, threads, [Path(path) for path in probes],
                                   calibrate.sweep_shapes(shape, length, sizes, tp))
        calibrate.write(result, Path(output))
    except ValueError as error:  # ModelError, RunError, CalibrationError; a --sweep that is not integers
        fail(str(error))
    except OSError as error:
        fail(f"{output}: {error.strerror or error}")
    except RuntimeError as error:  # torch: no CUDA device, an unsupported dtype on this device
        fail(f"--device {device}: {str(error).splitlines()[0]}")
    assert result.matmul_flops is not None
    click.echo(f"{output}: matmuls {result.matmul_flops / 1e12:.3f} TFLOP/s on {device} ({precision}), "
               f"{len(result.flops_by_work)} sizes swept, links {', '.join(result.bus_bandwidth) or 'none'}")
