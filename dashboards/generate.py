"""Regenerates the committed dashboard JSON from the code: ``python -m gpuwatch.dashboards.generate``.

tests/test_dashboards.py fails when the committed JSON differs from what this writes, so the JSON and the
code cannot drift apart. ``typescript()`` renders a dashboard as a typed TypeScript literal for the
type-check against Grafana's own schema types (@grafana/schema).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.cog.encoder import JSONEncoder

from gpuwatch.dashboards import DASHBOARDS

JSON_DIR = Path(__file__).resolve().parent / "json"

#: Panel type -> (module of @grafana/schema's generated panel types, has a FieldConfig for `custom`).
PANEL_TYPES = {
    "timeseries": ("timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen", True),
    "stat": ("stat/panelcfg/x/StatPanelCfg_types.gen", False),
    "heatmap": ("heatmap/panelcfg/x/HeatmapPanelCfg_types.gen", True),
    "state-timeline": ("statetimeline/panelcfg/x/StateTimelinePanelCfg_types.gen", True),
}


#: Interval-variable settings the SDK writes on every variable; Grafana's dashboard schema (@grafana/schema 13)
#: has no such fields, and these dashboards have no interval variable.
_INTERVAL_ONLY = ("auto", "auto_count", "auto_min")


def build(name: str) -> dict[str, Any]:
    """One dashboard as the JSON object Grafana imports."""
    board = importlib.import_module(f"gpuwatch.dashboards.{name}").build().build()
    data = json.loads(json.dumps(board, cls=JSONEncoder))
    for variable in data["templating"]["list"]:
        for key in _INTERVAL_ONLY:
            variable.pop(key, None)
    return data


def render(name: str) -> str:
    """One dashboard's JSON text, stable across runs (sorted keys) so diffs show real changes."""
    return json.dumps(build(name), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write(directory: Path = JSON_DIR) -> list[Path]:
    """Write every dashboard's JSON into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, uid in DASHBOARDS.items():
        path = directory / f"{uid}.json"
        path.write_text(render(name), encoding="utf-8")
        written.append(path)
    return written


def typescript(dashboard: dict[str, Any]) -> str:
    """The dashboard as a TypeScript module whose literals are typed with @grafana/schema's types: the
    whole dashboard as ``Dashboard``, and each panel's ``options`` and ``fieldConfig.defaults.custom`` as
    its panel plugin's ``Options`` and ``FieldConfig`` (excess property checks catch misspelt keys)."""
    lines = [
        'import type { Dashboard } from "@grafana/schema";',
        "// JSON spells a string enum member by its value: Json<T> is T with each string enum replaced by the union",
        "// of its values (`${E}`), and nothing else loosened.",
        "type Json<T> = T extends string ? (string extends T ? T : `${T}`)",
        "  : T extends readonly (infer U)[] ? Json<U>[]",
        "  : T extends object ? { [K in keyof T]: Json<T[K]> }",
        "  : T;",
    ]
    kinds = sorted({p["type"] for p in dashboard["panels"] if p["type"] != "row"})
    for kind in kinds:
        module, _ = PANEL_TYPES[kind]
        alias = kind.replace("-", "_")
        lines.append(f'import type * as {alias} from "@grafana/schema/dist/esm/raw/composable/{module}";')
    lines.append(f"export const dashboard: Json<Dashboard> = {json.dumps(dashboard, indent=2)};")
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        alias = panel["type"].replace("-", "_")
        lines.append(f"export const options_{panel['id']}: Json<{alias}.Options> = {json.dumps(panel['options'])};")
        if PANEL_TYPES[panel["type"]][1]:
            custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
            lines.append(f"export const custom_{panel['id']}: Json<{alias}.FieldConfig> = {json.dumps(custom)};")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    for path in write(Path(sys.argv[1]) if len(sys.argv) > 1 else JSON_DIR):
        print(path)
