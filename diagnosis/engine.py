"""Runs the selected rules over the facts: findings, and the rules that could not run with the reason."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

from gpuwatch.diagnosis import rules as _catalogue  # noqa: F401 - importing registers every rule
from gpuwatch.diagnosis.facts import Facts, RankFacts, describe_ranks
from gpuwatch.diagnosis.registry import FAMILIES, REGISTRY, Evidence, Finding, Rule

log = logging.getLogger(__name__)

#: Catalogue order of the families' code prefixes (as the README's Diagnosis section lists them): listings and
#: reports follow it. Every rule's code has one (``registry.Rule`` holds it to its family's).
PREFIX_ORDER = tuple(FAMILIES.values())

Overrides = Mapping[str, Mapping[str, float]]


class SelectionError(ValueError):
    """A --select/--ignore code that matches no rule."""


class ConfigError(ValueError):
    """A config file that cannot be read or names unknown rules or thresholds."""


def _order(code: str) -> tuple[int, str]:
    prefix = code.rstrip("0123456789")
    return PREFIX_ORDER.index(prefix), code


def catalogue() -> list[Rule]:
    """Every registered rule, in catalogue order."""
    return [REGISTRY[code] for code in sorted(REGISTRY, key=_order)]


def _matching(prefixes: Iterable[str]) -> set[str]:
    codes: set[str] = set()
    for prefix in prefixes:
        prefix = prefix.strip().upper()
        if not prefix:
            continue
        matched = set(REGISTRY) if prefix == "ALL" else {code for code in REGISTRY if code.startswith(prefix)}
        if not matched:
            raise SelectionError(f"unknown rule selector {prefix!r} (codes: {', '.join(r.code for r in catalogue())})")
        codes |= matched
    return codes


def select(select: Iterable[str] | None = None, ignore: Iterable[str] | None = None) -> list[Rule]:
    """Rules whose code starts with a ``select`` prefix (all when none given), minus the ``ignore``d ones,
    as a linter's ``--select``/``--ignore``."""
    chosen = _matching(select) if select else set(REGISTRY)
    chosen -= _matching(ignore or ())
    return [rule for rule in catalogue() if rule.code in chosen]


def load_config(path: Path) -> dict[str, dict[str, float]]:
    """Threshold overrides from a YAML file::

        thresholds:
          PERF002: {straggler_ratio: 1.5}
          PERF001: {max_bubble_ratio: 0.25}
    """
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not set(data) <= {"thresholds"}:
        raise ConfigError(f"{path}: expected a mapping with one key, 'thresholds'")
    overrides: dict[str, dict[str, float]] = {}
    for code, values in (data.get("thresholds") or {}).items():
        rule = REGISTRY.get(str(code).upper())
        if rule is None:
            raise ConfigError(f"{path}: unknown rule {code!r}")
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: thresholds of {code} must be a mapping of name: number")
        for name, value in values.items():
            if name not in rule.thresholds:
                known = ", ".join(rule.thresholds) or "none"
                raise ConfigError(f"{path}: {rule.code} has no threshold {name!r} (it has: {known})")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{path}: {rule.code}.{name} must be a finite number, got {value!r}")
            overrides.setdefault(rule.code, {})[name] = float(value)
    return overrides


@dataclasses.dataclass(frozen=True)
class Skipped:
    code: str
    reason: str
    #: "facts" (a need unmet), "source" (the source could not answer: a timeout, a partial answer) or "fetch" (what
    #: the source fetched cannot show what the rule judges)
    cause: str = "facts"


@dataclasses.dataclass
class Report:
    facts: Facts
    findings: list[Finding]
    ran: list[str]
    skipped: list[Skipped]

    @property
    def notes(self) -> list[str]:
        """The sources' notes, then what the ranks' instrumentation said in its hellos."""
        return [*self.facts.notes, *_hello_notes(self.facts)]


def _failure(rule: Rule, error: Exception) -> Finding:
    """A rule that raised: a finding at the rule's own severity, so that ``--fail-on`` cannot pass a job the rule
    never judged (a crashing critical rule is no all-clear)."""
    text = f"{type(error).__name__}: {error}"
    return Finding(rule.code, rule.family, rule.severity, f"rule {rule.code} failed and could not judge: {text}",
                   (Evidence(f"{rule.code} ({rule.title}) raised {text}", values={"exception": type(error).__name__}),),
                   "report it as a gpuwatch bug with the `--format json` report and `gpuwatch --version`; meanwhile "
                   f"check by hand what {rule.code} checks (gpuwatch diagnose --explain {rule.code})",
                   "A rule that failed has not cleared the facts it was meant to judge.")


def run(facts: Facts, rules: Iterable[Rule] | None = None, overrides: Overrides | None = None) -> Report:
    """Run ``rules`` (default: all) on ``facts``. A rule whose needs are unmet is skipped with the reason; its
    findings would rest on missing facts. A rule that raises becomes a finding of its own severity, with the
    exception: one broken rule costs neither the rest of the report nor the exit status."""
    findings: list[Finding] = []
    ran: list[str] = []
    skipped: list[Skipped] = []
    for rule in catalogue() if rules is None else rules:
        unjudged = facts.unjudged.get(rule.code)
        if unjudged is not None:
            skipped.append(Skipped(rule.code, unjudged.reason, "source" if unjudged.source else "fetch"))
            continue
        reason = rule.missing(facts)
        if reason is not None:
            skipped.append(Skipped(rule.code, reason))
            continue
        ran.append(rule.code)
        try:
            issues = list(rule.check(facts, rule.params((overrides or {}).get(rule.code))))
        except Exception as exc:  # one broken rule must not cost the rest of the report
            log.debug("rule %s failed", rule.code, exc_info=True)
            findings.append(_failure(rule, exc))
            continue
        findings += [Finding(rule.code, rule.family, min(rule.severity, issue.severity or rule.severity), issue.title,
                             issue.evidence, issue.fix, issue.reason) for issue in issues]
    findings.sort(key=lambda finding: (-finding.severity, _order(finding.code)))
    return Report(facts, findings, ran, skipped)


def _hello_notes(facts: Facts) -> list[str]:
    """Each job's ranks' hello notes, a line per note with the ranks that sent it: "job J, ranks 0-7: …"."""
    by_note: dict[tuple[str, str], list[RankFacts]] = {}
    for rank in facts.ranks:
        for note in rank.hello_notes:
            by_note.setdefault((rank.job, note), []).append(rank)
    return [f"job {job}, {describe_ranks(ranks)}: {note}" for (job, note), ranks in by_note.items()]
