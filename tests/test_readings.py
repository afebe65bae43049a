"""The typed readings contract: every reading a simulated node's collectors return comes back from /api/v1/state
as the identical dataclass, and the metric declarations are what both the exposition and diagnosis read."""

from __future__ import annotations

import dataclasses
import math

import pytest

from gpuwatch.agent.collectors import REGISTRY, readings
from gpuwatch.agent.collectors.base import CollectorContext
from gpuwatch.agent.collectors.nvml import GPU_GAUGES, NvmlCollector
from gpuwatch.agent.collectors.readings import (
    GpuReading,
    HostReadings,
    IbPortReading,
    NodeReadings,
    NvmlReadings,
    Reading,
)
from gpuwatch.agent.metricspec import MetricSpec
from gpuwatch.agent.sampler import Sampler
from gpuwatch.agent.server import AgentHTTPServer, serve_in_thread
from gpuwatch.agent.simulate import PRESETS, Simulation
from gpuwatch.agent.simulate.fake_nvml import FakeNvml
from gpuwatch.diagnosis.facts import GpuFacts
from gpuwatch.diagnosis.sources import agent as agent_source
from gpuwatch.diagnosis.sources import http_json
from gpuwatch.diagnosis.sources.collectors import GPU_GAUGES_READ, node_facts

#: The node collectors, by the fields of ``NodeReadings`` (a collector added by docs/architecture.md's recipe adds
#: one, so this test samples it with no edit here).
NODE_COLLECTORS = tuple(field.name for field in dataclasses.fields(NodeReadings))
#: Every reading type the contract declares.
READING_TYPES = {value for value in vars(readings).values()
                 if isinstance(value, type) and issubclass(value, Reading) and value is not Reading}


@pytest.fixture
def node(tmp_path):
    """A simulated DGX H100 sampled twice by the node collectors, with the faults that fill every optional reading
    (ECC errors and a pending row remap, an Xid, a lost GPU, a link and a port down); and the agent's HTTP server."""
    simulation = Simulation(PRESETS["dgx-h100"], tmp_path, seed=5)
    context = CollectorContext(sysfs_root=simulation.sysfs_root, nvml=simulation.nvml, simulated=True)
    sampler = Sampler([REGISTRY[name](context) for name in NODE_COLLECTORS],
                      interval=1.0, deadline=30.0, node="sim", mode="simulated")
    server = AgentHTTPServer(("127.0.0.1", 0), lambda: sampler.snapshot, stale_after=3600.0)
    serve_in_thread(server)
    try:
        sampler.sample_once()
        simulation.nvml.advance(1.0)
        simulation.nvml.inject_ecc(2, corrected=3, uncorrected=1)
        simulation.nvml.inject_xid(1, 79)
        simulation.nvml.set_nvlink_up(3, 7, False)
        simulation.nvml.lose_gpu(6)
        simulation.sysfs.set_port_down("mlx5_3", phys_state="Polling")
        simulation.sysfs.bump_counter("mlx5_2", "link_error_recovery", 10**6)  # 8-bit: saturates
        sampler.sample_once()
        yield sampler.snapshot, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        sampler.close()


def _types_in(value: object) -> set[type]:
    """The reading types a reading holds, itself included."""
    if isinstance(value, Reading):
        return {type(value)}.union(*(_types_in(getattr(value, field.name)) for field in dataclasses.fields(value)))
    if isinstance(value, tuple):
        return set().union(*(_types_in(item) for item in value))
    return set()


def test_every_reading_round_trips_through_the_state_endpoint_into_the_identical_dataclass(node):
    snapshot, url = node
    collected = NodeReadings(**{name: snapshot.readings[name] for name in NODE_COLLECTORS})
    assert _types_in(collected) == READING_TYPES  # the simulated node exercises every type
    assert collected.nvml.gpus[6].lost and collected.nvml.gpus[2].ecc_volatile.uncorrected == 1

    served = http_json(agent_source.state_url(url), "a gpuwatch agent")
    assert NodeReadings.from_dict(served["facts"]) == collected
    # Diagnosis sees the same node whether it ran the collectors itself or read an agent's state.
    assert agent_source.facts_from_state(served, url).nodes["sim"] == node_facts("sim", collected, {}, simulated=True)


def test_from_dict_reads_what_an_older_agent_left_out_as_unknown_and_ignores_what_a_newer_one_adds():
    lost = {"index": 3, "lost": True, "xid_watched": True, "xid_errors": {"79": 2}, "added_later": 1}
    assert GpuReading.from_dict(lost) == GpuReading(index=3, lost=True, xid_watched=True, xid_errors={"79": 2})
    assert NvmlReadings.from_dict({"gpus": [lost]}).gpus[0].power_watts is None
    assert NodeReadings.from_dict({"telemetry": {"ranks": []}}) == NodeReadings()


def test_non_finite_floats_come_back_from_their_json_strings():
    port = IbPortReading.from_dict({"device": "mlx5_0", "port": 1, "rate_bytes_per_second": "+Inf"})
    assert port.rate_bytes_per_second == math.inf
    assert math.isnan(HostReadings.from_dict({"cpu_ratio": "NaN"}).cpu_ratio)


def test_gpu_gauges_are_exported_from_their_declared_field_and_read_back_by_the_same_declaration():
    nvml = FakeNvml(PRESETS["dgx-h100"], seed=7)
    collector = NvmlCollector(CollectorContext(nvml=nvml, simulated=True))
    collector.collect()
    nvml.advance(1.0)
    result = collector.collect()
    exported = {(sample.name, sample.labels["gpu"]): sample.value for family in result.families
                for sample in family.samples if "gpu" in sample.labels}
    for spec in GPU_GAUGES:
        for gpu in result.readings.gpus:
            assert exported[spec.name, str(gpu.index)] == getattr(gpu, spec.field), spec.name
    read = {spec.name for spec in GPU_GAUGES_READ}
    assert read == {"gpuwatch_gpu_utilization_ratio", "gpuwatch_gpu_sm_active_ratio", "gpuwatch_gpu_memory_total_bytes",
                    "gpuwatch_gpu_memory_used_bytes", "gpuwatch_gpu_temperature_celsius", "gpuwatch_gpu_power_watts",
                    "gpuwatch_gpu_sm_clock_hertz"}
    assert all(hasattr(GpuFacts(index=0), spec.field) for spec in GPU_GAUGES_READ)
    collector.close()


def test_a_declaration_must_name_its_unit():
    with pytest.raises(ValueError, match="does not name its unit"):
        MetricSpec("gpuwatch_gpu_power", "Power.", "watts", "power_watts")

