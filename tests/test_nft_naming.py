"""Chain names: readable, content-hashed, bounded."""

from __future__ import annotations

import re

import pytest

from kubeproxy.backends.nftables.naming import (
    CHAIN_NAME_MAX,
    InvalidName,
    chain_name,
    is_service_chain,
    port_identity,
)
from kubeproxy.backends.nftables.objects import validate_name
from kubeproxy.objects import NamespacedName, Protocol, ServicePortName


def spn(ns: str = "ns1", name: str = "svc1", port: str = "p80") -> ServicePortName:
    return ServicePortName(NamespacedName(ns, name), port, Protocol.TCP)


def test_identity_is_readable() -> None:
    assert port_identity(spn()) == "ns1/svc1/tcp/p80"
    assert port_identity(ServicePortName(NamespacedName("a", "b"), "", Protocol.UDP)) == "a/b/udp/"


@pytest.mark.parametrize(
    "name",
    [spn(ns="bad ns"), spn(name='x"y'), spn(port="a;b"), spn(ns=""), spn(name="-x"), spn(port="{")],
)
def test_identity_refuses_names_nft_cannot_take(name: ServicePortName) -> None:
    with pytest.raises(InvalidName):
        port_identity(name)


def test_name_layout_and_hash() -> None:
    name = chain_name("service", "ns1/svc1/tcp/p80", ["rule a", "rule b"])
    prefix, tag, rest = name.split("-", 2)
    assert prefix == "service"
    assert re.fullmatch(r"[A-Z2-7]{8}", tag)
    assert rest == "ns1/svc1/tcp/p80"
    assert is_service_chain(name)
    validate_name("chain", name)


def test_same_rules_same_name_and_any_change_a_new_name() -> None:
    base = chain_name("service", "ns1/svc1/tcp/p80", ["a", "b"])
    assert chain_name("service", "ns1/svc1/tcp/p80", ("a", "b")) == base
    assert chain_name("service", "ns1/svc1/tcp/p80", ["a", "c"]) != base
    assert chain_name("service", "ns1/svc1/tcp/p80", ["b", "a"]) != base
    assert chain_name("service", "ns1/svc1/tcp/p80", ["ab"]) != base
    assert (
        chain_name("local", "ns1/svc1/tcp/p80", ["a", "b"]).split("-", 2)[1]
        != base.split("-", 2)[1]
    )
    assert (
        chain_name("service", "ns1/svc2/tcp/p80", ["a", "b"]).split("-", 2)[1]
        != base.split("-", 2)[1]
    )


def test_group_chain_suffix() -> None:
    name = chain_name("group", "ns1/svc1/tcp/p80", ["x"], group=3)
    assert name.endswith("-ns1/svc1/tcp/p80/3")
    assert name != chain_name("group", "ns1/svc1/tcp/p80", ["x"], group=4)


def test_long_names_are_truncated_and_stay_unique() -> None:
    ns = "n" * 63
    a = port_identity(spn(ns=ns, name="a" * 62 + "1", port="p" * 15))
    b = port_identity(spn(ns=ns, name="a" * 62 + "2", port="p" * 15))
    long_a = chain_name("external", a + "/" + "x" * 200, ["r"])
    long_b = chain_name("external", b + "/" + "x" * 200, ["r"])
    assert len(long_a) == CHAIN_NAME_MAX
    assert long_a.endswith("...")
    assert long_a != long_b
    validate_name("chain", long_a)


def test_fixed_chain_names_are_not_service_chains() -> None:
    for name in ("services", "filter-input", "mark-for-masquerade", "reject-chain"):
        assert not is_service_chain(name)
