"""Telemetry from training ranks to the node agent: record schema, socket paths, per-rank store.

Shared by both sides: the agent's ``telemetry`` collector and the ranks'
``gpuwatch.trainer.telemetry`` client. Nothing here imports torch.
"""
