"""Localhost NodePorts in nftables mode, upstream 1.37's ``KubeProxyNFTablesLocalhostNodePorts``.

With the gate on, :func:`~kubeproxy.backends.nftables.create_backend` wraps the family's
:class:`~kubeproxy.backends.nftables.backend.NftablesBackend` in a
:class:`LocalhostNodePortsBackend`. It consumes the same snapshot the core hands every
backend, after the wrapped backend synced it, and adds:

* where ``nodePortAddresses`` names a loopback CIDR of the family explicitly, the userspace
  TCP proxy (:class:`~kubeproxy.loopbackproxy.LocalNodePortProxy`) serving the family's
  TCP NodePorts on ``127.0.0.1`` / ``::1`` (what it serves: :mod:`kubeproxy.localnodeports`);
* packet rules rejecting what that proxy does not serve (KEP-6032): localhost traffic to
  the NodePorts of UDP and SCTP Services, and to TCP ones too where the proxy does not run
  (the gate on, no loopback in ``nodePortAddresses``), each protocol counted for
  ``kubeproxy_nftables_localhost_nodeport_rejected_packets_total``.

The rules live in our table (``table ip kube-proxy``, ``table ip6 kube-proxy``), in
objects of their own that the wrapped backend keeps (:data:`KEPT_OBJECTS`)::

    chain localhost-nodeports { type filter hook input priority 0 ; }
        ip daddr 127.0.0.0/8 udp dport @localhost-nodeports-udp counter reject comment "UDP"
        ...
    set localhost-nodeports-udp { type inet_service ; }      (the NodePorts of UDP ports)

In the input hook, because a loopback packet passes it after output, and a reject there
answers a UDP client with an ICMP error it sees (``ECONNREFUSED``); in the output hook
the sender would only see its own packet discarded (``EPERM``). The sets change by
element only (no rule is rewritten when a Service comes or goes); a full sync re-declares
everything. Turning the gate off removes them: the wrapped backend then no longer keeps
them, and deletes them as unused objects after its next full sync.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Final

from kubeproxy.backend import Backend, ProxySnapshot, SyncChanges, SyncError
from kubeproxy.backends.nftables.exec import NftExecutor
from kubeproxy.backends.nftables.objects import (
    Chain,
    Family,
    NftError,
    Set,
    readable_by_every_nft,
)
from kubeproxy.backends.nftables.rulecounters import rule_counters
from kubeproxy.backends.nftables.stale import chain_object, set_object
from kubeproxy.backends.nftables.table import TABLE, tokens_for
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.config import ProxierConfig
from kubeproxy.localnodeports import (
    NodePortTarget,
    explicit_loopback,
    nodeport_targets,
    targets_of_services,
)
from kubeproxy.loopbackproxy import LocalNodePortProxy
from kubeproxy.metrics import PerRegistry
from kubeproxy.objects import IPFamily, NamespacedName, Protocol, ServicePortName

__all__ = [
    "CHAIN",
    "KEPT_OBJECTS",
    "OBJECT_NAMES",
    "LocalhostNodePortMetrics",
    "LocalhostNodePortsBackend",
    "LocalhostRejects",
    "report_metrics",
    "set_name",
]

log = logging.getLogger(__name__)

CHAIN: Final = "localhost-nodeports"
"""The base chain holding the reject rules."""
_PROTOCOLS: Final = (Protocol.TCP, Protocol.UDP, Protocol.SCTP)
_NFT_FAMILIES: Final = {IPFamily.IPV4: Family.IP, IPFamily.IPV6: Family.IP6}


def set_name(protocol: Protocol) -> str:
    """The set of NodePorts of one protocol whose localhost traffic is rejected."""
    return f"{CHAIN}-{protocol.lower}"


KEPT_OBJECTS: Final = frozenset(
    {chain_object(CHAIN), *(set_object(set_name(p)) for p in _PROTOCOLS)}
)
"""What this module keeps in our table, for the wrapped backend not to delete them as
unused (its ``kept``)."""
OBJECT_NAMES: Final = frozenset(str(obj) for obj in KEPT_OBJECTS)
""":data:`KEPT_OBJECTS` as text (``chain NAME``, ``set NAME``), which ``kept`` reads too."""

_Key = tuple[Protocol, int]


class LocalhostRejects:
    """The reject rules of one family: which protocols' NodePorts are rejected on
    loopback (``rejected``), kept in step with the snapshots given to :meth:`sync`."""

    def __init__(self, family: IPFamily, executor: NftExecutor, rejected: Iterable[Protocol]):
        self.family = family
        self.rejected = frozenset(rejected)
        self.nft_family = _NFT_FAMILIES[family]
        self._executor = executor
        self._tokens = tokens_for(family)
        self._declared = False
        # What was written: each port's key, and how many Service ports want each key.
        self._keys: dict[ServicePortName, _Key] = {}
        self._by_service: dict[NamespacedName, set[ServicePortName]] = {}
        self._refs: dict[_Key, int] = {}

    def rules(self) -> list[tuple[str, str]]:
        """The chain's rules and their comments (the protocol, the metric's label)."""
        ip, loopback = self._tokens.table_family, self._tokens.loopback
        return [
            (
                f"{ip} daddr {loopback} {p.lower} dport @{set_name(p)} counter reject",
                p.value,
            )
            for p in _PROTOCOLS
            if p in self.rejected
        ]

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges, full: bool) -> None:
        """Write what ``snapshot`` asks for: everything on a full sync (or the first),
        else the element changes of ``changes.changed_services``. Raises
        :class:`~kubeproxy.backend.SyncError` when the kernel refused; the next sync
        must then be full."""
        try:
            if full or not self._declared:
                self._declared = False
                self._write_all(snapshot)
                self._declared = True
            else:
                self._write_changes(snapshot, changes.changed_services)
        except NftError as err:
            self._declared = False
            raise SyncError(f"localhost NodePort rules ({self.nft_family}): {err}") from err

    def _key(self, snapshot: ProxySnapshot, name: ServicePortName) -> _Key | None:
        port = snapshot.services.get(name)
        if port is None or not port.node_port or port.protocol not in self.rejected:
            return None
        return port.protocol, port.node_port

    def _write_all(self, snapshot: ProxySnapshot) -> None:
        self._keys.clear()
        self._by_service.clear()
        self._refs.clear()
        for name in snapshot.services:
            key = self._key(snapshot, name)
            if key is not None:
                self._remember(name, key)
        tx = Transaction(self.nft_family, TABLE)
        for protocol in _PROTOCOLS:
            tx.add(readable_by_every_nft(Set(set_name(protocol), "inet_service")))
        tx.add(Chain(CHAIN, "filter", "input", 0))
        tx.flush(Chain(CHAIN))
        for rule, comment in self.rules():
            tx.add_rule(CHAIN, rule, comment)
        for protocol in _PROTOCOLS:
            tx.flush(Set(set_name(protocol), "inet_service"))
            ports = sorted(port for (p, port) in self._refs if p is protocol)
            if ports:
                tx.add_elements(set_name(protocol), [((str(port),), ()) for port in ports])
        self._run(tx)

    def _write_changes(self, snapshot: ProxySnapshot, services: Iterable[NamespacedName]) -> None:
        before = set(self._refs)
        for service in services:
            for name in self._by_service.pop(service, set()):
                self._forget(name)
            for name in snapshot.ports_of(service):
                key = self._key(snapshot, name)
                if key is not None:
                    self._remember(name, key)
        after = set(self._refs)
        if before == after:
            return
        tx = Transaction(self.nft_family, TABLE)
        for protocol, port in sorted(before - after):
            tx.delete_element(set_name(protocol), (str(port),))
        for protocol, port in sorted(after - before):
            tx.add_elements(set_name(protocol), [((str(port),), ())])
        self._run(tx)

    def _remember(self, name: ServicePortName, key: _Key) -> None:
        self._keys[name] = key
        self._by_service.setdefault(name.service, set()).add(name)
        self._refs[key] = self._refs.get(key, 0) + 1

    def _forget(self, name: ServicePortName) -> None:
        key = self._keys.pop(name, None)
        if key is None:
            return
        count = self._refs[key] - 1
        if count:
            self._refs[key] = count
        else:
            del self._refs[key]

    def _run(self, tx: Transaction) -> None:
        if tx.error is not None:
            raise tx.error
        self._executor.run(tx)


class LocalhostNodePortsBackend:
    """An nftables backend with upstream's localhost NodePorts (see the module's text).

    ``inner`` is the family's nftables backend, created with :data:`KEPT_OBJECTS` kept;
    its attributes (counters, generation...) read through this wrapper. ``proxy`` is the
    family's userspace proxy, or None where ``nodePortAddresses`` names no loopback CIDR
    of the family (everything on loopback NodePorts is rejected then).
    """

    def __init__(
        self,
        inner: Backend,
        rejects: LocalhostRejects,
        proxy: LocalNodePortProxy | None,
        *,
        netns: str | None = None,
    ) -> None:
        if rejects.family is not inner.family:
            raise ValueError("the reject rules and the backend serve different families")
        self.inner = inner
        self.rejects = rejects
        self.proxy = proxy
        self.netns = netns
        self._targets: dict[ServicePortName, NodePortTarget] = {}
        self._targets_of: dict[NamespacedName, set[ServicePortName]] = {}

    @classmethod
    def create(
        cls,
        inner: Backend,
        config: ProxierConfig,
        executor: NftExecutor,
        *,
        netns: str | None = None,
    ) -> LocalhostNodePortsBackend:
        """The wrapper for ``config``: a proxy where ``nodePortAddresses`` names a
        loopback CIDR of the family, rejects for every protocol it does not serve."""
        family = inner.family
        proxy = None
        rejected = set(_PROTOCOLS)
        if explicit_loopback(config.node_port_addresses, family):
            proxy = LocalNodePortProxy(family, netns=netns)
            rejected.discard(Protocol.TCP)
            log.info(
                "Localhost NodePorts (%s): TCP through a userspace proxy on %s; UDP and SCTP "
                "rejected",
                family,
                proxy.address,
            )
        else:
            log.info(
                "Localhost NodePorts (%s): nodePortAddresses names no %s loopback CIDR; "
                "every localhost NodePort packet is rejected",
                family,
                family,
            )
        return cls(inner, LocalhostRejects(family, executor, rejected), proxy, netns=netns)

    @property
    def family(self) -> IPFamily:
        """The IP family this backend programs."""
        return self.inner.family

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Sync the wrapped backend, then the reject rules, then the proxy's listeners."""
        self.inner.sync(snapshot, changes)
        full = changes.full or bool(getattr(self.inner, "last_sync_full", False))
        self.rejects.sync(snapshot, changes, full)
        if self.proxy is None:
            return
        if full:
            self._targets.clear()
            self._targets_of.clear()
            for name, target in nodeport_targets(snapshot).items():
                self._keep(name, target)
            self.proxy.sync(self._targets.values())
            return
        changed = targets_of_services(snapshot, changes.changed_services)
        removed: list[int] = []
        for service in changes.changed_services:
            for name in self._targets_of.pop(service, set()):
                old = self._targets.pop(name)
                new = changed.get(name)
                if new is None or new.node_port != old.node_port:
                    removed.append(old.node_port)
        for name, target in changed.items():
            self._keep(name, target)
        self.proxy.apply(changed.values(), removed)

    def _keep(self, name: ServicePortName, target: NodePortTarget) -> None:
        self._targets[name] = target
        self._targets_of.setdefault(name.service, set()).add(name)

    def cleanup(self) -> None:
        """Stop the proxy and remove everything the wrapped backend made (the reject rules
        live in its table)."""
        self._close_proxy()
        self.inner.cleanup()

    def close(self) -> None:
        """Stop the proxy (its listeners and connections) and close the wrapped backend;
        the kernel rules stay."""
        self._close_proxy()
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()

    def _close_proxy(self) -> None:
        if self.proxy is not None:
            self.proxy.close()

    def rejected_packets(self) -> Mapping[str, int]:
        """Packets rejected so far, by protocol (``TCP``, ``UDP``, ``SCTP``)."""
        return rule_counters(self.rejects.nft_family, TABLE, CHAIN, netns=self.netns)

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this class lacks: the wrapped backend's own attributes
        # (its counters for metrics, its generation for tests) read through.
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


class LocalhostNodePortMetrics:
    """Upstream's localhost NodePort metrics for the families given to :meth:`add`:

    * ``kubeproxy_nftables_localhost_nodeport_listeners{ip_family}`` (gauge);
    * ``kubeproxy_nftables_localhost_nodeport_listener_creation_failures_total{ip_family}``;
    * ``kubeproxy_nftables_localhost_nodeport_rejected_packets_total{ip_family, protocol}``,
      read from the rules' counters at each scrape (one small netlink dump per family);

    and two of ours, for what upstream's unbounded proxy has no need of:

    * ``kubeproxy_nftables_localhost_nodeport_connections{ip_family}`` (gauge): the
      connections proxied now;
    * ``kubeproxy_nftables_localhost_nodeport_timed_out_connections_total{ip_family,
      reason}``: connections the proxy closed because nothing moved on them,
      ``reason="half-closed"`` or ``"idle"`` (:mod:`kubeproxy.loopbackproxy`).

    A prometheus-client collector; register one per registry.
    """

    def __init__(self) -> None:
        self.backends: dict[IPFamily, LocalhostNodePortsBackend] = {}

    def add(self, backend: LocalhostNodePortsBackend) -> None:
        """Report ``backend``'s family."""
        self.backends[backend.family] = backend

    def collect(self) -> Iterable[Any]:
        """The five metric families."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        listeners = GaugeMetricFamily(
            "kubeproxy_nftables_localhost_nodeport_listeners",
            "[ALPHA] Number of localhost NodePort listeners of the userspace proxy",
            labels=["ip_family"],
        )
        failures = CounterMetricFamily(
            "kubeproxy_nftables_localhost_nodeport_listener_creation_failures",
            "[ALPHA] Number of localhost NodePort listeners the userspace proxy failed to create",
            labels=["ip_family"],
        )
        rejected = CounterMetricFamily(
            "kubeproxy_nftables_localhost_nodeport_rejected_packets",
            "[ALPHA] Number of packets rejected on localhost NodePorts. UDP and SCTP are "
            "always rejected; TCP is rejected when the localhost NodePort proxy is not running",
            labels=["ip_family", "protocol"],
        )
        connections = GaugeMetricFamily(
            "kubeproxy_nftables_localhost_nodeport_connections",
            "Number of connections the localhost NodePort proxy relays now",
            labels=["ip_family"],
        )
        timed_out = CounterMetricFamily(
            "kubeproxy_nftables_localhost_nodeport_timed_out_connections",
            "Number of connections the localhost NodePort proxy closed because nothing moved"
            " on them (half closed for 60 s, or idle for 24 h)",
            labels=["ip_family", "reason"],
        )
        for family, backend in sorted(self.backends.items()):
            proxy = backend.proxy
            listeners.add_metric([family.value], float(proxy.listeners if proxy else 0))
            failures.add_metric([family.value], float(proxy.listener_failures if proxy else 0))
            connections.add_metric([family.value], float(proxy.connections if proxy else 0))
            timed_out.add_metric(
                [family.value, "half-closed"], float(proxy.closed_half_closed if proxy else 0)
            )
            timed_out.add_metric([family.value, "idle"], float(proxy.closed_idle if proxy else 0))
            try:
                counts = backend.rejected_packets()
            except NftError as err:
                log.error("Cannot read localhost NodePort reject counters (%s): %s", family, err)
                continue
            for protocol, packets in sorted(counts.items()):
                rejected.add_metric([family.value, protocol], float(packets))
        yield listeners
        yield failures
        yield rejected
        yield connections
        yield timed_out


_COLLECTORS = PerRegistry(LocalhostNodePortMetrics)


def report_metrics(registry: Any, backend: LocalhostNodePortsBackend) -> LocalhostNodePortMetrics:
    """Report ``backend``'s family in ``registry``'s :class:`LocalhostNodePortMetrics`
    (registered there the first time)."""
    collector = _COLLECTORS.of(registry)
    collector.add(backend)
    return collector
