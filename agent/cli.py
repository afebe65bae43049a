"""``gpuwatch agent``: the node agent's command, its flags as Prometheus exporters spell theirs. The product's
command line (``gpuwatch``, every subcommand) is ``gpuwatch.cli.main``."""

from __future__ import annotations

import grp
import logging
import socket
import sys
from pathlib import Path

import click

from gpuwatch.agent.server import DEFAULT_PORT
from gpuwatch.agent.simulate import PRESETS
from gpuwatch.agent.telemetry.store import DEFAULT_MAX_RANKS, DEFAULT_TTL
from gpuwatch.protocol.paths import ENV_VAR as SOCKET_ENV_VAR

DEFAULT_INTERVAL = 5.0


class ListenAddress(click.ParamType):
    """HOST:PORT, :PORT or [IPv6]:PORT, as Prometheus exporters take ``--web.listen-address``."""

    name = "HOST:PORT"

    def convert(self, value, param, ctx) -> tuple[str, int]:
        if isinstance(value, tuple):
            return value
        host, sep, port = str(value).rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            self.fail(f"{value!r} is not HOST:PORT (e.g. 0.0.0.0:{DEFAULT_PORT} or :{DEFAULT_PORT})", param, ctx)
        return host.strip("[]") or "0.0.0.0", int(port)


def _collector_options(function):
    """One ``--collector.NAME/--no-collector.NAME`` switch per registered collector."""
    from gpuwatch.agent.collectors import REGISTRY

    for name in sorted(REGISTRY, reverse=True):
        function = click.option(
            f"--collector.{name}/--no-collector.{name}",
            f"collector_{name}",
            default=REGISTRY[name].enabled_by_default,
            help=f"Enable the {name} collector ({'on' if REGISTRY[name].enabled_by_default else 'off'} by default).",
        )(function)
    return function


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--listen", type=ListenAddress(), default=f"0.0.0.0:{DEFAULT_PORT}", show_default=True,
              help="Address to serve /metrics, /healthz and /api/v1/state on.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=DEFAULT_INTERVAL, show_default=True,
              help="Seconds between sampling rounds (scrapes never trigger sampling).")
@click.option("--collector-timeout", type=click.FloatRange(min=0.05), default=None,
              help="Deadline for one collector's run; a collector that misses it is reported down. "
                   "[default: 0.8 × interval, at least 0.5 s]")
@click.option("--sysfs-root", type=click.Path(file_okay=False, path_type=Path), default=Path("/sys"),
              show_default=True, help="Where sysfs is mounted (a fixture tree can stand in).")
@click.option("--simulate", type=click.Choice(sorted(PRESETS)),
              default=None, help="Serve a simulated node (scripted NVML, generated sysfs) instead of real hardware.")
@click.option("--simulate.faults", "simulate_faults", type=click.Path(dir_okay=False, path_type=Path), default=None,
              metavar="FILE", help="Plant hardware faults into the simulated node from a JSON file (Xids, "
                                   "NVLink or InfiniBand ports down, IB errors, PCIe below max, clock slowdowns, ECC, "
                                   "row remaps, a lost GPU; gpuwatch.agent.simulate.faults). Needs --simulate.")
@click.option("--node", default=socket.gethostname(), show_default="hostname", help="Value of the node label.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@click.option("--telemetry.socket", "telemetry_socket", type=click.Path(dir_okay=False, path_type=Path),
              envvar=SOCKET_ENV_VAR, show_envvar=True,
              show_default="/run/gpuwatch/telemetry.sock if the agent may create it, else "
                           "/tmp/gpuwatch-UID/telemetry.sock",
              help="Unix datagram socket the training ranks send telemetry to.")
@click.option("--telemetry.ttl", "telemetry_ttl", type=click.FloatRange(min=1), default=DEFAULT_TTL,
              show_default=True,
              help="Seconds after which a silent rank is forgotten and its series disappear (not one whose hooks "
                   "closed while its process lives: a process that does not exit is kept in view).")
@click.option("--telemetry.max-ranks", "telemetry_max_ranks", type=click.IntRange(min=1),
              default=DEFAULT_MAX_RANKS, show_default=True,
              help="Ranks the agent keeps state for; records of further ranks are rejected (bounds memory).")
@click.option("--telemetry.socket-group", "telemetry_socket_group", metavar="GROUP", default=None,
              help="Group (name or gid) given the socket's directory and so the socket (0660): the training "
                   "users' group. [default: the agent's group]")
@click.option("--web.config.file", "web_config_file", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Prometheus exporter-toolkit web config: TLS (tls_server_config) and basic auth "
                                 "(basic_auth_users, bcrypt) for every endpoint but /healthz.")
@_collector_options
def agent(listen, interval, collector_timeout, sysfs_root, simulate, simulate_faults, node, log_level, telemetry_socket,
          telemetry_ttl, telemetry_max_ranks, telemetry_socket_group, web_config_file, **switches) -> None:
    """Sample this node's GPUs, NVLink, InfiniBand and host, and serve them to Prometheus."""
    from gpuwatch.agent.daemon import AgentConfig, run_agent
    from gpuwatch.agent.simulate.faults import FaultsError
    from gpuwatch.agent.simulate.faults import load as load_faults
    from gpuwatch.agent.webconfig import WebConfigError, load

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = click.get_current_context()
    if simulate and ctx.get_parameter_source("sysfs_root") is not click.core.ParameterSource.DEFAULT:
        raise click.UsageError("--simulate generates its own sysfs tree; drop --sysfs-root")
    if simulate_faults and not simulate:
        raise click.ClickException("--simulate.faults plants faults into a simulated node: add --simulate PRESET")
    try:
        faults = load_faults(simulate_faults, PRESETS[simulate]) if simulate_faults else ()
    except FaultsError as exc:
        raise click.ClickException(f"--simulate.faults {exc}") from None
    try:
        web = load(web_config_file) if web_config_file else None
    except WebConfigError as exc:
        raise click.ClickException(f"--web.config.file {exc}") from None
    enabled = [name.removeprefix("collector_") for name, on in switches.items() if on]
    config = AgentConfig(listen=listen, interval=interval, collector_timeout=collector_timeout,
                         sysfs_root=sysfs_root, simulate=simulate, faults=tuple(faults), node=node,
                         collectors=enabled,
                         telemetry_socket=telemetry_socket, telemetry_ttl=telemetry_ttl,
                         telemetry_max_ranks=telemetry_max_ranks,
                         telemetry_socket_group=_group_id(telemetry_socket_group), web=web)
    sys.exit(run_agent(config))


def _group_id(group: str | None) -> int | None:
    """A group name or number as a gid; an unknown name is an error, exit status 1. A number is taken as
    is: in a container the training users' gid often has no entry in the agent image's /etc/group."""
    if group is None or group.isdigit():
        return None if group is None else int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise click.ClickException(f"--telemetry.socket-group: no group {group!r} on this host") from None

