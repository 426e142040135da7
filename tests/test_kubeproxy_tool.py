"""``kubeproxy`` without a kernel: its arguments, and ``verify``'s comparison of two
tables the backend wrote into fakes (the kernel tests are in test_explain_kernel.py)."""

from __future__ import annotations

import io
import ipaddress
from dataclasses import replace

import pytest

from kubeproxy.backends.nftables import NftablesBackend
from kubeproxy.backends.nftables.explain import (
    FakeSource,
    ServiceView,
    TableView,
    explain_address,
    explain_service,
)
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.backends.nftables.verify import compare, compare_written
from kubeproxy.backends.nftables.written import WrittenSource, WrittenTable
from kubeproxy.cmd.kubeproxy import _dest, _parser, _print_views, _target
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
    before = replace(world, services=dict(world.services), endpoints=dict(world.endpoints))
    explained = explain_service(want, NamespacedName("ns", "web"))
    assert {f.address for f in explained.frontends} == {"172.30.0.10:80/tcp", "NodePort 30080/tcp"}
    world.add(replace(port, session_affinity_seconds=60), ep("10.180.0.1"))
    found = [str(d) for d in compare(want, _table(world))]
    assert "ns/web:http: 172.30.0.10:80/tcp: endpoints: missing 10.180.0.2:8080" in found
    assert any("affinity timeout 60 s, should be None s" in d for d in found), found
    # The fast comparison (what the command runs) says the same of the Service, and
    # names the chains of the class the kernel lacks.
    fast = compare_written(
        WrittenSource(_written(before)), WrittenSource(_written(world)), Family.IP
    )
    assert [str(d) for d in fast if d.subject == "ns/web:http"] == found
    assert any(d.what.startswith("chain internal-2.g1: missing") for d in fast), fast


def _written(world: World) -> WrittenTable:
    written = WrittenTable()
    backend = NftablesBackend(
        IPFamily.IPV4, ProxierConfig(node_name="n"), executor=written, support_check=False
    )
    backend.sync(world.snapshot(), full())
    return written


def test_explain_finds_a_service_by_name_or_one_frontend_by_address() -> None:
    world = World()
    web = ServicePort(spn("web"), ip("172.30.0.10"), 80, Protocol.TCP, node_port=30080)
    world.add(web, ep("10.180.0.1"))
    # A Service whose name begins with the other's: the filter is a prefilter only.
    world.add(ServicePort(spn("web2"), ip("172.30.0.11"), 80, Protocol.TCP), ep("10.180.0.2"))
    view = _table(world)
    named = explain_service(view, NamespacedName("ns", "web"))
    assert {f.name for f in named.frontends} == {"ns/web:http"}
    # No container naming Services was dumped whole: they were read through the filter.
    assert not {c for _kind, c, _verdict in view.named_containers()} & set(view._dumps)
    at = explain_address(view, ip("172.30.0.11"), 80, "tcp")
    assert at is not None and at.name == "ns/web2:http" and at.endpoints == ("10.180.0.2:8080",)
    # The node's nodePortAddresses (nodeport-ips) hold 192.168.0.2.
    nodeport = explain_address(view, ip("192.168.0.2"), 30080, "tcp")
    assert nodeport is not None and nodeport.address == "NodePort 30080/tcp"
    assert nodeport.nodeport_addresses == ("192.168.0.2",)
    assert explain_address(view, ip("192.168.0.9"), 30080, "tcp") is None
    assert explain_address(view, ip("172.30.0.10"), 81, "tcp") is None


def test_a_family_holding_nothing_is_one_line() -> None:
    world = World()
    world.add(ServicePort(spn("web"), ip("172.30.0.10"), 80, Protocol.TCP), ep("10.180.0.1"))
    service = NamespacedName("ns", "web")
    held = explain_service(_table(world), service)
    absent = ServiceView(service, Family.IP6, None)
    out = io.StringIO()
    _print_views([held, absent], out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "ns/web in ip kube-proxy, generation 1:"
    assert lines[-1] == "ns/web: not in ip6 (no table ip6 kube-proxy)"
    out = io.StringIO()
    _print_views([ServiceView(service, Family.IP, 3), absent], out)
    assert out.getvalue() == (
        "ns/web: not in ip (generation 3 has no frontend of it),"
        " nor in ip6 (no table ip6 kube-proxy)\n"
    )


def test_explain_takes_a_service_or_an_address() -> None:
    assert _target("demo/web") == NamespacedName("demo", "web")
    assert _target("10.0.0.1:53/udp") == (ip("10.0.0.1"), 53, "udp")
    with pytest.raises(Exception, match="neither NAMESPACE/SERVICE nor IP:PORT/PROTO"):
        _target("web")
