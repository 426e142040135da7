"""What one Service port renders to in the per-Service-chain structure
(``bench/chain_structure/render.py``): chains, elements, claims (pure, no kernel)."""

from __future__ import annotations

import ipaddress
import re
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.chain_structure.render import CASCADE_MAX, PortRules, render_port
from kubeproxy.backends.nftables.table import InvalidPort, RenderContext, tokens_for
from kubeproxy.config import LocalDetectMode, LocalDetector
from kubeproxy.objects import (
    CategorizedEndpoints,
    Endpoint,
    IPFamily,
    NamespacedName,
    Protocol,
    ServicePort,
    ServicePortName,
)

ip = ipaddress.ip_address
net = ipaddress.ip_network
NAME = ServicePortName(NamespacedName("ns", "web"), "http", Protocol.TCP)
CIDR = LocalDetector(LocalDetectMode.CLUSTER_CIDR, (net("10.0.0.0/8"),))
V4 = RenderContext.build(
    tokens_for(IPFamily.IPV4), CIDR, masquerade_all=False, node_addresses=(ip("192.168.0.2"),)
)


def ep(addr: str, port: int = 8080, local: bool = False) -> Endpoint:
    return Endpoint(ip(addr), port, is_local=local)


def cats(
    cluster: tuple[Endpoint, ...] = (),
    local: tuple[Endpoint, ...] = (),
    has_any: bool | None = None,
) -> CategorizedEndpoints:
    reachable = tuple(dict.fromkeys(cluster + local))
    return CategorizedEndpoints(
        cluster, local, reachable, bool(reachable) if has_any is None else has_any
    )


def port(**kw: object) -> ServicePort:
    args: dict[str, object] = {
        "name": NAME,
        "cluster_ip": ip("172.30.0.1"),
        "port": 80,
        "protocol": Protocol.TCP,
    }
    args.update(kw)
    return ServicePort(**args)  # type: ignore[arg-type]


_HASHED = re.compile(r"\b(service|local|external|firewall|group)-[A-Z2-7]{8}-ns/web/tcp/http")


def text(rules: PortRules) -> str:
    """A readable form with the hashes taken out (they are tested in test_nft_table)."""

    def plain(s: str) -> str:
        return _HASHED.sub(lambda m: m.group(1), s)

    lines = []
    for chain in rules.chains:
        lines.append(f"chain {plain(chain.name)}")
        lines.extend(f"  {plain(rule)}" for rule in chain.rules)
    for container, key, value in rules.elements:
        lines.append(f"{container}: {' . '.join(key)} : {plain(value[0])}")
    for container, key in rules.set_elements:
        lines.append(f"{container}: {' . '.join(key)}")
    return "\n".join(lines)


def golden(s: str) -> str:
    return "\n".join(
        line[4:] if line.startswith("    ") else line for line in s.strip().splitlines()
    )


def test_cluster_ip_two_endpoints() -> None:
    rules = render_port(V4, port(), cats((ep("10.180.0.2"), ep("10.180.0.1"))))
    assert text(rules) == golden(
        """
    chain service
      ip daddr 172.30.0.1 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
      numgen random mod 2 0 meta l4proto tcp dnat to 10.180.0.1:8080
      meta l4proto tcp dnat to 10.180.0.2:8080
    service-ips: 172.30.0.1 . tcp . 80 : goto service
    cluster-ips: 172.30.0.1
    hairpin-endpoints: 10.180.0.2 . 10.180.0.2
    hairpin-endpoints: 10.180.0.1 . 10.180.0.1
    """
    )
    assert rules.claims == {("172.30.0.1", "tcp", "80")}


def test_endpoints_sorted_as_strings_like_upstream() -> None:
    rules = render_port(V4, port(), cats((ep("10.1.1.1", 11), ep("10.1.1.11", 11))))
    dnats = [r for r in rules.chains[0].rules if "dnat" in r]
    assert dnats[0].endswith("10.1.1.11:11") and dnats[1].endswith("10.1.1.1:11")


def test_no_endpoints_rejects() -> None:
    rules = render_port(V4, port(protocol=Protocol.UDP, name=NAME), cats())
    assert rules.chains == ()
    assert text(rules) == golden(
        """
    no-endpoint-services: 172.30.0.1 . udp . 80 : goto reject-chain
    cluster-ips: 172.30.0.1
    """
    )


def test_internal_local_without_local_endpoints_drops() -> None:
    rules = render_port(V4, port(internal_policy_local=True), cats((ep("10.180.0.1"),), ()))
    assert rules.chains == ()
    assert text(rules) == golden(
        """
    no-endpoint-services: 172.30.0.1 . tcp . 80 : drop
    cluster-ips: 172.30.0.1
    hairpin-endpoints: 10.180.0.1 . 10.180.0.1
    """
    )


def test_internal_local_masquerades_in_local_chain() -> None:
    local = ep("10.180.0.1", local=True)
    rules = render_port(V4, port(internal_policy_local=True), cats((local,), (local,)))
    assert text(rules) == golden(
        """
    chain local
      ip daddr 172.30.0.1 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
      meta l4proto tcp dnat to 10.180.0.1:8080
    service-ips: 172.30.0.1 . tcp . 80 : goto local
    cluster-ips: 172.30.0.1
    hairpin-endpoints: 10.180.0.1 . 10.180.0.1
    """
    )


def test_node_port_cluster_policy() -> None:
    rules = render_port(
        V4, port(node_port=30080, external_ips=(ip("5.6.7.8"),)), cats((ep("10.180.0.1"),))
    )
    assert text(rules) == golden(
        """
    chain service
      ip daddr 172.30.0.1 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
      meta l4proto tcp dnat to 10.180.0.1:8080
    chain external
      jump mark-for-masquerade
      goto service
    service-ips: 172.30.0.1 . tcp . 80 : goto service
    service-ips: 5.6.7.8 . tcp . 80 : goto external
    service-nodeports: tcp . 30080 : goto external
    cluster-ips: 172.30.0.1
    hairpin-endpoints: 10.180.0.1 . 10.180.0.1
    """
    )
    assert rules.claims == {("172.30.0.1", "tcp", "80"), ("5.6.7.8", "tcp", "80"), ("tcp", "30080")}


def test_external_local_with_source_ranges_allowing_the_node() -> None:
    local = ep("10.180.0.1", local=True)
    other = ep("10.180.9.1")
    rules = render_port(
        V4,
        port(
            node_port=30080,
            load_balancer_vips=(ip("5.6.7.8"),),
            load_balancer_source_ranges=(net("203.0.113.0/25"), net("192.168.0.0/24")),
            external_policy_local=True,
            health_check_node_port=30999,
        ),
        cats((local, other), (local,)),
    )
    assert text(rules) == golden(
        """
    chain service
      ip daddr 172.30.0.1 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
      numgen random mod 2 0 meta l4proto tcp dnat to 10.180.0.1:8080
      meta l4proto tcp dnat to 10.180.9.1:8080
    chain local
      meta l4proto tcp dnat to 10.180.0.1:8080
    chain external
      ip saddr 10.0.0.0/8 goto service
      fib saddr type local jump mark-for-masquerade
      fib saddr type local goto service
      goto local
    chain firewall
      ip saddr 203.0.113.0/25 return
      ip saddr 192.168.0.0/24 return
      ip saddr 5.6.7.8 return
      drop
    service-ips: 172.30.0.1 . tcp . 80 : goto service
    service-ips: 5.6.7.8 . tcp . 80 : goto external
    firewall-ips: 5.6.7.8 . tcp . 80 : goto firewall
    service-nodeports: tcp . 30080 : goto external
    cluster-ips: 172.30.0.1
    hairpin-endpoints: 10.180.0.1 . 10.180.0.1
    hairpin-endpoints: 10.180.9.1 . 10.180.9.1
    """
    )


def test_source_ranges_without_the_node_do_not_allow_the_vip() -> None:
    rules = render_port(
        V4,
        port(load_balancer_vips=(ip("5.6.7.8"),), load_balancer_source_ranges=(net("1.2.3.0/24"),)),
        cats((ep("10.180.0.1"),)),
    )
    firewall = [c for c in rules.chains if c.name.startswith("firewall-")]
    assert firewall[0].rules == ("ip saddr 1.2.3.0/24 return", "drop")


def test_external_local_without_local_endpoints() -> None:
    rules = render_port(
        V4,
        port(node_port=30081, external_ips=(ip("5.6.7.8"),), external_policy_local=True),
        cats((ep("10.180.9.1"),), ()),
    )
    assert text(rules) == golden(
        """
    chain service
      ip daddr 172.30.0.1 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
      meta l4proto tcp dnat to 10.180.9.1:8080
    chain external
      ip saddr 10.0.0.0/8 goto service
      fib saddr type local jump mark-for-masquerade
      fib saddr type local goto service
    service-ips: 172.30.0.1 . tcp . 80 : goto service
    service-ips: 5.6.7.8 . tcp . 80 : goto external
    no-endpoint-services: 5.6.7.8 . tcp . 80 : drop
    service-nodeports: tcp . 30081 : goto external
    no-endpoint-nodeports: tcp . 30081 : drop
    cluster-ips: 172.30.0.1
    hairpin-endpoints: 10.180.9.1 . 10.180.9.1
    """
    )


def test_external_without_any_endpoint_rejects_everywhere() -> None:
    rules = render_port(
        V4,
        port(node_port=30081, load_balancer_vips=(ip("5.6.7.8"),), external_policy_local=True),
        cats(),
    )
    assert text(rules) == golden(
        """
    no-endpoint-services: 172.30.0.1 . tcp . 80 : goto reject-chain
    no-endpoint-services: 5.6.7.8 . tcp . 80 : goto reject-chain
    no-endpoint-nodeports: tcp . 30081 : goto reject-chain
    cluster-ips: 172.30.0.1
    """
    )


def test_session_affinity() -> None:
    rules = render_port(
        V4, port(session_affinity_seconds=600), cats((ep("10.180.0.1"), ep("10.180.0.2")))
    )
    upd = "update @affinity { ip saddr . ip daddr . meta l4proto . th dport timeout 600s : "
    assert text(rules) == golden(
        f"""
    chain service
      ip daddr 172.30.0.1 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
      jump affinity-lookup
      numgen random mod 2 0 {upd}10.180.0.1 . 8080 }} meta l4proto tcp dnat to 10.180.0.1:8080
      {upd}10.180.0.2 . 8080 }} meta l4proto tcp dnat to 10.180.0.2:8080
    service-ips: 172.30.0.1 . tcp . 80 : goto service
    cluster-ips: 172.30.0.1
    hairpin-endpoints: 10.180.0.1 . 10.180.0.1
    hairpin-endpoints: 10.180.0.2 . 10.180.0.2
    """
    )


def test_ipv6() -> None:
    ctx = RenderContext.build(
        tokens_for(IPFamily.IPV6),
        LocalDetector(LocalDetectMode.CLUSTER_CIDR, (net("fd00:10::/64"),)),
        masquerade_all=False,
    )
    rules = render_port(
        ctx,
        port(cluster_ip=ip("fd00:10:96::10"), node_port=30000),
        cats((ep("fd00:10::a1"),)),
    )
    assert text(rules) == golden(
        """
    chain service
      ip6 daddr fd00:10:96::10 ip6 saddr != fd00:10::/64 jump mark-for-masquerade
      meta l4proto tcp dnat to [fd00:10::a1]:8080
    chain external
      jump mark-for-masquerade
      goto service
    service-ips: fd00:10:96::10 . tcp . 80 : goto service
    service-nodeports: tcp . 30000 : goto external
    cluster-ips: fd00:10:96::10
    hairpin-endpoints: fd00:10::a1 . fd00:10::a1
    """
    )
    assert rules.affinity_maps == ()


def test_ipv6_affinity_uses_small_per_port_maps() -> None:
    """nft 1.0.6 aborts on IPv6 map updates with more than 32 bytes of key and value."""
    ctx = RenderContext.build(tokens_for(IPFamily.IPV6), LocalDetector(), masquerade_all=False)
    eps = (
        ep("fd00:10::a1", local=True),
        ep("fd00:10::a2", 9090),
        ep("fd00:10::a3", 9090),
    )
    rules = render_port(
        ctx,
        port(
            cluster_ip=ip("fd00:10:96::10"),
            session_affinity_seconds=10,
            node_port=30000,
            external_policy_local=True,
        ),
        cats(eps, eps[:1]),
    )
    maps = dict(rules.affinity_maps)
    names = re.findall(r"@(affinity-[A-Z2-7]{16})", text(rules))
    assert set(names) == set(maps)
    assert len(maps) == 3  # service chain: ports 8080 and 9090; local chain: 8080
    assert sorted(sorted(h) for h in maps.values()) == [
        ["fd00:10::a1"],
        ["fd00:10::a1"],
        ["fd00:10::a2", "fd00:10::a3"],
    ]
    service = next(c for c in rules.chains if c.name.startswith("service-"))
    map8080, map9090 = re.findall(r"@(affinity-\S+) : (\d+)", "\n".join(service.rules))
    assert service.rules[:2] == (
        f"meta l4proto tcp dnat to ip6 saddr map @{map8080[0]} : 8080",
        f"meta l4proto tcp dnat to ip6 saddr map @{map9090[0]} : 9090",
    )
    assert (
        f"update @{map9090[0]} {{ ip6 saddr timeout 10s : fd00:10::a2 }} "
        "meta l4proto tcp dnat to [fd00:10::a2]:9090"
    ) in service.rules[3]
    local = next(c for c in rules.chains if c.name.startswith("local-"))
    assert map8080[0] not in "\n".join(local.rules)
    assert "affinity-lookup" not in text(rules)


@pytest.mark.parametrize(
    ("detector", "masquerade_all", "masq", "local"),
    [
        (LocalDetector(), False, None, None),
        (LocalDetector(), True, "ip daddr 172.30.0.1 jump mark-for-masquerade", None),
        (
            CIDR,
            True,
            "ip daddr 172.30.0.1 jump mark-for-masquerade",
            "ip saddr 10.0.0.0/8 goto service",
        ),
        (
            LocalDetector(LocalDetectMode.BRIDGE_INTERFACE, interface="cbr0"),
            False,
            'ip daddr 172.30.0.1 iifname != "cbr0" jump mark-for-masquerade',
            'iifname "cbr0" goto service',
        ),
        (
            LocalDetector(LocalDetectMode.INTERFACE_NAME_PREFIX, interface="veth"),
            False,
            'ip daddr 172.30.0.1 iifname != "veth*" jump mark-for-masquerade',
            'iifname "veth*" goto service',
        ),
    ],
)
def test_detectors(
    detector: LocalDetector, masquerade_all: bool, masq: str | None, local: str | None
) -> None:
    ctx = RenderContext.build(tokens_for(IPFamily.IPV4), detector, masquerade_all=masquerade_all)
    rules = render_port(
        ctx, port(node_port=30000, external_policy_local=True), cats((ep("10.1.0.1"),))
    )
    lines = text(rules).splitlines()
    assert lines[0] == "chain service"
    if masq is None:
        assert lines[1] == "  meta l4proto tcp dnat to 10.1.0.1:8080"
    else:
        assert lines[1] == f"  {masq}"
    external = lines[lines.index("chain external") + 1 :]
    if local is None:
        assert external[0] == "  fib saddr type local jump mark-for-masquerade"
    else:
        assert external[0] == f"  {local}"


def test_external_ip_equal_to_cluster_ip_is_not_doubled() -> None:
    rules = render_port(V4, port(external_ips=(ip("172.30.0.1"),)), cats((ep("10.1.0.1"),)))
    keys = [(c, k) for c, k, _v in rules.elements]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(
    ("kw", "eps", "message"),
    [
        ({"port": 0}, (), "port 0"),
        ({"node_port": 70000}, (), "nodePort"),
        ({"cluster_ip": ip("fd00::1")}, (), "cluster IP"),
        ({"session_affinity_seconds": 86401}, (), "affinity"),
        ({}, (ep("fd00::2"),), "endpoint fd00::2"),
        ({}, (Endpoint(ip("10.0.0.1"), 0),), "endpoint port"),
        ({"name": ServicePortName(NamespacedName("ns", "a b"), "", Protocol.TCP)}, (), "name"),
    ],
)
def test_invalid_ports_are_refused(
    kw: dict[str, object], eps: tuple[Endpoint, ...], message: str
) -> None:
    with pytest.raises(InvalidPort if "name" not in kw else ValueError, match=message):
        render_port(V4, port(**kw), cats(eps))


# Endpoint choice: uniform, flat up to CASCADE_MAX, two levels above -------------------------

_NUMGEN_EQ = re.compile(r"^numgen random mod (\d+) 0 (.*)$")
_NUMGEN_LT = re.compile(r"^numgen random mod (\d+) < (\d+) goto (\S+)$")


def _distribution(rules: PortRules, chain_name: str) -> dict[str, Fraction]:
    """Probability of each dnat target when a packet enters ``chain_name``."""
    chains = {c.name: c.rules for c in rules.chains}
    result: dict[str, Fraction] = {}
    left = Fraction(1)
    for rule in chains[chain_name]:
        if "jump mark-for-masquerade" in rule or "jump affinity-lookup" in rule:
            continue
        if m := _NUMGEN_LT.match(rule):
            mod, below, target = int(m[1]), int(m[2]), m[3]
            p = left * Fraction(below, mod)
        elif m := _NUMGEN_EQ.match(rule):
            p = left * Fraction(1, int(m[1]))
            target = m[2]
        else:
            p, target = left, rule
        left -= p
        if target.startswith("goto "):
            target = target.removeprefix("goto ")
        if target in chains:
            for ep_, q in _distribution(rules, target).items():
                result[ep_] = result.get(ep_, Fraction(0)) + p * q
        else:
            dest = target.rsplit(" ", 1)[-1]
            result[dest] = result.get(dest, Fraction(0)) + p
    assert left == 0, "the last rule must be unconditional"
    return result


@given(st.integers(min_value=1, max_value=120), st.booleans())
def test_endpoint_choice_is_uniform(count: int, affinity: bool) -> None:
    eps = tuple(ep(f"10.{i // 250}.{i % 250}.1") for i in range(count))
    rules = render_port(V4, port(session_affinity_seconds=30 if affinity else 0), cats(eps))
    service = next(c for c in rules.chains if c.name.startswith("service-"))
    dist = _distribution(rules, service.name)
    assert set(dist) == {f"10.{i // 250}.{i % 250}.1:8080" for i in range(count)}
    assert set(dist.values()) == {Fraction(1, count)}
    groups = [c for c in rules.chains if c.name.startswith("group-")]
    if count <= CASCADE_MAX:
        assert not groups
    else:
        # About 2 sqrt(N) rules on the way to any endpoint.
        assert len(groups) * len(groups) >= count
        assert max(len(g.rules) for g in groups) <= len(groups) + 1
        assert len(service.rules) <= len(groups) + 2


def test_service_and_local_groups_do_not_collide() -> None:
    eps = tuple(ep(f"10.0.{i}.1", local=True) for i in range(20))
    rules = render_port(V4, port(node_port=30000, external_policy_local=True), cats(eps, eps))
    names = [c.name for c in rules.chains]
    assert len(names) == len(set(names))
    groups = [n for n in names if n.startswith("group-")]
    assert len(groups) == 10
