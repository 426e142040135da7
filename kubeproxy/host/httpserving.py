"""The proxy's small HTTP servers: long accept queues, bounded handlers, binding rules.

Every listener of the proxy (``/healthz`` and ``/livez``, ``/metrics``, each
HealthCheckNodePort) asks for the kernel's longest accept queue (:func:`listen_backlog`)
and runs at most :data:`DEFAULT_MAX_HANDLERS` connection handlers at once
(:class:`HandlerSlots`): load balancers and kubelets probe in bursts, and a burst that
overflows a short accept queue (the standard library's default is 5) costs clients a
SYN retransmit (1 s, then 3 s), enough to fail a probe; past the cap, connections wait
in that queue instead of each taking a thread.

:class:`BackgroundServer` is the server :mod:`kubeproxy.health` and
:mod:`kubeproxy.metrics` use: routes of fixed answers, bound to ``host:port``, retried
every few seconds when the address is taken, or failing at once with ``hard_fail``
(upstream's ``bindAddressHardFail``); a wildcard address serves both families where the
host has IPv6, IPv4 alone where it has not.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import queue
import socket
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import TCPServer
from typing import Any, Final

__all__ = [
    "DEFAULT_MAX_HANDLERS",
    "RETRY_INTERVAL",
    "BackgroundServer",
    "HandlerSlots",
    "QueryRoute",
    "Response",
    "Route",
    "ServerBindError",
    "listen_backlog",
    "parse_bind_address",
    "query_of",
    "send",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_HANDLERS: Final = 128
"""Connection handlers one server runs at once; more connections wait in the accept queue.

Enough that the slow clients a server meets in practice (a handler drops a request not
sent in full within 30 s) leave room for probes, few enough that a flood costs a bounded
number of threads and their stacks. Throughput does not need more: two cores answer
health probes faster than new threads could be scheduled.
"""

RETRY_INTERVAL: Final = 5.0
"""Seconds between attempts to bind an address that is taken (without ``hard_fail``)."""
_SOMAXCONN_PATH: Final = "/proc/sys/net/core/somaxconn"
_NO_IPV6: Final = (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT)


# --- listeners that hold bursts --------------------------------------------------------


def listen_backlog() -> int:
    """The accept queue to ask ``listen()`` for: the kernel's limit, ``net.core.somaxconn``.

    Read from this network namespace's ``/proc/sys`` (the kernel silently caps any larger
    request at it); :data:`socket.SOMAXCONN` when it cannot be read.
    """
    try:
        with open(_SOMAXCONN_PATH, encoding="ascii") as file:
            value = int(file.read().strip())
    except (OSError, ValueError):
        return socket.SOMAXCONN
    return value if value > 0 else socket.SOMAXCONN


class HandlerSlots:
    """At most ``limit`` connection handlers at once (None: no limit), and the threads
    that run them; thread-safe.

    A server's accept loop takes a slot (:meth:`acquire`) for each connection and hands
    the connection to :meth:`run`; the slot comes back when the handler ends. Under a
    flood the accept loop waits for a slot and the kernel's accept queue holds the
    connections: clients queue, threads and memory stay bounded.

    With a limit, handler threads are kept and reused (at most ``limit`` of them, idle
    ones waiting for work): starting a thread waits for it to run, a hand-over of the
    interpreter lock that, among a hundred busy handlers, costs milliseconds. Measured
    here (2 cores, 200 clients each opening a connection per request, 1000 health-check
    listeners): an accept loop starting a thread per connection answered 1,200-2,100
    connections a second, reused workers 3,500-3,600. Without a limit each connection
    gets a new thread, as the standard library's servers do.
    """

    def __init__(self, limit: int | None = DEFAULT_MAX_HANDLERS, name: str = "handler") -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"handler limit must be >= 1 or None, got {limit}")
        self.limit = limit
        self.name = name
        self._semaphore = threading.BoundedSemaphore(limit) if limit is not None else None
        self._lock = threading.Lock()
        self._active = 0
        self._peak = 0
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._workers = 0
        self._idle = 0

    @property
    def active(self) -> int:
        """Handlers running now."""
        with self._lock:
            return self._active

    @property
    def peak(self) -> int:
        """The most handlers that ran at once."""
        with self._lock:
            return self._peak

    @property
    def workers(self) -> int:
        """Handler threads kept for reuse (0 without a limit)."""
        with self._lock:
            return self._workers

    def acquire(self, closed: Callable[[], bool], poll: float = 0.1) -> bool:
        """Wait for a slot; False (no slot taken) once ``closed()`` is true."""
        while self._semaphore is not None and not self._semaphore.acquire(timeout=poll):
            if closed():
                return False
        with self._lock:
            self._active += 1
            self._peak = max(self._peak, self._active)
        return True

    def release(self) -> None:
        """Give a slot back (a handler ended)."""
        with self._lock:
            self._active -= 1
        if self._semaphore is not None:
            self._semaphore.release()

    def run(self, handler: Callable[[], None]) -> None:
        """Run ``handler`` in a handler thread, for a slot the caller acquired; the slot
        is given back when it ends (or here, if no thread can be started)."""
        if self._semaphore is None:
            self._start(functools.partial(self._run_once, handler))
            return
        with self._lock:
            work = self._work
            start = self._idle == 0
            if start:
                self._workers += 1
            else:
                self._idle -= 1
        work.put(handler)
        if start:
            self._start(functools.partial(self._worker, work), worker=True)

    def close(self) -> None:
        """Let the kept threads end (busy ones after their connection); a later
        :meth:`run` starts new ones. Servers call it when they stop."""
        with self._lock:
            retired, count = self._work, self._workers
            self._work = queue.SimpleQueue()
            self._workers = self._idle = 0
        for _ in range(count):
            retired.put(None)

    def _start(self, target: Callable[[], None], *, worker: bool = False) -> None:
        try:
            threading.Thread(target=target, name=self.name, daemon=True).start()
        except RuntimeError as err:  # no thread to be had: this connection waits for one
            logger.error("%s: cannot start a handler thread: %s", self.name, err)
            if worker:
                with self._lock:  # the queued handler runs on the next worker that starts
                    self._workers -= 1
            else:
                self.release()

    def _run_once(self, handler: Callable[[], None]) -> None:
        try:
            handler()
        except Exception:
            logger.exception("%s failed", self.name)
        finally:
            self.release()

    def _worker(self, work: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while (handler := work.get()) is not None:
            self._run_once(handler)
            with self._lock:
                if work is not self._work:  # closed meanwhile: a None is queued for us
                    continue
                self._idle += 1


# --- a small HTTP server --------------------------------------------------------------

Response = tuple[int, Mapping[str, str], bytes]
"""An HTTP answer: status code, headers, body."""

Route = Callable[[], Response]
"""Produces the answer for one path."""


@dataclass(frozen=True, slots=True)
class QueryRoute:
    """A route that answers from the request's query string: ``answer`` gets each
    parameter's first value (``/debug/explain?service=ns/web``). Called without a
    query, as any :data:`Route`, it gets none."""

    answer: Callable[[Mapping[str, str]], Response]

    def __call__(self) -> Response:
        """The answer to a request without a query."""
        return self.answer({})


def query_of(path: str) -> dict[str, str]:
    """The first value of each parameter of ``path``'s query string."""
    query = urllib.parse.parse_qs(path.partition("?")[2], keep_blank_values=True)
    return {name: values[0] for name, values in query.items()}


_NOT_FOUND: Final[Response] = (
    404,
    {"Content-Type": "text/plain; charset=utf-8", "X-Content-Type-Options": "nosniff"},
    b"404 page not found\n",
)


class ServerBindError(OSError):
    """A server could not bind its address (raised only with ``hard_fail``)."""


def parse_bind_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port``; empty host = every address) and validate it.

    The host must be an IP literal or empty; raises ValueError otherwise.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep:
        raise ValueError(f"bind address {address!r}: want host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"bind address {address!r}: {host!r} is not an IP address") from None
    try:
        port = int(port_text, 10)
    except ValueError:
        raise ValueError(f"bind address {address!r}: bad port {port_text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"bind address {address!r}: port out of range")
    return host, port


def _is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::")


def send(handler: BaseHTTPRequestHandler, response: Response, *, head: bool = False) -> None:
    """Write ``response`` through ``handler`` (headers only for a HEAD request)."""
    code, headers, body = response
    handler.log_request(code)
    handler.send_response_only(code)
    handler.send_header("Date", handler.date_time_string())
    for name, value in headers.items():
        handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    if not head:
        handler.wfile.write(body)


class _RoutingHandler(BaseHTTPRequestHandler):
    """Answers GET and HEAD from the server's routes (exact paths; the query only for a
    :class:`QueryRoute`)."""

    protocol_version = "HTTP/1.1"
    timeout = 30
    server: _RoutedServer

    def _answer(self, head: bool) -> None:
        route = self.server.routes.get(self.path.partition("?")[0])
        try:
            if isinstance(route, QueryRoute):
                response = route.answer(query_of(self.path))
            else:
                response = route() if route is not None else _NOT_FOUND
        except Exception:  # a broken route must not kill the server
            logger.exception("%s: answering %s failed", self.server.label, self.path)
            response = (500, {"Content-Type": "text/plain; charset=utf-8"}, b"internal error\n")
        send(self, response, head=head)

    def do_GET(self) -> None:
        """Answer a GET."""
        self._answer(head=False)

    def do_HEAD(self) -> None:
        """Answer a HEAD (headers only)."""
        self._answer(head=True)

    def log_message(self, format: str, *args: Any) -> None:
        """Log requests at debug level instead of printing them."""
        logger.debug("%s: %s", self.server.label, format % args)


class _RoutedServer(ThreadingHTTPServer):
    """A threading HTTP server carrying its routes; dual-stack on a wildcard host.

    ``backlog`` is the listen queue; ``slots`` caps the handler threads (the serving
    loop waits for a free one before it accepts again).
    """

    daemon_threads = True

    def __init__(
        self,
        label: str,
        host: str,
        port: int,
        routes: Mapping[str, Route],
        *,
        backlog: int,
        slots: HandlerSlots,
        dual_stack: bool = True,
    ) -> None:
        self.label = label
        self.routes = routes
        self.request_queue_size = backlog
        self.slots = slots
        self.closing = threading.Event()
        self._dual_stack = dual_stack and _is_wildcard(host) and socket.has_ipv6
        if self._dual_stack:
            self.address_family = socket.AF_INET6
            host = "::"
        elif _is_wildcard(host):
            self.address_family = socket.AF_INET
            host = "0.0.0.0"
        elif ":" in host:
            self.address_family = socket.AF_INET6
        else:
            self.address_family = socket.AF_INET
        super().__init__((host, port), _RoutingHandler)

    def server_bind(self) -> None:
        """Bind without the reverse DNS lookup HTTPServer does."""
        if self._dual_stack:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Take a handler slot before the request is handled (waits while all are busy)."""
        return self.slots.acquire(self.closing.is_set)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Handle the connection in a handler thread, which gives the slot back."""
        self.slots.run(functools.partial(self.process_request_thread, request, client_address))


class BackgroundServer:
    """An HTTP server on ``host:port`` serving ``routes`` from a thread of its own.

    A wildcard host (empty, ``0.0.0.0`` or ``::``) accepts IPv4 and IPv6, as Go does.
    An empty ``address`` disables the server. When the address cannot be bound,
    :meth:`start` raises :class:`ServerBindError` with ``hard_fail``; otherwise it logs
    and keeps retrying every ``retry_interval`` seconds until it binds or is stopped.

    ``backlog`` is the listen queue (None: :func:`listen_backlog`, the kernel's limit);
    ``max_handlers`` caps the connections handled at once (None: no cap); see
    :class:`HandlerSlots`. The benchmarks pass ``backlog=5, max_handlers=None``, the
    standard library's defaults, as the baseline.
    """

    def __init__(
        self,
        label: str,
        address: str,
        routes: Mapping[str, Route],
        *,
        hard_fail: bool = False,
        retry_interval: float = RETRY_INTERVAL,
        backlog: int | None = None,
        max_handlers: int | None = DEFAULT_MAX_HANDLERS,
    ) -> None:
        if backlog is not None and backlog < 1:
            raise ValueError(f"listen backlog must be >= 1, got {backlog}")
        self.label = label
        self.address = address
        self.host, self.requested_port = parse_bind_address(address) if address else ("", 0)
        self.routes = dict(routes)
        self.hard_fail = hard_fail
        self.retry_interval = retry_interval
        self.backlog = backlog
        self.slots = HandlerSlots(max_handlers, name=f"{label}-handler")
        self._lock = threading.Lock()
        self._server: _RoutedServer | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._bound = threading.Event()

    def add_routes(self, routes: Mapping[str, Route]) -> None:
        """Serve ``routes`` too, from now on (also when already serving: the server
        reads this same mapping)."""
        self.routes.update(routes)

    @property
    def enabled(self) -> bool:
        """False when the address is empty."""
        return bool(self.address)

    @property
    def port(self) -> int | None:
        """The port actually bound (useful with port 0), or None while not bound."""
        with self._lock:
            return None if self._server is None else self._server.server_port

    def wait_bound(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the server to be bound."""
        return self._bound.wait(timeout)

    def start(self) -> None:
        """Bind and serve in the background (see the class docstring for failures)."""
        if not self.enabled:
            logger.info("%s server disabled (no bind address)", self.label)
            return
        self._stop.clear()
        error = self._try_bind()
        if error is None:
            return
        if self.hard_fail:
            raise ServerBindError(
                error.errno, f"{self.label} server cannot bind {self.address}: {error}"
            )
        logger.error(
            "%s server cannot bind %s (%s); retrying every %gs",
            self.label,
            self.address,
            error,
            self.retry_interval,
        )
        thread = threading.Thread(target=self._retry, name=f"{self.label}-bind-retry", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _try_bind(self) -> OSError | None:
        make = functools.partial(
            _RoutedServer,
            self.label,
            self.host,
            self.requested_port,
            self.routes,
            backlog=self.backlog if self.backlog is not None else listen_backlog(),
            slots=self.slots,
        )
        try:
            server = make()
        except OSError as err:
            if not (_is_wildcard(self.host) and err.errno in _NO_IPV6):
                return err
            # IPv6 disabled on this host: the wildcard means every IPv4 address.
            try:
                server = make(dual_stack=False)
            except OSError as ipv4_err:
                return ipv4_err
        thread = threading.Thread(
            target=server.serve_forever, args=(0.25,), name=self.label, daemon=True
        )
        with self._lock:
            if self._stop.is_set():
                server.server_close()
                return None
            self._server = server
            self._threads.append(thread)
        thread.start()
        self._bound.set()
        logger.info("%s server listening on %s", self.label, self.address)
        return None

    def _retry(self) -> None:
        while not self._stop.wait(self.retry_interval):
            error = self._try_bind()
            if error is None:
                return
            logger.debug("%s server still cannot bind %s: %s", self.label, self.address, error)

    def stop(self) -> None:
        """Stop serving and release the port."""
        self._stop.set()
        with self._lock:
            server, self._server = self._server, None
            threads, self._threads = self._threads, []
        if server is not None:
            server.closing.set()  # a serving loop waiting for a handler slot gives up
            server.shutdown()
            server.server_close()
        for thread in threads:
            thread.join(timeout=5)
        self.slots.close()
        self._bound.clear()
