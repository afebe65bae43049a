"""The ``gpuwatch`` command line of the whole product (``main``): the agent, the trainer, the probe, diagnosis,
alerts, dashboards and the demo, each loaded only when invoked, so a node without torch runs the agent."""
