"""`gpuwatch train`: the reference hybrid-parallel trainer from the command line.

This module must not import torch at import time: `gpuwatch` (the agent's CLI) loads it lazily,
and the agent runs on nodes without torch. torch comes in when the command runs, after the
options are validated, so a bad layout is rejected at once.
"""

from __future__ import annotations

import dataclasses

import click

from gpuwatch.plan.model import ModelConfig
from gpuwatch.trainer.config import (
    DEVICES,
    FAULTS,
    PRECISIONS,
    SCHEDULES,
    ConfigError,
    TrainConfig,
    gpus_present,
    torchrun_world_size,
)

MODEL_FIELDS = {"layers", "heads", "hidden", "seq_len", "vocab_size"}
DEFAULTS = TrainConfig()


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--tp", default=2, show_default=True, help="Tensor-parallel ranks (consecutive ranks, one node).")
@click.option("--pp", default=2, show_default=True, help="Pipeline stages.")
@click.option("--dp", default=2, show_default=True, help="Data-parallel replicas.")
@click.option("--micro-batches", default=8, show_default=True,
              help="Micro-batches per step and DP rank (m ≥ 4 × pp keeps the pipeline bubble under 20 %).")
@click.option("--schedule", type=click.Choice(SCHEDULES), default="1f1b", show_default=True,
              help="Pipeline schedule: gpipe (all forwards, then all backwards) or 1f1b.")
@click.option("--steps", default=DEFAULTS.steps, show_default=True, help="Train until this optimizer step.")
@click.option("--global-batch", default=DEFAULTS.global_batch, show_default=True,
              help="Sequences per optimizer step, over all DP ranks (the same work on every layout).")
@click.option("--seed", default=DEFAULTS.seed, show_default=True, help="Seeds the weights and the data.")
@click.option("--lr", default=DEFAULTS.lr, show_default=True, help="Peak AdamW learning rate.")
@click.option("--warmup-steps", default=DEFAULTS.warmup_steps, show_default=True,
              help="Linear warm-up steps before the cosine decay.")
@click.option("--weight-decay", default=DEFAULTS.weight_decay, show_default=True,
              help="AdamW weight decay (not applied to biases and norm gains).")
@click.option("--clip-grad", default=DEFAULTS.clip_grad, show_default=True,
              help="Clip the global gradient norm (after the DP reduction) to this; 0 turns it off.")
@click.option("--precision", type=click.Choice(PRECISIONS), default=DEFAULTS.precision, show_default=True,
              help="fp16 (CUDA only) adds a dynamic loss scaler.")
@click.option("--device", type=click.Choice(DEVICES), default=DEFAULTS.device, show_default=True,
              help="auto: this rank's GPU when CUDA works (NCCL), else the CPU (gloo).")
@click.option("--layers", default=ModelConfig.layers, show_default=True, help="Transformer blocks.")
@click.option("--heads", default=ModelConfig.heads, show_default=True, help="Attention heads.")
@click.option("--hidden", default=ModelConfig.hidden, show_default=True, help="Model width.")
@click.option("--seq-len", default=ModelConfig.seq_len, show_default=True, help="Tokens per sequence.")
@click.option("--vocab", "vocab_size", default=ModelConfig.vocab_size, show_default=True, help="Vocabulary size.")
@click.option("--log-jsonl", type=click.Path(dir_okay=False), help="Write one JSON object per optimizer step.")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), help="Where per-rank checkpoints go.")
@click.option("--checkpoint-every", default=0, show_default=True,
              help="Also save every N steps (a checkpoint is always saved at the end with --checkpoint-dir).")
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in --checkpoint-dir, if any.")
@click.option("--telemetry/--no-telemetry", default=True, show_default=True,
              help="Measure every rank with gpuwatch's hooks and send the records to the node agent.")
@click.option("--telemetry-socket", type=click.Path(dir_okay=False),
              help="The agent's telemetry socket.  [default: GPUWATCH_SOCKET, else the agent's well-known places]")
@click.option("--job", help="Job id the records carry.  [default: GPUWATCH_JOB, SLURM_JOB_ID, TORCHELASTIC_RUN_ID, "
              "else generated]")
@click.option("--run-log", type=click.Path(file_okay=False), metavar="DIR",
              help="Also write every record to DIR/rank-NNNNN.jsonl, for diagnosis after the run.")
@click.option("--grad-similarity-every", default=DEFAULTS.grad_similarity_every, show_default=True, metavar="N",
              help="Gradient cosine similarity between each DP rank and the DP mean every N steps (0: off).")
@click.option("--checksum-every", default=DEFAULTS.checksum_every, show_default=True, metavar="N",
              help="Parameter checksum every N steps, for comparing DP replicas (0: off).")
@click.option("--memory-every", default=DEFAULTS.memory_every, show_default=True, metavar="N",
              help="Read memory every N steps, its peak covering the steps since the last reading (0: off).")
@click.option("--fault", "faults", type=click.Choice(tuple(FAULTS)), multiple=True, metavar="NAME",
              help="Reproduce a failure on purpose, for a demo or a test of `gpuwatch diagnose` (repeatable; every "
              "rank's telemetry hello lists it): " + "; ".join(f"{name}: {what}" for name, what in FAULTS.items())
              + ".")
@click.option("--fault-rank", type=int, metavar="N",
              help="The rank --fault slow-rank, hang-rank, crash-rank or raise-rank strikes.  [default: the last "
              "rank]")
@click.option("--fault-step", type=int, default=TrainConfig.fault_step, show_default=True, metavar="N",
              help="The step --fault hang-rank, crash-rank or raise-rank strikes at (the steps before give the job "
              "a rhythm to be overdue against).")
def train(**options) -> None:
    """Train a small GPT with tensor × pipeline × data parallelism on synthetic data.

    Started directly, it forks tp × pp × dp ranks on this machine; under torchrun
    (torchrun --nproc-per-node N -m gpuwatch.trainer.cli ...) it runs as one of the job's ranks.
    Rank order: TP fastest, then DP, then PP.
    """
    model = ModelConfig(**{name: options.pop(name) for name in MODEL_FIELDS})
    cfg = TrainConfig(model=model, **options)
    world_size = torchrun_world_size()
    try:
        cfg.validate(world_size)  # at once, before torch is imported
        if cfg.device == "auto" and not _cuda_possible():  # and what only the CPU cannot do, before any rank starts
            cfg = dataclasses.replace(cfg, device="cpu")
            cfg.validate(world_size)
    except ConfigError as error:
        raise click.UsageError(str(error)) from None

    from gpuwatch.trainer.launch import RankFailed, launch, run_rank
    from gpuwatch.trainer.train import train as train_rank

    try:
        if world_size is None:
            launch(train_rank, cfg.world_size, cfg, device=cfg.device)
        else:
            run_rank(train_rank, (cfg,), cfg.device)
    except ConfigError as error:  # found inside a rank under torchrun (no GPU, bad checkpoint, ...)
        raise click.UsageError(str(error)) from None
    except RankFailed as error:
        raise click.ClickException(str(error)) from None


def _cuda_possible() -> bool:
    """Whether `--device auto` can land on a GPU: a CUDA build of torch on a machine with a GPU."""
    import torch

    return torch.version.cuda is not None and gpus_present()


if __name__ == "__main__":
    train()

