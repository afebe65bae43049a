"""Node facts from the agent collectors' facts dicts (the shapes of ``agent/collectors/*.py``), whether they
come from an agent's /api/v1/state or from running the collectors in this process."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuwatch.agent.diagnosis.facts import GpuFacts, IbPortFacts, InterfaceFacts, NodeFacts, NvlinkFacts

#: Which node part each collector fills.
PARTS = {"nvml": "gpus", "nvlink": "nvlinks", "infiniband": "ib_ports", "host": "interfaces"}


def _gpu(raw: Mapping[str, Any]) -> GpuFacts:
    pcie = raw.get("pcie") or {}
    remap = raw.get("remapped_rows") or {}
    reasons = raw.get("clock_event_reasons")
    return GpuFacts(
        index=raw["index"], uuid=raw.get("uuid"), model=raw.get("model"), lost=bool(raw.get("lost")),
        utilization_ratio=raw.get("utilization_ratio"), sm_active_ratio=raw.get("sm_active_ratio"),
        memory_total_bytes=raw.get("memory_total_bytes"), memory_used_bytes=raw.get("memory_used_bytes"),
        temperature_celsius=raw.get("temperature_celsius"), power_watts=raw.get("power_watts"),
        sm_clock_hertz=raw.get("sm_clock_hertz"),
        clock_event_reasons=tuple(reasons) if reasons is not None else None,
        pcie_generation=pcie.get("current_generation"), pcie_max_generation=pcie.get("max_generation"),
        pcie_width=pcie.get("current_width"), pcie_max_width=pcie.get("max_width"),
        xid_errors=dict(raw.get("xid_errors") or {}),
        ecc_uncorrected=(raw.get("ecc_volatile") or {}).get("uncorrected"),
        remap_pending=bool(remap["pending"]) if "pending" in remap else None,
        remap_failure=bool(remap["failure"]) if "failure" in remap else None,
    )


def _nvlinks(links: list[Mapping[str, Any]]) -> list[NvlinkFacts]:
    """Per-link facts folded into one entry per GPU; a link whose state is unknown counts as neither."""
    by_gpu: dict[int, NvlinkFacts] = {}
    for link in links:
        gpu = by_gpu.setdefault(link["gpu"], NvlinkFacts(gpu=link["gpu"], links=0))
        gpu.links += 1
        if link.get("up") is False:
            gpu.down += (link["link"],)
        elif link.get("up") and link.get("speed_bytes_per_second"):
            gpu.up_speed_bytes_per_second = (gpu.up_speed_bytes_per_second or 0) + link["speed_bytes_per_second"]
    return [by_gpu[index] for index in sorted(by_gpu)]


def hca_model(device: Mapping[str, Any]) -> str | None:
    """The card model of an HCA from its sysfs attributes: the board id (PSID) names the exact SKU."""
    return device.get("board_id") or device.get("hca_type") or None


def _port(raw: Mapping[str, Any], models: Mapping[str, str | None]) -> IbPortFacts:
    return IbPortFacts(device=raw["device"], port=int(raw["port"]), link_layer=raw.get("link_layer"),
                       hca=models.get(raw["device"]),
                       state=raw.get("state"), phys_state=raw.get("phys_state"),
                       rate_bytes_per_second=raw.get("rate_bytes_per_second"), errors=dict(raw.get("errors") or {}))


def _interface(raw: Mapping[str, Any]) -> InterfaceFacts:
    return InterfaceFacts(name=raw["name"], up=bool(raw["up"]), loopback=bool(raw.get("is_loopback")),
                          addresses=tuple(a["address"] for a in raw.get("addresses", ()) if a.get("family") != "link"))


def node_facts(name: str, collected: Mapping[str, Mapping[str, Any]], missing: Mapping[str, str],
               simulated: bool | None = None) -> NodeFacts:
    """A node from the collectors' facts by collector name; ``missing`` says why a collector has none."""
    node = NodeFacts(name=name, simulated=simulated)
    if "nvml" in collected:
        node.gpus = [_gpu(raw) for raw in collected["nvml"].get("gpus", ())]
    if "nvlink" in collected:
        node.nvlinks = _nvlinks(collected["nvlink"].get("links", ()))
    if "infiniband" in collected:
        models = {device["device"]: hca_model(device) for device in collected["infiniband"].get("devices", ())}
        node.ib_ports = [_port(raw, models) for raw in collected["infiniband"].get("ports", ())]
    if "host" in collected:
        node.interfaces = [_interface(raw) for raw in collected["host"].get("network_interfaces", ())]
        node.cpus = collected["host"].get("cpu_count")
    node.missing = {PARTS[collector]: reason for collector, reason in missing.items()
                    if collector in PARTS and getattr(node, PARTS[collector]) is None}
    return node
