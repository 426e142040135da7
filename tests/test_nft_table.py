"""What every renderer of our table writes with (``backends/nftables/table.py``): chain
names (readable, content-hashed, bounded), upstream's base chains, the render context."""

from __future__ import annotations

import ipaddress
import logging
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubeproxy.backends.nftables.objects import validate_name
from kubeproxy.backends.nftables.table import (
    CHAIN_NAME_MAX,
    InvalidName,
    RenderContext,
    base_chains,
    chain_name,
    check_port_name,
    context_or_default,
    port_identity,
    tokens_for,
)
from kubeproxy.config import LocalDetectMode, LocalDetector
from kubeproxy.objects import IPFamily, NamespacedName, Protocol, ServicePortName


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


# Name parts near the edge of what a part may be: the allowed characters, separators at
# either end, characters nft refuses, a slash (which the one-pattern check must not let
# move a part's end), and empty parts.
_PARTS = st.text(alphabet='aZ09._-/ "\n{', max_size=6)


@given(ns=_PARTS, name=_PARTS, port=_PARTS)
def test_the_port_name_check_refuses_what_the_identity_refuses(
    ns: str, name: str, port: str
) -> None:
    candidate = spn(ns=ns, name=name, port=port)
    try:
        port_identity(candidate)
    except InvalidName:
        with pytest.raises(InvalidName):
            check_port_name(candidate)
    else:
        check_port_name(candidate)


def test_name_layout_and_hash() -> None:
    name = chain_name("service", "ns1/svc1/tcp/p80", ["rule a", "rule b"])
    prefix, tag, rest = name.split("-", 2)
    assert prefix == "service"
    assert re.fullmatch(r"[A-Z2-7]{8}", tag)
    assert rest == "ns1/svc1/tcp/p80"
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


def test_base_chains_are_upstreams_with_the_after_dnat_rules_in_the_filter_chains() -> None:
    chains = {c.name: c for c in base_chains(("jump after",))}
    hooks = {name: (c.type, c.hook, c.priority) for name, c in chains.items()}
    assert hooks == {
        "filter-prerouting-pre-dnat": ("filter", "prerouting", -110),
        "filter-output-pre-dnat": ("filter", "output", -110),
        "filter-input": ("filter", "input", 0),
        "filter-forward": ("filter", "forward", 0),
        "filter-output": ("filter", "output", 0),
        "nat-prerouting": ("nat", "prerouting", -100),
        "nat-output": ("nat", "output", -100),
        "nat-postrouting": ("nat", "postrouting", 100),
    }
    after = sorted(name for name, c in chains.items() if c.rules[-1] == "jump after")
    assert after == ["filter-forward", "filter-input", "filter-output"]
    assert chains["nat-prerouting"].rules == ("jump services",)
    assert chains["filter-input"].rules[:2] == (
        "ct state new jump nodeport-endpoints-check",
        "ct state new jump service-endpoints-check",
    )


V4 = tokens_for(IPFamily.IPV4)
V6 = tokens_for(IPFamily.IPV6)
net = ipaddress.ip_network
ip = ipaddress.ip_address


def test_render_context_says_what_is_masqueraded_and_what_is_local() -> None:
    mode = LocalDetectMode
    # What tells local traffic; everything else is masqueraded (the same match negated).
    local_matches = [
        (LocalDetector(mode.CLUSTER_CIDR, (net("10.0.0.0/8"),)), "ip saddr 10.0.0.0/8"),
        (LocalDetector(mode.NODE_CIDR, (net("10.1.2.0/24"),)), "ip saddr 10.1.2.0/24"),
        (LocalDetector(mode.BRIDGE_INTERFACE, interface="cbr0"), 'iifname "cbr0"'),
        (LocalDetector(mode.INTERFACE_NAME_PREFIX, interface="veth"), 'iifname "veth*"'),
    ]
    for detector, local in local_matches:
        match, value = local.rsplit(" ", 1)
        ctx = RenderContext.build(V4, detector, masquerade_all=False)
        assert (ctx.masquerade_match, ctx.local_match) == (f"{match} != {value}", local)
        everything = RenderContext.build(V4, detector, masquerade_all=True)
        assert (everything.masquerade_match, everything.local_match) == ("", local)
    none = RenderContext.build(V4, LocalDetector(), masquerade_all=False)
    assert (none.masquerade_match, none.local_match) == (None, None)
    assert RenderContext.build(V4, LocalDetector(), masquerade_all=True).masquerade_match == ""


def test_render_context_keeps_the_node_addresses_of_its_family() -> None:
    addresses = (ip("192.168.0.2"), ip("fd00::2"), ip("10.0.0.1"))
    ctx = RenderContext.build(V6, LocalDetector(), masquerade_all=False, node_addresses=addresses)
    assert ctx.node_addresses == (ip("fd00::2"),)
    assert ctx.tokens.table_family == "ip6"


@pytest.mark.parametrize(
    ("detector", "message"),
    [
        (LocalDetector(LocalDetectMode.BRIDGE_INTERFACE, interface='x" drop'), "interface"),
        (LocalDetector(LocalDetectMode.CLUSTER_CIDR, (net("fd00::/64"),)), "is not IPv4"),
    ],
)
def test_a_detector_nft_cannot_take_is_refused_or_dropped_with_one_line(
    detector: LocalDetector, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match=message):
        RenderContext.build(V4, detector, masquerade_all=False)
    logger = logging.getLogger("test_nft_table")
    with caplog.at_level(logging.ERROR, logger="test_nft_table"):
        ctx = context_or_default(
            V4, detector, masquerade_all=False, node_addresses=(), logger=logger
        )
    assert (ctx.masquerade_match, ctx.local_match) == (None, None)
    assert [r.getMessage() for r in caplog.records if message in r.getMessage()] != []
    assert len(caplog.records) == 1
