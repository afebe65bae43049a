"""The TP × PP × DP grid: documented rank order, and groups that really contain those ranks."""

import pytest
import torch
import torch.distributed as dist

from gpuwatch.trainer.launch import RankFailed, launch
from gpuwatch.trainer.parallel.groups import build_grid, layout


def test_layout_matches_the_documented_example():
    assert layout(tp=2, pp=2, dp=2) == {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    }


@pytest.mark.parametrize(("tp", "pp", "dp"), [(1, 1, 1), (4, 1, 2), (2, 4, 1), (8, 2, 4), (1, 3, 2)])
def test_every_kind_of_group_partitions_the_ranks_and_tp_groups_are_consecutive(tp, pp, dp):
    world = tp * pp * dp
    groups = layout(tp, pp, dp)
    for kind, size in (("tp", tp), ("pp", pp), ("dp", dp)):
        assert sorted(r for g in groups[kind] for r in g) == list(range(world))
        assert all(len(g) == size for g in groups[kind])
    assert all(g == list(range(g[0], g[0] + tp)) for g in groups["tp"])  # one node holds a TP group
    pp_of = {rank: stage for g in groups["pp"] for stage, rank in enumerate(g)}
    assert all(len({pp_of[r] for r in g}) == 1 for g in groups["dp"])  # a DP group stays in one stage


def _members(device):
    """Who is in each of my groups, found by an all-reduce over that very group."""
    grid = build_grid(tp=2, pp=2, dp=2)
    found = {}
    for kind, group in (("tp", grid.tp_group), ("pp", grid.pp_group), ("dp", grid.dp_group)):
        mask = torch.zeros(dist.get_world_size())
        mask[grid.rank] = 1
        dist.all_reduce(mask, group=group)
        found[kind] = mask.nonzero().flatten().tolist()
    neighbours = (grid.prev_rank if not grid.is_first_stage else None,
                  grid.next_rank if not grid.is_last_stage else None)
    separate = grid.pp_group is not grid.dp_group and grid.pp_group is not grid.tp_group
    return grid.rank, (grid.tp_rank, grid.pp_rank, grid.dp_rank), found, neighbours, separate


def test_groups_on_eight_ranks_hold_the_ranks_the_layout_promises():
    expected = layout(2, 2, 2)
    for rank, (tp_rank, pp_rank, dp_rank), found, neighbours, separate in launch(_members, 8, device="cpu",
                                                                                 timeout=120):
        assert rank == pp_rank * 4 + dp_rank * 2 + tp_rank
        for kind in ("tp", "pp", "dp"):
            assert found[kind] in expected[kind] and rank in found[kind]
        pipeline = found["pp"]
        assert neighbours == ((pipeline[0], None) if pp_rank == 1 else (None, pipeline[1]))
        assert separate  # pipeline and data-parallel traffic never share a group (a shared one can deadlock: TOPO001)


def _wrong_grid(device):
    build_grid(tp=2, pp=2, dp=1)


def test_a_grid_that_does_not_fill_the_world_is_refused_with_a_message_not_a_traceback():
    with pytest.raises(RankFailed, match="= 4, but the job has 2 ranks") as failure:
        launch(_wrong_grid, 2, device="cpu", timeout=60)
    assert "Traceback" not in failure.value.details
