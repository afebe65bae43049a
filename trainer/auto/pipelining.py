"""A job's pipeline as `torch.distributed.pipelining` runs it, read from its schedule object by `gpuwatch run`.

A schedule (`ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`, the zero-bubble ones; all subclasses of
`_PipelineSchedule`: https://pytorch.org/docs/stable/distributed.pipelining.html) holds what the hello's pipeline
fields need: its class, its micro-batches (`_n_microbatches`), the stages it runs on this rank (`_stage`, or
`_stages` for the schedules with several stages a rank) and through them the pipeline's stage count, this rank's
place and its process group (`num_stages`, `stage_index`, `group`, `group_rank`, `group_size`). Torch's private
names: read with care (`read_schedule` returns None where they are not as expected), never written.

What the AutoMonitor wraps, on the classes that define them, so every schedule made before or after is seen:

* each schedule class's `step`: the window of the step's schedule on this rank (`hooks.pipeline.WindowClock`: its
  idle time is the rank's waits on the pipeline's sends and receives), and which micro-batch losses belong to it;
* `_PipelineSchedule._compute_loss`: each micro-batch's loss on the last stage, as the schedule computes it. The
  step's loss is their mean, as torchtitan logs it (its `losses` list, averaged) and as the schedule's gradients are
  scaled (`scale_grads`: divided by the micro-batches).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from gpuwatch.plan.compute import schedule_bubble

#: torch.distributed.pipelining's module of schedules, where the classes patched are defined.
SCHEDULES_MODULE = "torch.distributed.pipelining.schedules"
#: The hello's `schedule` of each of torch's schedule classes; another class (a user's own schedule) is named by its
#: class name, lowercased.
SCHEDULE_LABELS: Mapping[str, str] = {
    "ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b", "ScheduleInterleaved1F1B": "interleaved_1f1b",
    "ScheduleLoopedBFS": "looped_bfs", "ScheduleInterleavedZeroBubble": "interleaved_zero_bubble",
    "ScheduleZBVZeroBubble": "zbv_zero_bubble", "ScheduleDualPipeV": "dualpipev",
}
#: The most module names a hello's `stage_modules` carries (schema).
MAX_STAGE_MODULES = 64


@dataclass(frozen=True)
class PipelineShape:
    """This rank's part of a pipeline, as its schedule says."""

    schedule: str  # the hello's label (SCHEDULE_LABELS)
    stages: int  # stages in the whole pipeline, virtual ones included
    ranks: int  # ranks the pipeline runs on: its process group's size
    rank: int  # this rank's place in that group: its pipeline stage in the hello's sense
    micro_batches: int
    virtual_stages: int  # stages this rank runs (2 for an interleaved schedule with 2 stages a rank)
    group: Any  # the stages' ProcessGroup (None: the default group)
    modules: tuple[str, ...]  # the modules this rank's stages hold

    @property
    def bubble_theoretical(self) -> float | None:
        """The share of the step a balanced pipeline of this shape idles, per schedule (`plan.compute.schedule_bubble`
        gives each formula and its source); None where the schedule's is not modelled."""
        return schedule_bubble(self.schedule, self.ranks, self.micro_batches, self.virtual_stages)


def read_schedule(schedule: Any) -> PipelineShape | None:
    """The pipeline a schedule object runs, or None where its attributes are not torch's as this module knows them."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    micro_batches = getattr(schedule, "_n_microbatches", None)
    if not stages or any(stage is None for stage in stages) or not isinstance(micro_batches, int):
        return None
    first = stages[0]
    try:
        stage_count, ranks, rank = int(first.num_stages), int(first.group_size), int(first.group_rank)
    except (AttributeError, TypeError, ValueError):
        return None
    name = type(schedule).__name__
    modules = [name for stage in stages for name in module_names(getattr(stage, "submod", None))]
    return PipelineShape(schedule=SCHEDULE_LABELS.get(name, name.lower()), stages=stage_count, ranks=ranks,
                         rank=rank, micro_batches=micro_batches, virtual_stages=len(stages),
                         group=getattr(first, "group", None), modules=tuple(modules[:MAX_STAGE_MODULES]))


def module_names(module: nn.Module | None) -> Iterator[str]:
    """The modules a stage holds, by name: its children, and the members of a container child (torchtitan's
    `layers` ModuleDict, a ModuleList, a Sequential), which are the layers a user moves between stages."""
    if module is None:
        return
    for name, child in module.named_children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList, nn.Sequential)):
            yield from (f"{name}.{member}" for member, _ in child.named_children())
        else:
            yield name
