"""A process group's members as a label value (`protocol.ranks`): runs at a stride, read back exactly."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwatch.protocol.ranks import MAX_MEMBERS_CHARS, members_text, parse_members
from gpuwatch.trainer.parallel.groups import layout


@given(st.lists(st.integers(0, 100_000), max_size=64, unique=True))
def test_any_list_of_ranks_reads_back_as_it_was(ranks):
    text = members_text(ranks)
    if text is not None:
        assert parse_members(text) == tuple(ranks)
        assert len(text) <= MAX_MEMBERS_CHARS


@pytest.mark.parametrize(("ranks", "text"), [
    ([0, 1, 2, 3], "0-3"),
    ([0, 4, 8, 12, 13], "0-12/4,13"),
    ([3, 1], "3,1"),  # the group's order, not sorted
    ([5, 6], "5,6"),  # a run is three or more
    ([7], "7"),
])
def test_runs_at_a_stride(ranks, text):
    assert members_text(ranks) == text


@pytest.mark.parametrize(("tp", "pp", "dp"), [(2, 2, 2), (8, 16, 64)])
def test_every_group_of_a_parallel_layout_is_one_run_or_a_pair_whatever_its_size(tp, pp, dp):
    for kind, groups in layout(tp, pp, dp).items():
        for members in groups:
            text = members_text(list(members))
            assert text is not None and text.count(",") <= (len(members) == 2), (kind, members, text)


def test_a_list_too_long_for_a_label_is_not_exported():
    assert members_text([n * n for n in range(200)]) is None  # no two steps alike: no run


@pytest.mark.parametrize("text", ["1-", "4-2", "0-5/2", "3/2", "a", "0-4/0"])
def test_anything_else_is_refused(text):
    with pytest.raises(ValueError):
        parse_members(text)
