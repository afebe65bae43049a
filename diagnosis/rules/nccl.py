"""Network configuration: NCCL environment variables that contradict the node's hardware."""

from __future__ import annotations

import types
from collections.abc import Iterator

from gpuwatch.diagnosis import needs
from gpuwatch.diagnosis.coverage import COLLECTIVE_TAIL, ENV_MINORITY, IB_PORT_UNHEALTHY, NCCL_SOCKET_IFNAME
from gpuwatch.diagnosis.facts import Facts, InterfaceFacts, Where, may_use_nccl
from gpuwatch.diagnosis.registry import Evidence, Issue, Severity, Threshold, rule
from gpuwatch.diagnosis.rules.common import capped, env_scopes
from gpuwatch.protocol.interconnect import env_flag

FAMILY = "network config"
#: Interfaces that only reach this host (NCCL itself skips them unless told to use them).
HOST_LOCAL_PREFIXES = ("lo", "docker", "virbr")
#: Interfaces named in NCCL003's evidence (a Kubernetes node can have hundreds of veths).
MAX_LISTED_INTERFACES = 12


def _ib_disabled(env: dict[str, str]) -> str | None:
    """The setting that keeps NCCL off InfiniBand, as written; None when IB is allowed."""
    if env_flag(env, "NCCL_IB_DISABLE"):
        return f"NCCL_IB_DISABLE={env['NCCL_IB_DISABLE']}"
    if env.get("NCCL_NET", "").strip().lower() == "socket":
        return f"NCCL_NET={env['NCCL_NET']}"
    return None


@rule("NCCL001", family=FAMILY, severity=Severity.CRITICAL,
      title="NCCL_IB_DISABLE=1 while InfiniBand/RoCE ports are active",
      needs=(needs.NCCL_ACROSS_NODES, needs.ENV, needs.IB_PORTS),
      coverage=(IB_PORT_UNHEALTHY, ENV_MINORITY))
def ib_disabled_with_active_ports(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """NCCL_IB_DISABLE=1 (or NCCL_NET=Socket) makes NCCL send every inter-node byte over TCP sockets even
    though the node has ACTIVE InfiniBand or RoCE ports: collectives across nodes run several times slower
    and large jobs can hang in them. The rule names the active ports it saw, so the evidence can be
    checked with ibstat on the node. It judges jobs that use NCCL across nodes (inside one node NCCL never
    uses InfiniBand, and a gloo job never reads the variable), and any pre-flight shell, which before
    launch may start either; one finding per job and setting, listing its nodes."""
    for scope in env_scopes(facts, across_nodes=True):
        setting = _ib_disabled(scope.env)
        if setting is None:
            continue
        active = {name: ports for name in scope.nodes
                  if (node := facts.nodes.get(name)) is not None and (ports := node.active_ports())}
        if not active:
            continue
        evidence = [Evidence(f"{setting} in the environment of {scope}", scope.where, {"setting": setting})]
        evidence += capped([Evidence(f"active port {port.describe()} on {name}", Where(node=name, port=port.name),
                                     {"link_layer": port.link_layer, "rate_bytes_per_second": rate})
                            for name, ports in active.items() for port in ports
                            for rate in (port.rate_bytes_per_second,)], what="active ports")
        listed = "; ".join(f"{name}: {', '.join(port.name for port in node_ports)}" if len(active) > 1
                           else ", ".join(port.name for port in node_ports) for name, node_ports in active.items())
        count = sum(len(node_ports) for node_ports in active.values())
        yield Issue(
            title=f"{setting} while {count} InfiniBand/RoCE port(s) are active on {', '.join(active)}: {listed}",
            evidence=tuple(evidence),
            fix="export NCCL_IB_DISABLE=0 (or unset it, and NCCL_NET=Socket) in the job's environment",
            reason="With IB disabled NCCL falls back to TCP sockets between nodes: collectives run several times "
                   "slower, and large jobs can hang in them.",
        )


@rule("NCCL002", family=FAMILY, severity=Severity.WARNING,
      title="RoCE ports without NCCL_IB_GID_INDEX", needs=(needs.NCCL_ACROSS_NODES, needs.ENV, needs.IB_PORTS),
      coverage=(IB_PORT_UNHEALTHY, ENV_MINORITY))
def roce_without_gid_index(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """On RoCE (an InfiniBand port whose link layer is Ethernet) every port has a table of GIDs: RoCEv1
    and RoCEv2, IPv4 and IPv6 link-local. NCCL must be told which one to use (NCCL_IB_GID_INDEX; RoCEv2
    with the IPv4 address is usually index 3, as `show_gids` lists it). Without it NCCL may pick a GID the
    fabric does not route, and cross-node connections fail or crawl. Judged for jobs that use NCCL across
    nodes and pre-flight shells; skipped where IB is disabled altogether (that is NCCL001's finding)."""
    for scope in env_scopes(facts, across_nodes=True):
        if "NCCL_IB_GID_INDEX" in scope.env or _ib_disabled(scope.env):
            continue
        roce = [(name, port) for name in scope.nodes if (node := facts.nodes.get(name)) is not None
                for port in node.active_ports() if port.link_layer == "Ethernet"]
        if not roce:
            continue
        nodes = sorted({name for name, _ in roce})
        yield Issue(
            title=f"{len(roce)} RoCE port(s) on {', '.join(nodes)} but NCCL_IB_GID_INDEX is not set",
            evidence=(Evidence(f"NCCL_IB_GID_INDEX unset in the environment of {scope}", scope.where),
                      *capped([Evidence(f"active RoCE port {port.describe()} on {name}",
                                        Where(node=name, port=port.name)) for name, port in roce], what="ports")),
            fix="export NCCL_IB_GID_INDEX=3 (confirm the RoCEv2 IPv4 entry with show_gids on the node)",
            reason="NCCL must use a routable RoCEv2 GID; the default entry may be RoCEv1 or IPv6 link-local, "
                   "and cross-node connections then fail or run slowly.",
        )


def _socket_ifname_problem(spec: str, interfaces: list[InterfaceFacts], may_span: bool) -> str | None:
    """What is wrong with NCCL_SOCKET_IFNAME on these interfaces, or None. NCCL's syntax: a comma list of
    name prefixes, ``=`` for exact names, a leading ``^`` to exclude instead of select."""
    exclude = spec.startswith("^")
    spec = spec.removeprefix("^")
    exact = spec.startswith("=")
    names = [name.strip() for name in spec.removeprefix("=").split(",") if name.strip()]

    def matches(interface: InterfaceFacts) -> bool:
        return any(interface.name == name if exact else interface.name.startswith(name) for name in names)

    def usable(interface: InterfaceFacts) -> bool:
        return interface.up and not interface.loopback and not interface.name.startswith(HOST_LOCAL_PREFIXES)

    if exclude:
        if not any(usable(i) for i in interfaces if not matches(i)):
            return "it excludes every interface that is up and reaches other hosts"
        return None
    chosen = [i for i in interfaces if matches(i)]
    if not chosen:
        return "no interface of that name exists"
    if not any(i.up for i in chosen):
        return f"{', '.join(i.name for i in chosen)} {'is' if len(chosen) == 1 else 'are'} down"
    if may_span and not any(usable(i) for i in chosen):
        return f"{', '.join(i.name for i in chosen)} only reach{'es' if len(chosen) == 1 else ''} this host " \
               "(loopback or a container bridge)"
    return None


@rule("NCCL003", family=FAMILY, severity=Severity.CRITICAL,
      title="NCCL_SOCKET_IFNAME names a missing, down, loopback or container interface",
      needs=(needs.NCCL_JOB, needs.ENV, needs.INTERFACES),
      coverage=(NCCL_SOCKET_IFNAME,))
def socket_ifname_unusable(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """NCCL bootstraps (and, without InfiniBand, moves data) over the interface NCCL_SOCKET_IFNAME
    selects. If that interface does not exist on the node, is down, or only reaches the host itself
    (lo, docker0, virbr0), ranks on other nodes can never connect and initialisation hangs until the
    timeout (NCCL docs, environment variables: NCCL_SOCKET_IFNAME chooses the IP interfaces NCCL uses).
    Loopback and bridges are accepted when every rank of the job is known to be on
    one node."""
    for scope in env_scopes(facts):
        spec = scope.env.get("NCCL_SOCKET_IFNAME", "").strip()
        if not spec:
            continue
        may_span = not scope.ranks or facts.spans_nodes(scope.job)
        for name in scope.nodes:
            node = facts.nodes.get(name)
            if node is None or node.interfaces is None:
                continue
            problem = _socket_ifname_problem(spec, node.interfaces, may_span)
            if problem is None:
                continue
            candidates = [i.name for i in node.interfaces
                          if i.up and not i.loopback and not i.name.startswith(HOST_LOCAL_PREFIXES) and i.addresses]
            listing = ", ".join(f"{i.name} ({'up' if i.up else 'down'}{', loopback' if i.loopback else ''})"
                                for i in node.interfaces[:MAX_LISTED_INTERFACES])
            if len(node.interfaces) > MAX_LISTED_INTERFACES:
                listing += f", ... and {len(node.interfaces) - MAX_LISTED_INTERFACES} more"
            yield Issue(
                title=f"NCCL_SOCKET_IFNAME={spec} on {node.name}: {problem}",
                evidence=(Evidence(f"NCCL_SOCKET_IFNAME={spec} in the environment of {scope}", scope.where,
                                   {"NCCL_SOCKET_IFNAME": spec}),
                          Evidence(f"interfaces on {node.name}: {listing}", Where(node=node.name))),
                fix=f"export NCCL_SOCKET_IFNAME={candidates[0] if candidates else '<data-network interface>'}"
                    + (f" (up, routable interfaces here: {', '.join(candidates)})" if candidates else ""),
                reason="NCCL's bootstrap connects over this interface; one that is missing, down or host-local "
                       "makes cross-node initialisation hang until the timeout.",
            )
            break  # one finding per job and setting: the first node that shows the problem stands for the rest


@rule("NCCL004", family=FAMILY, severity=Severity.WARNING,
      title="NCCL_P2P_DISABLE=1 on NVLink-connected GPUs", needs=(needs.NCCL_JOB, needs.ENV, needs.NVLINKS),
      coverage=(ENV_MINORITY,))
def p2p_disabled_on_nvlink(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """NCCL_P2P_DISABLE=1 (or NCCL_P2P_LEVEL=LOC) stops NCCL from using NVLink between the GPUs of a node:
    intra-node traffic goes through host shared memory, or over the network when NCCL_SHM_DISABLE=1 is
    set as well. On an A100 (NVIDIA's datasheet) NVLink carries 600 GB/s against PCIe Gen4's 64 GB/s, a 9.4x
    gap. NCCL_SHM_DISABLE=1
    alone is not flagged: with P2P allowed NCCL does not use the shared-memory path between NVLink peers."""
    for scope in env_scopes(facts):
        level = scope.env.get("NCCL_P2P_LEVEL", "").strip().upper()
        settings = [f"NCCL_P2P_DISABLE={scope.env['NCCL_P2P_DISABLE']}"] if env_flag(scope.env, "NCCL_P2P_DISABLE") \
            else ([f"NCCL_P2P_LEVEL={level}"] if level in ("LOC", "0") else [])
        linked_nodes = [node for name in scope.nodes if (node := facts.nodes.get(name)) is not None
                        and node.has_nvlink()]
        if not settings or not linked_nodes:
            continue
        if env_flag(scope.env, "NCCL_SHM_DISABLE"):
            settings.append(f"NCCL_SHM_DISABLE={scope.env['NCCL_SHM_DISABLE']}")
        evidence = [Evidence(f"{', '.join(settings)} in the environment of {scope}", scope.where)]
        for node in linked_nodes:
            assert node.nvlinks is not None, "has_nvlink() is None without NVLink facts"
            linked = [gpu for gpu in node.nvlinks if gpu.links > len(gpu.down)]
            links = sum(gpu.links - len(gpu.down) for gpu in linked)
            evidence.append(Evidence(f"{len(linked)} GPU(s) on {node.name} with {links} NVLink links up",
                                     Where(node=node.name), {"gpus": len(linked), "links_up": links}))
        yield Issue(
            title=f"{' and '.join(settings)} on {', '.join(n.name for n in linked_nodes)}, whose GPUs are "
                  "NVLink-connected",
            evidence=capped(evidence, what="nodes"),
            fix="unset NCCL_P2P_DISABLE" + (" and NCCL_SHM_DISABLE" if len(settings) > 1 else "")
                + " (or set them to 0)",
            reason="With P2P disabled intra-node collectives bypass NVLink and go through host memory"
                   + (" or the network" if len(settings) > 1 else "") + ", several times slower.",
        )


def _allows_tree(env: dict[str, str] | None) -> bool | None:
    if env is None:
        return None
    algo = env.get("NCCL_ALGO", "").lower()
    return "tree" in algo and not algo.startswith("^")


@rule("NCCL005", family=FAMILY, severity=Severity.WARNING,
      title="Ring all-reduce with a heavy latency tail", needs=(needs.NCCL_ACROSS_NODES, needs.COLLECTIVES),
      thresholds={
          "tail_ratio": Threshold(1.7, "a reported 128-GPU case: p99 142 ms against 83 ms typical before "
                                       "NCCL_ALGO=Tree, 45 ms against 31 ms (1.45) after"),
          "min_calls": Threshold(100, "a p99 needs about a hundred calls to mean anything"),
      },
      coverage=(COLLECTIVE_TAIL,))
def ring_latency_tail(facts: Facts, t: types.SimpleNamespace) -> Iterator[Issue]:
    """A ring all-reduce crosses every node in turn, so one slow link or busy switch port stalls the whole
    ring: the latency distribution grows a long tail. A practitioners' troubleshooting entry: occasional
    hangs, high p99 → ring all-reduce blocking on long chains → NCCL_ALGO=Tree; in one reported case
    switching to tree (NCCL_ALGO=Tree, NCCL_TREE_THRESHOLD=0) took a 128-GPU all-reduce from 83 ms to
    31 ms and p99 from 142 ms to 45 ms.
    The rule compares each rank's all-reduce p99 with its p50, only for jobs that span nodes (inside a
    node NCCL rings over NVLink and Tree does not help) and only where NCCL_ALGO does not already allow
    Tree. The per-op histogram mixes message sizes, hence the minimum call count.
    A slow ring stretches the same calls on every rank; a tail on some ranks only is their wait for the others,
    who came late to those calls (a checkpoint, a straggling step): a wait on a peer, not the network, which the
    rule leaves to PERF002 and the hang rules rather than send the user to NCCL_ALGO."""
    for job, ranks in facts.jobs().items():
        if not facts.spans_nodes(job) or not may_use_nccl(ranks):
            continue
        tailed, timed = [], 0
        for rank in ranks:
            stats = (rank.collectives or {}).get("all_reduce")
            if (stats is None or stats.count < t.min_calls or not stats.p50_seconds or stats.p99_seconds is None
                    or _allows_tree(rank.env)):
                continue
            timed += 1
            p50, p99 = stats.p50_seconds, stats.p99_seconds
            ratio = p99 / p50
            if ratio >= t.tail_ratio:
                tailed.append((ratio, rank, stats.count, p50, p99))
        if not tailed or len(tailed) < timed:  # some timed ranks without the tail: the others waited for them
            continue
        tailed.sort(key=lambda item: -item[0])
        unknown_env = any(rank.env is None for _, rank, *_ in tailed)
        yield Issue(
            title=f"all-reduce p99 up to {tailed[0][0]:.1f}x its p50 on {len(tailed)} rank(s) of job {job}",
            evidence=capped([Evidence(f"rank {rank.rank}: all-reduce p50 {p50 * 1e3:.2f} ms, p99 "
                                      f"{p99 * 1e3:.2f} ms ({ratio:.1f}x) over {calls} calls",
                                      rank.where, {"p50_seconds": p50, "p99_seconds": p99, "calls": calls})
                             for ratio, rank, calls, p50, p99 in tailed], what="ranks"),
            fix="export NCCL_ALGO=Tree (and NCCL_TREE_THRESHOLD=0 on older NCCL), then compare step times"
                + (" — unless NCCL_ALGO already allows Tree (the ranks' environment is unknown here)"
                   if unknown_env else ""),
            reason="A ring waits on its slowest hop at every step; a tree bounds the path length, which cut "
                   "p99 from 142 ms to 45 ms in one reported case.",
        )

