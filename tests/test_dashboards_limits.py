"""The dashboards draw the diagnose rules' thresholds: each rule threshold that dashboards/limits.py reads, changed in
the registry, changes the generated dashboards (a panel that wrote the number out instead would not move)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import re
from collections.abc import Iterator
from types import ModuleType

import pytest

from gpuwatch.dashboards import DASHBOARDS, limits
from gpuwatch.dashboards.generate import render
from gpuwatch.diagnosis.registry import REGISTRY, Threshold

THRESHOLDS = [(code, name) for code, rule in sorted(REGISTRY.items()) for name in rule.thresholds]


def _reloaded() -> list[ModuleType]:
    """limits.py and every dashboard module imported afresh, so that they read the registry as it is now."""
    return [importlib.reload(module) for module in
            (limits, *(importlib.import_module(f"gpuwatch.dashboards.{name}") for name in DASHBOARDS))]


def _limits() -> dict[str, object]:
    return {name: value for name, value in vars(limits).items() if name.isupper()}


def _dashboards() -> dict[str, str]:
    return {name: render(name) for name in DASHBOARDS}


@contextlib.contextmanager
def _perturbed(code: str, name: str) -> Iterator[None]:
    """One registry threshold changed (doubled; 1 where it is 0) and the dashboards reloaded; undone on leaving."""
    try:
        with pytest.MonkeyPatch.context() as patch:
            rule = REGISTRY[code]
            old = rule.thresholds[name]
            patch.setitem(REGISTRY, code, dataclasses.replace(
                rule, thresholds={**rule.thresholds, name: Threshold(old.value * 2 or 1, old.source)}))
            _reloaded()
            yield
    finally:
        _reloaded()


@pytest.fixture(scope="module")
def perturbed() -> dict[tuple[str, str], tuple[set[str], dict[str, str]]]:
    """{(rule code, threshold name): (the limits.py names that move with it, every dashboard's JSON with it moved)}."""
    baseline = _limits()
    found = {}
    for code, name in THRESHOLDS:
        with _perturbed(code, name):
            found[(code, name)] = ({limit for limit, value in _limits().items() if value != baseline[limit]},
                                   _dashboards())
    return found


def _steps(dashboard: str) -> Iterator[tuple[str, str, list[float]]]:
    """(title, description, threshold step values) of every panel of a dashboard's JSON."""
    for panel in json.loads(dashboard)["panels"]:
        steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])
        yield panel["title"], panel.get("description", ""), [step["value"] for step in steps if step["value"]]


def test_every_limit_read_from_a_rule_reaches_a_dashboard(perturbed):
    baseline = _dashboards()
    reached = {pair: {board for board, text in boards.items() if text != baseline[board]}
               for pair, (moved, boards) in perturbed.items() if moved}
    assert reached, "limits.py reads no rule threshold"
    assert {pair: boards for pair, boards in reached.items() if not boards} == {}, \
        "a limit read from a rule is drawn nowhere"


def test_no_panel_naming_a_rule_draws_a_copy_of_its_threshold(perturbed):
    """With a threshold changed, its old value is gone from the limits of the panels naming its rule: where it stays,
    the panel wrote the number out instead of reading it from dashboards/limits.py."""
    copies = []
    for (code, name), (_, boards) in perturbed.items():
        old = REGISTRY[code].thresholds[name].value
        for board, text in boards.items():
            copies += [f"{board} / {title}: {code} {name} = {old:g}" for title, description, steps in _steps(text)
                       if re.search(rf"\b{code}\b", description) and old in steps]
    assert copies == []


def test_the_straggler_panel_turns_red_at_perf002_s_ratio():
    with _perturbed("PERF002", "straggler_ratio"):
        ratio = REGISTRY["PERF002"].thresholds["straggler_ratio"].value
        cluster = render("cluster")
    assert f'"value": {ratio}' in cluster
    assert f"fire above {ratio:g}" in cluster
