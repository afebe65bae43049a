"""Wires collectors, sampler and HTTP server into the long-running agent process."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import tempfile
from pathlib import Path

from gpuwatch.agent.collectors import REGISTRY, CollectorContext
from gpuwatch.agent.sampler import Sampler
from gpuwatch.agent.server import AgentHTTPServer, serve_in_thread
from gpuwatch.agent.telemetry.store import DEFAULT_MAX_RANKS, DEFAULT_TTL

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
    telemetry_socket: Path | None = None  # None: GPUWATCH_SOCKET, else the shared default
    telemetry_ttl: float = DEFAULT_TTL
    telemetry_max_ranks: int = DEFAULT_MAX_RANKS


def run_agent(config: AgentConfig) -> int:
    """Run until SIGTERM or SIGINT; return the process exit status."""
    telemetry = {"telemetry_socket": config.telemetry_socket, "telemetry_ttl": config.telemetry_ttl,
                 "telemetry_max_ranks": config.telemetry_max_ranks}
    with contextlib.ExitStack() as stack:
        if config.simulate:
            from gpuwatch.agent.simulate import PRESETS, Simulation

            # tmpfs when there is one: the simulated counters are rewritten every round.
            shm = Path("/dev/shm")
            workdir = stack.enter_context(tempfile.TemporaryDirectory(
                prefix="gpuwatch-sim-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))
            simulation = Simulation(PRESETS[config.simulate], Path(workdir))
            context = CollectorContext(sysfs_root=simulation.sysfs_root, node=config.node,
                                       nvml=simulation.nvml, simulated=True, **telemetry)
            before_round = simulation.advance
        else:
            import pynvml

            context = CollectorContext(sysfs_root=config.sysfs_root, node=config.node, nvml=pynvml,
                                       **telemetry)
            before_round = None

        sampler = Sampler([REGISTRY[name](context) for name in config.collectors],
                          interval=config.interval, deadline=config.collector_timeout, node=config.node,
                          mode="simulated" if config.simulate else "real", before_round=before_round)
        stack.callback(sampler.close)
        try:
            server = AgentHTTPServer(config.listen, lambda: sampler.snapshot, stale_after=3 * config.interval + 10)
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
        log.info("gpuwatch agent (%s) serving on http://%s:%d/metrics, collectors: %s, interval %.1fs",
                 "simulated " + config.simulate if config.simulate else "real", host, port,
                 ", ".join(config.collectors) or "none", config.interval)
        sampler.run()
    log.info("stopped")
    return 0
