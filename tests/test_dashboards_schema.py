"""The dashboards' JSON type-checks against Grafana's own schema types (@grafana/schema 13) with
``tsc --noEmit --strict``: each dashboard becomes a typed TypeScript literal (``generate.typescript``), so
a misspelt key, a wrong type or an unknown enum value is a compile error. .ci/run installs typescript@5 and
@grafana/schema@13 into dashboards/typecheck/node_modules."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from gpuwatch.dashboards import DASHBOARDS
from gpuwatch.dashboards.generate import JSON_DIR, typescript

pytestmark = pytest.mark.integration

TYPECHECK = Path(__file__).resolve().parents[1] / "dashboards" / "typecheck"
TSC = TYPECHECK / "node_modules" / ".bin" / "tsc"
SCHEMA = TYPECHECK / "node_modules" / "@grafana" / "schema" / "package.json"


def _tsc(sources: dict[str, str]) -> subprocess.CompletedProcess:
    """Type-check these generated modules (name -> TypeScript) with the project's tsconfig (strict)."""
    if not TSC.exists() or not SCHEMA.exists():
        pytest.fail("typescript and @grafana/schema are not installed: run .ci/run, or "
                    "npm install --prefix dashboards/typecheck --no-save typescript@5 @grafana/schema@13")
    generated = TYPECHECK / "generated"
    generated.mkdir(exist_ok=True)
    for stale in generated.glob("*.ts"):
        stale.unlink()
    for name, source in sources.items():
        (generated / f"{name}.ts").write_text(source)
    return subprocess.run([str(TSC), "--noEmit", "--strict", "-p", str(TYPECHECK / "tsconfig.json")],
                          capture_output=True, text=True, timeout=300, cwd=TYPECHECK)


def _committed(name: str) -> dict:
    return json.loads((JSON_DIR / f"{DASHBOARDS[name]}.json").read_text())


def test_schema_is_grafana_13():
    assert json.loads(SCHEMA.read_text())["version"].startswith("13.")


def test_dashboards_type_check_against_grafana_schema():
    result = _tsc({name: typescript(_committed(name)) for name in DASHBOARDS})
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_violations_are_reported():
    """The check can fail: an unknown panel key, a wrong enum value and a misspelt option each do."""
    board = _committed("cluster")
    board["panels"][1]["gridPosition"] = board["panels"][1].pop("gridPos")
    board["panels"][2]["fieldConfig"]["defaults"]["thresholds"]["mode"] = "absolut"
    board["panels"][3]["options"]["colourMode"] = board["panels"][3]["options"].pop("colorMode")
    result = _tsc({"broken": typescript(board)})
    assert result.returncode != 0
    for culprit in ("gridPosition", "absolut", "colourMode"):
        assert culprit in result.stdout, result.stdout
