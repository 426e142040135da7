"""Service change tracking: collapse pending Service changes, then apply them to a map.

Handlers call :meth:`ServiceChangeTracker.update` for every add, update and delete; the
tracker keeps at most one pending change per Service (its ports before the first pending
change, and the latest ports), and forgets a change that nets out to nothing. At sync
time :meth:`ServicePortMap.apply` folds the pending changes into the map of every proxied
Service port and reports what changed. Upstream's ``ServiceChangeTracker`` and
``ServicePortMap`` behave the same way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeVar

from kubeproxy.handlers import KubeObject
from kubeproxy.objects import (
    IPAddress,
    IPFamily,
    NamespacedName,
    Protocol,
    ServicePort,
    ServicePortName,
)
from kubeproxy.parse import InvalidObject, parse_service, service_key
from kubeproxy.portindex import PortsByService

__all__ = ["ServiceChangeTracker", "ServicePortMap", "ServiceUpdateResult", "UdpFrontend"]

logger = logging.getLogger(__name__)

_Ports = Mapping[ServicePortName, ServicePort]
_NO_PORTS: _Ports = {}
_K = TypeVar("_K")


@dataclass(frozen=True, slots=True)
class ServiceUpdateResult:
    """What one :meth:`ServicePortMap.apply` changed.

    ``updated_services`` are the Services whose ports differ from before; a UDP cluster
    IP is in ``deleted_udp_cluster_ips`` when some UDP port used it before and none does
    now (its conntrack entries are stale).
    """

    updated_services: frozenset[NamespacedName]
    deleted_udp_cluster_ips: frozenset[IPAddress]


@dataclass(slots=True)
class _PendingChange:
    previous: _Ports
    current: _Ports


class ServiceChangeTracker:
    """Pending Service changes of one IP family, collapsed per Service.

    Invalid objects: a Service the proxy cannot use is logged once per event (the
    :class:`~kubeproxy.parse.InvalidObject` text, at warning level), counted in
    :attr:`invalid_objects`, and otherwise ignored. An update that makes a known Service
    invalid therefore keeps its last valid ports in place: the kernel keeps serving the
    last good rules rather than dropping a Service because of, say, a typo in one
    external IP; deleting the Service still removes them. The IPv6 tracker passes over a
    Service whose cluster IPs are all IPv4 texts, unless it holds that Service (or the
    one it was renamed from): it has no IPv6 ports to give, and if it is malformed the
    IPv4 tracker reports it (the event is still counted in :attr:`total_changes`).

    The "before" side of a pending change is the tracker's own record of the Service's
    ports (the result of the last valid event), not a re-conversion of the ``previous``
    object the caller passes: for a consistent event stream the two are the same, and the
    record stays correct when ``previous`` is invalid or an event was missed. The caller's
    ``previous`` is only used for its name on deletion.

    :meth:`update` may be called from other threads than :meth:`ServicePortMap.apply`.
    """

    def __init__(self, family: IPFamily) -> None:
        self.family = family
        self.total_changes = 0
        """Events received (every :meth:`update` carrying an object), for metrics."""
        self.invalid_objects = 0
        """Objects skipped as invalid, for metrics."""
        self._lock = threading.Lock()
        self._pending: dict[NamespacedName, _PendingChange] = {}
        # The ports of every known Service after all events so far (applied or pending):
        # the port itself when it is the only one (most Services), else a tuple; a tuple
        # of one was 56 bytes a Service more, and a dict 224 (17 MB at 100k).
        self._known: dict[NamespacedName, ServicePort | tuple[ServicePort, ...]] = {}

    @property
    def pending_count(self) -> int:
        """How many Services have a pending change."""
        return len(self._pending)

    def update(self, previous: KubeObject | None, current: KubeObject | None) -> bool:
        """Record an add (``previous`` None), update, or delete (``current`` None).

        Returns whether any change is pending at all (not whether this call changed
        something), as upstream.
        """
        if previous is None and current is None:
            return bool(self._pending)
        subject = current if current is not None else previous
        assert subject is not None
        with self._lock:
            self.total_changes += 1
            if (
                current is not None
                and self.family is IPFamily.IPV6
                and self._neither_held(_names_if_ipv4_only(current), previous)
            ):
                # Not this family's Service, and none this tracker holds: what the
                # parse would give ({}, or an error the IPv4 tracker reports) changes
                # nothing here. On an IPv4 cluster's dual-stack node every Service came
                # here to be parsed for nothing (100k Services: about 0.4 s of a start).
                return bool(self._pending)
        try:
            key = service_key(subject)
            ports = _NO_PORTS if current is None else parse_service(current, self.family, key=key)
        except InvalidObject as err:
            self._skip(err)
            return bool(self._pending)
        renamed_from: NamespacedName | None = None
        if previous is not None and current is not None:
            try:
                renamed_from = service_key(previous)
            except InvalidObject:
                renamed_from = None
            if renamed_from == key:
                renamed_from = None
        with self._lock:
            if renamed_from is not None:
                # Names are immutable in Kubernetes; treat a rename as delete plus add.
                self._record(renamed_from, _NO_PORTS)
            self._record(key, ports)
            return bool(self._pending)

    def _neither_held(self, names: tuple[str, str] | None, previous: KubeObject | None) -> bool:
        """Whether ``names`` (of the current object; None: unknown) and ``previous``'s
        are surely neither known nor pending here (the lock held)."""
        if names is None:
            return False
        if not self._known and not self._pending:
            return True
        keys = [NamespacedName(*names)]
        if previous is not None:
            before = _names(previous)
            if before is None:
                return False
            keys.append(NamespacedName(*before))
        return not any(key in self._known or key in self._pending for key in keys)

    def _skip(self, err: InvalidObject) -> None:
        logger.warning("%s", err)
        with self._lock:
            self.invalid_objects += 1

    def _record(self, key: NamespacedName, ports: _Ports) -> None:
        pending = self._pending.get(key)
        known = tuple(ports.values())
        if pending is None:
            held = self._known.get(key, ())
            before = (held,) if isinstance(held, ServicePort) else held
            if before != known:
                self._pending[key] = _PendingChange({p.name: p for p in before}, ports)
        elif pending.previous == ports:
            del self._pending[key]
        else:
            pending.current = ports
        if known:
            self._known[key] = known[0] if len(known) == 1 else known
        else:
            self._known.pop(key, None)

    def _checkout(self) -> dict[NamespacedName, _PendingChange]:
        with self._lock:
            pending, self._pending = self._pending, {}
        return pending


def _names(service: KubeObject) -> tuple[str, str] | None:
    """A Service's namespace and name as given (not validated), None when not strings."""
    metadata = service.get("metadata") if type(service) is dict else None
    if type(metadata) is not dict:
        return None
    namespace, name = metadata.get("namespace"), metadata.get("name")
    if type(namespace) is not str or type(name) is not str:
        return None
    return namespace, name


def _names_if_ipv4_only(service: KubeObject) -> tuple[str, str] | None:
    """:func:`_names` of a Service whose cluster IPs surely hold no IPv6 address (no text
    with a colon: only such a text parses to one), None when unsure."""
    spec = service.get("spec") if type(service) is dict else None
    if type(spec) is not dict:
        return None
    listed = spec.get("clusterIPs")
    if listed is not None:
        if type(listed) is not list:
            return None
        for text in listed:
            if type(text) is not str or ":" in text:
                return None
    primary = spec.get("clusterIP")
    if primary is not None and (type(primary) is not str or ":" in primary):
        return None
    return _names(service)


UdpFrontend = tuple[IPAddress, int]
"""A UDP Service frontend: an address (cluster IP, external IP or load-balancer VIP) and
the Service port."""


class ServicePortMap(dict[ServicePortName, ServicePort]):
    """Every proxied Service port of one family, as of the last :meth:`apply`.

    Change it only through :meth:`apply`: alongside, the map keeps indexes a sync reads
    instead of scanning every port: the port names of every Service (a changed Service's
    ports), a count of UDP ports per cluster IP (deleted UDP cluster IPs), the
    health-check node port of every Service that has one, and the UDP frontends and
    NodePorts with the ports they serve (stale UDP flows). Each is kept up to date as
    ports come and go, so what a sync costs follows what changed.
    """

    __slots__ = (
        "_health_check_ports",
        "_ports_by_service",
        "_udp_frontends",
        "_udp_node_ports",
        "_udp_ports_by_ip",
    )

    def __init__(self, ports: Mapping[ServicePortName, ServicePort] | None = None) -> None:
        super().__init__()
        self._udp_ports_by_ip: dict[IPAddress, int] = {}
        self._ports_by_service = PortsByService()
        self._health_check_ports: dict[NamespacedName, int] = {}
        self._udp_frontends: dict[UdpFrontend, set[ServicePortName]] = {}
        self._udp_node_ports: dict[int, set[ServicePortName]] = {}
        if ports:
            self._insert(ports.items())
            for service in self._ports_by_service:
                self._index_health_check(service)

    @property
    def ports_by_service(self) -> Mapping[NamespacedName, Collection[ServicePortName]]:
        """The port names of every Service in the map (a read-only view; each Service's
        names once, in the order they came)."""
        return MappingProxyType(self._ports_by_service)

    @property
    def udp_frontends(self) -> Mapping[UdpFrontend, AbstractSet[ServicePortName]]:
        """The UDP ports answering at each (address, port) frontend (a read-only view)."""
        return MappingProxyType(self._udp_frontends)

    @property
    def udp_node_ports(self) -> Mapping[int, AbstractSet[ServicePortName]]:
        """The UDP ports answering at each NodePort (a read-only view)."""
        return MappingProxyType(self._udp_node_ports)

    def _insert(self, ports: Iterable[tuple[ServicePortName, ServicePort]]) -> None:
        for name, port in ports:
            old = self.get(name)
            if old is not None:
                self._forget(old)
            self[name] = port
            self._ports_by_service.add(name)
            if port.protocol is Protocol.UDP:
                ip = port.cluster_ip
                self._udp_ports_by_ip[ip] = self._udp_ports_by_ip.get(ip, 0) + 1
                for frontend in _frontends(port):
                    self._udp_frontends.setdefault(frontend, set()).add(name)
                if port.node_port:
                    self._udp_node_ports.setdefault(port.node_port, set()).add(name)

    def _forget(self, port: ServicePort) -> None:
        """Drop ``port`` from the side indexes (the caller removes or replaces it)."""
        self._ports_by_service.discard(port.name)
        if port.protocol is Protocol.UDP:
            ip = port.cluster_ip
            left = self._udp_ports_by_ip[ip] - 1
            if left:
                self._udp_ports_by_ip[ip] = left
            else:
                del self._udp_ports_by_ip[ip]
            for frontend in _frontends(port):
                _discard(self._udp_frontends, frontend, port.name)
            if port.node_port:
                _discard(self._udp_node_ports, port.node_port, port.name)

    def _index_health_check(self, service: NamespacedName) -> None:
        """Note the health-check node port of ``service`` as its ports now say."""
        hcnp = 0
        for name in self._ports_by_service.get(service, ()):
            hcnp = self[name].health_check_node_port or hcnp
        if hcnp:
            self._health_check_ports[service] = hcnp
        else:
            self._health_check_ports.pop(service, None)

    def apply(self, tracker: ServiceChangeTracker) -> ServiceUpdateResult:
        """Fold the tracker's pending changes into this map, consuming them."""
        changes = tracker._checkout()
        maybe_deleted: set[IPAddress] = set()
        for change in changes.values():
            for name in change.previous:
                old = self.pop(name, None)
                if old is None:
                    logger.error("Service port %s to remove is not in the map", name)
                    continue
                self._forget(old)
                if old.protocol is Protocol.UDP:
                    maybe_deleted.add(old.cluster_ip)
            self._insert(change.current.items())
        for service in changes:
            self._index_health_check(service)
        deleted = frozenset(ip for ip in maybe_deleted if ip not in self._udp_ports_by_ip)
        return ServiceUpdateResult(frozenset(changes), deleted)

    def health_check_node_ports(self) -> dict[NamespacedName, int]:
        """The health-check node port of every Service that has one (a copy)."""
        return dict(self._health_check_ports)

    def health_check_node_port(self, service: NamespacedName) -> int:
        """The health-check node port of ``service``, 0 if it has none."""
        return self._health_check_ports.get(service, 0)

    def udp_cluster_ips(self) -> frozenset[IPAddress]:
        """Every cluster IP some UDP port uses."""
        return frozenset(self._udp_ports_by_ip)


def _frontends(port: ServicePort) -> Iterable[UdpFrontend]:
    number = port.port
    yield port.cluster_ip, number
    for address in port.load_balancer_vips:
        yield address, number
    for address in port.external_ips:
        yield address, number


def _discard(index: dict[_K, set[ServicePortName]], key: _K, name: ServicePortName) -> None:
    names = index.get(key)
    if names is not None:
        names.discard(name)
        if not names:
            del index[key]
