"""What a flow case needs in its scene, worked out from the case alone: :func:`plan_scene`.

Which endpoint IPs get a namespace, which pod and external client addresses send flows
(and which external ones send to themselves), which loopback destinations the node
listens on, which ports every listener answers, and whether the pods are routed or
bridged. :mod:`kubeproxy.testing.scene` builds what the plan says.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kubeproxy.config import LocalDetectMode
from kubeproxy.objects import IPAddress, IPFamily, Protocol
from kubeproxy.testing.cases import Case, OutputKind, StepAction
from kubeproxy.testing.node import STANDARD_NODE, StandardNode

__all__ = ["Role", "ScenePlan", "plan_scene"]


class Role(StrEnum):
    """Where a flow's source lives."""

    NODE = "node"
    ENDPOINT = "endpoint"
    POD = "pod"
    EXTERNAL = "external"


@dataclass(frozen=True, slots=True)
class ScenePlan:
    """What a case needs in its scene, computed from the case alone.

    ``endpoints`` and ``pods`` get a namespace each behind the bridge (or on a routed
    veth each when ``routed_pods``), listening on their address; ``pods`` are the pod
    network's flow sources and the destinations of flows the proxy must leave alone;
    ``external`` are the outside's client addresses, a namespace each, and
    ``self_addressed`` those of them that also send to themselves; ``node_extra`` are
    loopback destinations the node listens on; ``ports`` is every port a listener answers
    on (TCP and UDP, and SCTP when ``sctp``), except the loopback ``(address, port,
    protocol)`` in ``proxied``: a flow there expects endpoints, which on loopback only a
    proxy listening in the node can give (upstream's localhost NodePorts in nftables
    mode), so the runner leaves the place to it. ``bridge_addresses`` are the node's own
    addresses in the pod networks, used by no flow: on the bridge, or on the node's
    loopback when the pods are routed.
    """

    node: StandardNode
    bridge_addresses: tuple[ipaddress.IPv4Interface | ipaddress.IPv6Interface, ...]
    endpoints: tuple[IPAddress, ...]
    pods: tuple[IPAddress, ...]
    external: tuple[IPAddress, ...]
    node_extra: tuple[IPAddress, ...]
    ports: tuple[int, ...]
    routed_pods: bool = False
    self_addressed: tuple[IPAddress, ...] = ()
    proxied: frozenset[tuple[IPAddress, int, str]] = frozenset()
    sctp: bool = False
    """Whether listeners answer SCTP too (only when a flow needs it: opening an SCTP
    socket loads the kernel's SCTP module where it is one)."""

    def role_of(self, source: IPAddress) -> Role:
        """Where a flow from ``source`` is sent from."""
        if source in self.node.addresses or source.is_loopback:
            return Role.NODE
        if source in self.endpoints:
            return Role.ENDPOINT
        if source in self.pods:
            return Role.POD
        return Role.EXTERNAL


def _usable(address: IPAddress) -> bool:
    return not (
        address.is_loopback
        or address.is_multicast
        or address.is_unspecified
        or address.is_link_local
        or address.is_reserved
    )


def _slice_addresses(slice_: Mapping[str, Any]) -> Iterator[IPAddress]:
    for endpoint in slice_.get("endpoints") or ():
        if not isinstance(endpoint, Mapping):
            continue
        for text in endpoint.get("addresses") or ():
            # The core rejects what is not an IP; the scene only skips it.
            with contextlib.suppress(ValueError, TypeError):
                address = ipaddress.ip_address(text)
                if _usable(address):
                    yield address


def _slice_ports(slice_: Mapping[str, Any]) -> Iterator[int]:
    for port in slice_.get("ports") or ():
        if isinstance(port, Mapping):
            number = port.get("port")
            if isinstance(number, int) and not isinstance(number, bool) and 0 < number < 65536:
                yield number


def plan_scene(case: Case, node: StandardNode = STANDARD_NODE) -> ScenePlan:
    """Work out the scene a case needs: its endpoints, clients and ports.

    The pods are routed, each on its own veth, exactly when the case's local-traffic
    detector is InterfaceNamePrefix (made for such pods: behind a bridge it never sees
    them); otherwise they sit behind the bridge.
    """
    endpoints: dict[IPAddress, None] = {}
    ports: set[int] = set()
    for step in case.steps:
        if step.action is not StepAction.APPLY:
            continue
        for slice_ in step.endpoint_slices:
            endpoints.update(dict.fromkeys(_slice_addresses(slice_)))
            ports.update(_slice_ports(slice_))
    flows = [flow for _, flow in case.flows]
    for flow in flows:
        ports.add(flow.dest_port)
        if flow.output.kind is OutputKind.ENDPOINTS:
            for address, port in flow.output.endpoints:
                ports.add(port)
                if _usable(address):
                    endpoints.setdefault(address)
    node_addresses = set(node.addresses)
    endpoint_ips = tuple(a for a in endpoints if a not in node_addresses)
    pods: dict[IPAddress, None] = {}
    external: dict[IPAddress, None] = {}
    self_addressed: dict[IPAddress, None] = {}
    node_extra: dict[IPAddress, None] = {}
    proxied: set[tuple[IPAddress, int, str]] = set()
    for flow in flows:
        source = flow.source_ip
        if source in node_addresses or source in endpoints or source.is_loopback:
            pass
        elif source in node.pod_cidr(IPFamily.of(source)):
            pods.setdefault(source)
        else:
            external.setdefault(source)
            if flow.dest_ip == source:
                self_addressed.setdefault(source)
        if flow.dest_ip.is_loopback:
            node_extra.setdefault(flow.dest_ip)
            if flow.output.kind is OutputKind.ENDPOINTS:
                proxied.add((flow.dest_ip, flow.dest_port, flow.protocol.value))
        elif (
            flow.output.kind is OutputKind.UNTOUCHED
            and flow.dest_ip not in node_addresses
            and flow.dest_ip not in endpoints
            and flow.dest_ip in node.pod_cidr(IPFamily.of(flow.dest_ip))
        ):
            # Upstream's "no match" flow: a pod talking to another pod, no Service in
            # sight. The other pod must exist and answer (behind the bridge, where the
            # node's hooks still see the packet), or the flow could only time out.
            pods.setdefault(flow.dest_ip)
    used = set(endpoints) | set(pods) | set(external) | {f.dest_ip for f in flows}
    bridge = []
    for family in (IPFamily.IPV4, IPFamily.IPV6):
        cidr = node.pod_cidr(family)
        address = next(a for a in cidr.hosts() if a not in used and a not in node_addresses)
        bridge.append(ipaddress.ip_interface(f"{address}/{cidr.prefixlen}"))
    return ScenePlan(
        node=node,
        bridge_addresses=tuple(bridge),
        endpoints=endpoint_ips,
        pods=tuple(pods),
        external=tuple(external),
        node_extra=tuple(node_extra),
        ports=tuple(sorted(ports)),
        routed_pods=case.overrides.local_detector is LocalDetectMode.INTERFACE_NAME_PREFIX,
        self_addressed=tuple(self_addressed),
        proxied=frozenset(proxied),
        sctp=any(flow.protocol is Protocol.SCTP for flow in flows),
    )
