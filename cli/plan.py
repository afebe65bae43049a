"""``gpuwatch plan``: the planner's command, which may also take the cluster from the node agents (``--agent URL``).

In the CLI's floor, not the planner's: reading an agent's /api/v1/state is diagnosis's agent source, and the planner,
which diagnosis imports, may import neither it nor the agent. The flags and the planning itself are the planner's
(``plan.cli.plan_options``, ``run_plan``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import click

from gpuwatch.plan.cli import OneLineCommand, fail, plan_options, run_plan
from gpuwatch.plan.gpus import preset_for


@dataclass(frozen=True)
class AgentGpus:
    """What the agents' nodes hold, as the planner takes a cluster: GPUs in all, the most on one node, the preset."""

    gpus: int
    gpus_per_node: int
    preset: str
    models: tuple[str, ...]


def agent_gpus(urls: tuple[str, ...], gpu: str | None = None) -> AgentGpus:
    """The GPUs of the agents' nodes (lost ones left out), from their NVML readings, with the preset of their model
    unless ``gpu`` names one; ValueError, one line, where an agent cannot be read or sees no GPU, or, without ``gpu``,
    the nodes' GPUs differ or match no preset."""
    from gpuwatch.diagnosis.sources import SourceError
    from gpuwatch.diagnosis.sources.agent import fetch

    per_node: dict[str, int] = {}
    models: Counter[tuple[str, float | None]] = Counter()
    for url in urls:
        try:
            facts = fetch(url)
        except SourceError as error:
            raise ValueError(str(error)) from None
        for name, node in facts.nodes.items():
            if node.gpus is None:
                raise ValueError(f"the agent at {url} reads no GPU on {name}: "
                                 f"{node.missing.get('gpus', 'no NVML readings')}; give --gpus and --gpu")
            present = [(gpu.model, gpu.memory_total_bytes) for gpu in node.gpus
                       if not gpu.lost and gpu.model is not None]
            if not present:
                raise ValueError(f"the agent at {url} sees no working GPU on {name}; give --gpus and --gpu")
            per_node[name] = len(present)
            models.update(present)
    names = tuple(sorted({model for model, _ in models}))
    if gpu is not None:
        return AgentGpus(sum(per_node.values()), max(per_node.values()), gpu, names)
    if len(names) > 1:
        raise ValueError(f"the agents' nodes hold different GPUs ({', '.join(names)}): plan for one kind with --gpu")
    (model, memory), _ = models.most_common(1)[0]
    spec = preset_for(model, memory)
    if spec is None:
        raise ValueError(f"no preset matches the agents' GPU {model!r}: give --gpu (one of the presets) or "
                         "--calibration")
    return AgentGpus(sum(per_node.values()), max(per_node.values()), spec.name, names)


@click.command(cls=OneLineCommand)
@plan_options
@click.option("--agent", "agents", multiple=True, metavar="URL",
              help="Take the GPUs from node agents (repeat it for every node of the job): their count, the most on "
                   "one node and the preset of their model; --gpus, --gpus-per-node and --gpu, where given, win.")
def plan(agents: tuple[str, ...], gpus: int | None, gpus_per_node: int | None, gpu: str | None,
         **options: Any) -> None:
    """Which tp × cp × pp × dp layout (micro-batches, schedule and virtual stages, recomputation, ZeRO-1) a model should
    run with: every feasible one ranked by predicted step time, with the heaviest rank's memory, the bubble, the
    traffic per group and MFU; every rejected one with its reason (docs/plan.md). Example: gpuwatch plan --model
    config.json --gpus 64 --gpus-per-node 8 --gpu h100-80gb --global-batch 512 --seq-len 4096; or --agent URL in
    place of the GPU flags."""
    if agents:
        try:
            found = agent_gpus(agents, gpu)
        except ValueError as error:
            fail(str(error))
        gpus, gpus_per_node, gpu = gpus or found.gpus, gpus_per_node or found.gpus_per_node, found.preset
        click.echo(f"gpuwatch plan: {found.gpus} GPUs ({', '.join(found.models)}), at most {found.gpus_per_node} "
                   f"a node, from {len(agents)} agent(s): planned for {gpus} × {gpu}, {gpus_per_node} a node",
                   err=True)
    run_plan(gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, **options)
