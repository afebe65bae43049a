"""The agent's receiver of the ranks' telemetry: a thread that drains the socket as records arrive.

A datagram queue holds only ``net.unix.max_dgram_qlen`` records, so the receiver must not wait for the sampler: it
queues each datagram for the ``TelemetryStore``, which applies them in a batch before its next read, and has the
sender's process watched for its exit (``exits.ExitWatcher``) from its first record on.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from pathlib import Path

from gpuwatch.agent.telemetry import listener
from gpuwatch.agent.telemetry.exits import ExitWatcher
from gpuwatch.agent.telemetry.store import TelemetryStore

log = logging.getLogger(__name__)


class Receiver:
    """The thread draining the socket into the store, and the socket's lifetime: bound at ``path`` when made
    (``listener.SocketSetupError`` or OSError when it cannot be), removed by ``close`` if still ours."""

    def __init__(self, path: Path, store: TelemetryStore, exits: ExitWatcher) -> None:
        self.path = path
        self._socket, self._identity = listener.bind(path)
        self._store = store
        self._exits = exits
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="telemetry-receiver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        receive, queue, watch = self._socket.recvmsg, self._store.receive, self._exits.watch
        while True:
            try:
                datagram, ancillary, _, _ = receive(listener.RECV_BYTES, listener.CREDENTIALS_SPACE)
            except OSError as exc:
                if self._closing.is_set():
                    return
                log.warning("receiving telemetry failed: %s", exc)
                self._closing.wait(1.0)
                continue
            if self._closing.is_set():  # woken by close()
                return
            pid = listener.sender_pid(ancillary)
            queue(datagram, pid)  # applied in a batch by the store's next reader
            if pid is not None:  # its exit timed from the first record on, whenever the store is read
                watch((pid,))

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)  # wakes the blocked recv()
        self._thread.join(5)
        self._socket.close()
        listener.unlink_if_ours(self.path, self._identity)
