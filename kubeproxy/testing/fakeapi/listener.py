"""The fake API server's life cycle: its socket, its threads, its connections.

:class:`Listener` starts serving (HTTP or HTTPS) in a thread of its own and stops as a
killed server would: the listener closed, every connection cut mid-stream. Each request
goes, in its connection's thread, to the ``dispatch`` callable it was given with the
HTTP method; :func:`send` writes one JSON answer. What a request means is the business
of :mod:`~kubeproxy.testing.fakeapi.serving`.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kubeproxy.testing.fakeapi.faults import OpenWatches, cut

__all__ = ["Listener", "send"]

# The whole fake logs under one name, as it did when it was one module.
logger = logging.getLogger("kubeproxy.testing.fakeapi")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], listener: Listener, tls: ssl.SSLContext | None
    ) -> None:
        self.listener = listener
        self.tls = tls
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, address = super().get_request()
        if self.tls is not None:
            # The handshake happens in the connection's own thread (_Handler.setup), so a
            # slow or failing client never holds up the accept loop.
            conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        return conn, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that refuses our certificate (or that we refuse) is the test's
        # business, not a traceback on stderr.
        logger.debug("fakeapi: connection from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; Nagle plus delayed ACKs would add
    # 40 ms to every response.
    disable_nagle_algorithm = True
    server: _Server

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()
        super().setup()
        self.server.listener.opened(self.connection, self.server)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.listener.closed(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("fakeapi: " + format, *args)

    def _dispatch(self) -> None:
        self.server.listener.dispatch(self, self.command)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _dispatch


class Listener:
    """The socket and serving thread of one fake server; the state stays outside, so a
    stop and a start serve the same cluster on the same port."""

    def __init__(
        self,
        dispatch: Callable[[BaseHTTPRequestHandler, str], None],
        watches: OpenWatches,
        lock: threading.Condition,
    ) -> None:
        self.dispatch = dispatch
        self.server: _Server | None = None
        """The serving socket's server while running."""
        self._watches = watches
        self._lock = lock
        self._connections: set[socket.socket] = set()
        self._thread: threading.Thread | None = None

    def start(self, host: str, port: int, tls: ssl.SSLContext | None) -> int:
        """Serve on ``host:port`` (0: any free port) unless already serving; the port."""
        with self._lock:
            if self.server is not None:
                return self.server.server_address[1]
            server = _Server((host, port), self, tls)
            self._watches.new_generation()
            self.server = server
        port = server.server_address[1]
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"fakeapi-{port}",
            daemon=True,
        )
        self._thread.start()
        return port

    def stop(self) -> None:
        """Close the listener and cut every connection (and every watch) mid-stream."""
        with self._lock:
            server, self.server = self.server, None
            if server is None:
                return
            self._watches.new_generation()
            connections = list(self._connections)
        server.shutdown()
        server.server_close()
        for conn in connections:
            cut(conn)
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def opened(self, conn: socket.socket, server: object) -> None:
        """Count a connection as open, or cut it if ``server`` is no longer serving."""
        # A connection the listener accepted after stop() began (it serves until its
        # shutdown returns, up to half a second later) is cut at once, as a dead server
        # would never have answered it: a client reconnecting in that window used to get
        # a watch of the new generation, and events applied while "away" reached it.
        with self._lock:
            live = server is self.server
            if live:
                self._connections.add(conn)
        if not live:
            cut(conn)

    def closed(self, conn: socket.socket) -> None:
        """Forget a closed connection."""
        with self._lock:
            self._connections.discard(conn)


def send(
    request: BaseHTTPRequestHandler,
    code: int,
    payload: Any,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Answer with ``payload`` as JSON (a client gone meanwhile closes the connection)."""
    data = json.dumps(payload, separators=(",", ":")).encode()
    try:
        request.send_response(code)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            request.send_header(key, value)
        request.end_headers()
        request.wfile.write(data)
    except OSError:
        request.close_connection = True
