"""The hooks' step life cycle stays in one object: a `Step` reads and writes the `StepContext` its Monitor hands it.

Held on the source (its syntax tree), since the property is about who touches what: no module but monitor.py assigns
an attribute of a Monitor (a Monitor is always called `monitor`, `self.monitor` or `self._monitor` outside it), and
the modules a step's life cycle runs through (step.py, record.py, ddp.py, gradient_stats.py) read none either, so that
changing when a step ends means reading the step and its context, not the Monitor as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HOOKS = ROOT / "trainer" / "hooks"
#: The modules of a step's life cycle, from `Monitor.step()` to the record: they are handed a context, not a Monitor.
LIFE_CYCLE = ("step.py", "record.py", "ddp.py", "gradient_stats.py")
MONITOR_NAMES = frozenset({"monitor", "_monitor"})


def _is_monitor(node: ast.expr) -> bool:
    """`monitor`, `self.monitor`, `step.monitor`, `self._monitor`: an expression that is a Monitor by its name."""
    if isinstance(node, ast.Name):
        return node.id in MONITOR_NAMES
    return isinstance(node, ast.Attribute) and node.attr in MONITOR_NAMES


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    flat: list[ast.expr] = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets += target.elts
        else:
            flat.append(target)
    return flat


def monitor_writes(source: str) -> list[str]:
    """Each assignment to an attribute of a Monitor in `source` (`monitor.x = ...`, `setattr(monitor, ...)`), as
    `line: text`."""
    writes = []
    for node in ast.walk(ast.parse(source)):
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and _is_monitor(target.value):
                writes.append(f"{target.lineno}: {ast.unparse(target)}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
                and node.args and _is_monitor(node.args[0])):
            writes.append(f"{node.lineno}: {ast.unparse(node)}")
    return writes


def monitor_reads(source: str) -> list[str]:
    """Each attribute read off a Monitor in `source`, as `line: text`."""
    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _is_monitor(node.value)]


def _sources() -> list[Path]:
    """Every Python file of the product, the benchmarks and the examples (not the tests)."""
    return sorted(path for path in ROOT.rglob("*.py")
                  if not {"tests", ".git", "build"} & set(path.relative_to(ROOT).parts[:-1]))


def test_the_checks_find_what_they_look_for():
    source = ("monitor.current = step\nself.monitor.raised, x = True, 1\nself._monitor.n += 1\n"
              "setattr(monitor, 'data_wait', None)\nmonitor.failures.on_first = f\nstep.monitor.clock.mark()\n")
    assert monitor_writes(source) == ["1: monitor.current", "2: self.monitor.raised", "3: self._monitor.n",
                                      "4: setattr(monitor, 'data_wait', None)"]
    assert monitor_reads(source) == ["5: monitor.failures", "6: step.monitor.clock"]


def test_no_module_but_the_monitors_own_assigns_a_monitor_attribute():
    sources = _sources()
    assert HOOKS / "step.py" in sources and ROOT / "trainer" / "auto" / "instrument.py" in sources
    writes = {str(path.relative_to(ROOT)): found for path in sources if path != HOOKS / "monitor.py"
              if (found := monitor_writes(path.read_text()))}
    assert writes == {}


@pytest.mark.parametrize("module", LIFE_CYCLE)
def test_a_steps_life_cycle_reads_its_context_and_not_the_monitor(module):
    assert monitor_reads((HOOKS / module).read_text()) == []
