"""Snapshots for the backends' unit tests: a mutable set of Services and endpoints of one
family (:class:`World`) that builds a :class:`~kubeproxy.backend.ProxySnapshot` the way
the core does, the small builders the proxier tests of every backend share, and the
common rules of their incremental-equals-full state machines (:class:`WorldMachine`),
with the random Service ports and endpoints both nftables structures' machines draw.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kubeproxy.backend import NodePortAddresses, ProxySnapshot, SyncChanges
from kubeproxy.config import LocalDetectMode, LocalDetector
from kubeproxy.objects import (
    Endpoint,
    IPAddress,
    IPFamily,
    IPNetwork,
    NamespacedName,
    NodeInfo,
    Protocol,
    ServicePort,
    ServicePortName,
)
from kubeproxy.topology import categorize_endpoints

ip = ipaddress.ip_address
net = ipaddress.ip_network
NODE = "test-node"
V4_DETECTOR = LocalDetector(LocalDetectMode.CLUSTER_CIDR, (net("10.0.0.0/8"),))
NODE_ADDRESSES: Mapping[IPFamily, tuple[IPAddress, ...]] = {
    IPFamily.IPV4: (ip("192.168.0.2"), ip("192.168.1.2")),
    IPFamily.IPV6: (ip("2001:db8::1"),),
}


def spn(
    name: str, port: str = "http", ns: str = "ns", proto: Protocol = Protocol.TCP
) -> ServicePortName:
    return ServicePortName(NamespacedName(ns, name), port, proto)


def ep(
    addr: str,
    port: int = 8080,
    *,
    local: bool = False,
    ready: bool = True,
    serving: bool = True,
    terminating: bool = False,
) -> Endpoint:
    return Endpoint(ip(addr), port, local, ready, serving, terminating)


@dataclass
class World:
    """Services and endpoints of one family; builds snapshots like the core does."""

    family: IPFamily = IPFamily.IPV4
    services: dict[ServicePortName, ServicePort] = field(default_factory=dict)
    endpoints: dict[ServicePortName, tuple[Endpoint, ...]] = field(default_factory=dict)
    node_port_addresses: NodePortAddresses = field(
        default_factory=lambda: NodePortAddresses(addresses=(ip("192.168.0.2"),))
    )
    detector: LocalDetector = V4_DETECTOR
    service_cidrs: tuple[IPNetwork, ...] = (net("172.30.0.0/16"),)
    node_addresses: Mapping[IPFamily, tuple[IPAddress, ...]] = field(
        default_factory=lambda: dict(NODE_ADDRESSES)
    )

    def add(self, port: ServicePort, *eps: Endpoint) -> ServicePortName:
        self.services[port.name] = port
        self.endpoints[port.name] = tuple(sorted(eps, key=lambda e: e.key))
        return port.name

    def remove(self, name: ServicePortName) -> None:
        del self.services[name]
        self.endpoints.pop(name, None)

    def snapshot(self) -> ProxySnapshot:
        categorized = {
            name: categorize_endpoints(self.endpoints.get(name, ()), svc, NODE, "")
            for name, svc in self.services.items()
        }
        return ProxySnapshot(
            self.family,
            NodeInfo(NODE, addresses=self.node_addresses[self.family]),
            dict(self.services),
            dict(self.endpoints),
            categorized,
            service_cidrs=self.service_cidrs,
            node_port_addresses=self.node_port_addresses,
            local_detector=self.detector,
        )


class Clock:
    """A settable clock for a backend's ``clock`` argument."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def full() -> SyncChanges:
    return SyncChanges(full=True)


def changed(*names: ServicePortName) -> SyncChanges:
    return SyncChanges(full=False, changed_services=frozenset(n.service for n in names))


class WorldMachine(RuleBasedStateMachine):
    """Rules shared by the backends' "incremental syncs end where a full sync starts"
    state machines: Service ports are added, changed and removed in :attr:`world`, and
    :attr:`pending` holds the Services changed since the last successful sync.

    A subclass sets :attr:`names` (the port names to draw from), implements
    :meth:`draw_port` and :meth:`draw_endpoints`, and adds its own sync rules and
    invariants; :meth:`changes` is the incremental :class:`SyncChanges` for
    :attr:`pending`.
    """

    names: ClassVar[Sequence[ServicePortName]] = ()

    def __init__(self) -> None:
        super().__init__()
        self.world = self.new_world()
        self.pending: set[NamespacedName] = set()

    def new_world(self) -> World:
        return World()

    def draw_port(self, data: st.DataObject, name: ServicePortName) -> ServicePort:
        raise NotImplementedError

    def draw_endpoints(self, data: st.DataObject) -> tuple[Endpoint, ...]:
        raise NotImplementedError

    def changes(self, full: bool = False) -> SyncChanges:
        return SyncChanges(full=full, changed_services=frozenset(self.pending))

    @rule(data=st.data())
    def upsert(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self.names))
        self.world.add(self.draw_port(data, name), *self.draw_endpoints(data))
        self.pending.add(name.service)

    @precondition(lambda self: bool(self.world.services))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.world.services)))
        self.world.remove(name)
        self.pending.add(name.service)


# Random worlds for the backends' incremental-equals-full state machines ----------------

V6_DETECTOR = LocalDetector(LocalDetectMode.CLUSTER_CIDR, (net("fd00:10::/64"),))
PROPERTY_NAMES = [spn(f"s{i}") for i in range(6)] + [spn("s0", "alt", proto=Protocol.UDP)]
_PROPERTY_EPS = [f"10.180.{i}.{j}" for i in range(3) for j in range(1, 4)]


@st.composite
def service_ports(draw: st.DrawFn, name: ServicePortName) -> ServicePort:
    n = int(name.service.name[1:])
    return ServicePort(
        name,
        # A few shared IPs and ports make key conflicts likely.
        ip(f"172.30.0.{draw(st.sampled_from([n, n, 1, 2]))}"),
        draw(st.sampled_from([80, 80, 443])),
        name.protocol,
        node_port=draw(st.sampled_from([0, 0, 30000 + n, 30001])),
        external_ips=tuple(
            draw(st.sets(st.sampled_from([ip("5.5.5.5"), ip("5.5.5.6")]), max_size=2))
        ),
        load_balancer_vips=tuple(draw(st.sets(st.sampled_from([ip("6.6.6.6")]), max_size=1))),
        load_balancer_source_ranges=tuple(
            draw(
                st.sets(st.sampled_from([net("203.0.113.0/25"), net("192.168.0.0/16")]), max_size=2)
            )
        ),
        session_affinity_seconds=draw(st.sampled_from([0, 0, 10, 10800])),
        internal_policy_local=draw(st.booleans()),
        external_policy_local=draw(st.booleans()),
    )


@st.composite
def endpoint_sets(draw: st.DrawFn) -> tuple[Endpoint, ...]:
    count = draw(st.sampled_from([0, 1, 2, 3, 20]))
    if count == 20:
        return tuple(ep(f"10.181.{k}.1", local=k % 3 == 0) for k in range(count))
    addrs = draw(
        st.lists(st.sampled_from(_PROPERTY_EPS), min_size=count, max_size=count, unique=True)
    )
    return tuple(
        ep(
            a,
            draw(st.sampled_from([8080, 9090])),
            local=draw(st.booleans()),
            ready=(ready := draw(st.booleans()) or draw(st.booleans())),
            serving=ready or draw(st.booleans()),
            terminating=not ready,
        )
        for a in addrs
    )


def to_v6(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv6Address:
    return ipaddress.IPv6Address(f"fd00::{':'.join(str(b) for b in addr.packed)}")


def to_v6_net(
    cidr: ipaddress.IPv4Network | ipaddress.IPv6Network,
) -> ipaddress.IPv6Network:
    return ipaddress.IPv6Network(f"{to_v6(cidr.network_address)}/{96 + cidr.prefixlen}")


def v6_world() -> World:
    return World(
        IPFamily.IPV6,
        node_port_addresses=NodePortAddresses(addresses=(ip("2001:db8::1"),)),
        detector=V6_DETECTOR,
        service_cidrs=(net("fd00:10:96::/112"),),
    )
