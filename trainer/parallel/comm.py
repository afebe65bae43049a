"""Every collective and point-to-point transfer the trainer issues goes through these few functions.

One choke point keeps the traffic visible: a collective timer wraps these, not the call sites.
Calls on a group of one rank return at once, so the single-process run pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def all_reduce(tensor: torch.Tensor, group: ProcessGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce `tensor` in place across `group` and return it."""
    if dist.get_world_size(group) > 1:
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
    posting their receive hang on gloo (and on NCCL for large tensors).
    """
    ops = [dist.P2POp(dist.isend, tensor, peer, group) for tensor, peer in send]
    ops += [dist.P2POp(dist.irecv, tensor, peer, group) for tensor, peer in recv]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def barrier(group: ProcessGroup | None = None) -> None:
    """Wait until every rank of `group` (default: all ranks) gets here."""
    if dist.get_world_size(group) > 1:
        dist.barrier(group=group)
