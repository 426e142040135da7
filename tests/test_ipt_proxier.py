"""IptablesBackend on FakeIptables: golden dumps, partial syncs, stale chains, failures."""

from __future__ import annotations

import difflib
import logging
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from kubeproxy.backend import NodePortAddresses, ProxySnapshot, SyncChanges, SyncError
from kubeproxy.backends.iptables import IptablesBackend
from kubeproxy.backends.iptables.exec import IptablesVariant
from kubeproxy.backends.iptables.fake import FakeIptables
from kubeproxy.backends.iptables.naming import endpoint_chain, service_chains
from kubeproxy.backends.iptables.proxier import LARGE_CLUSTER_ENDPOINTS, cleanup_family
from kubeproxy.config import LocalDetectMode, LocalDetector, ProxierConfig
from kubeproxy.objects import (
    Endpoint,
    IPFamily,
    Protocol,
    ServicePort,
    ServicePortName,
)
from tests import snapshots
from tests.snapshots import (
    NODE,
    V4_DETECTOR,
    Clock,
    World,
    WorldMachine,
    changed,
    full,
    ip,
    net,
    spn,
)

V4 = IPFamily.IPV4
CONFIG = ProxierConfig(node_name=NODE)
NO_LOCALHOST = ProxierConfig(node_name=NODE, localhost_node_ports=False)


def ep(addr: str, port: int = 8080, *, local: bool = False, ready: bool = True) -> Endpoint:
    """An endpoint that is terminating when not ready."""
    return snapshots.ep(addr, port, local=local, ready=ready, terminating=not ready)


def backend(
    fake: FakeIptables,
    clock: Clock | None = None,
    config: ProxierConfig = CONFIG,
    chains_per_restore: int | None = None,
) -> IptablesBackend:
    return IptablesBackend(
        V4, config, executor=fake, clock=clock or Clock(), chains_per_restore=chains_per_restore
    )


def cip(n: int, **kw: object) -> ServicePort:
    """A ClusterIP port ``ns/s<n>:http`` on 172.30.0.<n>:80."""
    return replace(ServicePort(spn(f"s{n}"), ip(f"172.30.0.{n}"), 80, Protocol.TCP), **kw)  # type: ignore[arg-type]


def chain_lines(dump: str, prefix: str) -> list[str]:
    return [line for line in dump.splitlines() if line.startswith(prefix)]


def declared(text: str) -> set[str]:
    return {line[1:].split()[0] for line in text.splitlines() if line.startswith(":")}


def golden(text: str) -> str:
    return "\n".join(line.strip() for line in text.strip().splitlines())


# Golden dumps ----------------------------------------------------------------------------


def test_golden_upstream_example() -> None:
    # Upstream's TestOverallIPTablesRules service svc1 (ns1/svc1:p80), rule for rule.
    world = World()
    port = ServicePort(spn("svc1", "p80", "ns1"), ip("172.30.0.41"), 80, Protocol.TCP)
    world.add(port, ep("10.180.0.1", 80))
    fake = FakeIptables()
    backend(fake).sync(world.snapshot(), full())
    nat = fake.dump(V4, "nat")
    wanted = golden(
        """
        -A KUBE-SEP-SXIVWICOYRO3J4NJ -s 10.180.0.1/32 -m comment --comment "ns1/svc1:p80" -j KUBE-MARK-MASQ
        -A KUBE-SEP-SXIVWICOYRO3J4NJ -p tcp -m comment --comment "ns1/svc1:p80" -m tcp -j DNAT --to-destination 10.180.0.1:80
        -A KUBE-SERVICES -d 172.30.0.41/32 -p tcp -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
        -A KUBE-SERVICES -d 192.168.0.2/32 -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -j KUBE-NODEPORTS
        -A KUBE-SVC-XPGD46QRK7WJZT7O ! -s 10.0.0.0/8 -d 172.30.0.41/32 -p tcp -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ
        -A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> 10.180.0.1:80" -j KUBE-SEP-SXIVWICOYRO3J4NJ
        """  # noqa: E501
    )
    got = "\n".join(
        chain_lines(nat, "-A KUBE-SEP-")
        + chain_lines(nat, "-A KUBE-SERVICES")
        + chain_lines(nat, "-A KUBE-SVC-")
    )
    assert got == wanted
    assert (
        '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING'
        in nat
    )
    assert "-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000" in nat


def all_restores(fake: FakeIptables) -> str:
    return "".join(text for _family, text in fake.restores)


def restore_lines(fake: FakeIptables, prefix: str) -> list[str]:
    """Lines starting with ``prefix`` in every restore so far (tests sync once)."""
    return [line for line in all_restores(fake).splitlines() if line.startswith(prefix)]


def nat_lines(fake: FakeIptables, prefix: str) -> list[str]:
    nat = fake.restores[-1][1].split("*filter")[0]
    return [line for line in nat.splitlines() if line.startswith(prefix)]


def test_golden_policies_affinity_firewall() -> None:
    world = World()
    world.add(
        cip(
            2,
            node_port=30002,
            load_balancer_vips=(ip("6.6.6.6"),),
            load_balancer_source_ranges=(net("203.0.113.0/25"),),
            external_policy_local=True,
            health_check_node_port=30102,
            session_affinity_seconds=60,
        ),
        ep("10.180.0.4", local=True),
        ep("10.180.1.4"),
        ep("10.180.1.5"),
    )
    world.add(cip(3))  # no endpoints
    fake = FakeIptables()
    backend(fake).sync(world.snapshot(), full())
    svc, svl, ext, fw = service_chains("ns/s2:http", "tcp")
    s4, s14, s15 = (
        endpoint_chain("ns/s2:http", "tcp", f"10.180.{a}:8080") for a in ("0.4", "1.4", "1.5")
    )
    got = [
        *restore_lines(fake, f"-A {svc} "),
        *restore_lines(fake, f"-A {svl} "),
        *restore_lines(fake, f"-A {ext} "),
        *restore_lines(fake, f"-A {fw} "),
        *restore_lines(fake, f"-A {s4} "),
    ]
    c = "ns/s2:http"
    assert "\n".join(got) == golden(
        f"""
        -A {svc} -m comment --comment "{c} cluster IP" -m tcp -p tcp -d 172.30.0.2 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
        -A {svc} -m comment --comment "{c} -> 10.180.0.4:8080" -m recent --name {s4} --rcheck --seconds 60 --reap -j {s4}
        -A {svc} -m comment --comment "{c} -> 10.180.1.4:8080" -m recent --name {s14} --rcheck --seconds 60 --reap -j {s14}
        -A {svc} -m comment --comment "{c} -> 10.180.1.5:8080" -m recent --name {s15} --rcheck --seconds 60 --reap -j {s15}
        -A {svc} -m comment --comment "{c} -> 10.180.0.4:8080" -m statistic --mode random --probability 0.3333333333 -j {s4}
        -A {svc} -m comment --comment "{c} -> 10.180.1.4:8080" -m statistic --mode random --probability 0.5000000000 -j {s14}
        -A {svc} -m comment --comment "{c} -> 10.180.1.5:8080" -j {s15}
        -A {svl} -m comment --comment "{c} -> 10.180.0.4:8080" -m recent --name {s4} --rcheck --seconds 60 --reap -j {s4}
        -A {svl} -m comment --comment "{c} -> 10.180.0.4:8080" -j {s4}
        -A {ext} -m comment --comment "pod traffic for {c} external destinations" -s 10.0.0.0/8 -j {svc}
        -A {ext} -m comment --comment "masquerade LOCAL traffic for {c} external destinations" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ
        -A {ext} -m comment --comment "route LOCAL traffic for {c} external destinations" -m addrtype --src-type LOCAL -j {svc}
        -A {ext} -j {svl}
        -A {fw} -m comment --comment "{c} loadbalancer IP" -s 203.0.113.0/25 -j {ext}
        -A {s4} -m comment --comment "{c}" -s 10.180.0.4 -j KUBE-MARK-MASQ
        -A {s4} -m comment --comment "{c}" -m recent --name {s4} --set -m tcp -p tcp -j DNAT --to-destination 10.180.0.4:8080
        """  # noqa: E501
    )
    assert restore_lines(fake, "-A KUBE-SERVICES ") == [
        f'-A KUBE-SERVICES -m comment --comment "{c} cluster IP" -m tcp -p tcp -d 172.30.0.2 --dport 80 -j {svc}',  # noqa: E501
        f'-A KUBE-SERVICES -m comment --comment "{c} loadbalancer IP" -m tcp -p tcp -d 6.6.6.6 --dport 80 -j {fw}',  # noqa: E501
        '-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -d 192.168.0.2 -j KUBE-NODEPORTS',  # noqa: E501
        # filter: no endpoints, then our service-CIDR extension
        '-A KUBE-SERVICES -m comment --comment "ns/s3:http has no endpoints" -m tcp -p tcp -d 172.30.0.3 --dport 80 -j REJECT',  # noqa: E501
        "-A KUBE-SERVICES -d 172.30.0.0/16 -j KUBE-SERVICE-IPS",
    ]
    assert restore_lines(fake, "-A KUBE-SERVICE-IPS ") == [
        "-A KUBE-SERVICE-IPS -d 172.30.0.2 -j REJECT",
        "-A KUBE-SERVICE-IPS -d 172.30.0.3 -j REJECT",
        "-A KUBE-SERVICE-IPS -j DROP",
    ]
    assert restore_lines(fake, "-A KUBE-PROXY-FIREWALL ") == [
        f'-A KUBE-PROXY-FIREWALL -m comment --comment "{c} traffic not accepted by {fw}" -m tcp -p tcp -d 6.6.6.6 --dport 80 -j DROP'  # noqa: E501
    ]
    assert restore_lines(fake, '-A KUBE-NODEPORTS -m comment --comment "ns/s2:http health') == [
        f'-A KUBE-NODEPORTS -m comment --comment "{c} health check node port" -m tcp -p tcp --dport 30102 -j ACCEPT'  # noqa: E501
    ]


def test_restore_writes_nat_before_filter() -> None:
    # A refused nat block must stop the restore before filter changes (module docstring).
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    fake = FakeIptables()
    backend(fake).sync(world.snapshot(), full())
    tables = [line for line in fake.restores[-1][1].splitlines() if line.startswith("*")]
    assert tables == ["*nat", "*filter", "*mangle"]


def test_jumps_from_builtin_chains() -> None:
    fake = FakeIptables()
    backend(fake).sync(World().snapshot(), full())
    flt = fake.dump(V4, "filter")
    assert (
        '-A FORWARD -m comment --comment "kubernetes service portals" -m conntrack --ctstate NEW '
        "-j KUBE-SERVICES" in flt
    )
    assert "KUBE-FIREWALL" not in flt  # localhost NodePorts are off for these addresses
    assert '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES' in (
        fake.dump(V4, "nat")
    )


def test_localhost_node_ports_need_loopback_and_ipv4() -> None:
    world = World(node_port_addresses=NodePortAddresses(match_all=True))
    world.add(cip(1, node_port=30001), ep("10.180.0.1"))
    fake = FakeIptables()
    calls: list[int] = []
    b = IptablesBackend(V4, CONFIG, executor=fake, route_localnet=lambda: calls.append(1))
    b.sync(world.snapshot(), full())
    flt = fake.dump(V4, "filter")
    assert "-j KUBE-FIREWALL" in flt
    assert "block incoming localnet connections" in flt
    assert calls == [1]
    assert (
        "-m addrtype --dst-type LOCAL -j KUBE-NODEPORTS" in nat_lines(fake, "-A KUBE-SERVICES ")[-1]
    )
    # localhostNodePorts false: loopback is excluded and nothing else is touched.
    fake2 = FakeIptables()
    calls.clear()
    config = ProxierConfig(node_name=NODE, localhost_node_ports=False)
    b2 = IptablesBackend(V4, config, executor=fake2, route_localnet=lambda: calls.append(1))
    b2.sync(world.snapshot(), full())
    assert "KUBE-FIREWALL" not in fake2.dump(V4, "filter")
    assert calls == []
    assert nat_lines(fake2, "-A KUBE-SERVICES ")[-1].endswith(
        "-m addrtype --dst-type LOCAL ! -d 127.0.0.0/8 -j KUBE-NODEPORTS"
    )


def test_localhost_node_ports_switched_on_later() -> None:
    world = World()
    world.add(cip(1, node_port=30001), ep("10.180.0.1"))
    fake = FakeIptables()
    b = backend(fake)
    b.sync(world.snapshot(), full())
    assert "KUBE-FIREWALL" not in fake.dump(V4, "filter")
    world.node_port_addresses = NodePortAddresses(match_all=True)
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert b.last_sync_full
    assert "-A INPUT -j KUBE-FIREWALL" in fake.dump(V4, "filter")


# Partial syncs ---------------------------------------------------------------------------


def test_partial_sync_writes_only_changed_services() -> None:
    world = World()
    a = world.add(cip(1), ep("10.180.0.1"))
    b_ = world.add(cip(2), ep("10.180.0.2"))
    fake = FakeIptables()
    b = backend(fake)
    b.sync(world.snapshot(), full())
    world.add(cip(2), ep("10.180.0.2"), ep("10.180.0.3"))
    b.sync(world.snapshot(), changed(b_))
    assert not b.last_sync_full
    text = fake.restores[-1][1]
    chains = {c for c in declared(text) if c.startswith(("KUBE-SVC-", "KUBE-SEP-"))}
    assert chains == {
        service_chains("ns/s2:http", "tcp")[0],
        endpoint_chain("ns/s2:http", "tcp", "10.180.0.2:8080"),
        endpoint_chain("ns/s2:http", "tcp", "10.180.0.3:8080"),
    }
    # The unchanged Service's chains are untouched but still referenced.
    svc1 = service_chains("ns/s1:http", "tcp")[0]
    assert svc1 not in text.replace(f"-j {svc1}", "")
    assert f"-j {svc1}" in fake.dump(V4, "nat")
    assert a.service not in {b_.service}
    assert b.rules_last["nat"] < b.rules_total["nat"]


def test_partial_sync_replaces_top_level_rules_without_flushing() -> None:
    # iptables-nft re-resolves every jump of a chain it flushes: at 10k Services a rewrite
    # of KUBE-SERVICES costs seconds, so a partial sync deletes and inserts rules instead.
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    name = world.add(cip(2))
    fake = FakeIptables()
    b = backend(fake)
    b.sync(world.snapshot(), full())
    world.add(cip(2, external_ips=(ip("5.5.5.5"),)), ep("10.180.0.2"))
    b.sync(world.snapshot(), changed(name))
    text = fake.restores[-1][1]
    assert not declared(text) & {"KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-SERVICE-IPS"}
    ops = sorted(
        line.split(" -m comment")[0] for line in text.splitlines() if line[:3] in ("-D ", "-I ")
    )
    assert ops == ["-D KUBE-SERVICES", "-I KUBE-SERVICES", "-I KUBE-SERVICES"]
    nat = fake.dump(V4, "nat").splitlines()
    services = [line for line in nat if line.startswith("-A KUBE-SERVICES ")]
    assert "NOTE: this must be the last rule" in services[-1]
    assert len(services) == 4
    world.remove(name)
    b.sync(world.snapshot(), changed(name))
    assert "-D KUBE-SERVICE-IPS -d 172.30.0.2 -j REJECT" in fake.restores[-1][1]
    assert "172.30.0.2" not in fake.dump(V4)
    sent = len(fake.restores)
    b.sync(world.snapshot(), changed(name))  # nothing changed: nothing sent
    assert len(fake.restores) == sent


def test_nft_cold_sync_in_chunks_of_complete_services() -> None:
    world = World()
    for n in range(1, 8):
        world.add(cip(n), ep(f"10.180.0.{n}"), ep(f"10.180.1.{n}"))
    # iptables-legacy: one restore is fastest (restore.COLD_SYNC_NOTE).
    chunked, whole = FakeIptables(), FakeIptables(IptablesVariant.LEGACY)
    backend(chunked, chains_per_restore=4).sync(world.snapshot(), full())
    backend(whole).sync(world.snapshot(), full())
    assert chunked.dump(V4) == whole.dump(V4)
    assert len(whole.restores) == 1
    # 3 chains per Service; a restore closes once it holds 4 or more: 2 Services each.
    assert len(chunked.restores) == 5
    for _family, text in chunked.restores[:-1]:
        chains = declared(text) - {"KUBE-MARK-MASQ"}
        assert len({c for c in chains if c.startswith("KUBE-SVC-")}) * 3 == len(chains)
        assert "KUBE-SERVICES" not in text


def test_stale_chains_are_deleted() -> None:
    world = World()
    name = world.add(cip(1), ep("10.180.0.1"), ep("10.180.0.2"))
    fake = FakeIptables()
    b = backend(fake)
    b.sync(world.snapshot(), full())
    gone = endpoint_chain("ns/s1:http", "tcp", "10.180.0.2:8080")
    assert gone in fake.chains(V4, "nat")
    world.add(cip(1), ep("10.180.0.1"))
    b.sync(world.snapshot(), changed(name))
    assert gone not in fake.chains(V4, "nat")
    world.remove(name)
    b.sync(world.snapshot(), changed(name))
    assert not [c for c in fake.chains(V4, "nat") if c.startswith(("KUBE-SVC", "KUBE-SEP"))]


def test_full_sync_deletes_leftovers_found_in_the_kernel() -> None:
    fake = FakeIptables()
    fake.restore(
        V4,
        "*nat\n:KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]\n:KUBE-SEP-BBBBBBBBBBBBBBBB - [0:0]\n"
        "-A KUBE-SVC-AAAAAAAAAAAAAAAA -j KUBE-SEP-BBBBBBBBBBBBBBBB\n:OTHER - [0:0]\nCOMMIT\n",
    )
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    backend(fake).sync(world.snapshot(), full())
    chains = fake.chains(V4, "nat")
    assert "KUBE-SVC-AAAAAAAAAAAAAAAA" not in chains
    assert "KUBE-SEP-BBBBBBBBBBBBBBBB" not in chains
    assert "OTHER" in chains


def test_restart_over_existing_rules_converges() -> None:
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    world.add(cip(2), ep("10.180.0.2"))
    fake = FakeIptables()
    backend(fake).sync(world.snapshot(), full())
    before = fake.dump(V4)
    world.remove(spn("s2"))
    backend(fake).sync(world.snapshot(), full())  # a new process: state from the kernel
    fresh = FakeIptables()
    backend(fresh).sync(world.snapshot(), full())
    assert fake.dump(V4) == fresh.dump(V4)
    assert fake.dump(V4) != before


# Failures ----------------------------------------------------------------------------------


def test_refused_restore_keeps_state_and_next_sync_is_full() -> None:
    world = World()
    name = world.add(cip(1), ep("10.180.0.1"))
    fake = FakeIptables()
    b = backend(fake)
    b.sync(world.snapshot(), full())
    before = fake.dump(V4)
    world.add(cip(1), ep("10.180.0.9"))
    fake.fail_next("refused")
    with pytest.raises(SyncError, match="refused"):
        b.sync(world.snapshot(), changed(name))
    assert fake.dump(V4) == before
    assert (b.restore_failures, b.partial_restore_failures) == (1, 1)
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert b.last_sync_full
    assert endpoint_chain("ns/s1:http", "tcp", "10.180.0.9:8080") in fake.chains(V4, "nat")
    fake.fail_next("again")
    with pytest.raises(SyncError):
        b.sync(world.snapshot(), full())
    assert (b.restore_failures, b.partial_restore_failures) == (2, 1)


def test_missing_canary_forces_a_full_sync() -> None:
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    fake = FakeIptables()
    clock = Clock()
    b = backend(fake, clock)
    b.sync(world.snapshot(), full())
    clock.now += CONFIG.sync_period
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert not b.last_sync_full
    fake.restore(V4, "*mangle\n:KUBE-PROXY-CANARY - [0:0]\n-X KUBE-PROXY-CANARY\nCOMMIT\n")
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert not b.last_sync_full  # looked for at most once per sync period, as upstream
    clock.now += CONFIG.sync_period
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert b.last_sync_full
    assert "KUBE-PROXY-CANARY" in fake.chains(V4, "mangle")
    # A flushed canary (the chain still there, its rule gone) counts as gone too.
    fake.restore(V4, "*mangle\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n")
    clock.now += CONFIG.sync_period
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert b.last_sync_full
    clock.now += CONFIG.sync_period
    b.sync(world.snapshot(), SyncChanges(full=False))
    assert not b.last_sync_full


@pytest.mark.parametrize(
    "bad",
    [
        cip(7, name=spn("s7", 'p"x')),
        cip(7, name=spn("bad name")),
        cip(7, port=70000),
        cip(7, node_port=-1),
        cip(7, cluster_ip=ip("fd00::1")),
        cip(
            7, load_balancer_source_ranges=(net("fd00::/64"),), load_balancer_vips=(ip("6.6.6.7"),)
        ),
        cip(7, session_affinity_seconds=10**9),
    ],
)
def test_bad_input_never_reaches_a_command(
    bad: ServicePort, caplog: pytest.LogCaptureFixture
) -> None:
    world = World()
    world.add(cip(1), ep("10.180.0.1"))
    world.add(bad, ep("10.180.7.7"), ep("fd00::7") if False else ep("10.180.7.8", port=99999))
    fake = FakeIptables()
    b = backend(fake)
    with caplog.at_level(logging.ERROR):
        b.sync(world.snapshot(), full())
        b.sync(world.snapshot(), changed(bad.name))
    text = "".join(t for _f, t in fake.restores)
    assert "172.30.0.7" not in text and "10.180.7." not in text and "6.6.6.7" not in text
    assert "172.30.0.1 " in text  # the good Service is there
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "skipping service port" in errors[0].getMessage()


def test_large_cluster_mode_drops_endpoint_comments() -> None:
    world = World()
    per = 100
    count = LARGE_CLUSTER_ENDPOINTS // per + 1
    for n in range(1, count + 1):
        world.add(cip(n), *(ep(f"10.{n}.0.{k}") for k in range(1, per + 1)))
    fake = FakeIptables()
    clock = Clock()
    b = backend(fake, clock)
    b.sync(world.snapshot(), full())
    assert b.large_cluster
    text = all_restores(fake)
    assert "KUBE-SEP-" in text
    assert " -> " not in text
    assert '"ns/s1:http cluster IP"' in text
    # Periodic full syncs scan for stale chains at most once per sync period.
    saves = 0
    real_chains = fake.chains

    def counting(family: IPFamily, table: str) -> set[str]:
        nonlocal saves
        if table == "nat":
            saves += 1
        return real_chains(family, table)

    fake.chains = counting  # type: ignore[method-assign]
    clock.now += 1
    b.sync(world.snapshot(), full())
    assert saves == 0
    clock.now += CONFIG.sync_period
    b.sync(world.snapshot(), full())
    assert saves == 1


def test_cleanup_family_removes_ours_only() -> None:
    fake = FakeIptables()
    fake.restore(
        V4,
        "*filter\n:KUBE-FIREWALL - [0:0]\n:FOREIGN - [0:0]\n-A INPUT -j KUBE-FIREWALL\n"
        "-A FOREIGN -j ACCEPT\nCOMMIT\n*mangle\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n",
    )
    fake.save(V4, "nat")  # a table once read shows up empty in dumps, as in the kernel
    before = fake.dump(V4)
    world = World(node_port_addresses=NodePortAddresses(match_all=True))
    world.add(cip(1, node_port=30001, session_affinity_seconds=5), ep("10.180.0.1"))
    b = backend(fake, config=ProxierConfig(node_name=NODE, localhost_node_ports=False))
    b.sync(world.snapshot(), full())
    assert fake.dump(V4) != before
    cleanup_family(fake, V4)
    assert fake.dump(V4) == before


# Property: incremental syncs converge to exactly what a fresh full sync writes ------------

_NAMES = [spn(f"s{i}") for i in range(1, 6)] + [spn("s1", "alt", proto=Protocol.UDP)]
_EPS = [f"10.180.{i}.{j}" for i in range(3) for j in range(1, 4)]
_TOP = (
    "-A KUBE-SERVICES ",
    "-A KUBE-NODEPORTS ",
    "-A KUBE-EXTERNAL-SERVICES ",
    "-A KUBE-PROXY-FIREWALL ",
    "-A KUBE-SERVICE-IPS ",
)


def normalised(dump: str) -> list[str]:
    """The dump with the per-port rules of top-level chains sorted (their order across
    Services is not meaningful, as in upstream, whose map order is random)."""
    out: list[str] = []
    block: list[str] = []
    for line in dump.splitlines():
        if line.startswith(_TOP):
            block.append(line)
            continue
        out.extend(sorted(block))
        block = []
        out.append(line)
    return out + sorted(block)


@st.composite
def service_ports(draw: st.DrawFn, name: ServicePortName) -> ServicePort:
    n = int(name.service.name[1:])
    return ServicePort(
        name,
        ip(f"172.30.0.{draw(st.sampled_from([n, n, 1]))}"),
        draw(st.sampled_from([80, 443])),
        name.protocol,
        node_port=draw(st.sampled_from([0, 30000 + n])),
        # Lists, not sets: a Service may repeat an external IP.
        external_ips=tuple(
            draw(st.lists(st.sampled_from([ip("5.5.5.5"), ip("5.5.5.6")]), max_size=3))
        ),
        load_balancer_vips=tuple(draw(st.sets(st.sampled_from([ip("6.6.6.6")]), max_size=1))),
        load_balancer_source_ranges=tuple(
            draw(
                st.sets(st.sampled_from([net("203.0.113.0/25"), net("192.168.0.0/16")]), max_size=2)
            )
        ),
        session_affinity_seconds=draw(st.sampled_from([0, 0, 10])),
        internal_policy_local=draw(st.booleans()),
        external_policy_local=draw(st.booleans()),
        health_check_node_port=draw(st.sampled_from([0, 31000 + n])),
    )


@st.composite
def endpoint_sets(draw: st.DrawFn) -> tuple[Endpoint, ...]:
    count = draw(st.sampled_from([0, 1, 2, 3]))
    addrs = draw(st.lists(st.sampled_from(_EPS), min_size=count, max_size=count, unique=True))
    return tuple(
        ep(
            a,
            draw(st.sampled_from([8080, 9090])),
            local=draw(st.booleans()),
            ready=draw(st.booleans()),
        )
        for a in addrs
    )


class IncrementalEqualsFull(WorldMachine):
    """Random changes applied incrementally end where a fresh full sync starts."""

    names = _NAMES

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeIptables()
        self.clock = Clock()
        # Localhost NodePorts off: once on, kubelet's KUBE-FIREWALL chain stays (see
        # test_localhost_node_ports_switched_on_later), which no fresh sync writes.
        self.backend = backend(self.fake, self.clock, NO_LOCALHOST, chains_per_restore=4)
        self.backend.sync(self.world.snapshot(), full())

    def draw_port(self, data: st.DataObject, name: ServicePortName) -> ServicePort:
        return data.draw(service_ports(name))

    def draw_endpoints(self, data: st.DataObject) -> tuple[Endpoint, ...]:
        return data.draw(endpoint_sets())

    @rule(detector=st.sampled_from([V4_DETECTOR, LocalDetector()]), match_all=st.booleans())
    def settings_change(self, detector: LocalDetector, match_all: bool) -> None:
        self.world.detector = detector
        self.world.node_port_addresses = (
            NodePortAddresses(match_all=True)
            if match_all
            else NodePortAddresses(addresses=(ip("192.168.0.2"),))
        )

    @rule(as_full=st.booleans())
    def sync(self, as_full: bool) -> None:
        self.clock.now += 1
        self.backend.sync(self.world.snapshot(), self.changes(as_full))
        self.pending.clear()

    @rule()
    def refused_sync(self) -> None:
        self.fake.fail_next("refused")
        before = self.fake.dump(V4)
        sent = len(self.fake.restores)
        try:
            self.backend.sync(self.world.snapshot(), self.changes())
        except SyncError:
            pass
        else:
            # Nothing changed, so nothing was sent; a full sync always writes.
            assert len(self.fake.restores) == sent
            self.pending.clear()
            with pytest.raises(SyncError):
                self.backend.sync(self.world.snapshot(), full())
        assert self.fake.dump(V4) == before

    @invariant()
    def converges(self) -> None:
        snapshot = self.world.snapshot()
        self.backend.sync(snapshot, self.changes())
        self.pending.clear()
        fresh = FakeIptables()
        backend(fresh, config=NO_LOCALHOST).sync(snapshot, full())
        got, want = normalised(self.fake.dump(V4)), normalised(fresh.dump(V4))
        assert got == want, "\n".join(difflib.unified_diff(want, got, lineterm=""))
        nat = [
            line
            for line in self.fake.dump(V4, "nat").splitlines()
            if line.startswith("-A KUBE-SERVICES ")
        ]
        assert "NOTE: this must be the last rule" in nat[-1]
        assert self.backend.rules_total == fresh_backend_totals(snapshot)


def fresh_backend_totals(snapshot: ProxySnapshot) -> dict[str, int]:
    b = backend(FakeIptables(), config=NO_LOCALHOST)
    b.sync(snapshot, full())
    return b.rules_total


IncrementalEqualsFull.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIncrementalEqualsFull = IncrementalEqualsFull.TestCase


def test_create_backend_refuses_a_missing_namespace() -> None:
    from kubeproxy.backends.iptables import create_backend
    from kubeproxy.backends.iptables.exec import IptablesError

    with pytest.raises(IptablesError):
        create_backend(V4, CONFIG, netns="kpxib-does-not-exist")


def test_bad_detector_interface_is_ignored_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    world = World(detector=LocalDetector(LocalDetectMode.BRIDGE_INTERFACE, interface="br0 -j X"))
    world.add(cip(1), ep("10.180.0.1"))
    fake = FakeIptables()
    b = backend(fake)
    with caplog.at_level(logging.ERROR):
        b.sync(world.snapshot(), full())
        b.sync(world.snapshot(), SyncChanges(full=False))
        b.sync(world.snapshot(), full())
    assert "br0" not in all_restores(fake)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        "ignoring the local-traffic detector: local detector interface 'br0 -j X' is not valid"
    ]
