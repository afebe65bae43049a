"""Collector registry: one module per source, each exporting one ``Collector`` subclass.

A collector is registered by being here, as node_exporter's register themselves from their own file: every public
module of this package (not ``base``, ``readings`` or a ``_private`` helper) is imported and its ``Collector``
subclass registered under its ``name``. Adding a collector is adding its module; nothing else lists them in code
(the agent's switches, the sampler and the docs' collector table are made from ``REGISTRY``).
"""

from __future__ import annotations

import importlib
import pkgutil

from gpuwatch.agent.collectors.base import Collector, CollectorContext, CollectorResult

#: Modules of this package that hold no collector: the interface and the typed readings.
_NOT_COLLECTORS = frozenset({"base", "readings"})


def discover(package: str = __name__) -> dict[str, type[Collector]]:
    """The collectors of ``package``'s public modules by name, in module order; a module with no collector, or with
    two, or two modules with one name, fail at import with one line naming them."""
    found: dict[str, type[Collector]] = {}
    path = importlib.import_module(package).__path__
    for info in pkgutil.iter_modules(path):
        if info.name.startswith("_") or info.name in _NOT_COLLECTORS:
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        classes = [value for value in vars(module).values() if isinstance(value, type)
                   and issubclass(value, Collector) and value.__module__ == module.__name__]
        if len(classes) != 1:
            raise ImportError(f"{module.__name__} must define one Collector subclass, not {len(classes)}")
        (collector,) = classes
        if collector.name in found:
            raise ImportError(f"{module.__name__}: the collector name {collector.name!r} is taken")
        found[collector.name] = collector
    return found


REGISTRY: dict[str, type[Collector]] = discover()

__all__ = ["REGISTRY", "Collector", "CollectorContext", "CollectorResult", "discover"]
