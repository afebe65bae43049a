"""HTTP endpoints of the agent: /metrics, /healthz, /api/v1/state.

Handlers only read the sampler's latest immutable snapshot; they never touch hardware, so a
scrape costs the same whether a collector is slow, hung or failing.

With a web config (``gpuwatch.agent.webconfig``) connections are TLS and every path but /healthz
asks for basic auth: /healthz says only "ok" or "stale", and liveness probes (kubelet, systemd) carry
no credentials.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable

from gpuwatch.agent.exposition import CONTENT_TYPE
from gpuwatch.agent.snapshot import Snapshot
from gpuwatch.agent.webconfig import WebConfig

log = logging.getLogger(__name__)

_INDEX = b"""<html><head><title>gpuwatch agent</title></head><body>
<h1>gpuwatch agent</h1>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/healthz">/healthz</a></li>
<li><a href="/api/v1/state">/api/v1/state</a></li></ul></body></html>
"""


#: The agent's port: not dcgm-exporter's 9400, node_exporter's 9100 nor nvidia_gpu_exporter's 9835.
DEFAULT_PORT = 9746
#: Seconds a client gets for the TLS handshake, and an idle keep-alive connection is kept: a
#: silent peer must not hold a thread forever.
CONNECTION_TIMEOUT = 30.0

#: Seconds between the checks ``serve_forever`` makes for a shutdown request. socketserver's default of 0.5 s woke
#: the idle agent twice a second (0.17 ms of CPU a second, a sixth of what an idle agent may cost); ``shutdown``
#: wakes it at once instead.
SERVE_POLL_SECONDS = 60.0


class AgentHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    # Re-binding right after a restart must not fail on a socket in TIME_WAIT.
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], snapshot: Callable[[], Snapshot], stale_after: float,
                 web: WebConfig | None = None) -> None:
        self.snapshot = snapshot
        self.stale_after = stale_after
        self.web = web or WebConfig()
        super().__init__(address, _Handler)

    def shutdown(self) -> None:
        """Stop ``serve_forever`` now: it looks for the request only between polls SERVE_POLL_SECONDS apart, and a
        connection to the listening socket ends the poll it is in."""
        host, port = self.server_address[:2]  # a TCP server's: host as text
        stopping = threading.Thread(target=super().shutdown, name="http-shutdown")
        stopping.start()
        while stopping.is_alive():
            with contextlib.suppress(OSError):
                socket.create_connection((str(host), port), timeout=1).close()
            stopping.join(0.05)

    @property
    def scheme(self) -> str:
        return "https" if self.web.tls else "http"

    def finish_request(self, request: socket.socket | tuple[bytes, socket.socket],
                       client_address: tuple[str, int]) -> None:
        """The TLS handshake runs here, in the connection's own thread: a slow or silent client
        must not stall ``accept`` for everyone else."""
        if self.web.tls is None:
            super().finish_request(request, client_address)
            return
        assert isinstance(request, socket.socket), "a TCP server's request is the accepted connection"
        request.settimeout(CONNECTION_TIMEOUT)
        try:
            connection = self.web.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            log.debug("TLS handshake with %s failed: %s", client_address[0], exc)
            return
        try:
            super().finish_request(connection, client_address)
        finally:
            connection.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: AgentHTTPServer
    protocol_version = "HTTP/1.1"
    timeout = CONNECTION_TIMEOUT

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        auth = self.server.web.auth
        if auth is not None and path != "/healthz" and not auth.check(self.headers.get("Authorization")):
            self._send(401, "text/plain; charset=utf-8", b"Unauthorized\n",
                       {"WWW-Authenticate": 'Basic realm="gpuwatch"'})
            return
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
        scraper = self.client_address[0]  # each scraper's rhythm apart (snapshot.ScrapeClock)
        if "gzip" in self.headers.get("Accept-Encoding", ""):
            self._send(200, CONTENT_TYPE, snapshot.metrics(gzip=True, scraper=scraper), {"Content-Encoding": "gzip"})
        else:
            self._send(200, CONTENT_TYPE, snapshot.metrics(scraper=scraper))

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
        for name, value in {**self.server.web.headers, **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def serve_in_thread(server: AgentHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, args=(SERVE_POLL_SECONDS,), name="http", daemon=True)
    thread.start()
    return thread
