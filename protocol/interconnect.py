"""Which interconnect a collective's traffic takes (the schema's INTERCONNECTS), decided one way for the probe that
measures it (``gpuwatch probe``) and for diagnosis, which compares the measurement with that path's rating.

It follows NCCL's own choice as its environment variables document it: inside a node NVLink when the GPUs have
links up and peer-to-peer is allowed (``NCCL_P2P_DISABLE``), else PCIe; between nodes its IB transport over
active InfiniBand or RoCE ports unless ``NCCL_IB_DISABLE`` or ``NCCL_NET=Socket`` send it over TCP sockets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


def env_flag(env: Mapping[str, str], name: str) -> bool:
    """NCCL reads its switches as integers: set and non-zero means on."""
    try:
        return int(env.get(name, "0").strip() or "0") != 0
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class NodeLinks:
    """What a node's links offer a collective: whether any GPU has an NVLink link up, and the link layers
    ("InfiniBand", "Ethernet" for RoCE) of its ACTIVE InfiniBand ports; None where it could not be read."""

    nvlink_up: bool | None
    active_link_layers: frozenset[str] | None


def classify(backend: str, hostnames: Sequence[str], env: Mapping[str, str], node: NodeLinks | None) -> str:
    """The path one rank's traffic takes, given every rank's host. A lone rank moves nothing between ranks:
    loopback. gloo moves data over TCP: through loopback on one host, sockets between hosts. NCCL inside a node
    uses NVLink when the node's GPUs have links up and P2P is allowed, else PCIe; between nodes its IB transport
    over the active InfiniBand or RoCE (link layer Ethernet) ports, or sockets when IB is disabled or no port is
    active. ``node`` (this node's links) is needed for NCCL only; whatever cannot be known is "unknown"."""
    nodes = len(set(hostnames))
    if len(hostnames) == 1:
        return "loopback"
    if backend != "nccl":
        return "loopback" if nodes == 1 else "socket"
    if node is None:
        return "unknown"
    if nodes == 1:
        if node.nvlink_up is None:
            return "unknown"
        return "nvlink" if node.nvlink_up and not env_flag(env, "NCCL_P2P_DISABLE") else "pcie"
    net = env.get("NCCL_NET", "").strip().lower()
    if env_flag(env, "NCCL_IB_DISABLE") or net == "socket":
        return "socket"
    if net not in ("", "ib") or node.active_link_layers is None:
        return "unknown"  # a network plugin (EFA, ...) or unreadable ports
    if "InfiniBand" in node.active_link_layers:
        return "infiniband"
    if "Ethernet" in node.active_link_layers:
        return "roce"
    return "unknown" if node.active_link_layers else "socket"
