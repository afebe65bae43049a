"""Grafana dashboards of gpuwatch, as code (``generate.py``, grafana-foundation-sdk) and as the generated JSON
shipped in ``json/``.

Importing this package needs no SDK: users who installed gpuwatch export the shipped JSON with
``gpuwatch dashboards export DIR``; only regenerating it needs the ``dashboards`` extra.
"""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

#: Module of each dashboard, and the JSON file (named by its uid) it generates.
DASHBOARDS = {
    "cluster": "gpuwatch-cluster",
    "node": "gpuwatch-node",
    "interconnect": "gpuwatch-interconnect",
    "training": "gpuwatch-training",
}


def json_files() -> list[Path]:
    """The shipped dashboard JSON files."""
    folder = resources.files(__name__) / "json"
    return [Path(str(folder / f"{uid}.json")) for uid in DASHBOARDS.values()]


def export(directory: Path) -> list[Path]:
    """Copy the dashboards' JSON into ``directory`` (created if missing), ready for Grafana's import or
    file provisioning; returns the written paths."""
    directory.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copyfile(source, directory / source.name)) for source in json_files()]
