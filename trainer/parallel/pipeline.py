"""Pipeline parallelism: the forward and backward passes of one optimizer step over micro-batches.

Each stage runs its layers on a micro-batch, sends the activations to the next stage and, on the
way back, the input gradients to the previous one. Both schedules are one loop (as in
Megatron-LM's non-interleaved schedule), differing only in how many forward passes run before
the first backward:

    GPipe   warm-up = m               all m forwards, then all m backwards: m micro-batches of
                                      activations alive at once.
    1F1B    warm-up = pp - stage - 1  then one forward, one backward: at most pp - stage
                                      micro-batches alive, whatever m.

Both idle a stage for (pp - 1) / (m + pp - 1) of the step (the bubble); 1F1B saves memory, not time.

Neighbours exchange through comm.exchange, which posts each pair of transfers together: in the
steady state a stage sends its activation while receiving a gradient from the same neighbour, and
two blocking sends facing each other would hang. Compute (_forward, _backward) and communication
(_p2p) are separate methods, so what a stage spends busy and waiting can be measured apart: `run`
takes a `StageClock` (the hooks' PipelineClock is one), which times every pass as busy and closes the
stage's window when the schedule ends. The schedule knows only that small interface, not the hooks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.distributed import ProcessGroup

from gpuwatch.trainer.model import GPTStage
from gpuwatch.trainer.parallel import comm
from gpuwatch.trainer.parallel.groups import Grid


class StageClock(Protocol):
    """Times one stage's schedule: `start` before it, `busy` around every forward and backward pass, `stop`
    after it."""

    def start(self) -> None: ...

    def busy(self) -> AbstractContextManager[object]: ...

    def stop(self) -> None: ...


class _Untimed:
    """The schedule run without a clock."""

    def start(self) -> None:
        pass

    stop = start

    def busy(self) -> AbstractContextManager[object]:
        return nullcontext()


UNTIMED = _Untimed()


@dataclass(frozen=True)
class MicroBatch:
    inputs: torch.Tensor  # token ids, used by the first stage
    targets: torch.Tensor  # next tokens, used by the last stage


class Pipeline:
    """Runs this rank's stage through a schedule; `run` leaves the summed gradients in .grad."""

    def __init__(
        self,
        stage: GPTStage,
        grid: Grid,
        schedule: str,
        activation_shape: tuple[int, ...],
        device: torch.device,
        autocast: Callable[[], AbstractContextManager],
    ) -> None:
        self.stage, self.grid, self.schedule = stage, grid, schedule
        self.activation_shape, self.device, self.autocast = activation_shape, device, autocast
        #: what wraps every forward and backward pass, and the group the send/recv go over (the slow-rank and
        #: shared-pp-dp-group faults replace them: gpuwatch.trainer.faults)
        self.pace: Callable[[], AbstractContextManager] = nullcontext
        self.group: ProcessGroup = grid.pp_group
        self.losses: list[torch.Tensor] = []
        self.clock: StageClock = UNTIMED

    def run(
        self, batches: list[MicroBatch], loss_scale: float = 1.0, clock: StageClock = UNTIMED
    ) -> list[torch.Tensor]:
        """Forward and backward over all micro-batches; returns their losses (last stage, else empty).

        Each micro-batch's loss is divided by m (the step's loss is their mean) and multiplied by
        `loss_scale` (fp16) before the backward pass. `clock` measures the stage's bubble.
        """
        m = len(batches)
        warmup = m if self.schedule == "gpipe" else min(self.grid.pp - self.grid.pp_rank - 1, m)
        scale = loss_scale / m
        self.losses = []
        self.clock = clock
        clock.start()
        in_flight: deque[tuple[torch.Tensor | None, torch.Tensor]] = deque()

        for batch in batches[:warmup]:
            x = self._recv_forward()
            output = self._forward(x, batch, scale)
            self._send_forward(output)
            in_flight.append((x, output))

        x = self._recv_forward() if warmup < m else None
        for i in range(warmup, m):  # steady state: one forward, one backward
            output = self._forward(x, batches[i], scale)
            output_grad = self._send_forward_recv_backward(output)
            in_flight.append((x, output))
            input_grad = self._backward(*in_flight.popleft(), output_grad)
            if i == m - 1:
                self._send_backward(input_grad)
            else:
                x = self._send_backward_recv_forward(input_grad)

        for _ in range(warmup):  # cool-down: the backwards still owed
            output_grad = self._recv_backward()
            self._send_backward(self._backward(*in_flight.popleft(), output_grad))
        clock.stop()
        return self.losses

    # -- compute ------------------------------------------------------------------------------

    def _forward(self, x: torch.Tensor | None, batch: MicroBatch, scale: float) -> torch.Tensor:
        """The stage's output; on the last stage the scaled loss, whose unscaled value is recorded."""
        with self.clock.busy(), self.pace(), self.autocast():
            output = self.stage(batch.inputs if x is None else x)
            if not self.grid.is_last_stage:
                return output
            loss = self.stage.loss(output, batch.targets)
        self.losses.append(loss.detach())
        return loss * scale

    def _backward(
        self, x: torch.Tensor | None, output: torch.Tensor, output_grad: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Backpropagate through the stage; returns the gradient for the previous stage."""
        with self.clock.busy(), self.pace():
            torch.autograd.backward(output, grad_tensors=output_grad)
        return None if x is None else x.grad

    # -- communication ------------------------------------------------------------------------

    def _p2p(
        self,
        send_prev: torch.Tensor | None = None,
        send_next: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> dict[str, torch.Tensor]:
        """One batched exchange with the neighbour stages; returns what arrived, keyed "prev"/"next".
        Directions that do not exist (before the first stage, after the last) are skipped."""
        grid = self.grid
        send, recv, received = [], [], {}
        if not grid.is_first_stage:
            if send_prev is not None:
                send.append((send_prev.detach(), grid.prev_rank))
            if recv_prev:
                received["prev"] = torch.empty(self.activation_shape, device=self.device)
                recv.append((received["prev"], grid.prev_rank))
        if not grid.is_last_stage:
            if send_next is not None:
                send.append((send_next.detach(), grid.next_rank))
            if recv_next:
                received["next"] = torch.empty(self.activation_shape, device=self.device)
                recv.append((received["next"], grid.next_rank))
        comm.exchange(self.group, send=send, recv=recv)
        return received

    def _recv_forward(self) -> torch.Tensor | None:
        x = self._p2p(recv_prev=True).get("prev")
        return None if x is None else x.requires_grad_()

    def _send_forward(self, output: torch.Tensor) -> None:
        self._p2p(send_next=output)

    def _send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor | None:
        return self._p2p(send_next=output, recv_next=True).get("next")

    def _send_backward_recv_forward(self, input_grad: torch.Tensor | None) -> torch.Tensor | None:
        x = self._p2p(send_prev=input_grad, recv_prev=True).get("prev")
        return None if x is None else x.requires_grad_()

    def _recv_backward(self) -> torch.Tensor | None:
        return self._p2p(recv_next=True).get("next")

    def _send_backward(self, input_grad: torch.Tensor | None) -> None:
        self._p2p(send_prev=input_grad)
