"""HTTP endpoints of the agent: /metrics, /healthz, /api/v1/state.

Handlers only read the sampler's latest immutable snapshot; they never touch hardware, so a
scrape costs the same whether a collector is slow, hung or failing.
"""

from __future__ import annotations

import http.server
import logging
import threading
import time
from collections.abc import Callable

from gpuwatch.agent.exposition import CONTENT_TYPE
from gpuwatch.agent.snapshot import Snapshot

log = logging.getLogger(__name__)

_INDEX = b"""<html><head><title>gpuwatch agent</title></head><body>
<h1>gpuwatch agent</h1>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/healthz">/healthz</a></li>
<li><a href="/api/v1/state">/api/v1/state</a></li></ul></body></html>
"""


class AgentHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    # Re-binding right after a restart must not fail on a socket in TIME_WAIT.
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], snapshot: Callable[[], Snapshot], stale_after: float) -> None:
        self.snapshot = snapshot
        self.stale_after = stale_after
        super().__init__(address, _Handler)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: AgentHTTPServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        snapshot = self.server.snapshot()
        if path == "/metrics":
            self._metrics(snapshot)
        elif path == "/api/v1/state":
            self._send(200, "application/json", snapshot.state_json)
        elif path == "/healthz":
            self._healthz(snapshot)
        elif path == "/":
            self._send(200, "text/html; charset=utf-8", _INDEX)
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found\n")

    def _metrics(self, snapshot: Snapshot) -> None:
        if "gzip" in self.headers.get("Accept-Encoding", ""):
            self._send(200, CONTENT_TYPE, snapshot.metrics_gzip, {"Content-Encoding": "gzip"})
        else:
            self._send(200, CONTENT_TYPE, snapshot.metrics_text)

    def _healthz(self, snapshot: Snapshot) -> None:
        """Healthy while the sampler keeps publishing; collectors being down is not unhealthy."""
        age = time.time() - snapshot.timestamp
        if snapshot.timestamp and age <= self.server.stale_after:
            self._send(200, "text/plain; charset=utf-8", b"ok\n")
        else:
            self._send(503, "text/plain; charset=utf-8", f"stale: last sample {age:.0f}s ago\n".encode())

    def _send(self, status: int, content_type: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def serve_in_thread(server: AgentHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
    thread.start()
    return thread
