"""The one small interface every collector implements (node_exporter style)."""

from __future__ import annotations

import abc
import dataclasses
import functools
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from prometheus_client.core import Metric

from gpuwatch.agent.telemetry.store import DEFAULT_MAX_JOBS, DEFAULT_MAX_RANKS, DEFAULT_TTL


@dataclasses.dataclass(frozen=True)
class CollectorContext:
    """What a collector may depend on; chosen once at start-up by the CLI (real or simulated node)."""

    sysfs_root: Path = Path("/sys")
    node: str = ""
    # The pynvml module, or the scripted stand-in of gpuwatch.agent.simulate when simulating.
    nvml: types.ModuleType | Any = None
    simulated: bool = False
    # Training telemetry: where the ranks send (None: the shared default of telemetry.paths) and the
    # bounds of the per-rank state.
    telemetry_socket: Path | None = None
    telemetry_ttl: float = DEFAULT_TTL
    telemetry_max_ranks: int = DEFAULT_MAX_RANKS
    telemetry_max_jobs: int = DEFAULT_MAX_JOBS


class DeferredFamilies(Sequence[Metric]):
    """Metric families built on first use, from data the collector already copied.

    Building families is the costly part of a collector with many series (64 ranks' histograms);
    deferred, it runs only when the snapshot is rendered (ahead of a scrape that keeps a rhythm, else by the
    scrape), never in the rounds nobody scrapes.
    ``build`` must not read state that changes after ``collect`` returns.
    """

    def __init__(self, build: Callable[[], list[Metric]]) -> None:
        self._build = build

    @functools.cached_property
    def _families(self) -> list[Metric]:
        return self._build()

    def __getitem__(self, index):  # type: ignore[override]
        return self._families[index]

    def __len__(self) -> int:
        return len(self._families)


class DeferredReadings(Mapping[str, Any]):
    """A collector's readings read on first use: what ``/api/v1/state`` (``as_dict``) or a test looks up."""

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self._read = read

    @functools.cached_property
    def _readings(self) -> dict[str, Any]:
        return self._read()

    def as_dict(self) -> dict[str, Any]:
        return self._readings

    def __getitem__(self, key: str) -> Any:
        return self._readings[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._readings)

    def __len__(self) -> int:
        return len(self._readings)


#: A collector's readings: its typed readings (``collectors.readings``), or the telemetry store's state.
R = TypeVar("R")


@dataclasses.dataclass
class CollectorResult(Generic[R]):
    """One sample of one collector.

    ``families`` (a list, or ``DeferredFamilies``) go to /metrics; ``readings`` go to /api/v1/state (as JSON) and
    to diagnosis; ``errors`` are partial failures (one GPU lost, one unreadable file) that did not stop the rest.
    """

    families: Sequence[Metric] = dataclasses.field(default_factory=list)
    # A collector without readings has an empty object in /api/v1/state.
    readings: R = dataclasses.field(default_factory=dict)  # type: ignore[assignment]
    errors: list[str] = dataclasses.field(default_factory=list)
    #: Seconds during which running the collector again would find the same nothing (no InfiniBand device on the
    #: node): the sampler serves this result again until then instead of running it. None: run it every round.
    unchanged_for_seconds: float | None = None


class CollectorError(Exception):
    """The collector cannot sample at all (library missing, directory absent); it is reported down."""


class Collector(abc.ABC):
    """Samples one source. ``collect`` may raise: the sampler marks the collector down and goes on."""

    name: ClassVar[str]
    #: Whether ``gpuwatch agent`` enables it unless ``--no-collector.NAME`` is given.
    enabled_by_default: ClassVar[bool] = True
    #: False for a collector that reads only the agent's own memory and so cannot hang: the sampler runs it in its
    #: own thread instead of handing it to a worker thread under the deadline. A hand-off costs ~0.1 ms of CPU a
    #: round (the wake-ups of both threads), a large share of what an agent with nothing to collect spends.
    may_block: ClassVar[bool] = True

    def __init__(self, context: CollectorContext) -> None:
        self.context = context

    @abc.abstractmethod
    def collect(self) -> CollectorResult[Any]:
        """Read the source once and return its metric families and readings."""

    def close(self) -> None:  # noqa: B027 - optional hook, most collectors hold nothing
        """Release what the collector holds (NVML handle, sockets) at shutdown."""
