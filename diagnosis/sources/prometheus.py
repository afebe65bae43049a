"""``--prometheus URL``: every node and rank of a cluster from the agents' series, through the HTTP API.

A fixed handful of instant queries, each returning a whole family for all nodes at once (never one query
per node), so the cost stays flat from 1 node to 1,024. Nodes are named by ``gpuwatch_agent_info``'s
``node`` label and joined to other series on ``instance``. The training job is the series' ``job``
label, which Prometheus renames ``exported_job`` unless the scrape honours labels.

A rank's environment is the part of it that rules read (``gpuwatch_train_env_info``, one series per variable
set; ``schema.EXPORTED_ENV``), and its process groups as runs of ranks (``gpuwatch_train_process_group_info``).
What Prometheus does not carry stays unknown (None): a group too large to export, the network interfaces of an agent
that does not export them, the interfaces' traffic history (an agent's state keeps one; here it would take a range
query per job), and the environment of a rank that set none of the exported variables. Error counters
become increases over ``WINDOW``, which a single agent snapshot cannot give.

Past 500 lines on purpose: one reader (``_Reader``), a method per family it turns into facts, each beside the query
it reads; the outlier fetch, which reads less, is ``outliers.py``.
"""

from __future__ import annotations

import collections
import math
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec

from gpuwatch.agent.collectors.host import CPUS, NETWORK_INFO, NETWORK_SPEED, PROCESS_CPU
from gpuwatch.agent.collectors.infiniband import (
    DEVICE_INFO,
    PHYS_STATES,
    PORT_ERRORS,
    PORT_PHYSICAL_STATE,
    PORT_RATE,
    PORT_STATE,
    PORT_STATES,
    PORT_UP,
)
from gpuwatch.agent.collectors.nvlink import LINK_SPEED, LINK_UP
from gpuwatch.agent.collectors.nvml import (
    CLOCK_EVENT_ACTIVE,
    ECC_VOLATILE_ERRORS,
    GPU_INFO,
    GPU_LOST,
    PCIE_LINK_GENERATION,
    PCIE_LINK_WIDTH,
    ROW_REMAP_FAILURE,
    ROW_REMAP_PENDING,
    XID_ERRORS,
)
from gpuwatch.agent.sampler import AGENT_INFO, COLLECTOR_UP
from gpuwatch.agent.telemetry.metrics import (
    CALLS,
    CHECKSUM,
    CLOSED,
    CLOSED_CPU,
    COSINE,
    COUNTERS,
    ENV_INFO,
    EXITED,
    GPU_JOB,
    GROUP_INFO,
    HELLO_TIME,
    IN_FLIGHT,
    LAST_STEP,
    LATENCY,
    MEMORY_GAUGES,
    MEMORY_PEAK,
    MODEL_INFO,
    MODEL_INFO_FIELDS,
    PHASE,
    PROBE_BANDWIDTH,
    PROBE_INFO,
    RAISED,
    RANK_INFO,
    STALLED,
    STEP_GAUGES,
    UNAVAILABLE,
    VOLUME,
    WINDOW_GAUGES,
    WINDOW_MEDIAN,
)
from gpuwatch.agent.telemetry.window import WindowSummary
from gpuwatch.diagnosis import needs
from gpuwatch.diagnosis.facts import (
    BandwidthMeasurement,
    CollectiveFacts,
    Facts,
    GpuFacts,
    History,
    IbPortFacts,
    InFlightFacts,
    InterfaceFacts,
    Layout,
    NodeFacts,
    NvlinkFacts,
    ProgressFacts,
    RankFacts,
    Sampled,
    SourceInfo,
    StepFacts,
    Unjudged,
    Workload,
    group_members,
)
from gpuwatch.diagnosis.registry import REGISTRY
from gpuwatch.diagnosis.sources import HTTP_TIMEOUT, WINDOW, Meter, QueryError, SourceError, http_json, outliers
from gpuwatch.diagnosis.sources.collectors import GPU_GAUGES_READ, PARTS, hca_model, read_by
from gpuwatch.diagnosis.sources.httpconfig import HttpConfig
from gpuwatch.diagnosis.sources.telemetry import after_close
from gpuwatch.protocol.ranks import parse_members
from gpuwatch.protocol.records import ModelShapeFields

#: How far back the per-step host RSS history reaches, and its resolution.
HISTORY = "30m:30s"

#: The nvml collector's gauges diagnosis reads -> GpuFacts field (the reading's field of the same name).
_GPU_GAUGES = {spec.name: spec.field for spec in GPU_GAUGES_READ}
_GPU_SERIES = "|".join([*(spec.name for spec in (GPU_INFO, GPU_LOST, PCIE_LINK_GENERATION, PCIE_LINK_WIDTH,
                                                   ROW_REMAP_PENDING, ROW_REMAP_FAILURE, GPU_JOB)), *_GPU_GAUGES])
_IB_SERIES = "|".join(spec.name for spec in (DEVICE_INFO, PORT_UP, PORT_RATE, PORT_STATE, PORT_PHYSICAL_STATE))
#: The telemetry collector's latest-step gauges diagnosis reads -> StepFacts field (the record's field name); the
#: step number is read on its own, as it tells whether the rank has a latest step at all.
_STEP_GAUGES = {spec.name: spec.field for spec in read_by((*STEP_GAUGES, *MEMORY_GAUGES), StepFacts)
                if spec is not LAST_STEP}
_MEMORY_SERIES = frozenset(spec.name for spec in MEMORY_GAUGES)
#: The telemetry collector's rank counters diagnosis reads -> RankFacts field (the rank state's field name).
_RANK_COUNTERS = {f"{spec}_total": spec.field for spec in read_by(COUNTERS, RankFacts)}
#: A rank's collective series, per op: the latency histogram's count and sum, and the bytes moved.
_COLLECTIVE_COUNT, _COLLECTIVE_SUM, _COLLECTIVE_BYTES = f"{LATENCY}_count", f"{LATENCY}_sum", f"{VOLUME}_total"
#: A rank's process CPU time, from the host collector (for HANG007, beside its CPU time as its hooks closed).
_PROCESS_CPU_TOTAL = f"{PROCESS_CPU}_total"
_RANK_SERIES = "|".join([*(spec.name for spec in (RANK_INFO, MODEL_INFO, ENV_INFO, LAST_STEP, CHECKSUM, COSINE,
                                                   WINDOW_MEDIAN, UNAVAILABLE, STALLED, PHASE, IN_FLIGHT, EXITED,
                                                   CLOSED, CLOSED_CPU, RAISED, CALLS, GROUP_INFO, HELLO_TIME,
                                                   *WINDOW_GAUGES)),
                         _PROCESS_CPU_TOTAL, _COLLECTIVE_COUNT, _COLLECTIVE_SUM, _COLLECTIVE_BYTES, *_STEP_GAUGES,
                         *_RANK_COUNTERS])
_RANK_KEY = "instance, job, exported_job, rank"


#: Longer query URLs are POSTed (an outlier fetch's scope names many nodes): proxies and engines limit URLs to a
#: few KiB (Go's net/http reads 1 MiB of headers; nginx's default buffer is 8 KiB), and every engine takes both.
MAX_GET_URL = 4096


class Api:
    """A PromQL engine's instant-query API (Prometheus, Thanos, Mimir, VictoriaMetrics): queries carry the
    engine-side ``timeout`` and count what they cost; long ones are POSTed (``MAX_GET_URL``). An answer
    the engine marks partial or sends with warnings is no answer: judged on it, a rule could pass what it never saw.
    """

    def __init__(self, url: str, timeout: float = HTTP_TIMEOUT, config: HttpConfig | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.username is not None or parts.password is not None:  # said without them: never printed
            raise SourceError("the --prometheus URL carries credentials (user:password@): put them in "
                              "--http.config.file (basic_auth), where they are read from a file and never shown")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.config = config or HttpConfig()
        self.meter = Meter()

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (vector or matrix samples). A query the engine could not answer whole is a
        QueryError; an engine that is none (or unreachable) a SourceError."""
        # Plain seconds: Prometheus parses a float or a Go duration of whole units ("2.5s" is refused; "2.5" is
        # 2.5 s), VictoriaMetrics either.
        form = {"query": expr, "timeout": f"{self.timeout:g}"}
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode(form)}"
        long = len(url) > MAX_GET_URL
        answer = http_json(f"{self.url}/api/v1/query" if long else url, "a PromQL engine (Prometheus HTTP API)",
                           self.timeout + TIMEOUT_GRACE, self.config, form=form if long else None, meter=self.meter)
        if not isinstance(answer, dict) or answer.get("status") not in ("success", "error"):
            raise SourceError(f"{self.config.redact(self.url)} is not a Prometheus HTTP API (unexpected answer to "
                              "/api/v1/query)")
        if answer["status"] == "error":
            raise QueryError(f"{answer.get('errorType', 'error')}: {answer.get('error')}")
        warnings = [str(warning) for warning in answer.get("warnings") or ()]
        if answer.get("isPartial"):  # VictoriaMetrics: some storage nodes did not answer
            warnings.append("the engine marked the answer partial (isPartial)")
        if warnings:
            raise QueryError("partial answer: " + "; ".join(warnings))
        return answer["data"]["result"]


def _value(sample: dict[str, Any]) -> float:
    """Prometheus writes sample values as strings, non-finite ones as "NaN", "+Inf", "-Inf"."""
    return float(sample["value"][1])


def _int(text: str | None) -> int | None:
    return int(text) if text not in (None, "") else None


#: Seconds the client waits beyond the engine-side query timeout, so that the engine's own timeout answer (which
#: names the query) arrives before the socket gives up.
TIMEOUT_GRACE = 5.0
#: ``--prometheus.fetch auto`` pulls every series up to this many nodes (a few MB at most, and every rule runs) and
#: fetches outliers above it.
AUTO_FULL_MAX_NODES = 64
FETCH_MODES = ("auto", "full", "outliers")


def fetch(url: str, timeout: float = HTTP_TIMEOUT, config: HttpConfig | None = None, mode: str = "auto",
          overrides: Mapping[str, Mapping[str, float]] | None = None) -> Facts:
    """Facts of every node and rank the engine knows of: pulled whole (``full``), or (``outliers``) judged through
    aggregates computed by the engine, with only the deviating nodes, the jobs whose rules need them whole and one
    node per job fetched in detail. ``overrides`` are ``--config``'s thresholds: the outlier selectors use the
    thresholds the rules will judge with."""
    return read(Api(url, timeout, config), mode, overrides)


def read(api: Api, mode: str = "auto", overrides: Mapping[str, Mapping[str, float]] | None = None) -> Facts:
    """``fetch`` through a given API (the benchmark times each query through its own)."""
    if mode not in FETCH_MODES:
        raise SourceError(f"unknown fetch mode {mode!r} (one of {', '.join(FETCH_MODES)})")
    nodes = _count(api, f"count({AGENT_INFO})")
    if not nodes:
        raise SourceError(f"{api.url} has no {AGENT_INFO} series: it scrapes no gpuwatch agent")
    if mode == "auto":
        mode = "full" if nodes <= AUTO_FULL_MAX_NODES else "outliers"
    reader = _Reader(api)
    if mode == "outliers" and _count(api, f'count({RANK_INFO}{{exported_job!=""}})'):
        mode = "full"  # the aggregates group by `job`, as the alerts do: they would lump every job together
        reader.facts.notes.append(
            f"{api.url}: the agents are scraped without honor_labels (training jobs in exported_job), which the "
            "outlier fetch's aggregates and the alerts assume: every series was pulled instead")
    if mode == "outliers":
        plan = outliers.plan(api, overrides or {})
        reader.scope = outliers.instance_matcher(plan.instances)
        reader.facts.peers = plan.peers
        reader.facts.unjudged.update(plan.unjudged)
        reader.facts.notes.append(
            f"{api.url}: {nodes} node(s) judged through PromQL aggregates; {len(plan.instances)} fetched in detail "
            f"({plan.describe()})")
    facts = reader.read()
    facts.sources[0] = SourceInfo("prometheus", api.url, fetch=mode, queries=api.meter.requests,
                                  bytes_received=api.meter.bytes, nodes=nodes)
    return facts


#: The needs each read's facts serve: a read that fails leaves the rules with one of these needs unjudged ("ranks":
#: every rule needing any rank fact, i.e. a need that is not a node part's).
_NODE_NEEDS = {"gpus": (needs.GPUS, needs.GPU_CAPACITY), "nvlinks": (needs.NVLINKS,), "ib_ports": (needs.IB_PORTS,),
               "interfaces": (needs.INTERFACES,), "bandwidth": (needs.BANDWIDTH,)}


def rules_reading(part: str) -> list[str]:
    """The codes of the rules resting on a read (``_Reader._parts``)."""
    node_needs = {need for group in _NODE_NEEDS.values() for need in group}
    wanted = node_needs if part == "nodes" else set(_NODE_NEEDS.get(part, ()))
    return [rule.code for rule in REGISTRY.values()
            if (set(rule.needs) & wanted) or (part == "ranks" and set(rule.needs) - node_needs)]


def _count(api: Api, expr: str) -> int:
    """A scalar count from a one-sample vector (0 when the vector is empty)."""
    result = api.query(expr)
    return int(_value(result[0])) if result else 0


class _Reader:
    """One diagnosis' worth of queries, turned into Facts."""

    def __init__(self, api: Api) -> None:
        self.api = api
        #: A label matcher every selector carries (``instance=~"…"``: the nodes an outlier fetch reads in detail);
        #: empty for a full pull.
        self.scope = ""
        self.nodes: dict[str, NodeFacts] = {}  # by instance
        self.facts = Facts(sources=[SourceInfo("prometheus", api.url)])
        self.gpu_of_rank: dict[tuple[str, str, str | None], tuple[int, str | None]] = {}  # (node, job, rank) -> GPU

    def read(self) -> Facts:
        agents = self.api.query(self.sel(AGENT_INFO.name))
        if not agents:
            raise SourceError(f"{self.api.url} has no {AGENT_INFO} series: it scrapes no gpuwatch agent")
        for sample in agents:
            labels = sample["metric"]
            name = labels.get("node") or labels.get("instance", "unknown")
            self.nodes[labels.get("instance", name)] = self.facts.nodes[name] = NodeFacts(
                name=name, simulated=labels.get("mode") == "simulated",
                missing={"interfaces": f"the agent exports no network interfaces ({NETWORK_INFO})"})
        for part, read in self._parts():
            try:
                read()
            except QueryError as exc:
                self._unjudged(part, str(exc))
        return self.facts

    def _parts(self) -> list[tuple[str, Callable[[], None]]]:
        """The reads, each named after the ``needs`` of the rules its facts serve (``_PART_NEEDS``)."""
        return [("nodes", self._collectors), ("nodes", self._cpus), ("gpus", self._gpus),
                ("nvlinks", self._nvlinks), ("ib_ports", self._ib_ports), ("interfaces", self._interfaces),
                ("ranks", self._ranks),
                ("bandwidth", self._bandwidth)]

    def _unjudged(self, part: str, reason: str) -> None:
        """A read the engine could not answer whole: every rule resting on its facts could not run, and says so."""
        what = f"the {part.replace('_', ' ')} query failed: {self.api.config.redact(reason)}"
        self.facts.notes.append(f"{self.api.url}: {what}")
        for code in rules_reading(part):
            self.facts.unjudged.setdefault(code, Unjudged(what, source=True))

    def sel(self, name: str, matchers: str = "") -> str:
        """A vector selector of ``name`` (may be empty, with ``__name__`` in ``matchers``) within the scope."""
        return f"{name}{{{', '.join(filter(None, (matchers, self.scope)))}}}"

    def _node_samples(self, expr: str) -> Iterator[tuple[NodeFacts, dict[str, str], dict[str, Any]]]:
        for sample in self.api.query(expr):
            node = self.nodes.get(sample["metric"].get("instance"))
            if node is not None:
                yield node, sample["metric"], sample

    def _collectors(self) -> None:
        """A part whose collector is up starts known (empty); one that is down or absent stays unknown."""
        up: dict[str, dict[str | None, float]] = collections.defaultdict(dict)
        for node, labels, sample in self._node_samples(self.sel(COLLECTOR_UP.name)):
            up[node.name][labels.get("collector")] = _value(sample)
        for node in self.nodes.values():
            for collector, part in PARTS.items():
                if part == "interfaces":
                    continue
                state = up[node.name].get(collector)
                if state == 1:
                    setattr(node, part, [])
                else:
                    node.missing[part] = f"{collector} collector " + ("down" if state == 0 else "not running")
                    self.facts.notes.append(f"{node.name}: {node.missing[part]}")

    def _cpus(self) -> None:
        """Each node's logical CPUs: where CPU ranks outnumber them, the timing rules discount the wait for a CPU."""
        for node, _, sample in self._node_samples(self.sel(CPUS.name)):
            node.cpus = _int_or_none(_value(sample))

    def _gpu(self, node: NodeFacts, index: str | None) -> GpuFacts | None:
        if node.gpus is None or index is None:
            return None
        found = node.gpu(index=int(index))
        if found is None:
            found = GpuFacts(index=int(index), xid_errors={})
            node.gpus.append(found)
            node.gpus.sort(key=lambda gpu: gpu.index)
        return found

    def _gpus(self) -> None:
        for node, labels, sample in self._node_samples(self.sel("", f'__name__=~"{_GPU_SERIES}"')):
            name, value = labels["__name__"], _value(sample)
            if name == GPU_JOB.name:
                self.gpu_of_rank[node.name, _job(labels), labels.get("rank")] = (int(labels["gpu"]), labels.get("uuid"))
                continue
            gpu = self._gpu(node, labels.get("gpu"))
            if gpu is None:
                continue
            if name == GPU_INFO.name:
                gpu.uuid, gpu.model = labels.get("uuid"), labels.get("model")
            elif name == GPU_LOST.name:
                gpu.lost = value == 1
            elif name in (ROW_REMAP_PENDING.name, ROW_REMAP_FAILURE.name):
                setattr(gpu, "remap_pending" if name == ROW_REMAP_PENDING.name else "remap_failure", value == 1)
            elif name in (PCIE_LINK_GENERATION.name, PCIE_LINK_WIDTH.name):
                quantity = "generation" if name == PCIE_LINK_GENERATION.name else "width"
                field = f"pcie_{quantity}" if labels.get("kind") == "current" else f"pcie_max_{quantity}"
                setattr(gpu, field, int(value))
            else:
                setattr(gpu, _GPU_GAUGES[name], value)
        for node, labels, _ in self._node_samples(
                f"count by (instance, gpu) ({self.sel(CLOCK_EVENT_ACTIVE.name)})"):
            if (gpu := self._gpu(node, labels.get("gpu"))) is not None:
                gpu.clock_event_reasons = ()
        for node, labels, _ in self._node_samples(self.sel(CLOCK_EVENT_ACTIVE.name) + " == 1"):
            if (gpu := self._gpu(node, labels.get("gpu"))) is not None:
                gpu.clock_event_reasons = (*(gpu.clock_event_reasons or ()), labels["reason"])
        faults = self.sel("", f'__name__=~"{XID_ERRORS}_total|{ECC_VOLATILE_ERRORS}_total"') + " > 0"
        for node, labels, sample in self._node_samples(faults):
            gpu = self._gpu(node, labels.get("gpu"))
            if gpu is None:
                continue
            if labels["__name__"] == f"{XID_ERRORS}_total":
                assert gpu.xid_errors is not None, "_gpu makes each GPU with an empty xid_errors"
                gpu.xid_errors[labels["xid"]] = int(_value(sample))
            elif labels.get("error") == "uncorrected":
                gpu.ecc_uncorrected = int(_value(sample))
        for node in self.nodes.values():
            for gpu in node.gpus or ():
                gpu.ecc_uncorrected = gpu.ecc_uncorrected or 0

    def _nvlinks(self) -> None:
        links: dict[tuple[str, int], NvlinkFacts] = {}
        for node, labels, sample in self._node_samples(f"count by (instance, gpu) ({self.sel(LINK_UP.name)})"):
            if node.nvlinks is not None:
                links[node.name, int(labels["gpu"])] = link = NvlinkFacts(gpu=int(labels["gpu"]),
                                                                          links=int(_value(sample)))
                node.nvlinks.append(link)
        for node, labels, _ in self._node_samples(self.sel(LINK_UP.name) + " == 0"):
            if (entry := links.get((node.name, int(labels["gpu"])))) is not None:
                entry.down = tuple(sorted((*entry.down, int(labels["link"]))))
        speed = (f"sum by (instance, gpu) ({self.sel(LINK_SPEED.name)} "
                 f"* on (instance, gpu, link) {self.sel(LINK_UP.name)})")
        for node, labels, sample in self._node_samples(speed):
            if (entry := links.get((node.name, int(labels["gpu"])))) is not None:
                entry.up_speed_bytes_per_second = _value(sample)
        for node in self.nodes.values():
            if node.nvlinks is not None:
                node.nvlinks.sort(key=lambda entry: entry.gpu)

    def _interfaces(self) -> None:
        """Each node's network interfaces (state, loopback, addresses) and their link speeds; a node whose agent
        exports none (an older agent) keeps them unknown."""
        found: dict[tuple[str, str], InterfaceFacts] = {}
        speeds: dict[tuple[str, str], float] = {}
        series = "|".join(spec.name for spec in (NETWORK_INFO, NETWORK_SPEED))
        for node, labels, sample in self._node_samples(self.sel("", f'__name__=~"{series}"')):
            key = node.name, labels.get("interface", "")
            if labels["__name__"] == NETWORK_SPEED.name:
                speeds[key] = _value(sample)
                continue
            if node.interfaces is None:
                node.interfaces = []
                node.missing.pop("interfaces", None)
            found[key] = InterfaceFacts(name=key[1], up=labels.get("state") == "up",
                                        loopback=labels.get("loopback") == "true",
                                        addresses=tuple(labels.get("addresses", "").split()))
            node.interfaces.append(found[key])
        for key, speed in speeds.items():
            if key in found:
                found[key].speed_bytes_per_second = speed

    def _ib_ports(self) -> None:
        ports: dict[tuple[str, str, str], IbPortFacts] = {}

        def port(node: NodeFacts, labels: dict[str, str]) -> IbPortFacts | None:
            if node.ib_ports is None:
                return None
            key = (node.name, labels["device"], labels["port"])
            if key not in ports:
                ports[key] = IbPortFacts(device=labels["device"], port=int(labels["port"]), errors_increase={},
                                         window_seconds=_seconds(WINDOW))
                node.ib_ports.append(ports[key])
            return ports[key]

        models: dict[tuple[str, str], str | None] = {}
        for node, labels, sample in self._node_samples(self.sel("", f'__name__=~"{_IB_SERIES}"')):
            name, value = labels["__name__"], _value(sample)
            if name == DEVICE_INFO.name:
                models[node.name, labels["device"]] = hca_model(labels.get("board_id"), labels.get("hca_type"))
                continue
            if (entry := port(node, labels)) is None:
                continue
            entry.link_layer = labels.get("link_layer", entry.link_layer)
            if name == PORT_RATE.name:
                entry.rate_bytes_per_second = value
            elif name == PORT_STATE.name:
                entry.state = PORT_STATES.get(int(value), str(int(value)))
            elif name == PORT_PHYSICAL_STATE.name:
                entry.phys_state = PHYS_STATES.get(int(value), str(int(value)))
        for node, labels, sample in self._node_samples(
                f"increase({self.sel(f'{PORT_ERRORS}_total')}[{WINDOW}]) > 0"):
            if (entry := port(node, labels)) is not None:
                assert entry.errors_increase is not None, "port() makes each port with an empty errors_increase"
                entry.errors_increase[labels["counter"]] = _value(sample)
        for node in self.nodes.values():
            for entry in node.ib_ports or ():
                entry.hca = models.get((node.name, entry.device))
            if node.ib_ports is not None:
                node.ib_ports.sort(key=lambda entry: (entry.device, entry.port))

    def _ranks(self) -> None:
        series: dict[tuple[str, str], dict[str, Any]] = collections.defaultdict(dict)
        labels_of: dict[tuple[str, str], tuple[NodeFacts, dict[str, str]]] = {}
        # rank!="": not the agent's own row of the host collector's process CPU
        for node, labels, sample in self._node_samples(self.sel("", f'__name__=~"{_RANK_SERIES}", rank!=""')):
            key = (_job(labels), labels["rank"])
            name = labels["__name__"]
            if name == RANK_INFO.name:
                labels_of[key] = (node, labels)
            elif name == ENV_INFO.name:
                series[key].setdefault("env", {})[labels["name"]] = labels.get("value", "")
            elif name == MODEL_INFO.name:
                series[key]["workload"] = _workload(labels)
            elif name == CALLS.name:
                series[key].setdefault("collective_calls", {})[labels["group"]] = int(_value(sample))
            elif name in (_COLLECTIVE_COUNT, _COLLECTIVE_SUM, _COLLECTIVE_BYTES):
                series[key].setdefault("collectives", {}).setdefault(labels["op"], {})[name] = _value(sample)
            elif name == WINDOW_MEDIAN.name:
                series[key].setdefault("window_medians", {})[labels["timing"]] = _value(sample)
            elif name == UNAVAILABLE.name:
                series[key].setdefault("unavailable", {})[labels["signal"]] = labels["reason"]
            elif name == PHASE.name:
                series[key]["phase"] = labels["phase"]
            elif name == IN_FLIGHT.name:
                series[key]["in_flight"] = (labels["op"], labels["group"], int(_value(sample)))
            elif name == GROUP_INFO.name:
                series[key].setdefault("process_groups", {})[labels["group"]] = list(parse_members(labels["members"]))
            elif name == RAISED.name:
                series[key]["raised"] = (f"{labels['type']}: {labels['message']}", _value(sample))
            elif name == HELLO_TIME.name:  # its age by the engine's clock: the time the query was evaluated at
                series[key]["hello_age"] = max(0.0, float(sample["value"][0]) - _value(sample))
            elif name == CLOSED.name:  # likewise
                series[key]["closed_age"] = max(0.0, float(sample["value"][0]) - _value(sample))
            elif name == _PROCESS_CPU_TOTAL:
                series[key]["process"] = (int(labels["pid"]), _value(sample))
            else:
                series[key][name] = _value(sample)
                if name in _MEMORY_SERIES:
                    series[key]["memory_kind"] = labels.get("kind")
        for quantile in ("0.5", "0.99"):
            expr = f"histogram_quantile({quantile}, {self.sel(f'{LATENCY}_bucket')})"
            for _, labels, sample in self._node_samples(expr):
                ops = series[_job(labels), labels["rank"]].setdefault("collectives", {})
                ops.setdefault(labels["op"], {})[quantile] = _value(sample)
        histories = self._rss_histories()
        for key, (node, labels) in sorted(labels_of.items(), key=lambda item: (item[0][0], int(item[0][1]))):
            self.facts.ranks.append(self._rank(node, labels, series[key], histories.get(key)))

    def _bandwidth(self) -> None:
        """Each job's latest probe, as its agent exports it: the peak bus bandwidth per op (the message size of
        the peak is not exported)."""
        shapes: dict[tuple[str, str], dict[str, str]] = {}
        peaks: list[tuple[NodeFacts, dict[str, str], float]] = []
        for node, labels, sample in self._node_samples(
                self.sel("", f'__name__=~"{PROBE_BANDWIDTH}|{PROBE_INFO}"')):
            if labels["__name__"] == PROBE_INFO.name:
                shapes[node.name, _job(labels)] = labels
            else:
                peaks.append((node, labels, _value(sample)))
        measurements = []
        for node, labels, busbw in peaks:
            shape = shapes.get((node.name, _job(labels)), {})
            measurements.append(BandwidthMeasurement(
                node=node.name, interconnect=labels["interconnect"], op=labels["op"], size_bytes=None,
                busbw_bytes_per_second=busbw, ranks=_int(shape.get("world_size")), job=_job(labels),
                ranks_per_node=_int(shape.get("ranks_per_node"))))
        self.facts.bandwidth = measurements or None

    def _rss_histories(self) -> dict[tuple[str, str], History]:
        """Host RSS per step over ``HISTORY``: two subqueries at one resolution, so their timestamps align."""
        rss = self.sel(MEMORY_PEAK.name, 'kind="host_rss"')
        steps_at: dict[tuple[str, str], dict[float, float]] = {}
        query = f"({self.sel(LAST_STEP.name)} and on ({_RANK_KEY}) {rss})[{HISTORY}]"
        for _, labels, sample in self._node_samples(query):
            steps_at[_job(labels), labels["rank"]] = {float(t): float(v) for t, v in sample["values"]}
        histories = {}
        for _, labels, sample in self._node_samples(f"{rss}[{HISTORY}]"):
            key = (_job(labels), labels["rank"])
            steps = steps_at.get(key, {})
            # One point per step: a step slower than the resolution is sampled more than once.
            per_step = {int(steps[float(t)]): float(v) for t, v in sample["values"] if float(t) in steps}
            histories[key] = History(host_rss_bytes=sorted(per_step.items()))
        return histories

    def _rank(self, node: NodeFacts, labels: dict[str, str], values: dict[str, Any],
              history: History | None) -> RankFacts:
        job, rank = _job(labels), int(labels["rank"])
        outside = tuple(filter(None, labels.get("unavailable_from_outside", "").split(",")))
        layout = None if "layout" in outside else Layout(
            world_size=int(labels["world_size"]), tp_size=int(labels["tp_size"]), pp_size=int(labels["pp_size"]),
            dp_size=int(labels["dp_size"]), tp_rank=int(labels["tp_rank"]), pp_stage=int(labels["pp_stage"]),
            dp_rank=int(labels["dp_rank"]), local_rank=_int(labels.get("local_rank")),
            schedule=labels.get("schedule") or None, micro_batches=_int(labels.get("micro_batches")),
            virtual_stages=_int(labels.get("virtual_stages")), precision=labels.get("precision") or None)
        last_step = values.get(LAST_STEP.name)
        last = None
        if last_step is not None:
            last = StepFacts(step=int(last_step), memory_kind=values.get("memory_kind"),
                             collective_calls=values.get("collective_calls"),
                             **{field: values.get(name) for name, field in _STEP_GAUGES.items()})
        collectives = {
            op: CollectiveFacts(op=op, count=int(stats.get(_COLLECTIVE_COUNT, 0)),
                                seconds=stats.get(_COLLECTIVE_SUM, 0.0), bytes=stats.get(_COLLECTIVE_BYTES),
                                p50_seconds=_finite_or_none(stats.get("0.5")),
                                p99_seconds=_finite_or_none(stats.get("0.99")))
            for op, stats in values.get("collectives", {}).items()}
        gpu_index, gpu_uuid = self.gpu_of_rank.get((node.name, job, labels["rank"]), (None, None))

        def sampled(name: str) -> Sampled | None:
            value = values.get(name)
            return None if value is None else Sampled(value=value, as_of_step=_int_or_none(last_step))

        backend = labels.get("backend")
        # Each an int or None, by field name: Any, as mypy cannot match ** keys to RankFacts' own fields.
        counters: dict[str, Any] = {field: _int_or_none(values.get(name)) for name, field in _RANK_COUNTERS.items()}
        return RankFacts(
            job=job, rank=rank, node=node.name, layout=layout, gpu_index=gpu_index, gpu_uuid=gpu_uuid,
            env=values.get("env"), process_groups=values.get("process_groups"),
            backends={"default": backend} if backend else None,
            faults=tuple(filter(None, labels.get("faults", "").split(","))), unavailable_from_outside=outside,
            hello_age_seconds=values.get("hello_age"), last=last, workload=values.get("workload"),
            window=_window(values), unavailable=values.get("unavailable"),
            collectives=collectives or None, param_checksum=sampled(CHECKSUM.name),
            grad_cosine=sampled(COSINE.name), history=history,
            progress=_progress(values, int(labels["world_size"]), last), exited_at=values.get(EXITED.name),
            after_close=after_close(values.get("closed_age"), values.get(CLOSED_CPU.name), values.get("process"),
                                    EXITED.name in values), **counters)


def _progress(values: dict[str, Any], world_size: int, last: StepFacts | None) -> ProgressFacts | None:
    """An overdue rank's progress as its agent exports it: no stack and no overdue mark (the rules' own stall
    threshold decides), the error of a step that raised with the time it was sent, and the in-flight group's
    members from the exported process groups (`gpuwatch_train_process_group_info`; "default" the world). A group
    whose members were too many to export has none, and the rules fall back to who is stuck outside any
    collective."""
    stalled = values.get(STALLED.name)
    if stalled is None or "phase" not in values:
        return None
    in_flight = None
    if "in_flight" in values:
        op, group, seq = values["in_flight"]
        in_flight = InFlightFacts(op=op, group=group, members=group_members(values.get("process_groups"), world_size,
                                                                            group), seq=seq, seconds=stalled)
    error, raised_at = values.get("raised", (None, None))
    return ProgressFacts(step=last.step if last is not None else 0, phase=values["phase"], stalled_seconds=stalled,
                         overdue_seconds=0.0, collective=in_flight, error=error, time=raised_at)


def _workload(labels: dict[str, str]) -> Workload | None:
    """What a rank trains, from ``gpuwatch_train_model_info``'s labels (the hello's model block, each field a label,
    and its batch), converted by the record's own struct; None where the labels are not a model."""
    shape = {name: labels[name] for name in MODEL_INFO_FIELDS if labels.get(name, "") != ""}
    try:
        model = msgspec.convert(shape, ModelShapeFields, strict=False)
        return Workload(model, int(labels["global_batch"]), int(labels["seq_len"]))
    except (msgspec.ValidationError, KeyError, ValueError):
        return None


def _window(values: dict[str, Any]) -> WindowSummary | None:
    """The rank's window as its agent summarised it (``window.summarize``), read back through the exporter's
    own table of series, so the Prometheus source judges the very figures the agent source does."""
    figures = {spec.field: values[spec.name] for spec in WINDOW_GAUGES if spec.name in values}
    if "steps" not in figures:
        return None
    medians = dict(values.get("window_medians", {}))
    if (bubble := figures.pop("bubble_ratio", None)) is not None:
        medians["bubble_ratio"] = bubble
    counts: dict[str, int] = {field: int(figures[field])
                              for field in ("steps", "first_step", "last_step", "loss_steps", "grad_norm_steps",
                                            "checksums", "distinct_checksums")
                              if field in figures}
    fields: dict[str, Any] = {**figures, **counts, "medians": medians}  # counts as ints over their float gauges
    return WindowSummary(**fields)


def _job(labels: dict[str, str]) -> str:
    """The training job: ``exported_job`` when Prometheus renamed the series' own ``job`` label."""
    return labels.get("exported_job") or labels.get("job", "")


def _seconds(duration: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(duration[:-1]) * units[duration[-1]]


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _int_or_none(value: float | None) -> int | None:
    return int(value) if value is not None and math.isfinite(value) else None
