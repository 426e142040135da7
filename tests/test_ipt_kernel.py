"""The iptables backend against the real kernel, in network namespaces we create.

* every example, behaviour and iptables-only flow case with real packets, with the
  variant a fresh namespace gets (iptables-nft); the examples again with iptables-legacy;
* a restart: a second backend doing a full sync over the rules the first left keeps an
  established connection through a ClusterIP alive, and new connections work throughout;
* a restore the kernel refuses (a foreign rule still jumps to a chain we delete) leaves
  the previous rules in place, and the backend recovers once the reference is gone;
* cleanup leaves the namespace's iptables as it found them: foreign chains, kubelet's
  chains and their rules survive, in both variants.

Namespaces are named ``kpxib-<pid>-<role>`` and deleted whatever happens.
"""

from __future__ import annotations

import ipaddress
import os
import re
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
from kubeproxy.backends.iptables import (
    IptablesBackend,
    cleanup,
    create_backend,
)
from kubeproxy.backends.iptables.exec import IptablesCommands, IptablesVariant
from kubeproxy.backends.iptables.naming import endpoint_chain
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
CONFIG = ProxierConfig(node_name="kpxib-node")
T = TypeVar("T")

pytestmark = pytest.mark.kernel

test_flow_cases = flow_test(
    ["flowcases/examples/*.yaml", "flowcases/behaviour/*.yaml", "flowcases/iptables/*.yaml"],
    backend="kubeproxy.backends.iptables:create_backend",
    base=REPO,
    marks=[pytest.mark.kernel],
)

test_flow_cases_legacy = flow_test(
    ["flowcases/examples/*.yaml"],
    backend="kubeproxy.backends.iptables:create_legacy_backend",
    base=REPO,
    marks=[pytest.mark.kernel],
)


# Namespaces ------------------------------------------------------------------------------


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def run_in(netns: str, *argv: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        ["ip", "netns", "exec", netns, *argv],
        input=stdin,
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout


_COUNTERS = re.compile(r"\[\d+:\d+\]")


def saved(netns: str, variant: str = "nft", family: str = "iptables") -> str:
    """``iptables-save`` of every table, without comments and packet counters."""
    text = run_in(netns, f"{family}-{variant}-save")
    return "\n".join(
        _COUNTERS.sub("[0:0]", line) for line in text.splitlines() if not line.startswith("#")
    )


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
def netns() -> Iterator[str]:
    name = f"kpxib-{os.getpid()}-bare"
    try:
        ip("netns", "add", name)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


@pytest.fixture
def topology() -> Iterator[Topology]:
    prefix = f"kpxib-{os.getpid()}"
    topo = Topology(f"{prefix}-node", f"{prefix}-cli", f"{prefix}-srv")
    names = [topo.node, topo.client, topo.server]
    try:
        for name in names:
            ip("netns", "add", name)
            ip("-n", name, "link", "set", "lo", "up")
        ip("-n", topo.node, "link", "add", "kpxib-c", "type", "veth", "peer", "name", "eth0",
           "netns", topo.client)  # fmt: skip
        ip("-n", topo.node, "link", "add", "kpxib-s", "type", "veth", "peer", "name", "eth0",
           "netns", topo.server)  # fmt: skip
        for link, addr in (("kpxib-c", "10.0.0.1/24"), ("kpxib-s", "10.180.0.1/24")):
            ip("-n", topo.node, "addr", "add", addr, "dev", link)
            ip("-n", topo.node, "link", "set", link, "up")
        for name, addr, gateway in (
            (topo.client, "10.0.0.2/24", "10.0.0.1"),
            (topo.server, "10.180.0.10/24", "10.180.0.1"),
        ):
            ip("-n", name, "addr", "add", addr, "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
            ip("-n", name, "route", "add", "default", "via", gateway)
        run_in(topo.node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
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

TARGET = ServicePortName(NamespacedName("kpxib", "echo"), "tcp", Protocol.TCP)


def snapshot(extra: int, offset: int = 0, *, target_endpoints: int = 1) -> ProxySnapshot:
    """The echo Service (172.30.0.10:80 -> 10.180.0.10:8080) plus ``extra`` others."""
    services: dict[ServicePortName, ServicePort] = {}
    endpoints: dict[ServicePortName, tuple[Endpoint, ...]] = {}
    categorized: dict[ServicePortName, CategorizedEndpoints] = {}

    def add(port: ServicePort, eps: tuple[Endpoint, ...]) -> None:
        services[port.name] = port
        endpoints[port.name] = eps
        categorized[port.name] = CategorizedEndpoints(eps, (), eps, bool(eps))

    echo: tuple[Endpoint, ...] = (Endpoint(ipaddress.ip_address("10.180.0.10"), 8080),)
    if target_endpoints > 1:
        echo += (Endpoint(ipaddress.ip_address("10.180.0.11"), 8080),)
    add(ServicePort(TARGET, ipaddress.ip_address("172.30.0.10"), 80, Protocol.TCP), echo)
    for index in range(offset, offset + extra):
        name = ServicePortName(NamespacedName("bulk", f"s{index}"), "http", Protocol.TCP)
        eps = tuple(
            Endpoint(ipaddress.ip_address(0x0AB50000 + index * 4 + k), 8080) for k in range(3)
        )
        add(ServicePort(name, ipaddress.ip_address(0xAC1E1000 + index), 80, Protocol.TCP), eps)
    return ProxySnapshot(
        IPFamily.IPV4,
        NodeInfo("kpxib-node", addresses=(ipaddress.ip_address("10.0.0.1"),)),
        services,
        endpoints,
        categorized,
        service_cidrs=(ipaddress.ip_network("172.30.0.0/16"),),
        node_port_addresses=NodePortAddresses(addresses=(ipaddress.ip_address("10.0.0.1"),)),
        local_detector=LocalDetector(
            LocalDetectMode.CLUSTER_CIDR, (ipaddress.ip_network("10.0.0.0/8"),)
        ),
    )


def v6_snapshot() -> ProxySnapshot:
    name = ServicePortName(NamespacedName("kpxib", "six"), "http", Protocol.TCP)
    eps = (Endpoint(ipaddress.ip_address("fd00:10::10"), 8080),)
    return ProxySnapshot(
        IPFamily.IPV6,
        NodeInfo("kpxib-node", addresses=(ipaddress.ip_address("2001:db8::1"),)),
        {name: ServicePort(name, ipaddress.ip_address("fd00:10:96::10"), 80, Protocol.TCP)},
        {name: eps},
        {name: CategorizedEndpoints(eps, (), eps, True)},
        service_cidrs=(ipaddress.ip_network("fd00:10:96::/112"),),
        node_port_addresses=NodePortAddresses(match_all=True),
    )


def full() -> SyncChanges:
    return SyncChanges(full=True)


def changed(*services: NamespacedName) -> SyncChanges:
    return SyncChanges(full=False, changed_services=frozenset(services))


# Restart ---------------------------------------------------------------------------------


def test_restart_keeps_connections_and_serves_new_ones(topology: Topology) -> None:
    first = create_backend(IPFamily.IPV4, CONFIG, netns=topology.node)
    assert first._executor.variant is IptablesVariant.NFT  # a fresh namespace's default
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
        # A new process: the same rules, now with many more Services, stale ones to delete
        # and every chain rewritten.
        second = create_backend(IPFamily.IPV4, CONFIG, netns=topology.node)
        started = time.monotonic()
        second.sync(snapshot(2000, offset=100), full())
        took = time.monotonic() - started
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
    nat = saved(topology.node)
    assert "KUBE-SVC-" in nat
    stale = ServicePortName(NamespacedName("bulk", "s0"), "http", Protocol.TCP)
    assert endpoint_chain(f"{stale.service}:http", "tcp", "10.181.0.0:8080") not in nat


# Refused restores ------------------------------------------------------------------------


def test_refused_restore_keeps_previous_rules(topology: Topology) -> None:
    node = topology.node
    backend = create_backend(IPFamily.IPV4, CONFIG, netns=node)
    backend.sync(snapshot(5, target_endpoints=2), full())
    # Someone else's rule jumps to the chain of the endpoint about to go away: the kernel
    # refuses to delete a chain still referenced, so the whole restore is refused.
    doomed = endpoint_chain(f"{TARGET.service}:{TARGET.port}", "tcp", "10.180.0.11:8080")
    run_in(node, "iptables-nft", "-t", "nat", "-N", "KPXIB-FOREIGN")
    run_in(node, "iptables-nft", "-t", "nat", "-A", "KPXIB-FOREIGN", "-j", doomed)
    before = saved(node)
    with pytest.raises(SyncError):
        backend.sync(snapshot(5), changed(TARGET.service))
    assert saved(node) == before
    assert backend.restore_failures == 1 and backend.partial_restore_failures == 1

    def connect() -> bytes:
        with socket.create_connection(("172.30.0.10", 80), timeout=2) as sock:
            sock.sendall(b"still\n")
            return sock.recv(64)

    # 10.180.0.11 does not exist: try until the cascade picks the live endpoint.
    for _ in range(20):
        try:
            assert topology.in_namespace(topology.client, connect) == b"still\n"
            break
        except OSError:
            continue
    else:
        pytest.fail("the previous rules no longer reach the echo server")
    run_in(node, "iptables-nft", "-t", "nat", "-F", "KPXIB-FOREIGN")
    backend.sync(snapshot(5), SyncChanges(full=False))
    assert backend.last_sync_full
    assert doomed not in saved(node)
    assert topology.in_namespace(topology.client, connect) == b"still\n"


# Cleanup ---------------------------------------------------------------------------------

FOREIGN = """*filter
:KUBE-FIREWALL - [0:0]
:KPXIB-FOREIGN - [0:0]
-A INPUT -j KUBE-FIREWALL
-A FORWARD -j KPXIB-FOREIGN
-A KPXIB-FOREIGN -s 192.0.2.1/32 -j DROP
COMMIT
*nat
:KPXIB-FOREIGN-NAT - [0:0]
-A PREROUTING -j KPXIB-FOREIGN-NAT
-A KPXIB-FOREIGN-NAT -d 192.0.2.2/32 -p tcp -j DNAT --to-destination 192.0.2.3:80
COMMIT
*mangle
:KUBE-IPTABLES-HINT - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
COMMIT
"""


FOREIGN6 = """*filter
:KPXIB-FOREIGN - [0:0]
-A FORWARD -j KPXIB-FOREIGN
-A KPXIB-FOREIGN -s 2001:db8:99::1/128 -j DROP
COMMIT
*nat
:KPXIB-FOREIGN-NAT - [0:0]
COMMIT
*mangle
:KUBE-KUBELET-CANARY - [0:0]
COMMIT
"""


def test_cleanup_leaves_iptables_as_found(netns: str) -> None:
    # Tables exist before (iptables-nft never deletes a table it created, nor do we: a
    # table someone else shares is not ours to remove), so "as found" is exact.
    run_in(netns, "iptables-nft-restore", "--noflush", stdin=FOREIGN)
    run_in(netns, "iptables-legacy-restore", "-w", "120", "--noflush", stdin=FOREIGN)
    run_in(netns, "ip6tables-nft-restore", "--noflush", stdin=FOREIGN6)
    nft_before, legacy_before = saved(netns), saved(netns, "legacy")
    six_before = saved(netns, family="ip6tables")
    # Both variants hold kubelet's hint, so detection would pick legacy: say nft here.
    v4 = IptablesBackend(
        IPFamily.IPV4, CONFIG, executor=IptablesCommands(IptablesVariant.NFT, netns=netns)
    )
    v4.sync(snapshot(20), full())
    v4.sync(snapshot(20, offset=5), changed(*(NamespacedName("bulk", f"s{i}") for i in range(25))))
    v6 = IptablesBackend(
        IPFamily.IPV6, CONFIG, executor=IptablesCommands(IptablesVariant.NFT, netns=netns)
    )
    v6.sync(v6_snapshot(), full())
    # iptables-legacy's lock is the host's: other tests and benchmarks may hold it a while.
    legacy = IptablesBackend(
        IPFamily.IPV4,
        CONFIG,
        executor=IptablesCommands(IptablesVariant.LEGACY, netns=netns, wait=120),
    )
    legacy.sync(snapshot(3), full())
    assert "KUBE-SVC-" in saved(netns) and "KUBE-SVC-" in saved(netns, "legacy")
    assert "KUBE-SVC-" in saved(netns, family="ip6tables")

    cleanup(netns=netns, wait=120)
    assert saved(netns) == nft_before
    assert saved(netns, "legacy") == legacy_before
    assert saved(netns, family="ip6tables") == six_before
    cleanup(netns=netns, wait=120)  # nothing left to remove is fine
    assert saved(netns) == nft_before
