"""The node this runs on, read directly (no agent needed): the agent's own collectors run once in this
process — InfiniBand ports from sysfs, network interfaces via psutil, GPUs and NVLink via NVML where a
driver is present — and, for ``--preflight``, the NCCL-related variables of the current shell."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pynvml

from gpuwatch.agent.collectors import REGISTRY, CollectorContext
from gpuwatch.agent.collectors.readings import NodeReadings
from gpuwatch.diagnosis.facts import Facts, SourceInfo
from gpuwatch.diagnosis.sources.collectors import PARTS, node_facts
from gpuwatch.protocol.schema import env_name_allowed


def collect(sysfs_root: Path = Path("/sys"), *, env: Mapping[str, str] | None = None) -> Facts:
    """This node's facts; ``env`` (the shell's environment, for a pre-flight check) is kept to the names a
    hello may carry, so secrets never reach a report."""
    name = socket.gethostname()
    context = CollectorContext(sysfs_root=Path(sysfs_root), node=name, nvml=pynvml)
    collected: dict[str, Any] = {}  # readings by collector name
    missing: dict[str, str] = {}
    facts = Facts(sources=[SourceInfo("preflight" if env is not None else "local", name)])
    for collector_name in PARTS:
        collector = REGISTRY[collector_name](context)
        try:
            result = collector.collect()
        except Exception as exc:  # a collector that cannot sample here costs its part of the facts only
            missing[collector_name] = f"{collector_name}: {exc}"
            facts.notes.append(f"{name}: {collector_name} unavailable: {exc}")
            continue
        finally:
            collector.close()
        collected[collector_name] = result.readings
        facts.notes += [f"{name}: {collector_name}: {error}" for error in result.errors[:3]]
    node_fact = node_facts(name, NodeReadings(**collected), missing)
    if env is not None:
        node_fact.env = {key: value for key, value in env.items() if env_name_allowed(key)}
    facts.nodes[name] = node_fact
    return facts
