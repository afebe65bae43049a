"""The immutable result of one sampling round: what every scrape and state request serves.

Its exposition text, gzip and JSON state are produced once, on first use, and kept: at 1 s sampling and
a 15 s scrape interval most rounds are never scraped, and a round nobody asks for costs no rendering.
The round a regular scraper is about to read is rendered ahead by the sampler (``ScrapeClock``), so
that scrape is served from memory.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import itertools
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client.core import Metric

from gpuwatch.agent.exposition import Renderer


def _json_safe(value: Any) -> Any:
    """Non-finite floats become "NaN"/"+Inf"/"-Inf", as in Prometheus's HTTP API: strict JSON stays parseable.
    Objects with an ``as_dict`` (collectors' readings, a window's step points) are written as that dict, only when
    the state is asked for."""
    as_dict = getattr(value, "as_dict", None)
    if callable(as_dict):
        value = as_dict()
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class CollectorStatus:
    up: bool
    duration_seconds: float
    last_error: str | None = None
    partial_errors: tuple[str, ...] = ()
    last_success_timestamp: float | None = None
    #: Seconds from the snapshot's timestamp until a failing collector, backing off, runs again.
    next_attempt_seconds: float | None = None


class ScrapeClock:
    """When /metrics was scraped, to tell whether the next scrape is due soon.

    Prometheus scrapes each target at a fixed interval, so the gap between the last two scrapes predicts
    the next one. A scraper out of rhythm (a person with curl) is only served a little slower: the
    snapshot renders on its demand.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._period: float | None = None

    def scraped(self) -> None:
        now = self._clock()
        with self._lock:
            if self._last is not None:
                self._period = now - self._last
            self._last = now

    def due_within(self, seconds: float) -> bool:
        """Whether the next scrape at the last gap falls within ``seconds`` from now, or is overdue from a
        scraper that was active within two of its gaps."""
        with self._lock:
            if self._last is None or self._period is None:
                return False
            now = self._clock()
            return self._last + self._period - now <= seconds and now - self._last <= 2 * self._period + seconds


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Swapped whole by the sampler; readers never see a half-built one."""

    timestamp: float
    #: The round's metric families, one sequence per collector (a collector's may build on first use).
    families: Sequence[Sequence[Metric]]
    collectors: dict[str, CollectorStatus]
    #: Each collector's readings, by collector name.
    readings: dict[str, Any]
    agent: dict[str, Any]
    renderer: Renderer = dataclasses.field(default_factory=Renderer, compare=False, repr=False)
    scrapes: ScrapeClock = dataclasses.field(default_factory=ScrapeClock, compare=False, repr=False)

    @property
    def metrics_text(self) -> bytes:
        """The exposition, for a scrape (which the scrape clock notes)."""
        self.scrapes.scraped()
        return self._text

    @property
    def metrics_gzip(self) -> bytes:
        """The exposition gzipped, as Prometheus asks for it, for a scrape (which the scrape clock notes)."""
        self.scrapes.scraped()
        return self._gzip

    def render(self) -> bytes:
        """Render the text and its gzip now, ahead of the scrape expected to read this snapshot."""
        return self._gzip

    @functools.cached_property
    def _text(self) -> bytes:
        # Once per snapshot; the renderer serialises concurrent first scrapes.
        return self.renderer.render(itertools.chain.from_iterable(self.families))

    @functools.cached_property
    def _gzip(self) -> bytes:
        return gzip.compress(self._text, compresslevel=1)

    @functools.cached_property
    def state_json(self) -> bytes:
        state = {
            "agent": self.agent,
            "timestamp": self.timestamp,
            "collectors": {name: dataclasses.asdict(status) for name, status in self.collectors.items()},
            "facts": self.readings,  # the key readers of /api/v1/state have always used
        }
        return json.dumps(_json_safe(state), default=str, allow_nan=False).encode()
