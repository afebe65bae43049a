"""Node: one node's GPUs — activity, memory, power, heat, clocks and throttling, PCIe, Xid and ECC — and host."""

from __future__ import annotations

from gpuwatch.agent.collectors.host import CPU_UTILIZATION, MEMORY_GAUGES
from gpuwatch.agent.collectors.nvml import (
    CLOCK_EVENT_ACTIVE,
    ECC_VOLATILE_ERRORS,
    GPU_GAUGES,
    PCIE_LINK_GENERATION,
    PCIE_LINK_WIDTH,
    PCIE_REPLAYS,
    REMAPPED_ROWS,
    ROW_REMAP_FAILURE,
    ROW_REMAP_PENDING,
    XID_ERRORS,
)
from gpuwatch.agent.metricspec import MetricSpec, by_field
from gpuwatch.dashboards.limits import (
    MAX_PEAK_SHARE,
    MEMORY_USED_WARN,
    TEMPERATURE_HOT_CELSIUS,
    TEMPERATURE_WARM_CELSIUS,
    percent,
)
from gpuwatch.dashboards.panels import (
    BYTES,
    COUNT,
    GPU,
    NODE,
    PER_SECOND,
    PERCENT,
    RED,
    YELLOW,
    Dashboard,
    PanelBuilder,
    Query,
    dashboard,
    datasource_variable,
    gpu_variable,
    node_variable,
    red_above,
    thresholds,
    timeseries,
)

UID = "gpuwatch-node"
PER_GPU = "GPU {{gpu}}"
#: The families of tables the panels plot, each by the reading it holds.
_SM_ACTIVE, _SM_OCCUPANCY, _TENSOR_ACTIVE, _DRAM_ACTIVE = (
    by_field(GPU_GAUGES, field) for field in ("sm_active_ratio", "sm_occupancy_ratio", "tensor_active_ratio",
                                              "dram_active_ratio"))
_MEMORY_USED, _MEMORY_TOTAL, _POWER, _TEMPERATURE, _SM_CLOCK = (
    by_field(GPU_GAUGES, field) for field in ("memory_used_bytes", "memory_total_bytes", "power_watts",
                                              "temperature_celsius", "sm_clock_hertz"))
_MEMORY_AVAILABLE = by_field(MEMORY_GAUGES, "memory_available_bytes")


def _ratio(title: str, series: MetricSpec, description: str) -> PanelBuilder:
    return timeseries(title, PERCENT, description, Query(f"{series}{{{GPU}}}", PER_GPU), width=6,
                      minimum=0, maximum=1)


def _activity() -> list[PanelBuilder]:
    return [
        _ratio("SM activity", _SM_ACTIVE, "Share of time the SMs had work (GPM on Hopper and "
               "newer; the utilisation rate elsewhere). Below 30 % in training: input stall (PERF003)."),
        _ratio("SM occupancy", _SM_OCCUPANCY, "Resident warps over the SMs' maximum (GPM)."),
        _ratio("Tensor core activity", _TENSOR_ACTIVE, "Share of time the tensor cores were "
               "busy (GPM): low while SMs are busy means the math is not on tensor cores."),
        _ratio("DRAM activity", _DRAM_ACTIVE, "Share of time device memory was read or "
               "written (GPM)."),
    ]


def _memory_power() -> list[PanelBuilder]:
    return [
        timeseries("Memory used", PERCENT, "Device memory used over total, per GPU (MEM002 warns above "
                   f"{percent(MAX_PEAK_SHARE)} "
                   "of a rank's peak).",
                   Query(f"{_MEMORY_USED}{{{GPU}}} / {_MEMORY_TOTAL}{{{GPU}}}",
                         PER_GPU), width=6, minimum=0, maximum=1,
                   limits=thresholds((None, "green"), (MEMORY_USED_WARN, YELLOW), (MAX_PEAK_SHARE, RED))),
        timeseries("Memory used (bytes)", BYTES, "Device memory used, per GPU.",
                   Query(f"{_MEMORY_USED}{{{GPU}}}", PER_GPU), width=6),
        timeseries("Power", "watt", "Power draw per GPU; a GPU pinned at its limit may show sw_power_cap below.",
                   Query(f"{_POWER}{{{GPU}}}", PER_GPU),
                   width=6),
        timeseries("Temperature", "celsius", "GPU temperature; throttling typically starts in the high 80s.",
                   Query(f"{_TEMPERATURE}{{{GPU}}}", PER_GPU), width=6,
                   limits=thresholds((None, "green"), (TEMPERATURE_WARM_CELSIUS, YELLOW),
                                     (TEMPERATURE_HOT_CELSIUS, RED))),
    ]


def _clocks_pcie() -> list[PanelBuilder]:
    return [
        timeseries("SM clock", "hertz", "Current SM clock per GPU: drops below the others' under throttling.",
                   Query(f"{_SM_CLOCK}{{{GPU}}}", PER_GPU), width=6),
        timeseries("Throttle reasons", COUNT, "GPUs held down by each clock-event reason (HW005: thermal and "
                   "hardware slowdowns under load; gpu_idle is normal power saving).",
                   Query(f"sum by (reason) ({CLOCK_EVENT_ACTIVE}{{{GPU}}})", "{{reason}}"), width=6),
        timeseries("PCIe width, current / max", PERCENT, "Trained PCIe link width over the GPU's maximum "
                   "(HW002 below 100 %).",
                   Query(f'{PCIE_LINK_WIDTH}{{{GPU}, kind="current"}} / ignoring (kind) '
                         f'{PCIE_LINK_WIDTH}{{{GPU}, kind="max"}}', PER_GPU), width=6,
                   minimum=0, maximum=1),
        timeseries("PCIe generation, current / max", PERCENT, "Current PCIe generation over the maximum; an "
                   "idle GPU lowers it to save power, a busy one should not.",
                   Query(f'{PCIE_LINK_GENERATION}{{{GPU}, kind="current"}} / ignoring (kind) '
                         f'{PCIE_LINK_GENERATION}{{{GPU}, kind="max"}}', PER_GPU), width=6,
                   minimum=0, maximum=1),
    ]


def _errors() -> list[PanelBuilder]:
    return [
        timeseries("Xid errors", COUNT, "Xid events per GPU and code over the interval (HW004; 13/31/43/45 are "
                   "application errors).",
                   Query(f"sum by (gpu, xid) (increase({XID_ERRORS}_total{{{GPU}}}[$__rate_interval]))",
                         "GPU {{gpu}} Xid {{xid}}"), width=6, limits=red_above(1)),
        timeseries("ECC errors", COUNT, "Volatile ECC errors per GPU over the interval; any uncorrected one "
                   "pages (GpuUncorrectableEccErrors).",
                   Query(f"sum by (gpu, error) (increase({ECC_VOLATILE_ERRORS}_total{{{GPU}}}"
                         "[$__rate_interval]))", "GPU {{gpu}} {{error}}"), width=6),
        timeseries("Row remapping", COUNT, "Rows remapped per cause, and pending/failed remaps (a reset applies "
                   "them; a failure means replace the GPU).",
                   Query(f"sum by (gpu, cause) ({REMAPPED_ROWS}{{{GPU}}})", "GPU {{gpu}} {{cause}}"),
                   Query(f"{ROW_REMAP_PENDING}{{{GPU}}} + {ROW_REMAP_FAILURE}{{{GPU}}}",
                         "GPU {{gpu}} pending or failed"), width=6),
        timeseries("PCIe replays", PER_SECOND, "PCIe replay rate per GPU: link-level retransmissions.",
                   Query(f"rate({PCIE_REPLAYS}_total{{{GPU}}}[$__rate_interval])", PER_GPU), width=6),
    ]


def _host() -> list[PanelBuilder]:
    return [
        timeseries("Host CPU", PERCENT, "CPU utilisation of the node: data loading competes with it.",
                   Query(f"{CPU_UTILIZATION}{{{NODE}}}", "{{instance}}"), minimum=0, maximum=1),
        timeseries("Host memory available", BYTES, "Host memory available for new allocations.",
                   Query(f"{_MEMORY_AVAILABLE}{{{NODE}}}", "{{instance}}")),
    ]


def build() -> Dashboard:
    """The Node dashboard."""
    return dashboard(
        UID, "gpuwatch / Node",
        "One node's GPUs as NVML sees them, and its host: pick the node, optionally some GPUs.",
        [datasource_variable(), node_variable(multi=False), gpu_variable()],
        [
            ("GPU activity", _activity()),
            ("Memory, power and temperature", _memory_power()),
            ("Clocks, throttling and PCIe", _clocks_pcie()),
            ("Errors", _errors()),
            ("Host", _host()),
        ],
    )
