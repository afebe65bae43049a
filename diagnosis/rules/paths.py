"""What a job's collectives achieve, and what the path they run over should give: the bus bandwidth each process
group achieved (nccl-tests' conventions) and its path's rating (NVLink from the agent's topology, InfiniBand/RoCE
from the port's rate, sockets from the NIC's speed), with the nodes and NICs it runs over, and what those NICs'
counters show they carried over the job's step window. Helpers of PERF004.

Bus bandwidth, as nccl-tests defines it (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
algbw = bytes / seconds, and busbw = algbw × 2(n−1)/n for all-reduce, algbw × (n−1)/n for all-gather and
reduce-scatter (n ranks): the data each rank's link carries, so it compares with one link's speed whatever n is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gpuwatch.diagnosis.facts import (
    Facts,
    InterfaceFacts,
    NicTraffic,
    NodeFacts,
    RankFacts,
    group_members,
    median,
    rank_list,
)
from gpuwatch.diagnosis.rules.common import world_size

#: The ops of a sharded (FSDP, ZeRO-3) job: parameters gathered before use, gradients reduce-scattered after.
SHARDED_OPS = ("all_gather", "reduce_scatter")


def rate_text(bytes_per_second: float) -> str:
    """A link rate as people write it: ``52 Mb/s``, ``10 Gb/s``, ``3.82 Tb/s``."""
    bits = bytes_per_second * 8
    for scale, unit in ((1e12, "Tb/s"), (1e9, "Gb/s")):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits / 1e6:.3g} Mb/s"


def sharded(ranks: Sequence[RankFacts]) -> bool:
    """Whether a job shards its parameters (FSDP, ZeRO-3): its timed collectives move more bytes in all-gathers and
    reduce-scatters than in all-reduces."""
    moved: dict[str, float] = {}
    for rank in ranks:
        for op, totals in (rank.collectives or {}).items():
            if totals.bytes:
                kind = next((k for k in SHARDED_OPS if k in op), "all_reduce" if "all_reduce" in op else "other")
                moved[kind] = moved.get(kind, 0.0) + totals.bytes
    return sum(moved.get(k, 0.0) for k in SHARDED_OPS) > moved.get("all_reduce", 0.0)


def bus_factor(sharded_job: bool, ranks: int) -> float:
    """busbw / algbw (nccl-tests' PERFORMANCE.md): 2(n−1)/n for all-reduce, (n−1)/n for all-gather and
    reduce-scatter."""
    return (1 if sharded_job else 2) * (ranks - 1) / ranks


@dataclasses.dataclass(frozen=True)
class Path:
    """What one process group's traffic runs over: its name, the nodes its members run on, whether it crosses nodes
    (None: members unseen here), the NICs or links named, and the rating (bytes/s) with how it was reckoned; or
    None with why there is none."""

    name: str
    nodes: tuple[str, ...]
    crosses: bool | None
    links: tuple[str, ...]
    rating: float | None
    how: str
    #: The NIC each node's share of the traffic leaves by (node, interface, its speed in bytes/s), where named.
    nics: tuple[tuple[str, str, float | None], ...] = ()

    def describe(self) -> str:
        where = ("across nodes " if self.crosses else "inside node " if self.crosses is False else "on nodes ") \
            + ", ".join(self.nodes) if self.nodes else "on unknown nodes"
        return f"{self.name} {where}" + (f" ({', '.join(self.links)})" if self.links else "")


@dataclasses.dataclass(frozen=True)
class Achieved:
    """One process group's collectives in a step: the bytes handed to them and the seconds they took (the
    transfer: the least-waiting rank's), over n members; its bus bandwidth by nccl-tests' convention."""

    group: str
    members: tuple[int, ...]
    bytes: float
    seconds: float
    sharded: bool
    source: str  # where the figures come from, for evidence

    @property
    def algbw(self) -> float:
        return self.bytes / self.seconds

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.sharded, len(self.members))


def achieved(last: RankFacts, ranks: Sequence[RankFacts], transfer: float,
             bytes_per_step: float | None) -> list[Achieved]:
    """Each process group's achieved bandwidth, seen from ``last`` (the rank that waits least, whose exposed time is
    transfer): its latest step's per-group bytes and seconds (``groups``, the hooks' timed calls) where it reports
    them, else the job's bytes per step over its transfer time on the data-parallel group (DDP measured from
    outside: its reducer's all-reduces show as exposed time and a byte count)."""
    world = last.layout.world_size if last.layout is not None else None
    shard = sharded(ranks)
    found = []
    step_groups = last.last.groups if last.last is not None else None
    for group, totals in (step_groups or {}).items():
        members = group_members(last.process_groups, world, group)
        if members is not None and len(members) > 1 and totals.bytes > 0 and totals.seconds > 0:
            found.append(Achieved(group, members, float(totals.bytes), totals.seconds, shard,
                                  f"rank {last.rank}'s latest step: {totals.bytes / 2**20:.3g} MiB in "
                                  f"{totals.seconds:.3g} s on group {group}"))
    if found or bytes_per_step is None or transfer <= 0:
        return sorted(found, key=lambda a: -a.seconds)
    group = "dp" if last.process_groups and "dp" in last.process_groups else "default"
    members = group_members(last.process_groups, world, group)
    if members is None or len(members) < 2:
        return []
    return [Achieved(group, members, bytes_per_step, transfer, shard,
                     f"{bytes_per_step / 2**20:.3g} MiB per step in {transfer:.3g} s of exposed collective time "
                     f"(rank {last.rank}'s, which waits least: an upper bound on the bandwidth, as overlap hides "
                     "part of the transfer)")]


def _socket_interface(node: NodeFacts, wanted: str | None) -> InterfaceFacts | None:
    """The NIC a socket transport uses on a node: the one NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME names (a name or a
    prefix; the first listed), else the fastest up, non-loopback interface with an address and a known speed."""
    candidates = [i for i in node.interfaces or () if i.up and not i.loopback and i.speed_bytes_per_second]
    if wanted and not wanted.startswith(("^", "=")):
        names = [w for w in wanted.split(",") if w]
        for name in names:
            match = next((i for i in candidates if i.name == name), None) or \
                next((i for i in candidates if i.name.startswith(name)), None)
            if match is not None:
                return match
    with_address = [i for i in candidates if i.addresses]
    return max(with_address, key=lambda i: i.speed_bytes_per_second or 0.0, default=None)


#: The interconnects a probe classifies (``schema.INTERCONNECTS``) that cross nodes.
ACROSS_NODES = ("infiniband", "roce", "socket")


def path_of(facts: Facts, ranks: Sequence[RankFacts], achieved_group: Achieved) -> Path:
    """The path of one group, rated by its links (``_linked_path``), or, across nodes where they give no rating, by
    what the job's own `gpuwatch probe` measured across its nodes: the best bus bandwidth of its ops, the network's
    proven capacity. (Inside a node an unrated path stays unrated: loopback or PCIe is no network to repair.)"""
    path = _linked_path(facts, ranks, achieved_group)
    if path.rating is not None or not path.crosses:
        return path
    job = ranks[0].job if ranks else None
    probed = [m for m in facts.bandwidth or () if m.job == job and m.interconnect in ACROSS_NODES]
    if not probed:
        return path
    best = max(probed, key=lambda m: m.busbw_bytes_per_second)
    return dataclasses.replace(path, rating=best.busbw_bytes_per_second, how=(
        f"gpuwatch probe measured {rate_text(best.busbw_bytes_per_second)} of {best.op} bus bandwidth on it "
        f"({best.interconnect}), where its links give no rating: {path.how}"))


def _linked_path(facts: Facts, ranks: Sequence[RankFacts], achieved_group: Achieved) -> Path:
    """The path of one group: across nodes, InfiniBand/RoCE for NCCL where the nodes have active ports, else the
    sockets over each node's NIC (its speed the rating, the slowest node's); inside a node, NVLink for NCCL where
    the GPUs have links up. Loopback, PCIe and unknown parts have no rating."""
    members = set(achieved_group.members)
    by_rank = {r.rank: r for r in ranks}
    seen = [by_rank[m] for m in sorted(members) if m in by_rank]
    hosts = tuple(sorted({r.host for r in seen if r.host is not None}))
    unseen = members - set(by_rank)
    crosses = True if len(hosts) > 1 else (None if unseen or not hosts else False)
    backends = {r.backends.get(achieved_group.group) or r.backends.get("default") for r in seen if r.backends}
    backend = next(iter(backends)) if len(backends) == 1 else None
    nodes = [facts.nodes[h] for h in hosts if h in facts.nodes]
    if crosses is False:
        node = nodes[0] if nodes else None
        if backend == "nccl" and node is not None and node.has_nvlink():
            speeds = [g.up_speed_bytes_per_second for g in node.nvlinks or () if g.up_speed_bytes_per_second]
            if speeds:
                return Path("NVLink", hosts, False, (), min(speeds), "the slowest GPU's NVLink links together")
        what = "shared memory and loopback (gloo inside one node)" if backend == "gloo" else "inside one node"
        return Path(what, hosts, False, (), None, "no rating for this path")
    if len(nodes) < len(hosts) or not nodes:
        return Path("the network", hosts, crosses, (), None, "the nodes' NICs are unknown to this source")
    if backend != "gloo":
        ports = {node.name: [p for p in node.active_ports() if p.rate_bytes_per_second] for node in nodes}
        if all(ports.values()):
            layer = next(iter(ports.values()))[0].link_layer
            per_node = max(sum(1 for r in seen if r.host == h) for h in hosts)
            rails = min(per_node, *(len(p) for p in ports.values()))
            slowest = min(p.rate_bytes_per_second or 0.0 for found in ports.values() for p in found)
            links = tuple(f"{n}:{p.name}" for n, found in ports.items() for p in found[:rails])
            return Path("RoCE" if layer == "Ethernet" else "InfiniBand", hosts, crosses, links, slowest * rails,
                        f"{rails} active port(s) of {rate_text(slowest)} a node")
    variable = "GLOO_SOCKET_IFNAME" if backend == "gloo" else "NCCL_SOCKET_IFNAME"
    wanted = next((r.env[variable] for r in seen if r.env and r.env.get(variable)), None)
    nics = {node.name: _socket_interface(node, wanted) for node in nodes}
    if any(nic is None for nic in nics.values()):
        unknown = [name for name, nic in nics.items() if nic is None]
        return Path("sockets", hosts, crosses, (), None, f"the speed of the NIC on {', '.join(unknown)} is unknown")
    nic_speeds = {name: nic.speed_bytes_per_second or 0.0 for name, nic in nics.items() if nic is not None}
    slowest_node = min(nic_speeds, key=lambda name: nic_speeds[name])
    links = tuple(f"{name}:{nic.name} ({rate_text(nic.speed_bytes_per_second or 0.0)})"
                  for name, nic in nics.items() if nic is not None)
    chosen = f"{variable}={wanted}" if wanted else "the fastest NIC with an address"
    return Path("sockets (TCP)", hosts, crosses, links, nic_speeds[slowest_node],
                f"the NIC's link speed on {slowest_node} ({chosen}; /sys/class/net/*/speed)",
                tuple((name, nic.name, nic.speed_bytes_per_second) for name, nic in nics.items() if nic is not None))


@dataclasses.dataclass(frozen=True)
class NodeTraffic:
    """What one node's NIC on a group's path carried over the job's step window there: its counters' difference
    and the steps that window spans (its ranks' median step time)."""

    node: str
    traffic: NicTraffic
    speed: float | None
    steps: float

    @property
    def utilization(self) -> float | None:
        return self.traffic.busiest_bytes_per_second / self.speed if self.speed else None

    def describe(self) -> str:
        t = self.traffic
        share = f", {self.utilization:.2%} of its {rate_text(self.speed)}" if self.speed else ""
        return (f"{self.node}'s {t.interface} sent {rate_text(t.transmit_bytes / t.seconds)} and received "
                f"{rate_text(t.receive_bytes / t.seconds)} over {t.seconds:.3g} s of the step window{share} "
                f"({max(t.transmit_bytes, t.receive_bytes) / self.steps / 2**20:.3g} MiB a step the busier way), "
                f"{t.errors} errors, {t.drops} drops")


def traffic_on(facts: Facts, ranks: Sequence[RankFacts], path: Path) -> list[NodeTraffic]:
    """Each named NIC's traffic over its node's step window (from the earliest start to the latest end of the
    windows of the job's ranks there), where that node's agent kept counter samples inside it."""
    found = []
    for node_name, interface, speed in path.nics:
        node = facts.nodes.get(node_name)
        windows = [r.window for r in ranks if r.host == node_name and r.window is not None
                   and r.window.ended is not None]
        steps = [step for w in windows if (step := w.median("step_seconds"))]
        if node is None or not windows or not steps:
            continue
        start = min(w.ended - w.seconds for w in windows if w.ended is not None)
        end = max(w.ended for w in windows if w.ended is not None)
        traffic = node.traffic_between(interface, start, end)
        if traffic is not None:
            found.append(NodeTraffic(node_name, traffic, speed, traffic.seconds / median(steps)))
    return found


#: A node's NIC is the slow side when it runs this much busier against its own speed than every other node's NIC: its
#: link negotiated a lower speed, or carries other traffic.
BUSIER = 1.5


def slow_side(traffic: Sequence[NodeTraffic]) -> tuple[str, str] | None:
    """The node whose NIC the counters single out, and why: the only one counting errors or drops in the window,
    or one running BUSIER × busier against its speed than all the others. None when no node stands out: a collective
    moves in lockstep, so a link slowed by shaping or a congested switch port shows the same rate on every side."""
    if len(traffic) < 2:
        return None
    faulty = [t for t in traffic if t.traffic.errors or t.traffic.drops]
    if len(faulty) == 1:
        t = faulty[0]
        return t.node, f"its {t.traffic.interface} alone counted errors or drops ({t.traffic.errors} errors, " \
                       f"{t.traffic.drops} drops in the window)"
    rated = sorted((t for t in traffic if t.utilization is not None), key=lambda t: -(t.utilization or 0.0))
    if len(rated) >= 2 and (rated[0].utilization or 0.0) >= BUSIER * (rated[1].utilization or 0.0) > 0:
        return rated[0].node, f"its {rated[0].traffic.interface} runs at {rated[0].utilization:.2%} of its speed, " \
                              f"the others at most {rated[1].utilization:.2%}"
    return None


def waits_for_unseen(ranks: Sequence[RankFacts], exposed: dict[int, float]) -> tuple[float, list[int], int] | None:
    """Where the ranks measured are fewer than the job's world size (the hellos'): the median exposed collective
    time of those measured, the ranks not measured here, and the world size; None when every rank is measured."""
    world = world_size(ranks)
    if world is None or not exposed:
        return None
    missing = sorted(set(range(world)) - set(exposed))
    return (median(exposed.values()), missing, world) if missing else None


def unseen_text(ranks: Sequence[RankFacts], missing: Sequence[int]) -> str:
    """``ranks not reporting here (2-3)``, or ``ranks not measured here`` for ranks seen without a full window."""
    present = {r.rank for r in ranks}
    how = "not measured here" if present & set(missing) else "not reporting here"
    return f"rank{'s' if len(missing) > 1 else ''} {how} ({rank_list(missing)})"

