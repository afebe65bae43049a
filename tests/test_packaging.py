"""Packaging: everything installs under `gpuwatch.`; no package folder is forgotten in pyproject.toml."""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_under_the_gpuwatch_name():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    roots = config["package-dir"]  # {"gpuwatch.agent": "agent", ...}
    on_disk = set()
    for import_name, folder in roots.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join((import_name, *relative)))
    assert on_disk == listed
    assert all(name.startswith("gpuwatch.") for name in listed)


def test_console_script_points_at_the_cli():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"gpuwatch": "gpuwatch.cli.main:main"}


def test_agent_dependencies_exclude_torch_and_deprecated_pynvml():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].split("~")[0].strip().lower() for dep in project["dependencies"]}
    assert "torch" not in names
    assert "pynvml" not in names and "nvidia-ml-py" in names


def test_the_report_ships_its_page_assets_and_the_vendored_chart_library_with_its_licence():
    """The page inlines them at run time (report/render.py): a wheel without them writes no page."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["gpuwatch.report"]
    shipped = {path.relative_to(ROOT / "report").as_posix() for pattern in patterns
               for path in (ROOT / "report").glob(pattern)}
    assert {"page.js", "page.css", "vendor/uplot/uPlot.iife.min.js", "vendor/uplot/uPlot.min.css",
            "vendor/uplot/LICENSE"} <= shipped
