"""The rules' thresholds table in docs/runbook.md, generated from their declarations (``@rule(..., thresholds=...,
needs=...)``): each rule with a threshold, its thresholds' values and the facts it needs, so that the runbook never
restates a number a rule holds. ``python -m gpuwatch.diagnosis.docs`` rewrites the table between its markers;
``--check`` exits 1 with one line when the committed file is stale (a test runs it), as ``gpuwatch alerts generate
--check`` does for the alert rules. Each threshold's source is the rule's ``--explain``."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from gpuwatch.diagnosis import rules  # noqa: F401 - registers every rule
from gpuwatch.diagnosis.registry import REGISTRY

#: The runbook, in a checkout (docs/ is not packaged).
RUNBOOK = Path(__file__).resolve().parents[1] / "docs" / "runbook.md"
BEGIN = ("<!-- BEGIN rule thresholds: generated from each rule's @rule(...) by "
         "`python -m gpuwatch.diagnosis.docs`; edit the rule, not this table -->")
END = "<!-- END rule thresholds -->"


def _value(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def table() -> str:
    """One row per rule with thresholds: code and title, each threshold as name = value, and what it needs."""
    rows = ["| Rule | Thresholds (`--explain CODE` gives each one's source) | Needs |", "|---|---|---|"]
    for code, rule in REGISTRY.items():
        if rule.thresholds:
            values = ", ".join(f"`{name}` = {_value(t.value)}" for name, t in rule.thresholds.items())
            rows.append(f"| {code} {rule.title} | {values} | {', '.join(need.name for need in rule.needs) or '–'} |")
    return "\n".join(rows)


def render(text: str) -> str:
    """``text`` with the table between its markers replaced by the current one."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the runbook has no {BEGIN!r} ... {END!r} markers")
    return f"{text[:start]}{BEGIN}\n{table()}\n{text[end:]}"


def stale(path: Path = RUNBOOK) -> str | None:
    """Why ``path`` does not hold the current table (one line), or None when it does."""
    text = path.read_text(encoding="utf-8")
    if render(text) != text:
        return (f"{path}'s rule thresholds differ from the rules' declarations: "
                "run python -m gpuwatch.diagnosis.docs")
    return None


def main(argv: Sequence[str] = ()) -> int:
    if list(argv) == ["--check"]:
        problem = stale()
        print(problem or f"{RUNBOOK} is fresh", file=sys.stderr if problem else sys.stdout)
        return 1 if problem else 0
    if argv:
        print("usage: python -m gpuwatch.diagnosis.docs [--check]", file=sys.stderr)
        return 2
    RUNBOOK.write_text(render(RUNBOOK.read_text(encoding="utf-8")), encoding="utf-8")
    print(RUNBOOK)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
