"""Every collective and point-to-point transfer the trainer issues goes through these few functions.

One choke point keeps the traffic visible: the hooks' collective timer wraps these (`set_timer`),
not the call sites. Calls on a group of one rank return at once, so the single-process run pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

#: timer(op, nbytes, group) -> a context manager around one call on `group` (None: the default group); op is a
#: telemetry schema op name.
Timer = Callable[[str, int, ProcessGroup | None], AbstractContextManager]
_UNTIMED = nullcontext()
_timer: Timer | None = None


def set_timer(timer: Timer | None) -> None:
    """Time every call below with `timer` (gpuwatch.trainer.hooks.Monitor.collective); None stops timing."""
    global _timer
    _timer = timer


def _timed(op: str, tensors: Sequence[torch.Tensor], group: ProcessGroup | None) -> AbstractContextManager:
    if _timer is None:
        return _UNTIMED
    return _timer(op, sum(t.nbytes for t in tensors), group)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup,
               op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce `tensor` in place across `group` and return it."""
    if dist.get_world_size(group) > 1:
        with _timed("all_reduce", (tensor,), group):
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


def exchange(
    group: ProcessGroup,
    *,
    send: Sequence[tuple[torch.Tensor, int]] = (),
    recv: Sequence[tuple[torch.Tensor, int]] = (),
) -> None:
    """Post all sends and receives (tensor, global peer rank) together, then wait for all of them.

    Batching is what keeps neighbours from deadlocking: two ranks that each block in a send before
    posting their receive hang on gloo (and on NCCL for large tensors). Timed as one call: a "recv"
    when it receives anything (waiting for the peer's data is what takes the time), else a "send",
    with the bytes of every transfer in it.
    """
    ops = [dist.P2POp(dist.isend, tensor, peer, group) for tensor, peer in send]
    ops += [dist.P2POp(dist.irecv, tensor, peer, group) for tensor, peer in recv]
    if ops:
        with _timed("recv" if recv else "send", [tensor for tensor, _ in (*send, *recv)], group):
            for request in dist.batch_isend_irecv(ops):
                request.wait()


def barrier(group: ProcessGroup | None = None) -> None:
    """Wait until every rank of `group` (default: all ranks) gets here."""
    if dist.get_world_size(group) > 1:
        with _timed("barrier", (), group):
            dist.barrier(group=group)
