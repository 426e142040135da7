"""Stale UDP flows: the reconciler's rules (fake table, property test), its wiring into the
Proxier (runs only when UDP endpoints changed), and the ctnetlink executor against real
UDP flows DNAT'ed by nftables inside network namespaces of our own (kpxm-c*)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.backend import ProxySnapshot, SyncChanges
from kubeproxy.config import ProxierConfig
from kubeproxy.conntrack import (
    ConntrackError,
    ConntrackReconciler,
    FakeConntrack,
    Flow,
    NetlinkConntrack,
    find_stale_flows,
)
from kubeproxy.conntrack.messages import dump_flow
from kubeproxy.host.netns import in_netns as entered
from kubeproxy.metrics import ProxyMetrics
from kubeproxy.objects import (
    Endpoint,
    IPAddress,
    IPFamily,
    NamespacedName,
    Protocol,
    ServicePort,
    ServicePortName,
)
from kubeproxy.proxier import Proxier

V4 = IPFamily.IPV4
V6 = IPFamily.IPV6
NODE = "node-a"
ip = ipaddress.ip_address


def spn(name: str, port: str = "dns", protocol: Protocol = Protocol.UDP) -> ServicePortName:
    return ServicePortName(NamespacedName("demo", name), port, protocol)


def udp_port(
    name: str,
    cluster_ip: str,
    port: int = 53,
    *,
    node_port: int = 0,
    external: Sequence[str] = (),
    vips: Sequence[str] = (),
    protocol: Protocol = Protocol.UDP,
) -> ServicePort:
    return ServicePort(
        name=spn(name, protocol=protocol),
        cluster_ip=ip(cluster_ip),
        port=port,
        protocol=protocol,
        node_port=node_port,
        external_ips=tuple(ip(a) for a in external),
        load_balancer_vips=tuple(ip(a) for a in vips),
    )


def endpoint(address: str, port: int = 5353, *, serving: bool = True) -> Endpoint:
    return Endpoint(ip(address), port, ready=serving, serving=serving)


def flow(dst: str, dport: int, reply: str, rport: int = 5353, sport: int = 40000) -> Flow:
    client = "10.99.0.2" if ip(dst).version == 4 else "fd00:99::2"
    return Flow(ip(client), sport, ip(dst), dport, ip(reply), rport)


# --- the rules ------------------------------------------------------------------------


def test_stale_flows_by_frontend_and_reply_source() -> None:
    services = {
        spn("dns"): udp_port(
            "dns",
            "10.96.0.10",
            node_port=30053,
            external=["203.0.113.7"],
            vips=["198.51.100.9"],
        ),
        spn("web", "http", Protocol.TCP): udp_port("web", "10.96.0.11", 80, protocol=Protocol.TCP),
        spn("empty"): udp_port("empty", "10.96.0.20"),
    }
    endpoints = {
        spn("dns"): (
            endpoint("10.244.0.11"),
            endpoint("10.244.0.12", serving=False),
            Endpoint(ip("10.244.0.13"), 5353, ready=False, serving=True, terminating=True),
        ),
        spn("web", "http", Protocol.TCP): (endpoint("10.244.0.30", 8080),),
    }
    keep = [
        flow("10.96.0.10", 53, "10.244.0.11", sport=1),
        flow("203.0.113.7", 53, "10.244.0.11", sport=2),
        flow("198.51.100.9", 53, "10.244.0.11", sport=3),
        flow("192.168.50.2", 30053, "10.244.0.11", sport=4),
        flow("10.96.0.10", 53, "10.244.0.13", sport=5),  # serving while terminating
        flow("10.96.0.11", 80, "10.244.0.99", 8080, sport=6),  # TCP Service: not ours
        flow("10.244.0.11", 5353, "10.244.0.11", sport=7),  # straight to a pod
        flow("10.96.0.10", 54, "10.96.0.10", 54, sport=8),  # another port of the VIP
    ]
    stale = [
        flow("10.96.0.10", 53, "10.244.0.12", sport=11),  # not serving
        flow("203.0.113.7", 53, "10.244.0.99", sport=12),  # gone
        flow("198.51.100.9", 53, "10.244.0.11", 6000, sport=13),  # right IP, wrong port
        flow("192.168.50.2", 30053, "10.244.0.12", sport=14),  # NodePort, any address
        flow("10.0.0.1", 30053, "10.0.0.1", 30053, sport=15),  # NodePort, never DNAT'ed
        flow("10.96.0.10", 53, "10.96.0.10", 53, sport=16),  # black-holed before rules
        flow("10.96.0.20", 53, "10.244.0.50", sport=17),  # zero endpoints: all go (1.37)
    ]
    assert sorted(find_stale_flows(services, endpoints, keep + stale)) == sorted(stale)


def test_shared_external_ip_accepts_endpoints_of_every_service() -> None:
    services = {
        spn("a"): udp_port("a", "10.96.0.10", external=["203.0.113.7"]),
        spn("b"): udp_port("b", "10.96.0.11", external=["203.0.113.7"]),
    }
    endpoints = {spn("a"): (endpoint("10.244.0.11"),)}
    flows = [flow("203.0.113.7", 53, "10.244.0.11"), flow("10.96.0.11", 53, "10.244.0.11")]
    assert find_stale_flows(services, endpoints, flows) == [flows[1]]


FRONTENDS = ["10.96.0.10", "10.96.0.11", "203.0.113.7", "192.168.50.2", "10.0.0.1"]
BACKENDS = ["10.244.0.11", "10.244.0.12", "10.244.0.13", "10.96.0.10"]


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["a", "b", "c"]),
        st.tuples(
            st.sampled_from(FRONTENDS[:2]),
            st.sampled_from([53, 54]),
            st.booleans(),
            st.lists(st.tuples(st.sampled_from(BACKENDS[:3]), st.booleans()), max_size=3),
        ),
    ),
    st.lists(
        st.tuples(
            st.sampled_from(FRONTENDS),
            st.sampled_from([53, 54, 30053, 30054]),
            st.sampled_from(BACKENDS),
            st.sampled_from([5353, 53, 54]),
        ),
        max_size=20,
    ),
)
def test_reconciled_table_keeps_exactly_the_good_flows(
    spec: dict[str, tuple[str, int, bool, list[tuple[str, bool]]]],
    raw_flows: list[tuple[str, int, str, int]],
) -> None:
    services: dict[ServicePortName, ServicePort] = {}
    endpoints: dict[ServicePortName, tuple[Endpoint, ...]] = {}
    for index, (name, (cluster_ip, port, node_port, backends)) in enumerate(sorted(spec.items())):
        services[spn(name)] = udp_port(
            name, cluster_ip, port, node_port=30053 + index if node_port else 0
        )
        endpoints[spn(name)] = tuple(endpoint(a, serving=s) for a, s in backends)
    table = FakeConntrack(
        flow(dst, dport, reply, rport, sport=1000 + i)
        for i, (dst, dport, reply, rport) in enumerate(raw_flows)
    )
    before = table.flows
    ConntrackReconciler(table).reconcile(V4, services, endpoints)

    def serving(name: ServicePortName) -> set[tuple[IPAddress, int]]:
        return {(e.ip, e.port) for e in endpoints[name] if e.serving}

    def should_go(item: Flow) -> bool:
        """Some kind of frontend matches and none of its ports serves the reply source."""
        reply = (item.reply_src, item.reply_src_port)
        by_address = [
            serving(name)
            for name, port in services.items()
            if (port.cluster_ip, port.port) == (item.orig_dst, item.orig_dst_port)
        ]
        by_node_port = [
            serving(name)
            for name, port in services.items()
            if port.node_port and port.node_port == item.orig_dst_port
        ]
        return any(
            matches and not any(reply in backends for backends in matches)
            for matches in (by_address, by_node_port)
        )

    assert table.flows == [item for item in before if not should_go(item)]
    assert sorted(table.deleted) == [item for item in before if should_go(item)]


def test_reconciler_records_metrics_and_survives_listing_failures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = ProxyMetrics(process_metrics=False)
    ticks = iter([10.0, 10.25, 20.0])
    table = FakeConntrack(
        [flow("10.96.0.10", 53, "10.244.0.12"), flow("10.96.0.10", 53, "10.244.0.11", sport=2)]
    )
    reconciler = ConntrackReconciler(table, metrics, clock=lambda: next(ticks))
    services = {spn("dns"): udp_port("dns", "10.96.0.10")}
    endpoints = {spn("dns"): (endpoint("10.244.0.11"),)}
    assert reconciler.reconcile(V4, services, endpoints) == 1
    text = metrics.expose().decode()
    assert 'kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family="IPv4"} 1' in text
    assert 'kubeproxy_conntrack_reconciler_sync_duration_seconds_sum{ip_family="IPv4"} 0.25' in text
    assert [f.reply_src for f in table.flows] == [ip("10.244.0.11")]

    table.fail_list = ConntrackError(1, "Operation not permitted")
    assert reconciler.reconcile(V4, services, {}) == 0
    assert "Cannot list IPv4 conntrack entries" in caplog.text
    text = metrics.expose().decode()
    assert 'kubeproxy_conntrack_reconciler_sync_duration_seconds_count{ip_family="IPv4"} 1' in text


# --- wired into the proxier -----------------------------------------------------------


class Backend:
    def __init__(self, family: IPFamily = V4) -> None:
        self._family = family

    @property
    def family(self) -> IPFamily:
        return self._family

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        pass

    def cleanup(self) -> None:
        pass


class CountingReconciler(ConntrackReconciler):
    def __init__(self, table: FakeConntrack) -> None:
        super().__init__(table)
        self.calls = 0

    def reconcile(self, *args: Any) -> int:
        self.calls += 1
        return super().reconcile(*args)


def dns_service(name: str = "dns", cluster_ip: str = "10.96.0.10") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "demo"},
        "spec": {
            "clusterIP": cluster_ip,
            "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP"},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
            ],
        },
    }


def dns_slice(
    addresses: Sequence[str], name: str = "dns", protocols: Sequence[str] = ("UDP", "TCP")
) -> dict[str, Any]:
    family = "IPv6" if addresses and ":" in addresses[0] else "IPv4"
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-1",
            "namespace": "demo",
            "labels": {"kubernetes.io/service-name": name},
        },
        "addressType": family,
        "endpoints": [
            {"addresses": [a], "nodeName": NODE, "conditions": {"ready": True}} for a in addresses
        ],
        "ports": [
            {"name": "dns" if p == "UDP" else "dns-tcp", "port": 5353, "protocol": p}
            for p in protocols
        ],
    }


def test_proxier_runs_the_reconciler_only_when_udp_endpoints_changed() -> None:
    table = FakeConntrack()
    reconciler = CountingReconciler(table)
    proxier = Proxier(V4, ProxierConfig(node_name=NODE), Backend(), conntrack=reconciler)
    proxier.on_service_add(dns_service())
    proxier.on_service_add(
        {
            "metadata": {"name": "web", "namespace": "demo"},
            "spec": {"clusterIP": "10.96.0.11", "ports": [{"port": 80, "protocol": "TCP"}]},
        }
    )
    proxier.on_endpoint_slice_add(dns_slice(["10.244.0.11", "10.244.0.12"]))
    proxier.on_services_synced()
    proxier.on_endpoint_slices_synced()
    assert reconciler.calls == 1  # UDP endpoints appeared

    web_slice = dns_slice(["10.244.0.30"], name="web", protocols=["TCP"])
    web_slice["ports"] = [{"port": 80, "protocol": "TCP"}]
    proxier.on_endpoint_slice_add(web_slice)
    assert proxier.sync_now()
    assert reconciler.calls == 1  # TCP only

    table.add(flow("10.96.0.10", 53, "10.244.0.11", sport=1))
    table.add(flow("10.96.0.10", 53, "10.244.0.12", sport=2))
    proxier.on_endpoint_slice_update(
        dns_slice(["10.244.0.11", "10.244.0.12"]), dns_slice(["10.244.0.11"])
    )
    assert proxier.sync_now()
    assert reconciler.calls == 2
    assert [f.reply_src for f in table.flows] == [ip("10.244.0.11")]

    # Scale to zero: every flow of the Service goes (1.37 behaviour).
    proxier.on_endpoint_slice_update(dns_slice(["10.244.0.11"]), dns_slice([]))
    assert proxier.sync_now()
    assert reconciler.calls == 3
    assert table.flows == []


# --- kernel: real flows ---------------------------------------------------------------


def run(*argv: str, stdin: str | None = None) -> str:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{argv}: {done.stderr}"
    return done.stdout


@dataclass
class Node:
    """A namespace whose loopback holds a client, pods, a node IP and routes to VIPs."""

    name: str
    family: IPFamily

    def nft(self, ruleset: str) -> None:
        run("ip", "netns", "exec", self.name, "nft", "-f", "-", stdin=ruleset)

    def socket(self, bind: tuple[str, int]) -> socket.socket:
        kind = socket.AF_INET if self.family is V4 else socket.AF_INET6
        with entered(self.name):
            sock = socket.socket(kind, socket.SOCK_DGRAM)
        sock.bind(bind)
        sock.settimeout(2)
        return sock

    def cli_flows(self) -> set[tuple[int, str, int, str, int]]:
        """(orig sport, dst, dport, reply src, sport) of UDP flows, as the conntrack tool
        sees them."""
        family = "ipv4" if self.family is V4 else "ipv6"
        out = run("ip", "netns", "exec", self.name, "conntrack", "-L", "-p", "udp", "-f", family)
        seen = set()
        for line in out.splitlines():
            fields = [part.split("=", 1) for part in line.split() if "=" in part]
            values = [v for k, v in fields if k in ("src", "dst", "sport", "dport")]
            if len(values) >= 8:
                seen.add(
                    (
                        int(values[2]),
                        str(ip(values[1])),
                        int(values[3]),
                        str(ip(values[4])),
                        int(values[6]),
                    )
                )
        return seen


def as_cli(item: Flow) -> tuple[int, str, int, str, int]:
    return (
        item.orig_src_port,
        str(item.orig_dst),
        item.orig_dst_port,
        str(item.reply_src),
        item.reply_src_port,
    )


@pytest.fixture
def node_v4() -> Iterator[Node]:
    name = f"kpxm-c{os.getpid()}"
    run("ip", "netns", "add", name)
    try:
        batch = "".join(
            f"{line}\n"
            for line in [
                "link set lo up",
                "address add 10.99.0.2/32 dev lo",
                "address add 10.244.0.11/32 dev lo",
                "address add 10.244.0.12/32 dev lo",
                "address add 192.168.50.2/32 dev lo",
                "route add 10.96.0.0/12 dev lo",
                "route add 203.0.113.0/24 dev lo",
            ]
        )
        run("ip", "-n", name, "-batch", "-", stdin=batch)
        yield Node(name, V4)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.fixture
def node_v6() -> Iterator[Node]:
    name = f"kpxm-c6{os.getpid()}"
    run("ip", "netns", "add", name)
    try:
        batch = "".join(
            f"{line}\n"
            for line in [
                "link set lo up",
                "address add fd00:99::2/128 dev lo nodad",
                "address add fd00:244::11/128 dev lo nodad",
                "address add fd00:244::12/128 dev lo nodad",
                "route add fd00:96::/64 dev lo",
            ]
        )
        run("ip", "-n", name, "-batch", "-", stdin=batch)
        yield Node(name, V6)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


TWO_PODS6 = "numgen inc mod 2 map { 0 : fd00:244::11, 1 : fd00:244::12 }"
TWO_PODS = "numgen inc mod 2 map { 0 : 10.244.0.11, 1 : 10.244.0.12 }"
V4_RULES = f"""
table ip kpxm {{
  chain output {{
    type nat hook output priority -100;
    ip daddr {{ 10.96.0.10, 203.0.113.7 }} udp dport 53 dnat to {TWO_PODS} : 5353;
    ip daddr 192.168.50.2 udp dport 30053 dnat to {TWO_PODS} : 5353;
    ip daddr 10.96.0.20 udp dport 53 dnat to 10.244.0.12 : 5353;
    ip daddr 10.96.0.30 udp dport 53 dnat to 10.244.0.11 : 6000;
  }}
}}
"""


def exchange(
    node: Node, targets: Sequence[tuple[str, int]], servers: Sequence[socket.socket]
) -> list[socket.socket]:
    """Each target gets a datagram from a fresh client socket; servers answer every one."""
    clients = []
    client_ip = "10.99.0.2" if node.family is V4 else "fd00:99::2"
    for target in targets:
        client = node.socket((client_ip, 0))
        client.sendto(b"query", target)
        clients.append(client)
    for server in servers:
        server.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                data, peer = server.recvfrom(100)
                server.sendto(b"answer " + data, peer)
    for client in clients:
        client.settimeout(0.5)
        with contextlib.suppress(TimeoutError):
            client.recvfrom(100)
    return clients


@pytest.mark.kernel
def test_reconciler_deletes_exactly_the_stale_real_flows(node_v4: Node) -> None:
    node = node_v4
    node.nft(V4_RULES)
    servers = [
        node.socket(("10.244.0.11", 5353)),
        node.socket(("10.244.0.12", 5353)),
        node.socket(("10.244.0.11", 6000)),
    ]
    targets = (
        [("10.96.0.10", 53)] * 4
        + [("203.0.113.7", 53)] * 2
        + [("192.168.50.2", 30053)] * 4
        + [("10.96.0.20", 53)] * 2
        + [("10.96.0.30", 53)]
        + [("10.244.0.12", 5353)]  # straight to a pod: not a frontend
    )
    clients = exchange(node, targets, servers)
    executor = NetlinkConntrack(node.name)
    before = executor.list_udp(V4)
    assert len(before) == len(targets)
    assert executor.list_udp(V6) == []
    cli_before = node.cli_flows()
    assert {as_cli(f) for f in before} == cli_before

    services = {
        spn("dns"): udp_port("dns", "10.96.0.10", node_port=30053, external=["203.0.113.7"]),
        spn("empty"): udp_port("empty", "10.96.0.20"),
        spn("other"): udp_port("other", "10.96.0.30"),
    }
    endpoints = {
        spn("dns"): (endpoint("10.244.0.11"), endpoint("10.244.0.12", serving=False)),
        spn("other"): (endpoint("10.244.0.11", 5353),),
    }
    metrics = ProxyMetrics(process_metrics=False)
    deleted = ConntrackReconciler(executor, metrics).reconcile(V4, services, endpoints)

    expected_gone = {
        f
        for f in before
        if (f.reply_src == ip("10.244.0.12") and str(f.orig_dst) != "10.244.0.12")
        or f.orig_dst == ip("10.96.0.30")
    }
    # 2 of 4 VIP flows, 1 of 2 external, 2 of 4 NodePort, 2 zero-endpoint, 1 wrong port.
    assert len(expected_gone) == 8
    assert deleted == 8
    after = executor.list_udp(V4)
    assert set(after) == set(before) - expected_gone
    assert node.cli_flows() == {as_cli(f) for f in after}
    assert (
        'kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family="IPv4"} 8'
        in metrics.expose().decode()
    )
    # Deleting again finds nothing (already gone is not an error).
    assert executor.delete(sorted(expected_gone)) == 0
    for sock in clients + servers:
        sock.close()


@pytest.mark.kernel
def test_ipv6_flows_are_listed_and_deleted(node_v6: Node) -> None:
    node = node_v6
    node.nft(
        f"""
table ip6 kpxm {{
  chain output {{
    type nat hook output priority -100;
    ip6 daddr fd00:96::10 udp dport 53 dnat to {TWO_PODS6} : 5353;
  }}
}}
"""
    )
    servers = [node.socket(("fd00:244::11", 5353)), node.socket(("fd00:244::12", 5353))]
    clients = exchange(node, [("fd00:96::10", 53)] * 4, servers)
    executor = NetlinkConntrack(node.name)
    before = executor.list_udp(V6)
    assert len(before) == 4
    assert executor.list_udp(V4) == []
    services = {spn("dns"): udp_port("dns", "fd00:96::10")}
    endpoints = {spn("dns"): (endpoint("fd00:244::11"),)}
    assert ConntrackReconciler(executor).reconcile(V6, services, endpoints) == 2
    after = executor.list_udp(V6)
    assert {f.reply_src for f in after} == {ip("fd00:244::11")}
    assert len(node.cli_flows()) == 2
    for sock in clients + servers:
        sock.close()


@pytest.mark.kernel
def test_proxier_hook_clears_flows_of_a_scaled_down_service(node_v4: Node) -> None:
    node = node_v4
    node.nft(V4_RULES)
    servers = [node.socket(("10.244.0.11", 5353)), node.socket(("10.244.0.12", 5353))]
    executor = NetlinkConntrack(node.name)
    proxier = Proxier(
        V4,
        ProxierConfig(node_name=NODE),
        Backend(),
        conntrack=ConntrackReconciler(executor),
    )
    proxier.on_service_add(dns_service())
    proxier.on_endpoint_slice_add(dns_slice(["10.244.0.11", "10.244.0.12"]))
    proxier.on_services_synced()
    proxier.on_endpoint_slices_synced()
    clients = exchange(node, [("10.96.0.10", 53)] * 4, servers)
    assert len(executor.list_udp(V4)) == 4

    proxier.on_endpoint_slice_update(
        dns_slice(["10.244.0.11", "10.244.0.12"]), dns_slice(["10.244.0.11"])
    )
    assert proxier.sync_now()
    assert {f.reply_src for f in executor.list_udp(V4)} == {ip("10.244.0.11")}
    proxier.on_endpoint_slice_update(dns_slice(["10.244.0.11"]), dns_slice([]))
    assert proxier.sync_now()
    assert executor.list_udp(V4) == []
    assert node.cli_flows() == set()
    for sock in clients + servers:
        sock.close()


@pytest.mark.kernel
def test_thousands_of_flows_are_deleted_in_bulk(node_v4: Node) -> None:
    node = node_v4
    node.nft(V4_RULES)
    run(
        "ip",
        "netns",
        "exec",
        node.name,
        "sysctl",
        "-qw",
        "net.netfilter.nf_conntrack_udp_timeout=300",
    )
    count = 3000
    with entered(node.name):
        for source_port in range(20000, 20000 + count):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
                client.bind(("10.99.0.2", source_port))
                client.sendto(b"q", ("10.96.0.10", 53))
    executor = NetlinkConntrack(node.name)
    start = time.perf_counter()
    flows = executor.list_udp(V4)
    listed = time.perf_counter() - start
    assert len(flows) == count
    services = {spn("dns"): udp_port("dns", "10.96.0.10")}
    endpoints = {spn("dns"): (endpoint("10.244.0.11"),)}
    start = time.perf_counter()
    deleted = ConntrackReconciler(executor).reconcile(V4, services, endpoints)
    elapsed = time.perf_counter() - start
    assert deleted == count // 2
    assert {f.reply_src for f in executor.list_udp(V4)} == {ip("10.244.0.11")}
    # Generous bounds for a loaded 2-core machine (measured ~0.1 s and ~0.2 s).
    assert listed < 3.0
    assert elapsed < 6.0


@pytest.mark.kernel
def test_executor_errors_are_conntrack_errors() -> None:
    with pytest.raises(ConntrackError, match="kpxm-no-such"):
        NetlinkConntrack("kpxm-no-such-namespace").list_udp(V4)
    with pytest.raises(ConntrackError):
        NetlinkConntrack("../etc").list_udp(V4)


def test_executor_refuses_bad_batch_sizes() -> None:
    with pytest.raises(ValueError):
        NetlinkConntrack(batch=0)


def _answer(flow: Flow, *, kernel_layout: bool) -> bytes:
    """A dump answer's payload for ``flow``: its tuples in the layout the kernel writes,
    or with the protocol attribute first (legal, read only by the attribute walk)."""
    v4 = flow.orig_src.version == 4
    src_kind, dst_kind = (1, 2) if v4 else (3, 4)

    def tuple_attr(kind: int, src: IPAddress, sport: int, dst: IPAddress, dport: int) -> bytes:
        addresses = nlmsg.nested(
            1, nlmsg.attr(src_kind, src.packed), nlmsg.attr(dst_kind, dst.packed)
        )
        proto = nlmsg.nested(
            2,
            nlmsg.attr(1, b"\x11"),
            nlmsg.attr(2, sport.to_bytes(2, "big")),
            nlmsg.attr(3, dport.to_bytes(2, "big")),
        )
        return nlmsg.nested(kind, *((addresses, proto) if kernel_layout else (proto, addresses)))

    family = socket.AF_INET if v4 else socket.AF_INET6
    return (
        nlmsg.NFGEN.pack(family, 0, 0)
        + tuple_attr(1, flow.orig_src, flow.orig_src_port, flow.orig_dst, flow.orig_dst_port)
        + tuple_attr(2, flow.reply_src, flow.reply_src_port, flow.orig_src, flow.orig_src_port)
    )


@settings(max_examples=50, deadline=None)
@given(
    st.sampled_from([4, 6]),
    st.lists(st.integers(0, 2**128 - 1), min_size=3, max_size=3),
    st.lists(st.integers(0, 65535), min_size=3, max_size=3),
)
def test_dump_answers_read_the_same_by_layout_and_by_walk(
    version: int, addresses: list[int], ports: list[int]
) -> None:
    make = ipaddress.IPv4Address if version == 4 else ipaddress.IPv6Address
    src, dst, reply = (make(a % 2**32 if version == 4 else a) for a in addresses)
    flow = Flow(src, ports[0], dst, ports[1], reply, ports[2])
    expected = (src.packed, ports[0], dst.packed, ports[1], reply.packed, ports[2])
    ctnetlink_answer = nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_CTNETLINK, 0)
    for kernel_layout in (True, False):
        payload = _answer(flow, kernel_layout=kernel_layout)
        view = memoryview(payload)
        assert dump_flow(ctnetlink_answer, view, 0, len(payload)) == expected
        other_subsystem = nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_CTNETLINK + 1, 0)
        assert dump_flow(other_subsystem, view, 0, len(payload)) is None
