"""The immutable result of one sampling round: what every scrape and state request serves."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import math
from typing import Any


def _json_safe(value: Any) -> Any:
    """Non-finite floats become "NaN"/"+Inf"/"-Inf", as in Prometheus's HTTP API: strict JSON stays parseable."""
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


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Swapped whole by the sampler; readers never see a half-built one."""

    timestamp: float
    metrics_text: bytes
    collectors: dict[str, CollectorStatus]
    facts: dict[str, Any]
    agent: dict[str, Any]

    @functools.cached_property
    def metrics_gzip(self) -> bytes:
        """Prometheus asks for gzip; compressing once per snapshot keeps scrapes cheap."""
        return gzip.compress(self.metrics_text, compresslevel=1)

    @functools.cached_property
    def state_json(self) -> bytes:
        state = {
            "agent": self.agent,
            "timestamp": self.timestamp,
            "collectors": {name: dataclasses.asdict(status) for name, status in self.collectors.items()},
            "facts": self.facts,
        }
        return json.dumps(_json_safe(state), default=str, allow_nan=False).encode()
