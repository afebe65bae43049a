"""The immutable result of one sampling round: what every scrape and state request serves.

Its exposition text, gzip and JSON state are produced once, on first use, and kept: at 1 s sampling and
a 15 s scrape interval most rounds are never scraped, and a round nobody asks for costs no rendering.
The round a regular scraper is about to read is rendered ahead by the sampler (``ScrapeClock``), so
that scrape is served from memory.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client.core import Metric

from gpuwatch.agent.exposition import Renderer

try:  # ISA-L's deflate (python-isal): zlib's gzip at its fastest level for a tenth of the CPU (benchmarks/gzip_cost.py)
    from isal.igzip import compress as gzip_compress
except ImportError:  # a platform without its wheel: the standard library's zlib
    from gzip import compress as gzip_compress  # type: ignore[assignment]  # the same call, typed by typeshed
#: The fastest level of either: a 64-rank page (1.2 MB) compresses ~20x at both, and ISA-L's level 3 costs 8x its 1.
GZIP_LEVEL = 1


def json_safe(value: Any) -> Any:
    """Non-finite floats become "NaN"/"+Inf"/"-Inf", as in Prometheus's HTTP API: strict JSON stays parseable; a
    float of a subclass (``records.MaybeNonFinite``, a loss the schema's checks took) the float it is. Objects with an
    ``as_dict`` (collectors' readings, a window's step points, record bodies) are written as that dict, only when the
    state is asked for."""
    as_dict = getattr(value, "as_dict", None)
    if callable(as_dict):
        value = as_dict()
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
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


#: Scrapers whose rhythm the scrape clock keeps (the longest silent forgotten first): a Prometheus pair, a second
#: pair during a migration, and people with curl.
MAX_SCRAPERS = 16


@dataclasses.dataclass(frozen=True, slots=True)
class _Rhythm:
    last: float  # when the scraper last scraped, on the clock
    gap: float | None  # the gap before that scrape; None after its first


class ScrapeClock:
    """When /metrics was scraped, by whom, to tell whether a scrape is due soon.

    Prometheus scrapes each target at a fixed interval, so the gap between a scraper's last two scrapes predicts its
    next one. Each scraper (its address) keeps its own rhythm: a highly available pair of Prometheus servers scrapes
    the same agent at two offsets, and one rhythm for both took their alternating short and long gaps for the
    interval and rendered ahead rounds nobody read (two scrapers 3 s apart every 15 s at 1 s sampling: 7 renders
    where 2 were needed, both of those on the scrape's demand). A scraper out of rhythm (a person with curl) is only
    served a little slower: the snapshot renders on its demand.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._rhythms: dict[str, _Rhythm] = {}  # least recently scraped first

    def scraped(self, scraper: str = "") -> None:
        """A scrape by ``scraper`` (its address; scrapes that name none share one rhythm)."""
        now = self._clock()
        with self._lock:
            previous = self._rhythms.pop(scraper, None)
            self._rhythms[scraper] = _Rhythm(now, None if previous is None else now - previous.last)
            if len(self._rhythms) > MAX_SCRAPERS:
                del self._rhythms[next(iter(self._rhythms))]

    def due_within(self, seconds: float) -> bool:
        """Whether some scraper's next scrape at its last gap falls within ``seconds`` from now, or is overdue from a
        scraper that was active within two of its gaps."""
        with self._lock:
            now = self._clock()
            return any(rhythm.gap is not None and rhythm.last + rhythm.gap - now <= seconds
                       and now - rhythm.last <= 2 * rhythm.gap + seconds for rhythm in self._rhythms.values())


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

    def metrics(self, *, gzip: bool = False, scraper: str = "") -> bytes:
        """The exposition, gzipped as Prometheus asks for it or not, for a scrape by ``scraper`` (its address), which
        the scrape clock notes."""
        self.scrapes.scraped(scraper)
        return self._gzip if gzip else self._text

    def render(self) -> bytes:
        """Render the text and its gzip now, ahead of the scrape expected to read this snapshot."""
        return self._gzip

    @functools.cached_property
    def _text(self) -> bytes:
        # Once per snapshot; the renderer serialises concurrent first scrapes.
        return self.renderer.render(itertools.chain.from_iterable(self.families))

    @functools.cached_property
    def _gzip(self) -> bytes:
        return gzip_compress(self._text, compresslevel=GZIP_LEVEL)

    @functools.cached_property
    def state_json(self) -> bytes:
        state = {
            "agent": self.agent,
            "timestamp": self.timestamp,
            "collectors": {name: dataclasses.asdict(status) for name, status in self.collectors.items()},
            "facts": self.readings,  # the key readers of /api/v1/state have always used
        }
        return json.dumps(json_safe(state), default=str, allow_nan=False).encode()
