"""Shared building blocks of the dashboards: the datasource, variables, queries, panels and layout.

Every panel is made here, so every panel gets the templated Prometheus datasource, a unit and a
description the same way; the dashboard modules only say what to plot.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpuwatch.agent.collectors.nvml import GPU_INFO
from gpuwatch.agent.sampler import AGENT_INFO
from gpuwatch.agent.telemetry.metrics import RANK_INFO

with warnings.catch_warnings():
    # The SDK prefers its v2 dashboards, which Grafana 11 cannot import; the classic JSON model is the one
    # Grafana 11 to 13 all import, so its deprecation notice is not for us.
    warnings.filterwarnings("ignore", "Prefer using dashboardv2", DeprecationWarning)
    from grafana_foundation_sdk.builders import common as common_builders
    from grafana_foundation_sdk.builders import dashboard as dash
    from grafana_foundation_sdk.builders import heatmap as heatmap_panel
    from grafana_foundation_sdk.builders import prometheus as prom
    from grafana_foundation_sdk.builders import stat as stat_panel
    from grafana_foundation_sdk.builders import statetimeline as state_panel
    from grafana_foundation_sdk.builders import timeseries as timeseries_panel
    from grafana_foundation_sdk.cog import builder as cog
    from grafana_foundation_sdk.models import common
    from grafana_foundation_sdk.models import dashboard as model
    from grafana_foundation_sdk.models import heatmap as heatmap_model

Dashboard = dash.Dashboard
#: What the dashboard modules hand to ``dashboard()``: any panel builder.
PanelBuilder = cog.Builder[model.Panel]

DATASOURCE = common.DataSourceRef(type_val="prometheus", uid="${datasource}")

#: Label matchers the panels filter on. The node is the Prometheus target (`instance`), the training job is
#: the series' own `job` label (scrape with honor_labels: true, see docs/runbook.md#setup).
NODE = 'instance=~"$node"'
GPU = f'{NODE}, gpu=~"$gpu"'
RANKS = 'job=~"$job", rank=~"$rank", instance=~"$node"'
JOBS = 'job=~"$job"'

#: Grafana unit ids used by the panels.
PERCENT = "percentunit"
SECONDS = "s"
BYTES = "bytes"
BYTES_PER_SECOND = "Bps"
FLOPS = "flops"
PER_SECOND = "cps"
COUNT = "short"
NONE = "none"

GREEN, YELLOW, RED = "green", "#EAB839", "red"


def datasource_variable() -> dash.DatasourceVariable:
    return dash.DatasourceVariable("datasource").label("Data source").type("prometheus")


def label_variable(name: str, label: str, query: str, *, multi: bool = True) -> dash.QueryVariable:
    """A variable over one label's values; multi-value ones offer All, matched with `=~`."""
    variable = (
        dash.QueryVariable(name).label(label).datasource(DATASOURCE)
        .query({"qryType": 1, "query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"})
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(model.VariableSort.NATURAL_ASC)
    )
    if multi:
        variable = variable.multi(True).include_all(True).all_value(".*")
    return variable


def job_variable() -> dash.QueryVariable:
    return label_variable("job", "Training job", f"label_values({RANK_INFO}, job)")


def node_variable(*, multi: bool = True) -> dash.QueryVariable:
    return label_variable("node", "Node", f"label_values({AGENT_INFO}, instance)", multi=multi)


def rank_variable() -> dash.QueryVariable:
    return label_variable("rank", "Rank", f'label_values({RANK_INFO}{{job=~"$job"}}, rank)')


def gpu_variable() -> dash.QueryVariable:
    return label_variable("gpu", "GPU", f'label_values({GPU_INFO}{{instance=~"$node"}}, gpu)')


@dataclass(frozen=True)
class Query:
    """One PromQL expression and the legend of its series."""

    expr: str
    legend: str = ""


def _targets(queries: Sequence[Query]) -> list[prom.Dataquery]:
    return [
        prom.Dataquery().expr(q.expr).legend_format(q.legend or "__auto").ref_id(chr(ord("A") + i))
        .datasource(DATASOURCE)
        for i, q in enumerate(queries)
    ]


def thresholds(*steps: tuple[float | None, str]) -> dash.ThresholdsConfig:
    """Absolute thresholds; the first step's value is None (from -Infinity)."""
    return dash.ThresholdsConfig().mode(model.ThresholdsMode.ABSOLUTE).steps(
        [model.Threshold(value=value, color=color) for value, color in steps])


def red_above(limit: float) -> dash.ThresholdsConfig:
    return thresholds((None, GREEN), (limit, RED))


def _common(panel, title: str, unit: str, description: str, queries: Sequence[Query], width: int, height: int):
    """What every panel has: title, description, the templated datasource, its queries, unit and size."""
    return (panel.title(title).description(description).datasource(DATASOURCE).targets(_targets(queries))
            .unit(unit).span(width).height(height))


def timeseries(title: str, unit: str, description: str, *queries: Query, width: int = 12, height: int = 8,
               minimum: float | None = None, maximum: float | None = None,
               limits: dash.ThresholdsConfig | None = None) -> timeseries_panel.Panel:
    """A time series panel; with `limits`, the thresholds are drawn as dashed lines and colour the series."""
    panel = _common(timeseries_panel.Panel(), title, unit, description, queries, width, height).fill_opacity(10)
    if minimum is not None:
        panel = panel.min(minimum)
    if maximum is not None:
        panel = panel.max(maximum)
    if limits is not None:
        panel = (panel.thresholds(limits)
                 .thresholds_style(common_builders.GraphThresholdsStyleConfig()
                                   .mode(common.GraphThresholdsStyleMode.DASHED))
                 .color_scheme(dash.FieldColor().mode(model.FieldColorModeId.THRESHOLDS)))
    return panel


def stat(title: str, unit: str, description: str, query: Query, *, width: int = 4, height: int = 4,
         limits: dash.ThresholdsConfig | None = None) -> stat_panel.Panel:
    """A single number: the latest value of one query, coloured by `limits` (all green without)."""
    return (_common(stat_panel.Panel(), title, unit, description, [query], width, height)
            .thresholds(limits or thresholds((None, GREEN)))
            .color_mode(common.BigValueColorMode.BACKGROUND)
            .graph_mode(common.BigValueGraphMode.AREA)
            .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))


def heatmap(title: str, unit: str, description: str, query: Query, *, width: int = 24,
            height: int = 10) -> heatmap_panel.Panel:
    """One row per series (the query's legend names the row), time across, colour the value.

    Grafana's heatmap always puts time on the x axis; with calculation off it takes each series as a row
    of cells, which makes it the per-rank (or per-GPU) heat map: a slow rank is a dark row.
    """
    return (_common(heatmap_panel.Panel(), title, unit, description, [query], width, height)
            .calculate(False)
            .color(heatmap_panel.HeatmapColorOptions().mode(heatmap_model.HeatmapColorMode.SCHEME)
                   .scheme("Turbo").exponent(0.5).steps(64).reverse(False)
                   .scale(heatmap_model.HeatmapColorScale.LINEAR))
            # The default hides cells at or below 1e-9: a stalled rank's zero must show, as the darkest cell.
            .filter_values(heatmap_panel.FilterValueRange().le(-1))
            .y_axis(heatmap_panel.YAxisConfig().axis_placement(common.AxisPlacement.LEFT).unit(NONE))
            .cell_gap(1)
            .show_value(common.VisibilityMode.NEVER)
            .tooltip(heatmap_panel.HeatmapTooltip().mode(common.TooltipDisplayMode.SINGLE).y_histogram(False))
            .show_legend())


def state_timeline(title: str, description: str, query: Query, states: dict[int, tuple[str, str]], *,
                   width: int = 12, height: int = 8) -> state_panel.Panel:
    """Numeric states shown by name and colour over time, one row per series."""
    mapping = model.ValueMap(
        options={str(value): model.ValueMappingResult(text=text, color=color, index=i)
                 for i, (value, (text, color)) in enumerate(sorted(states.items()))})
    return (_common(state_panel.Panel(), title, NONE, description, [query], width, height)
            .mappings([mapping])
            .show_value(common.VisibilityMode.NEVER)
            .merge_values(True)
            .fill_opacity(80))


def dashboard(uid: str, title: str, description: str, variables: Iterable[cog.Builder],
              sections: Iterable[tuple[str, Sequence[PanelBuilder]]]) -> dash.Dashboard:
    """A dashboard of titled rows of panels, with the shared time settings and tags."""
    board = (dash.Dashboard(title).uid(uid).description(description).tags(["gpuwatch"])
             .editable().tooltip(model.DashboardCursorSync.CROSSHAIR).refresh("30s").time("now-1h", "now")
             .timezone("browser").variables(list(variables)))
    ids = iter(range(1, 1000))
    for row_title, panels in sections:
        board = board.with_row(dash.Row(row_title).id(next(ids)))
        for panel in panels:
            board = board.with_panel(panel.id(next(ids)))
    return board
