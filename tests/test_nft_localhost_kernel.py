"""Localhost NodePorts' reject counters and the ``NFTablesNetlink`` gate, in the kernel.

The reject rules count what they refuse, by protocol; the counters are read over netlink
(one chain's rules, whatever else the table holds) into upstream's
``kubeproxy_nftables_localhost_nodeport_rejected_packets_total``. With ``NFTablesNetlink``
off, the same sync goes through libnftables alone and the kernel ends up the same.
"""

from __future__ import annotations

import errno
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kubeproxy.backends.nftables import create_backend
from kubeproxy.backends.nftables.localhost import (
    LocalhostNodePortMetrics,
    LocalhostNodePortsBackend,
)
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.backends.nftables.rulecounters import rule_counters
from kubeproxy.config import ProxierConfig
from kubeproxy.featuregates import resolve
from kubeproxy.metrics import expose
from kubeproxy.objects import IPFamily, Protocol
from kubeproxy.testing.netns import entered
from tests.kernelkit import lone_namespace
from tests.snapshots import World, ep, full, spn
from tests.test_nft_localhost import port

pytestmark = pytest.mark.kernel


@pytest.fixture
def netns() -> Iterator[tuple[str, int]]:
    with lone_namespace("kpxlk") as made:
        yield made.name, made.fd


def refused(fd: int, protocol: Protocol, port_number: int) -> bool:
    kind = socket.SOCK_STREAM if protocol is Protocol.TCP else socket.SOCK_DGRAM
    with entered(fd):
        sock = socket.socket(socket.AF_INET, kind)
    with sock:
        sock.settimeout(1.0)
        try:
            sock.connect(("127.0.0.1", port_number))
            if kind == socket.SOCK_DGRAM:
                sock.send(b"x")
                sock.recv(16)
        except ConnectionRefusedError:
            return True
        except OSError as err:
            return err.errno == errno.ECONNREFUSED
    return False


def test_rejects_are_counted_by_protocol_and_reported(netns: tuple[str, int]) -> None:
    name, fd = netns
    gates = resolve({"KubeProxyNFTablesLocalhostNodePorts": True})
    config = ProxierConfig(node_name="n", node_port_addresses=("primary",), feature_gates=gates)
    backend = create_backend(IPFamily.IPV4, config, netns=name)
    assert isinstance(backend, LocalhostNodePortsBackend)
    try:
        world = World()
        world.add(port(spn("web"), 30080), ep("10.180.0.1", 80, local=True))
        world.add(port(spn("dns", proto=Protocol.UDP), 30053), ep("10.180.0.1", 53, local=True))
        backend.sync(world.snapshot(), full())
        assert refused(fd, Protocol.TCP, 30080) and refused(fd, Protocol.TCP, 30080)
        assert refused(fd, Protocol.UDP, 30053)
        assert backend.rejected_packets() == {"TCP": 2, "UDP": 1, "SCTP": 0}
        collector = LocalhostNodePortMetrics()
        collector.add(backend)
        registry = CollectorRegistry()
        registry.register(collector)
        text = expose(registry).decode()
        assert (
            'kubeproxy_nftables_localhost_nodeport_rejected_packets_total{ip_family="IPv4",'
            'protocol="TCP"} 2' in text
        )
    finally:
        backend.cleanup()
    assert rule_counters(Family.IP, "kube-proxy", "localhost-nodeports", netns=name) == {}


def test_nftables_netlink_off_syncs_through_libnftables_alone(netns: tuple[str, int]) -> None:
    name, _fd = netns
    dumps = []
    for value in (True, False):
        # Today's table (the owned one writes everything over netlink: its own tests).
        gates = resolve({"NFTablesNetlink": value, "NFTablesOwnedTable": False})
        config = ProxierConfig(node_name="n", feature_gates=gates)
        backend = create_backend(IPFamily.IPV4, config, netns=name)
        executor: Any = vars(backend)["_executor"]
        assert executor.netlink_elements is value
        world = World()
        world.add(port(spn("web"), 30080), ep("10.180.0.1", 80), ep("10.180.0.2", 80))
        backend.sync(world.snapshot(), full())
        listed = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                name,
                "nft",
                "list",
                "map",
                "ip",
                "kube-proxy",
                f"endpoints-tcp-b2.g{backend.generation}",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        dumps.append(listed.replace(f".g{backend.generation}", ""))
        # Without NFTablesNetlink nothing of ours talked netlink: no element writer made.
        assert (executor._writer is None) is not value
        backend.cleanup()
    assert "172.30.0.1 . tcp . 80 . 0 : 10.180.0.1 . 80" in dumps[0]
    assert dumps[0] == dumps[1]
