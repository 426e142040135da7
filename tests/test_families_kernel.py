"""IP families as upstream picks them, with real packets: the daemon in a node namespace.

Upstream (``platformCheckSupported``, ``createProxier``) proxies the primary family (the
node IP's) and the other one whenever the kernel supports it, whether or not the Node
lists an address of it; a primary family the kernel lacks stops the start. Here the Node
lists only an IPv4 address, yet an IPv6 Service's cluster IP answers from the node; with
IPv6 said missing, it does not (and the IPv4 one still does); an IPv6-primary node on a
kernel without IPv6 does not start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubeproxy.backends.nftables import create_backend
from kubeproxy.configfile.model import defaults
from kubeproxy.conntrack import FakeConntrack
from kubeproxy.daemon import Daemon, DaemonOptions, DaemonSeams, StartupError, build_daemon
from kubeproxy.daemon.gctuning import GcOps
from kubeproxy.objects import IPFamily, Protocol
from kubeproxy.testing.fakeapi import endpoint_slice, node, service
from kubeproxy.testing.netns import entered
from kubeproxy.testing.traffic import ListenerServer, make_listener
from tests.kernelkit import NodeAndPod, node_and_pod

pytestmark = pytest.mark.kernel

NODE = "kpxfam-node"
NODE_V4, NODE_V6 = "192.168.72.2", "fd00:72::2"
POD_V4, POD_V4_UNUSED, POD_V6 = "10.244.0.21", "10.244.0.22", "fd00:244::21"
SVC_V4, SVC_V6 = "172.30.72.10", "fd00:96::72:10"
GC_UNTOUCHED = GcOps(collect=lambda: 0, freeze=lambda: None, set_threshold=lambda *_: None)


@contextlib.contextmanager
def scene() -> Iterator[NodeAndPod]:
    """The node and pod namespaces, both families."""
    with node_and_pod("kpxfam", NODE_V4, (POD_V4, POD_V4_UNUSED), ipv6=(NODE_V6, POD_V6)) as pair:
        yield pair


@contextlib.contextmanager
def endpoints(where: NodeAndPod) -> Iterator[None]:
    """Both pod addresses listen on TCP 80 (answering with what they saw), and answer
    the node directly (a fresh veth takes a moment before IPv6 neighbours resolve)."""
    server = ListenerServer("kpxfam")
    try:
        for address in (POD_V4, POD_V6):
            ip = ipaddress.ip_address(address)
            server.add(make_listener(where.pod_fd, ip, 80, Protocol.TCP, version=ip.version))
        server.start()
        deadline = time.monotonic() + 10.0
        while not (answers(where.node_fd, POD_V4) and answers(where.node_fd, POD_V6)):
            assert time.monotonic() < deadline, "the pod namespace never answered the node"
            time.sleep(0.1)
        yield
    finally:
        server.close()


def manifests(tmp_path: Path, node_addresses: list[str]) -> Path:
    """The Node (with ``node_addresses`` only) and a Service of each family."""
    v6 = service("web6", cluster_ip=SVC_V6, ports=(("http", 80, "TCP"),))
    v6["spec"]["ipFamilies"] = ["IPv6"]
    v6_slice = endpoint_slice("web6-a", "web6", addresses=[POD_V6], ports=(("http", 80, "TCP"),))
    v6_slice["addressType"] = "IPv6"
    objects: list[dict[str, Any]] = [
        node(NODE, addresses=node_addresses),
        service("web", cluster_ip=SVC_V4, ports=(("http", 80, "TCP"),)),
        endpoint_slice("web-a", "web", addresses=[POD_V4], ports=(("http", 80, "TCP"),)),
        v6,
        v6_slice,
    ]
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump_all(objects))
    return tmp_path


def options(directory: Path) -> DaemonOptions:
    configuration = dataclasses.replace(
        defaults(), hostname_override=NODE, healthz_bind_address="", metrics_bind_address=""
    )
    return DaemonOptions.from_configuration(configuration, mode="nftables", manifests=directory)


def answers(netns_fd: int, address: str) -> bool:
    """Whether a TCP connection from the namespace to ``address``:80 is answered."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with entered(netns_fd):
        sock = socket.socket(family, socket.SOCK_STREAM)
    with sock:
        sock.settimeout(1.0)
        try:
            sock.connect((address, 80))
            return bool(sock.recv(256))
        except OSError:
            return False


def node_seams(where: NodeAndPod, ipv6_supported: bool | None) -> DaemonSeams:
    """The daemon's executors in the node namespace; no conntrack, no host tuning."""
    return DaemonSeams(
        netns=where.node,
        conntrack=FakeConntrack(),
        privileged=False,
        gc_ops=GC_UNTOUCHED,
        ipv6_supported=ipv6_supported,
    )


@contextlib.contextmanager
def synced_daemon(
    where: NodeAndPod, directory: Path, ipv6_supported: bool | None = None
) -> Iterator[Daemon]:
    """The library daemon of nftables mode in the node namespace, synced once; its rules
    are removed afterwards."""
    daemon = build_daemon(
        options(directory),
        create_backend,
        seams=node_seams(where, ipv6_supported),
    )
    try:
        assert daemon.sync_once()
        yield daemon
    finally:
        daemon.stop()
        for proxier in daemon.proxiers.values():
            proxier.backend.cleanup()


@pytest.mark.parametrize(
    ("node_addresses", "ipv6_supported", "families", "line"),
    [
        # The Node knows no IPv6 address; the kernel's own answer says IPv6 is here.
        pytest.param(
            [NODE_V4],
            None,
            [IPFamily.IPV4, IPFamily.IPV6],
            'kube-proxy running in dual-stack mode primary ipFamily="IPv4"',
            id="second family without a node address of it",
        ),
        pytest.param(
            [NODE_V4, NODE_V6],
            False,
            [IPFamily.IPV4],
            'kube-proxy running in single-stack mode ipFamily="IPv4"',
            id="kernel without the second family",
        ),
        pytest.param(
            [NODE_V6, NODE_V4],
            True,
            [IPFamily.IPV4, IPFamily.IPV6],
            'kube-proxy running in dual-stack mode primary ipFamily="IPv6"',
            id="IPv6-primary node",
        ),
    ],
)
def test_families_as_upstream_picks_them(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    node_addresses: list[str],
    ipv6_supported: bool | None,
    families: list[IPFamily],
    line: str,
) -> None:
    caplog.set_level(logging.INFO, logger="kubeproxy.daemon")
    directory = manifests(tmp_path, node_addresses)
    with (
        scene() as where,
        endpoints(where),
        synced_daemon(where, directory, ipv6_supported) as daemon,
    ):
        primary = IPFamily.IPV6 if ":" in node_addresses[0] else IPFamily.IPV4
        assert daemon.node_ips.primary_family is primary
        assert daemon.families == families
        assert answers(where.node_fd, SVC_V4), "the IPv4 cluster IP answers"
        v6 = IPFamily.IPV6 in families
        assert answers(where.node_fd, SVC_V6) is v6, "IPv6 rules iff an IPv6 proxier"
        if v6 and NODE_V6 not in node_addresses:
            assert daemon.node_ips.ipv6.is_loopback, "the loopback stands in for it"
    assert line in caplog.messages


def test_a_primary_family_the_kernel_lacks_stops_the_start(tmp_path: Path) -> None:
    with scene() as where:
        with pytest.raises(StartupError, match=r'^no support for primary IP family "IPv6"$'):
            build_daemon(
                options(manifests(tmp_path, [NODE_V6])),
                create_backend,
                seams=node_seams(where, ipv6_supported=False),
            )
        # Nothing was written: the start stopped before any backend existed.
        listed = subprocess.run(
            ["ip", "netns", "exec", where.node, "nft", "list", "tables"],
            check=True,
            capture_output=True,
            text=True,
        )
        assert "kube-proxy" not in listed.stdout
