"""Every family is declared once (``agent.metricspec.MetricSpec``), the declarations are what a simulated agent really
exports, and every metric name that diagnose's PromQL, the alert rules or the dashboards select is one of their
series: a family renamed or dropped on the agent's side fails here rather than turning a rule or a panel into a
silent "no data". Diagnose, the alert rules and the dashboards name each family through its declaration, never
written out, so that a rename is the one edit of the declaration."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from telemetry_records import hello, step

from gpuwatch.agent.collectors.nvml import GPU_GAUGES
from gpuwatch.agent.metricspec import MetricSpec, by_field, declared
from gpuwatch.agent.sampler import AGENT_INFO
from gpuwatch.agent.telemetry.metrics import LAST_STEP
from gpuwatch.diagnosis.sources import prometheus
from gpuwatch.trainer.telemetry import TelemetryClient

from conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent
#: A metric name in PromQL or Python text; recording rules ("gpuwatch:...") have a colon instead of the underscore.
METRIC_NAME = re.compile(r"\bgpuwatch_[a-z0-9_]*[a-z0-9]")
#: The modules whose PromQL must name families through their declarations only: diagnose's, and every module of
#: the alert rules and the dashboards (their generated files hold the names the declarations give).
READERS = (ROOT / "diagnosis" / "sources" / "prometheus.py",
           ROOT / "diagnosis" / "sources" / "outliers.py",
           ROOT / "diagnosis" / "coverage.py",
           *sorted((ROOT / "alerts").glob("*.py")),
           *sorted((ROOT / "dashboards").glob("*.py")))


def declared_families() -> dict[str, MetricSpec]:
    """Every ``MetricSpec`` a module of the agent holds (alone, or in a table), by family name (``declared``, which
    fails on a name declared twice: a family is declared in one place)."""
    return {name: spec for name, (_, spec) in declared().items()}


def exposition_problems(declared: Iterable[MetricSpec], exposition: str) -> list[str]:
    """What differs between the ``declared`` families and an agent's ``exposition`` (its /metrics text), one line
    each: a family declared but not exported or exported undeclared, and an exported family whose type or labels are
    not its declaration's. A callable over any declarations and any page, so that tests/test_recipes.py holds a
    collector added by the recipe to the same check."""
    specs = {spec.name: spec for spec in declared}
    exported = {family.name: family for family in text_string_to_metric_families(exposition)}
    missing, undeclared = family_differences(specs, exported)
    problems = [f"{name}: declared, not exported" for name in sorted(missing)]
    problems += [f"{name}: exported, not declared" for name in sorted(undeclared)]
    for name in sorted(exported.keys() & specs.keys()):
        family, spec = exported[name], specs[name]
        if family.type != spec.exposed_type:
            problems.append(f"{name}: exported as {family.type}, declared {spec.exposed_type}")
        labels = {label for sample in family.samples for label in sample.labels} - {"le"}
        if family.samples and labels != set(spec.labels):
            problems.append(f"{name}: exported with labels {sorted(labels)}, declared {sorted(spec.labels)}")
    return problems


def family_differences(declared: Iterable[str], exported: Iterable[str]) -> tuple[set[str], set[str]]:
    """(declared but not exported, exported but not declared)."""
    declared, exported = set(declared), set(exported)
    return declared - exported, exported - declared


def unknown_series(exprs: Iterable[str], families: Iterable[MetricSpec]) -> dict[str, str]:
    """The metric names the expressions select that are no series of ``families``, each with an expression naming
    it."""
    series = {name for spec in families for name in spec.sample_names}
    return {name: expr for expr in exprs for name in METRIC_NAME.findall(expr) if name not in series}


def metric_literals(source: str) -> list[str]:
    """String constants of a module's code (docstrings aside) that hold a metric name: a name written out instead
    of read from its declaration."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and METRIC_NAME.search(node.value)]


class RecordingApi(prometheus.Api):
    """An engine that answers every query empty but the node count and the agents' series (one node), and keeps the
    queries: what diagnose sends, in full or outlier mode, without an engine."""

    def __init__(self) -> None:
        super().__init__("http://recording.invalid")
        self.queries: list[str] = []

    def query(self, expr: str) -> list[dict[str, Any]]:
        self.queries.append(expr)
        if expr == f"count({AGENT_INFO})" or expr.startswith(f"{AGENT_INFO}{{"):
            return [{"metric": {"instance": "node-0:9400", "node": "node-0"}, "value": [0, "1"]}]
        return []


def _scrape_with_a_rank(start_agent) -> str:
    """A simulated node with one rank that stepped: its /metrics page."""
    agent = start_agent("--simulate", "dgx-h100", "--interval", "0.5")
    with TelemetryClient(agent.telemetry_socket, heartbeat_interval=0) as client:
        client.send(hello(0))
        client.send(step(0, 1))

    # The rank's series, and the GPM ratios, which need two rounds' samples.
    awaited = (LAST_STEP, by_field(GPU_GAUGES, "sm_occupancy_ratio"))

    def page_with_the_rank() -> str | None:
        page = agent.get("/metrics").decode()
        return page if all(f"{spec}{{" in page for spec in awaited) else None

    return wait_until(page_with_the_rank, what="the rank's series")


def test_the_declared_families_are_the_families_a_simulated_agent_exports(start_agent):
    assert exposition_problems(declared_families().values(), _scrape_with_a_rank(start_agent)) == []


@pytest.mark.parametrize("mode", ["full", "outliers"])
def test_every_series_diagnose_queries_is_declared(mode):
    api = RecordingApi()
    prometheus.read(api, mode)
    assert len(api.queries) > 10
    assert unknown_series(api.queries, declared_families().values()) == {}


def _alert_exprs() -> list[str]:
    document = yaml.safe_load((ROOT / "alerts" / "gpuwatch.rules.yml").read_text())
    return [rule["expr"] for group in document["groups"] for rule in group["rules"]]


def _dashboard_queries(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "query", "definition") and isinstance(value, str):
                yield value
            else:
                yield from _dashboard_queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from _dashboard_queries(item)


def test_alert_rules_and_dashboards_select_declared_series_only():
    alerts = _alert_exprs()
    dashboards = [query for path in sorted((ROOT / "dashboards" / "json").glob("*.json"))
                  for query in _dashboard_queries(json.loads(path.read_text()))]
    assert len(alerts) > 10 and len(dashboards) > 10
    declared = declared_families().values()
    assert unknown_series(alerts, declared) == {}
    assert unknown_series(dashboards, declared) == {}


@pytest.mark.parametrize("reader", READERS, ids=lambda path: str(path.relative_to(ROOT)))
def test_diagnose_alerts_and_dashboards_name_no_family_but_through_its_declaration(reader):
    assert metric_literals(reader.read_text()) == []


def test_the_checks_fail_on_what_they_guard_against():
    declared = [MetricSpec("gpuwatch_made_up_seconds", "Declared, never exported.", "seconds"),
                MetricSpec("gpuwatch_made_up_calls", "A counter.", kind="counter")]
    assert family_differences([spec.name for spec in declared], ["gpuwatch_made_up_calls", "gpuwatch_stray"]) == (
        {"gpuwatch_made_up_seconds"}, {"gpuwatch_stray"})
    # A counter is selected by its _total series, never by its family name; an unknown family is unknown.
    assert unknown_series(["rate(gpuwatch_made_up_calls_total[5m]) > gpuwatch:made_up:recorded"], declared) == {}
    assert set(unknown_series(["gpuwatch_made_up_calls > 0", "gpuwatch_unknown_family{gpu=\"0\"}"], declared)) == {
        "gpuwatch_made_up_calls", "gpuwatch_unknown_family"}
    # A regex over names hides them: its stem is no series.
    assert set(unknown_series(['{__name__=~"gpuwatch_made_(up_seconds|x)"}'], declared)) == {"gpuwatch_made"}
    page = ("# HELP gpuwatch_made_up_calls_total A counter.\n# TYPE gpuwatch_made_up_calls_total gauge\n"
            'gpuwatch_made_up_calls_total{gpu="0"} 1\n')
    assert exposition_problems(declared, page) == [
        "gpuwatch_made_up_calls: declared, not exported", "gpuwatch_made_up_seconds: declared, not exported",
        "gpuwatch_made_up_calls_total: exported, not declared"]
    page = ("# HELP gpuwatch_made_up_calls A counter.\n# TYPE gpuwatch_made_up_calls gauge\n"
            'gpuwatch_made_up_calls{gpu="0"} 1\n')
    assert exposition_problems(declared[1:], page) == [
        "gpuwatch_made_up_calls: exported as gauge, declared counter",
        "gpuwatch_made_up_calls: exported with labels ['gpu'], declared []"]
    source = '"""Reads `gpuwatch_agent_info`."""\nQUERY = "count(gpuwatch_agent_info)"\nRULE = "gpuwatch:x:y"\n'
    assert metric_literals(source) == ["count(gpuwatch_agent_info)"]
    # A name written into an f-string (the dashboards' queries), or built from a prefix, is written out too.
    source = 'PANEL = f"sum(gpuwatch_gpu_lost{{{NODE}}})"\nPHASE = f"gpuwatch_train_{field}"\nOK = f"{GPU_LOST} == 1"\n'
    assert metric_literals(source) == ["sum(gpuwatch_gpu_lost{", "gpuwatch_train_"]


def test_a_spec_names_its_series_and_refuses_a_misnamed_family():
    latency = MetricSpec("gpuwatch_made_up_seconds", "A histogram.", "seconds", kind="histogram")
    assert latency.sample_names == ("gpuwatch_made_up_seconds_bucket", "gpuwatch_made_up_seconds_count",
                                    "gpuwatch_made_up_seconds_sum")
    assert f"rate({latency}_sum[5m])" == "rate(gpuwatch_made_up_seconds_sum[5m])"
    calls = MetricSpec("gpuwatch_made_up_calls", "A counter.", kind="counter", labels=("gpu",))
    family = calls.family()
    family.add_metric(["0"], 3)
    assert [(sample.name, sample.labels) for sample in family.samples] == [("gpuwatch_made_up_calls_total",
                                                                            {"gpu": "0"})]
    with pytest.raises(ValueError, match="without _total"):
        MetricSpec("gpuwatch_made_up_total", "A counter named as its series.", kind="counter")
    with pytest.raises(ValueError, match="_info"):
        MetricSpec("gpuwatch_made_up", "Info named as a gauge.", kind="info")
    with pytest.raises(ValueError, match="unit"):
        MetricSpec("gpuwatch_made_up", "No unit in the name.", "seconds")


@pytest.mark.parametrize(("name", "unit", "message"), [
    ("gpuwatch_link_speed_bits", "bits", "bits is not a Prometheus base unit: use bytes"),
    ("gpuwatch_step_milliseconds", "", "milliseconds is not a Prometheus base unit: use seconds"),
    ("gpuwatch_busy_percent", "percent", "percent is not a Prometheus base unit: use ratio"),
    ("gpuwatch_link_bytes_per_minute", "bytes_per_minute", "bytes_per_minute is not a Prometheus base unit"),
])
def test_a_spec_refuses_a_unit_that_is_not_a_base_unit(name, unit, message):
    """promtool rejects some non-base units and a reader would convert the rest: the declaration refuses them."""
    with pytest.raises(ValueError, match=message):
        MetricSpec(name, "A family in a non-base unit.", unit)
    assert MetricSpec("gpuwatch_link_bytes_per_second", "A rate in base units.", "bytes_per_second").unit
