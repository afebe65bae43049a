"""Sources fill ``Facts``: the local node, a node agent's state, a run log, a Prometheus server.

Each reports what keeps it from answering as ``SourceError`` with a message for people (the CLI exits 2
with it); partial trouble (a bad line, a collector down) goes to ``Facts.notes`` and ``NodeFacts.missing``.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from gpuwatch.diagnosis.sources.httpconfig import HttpConfig

#: Seconds an HTTP source waits for an answer.
HTTP_TIMEOUT = 10.0
#: The window over which diagnosis reads error counters' increases (Xids, ECC, NVLink and port errors): long enough
#: for a few scrapes of a slow-climbing counter, short enough that a fixed link stops counting. Stated once here:
#: the full pull, the outlier fetch and the alerts (alerts/rules.py) judge the same increase over the same span.
WINDOW_MINUTES = 10
#: ``WINDOW_MINUTES`` as a PromQL range duration.
WINDOW = f"{WINDOW_MINUTES}m"


class SourceError(Exception):
    """A source cannot provide facts at all: unreachable, not what it claims to be, unreadable."""


@dataclasses.dataclass
class Meter:
    """What a source's requests cost: how many, and the bytes of their answers (as received, before decoding)."""

    requests: int = 0
    bytes: int = 0


def http_json(url: str, what: str, timeout: float = HTTP_TIMEOUT, config: HttpConfig | None = None,
              form: dict[str, str] | None = None, meter: Meter | None = None) -> Any:
    """GET ``url`` (POST ``form`` when given) and decode its JSON body; every failure becomes a SourceError naming
    ``what`` was expected. ``config`` adds the headers and TLS context of ``--http.config.file``; no message
    carries its credentials (nor a URL's user:password), even where the server echoes them back."""
    config = config or HttpConfig()
    shown = _shown(url)
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise SourceError(f"{shown} is not an http:// or https:// URL")
    body = urllib.parse.urlencode(form).encode() if form is not None else None
    request = urllib.request.Request(url, data=body, headers={"Accept": "application/json", **config.headers})
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=config.tls) as response:
            payload = response.read()
        if meter is not None:
            meter.requests += 1
            meter.bytes += len(payload)
    except urllib.error.HTTPError as exc:
        detail = config.redact(exc.read(4096).decode("utf-8", "replace").strip())
        error = _json_error(detail)
        if error is not None:  # the engine's own answer ({"status": "error", ...}): a query problem, said as such
            raise QueryError(error) from None
        raise SourceError(config.redact(f"{shown} answered HTTP {exc.code} {exc.reason}: is it {what}? "
                                        f"{' '.join(detail[:300].split())}").rstrip()) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            raise QueryError(f"cannot reach {shown}: no answer within {timeout:g} s") from None
        raise SourceError(config.redact(f"cannot reach {shown}: {reason}")) from None
    try:
        return json.loads(payload)
    except ValueError:
        raise SourceError(f"{shown} did not return JSON: is it {what}?") from None


class QueryError(SourceError):
    """One query the engine could not answer (a timeout, a rejected expression): the rules that rest on it could
    not run, the others can."""


def _json_error(body: str) -> str | None:
    """The ``error`` of a PromQL engine's JSON error answer, else None."""
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    if isinstance(answer, dict) and answer.get("status") == "error":
        return f"{answer.get('errorType', 'error')}: {answer.get('error')}"
    return None


def _shown(url: str) -> str:
    """``url`` as messages show it: without ``user:password@`` and without the query string (a PromQL query is
    long, and the engine's own error names what went wrong with it)."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2], query="", fragment=""))
