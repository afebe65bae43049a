"""Node facts from the node collectors' typed readings (``agent.collectors.readings``), whether they come back
from an agent's /api/v1/state or from running the collectors in this process."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from gpuwatch.agent.collectors.nvml import GPU_GAUGES
from gpuwatch.agent.collectors.readings import (
    GpuReading,
    IbPortReading,
    InterfaceReading,
    NodeReadings,
    NvlinkReading,
)
from gpuwatch.agent.metricspec import MetricSpec
from gpuwatch.diagnosis.facts import (
    CounterSample,
    GpuFacts,
    IbPortFacts,
    InterfaceFacts,
    NodeFacts,
    NvlinkFacts,
)

#: Which node part each collector fills.
PARTS = {"nvml": "gpus", "nvlink": "nvlinks", "infiniband": "ib_ports", "host": "interfaces"}


def read_by(specs: Iterable[MetricSpec], facts_type: type) -> tuple[MetricSpec, ...]:
    """The declared series whose field ``facts_type`` has too: what diagnosis reads of a collector's table.

    A quantity keeps one name from the collector's reading (or the telemetry record) to diagnosis' facts, so this
    filters the exporter's own declaration instead of copying part of it."""
    fields = {field.name for field in dataclasses.fields(facts_type)}
    return tuple(spec for spec in specs if spec.field in fields)


#: The per-GPU gauges diagnosis judges, read from a reading here and from their series by the Prometheus source.
GPU_GAUGES_READ = read_by(GPU_GAUGES, GpuFacts)


def _gpu(reading: GpuReading) -> GpuFacts:
    pcie, rows, ecc = reading.pcie, reading.remapped_rows, reading.ecc_volatile
    return GpuFacts(
        index=reading.index, uuid=reading.uuid, model=reading.model, lost=reading.lost,
        **{spec.field: getattr(reading, spec.field) for spec in GPU_GAUGES_READ},
        clock_event_reasons=reading.clock_event_reasons,
        pcie_generation=pcie.current_generation if pcie is not None else None,
        pcie_max_generation=pcie.max_generation if pcie is not None else None,
        pcie_width=pcie.current_width if pcie is not None else None,
        pcie_max_width=pcie.max_width if pcie is not None else None,
        xid_errors=dict(reading.xid_errors),
        ecc_uncorrected=ecc.uncorrected if ecc is not None else None,
        remap_pending=bool(rows.pending) if rows is not None and rows.pending is not None else None,
        remap_failure=bool(rows.failure) if rows is not None and rows.failure is not None else None,
    )


def _nvlinks(links: Sequence[NvlinkReading]) -> list[NvlinkFacts]:
    """Per-link readings folded into one entry per GPU; a link whose state is unknown counts as neither."""
    by_gpu: dict[int, NvlinkFacts] = {}
    for link in links:
        gpu = by_gpu.setdefault(link.gpu, NvlinkFacts(gpu=link.gpu, links=0))
        gpu.links += 1
        if link.up is False:
            gpu.down += (link.link,)
        elif link.up and link.speed_bytes_per_second:
            gpu.up_speed_bytes_per_second = (gpu.up_speed_bytes_per_second or 0) + link.speed_bytes_per_second
    return [by_gpu[index] for index in sorted(by_gpu)]


def hca_model(board_id: str | None, hca_type: str | None) -> str | None:
    """The card model of an HCA from its sysfs attributes: the board id (PSID) names the exact SKU."""
    return board_id or hca_type or None


def _port(reading: IbPortReading, models: dict[str, str | None]) -> IbPortFacts:
    return IbPortFacts(device=reading.device, port=reading.port, link_layer=reading.link_layer,
                       hca=models.get(reading.device), state=reading.state, phys_state=reading.phys_state,
                       rate_bytes_per_second=reading.rate_bytes_per_second, errors=dict(reading.errors))


def _interface(reading: InterfaceReading) -> InterfaceFacts:
    return InterfaceFacts(name=reading.name, up=reading.up, loopback=reading.is_loopback,
                          addresses=reading.ip_addresses, speed_bytes_per_second=reading.speed_bytes_per_second)


def node_facts(name: str, readings: NodeReadings, missing: dict[str, str], simulated: bool | None = None) -> NodeFacts:
    """A node from its collectors' readings; ``missing`` says why a collector (by name) has none."""
    node = NodeFacts(name=name, simulated=simulated)
    if readings.nvml is not None:
        node.gpus = [_gpu(gpu) for gpu in readings.nvml.gpus]
    if readings.nvlink is not None:
        node.nvlinks = _nvlinks(readings.nvlink.links)
    if readings.infiniband is not None:
        models = {device.device: hca_model(device.board_id, device.hca_type)
                  for device in readings.infiniband.devices}
        node.ib_ports = [_port(port, models) for port in readings.infiniband.ports]
    if readings.host is not None:
        node.interfaces = [_interface(interface) for interface in readings.host.network_interfaces]
        node.traffic = [CounterSample(sample.time, {i.name: (i.receive_bytes, i.transmit_bytes, i.errors, i.drops)
                                                    for i in sample.interfaces})
                        for sample in readings.host.network_traffic]
        node.cpus = readings.host.cpu_count
    node.missing = {PARTS[collector]: reason for collector, reason in missing.items()
                    if collector in PARTS and getattr(node, PARTS[collector]) is None}
    return node
