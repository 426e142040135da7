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
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubeproxy.backend import NodePortAddresses, ProxySnapshot, SyncChanges, SyncError
from kubeproxy.backends.iptables import (
    IptablesBackend,
    cleanup,
    create_backend,
)
from kubeproxy.backends.iptables.exec import IptablesCommands, IptablesVariant
from kubeproxy.backends.iptables.naming import endpoint_chain
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
from kubeproxy.testing.pytest import flow_test
from tests.kernelkit import (
    Topology,
    assert_restart_keeps_connections,
    client_node_server,
    echo_port_name,
    echo_snapshot,
    ip,
    run_in,
)

REPO = Path(__file__).resolve().parent.parent
CONFIG = ProxierConfig(node_name="kpxib-node")

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


# Namespaces and snapshots ----------------------------------------------------------------

PREFIX = "kpxib"
TARGET = echo_port_name(PREFIX)
_COUNTERS = re.compile(r"\[\d+:\d+\]")


def saved(netns: str, variant: str = "nft", family: str = "iptables") -> str:
    """``iptables-save`` of every table, without comments and packet counters."""
    text = run_in(netns, f"{family}-{variant}-save")
    return "\n".join(
        _COUNTERS.sub("[0:0]", line) for line in text.splitlines() if not line.startswith("#")
    )


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"{PREFIX}-{os.getpid()}-bare"
    try:
        ip("netns", "add", name)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


@pytest.fixture
def topology() -> Iterator[Topology]:
    with client_node_server(PREFIX) as topo:
        yield topo


def snapshot(extra: int, offset: int = 0, *, target_endpoints: int = 1) -> ProxySnapshot:
    """The echo Service (172.30.0.10:80 -> 10.180.0.10:8080) plus ``extra`` others."""
    return echo_snapshot(PREFIX, extra, offset, target_endpoints=target_endpoints)


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

    def restart() -> None:
        # A new process: the same rules, now with many more Services, stale ones to delete
        # and every chain rewritten.
        second = create_backend(IPFamily.IPV4, CONFIG, netns=topology.node)
        second.sync(snapshot(2000, offset=100), full())

    assert_restart_keeps_connections(topology, restart)
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

    # 10.180.0.11 does not exist: try until the cascade picks the live endpoint (one
    # in two; 60 tries all miss it with a chance of 2**-60, 20 did once in a million).
    for _ in range(60):
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
