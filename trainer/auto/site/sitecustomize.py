"""Injected by `gpuwatch run` (gpuwatch.trainer.auto): Python's `site` module imports this file at every start of a
process whose PYTHONPATH begins with its directory. With GPUWATCH_AUTO=1 it instruments the process once torch is
imported, and notes for `gpuwatch run` that it loaded (or why it could not: gpuwatch not importable by this
interpreter); in any case it then runs the sitecustomize it hides, the next one on `sys.path`, so that a site's or a
user's own start-up code still runs. Standard library only until it is enabled."""

from __future__ import annotations

import contextlib
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
        _note_unimportable(error)
        return
    install()


def _note_unimportable(error: ImportError) -> None:
    """Note the failed import for `gpuwatch run`'s end-of-run line, through gpuwatch's status module loaded by its
    path (standard library only, beside this file's directory): the package it belongs to is what failed to import.
    Nothing of it may stop the process: an interpreter that cannot load even that runs on, its message printed."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "status.py")
    with contextlib.suppress(Exception):
        spec = importlib.util.spec_from_file_location("_gpuwatch_run_status", path)
        if spec is None or spec.loader is None:
            return
        status = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(status)
        status.note("failure", where=f"importing gpuwatch in {sys.executable}",
                    error=f"{type(error).__name__}: {error}")


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
