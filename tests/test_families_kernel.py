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
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubeproxy.backends.nftables import create_backend
from kubeproxy.conntrack import FakeConntrack
from kubeproxy.daemon import Daemon, DaemonOptions, StartupError, build_daemon
from kubeproxy.daemon.gctuning import GcOps
from kubeproxy.objects import IPFamily, Protocol
from kubeproxy.proxyconfig import defaults
from kubeproxy.testing.fakeapi import endpoint_slice, node, service
from kubeproxy.testing.netns import (
    SubprocessRunner,
    add_namespaces,
    delete_namespaces,
    entered,
    open_namespace,
    write_sysctl,
)
from kubeproxy.testing.traffic import ListenerServer, make_listener

pytestmark = pytest.mark.kernel

NODE = "kpxfam-node"
NODE_V4, NODE_V6 = "192.168.72.2", "fd00:72::2"
POD_V4, POD_V6 = "10.244.72.21", "fd00:72:1::21"
SVC_V4, SVC_V6 = "172.30.72.10", "fd00:96::72:10"
GC_UNTOUCHED = GcOps(collect=lambda: 0, freeze=lambda: None, set_threshold=lambda *_: None)


@dataclass(frozen=True)
class Scene:
    """A node namespace and a pod namespace (both families), and a descriptor on each."""

    node: str
    node_fd: int
    pod_fd: int


@contextlib.contextmanager
def scene() -> Iterator[Scene]:
    run_id = uuid.uuid4().hex[:6]
    names = [f"kpxfam-{run_id}-node", f"kpxfam-{run_id}-pod"]
    node_if, pod_if = f"kpxfam{run_id}n", f"kpxfam{run_id}p"
    runner = SubprocessRunner()
    fds: list[int] = []
    try:
        add_namespaces(runner, names)
        fds = [open_namespace(names[0]), open_namespace(names[1])]
        for fd in fds:
            # Neighbour discovery waits for no duplicate-address detection here.
            write_sysctl(
                fd,
                [("net.ipv6.conf.all.accept_dad", "0"), ("net.ipv6.conf.default.accept_dad", "0")],
            )
        runner(
            ["ip", "-n", names[0], "-batch", "-"],
            stdin=f"link set lo up\naddr add {NODE_V4}/32 dev lo\n"
            f"addr add {NODE_V6}/128 dev lo nodad\n"
            f"link add {node_if} type veth peer name {pod_if} netns {names[1]}\n"
            f"addr add 10.244.72.1/24 dev {node_if}\n"
            f"addr add fd00:72:1::1/64 dev {node_if} nodad\nlink set {node_if} up\n"
            f"route add 172.30.0.0/16 dev {node_if}\nroute add fd00:96::/64 dev {node_if}\n",
        )
        runner(
            ["ip", "-n", names[1], "-batch", "-"],
            stdin=f"link set lo up\naddr add {POD_V4}/24 dev {pod_if}\n"
            f"addr add {POD_V6}/64 dev {pod_if} nodad\nlink set {pod_if} up\n"
            "route add default via 10.244.72.1\nroute add default via fd00:72:1::1\n",
        )
        yield Scene(names[0], fds[0], fds[1])
    finally:
        for fd in fds:
            os.close(fd)
        left = delete_namespaces(runner, names)
        assert not left, f"namespaces left behind: {left}"


@contextlib.contextmanager
def endpoints(where: Scene) -> Iterator[None]:
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


@contextlib.contextmanager
def synced_daemon(where: Scene, directory: Path, **build: Any) -> Iterator[Daemon]:
    """The library daemon of nftables mode in the node namespace, synced once; its rules
    are removed afterwards."""
    daemon = build_daemon(
        options(directory),
        create_backend,
        netns=where.node,
        conntrack=FakeConntrack(),
        privileged=False,
        gc_ops=GC_UNTOUCHED,
        **build,
    )
    try:
        assert daemon.sync_once()
        yield daemon
    finally:
        daemon.stop()
        for proxier in daemon.proxiers.values():
            proxier.backend.cleanup()


def test_the_second_family_runs_without_a_node_address_of_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kubeproxy.daemon")
    # The Node knows no IPv6 address; the kernel's own answer says IPv6 is here.
    directory = manifests(tmp_path, [NODE_V4])
    with scene() as where, endpoints(where), synced_daemon(where, directory) as daemon:
        assert daemon.families == [IPFamily.IPV4, IPFamily.IPV6]
        assert daemon.node_ips.ipv6.is_loopback
        assert answers(where.node_fd, SVC_V6), "the IPv6 cluster IP answers"
        assert answers(where.node_fd, SVC_V4), "the IPv4 cluster IP answers"
    assert 'kube-proxy running in dual-stack mode primary ipFamily="IPv4"' in caplog.messages


def test_a_kernel_without_the_second_family_runs_single_stack(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kubeproxy.daemon")
    with scene() as where, endpoints(where):
        directory = manifests(tmp_path, [NODE_V4, NODE_V6])
        with synced_daemon(where, directory, ipv6_supported=False) as daemon:
            assert daemon.families == [IPFamily.IPV4]
            assert answers(where.node_fd, SVC_V4)
            assert not answers(where.node_fd, SVC_V6), "no IPv6 proxier, no IPv6 rules"
    assert 'kube-proxy running in single-stack mode ipFamily="IPv4"' in caplog.messages


def test_an_ipv6_primary_node_runs_both_families(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kubeproxy.daemon")
    with scene() as where, endpoints(where):
        directory = manifests(tmp_path, [NODE_V6, NODE_V4])
        with synced_daemon(where, directory, ipv6_supported=True) as daemon:
            assert daemon.node_ips.primary_family is IPFamily.IPV6
            assert daemon.families == [IPFamily.IPV4, IPFamily.IPV6]
            assert answers(where.node_fd, SVC_V6) and answers(where.node_fd, SVC_V4)
    assert 'kube-proxy running in dual-stack mode primary ipFamily="IPv6"' in caplog.messages


def test_a_primary_family_the_kernel_lacks_stops_the_start(tmp_path: Path) -> None:
    with scene() as where:
        with pytest.raises(StartupError, match=r'^no support for primary IP family "IPv6"$'):
            build_daemon(
                options(manifests(tmp_path, [NODE_V6])),
                create_backend,
                netns=where.node,
                conntrack=FakeConntrack(),
                privileged=False,
                gc_ops=GC_UNTOUCHED,
                ipv6_supported=False,
            )
        # Nothing was written: the start stopped before any backend existed.
        listed = subprocess.run(
            ["ip", "netns", "exec", where.node, "nft", "list", "tables"],
            check=True,
            capture_output=True,
            text=True,
        )
        assert "kube-proxy" not in listed.stdout
