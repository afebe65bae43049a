"""The immutable result of one sampling round: what every scrape and state request serves.

Its exposition text, gzip and JSON state are produced once, on first use, and kept. While a scraper keeps
coming (``ScrapeClock``), the sampler renders every round before publishing it, so that a scrape, whenever it
comes, is served from memory; an agent nobody scrapes renders nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import itertools
import json
import math
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
    """When /metrics was last scraped, to tell whether a scraper is still around.

    Rendering every round while one is makes a scrape of a new snapshot as fast as one of a snapshot already
    rendered, whenever it comes: nothing depends on predicting the scraper's rhythm (rendering ahead of the scrape
    expected at the last gap, as before, measured well on one machine and left fresh scrapes at 21-33 ms on
    another).
    """

    #: A scraper silent for longer is gone: twice the longest scrape interval commonly configured (60 s).
    GONE_AFTER_SECONDS = 120.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: float | None = None

    def scraped(self) -> None:
        self._last = self._clock()  # one reference store: no lock needed between handler threads

    def active(self) -> bool:
        """Whether /metrics was scraped within the last GONE_AFTER_SECONDS."""
        last = self._last
        return last is not None and self._clock() - last <= self.GONE_AFTER_SECONDS


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
        """Render the text and its gzip now, before any scrape asks for them."""
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
