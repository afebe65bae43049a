"""Stand-in for `torchtitan.distributed.parallel_dims` (see ../../README.md): `ParallelDims.build_mesh` makes the world
mesh as torchtitan does, with the real `init_device_mesh`, torchtitan's dimension names and order."""

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
        sizes = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        kept = [(size, name) for size, name in zip(sizes, names, strict=True) if size > 1]
        return init_device_mesh(device_type, tuple(size for size, _ in kept),
                                mesh_dim_names=tuple(name for _, name in kept))
