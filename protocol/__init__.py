"""What the training side and the agent agree on, importable by both without either's internals: the telemetry
record schema and its socket paths (``schema``, ``paths``) and which interconnect a collective's traffic takes
(``interconnect``), decided the same way by ``gpuwatch probe`` and by diagnosis."""
