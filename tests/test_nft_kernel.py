"""The nftables backend against the real kernel, in network namespaces we create.

* every example and behaviour flow case, with real packets (the flow-case runner);
* a restart: a second backend doing a full sync over the table the first left keeps an
  established connection through a ClusterIP alive, and new connections work throughout;
* a foreign table with base chains at our hooks stays byte for byte unchanged through
  syncs and cleanup, and cleanup removes only our tables;
* a transaction the kernel refuses leaves the previous rules in place.

Namespaces are named ``kpxr-<pid>-<role>`` and deleted whatever happens.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

from kubeproxy.backend import NodePortAddresses, ProxySnapshot, SyncChanges, SyncError
from kubeproxy.backends.nftables import NftablesBackend, cleanup, create_backend
from kubeproxy.backends.nftables.exec import LibNftables
from kubeproxy.config import LocalDetectMode, LocalDetector, ProxierConfig
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
from kubeproxy.testing.netns import entered, open_namespace
from kubeproxy.testing.pytest import flow_test

REPO = Path(__file__).resolve().parent.parent
CONFIG = ProxierConfig(node_name="kpxr-node")
T = TypeVar("T")

pytestmark = pytest.mark.kernel

test_flow_cases = flow_test(
    ["flowcases/examples/*.yaml", "flowcases/behaviour/*.yaml"],
    backend="nftables",
    base=REPO,
    marks=[pytest.mark.kernel],
)


# Namespaces ------------------------------------------------------------------------------


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def nft_in(netns: str, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", *args],
        input=stdin,
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout


@dataclass
class Topology:
    """client (10.0.0.2) -- node -- server (10.180.0.10, echo on 8080)."""

    node: str
    client: str
    server: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def in_namespace(self, netns: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a thread that has entered ``netns``; return its result."""
        result: list[T] = []
        errors: list[BaseException] = []

        def run() -> None:
            fd = open_namespace(netns)
            try:
                with entered(fd):
                    result.append(fn())
            except BaseException as err:  # re-raised in the caller
                errors.append(err)
            finally:
                os.close(fd)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
        return result[0]


ECHO_SERVER = """
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080)); s.listen(512)
def serve(c):
    with c:
        while True:
            data = c.recv(4096)
            if not data:
                return
            c.sendall(data)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


@pytest.fixture
def topology() -> Iterator[Topology]:
    prefix = f"kpxr-{os.getpid()}"
    topo = Topology(f"{prefix}-node", f"{prefix}-cli", f"{prefix}-srv")
    names = [topo.node, topo.client, topo.server]
    try:
        for name in names:
            ip("netns", "add", name)
            ip("-n", name, "link", "set", "lo", "up")
        ip("-n", topo.node, "link", "add", "kpxr-c", "type", "veth", "peer", "name", "eth0",
           "netns", topo.client)  # fmt: skip
        ip("-n", topo.node, "link", "add", "kpxr-s", "type", "veth", "peer", "name", "eth0",
           "netns", topo.server)  # fmt: skip
        for link, addr in (("kpxr-c", "10.0.0.1/24"), ("kpxr-s", "10.180.0.1/24")):
            ip("-n", topo.node, "addr", "add", addr, "dev", link)
            ip("-n", topo.node, "link", "set", link, "up")
        for name, addr, gateway in (
            (topo.client, "10.0.0.2/24", "10.0.0.1"),
            (topo.server, "10.180.0.10/24", "10.180.0.1"),
        ):
            ip("-n", name, "addr", "add", addr, "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
            ip("-n", name, "route", "add", "default", "via", gateway)
        subprocess.run(
            ["ip", "netns", "exec", topo.node, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
            check=True,
        )
        server = subprocess.Popen(
            ["ip", "netns", "exec", topo.server, sys.executable, "-c", ECHO_SERVER],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        topo.processes.append(server)
        _wait_for_server(topo)
        yield topo
    finally:
        for process in topo.processes:
            process.kill()
            process.wait()
        for name in names:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def _wait_for_server(topo: Topology) -> None:
    def probe() -> bool:
        for _ in range(100):
            try:
                with socket.create_connection(("10.180.0.10", 8080), timeout=0.2):
                    return True
            except OSError:
                time.sleep(0.05)
        return False

    assert topo.in_namespace(topo.node, probe), "echo server did not come up"


# Snapshots -------------------------------------------------------------------------------

TARGET = ServicePortName(NamespacedName("kpxr", "echo"), "tcp", Protocol.TCP)


def snapshot(extra: int, offset: int = 0) -> ProxySnapshot:
    """The echo Service (172.30.0.10:80 -> 10.180.0.10:8080) plus ``extra`` others."""
    services: dict[ServicePortName, ServicePort] = {}
    endpoints: dict[ServicePortName, tuple[Endpoint, ...]] = {}
    categorized: dict[ServicePortName, CategorizedEndpoints] = {}

    def add(port: ServicePort, eps: tuple[Endpoint, ...]) -> None:
        services[port.name] = port
        endpoints[port.name] = eps
        categorized[port.name] = CategorizedEndpoints(eps, (), eps, bool(eps))

    add(
        ServicePort(TARGET, ipaddress.ip_address("172.30.0.10"), 80, Protocol.TCP),
        (Endpoint(ipaddress.ip_address("10.180.0.10"), 8080),),
    )
    for index in range(offset, offset + extra):
        name = ServicePortName(NamespacedName("bulk", f"s{index}"), "http", Protocol.TCP)
        eps = tuple(
            Endpoint(ipaddress.ip_address(0x0AB50000 + index * 4 + k), 8080) for k in range(3)
        )
        add(ServicePort(name, ipaddress.ip_address(0xAC1E1000 + index), 80, Protocol.TCP), eps)
    return ProxySnapshot(
        IPFamily.IPV4,
        NodeInfo("kpxr-node", addresses=(ipaddress.ip_address("10.0.0.1"),)),
        services,
        endpoints,
        categorized,
        service_cidrs=(ipaddress.ip_network("172.30.0.0/16"),),
        node_port_addresses=NodePortAddresses(addresses=(ipaddress.ip_address("10.0.0.1"),)),
        local_detector=LocalDetector(
            LocalDetectMode.CLUSTER_CIDR, (ipaddress.ip_network("10.0.0.0/8"),)
        ),
    )


def full() -> SyncChanges:
    return SyncChanges(full=True)


# Restart ---------------------------------------------------------------------------------


def test_restart_keeps_connections_and_serves_new_ones(topology: Topology) -> None:
    first = create_backend(IPFamily.IPV4, CONFIG, netns=topology.node)
    first.sync(snapshot(300), full())

    def open_established() -> socket.socket:
        sock = socket.create_connection(("172.30.0.10", 80), timeout=2)
        sock.sendall(b"before\n")
        assert sock.recv(64) == b"before\n"
        return sock

    established = topology.in_namespace(topology.client, open_established)
    stop = threading.Event()
    results = {"ok": 0, "failed": 0}
    errors: list[str] = []

    def connect_loop() -> None:
        while not stop.is_set():
            try:
                with socket.create_connection(("172.30.0.10", 80), timeout=1) as sock:
                    sock.sendall(b"x")
                    if sock.recv(8) != b"x":
                        raise OSError("wrong echo")
                results["ok"] += 1
            except OSError as err:
                results["failed"] += 1
                errors.append(str(err))
            time.sleep(0.002)

    fd = open_namespace(topology.client)

    def loop_in_client() -> None:
        with entered(fd):
            connect_loop()

    looper = threading.Thread(target=loop_in_client)
    looper.start()
    try:
        time.sleep(0.2)
        before = results["ok"]
        # A new process: the same table, now with thousands more Services to add (several
        # transactions), and the fixed chains rewritten.
        second = create_backend(IPFamily.IPV4, CONFIG, netns=topology.node)
        started = time.monotonic()
        second.sync(snapshot(4000), full())
        took = time.monotonic() - started
        assert second.last_transactions >= 2
        during = results["ok"] - before
        time.sleep(0.2)
    finally:
        stop.set()
        looper.join()
        os.close(fd)
    established.sendall(b"after\n")
    assert established.recv(64) == b"after\n"
    established.close()
    assert results["failed"] == 0, errors[:5]
    assert during > 0, f"no connection completed during the {took:.2f}s restart sync"


# Foreign tables and cleanup --------------------------------------------------------------

FOREIGN = """
table inet kpxr-foreign {
    set blocked { type ipv4_addr ; elements = { 192.0.2.1, 192.0.2.2 } ; }
    set ports { type inet_service ; flags interval ; elements = { 1000-2000, 8080 } ; }
    map marks { type ipv4_addr : mark ; elements = { 192.0.2.3 : 0x1 } ; }
    chain pre { type nat hook prerouting priority -100 ; policy accept ; ip saddr @blocked return ; }
    chain out { type nat hook output priority -100 ; policy accept ; }
    chain post { type nat hook postrouting priority 100 ; policy accept ; }
    chain forwarding { type filter hook forward priority 0 ; policy accept ; tcp dport @ports accept ; }
    chain inbound { type filter hook input priority 0 ; policy accept ; }
    chain outbound { type filter hook output priority 0 ; policy accept ; }
    chain marker { meta mark set ip saddr map @marks ; }
}
"""  # noqa: E501


def test_foreign_table_is_untouched_and_cleanup_removes_only_ours(topology: Topology) -> None:
    node = topology.node
    nft_in(node, "-f", "-", stdin=FOREIGN)
    foreign = nft_in(node, "list", "table", "inet", "kpxr-foreign")
    clock = [100.0]
    v4 = NftablesBackend(IPFamily.IPV4, CONFIG, executor=LibNftables(node), clock=lambda: clock[0])
    v4.sync(snapshot(50), full())
    v4.sync(snapshot(50, offset=20), SyncChanges(full=False, changed_services=_bulk(0, 70)))
    clock[0] += 2
    v4.sync(snapshot(50, offset=20), SyncChanges(full=False))  # stale chains deleted
    v4.sync(snapshot(50, offset=20), full())
    v6 = create_backend(IPFamily.IPV6, CONFIG, netns=node)
    v6.sync(_v6_snapshot(), full())
    tables = nft_in(node, "list", "tables")
    assert "table ip kube-proxy" in tables and "table ip6 kube-proxy" in tables
    assert nft_in(node, "list", "table", "inet", "kpxr-foreign") == foreign

    cleanup(netns=node)
    tables = nft_in(node, "list", "tables")
    assert "kube-proxy" not in tables
    assert "table inet kpxr-foreign" in tables
    assert nft_in(node, "list", "table", "inet", "kpxr-foreign") == foreign
    cleanup(netns=node)  # nothing left to delete is fine
    v4.sync(snapshot(5), full())
    v4.cleanup()
    assert "kube-proxy" not in nft_in(node, "list", "tables")
    assert nft_in(node, "list", "table", "inet", "kpxr-foreign") == foreign


def _bulk(start: int, stop: int) -> frozenset[NamespacedName]:
    return frozenset(NamespacedName("bulk", f"s{i}") for i in range(start, stop))


def _v6_snapshot() -> ProxySnapshot:
    name = ServicePortName(NamespacedName("kpxr", "v6"), "", Protocol.TCP)
    eps = (Endpoint(ipaddress.ip_address("fd00:10::a1"), 8080),)
    port = ServicePort(
        name, ipaddress.ip_address("fd00:10:96::10"), 80, Protocol.TCP, session_affinity_seconds=60
    )
    return ProxySnapshot(
        IPFamily.IPV6,
        NodeInfo("kpxr-node"),
        {name: port},
        {name: eps},
        {name: CategorizedEndpoints(eps, (), eps, True)},
    )


# Refused transactions --------------------------------------------------------------------


def test_refused_transaction_leaves_the_previous_rules(topology: Topology) -> None:
    node = topology.node
    backend = create_backend(IPFamily.IPV4, CONFIG, netns=node)
    backend.sync(snapshot(10), full())
    # Someone else puts an element where our next incremental sync will add its own: the
    # kernel refuses our whole transaction (EEXIST).
    nft_in(
        node,
        "add element ip kube-proxy no-endpoint-services { 172.30.16.99 . tcp . 80 : drop }",
    )
    before = nft_in(node, "list", "table", "ip", "kube-proxy")
    grown = snapshot(100)
    name = ServicePortName(NamespacedName("bulk", "s99"), "http", Protocol.TCP)
    empty = dict(grown.categorized)
    empty[name] = CategorizedEndpoints()
    grown = ProxySnapshot(
        grown.family,
        grown.node,
        grown.services,
        grown.endpoints,
        empty,
        grown.service_cidrs,
        grown.node_port_addresses,
        grown.local_detector,
    )
    with pytest.raises(SyncError, match="File exists"):
        backend.sync(grown, SyncChanges(full=False, changed_services=_bulk(10, 100)))
    assert nft_in(node, "list", "table", "ip", "kube-proxy") == before
    assert backend.sync_failures == 1

    def echo() -> bytes:
        with socket.create_connection(("172.30.0.10", 80), timeout=2) as sock:
            sock.sendall(b"still\n")
            return sock.recv(64)

    assert topology.in_namespace(topology.client, echo) == b"still\n"
    # The next sync re-reads the kernel and converges.
    backend.sync(grown, SyncChanges(full=False))
    assert backend.last_sync_full
    listing = nft_in(node, "list", "map", "ip", "kube-proxy", "no-endpoint-services")
    assert "172.30.16.99 . tcp . 80 : goto reject-chain" in listing
