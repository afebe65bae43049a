"""Interconnect: NVLink per link and InfiniBand/RoCE per port — bandwidth against the rated rate, errors, state.

Utilisation panels divide the measured rate by the link's own rated rate (one direction), so one panel fits
NVLink generations and NDR/HDR ports alike; red above 80 %, where practitioners start to see queueing.
"""

from __future__ import annotations

from gpuwatch.dashboards.limits import LINK_BUSY_SHARE, PORT_ERRORS_PER_SECOND
from gpuwatch.dashboards.panels import (
    BYTES_PER_SECOND,
    COUNT,
    NODE,
    PER_SECOND,
    PERCENT,
    RED,
    Dashboard,
    PanelBuilder,
    Query,
    dashboard,
    datasource_variable,
    node_variable,
    red_above,
    stat,
    state_timeline,
    timeseries,
)

UID = "gpuwatch-interconnect"
LINK = "{{instance}} GPU {{gpu}} link {{link}}"
PORT = "{{instance}} {{device}}/{{port}}"

#: IB PortInfo states (ibstat), and the physical states.
PORT_STATES = {1: ("DOWN", RED), 2: ("INIT", "orange"), 3: ("ARMED", "yellow"), 4: ("ACTIVE", "green"),
               5: ("ACTIVE_DEFER", "yellow")}
PHYSICAL_STATES = {1: ("Sleep", "orange"), 2: ("Polling", RED), 3: ("Disabled", RED),
                   4: ("PortConfigurationTraining", "orange"), 5: ("LinkUp", "green"),
                   6: ("LinkErrorRecovery", "orange"), 7: ("PhyTest", "orange")}


def _utilisation(direction: str, counter: str, rated: str, on: str, legend: str, description: str) -> PanelBuilder:
    return timeseries(
        f"{direction} utilisation", PERCENT, description,
        Query(f"rate({counter}{{{NODE}}}[$__rate_interval]) / on ({on}) {rated}{{{NODE}}}", legend),
        minimum=0, maximum=1, limits=red_above(LINK_BUSY_SHARE))


def _nvlink() -> list[PanelBuilder]:
    nvlink = "instance, gpu, link"
    rated = "gpuwatch_nvlink_speed_bytes_per_second"
    return [
        stat("NVLinks up", COUNT, "Active NVLinks of the selected nodes.", Query(f"sum(gpuwatch_nvlink_up{{{NODE}}})"),
             width=4),
        stat("NVLinks down", COUNT, "Inactive NVLinks (HW001, NvlinkDown).",
             Query(f"count(gpuwatch_nvlink_up{{{NODE}}} == 0) or vector(0)"), width=4, limits=red_above(1)),
        timeseries("NVLink errors", PER_SECOND, "CRC, replay and recovery errors per second by GPU and type; "
                   "rising recovery errors precede a link going down.",
                   Query(f"sum by (instance, gpu, error) (rate(gpuwatch_nvlink_errors_total{{{NODE}}}"
                         "[$__rate_interval]))", "{{instance}} GPU {{gpu}} {{error}}"), width=16),
        _utilisation("NVLink transmit", "gpuwatch_nvlink_transmitted_bytes_total", rated, nvlink, LINK,
                     "Per-link transmit rate over the link's rated one-direction rate; PERF005 flags links far "
                     "below rate under load, red marks links above 80 %."),
        _utilisation("NVLink receive", "gpuwatch_nvlink_received_bytes_total", rated, nvlink, LINK,
                     "Per-link receive rate over the link's rated one-direction rate."),
        timeseries("NVLink bandwidth per GPU", BYTES_PER_SECOND, "Transmit plus receive rate, all links of a GPU.",
                   Query(f"sum by (instance, gpu) (rate(gpuwatch_nvlink_transmitted_bytes_total{{{NODE}}}"
                         f"[$__rate_interval]) + rate(gpuwatch_nvlink_received_bytes_total{{{NODE}}}"
                         "[$__rate_interval]))", "{{instance}} GPU {{gpu}}"), width=24),
    ]


def _infiniband() -> list[PanelBuilder]:
    port = "instance, device, port"
    rated = "gpuwatch_ib_port_rate_bytes_per_second"
    return [
        _utilisation("InfiniBand transmit", "gpuwatch_ib_port_transmitted_bytes_total", rated, port, PORT,
                     "Per-port transmit rate over the port's negotiated rate; red above 80 %."),
        _utilisation("InfiniBand receive", "gpuwatch_ib_port_received_bytes_total", rated, port, PORT,
                     "Per-port receive rate over the port's negotiated rate."),
        timeseries("InfiniBand errors", PER_SECOND, "Port error counters per second by counter (HW003): symbol "
                   "errors and link recoveries point at a cable, discards at congestion.",
                   Query(f"sum by (instance, device, port, counter) (rate(gpuwatch_ib_port_errors_total{{{NODE}}}"
                         "[$__rate_interval]))", f"{PORT} {{{{counter}}}}"), limits=red_above(PORT_ERRORS_PER_SECOND)),
        timeseries("InfiniBand transmit wait", PER_SECOND, "Ticks per second the port had data but no credits: "
                   "congestion downstream.",
                   Query(f"rate(gpuwatch_ib_port_transmit_wait_ticks_total{{{NODE}}}[$__rate_interval])", PORT)),
        state_timeline("InfiniBand port state", "Logical port state (ACTIVE is up; HW003, InfinibandPortDown).",
                       Query(f"gpuwatch_ib_port_state_id{{{NODE}}}", PORT), PORT_STATES),
        state_timeline("InfiniBand physical state", "Physical link state: Polling means no peer (cable, switch "
                       "port), Disabled an administrative shutdown.",
                       Query(f"gpuwatch_ib_port_physical_state_id{{{NODE}}}", PORT), PHYSICAL_STATES),
    ]


def build() -> Dashboard:
    """The Interconnect dashboard."""
    return dashboard(
        UID, "gpuwatch / Interconnect",
        "One node's NVLinks and InfiniBand/RoCE ports: bandwidth against the rated rate, errors and link state.",
        [datasource_variable(), node_variable(multi=False)],
        [("NVLink", _nvlink()), ("InfiniBand / RoCE", _infiniband())],
    )
