"""ClientIP affinity of a port reached beyond its cluster IP, through the nftables backend,
with real connections.

A port whose every address picks from one endpoint list (both traffic policies Cluster)
keeps one entry per client in the map keyed by its cluster-IP frontend, whichever
address the client came through: its load-balancer and external IPs and its NodePort are
turned into the cluster IP (and Service port) by the generation's canonical maps before
the lookup and the record, and put back after. This checks what upstream means by it:
one entry per Service port and client across its addresses, the timeout counted from the
last connection, an endpoint that goes taking its entries, and a connection whose entry
a full map refuses served all the same (and counted).

Namespaces are named ``kpxa-<random>-node`` / ``-pod`` and deleted whatever happens.
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Iterator
from unittest import mock

import pytest

from kubeproxy.backend import NodePortAddresses, ProxySnapshot, SyncChanges
from kubeproxy.backends.nftables import NftablesBackend
from kubeproxy.backends.nftables.exec import LibNftables
from kubeproxy.backends.nftables.explain import TableView, explain_service
from kubeproxy.backends.nftables.frontends import Kind
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.backends.nftables.reader import TableReader
from kubeproxy.backends.nftables.table import (
    affinity_frontend6_pin,
    affinity_frontend_shard,
    affinity_pin,
    port_identity,
)
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import (
    CategorizedEndpoints,
    Endpoint,
    IPFamily,
    NamespacedName,
    NodeInfo,
    Protocol,
    ServicePort,
    ServicePortName,
)
from kubeproxy.testing.runner import default_timeout
from tests import kernelkit
from tests.kernelkit import NodeAndPod, node_and_pod_serving, run_in

pytestmark = pytest.mark.kernel

NODE_IP = "192.168.71.4"
EP1, EP2 = "10.244.0.51", "10.244.0.52"
CLUSTER_IP, LB_IP, EXTERNAL_IP = "172.30.0.10", "172.30.5.10", "172.30.6.10"
NODE_PORT = 30080
CLIENT = "10.244.0.1"  # the node's address towards the pods: its connections' source
NAME = ServicePortName(NamespacedName("kpxa", "sticky"), "http", Protocol.TCP)
SHARD, _NUMBER = affinity_frontend_shard(port_identity(NAME))
CONFIG = ProxierConfig(node_name="kpxa-node")
ENDPOINTS = (f"{EP1}:8080", f"{EP2}:8080")


@pytest.fixture
def namespaces() -> Iterator[NodeAndPod]:
    with node_and_pod_serving("kpxa", NODE_IP, (EP1, EP2)) as pair:
        yield pair


@pytest.fixture
def namespaces6() -> Iterator[NodeAndPod]:
    with node_and_pod_serving(
        "kpxa", NODE_IP, (EP1, EP2), ipv6=(NODE_IP6, *EP6), protocols=(Protocol.TCP, Protocol.UDP)
    ) as pair:
        yield pair


def snapshot(*addresses: str) -> ProxySnapshot:
    """The sticky port on its cluster IP, a load-balancer IP, an external IP and a
    NodePort, with endpoints ``addresses`` (port 8080)."""
    eps = tuple(Endpoint(ipaddress.ip_address(a), 8080) for a in addresses)
    port = ServicePort(
        NAME,
        ipaddress.ip_address(CLUSTER_IP),
        80,
        Protocol.TCP,
        node_port=NODE_PORT,
        external_ips=(ipaddress.ip_address(EXTERNAL_IP),),
        load_balancer_vips=(ipaddress.ip_address(LB_IP),),
        session_affinity_seconds=60,
    )
    return ProxySnapshot(
        IPFamily.IPV4,
        NodeInfo("kpxa-node"),
        {NAME: port},
        {NAME: eps},
        {NAME: CategorizedEndpoints(eps, (), eps, True)},
        node_port_addresses=NodePortAddresses(match_all=True),
    )


def answered_by(netns_fd: int, address: str, port: int = 80) -> str | None:
    """The endpoint that answered a connection from the node, from :data:`CLIENT`
    whichever address it goes to."""
    return kernelkit.answered_by(netns_fd, address, port, source=CLIENT)


def entries(netns: str) -> list[tuple[str, str, float]]:
    """(key, endpoint, seconds left) of every entry of the port's affinity map."""
    listing = run_in(netns, "nft", "list", "map", "ip", "kube-proxy", SHARD)
    pattern = r"([\d.]+ \. tcp \. 80 \. [\d.]+)(?: timeout \S+)? expires (\S+) : ([\d.]+ \. \d+)"
    return [
        (key, endpoint.replace(" . ", ":"), _seconds(expires))
        for key, expires, endpoint in re.findall(pattern, listing)
    ]


def _seconds(text: str) -> float:
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)(ms|h|m|s|d)", text))


ADDRESSES = ((CLUSTER_IP, 80), (LB_IP, 80), (EXTERNAL_IP, 80), (NODE_IP, NODE_PORT))


def test_every_address_shares_the_cluster_ips_entry(namespaces: NodeAndPod) -> None:
    node, fd = namespaces.node, namespaces.node_fd
    backend = NftablesBackend(IPFamily.IPV4, CONFIG, executor=LibNftables(netns=node))
    backend.sync(snapshot(EP1, EP2), SyncChanges(full=True))
    mine = f"{CLUSTER_IP} . tcp . 80 . {CLIENT}"
    for first in ((LB_IP, 80), (NODE_IP, NODE_PORT), (EXTERNAL_IP, 80)):
        run_in(node, "nft", "flush", "map", "ip", "kube-proxy", SHARD)
        chosen = answered_by(fd, *first)
        assert chosen in ENDPOINTS
        # Written as the cluster IP's entry, whichever address came first.
        assert [(k, e) for k, e, _left in entries(node)] == [(mine, chosen)]
        for _ in range(3):
            for address in ADDRESSES:
                assert answered_by(fd, *address) == chosen, address
        assert len(entries(node)) == 1

    # Each new connection counts the timeout again, through any address. Without that,
    # the entry has lost the whole pause by the listing; with it, only the time from the
    # connection to the listing, which must stay below the slack (milliseconds, but a
    # loaded machine can stall a second: test_affinity_canonical_kernel's measure).
    slack = 2.0 * default_timeout()
    before = entries(node)[0][2]
    time.sleep(slack + 1.0)
    assert answered_by(fd, NODE_IP, NODE_PORT) == chosen
    assert entries(node)[0][2] > before - slack
    time.sleep(slack + 1.0)
    assert answered_by(fd, LB_IP) == chosen
    assert entries(node)[0][2] > before - slack

    # The endpoint goes: its entries with it; the client is pinned anew, everywhere.
    remaining = EP2 if chosen == ENDPOINTS[0] else EP1
    backend.sync(
        snapshot(remaining), SyncChanges(full=False, changed_services=frozenset({NAME.service}))
    )
    assert entries(node) == []
    assert answered_by(fd, EXTERNAL_IP) == f"{remaining}:8080"
    assert [(k, e) for k, e, _left in entries(node)] == [(mine, f"{remaining}:8080")]
    for address in ADDRESSES:
        assert answered_by(fd, *address) == f"{remaining}:8080"


def test_a_full_map_still_serves_every_address_and_counts_it(namespaces: NodeAndPod) -> None:
    """A map of one entry, held by another client: the kernel refuses this client's
    entries; each connection is served all the same (its packet put back as it was, or
    it would leave for the cluster IP) and counted as not recorded."""
    from prometheus_client import CollectorRegistry

    from kubeproxy.backends.nftables.affinity_metrics import report_affinity

    node, fd = namespaces.node, namespaces.node_fd
    backend = NftablesBackend(
        IPFamily.IPV4, CONFIG, executor=LibNftables(netns=node), affinity_size=1
    )
    backend.sync(snapshot(EP1, EP2), SyncChanges(full=True))
    registry = CollectorRegistry()
    report_affinity(registry, backend)
    other = f"{CLUSTER_IP} . tcp . 80 . 10.9.9.9"
    run_in(node, "nft", f"add element ip kube-proxy {SHARD} {{ {other} : {EP1} . 8080 }}")
    served = 0
    for _ in range(3):
        for address in ADDRESSES[1:]:
            assert answered_by(fd, *address) in ENDPOINTS, address
            served += 1
    assert [k for k, _e, _left in entries(node)] == [other]
    unrecorded = registry.get_sample_value(
        "kubeproxy_nftables_affinity_unrecorded_connections_total", {"ip_family": "IPv4"}
    )
    assert unrecorded == served


NODE_IP6, CLIENT6 = "fd00:71::4", "fd00:244::1"
EP6 = ("fd00:244::51", "fd00:244::52")
CLUSTER_IP6, LB_IP6 = "fd00:96::10", "fd00:96::5:10"
NAME6 = ServicePortName(NamespacedName("kpxa", "sticky6"), "http", Protocol.TCP)
ANY = mock.ANY
NAME6_UDP = ServicePortName(NamespacedName("kpxa", "sticky6"), "dns", Protocol.UDP)


def snapshot6(*addresses: str) -> ProxySnapshot:
    """An IPv6 Service: a sticky TCP port on its cluster IP, a load-balancer IP and a
    NodePort, and a sticky UDP port on the cluster IP and the load-balancer IP (a UDP
    NodePort keeps its pins), endpoints ``addresses`` (port 8080)."""
    eps = tuple(Endpoint(ipaddress.ip_address(a), 8080) for a in addresses)
    ports = {
        name: ServicePort(
            name,
            ipaddress.ip_address(CLUSTER_IP6),
            80 if name is NAME6 else 53,
            name.protocol,
            node_port=NODE_PORT if name is NAME6 else 0,
            load_balancer_vips=(ipaddress.ip_address(LB_IP6),),
            session_affinity_seconds=60,
        )
        for name in (NAME6, NAME6_UDP)
    }
    return ProxySnapshot(
        IPFamily.IPV6,
        NodeInfo("kpxa-node"),
        ports,
        {name: eps for name in ports},
        {name: CategorizedEndpoints(eps, (), eps, True) for name in ports},
        node_port_addresses=NodePortAddresses(match_all=True),
    )


def entries6(netns: str, shard: str) -> list[tuple[tuple[str, str], str]]:
    """(the key's two frontend numbers, endpoint) of every entry of IPv6 map ``shard``."""
    listing = run_in(netns, "nft", "list", "map", "ip6", "kube-proxy", shard)
    pattern = r"(\d+) \. (\d+) \. \d+(?: timeout \S+)? expires \S+ : ([0-9a-f:]+)"
    return [((high, low), endpoint) for high, low, endpoint in re.findall(pattern, listing)]


def test_ipv6_addresses_share_one_entry_keyed_by_the_cluster_ip(namespaces6: NodeAndPod) -> None:
    """Through the cluster IP, the load-balancer IP and the NodePort (TCP), and the
    cluster and load-balancer IPs (UDP: the address turned back and forth, its checksum
    fixed up through the pseudo-header), a client keeps one entry per port, keyed by the
    numbers :func:`affinity_frontend6_pin` computes for the cluster-IP frontend (the
    kernel's ``jhash``, checked here); an endpoint that goes takes its entries."""
    node, fd = namespaces6.node, namespaces6.node_fd
    backend = NftablesBackend(IPFamily.IPV6, CONFIG, executor=LibNftables(netns=node))
    backend.sync(snapshot6(*EP6), SyncChanges(full=True))
    endpoints = tuple(f"[{a}]:8080" for a in EP6)
    cases = (
        (NAME6, Protocol.TCP, 80, ((CLUSTER_IP6, 80), (LB_IP6, 80), (NODE_IP6, NODE_PORT))),
        (NAME6_UDP, Protocol.UDP, 53, ((CLUSTER_IP6, 53), (LB_IP6, 53))),
    )
    chosen: dict[ServicePortName, str] = {}
    for name, protocol, service_port, addresses in cases:
        shard = affinity_pin(port_identity(name), "service", 0)[0]
        pin = affinity_frontend6_pin((CLUSTER_IP6, protocol.lower, str(service_port)))
        for first in addresses[1:]:
            run_in(node, "nft", "flush", "map", "ip6", "kube-proxy", shard)
            picked = kernelkit.answered_by(fd, *first, source=CLIENT6, protocol=protocol)
            assert picked is not None and picked in endpoints, (name, first)
            host = picked[1:].partition("]")[0]
            # Written as the cluster IP's entry, whichever address came first.
            assert entries6(node, shard) == [(pin, host)], (name, first)
            for _ in range(2):
                for address in addresses:
                    got = kernelkit.answered_by(fd, *address, source=CLIENT6, protocol=protocol)
                    assert got == picked, (name, address)
            assert len(entries6(node, shard)) == 1
        assert picked is not None
        chosen[name] = picked

    # Every address explains its port's one entry (found by the frontend's numbers, not
    # another port's of the same map), and the listing loads again.
    for name in chosen:
        shard = affinity_pin(port_identity(name), "service", 0)[0]
        run_in(node, "nft", f"add element ip6 kube-proxy {shard} {{ 7 . 8 . 9 : {EP6[0]} }}")
    with TableReader(node) as reader:
        view = TableView(reader, Family.IP6)
        for fe in explain_service(view, NAME6.service).frontends:
            number = fe.key[-1] if fe.kind == Kind.IP else fe.key[1]
            mine = chosen[NAME6 if number in ("80", str(NODE_PORT)) else NAME6_UDP]
            host = mine[1:].partition("]")[0]  # an IPv6 entry holds the address alone
            assert [(a.client, a.endpoint) for a in fe.affinity] == [(ANY, host)], fe.key
    assert kernelkit.nft_listing_reloads(node) is None

    # The TCP port's endpoint goes: its entries with it; the client is pinned anew.
    gone = chosen[NAME6][1:].partition("]")[0]
    remaining = EP6[1] if gone == EP6[0] else EP6[0]
    backend.sync(
        snapshot6(remaining),
        SyncChanges(full=False, changed_services=frozenset({NAME6.service})),
    )
    for name, protocol, service_port, _addresses in cases:
        shard = affinity_pin(port_identity(name), "service", 0)[0]
        pin = affinity_frontend6_pin((CLUSTER_IP6, protocol.lower, str(service_port)))
        held = entries6(node, shard)
        # The port's own entries of the endpoint gone went; another port's entry (the
        # numbers no port has) waits for a full sync.
        kept = chosen[name] != chosen[NAME6]  # the UDP port's entry, if another endpoint's
        assert [e for e in held if e[0] == pin] == ([(pin, remaining)] if kept else [])
        assert (("7", "8"), EP6[0]) in held
    for address in cases[0][3]:
        assert kernelkit.answered_by(fd, *address, source=CLIENT6) == f"[{remaining}]:8080"
