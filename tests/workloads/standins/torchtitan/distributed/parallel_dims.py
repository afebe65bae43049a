"""Stand-in for `torchtitan.distributed.parallel_dims` (see ../../README.md): `ParallelDims.build_mesh` makes its meshes
as torchtitan 0.3.0 does, with the real `init_device_mesh` and `DeviceMesh._unflatten`: a one-dimensional world mesh
named "world", unflattened into the data-loading mesh ("pp", "batch", "cp", "tp") and the mesh FSDP shards over
("pp", "dp_replicate", "dp_shard", "cp", "tp") (torchtitan/distributed/parallel_dims.py, `build_mesh`; torchtitan
gives degree-1 dimensions a "fake" backend, left out here: they make real groups of one rank)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh FSDP shards over (torchtitan keeps each of its meshes; the others are not needed here)."""
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        batch = self.dp_replicate * self.dp_shard
        world._unflatten(0, (self.pp, batch, self.cp, self.tp), ("pp", "batch", "cp", "tp"))
        return world._unflatten(0, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                                ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
