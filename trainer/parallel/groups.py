"""The TP × PP × DP process-group grid, built once at start-up.

Rank order: TP varies fastest, then DP, then PP:

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

    tp=2 pp=2 dp=2   rank     0 1  2 3  4 5  6 7
                     tp_rank  0 1  0 1  0 1  0 1
                     dp_rank  0 0  1 1  0 0  1 1
                     pp_rank  0 0  0 0  1 1  1 1
    TP groups {0,1} {2,3} {4,5} {6,7}   DP groups {0,2} {1,3} {4,6} {5,7}   PP groups {0,4} {1,5} {2,6} {3,7}

A TP group is `tp` consecutive ranks, and launchers put consecutive ranks on one node, so with tp at
most the GPUs per node the per-layer all-reduces (the heaviest traffic) stay on NVLink. A DP group
lies inside one pipeline stage. Pipeline send/recv and data-parallel all-reduce each get their own
groups: on one shared group a large all-reduce blocks the send/recv another stage waits on, and the job
can deadlock (diagnose rule TOPO001).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from gpuwatch.trainer.config import ConfigError
from gpuwatch.trainer.parallel import comm


def layout(tp: int, pp: int, dp: int) -> dict[str, list[list[int]]]:
    """The global ranks of every TP, DP and PP group, each listed by its own rank order."""

    def rank(t: int, d: int, p: int) -> int:
        return p * dp * tp + d * tp + t

    return {
        "tp": [[rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }


@dataclass(frozen=True)
class Grid:
    """This rank's coordinates and groups. `pp_ranks` lists the global ranks of its pipeline by stage."""

    tp: int
    pp: int
    dp: int
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: ProcessGroup
    pp_group: ProcessGroup
    dp_group: ProcessGroup
    pp_ranks: tuple[int, ...]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (only meaningful off the first stage)."""
        return self.pp_ranks[self.pp_rank - 1]

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline stage (only meaningful off the last stage)."""
        return self.pp_ranks[self.pp_rank + 1]



def build_grid(tp: int, pp: int, dp: int) -> Grid:
    """Create every group on every rank (new_group is collective and must run in the same order)."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if tp * pp * dp != world_size:
        raise ConfigError(f"--tp {tp} × --pp {pp} × --dp {dp} = {tp * pp * dp}, but the job has {world_size} ranks")
    mine: dict[str, tuple[ProcessGroup, list[int]]] = {}
    for kind, groups in layout(tp, pp, dp).items():
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = (group, ranks)
    # NCCL builds a communicator on a group's first collective, and batch_isend_irecv may only be that first
    # call when every rank of the group joins it; a barrier per pipeline makes sure it is not.
    comm.barrier(mine["pp"][0])
    return Grid(
        tp=tp, pp=pp, dp=dp, rank=rank,
        tp_rank=mine["tp"][1].index(rank), pp_rank=mine["pp"][1].index(rank), dp_rank=mine["dp"][1].index(rank),
        tp_group=mine["tp"][0], pp_group=mine["pp"][0], dp_group=mine["dp"][0],
        pp_ranks=tuple(mine["pp"][1]),
    )
