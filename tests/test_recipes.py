"""docs/architecture.md's recipes, followed: a rule and a collector added in-process exactly as "Add a rule" and "Add a
collector" say, and everything derived from the registries picks them up with no other edit.

Why in-process: a recipe that leaves out a file rots silently (the next engineer adds a rule, a list somewhere does not
know it, and a dashboard, an alert or the outlier fetch misses it). Here a temporary rule (a fresh code in an existing
family, a threshold with its source, needs, a new selector built from its threshold) and a temporary collector (one
``MetricSpec``, typed readings, the simulated node producing its source) are registered the way the recipes say and
then looked for in every artefact derived from them: the catalogue, ``--select``/``--ignore``, ``--explain``,
``--config``, the outlier fetch's queries, the "not run" reasons, the generated alerts; the ``--collector.NAME``
switches, one round's exposition and /api/v1/state, and the declared-vs-exported check of test_metric_families.py.
Both are removed afterwards (the registries restored, the agent's command rebuilt). A last test reads the two recipes
and holds every file they name to the repository, and the hand-written lists they send people to (the code ranges,
the agent's collector lists) to the registries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import json
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from test_metric_families import exposition_problems

from gpuwatch.agent import cli as agent_cli
from gpuwatch.agent import daemon, sampler
from gpuwatch.agent.collectors import REGISTRY as COLLECTORS
from gpuwatch.agent.collectors.base import Collector, CollectorError, CollectorResult
from gpuwatch.agent.collectors.nvml import GPU_GAUGES
from gpuwatch.agent.collectors.readings import Reading
from gpuwatch.agent.metricspec import MetricSpec, by_field
from gpuwatch.agent.simulate.sysfs import SimulatedSysfs
from gpuwatch.alerts import generate
from gpuwatch.alerts.rules import Alert, Group
from gpuwatch.cli.main import main
from gpuwatch.diagnosis import engine, needs
from gpuwatch.diagnosis.coverage import Selector
from gpuwatch.diagnosis.facts import Facts, GpuFacts, NodeFacts, Where
from gpuwatch.diagnosis.registry import FAMILIES, REGISTRY, Evidence, Issue, Rule, Severity, Threshold, rule
from gpuwatch.diagnosis.sources import outliers

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# -- Add a rule ---------------------------------------------------------------------------------------------------

FAMILY = "performance"
PREFIX = FAMILIES[FAMILY]
#: Step 1: the next free code of the family (codes are never reused, so the highest plus one).
CODE = f"{PREFIX}{max(int(code[len(PREFIX):]) for code in REGISTRY if code.startswith(PREFIX)) + 1:03d}"
TITLE = "GPU hotter than the recipe's limit"
SOURCE = "a number for the recipe's test, stated plainly"
TEMPERATURE = by_field(GPU_GAUGES, "temperature_celsius")
#: Step 5: a new selector, built from the rule's own threshold.
HOT_GPUS = Selector("GPUs hotter than the recipe's limit",
                    lambda t, y: f"{TEMPERATURE} > {t(CODE).max_celsius:g}")


def _hot_gpus(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """A GPU above ``max_celsius`` (the --explain text of the recipe's test rule): it throttles, and its rank becomes
    the one the others wait for. The number is the test's own, stated plainly."""
    for node in facts.nodes.values():
        hot = [gpu for gpu in node.gpus or () if (gpu.temperature_celsius or 0) > t.max_celsius]
        if hot:
            yield Issue(f"{len(hot)} GPU(s) above {t.max_celsius:g} °C on {node.name}",
                        tuple(Evidence(f"GPU {gpu.index} at {gpu.temperature_celsius:g} °C",
                                       Where(node=node.name, gpu=gpu.index)) for gpu in hot),
                        "check the node's cooling", "A hot GPU slows itself down.")


@contextlib.contextmanager
def _restored_registry() -> Iterator[None]:
    """The rule registry as it was, put back even where a registration that should fail succeeded."""
    before = dict(REGISTRY)
    try:
        yield
    finally:
        REGISTRY.clear()
        REGISTRY.update(before)


@pytest.fixture
def recipe_rule() -> Iterator[Rule]:
    """Step 2: the check decorated with ``@rule``, its needs (step 3) and coverage (step 5); removed afterwards."""
    with _restored_registry():
        rule(CODE, family=FAMILY, severity=Severity.WARNING, title=TITLE, needs=(needs.GPUS,),
             thresholds={"max_celsius": Threshold(90, SOURCE)}, coverage=(HOT_GPUS,))(_hot_gpus)
        yield REGISTRY[CODE]
    assert CODE not in REGISTRY


def _hot_node(celsius: float) -> Facts:
    return Facts(nodes={"node-7": NodeFacts("node-7", gpus=[GpuFacts(0, temperature_celsius=celsius)])})


def test_the_catalogue_and_the_selections_take_a_new_rule_by_code_and_family(recipe_rule):
    codes = [entry.code for entry in engine.catalogue()]
    family = [code for code in codes if code.startswith(PREFIX)]
    assert family[-1] == CODE and codes.index(CODE) == codes.index(family[-2]) + 1
    assert engine.select([CODE.lower()]) == [recipe_rule]
    assert recipe_rule in engine.select([PREFIX])
    assert recipe_rule not in engine.select([PREFIX], [CODE]) and recipe_rule not in engine.select([], [PREFIX])
    listed = CliRunner().invoke(main, ["diagnose", "--list-rules", "--format", "json", "--select", PREFIX])
    assert {"code": CODE, "family": FAMILY, "severity": "warning", "title": TITLE} in json.loads(listed.output)


def test_explain_and_config_read_the_new_rules_threshold(recipe_rule, tmp_path):
    explained = CliRunner().invoke(main, ["diagnose", "--explain", CODE.lower()])
    assert explained.exit_code == 0, explained.output
    assert explained.output.startswith(f"{CODE}: {TITLE}\nfamily: {FAMILY}    severity: warning")
    assert f"max_celsius = 90  — {SOURCE}" in explained.output
    assert "it throttles, and its rank becomes" in explained.output
    assert f"Needs: {needs.GPUS.name}" in explained.output

    config = tmp_path / "thresholds.yml"
    config.write_text(f"thresholds: {{{CODE}: {{max_celsius: 95}}}}\n")
    overrides = engine.load_config(config)
    assert overrides == {CODE: {"max_celsius": 95.0}}
    assert [f.code for f in engine.run(_hot_node(93), [recipe_rule]).findings] == [CODE]
    assert engine.run(_hot_node(93), [recipe_rule], overrides).findings == []
    config.write_text(f"thresholds: {{{CODE}: {{min_celsius: 95}}}}\n")
    with pytest.raises(engine.ConfigError, match=f"{CODE} has no threshold 'min_celsius' .it has: max_celsius"):
        engine.load_config(config)


def test_the_docs_tables_are_the_rules_and_take_a_new_rule(recipe_rule):
    """docs/runbook.md's thresholds and docs/diagnosis.md's catalogue are generated from the registry: without the
    recipe's rule the committed ones are fresh; with it, both tables have its row and the committed documents are
    stale, which --check says."""
    from gpuwatch.cli import docs

    assert f"| {CODE} {TITLE} | `max_celsius` = 90 | {needs.GPUS.name} |" in docs.thresholds_table()
    assert f"| {CODE} | {FAMILY} | warning | {TITLE} | ranks |" in docs.rule_catalogue()
    assert [line.split("'")[0] for line in docs.stale()] == [str(ROOT / "docs" / "runbook.md"),
                                                             str(ROOT / "docs" / "diagnosis.md")]
    assert "python -m gpuwatch.cli.docs" in docs.stale()[0]
    assert docs.main(["--check"]) == 1
    del REGISTRY[CODE]
    assert docs.stale() == [] and docs.main(["--check"]) == 0  # the committed docs are the registries'
    REGISTRY[CODE] = recipe_rule


def test_the_new_rule_says_why_it_did_not_run_when_its_needs_are_missing(recipe_rule):
    down = Facts(nodes={"node-7": NodeFacts("node-7", missing={"gpus": "nvml collector down"})})
    for facts in (Facts(), down):
        result = engine.run(facts, [recipe_rule])
        assert result.ran == [] and [(s.code, s.cause) for s in result.skipped] == [(CODE, "facts")]
        assert result.skipped[0].reason == needs.GPUS.available(facts)
    assert "node-7: nvml collector down" in engine.run(down, [recipe_rule]).skipped[0].reason


class RecordingEngine:
    """A PromQL engine (``outliers.Engine``) that keeps the queries and answers one node to the new selector."""

    def __init__(self, answered: str) -> None:
        self.answered, self.asked = answered, list[str]()

    def query(self, expr: str) -> list[dict[str, Any]]:
        self.asked.append(expr)
        return [{"metric": {"instance": "node-7"}, "value": [0, "1"]}] if expr == self.answered else []


@pytest.mark.parametrize(("overrides", "bound"), [({}, "90"), ({CODE: {"max_celsius": 95.0}}, "95")])
def test_the_outlier_fetch_asks_the_new_selector_with_the_rules_threshold(recipe_rule, overrides, bound):
    served = outliers.served(REGISTRY)
    assert list(served.selectors)[-1] == HOT_GPUS and served.selectors[HOT_GPUS] == (CODE,)
    query = f"group by (instance) ({TEMPERATURE} > {bound})"
    fetch = RecordingEngine(query)
    plan = outliers.plan(fetch, overrides)
    assert query in fetch.asked
    assert "node-7" in plan.instances and plan.reasons[HOT_GPUS.what] == 1
    assert CODE not in plan.unjudged


def test_an_alert_mirroring_the_new_rule_renders_and_follows_its_threshold(recipe_rule, monkeypatch):
    alert = Alert("GpuHotterThanTheRecipe", CODE, expr=f"{TEMPERATURE} > ${{max_celsius}}", for_minutes=5,
                  summary="A GPU is hot", description="A GPU has been above ${max_celsius} °C for ${for_minutes} "
                                                      "minutes.")
    monkeypatch.setattr(generate, "GROUPS", (*generate.GROUPS, Group("gpuwatch.recipe", (alert,))))

    def rendered() -> dict[str, Any]:
        (found,) = [entry for group in yaml.safe_load(generate.render())["groups"] for entry in group["rules"]
                    if entry.get("alert") == alert.name]
        return found

    assert rendered()["expr"] == f"{TEMPERATURE} > 90"
    assert rendered()["labels"] == {"severity": "warning"}
    assert rendered()["annotations"]["description"] == "A GPU has been above 90 °C for 5 minutes."
    monkeypatch.setitem(REGISTRY, CODE, dataclasses.replace(recipe_rule, thresholds={
        "max_celsius": Threshold(80, SOURCE)}))
    assert rendered()["expr"] == f"{TEMPERATURE} > 80"


@pytest.mark.parametrize(("code", "declared", "refusal"), [
    (CODE, {}, f"rule {CODE} declares no coverage"),
    ("HW" + CODE[len(PREFIX):], {"coverage": (HOT_GPUS,)},
     f"rule HW{CODE[len(PREFIX):]}: a {FAMILY} rule's code is {PREFIX} and a number"),
])
def test_a_rule_without_coverage_or_off_its_prefix_is_refused_in_one_line_naming_its_code(code, declared, refusal):
    with _restored_registry(), pytest.raises(ValueError) as refused:
        rule(code, family=FAMILY, severity=Severity.WARNING, title=TITLE, **declared)(_hot_gpus)
    assert str(refused.value).startswith(refusal) and "\n" not in str(refused.value)
    assert code not in REGISTRY


# -- Add a collector ----------------------------------------------------------------------------------------------

#: Where the recipe's collector reads its source, under the sysfs root (the simulated node's included).
WIDGETS = "class/gpuwatch_recipe_widget"
#: Step 1: its one family, declared beside the collector.
WIDGET_TEMPERATURE = MetricSpec("gpuwatch_recipe_widget_temperature_celsius", "Temperature of a recipe widget.",
                                "celsius", "temperature_celsius", labels=("widget",))


@dataclasses.dataclass(frozen=True, slots=True)
class WidgetReading(Reading):
    """Step 2: one widget's reading, its field named as the family's ``field``."""

    widget: str
    temperature_celsius: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class WidgetReadings(Reading):
    """Step 2: the collector's readings, as /api/v1/state carries them."""

    widgets: tuple[WidgetReading, ...] = ()


class WidgetCollector(Collector):
    """Step 1: reads every widget's temperature (millidegrees, as sysfs writes them); down where there are none."""

    name = "recipewidget"

    def collect(self) -> CollectorResult[WidgetReadings]:
        directory = self.context.sysfs_root / WIDGETS
        if not directory.is_dir():
            raise CollectorError(f"{directory} is absent")
        readings = WidgetReadings(tuple(WidgetReading(path.name, int((path / "temp").read_text()) / 1000)
                                        for path in sorted(directory.iterdir())))
        family = WIDGET_TEMPERATURE.family()
        for widget in readings.widgets:
            if widget.temperature_celsius is not None:
                family.add_metric([widget.widget], widget.temperature_celsius)
        return CollectorResult([family], readings)


@contextlib.contextmanager
def _registered_collector() -> Iterator[None]:
    """Step 3: the collector in ``collectors.REGISTRY``, and ``gpuwatch agent`` rebuilt, whose switches are made from
    the registry when its module is imported; both put back afterwards."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(COLLECTORS, WidgetCollector.name, WidgetCollector)
        importlib.reload(agent_cli)
        try:
            yield
        finally:
            patch.undo()
            importlib.reload(agent_cli)


def _simulated_widgets(patch: pytest.MonkeyPatch) -> None:
    """Step 4, the simulated node: ``SimulatedSysfs`` writes the widgets' files as it advances before each round."""
    advance = SimulatedSysfs.advance

    def advance_with_widgets(self: SimulatedSysfs, seconds: float | None = None) -> None:
        advance(self, seconds)
        for index, millidegrees in enumerate((41000, 43500)):
            widget = self.root / WIDGETS / f"widget{index}"
            widget.mkdir(parents=True, exist_ok=True)
            (widget / "temp").write_text(f"{millidegrees}\n")

    patch.setattr(SimulatedSysfs, "advance", advance_with_widgets)


def _agent_config(patch: pytest.MonkeyPatch) -> daemon.AgentConfig:
    """``gpuwatch agent --simulate dgx-h100`` with the new collector on and every other one off, as the command line
    turns it into the agent's configuration."""
    configs: list[daemon.AgentConfig] = []
    patch.setattr(daemon, "run_agent", lambda config: configs.append(config) or 0)
    others = [f"--no-collector.{name}" for name in COLLECTORS if name != WidgetCollector.name]
    result = CliRunner().invoke(main, ["agent", "--simulate", "dgx-h100", "--listen", "127.0.0.1:0", "--node", "sim",
                                       "--interval", "1", f"--collector.{WidgetCollector.name}", *others])
    assert result.exit_code == 0, result.output
    (config,) = configs
    return config


def _one_round(config: daemon.AgentConfig) -> tuple[str, dict[str, Any], Any]:
    """One sampling round of the agent ``config`` describes: its /metrics page, its /api/v1/state and the new
    collector's readings."""
    with contextlib.ExitStack() as stack:
        snapshot = daemon.build_sampler(config, stack).sample_once()
        return (snapshot.metrics().decode(), json.loads(snapshot.state_json),
                snapshot.readings.get(WidgetCollector.name))


#: What a page of the new collector alone holds: its family and the agent's own.
DECLARED = [WIDGET_TEMPERATURE, *(value for value in vars(sampler).values() if isinstance(value, MetricSpec))]


def test_a_new_collector_gets_its_switches_its_family_its_state_and_passes_the_families_check():
    switch = f"--collector.{WidgetCollector.name} / --no-collector.{WidgetCollector.name}"
    with _registered_collector(), pytest.MonkeyPatch.context() as patch:
        assert switch in CliRunner().invoke(main, ["agent", "--help"]).output
        _simulated_widgets(patch)
        config = _agent_config(patch)
        assert config.collectors == [WidgetCollector.name]
        page, state, readings = _one_round(config)
    assert switch not in CliRunner().invoke(main, ["agent", "--help"]).output  # and removed again

    assert 'gpuwatch_recipe_widget_temperature_celsius{widget="widget1"} 43.5' in page
    assert f"# HELP {WIDGET_TEMPERATURE} {WIDGET_TEMPERATURE.help}\n# TYPE {WIDGET_TEMPERATURE} gauge\n" in page
    assert exposition_problems(DECLARED, page) == []
    assert state["collectors"][WidgetCollector.name]["up"] is True
    assert WidgetReadings.from_dict(state["facts"][WidgetCollector.name]) == readings
    assert readings.widgets[0] == WidgetReading("widget0", 41.0)


def test_the_families_check_rejects_a_new_collector_the_simulated_node_does_not_feed():
    with _registered_collector(), pytest.MonkeyPatch.context() as patch:
        page, state, readings = _one_round(_agent_config(patch))
    assert readings is None and state["collectors"][WidgetCollector.name]["up"] is False
    assert exposition_problems(DECLARED, page) == [f"{WIDGET_TEMPERATURE}: declared, not exported"]


# -- The recipes' own text ----------------------------------------------------------------------------------------

#: A repository path in backquotes: a slash, no spaces; NAME stands for the new part's name.
PATH = re.compile(r"`([\w.-]+(?:/[\w.${}-]*)+)`")


def _section(title: str) -> str:
    """A level-3 section of docs/architecture.md, up to the next heading."""
    text = ARCHITECTURE.read_text()
    start = text.index(f"\n### {title}\n")
    end = re.compile(r"\n#{2,3} ").search(text, start + 1)
    return text[start:end.start() if end else len(text)]


@pytest.mark.parametrize("title", ["Add a collector", "Add a rule"])
def test_every_file_a_recipe_names_exists(title):
    paths = PATH.findall(_section(title))
    assert len(paths) > 8, paths
    missing = [path for path in paths if not (ROOT / path.split("NAME")[0].rpartition("/")[0]
                                              if "NAME" in path else ROOT / path).exists()]
    assert missing == []


def test_the_family_prefixes_the_add_a_rule_recipe_lists_are_the_registrys():
    prefixes = ", ".join(f"`{prefix}`" for prefix in FAMILIES.values())
    assert f"(`FAMILIES` in `diagnosis/registry.py`: {prefixes})" in " ".join(ARCHITECTURE.read_text().split())


_WIDGET_MODULE = f"""\"\"\"Recipe widgets, read from sysfs.\"\"\"
from {WidgetCollector.__module__} import WidgetCollector as _Widget


class WidgetCollector(_Widget):
    pass
"""


def test_a_collector_is_registered_by_its_module_being_in_the_package(tmp_path, monkeypatch):
    """Step 1 is the registration: ``discover`` finds the collector of every public module of the package (as
    ``agent/collectors/__init__.py`` builds REGISTRY), skips private helpers, and refuses a module with two."""
    from gpuwatch.agent.collectors import discover

    package = tmp_path / "recipe_collectors"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "widget.py").write_text(_WIDGET_MODULE)
    (package / "_helper.py").write_text(_WIDGET_MODULE)  # private: not a collector's module, however it looks
    monkeypatch.syspath_prepend(str(tmp_path))
    found = discover("recipe_collectors")
    assert list(found) == [WidgetCollector.name]
    assert found[WidgetCollector.name].__module__ == "recipe_collectors.widget"
    (package / "twice.py").write_text(_WIDGET_MODULE + "\n\nclass Another(_Widget):\n    name = 'another'\n")
    with pytest.raises(ImportError, match=r"^recipe_collectors\.twice must define one Collector subclass, not 2$"):
        discover("recipe_collectors")


def test_the_docs_collector_table_is_the_registrys_and_takes_a_new_collector():
    """docs/agent.md's collectors table is generated from REGISTRY (the README and the flags table send people to it,
    naming no collector): the new collector gets its row, with what its module's docstring says it reads."""
    from gpuwatch.cli import docs

    assert docs.stale() == []
    with _registered_collector():
        row = f"| `{WidgetCollector.name}` | on | {inspect.getdoc(sys.modules[__name__]).split(chr(10))[0]}"
        assert row in docs.collectors_table()
        assert docs.stale() == [f"{ROOT / 'docs' / 'agent.md'}'s generated tables differ from the declarations: "
                                "run python -m gpuwatch.cli.docs"]
    assert docs.stale() == []
