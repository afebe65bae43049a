"""Training hooks: measure every rank's steps inside training and send them to the node agent.

A plain DistributedDataParallel script (the DDP model gets a communication hook that times its
all-reduces and measures gradient agreement):

    monitor = hooks.Monitor(model, flops_per_token=hooks.transformer_flops_per_token(n, layers, width, seq),
                            run_log="runs/")                      # optional: every record in runs/rank-NNNNN.jsonl too
    for inputs, targets in monitor.data(loader):                  # data-loader wait
        with monitor.step(tokens=inputs.numel(), samples=len(inputs)) as step:
            with step.compute():                                  # forward + backward, minus waits on collectives
                loss = F.cross_entropy(model(inputs), targets); loss.backward()
            with step.optimizer():
                optimizer.step(); optimizer.zero_grad()
            step.report(loss=loss, lr=scheduler.get_last_lr()[0])  # tensors are read later, without a sync
    monitor.close()

Per step and rank this sends step time and its parts, collective latency per op (a histogram) and
the time spent waiting on collectives, pipeline bubble (with a `PipelineClock` in the schedule), memory
(CUDA allocator, or peak host RSS on the CPU), loss / gradient norm / non-finite flags / loss scale /
learning rate, gradient cosine similarity and a parameter checksum every N steps (and why not, when
one was due and could not be had), tokens, samples, model FLOP/s and MFU; once per rank a `hello`
with its layout, process groups and their backends, build, GPU and environment. Records follow
`gpuwatch.protocol.schema`; `examples/ddp_train.py` is a complete script, and
`gpuwatch.trainer.train` instruments the reference TP × PP × DP trainer.

Nothing here blocks the training loop or raises into it: CUDA timings are events read once the
device is past them, records are built, encoded and sent on the telemetry client's thread, and a
failure inside the hooks is counted (`Monitor.failures`) and logged once.
"""

from gpuwatch.trainer.hooks.flops import PEAK_FLOPS, peak_flops, transformer_flops_per_token
from gpuwatch.trainer.hooks.gradients import GradientSimilarity, cosine, parameter_checksum
from gpuwatch.trainer.hooks.identity import Layout, resolve_job
from gpuwatch.trainer.hooks.monitor import DEFAULT_EVERY, SIGNALS, Monitor
from gpuwatch.trainer.hooks.off import OFF
from gpuwatch.trainer.hooks.pipeline import PipelineClock, theoretical_bubble
from gpuwatch.trainer.hooks.step import Step

__all__ = [
    "DEFAULT_EVERY",
    "OFF",
    "PEAK_FLOPS",
    "SIGNALS",
    "GradientSimilarity",
    "Layout",
    "Monitor",
    "PipelineClock",
    "Step",
    "cosine",
    "parameter_checksum",
    "peak_flops",
    "resolve_job",
    "theoretical_bubble",
    "transformer_flops_per_token",
]
