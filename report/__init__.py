"""``gpuwatch report``: one self-contained HTML page of a job (findings first, every rank, its steps and phases) and
its Chrome/Perfetto trace. Data flows one way: gather (the diagnosis sources and engine) → model (typed) → render
(HTML) and trace (Trace Event Format JSON). docs/report.md."""
