"""A user's tensor × data parallel script that knows nothing of gpuwatch (no import of it), on 4 ranks as tp=2 × dp=2:
each tensor-parallel pair computes a row-parallel linear layer (each rank holds half of the input features and of
the weight; the partial outputs are summed by an all-reduce over the pair), and each data-parallel pair averages its
gradients by an all-reduce, by hand, before SGD steps. No DistributedDataParallel model: from outside, the layout is
known only where the job's framework tells it, or the user does (``gpuwatch run --layout 2,1,2``).

``--groups`` says who makes the process groups, as a framework would:

* ``plain``: the script itself, with ``dist.new_group``, in the order TP fastest, then DP;
* ``megatron``: ``megatron.core.parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)``;
* ``torchtitan``: torchtitan's ``ParallelDims(...).build_mesh("cpu")``, a device mesh ("dp_shard", "tp").

The last two import the frameworks' modules: their stand-ins in tests/workloads/standins/ (on PYTHONPATH).

    gpuwatch run --layout 2,1,2 -- torchrun --standalone --nproc-per-node 4 tests/workloads/parallel_layouts.py
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from clean_exit import run_then_exit
from torch import nn
from torch.distributed import ProcessGroup

TP = 2
FEATURES = 8


def groups(kind: str) -> tuple[ProcessGroup, ProcessGroup]:
    """This rank's tensor- and data-parallel groups, made the way `kind` makes them."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // TP
    if kind == "megatron":
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
        return parallel_state.get_tensor_model_parallel_group(), parallel_state.get_data_parallel_group()
    if kind == "torchtitan":
        from torchtitan.distributed.parallel_dims import ParallelDims

        mesh = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=TP, pp=1, world_size=world).build_mesh("cpu")
        return mesh.get_group("tp"), mesh.get_group("dp_shard")
    mine: dict[str, ProcessGroup] = {}
    for name, members in (("tp", [[d * TP + t for t in range(TP)] for d in range(dp)]),
                          ("dp", [[d * TP + t for d in range(dp)] for t in range(TP)])):
        for ranks in members:
            group = dist.new_group(ranks)  # every rank makes every group, in the same order
            if rank in ranks:
                mine[name] = group
    return mine["tp"], mine["dp"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups", choices=("plain", "megatron", "torchtitan"), default="plain")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tp_group, dp_group = groups(args.groups)
    tp_rank, dp_rank, dp = dist.get_rank(tp_group), dist.get_rank(dp_group), dist.get_world_size(dp_group)
    torch.manual_seed(tp_rank)  # the weight's shard: the same on every replica
    layer = nn.Linear(FEATURES // TP, 1, bias=False)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(dp_rank)  # each replica its own data, the same within a TP pair
    target = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(99))
    for step in range(args.steps):
        inputs = torch.randn(16, FEATURES, generator=generator)
        half = inputs[:, tp_rank * FEATURES // TP:(tp_rank + 1) * FEATURES // TP]
        partial = layer(half)
        summed = partial.detach().clone()
        dist.all_reduce(summed, group=tp_group)
        output = partial + (summed - partial.detach())  # the sum forward, the identity backward: row-parallel
        loss = F.mse_loss(output, inputs @ target)
        loss.backward()
        for param in layer.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad, group=dp_group)
            param.grad /= dp
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and step % 4 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)
