"""The agent's side of the ranks' telemetry, below the ``telemetry`` collector (``agent.collectors.telemetry``).

The socket (``listener``) and the thread that drains it (``receiver``); the per-rank store (``store``), each rank's
window of recent steps (``window``) and the watch on the ranks' processes (``exits``); what a sampling round reads
of the store (``rounds``); the exported families (``metrics``) and their per-rank lines (``series``). The ranks'
end is ``gpuwatch.trainer.telemetry``, the records' schema ``gpuwatch.protocol.schema``. Nothing here imports torch.
"""
