"""The rule registry, after ruff's: every rule has a stable code, a family, a severity and a title, and lives
in one function registered with ``@rule``. The decorator also records the facts the rule needs (so the
engine can say why a rule did not run), its named thresholds (overridable from a config file), its cluster-scale
coverage (``coverage.py``: how the outlier fetch finds the nodes it must read; a rule without one is refused) and its
explanation (the function's docstring, shown by ``--explain``).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from gpuwatch.diagnosis.coverage import CoveragePart, WholeJob
from gpuwatch.diagnosis.facts import Facts, Where

#: Each family's code prefix, in catalogue order (``engine.PREFIX_ORDER``): a code names its family (``--select HW``
#: selects the hardware rules).
FAMILIES = {
    "network config": "NCCL",
    "hardware": "HW",
    "performance": "PERF",
    "memory": "MEM",
    "convergence": "CONV",
    "topology": "TOPO",
    "hangs": "HANG",
    "plan": "PLAN",
}


class Severity(enum.IntEnum):
    """Ordered, so ``--fail-on warning`` means warning or worse."""

    INFO = 1
    WARNING = 2
    CRITICAL = 3

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclasses.dataclass(frozen=True)
class Need:
    """A fact a rule cannot work without. ``available`` returns None when present, else why it is not."""

    name: str
    available: Callable[[Facts], str | None]


@dataclasses.dataclass(frozen=True)
class Threshold:
    value: float
    #: Where the number comes from (a public source, a reported case, a measurement, or why it was chosen).
    source: str


@dataclasses.dataclass(frozen=True)
class Evidence:
    text: str
    where: Where = dataclasses.field(default_factory=Where)
    #: The numbers behind the text, by name (docs/diagnose-report.schema.json): a number, a string, None, or a
    #: list of them (the ranks waiting for a straggler, the signs of a model that does not learn).
    values: Mapping[str, float | int | str | list[int] | list[str] | None] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Issue:
    """What a rule yields: a one-line title, the evidence, the fix and the reason for it in a sentence.
    ``severity`` lowers the rule's own where the evidence is weaker than the rule assumes (it says why)."""

    title: str
    evidence: tuple[Evidence, ...]
    fix: str
    reason: str
    severity: Severity | None = None


@dataclasses.dataclass(frozen=True)
class Finding:
    """An issue stamped with its rule's code, family and severity, as the report shows it."""

    code: str
    family: str
    severity: Severity
    title: str
    evidence: tuple[Evidence, ...]
    fix: str
    reason: str


Check = Callable[[Facts, types.SimpleNamespace], Iterable[Issue]]

#: Where `gpuwatch report` shows a rule's evidence: the ranks table, the step-time heatmap, the phases, the
#: collectives, the pipeline bubble, the hang timeline, the training curves or the memory view.
View = Literal["ranks", "heatmap", "phases", "collectives", "bubble", "hang", "curves", "memory"]
VIEWS: tuple[View, ...] = typing.get_args(View)


@dataclasses.dataclass(frozen=True)
class Rule:
    code: str
    family: str
    severity: Severity
    title: str
    needs: tuple[Need, ...]
    thresholds: Mapping[str, Threshold]
    explanation: str
    check: Check
    #: How the outlier fetch finds the nodes or jobs it must read for this rule (``coverage.py``).
    coverage: tuple[CoveragePart, ...]
    #: The report view its evidence is seen in.
    view: View = "ranks"

    def __post_init__(self) -> None:
        prefix = FAMILIES.get(self.family)
        if prefix is None:
            raise ValueError(f"rule {self.code}: family {self.family!r} is none of {', '.join(FAMILIES)}")
        if not (self.code.startswith(prefix) and self.code[len(prefix):].isdigit()):
            raise ValueError(f"rule {self.code}: a {self.family} rule's code is {prefix} and a number")
        if self.view not in VIEWS:
            raise ValueError(f"rule {self.code}: view {self.view!r} is none of {', '.join(VIEWS)}")
        if not self.coverage:
            raise ValueError(f"rule {self.code} declares no coverage: without one, the outlier fetch would judge it "
                             "only on the nodes it reads for other rules")
        if any(isinstance(part, WholeJob) for part in self.coverage) and len(self.coverage) > 1:
            raise ValueError(f"rule {self.code}: WholeJob coverage stands alone (the outlier fetch does not run a "
                             "rule that needs every rank, so a selector beside it would pick nodes for nothing)")

    def params(self, overrides: Mapping[str, float] | None = None) -> types.SimpleNamespace:
        """The thresholds as attributes, config overrides applied."""
        values = {name: threshold.value for name, threshold in self.thresholds.items()}
        values.update(overrides or {})
        return types.SimpleNamespace(**values)

    def missing(self, facts: Facts) -> str | None:
        """Why the rule cannot run on these facts, or None."""
        reasons = dict.fromkeys(reason for need in self.needs if (reason := need.available(facts)) is not None)
        return "; ".join(reasons) if reasons else None


#: Every rule by code, filled by importing ``gpuwatch.diagnosis.rules``.
REGISTRY: dict[str, Rule] = {}


def rule(
    code: str,
    *,
    family: str,
    severity: Severity,
    title: str,
    needs: Iterable[Need] = (),
    thresholds: Mapping[str, Threshold] | None = None,
    coverage: Iterable[CoveragePart] = (),
    view: View = "ranks",
) -> Callable[[Check], Check]:
    """Register ``check`` as rule ``code``; a duplicate code, a code without its family's prefix or a rule without
    ``coverage`` is a programming error (``coverage`` is required; it defaults to none so that the error names the
    rule)."""

    def register(check: Check) -> Check:
        if code in REGISTRY:
            raise ValueError(f"rule code {code} registered twice")
        if not check.__doc__:
            raise ValueError(f"rule {code} needs a docstring: it is the --explain text")
        REGISTRY[code] = Rule(code, family, severity, title, tuple(needs), dict(thresholds or {}),
                              inspect.cleandoc(check.__doc__), check, tuple(coverage), view)
        return check

    return register
