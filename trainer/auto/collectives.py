"""Which of torch's entry points are collectives, read from the installed torch rather than a hand list, and the
routing of the functional ones through `gpuwatch run`'s hooks.

Two kinds:

* `torch.distributed`'s Python functions (`collective_functions`): every public function that takes `async_op`,
  whatever its entry point, and the point-to-point calls; the AutoMonitor wraps each.
* PyTorch's functional collectives (`functional_collective_ops`), which DTensor, tensor and sequence parallelism
  (`parallelize_module`) and `torch.distributed._functional_collectives` communicate through.

A functional collective is a dispatcher op (`torch.ops._c10d_functional.all_reduce`, `all_gather_into_tensor`,
`reduce_scatter_tensor`, `all_to_all_single`, their coalesced and in-place forms, the autograd-aware
`torch.ops._c10d_functional_autograd.*`) that launches the collective and returns its output at once; the training
thread waits for it in `torch.ops._c10d_functional.wait_tensor`, called on that output (by the
`AsyncCollectiveTensor` it is wrapped in, at its first use: https://pytorch.org/docs/stable/distributed.tensor.html
and the module docstring of torch/distributed/_functional_collectives.py). None of them goes through
`distributed_c10d`'s Python functions or `Work.wait`.

Every call from Python reaches these ops through one object per op, its `OpOverloadPacket`, looked up on the
namespace at each call. `time_functional_collectives` gives each of those objects a subclass whose `__call__` runs
the caller's hooks first: the objects stay the ones torch made, so their `.default` overloads (which torch's own
tables key on) and every `isinstance` check stay as they were. While torch.compile traces, the hooks step aside: a
compiled graph calls the ops itself. A functional op called from C++ (the backward of the
`_c10d_functional_autograd` ops) does not pass through Python and is not seen.

tests/test_gpuwatch_run.py fails when a function or op of either kind counts as no collective.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch._ops import OpOverloadPacket

#: The ops a collective's name starts with (schema.COLLECTIVE_OPS), longest first: `reduce_scatter_tensor` is a
#: reduce-scatter, not a reduce.
_OPS_BY_PREFIX = ("reduce_scatter", "all_reduce", "all_gather", "all_to_all", "broadcast", "barrier", "reduce",
                  "gather", "scatter")
#: torch.distributed's point-to-point calls, which take no `async_op`: `isend`/`irecv` return a Work to wait for.
POINT_TO_POINT: Mapping[str, str] = {"send": "send", "recv": "recv", "isend": "send", "irecv": "recv"}
ASYNCHRONOUS_POINT_TO_POINT = frozenset({"isend", "irecv"})
def op_of(name: str) -> str | None:
    """The op (schema.COLLECTIVE_OPS) a torch.distributed function's name counts as, None for no collective."""
    if name in POINT_TO_POINT:
        return POINT_TO_POINT[name]
    return next((op for op in _OPS_BY_PREFIX if name == op or name.startswith(op + "_")), None)


def takes_async_op(function: object) -> bool:
    """Whether `function` takes `async_op`: what every collective of torch.distributed has in common."""
    try:
        return callable(function) and "async_op" in inspect.signature(function).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def collective_functions(module: ModuleType = dist.distributed_c10d) -> dict[str, str]:
    """Every collective the installed torch.distributed exports, by name, with the op it counts as: its public
    functions that take `async_op`, whatever their entry point, and the point-to-point calls. A function of that
    kind whose name fits no op is left out here: tests/test_gpuwatch_run.py fails on it."""
    names = [name for name in dir(module) if not name.startswith("_") and takes_async_op(getattr(module, name))]
    names += [name for name in POINT_TO_POINT if callable(getattr(module, name, None))]
    return {name: op for name in names if (op := op_of(name)) is not None}


#: The dispatcher namespaces of PyTorch's functional collectives.
NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
#: The op the training thread waits in; every other public op of NAMESPACES launches a collective.
WAIT = "wait_tensor"
#: Ops of NAMESPACES whose names fit no collective op by prefix: `batch_p2p_ops` launches a list of sends and
#: receives at once (counted as a send: the bytes it is handed are the ones it moves).
IRREGULAR: Mapping[str, str] = {"batch_p2p_ops": "send"}

#: Handles a call of a launching op: (the schema op it counts as, its process group's name where it takes one, its
#: arguments, keywords, the call itself).
Launch = Callable[[str, "str | None", tuple, dict, Callable[..., Any]], Any]
#: Handles a call of `wait_tensor`: (its arguments, keywords, the call itself).
Wait = Callable[[tuple, dict, Callable[..., Any]], Any]


def functional_collective_ops(names: list[str] | None = None) -> dict[tuple[str, str], str | None]:
    """Every public op of NAMESPACES the dispatcher knows, by (namespace, name), with the schema op it counts as
    (schema.COLLECTIVE_OPS), None for `wait_tensor` and for an op that fits none (which the test refuses)."""
    names = names if names is not None else torch._C._dispatch_get_all_op_names()
    ops: dict[tuple[str, str], str | None] = {}
    for qualified in names:
        namespace, _, name = qualified.partition("::")
        if namespace in NAMESPACES and not name.startswith("_"):
            ops[namespace, name] = None if name == WAIT else IRREGULAR.get(name) or op_of(name)
    return ops


def group_name_position(packet: OpOverloadPacket) -> int | None:
    """Where an op takes its process group's name (`group_name`) among its positional arguments."""
    arguments = [argument.name for argument in packet.default._schema.arguments]
    return arguments.index("group_name") if "group_name" in arguments else None


class _Timed(OpOverloadPacket):
    """An op's packet whose calls go through its `_gpuwatch_call` first (set by `time_functional_collectives`)."""

    _gpuwatch_call: Callable[..., Any]

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return OpOverloadPacket.__call__(self, *args, **kwargs)
        return self._gpuwatch_call(*args, **kwargs)


def time_functional_collectives(launch: Launch, wait: Wait) -> list[str]:
    """Route every functional collective op through `launch` and `wait_tensor` through `wait`; the ops routed, by
    qualified name. An op whose packet cannot be had (not loaded in this build) is left alone."""
    routed: list[str] = []
    for (namespace, name), op in functional_collective_ops().items():
        if op is None and name != WAIT:
            continue
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if not isinstance(packet, OpOverloadPacket) or isinstance(packet, _Timed):
            continue
        call = OpOverloadPacket.__call__.__get__(packet)
        if op is None:
            packet._gpuwatch_call = _bind_wait(wait, call)  # type: ignore[attr-defined]
        else:
            packet._gpuwatch_call = _bind_launch(launch, op, group_name_position(packet), call)  # type: ignore[attr-defined]
        packet.__class__ = _Timed
        routed.append(f"{namespace}::{name}")
    return routed


def _bind_launch(launch: Launch, op: str, group_at: int | None, call: Callable[..., Any]) -> Callable[..., Any]:
    def launched(*args: Any, **kwargs: Any) -> Any:
        group_name = kwargs.get("group_name") if group_at is None or group_at >= len(args) else args[group_at]
        return launch(op, group_name, args, kwargs, call)

    return launched


def _bind_wait(wait: Wait, call: Callable[..., Any]) -> Callable[..., Any]:
    def waited(*args: Any, **kwargs: Any) -> Any:
        return wait(args, kwargs, call)

    return waited
