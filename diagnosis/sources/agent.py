"""``--agent URL``: one node's facts and its ranks' telemetry from a gpuwatch agent's /api/v1/state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from gpuwatch.agent.collectors.readings import NodeReadings
from gpuwatch.agent.telemetry.readings import TelemetryReadings
from gpuwatch.diagnosis.facts import Facts, SourceInfo
from gpuwatch.diagnosis.sources import HTTP_TIMEOUT, SourceError, http_json
from gpuwatch.diagnosis.sources.collectors import PARTS, node_facts
from gpuwatch.diagnosis.sources.telemetry import after_close, bandwidth, rank_facts
from gpuwatch.protocol.records import convert

STATE_PATH = "/api/v1/state"


def state_url(url: str) -> str:
    """The state endpoint of an agent given by its base URL (or by the endpoint itself)."""
    url = url.rstrip("/")
    return url if url.endswith(STATE_PATH) else url + STATE_PATH


def fetch(url: str, timeout: float = HTTP_TIMEOUT) -> Facts:
    return facts_from_state(http_json(state_url(url), "a gpuwatch agent", timeout), state_url(url))


def _is_state(state: Any) -> bool:
    return (isinstance(state, dict) and isinstance(state.get("agent"), dict) and "node" in state["agent"]
            and isinstance(state.get("facts"), dict) and isinstance(state.get("collectors"), dict))


def facts_from_state(state: Any, location: str) -> Facts:
    """Facts of the agent's node, of every rank that reported to it and of the latest probe of each job."""
    if not _is_state(state):
        raise SourceError(f"{location} is not a gpuwatch agent's state (no agent/collectors/facts objects)")
    name = state["agent"]["node"]
    collected: Mapping[str, Any] = state["facts"]
    facts = Facts(sources=[SourceInfo("agent", location)])
    missing = {}
    for collector in (*PARTS, "telemetry"):
        status = state["collectors"].get(collector)
        if collector in collected:
            if status is not None and status.get("partial_errors"):
                facts.notes.append(f"{name}: {collector} collector: {'; '.join(status['partial_errors'][:3])}")
            continue
        missing[collector] = (f"{collector} collector down: {status.get('last_error')}" if status is not None
                              else f"{collector} collector not enabled on the agent")
        facts.notes.append(f"{name}: {missing[collector]}")
    readings = NodeReadings.from_dict(collected)
    facts.nodes[name] = node_facts(name, readings, missing, simulated=state["agent"].get("mode") == "simulated")
    try:
        telemetry = convert(collected, StateFacts).telemetry or TelemetryReadings()
    except msgspec.ValidationError as exc:
        raise SourceError(f"{location}: malformed telemetry in the agent's state: {exc}") from None
    now = state.get("timestamp")
    processes = {(p.job, p.rank): p for p in readings.host.processes} if readings.host is not None else {}
    for reading in telemetry.ranks:
        rank = rank_facts(reading, node=name, now=now)
        closed = rank.progress if rank.progress is not None and rank.progress.phase == "closed" else None
        process = processes.get((rank.job, str(rank.rank)))
        rank.after_close = after_close(
            now - closed.time if closed is not None and closed.time is not None and now is not None else None,
            closed.cpu_seconds if closed is not None else None,
            (process.pid, process.cpu_seconds) if process is not None else None, rank.exited_at is not None)
        facts.ranks.append(rank)
    facts.bandwidth = bandwidth(telemetry.probes, name)
    return facts


class StateFacts(msgspec.Struct):
    """What diagnosis reads typed of the state's ``facts``: the telemetry collector's part (the node collectors'
    readings beside it are ``NodeReadings``'); absent where the collector is down or not enabled."""

    telemetry: TelemetryReadings | None = None
