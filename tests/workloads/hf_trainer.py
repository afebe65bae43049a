"""A user's Hugging Face ``Trainer`` job that knows nothing of gpuwatch, its first import ``transformers`` (as most
Hugging Face scripts begin): a tiny Llama (2 layers, hidden 32, vocabulary 128) built from its config, trained as a
causal LM on synthetic token sequences (framework_job.Tokens) on 2 CPU ranks with gloo, with gradient accumulation
(2 micro-batches of 4 per optimizer step), an evaluation every 4 steps and a checkpoint (``save_strategy="steps"``)
every 4 steps to a temporary directory, the loss logged every step, ``report_to="none"``, nothing downloaded.

    gpuwatch run -- torchrun --standalone --nproc-per-node 2 tests/workloads/hf_trainer.py --steps 12

The framework's own per-step loss (``--out``) is what the Trainer logs (``on_log``'s ``logs["loss"]``, every step):
per rank, the sum of the step's micro-batch losses as ``training_step`` returns them (each already divided by the
accumulation: a token-weighted share of the step's mean), then all-gathered and averaged over the ranks; every rank
writes the same list, and the evaluations and checkpoints the Trainer made (``on_evaluate``, ``on_save``).

Faults (framework_job.FAULTS): ``slow-data`` in the data set's ``__getitem__``; ``slow-compute`` in a forward
pre-hook of the model's embedding (inside the model's forward); ``slow-outside`` in a ``TrainerCallback``'s
``on_step_end``; ``slow-optimizer`` in the optimizer's ``step`` (``optimizer_cls_and_kwargs``); ``--never-learns``:
``learning_rate=0``.
"""

from __future__ import annotations

# isort: split
import transformers  # the first import, before torch: the way Hugging Face scripts begin

# isort: split
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from clean_exit import run_then_exit
from framework_job import Fault, Tokens, parameters_hash, parser, slow_optimizer, write_results

MICRO_BATCH, ACCUMULATE, EVAL_EVERY = 4, 2, 4


class SlowCallback(transformers.TrainerCallback):
    """``slow-outside``: a callback that takes its time after every optimizer step (on_step_end)."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault

    def on_step_end(self, args, state, control, **kwargs):
        self.fault.sleep("outside")


class LoggedLosses(transformers.TrainerCallback):
    """The loss the Trainer logs at each optimizer step (logging_steps=1), and how many evaluations and checkpoints
    it made."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.evaluations = self.checkpoints = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])

    def on_evaluate(self, args, state, control, **kwargs):
        self.evaluations += 1

    def on_save(self, args, state, control, **kwargs):
        self.checkpoints += 1


def main() -> object:
    args = parser(__doc__).parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fault = Fault(args, rank)
    # the same directory on every rank (torchrun gives them one run id), gone at the end
    output = os.path.join(tempfile.gettempdir(), f"hf-trainer-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    model.model.embed_tokens.register_forward_pre_hook(
        lambda module, inputs: fault.sleep("compute", ACCUMULATE) if module.training else None)
    lr = 0.0 if fault.never_learns else 1e-3
    training = transformers.TrainingArguments(
        output_dir=output, max_steps=args.steps, per_device_train_batch_size=MICRO_BATCH,
        per_device_eval_batch_size=MICRO_BATCH, gradient_accumulation_steps=ACCUMULATE,
        learning_rate=lr, logging_steps=1, eval_strategy="steps",
        eval_steps=EVAL_EVERY, save_strategy="steps", save_steps=EVAL_EVERY, save_total_limit=1, report_to="none",
        use_cpu=True, ddp_backend="gloo", disable_tqdm=True, log_level="warning", dataloader_num_workers=0, seed=0)
    logged = LoggedLosses()
    trainer = transformers.Trainer(
        model=model, args=training,
        train_dataset=Tokens(args.steps * ACCUMULATE * MICRO_BATCH * world, fault, MICRO_BATCH * ACCUMULATE, True),
        eval_dataset=Tokens(MICRO_BATCH * world, as_dict=True), callbacks=[SlowCallback(fault), logged],
        optimizer_cls_and_kwargs=(slow_optimizer(torch.optim.AdamW, fault), {"lr": lr}))
    trainer.train()
    write_results(args.out, rank, logged.losses, parameters_hash(trainer.model.parameters()),
                  evaluations=logged.evaluations, checkpoints=logged.checkpoints)
    if dist.is_initialized():
        dist.barrier()
        if rank == 0:
            shutil.rmtree(output, ignore_errors=True)
        dist.destroy_process_group()
    return trainer


if __name__ == "__main__":
    run_then_exit(main)
