"""Collector registry: one module per source, each exporting one ``Collector`` subclass."""

from __future__ import annotations

from gpuwatch.agent.collectors.base import Collector, CollectorContext, CollectorResult
from gpuwatch.agent.collectors.host import HostCollector
from gpuwatch.agent.collectors.infiniband import InfinibandCollector
from gpuwatch.agent.collectors.nvlink import NvlinkCollector
from gpuwatch.agent.collectors.nvml import NvmlCollector
from gpuwatch.agent.collectors.telemetry import TelemetryCollector

REGISTRY: dict[str, type[Collector]] = {
    cls.name: cls
    for cls in (NvmlCollector, NvlinkCollector, InfinibandCollector, HostCollector, TelemetryCollector)
}

__all__ = ["REGISTRY", "Collector", "CollectorContext", "CollectorResult"]
