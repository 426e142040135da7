"""Health: the proxy's own health state, its ``/healthz`` and ``/livez`` server, and the
per-Service health-check servers that load balancers probe.

Semantics follow upstream kube-proxy (``pkg/proxy/healthcheck``, 1.33+):

* :class:`ProxyHealth` keeps, per IP family, when the proxier last synced successfully
  and since when an un-synced change has been waiting. The proxy is healthy when no
  family that has synced at least once has had a change waiting for ``health_timeout``
  (upstream: twice ``syncPeriod``). The node is *eligible* unless it is being deleted or
  carries the cluster autoscaler's ``ToBeDeletedByClusterAutoscaler`` taint (or is not
  known yet).
* Beyond upstream, :class:`ProxyHealth` also holds *data-plane faults*: what the proxy
  knows the kernel lacks of what it last wrote (rules removed by someone else and not yet
  repaired, syncs failing repeatedly), reported and cleared by whoever detects them
  (:meth:`ProxyHealth.report_data_plane_broken`,
  :meth:`ProxyHealth.report_data_plane_repaired`). A node that answers 200 while its
  rules are gone receives load-balancer traffic it cannot deliver.
* :class:`ProxyHealthServer` serves ``/healthz`` (200 iff healthy, no data-plane fault and
  the node eligible; a fault's reason is in the body) and ``/livez`` (200 iff healthy)
  with upstream's JSON body and headers.
* :class:`ServiceHealthServer` opens one listener per ``healthCheckNodePort`` (Services
  of type LoadBalancer with ``externalTrafficPolicy: Local``) and answers 200 when the
  Service has local ready endpoints and the proxy is healthy with no data-plane fault,
  503 otherwise.
* :class:`HealthObserver` ties them to a :class:`~kubeproxy.proxier.Proxier`: it is a
  :class:`~kubeproxy.proxier.SyncObserver` (queued / finished syncs; repeated failed
  syncs become a data-plane fault) and its :meth:`HealthObserver.after_sync` is a
  :class:`~kubeproxy.proxier.SyncHook`.

Every listener here is :mod:`kubeproxy.httpserving`'s (long accept queues, at most
:data:`DEFAULT_MAX_HANDLERS` handlers at once, binding and retrying as upstream); its
names are still importable from here.

Longer than most modules (about 870 lines): the health state and the two kinds of
servers that answer from it (``/healthz`` and the HealthCheckNodePorts) share its lock
and its fault rules, and :class:`HealthObserver` feeds both from the syncs; the listener
machinery, a concept of its own, lives in :mod:`kubeproxy.httpserving`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from socketserver import BaseServer
from typing import TYPE_CHECKING, Any, Final, Protocol

from kubeproxy.httpserving import (
    DEFAULT_MAX_HANDLERS,
    RETRY_INTERVAL,
    BackgroundServer,
    HandlerSlots,
    Response,
    Route,
    ServerBindError,
    listen_backlog,
    parse_bind_address,
    send,
)
from kubeproxy.objects import IPAddress, IPFamily, NamespacedName, NodeInfo

if TYPE_CHECKING:
    from kubeproxy.backend import ProxySnapshot, SyncChanges
    from kubeproxy.proxier import Proxier

__all__ = [
    "DEFAULT_HEALTHZ_ADDRESS",
    "DEFAULT_MAX_HANDLERS",
    "FAULT_FIRST_SYNC",
    "FAULT_RULES_REMOVED",
    "FAULT_SYNC_FAILURES",
    "SYNC_FAILURE_THRESHOLD",
    "BackgroundServer",
    "DataPlaneFault",
    "FamilyHealth",
    "HandlerSlots",
    "HealthMetrics",
    "HealthObserver",
    "HealthStatus",
    "ListenErrorCallback",
    "ProxyHealth",
    "ProxyHealthServer",
    "Response",
    "Route",
    "ServerBindError",
    "ServiceHealthServer",
    "format_time",
    "listen_backlog",
    "parse_bind_address",
]

logger = logging.getLogger(__name__)

DEFAULT_HEALTHZ_ADDRESS: Final = "0.0.0.0:10256"
"""Upstream's default ``healthzBindAddress``."""

FAULT_RULES_REMOVED: Final = "rules-removed"
"""The ``cause`` for :meth:`ProxyHealth.report_data_plane_broken` when rules the proxy
wrote were removed (or changed) by someone else and not yet repaired."""

FAULT_SYNC_FAILURES: Final = "sync-failures"
"""The ``cause`` :class:`HealthObserver` reports when syncs fail repeatedly."""

FAULT_FIRST_SYNC: Final = "first-sync"
"""The ``cause`` of :meth:`ProxyHealth.await_first_sync`: the rules are not written yet."""

SYNC_FAILURE_THRESHOLD: Final = 2
"""Failed syncs of a family in a row that make a data-plane fault.

One failure can be a passing refusal that the retry mends; a second one, a retry
interval later (``syncPeriod``), means the kernel stays behind what the proxy wants.
"""

_JSON_HEADERS: Final = {"Content-Type": "application/json", "X-Content-Type-Options": "nosniff"}


# --- time format ----------------------------------------------------------------------


def format_time(moment: float | None) -> str:
    """A wall-clock time (unix seconds) as Go's JSON encoding writes a ``time.Time``.

    RFC 3339 in UTC with the fraction trimmed of trailing zeros (``RFC3339Nano``);
    ``None`` is Go's zero time, ``0001-01-01T00:00:00Z``.
    """
    if moment is None:
        return "0001-01-01T00:00:00Z"
    when = datetime.fromtimestamp(moment, UTC)
    text = when.strftime("%Y-%m-%dT%H:%M:%S")
    fraction = f"{when.microsecond:06d}".rstrip("0")
    if fraction:
        text += "." + fraction
    return text + "Z"


# --- health state ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FamilyHealth:
    """The health of one IP family's proxier (``status[family]`` in the JSON body)."""

    last_updated: float
    healthy: bool


@dataclass(frozen=True, slots=True)
class DataPlaneFault:
    """Something the kernel lacks of what the proxy last wrote, as reported.

    ``cause`` names the detector (:data:`FAULT_RULES_REMOVED`,
    :data:`FAULT_SYNC_FAILURES`, or a name of the caller's own); ``since`` is the
    wall-clock time of the first report since the last repair.
    """

    family: IPFamily
    cause: str
    reason: str
    since: float

    def describe(self) -> str:
        """``IPv4: <reason>``: one line for logs and the ``/healthz`` body."""
        return f"{self.family}: {self.reason}"


@dataclass(frozen=True, slots=True)
class HealthStatus:
    """What :meth:`ProxyHealth.health` found.

    ``last_updated`` is the latest successful sync of any family (None before the
    first); ``status`` has an entry per family that has synced at least once.
    ``healthy`` is upstream's verdict (no change has waited too long); ``faults`` are
    the data-plane faults reported now, which :attr:`serving` adds to it.
    """

    last_updated: float | None
    current_time: float
    healthy: bool
    status: Mapping[IPFamily, FamilyHealth] = field(default_factory=dict)
    faults: tuple[DataPlaneFault, ...] = ()

    @property
    def serving(self) -> bool:
        """Healthy and no data-plane fault: whether traffic sent here is delivered."""
        return self.healthy and not self.faults

    def to_json(
        self,
        *,
        last_updated: float | None,
        node_eligible: bool | None,
        with_faults: bool = False,
    ) -> str:
        """The compact JSON body upstream sends (keys in upstream's order).

        ``last_updated`` is the top-level value to report (upstream reports the current
        time on a 200); ``node_eligible`` is left out when None (``/livez``). With
        ``with_faults`` (``/healthz``) a fault makes ``healthy`` false (for its family
        too) and adds ``reason``: every fault's description, joined by ``"; "``. Without
        faults the body has exactly upstream's keys.
        """
        faulty = {fault.family for fault in self.faults} if with_faults else set()
        body: dict[str, Any] = {
            "lastUpdated": format_time(last_updated),
            "currentTime": format_time(self.current_time),
        }
        if node_eligible is not None:
            body["nodeEligible"] = node_eligible
        body["healthy"] = self.healthy and not faulty
        if self.status:
            body["status"] = {
                family.value: {
                    "lastUpdated": format_time(state.last_updated),
                    "healthy": state.healthy and family not in faulty,
                }
                for family, state in sorted(self.status.items())
            }
        if faulty:
            body["reason"] = "; ".join(fault.describe() for fault in self.faults)
        return json.dumps(body, separators=(",", ":"))


class ProxyHealth:
    """Per-family sync timestamps, data-plane faults and the node's eligibility;
    thread-safe.

    ``clock`` returns wall-clock seconds (it also stamps the reported times).
    ``node`` is the node as known at start; None means unknown, which makes the node
    ineligible (as upstream's newest code) until :meth:`set_node` is called.

    Data-plane faults (:meth:`report_data_plane_broken`) are for whoever learns that the
    kernel no longer holds what the proxy last wrote; each is kept per family and cause
    until that cause's :meth:`report_data_plane_repaired`.
    """

    def __init__(
        self,
        health_timeout: float,
        clock: Callable[[], float] = time.time,
        *,
        node: NodeInfo | None = None,
    ) -> None:
        if health_timeout <= 0:
            raise ValueError(f"health timeout must be positive, got {health_timeout}")
        self.health_timeout = health_timeout
        self.clock = clock
        self._lock = threading.Lock()
        self._last_updated: dict[IPFamily, float] = {}
        self._oldest_queued: dict[IPFamily, float] = {}
        self._faults: dict[tuple[IPFamily, str], DataPlaneFault] = {}
        self._node = node

    def queued_update(self, family: IPFamily) -> None:
        """A change for ``family`` is waiting for a sync (keeps the oldest such time)."""
        with self._lock:
            self._oldest_queued.setdefault(family, self.clock())

    def updated(self, family: IPFamily) -> None:
        """``family`` synced successfully: nothing is waiting any more."""
        with self._lock:
            self._oldest_queued.pop(family, None)
            self._last_updated[family] = self.clock()
            self._faults.pop((family, FAULT_FIRST_SYNC), None)

    def await_first_sync(self, families: Iterable[IPFamily]) -> None:
        """Until each of ``families`` has synced once (:meth:`updated`), hold the
        :data:`FAULT_FIRST_SYNC` fault for it: ``/healthz`` and the HealthCheckNodePorts
        answer 503 ("waiting for the first sync"), ``/livez`` 200. A proxy serving its
        health endpoints from the first second of a long start (100k Services) must not
        draw load-balancer traffic to a node whose rules are not written yet."""
        with self._lock:
            now = self.clock()
            for family in families:
                if family not in self._last_updated:
                    self._faults.setdefault(
                        (family, FAULT_FIRST_SYNC),
                        DataPlaneFault(family, FAULT_FIRST_SYNC, "waiting for the first sync", now),
                    )

    def report_data_plane_broken(self, family: IPFamily, cause: str, reason: str) -> None:
        """Report that the kernel no longer holds what the proxy last wrote for ``family``.

        From now until :meth:`report_data_plane_repaired` with the same ``family`` and
        ``cause``, ``/healthz`` answers 503 with ``reason`` in its JSON body (``healthy``
        false, ``reason`` "IPv4: <reason>") and every HealthCheckNodePort answers 503
        (``serviceProxyHealthy`` false), so load balancers stop sending traffic the node
        cannot deliver. ``/livez`` is not affected: restarting the proxy is not the
        repair, the proxy's own full sync is.

        ``cause`` names the detector: :data:`FAULT_RULES_REMOVED` for rules removed or
        changed by someone else, :data:`FAULT_SYNC_FAILURES` (reported by
        :class:`HealthObserver`) for repeated failed syncs, or any name of the caller's.
        Faults of different causes are independent: one detector's repair never clears
        another's fault. Reporting again updates the reason and keeps the first time;
        the first report of a fault logs one warning.
        """
        if not cause or not reason:
            raise ValueError("a data-plane fault needs a cause and a reason")
        with self._lock:
            previous = self._faults.get((family, cause))
            since = self.clock() if previous is None else previous.since
            self._faults[family, cause] = DataPlaneFault(family, cause, reason, since)
        if previous is None:
            logger.warning("Data plane broken (%s), /healthz fails: %s: %s", cause, family, reason)

    def report_data_plane_repaired(self, family: IPFamily, cause: str) -> None:
        """Clear the fault ``cause`` reported for ``family`` (nothing if none is set).

        Call it once the kernel holds what the proxy wrote again (after the repairing
        sync succeeded). Logs one line when a fault was set.
        """
        with self._lock:
            fault = self._faults.pop((family, cause), None)
            now = self.clock()
        if fault is not None:
            logger.info(
                "Data plane repaired (%s) for %s after %.1fs", cause, family, now - fault.since
            )

    def data_plane_faults(self) -> tuple[DataPlaneFault, ...]:
        """The faults reported and not repaired, oldest first."""
        with self._lock:
            return self._sorted_faults()

    def _sorted_faults(self) -> tuple[DataPlaneFault, ...]:
        return tuple(sorted(self._faults.values(), key=lambda f: (f.since, f.family, f.cause)))

    def set_node(self, node: NodeInfo | None) -> None:
        """The node as last seen (None: not known)."""
        with self._lock:
            self._node = node

    def node_eligible(self) -> bool:
        """False when the node is unknown, being deleted, or tainted for deletion."""
        with self._lock:
            node = self._node
        return node is not None and not node.deleting and not node.to_be_deleted_taint

    def health(self) -> HealthStatus:
        """The health now: unhealthy if a synced family has had a change waiting too long.

        Families that never synced do not count (the proxy is healthy while starting).
        """
        with self._lock:
            now = self.clock()
            status: dict[IPFamily, FamilyHealth] = {}
            healthy = True
            for family, last in self._last_updated.items():
                queued = self._oldest_queued.get(family)
                family_healthy = queued is None or now - queued < self.health_timeout
                healthy = healthy and family_healthy
                status[family] = FamilyHealth(last, family_healthy)
            last_updated = max(self._last_updated.values(), default=None)
            faults = self._sorted_faults()
        return HealthStatus(last_updated, now, healthy, status, faults)

    def healthy(self) -> bool:
        """Shorthand for ``health().healthy`` (upstream's verdict, faults aside)."""
        return self.health().healthy

    def serving(self) -> bool:
        """Shorthand for ``health().serving``: healthy and no data-plane fault."""
        return self.health().serving


class HealthMetrics(Protocol):
    """Counts health responses (``kubeproxy_proxy_healthz_total`` / ``..._livez_total``)."""

    def healthz_response(self, code: int) -> None:
        """A ``/healthz`` answer with status ``code`` was sent."""
        ...

    def livez_response(self, code: int) -> None:
        """A ``/livez`` answer with status ``code`` was sent."""
        ...


# --- /healthz and /livez --------------------------------------------------------------


class ProxyHealthServer:
    """``/healthz`` and ``/livez`` on the healthz address (default ``0.0.0.0:10256``).

    ``/healthz``: 200 when healthy, with no data-plane fault, and the node is eligible,
    else 503 (a fault adds its ``reason`` to the body). ``/livez``: 200 when healthy,
    else 503. Both send compact JSON (``lastUpdated``, ``currentTime``,
    [``nodeEligible``,] ``healthy``, ``status`` per family) with ``Content-Type:
    application/json`` and ``X-Content-Type-Options: nosniff``; on a 200 ``lastUpdated``
    is the current time (upstream keeps this for old probes). Each answer is counted in
    ``metrics`` when given. Call :meth:`start` and :meth:`stop`. ``backlog`` and
    ``max_handlers`` are :class:`BackgroundServer`'s.
    """

    def __init__(
        self,
        address: str,
        health: ProxyHealth,
        metrics: HealthMetrics | None = None,
        *,
        hard_fail: bool = False,
        retry_interval: float = RETRY_INTERVAL,
        backlog: int | None = None,
        max_handlers: int | None = DEFAULT_MAX_HANDLERS,
    ) -> None:
        self.health = health
        self.metrics = metrics
        self.server = BackgroundServer(
            "healthz",
            address,
            {"/healthz": self.healthz, "/livez": self.livez},
            hard_fail=hard_fail,
            retry_interval=retry_interval,
            backlog=backlog,
            max_handlers=max_handlers,
        )

    @property
    def port(self) -> int | None:
        """The bound port, or None while not bound."""
        return self.server.port

    def start(self) -> None:
        """Start serving (raises :class:`ServerBindError` with ``hard_fail``)."""
        self.server.start()

    def stop(self) -> None:
        """Stop serving."""
        self.server.stop()

    def healthz(self) -> Response:
        """The ``/healthz`` answer."""
        status = self.health.health()
        eligible = self.health.node_eligible()
        code = 200 if status.serving and eligible else 503
        if self.metrics is not None:
            self.metrics.healthz_response(code)
        reported = status.current_time if code == 200 else status.last_updated
        body = status.to_json(last_updated=reported, node_eligible=eligible, with_faults=True)
        return code, _JSON_HEADERS, body.encode()

    def livez(self) -> Response:
        """The ``/livez`` answer."""
        status = self.health.health()
        code = 200 if status.healthy else 503
        if self.metrics is not None:
            self.metrics.livez_response(code)
        reported = status.current_time if code == 200 else status.last_updated
        body = status.to_json(last_updated=reported, node_eligible=None)
        return code, _JSON_HEADERS, body.encode()


# --- per-Service health checks --------------------------------------------------------


class _AcceptLoop:
    """One thread accepting on many listening sockets; each connection gets a thread.

    A thread per listener would wake up hundreds of times a second with many
    LoadBalancer Services; one epoll set costs nothing while idle. Handler threads take
    a slot of ``slots`` before the connection is accepted: while all are busy the loop
    waits and connections queue in the listeners' accept queues.
    """

    def __init__(self, name: str, slots: HandlerSlots) -> None:
        self.slots = slots
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, sock: socket.socket, handle: Callable[[socket.socket], None]) -> None:
        """Start accepting on ``sock`` (non-blocking, listening); ``handle`` runs in a
        thread of its own for each connection, which it must close."""
        self._selector.register(sock, selectors.EVENT_READ, handle)

    def remove(self, sock: socket.socket) -> None:
        """Stop accepting on ``sock`` and close it."""
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        sock.close()

    def close(self) -> None:
        """Stop the loop (listeners still registered are closed)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for key in list(self._selector.get_map().values()):
            if key.data is not None:
                self.remove(key.fileobj)  # type: ignore[arg-type]
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _run(self) -> None:
        while not self._closed:
            try:
                ready = self._selector.select()
            except OSError as err:
                logger.error("health-check accept loop: %s", err)
                time.sleep(0.1)
                continue
            for key, _ in ready:
                if key.data is None:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(64)
                    continue
                if not self.slots.acquire(lambda: self._closed):
                    return
                listener: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    conn, _ = listener.accept()
                except OSError:  # nothing to accept any more, or closed under us by remove()
                    self.slots.release()
                    continue
                self.slots.run(functools.partial(key.data, conn))


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
        self._loop: _AcceptLoop | None = None

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
        headers = {**_JSON_HEADERS, "X-Load-Balancing-Endpoint-Weight": str(count)}
        return (200 if count > 0 and healthy else 503), headers, body.encode()

    def _open(self, name: NamespacedName, port: int) -> list[socket.socket]:
        if not 0 <= port <= 65535:
            raise OSError(f"port {port} out of range")
        if self._loop is None:
            self._loop = _AcceptLoop(f"health-checks-{self.family.value}", self.slots)
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


# --- wiring to the proxier ------------------------------------------------------------


class HealthObserver:
    """Feeds :class:`ProxyHealth` and the per-family :class:`ServiceHealthServer`\\ s.

    As a :class:`~kubeproxy.proxier.SyncObserver`: a queued sync marks a change as
    waiting, a successful sync marks the family as updated; ``sync_failure_threshold``
    failed syncs of a family in a row report a :data:`FAULT_SYNC_FAILURES` data-plane
    fault (with the last error), which the next successful sync repairs. Give
    :meth:`after_sync` to
    the proxier as a :class:`~kubeproxy.proxier.SyncHook`: after each successful sync
    it records the node (for eligibility), moves the family's Service health server to
    the resolved ``nodePortAddresses`` (all addresses when they match all), and syncs
    its Services and local endpoint counts.
    """

    def __init__(
        self,
        health: ProxyHealth,
        service_health: Mapping[IPFamily, ServiceHealthServer] | None = None,
        *,
        sync_failure_threshold: int = SYNC_FAILURE_THRESHOLD,
    ) -> None:
        if sync_failure_threshold < 1:
            raise ValueError(f"sync failure threshold must be >= 1, got {sync_failure_threshold}")
        self.health = health
        self.service_health: dict[IPFamily, ServiceHealthServer] = dict(service_health or {})
        self.sync_failure_threshold = sync_failure_threshold
        self._failures_in_a_row: dict[IPFamily, int] = {}

    def sync_queued(self, family: IPFamily) -> None:
        """A change waits for ``family``."""
        self.health.queued_update(family)

    def sync_finished(
        self,
        family: IPFamily,
        full: bool,
        duration: float,
        error: BaseException | None,
        snapshot_sizes: tuple[int, int],
    ) -> None:
        """A successful sync makes ``family`` up to date; failures in a row are a fault."""
        if error is None:
            self._failures_in_a_row.pop(family, None)
            self.health.updated(family)
            self.health.report_data_plane_repaired(family, FAULT_SYNC_FAILURES)
            return
        count = self._failures_in_a_row.get(family, 0) + 1
        self._failures_in_a_row[family] = count
        if count >= self.sync_failure_threshold:
            kind = "full" if full else "partial"
            self.health.report_data_plane_broken(
                family,
                FAULT_SYNC_FAILURES,
                f"{count} syncs in a row failed, the last ({kind}): {_first_line(error)}",
            )

    def endpoints_trigger_times(self, family: IPFamily, times: list[float]) -> None:
        """Not used for health."""

    def after_sync(self, proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Update node eligibility and the family's Service health checks.

        A full sync (or a move to other addresses) reconciles every health check; a
        partial one only the changed Services' (60 % of a 30k-Service daemon's partial
        sync went to rebuilding every Service's port and endpoint count before).
        """
        self.health.set_node(snapshot.node)
        server = self.service_health.get(snapshot.family)
        if server is None:
            return
        node_ports = snapshot.node_port_addresses
        moved = server.set_addresses(None if node_ports.match_all else node_ports.addresses)
        if changes.full or moved:
            server.sync_services(proxier.health_check_node_ports())
            server.sync_endpoints(proxier.local_ready_endpoints())
            return
        port, count = proxier.health_check_node_port, proxier.local_ready_count
        server.update_services(
            {service: (port(service), count(service)) for service in changes.changed_services}
        )

    def close(self) -> None:
        """Close every Service health server."""
        for server in self.service_health.values():
            server.close()


def _first_line(error: BaseException, limit: int = 300) -> str:
    """An error as one bounded line (nft's messages run over many lines)."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
