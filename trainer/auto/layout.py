"""The job's parallel layout, as a rank measured from outside (`gpuwatch run`) can learn it, best source first:

1. `gpuwatch run --layout tp,pp,dp` (LAYOUT_VARIABLE): the user says it. Only sizes are given, so the ranks are
   taken in the order Megatron-LM (its default `order="tp-cp-ep-dp-pp"`), torchtitan's mesh
   `("pp", "dp_replicate", "dp_shard", "cp", "tp")` and gpuwatch's reference trainer all use: TP fastest, then DP,
   then PP (`gpuwatch.trainer.parallel.groups.layout`).
2. Megatron's parallel state, where `megatron.core.parallel_state` is already imported and
   `model_parallel_is_initialized()`: `get_tensor_model_parallel_world_size/_rank/_group`,
   `get_pipeline_model_parallel_world_size/_rank/_group`, `get_data_parallel_world_size/_rank/_group`
   (https://docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/parallel_state.html). Nothing is imported
   here: a job that does not use Megatron never loads it.
3. A device mesh spanning the world made by `torch.distributed.device_mesh.init_device_mesh` or unflattened from
   one (`DeviceMesh._unflatten`: torchtitan 0.3.0's `ParallelDims` unflattens a one-dimensional "world" mesh into
   its named dimensions), the latest first (`mesh_dim_names` among "pp", "dp_replicate", "dp_shard", "dp", "batch"
   (torchtitan's data-loading dimension, dp_replicate × dp_shard), "tp", and any other of size 1;
   https://docs.pytorch.org/docs/stable/distributed.html#torch.distributed.device_mesh.init_device_mesh). The
   AutoMonitor wraps both and hands the meshes they returned here; the groups come from the mesh's
   own rank grid, so no order is assumed. A one-dimensional mesh without names over the world is data parallel:
   it is the mesh FSDP2's `fully_shard` makes when given none (its default `(world_size,)` mesh shards the model
   over every rank, each rank a replica's shard fed its own data).
4. A DistributedDataParallel model over every rank: plain data parallelism, the Monitor's default layout.

None of these: the layout is unknown (`None`), and the hello says so ("layout" in `unavailable_from_outside`).
A layout whose sizes do not multiply to the world size (context or expert parallelism, a mesh dimension of
another name) is no layout of the Monitor's kind (tp × pp × dp), and is unknown too, rather than half right; the
hello then says in a line what could not be placed (its `notes`), so the user can give `--layout`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpuwatch.trainer.auto import LAYOUT_VARIABLE, parse_layout
from gpuwatch.trainer.hooks.identity import Layout
from gpuwatch.trainer.parallel.groups import layout as grid_groups

log = logging.getLogger("gpuwatch.trainer.auto")

MEGATRON_STATE = "megatron.core.parallel_state"
#: A mesh dimension's name → the Layout dimension it counts toward (torchtitan's names, and the plain ones).
MESH_DIMENSIONS: Mapping[str, str] = {"tp": "tp", "pp": "pp", "dp": "dp", "dp_replicate": "dp", "dp_shard": "dp",
                                      "batch": "dp"}


def detect_layout(model: nn.Module, meshes: Sequence[Any] = (), environ: Mapping[str, str] = os.environ,
                  modules: Mapping[str, Any] = sys.modules,
                  notes: list[str] | None = None) -> tuple[Layout | None, str]:
    """The job's layout, seen from this rank once a process group exists, and where it came from ("option",
    "megatron", "device_mesh", "ddp"; "unknown" with None). What was found but could not be placed is added to
    `notes`, a line each."""
    notes = notes if notes is not None else []
    world, rank = dist.get_world_size(), dist.get_rank()
    local_rank = int(environ.get("LOCAL_RANK", "0"))
    option = environ.get(LAYOUT_VARIABLE)
    if option:
        tp, pp, dp = parse_layout(option)
        if tp * pp * dp == world:
            return _from_sizes(tp, pp, dp, rank, world, local_rank), "option"
        notes.append(f"--layout {option} multiplies to {tp * pp * dp}, but the job has {world} ranks: layout unknown")
        log.warning("gpuwatch run: %s", notes[-1])
        return None, "unknown"
    state = modules.get(MEGATRON_STATE)
    if state is not None and state.model_parallel_is_initialized():
        found = _from_megatron(state, rank, world, local_rank)
        if found is not None:
            return found, "megatron"
        notes.append("Megatron's parallel state has sizes that do not multiply to the world size "
                     "(context or expert parallelism): layout unknown")
    for mesh in reversed(meshes):  # the latest mesh over the whole world: torchtitan's world mesh
        found = _from_mesh(mesh, rank, world, local_rank)
        if found is not None:
            return found, "device_mesh"
    if isinstance(model, nn.parallel.DistributedDataParallel) and dist.get_world_size(model.process_group) == world:
        return Layout.data_parallel(), "ddp"
    notes += [f"a device mesh over the {world} ranks with dimensions {_shape_text(mesh)} is no tp × pp × dp "
              "layout: layout unknown (give gpuwatch run --layout)" for mesh in meshes if mesh.mesh.numel() == world]
    return None, "unknown"


def _from_sizes(tp: int, pp: int, dp: int, rank: int, world: int, local_rank: int) -> Layout:
    """Sizes in the order TP fastest, then DP, then PP; every group made by the job itself, on the default backend."""
    mine = {kind: next(members for members in groups if rank in members)
            for kind, groups in grid_groups(tp, pp, dp).items()}
    return _layout(rank, world, local_rank, {"tp": tp, "pp": pp, "dp": dp},
                   {kind: members.index(rank) for kind, members in mine.items()},
                   {kind: tuple(members) for kind, members in mine.items()},
                   dict.fromkeys(mine, dist.get_backend()))


def _from_megatron(state: Any, rank: int, world: int, local_rank: int) -> Layout | None:
    """From Megatron's parallel-state getters (the data-parallel ones without context parallelism, their default)."""
    getters = {"tp": "tensor_model_parallel", "pp": "pipeline_model_parallel", "dp": "data_parallel"}
    sizes = {kind: int(getattr(state, f"get_{name}_world_size")()) for kind, name in getters.items()}
    if sizes["tp"] * sizes["pp"] * sizes["dp"] != world:
        return None
    groups = {kind: getattr(state, f"get_{name}_group")() for kind, name in getters.items()}
    return _layout(rank, world, local_rank, sizes,
                   {kind: int(getattr(state, f"get_{name}_rank")()) for kind, name in getters.items()},
                   {kind: tuple(dist.get_process_group_ranks(group)) for kind, group in groups.items()},
                   {kind: dist.get_backend(group) for kind, group in groups.items()})


def _from_mesh(mesh: Any, rank: int, world: int, local_rank: int) -> Layout | None:
    """From a DeviceMesh over every rank whose dimensions are all of MESH_DIMENSIONS (or of size 1): each kind's
    members are the ranks of the mesh's grid that differ from this rank only along that kind's dimensions."""
    grid: torch.Tensor = mesh.mesh
    names: tuple[str, ...] = tuple(mesh.mesh_dim_names or ()) or (("dp",) if grid.dim() == 1 else ())
    coordinate = mesh.get_coordinate()
    if grid.numel() != world or len(names) != grid.dim() or coordinate is None:
        return None
    if any(name not in MESH_DIMENSIONS and size > 1 for name, size in zip(names, grid.shape, strict=True)):
        return None
    sizes = {kind: 1 for kind in ("tp", "pp", "dp")}
    ranks = dict.fromkeys(sizes, 0)
    kinds = [MESH_DIMENSIONS.get(name) for name in names]
    for kind, size, place in zip(kinds, grid.shape, coordinate, strict=True):
        if kind is not None:  # dp_replicate then dp_shard: the replicate index is the slower one
            ranks[kind] = ranks[kind] * size + place
            sizes[kind] *= size
    members = {kind: _along(grid, coordinate, [k == kind for k in kinds]) for kind in sizes}
    return _layout(rank, world, local_rank, sizes, ranks, members, dict.fromkeys(sizes, dist.get_backend()))


def _shape_text(mesh: Any) -> str:
    """A mesh's dimensions as "(dp_shard=2, cp=2)", or its sizes where it names none."""
    sizes = tuple(mesh.mesh.shape)
    names = tuple(mesh.mesh_dim_names or ())
    if len(names) != len(sizes):
        return str(sizes)
    return "(" + ", ".join(f"{name}={size}" for name, size in zip(names, sizes, strict=True)) + ")"


def _along(grid: torch.Tensor, coordinate: Sequence[int], free: Iterable[bool]) -> tuple[int, ...]:
    """The ranks of `grid` at `coordinate` in every dimension not `free`, any index in the free ones."""
    index = tuple(slice(None) if is_free else place for place, is_free in zip(coordinate, free, strict=True))
    return tuple(int(r) for r in grid[index].flatten().tolist())


def _layout(rank: int, world: int, local_rank: int, sizes: Mapping[str, int], ranks: Mapping[str, int],
            members: Mapping[str, tuple[int, ...]], backends: Mapping[str, str]) -> Layout:
    return Layout(rank=rank, world_size=world, local_rank=local_rank, tp_size=sizes["tp"], pp_size=sizes["pp"],
                  dp_size=sizes["dp"], tp_rank=ranks["tp"], pp_stage=ranks["pp"], dp_rank=ranks["dp"],
                  process_groups=dict(members), backends=dict(backends))
