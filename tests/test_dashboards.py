"""The dashboards: the committed JSON is what the code generates, and every dashboard is well-formed —
unique panel ids, no overlapping panels, a unit, a datasource and a description on every panel, the
variables its queries use — and ``gpuwatch dashboards export`` hands them out."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwatch.cli.main import main
from gpuwatch.dashboards import DASHBOARDS, json_files
from gpuwatch.dashboards.generate import JSON_DIR, render, write

NAMES = list(DASHBOARDS)
BUILT_IN = {"__rate_interval", "__interval", "__range"}


def _load(name: str) -> dict:
    return json.loads((JSON_DIR / f"{DASHBOARDS[name]}.json").read_text())


def _panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


@pytest.mark.parametrize("name", NAMES)
def test_committed_json_is_what_the_code_generates(name):
    committed = (JSON_DIR / f"{DASHBOARDS[name]}.json").read_text()
    assert committed == render(name), "run `python -m gpuwatch.dashboards.generate` and commit dashboards/json/"


def test_an_out_of_date_file_is_detected(tmp_path):
    """The check above compares the text exactly: a stale copy differs."""
    write(tmp_path)
    stale = tmp_path / "gpuwatch-node.json"
    board = json.loads(stale.read_text())
    board["panels"][1]["title"] = "renamed in the JSON only"
    stale.write_text(json.dumps(board, indent=2, sort_keys=True) + "\n")
    assert stale.read_text() != render("node")
    assert (tmp_path / "gpuwatch-cluster.json").read_text() == render("cluster")


@pytest.mark.parametrize("name", NAMES)
def test_panel_ids_are_unique(name):
    ids = [p["id"] for p in _load(name)["panels"]]
    assert all(isinstance(i, int) and i > 0 for i in ids)
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("name", NAMES)
def test_panels_do_not_overlap_and_fit_the_grid(name):
    boxes = [(p["title"], p["gridPos"]) for p in _load(name)["panels"]]
    for _, g in boxes:
        assert g["x"] >= 0 and g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24
    for (a, ga), (b, gb) in itertools.combinations(boxes, 2):
        apart = (ga["x"] + ga["w"] <= gb["x"] or gb["x"] + gb["w"] <= ga["x"]
                 or ga["y"] + ga["h"] <= gb["y"] or gb["y"] + gb["h"] <= ga["y"])
        assert apart, f"{a!r} {ga} overlaps {b!r} {gb}"


@pytest.mark.parametrize("name", NAMES)
def test_every_panel_has_unit_datasource_description_and_queries(name):
    for panel in _panels(_load(name)):
        where = f"{name}: {panel['title']!r}"
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{where} has no unit"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert len(panel.get("description", "")) > 20, f"{where} has no description"
        assert panel["targets"], f"{where} has no query"
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"].strip(), where
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), where


@pytest.mark.parametrize("name", NAMES)
def test_queries_use_only_defined_variables(name):
    board = _load(name)
    defined = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "node"} <= defined
    used = set()
    for panel in _panels(board):
        for target in panel["targets"]:
            used |= set(re.findall(r"\$\{?(\w+)", target["expr"]))
    assert used - BUILT_IN <= defined
    assert used - BUILT_IN, "queries are filtered by the variables"


def test_job_and_rank_variables_where_training_is_shown():
    for name in ("cluster", "training"):
        variables = {v["name"]: v for v in _load(name)["templating"]["list"]}
        assert {"datasource", "job", "node", "rank"} <= set(variables)
        assert variables["rank"]["query"]["query"] == 'label_values(gpuwatch_train_rank_info{job=~"$job"}, rank)'
        assert variables["datasource"]["query"] == "prometheus"


def test_link_utilisation_is_red_above_80_percent():
    panels = {p["title"]: p for p in _panels(_load("interconnect"))}
    for title in ("NVLink transmit utilisation", "NVLink receive utilisation",
                  "InfiniBand transmit utilisation", "InfiniBand receive utilisation"):
        defaults = panels[title]["fieldConfig"]["defaults"]
        assert defaults["unit"] == "percentunit" and defaults["max"] == 1
        assert defaults["thresholds"]["steps"][-1] == {"color": "red", "value": 0.8}
        assert defaults["color"]["mode"] == "thresholds"
        assert "_speed_bytes_per_second" in panels[title]["targets"][0]["expr"] \
            or "_rate_bytes_per_second" in panels[title]["targets"][0]["expr"]


def test_cluster_overview_has_the_flops_per_rank_heatmap():
    heatmaps = [p for p in _panels(_load("cluster")) if p["type"] == "heatmap"]
    assert len(heatmaps) == 1
    panel = heatmaps[0]
    assert panel["options"]["calculate"] is False  # each series (rank) is a row of cells
    assert panel["options"]["filterValues"]["le"] < 0  # a rank at 0 FLOP/s is shown, not hidden
    assert panel["fieldConfig"]["defaults"]["unit"] == "flops"
    assert "by (job, rank)" in panel["targets"][0]["expr"]
    assert "gpuwatch_train_model_flops_per_second" in panel["targets"][0]["expr"]
    assert "{{rank}}" in panel["targets"][0]["legendFormat"]


def test_export_writes_the_shipped_json(tmp_path):
    result = CliRunner().invoke(main, ["dashboards", "export", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    written = sorted(Path(line) for line in result.output.split())
    assert [p.name for p in written] == sorted(f"{uid}.json" for uid in DASHBOARDS.values())
    for path in written:
        assert path.read_text() == (JSON_DIR / path.name).read_text()
    assert {p.name for p in json_files()} == {p.name for p in written}
