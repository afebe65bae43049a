"""The GPU acceptance kit's job for the frameworks that need CUDA to run at all (torchtitan, Megatron-core): a small
model trained a few steps on NCCL, with the parallel groups made by the framework, under `gpuwatch run`. No gpuwatch
import: what is checked is what `gpuwatch run` sees from outside (the framework named, the layout read from its
groups, every optimizer step, the collectives timed).

    gpuwatch run --run-log DIR -- torchrun --standalone --nproc-per-node N benchmarks/gpu_framework_job.py \\
        --framework megatron|torchtitan [--steps 5]

* megatron: `megatron.core.parallel_state.initialize_model_parallel()` (tp = pp = 1: data parallel over every rank),
  a DistributedDataParallel MLP over Megatron's data-parallel group;
* torchtitan: `torchtitan.distributed.ParallelDims` with every rank in `dp_shard`, its world mesh, and FSDP2's
  `fully_shard` over it, as torchtitan's own FSDP path applies it.
"""

from __future__ import annotations

import argparse
import inspect
import os

import torch
import torch.distributed as dist
from torch import nn


def megatron_model(model: nn.Module) -> nn.Module:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    return nn.parallel.DistributedDataParallel(model, process_group=parallel_state.get_data_parallel_group())


def torchtitan_model(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torchtitan.distributed import ParallelDims

    world = dist.get_world_size()
    sizes = {"dp_replicate": 1, "dp_shard": world, "cp": 1, "tp": 1, "pp": 1, "ep": 1, "etp": 1,
             "world_size": world}
    accepted = inspect.signature(ParallelDims).parameters  # its fields have grown over releases
    dims = ParallelDims(**{name: size for name, size in sizes.items() if name in accepted})
    mesh = dims.build_mesh(device_type="cuda") if hasattr(dims, "build_mesh") else dims.world_mesh
    return fully_shard(model, mesh=mesh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--framework", choices=("megatron", "torchtitan"), required=True)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
    model = megatron_model(model) if args.framework == "megatron" else torchtitan_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(args.steps):
        inputs = torch.randn(32, 256, device="cuda")
        nn.functional.mse_loss(model(inputs), inputs).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
