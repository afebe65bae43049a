"""A plain DistributedDataParallel training script, instrumented with gpuwatch's hooks.

Nothing here comes from gpuwatch's reference trainer: a small language model, a DataLoader with a
DistributedSampler, AdamW and DDP, as in any PyTorch tutorial. The lines marked `# gpuwatch` are
all it takes to see every rank's step time, compute time, data-loader wait, all-reduce latency,
memory, loss, gradient agreement across ranks and FLOP/s in Prometheus:

    gpuwatch agent &                                                   # once per node
    torchrun --nproc-per-node 2 examples/ddp_train.py --steps 200      # CPU (gloo) or one GPU per rank (NCCL)
    curl -s localhost:9746/metrics | grep gpuwatch_train_

With GPUWATCH_RUN_LOG=runs/ (or `hooks.Monitor(..., run_log="runs/")`) every rank also keeps its records
in runs/rank-NNNNN.jsonl, agent or not, for `gpuwatch diagnose --run-log runs/` after the job.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from gpuwatch.trainer import hooks


class TinyLM(nn.Module):
    """Embedding, a few MLP blocks, a head: next-token prediction without attention, small enough for a CPU."""

    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def train(device: torch.device, steps: int = 50, batch: int = 8, seq_len: int = 32, vocab: int = 256,
          width: int = 64, depth: int = 2, measure_every: int = 10) -> list[float]:
    """Train on a random token stream (shifted by one for targets); returns this rank's losses.
    Call it once the default process group exists (torchrun, or gpuwatch's fork launcher)."""
    torch.manual_seed(0)
    tokens = torch.randint(vocab, (steps * batch * dist.get_world_size(), seq_len + 1))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=False))
    model = TinyLM(vocab, width, depth).to(device)
    matmul_params = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embed."))
    model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    monitor = hooks.Monitor(model, flops_per_token=6 * matmul_params,  # gpuwatch (MLPs only: no attention term)
                            grad_similarity_every=measure_every, checksum_every=measure_every,
                            memory_every=measure_every)
    losses = []
    for inputs, targets in monitor.data(loader):  # gpuwatch: times the wait for each batch
        with monitor.step(tokens=inputs.numel(), samples=len(inputs)) as step:  # gpuwatch
            inputs, targets = inputs.to(device), targets.to(device)
            with step.compute():  # gpuwatch
                loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
                loss.backward()
            with step.optimizer():  # gpuwatch
                grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step.report(loss=loss.detach(), grad_norm=grad_norm, lr=optimizer.param_groups[0]["lr"])  # gpuwatch
        losses.append(loss.detach())
    monitor.close()  # gpuwatch: sends the last steps
    return [loss.item() for loss in losses]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    losses = train(device, steps=args.steps)
    if dist.get_rank() == 0:
        print(f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
