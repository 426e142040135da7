"""``kubeproxy`` without a kernel: its arguments, and ``verify``'s comparison of two
tables the backend wrote into fakes (the kernel tests are in test_explain_kernel.py)."""

from __future__ import annotations

import ipaddress
from dataclasses import replace

import pytest

from kubeproxy.backends.nftables import NftablesBackend
from kubeproxy.backends.nftables.explain import FakeSource, TableView, explain_service
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.backends.nftables.verify import compare
from kubeproxy.cmd.kubeproxy import _dest, _parser
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPFamily, NamespacedName, Protocol, ServicePort
from tests.snapshots import Clock, World, ep, full, spn

ip = ipaddress.ip_address


def test_addresses_ports_and_protocols_are_parsed_or_refused() -> None:
    assert _dest("172.30.0.10:80/tcp") == (ip("172.30.0.10"), 80, "tcp")
    assert _dest("[fd00::10]:53/UDP") == (ip("fd00::10"), 53, "udp")
    assert _dest("10.0.0.1:30080") == (ip("10.0.0.1"), 30080, "tcp")
    for bad in ("web:80/tcp", "10.0.0.1:0/tcp", "10.0.0.1:80/icmp", "10.0.0.1"):
        with pytest.raises(Exception, match="not"):
            _dest(bad)
    args = _parser().parse_args(["verify", "--manifests", "d", "--", "--hostname-override", "n"])
    assert args.proxy_flags == ["--", "--hostname-override", "n"]
    with pytest.raises(SystemExit):
        _parser().parse_args(["explain", "no-slash"])


def _table(world: World) -> TableView:
    fake = FakeNft()
    backend = NftablesBackend(
        IPFamily.IPV4,
        ProxierConfig(node_name="test-node"),
        executor=fake,
        clock=Clock(),
        support_check=False,
    )
    backend.sync(world.snapshot(), full())
    return TableView(FakeSource(fake), Family.IP)


def test_two_tables_compare_in_service_terms() -> None:
    world = World()
    port = ServicePort(spn("web"), ip("172.30.0.10"), 80, Protocol.TCP, node_port=30080)
    world.add(port, ep("10.180.0.1"), ep("10.180.0.2"))
    want = _table(world)
    assert compare(want, _table(world)) == []
    explained = explain_service(want, NamespacedName("ns", "web"))
    assert {f.address for f in explained.frontends} == {"172.30.0.10:80/tcp", "NodePort 30080/tcp"}
    world.add(replace(port, session_affinity_seconds=60), ep("10.180.0.1"))
    found = [str(d) for d in compare(want, _table(world))]
    assert "ns/web:http: 172.30.0.10:80/tcp: endpoints: missing 10.180.0.2:8080" in found
    assert any("affinity timeout 60 s, should be None s" in d for d in found), found
