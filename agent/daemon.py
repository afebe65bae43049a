"""Wires collectors, sampler and HTTP server into the long-running agent process."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwatch.agent.collectors import REGISTRY, CollectorContext
from gpuwatch.agent.collectors.host import HostCollector
from gpuwatch.agent.collectors.telemetry import TelemetryCollector
from gpuwatch.agent.sampler import Sampler
from gpuwatch.agent.server import AgentHTTPServer, serve_in_thread
from gpuwatch.agent.telemetry import listener
from gpuwatch.agent.telemetry.store import DEFAULT_MAX_RANKS, DEFAULT_TTL
from gpuwatch.agent.webconfig import WebConfig
from gpuwatch.protocol.paths import default_socket_path

if TYPE_CHECKING:
    from gpuwatch.agent.simulate.faults import Fault

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    listen: tuple[str, int]
    interval: float
    sysfs_root: Path
    node: str
    collectors: list[str]
    collector_timeout: float | None = None
    simulate: str | None = None
    faults: tuple[Fault, ...] = ()  # planted into the simulated node (--simulate.faults)
    telemetry_socket: Path | None = None  # None: GPUWATCH_SOCKET, else the shared default
    telemetry_ttl: float = DEFAULT_TTL
    telemetry_max_ranks: int = DEFAULT_MAX_RANKS
    telemetry_socket_group: int | None = None  # gid given the socket's directory (and so the socket)
    web: WebConfig | None = None  # TLS and basic auth (--web.config.file)


def run_agent(config: AgentConfig) -> int:
    """Run until SIGTERM or SIGINT; return the process exit status."""
    if os.geteuid() == 0:
        log.warning("running as root: the agent needs no privileges (docs/reliability.md, Privileges)")
    if config.telemetry_socket_group is not None and "telemetry" in config.collectors:
        socket_path = config.telemetry_socket or default_socket_path()
        try:
            listener.prepare_directory(socket_path.parent, config.telemetry_socket_group)
        except listener.SocketSetupError as exc:
            log.error("telemetry socket: %s", exc)
            return 1
    with contextlib.ExitStack() as stack:
        sampler = build_sampler(config, stack)
        try:
            server = AgentHTTPServer(config.listen, lambda: sampler.snapshot, stale_after=3 * config.interval + 10,
                                     web=config.web)
        except OSError as exc:
            log.error("cannot listen on %s:%d: %s", *config.listen, exc.strerror or exc)
            return 1
        stack.callback(server.server_close)
        serve_in_thread(server)
        stack.callback(server.shutdown)

        def stop(signum: int, _frame: object) -> None:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            sampler.stop()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        host, port = server.server_address[:2]
        log.info("gpuwatch agent (%s) serving on %s://%s:%d/metrics%s, collectors: %s, interval %.1fs",
                 "simulated " + config.simulate if config.simulate else "real", server.scheme, host, port,
                 " (basic auth)" if server.web.auth else "",
                 ", ".join(config.collectors) or "none", config.interval)
        sampler.run()
    log.info("stopped")
    return 0


def build_sampler(config: AgentConfig, stack: contextlib.ExitStack) -> Sampler:
    """The node (real, or simulated with its faults planted), its enabled collectors from ``REGISTRY`` and the
    sampler over them, closed by ``stack``: everything ``run_agent`` serves, without the server or the signals, so that
    a test can take one round of exactly what ``gpuwatch agent`` would export (tests/test_recipes.py)."""
    telemetry: dict[str, Any] = {"telemetry_socket": config.telemetry_socket, "telemetry_ttl": config.telemetry_ttl,
                                 "telemetry_max_ranks": config.telemetry_max_ranks}
    before_round: Callable[[], None] | None = None
    simulation_cpu: Callable[[], float] | None = None
    if config.simulate:
        from gpuwatch.agent.simulate import PRESETS, Simulation
        from gpuwatch.agent.simulate.workdir import workdir

        simulation = Simulation(PRESETS[config.simulate], stack.enter_context(workdir()), faults=config.faults)
        for fault in config.faults:
            log.info("simulated fault planted: %s", fault.describe())
        context = CollectorContext(sysfs_root=simulation.sysfs_root, node=config.node,
                                   nvml=simulation.nvml, simulated=True, **telemetry)
        before_round, simulation_cpu = simulation.advance, simulation.cpu_seconds
    else:
        import pynvml

        context = CollectorContext(sysfs_root=config.sysfs_root, node=config.node, nvml=pynvml, **telemetry)

    collectors = {name: REGISTRY[name](context) for name in config.collectors}
    host_collector, telemetry_collector = collectors.get("host"), collectors.get("telemetry")
    if isinstance(host_collector, HostCollector) and isinstance(telemetry_collector, TelemetryCollector):
        # the host exports the ranks' RSS and CPU time
        host_collector.watch_ranks(telemetry_collector.store.sender_pids)
    sampler = Sampler(list(collectors.values()),
                      interval=config.interval, deadline=config.collector_timeout, node=config.node,
                      mode="simulated" if config.simulate else "real", before_round=before_round,
                      simulation_cpu=simulation_cpu)
    stack.callback(sampler.close)
    return sampler
