"""ChainNftablesBackend (the per-Service-chain structure, ``bench/chain_structure``) on
FakeNft.

Full and incremental syncs, conflicts, failures, stale chains; the recorded ruleset the map
structure's upgrade tests load is what it writes.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, settings

from bench.chain_structure import ChainNftablesBackend, create_chain_backend
from kubeproxy.backend import Backend, NodePortAddresses, SyncChanges, SyncError
from kubeproxy.backends.nftables import render_transactions
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.objects import Element, Family, NftError
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.config import LocalDetectMode, LocalDetector, ProxierConfig
from kubeproxy.objects import (
    IPFamily,
    Protocol,
    ServicePort,
)
from tests import chain_ruleset
from tests.nftmachine import NftWorldMachine, V6Machine
from tests.snapshots import (
    NODE,
    V6_DETECTOR,
    Clock,
    World,
    changed,
    ep,
    full,
    ip,
    net,
    spn,
    v6_world,
)

CONFIG = ProxierConfig(node_name=NODE)


def backend(
    fake: FakeNft,
    clock: Clock | None = None,
    family: IPFamily = IPFamily.IPV4,
    config: ProxierConfig = CONFIG,
    ports_per_transaction: int = 2000,
) -> ChainNftablesBackend:
    return ChainNftablesBackend(
        family,
        config,
        executor=fake,
        clock=clock or Clock(),
        ports_per_transaction=ports_per_transaction,
    )


_HASH = re.compile(r"\b(service|local|external|firewall|group)-[A-Z2-7]{8}-")


def per_service(dump: str) -> str:
    """The dump lines about Services (chains with '/', elements), hashes taken out.

    Chains are ordered by their name without the hash (rules keep their order).
    """
    lines = [
        _HASH.sub(r"\1-", line).replace(" ip kube-proxy ", " ").replace(" ip6 kube-proxy ", " ")
        for line in dump.splitlines()
        if line.startswith("add element")
        or (line.split()[1] in ("chain", "rule") and "/" in line.split()[4])
    ]

    def order(item: tuple[int, str]) -> tuple[int, str, int]:
        index, line = item
        _verb, noun, name = ([*line.split(" ", 3), "", ""])[:3]
        rank = {"chain": 0, "rule": 1}.get(noun, 2)
        return (rank, name if rank < 2 else "", index)

    return "\n".join(line for _, line in sorted(enumerate(lines), key=order))


def golden(text: str) -> str:
    return "\n".join(line.strip() for line in text.strip().splitlines())


def cip(n: int) -> ServicePort:
    """A plain ClusterIP port ``ns/s<n>:http`` on 172.30.0.<n>:80."""
    return ServicePort(spn(f"s{n}"), ip(f"172.30.0.{n}"), 80, Protocol.TCP)


# Golden dumps ----------------------------------------------------------------------------


def test_golden_ipv4() -> None:
    world = World()
    world.add(cip(1), ep("10.180.0.1"), ep("10.180.1.1", local=True))
    world.add(replace(cip(2), protocol=Protocol.UDP, name=spn("s2", "dns", proto=Protocol.UDP)))
    world.add(
        replace(cip(3), node_port=30003, external_ips=(ip("5.5.5.5"),)),
        ep("10.180.0.3", 80),
    )
    world.add(
        replace(
            cip(4),
            node_port=30004,
            load_balancer_vips=(ip("6.6.6.6"),),
            load_balancer_source_ranges=(net("203.0.113.0/25"),),
            external_policy_local=True,
        ),
        ep("10.180.0.4"),
    )
    world.add(replace(cip(5), internal_policy_local=True), ep("10.180.0.5"))
    world.add(
        replace(cip(6), session_affinity_seconds=60),
        ep("10.180.0.6"),
        # Terminating but serving: the core's fallback keeps it while nothing is ready.
        ep("10.180.1.6", ready=False, serving=True, terminating=True),
    )
    fake = FakeNft()
    backend(fake).sync(world.snapshot(), full())
    assert per_service(fake.dump()) == golden(
        """
        add chain external-ns/s3/tcp/http
        add chain external-ns/s4/tcp/http
        add chain firewall-ns/s4/tcp/http
        add chain service-ns/s1/tcp/http
        add chain service-ns/s3/tcp/http
        add chain service-ns/s4/tcp/http
        add chain service-ns/s6/tcp/http
        add rule external-ns/s3/tcp/http jump mark-for-masquerade
        add rule external-ns/s3/tcp/http goto service-ns/s3/tcp/http
        add rule external-ns/s4/tcp/http ip saddr 10.0.0.0/8 goto service-ns/s4/tcp/http
        add rule external-ns/s4/tcp/http fib saddr type local jump mark-for-masquerade
        add rule external-ns/s4/tcp/http fib saddr type local goto service-ns/s4/tcp/http
        add rule firewall-ns/s4/tcp/http ip saddr 203.0.113.0/25 return
        add rule firewall-ns/s4/tcp/http drop
        add rule service-ns/s1/tcp/http ip daddr 172.30.0.1 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
        add rule service-ns/s1/tcp/http numgen random mod 2 0 meta l4proto tcp dnat to 10.180.0.1:8080
        add rule service-ns/s1/tcp/http meta l4proto tcp dnat to 10.180.1.1:8080
        add rule service-ns/s3/tcp/http ip daddr 172.30.0.3 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
        add rule service-ns/s3/tcp/http meta l4proto tcp dnat to 10.180.0.3:80
        add rule service-ns/s4/tcp/http ip daddr 172.30.0.4 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
        add rule service-ns/s4/tcp/http meta l4proto tcp dnat to 10.180.0.4:8080
        add rule service-ns/s6/tcp/http ip daddr 172.30.0.6 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
        add rule service-ns/s6/tcp/http jump affinity-lookup
        add rule service-ns/s6/tcp/http update @affinity { ip saddr . ip daddr . meta l4proto . th dport timeout 60s : 10.180.0.6 . 8080 } meta l4proto tcp dnat to 10.180.0.6:8080
        add element cluster-ips { 172.30.0.1 }
        add element cluster-ips { 172.30.0.2 }
        add element cluster-ips { 172.30.0.3 }
        add element cluster-ips { 172.30.0.4 }
        add element cluster-ips { 172.30.0.5 }
        add element cluster-ips { 172.30.0.6 }
        add element hairpin-endpoints { 10.180.0.1 . 10.180.0.1 }
        add element hairpin-endpoints { 10.180.0.3 . 10.180.0.3 }
        add element hairpin-endpoints { 10.180.0.4 . 10.180.0.4 }
        add element hairpin-endpoints { 10.180.0.6 . 10.180.0.6 }
        add element hairpin-endpoints { 10.180.1.1 . 10.180.1.1 }
        add element nodeport-ips { 192.168.0.2 }
        add element firewall-ips { 6.6.6.6 . tcp . 80 : goto firewall-ns/s4/tcp/http }
        add element no-endpoint-nodeports { tcp . 30004 : drop }
        add element no-endpoint-services { 172.30.0.2 . udp . 80 : goto reject-chain }
        add element no-endpoint-services { 172.30.0.5 . tcp . 80 : drop }
        add element no-endpoint-services { 6.6.6.6 . tcp . 80 : drop }
        add element service-ips { 172.30.0.1 . tcp . 80 : goto service-ns/s1/tcp/http }
        add element service-ips { 172.30.0.3 . tcp . 80 : goto service-ns/s3/tcp/http }
        add element service-ips { 172.30.0.4 . tcp . 80 : goto service-ns/s4/tcp/http }
        add element service-ips { 172.30.0.6 . tcp . 80 : goto service-ns/s6/tcp/http }
        add element service-ips { 5.5.5.5 . tcp . 80 : goto external-ns/s3/tcp/http }
        add element service-ips { 6.6.6.6 . tcp . 80 : goto external-ns/s4/tcp/http }
        add element service-nodeports { tcp . 30003 : goto external-ns/s3/tcp/http }
        add element service-nodeports { tcp . 30004 : goto external-ns/s4/tcp/http }
        """  # noqa: E501
    )


def test_golden_ipv6() -> None:
    world = World(
        IPFamily.IPV6,
        node_port_addresses=NodePortAddresses(addresses=(ip("2001:db8::1"),)),
        detector=V6_DETECTOR,
        service_cidrs=(net("fd00:10:96::/112"),),
    )
    world.add(
        ServicePort(spn("web6"), ip("fd00:10:96::10"), 80, Protocol.TCP, node_port=30080),
        ep("fd00:10::a1"),
    )
    fake = FakeNft()
    backend(fake, family=IPFamily.IPV6).sync(world.snapshot(), full())
    dump = fake.dump()
    assert "add table ip6 kube-proxy" in dump
    assert "ip6 daddr fd00:10:96::/112 drop" in dump
    assert per_service(dump) == golden(
        """
        add chain external-ns/web6/tcp/http
        add chain service-ns/web6/tcp/http
        add rule external-ns/web6/tcp/http jump mark-for-masquerade
        add rule external-ns/web6/tcp/http goto service-ns/web6/tcp/http
        add rule service-ns/web6/tcp/http ip6 daddr fd00:10:96::10 ip6 saddr != fd00:10::/64 jump mark-for-masquerade
        add rule service-ns/web6/tcp/http meta l4proto tcp dnat to [fd00:10::a1]:8080
        add element cluster-ips { fd00:10:96::10 }
        add element hairpin-endpoints { fd00:10::a1 . fd00:10::a1 }
        add element nodeport-ips { 2001:db8::1 }
        add element service-ips { fd00:10:96::10 . tcp . 80 : goto service-ns/web6/tcp/http }
        add element service-nodeports { tcp . 30080 : goto external-ns/web6/tcp/http }
        """  # noqa: E501
    )


def test_fixed_structure_is_written_once_per_full_sync() -> None:
    fake = FakeNft()
    b = backend(fake)
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    b.sync(world.snapshot(), full())
    dump = fake.dump()
    for line in (
        'add table ip kube-proxy { comment "rules for kube-proxy" ; }',
        "add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }",
        "add chain ip kube-proxy filter-prerouting-pre-dnat "
        "{ type filter hook prerouting priority -110 ; }",
        "add rule ip kube-proxy masquerading masquerade fully-random",
        "add rule ip kube-proxy cluster-ips-check ip daddr 172.30.0.0/16 drop",
    ):
        assert line in dump.splitlines()
    # A second full sync with nothing changed rewrites only the fixed chains.
    b.sync(world.snapshot(), full())
    ops = fake.transactions[-1].operations()
    assert not any("/" in str(getattr(obj, "name", getattr(obj, "chain", ""))) for _, obj in ops)
    assert not any(isinstance(obj, Element) and obj.container != "nodeport-ips" for _, obj in ops)
    assert fake.dump() == dump


# Incremental syncs -----------------------------------------------------------------------


def _touched(tx: Transaction) -> set[str]:
    text = tx.render()
    return set(re.findall(r"ns/s\d+", text)) | set(re.findall(r"172\.30\.0\.\d+", text))


def test_one_endpoint_changed_touches_only_that_service() -> None:
    fake = FakeNft()
    clock = Clock()
    b = backend(fake, clock)
    world = World()
    for n in range(1, 21):
        world.add(cip(n), ep(f"10.180.0.{n}"), ep(f"10.180.1.{n}"))
    b.sync(world.snapshot(), full())
    runs = len(fake.transactions)
    world.add(cip(7), ep("10.180.0.7"), ep("10.180.1.7"), ep("10.180.2.7"))
    b.sync(world.snapshot(), changed(spn("s7")))
    assert len(fake.transactions) == runs + 1
    tx = fake.transactions[-1]
    assert _touched(tx) == {"ns/s7", "172.30.0.7"}
    # new chain + 4 rules, replace the service-ips element, one new hairpin element
    assert tx.num_operations == 1 + 4 + 2 + 1
    assert not b.last_sync_full
    # The old chain goes a second later, in its own transaction.
    clock.now += 1.0
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert [verb for verb, _ in fake.transactions[-1].operations()] == ["delete"]
    assert "ns/s7" in fake.transactions[-1].render()


def test_add_and_remove_a_service() -> None:
    fake = FakeNft()
    clock = Clock()
    b = backend(fake, clock)
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    b.sync(world.snapshot(), full())
    before = fake.dump()
    name = world.add(cip(2), ep("10.180.0.2"))
    b.sync(world.snapshot(), changed(name))
    added = fake.transactions[-1]
    # chain + 2 rules, service-ips, cluster-ips, hairpin
    assert added.num_operations == 6
    assert _touched(added) == {"ns/s2", "172.30.0.2"}
    world.remove(name)
    b.sync(world.snapshot(), changed(name))
    removed = fake.transactions[-1]
    assert sorted(verb for verb, _ in removed.operations()) == ["delete"] * 3
    clock.now += 2
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert fake.dump() == before


def test_no_changes_no_transaction() -> None:
    fake = FakeNft()
    b = backend(fake)
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    b.sync(world.snapshot(), full())
    runs = len(fake.transactions)
    b.sync(world.snapshot(), SyncChanges(full=False))
    b.sync(world.snapshot(), changed(spn("s1")))
    assert len(fake.transactions) == runs
    assert b.last_operations == 0


def test_shared_hairpin_and_cluster_ip_are_reference_counted() -> None:
    fake = FakeNft()
    b = backend(fake)
    world = World()
    shared = ep("10.180.0.9")
    world.add(cip(1), shared)
    world.add(cip(2), shared)
    world.add(replace(cip(1), name=spn("s1", "https"), port=443), shared)
    b.sync(world.snapshot(), full())
    world.remove(spn("s1"))
    b.sync(world.snapshot(), changed(spn("s1")))
    dump = fake.dump()
    assert "add element ip kube-proxy hairpin-endpoints { 10.180.0.9 . 10.180.0.9 }" in dump
    assert "add element ip kube-proxy cluster-ips { 172.30.0.1 }" in dump
    world.remove(spn("s1", "https"))
    b.sync(world.snapshot(), changed(spn("s1")))
    dump = fake.dump()
    assert "10.180.0.9 . 10.180.0.9" in dump
    assert "cluster-ips { 172.30.0.1 }" not in dump
    world.remove(spn("s2"))
    b.sync(world.snapshot(), changed(spn("s2")))
    assert "10.180.0.9 . 10.180.0.9" not in fake.dump()


def test_node_port_addresses_change_rewrites_fixed_chains_only() -> None:
    fake = FakeNft()
    b = backend(fake)
    world = World()
    world.add(replace(cip(1), node_port=30001), ep("10.180.0.1"))
    b.sync(world.snapshot(), full())
    world.node_port_addresses = NodePortAddresses(match_all=True)
    b.sync(world.snapshot(), SyncChanges(full=False))
    dump = fake.dump()
    assert "add element ip kube-proxy nodeport-ips" not in dump
    assert (
        "add rule ip kube-proxy services fib daddr type local ip daddr != 127.0.0.0/8 "
        "meta l4proto . th dport vmap @service-nodeports"
    ) in dump
    assert "ns/s1" not in fake.transactions[-1].render()


def test_detector_change_rerenders_every_port() -> None:
    fake = FakeNft()
    clock = Clock()
    b = backend(fake, clock)
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    world.add(cip(2), ep("10.180.0.2"))
    b.sync(world.snapshot(), full())
    world.detector = LocalDetector(LocalDetectMode.BRIDGE_INTERFACE, interface="cbr0")
    b.sync(world.snapshot(), SyncChanges(full=False))
    clock.now += 1
    b.sync(world.snapshot(), SyncChanges(full=False))
    fresh = FakeNft()
    backend(fresh).sync(world.snapshot(), full())
    assert fake.dump() == fresh.dump()
    assert 'iifname != "cbr0"' in fake.dump()


# Restarts and full syncs over existing state ----------------------------------------------


def test_restart_reuses_existing_chains_without_rewriting_them() -> None:
    fake = FakeNft()
    world = World()
    for n in range(1, 6):
        world.add(replace(cip(n), node_port=30000 + n), ep(f"10.180.0.{n}"))
    backend(fake).sync(world.snapshot(), full())
    dump = fake.dump()
    second = backend(fake)
    second.sync(world.snapshot(), full())
    ops = fake.transactions[-1].operations()
    assert not any("/" in getattr(obj, "name", "") for _, obj in ops)
    assert not any(getattr(obj, "chain", "").count("/") for _, obj in ops)
    assert fake.dump() == dump


def test_restart_right_after_a_change_keeps_reused_chains_intact() -> None:
    """A chain left behind by a previous process must still work if it is wanted again.

    The previous process changed s1 (its old chain went stale) and stopped before deleting
    the old chain; the Service then went back to its old endpoints.
    """
    fake = FakeNft()
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    first = backend(fake)
    first.sync(world.snapshot(), full())
    original = fake.dump()
    world.add(cip(1), ep("10.180.0.2"))
    first.sync(world.snapshot(), changed(spn("s1")))
    world.add(cip(1), ep("10.180.0.1"))
    backend(fake).sync(world.snapshot(), full())
    dump = fake.dump()
    target = re.search(r"service-ips \{ 172.30.0.1 . tcp . 80 : goto (\S+) \}", dump)
    assert target is not None
    assert f"add rule ip kube-proxy {target[1]} meta l4proto tcp dnat to 10.180.0.1:8080" in dump
    # The original chain was reused; the one from the middle state goes after a second.
    assert target[1] in original
    assert len(re.findall(r"add chain ip kube-proxy service-[A-Z2-7]{8}-", dump)) == 2


def test_full_sync_removes_what_nobody_wants_and_deletes_old_chains_later() -> None:
    fake = FakeNft()
    clock = Clock()
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    world.add(cip(2), ep("10.180.0.2"))
    backend(fake).sync(world.snapshot(), full())
    world.remove(spn("s2"))
    b = backend(fake, clock)
    b.sync(world.snapshot(), full())
    dump = fake.dump()
    assert "172.30.0.2 . tcp" not in dump and "cluster-ips { 172.30.0.2 }" not in dump
    assert "ns/s2" in dump  # the chain stays until it has been unreferenced for a second
    clock.now += 0.5
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert "ns/s2" in fake.dump()
    clock.now += 0.5
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert "ns/s2" not in fake.dump()
    fresh = FakeNft()
    backend(fresh).sync(world.snapshot(), full())
    assert fake.dump() == fresh.dump()


def test_full_sync_fixes_elements_changed_behind_our_back() -> None:
    fake = FakeNft()
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    b = backend(fake)
    b.sync(world.snapshot(), full())
    expected = fake.dump()
    fake.run_text(
        "delete element ip kube-proxy cluster-ips { 172.30.0.1 }\n"
        "add element ip kube-proxy cluster-ips { 172.30.9.9 }\n"
        "add element ip kube-proxy no-endpoint-services { 172.30.9.9 . tcp . 1 : drop }\n"
    )
    b.sync(world.snapshot(), full())
    assert fake.dump() == expected


def test_chunked_cold_sync_equals_one_transaction() -> None:
    world = World()
    for n in range(1, 12):
        world.add(
            replace(cip(n), node_port=30000 + n, session_affinity_seconds=n % 2 * 10),
            *(ep(f"10.{n}.0.{k}") for k in range(1, n + 1)),
        )
    one = FakeNft()
    backend(one).sync(world.snapshot(), full())
    chunked = FakeNft()
    b = backend(chunked, ports_per_transaction=3)
    b.sync(world.snapshot(), full())
    assert b.last_transactions == 4
    # (the support check's probes commit to a throw-away table of their own first)
    assert len([tx for tx in chunked.transactions if tx.table == "kube-proxy"]) == 4
    assert chunked.dump() == one.dump()


# Conflicts and bad input -----------------------------------------------------------------


def test_duplicate_node_port_first_wins_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeNft()
    b = backend(fake)
    world = World()
    world.add(replace(cip(1), node_port=30000), ep("10.180.0.1"))
    world.add(replace(cip(2), node_port=30000), ep("10.180.0.2"))
    world.add(cip(3), ep("10.180.0.3"))
    with caplog.at_level(logging.ERROR):
        b.sync(world.snapshot(), full())
        b.sync(world.snapshot(), full())
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "ns/s2:http" in errors[0] and "ns/s1:http" in errors[0] and "tcp . 30000" in errors[0]
    dump = fake.dump()
    assert "ns/s1/" in dump and "ns/s3/" in dump
    assert "ns/s2/" not in dump and "172.30.0.2" not in dump
    # When the winner goes away, the other one is programmed.
    world.remove(spn("s1"))
    b.sync(world.snapshot(), changed(spn("s1")))
    assert "goto external-" in fake.dump() and "ns/s2/" in fake.dump()


def test_duplicate_service_ip_port_lower_name_wins_even_when_added_later() -> None:
    fake = FakeNft()
    clock = Clock()
    b = backend(fake, clock)
    world = World()
    world.add(replace(cip(2), external_ips=(ip("5.5.5.5"),)), ep("10.180.0.2"))
    b.sync(world.snapshot(), full())
    world.add(replace(cip(1), external_ips=(ip("5.5.5.5"),)), ep("10.180.0.1"))
    b.sync(world.snapshot(), changed(spn("s1")))
    dump = fake.dump()
    assert "ns/s1/" in dump
    assert "cluster-ips { 172.30.0.2 }" not in dump
    clock.now += 1
    b.sync(world.snapshot(), SyncChanges(full=False))
    fresh = FakeNft()
    backend(fresh).sync(world.snapshot(), full())
    assert fake.dump() == fresh.dump()


def test_invalid_port_is_skipped_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeNft()
    b = backend(fake)
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    world.add(cip(2), ep("fd00::1"))  # wrong family
    with caplog.at_level(logging.ERROR):
        b.sync(world.snapshot(), full())
        b.sync(world.snapshot(), changed(spn("s2")))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "ns/s2:http" in errors[0] and "fd00::1" in errors[0]
    assert "ns/s1/" in fake.dump() and "172.30.0.2" not in fake.dump()


# Failures --------------------------------------------------------------------------------


def test_refused_transaction_raises_and_keeps_previous_rules() -> None:
    fake = FakeNft()
    clock = Clock()
    b = backend(fake, clock)
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    b.sync(world.snapshot(), full())
    before = fake.dump()
    world.add(cip(1), ep("10.180.0.2"))
    world.add(cip(2), ep("10.180.0.3"))
    fake.fail_next = NftError("Could not process rule: No such file or directory", 2)
    with pytest.raises(SyncError, match="No such file"):
        b.sync(world.snapshot(), changed(spn("s1"), spn("s2")))
    assert fake.dump() == before
    assert b.sync_failures == 1
    # Whatever the core asks for next, the backend re-lists and converges.
    runs = len(fake.transactions)
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert b.last_sync_full
    assert len(fake.transactions) > runs
    clock.now += 1
    b.sync(world.snapshot(), SyncChanges(full=False))
    fresh = FakeNft()
    backend(fresh).sync(world.snapshot(), full())
    assert fake.dump() == fresh.dump()


def test_failure_in_a_later_chunk_keeps_earlier_chunks_consistent() -> None:
    fake = FakeNft()
    clock = Clock()
    world = World()
    for n in range(1, 7):
        world.add(cip(n), ep(f"10.180.0.{n}"))
    b = backend(fake, clock, ports_per_transaction=2)

    real_run = fake.run
    calls = []

    def flaky(tx: Transaction) -> None:
        calls.append(tx)
        if len(calls) == 2:
            raise NftError("boom")
        real_run(tx)

    fake.run = flaky  # type: ignore[method-assign]
    with pytest.raises(SyncError):
        b.sync(world.snapshot(), full())
    # Only the first chunk landed: s1 and s2 work, the others are absent (not half-made).
    dump = fake.dump()
    assert "ns/s1/" in dump and "ns/s2/" in dump and "ns/s3/" not in dump
    assert "172.30.0.3" not in dump
    fake.run = real_run  # type: ignore[method-assign]
    b.sync(world.snapshot(), SyncChanges(full=False))
    fresh = FakeNft()
    backend(fresh).sync(world.snapshot(), full())
    assert fake.dump() == fresh.dump()


def test_stale_chain_deletion_failure_is_counted_and_forces_a_full_sync(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeNft()
    clock = Clock()
    b = backend(fake, clock)
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    b.sync(world.snapshot(), full())
    world.add(cip(1), ep("10.180.0.2"))
    b.sync(world.snapshot(), changed(spn("s1")))
    clock.now += 1
    fake.fail_next = NftError("Device or resource busy", 16)
    with caplog.at_level(logging.ERROR):
        b.sync(world.snapshot(), SyncChanges(full=False))
    assert b.stale_chain_failures == 1
    assert b.last_sync_full
    assert any("stale" in r.getMessage() for r in caplog.records)
    clock.now += 1
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert len(re.findall(r"add chain ip kube-proxy service-[A-Z2-7]{8}-", fake.dump())) == 1


# Affinity cleanup ------------------------------------------------------------------------


def test_affinity_entries_of_removed_endpoints_are_deleted() -> None:
    fake = FakeNft()
    b = backend(fake)
    world = World()
    sticky = replace(cip(1), session_affinity_seconds=600, node_port=30001)
    world.add(sticky, ep("10.180.0.1"), ep("10.180.0.2"))
    world.add(replace(cip(2), session_affinity_seconds=600), ep("10.180.0.1"))
    b.sync(world.snapshot(), full())
    entries = [
        "10.9.0.1 . 172.30.0.1 . tcp . 80 : 10.180.0.1 . 8080",
        "10.9.0.2 . 172.30.0.1 . tcp . 80 : 10.180.0.2 . 8080",
        "10.9.0.3 . 192.168.0.2 . tcp . 30001 : 10.180.0.2 . 8080",
        "10.9.0.4 . 172.30.0.2 . tcp . 80 : 10.180.0.1 . 8080",
    ]
    fake.run_text(
        "".join(
            f"add element ip kube-proxy affinity {{ {e.replace(' :', ' timeout 600s :')} }}\n"
            for e in entries
        )
    )
    world.add(sticky, ep("10.180.0.1"))
    b.sync(world.snapshot(), changed(spn("s1")))
    left = {
        " . ".join(el.key) + " : " + " . ".join(el.value)
        for el in fake.list_elements(Family.IP, "kube-proxy", "affinity")
    }
    assert left == {entries[0], entries[3]}
    # Turning affinity off drops the service's entries; the other service keeps its own.
    world.add(replace(sticky, session_affinity_seconds=0), ep("10.180.0.1"))
    b.sync(world.snapshot(), changed(spn("s1")))
    left = {" . ".join(el.key) for el in fake.list_elements(Family.IP, "kube-proxy", "affinity")}
    assert left == {"10.9.0.4 . 172.30.0.2 . tcp . 80"}
    assert b.affinity_cleanup_failures == 0


def test_full_sync_cleans_affinity_entries_left_from_before() -> None:
    fake = FakeNft()
    world = World()
    world.add(replace(cip(1), session_affinity_seconds=600), ep("10.180.0.1"))
    backend(fake).sync(world.snapshot(), full())
    fake.run_text(
        "add element ip kube-proxy affinity { 10.9.0.1 . 172.30.0.1 . tcp . 80 timeout 60s : 10.180.0.1 . 8080 }\n"  # noqa: E501
        "add element ip kube-proxy affinity { 10.9.0.2 . 172.30.0.1 . tcp . 80 timeout 60s : 10.180.0.7 . 8080 }\n"  # noqa: E501
        "add element ip kube-proxy affinity { 10.9.0.3 . 172.30.0.9 . tcp . 80 timeout 60s : 10.180.0.1 . 8080 }\n"  # noqa: E501
    )
    backend(fake).sync(world.snapshot(), full())
    left = [el.key[0] for el in fake.list_elements(Family.IP, "kube-proxy", "affinity")]
    assert left == ["10.9.0.1"]


# Cleanup and dry runs --------------------------------------------------------------------


def test_cleanup_deletes_only_our_table() -> None:
    fake = FakeNft()
    fake.run_text(
        "add table inet foreign\n"
        "add chain inet foreign input { type filter hook input priority 0 ; }\n"
        "add table ip6 kube-proxy\n"
    )
    foreign = fake.dump(Family.INET, "foreign")
    b = backend(fake)
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    b.sync(world.snapshot(), full())
    b.cleanup()
    assert not fake.table_exists(Family.IP, "kube-proxy")
    assert fake.table_exists(Family.IP6, "kube-proxy")
    assert fake.dump(Family.INET, "foreign") == foreign
    b.cleanup()  # a missing table is fine
    b.sync(world.snapshot(), SyncChanges(full=False))  # and the backend starts over
    assert "ns/s1/" in fake.dump()


def test_dry_run_with_a_fake_renders_a_cold_sync() -> None:
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    fake = FakeNft()
    b = ChainNftablesBackend(IPFamily.IPV4, CONFIG, executor=fake)  # support check included
    b.sync(world.snapshot(), full())
    text = render_transactions(fake.transactions)
    assert text.startswith("# transaction 1: ")
    assert "add table ip kube-proxy" in text
    assert "add element ip kube-proxy service-ips { 172.30.0.1 . tcp . 80 : goto service-" in text


def test_create_backend_refuses_a_missing_namespace() -> None:
    with pytest.raises(NftError):
        create_chain_backend(IPFamily.IPV4, CONFIG, netns="kpxr-does-not-exist")


def test_wrong_family_snapshot_is_refused() -> None:
    with pytest.raises(ValueError, match="IPv6"):
        backend(FakeNft()).sync(World(IPFamily.IPV6).snapshot(), full())


# Property: incremental syncs converge to exactly what a fresh full sync writes ------------


class IncrementalEqualsFull(NftWorldMachine):
    """Incremental syncs end exactly where a fresh full sync starts: the same dump."""

    def make_backend(self, fake: FakeNft, clock: Clock, *, small: bool) -> Backend:
        return backend(fake, clock, self.family, ports_per_transaction=3 if small else 2000)

    def state(self, fake: FakeNft) -> list[str]:
        return fake.dump().splitlines()


IncrementalEqualsFull.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIncrementalEqualsFull = IncrementalEqualsFull.TestCase


class IncrementalEqualsFull6(V6Machine, IncrementalEqualsFull):
    """The same on IPv6 (per-port affinity maps, bracketed endpoints)."""


IncrementalEqualsFull6.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIncrementalEqualsFull6 = IncrementalEqualsFull6.TestCase


# IPv6 session affinity: per-port maps ---------------------------------------------------


def _v6_port(seconds: int = 600) -> ServicePort:
    return ServicePort(
        spn("web6"), ip("fd00:10:96::10"), 80, Protocol.TCP, session_affinity_seconds=seconds
    )


def test_ipv6_affinity_maps_live_and_die_with_their_port() -> None:
    fake = FakeNft()
    clock = Clock()
    b = backend(fake, clock, family=IPFamily.IPV6)
    world = v6_world()
    world.add(_v6_port(), ep("fd00:10::a1"), ep("fd00:10::a2"))
    b.sync(world.snapshot(), full())
    maps = [m for m in fake.list_sets(Family.IP6, "kube-proxy") if m.startswith("affinity-")]
    assert len(maps) == 1
    assert (
        f"add map ip6 kube-proxy {maps[0]} {{ type ipv6_addr : ipv6_addr ; "
        "flags dynamic,timeout ; timeout 10800s ; size 65536 ; }"
    ) in fake.dump()
    fake.run_text(
        f"add element ip6 kube-proxy {maps[0]} {{ fd00:99::1 timeout 600s : fd00:10::a1 }}\n"
        f"add element ip6 kube-proxy {maps[0]} {{ fd00:99::2 timeout 600s : fd00:10::a2 }}\n"
    )
    # An endpoint goes: the map stays, entries pointing at it go.
    world.add(_v6_port(), ep("fd00:10::a1"))
    b.sync(world.snapshot(), changed(spn("web6")))
    entries = fake.list_elements(Family.IP6, "kube-proxy", maps[0])
    assert [(e.key, e.value) for e in entries] == [(("fd00:99::1",), ("fd00:10::a1",))]
    # Affinity off: the map goes a second later, after the chains that used it.
    world.add(_v6_port(0), ep("fd00:10::a1"))
    b.sync(world.snapshot(), changed(spn("web6")))
    assert fake.table_exists(Family.IP6, "kube-proxy")
    assert maps[0] in fake.list_sets(Family.IP6, "kube-proxy")
    clock.now += 1
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert maps[0] not in fake.list_sets(Family.IP6, "kube-proxy")
    fresh = FakeNft()
    backend(fresh, family=IPFamily.IPV6).sync(world.snapshot(), full())
    assert fake.dump() == fresh.dump()


def test_ipv6_affinity_maps_found_at_restart() -> None:
    fake = FakeNft()
    world = v6_world()
    world.add(_v6_port(), ep("fd00:10::a1"))
    backend(fake, family=IPFamily.IPV6).sync(world.snapshot(), full())
    (name,) = [m for m in fake.list_sets(Family.IP6, "kube-proxy") if m.startswith("affinity-")]
    fake.run_text(
        f"add element ip6 kube-proxy {name} {{ fd00:99::1 timeout 600s : fd00:10::a1 }}\n"
        f"add element ip6 kube-proxy {name} {{ fd00:99::2 timeout 600s : fd00:10::a7 }}\n"
    )
    clock = Clock()
    b = backend(fake, clock, family=IPFamily.IPV6)
    b.sync(world.snapshot(), full())
    # Reused (its entries kept), the stale entry dropped.
    assert [e.key for e in fake.list_elements(Family.IP6, "kube-proxy", name)] == [("fd00:99::1",)]
    world.remove(spn("web6"))
    b.sync(world.snapshot(), full())
    clock.now += 1
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert name not in fake.list_sets(Family.IP6, "kube-proxy")


def test_first_full_sync_replaces_base_chains_of_another_layout() -> None:
    fake = FakeNft()
    # An older layout had the filter chains at priority -110; the kernel cannot move them.
    fake.run_text(
        "add table ip kube-proxy\n"
        "add chain ip kube-proxy filter-input { type filter hook input priority -110 ; }\n"
        "add chain ip kube-proxy endpoints-check\n"
        "add rule ip kube-proxy filter-input ct state new jump endpoints-check\n"
    )
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    b = backend(fake)
    b.sync(world.snapshot(), full())
    dump = fake.dump()
    assert "add chain ip kube-proxy filter-input { type filter hook input priority 0 ; }" in dump
    assert "jump endpoints-check" not in dump
    # Later full syncs leave base chains alone.
    b.sync(world.snapshot(), full())
    assert not any(verb == "delete" for verb, _ in fake.transactions[-1].operations())


def test_unexpected_error_propagates_and_forces_a_full_sync() -> None:
    fake = FakeNft()
    b = backend(fake)
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    b.sync(world.snapshot(), full())
    real_run = fake.run

    def broken(tx: Transaction) -> None:
        raise RuntimeError("executor bug")

    fake.run = broken  # type: ignore[method-assign]
    world.add(cip(2), ep("10.180.0.2"))
    with pytest.raises(RuntimeError):
        b.sync(world.snapshot(), changed(spn("s2")))
    fake.run = real_run  # type: ignore[method-assign]
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert b.last_sync_full
    fresh = FakeNft()
    backend(fresh).sync(world.snapshot(), full())
    assert fake.dump() == fresh.dump()


# The recording the map structure's upgrade tests start from ------------------------------


def test_the_recorded_ruleset_is_what_this_structure_writes() -> None:
    recorded = chain_ruleset.recorded()
    assert "add map ip kube-proxy service-ips" in recorded
    assert "kpxr/echo/tcp/tcp" in recorded  # the kernel test's echo Service
    assert recorded == chain_ruleset.record(), "re-record it: see tests/chain_ruleset.py"
