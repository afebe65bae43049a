"""Hardware: NVLink, PCIe, InfiniBand ports, GPU faults and throttling, as the node agent sees them."""

from __future__ import annotations

import types
from collections.abc import Iterator

from gpuwatch.diagnosis import needs
from gpuwatch.diagnosis.coverage import (
    COLLECTORS_DOWN,
    GPU_FAULTY,
    GPU_SLOWDOWN,
    IB_PORT_UNHEALTHY,
    NVLINK_DOWN,
    PCIE_BELOW_MAX,
)
from gpuwatch.diagnosis.facts import SLOWDOWN_REASONS, Facts, Where, gbit, group_by
from gpuwatch.diagnosis.registry import Evidence, Issue, Severity, Threshold, rule
from gpuwatch.diagnosis.rules.common import capped, ratio_text

FAMILY = "hardware"
LOAD = Threshold(0.3, "a GPU busier than this is under load; idle GPUs drop their PCIe generation and clocks to "
                      "save power")

#: What the Xid codes the agent watches mean (NVIDIA's Xid catalogue); codes caused by the application.
XID_MEANINGS = {
    "13": "graphics engine exception", "31": "GPU memory page fault", "43": "GPU stopped processing",
    "45": "preemptive cleanup", "48": "double-bit ECC error", "61": "internal micro-controller breakpoint",
    "62": "internal micro-controller halt", "63": "ECC page retirement or row remap recorded",
    "64": "ECC page retirement or row remap failure", "74": "NVLink error", "79": "GPU has fallen off the bus",
    "92": "high single-bit ECC error rate", "94": "contained ECC error", "95": "uncontained ECC error",
    "119": "GSP RPC timeout", "120": "GSP error",
}
APPLICATION_XIDS = frozenset({"13", "31", "43", "45"})


@rule("HW001", family=FAMILY, severity=Severity.WARNING,
      title="NVLink link inactive on a GPU that has links", needs=(needs.NVLINKS,),
      coverage=(NVLINK_DOWN, COLLECTORS_DOWN))
def nvlink_down(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """A GPU whose NVLink links are not all up routes its share of intra-node collectives over fewer links
    (or PCIe): every collective through it slows down, and the ring is as fast as its slowest hop. GPUs
    without NVLink (PCIe cards) have no links and are not flagged."""
    for node in facts.nodes.values():
        broken = [gpu for gpu in node.nvlinks or () if gpu.links and gpu.down]
        if not broken:
            continue
        down = sum(len(gpu.down) for gpu in broken)
        yield Issue(
            title=f"{down} NVLink link(s) down on {node.name} "
                  f"(GPU {', '.join(str(gpu.gpu) for gpu in broken)})",
            evidence=tuple(Evidence(f"gpu {gpu.gpu}: link(s) {', '.join(map(str, gpu.down))} down of {gpu.links}",
                                    Where(node=node.name, gpu=gpu.gpu), {"links": gpu.links, "down": len(gpu.down)})
                           for gpu in broken),
            fix=f"drain {node.name}, check with `nvidia-smi nvlink --status` and `dcgmi diag -r 3`; reset the GPU, "
                "then reseat or RMA the baseboard if the link stays down",
            reason="NCCL routes around a down link, so every collective through that GPU runs on less "
                   "bandwidth and slows the whole job.",
        )


@rule("HW002", family=FAMILY, severity=Severity.WARNING,
      title="PCIe link below its maximum generation or width under load", needs=(needs.GPUS,),
      thresholds={"min_load": LOAD},
      coverage=(PCIE_BELOW_MAX, COLLECTORS_DOWN))
def pcie_degraded(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """A GPU's PCIe link trains to a lower generation or width when a riser, slot or cable is bad; host to
    device copies and GPUDirect RDMA to the NIC then run at a fraction of their speed. Idle GPUs lower
    their PCIe generation on purpose to save power, so the rule only judges GPUs under load."""
    for node in facts.nodes.values():
        degraded = []
        for gpu in node.gpus or ():
            busy = gpu.busy
            if busy is None or busy < t.min_load or gpu.pcie_generation is None or gpu.pcie_max_generation is None \
                    or gpu.pcie_width is None or gpu.pcie_max_width is None:
                continue
            if gpu.pcie_generation < gpu.pcie_max_generation or gpu.pcie_width < gpu.pcie_max_width:
                degraded.append(Evidence(
                    f"gpu {gpu.index}: PCIe Gen{gpu.pcie_generation} x{gpu.pcie_width} of "
                    f"Gen{gpu.pcie_max_generation} x{gpu.pcie_max_width} at {ratio_text(busy)} load",
                    Where(node=node.name, gpu=gpu.index),
                    {"generation": gpu.pcie_generation, "max_generation": gpu.pcie_max_generation,
                     "width": gpu.pcie_width, "max_width": gpu.pcie_max_width, "load": busy}))
        if degraded:
            yield Issue(
                title=f"{len(degraded)} GPU(s) on {node.name} run a degraded PCIe link under load",
                evidence=tuple(degraded),
                fix=f"reseat the GPU or riser on {node.name} and check the slot's BIOS link speed; confirm with "
                    "`nvidia-smi -q -d PCIE` under load",
                reason="A link trained down to a lower generation or width caps host-device copies and "
                       "GPUDirect RDMA traffic.",
            )


@rule("HW003", family=FAMILY, severity=Severity.CRITICAL,
      title="InfiniBand port not ACTIVE, slower than its peers, or with rising errors", needs=(needs.IB_PORTS,),
      thresholds={"max_error_increase": Threshold(
          10, "a few symbol errors over the window are within a healthy link's bit error rate; more mean a bad "
              "cable or transceiver")},
      coverage=(IB_PORT_UNHEALTHY, COLLECTORS_DOWN))
def ib_port_unhealthy(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """NCCL spreads inter-node traffic over the node's ports, and every collective runs at the pace of the
    slowest one. Three signs of a bad port, each compared with the port's peers (ports of the same HCA
    model and link layer on the node, so a spare port, or a frontend NIC with no active peer of its model,
    is not flagged): a port that is not ACTIVE while its peers are; an ACTIVE port that trained to a lower rate
    than its peers (a bad cable or transceiver); error counters rising (symbol errors, link recoveries,
    link downs; needs two samples, so only the Prometheus source can show it)."""
    for node in facts.nodes.values():
        ports = node.ib_ports or []
        down, slow, erring = [], [], []
        for _, peers in group_by(ports, lambda p: p.kind):
            active = [port for port in peers if port.active]
            if not active:
                continue
            best = max((port.rate_bytes_per_second or 0 for port in active), default=0)
            for port in peers:
                where = Where(node=node.name, port=port.name)
                if port.active is False:
                    down.append(Evidence(f"{port.name} is {port.state} (physical: {port.phys_state}) while "
                                         f"{len(active)} peer port(s) are ACTIVE", where,
                                         {"state": port.state, "phys_state": port.phys_state}))
                elif port.active and port.rate_bytes_per_second is not None and port.rate_bytes_per_second < best:
                    slow.append(Evidence(f"{port.name} runs at {gbit(port.rate_bytes_per_second)}, its peers at "
                                         f"{gbit(best)}", where, {"rate_bytes_per_second": port.rate_bytes_per_second,
                                                                  "peer_rate_bytes_per_second": best}))
        for port in ports:
            rising = {name: value for name, value in (port.errors_increase or {}).items() if value > 0}
            if sum(rising.values()) > t.max_error_increase:
                window = f" in {port.window_seconds:g} s" if port.window_seconds else ""
                erring.append(Evidence(f"{port.name}: " + ", ".join(f"{name} +{value:g}" for name, value in
                                                                    sorted(rising.items())) + window,
                                       Where(node=node.name, port=port.name), rising))
        for problem, evidence in (("not ACTIVE", down), ("slower than its peers", slow), ("with rising error "
                                                                                        "counters", erring)):
            if evidence:
                yield Issue(
                    title=f"{len(evidence)} InfiniBand port(s) on {node.name} {problem}: "
                          + ", ".join(str(e.where.port) for e in evidence),
                    evidence=tuple(evidence),
                    fix=f"check the cable and transceiver with `ibstat` / `iblinkinfo` / `mlxlink` on {node.name}; "
                        "drain the node until the port is ACTIVE at full rate",
                    reason="Collectives stripe across the node's ports and run at the pace of the slowest: a "
                           "down, slow or erroring port slows or stalls the whole job.",
                )


@rule("HW004", family=FAMILY, severity=Severity.CRITICAL,
      title="GPU Xid errors, uncorrectable ECC errors or pending row remaps", needs=(needs.GPUS,),
      coverage=(GPU_FAULTY, COLLECTORS_DOWN))
def gpu_faults(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """Critical Xid events, uncorrectable (double-bit) ECC errors and row remaps waiting for a reset mean
    the GPU's results or availability cannot be trusted: jobs on it crash, hang or silently compute on
    corrupted memory. A GPU that fell off the bus (lost) is reported too. Xids 13, 31, 43 and 45 are
    usually raised by the application (an illegal memory access), so their fix says to check the code
    first."""
    for node in facts.nodes.values():
        for gpu in node.gpus or ():
            where = Where(node=node.name, gpu=gpu.index)
            evidence = []
            if gpu.lost:
                evidence.append(Evidence(f"gpu {gpu.index} is lost (fell off the bus)", where, {"lost": 1}))
            xids = {code: count for code, count in (gpu.xid_errors or {}).items() if count > 0}
            for code, count in sorted(xids.items(), key=lambda item: int(item[0])):
                meaning = XID_MEANINGS.get(code, "see NVIDIA's Xid catalogue")
                evidence.append(Evidence(f"gpu {gpu.index}: Xid {code} ({meaning}) x{count}", where,
                                         {"xid": int(code), "count": count}))
            if gpu.ecc_uncorrected:
                evidence.append(Evidence(f"gpu {gpu.index}: {gpu.ecc_uncorrected} uncorrectable ECC error(s)", where,
                                         {"ecc_uncorrected": gpu.ecc_uncorrected}))
            if gpu.remap_pending:
                evidence.append(Evidence(f"gpu {gpu.index}: a row remap is pending (needs a GPU reset)", where,
                                         {"remap_pending": 1}))
            if gpu.remap_failure:
                evidence.append(Evidence(f"gpu {gpu.index}: a row remap failed", where, {"remap_failure": 1}))
            if not evidence:
                continue
            application_only = not gpu.lost and xids and set(xids) <= APPLICATION_XIDS and not (
                gpu.ecc_uncorrected or gpu.remap_pending or gpu.remap_failure)
            yield Issue(
                title=f"gpu {gpu.index} on {node.name}: "
                      + "; ".join(e.text.removeprefix(f"gpu {gpu.index}: ") for e in evidence[:2]),
                evidence=tuple(evidence),
                fix=("check the application for illegal memory accesses (compute-sanitizer); treat it as hardware "
                     "if it recurs across jobs" if application_only else
                     f"drain {node.name}, reset gpu {gpu.index} (`nvidia-smi -r -i {gpu.index}`) to apply pending "
                     "remaps, run `dcgmi diag -r 3`, and RMA the GPU if errors return"),
                reason="A GPU with hardware faults crashes or hangs the jobs on it, or corrupts their results "
                       "silently.",
            )


@rule("HW005", family=FAMILY, severity=Severity.WARNING,
      title="GPU throttled (thermal or power) under load", needs=(needs.GPUS,), thresholds={"min_load": LOAD},
      coverage=(GPU_SLOWDOWN, COLLECTORS_DOWN))
def gpu_throttled(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """A GPU that slows its clocks for heat or a power brake computes slower, and in synchronous training
    every other rank waits for it (it shows up as a straggler). Only hardware and thermal slowdowns
    count: sitting at the software power cap is normal for a fully loaded GPU, and idle GPUs report
    clock events that mean nothing; the rule only judges GPUs under load."""
    for node in facts.nodes.values():
        throttled = []
        for gpu in node.gpus or ():
            busy = gpu.busy
            reasons = [r for r in gpu.clock_event_reasons or () if r in SLOWDOWN_REASONS]
            if busy is None or busy < t.min_load or not reasons:
                continue
            details = [f"{gpu.temperature_celsius:g} °C" if gpu.temperature_celsius is not None else None,
                       f"{gpu.power_watts:.0f} W" if gpu.power_watts is not None else None,
                       f"SM clock {gpu.sm_clock_hertz / 1e6:.0f} MHz" if gpu.sm_clock_hertz is not None else None]
            throttled.append(Evidence(
                f"gpu {gpu.index}: {', '.join(reasons)} at {ratio_text(busy)} load"
                + "".join(f", {d}" for d in details if d), Where(node=node.name, gpu=gpu.index),
                {"reasons": ",".join(reasons), "temperature_celsius": gpu.temperature_celsius,
                 "power_watts": gpu.power_watts, "sm_clock_hertz": gpu.sm_clock_hertz}))
        if throttled:
            yield Issue(
                title=f"{len(throttled)} GPU(s) on {node.name} throttled under load",
                evidence=capped(throttled, what="GPUs"),
                fix=f"check cooling (fans, inlet temperature, airflow) and power delivery on {node.name} "
                    "(`nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER`)",
                reason="A throttled GPU runs slower, and synchronous training waits for its slowest GPU.",
            )
