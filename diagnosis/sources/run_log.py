"""``--run-log PATH``: the JSONL run log the hooks write (one telemetry record per line, schema v1), for a
post-mortem after the job ended: one file, or a directory of them (``gpuwatch train --run-log DIR`` writes
one per rank, ``rank-NNNNN.jsonl``).

Every line is validated with the agent's own ``decode``; a bad line is reported (line number and reason) and skipped. A
run log may be read while its job still writes it: a last line without its newline that does not decode is a record
still being written, skipped and said so, not a bad line. Counters are accumulated by the agent's own
``TelemetryStore``, so a run log and a live agent count alike; the per-step history (loss, grad norm, host RSS, and
every step whole for ``gpuwatch report``'s views) is what only a log has.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from pathlib import Path

from gpuwatch.agent.snapshot import json_safe
from gpuwatch.agent.telemetry.readings import RankReadings
from gpuwatch.agent.telemetry.rounds import rank_readings
from gpuwatch.agent.telemetry.store import TelemetryStore
from gpuwatch.diagnosis.facts import Facts, History, SourceInfo, StepRow
from gpuwatch.diagnosis.sources import SourceError
from gpuwatch.diagnosis.sources.telemetry import bandwidth, rank_facts
from gpuwatch.protocol.records import Step, convert
from gpuwatch.protocol.schema import MAX_RANK, RecordRejected, decode

#: Steps of history kept per rank and series (the latest ones); bounds memory on very long runs.
HISTORY_LIMIT = 20_000
#: Bad lines quoted in the notes; the rest are counted.
MAX_QUOTED_BAD_LINES = 20


#: The History series of (step, value) the rules read; ``History.steps`` is kept beside them, whole rows.
SERIES = tuple(field.name for field in dataclasses.fields(History) if field.name != "steps")


class _Series:
    """The latest HISTORY_LIMIT points of every History series of one rank, and its steps whole."""

    def __init__(self) -> None:
        self.points: dict[str, collections.deque[tuple[int, float]]] = {
            name: collections.deque(maxlen=HISTORY_LIMIT) for name in SERIES}
        self.steps: collections.deque[StepRow] = collections.deque(maxlen=HISTORY_LIMIT)

    def history(self) -> History:
        return History(**{name: list(points) for name, points in self.points.items()}, steps=list(self.steps))


def _files(path: Path) -> list[Path]:
    if not path.is_dir():
        return [path]
    files = sorted(path.glob("*.jsonl"))
    if not files:
        raise SourceError(f"run log directory {path} holds no *.jsonl file")
    return files


def read(path: Path) -> Facts:
    store = TelemetryStore(ttl=float("inf"), max_ranks=MAX_RANK + 1, max_jobs=MAX_RANK + 1)
    series: dict[tuple[str, int], _Series] = collections.defaultdict(_Series)
    bad: list[str] = []
    writing: list[str] = []
    records = 0
    for file in _files(path):
        try:
            with open(file, "rb") as log:
                for number, raw in enumerate(log, 1):
                    line = raw.strip()
                    if not line:
                        continue
                    try:
                        record = decode(line)
                    except RecordRejected as rejected:
                        if raw.endswith(b"\n"):
                            bad.append(f"{file}:{number}: {rejected}")
                        else:  # only the file's last line can lack its newline
                            writing.append(f"{file}:{number}: the last line is still being written: skipped")
                        continue
                    store.ingest(line)
                    records += 1
                    if isinstance(record.body, Step):
                        _add(series[record.job, record.rank], record.body)
        except OSError as exc:
            raise SourceError(f"cannot read run log {file}: {exc.strerror or exc}") from None
    if not records:
        raise SourceError(f"{path} holds no valid telemetry record ({len(bad)} bad line(s)"
                          + (f", first: {bad[0]}" if bad else "") + ")")
    facts = Facts(sources=[SourceInfo("run_log", str(path))])
    facts.notes += writing + bad[:MAX_QUOTED_BAD_LINES]
    if len(bad) > MAX_QUOTED_BAD_LINES:
        facts.notes.append(f"{path}: ... and {len(bad) - MAX_QUOTED_BAD_LINES} more bad line(s)")
    ranks, _ = store.snapshot()
    for state in ranks:
        # The agent's state of the rank, as /api/v1/state writes it and the agent source reads it back.
        rank = convert(json_safe(rank_readings(state)), RankReadings)
        facts.ranks.append(rank_facts(rank, node=None, history=series[state.job, state.rank].history(), now=math.inf))
    facts.bandwidth = bandwidth(store.probes(), None)
    return facts


def _add(series: _Series, step: Step) -> None:
    memory = step.memory
    host_rss = memory.peak_bytes if memory is not None and memory.kind == "host_rss" else None
    for name, value in (("loss", step.loss), ("grad_norm", step.grad_norm), ("host_rss_bytes", host_rss)):
        if value is not None:
            series.points[name].append((step.step, value))
    pipeline = step.pipeline
    series.steps.append(StepRow(
        step.step, step.time, step.step_seconds, step.dataloader_wait_seconds, step.compute_seconds,
        step.optimizer_seconds, step.outside_model_seconds, step.exposed_collective_seconds,
        pipeline.bubble_ratio if pipeline else None, pipeline.bubble_ratio_theoretical if pipeline else None,
        step.loss, step.grad_norm, step.lr, step.grad_cosine_similarity,
        memory.peak_bytes if memory is not None else None,
        tuple((op, calls.count, calls.seconds) for op, calls in (step.collectives or {}).items()),
        tuple((group, totals.seconds) for group, totals in (step.groups or {}).items())))
