"""Stand-in for `megatron.core.parallel_state` (see ../../README.md): the calls `gpuwatch run` reads, same names and
meanings, on real torch.distributed groups built in Megatron's default order (TP fastest, then DP, then PP)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import ProcessGroup

_GROUPS: dict[str, tuple[ProcessGroup, list[int]]] = {}


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1) -> None:
    """Every rank makes every group, in the same order (new_group is collective), and keeps its own."""
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // (tp * pp)

    def at(t: int, d: int, p: int) -> int:
        return p * dp * tp + d * tp + t

    grids = {
        "tensor_model_parallel": [[at(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "data_parallel": [[at(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pipeline_model_parallel": [[at(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }
    for kind, groups in grids.items():
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                _GROUPS[kind] = (group, ranks)


def model_parallel_is_initialized() -> bool:
    return bool(_GROUPS)


def _size(kind: str) -> int:
    return len(_GROUPS[kind][1])


def _rank(kind: str) -> int:
    return _GROUPS[kind][1].index(dist.get_rank())


def get_tensor_model_parallel_group() -> ProcessGroup:
    return _GROUPS["tensor_model_parallel"][0]


def get_tensor_model_parallel_world_size() -> int:
    return _size("tensor_model_parallel")


def get_tensor_model_parallel_rank() -> int:
    return _rank("tensor_model_parallel")


def get_pipeline_model_parallel_group() -> ProcessGroup:
    return _GROUPS["pipeline_model_parallel"][0]


def get_pipeline_model_parallel_world_size() -> int:
    return _size("pipeline_model_parallel")


def get_pipeline_model_parallel_rank() -> int:
    return _rank("pipeline_model_parallel")


def get_data_parallel_group() -> ProcessGroup:
    return _GROUPS["data_parallel"][0]


def get_data_parallel_world_size() -> int:
    return _size("data_parallel")


def get_data_parallel_rank() -> int:
    return _rank("data_parallel")
