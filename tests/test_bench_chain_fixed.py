"""The fixed part of the per-Service-chain structure's table
(``bench/chain_structure/fixed.py``): base chains at upstream's hooks, helper chains,
containers."""

from __future__ import annotations

import ipaddress
import logging

import pytest

from bench.chain_structure.fixed import FixedStructure, fixed_structure
from bench.chain_structure.naming import is_service_chain
from kubeproxy.backend import NodePortAddresses
from kubeproxy.backends.nftables.table import Names, base_chains, chain_name
from kubeproxy.objects import IPFamily

ip = ipaddress.ip_address
net = ipaddress.ip_network


def v4(**kw: object) -> FixedStructure:
    args: dict[str, object] = {
        "masquerade_mark": 0x4000,
        "node_port_addresses": NodePortAddresses(addresses=(ip("192.168.0.2"),)),
        "service_cidrs": (net("172.30.0.0/16"),),
    }
    args.update(kw)
    return fixed_structure(IPFamily.IPV4, **args)  # type: ignore[arg-type]


def chains(structure: FixedStructure) -> dict[str, tuple[str, ...]]:
    return {c.name: c.rules for c in structure.chains}


def test_base_chains_are_upstreams_as_the_map_structure_has_them() -> None:
    # Hooks and priorities are checked in test_nft_table; this structure adds no rule.
    base = [c for c in v4().chains if c.hook is not None]
    assert base == list(base_chains())
    assert len(base) == 8


def test_ipv4_rules() -> None:
    assert chains(v4()) == {
        "filter-prerouting-pre-dnat": ("ct state new jump firewall-check",),
        "filter-output-pre-dnat": ("ct state new jump firewall-check",),
        "filter-input": (
            "ct state new jump nodeport-endpoints-check",
            "ct state new jump service-endpoints-check",
        ),
        "filter-forward": (
            "ct state new jump service-endpoints-check",
            "ct state new jump cluster-ips-check",
        ),
        "filter-output": (
            "ct state new jump service-endpoints-check",
            "ct state new jump cluster-ips-check",
        ),
        "nat-prerouting": ("jump services",),
        "nat-output": ("jump services",),
        "nat-postrouting": ("jump masquerading",),
        "services": (
            "ip daddr . meta l4proto . th dport vmap @service-ips",
            "ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports",
        ),
        "service-endpoints-check": (
            "ip daddr . meta l4proto . th dport vmap @no-endpoint-services",
        ),
        "nodeport-endpoints-check": (
            "ip daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports",
        ),
        "firewall-check": ("ip daddr . meta l4proto . th dport vmap @firewall-ips",),
        "cluster-ips-check": ("ip daddr @cluster-ips reject", "ip daddr 172.30.0.0/16 drop"),
        "reject-chain": ("reject",),
        "mark-for-masquerade": ("meta mark set meta mark or 0x4000",),
        "masquerading": (
            "ct status dnat ip saddr . ip daddr @hairpin-endpoints jump mark-for-masquerade",
            "meta mark & 0x4000 == 0 return",
            "meta mark set meta mark xor 0x4000",
            "masquerade fully-random",
        ),
        "affinity-lookup": (
            "meta l4proto tcp dnat to ip saddr . ip daddr . meta l4proto . th dport map @affinity",
            "meta l4proto udp dnat to ip saddr . ip daddr . meta l4proto . th dport map @affinity",
            "meta l4proto sctp dnat to ip saddr . ip daddr . meta l4proto . th dport map @affinity",
        ),
    }
    assert v4().nodeport_ips == ("192.168.0.2",)


def test_ipv6_and_match_all_node_ports() -> None:
    structure = fixed_structure(
        IPFamily.IPV6,
        0x10,
        NodePortAddresses(match_all=True),
        (net("fd00:10:96::/112"), net("172.30.0.0/16"), net("fd00:20::/112")),
    )
    rules = chains(structure)
    assert rules["services"][1] == (
        "fib daddr type local ip6 daddr != ::1 meta l4proto . th dport vmap @service-nodeports"
    )
    assert rules["nodeport-endpoints-check"] == (
        "ip6 daddr != ::1 meta l4proto . th dport vmap @no-endpoint-nodeports",
    )
    assert rules["cluster-ips-check"] == (
        "ip6 daddr @cluster-ips reject",
        "ip6 daddr fd00:10:96::/112 drop",
        "ip6 daddr fd00:20::/112 drop",
    )
    assert rules["mark-for-masquerade"] == ("meta mark set meta mark or 0x10",)
    types = {c.name: c.type for c in structure.containers}
    assert types[Names.SERVICE_IPS] == "ipv6_addr . inet_proto . inet_service : verdict"
    assert types[Names.HAIRPIN_ENDPOINTS] == "ipv6_addr . ipv6_addr"
    assert types[Names.AFFINITY] == (
        "ipv6_addr . ipv6_addr . inet_proto . inet_service : ipv6_addr . inet_service"
    )
    assert structure.nodeport_ips == ()


def test_affinity_map_is_dynamic_with_timeout_and_bounded() -> None:
    affinity = next(c for c in v4().containers if c.name == Names.AFFINITY)
    assert affinity.is_map
    assert set(affinity.flags) == {"dynamic", "timeout"}
    assert affinity.timeout == 3 * 3600
    assert affinity.size == 1048576


def test_loopback_node_port_addresses_are_skipped_with_a_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR):
        structure = v4(
            node_port_addresses=NodePortAddresses(
                addresses=(ip("127.0.0.1"), ip("192.168.0.2"), ip("2001:db8::1"))
            )
        )
    assert structure.nodeport_ips == ("192.168.0.2",)
    assert len(caplog.records) == 1
    assert "127.0.0.1" in caplog.records[0].getMessage()


def test_fingerprint_follows_every_input() -> None:
    base = v4().fingerprint
    assert v4().fingerprint == base
    assert v4(masquerade_mark=0x8000).fingerprint != base
    assert v4(service_cidrs=()).fingerprint != base
    assert v4(node_port_addresses=NodePortAddresses(match_all=True)).fingerprint != base
    assert (
        v4(node_port_addresses=NodePortAddresses(addresses=(ip("192.168.0.3"),))).fingerprint
        != base
    )


def test_no_fixed_chain_is_taken_for_a_service_chain() -> None:
    # A full sync deletes every service chain no port wants: a fixed one must never be one.
    for structure in (v4(), v4(node_port_addresses=NodePortAddresses(match_all=True))):
        names = [chain.name for chain in structure.chains]
        assert "services" in names and "filter-input" in names
        assert [name for name in names if is_service_chain(name)] == []
    assert is_service_chain(chain_name("service", "ns1/svc1/tcp/p80", ["rule a"]))
