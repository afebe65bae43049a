"""Model FLOPs per token, and model FLOPs utilisation (MFU) where the device's peak is known.

For a dense decoder-only transformer (PaLM, appendix B; nanoGPT's `estimate_mfu`), one token of
training costs

    6·N + 12·L·h·s   FLOPs

with N the parameters that take part in matrix multiplies (an embedding lookup does not), L layers,
h the model width and s the sequence length. 6·N: the forward pass does a multiply and an add per
parameter and token, the backward pass twice that. 12·L·h·s: attention's QKᵀ and AV products
(2·2·s·h per token and layer forward, three times that with the backward), which N does not hold;
counted over the full s×s square as PaLM does, although a causal mask could skip half of it.
These are the model's FLOPs, not the hardware's: recomputing activations does not raise them.

A rank's achieved model FLOP/s = its share of the FLOPs per token × the tokens it processed / step
time (with tensor and pipeline parallelism a rank does 1/(tp·pp) of its replica's FLOPs). MFU
divides that by the device's dense bf16 tensor-core peak (`PEAK_FLOPS`); on the CPU there is none.
"""

from __future__ import annotations

import torch

#: Dense (no sparsity) bf16 tensor-core peak FLOP/s from NVIDIA's data sheets, by a part of the name
#: torch.cuda.get_device_name reports, most specific first ("NVIDIA H100 80GB HBM3" is the SXM part).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835.5e12),
    ("H200", 989.5e12),
    ("H100 NVL", 835.5e12),
    ("H100 PCIE", 756.5e12),
    ("H100", 989.5e12),
    ("A100", 312e12),
)


def transformer_flops_per_token(matmul_params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token of a dense transformer: 6·N + 12·L·h·s (see the module docstring)."""
    return 6 * matmul_params + 12 * layers * hidden * seq_len


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOP/s, or None when it is not a GPU in `PEAK_FLOPS`."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    return next((peak for model, peak in PEAK_FLOPS if model in name), None)
