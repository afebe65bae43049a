"""Interconnect: NVLink per link and InfiniBand/RoCE per port — bandwidth against the rated rate, errors, state.

Utilisation panels divide the measured rate by the link's own rated rate (one direction), so one panel fits
NVLink generations and NDR/HDR ports alike; red above 80 %, where practitioners start to see queueing.
"""

from __future__ import annotations

from gpuwatch.agent.collectors.infiniband import (
    PORT_ERRORS,
    PORT_PHYSICAL_STATE,
    PORT_RATE,
    PORT_STATE,
    PORT_TRAFFIC,
)
from gpuwatch.agent.collectors.nvlink import LINK_ERRORS, LINK_SPEED, LINK_UP, NVLINK_FAMILIES
from gpuwatch.agent.metricspec import MetricSpec, by_field
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
#: The traffic counters the panels plot, by the quantity each counts.
_LINK_TRANSMITTED, _LINK_RECEIVED = by_field(NVLINK_FAMILIES, "tx_bytes"), by_field(NVLINK_FAMILIES, "rx_bytes")
_PORT_TRANSMITTED, _PORT_RECEIVED, _PORT_TRANSMIT_WAIT = (
    by_field(PORT_TRAFFIC, field) for field in ("transmitted_bytes", "received_bytes", "transmit_wait_ticks"))

#: IB PortInfo states (ibstat), and the physical states.
PORT_STATES = {1: ("DOWN", RED), 2: ("INIT", "orange"), 3: ("ARMED", "yellow"), 4: ("ACTIVE", "green"),
               5: ("ACTIVE_DEFER", "yellow")}
PHYSICAL_STATES = {1: ("Sleep", "orange"), 2: ("Polling", RED), 3: ("Disabled", RED),
                   4: ("PortConfigurationTraining", "orange"), 5: ("LinkUp", "green"),
                   6: ("LinkErrorRecovery", "orange"), 7: ("PhyTest", "orange")}


def _utilisation(direction: str, counter: MetricSpec, rated: MetricSpec, on: str, legend: str,
                 description: str) -> PanelBuilder:
    return timeseries(
        f"{direction} utilisation", PERCENT, description,
        Query(f"rate({counter}_total{{{NODE}}}[$__rate_interval]) / on ({on}) {rated}{{{NODE}}}", legend),
        minimum=0, maximum=1, limits=red_above(LINK_BUSY_SHARE))


def _nvlink() -> list[PanelBuilder]:
    nvlink = "instance, gpu, link"
    return [
        stat("NVLinks up", COUNT, "Active NVLinks of the selected nodes.", Query(f"sum({LINK_UP}{{{NODE}}})"),
             width=4),
        stat("NVLinks down", COUNT, "Inactive NVLinks (HW001, NvlinkDown).",
             Query(f"count({LINK_UP}{{{NODE}}} == 0) or vector(0)"), width=4, limits=red_above(1)),
        timeseries("NVLink errors", PER_SECOND, "CRC, replay and recovery errors per second by GPU and type; "
                   "rising recovery errors precede a link going down.",
                   Query(f"sum by (instance, gpu, error) (rate({LINK_ERRORS}_total{{{NODE}}}"
                         "[$__rate_interval]))", "{{instance}} GPU {{gpu}} {{error}}"), width=16),
        _utilisation("NVLink transmit", _LINK_TRANSMITTED, LINK_SPEED, nvlink, LINK,
                     "Per-link transmit rate over the link's rated one-direction rate; PERF005 flags links far "
                     "below rate under load, red marks links above 80 %."),
        _utilisation("NVLink receive", _LINK_RECEIVED, LINK_SPEED, nvlink, LINK,
                     "Per-link receive rate over the link's rated one-direction rate."),
        timeseries("NVLink bandwidth per GPU", BYTES_PER_SECOND, "Transmit plus receive rate, all links of a GPU.",
                   Query(f"sum by (instance, gpu) (rate({_LINK_TRANSMITTED}_total{{{NODE}}}"
                         f"[$__rate_interval]) + rate({_LINK_RECEIVED}_total{{{NODE}}}"
                         "[$__rate_interval]))", "{{instance}} GPU {{gpu}}"), width=24),
    ]


def _infiniband() -> list[PanelBuilder]:
    port = "instance, device, port"
    return [
        _utilisation("InfiniBand transmit", _PORT_TRANSMITTED, PORT_RATE, port, PORT,
                     "Per-port transmit rate over the port's negotiated rate; red above 80 %."),
        _utilisation("InfiniBand receive", _PORT_RECEIVED, PORT_RATE, port, PORT,
                     "Per-port receive rate over the port's negotiated rate."),
        timeseries("InfiniBand errors", PER_SECOND, "Port error counters per second by counter (HW003): symbol "
                   "errors and link recoveries point at a cable, discards at congestion.",
                   Query(f"sum by (instance, device, port, counter) (rate({PORT_ERRORS}_total{{{NODE}}}"
                         "[$__rate_interval]))", f"{PORT} {{{{counter}}}}"), limits=red_above(PORT_ERRORS_PER_SECOND)),
        timeseries("InfiniBand transmit wait", PER_SECOND, "Ticks per second the port had data but no credits: "
                   "congestion downstream.",
                   Query(f"rate({_PORT_TRANSMIT_WAIT}_total{{{NODE}}}[$__rate_interval])", PORT)),
        state_timeline("InfiniBand port state", "Logical port state (ACTIVE is up; HW003, InfinibandPortDown).",
                       Query(f"{PORT_STATE}{{{NODE}}}", PORT), PORT_STATES),
        state_timeline("InfiniBand physical state", "Physical link state: Polling means no peer (cable, switch "
                       "port), Disabled an administrative shutdown.",
                       Query(f"{PORT_PHYSICAL_STATE}{{{NODE}}}", PORT), PHYSICAL_STATES),
    ]


def build() -> Dashboard:
    """The Interconnect dashboard."""
    return dashboard(
        UID, "gpuwatch / Interconnect",
        "One node's NVLinks and InfiniBand/RoCE ports: bandwidth against the rated rate, errors and link state.",
        [datasource_variable(), node_variable(multi=False)],
        [("NVLink", _nvlink()), ("InfiniBand / RoCE", _infiniband())],
    )
