"""Mixed precision: autocast for bf16 and fp16, and a dynamic loss scaler for fp16.

Parameters, optimizer state and the residual stream stay fp32; autocast runs matmuls in the low
precision. fp16's narrow range flushes small gradients to zero (the PyTorch AMP docs' reason for
gradient scaling: without a GradScaler the loss stops moving, or turns NaN), so fp16 multiplies the
loss by a scale S before backward, divides the gradients by S after the DP reduction, and skips the
step, halving S, when a gradient is inf or NaN. The verdict comes from the global gradient norm,
which every rank shares, so all ranks skip together: torch.amp.GradScaler looks only at its own
rank's gradients, and pipeline stages could then disagree.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=LOW_PRECISION[precision])


class DynamicLossScaler:
    """torch.amp.GradScaler's policy (start at 2^16, double after 2000 good steps, halve on overflow),
    decided from a norm all ranks agree on. Disabled, the scale stays 1 and every step is taken."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0

    def unscale(self, params: list[torch.nn.Parameter]) -> None:
        if self.enabled:
            for param in params:
                if param.grad is not None:
                    param.grad.div_(self.scale)

    def update(self, grads_finite: bool) -> bool:
        """Adjust the scale after a step's gradients are known; returns whether to take the step."""
        if not self.enabled:
            return True
        if not grads_finite:
            self.scale /= 2
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= 2
            self.good_steps = 0
        return True

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.good_steps = state["scale"], int(state["good_steps"])
