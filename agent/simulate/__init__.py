"""A simulated node for machines without GPUs: the *same* collectors, driven by a scripted stand-in
for the ``pynvml`` module and a generated sysfs tree. Every series it serves is marked
``mode="simulated"`` on ``gpuwatch_agent_info``; the real path stays the default.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuwatch.agent.simulate.faults import Fault


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    description: str
    gpu_model: str
    gpu_count: int
    gpu_memory_bytes: int
    nvlinks_per_gpu: int
    #: NVLink data rate of one link, one direction (NVML reports the common speed in MB/s).
    nvlink_speed_mbps: int
    gpm_supported: bool
    pcie_max_generation: int
    pcie_max_width: int
    power_limit_watts: float
    driver_version: str
    #: One single-port HCA per entry, ``mlx5_0`` … ``mlx5_{n-1}``.
    ib_ports: int
    ib_rate: str
    ib_link_layer: str


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="dgx-h100",
            description="8× H100 SXM5 80GB, 18 NVLink4 links per GPU, 8× ConnectX-7 NDR 400 Gb/s InfiniBand",
            gpu_model="NVIDIA H100 80GB HBM3",
            gpu_count=8,
            gpu_memory_bytes=80 * 1024**3,
            nvlinks_per_gpu=18,
            nvlink_speed_mbps=26_562,
            gpm_supported=True,
            pcie_max_generation=5,
            pcie_max_width=16,
            power_limit_watts=700.0,
            driver_version="550.90.07",
            ib_ports=8,
            ib_rate="400 Gb/sec (4X NDR)",
            ib_link_layer="InfiniBand",
        ),
        Preset(
            name="a100-roce",
            description="4× A100 PCIe 40GB (no GPM, no NVLink), 2× ConnectX-6 RoCE 100 Gb/s",
            gpu_model="NVIDIA A100-PCIE-40GB",
            gpu_count=4,
            gpu_memory_bytes=40 * 1024**3,
            nvlinks_per_gpu=0,
            nvlink_speed_mbps=0,
            gpm_supported=False,
            pcie_max_generation=4,
            pcie_max_width=16,
            power_limit_watts=250.0,
            driver_version="535.183.01",
            ib_ports=2,
            ib_rate="100 Gb/sec (4X EDR)",
            ib_link_layer="Ethernet",
        ),
    )
}


class Simulation:
    """The scripted NVML module and sysfs tree of one preset, advanced before every sampling round."""

    def __init__(self, preset: Preset, workdir: Path, seed: int = 0, faults: Sequence[Fault] = ()) -> None:
        from gpuwatch.agent.simulate.fake_nvml import FakeNvml
        from gpuwatch.agent.simulate.sysfs import SimulatedSysfs

        self.preset = preset
        self.nvml = FakeNvml(preset, seed=seed)
        self.sysfs = SimulatedSysfs(preset, Path(workdir) / "sys", seed=seed)
        self._advancing = 0.0  # CPU seconds spent in advance()
        #: Planted faults not in effect yet: an Xid waits until the nvml collector listens for Xid events.
        self.pending = [fault for fault in faults if not self._plant(fault)]

    def _plant(self, fault: Fault) -> bool:
        """Put ``fault`` (checked by ``faults.load``) into effect; False when it cannot be yet."""
        nvml, sysfs, fields = self.nvml, self.sysfs, fault.fields
        if fault.kind == "xid":
            if not nvml.listens_for_xid(fields["gpu"]):
                return False
            nvml.inject_xid(fields["gpu"], fields["xid"])
        elif fault.kind == "nvlink_down":
            nvml.set_nvlink_up(fields["gpu"], fields["link"], up=False)
        elif fault.kind == "ib_port_down":
            sysfs.set_port_down(fields["device"], phys_state=fields["phys_state"])
        elif fault.kind == "ib_errors":
            sysfs.bump_counter(fields["device"], fields["counter"], fields["count"])
        elif fault.kind == "pcie":
            nvml.set_pcie_link(fields["gpu"], generation=fields["generation"], width=fields["width"])
        elif fault.kind == "clock_slowdown":
            from gpuwatch.agent.simulate.faults import CLOCK_REASONS

            reasons = 0
            for name in fields["reasons"]:
                reasons |= CLOCK_REASONS[name]
            nvml.set_clock_event_reasons(fields["gpu"], reasons)
        elif fault.kind == "ecc":
            nvml.inject_ecc(fields["gpu"], corrected=fields["corrected"], uncorrected=fields["uncorrected"])
        elif fault.kind == "row_remap_failure":
            nvml.fail_row_remap(fields["gpu"])
        elif fault.kind == "gpu_lost":
            nvml.lose_gpu(fields["gpu"])
        else:
            raise ValueError(f"no way to plant a {fault.kind} fault")
        return True

    @property
    def sysfs_root(self) -> Path:
        return self.sysfs.root

    def advance(self) -> None:
        """Move counters and gauges forward by the wall time elapsed since the last call."""
        started = time.thread_time()
        if self.pending:
            self.pending = [fault for fault in self.pending if not self._plant(fault)]
        self.nvml.advance()
        self.sysfs.advance()
        self._advancing += time.thread_time() - started

    def cpu_seconds(self) -> float:
        """CPU time this process spent on the simulation so far: advancing it, and inside the scripted NVML's
        functions while collectors call them. A real node pays none of it (it pays pynvml's ctypes calls and the
        driver instead), so the agent's own cost is its process's CPU time without this."""
        return self._advancing + self.nvml.cpu_seconds
