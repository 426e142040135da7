"""nodePortAddresses resolution: keywords, CIDRs, families, host addresses."""

from __future__ import annotations

import ipaddress
from ipaddress import ip_address, ip_network

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubeproxy.nodeports import expand_node_port_cidrs, resolve_node_port_addresses
from kubeproxy.objects import IPAddress, IPFamily, NodeInfo

V4 = IPFamily.IPV4
V6 = IPFamily.IPV6

NODE = NodeInfo(
    name="node-a",
    addresses=(
        ip_address("192.168.1.10"),
        ip_address("fd00::10"),
        ip_address("10.0.0.5"),
    ),
)

HOST: tuple[IPAddress, ...] = (
    ip_address("127.0.0.1"),
    ip_address("192.168.1.10"),
    ip_address("192.168.1.11"),
    ip_address("10.0.0.5"),
    ip_address("172.16.0.1"),
    ip_address("::1"),
    ip_address("fd00::10"),
    ip_address("fe80::1"),
)


def addrs(*texts: str) -> tuple[IPAddress, ...]:
    return tuple(ip_address(t) for t in texts)


def test_empty_spec_matches_all_without_loopback() -> None:
    result = resolve_node_port_addresses([], V4, NODE, HOST)
    assert result.match_all
    assert result.cidrs == (ip_network("0.0.0.0/0"),)
    assert result.addresses == addrs("10.0.0.5", "172.16.0.1", "192.168.1.10", "192.168.1.11")


def test_empty_spec_ipv6() -> None:
    result = resolve_node_port_addresses([], V6, NODE, HOST)
    assert result.match_all
    assert result.cidrs == (ip_network("::/0"),)
    assert result.addresses == addrs("fd00::10", "fe80::1")


def test_primary_is_the_first_node_address_of_the_family() -> None:
    v4 = resolve_node_port_addresses(["primary"], V4, NODE, HOST)
    assert not v4.match_all
    assert v4.cidrs == (ip_network("192.168.1.10/32"),)
    assert v4.addresses == addrs("192.168.1.10")
    v6 = resolve_node_port_addresses(["primary"], V6, NODE, HOST)
    assert v6.cidrs == (ip_network("fd00::10/128"),)
    assert v6.addresses == addrs("fd00::10")


def test_primary_not_on_a_host_interface_gives_no_address() -> None:
    node = NodeInfo(name="n", addresses=addrs("203.0.113.7"))
    result = resolve_node_port_addresses(["primary"], V4, node, HOST)
    assert not result.match_all
    assert result.cidrs == (ip_network("203.0.113.7/32"),)
    assert result.addresses == ()


def test_primary_without_address_of_family_matches_all_like_upstream() -> None:
    node = NodeInfo(name="n", addresses=addrs("192.168.1.10"))
    result = resolve_node_port_addresses(["primary"], V6, node, HOST)
    assert result.match_all
    assert result.cidrs == (ip_network("::/0"),)


def test_localhost() -> None:
    v4 = resolve_node_port_addresses(["localhost"], V4, NODE, HOST)
    assert not v4.match_all
    assert v4.cidrs == (ip_network("127.0.0.0/8"),)
    assert v4.addresses == addrs("127.0.0.1")
    v6 = resolve_node_port_addresses(["localhost"], V6, NODE, HOST)
    assert v6.cidrs == (ip_network("::1/128"),)
    assert v6.addresses == addrs("::1")


@pytest.mark.parametrize(
    "spec", [["all"], ["0.0.0.0/0"], ["primary", "all"], ["10.0.0.0/8", "0.0.0.0/0"]]
)
def test_all_and_zero_cidr_match_all(spec: list[str]) -> None:
    result = resolve_node_port_addresses(spec, V4, NODE, HOST)
    assert result.match_all
    assert ip_network("0.0.0.0/0") in result.cidrs
    assert ip_address("127.0.0.1") not in result.addresses
    assert ip_address("172.16.0.1") in result.addresses


def test_cidrs_select_host_addresses_sorted_and_unique() -> None:
    spec = ["192.168.1.0/24", "10.0.0.0/8", "192.168.1.11/32", "fd00::/64"]
    result = resolve_node_port_addresses(spec, V4, NODE, [*HOST, ip_address("10.0.0.5")])
    assert not result.match_all
    assert result.cidrs == (
        ip_network("192.168.1.0/24"),
        ip_network("10.0.0.0/8"),
        ip_network("192.168.1.11/32"),
    )
    assert result.addresses == addrs("10.0.0.5", "192.168.1.10", "192.168.1.11")


def test_other_family_entries_are_ignored() -> None:
    v6 = resolve_node_port_addresses(["192.168.1.0/24", "fd00::/64"], V6, NODE, HOST)
    assert v6.cidrs == (ip_network("fd00::/64"),)
    assert v6.addresses == addrs("fd00::10")
    # Nothing of the family named: the family matches everything (upstream).
    only_v4 = resolve_node_port_addresses(["192.168.1.0/24"], V6, NODE, HOST)
    assert only_v4.match_all


def test_keywords_combine_with_cidrs() -> None:
    result = resolve_node_port_addresses(["primary", "localhost", "172.16.0.0/12"], V4, NODE, HOST)
    assert result.cidrs == (
        ip_network("192.168.1.10/32"),
        ip_network("127.0.0.0/8"),
        ip_network("172.16.0.0/12"),
    )
    assert result.addresses == addrs("127.0.0.1", "172.16.0.1", "192.168.1.10")


def test_duplicate_cidrs_collapse() -> None:
    cidrs = expand_node_port_cidrs(["primary", "192.168.1.10/32", "192.168.1.10"], V4, NODE)
    assert cidrs == (ip_network("192.168.1.10/32"),)


def test_non_strict_cidr_is_normalised() -> None:
    assert expand_node_port_cidrs(["10.1.2.3/8"], V4, NODE) == (ip_network("10.0.0.0/8"),)


def test_bad_entry_raises() -> None:
    with pytest.raises(ValueError, match="nope"):
        resolve_node_port_addresses(["nope"], V4, NODE, HOST)


v4_addresses = st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address)
v4_networks = st.tuples(st.integers(0, 2**32 - 1), st.integers(1, 32)).map(
    lambda t: ipaddress.IPv4Network((t[0], t[1]), strict=False)
)


@given(st.lists(v4_networks, max_size=4), st.lists(v4_addresses, max_size=8))
def test_addresses_are_exactly_the_host_addresses_in_the_cidrs(
    networks: list[ipaddress.IPv4Network], host: list[ipaddress.IPv4Address]
) -> None:
    result = resolve_node_port_addresses([str(n) for n in networks], V4, NODE, host)
    if not networks:
        assert result.match_all
        assert set(result.addresses) == {a for a in host if not a.is_loopback}
    else:
        assert not result.match_all
        assert set(result.addresses) == {a for a in host if any(a in n for n in networks)}
    assert list(result.addresses) == sorted(set(result.addresses))
