"""Upstream's iptables-mode packet counters (nfacct) and their metrics.

On fakes: the rules count through a counter only once it exists, a counter that cannot be
made is one error line and no rule change, and the metrics read the counters at scrape
time. In network namespaces: the real counters count dropped INVALID packets and
accepted localhost NodePort packets, and a scrape shows them.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import struct
from dataclasses import replace

import pytest

from kubeproxy.backend import NodePortAddresses, SyncChanges
from kubeproxy.backends.iptables import IptablesBackend, create_backend
from kubeproxy.backends.iptables.fake import FakeIptables
from kubeproxy.backends.iptables.nfacct import (
    COUNTERS,
    CT_STATE_INVALID_DROPPED,
    LOCALHOST_NODEPORTS_ACCEPTED,
    FakeNFAcct,
    NetlinkNFAcct,
    NFAcctError,
)
from kubeproxy.cmd.modes import iptables_hooks
from kubeproxy.config import ProxierConfig
from kubeproxy.metrics import ProxyMetrics
from kubeproxy.objects import IPFamily, Protocol, ServicePort
from tests.kernelkit import ECHO_SERVER_IP, Topology, client_node_server, echo_snapshot
from tests.snapshots import NODE, World, ep, full, ip, spn

V4, V6 = IPFamily.IPV4, IPFamily.IPV6
CONFIG = ProxierConfig(node_name=NODE)
INVALID_DROP = (
    "-m conntrack --ctstate INVALID -m nfacct --nfacct-name ct_state_invalid_dropped_pkts -j DROP"
)
INVALID_METRIC = "kubeproxy_iptables_ct_state_invalid_dropped_packets_total"
LOCALHOST_METRIC = "kubeproxy_iptables_localhost_nodeports_accepted_packets_total"


def localhost_world() -> World:
    world = World(node_port_addresses=NodePortAddresses(match_all=True))
    port = ServicePort(spn("web"), ip("172.30.0.1"), 80, Protocol.TCP, node_port=30001)
    world.add(port, ep("10.180.0.1", 8080))
    return world


def nodeport_rules(fake: FakeIptables) -> list[str]:
    return [line for line in fake.dump(V4, "nat").splitlines() if "-A KUBE-NODEPORTS" in line]


def test_rules_count_through_the_counters_once_they_exist() -> None:
    fake, counters = FakeIptables(), FakeNFAcct()
    backend = IptablesBackend(V4, CONFIG, executor=fake, nfacct=counters)
    assert backend.nfacct_counters == frozenset(COUNTERS)
    assert set(counters.counters) == set(COUNTERS)
    backend.sync(localhost_world().snapshot(), full())
    assert f"-A KUBE-FORWARD {INVALID_DROP}" in fake.dump(V4, "filter")
    rules = nodeport_rules(fake)
    # Upstream's pair: loopback destinations through the counter, then everyone.
    assert len(rules) == 2
    assert "-d 127.0.0.0/8" in rules[0]
    assert "-m nfacct --nfacct-name localhost_nps_accepted_pkts" in rules[0]
    assert "nfacct" not in rules[1]
    assert rules[0].endswith(rules[1].rsplit(" -j ", 1)[1])


def test_no_localhost_counter_rule_without_localhost_node_ports() -> None:
    fake = FakeIptables()
    config = ProxierConfig(node_name=NODE, localhost_node_ports=False)
    backend = IptablesBackend(V4, config, executor=fake, nfacct=FakeNFAcct())
    backend.sync(localhost_world().snapshot(), full())
    assert [r for r in nodeport_rules(fake) if "nfacct" in r] == []
    # The INVALID drop counts whatever localhost NodePorts do.
    assert INVALID_DROP in fake.dump(V4, "filter")
    # IPv6 never has localhost NodePorts (upstream: IPv4 only).
    assert (
        not IptablesBackend(V6, CONFIG, executor=fake, nfacct=FakeNFAcct())
        ._context_for(replace(localhost_world().snapshot(), family=V6), False)
        .localhost_nodeport_counter
    )


def test_a_counter_that_cannot_be_made_is_one_error_and_plain_rules(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeIptables()
    backend = IptablesBackend(V4, CONFIG, executor=fake, nfacct=FakeNFAcct(refuse=errno.EPERM))
    assert backend.nfacct_counters == frozenset()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and all("Failed to create nfacct counter" in e for e in errors)
    backend.sync(localhost_world().snapshot(), full())
    assert "nfacct" not in fake.dump(V4, "filter") + fake.dump(V4, "nat")
    assert "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP" in fake.dump(V4, "filter")
    assert backend.packet_counts() == {}


def test_metrics_read_the_counters_at_scrape_time() -> None:
    counters = FakeNFAcct()
    backend = IptablesBackend(V4, CONFIG, executor=FakeIptables(), nfacct=counters)
    metrics = ProxyMetrics(mode="iptables", process_metrics=False)
    iptables_hooks(backend, metrics)
    iptables_hooks(backend, metrics)  # the other family's backend: registered once
    counters.counters[CT_STATE_INVALID_DROPPED] = 7
    counters.counters[LOCALHOST_NODEPORTS_ACCEPTED] = 3
    lines = metrics.expose().decode().splitlines()
    assert f"{INVALID_METRIC} 7" in lines
    assert f"{LOCALHOST_METRIC} 3" in lines
    assert f"# TYPE {LOCALHOST_METRIC} counter" in lines
    counters.counters[LOCALHOST_NODEPORTS_ACCEPTED] = 5
    assert f"{LOCALHOST_METRIC} 5" in metrics.expose().decode().splitlines()
    # A counter gone from the kernel is left out of the scrape, which still succeeds.
    del counters.counters[CT_STATE_INVALID_DROPPED]
    text = metrics.expose().decode()
    assert INVALID_METRIC not in text and f"{LOCALHOST_METRIC} 5" in text


def test_other_modes_have_no_packet_metrics() -> None:
    backend = IptablesBackend(V4, CONFIG, executor=FakeIptables(), nfacct=FakeNFAcct())
    for mode in ("nftables", "ipvs"):
        metrics = ProxyMetrics(mode=mode, process_metrics=False)
        iptables_hooks(backend, metrics)
        assert "packets_total" not in metrics.expose().decode()


def test_counter_names_are_checked() -> None:
    with pytest.raises(NFAcctError):
        FakeNFAcct().ensure("x" * 40)
    with pytest.raises(NFAcctError):
        FakeNFAcct().ensure("bad\nname")


# The kernel ------------------------------------------------------------------------------


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def send_syn_fin(source: str, destination: str, port: int) -> None:
    """One TCP segment with SYN and FIN set: conntrack marks it INVALID."""
    header = struct.pack("!HHIIBBHHH", 40000, port, 1, 0, 5 << 4, 0x03, 1024, 0, 0)
    pseudo = (
        ipaddress.IPv4Address(source).packed
        + ipaddress.IPv4Address(destination).packed
        + struct.pack("!BBH", 0, socket.IPPROTO_TCP, len(header))
    )
    header = header[:16] + struct.pack("!H", _checksum(pseudo + header)) + header[18:]
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP) as sock:
        sock.sendto(header, (destination, 0))


@pytest.mark.kernel
def test_kernel_counters_count_and_the_scrape_shows_them() -> None:
    with client_node_server("kpxnf") as topology:
        check_counters(topology)


def check_counters(topology: Topology) -> None:
    backend = create_backend(V4, CONFIG, netns=topology.node)
    assert backend.nfacct_counters == frozenset(COUNTERS)
    snapshot = echo_snapshot("kpxnf", 0)
    (name,) = snapshot.services
    snapshot = replace(
        snapshot,
        services={name: replace(snapshot.services[name], node_port=30080)},
        node_port_addresses=NodePortAddresses(match_all=True),
    )
    backend.sync(snapshot, SyncChanges(full=True))
    metrics = ProxyMetrics(mode="iptables", process_metrics=False)
    iptables_hooks(backend, metrics)
    before = backend.packet_counts()
    assert set(before) == set(COUNTERS)

    def via_localhost() -> bytes:
        with socket.create_connection(("127.0.0.1", 30080), timeout=2) as sock:
            sock.sendall(b"lo\n")
            return sock.recv(16)

    assert topology.in_namespace(topology.node, via_localhost) == b"lo\n"
    topology.in_namespace(topology.client, lambda: send_syn_fin("10.0.0.2", ECHO_SERVER_IP, 8080))
    after = backend.packet_counts()
    assert after[LOCALHOST_NODEPORTS_ACCEPTED] > before[LOCALHOST_NODEPORTS_ACCEPTED]
    assert after[CT_STATE_INVALID_DROPPED] == before[CT_STATE_INVALID_DROPPED] + 1
    lines = metrics.expose().decode().splitlines()
    assert f"{INVALID_METRIC} {after[CT_STATE_INVALID_DROPPED]}" in lines
    assert any(line.startswith(f"{LOCALHOST_METRIC} ") for line in lines)
    # A second backend (a restart, or the other family) finds the counters there.
    NetlinkNFAcct(topology.node).ensure(CT_STATE_INVALID_DROPPED)
    assert NetlinkNFAcct(topology.node).packets(CT_STATE_INVALID_DROPPED) >= 1
    with pytest.raises(NFAcctError) as missing:
        NetlinkNFAcct(topology.node).packets("kpxnf_missing")
    assert missing.value.errno == errno.ENOENT
