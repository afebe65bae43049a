"""A process group's members as one short label value, for the exposition: what Prometheus needs to tell two
ranks' groups of one name apart (a pipeline's DP groups are all called "dp") and to say who is missing.

Runs of three or more ranks at a fixed stride, as ``first-last/stride`` (``0-12/4`` is 0, 4, 8, 12; ``/1`` left
out), joined by commas: a group of a tensor × pipeline × data parallel layout is one run (or a pair), whatever the
job's size, and any other list still reads back exactly. A list whose text would exceed
MAX_MEMBERS_CHARS is not exported: the rules then work without those members, as they do for a group no hello
lists.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_MEMBERS_CHARS = 256


def members_text(ranks: Sequence[int]) -> str | None:
    """``[0, 4, 8, 12, 13]`` -> ``"0-12/4,13"``: runs of three or more at one stride, the rest one by one, in
    the group's order (its ranks' places in it). None when longer than MAX_MEMBERS_CHARS."""
    parts: list[str] = []
    start = 0
    while start < len(ranks):
        end = start + 1  # ranks[start:end] is the run so far
        if start + 2 < len(ranks):
            stride = ranks[start + 1] - ranks[start]
            while stride > 0 and end < len(ranks) and ranks[end] - ranks[end - 1] == stride:
                end += 1
            if end - start < 3:
                end = start + 1
        if end - start == 1:
            parts.append(str(ranks[start]))
        else:
            stride = ranks[start + 1] - ranks[start]
            parts.append(f"{ranks[start]}-{ranks[end - 1]}" + (f"/{stride}" if stride != 1 else ""))
        start = end
    text = ",".join(parts)
    return text if len(text) <= MAX_MEMBERS_CHARS else None


def parse_members(text: str) -> tuple[int, ...]:
    """The ranks of `members_text`'s text, in order. ValueError for anything else."""
    ranks: list[int] = []
    for part in text.split(",") if text else ():
        span, _, stride = part.partition("/")
        first, dash, last = span.partition("-")
        step = int(stride) if stride else 1
        if not dash:
            if stride:
                raise ValueError(f"a stride without a run: {part!r}")
            ranks.append(int(first))
            continue
        if step <= 0 or int(last) < int(first) or (int(last) - int(first)) % step:
            raise ValueError(f"not a run of ranks: {part!r}")
        ranks.extend(range(int(first), int(last) + 1, step))
    return tuple(ranks)
