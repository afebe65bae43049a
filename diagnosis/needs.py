"""The facts rules declare they need. Each check returns None when the facts are there, else why they are
not, in words a user can act on; a rule with an unmet need is reported as not run with that reason."""

from __future__ import annotations

from collections.abc import Callable

from gpuwatch.agent.telemetry.window import BUSY as BUSY_SECONDS
from gpuwatch.agent.telemetry.window import MIN_WINDOW_STEPS, PHASE_TIMINGS
from gpuwatch.diagnosis.facts import RATED_BY, Facts, RankFacts, describe_ranks, group_by, may_use_nccl
from gpuwatch.diagnosis.registry import Need
from gpuwatch.protocol.schema import UNAVAILABLE_FROM_OUTSIDE, UNAVAILABLE_REASONS


def _node_part(part: str, what: str) -> Need:
    """A part of the node facts (``gpus``, ``ib_ports`` ...) known on at least one node."""

    def available(facts: Facts) -> str | None:
        if any(getattr(node, part) is not None for node in facts.nodes.values()):
            return None
        if not facts.nodes:
            return f"no node facts ({what} unknown): use --agent, --prometheus or run on the node"
        reasons = sorted({f"{node.name}: {node.missing[part]}" for node in facts.nodes.values()
                          if part in node.missing})
        return f"{what} unknown" + (f" ({'; '.join(reasons)})" if reasons else "")

    return Need(what, available)


def _rank_fact(what: str, present: Callable[[RankFacts], bool], hint: str, signal: str | None = None,
               outside: str | None = None) -> Need:
    """A per-rank fact present on at least one rank. For a ``signal`` the ranks may report unavailable
    (``schema.UNAVAILABLE_SIGNALS``), the reason they gave is the reason the rule could not run; for one a rank
    measured from outside cannot see (``outside``, in ``schema.UNAVAILABLE_FROM_OUTSIDE``), the hello said so."""

    def available(facts: Facts) -> str | None:
        if not facts.ranks:
            return "no training telemetry (no rank has reported): use --agent, --run-log or --prometheus"
        if any(present(rank) for rank in facts.ranks):
            return None
        said = [rank for rank in facts.ranks if signal is not None and signal in (rank.unavailable or {})]
        if said:
            return f"no {what}: " + "; ".join(
                f"{describe_ranks(ranks)} of job {job} reported it unavailable: "
                f"{UNAVAILABLE_REASONS.get(reason, reason)}"
                for (job, reason), ranks in group_by(said, lambda r: (r.job, r.unavailable[signal])))
        if outside is not None and (blind := [r for r in facts.ranks if outside in r.unavailable_from_outside]):
            return f"no {what}: " + "; ".join(
                f"{describe_ranks(ranks)} of job {job} measured from outside (gpuwatch run), where "
                f"{UNAVAILABLE_FROM_OUTSIDE[outside]}" for job, ranks in group_by(blind, lambda r: r.job))
        return f"no {what}: {hint}"

    return Need(what, available)


def _windowed(timing: str) -> Callable[[RankFacts], bool]:
    """A rank whose window holds enough steps to judge ``timing`` by its median."""
    return lambda r: r.window is not None and r.window.steps >= MIN_WINDOW_STEPS and timing in r.window.medians


def _env_available(facts: Facts) -> str | None:
    if any(rank.env is not None for rank in facts.ranks) or any(n.env is not None for n in facts.nodes.values()):
        return None
    return ("no NCCL environment: no rank hello carries one (Prometheus series do not) and --preflight "
            "was not given")


#: Why a probed path cannot be judged against a rating (see ``facts.RATED_BY`` for those that can).
UNRATED_PATHS = {
    "loopback": "a single-node gloo probe moves data through this host's loopback and memory, which have no "
                "link rating",
    "socket": "TCP sockets reach a share of the NIC rate that the kernel and CPUs set, not the link",
    "pcie": "PCIe peer traffic crosses switches and the CPU root complex, so its achievable share of the link "
            "rate depends on the platform",
    "unknown": "the probe could not tell which interconnect carried its traffic",
}


def _bandwidth_available(facts: Facts) -> str | None:
    """A probe of a rated path (NVLink, InfiniBand, RoCE) whose node's link facts are known."""
    if not facts.bandwidth:
        return ("no interconnect bandwidth measurement: run gpuwatch probe (it reports to the node's agent and "
                "to --run-log)")
    rated = [m for m in facts.bandwidth if m.interconnect in RATED_BY]
    if not rated:
        paths = sorted({m.interconnect for m in facts.bandwidth})
        return "; ".join(f"the probe measured {path}: {UNRATED_PATHS.get(path, 'it has no known rating')}"
                         for path in paths)
    for measurement in rated:
        node = facts.nodes.get(measurement.node)
        if node is not None and getattr(node, RATED_BY[measurement.interconnect]) is not None:
            return None
    nodes = ", ".join(sorted({m.node for m in rated}))
    return (f"rated link speed unknown: no NVLink/port facts of the probed node(s) {nodes} (add --agent, or "
            "diagnose on the node)")


def _nccl_jobs(across_nodes: bool) -> Need:
    """A job the NCCL rules can judge: one that may use NCCL (its hellos name the backends) and, with
    ``across_nodes``, runs on more than one node; or a pre-flight shell, which before launch may start anything."""

    def available(facts: Facts) -> str | None:
        jobs = facts.jobs()
        if not jobs or any(node.env is not None for node in facts.nodes.values()):
            return None
        reasons = []
        for job, ranks in jobs.items():
            if not may_use_nccl(ranks):
                backends = sorted({b for r in ranks for b in (r.backends or {}).values()})
                reasons.append(f"job {job} uses {', '.join(backends)}, not NCCL")
            elif not across_nodes or facts.spans_nodes(job):
                return None
            else:
                reasons.append(f"job {job} runs on one node ({ranks[0].host}), and NCCL uses InfiniBand, RoCE "
                               "and its socket interface only between nodes")
        return "; ".join(reasons)

    return Need("a job that uses NCCL" + (" across nodes" if across_nodes else ""), available)


def _has_cuda_memory(rank: RankFacts) -> bool:
    return rank.last is not None and rank.last.memory_kind == "cuda"


def _capacity_available(facts: Facts) -> str | None:
    cuda = [rank for rank in facts.ranks if _has_cuda_memory(rank)]
    if not cuda:
        return CUDA_MEMORY.available(facts) or "no CUDA memory figures"
    if any(rank.ooms for rank in cuda):
        return None
    for rank in cuda:
        gpu = facts.gpu_of(rank)
        if gpu is not None and gpu.memory_total_bytes is not None:
            return None
    return "GPU memory capacity unknown: the ranks' GPUs are not among the known nodes' GPUs (needs NVML facts)"


def _pipeline_available(facts: Facts) -> str | None:
    """Measured bubble or micro-batch count wherever a pipeline exists; no pipeline is nothing to judge."""
    piped = [(r, r.layout) for r in facts.ranks if r.layout is not None and r.layout.pp_size > 1]
    if any(layout.micro_batches is not None or (r.last is not None and r.last.bubble_ratio is not None)
           for r, layout in piped) or not piped:
        return LAYOUT.available(facts)
    return "pipeline ranks report neither a measured bubble nor micro_batches"


ENV = Need("NCCL environment", _env_available)
NCCL_JOB = _nccl_jobs(across_nodes=False)
NCCL_ACROSS_NODES = _nccl_jobs(across_nodes=True)
GPUS = _node_part("gpus", "GPU facts (NVML)")
NVLINKS = _node_part("nvlinks", "NVLink facts")
IB_PORTS = _node_part("ib_ports", "InfiniBand/RoCE port facts")
INTERFACES = _node_part("interfaces", "network interfaces")
TELEMETRY = _rank_fact("training telemetry", lambda r: True, "no rank has reported")
LAYOUT = _rank_fact("parallel layout (which ranks are peers doing the same work)", lambda r: r.layout is not None,
                    "no rank's hello reached the source", outside="layout")
_FEW_STEPS = (f"or fewer than {MIN_WINDOW_STEPS} steps in every rank's window (one step is too noisy a sample "
              "to judge)")
COMPUTE = _rank_fact("compute time over a window", _windowed("compute_seconds"),
                     f"step records lack compute_seconds, {_FEW_STEPS}")
BUSY = _rank_fact("busy time (the step's phases) over a window", _windowed(BUSY_SECONDS),
                  f"step records lack every phase ({', '.join(PHASE_TIMINGS)}), {_FEW_STEPS}")
DATALOADER = _rank_fact("data-loader wait over a window", _windowed("dataloader_wait_seconds"),
                        f"step records lack dataloader_wait_seconds, {_FEW_STEPS}")
EXPOSED_COLLECTIVES = _rank_fact("exposed collective time over a window",
                                 _windowed("exposed_collective_seconds"),
                                 f"step records lack exposed_collective_seconds, {_FEW_STEPS}")
STEP_TIME = _rank_fact("step time over a window", _windowed("step_seconds"), f"no step records, {_FEW_STEPS}")
WORKLOAD = _rank_fact("the model's shape and batch", lambda r: r.workload is not None and r.layout is not None,
                      "no hello carries the model's shape, global batch and sequence length (the reference "
                      "trainer's do, and gpuwatch run's where it can read the model and the job's layout: its "
                      "hello's notes say what it could not)")
PIPELINE = Need("pipeline bubble or micro-batches", _pipeline_available)
COLLECTIVES = _rank_fact("collective timings", lambda r: bool(r.collectives), "step records lack collectives",
                         outside="ddp_bucket_latency")
CUDA_MEMORY = _rank_fact("CUDA allocator figures", _has_cuda_memory,
                         "step records carry no CUDA memory (CPU ranks report host RSS only)")
GPU_CAPACITY = Need("GPU memory capacity", _capacity_available)
RSS_HISTORY = _rank_fact("host RSS history", lambda r: r.history is not None and len(r.history.host_rss_bytes) > 1,
                         "needs host_rss memory readings over the steps, from a run log or Prometheus (one "
                         "snapshot cannot show growth)")
LOSS = _rank_fact("loss", lambda r: (r.last is not None and r.last.loss is not None)
                  or (r.history is not None and bool(r.history.loss)),
                  "step records lack loss")
GRAD_NORM = _rank_fact("gradient norm", lambda r: (r.last is not None and r.last.grad_norm is not None)
                       or (r.history is not None and bool(r.history.grad_norm)), "step records lack grad_norm",
                       signal="grad_norm", outside="gradients")
LEARNING = _rank_fact("loss, gradient norm or checksums over a window",
                      lambda r: r.window is not None and r.window.steps >= MIN_WINDOW_STEPS
                      and (r.window.loss_steps > 1 or r.window.grad_norm_steps > 0 or r.window.checksums > 1),
                      f"step records lack loss, grad_norm and param_checksum, {_FEW_STEPS}")
CHECKSUM = _rank_fact("parameter checksums", lambda r: r.param_checksum is not None,
                      "step records lack param_checksum", signal="param_checksum",
                      outside="gradients")
COSINE = _rank_fact("gradient cosine similarity", lambda r: r.grad_cosine is not None,
                    "step records lack grad_cosine_similarity", signal="grad_cosine_similarity",
                    outside="gradients")
PROCESS_GROUPS = _rank_fact("process-group membership",
                            lambda r: r.process_groups is not None and {"pp", "dp"} <= r.process_groups.keys(),
                            "hellos lack process_groups with 'pp' and 'dp' members (Prometheus has none of a group "
                            "too large to export)")
HOSTS = _rank_fact("rank placement", lambda r: r.layout is not None and r.host is not None,
                   "hellos lack the rank's hostname")
BANDWIDTH = Need("interconnect bandwidth measurement", _bandwidth_available)
