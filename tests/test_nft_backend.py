"""NftablesBackend (the map structure) on FakeNft: what a sync writes, what an incremental
sync sends, generations, conflicts, failures, upgrades from the per-Service-chain
structure, and the property that incremental syncs end where a fresh full sync starts.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubeproxy.backend import Backend, NodePortAddresses, SyncChanges, SyncError
from kubeproxy.backends.nftables import ChainNftablesBackend, NftablesBackend
from kubeproxy.backends.nftables.backend import restitch
from kubeproxy.backends.nftables.fake import FakeNft, parse_commands
from kubeproxy.backends.nftables.inspect import served_frontends, slots_of
from kubeproxy.backends.nftables.layout import CLASS_NAME, generation_of
from kubeproxy.backends.nftables.objects import (
    Chain,
    Element,
    Family,
    Map,
    NftError,
    Rule,
    Set,
)
from kubeproxy.config import LocalDetector, ProxierConfig
from kubeproxy.objects import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName
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
) -> NftablesBackend:
    return NftablesBackend(
        family,
        CONFIG,
        executor=fake,
        clock=clock or Clock(),
        elements_per_transaction=elements_per_transaction,
        support_check=False,
    )


def web(world: World, *addrs: str, **fields: object) -> ServicePortName:
    port = ServicePort(spn("web"), ip("172.30.0.10"), 80, Protocol.TCP)
    return world.add(replace(port, **fields), *(ep(a) for a in addrs))  # type: ignore[arg-type]


def lines(text: str, pattern: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(pattern, line)]


# What a full sync writes --------------------------------------------------------------------


def test_a_service_is_data_behind_a_few_fixed_rules() -> None:
    world = World()
    web(world, "10.180.0.1", "10.180.0.2", node_port=30080)
    fake = FakeNft()
    backend(fake).sync(world.snapshot(), full())
    dump = fake.dump()
    assert lines(dump, r"rule ip kube-proxy (service-frontends|nodeport-frontends|services) ") == [
        "add rule ip kube-proxy nodeport-frontends "
        "meta l4proto . th dport @nodeport-2.g1 goto nodeport-2.g1",
        "add rule ip kube-proxy service-frontends "
        "ip daddr . meta l4proto . th dport @internal-2.g1 goto internal-2.g1",
        "add rule ip kube-proxy services jump service-frontends",
        "add rule ip kube-proxy services ip daddr @nodeport-ips jump nodeport-frontends",
    ]
    assert lines(dump, r"rule ip kube-proxy (internal|pick)-2\.g1 ") == [
        "add rule ip kube-proxy internal-2.g1 ip saddr != 10.0.0.0/8 jump mark-for-masquerade",
        "add rule ip kube-proxy internal-2.g1 goto pick-2.g1",
        "add rule ip kube-proxy pick-2.g1 "
        "dnat to ip daddr . meta l4proto . th dport . numgen random mod 2 map @endpoints-tcp.g1",
        "add rule ip kube-proxy pick-2.g1 "
        "dnat to ip daddr . meta l4proto . th dport . numgen random mod 2 map @endpoints-udp.g1",
        "add rule ip kube-proxy pick-2.g1 "
        "dnat to ip daddr . meta l4proto . th dport . numgen random mod 2 map @endpoints-sctp.g1",
    ]
    assert lines(dump, r"element ip kube-proxy (internal-2|endpoints-tcp|cluster-ips)") == [
        "add element ip kube-proxy cluster-ips { 172.30.0.10 }",
        "add element ip kube-proxy internal-2.g1 { 172.30.0.10 . tcp . 80 }",
        "add element ip kube-proxy endpoints-tcp.g1 "
        "{ 172.30.0.10 . tcp . 80 . 0 : 10.180.0.1 . 8080 }",
        "add element ip kube-proxy endpoints-tcp.g1 "
        "{ 172.30.0.10 . tcp . 80 . 1 : 10.180.0.2 . 8080 }",
    ]
    # The NodePort is masqueraded (externalTrafficPolicy: Cluster) and has its own slots.
    assert "add rule ip kube-proxy nodeport-2.g1 jump mark-for-masquerade" in dump
    assert "nodeport-endpoints-tcp.g1 { tcp . 30080 . 1 : 10.180.0.2 . 8080 }" in dump


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
    assert "add element ip kube-proxy no-endpoint-reject.g1 { 172.30.0.11 . tcp . 80 }" in dump
    # No local endpoint: external traffic is dropped, but pods and the node itself are
    # short-circuited to every endpoint (masqueraded when the node is the source).
    assert "add element ip kube-proxy no-endpoint-nodeports-drop.g1 { udp . 30053 }" in dump
    assert "add element ip kube-proxy nodeport-local-0-1.g1 { udp . 30053 }" in dump
    assert lines(dump, r"rule ip kube-proxy nodeport-local-0-1\.g1 ") == [
        "add rule ip kube-proxy nodeport-local-0-1.g1 "
        "ip saddr 10.0.0.0/8 goto pick-nodeport-shortcut-1.g1",
        "add rule ip kube-proxy nodeport-local-0-1.g1 "
        "fib saddr type local jump mark-for-masquerade",
        "add rule ip kube-proxy nodeport-local-0-1.g1 "
        "fib saddr type local goto pick-nodeport-shortcut-1.g1",
    ]
    assert "shortcut-nodeport-endpoints-udp.g1 { udp . 30053 . 0 : 10.180.0.5 . 5353 }" in dump


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
    fake = FakeNft()
    backend(fake).sync(world.snapshot(), full())
    dump = fake.dump()
    assert "add element ip kube-proxy firewall-ips.g1 { 5.6.7.8 . tcp . 443 }" in dump
    allowed = lines(dump, r"element ip kube-proxy firewall-allow\.g1")
    # The node's own address is in a source range: a VIP looped back is allowed too.
    assert [line.split("{ ")[1] for line in allowed] == [
        "5.6.7.8 . tcp . 443 . 192.168.0.0/16 }",
        "5.6.7.8 . tcp . 443 . 203.0.113.0/24 }",
        "5.6.7.8 . tcp . 443 . 5.6.7.8 }",
    ]
    # An endpoint known to run on another node never hairpins through this one.
    assert lines(dump, "element ip kube-proxy hairpin-endpoints.g1 {") == [
        "add element ip kube-proxy hairpin-endpoints.g1 { 10.180.0.9 . 10.180.0.9 }"
    ]


def test_session_affinity_records_after_dnat() -> None:
    world = World()
    web(world, "10.180.0.1", session_affinity_seconds=600)
    fake = FakeNft()
    backend(fake).sync(world.snapshot(), full())
    dump = fake.dump()
    assert "add element ip kube-proxy affinity-600.g1 { 172.30.0.10 . tcp . 80 }" in dump
    assert lines(dump, r"rule ip kube-proxy pick-1-affinity\.g1 ")[0] == (
        "add rule ip kube-proxy pick-1-affinity.g1 meta l4proto { tcp, udp, sctp } "
        "dnat to ip saddr . ip daddr . meta l4proto . th dport map @affinity"
    )
    assert (
        "add rule ip kube-proxy affinity-record meta l4proto tcp "
        "ct original ip daddr . meta l4proto . ct original proto-dst @affinity-600.g1 "
        "update @affinity { ip saddr . ct original ip daddr . meta l4proto . "
        "ct original proto-dst timeout 600s : ip daddr . th dport }"
    ) in dump
    assert (
        "add rule ip kube-proxy filter-forward ct state new ct status dnat jump affinity-record"
        in dump
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
        "delete element ip kube-proxy endpoints-tcp.g1 { 172.30.0.10 . tcp . 80 . 1 }",
        "delete element ip kube-proxy hairpin-endpoints.g1 { 10.180.0.2 . 10.180.0.2 }",
        "add element ip kube-proxy endpoints-tcp.g1 "
        "{ 172.30.0.10 . tcp . 80 . 1 : 10.180.0.4 . 8080 }",
        "add element ip kube-proxy hairpin-endpoints.g1 { 10.180.0.4 . 10.180.0.4 }",
    ]
    assert b.last_operations == 4 and b.last_transactions == 1 and not b.last_sync_full


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
    # Down to two: slot 2 (the last) moves into the freed slot 0, class 3 -> class 2,
    # which exists already: no rule, no chain.
    web(world, "10.180.0.2", "10.180.0.3")
    b.sync(world.snapshot(), changed(name))
    text = fake.transactions[-1].render()
    assert "rule" not in text and "chain" not in text
    assert "delete element ip kube-proxy internal-3.g1 { 172.30.0.10 . tcp . 80 }" in text
    assert "add element ip kube-proxy internal-2.g1 { 172.30.0.10 . tcp . 80 }" in text
    assert slots_of(fake, Family.IP, ("172.30.0.10", "tcp", "80")) == [
        ("10.180.0.3", "8080"),
        ("10.180.0.2", "8080"),
    ]
    # Up to four: a class seen for the first time brings its chain and one rule, in a
    # transaction before the elements (an empty class set matches nothing meanwhile).
    web(world, "10.180.0.2", "10.180.0.3", "10.180.0.7", "10.180.0.8")
    count = len(fake.transactions)
    b.sync(world.snapshot(), changed(name))
    structure, elements = (tx.render() for tx in fake.transactions[count:])
    assert "add chain ip kube-proxy internal-4.g1" in structure
    assert (
        "add rule ip kube-proxy service-frontends "
        "ip daddr . meta l4proto . th dport @internal-4.g1 goto internal-4.g1"
    ) in structure
    assert "element" not in structure and "rule" not in elements
    assert "add element ip kube-proxy internal-4.g1 { 172.30.0.10 . tcp . 80 }" in elements


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
    with pytest.raises(SyncError, match="refused"):
        b.sync(world.snapshot(), changed(name))
    assert fake.dump() == before
    assert b.sync_failures == 1
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
    world = World()
    web(world, "10.180.0.1", "10.180.0.2", node_port=30080, session_affinity_seconds=60)
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
    old = ChainNftablesBackend(IPFamily.IPV4, CONFIG, executor=fake, support_check=False)
    old.sync(world.snapshot(), full())
    assert "service-ips" in fake.list_sets(Family.IP, "kube-proxy")
    new = backend(fake, clock)
    new.sync(world.snapshot(), full())
    clock.now += 1.0
    new.sync(world.snapshot(), SyncChanges(full=False))
    assert new.stale_chain_failures == 0
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


def test_affinity_entries_of_removed_endpoints_are_deleted() -> None:
    world = World()
    name = web(world, "10.180.0.1", "10.180.0.2", session_affinity_seconds=60)
    fake = FakeNft()
    b = backend(fake)
    b.sync(world.snapshot(), full())
    fake.run_text(
        "add element ip kube-proxy affinity { "
        "10.0.0.5 . 172.30.0.10 . tcp . 80 : 10.180.0.1 . 8080, "
        "10.0.0.6 . 172.30.0.10 . tcp . 80 : 10.180.0.2 . 8080 }"
    )
    web(world, "10.180.0.2", session_affinity_seconds=60)
    b.sync(world.snapshot(), changed(name))
    left = [e.key[0] for e in fake.list_elements(Family.IP, "kube-proxy", "affinity")]
    assert left == ["10.0.0.6"]


def test_ipv6_affinity_keeps_per_port_chains() -> None:
    world = v6_world()
    name = world.add(
        ServicePort(spn("v6"), ip("fd00:96::10"), 80, Protocol.TCP, session_affinity_seconds=60),
        Endpoint(ip("fd00:180::1"), 8080),
    )
    fake = FakeNft()
    b = backend(fake, family=IPFamily.IPV6)
    b.sync(world.snapshot(), full())
    dump = fake.dump()
    vmap = lines(dump, r"element ip6 kube-proxy dedicated-ips\.g1")
    assert len(vmap) == 1 and ": goto service-" in vmap[0]
    assert "update @affinity-" in dump
    world.remove(name)
    b.sync(world.snapshot(), changed(name))
    assert lines(fake.dump(), r"element ip6 kube-proxy dedicated-ips\.g1") == []


# Property: incremental syncs end where a fresh full sync starts ------------------------------


def normalized(fake: FakeNft, family: Family = Family.IP) -> dict[str, object]:
    """The table as what it does: the current generation's objects without their
    generation, each endpoint-slot map as the endpoints of each frontend (slots checked to
    be numbered 0..N-1), empty classes (kept until the next full sync) left out."""
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
    empty = {n for n in sets if CLASS_NAME.fullmatch(n) and not sets[n]}
    empty |= {
        n for n in sets if re.fullmatch(r"affinity-(nodeports-)?[0-9]+\.g[0-9]+", n) and not sets[n]
    }

    def strip(text: str) -> str:
        return re.sub(r"\.g[0-9]+\b", "", text)

    def reads_empty(rule: str) -> bool:
        return any(f"@{name} " in rule + " " for name in empty)

    out: dict[str, object] = {}
    for name, elements in sets.items():
        if name in empty:
            continue
        if "endpoints-" in name:
            by_key: dict[tuple[str, ...], dict[int, tuple[str, ...]]] = {}
            for element in elements:
                key, slot, value = element[:-4], int(element[-4]), element[-2:]
                by_key.setdefault(key, {})[slot] = value
            for key, slots in by_key.items():
                assert sorted(slots) == list(range(len(slots))), f"{name} {key}: {slots}"
            out[strip(name)] = {k: sorted(v.values()) for k, v in by_key.items()}
        else:
            out[strip(name)] = sorted(elements)
    live = [r for n, rules in chains.items() if n not in empty for r in rules if not reads_empty(r)]
    used = {m for r in live for m in re.findall(r"goto (\S+)", r)}
    for name, rules in chains.items():
        if name in empty or (
            (CLASS_NAME.fullmatch(name) or name.startswith("pick")) and name not in used
        ):
            continue
        kept = [strip(r) for r in rules if not reads_empty(r)]
        if name in ("service-frontends", "nodeport-frontends", "affinity-record"):
            kept.sort()
        out[f"chain {name if generation_of(name) is None else strip(name)}"] = kept
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
    """The same on IPv6 (per-port chains for affinity, bracketed endpoints)."""


IncrementalEqualsFull6.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIncrementalEqualsFull6 = IncrementalEqualsFull6.TestCase
