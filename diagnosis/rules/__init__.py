"""The rule catalogue: one module per family; importing this package registers every rule."""

from gpuwatch.diagnosis.rules import convergence, hangs, hardware, memory, nccl, performance, plan, topology

__all__ = ["convergence", "hangs", "hardware", "memory", "nccl", "performance", "plan", "topology"]
