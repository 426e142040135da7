"""NftablesBackend (the map structure) on FakeNft: what a sync writes, what an incremental
sync sends, generations, conflicts, failures, upgrades from the per-Service-chain
structure, and the property that incremental syncs end where a fresh full sync starts.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubeproxy.backend import Backend, NodePortAddresses, ProxySnapshot, SyncChanges, SyncError
from kubeproxy.backends.nftables import NftablesBackend
from kubeproxy.backends.nftables.backend import restitch
from kubeproxy.backends.nftables.fake import FakeNft, parse_commands
from kubeproxy.backends.nftables.inspect import served_frontends, slots_of
from kubeproxy.backends.nftables.layout import (
    AFFINITY_PER_PORT,
    AFFINITY_PINNED,
    AFFINITY_SHARED,
    AFFINITY_SHARED_IPV4,
    CLASS_NAME,
    generation_of,
)
from kubeproxy.backends.nftables.objects import (
    Chain,
    Element,
    Family,
    Map,
    NftError,
    Rule,
    Set,
    readable_by_every_nft,
)
from kubeproxy.backends.nftables.table import (
    AFFINITY_SHARDS,
    affinity_frontend6_pin,
    affinity_frontend_shard,
    affinity_map_name,
    affinity_pin,
    port_identity,
)
from kubeproxy.config import LocalDetector, ProxierConfig
from kubeproxy.objects import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName
from tests import chain_ruleset
from tests.nftmachine import NftWorldMachine, V6Machine
from tests.snapshots import (
    Clock,
    World,
    changed,
    ep,
    full,
    spn,
    v6_world,
)

ip = ipaddress.ip_address
net = ipaddress.ip_network
CONFIG = ProxierConfig(node_name="test-node")


def backend(
    fake: FakeNft,
    clock: Clock | None = None,
    family: IPFamily = IPFamily.IPV4,
    *,
    elements_per_transaction: int = 10_000,
    affinity: str = AFFINITY_SHARED,
    precreate_counts: int = 0,
) -> NftablesBackend:
    return NftablesBackend(
        family,
        CONFIG,
        executor=fake,
        clock=clock or Clock(),
        elements_per_transaction=elements_per_transaction,
        affinity=affinity,
        support_check=False,
        precreate_counts=precreate_counts,
    )


def web(world: World, *addrs: str, **fields: object) -> ServicePortName:
    port = ServicePort(spn("web"), ip("172.30.0.10"), 80, Protocol.TCP)
    return world.add(replace(port, **fields), *(ep(a) for a in addrs))  # type: ignore[arg-type]


def lines(text: str, pattern: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(pattern, line)]


def _chains(fake: FakeNft, family: Family = Family.IP) -> dict[str, list[str]]:
    chains: dict[str, list[str]] = {}
    for _fam, _table, _verb, obj in parse_commands(fake.dump(family)):
        if isinstance(obj, Chain):
            chains.setdefault(obj.name, [])
        elif isinstance(obj, Rule):
            chains[obj.chain].append(obj.rule)
    return chains


class _Tree:
    """The fake's current dispatch tree, walked as the kernel walks it."""

    def __init__(self, fake: FakeNft, family: Family = Family.IP) -> None:
        self.chains = _chains(fake, family)
        self.members = {
            name: {e.key for e in fake.list_elements(family, "kube-proxy", name)}
            for name in fake.list_sets(family, "kube-proxy")
            if "class-bit-" in name or name.startswith("dispatch-")
        }

    def walk(self, key: tuple[str, ...]) -> tuple[str | None, int]:
        """Where a new connection to frontend ``key`` ends up: (its class chain, the set
        lookups on the way)."""
        kind = "ips" if len(key) == 3 else "nodeports"
        (services,) = [r for r in self.chains["services"] if f"@dispatch-{kind}." in r]
        dispatch, chain = re.findall(r"@(\S+) goto (\S+)", services)[0]
        if key not in self.members[dispatch]:
            return None, 1
        lookups = 1
        while True:
            for rule in self.chains[chain]:
                found = re.fullmatch(r".* @(\S+) goto (\S+)", rule)
                if found is None:
                    return rule.removeprefix("goto "), lookups
                lookups += 1
                if key in self.members[found.group(1)]:
                    chain = found.group(2)
                    break
            else:
                return None, lookups

    def classes(self) -> dict[tuple[str, ...], str]:
        """Every dispatched frontend -> the class chain its new connections reach."""
        out = {}
        for name, keys in self.members.items():
            if re.fullmatch(r"dispatch-(ips|nodeports)\.g[0-9]+", name):
                for key in keys:
                    cls, _ = self.walk(key)
                    assert cls is not None, key
                    out[key] = cls
        return out


def classes_of(fake: FakeNft, family: Family = Family.IP) -> dict[tuple[str, ...], str]:
    """Every dispatched frontend -> the class chain its new connections reach."""
    return _Tree(fake, family).classes()


# What a full sync writes --------------------------------------------------------------------


def test_a_service_is_data_behind_a_few_fixed_rules() -> None:
    world = World()
    web(world, "10.180.0.1", "10.180.0.2", node_port=30080)
    fake = FakeNft()
    backend(fake).sync(world.snapshot(), full())
    dump = fake.dump()
    assert lines(dump, r"rule ip kube-proxy (services|dispatch-[a-z]+-0\.g1) ") == [
        "add rule ip kube-proxy dispatch-ips-0.g1 goto internal-2.g1",
        "add rule ip kube-proxy dispatch-nodeports-0.g1 goto nodeport-2.g1",
        "add rule ip kube-proxy services "
        "ip daddr . meta l4proto . th dport @dispatch-ips.g1 goto dispatch-ips-0.g1",
        "add rule ip kube-proxy services "
        "ip daddr @nodeport-ips meta l4proto . th dport @dispatch-nodeports.g1 "
        "goto dispatch-nodeports-0.g1",
    ]
    assert lines(dump, r"rule ip kube-proxy (internal|pick)-2\.g1 ") == [
        "add rule ip kube-proxy internal-2.g1 ip saddr != 10.0.0.0/8 jump mark-for-masquerade",
        "add rule ip kube-proxy internal-2.g1 goto pick-2.g1",
        "add rule ip kube-proxy pick-2.g1 "
        "dnat to ip daddr . meta l4proto . th dport . numgen random mod 2 map @endpoints-tcp-b2.g1",
        "add rule ip kube-proxy pick-2.g1 "
        "dnat to ip daddr . meta l4proto . th dport . numgen random mod 2 map @endpoints-udp-b2.g1",
        "add rule ip kube-proxy pick-2.g1 "
        "dnat to ip daddr . meta l4proto . th dport . numgen random mod 2 "
        "map @endpoints-sctp-b2.g1",
    ]
    assert lines(dump, r"element ip kube-proxy (dispatch-ips|endpoints-tcp|cluster-ips)") == [
        "add element ip kube-proxy cluster-ips { 172.30.0.10 }",
        # The frontend names its Service port (what `kubeproxy explain` reads back).
        "add element ip kube-proxy dispatch-ips.g1 "
        '{ 172.30.0.10 . tcp . 80 comment "ns/web:http" }',
        "add element ip kube-proxy endpoints-tcp-b2.g1 "
        "{ 172.30.0.10 . tcp . 80 . 0 : 10.180.0.1 . 8080 }",
        "add element ip kube-proxy endpoints-tcp-b2.g1 "
        "{ 172.30.0.10 . tcp . 80 . 1 : 10.180.0.2 . 8080 }",
    ]
    # The NodePort is masqueraded (externalTrafficPolicy: Cluster) and has its own slots.
    assert "add rule ip kube-proxy nodeport-2.g1 jump mark-for-masquerade" in dump
    assert "nodeport-endpoints-tcp-b2.g1 { tcp . 30080 . 1 : 10.180.0.2 . 8080 }" in dump


def test_no_endpoints_reject_and_local_policy_drops() -> None:
    world = World()
    world.add(ServicePort(spn("empty"), ip("172.30.0.11"), 80, Protocol.TCP))
    world.add(
        ServicePort(
            spn("remote"),
            ip("172.30.0.12"),
            53,
            Protocol.UDP,
            node_port=30053,
            external_policy_local=True,
        ),
        ep("10.180.0.5", 5353),
    )
    fake = FakeNft()
    backend(fake).sync(world.snapshot(), full())
    dump = fake.dump()
    assert (
        "add element ip kube-proxy no-endpoint-reject.g1 "
        '{ 172.30.0.11 . tcp . 80 comment "ns/empty:http" }' in dump
    )
    # No local endpoint: external traffic is dropped, but pods and the node itself are
    # short-circuited to every endpoint (masqueraded when the node is the source).
    assert (
        "add element ip kube-proxy no-endpoint-nodeports-drop.g1 "
        '{ udp . 30053 comment "ns/remote:http" }' in dump
    )
    assert (
        'add element ip kube-proxy dispatch-nodeports.g1 { udp . 30053 comment "ns/remote:http" }'
        in dump
    )
    assert "add rule ip kube-proxy dispatch-nodeports-0.g1 goto nodeport-local-0-1.g1" in dump
    assert lines(dump, r"rule ip kube-proxy nodeport-local-0-1\.g1 ") == [
        "add rule ip kube-proxy nodeport-local-0-1.g1 "
        "ip saddr 10.0.0.0/8 goto pick-nodeport-shortcut-1.g1",
        "add rule ip kube-proxy nodeport-local-0-1.g1 "
        "fib saddr type local jump mark-for-masquerade",
        "add rule ip kube-proxy nodeport-local-0-1.g1 "
        "fib saddr type local goto pick-nodeport-shortcut-1.g1",
    ]
    assert "shortcut-nodeport-endpoints-udp-b1.g1 { udp . 30053 . 0 : 10.180.0.5 . 5353 }" in dump


def test_firewall_and_hairpin_are_data() -> None:
    world = World()
    world.add(
        ServicePort(
            spn("lb"),
            ip("172.30.0.20"),
            443,
            Protocol.TCP,
            load_balancer_vips=(ip("5.6.7.8"),),
            load_balancer_source_ranges=(net("203.0.113.0/24"), net("192.168.0.0/16")),
        ),
        ep("10.180.0.9", 8443),
        Endpoint(ip("10.181.0.1"), 8443, remote=True),
    )
    # Another Service shares the VIP and port number, over UDP, with a range of its own:
    # its sources are let in for UDP only.
    world.add(
        ServicePort(
            spn("lb-udp"),
            ip("172.30.0.21"),
            443,
            Protocol.UDP,
            load_balancer_vips=(ip("5.6.7.8"),),
            load_balancer_source_ranges=(net("198.51.100.0/24"),),
        ),
        ep("10.180.0.10", 8443),
    )
    fake = FakeNft()
    backend(fake).sync(world.snapshot(), full())
    dump = fake.dump()
    assert lines(dump, r"element ip kube-proxy firewall-ips\.g1") == [
        "add element ip kube-proxy firewall-ips.g1 { 5.6.7.8 . tcp . 443 }",
        "add element ip kube-proxy firewall-ips.g1 { 5.6.7.8 . udp . 443 }",
    ]
    allowed = lines(dump, r"element ip kube-proxy firewall-allow-tcp\.g1")
    # The node's own address is in a source range: a VIP looped back is allowed too.
    assert [line.split("{ ")[1] for line in allowed] == [
        "5.6.7.8 . 443 . 192.168.0.0/16 }",
        "5.6.7.8 . 443 . 203.0.113.0/24 }",
        "5.6.7.8 . 443 . 5.6.7.8 }",
    ]
    udp = lines(dump, r"element ip kube-proxy firewall-allow-udp\.g1")
    assert [line.split("{ ")[1] for line in udp] == ["5.6.7.8 . 443 . 198.51.100.0/24 }"]
    assert not lines(dump, r"element ip kube-proxy firewall-allow-sctp\.g1")
    # One rule per protocol reads them, then the frontends with ranges drop the rest:
    # no rule per Service, and no one-byte field in an interval key (see layout).
    assert _chains(fake)["firewall-check"] == [
        "meta l4proto tcp ip daddr . th dport . ip saddr @firewall-allow-tcp.g1 return",
        "meta l4proto udp ip daddr . th dport . ip saddr @firewall-allow-udp.g1 return",
        "meta l4proto sctp ip daddr . th dport . ip saddr @firewall-allow-sctp.g1 return",
        "ip daddr . meta l4proto . th dport @firewall-ips.g1 drop",
    ]
    # Every endpoint hairpins, as upstream's: whether one runs here is only as good as
    # the node name it names (with --hostname-override it may name none).
    assert lines(dump, "element ip kube-proxy hairpin-endpoints.g1 {") == [
        "add element ip kube-proxy hairpin-endpoints.g1 { 10.180.0.10 . 10.180.0.10 }",
        "add element ip kube-proxy hairpin-endpoints.g1 { 10.180.0.9 . 10.180.0.9 }",
        "add element ip kube-proxy hairpin-endpoints.g1 { 10.181.0.1 . 10.181.0.1 }",
    ]


def _sticky_web(affinity: str) -> FakeNft:
    """The fake after a full sync of one ClientIP port with a NodePort and an LB IP."""
    world = World()
    web(
        world,
        "10.180.0.1",
        session_affinity_seconds=600,
        node_port=30080,
        load_balancer_vips=(ip("5.6.7.8"),),
    )
    fake = FakeNft()
    backend(fake, affinity=affinity).sync(world.snapshot(), full())
    return fake


# affinity-find: a new DNATed connection's port (by its original destination) in the
# record maps, whose elements go to the port's record chain.
FIND_RULES = [
    "add rule ip kube-proxy affinity-find meta l4proto { tcp, udp, sctp } "
    "ct original ip daddr . meta l4proto . ct original proto-dst "
    "vmap @affinity-record-ips.g1",
    "add rule ip kube-proxy affinity-find ct original ip daddr @nodeport-ips "
    "meta l4proto { tcp, udp, sctp } ct original ip daddr . meta l4proto . "
    "ct original proto-dst != @dispatch-ips.g1 meta l4proto . ct original proto-dst "
    "vmap @affinity-record-nodeports.g1",
]


# With the shared maps, first: an address other than a cluster IP that the canonical maps
# hold turned into its cluster IP's, then its record element read (IPv4).
CANONICAL_FIND_RULES = [
    "add rule ip kube-proxy affinity-find meta l4proto { tcp, udp, sctp } ip daddr set "
    "ct original ip daddr . meta l4proto . ct original proto-dst map @affinity-canonical-ips.g1 "
    "goto affinity-canonical-record-ips.g1",
    "add rule ip kube-proxy affinity-find ct original ip daddr @nodeport-ips "
    "meta l4proto { tcp, udp, sctp } ct original ip daddr . meta l4proto . "
    "ct original proto-dst != @dispatch-ips.g1 ip daddr set meta l4proto . ct original "
    "proto-dst map @affinity-canonical-nodeports.g1 goto affinity-canonical-record-nodeports.g1",
]


def test_per_port_session_affinity_is_per_port_and_list() -> None:
    fake = _sticky_web(AFFINITY_PER_PORT)
    dump = fake.dump()
    # One map for the port's endpoint list, read and written by every frontend of it.
    maps = lines(dump, r"^add map ip kube-proxy affinity-[A-Z2-7]{16} ")
    assert len(maps) == 1
    assert "{ typeof ip daddr : ip daddr . th dport ; flags dynamic,timeout ;" in maps[0]
    assert "size" not in maps[0]  # the kernel bounds it at 65535 without preallocating
    name = maps[0].split()[4]
    lookup = lines(dump, r"^add rule ip kube-proxy affinity-lookup-[A-Z2-7]{8}-ns/web/tcp/http ")
    record = lines(dump, r"^add rule ip kube-proxy affinity-record-[A-Z2-7]{8}-ns/web/tcp/http ")
    # The port's own protocol, compared: a set of protocols here would be an anonymous
    # set per port, which made cold syncs with affinity quadratic in the kernel.
    assert [r.split(" ", 5)[5] for r in lookup] == [
        f"meta l4proto tcp dnat to ip saddr map @{name}"
    ]
    assert [r.split(" ", 5)[5] for r in record] == [
        f"update @{name} {{ ip saddr timeout 600s : ip daddr . th dport }}"
    ]
    lookup_chain, record_chain = lookup[0].split()[4], record[0].split()[4]
    for key in ("172.30.0.10 . tcp . 80", "5.6.7.8 . tcp . 80"):
        assert f"affinity-lookup-ips.g1 {{ {key} : jump {lookup_chain} }}" in dump
        assert f"affinity-record-ips.g1 {{ {key} : goto {record_chain} }}" in dump
    assert f"affinity-lookup-nodeports.g1 {{ tcp . 30080 : jump {lookup_chain} }}" in dump
    assert lines(dump, r"rule ip kube-proxy pick-1-affinity\.g1 ")[0] == (
        "add rule ip kube-proxy pick-1-affinity.g1 jump affinity-lookup-ips.g1"
    )
    # Per-port record chains write without counting: affinity-record only goes on.
    assert lines(dump, r"rule ip kube-proxy affinity-record ") == [
        "add rule ip kube-proxy affinity-record jump affinity-find"
    ]
    assert lines(dump, r"rule ip kube-proxy affinity-find ") == FIND_RULES
    assert (
        "add rule ip kube-proxy filter-forward ct state new ct status dnat jump affinity-record"
        in dump
    )


LOCAL_STICKY = ServicePort(
    spn("web"),
    ip("172.30.0.10"),
    80,
    Protocol.TCP,
    node_port=30080,
    external_policy_local=True,
    session_affinity_seconds=60,
)
"""A Local-policy NodePort with ClientIP affinity."""


def test_every_set_and_map_is_declared_so_that_every_nft_can_list_it() -> None:
    # nft 1.1.2+ records a lone data type in a set's user data, and nft before 1.1.4
    # crashes loading it (objects.readable_by_every_nft): no declaration may have one.
    world = World()
    web(world, "10.180.0.1", session_affinity_seconds=600, node_port=30080)
    fake = FakeNft()
    backend(fake).sync(world.snapshot(), full())
    declared = lines(fake.dump(), r"^add (set|map) ")
    assert len(declared) > 10
    for line in declared:
        body = line.split(" { ", 1)[1].split(" ; ")[0]
        kind, _, text = body.partition(" ")
        sides = [side.split(" . ") for side in text.split(" : ")]
        assert kind == "typeof" or all(len(parts) > 1 for parts in sides), line
    assert "add set ip kube-proxy cluster-ips { typeof ip daddr ;" in fake.dump()


def test_a_lone_data_type_is_declared_as_an_expression() -> None:
    assert readable_by_every_nft(Set("s", "ipv4_addr")) == Set("s", "ip daddr", typeof=True)
    assert readable_by_every_nft(Set("s", "inet_service", comment="c")) == Set(
        "s", "th dport", comment="c", typeof=True
    )
    assert readable_by_every_nft(
        Map("m", "ipv6_addr . inet_proto . inet_service : verdict")
    ) == Map("m", "ip6 daddr . meta l4proto . th dport : verdict", typeof=True)
    # Concatenations only, already typeof, or a type with no expression: kept.
    for kept in (
        Set("s", "ipv4_addr . inet_service"),
        Map("m", "ip daddr : ip daddr . th dport", typeof=True),
        Set("s", "ether_addr"),
    ):
        assert readable_by_every_nft(kept) is kept


def test_per_port_local_policy_affinity_records_in_every_list_holding_the_endpoint() -> None:
    world = World()
    world.add(LOCAL_STICKY, ep("10.180.0.1", local=True), ep("10.180.0.2"))
    fake = FakeNft()
    backend(fake, affinity=AFFINITY_PER_PORT).sync(world.snapshot(), full())
    dump = fake.dump()
    # The cluster list (both endpoints) and the node-local one each have their map; one
    # record chain for the port writes the cluster map always (it holds every endpoint)
    # and the local map when the endpoint is a local one, as upstream records a client
    # per endpoint, read by its cluster and local chains alike.
    cluster = affinity_map_name(port_identity(LOCAL_STICKY.name), "service", 0)
    local = affinity_map_name(port_identity(LOCAL_STICKY.name), "local", 0)
    record = [r.split(" ", 5)[5] for r in lines(dump, r"^add rule ip kube-proxy affinity-record-")]
    assert record == [
        f"update @{cluster} {{ ip saddr timeout 60s : ip daddr . th dport }}",
        "ip daddr . th dport @affinity-local-endpoints "
        f"update @{local} {{ ip saddr timeout 60s : ip daddr . th dport }}",
    ]
    assert "add element ip kube-proxy affinity-local-endpoints { 10.180.0.1 . 8080 }" in dump
    (chain,) = {r.split()[4] for r in lines(dump, r"^add rule ip kube-proxy affinity-record-")}
    assert f"affinity-record-ips.g1 {{ 172.30.0.10 . tcp . 80 : goto {chain} }}" in dump
    assert f"affinity-record-nodeports.g1 {{ tcp . 30080 : goto {chain} }}" in dump


def _first(transactions: list[str], text: str) -> int:
    return next(i for i, tx in enumerate(transactions) if text in tx)


def test_a_new_lb_ip_is_never_reachable_before_its_source_ranges() -> None:
    # One element per transaction: the partial sync is cut as finely as it can be.
    world = World()
    world.add(ServicePort(spn("other"), ip("172.30.0.9"), 80, Protocol.TCP), ep("10.180.0.9"))
    fake = FakeNft()
    b = backend(fake, elements_per_transaction=1)
    b.sync(world.snapshot(), full())
    port = ServicePort(
        spn("lb"),
        ip("172.30.0.20"),
        443,
        Protocol.TCP,
        load_balancer_vips=(ip("5.6.7.8"),),
        load_balancer_source_ranges=(net("203.0.113.0/24"),),
    )
    name = world.add(port, ep("10.180.0.1", 8443), ep("10.180.0.2", 8443))
    start = len(fake.transactions)
    b.sync(world.snapshot(), changed(name))
    added = [tx.render() for tx in fake.transactions[start:]]
    vip = "{ 5.6.7.8 . tcp . 443"
    named = 'comment "ns/lb:http"'
    reachable = _first(added, f"add element ip kube-proxy dispatch-ips.g1 {vip} {named} }}")
    assert _first(added, f"add element ip kube-proxy firewall-ips.g1 {vip} }}") <= reachable
    allow = "{ 5.6.7.8 . 443"
    assert _first(added, f"add element ip kube-proxy firewall-allow-tcp.g1 {allow}") <= reachable
    # And the ranges go only once the VIP is no longer dispatched.
    world.remove(name)
    start = len(fake.transactions)
    b.sync(world.snapshot(), changed(name))
    removed = [tx.render() for tx in fake.transactions[start:]]
    gone = _first(removed, f"delete element ip kube-proxy dispatch-ips.g1 {vip} }}")
    assert _first(removed, f"delete element ip kube-proxy firewall-ips.g1 {vip} }}") >= gone
    assert _first(removed, f"delete element ip kube-proxy firewall-allow-tcp.g1 {allow}") >= gone


def test_overlapping_source_ranges_are_merged_not_refused() -> None:
    # The kernel (and the fake) refuse overlapping entries of an interval set, and one
    # refused element fails a whole sync: ranges inside others are dropped, and the VIPs
    # are not added when a range covers them.
    world = World()
    world.add(
        ServicePort(
            spn("lb"),
            ip("172.30.0.20"),
            80,
            Protocol.TCP,
            load_balancer_vips=(ip("5.6.7.8"),),
            load_balancer_source_ranges=(
                net("0.0.0.0/0"),
                net("10.0.0.0/8"),
                net("10.1.0.0/16"),
            ),
        ),
        ep("10.180.0.1"),
    )
    world.add(
        ServicePort(
            spn("lb2"),
            ip("172.30.0.21"),
            80,
            Protocol.TCP,
            load_balancer_vips=(ip("5.6.7.9"),),
            load_balancer_source_ranges=(net("192.168.0.0/24"), net("192.168.0.0/25")),
        ),
        ep("10.180.0.2"),
    )
    fake = FakeNft()
    backend(fake).sync(world.snapshot(), full())
    allowed = sorted(
        e.key for e in fake.list_elements(Family.IP, "kube-proxy", "firewall-allow-tcp.g1")
    )
    assert allowed == [
        ("5.6.7.8", "80", "0.0.0.0/0"),
        # The node (192.168.0.2) is in the range: the VIP looped back is allowed too.
        ("5.6.7.9", "80", "192.168.0.0/24"),
        ("5.6.7.9", "80", "5.6.7.9"),
    ]
    with pytest.raises(NftError, match="overlaps"):
        fake.run_text("add element ip kube-proxy firewall-allow-tcp.g1 { 5.6.7.8 . 80 . 1.2.3.4 }")


def test_a_connection_to_a_service_ip_never_records_a_nodeports_affinity() -> None:
    # Service a: a ClusterIP on port 30080; Service b: NodePort 30080 with affinity. The
    # NodePort record rule reads the original destination's protocol and port only, so it
    # must leave out destinations that a Service IP dispatched.
    world = World()
    world.add(ServicePort(spn("a"), ip("172.30.0.30"), 30080, Protocol.TCP), ep("10.180.0.1"))
    world.add(
        ServicePort(
            spn("b"),
            ip("172.30.0.31"),
            80,
            Protocol.TCP,
            node_port=30080,
            session_affinity_seconds=60,
        ),
        ep("10.180.0.2"),
    )
    fake = FakeNft()
    backend(fake).sync(world.snapshot(), full())
    (rule,) = lines(fake.dump(), r"affinity-find .*vmap @affinity-record-nodeports")
    assert "ct original proto-dst != @dispatch-ips.g1" in rule
    assert (
        "add element ip kube-proxy dispatch-ips.g1 "
        '{ 172.30.0.30 . tcp . 30080 comment "ns/a:http" }' in fake.dump()
    )


# Incremental syncs send data only -----------------------------------------------------------


def test_an_endpoint_change_rewrites_one_slot() -> None:
    world = World()
    name = web(world, "10.180.0.1", "10.180.0.2", "10.180.0.3")
    fake = FakeNft()
    b = backend(fake)
    b.sync(world.snapshot(), full())
    web(world, "10.180.0.1", "10.180.0.4", "10.180.0.3")
    b.sync(world.snapshot(), changed(name))
    text = fake.transactions[-1].render()
    assert text.splitlines() == [
        "delete element ip kube-proxy endpoints-tcp-b2.g1 { 172.30.0.10 . tcp . 80 . 1 }",
        "delete element ip kube-proxy hairpin-endpoints.g1 { 10.180.0.2 . 10.180.0.2 }",
        "add element ip kube-proxy hairpin-endpoints.g1 { 10.180.0.4 . 10.180.0.4 }",
        "add element ip kube-proxy endpoints-tcp-b2.g1 "
        "{ 172.30.0.10 . tcp . 80 . 1 : 10.180.0.4 . 8080 }",
    ]
    assert b.last_operations == 4 and b.last_transactions == 1 and not b.last_sync_full


def test_the_last_sync_plan_says_what_the_sync_committed(monkeypatch: pytest.MonkeyPatch) -> None:
    world = World()
    name = web(world, "10.180.0.1", "10.180.0.2", "10.180.0.3")
    fake = FakeNft()
    b = backend(fake)
    b.sync(world.snapshot(), full())
    cold = b.last_sync_plan()
    assert cold["full"] and cold["generation"] == 1 and cold["ports_planned"] == 1
    assert cold["elements"]["dispatch-ips.g1"] == {"added": 1, "deleted": 0}
    assert cold["elements"]["endpoints-tcp-b2.g1"] == {"added": 3, "deleted": 0}
    web(world, "10.180.0.1", "10.180.0.4", "10.180.0.3")
    b.sync(world.snapshot(), changed(name))
    assert b.last_sync_plan() == {
        "full": False,
        "generation": 1,
        "ports_planned": 1,
        "operations": 4,
        "transactions": 1,
        "elements": {
            "endpoints-tcp-b2.g1": {"added": 1, "deleted": 1},
            "hairpin-endpoints.g1": {"added": 1, "deleted": 1},
        },
        "other_containers": {"containers": 0, "added": 0, "deleted": 0},
    }
    # Beyond PLAN_CONTAINERS, containers are summed, the busiest named.
    monkeypatch.setattr("kubeproxy.backends.nftables.backend.PLAN_CONTAINERS", 1)
    bounded = b.last_sync_plan()
    assert list(bounded["elements"]) == ["endpoints-tcp-b2.g1"]
    assert bounded["other_containers"] == {"containers": 1, "added": 1, "deleted": 1}


def test_scaling_moves_the_frontend_between_classes_and_fills_holes() -> None:
    world = World()
    name = web(world, "10.180.0.1", "10.180.0.2", "10.180.0.3")
    other = world.add(
        ServicePort(spn("two"), ip("172.30.0.11"), 80, Protocol.TCP),
        ep("10.180.1.1"),
        ep("10.180.1.2"),
    )
    fake = FakeNft()
    b = backend(fake)
    b.sync(world.snapshot(), full())
    del other
    key = ("172.30.0.10", "tcp", "80")
    assert classes_of(fake)[key] == "internal-3.g1"
    # Down to two: slot 2 (the last) moves into the freed slot 0, class 3 -> class 2,
    # which exists already: its class number's bits change, no rule, no chain.
    web(world, "10.180.0.2", "10.180.0.3")
    b.sync(world.snapshot(), changed(name))
    text = fake.transactions[-1].render()
    assert "rule" not in text and "chain" not in text
    assert "class-bit-ips-" in text
    assert classes_of(fake)[key] == "internal-2.g1"
    assert slots_of(fake, Family.IP, key) == [("10.180.0.3", "8080"), ("10.180.0.2", "8080")]
    # Up to four: a class seen for the first time brings its chain and its place in the
    # dispatch tree, in a transaction before the elements.
    web(world, "10.180.0.2", "10.180.0.3", "10.180.0.7", "10.180.0.8")
    count = len(fake.transactions)
    b.sync(world.snapshot(), changed(name))
    structure, elements = (tx.render() for tx in fake.transactions[count:])
    assert "add chain ip kube-proxy internal-4.g1" in structure
    assert "goto internal-4.g1" in structure
    assert "element" not in structure and "rule" not in elements
    assert classes_of(fake)[key] == "internal-4.g1"


def ladder(world: World, numbers: Iterable[int]) -> list[ServicePortName]:
    """Service ``s<n>`` with ``n + 1`` endpoints for each ``n``: one class each."""
    return [
        world.add(
            ServicePort(spn(f"s{n}"), ip(f"172.30.{n // 200}.{n % 200}"), 80, Protocol.TCP),
            *(ep(str(ip("10.0.0.0") + 1024 * n + k)) for k in range(1, n + 2)),
        )
        for n in numbers
    ]


def test_precreated_counts_make_a_new_count_data_only_up_to_the_bound() -> None:
    world = World()
    name = web(world, "10.180.0.1", "10.180.0.2", "10.180.0.3", node_port=30080)
    fake = FakeNft()
    b = backend(fake, precreate_counts=6)
    b.sync(world.snapshot(), full())
    key, nodeport = ("172.30.0.10", "tcp", "80"), ("tcp", "30080")
    assert classes_of(fake)[key] == "internal-3.g1"
    # A count no Service has, within the bound: its class is there, only elements move.
    web(world, *(f"10.180.0.{n}" for n in range(1, 6)), node_port=30080)
    count = len(fake.transactions)
    b.sync(world.snapshot(), changed(name))
    (only,) = (tx.render() for tx in fake.transactions[count:])
    assert "rule" not in only and "chain" not in only
    assert classes_of(fake)[key] == "internal-5.g1"
    assert classes_of(fake)[nodeport] == "nodeport-5.g1"
    assert len(slots_of(fake, Family.IP, key)) == 5
    # Above the bound: the class comes as before, in a transaction before the elements.
    web(world, *(f"10.180.0.{n}" for n in range(1, 8)), node_port=30080)
    count = len(fake.transactions)
    b.sync(world.snapshot(), changed(name))
    structure, _elements = (tx.render() for tx in fake.transactions[count:])
    assert "add chain ip kube-proxy internal-7.g1" in structure
    assert classes_of(fake)[key] == "internal-7.g1"


def test_a_tree_grown_class_by_class_leads_where_a_full_syncs_does() -> None:
    """Each new class rewrites the tree chains on its own path only (``tree_chains``'
    ``only``); the frontends still reach the class a fresh full sync sends them to."""
    world = World()
    ladder(world, range(20))
    fake = FakeNft()
    b = backend(fake)
    b.sync(world.snapshot(), full())
    for n in range(20, 40):  # twenty classes seen for the first time, one sync each
        (name,) = ladder(world, [n])
        count = len(fake.transactions)
        b.sync(world.snapshot(), changed(name))
        assert f"add chain ip kube-proxy internal-{n + 1}.g1" in fake.transactions[count].render()
    # The tree the incremental syncs built leads every frontend where a full sync's does.
    incremental = classes_of(fake)
    fresh = FakeNft()
    backend(fresh).sync(world.snapshot(), full())
    assert len(set(incremental.values())) == 40
    assert {k: c.split(".")[0] for k, c in incremental.items()} == {
        k: c.split(".")[0] for k, c in classes_of(fresh).items()
    }


def test_hundreds_of_classes_cost_a_few_lookups_and_a_change_is_data() -> None:
    world = World()
    names = ladder(world, range(150))
    fake = FakeNft()
    b = backend(fake)
    b.sync(world.snapshot(), full())
    dispatched = classes_of(fake)
    assert len(set(dispatched.values())) == 150
    # Every connection walks at most one lookup per bit of the class numbers.
    depth = len([n for n in fake.list_sets(Family.IP, "kube-proxy") if "class-bit-ips" in n])
    assert depth == 8  # 2 ** 7 < 150 classes <= 2 ** 8
    tree = _Tree(fake)
    # The dispatch set's lookup, then at most one per bit.
    assert max(tree.walk(key)[1] for key in dispatched) <= 1 + depth
    # A new endpoint count moves the frontend to another class's bits: data only.
    world.add(
        ServicePort(spn("s7"), ip("172.30.0.7"), 80, Protocol.TCP),
        *(ep(str(ip("10.0.0.0") + 1024 * 7 + k)) for k in range(1, 4)),
    )
    b.sync(world.snapshot(), changed(names[7]))
    assert "rule" not in fake.transactions[-1].render()
    assert classes_of(fake)[("172.30.0.7", "tcp", "80")] == "internal-3.g1"


def test_removing_a_service_removes_its_data() -> None:
    world = World()
    name = web(world, "10.180.0.1", node_port=30080)
    fake = FakeNft()
    b = backend(fake)
    b.sync(world.snapshot(), full())
    world.remove(name)
    b.sync(world.snapshot(), changed(name))
    assert served_frontends(fake, Family.IP) == set()
    assert fake.list_elements(Family.IP, "kube-proxy", "cluster-ips") == []
    assert b.generation == 1


@given(
    old=st.lists(st.sampled_from("abcdefghij"), unique=True, max_size=10),
    new=st.lists(st.sampled_from("abcdefghij"), unique=True, max_size=10),
)
def test_restitch_keeps_the_slots_of_endpoints_that_stay(old: list[str], new: list[str]) -> None:
    slots = restitch(tuple(old), tuple(sorted(new)))
    assert sorted(slots) == sorted(new)
    for index, value in enumerate(old):
        if value in new and index < len(new):
            assert slots[index] == value
    changed_slots = sum(
        1 for i in range(max(len(old), len(slots))) if old[i : i + 1] != list(slots[i : i + 1])
    )
    # Never more slot writes than endpoints that came or went, plus those moved down.
    assert changed_slots <= len(set(old) ^ set(new)) + max(0, len(old) - len(new))


# Generations, failures, upgrades ------------------------------------------------------------


def test_a_full_sync_builds_a_new_generation_and_deletes_the_old_one_later() -> None:
    world = World()
    web(world, "10.180.0.1")
    fake, clock = FakeNft(), Clock()
    b = backend(fake, clock)
    b.sync(world.snapshot(), full())
    b.sync(world.snapshot(), full())
    assert b.generation == 2
    names = fake.list_sets(Family.IP, "kube-proxy") + list(
        fake.list_chains(Family.IP, "kube-proxy")
    )
    assert any(n.endswith(".g1") for n in names)
    # Until the switch every fixed chain read generation 1; now only generation 2.
    assert ".g1" not in "".join(lines(fake.dump(), r"rule ip kube-proxy (services|service-)"))
    clock.now += 1.0
    b.sync(world.snapshot(), SyncChanges(full=False))
    names = fake.list_sets(Family.IP, "kube-proxy") + list(
        fake.list_chains(Family.IP, "kube-proxy")
    )
    assert not any(n.endswith(".g1") for n in names)
    assert served_frontends(fake, Family.IP) == {("172.30.0.10", "tcp", "80")}


def test_a_refused_sync_keeps_the_rules_and_the_next_one_is_full() -> None:
    world = World()
    name = web(world, "10.180.0.1")
    fake = FakeNft()
    b = backend(fake)
    b.sync(world.snapshot(), full())
    before = fake.dump()
    web(world, "10.180.0.2")
    fake.fail_next = NftError("refused")
    with pytest.raises(SyncError, match="refused") as failed:
        b.sync(world.snapshot(), changed(name))
    assert fake.dump() == before
    assert b.sync_failures == 1
    # The refused write is kept where an operator finds it, and the error line says where.
    (kept,) = re.findall(r"the refused write is in (\S+)\)", str(failed.value))
    text = Path(kept).read_text()
    assert text.startswith("# ") and "nftables ip sync failed" in text and "# refused\n" in text
    assert (
        "add element ip kube-proxy endpoints-tcp-b1.g1 "
        "{ 172.30.0.10 . tcp . 80 . 0 : 10.180.0.2 . 8080 }" in text
    )
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert b.last_sync_full and b.generation == 2
    assert slots_of(fake, Family.IP, ("172.30.0.10", "tcp", "80")) == [("10.180.0.2", "8080")]


def test_a_context_change_is_a_new_generation() -> None:
    world = World()
    web(world, "10.180.0.1")
    fake = FakeNft()
    b = backend(fake)
    b.sync(world.snapshot(), full())
    world.detector = LocalDetector()
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert b.last_sync_full and b.generation == 2
    assert "internal-1.g2 goto pick-1.g2" in fake.dump()
    assert "internal-1.g2 ip saddr" not in fake.dump()


def test_upgrade_from_the_per_service_chain_structure() -> None:
    # The table that structure wrote for the cluster (recorded: tests/chain_ruleset.py).
    cluster = chain_ruleset.cluster()
    fake, clock = FakeNft(), Clock()
    fake.run_text(chain_ruleset.recorded())
    old = fake.list_sets(Family.IP, "kube-proxy")
    assert {"service-ips", "service-nodeports", "firewall-ips", "affinity"} <= set(old)
    old_chains = {c for c in fake.list_chains(Family.IP, "kube-proxy") if "/" in c}
    assert len(old_chains) == len(cluster.services) + 3  # 2 external-, 1 firewall-
    new = NftablesBackend(
        IPFamily.IPV4, chain_ruleset.CONFIG, executor=fake, clock=clock, support_check=False
    )
    new.sync(cluster, full())
    clock.now += 1.0
    new.sync(cluster, SyncChanges(full=False))
    assert new.stale_chain_failures == 0
    kept = set(old) & set(fake.list_sets(Family.IP, "kube-proxy"))
    assert kept == {"cluster-ips", "nodeport-ips"}  # upstream's, which others read
    assert not old_chains & set(fake.list_chains(Family.IP, "kube-proxy"))
    fresh = FakeNft()
    once = NftablesBackend(IPFamily.IPV4, chain_ruleset.CONFIG, executor=fresh, support_check=False)
    once.sync(cluster, full())
    assert normalized(fake) == normalized(fresh)


def test_upgrade_from_the_four_field_source_range_set() -> None:
    # Before the 6.12 fix one interval set held "VIP . protocol . port . source" (a key some
    # kernels refuse with nft < 1.1.0). A restart over such a table builds the per-protocol
    # sets in a new generation and the old set goes with its generation.
    world = World()
    world.add(
        ServicePort(
            spn("lb"),
            ip("172.30.0.20"),
            443,
            Protocol.TCP,
            load_balancer_vips=(ip("5.6.7.8"),),
            load_balancer_source_ranges=(net("203.0.113.0/24"),),
        ),
        ep("10.180.0.9", 8443),
    )
    fake, clock = FakeNft(), Clock()
    backend(fake, clock).sync(world.snapshot(), full())
    table = "ip kube-proxy"
    fake.run_text(
        f"add set {table} firewall-allow.g1 {{ typeof ip daddr . meta l4proto . th dport"
        " . ip saddr ; flags interval ; }\n"
        f"add element {table} firewall-allow.g1 {{ 5.6.7.8 . tcp . 443 . 203.0.113.0/24 }}\n"
        f"flush chain {table} firewall-check\n"
        f"add rule {table} firewall-check ip daddr . meta l4proto . th dport . ip saddr"
        " @firewall-allow.g1 return\n"
        f"add rule {table} firewall-check ip daddr . meta l4proto . th dport"
        " @firewall-ips.g1 drop\n"
    )
    for name in fake.list_sets(Family.IP, "kube-proxy"):
        if name.startswith("firewall-allow-"):
            fake.run_text(f"delete set {table} {name}")
    assert "firewall-check ip daddr . meta l4proto . th dport . ip saddr @firewall-allow.g1" in (
        fake.dump()
    )
    restarted = backend(fake, clock)
    restarted.sync(world.snapshot(), full())
    clock.now += 1.0
    restarted.sync(world.snapshot(), SyncChanges(full=False))
    assert "firewall-allow.g1" not in fake.list_sets(Family.IP, "kube-proxy")
    fresh = FakeNft()
    backend(fresh).sync(world.snapshot(), full())
    assert normalized(fake) == normalized(fresh)


def test_duplicate_frontends_first_port_wins_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    world = World()
    web(world, "10.180.0.1")
    world.add(ServicePort(spn("xweb"), ip("172.30.0.10"), 80, Protocol.TCP), ep("10.180.9.9"))
    fake = FakeNft()
    b = backend(fake)
    with caplog.at_level(logging.ERROR):
        b.sync(world.snapshot(), full())
        b.sync(world.snapshot(), full())
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [
        "skipping service port ns/xweb:http: 172.30.0.10 . tcp . 80 is already used by "
        "service port ns/web:http"
    ]
    assert slots_of(fake, Family.IP, ("172.30.0.10", "tcp", "80")) == [("10.180.0.1", "8080")]


def test_a_bad_port_is_skipped_and_the_others_are_programmed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    world = World()
    web(world, "10.180.0.1")
    world.add(ServicePort(spn("bad"), ip("172.30.0.11"), 70000, Protocol.TCP), ep("10.180.0.2"))
    fake = FakeNft()
    with caplog.at_level(logging.ERROR):
        backend(fake).sync(world.snapshot(), full())
    assert served_frontends(fake, Family.IP) == {("172.30.0.10", "tcp", "80")}
    assert [r.getMessage() for r in caplog.records] == [
        "skipping service port ns/bad:http: port 70000 is out of range"
    ]


def test_a_loopback_nodeport_address_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    world = World()
    name = web(world, "10.180.0.1", node_port=30080)
    world.node_port_addresses = NodePortAddresses(addresses=(ip("127.0.0.1"), ip("192.168.0.2")))
    fake = FakeNft()
    b = backend(fake)
    with caplog.at_level(logging.ERROR):
        b.sync(world.snapshot(), full())
        web(world, "10.180.0.2", node_port=30080)
        b.sync(world.snapshot(), changed(name))
        b.sync(world.snapshot(), full())
    assert [r.getMessage() for r in caplog.records] == [
        "skipping NodePort address 127.0.0.1: localhost NodePorts are not supported"
    ]
    assert [e.key for e in fake.list_elements(Family.IP, "kube-proxy", "nodeport-ips")] == [
        ("192.168.0.2",)
    ]


def _affinity_maps(fake: FakeNft, family: Family = Family.IP) -> list[str]:
    return sorted(
        n for n in fake.list_sets(family, "kube-proxy") if re.fullmatch(r"affinity-[A-Z2-7]{16}", n)
    )


def test_per_port_affinity_entries_of_removed_endpoints_are_deleted() -> None:
    world = World()
    name = web(world, "10.180.0.1", "10.180.0.2", session_affinity_seconds=60)
    fake = FakeNft()
    b = backend(fake, affinity=AFFINITY_PER_PORT)
    b.sync(world.snapshot(), full())
    (cluster,) = _affinity_maps(fake)
    fake.run_text(
        f"add element ip kube-proxy {cluster} {{ "
        "10.0.0.5 : 10.180.0.1 . 8080, 10.0.0.6 : 10.180.0.2 . 8080 }"
    )
    web(world, "10.180.0.2", session_affinity_seconds=60)
    b.sync(world.snapshot(), changed(name))
    assert [e.key for e in fake.list_elements(Family.IP, "kube-proxy", cluster)] == [("10.0.0.6",)]


def test_per_port_short_circuit_affinity_entries_of_removed_endpoints_are_deleted() -> None:
    # Pods and the node itself pick from every endpoint of a Local-policy NodePort: their
    # entries sit in the cluster list's map and go with the endpoint too.
    world = World()
    port = LOCAL_STICKY
    name = world.add(port, ep("10.180.0.1", local=True), ep("10.180.0.2"))
    fake, clock = FakeNft(), Clock()
    b = backend(fake, clock, affinity=AFFINITY_PER_PORT)
    b.sync(world.snapshot(), full())
    cluster = affinity_map_name(port_identity(name), "service", 0)
    local = affinity_map_name(port_identity(name), "local", 0)
    assert _affinity_maps(fake) == sorted([cluster, local])
    fake.run_text(
        f"add element ip kube-proxy {cluster} {{ "
        "10.0.0.5 : 10.180.0.1 . 8080, 192.168.0.2 : 10.180.0.2 . 8080 }\n"
        f"add element ip kube-proxy {local} {{ 203.0.113.9 : 10.180.0.1 . 8080 }}"
    )
    world.add(port, ep("10.180.0.1", local=True))
    b.sync(world.snapshot(), changed(name))
    for table in (cluster, local):
        values = [e.value for e in fake.list_elements(Family.IP, "kube-proxy", table)]
        assert values == [("10.180.0.1", "8080")]
    # The Service goes: its maps and chains go a second later.
    world.remove(name)
    b.sync(world.snapshot(), changed(name))
    clock.now += 1.0
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert _affinity_maps(fake) == []
    assert not [c for c in fake.list_chains(Family.IP, "kube-proxy") if "ns/web" in c]


def test_per_port_ipv6_affinity_has_a_map_per_endpoint_port() -> None:
    world = v6_world()
    name = world.add(
        ServicePort(spn("v6"), ip("fd00:96::10"), 80, Protocol.TCP, session_affinity_seconds=60),
        Endpoint(ip("fd00:180::1"), 8080),
        Endpoint(ip("fd00:180::2"), 9090),
    )
    fake = FakeNft()
    b = backend(fake, family=IPFamily.IPV6, affinity=AFFINITY_PER_PORT)
    b.sync(world.snapshot(), full())
    dump = fake.dump()
    maps = _affinity_maps(fake, Family.IP6)
    assert len(maps) == 2
    identity = port_identity(spn("v6"))
    by_port = {p: affinity_map_name(identity, "service", p) for p in (8080, 9090)}
    assert sorted(by_port.values()) == maps
    lookup = lines(dump, r"^add rule ip6 kube-proxy affinity-lookup-[A-Z2-7]{8}-")
    assert sorted(r.split(" ", 5)[5] for r in lookup) == sorted(
        f"meta l4proto tcp dnat to ip6 saddr map @{by_port[p]} : {p}" for p in (8080, 9090)
    )
    record = [
        r.split(" ", 5)[5]
        for r in lines(dump, r"^add rule ip6 kube-proxy affinity-record-[A-Z2-7]{8}-")
    ]
    assert sorted(r.split(" update ")[0] for r in record) == ["th dport 8080", "th dport 9090"]
    assert lines(dump, r"dedicated-") == []
    world.remove(name)
    b.sync(world.snapshot(), changed(name))
    assert lines(fake.dump(), r"element ip6 kube-proxy affinity-lookup-ips\.g1") == []


# Property: incremental syncs end where a fresh full sync starts ------------------------------


def normalized(fake: FakeNft, family: Family = Family.IP) -> dict[str, object]:
    """The table as what it does: the current generation's objects without their
    generation, the dispatch tree as the class each frontend's connections reach (class
    numbers depend on the order classes came in), each endpoint-slot map as the endpoints
    of each frontend (slots checked to be numbered 0..N-1), classes no frontend reaches
    (kept until the next full sync), their picks and empty slot maps left out."""
    chains: dict[str, list[str]] = {}
    sets: dict[str, list[tuple[str, ...]]] = {}
    for fam, _table, verb, obj in parse_commands(fake.dump()):
        assert verb == "add" and fam is family
        if isinstance(obj, Chain):
            chains[obj.name] = []
        elif isinstance(obj, Rule):
            chains[obj.chain].append(obj.rule)
        elif isinstance(obj, Set | Map):
            sets[obj.name] = []
        elif isinstance(obj, Element):
            sets[obj.container].append((*obj.key, ":", *obj.value))
    gens = {g for name in [*chains, *sets] if (g := generation_of(name)) is not None}
    assert len(gens) == 1, f"more than one generation left: {sorted(gens)}"

    def strip(text: str) -> str:
        return re.sub(r"\.g[0-9]+\b", "", text)

    reached = _Tree(fake, family).classes()
    out: dict[str, object] = {"dispatch": sorted((k, strip(c)) for k, c in reached.items())}
    tree = re.compile(r"(class-bit|dispatch)-(ips|nodeports)(-[0-9]+)?\.g[0-9]+")
    for name, elements in sets.items():
        if tree.fullmatch(name):
            continue
        if "endpoints-" in name:
            if not elements:
                continue  # a bucket no frontend uses (any more): kept with its picks
            by_key: dict[tuple[str, ...], dict[int, tuple[str, ...]]] = {}
            for element in elements:
                key, slot, value = element[:-4], int(element[-4]), element[-2:]
                by_key.setdefault(key, {})[slot] = value
            for key, slots in by_key.items():
                assert sorted(slots) == list(range(len(slots))), f"{name} {key}: {slots}"
            out[strip(name)] = {k: sorted(v.values()) for k, v in by_key.items()}
        else:
            out[strip(name)] = sorted(elements)
    live = set(reached.values())
    picks = {t for c in live for r in chains[c] for t in re.findall(r"goto (pick\S+)", r)}
    for name, rules in chains.items():
        if tree.fullmatch(name):
            continue
        if CLASS_NAME.fullmatch(name) and name not in live:
            continue
        if name.startswith("pick") and name not in picks:
            continue
        out[f"chain {strip(name)}"] = [strip(r) for r in rules]
    return out


class IncrementalEqualsFull(NftWorldMachine):
    """Incremental syncs end where a fresh full sync starts, generation and slot
    numbering aside (:func:`normalized`)."""

    def make_backend(self, fake: FakeNft, clock: Clock, *, small: bool) -> Backend:
        return backend(fake, clock, self.family, elements_per_transaction=4 if small else 10_000)

    def state(self, fake: FakeNft) -> list[str]:
        family = Family.IP if self.family is IPFamily.IPV4 else Family.IP6
        return [f"{k}: {v}" for k, v in sorted(normalized(fake, family).items())]


IncrementalEqualsFull.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIncrementalEqualsFull = IncrementalEqualsFull.TestCase


class IncrementalEqualsFull6(V6Machine, IncrementalEqualsFull):
    """The same on IPv6 (affinity maps per endpoint port, bracketed endpoints)."""


IncrementalEqualsFull6.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIncrementalEqualsFull6 = IncrementalEqualsFull6.TestCase


# Session affinity in the shared maps (issue 32) ---------------------------------------------


def _pin_key(identity: str, which: str, port: int = 0, client: str = "ip saddr") -> tuple[str, str]:
    shard, high, low = affinity_pin(identity, which, port)
    return shard, f"numgen random mod 1 offset {high} . numgen random mod 1 offset {low} . {client}"


def test_shared_affinity_keys_one_maps_entries_by_the_ports_pin_and_the_client() -> None:
    fake = _sticky_web(AFFINITY_PINNED)
    dump = fake.dump()
    # A fixed number of maps whatever the number of ports, none of a port's own.
    shards = lines(dump, r"^add map ip kube-proxy affinity-clients-")
    assert len(shards) == AFFINITY_SHARDS
    assert _affinity_maps(fake) == []
    # Every port pinned: nothing in the canonical maps.
    assert not lines(dump, r"^add element ip kube-proxy affinity-canonical-")
    assert (
        "{ typeof numgen random mod 1 . numgen random mod 1 . ip saddr : ip daddr . th dport ;"
        " flags dynamic,timeout ;" in shards[0]
    )
    assert "size" not in shards[0]  # the kernel bounds each at 65535 without preallocating
    shard, key = _pin_key(port_identity(spn("web")), "service")
    lookup = lines(dump, r"^add rule ip kube-proxy affinity-lookup-[A-Z2-7]{8}-ns/web/tcp/http ")
    record = lines(dump, r"^add rule ip kube-proxy affinity-record-[A-Z2-7]{8}-ns/web/tcp/http ")
    assert [r.split(" ", 5)[5] for r in lookup] == [f"meta l4proto tcp dnat to {key} map @{shard}"]
    # A recorded connection is accepted; one that could not be recorded (the map is
    # full) comes back to affinity-record, which counts it in affinity-full's rule. The
    # record maps' elements go to the record chain from affinity-find, which accepts a
    # connection no map holds, so nothing else comes back.
    assert [r.split(" ", 5)[5] for r in record] == [
        f"update @{shard} {{ {key} timeout 600s : ip daddr . th dport }} accept",
    ]
    assert lines(dump, r"^add rule ip kube-proxy affinity-full ") == [
        'add rule ip kube-proxy affinity-full counter comment "not recorded"'
    ]
    assert lines(dump, r"^add rule ip kube-proxy affinity-record ") == [
        "add rule ip kube-proxy affinity-record jump affinity-find",
        "add rule ip kube-proxy affinity-record jump affinity-full",
    ]
    assert lines(dump, r"^add rule ip kube-proxy affinity-find ") == [
        CANONICAL_FIND_RULES[0],
        FIND_RULES[0],
        CANONICAL_FIND_RULES[1],
        FIND_RULES[1],
        "add rule ip kube-proxy affinity-find accept",
    ]
    # Every frontend of the port reads and writes the same entries.
    lookup_chain, record_chain = lookup[0].split()[4], record[0].split()[4]
    for frontend in ("172.30.0.10 . tcp . 80", "5.6.7.8 . tcp . 80"):
        assert f"affinity-lookup-ips.g1 {{ {frontend} : jump {lookup_chain} }}" in dump
        assert f"affinity-record-ips.g1 {{ {frontend} : goto {record_chain} }}" in dump
    assert f"affinity-lookup-nodeports.g1 {{ tcp . 30080 : jump {lookup_chain} }}" in dump


def test_shared_affinity_records_the_local_list_first_then_the_cluster_list() -> None:
    world = World()
    world.add(LOCAL_STICKY, ep("10.180.0.1", local=True), ep("10.180.0.2"))
    fake = FakeNft()
    backend(fake).sync(world.snapshot(), full())
    identity = port_identity(LOCAL_STICKY.name)
    shard, cluster = _pin_key(identity, "service")
    same_shard, local = _pin_key(identity, "local")
    assert same_shard == shard  # every entry of a port in one map
    record = [
        r.split(" ", 5)[5] for r in lines(fake.dump(), r"^add rule ip kube-proxy affinity-record-")
    ]
    assert record == [
        "ip daddr . th dport @affinity-local-endpoints "
        f"update @{shard} {{ {local} timeout 60s : ip daddr . th dport }}",
        f"update @{shard} {{ {cluster} timeout 60s : ip daddr . th dport }} accept",
    ]


def _pin(identity: str, which: str, port: int = 0) -> tuple[str, str, str]:
    shard, high, low = affinity_pin(identity, which, port)
    return shard, str(high), str(low)


def test_shared_affinity_entries_of_removed_endpoints_and_ports_are_deleted() -> None:
    world = World()
    # Every port pinned: the port's entries are keyed by its pins.
    sticky = {"session_affinity_seconds": 60, "node_port": 30080}
    name = web(world, "10.180.0.1", "10.180.0.2", **sticky)
    fake = FakeNft()
    b = backend(fake, affinity=AFFINITY_PINNED)
    b.sync(world.snapshot(), full())
    shard, high, low = _pin(port_identity(name), "service")
    # Another port's entry (pins that no port has) in the same map, pointing at the
    # endpoint that goes: left alone by the incremental sync, gone at the full sync.
    fake.run_text(
        f"add element ip kube-proxy {shard} {{ "
        f"{high} . {low} . 10.0.0.5 : 10.180.0.1 . 8080, "
        f"{high} . {low} . 10.0.0.6 : 10.180.0.2 . 8080, "
        "7 . 8 . 10.0.0.7 : 10.180.0.1 . 8080 }"
    )

    def keys() -> list[tuple[str, ...]]:
        return sorted(e.key for e in fake.list_elements(Family.IP, "kube-proxy", shard))

    web(world, "10.180.0.2", **sticky)
    b.sync(world.snapshot(), changed(name))
    assert keys() == [(high, low, "10.0.0.6"), ("7", "8", "10.0.0.7")]
    b.sync(world.snapshot(), full())
    assert keys() == [(high, low, "10.0.0.6")]


def test_shared_ipv6_affinity_keys_a_hash_of_the_client_with_a_pin_per_endpoint_port() -> None:
    world = v6_world()
    world.add(
        ServicePort(spn("v6"), ip("fd00:96::10"), 80, Protocol.TCP, session_affinity_seconds=60),
        Endpoint(ip("fd00:180::1"), 8080),
        Endpoint(ip("fd00:180::2"), 9090),
    )
    fake = FakeNft()
    backend(fake, family=IPFamily.IPV6).sync(world.snapshot(), full())
    dump = fake.dump()
    identity = port_identity(spn("v6"))
    client = "jhash ip6 saddr mod 4294967295 seed 0x0"
    keys = {p: _pin_key(identity, "service", p, client) for p in (8080, 9090)}
    lookup = lines(dump, r"^add rule ip6 kube-proxy affinity-lookup-[A-Z2-7]{8}-")
    assert sorted(r.split(" ", 5)[5] for r in lookup) == sorted(
        f"meta l4proto tcp dnat to {key} map @{shard} : {p}" for p, (shard, key) in keys.items()
    )
    record = [
        r.split(" ", 5)[5]
        for r in lines(dump, r"^add rule ip6 kube-proxy affinity-record-[A-Z2-7]{8}-")
    ]
    assert sorted(record) == sorted(
        [
            *(
                f"th dport {p} update @{shard} {{ {key} timeout 60s : ip6 daddr }} accept"
                for p, (shard, key) in keys.items()
            ),
        ]
    )
    assert (
        "typeof numgen random mod 1 . numgen random mod 1 . numgen random mod 1 : ip6 daddr" in dump
    )


def _sticky_v6_snapshot(*endpoints: str) -> ProxySnapshot:
    """An IPv6 port with ClientIP affinity on its cluster IP, a load-balancer IP and a
    NodePort, endpoints ``endpoints`` (port 8080)."""
    world = v6_world()
    world.add(
        ServicePort(
            spn("v6"),
            ip("fd00:96::10"),
            80,
            Protocol.TCP,
            node_port=30080,
            load_balancer_vips=(ip("fd00:5::10"),),
            session_affinity_seconds=60,
        ),
        *(Endpoint(ip(a), 8080) for a in endpoints),
    )
    return world.snapshot()


def _sticky_v6(fake: FakeNft, *endpoints: str, affinity: str = AFFINITY_SHARED) -> NftablesBackend:
    """:func:`_sticky_v6_snapshot` synced in full into ``fake``."""
    b = backend(fake, family=IPFamily.IPV6, affinity=affinity)
    b.sync(_sticky_v6_snapshot(*endpoints), full())
    return b


def test_shared_ipv6_affinity_of_one_endpoint_port_is_keyed_by_hashes_of_the_cluster_ip() -> None:
    """An IPv6 port whose endpoints answer on one port has no chain of its own: its map's
    shared chains key the entry by two hashes of the cluster-IP frontend and one of the
    client; its other addresses are elements of the canonical maps; the structure
    before (``shared-ipv4``) keeps its pins."""
    fake = FakeNft()
    _sticky_v6(fake, "fd00:180::1", "fd00:180::2")
    dump = fake.dump()
    identity = port_identity(spn("v6"))
    shard = affinity_pin(identity, "service", 0)[0]
    frontend = "ip6 daddr . meta l4proto . th dport"
    seeds = ("0x6b707831", "0x6b707832")
    client = "jhash ip6 saddr mod 4294967295 seed 0x0"
    key = " . ".join(f"jhash {frontend} mod 4294967295 seed {s}" for s in seeds)
    lookup = [
        r.split(" ", 5)[5]
        for r in lines(dump, r"^add rule ip6 kube-proxy affinity-lookup-[A-Z2-7]{8}-")
    ]
    assert lookup == [f"meta l4proto tcp dnat to {key} . {client} map @{shard} : 8080"]
    record = [
        r.split(" ", 5)[5]
        for r in lines(dump, r"^add rule ip6 kube-proxy affinity-record-[A-Z2-7]{8}-")
    ]
    original = "ct original ip6 daddr . meta l4proto . ct original proto-dst"
    hashed = " . ".join(f"jhash {original} mod 4294967295 seed {s}" for s in seeds)
    assert f"meta l4proto {{ tcp, udp, sctp }} update @{shard} {{ {hashed} . {client} " in (
        " ".join(record)
    )
    # The chains are the map's (named after it), no port's.
    assert not lines(dump, r"^add chain ip6 kube-proxy affinity-.*ns/v6")
    assert "affinity-canonical-ips.g1 { fd00:5::10 . tcp . 80 : fd00:96::10 }" in dump
    assert "affinity-canonical-nodeports.g1 { tcp . 30080 : fd00:96::10 }" in dump
    assert "affinity-canonical-ports.g1 { tcp . 30080 : 80 }" in dump

    before = FakeNft()
    _sticky_v6(before, "fd00:180::1", "fd00:180::2", affinity=AFFINITY_SHARED_IPV4)
    assert lines(before.dump(), r"^add chain ip6 kube-proxy affinity-.*ns/v6")
    assert not lines(before.dump(), r"^add element ip6 kube-proxy affinity-canonical-")


def test_shared_ipv6_affinity_entries_of_removed_endpoints_are_deleted() -> None:
    """The cleaner finds an IPv6 port's entries by the numbers the kernel's jhash writes
    (:func:`affinity_frontend6_pin`): those pointing at an endpoint gone go, another
    port's stay until the full sync finds no port with their numbers."""
    fake = FakeNft()
    b = _sticky_v6(fake, "fd00:180::1", "fd00:180::2")
    shard = affinity_pin(port_identity(spn("v6")), "service", 0)[0]
    high, low = affinity_frontend6_pin(("fd00:96::10", "tcp", "80"))
    fake.run_text(
        f"add element ip6 kube-proxy {shard} {{ "
        f"{high} . {low} . 5 : fd00:180::1, {high} . {low} . 6 : fd00:180::2, "
        "7 . 8 . 9 : fd00:180::1 }"
    )

    def keys() -> list[tuple[str, ...]]:
        return sorted(e.key for e in fake.list_elements(Family.IP6, "kube-proxy", shard))

    b.sync(_sticky_v6_snapshot("fd00:180::2"), changed(spn("v6")))
    assert keys() == [(high, low, "6"), ("7", "8", "9")]
    b.sync(_sticky_v6_snapshot("fd00:180::2"), full())
    assert keys() == [(high, low, "6")]


def test_a_table_with_maps_per_port_loses_them_to_the_shared_maps() -> None:
    world = World()
    web(world, "10.180.0.1", session_affinity_seconds=60)
    fake, clock = FakeNft(), Clock()
    backend(fake, clock, affinity=AFFINITY_PER_PORT).sync(world.snapshot(), full())
    assert len(_affinity_maps(fake)) == 1
    b = backend(fake, clock)
    b.sync(world.snapshot(), full())
    clock.now += 2.0
    assert b.collect_stale()
    assert _affinity_maps(fake) == []
    assert len([n for n in fake.list_sets(Family.IP, "kube-proxy") if "clients" in n]) == 256


def test_the_affinity_choice_is_checked() -> None:
    with pytest.raises(ValueError, match="unknown affinity maps"):
        backend(FakeNft(), affinity="both")


@pytest.mark.parametrize(
    ("fields", "foreign"),
    [
        # On its cluster IP only; another frontend's entry beside it.
        ({}, "172.30.0.11"),
        # With a NodePort and a load-balancer IP: every address shows the cluster IP's
        # entries (never one keyed by another address).
        ({"node_port": 30080, "load_balancer_vips": (ip("5.6.7.8"),)}, "5.6.7.8"),
    ],
)
def test_explain_shows_a_ports_own_entries_of_its_frontend_keyed_map(
    fields: dict[str, object], foreign: str
) -> None:
    from kubeproxy.backends.nftables.explain import FakeSource, TableView, explain_service

    world = World()
    name = web(world, "10.180.0.1", session_affinity_seconds=60, **fields)
    fake = FakeNft()
    backend(fake).sync(world.snapshot(), full())
    shard, _number = affinity_frontend_shard(port_identity(name))
    fake.run_text(
        f"add element ip kube-proxy {shard} {{ "
        "172.30.0.10 . tcp . 80 . 10.0.0.5 : 10.180.0.1 . 8080, "
        f"{foreign} . tcp . 80 . 10.0.0.7 : 10.180.0.1 . 8080 }}"
    )
    view = explain_service(TableView(FakeSource(fake), Family.IP), name.service)
    assert len(view.frontends) == 1 + len(fields)
    for frontend in view.frontends:
        assert frontend.affinity_maps == (shard,), frontend.key
        assert frontend.affinity_timeout_s == 60, frontend.key
        assert [(a.client, a.endpoint) for a in frontend.affinity] == [
            ("10.0.0.5", "10.180.0.1:8080")
        ], frontend.key


def test_explain_shows_a_ports_own_entries_of_its_shared_map() -> None:
    from kubeproxy.backends.nftables.explain import FakeSource, TableView, explain_service

    world = World()
    name = web(world, "10.180.0.1", session_affinity_seconds=60)
    fake = FakeNft()
    backend(fake, affinity=AFFINITY_PINNED).sync(world.snapshot(), full())
    shard, high, low = _pin(port_identity(name), "service")
    fake.run_text(
        f"add element ip kube-proxy {shard} {{ "
        f"{high} . {low} . 10.0.0.5 : 10.180.0.1 . 8080, 7 . 8 . 10.0.0.7 : 10.180.0.1 . 8080 }}"
    )
    view = explain_service(TableView(FakeSource(fake), Family.IP), name.service)
    (frontend,) = view.frontends
    assert frontend.affinity_maps == (shard,)
    assert [(a.client, a.endpoint) for a in frontend.affinity] == [("10.0.0.5", "10.180.0.1:8080")]


# Session affinity keyed by the frontend (issue 32 item 3) -----------------------------------

_FRONTEND_LOOKUP = "ip daddr . meta l4proto . th dport . ip saddr"


def _cluster_ip_port(n: int, seconds: int = 60, proto: Protocol = Protocol.TCP) -> ServicePort:
    return ServicePort(
        spn(f"s{n}", proto=proto),
        ip(f"172.30.1.{n}"),
        80,
        proto,
        session_affinity_seconds=seconds,
    )


def _affinity_chains(fake: FakeNft) -> dict[str, list[str]]:
    return {
        n: r
        for n, r in _chains(fake).items()
        if re.match(r"affinity-(lookup|record)(-other|-nodeport)?-[A-Z2-7]{8}-", n)
    }


def _two_ports_of_one_shard() -> tuple[int, int]:
    seen: dict[int, int] = {}
    for n in range(1, 250):
        _shard, number = affinity_frontend_shard(port_identity(_cluster_ip_port(n).name))
        if number in seen:
            return seen[number], n
        seen[number] = n
    raise AssertionError("no two ports share a map")  # 256 maps: a pair comes by ~20


def test_a_cluster_ip_only_port_keys_its_entries_by_its_frontend_with_no_chain_of_its_own() -> None:
    world = World()
    first, second = _two_ports_of_one_shard()
    for n in (first, second):
        world.add(_cluster_ip_port(n), ep(f"10.180.1.{n}"))
    world.add(_cluster_ip_port(200, proto=Protocol.UDP), ep("10.180.2.1"))
    fake = FakeNft()
    backend(fake).sync(world.snapshot(), full())
    dump = fake.dump()
    maps = lines(dump, r"^add map ip kube-proxy affinity-frontends-")
    shard, number = affinity_frontend_shard(port_identity(_cluster_ip_port(first).name))
    udp_shard, udp_number = affinity_frontend_shard(
        port_identity(_cluster_ip_port(200, proto=Protocol.UDP).name)
    )
    # Only the maps some port uses are declared.
    assert sorted(m.split()[4] for m in maps) == sorted({shard, udp_shard})
    assert (
        f"{{ typeof {_FRONTEND_LOOKUP} : ip daddr . th dport ; flags dynamic,timeout ;" in maps[0]
    )
    assert "size" not in maps[0]
    chains = _affinity_chains(fake)
    # One lookup chain per map and protocol, one record chain per map and timeout; no
    # chain names a port.
    assert not [n for n in chains if "/" in n]
    record_rule = (
        "meta l4proto { tcp, udp, sctp } update @{m} { ct original ip daddr . meta l4proto . "
        "ct original proto-dst . ip saddr timeout 60s : ip daddr . th dport } accept"
    )
    expected = {
        ("lookup", number): [f"meta l4proto tcp dnat to {_FRONTEND_LOOKUP} map @{shard}"],
        ("record", number): [record_rule.replace("{m}", shard)],
        ("lookup", udp_number): [f"meta l4proto udp dnat to {_FRONTEND_LOOKUP} map @{udp_shard}"],
        ("record", udp_number): [record_rule.replace("{m}", udp_shard)],
    }
    found = {}
    for name, rules in chains.items():
        which, tail = name.split("-")[1], name.split("-")[-1]
        found[which, int(tail)] = rules
    assert found == expected
    # Both ports of one map go to its chains.
    lookup = next(
        n for n in chains if n.startswith("affinity-lookup-") and n.endswith(f"-{number}")
    )
    record = next(
        n for n in chains if n.startswith("affinity-record-") and n.endswith(f"-{number}")
    )
    for n in (first, second):
        frontend = f"172.30.1.{n} . tcp . 80"
        assert f"affinity-lookup-ips.g1 {{ {frontend} : jump {lookup} }}" in dump
        assert f"affinity-record-ips.g1 {{ {frontend} : goto {record} }}" in dump


def test_shared_chains_of_frontend_keyed_maps_go_with_their_last_port() -> None:
    world = World()
    first, second = _two_ports_of_one_shard()
    for n in (first, second):
        world.add(_cluster_ip_port(n), ep(f"10.180.1.{n}"))
    fake, clock = FakeNft(), Clock()
    b = backend(fake, clock)
    b.sync(world.snapshot(), full())
    before = set(_affinity_chains(fake))
    assert len(before) == 2
    shard, _number = affinity_frontend_shard(port_identity(_cluster_ip_port(first).name))
    assert shard in fake.list_sets(Family.IP, "kube-proxy")
    world.remove(_cluster_ip_port(first).name)
    b.sync(world.snapshot(), changed(_cluster_ip_port(first).name))
    clock.now += 2.0
    b.collect_stale()
    assert set(_affinity_chains(fake)) == before  # the second port still reads them
    world.remove(_cluster_ip_port(second).name)
    b.sync(world.snapshot(), changed(_cluster_ip_port(second).name))
    clock.now += 2.0
    b.sync(world.snapshot(), changed())
    b.collect_stale()
    assert _affinity_chains(fake) == {}
    # The map went with its chains (and its entries: no port uses them).
    assert shard not in fake.list_sets(Family.IP, "kube-proxy")


def test_frontend_keyed_entries_of_removed_endpoints_and_ports_are_deleted() -> None:
    world = World()
    name = web(world, "10.180.0.1", "10.180.0.2", session_affinity_seconds=60)
    fake = FakeNft()
    b = backend(fake)
    b.sync(world.snapshot(), full())
    shard, _number = affinity_frontend_shard(port_identity(name))
    # Another frontend's entry (no port has it) in the same map, pointing at the endpoint
    # that goes: left alone by the incremental sync, gone at the full sync.
    fake.run_text(
        f"add element ip kube-proxy {shard} {{ "
        "172.30.0.10 . tcp . 80 . 10.0.0.5 : 10.180.0.1 . 8080, "
        "172.30.0.10 . tcp . 80 . 10.0.0.6 : 10.180.0.2 . 8080, "
        "172.30.0.99 . tcp . 80 . 10.0.0.7 : 10.180.0.1 . 8080 }"
    )

    def keys() -> list[tuple[str, ...]]:
        return sorted(e.key for e in fake.list_elements(Family.IP, "kube-proxy", shard))

    web(world, "10.180.0.2", session_affinity_seconds=60)
    b.sync(world.snapshot(), changed(name))
    assert keys() == [
        ("172.30.0.10", "tcp", "80", "10.0.0.6"),
        ("172.30.0.99", "tcp", "80", "10.0.0.7"),
    ]
    b.sync(world.snapshot(), full())
    assert keys() == [("172.30.0.10", "tcp", "80", "10.0.0.6")]


def test_local_policy_ports_and_the_pinned_structure_keep_chains_of_their_own() -> None:
    world = World()
    world.add(LOCAL_STICKY, ep("10.180.0.1", local=True), ep("10.180.0.2"))
    world.add(_cluster_ip_port(1), ep("10.180.1.1"))
    exposed = replace(_cluster_ip_port(2), node_port=30082, external_ips=(ip("5.6.7.9"),))
    world.add(exposed, ep("10.180.1.2"))
    for affinity, own in ((AFFINITY_SHARED, 1), (AFFINITY_PINNED, 3)):
        fake = FakeNft()
        backend(fake, affinity=affinity).sync(world.snapshot(), full())
        chains = _affinity_chains(fake)
        # Each pinned port of its own: a lookup and a record chain named after it. With
        # the shared maps only the Local-policy port (its addresses pick from two lists).
        assert len({n.split("-", 3)[-1] for n in chains if "/" in n}) == own
        frontends = lines(fake.dump(), r"^add map ip kube-proxy affinity-frontends-")
        keyed = {
            affinity_frontend_shard(port_identity(p.name))[0]
            for p in (_cluster_ip_port(1), exposed)
        }
        assert len(frontends) == (len(keyed) if affinity == AFFINITY_SHARED else 0)


def test_a_ports_other_addresses_share_its_cluster_ip_entry_through_the_canonical_maps() -> None:
    world = World()
    port = replace(
        _cluster_ip_port(3),
        node_port=30083,
        external_ips=(ip("5.6.7.9"),),
        load_balancer_vips=(ip("5.6.7.10"),),
    )
    world.add(port, ep("10.180.1.3"))
    fake = FakeNft()
    b = backend(fake)
    b.sync(world.snapshot(), full())
    dump = fake.dump()
    cluster = "172.30.1.3 . tcp . 80"
    shard, _number = affinity_frontend_shard(port_identity(port.name))
    # The cluster IP alone has a lookup element: the others read it once turned into it.
    assert lines(dump, r"^add element ip kube-proxy affinity-lookup-") == [
        f"add element ip kube-proxy affinity-lookup-ips.g1 {{ {cluster} : jump "
        + _chain_of(dump, "affinity-lookup-", f"map @{shard}")
        + " }"
    ]
    assert sorted(lines(dump, r"^add element ip kube-proxy affinity-canonical-")) == [
        "add element ip kube-proxy affinity-canonical-ips.g1 { 5.6.7.10 . tcp . 80 : 172.30.1.3 }",
        "add element ip kube-proxy affinity-canonical-ips.g1 { 5.6.7.9 . tcp . 80 : 172.30.1.3 }",
        "add element ip kube-proxy affinity-canonical-nodeports.g1 { tcp . 30083 : 172.30.1.3 }",
        "add element ip kube-proxy affinity-canonical-ports.g1 { tcp . 30083 : 80 }",
    ]
    # Each address kind writes the cluster IP's entry through a record chain of its own,
    # shared by every port of its map (no chain named after the port).
    records = {
        e.split(" : goto ")[0].split("{ ")[1]: e.split(" : goto ")[1].rstrip(" }")
        for e in lines(dump, r"^add element ip kube-proxy affinity-record-")
    }
    chains = _affinity_chains(fake)
    assert not [n for n in chains if "/" in n]
    assert chains[records["5.6.7.9 . tcp . 80"]] == [
        f"meta l4proto {{ tcp, udp, sctp }} update @{shard} {{ ip daddr . meta l4proto . "
        "ct original proto-dst . ip saddr timeout 60s : ct reply ip saddr . ct reply proto-src }"
        " ip daddr set ct reply ip saddr accept",
        "ip daddr set ct reply ip saddr",
    ]
    assert records["5.6.7.10 . tcp . 80"] == records["5.6.7.9 . tcp . 80"]
    assert chains[records["tcp . 30083"]][0].startswith(
        f"update @{shard} {{ ip daddr . meta l4proto . tcp dport . ip saddr timeout 60s"
    )
    # A Local policy later: the port keeps its pins, and leaves the canonical maps.
    world.add(replace(port, external_policy_local=True), ep("10.180.1.3", local=True))
    b.sync(world.snapshot(), changed(port.name))
    for canonical in ("ips", "nodeports", "ports"):
        assert not fake.list_elements(Family.IP, "kube-proxy", f"affinity-canonical-{canonical}.g1")
    assert [n for n in _affinity_chains(fake) if "/" in n]


def test_udp_ports_with_a_nodeport_keep_their_pins() -> None:
    # A NodePort turned into its Service port is a `udp dport set`, which makes a UDP
    # checksum of 0 into 0xffff (dropped by the receiver); an address write keeps it.
    world = World()
    nodeport = replace(_cluster_ip_port(5, proto=Protocol.UDP), node_port=30085)
    balanced = replace(
        _cluster_ip_port(6, proto=Protocol.UDP), load_balancer_vips=(ip("5.6.7.11"),)
    )
    world.add(nodeport, ep("10.180.1.5"))
    world.add(balanced, ep("10.180.1.6"))
    fake = FakeNft()
    backend(fake).sync(world.snapshot(), full())
    pinned = {n.split("-", 3)[-1] for n in _affinity_chains(fake) if "/" in n}
    assert len(pinned) == 1 and "s5" in next(iter(pinned))
    assert sorted(lines(fake.dump(), r"^add element ip kube-proxy affinity-canonical-")) == [
        "add element ip kube-proxy affinity-canonical-ips.g1 { 5.6.7.11 . udp . 80 : 172.30.1.6 }"
    ]


def _chain_of(dump: str, prefix: str, holding: str) -> str:
    """The chain whose name starts with ``prefix`` and one of whose rules holds ``holding``."""
    found = {
        line.split()[4]
        for line in lines(dump, rf"^add rule ip kube-proxy {prefix}")
        if holding in line
    }
    (name,) = found
    return name
