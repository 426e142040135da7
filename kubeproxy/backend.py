"""The backend contract: what the core hands a renderer at every sync, and what it expects back.

A backend (nftables, iptables, ipvs, or an out-of-tree one) turns a :class:`ProxySnapshot`
into kernel state. The core has already done the work that is the same for every backend:
merging EndpointSlices, traffic policy, topology, the terminating fallback, resolving
``nodePortAddresses``, the local-traffic detector of this family. A backend never
re-derives any of it.

Backends are found through the ``kubeproxy.backends`` entry-point group; each entry point
is a :class:`BackendFactory`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

from kubeproxy.config import LocalDetector, ProxierConfig
from kubeproxy.objects import (
    CategorizedEndpoints,
    Endpoint,
    Endpoints,
    IPAddress,
    IPFamily,
    IPNetwork,
    NamespacedName,
    NodeInfo,
    ServicePort,
    ServicePortName,
)

__all__ = [
    "Backend",
    "BackendFactory",
    "NodePortAddresses",
    "ProxySnapshot",
    "SkippedPorts",
    "SyncChanges",
    "SyncError",
]

T = TypeVar("T")
_NO_ENDPOINTS = CategorizedEndpoints()


class SyncError(Exception):
    """A sync the kernel refused. The backend left the previous rules in place."""


@dataclass(frozen=True, slots=True)
class NodePortAddresses:
    """Where NodePorts are accepted, for one family.

    ``match_all`` means every local address of the node (except loopback); otherwise
    exactly ``addresses``. ``cidrs`` keeps what the configuration said, for backends that
    match by CIDR.
    """

    match_all: bool = False
    addresses: tuple[IPAddress, ...] = ()
    cidrs: tuple[IPNetwork, ...] = ()


@dataclass(frozen=True, slots=True)
class ProxySnapshot:
    """The full current view of one IP family, already computed.

    The mappings are read-only views of the core's state: read them during ``sync`` and
    do not keep references to them afterwards.

    ``services`` holds every proxied Service port of this family; ``categorized`` has an
    entry for every key of ``services`` (an empty one when the port has no endpoints);
    ``endpoints`` holds the merged, sorted endpoints per port as the EndpointSlices say,
    before policy. ``ports_by_service`` lists the port names of every Service in
    ``services``, so an incremental sync finds a changed Service's ports directly.
    """

    family: IPFamily
    node: NodeInfo
    services: Mapping[ServicePortName, ServicePort]
    endpoints: Mapping[ServicePortName, Endpoints]
    categorized: Mapping[ServicePortName, CategorizedEndpoints]
    service_cidrs: tuple[IPNetwork, ...] = ()
    node_port_addresses: NodePortAddresses = field(default_factory=NodePortAddresses)
    local_detector: LocalDetector = field(default_factory=LocalDetector)
    ports_by_service: Mapping[NamespacedName, Collection[ServicePortName]] | None = None

    def ports_of(self, service: NamespacedName) -> list[ServicePortName]:
        """The port names of one Service present in this snapshot, sorted.

        Uses ``ports_by_service`` when the snapshot has it (the core always fills it); a
        snapshot built by hand without it costs a scan of every port.
        """
        if self.ports_by_service is not None:
            return sorted(self.ports_by_service.get(service, ()))
        return sorted(name for name in self.services if name.service == service)


@dataclass(frozen=True, slots=True)
class SyncChanges:
    """What changed since the last successful sync.

    ``full`` asks the backend to reconcile everything against the kernel (first sync,
    the periodic full sync, after a failure, after a node topology change); otherwise the
    backend may touch only the Services in ``changed_services`` (a Service is listed when
    the Service object or any of its EndpointSlices changed, including deletions).

    ``deleted_udp_cluster_ips`` and ``stale_udp_endpoints`` are for conntrack cleanup:
    UDP service IPs that went away, and (service port, endpoint) pairs of UDP endpoints
    that are no longer used.
    """

    full: bool
    changed_services: frozenset[NamespacedName] = frozenset()
    deleted_udp_cluster_ips: frozenset[IPAddress] = frozenset()
    stale_udp_endpoints: tuple[tuple[ServicePortName, Endpoint], ...] = ()
    conntrack_cleanup_required: bool = False


@runtime_checkable
class Backend(Protocol):
    """A renderer of one IP family's snapshot into kernel state."""

    @property
    def family(self) -> IPFamily:
        """The IP family this backend programs."""
        ...

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Make the kernel match ``snapshot``, atomically.

        Raises :class:`SyncError` when the kernel refused the change; the previous rules
        must then still be in place, and the core asks for a full sync next time.
        """
        ...

    def cleanup(self) -> None:
        """Remove everything this backend ever created (tables, chains, sets, links)."""
        ...


class BackendFactory(Protocol):
    """Creates a backend for one family (the ``kubeproxy.backends`` entry point).

    ``netns`` names a network namespace (as ``ip netns`` knows it) to program instead of
    the current one; tests and the flow-case runner use it.
    """

    def __call__(
        self, family: IPFamily, config: ProxierConfig, *, netns: str | None = None
    ) -> Backend:
        """Return a new backend."""
        ...


class SkippedPorts:
    """The Service ports a backend could not render, each with its reason.

    :meth:`render` turns one port of a snapshot into whatever the backend writes; a port
    whose rendering raises :class:`ValueError` (a value the kernel tool cannot take) is
    skipped with one error line on ``logger``, logged again only when its reason changes,
    so a bad Service costs one line, not one per sync, and never breaks the others.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self.reasons: dict[ServicePortName, str] = {}
        """Why each skipped port was skipped."""

    def render(
        self,
        snapshot: ProxySnapshot,
        name: ServicePortName,
        render: Callable[[ServicePort, CategorizedEndpoints], T],
    ) -> T | None:
        """``render(port, categorized endpoints)`` of ``name`` in ``snapshot``.

        None when the port is not in the snapshot (it is then no longer skipped either)
        or when ``render`` raised :class:`ValueError` (the port is skipped).
        """
        port = snapshot.services.get(name)
        if port is None:
            self.reasons.pop(name, None)
            return None
        try:
            rendered = render(port, snapshot.categorized.get(name, _NO_ENDPOINTS))
        except ValueError as err:
            reason = str(err)
            if self.reasons.get(name) != reason:
                self._log.error("skipping service port %s: %s", name, reason)
            self.reasons[name] = reason
            return None
        if self.reasons:  # most syncs skip no port: no lookup a port
            self.reasons.pop(name, None)
        return rendered

    def forget_missing(self, snapshot: ProxySnapshot) -> None:
        """Drop the skipped ports that are no longer in ``snapshot``."""
        for name in [n for n in self.reasons if n not in snapshot.services]:
            del self.reasons[name]

    def __iter__(self) -> Iterator[ServicePortName]:
        return iter(self.reasons)
