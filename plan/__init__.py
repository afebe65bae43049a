"""``gpuwatch.plan``: which tensor × pipeline × data-parallel layout a model should run with on a cluster, predicted
from the model's shape, the GPUs' figures and the run's batch, before anything runs.

Torch-free and import-light, like the protocol: a planner is a few formulas over integers (docs/plan.md lists each
with its public source), and it runs wherever ``gpuwatch`` does, the agent's nodes and a laptop included.
"""
