"""The HTTP connection settings every baton server shares (OpenAI server, prefill, router).

uvicorn closes a kept-alive connection that stays idle (``timeout_keep_alive``) but has no
deadline for a request that is arriving: a client that sends half a request line, or
headers without their end, or a body slower than a trickle, held its connection (and a
slot of the server) forever. ``ReadDeadlineH11Protocol`` gives every request
``REQUEST_READ_TIMEOUT_S`` from its first byte (or from the connection's opening) to
arrive in full, headers and body, and closes the connection past it. Responses -- a long
SSE stream included -- are not limited.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from baton.platform import listen_socket

REQUEST_READ_TIMEOUT_S = 30.0
"""From a request's first byte (or the connection's opening) to its last."""
KEEP_ALIVE_S = 75.0
"""How long an idle kept-alive connection stays open: longer than clients keep idle
connections pooled (httpx: 5 s -- uvicorn's default too). At equal timeouts the server
closed a connection just as a client, its event loop busy, sent its next request on it:
a reset, ``httpx.ReadError``, ~1 in 2,000 requests through the router at 55/s."""
_ARRIVED = (h11.DONE, h11.MUST_CLOSE)
"""The client's h11 states once its request is in full (MUST_CLOSE: it said Connection:
close)."""


class ReadDeadlineH11Protocol(H11Protocol):
    read_timeout_s = REQUEST_READ_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._arm()  # a connection that never sends a byte is closed too

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in _ARRIVED:  # the request has arrived in full
            self._disarm()
        elif data and self._read_deadline is None:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._on_deadline)

    def _disarm(self) -> None:
        if getattr(self, "_read_deadline", None) is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _on_deadline(self) -> None:
        self._read_deadline = None
        if self.conn.their_state not in _ARRIVED and not self.transport.is_closing():
            self.logger.warning(
                "closing a connection whose request did not arrive in %g s", self.read_timeout_s
            )
            self.transport.close()


class _BoundServer(uvicorn.Server):
    """A uvicorn server on a socket bound before it starts (``server``)."""

    def __init__(self, config: uvicorn.Config, listener: socket.socket) -> None:
        super().__init__(config)
        self.listener = listener

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            super().run(sockets=sockets or [self.listener])
        finally:
            self.listener.close()


def server(
    app: Any, host: str, port: int, listener: socket.socket | None = None, **options: Any
) -> uvicorn.Server:
    """A uvicorn server with baton's connection settings (``options``: more of
    ``uvicorn.Config``) on ``listener``, else on ``host:port`` bound now: raises
    ``PortInUse`` (naming ``--port``) when it is taken -- uvicorn would log it and exit 1,
    which a supervisor restarted forever. Bind first (``platform.listen_socket``) where
    the app takes long to build."""
    listener = listener or listen_socket(host, port)
    options.setdefault("timeout_keep_alive", KEEP_ALIVE_S)
    config = uvicorn.Config(app, host=host, port=port, http=ReadDeadlineH11Protocol, **options)
    return _BoundServer(config, listener)


LOG_LEVELS = ("debug", "info", "warning", "error")
ACCESS_LOGGER = "baton.access"
"""One line per request (the router's relay line); off unless ``--access-log``."""


def configure_logging(tag: str, level: str = "info", access_log: bool = False) -> str:
    """The console of a baton process: ``level`` for baton's own lines (state changes at
    INFO: a worker healthy or not, restarted, a peer gone), HTTP-client lines (httpx: one per
    health check) and uvicorn's start-up chatter only at DEBUG, per-request lines only with
    ``access_log``. Returns the level to give uvicorn (``server(..., log_level=...)``)."""
    logging.basicConfig(
        level=level.upper(), format=f"%(asctime)s {tag} %(levelname)s %(message)s", force=True
    )
    quiet = logging.DEBUG if level == "debug" else logging.WARNING
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(quiet)
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO if access_log else logging.WARNING)
    return "debug" if level == "debug" else "warning"
