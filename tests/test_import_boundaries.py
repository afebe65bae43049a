"""The parts depend on each other one way (docs/architecture.md): every import statement of the package, lazy ones
inside functions included, is read from the source and checked against the boundaries below. A new import that
crosses one fails here, before it turns into a node agent that needs torch or a measuring module that judges."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Top-level folder -> the import name it is installed under (pyproject.toml's package-dir).
PACKAGES = {"agent": "gpuwatch.agent", "trainer": "gpuwatch.trainer", "protocol": "gpuwatch.protocol",
            "cli": "gpuwatch.cli", "alerts": "gpuwatch.alerts", "dashboards": "gpuwatch.dashboards"}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute names, at any depth of the file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _modules(folder: str) -> dict[str, set[str]]:
    """{file relative to the repository: what it imports} for every Python file under ``folder``."""
    return {str(path.relative_to(ROOT)): _imports(path) for path in sorted((ROOT / folder).rglob("*.py"))}


def _under(name: str, *prefixes: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def _violations(folder: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> dict[str, list[str]]:
    found = {}
    for module, imports in _modules(folder).items():
        bad = sorted(name for name in imports if _under(name, *forbidden) and not _under(name, *allowed))
        if bad:
            found[module] = bad
    return found


@pytest.mark.parametrize(("folder", "forbidden", "allowed", "why"), [
    ("agent", ("torch",), (), "the agent runs on nodes without torch"),
    ("protocol", ("torch",), (), "both sides import the protocol, the agent without torch"),
    ("agent", ("gpuwatch.trainer", "gpuwatch.cli"), (), "the agent knows the trainer only by its records"),
    ("protocol", ("gpuwatch.agent", "gpuwatch.trainer", "gpuwatch.cli"), (), "the protocol is neutral"),
    ("agent/collectors", ("gpuwatch.agent.diagnosis",), (), "collectors measure; diagnosis judges"),
    ("trainer/parallel", ("gpuwatch.trainer.hooks",), (), "the parallel trainer reads without its instruments"),
    ("trainer", ("gpuwatch.agent", "gpuwatch.cli"), ("gpuwatch.agent.collectors",),
     "the trainer speaks the protocol; it may read its node through the collectors (the probe), never judge"),
])
def test_import_boundary(folder, forbidden, allowed, why):
    assert _violations(folder, forbidden, allowed) == {}, why


def test_the_reader_sees_lazy_imports_inside_functions(tmp_path):
    """The boundary holds for imports a function makes when it runs, not only at the top of a file."""
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    import torch.distributed as dist\n    from gpuwatch.trainer import hooks\n")
    assert _imports(source) >= {"torch.distributed", "gpuwatch.trainer", "gpuwatch.trainer.hooks"}


def test_every_top_level_package_is_checked():
    """A new top-level package must be named here (and in pyproject.toml's package-dir) to be covered."""
    folders = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert folders == set(PACKAGES)
