"""Localhost NodePorts without ``route_localnet`` (KEP-6032): what to serve, and for whom.

Upstream 1.37's nftables mode serves ``127.0.0.1:<nodePort>`` and ``[::1]:<nodePort>``
through a userspace TCP proxy when the ``KubeProxyNFTablesLocalhostNodePorts`` gate is on
and ``nodePortAddresses`` names a loopback CIDR of the family explicitly (``localhost``,
``127.0.0.1/32``...; ``all`` or a zero CIDR do not count, :func:`explicit_loopback`):
kernel NAT cannot rewrite a loopback destination without ``route_localnet``, the
CVE-2020-8558 class of problems. What it serves, as upstream's
``pkg/proxy/localnodeportproxy`` decides it (:func:`nodeport_targets`):

* TCP NodePorts only; a port without endpoints gets no listener (connections refused);
* the port's cluster endpoints (topology and the terminating fallback applied), or its
  local ones under ``externalTrafficPolicy: Local``, with no fallback to other nodes;
  ``internalTrafficPolicy`` does not apply (NodePort traffic is external);
* the Service's ClientIP affinity timeout.

The listening is :class:`kubeproxy.loopbackproxy.LocalNodePortProxy`'s (one thread per
family, bounded connections); nftables mode wires both in
(``kubeproxy.backends.nftables.localhost``), with the packet rules that reject what the
proxy does not serve. Nothing here knows any backend: it reads the core's snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from kubeproxy.backend import ProxySnapshot
from kubeproxy.nodeports import expand_node_port_cidrs
from kubeproxy.objects import IPFamily, NamespacedName, NodeInfo, Protocol, ServicePortName

__all__ = [
    "NodePortTarget",
    "explicit_loopback",
    "loopback_address",
    "nodeport_targets",
    "targets_of_services",
]

_LOOPBACK: Final = {IPFamily.IPV4: "127.0.0.1", IPFamily.IPV6: "::1"}


def loopback_address(family: IPFamily) -> str:
    """The address the listeners of ``family`` bind: ``127.0.0.1`` or ``::1``."""
    return _LOOPBACK[family]


def explicit_loopback(node_port_addresses: Sequence[str], family: IPFamily) -> bool:
    """Whether ``nodePortAddresses`` names a loopback CIDR of ``family`` explicitly
    (upstream's ``ContainsExplicitLoopback``): ``localhost`` or a non-zero CIDR inside
    ``127.0.0.0/8`` (``::1/128`` for IPv6). ``all``, a zero CIDR or a wide CIDR that
    merely contains loopback do not ask for localhost NodePorts."""
    cidrs = expand_node_port_cidrs(node_port_addresses, family, NodeInfo(name=""))
    return any(c.prefixlen and c.network_address.is_loopback for c in cidrs)


@dataclass(frozen=True, slots=True)
class NodePortTarget:
    """One TCP NodePort to serve on loopback: the port, the ``(ip, port)`` endpoints
    to spread connections over, and the ClientIP affinity timeout (0: none)."""

    name: ServicePortName
    node_port: int
    endpoints: tuple[tuple[str, int], ...]
    affinity_seconds: int = 0


def _target(snapshot: ProxySnapshot, name: ServicePortName) -> NodePortTarget | None:
    port = snapshot.services.get(name)
    if port is None or not port.node_port or port.protocol is not Protocol.TCP:
        return None
    categorized = snapshot.categorized.get(name)
    if categorized is None or not categorized.has_any:
        return None
    chosen = categorized.local if port.external_policy_local else categorized.cluster
    endpoints = tuple(dict.fromkeys((e.address, e.port) for e in chosen))
    if not endpoints:
        return None
    return NodePortTarget(name, port.node_port, endpoints, port.session_affinity_seconds)


def nodeport_targets(snapshot: ProxySnapshot) -> dict[ServicePortName, NodePortTarget]:
    """What to listen for, for every Service port of ``snapshot`` (a full sync)."""
    found: dict[ServicePortName, NodePortTarget] = {}
    for name in snapshot.services:
        target = _target(snapshot, name)
        if target is not None:
            found[name] = target
    return found


def targets_of_services(
    snapshot: ProxySnapshot, services: Iterable[NamespacedName]
) -> dict[ServicePortName, NodePortTarget]:
    """What to listen for, for the ports of ``services`` only (an incremental sync)."""
    found: dict[ServicePortName, NodePortTarget] = {}
    for service in services:
        for name in snapshot.ports_of(service):
            target = _target(snapshot, name)
            if target is not None:
                found[name] = target
    return found
