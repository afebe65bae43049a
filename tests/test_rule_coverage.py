"""Each rule's cluster-scale coverage, declared in its ``@rule``: above 64 nodes the Prometheus source reads in
detail only the nodes the outlier fetch picks, so a rule the fetch does not know how to serve would be judged on the
nodes read for the others alone, silently. The registry refuses such a rule, and the fetch asks what the rules
declare."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
from collections.abc import Iterator

import pytest

from gpuwatch.diagnosis import coverage
from gpuwatch.diagnosis.coverage import COLLECTORS_DOWN, ENV_MINORITY, STRAGGLERS, Selector, WholeJob
from gpuwatch.diagnosis.facts import Facts
from gpuwatch.diagnosis.registry import FAMILIES, REGISTRY, Issue, Rule, Severity, rule
from gpuwatch.diagnosis.sources import QueryError, outliers


def _check(facts: Facts, t: types.SimpleNamespace) -> list[Issue]:
    """Finds nothing: the rules registered here are refused before they could run."""
    return []


@pytest.fixture
def registry_restored() -> Iterator[dict[str, Rule]]:
    """The registry as it was, put back after the test even where a registration that should fail succeeded."""
    before = dict(REGISTRY)
    yield before
    REGISTRY.clear()
    REGISTRY.update(before)


def _register(code: str, family: str = "performance", **kwargs: object) -> None:
    rule(code, family=family, severity=Severity.WARNING, title="a test rule", **kwargs)(_check)


@pytest.mark.parametrize(("code", "family", "declared", "refusal"), [
    ("PERF999", "performance", {}, "PERF999 declares no coverage"),
    ("PERF999", "performance", {"coverage": ()}, "PERF999 declares no coverage"),
    ("PERF999", "performance", {"coverage": (WholeJob("it reads every rank"), STRAGGLERS)},
     "PERF999: WholeJob coverage stands alone"),
    ("PERF999", "performance", {"coverage": (WholeJob("it reads every rank"), WholeJob("twice"))},
     "PERF999: WholeJob coverage stands alone"),
    ("HW999", "performance", {"coverage": (STRAGGLERS,)}, "HW999: a performance rule's code is PERF and a number"),
    ("PERFX99", "performance", {"coverage": (STRAGGLERS,)}, "PERFX99: a performance rule's code is PERF"),
    ("PERF999", "speed", {"coverage": (STRAGGLERS,)}, "PERF999: family 'speed' is none of"),
])
def test_a_rule_without_coverage_mixing_whole_job_with_selectors_or_off_its_family_prefix_is_refused_by_code(
        code, family, declared, refusal, registry_restored):
    with pytest.raises(ValueError, match=refusal):
        _register(code, family, **declared)
    assert registry_restored == REGISTRY


def test_a_rule_cannot_lose_its_coverage_after_registration_either():
    """The check is the Rule's own, so a copy made with dataclasses.replace is held to it too."""
    with pytest.raises(ValueError, match="PERF002 declares no coverage"):
        dataclasses.replace(REGISTRY["PERF002"], coverage=())


def test_every_rule_declares_its_coverage_and_its_familys_prefix():
    assert {entry.family for entry in REGISTRY.values()} == set(FAMILIES)
    for code, entry in REGISTRY.items():
        assert code.startswith(FAMILIES[entry.family]), code
        assert entry.coverage, code
        assert all(isinstance(part, Selector | WholeJob) or part is ENV_MINORITY for part in entry.coverage), code


def test_the_fetch_serves_every_rule_once_as_a_whole_job_or_through_what_it_declares():
    served = outliers.served(REGISTRY)
    assert list(served.selectors) == list(coverage.DECLARED), "every declared selector serves a rule, in its order"
    by_selector = {code for codes in served.selectors.values() for code in codes}
    assert set(served.whole_job).isdisjoint(by_selector | set(served.env_minority))
    assert set(served.whole_job) | by_selector | set(served.env_minority) == set(REGISTRY)
    for code, entry in REGISTRY.items():
        assert {selector for selector, codes in served.selectors.items() if code in codes} == {
            part for part in entry.coverage if isinstance(part, Selector)}, code
    # The rules the outlier fetch reports as not run, and those it serves through the environments' minorities.
    assert set(served.whole_job) == {"PERF004", "MEM003", "CONV005", "CONV006", "TOPO001", "TOPO002", "PLAN001",
                                     "PLAN002"}
    assert set(served.env_minority) == {"NCCL001", "NCCL002", "NCCL004", "MEM001"}
    # A node whose collectors are down shows no hardware fault: every hardware rule reads it.
    assert served.selectors[COLLECTORS_DOWN] == tuple(code for code, entry in REGISTRY.items()
                                                      if entry.family == "hardware")


class Engine:
    """A PromQL engine answering ``rows`` to the queries in it, nothing to the others, and failing ``failing``."""

    def __init__(self, rows: dict[str, list[str]], failing: str = "") -> None:
        self.rows, self.failing, self.asked = rows, failing, set[str]()

    def query(self, expr: str) -> list[dict]:
        self.asked.add(expr)
        if expr == self.failing:
            raise QueryError("the engine timed out")
        return [{"metric": {"instance": instance}, "value": [0, "1"]} for instance in self.rows.get(expr, [])]


def test_the_whole_job_rules_are_reported_not_run_with_their_reason():
    plan = outliers.plan(Engine({}), {})
    whole_job = outliers.served(REGISTRY).whole_job
    assert set(plan.unjudged) == set(whole_job)
    for code, why in whole_job.items():
        assert f"({why})" in plan.unjudged[code].reason and not plan.unjudged[code].source, code


def test_a_rule_declaring_a_new_selector_has_it_asked_its_nodes_read_and_is_not_run_when_it_fails(monkeypatch):
    signal = Selector("nodes with a test signal", lambda t, y: f"test_signal > {t('PERF999').limit:g}")
    query = "group by (instance) (test_signal > 3)"
    monkeypatch.setitem(REGISTRY, "PERF999", dataclasses.replace(
        REGISTRY["PERF002"], code="PERF999", thresholds={"limit": dataclasses.replace(
            REGISTRY["PERF002"].thresholds["straggler_ratio"], value=3)}, coverage=(signal,)))
    assert list(outliers.served(REGISTRY).selectors)[-1] == signal  # after the declared ones
    engine = Engine({query: ["node-7"]})
    plan = outliers.plan(engine, {})
    assert query in engine.asked
    assert "node-7" in plan.instances and plan.reasons["nodes with a test signal"] == 1
    assert "PERF999" not in plan.unjudged

    plan = outliers.plan(Engine({query: ["node-7"]}, failing=query), {})
    assert "node-7" not in plan.instances
    assert plan.unjudged["PERF999"].source
    assert plan.unjudged["PERF999"].reason == ("the outlier query for nodes with a test signal failed: "
                                               "the engine timed out")


def test_the_coverage_module_imports_alone():
    """First in a fresh interpreter, as a rule module imports it: no import cycle may break it."""
    result = subprocess.run([sys.executable, "-c", "import gpuwatch.diagnosis.coverage"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
