"""Injected by `gpuwatch run` (gpuwatch.trainer.auto): Python's `site` module imports this file at every start of a
process whose PYTHONPATH begins with its directory. With GPUWATCH_AUTO=1 it instruments the process once torch is
imported; in any case it then runs the sitecustomize it hides, the next one on `sys.path`, so that a site's or a
user's own start-up code still runs. Standard library only until it is enabled."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _enable() -> None:
    if os.environ.get("GPUWATCH_AUTO") != "1":
        return
    try:
        from gpuwatch.trainer.auto import install
    except ImportError as error:  # gpuwatch is not importable by this interpreter: run unmeasured
        print(f"gpuwatch run: not instrumenting {sys.executable}: {error}", file=sys.stderr)
        return
    install()


def _run_the_next_sitecustomize() -> None:
    """Execute the first sitecustomize on `sys.path` after this file's directory, as `sitecustomize` (its errors
    reach `site`, which reports them as it would have)."""
    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(entry or os.curdir) for entry in sys.path]
    later = entries[entries.index(here) + 1:] if here in entries else [e for e in entries if e != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_enable()
_run_the_next_sitecustomize()
