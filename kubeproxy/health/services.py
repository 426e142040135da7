"""The per-Service health checks: one listener per ``healthCheckNodePort``.

:class:`ServiceHealthServer` opens a listener for every Service of type LoadBalancer with
``externalTrafficPolicy: Local`` and answers a load balancer's probe with the Service's
local ready endpoints and whether the proxy is serving (:class:`~kubeproxy.health.state.
ProxyHealth`). Apart from the proxy's own ``/healthz`` server
(:mod:`kubeproxy.health.proxy`): many ports that come and go with the Services, retried
when they cannot be opened, served by one :class:`~kubeproxy.health.acceptloop.AcceptLoop`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from socketserver import BaseServer
from typing import Any

from kubeproxy.health.acceptloop import AcceptLoop
from kubeproxy.health.state import JSON_HEADERS, ProxyHealth
from kubeproxy.host.httpserving import (
    DEFAULT_MAX_HANDLERS,
    HandlerSlots,
    Response,
    listen_backlog,
    send,
)
from kubeproxy.objects import IPAddress, IPFamily, NamespacedName

__all__ = ["ListenErrorCallback", "ServiceHealthServer"]

# All of health logs under one name, as it did when it was one module.
logger = logging.getLogger("kubeproxy.health")


class _ServiceHandler(BaseHTTPRequestHandler):
    """Answers a load balancer's probe for one Service."""

    protocol_version = "HTTP/1.1"
    timeout = 30
    server: _ServiceContext

    def _answer(self, head: bool) -> None:
        send(self, self.server.owner.answer(self.server.service), head=head)

    def do_GET(self) -> None:
        """Answer a GET."""
        self._answer(head=False)

    def do_HEAD(self) -> None:
        """Answer a HEAD."""
        self._answer(head=True)

    def log_message(self, format: str, *args: Any) -> None:
        """Log probes at debug level."""
        logger.debug("health check %s: %s", self.server.service, format % args)


class _ServiceContext(BaseServer):
    """What a probe handler needs to know: its Service and the server that owns it."""

    def __init__(self, owner: ServiceHealthServer, service: NamespacedName) -> None:
        # Not a real server: the handler only reads these two attributes.
        self.owner = owner
        self.service = service


@dataclass(slots=True)
class _Listener:
    port: int
    sockets: list[socket.socket]
    endpoints: int = 0


ListenErrorCallback = Callable[[NamespacedName, int, str], None]
"""Told (Service, port, message) when a health-check port cannot be opened."""


class ServiceHealthServer:
    """Health-check listeners of one IP family, one per Service with a health-check port.

    ``addresses`` are the node addresses to listen on; None listens on the family's
    wildcard address (IPv6 sockets are IPv6-only, so an IPv4 and an IPv6 server can
    share port numbers). An answer is 200 when the Service has local ready endpoints
    and ``health`` says the proxy is serving (healthy, no data-plane fault), else 503,
    with upstream's tab-indented JSON body and the ``X-Load-Balancing-Endpoint-Weight``
    header.

    A port that cannot be opened is logged, reported to ``on_listen_error`` (the binary
    posts a ``FailedToStartServiceHealthcheck`` event) and retried at the next
    :meth:`sync_services`.

    One thread accepts on every listener; ``backlog`` (None: :func:`listen_backlog`)
    is each listener's accept queue and ``max_handlers`` (None: no cap) the probes
    answered at once across all of them (:class:`HandlerSlots`).
    """

    def __init__(
        self,
        family: IPFamily,
        health: ProxyHealth,
        *,
        addresses: Sequence[IPAddress] | None = None,
        node_name: str = "",
        on_listen_error: ListenErrorCallback | None = None,
        backlog: int | None = None,
        max_handlers: int | None = DEFAULT_MAX_HANDLERS,
    ) -> None:
        if backlog is not None and backlog < 1:
            raise ValueError(f"listen backlog must be >= 1, got {backlog}")
        self.family = family
        self.health = health
        self.node_name = node_name
        self.on_listen_error = on_listen_error
        self.backlog = backlog
        self.slots = HandlerSlots(max_handlers, name=f"health-check-{family.value}")
        self._addresses = self._checked(addresses)
        self._lock = threading.Lock()
        self._listeners: dict[NamespacedName, _Listener] = {}
        # Health checks that could not be opened: (port, local endpoints), retried.
        self._unopened: dict[NamespacedName, tuple[int, int]] = {}
        self._loop: AcceptLoop | None = None

    def _checked(self, addresses: Sequence[IPAddress] | None) -> tuple[IPAddress, ...] | None:
        if addresses is None:
            return None
        wrong = [a for a in addresses if a.version != self.family.version]
        if wrong:
            raise ValueError(f"{self.family} health-check server given {wrong}")
        return tuple(dict.fromkeys(addresses))

    @property
    def addresses(self) -> tuple[IPAddress, ...] | None:
        """Where listeners bind (None: the family's wildcard)."""
        return self._addresses

    def set_addresses(self, addresses: Sequence[IPAddress] | None) -> bool:
        """Listen elsewhere from now on: open listeners are closed if the set changed.

        They are opened again on the new addresses by the next :meth:`sync_services`.
        Returns whether the set changed.
        """
        checked = self._checked(addresses)
        with self._lock:
            if checked == self._addresses:
                return False
            logger.info(
                "%s health checks move from %s to %s",
                self.family,
                self._describe(self._addresses),
                self._describe(checked),
            )
            self._addresses = checked
            for listener in self._listeners.values():
                self._close(listener)
            self._listeners.clear()
            self._unopened.clear()
        return True

    @staticmethod
    def _describe(addresses: tuple[IPAddress, ...] | None) -> str:
        if addresses is None:
            return "all addresses"
        return ", ".join(map(str, addresses)) or "no address"

    def sync_services(self, services: Mapping[NamespacedName, int]) -> None:
        """Make the listeners match ``services`` (Service -> health-check port).

        Listeners of vanished Services or changed ports close; new ones open.
        """
        failures: list[tuple[NamespacedName, int, str]] = []
        with self._lock:
            for name in list(self._listeners):
                listener = self._listeners[name]
                if services.get(name) != listener.port:
                    self._close_listener(name)
            unopened, self._unopened = self._unopened, {}
            for name, port in services.items():
                if name not in self._listeners:
                    count = unopened[name][1] if name in unopened else 0
                    self._open_listener(name, port, count, failures)
        self._report(failures)

    def sync_endpoints(self, endpoints: Mapping[NamespacedName, int]) -> None:
        """Set the local ready endpoint count of every Service (absent: 0)."""
        with self._lock:
            for name, listener in self._listeners.items():
                listener.endpoints = endpoints.get(name, 0)
            for name, (port, _count) in self._unopened.items():
                self._unopened[name] = (port, endpoints.get(name, 0))

    def update_services(self, changed: Mapping[NamespacedName, tuple[int, int]]) -> None:
        """Apply what changed for some Services, leaving the others as they are.

        ``changed`` maps a Service to its health-check port (0: none any more) and its
        local ready endpoint count. Listeners whose port changed or went away close, new
        ones open, and every listener that could not be opened before is tried again
        (as :meth:`sync_services` would): the work follows the Services given and the
        failed listeners, not every Service with a health check.
        """
        failures: list[tuple[NamespacedName, int, str]] = []
        with self._lock:
            for name, (port, count) in changed.items():
                listener = self._listeners.get(name)
                if listener is not None and listener.port != port:
                    self._close_listener(name)
                    listener = None
                self._unopened.pop(name, None)
                if listener is not None:
                    listener.endpoints = count
                elif port:
                    self._open_listener(name, port, count, failures)
            retry = [(n, p, c) for n, (p, c) in self._unopened.items() if n not in changed]
            for name, port, count in retry:
                del self._unopened[name]
                self._open_listener(name, port, count, failures)
        self._report(failures)

    def _open_listener(
        self,
        name: NamespacedName,
        port: int,
        count: int,
        failures: list[tuple[NamespacedName, int, str]],
    ) -> None:
        """Open ``name``'s listener (lock held); a failure is noted for a retry."""
        try:
            sockets = self._open(name, port)
        except OSError as err:
            message = (
                f'node {self.node_name} failed to start healthcheck "{name}" on port {port}: {err}'
            )
            logger.error("%s", message)
            failures.append((name, port, message))
            self._unopened[name] = (port, count)
            return
        logger.info("Opened health check for %s on port %d", name, port)
        self._listeners[name] = _Listener(port, sockets, count)

    def _close_listener(self, name: NamespacedName) -> None:
        listener = self._listeners.pop(name)
        logger.info("Closing health check for %s on port %d", name, listener.port)
        self._close(listener)

    def _report(self, failures: list[tuple[NamespacedName, int, str]]) -> None:
        if self.on_listen_error is None:
            return
        for name, port, message in failures:
            try:
                self.on_listen_error(name, port, message)
            except Exception:
                logger.exception("health-check listen-error callback failed")

    def listening(self) -> dict[NamespacedName, list[tuple[str, int]]]:
        """The bound socket addresses (host, port) of every open health check."""
        with self._lock:
            return {
                name: [sock.getsockname()[:2] for sock in listener.sockets]
                for name, listener in self._listeners.items()
            }

    def close(self) -> None:
        """Close every listener and stop accepting."""
        with self._lock:
            for listener in self._listeners.values():
                self._close(listener)
            self._listeners.clear()
            self._unopened.clear()
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.close()
        self.slots.close()

    def answer(self, service: NamespacedName) -> Response:
        """The answer to a probe for ``service``."""
        with self._lock:
            listener = self._listeners.get(service)
            count = None if listener is None else listener.endpoints
        if count is None:
            # Closed between accept and request: upstream answers with nothing.
            logger.error("Received a request for closed health check %s", service)
            return 200, {}, b""
        healthy = self.health.serving()
        body = (
            "{\n"
            '\t"service": {\n'
            f'\t\t"namespace": {json.dumps(service.namespace)},\n'
            f'\t\t"name": {json.dumps(service.name)}\n'
            "\t},\n"
            f'\t"localEndpoints": {count},\n'
            f'\t"serviceProxyHealthy": {"true" if healthy else "false"}\n'
            "}"
        )
        headers = {**JSON_HEADERS, "X-Load-Balancing-Endpoint-Weight": str(count)}
        return (200 if count > 0 and healthy else 503), headers, body.encode()

    def _open(self, name: NamespacedName, port: int) -> list[socket.socket]:
        if not 0 <= port <= 65535:
            raise OSError(f"port {port} out of range")
        if self._loop is None:
            self._loop = AcceptLoop(f"health-checks-{self.family.value}", self.slots)
        loop = self._loop
        hosts = (
            [self._wildcard()]
            if self._addresses is None
            else [str(address) for address in self._addresses]
        )
        sockets: list[socket.socket] = []
        try:
            for host in hosts:
                sockets.append(self._listen(host, port))
        except OSError:
            for sock in sockets:
                sock.close()
            raise
        for sock in sockets:
            loop.add(sock, functools.partial(self._serve, name=name))
        return sockets

    def _wildcard(self) -> str:
        return "0.0.0.0" if self.family is IPFamily.IPV4 else "::"

    def _listen(self, host: str, port: int) -> socket.socket:
        family = socket.AF_INET if self.family is IPFamily.IPV4 else socket.AF_INET6
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, port))
            sock.listen(self.backlog if self.backlog is not None else listen_backlog())
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock

    def _close(self, listener: _Listener) -> None:
        for sock in listener.sockets:
            if self._loop is not None:
                self._loop.remove(sock)
            else:
                sock.close()

    def _serve(self, conn: socket.socket, name: NamespacedName) -> None:
        conn.setblocking(True)
        try:
            peer = conn.getpeername()
            _ServiceHandler(conn, peer, _ServiceContext(self, name))
        except OSError as err:
            logger.debug("health check %s: connection failed: %s", name, err)
        except Exception:
            logger.exception("health check %s: handler failed", name)
        finally:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
