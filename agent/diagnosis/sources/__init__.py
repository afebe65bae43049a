"""Sources fill ``Facts``: the local node, a node agent's state, a run log, a Prometheus server.

Each reports what keeps it from answering as ``SourceError`` with a message for people (the CLI exits 2
with it); partial trouble (a bad line, a collector down) goes to ``Facts.notes`` and ``NodeFacts.missing``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

#: Seconds an HTTP source waits for an answer.
HTTP_TIMEOUT = 10.0


class SourceError(Exception):
    """A source cannot provide facts at all: unreachable, not what it claims to be, unreadable."""


def http_json(url: str, what: str, timeout: float = HTTP_TIMEOUT) -> Any:
    """GET ``url`` and decode its JSON body; every failure becomes a SourceError naming ``what`` was expected."""
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise SourceError(f"{url} is not an http:// or https:// URL")
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read(300).decode("utf-8", "replace").strip()
        raise SourceError(f"{url} answered HTTP {exc.code} {exc.reason}: is it {what}? {detail}".rstrip()) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            reason = f"no answer within {timeout:g} s"
        raise SourceError(f"cannot reach {url}: {reason}") from None
    try:
        return json.loads(body)
    except ValueError:
        raise SourceError(f"{url} did not return JSON: is it {what}?") from None
