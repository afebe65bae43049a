"""The parts depend on each other one way (docs/architecture.md): every import statement of the package, lazy ones
inside functions included, is read from the source and checked against the boundaries below. A new import that
crosses one fails here, before it turns into a node agent that needs torch or a measuring module that judges."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Top-level folder -> the import name it is installed under (pyproject.toml's package-dir).
PACKAGES = {"agent": "gpuwatch.agent", "diagnosis": "gpuwatch.diagnosis", "trainer": "gpuwatch.trainer",
            "protocol": "gpuwatch.protocol", "cli": "gpuwatch.cli", "alerts": "gpuwatch.alerts",
            "dashboards": "gpuwatch.dashboards", "plan": "gpuwatch.plan", "report": "gpuwatch.report"}


#: Modules that may import a forbidden name inside a function only (measuring with torch where the package runs
#: without it): {file: names}. A top-level import of them still fails the boundary.
LAZY_ONLY = {"plan/calibrate.py": ("torch",)}


def _imports(path: Path, skip_functions: bool = False) -> set[str]:
    """Every module ``path`` imports, absolute names, at any depth of the file (outside function bodies with
    ``skip_functions``)."""
    names: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    nested = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
              for inner in ast.walk(node)} if skip_functions else set()
    for node in ast.walk(tree):
        if id(node) in nested:
            continue
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
        lazy = LAZY_ONLY.get(module, ())
        if lazy:
            top_level = _imports(ROOT / module, skip_functions=True)
            imports = {name for name in imports if not _under(name, *lazy) or name in top_level}
        bad = sorted(name for name in imports if _under(name, *forbidden) and not _under(name, *allowed))
        if bad:
            found[module] = bad
    return found


@pytest.mark.parametrize(("folder", "forbidden", "allowed", "why"), [
    ("agent", ("torch",), (), "the agent runs on nodes without torch"),
    ("protocol", ("torch",), (), "both sides import the protocol, the agent without torch"),
    ("agent", ("gpuwatch.trainer", "gpuwatch.cli"), (), "the agent knows the trainer only by its records"),
    ("protocol", ("gpuwatch.agent", "gpuwatch.trainer", "gpuwatch.cli"), (), "the protocol is neutral"),
    ("agent", ("gpuwatch.diagnosis", "gpuwatch.report"), (),
     "the node agent measures and serves; diagnosis, above it, judges what it serves (and run logs, and Prometheus)"),
    ("diagnosis", ("torch", "gpuwatch.trainer", "gpuwatch.cli", "gpuwatch.report"), (),
     "diagnosis runs wherever gpuwatch does, knows the trainer only by its records, and is below the report"),
    ("trainer/parallel", ("gpuwatch.trainer.hooks",), (), "the parallel trainer reads without its instruments"),
    ("trainer", ("gpuwatch.agent", "gpuwatch.cli"), ("gpuwatch.agent.collectors",),
     "the trainer speaks the protocol; it may read its node through the collectors (the probe), never judge"),
    ("plan", ("torch", "gpuwatch.agent", "gpuwatch.cli", "gpuwatch.trainer"), (),
     "the planner runs without torch, wherever gpuwatch does, and knows nothing of the trainer, which imports it "
     "(the reference model's shape, ModelConfig, is the planner's; its calibration imports torch inside the "
     "function that measures: LAZY_ONLY)"),
    ("report", ("torch", "gpuwatch.trainer", "gpuwatch.cli", "gpuwatch.plan", "gpuwatch.diagnosis.rules"), (),
     "the report reads what the diagnosis sources read and shows the engine's findings: it judges nothing itself, "
     "and reads a plan as its JSON"),
])
def test_import_boundary(folder, forbidden, allowed, why):
    assert _violations(folder, forbidden, allowed) == {}, why


def test_importing_the_agent_the_diagnosis_and_the_report_loads_nothing_of_the_trainer_nor_torch():
    """Transitively, not only the import statements above: a fresh interpreter imports the agent's command, the
    diagnosis engine with every rule, and the report, and holds no module of the trainer's, nor torch."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, gpuwatch.agent.cli, gpuwatch.diagnosis.engine, "
         "gpuwatch.diagnosis.rules, gpuwatch.report.cli, gpuwatch.alerts.generate; "
         "print(' '.join(m for m in sys.modules if m.startswith(('gpuwatch.trainer', 'torch'))))"],
        capture_output=True, text=True, check=True, timeout=120)
    assert loaded.stdout.split() == [], loaded.stdout


def test_the_facts_the_rules_judge_import_nothing_of_the_planner():
    """diagnosis/facts.py is the contract every source fills and every rule reads: the calibration it carries for the
    PLAN rules is protocol.calibration's, so the contract stands without the planner (which the PLAN rules import)."""
    assert not {name for name in _imports(ROOT / "diagnosis" / "facts.py") if _under(name, "gpuwatch.plan")}


#: The parts whose modules must not use each other's private names (tests may: see `test_no_private_name_...`).
PRIVATE_CHECKED = ("agent", "diagnosis", "trainer", "protocol", "cli", "alerts", "dashboards", "plan", "report")
#: A named tuple's API: public, though spelled with an underscore so as not to clash with its fields.
NAMED_TUPLE_API = frozenset({"_asdict", "_field_defaults", "_fields", "_make", "_replace"})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in NAMED_TUPLE_API


def _private_uses(path: Path, root: Path = ROOT) -> list[str]:
    """Each use in ``path`` (a file under ``root``) of another gpuwatch module's private name: ``from gpuwatch.x import
    _name``, ``_name`` read off an imported gpuwatch module or off a name imported from one (``snapshot._name``,
    ``Class._name``), and a private module (``gpuwatch.x._module``) imported from outside the package holding it."""
    folder, *subpackages, _ = path.relative_to(root).parts
    package = ".".join([PACKAGES[folder], *subpackages])
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _under(node.module, "gpuwatch"):
            found += [(node.lineno, f"from {node.module} import {alias.name}")
                      for alias in node.names if _private(alias.name)]
            imported.update(alias.asname or alias.name for alias in node.names)
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names if _under(alias.name, "gpuwatch")]
            imported.update(alias.asname or alias.name.split(".")[0] for alias in node.names if alias.name in modules)
        else:
            continue
        for module in modules:  # a private module may be imported by its own package only
            parts = module.split(".")
            holder = next((".".join(parts[:index]) for index, part in enumerate(parts) if _private(part)), None)
            if holder is not None and not _under(package, holder):
                found.append((node.lineno, f"import of {module}, private to {holder}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in imported:
                found.append((node.lineno, ast.unparse(node)))
    return [f"line {line}: {use}" for line, use in sorted(found)]


def test_no_private_name_of_another_module_is_used():
    """A module's private names (a leading underscore) are its own: another module that needs one makes it public
    where it is defined, so whoever changes the module sees who depends on what. Tests are exempt: they are white-box
    on purpose (they patch a module's clock, read a store's queue, call a parser directly) and nothing builds on
    them, so their coupling costs no other module; the benchmarks, outside the package, likewise."""
    found = {}
    for folder in PRIVATE_CHECKED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            uses = _private_uses(path)
            if uses:
                found[str(path.relative_to(ROOT))] = uses
    assert found == {}


def test_the_private_name_check_sees_every_form(tmp_path):
    """Imported private names, private names read off imported modules and names, and private modules imported
    from outside their package; not dunders, a named tuple's API, or one's own private names."""
    (tmp_path / "agent").mkdir()
    source = tmp_path / "agent" / "uses.py"
    source.write_text(
        "import gpuwatch.trainer.hooks.monitor as monitor\n"
        "from gpuwatch.agent import __version__, snapshot\n"
        "from gpuwatch.agent.snapshot import Snapshot, _json_safe\n"
        "from gpuwatch.trainer.hooks._internal import Failures\n"
        "from gpuwatch.agent.collectors._procfs import open_counters\n"
        "def f(point):\n"
        "    _own = point._replace(step=1)\n"
        "    return monitor._Phase, snapshot._json_safe(1), Snapshot._cache, point._hidden, _own\n")
    assert _private_uses(source, tmp_path) == [
        "line 3: from gpuwatch.agent.snapshot import _json_safe",
        "line 4: import of gpuwatch.trainer.hooks._internal, private to gpuwatch.trainer.hooks",
        "line 5: import of gpuwatch.agent.collectors._procfs, private to gpuwatch.agent.collectors",
        "line 8: Snapshot._cache", "line 8: monitor._Phase", "line 8: snapshot._json_safe"]


#: Past this many lines a module of the package says why in its docstring: a long module is usually several parts,
#: each of which could be read alone.
MAX_LINES = 500
LONG_REASON = f"Past {MAX_LINES} lines on purpose:"


def test_a_module_past_the_line_limit_says_why():
    long = {}
    for folder in ("agent", "trainer", "protocol", "cli", "plan"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            source = path.read_text()
            lines = len(source.splitlines())
            if lines > MAX_LINES and LONG_REASON not in (ast.get_docstring(ast.parse(source)) or ""):
                long[str(path.relative_to(ROOT))] = lines
    assert long == {}, f"split them, or say why in the docstring ({LONG_REASON} ...)"


def test_the_reader_sees_lazy_imports_inside_functions(tmp_path):
    """The boundary holds for imports a function makes when it runs, not only at the top of a file."""
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    import torch.distributed as dist\n    from gpuwatch.trainer import hooks\n")
    assert _imports(source) >= {"torch.distributed", "gpuwatch.trainer", "gpuwatch.trainer.hooks"}


def test_a_lazy_only_import_is_allowed_inside_functions_only(tmp_path):
    source = tmp_path / "lazy.py"
    source.write_text("import json\ndef f():\n    import torch\nclass C:\n    def g(self):\n        import numpy\n")
    assert _imports(source, skip_functions=True) == {"json"}
    assert _imports(source) == {"json", "torch", "numpy"}


def test_every_top_level_package_is_checked():
    """A new top-level package must be named here (and in pyproject.toml's package-dir) to be covered."""
    folders = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert folders == set(PACKAGES)
