"""The cluster a plan is for: GPU presets from NVIDIA's datasheets, how many per node, and measured figures that
replace the datasheet's where a machine has been calibrated.

Each preset's figures are the datasheet's dense (no 2:4 sparsity) tensor-core peaks for bf16 and fp16, the plain
fp32 peak (fp32 training does not use TF32 by default in PyTorch), the memory in GiB (the 80 GB parts show 80 GiB to
CUDA: nvidia-smi reports 81,559 MiB on an H100, 81,920 on an A100; the 141 GB H200 143,771 MiB, 140 GiB), and the
bus bandwidth of each link *per direction*: NVLink's datasheet figure is the two directions together, and a ring
all-reduce's bus bandwidth (nccl-tests' convention, https://github.com/NVIDIA/nccl-tests/blob/master/doc/
PERFORMANCE.md) is bounded by one direction. The InfiniBand figure is one adapter per GPU, as in the DGX systems:
400 Gb/s ConnectX-7 (DGX H100/H200), 200 Gb/s ConnectX-6 HDR (DGX A100).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpuwatch.protocol.calibration import Calibration

GIB = 2**30
TERA = 1e12
GB = 1e9

#: The share of the datasheet's peak FLOP/s the matmuls are taken to achieve where nothing measured it: large
#: transformer training reaches 40-55 % MFU on A100 and H100 (Narayanan et al. 2021 report 52 % of the peak on
#: 3,072 A100; Chowdhery et al. 2022, PaLM, 46 % MFU).
DEFAULT_EFFICIENCY = 0.5
#: The shape model's share of the datasheet peak a compute-bound matmul achieves, where nothing measured it
#: (``Cluster`` with ``efficiency=None``): an assumption, one figure for every GPU, shape and row, not measured here
#: (no GPU): the low end of what large half-precision GEMMs are commonly reported to reach on A100 and H100 (clocks
#: below boost under load, tile and wave quantization: NVIDIA's "Matrix Multiplication Background User's Guide").
#: benchmarks/README.md shows how the published comparisons move with 0.75 and 0.8. `gpuwatch calibrate` measures
#: the real figure by shape.
GEMM_EFFICIENCY = 0.7


class ClusterError(ValueError):
    """A cluster description that cannot be planned: the message names the flag and what is wrong."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model's figures. ``peak_flops`` by precision (dense FLOP/s), ``bus_bandwidth`` by link (bytes/s,
    one direction), ``sources``: where each figure is published; ``memory_bandwidth``: the HBM's bytes/s (the
    datasheet's), which bounds the elementwise work (norms, activation functions, dropout, residual adds, a softmax
    kept whole)."""

    name: str
    memory_bytes: int
    peak_flops: Mapping[str, float]
    bus_bandwidth: Mapping[str, float]
    sources: tuple[str, ...]
    memory_bandwidth: float = 0.0
    #: GPUs one NVLink domain joins, where it is larger than a node (GB200 NVL72: 72 GPUs over NVLink Switch trays,
    #: 4 a compute tray); None: the node is the domain.
    nvlink_domain: int | None = None


H100_SOURCES = (
    "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: 80 GB, FP32 67 TFLOPS, BF16/FP16 1,979 TFLOPS with sparsity, "
    "989 dense, HBM3 3.35 TB/s, NVLink 900 GB/s): https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet",
    "NVIDIA DGX H100 datasheet (8 × single-port ConnectX-7, 400 Gb/s InfiniBand per GPU): "
    "https://resources.nvidia.com/en-us-dgx-systems/ai-enterprise-dgx",
)
A100_SOURCES = (
    "NVIDIA A100 Tensor Core GPU datasheet (A100 SXM 40/80 GB: FP32 19.5 TFLOPS, BF16/FP16 312 TFLOPS dense, "
    "HBM 1,555 / 2,039 GB/s, NVLink 600 GB/s): https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
    "NVIDIA DGX A100 datasheet (8 × single-port ConnectX-6, 200 Gb/s HDR InfiniBand per GPU): "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/nvidia-dgx-a100-datasheet.pdf",
)
H200_SOURCES = (
    "NVIDIA H200 Tensor Core GPU page (H200 SXM: 141 GB, FP32 67 TFLOPS, BF16/FP16 1,979 TFLOPS with sparsity, "
    "HBM3e 4.8 TB/s, NVLink 900 GB/s): https://www.nvidia.com/en-us/data-center/h200/",
    H100_SOURCES[1].replace("DGX H100", "DGX H100/H200"),
)

B200_SOURCES = (
    "NVIDIA DGX B200 datasheet (8 × B200: 1,440 GB HBM3e, 64 TB/s, 72 PFLOPS FP8 training with sparsity, i.e. "
    "2.25 PFLOPS BF16/FP16 dense a GPU; NVLink 5 1.8 TB/s a GPU; 8 × single-port ConnectX-7, 400 Gb/s a GPU): "
    "https://resources.nvidia.com/en-us-dgx-systems/dgx-b200-datasheet",
    "NVIDIA Blackwell architecture technical brief (B200 at 1,000 W: FP32 80 TFLOPS): "
    "https://resources.nvidia.com/en-us-blackwell-architecture",
)
GB200_SOURCES = (
    "NVIDIA GB200 NVL72 page (72 Blackwell GPUs in one NVLink domain: 720 PFLOPS FP8 training with sparsity, i.e. "
    "2.5 PFLOPS BF16/FP16 dense a GPU; up to 13.4 TB HBM3e and 576 TB/s, i.e. 186 GB and 8 TB/s a GPU; NVLink "
    "Switch 130 TB/s, 1.8 TB/s a GPU): https://www.nvidia.com/en-us/data-center/gb200-nvl72/",
    "NVIDIA GB200 NVL72 compute tray: 2 GB200 superchips (4 GPUs), each GPU with a 400 Gb/s ConnectX-7 port to the "
    "InfiniBand fabric (Quantum-X800 with ConnectX-8 doubles it): the reference architecture's default taken here",
)

_HOPPER_FLOPS = {"bf16": 989 * TERA, "fp16": 989 * TERA, "fp32": 67 * TERA}
_AMPERE_FLOPS = {"bf16": 312 * TERA, "fp16": 312 * TERA, "fp32": 19.5 * TERA}
PRESETS: dict[str, GpuSpec] = {spec.name: spec for spec in (
    GpuSpec("h100-80gb", 80 * GIB, _HOPPER_FLOPS, {"nvlink": 450 * GB, "ib": 50 * GB}, H100_SOURCES, 3350 * GB),
    GpuSpec("h200-141gb", 140 * GIB, _HOPPER_FLOPS, {"nvlink": 450 * GB, "ib": 50 * GB}, H200_SOURCES, 4800 * GB),
    GpuSpec("a100-80gb", 80 * GIB, _AMPERE_FLOPS, {"nvlink": 300 * GB, "ib": 25 * GB}, A100_SOURCES, 2039 * GB),
    GpuSpec("a100-40gb", 40 * GIB, _AMPERE_FLOPS, {"nvlink": 300 * GB, "ib": 25 * GB}, A100_SOURCES, 1555 * GB),
    GpuSpec("b200-180gb", 180 * 10**9, {"bf16": 2250 * TERA, "fp16": 2250 * TERA, "fp32": 80 * TERA},
            {"nvlink": 900 * GB, "ib": 50 * GB}, B200_SOURCES, 8000 * GB),
    GpuSpec("gb200-nvl72", 186 * 10**9, {"bf16": 2500 * TERA, "fp16": 2500 * TERA, "fp32": 90 * TERA},
            {"nvlink": 900 * GB, "ib": 50 * GB}, GB200_SOURCES, 8000 * GB, nvlink_domain=72),
)}


def preset_for(model: str, memory_bytes: float | None = None) -> GpuSpec | None:
    """The preset of a GPU as NVML names it ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"), with its memory where
    the name does not tell the size; None for a GPU without one (a PCIe H100 or A100 has other peaks and no NVLink
    switch: no preset stands for it)."""
    name = model.upper()
    if "GB200" in name:  # a Grace Blackwell superchip's GPU: the rack's NVLink domain (the NVL72 rack)
        return PRESETS["gb200-nvl72"]
    if "PCIE" in name or "NVL" in name.replace("NVLINK", ""):
        return None
    if "B200" in name:
        return PRESETS["b200-180gb"]
    if "H200" in name:
        return PRESETS["h200-141gb"]
    if "H100" in name:
        return PRESETS["h100-80gb"]
    if "A100" in name:
        small = "40GB" in name or (memory_bytes is not None and memory_bytes < 60 * GIB)
        return PRESETS["a100-40gb" if small else "a100-80gb"]
    return None


def preset(name: str) -> GpuSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ClusterError(f"unknown GPU preset {name!r} (one of {', '.join(PRESETS)})") from None


@dataclass(frozen=True)
class Cluster:
    """``gpus`` in nodes of ``gpus_per_node`` of one kind. ``efficiency``: the share of the datasheet's peak all
    of a layer's work achieves, flat (ignored when ``calibration`` measured the matmuls); None: the shape model
    (`compute.stage_seconds`): the matmuls at ``GEMM_EFFICIENCY`` of the peak and the elementwise work at the HBM's
    bandwidth, so that bigger layers run closer to the peak. `gpuwatch plan` uses the shape model by default."""

    gpus: int
    gpus_per_node: int
    gpu: GpuSpec
    efficiency: float | None = DEFAULT_EFFICIENCY
    calibration: Calibration = field(default_factory=Calibration)
    #: GPUs one NVLink domain joins (``--nvlink-domain``); None: the preset's, else the node.
    nvlink_domain: int | None = None

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ClusterError(f"--gpus and --gpus-per-node must be at least 1 (got {self.gpus}, "
                               f"{self.gpus_per_node})")
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise ClusterError(f"--gpus {self.gpus} is not a whole number of nodes of --gpus-per-node "
                               f"{self.gpus_per_node}")
        if self.efficiency is not None and not 0 < self.efficiency <= 1:
            raise ClusterError(f"--efficiency must be in (0, 1] (got {self.efficiency})")
        if self.nvlink_domain is not None and (self.nvlink_domain < self.gpus_per_node
                                               or self.nvlink_domain % self.gpus_per_node):
            raise ClusterError(f"--nvlink-domain {self.nvlink_domain} is not a whole number of nodes of "
                               f"--gpus-per-node {self.gpus_per_node}")

    @property
    def domain(self) -> int:
        """GPUs one NVLink domain joins: the cluster's figure, else the preset's, else a node; never more than the
        cluster."""
        return min(self.gpus, self.nvlink_domain or self.gpu.nvlink_domain or self.gpus_per_node)

    @property
    def shape_model(self) -> bool:
        """Whether the step's compute follows the shape model (no flat efficiency, no measured matmuls)."""
        calibration = self.calibration
        return self.efficiency is None and not calibration.flops_by_work and calibration.matmul_flops is None

    def achieved_flops(self, precision: str, work: float | None = None) -> float:
        """FLOP/s one GPU's matmuls run at: measured at the ``work`` of a layer's matmuls (forward FLOPs per
        micro-batch on one rank) where a sweep was, else measured, else the datasheet peak × the efficiency."""
        if self.calibration.flops_by_work and work is not None:
            return swept(self.calibration.flops_by_work, work)
        if self.calibration.matmul_flops is not None:
            return self.calibration.matmul_flops
        return self.gpu.peak_flops[precision] * (GEMM_EFFICIENCY if self.efficiency is None else self.efficiency)

    def bus_bandwidth(self, link: str, nbytes: int) -> float:
        """Bytes/s a collective of ``nbytes`` reaches on ``link``: measured where the probe swept it, else the
        datasheet's."""
        points = self.calibration.bus_bandwidth.get(link)
        return swept(points, nbytes) if points else self.gpu.bus_bandwidth[link]

    def link(self, span: int) -> str:
        """The link a group whose members lie within ``span`` consecutive ranks crosses (ranks are placed node by
        node, as launchers do, so a span within the NVLink domain stays on NVLink)."""
        return "nvlink" if span <= self.domain else "ib"


def swept(points: Sequence[tuple[float, float]], size: float) -> float:
    """The figure a sweep of (size, figure) pairs, ascending, gives ``size``: that of the largest size swept that is
    not larger (the smallest size's below the sweep): a conservative step, never an extrapolation."""
    index = bisect.bisect_right([point for point, _ in points], size) - 1
    return points[max(index, 0)][1]
