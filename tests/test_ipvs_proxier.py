"""IPVSBackend on the fakes: what a sync creates, graceful termination, scheduler and
persistence, exclude CIDRs, failures, cleanup, and incremental == full (hypothesis)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from kubeproxy.backend import NodePortAddresses, SyncChanges, SyncError
from kubeproxy.backends.iptables.exec import IptablesError
from kubeproxy.backends.iptables.fake import FakeIptables
from kubeproxy.backends.ipvs import IPVSBackend
from kubeproxy.backends.ipvs.fake import FakeIPSets, FakeIPVS, FakeLinks
from kubeproxy.backends.ipvs.netlink import DUMMY_DEVICE, RealServer, VirtualServer
from kubeproxy.backends.ipvs.rules import CHAINS
from kubeproxy.backends.ipvs.sysctls import FileSysctlApplier, ipvs_sysctls
from kubeproxy.config import IPVSSettings, LocalDetectMode, LocalDetector, ProxierConfig
from kubeproxy.objects import (
    Endpoint,
    IPAddress,
    IPFamily,
    IPNetwork,
    Protocol,
    ServicePort,
    ServicePortName,
)
from tests import snapshots
from tests.snapshots import NODE, WorldMachine, changed, ep, full, ip, net, spn

NODE_IP = ip("192.168.0.2")
CONFIG = ProxierConfig(node_name=NODE)
V4 = IPFamily.IPV4


@dataclass
class World(snapshots.World):
    """The node with one address per family, no local detector, no service CIDRs."""

    detector: LocalDetector = field(default_factory=LocalDetector)
    service_cidrs: tuple[IPNetwork, ...] = ()
    node_addresses: Mapping[IPFamily, tuple[IPAddress, ...]] = field(
        default_factory=lambda: {V4: (NODE_IP,), IPFamily.IPV6: (ip("2001:db8::2"),)}
    )


@dataclass
class Kit:
    ipvs: FakeIPVS = field(default_factory=FakeIPVS)
    links: FakeLinks = field(default_factory=FakeLinks)
    ipsets: FakeIPSets = field(default_factory=FakeIPSets)
    iptables: FakeIptables = field(default_factory=FakeIptables)

    def backend(self, config: ProxierConfig = CONFIG, family: IPFamily = V4) -> IPVSBackend:
        return IPVSBackend(
            family,
            config,
            ipvs=self.ipvs,
            links=self.links,
            ipsets=self.ipsets,
            iptables=self.iptables,
        )

    def state(self, family: IPFamily = V4) -> tuple[str, list[str], str, str]:
        """Everything the backend owns, as text (IPVS, addresses, ipsets, iptables)."""
        addresses = sorted(str(a) for a in self.links.links.get(DUMMY_DEVICE, set()))
        ours = {chain for _, chain in CHAINS}
        rules = [
            line
            for table in ("filter", "nat")
            for line in self.iptables.dump(family, table).splitlines()
            if any(chain in line for chain in ours)
        ]
        return self.ipvs.dump(), addresses, self.ipsets.dump(), "\n".join(rules)


def cluster_ip(name: str, vip: str, port: int = 80, **kw: object) -> ServicePort:
    spname = spn(name, proto=kw.pop("proto", Protocol.TCP))  # type: ignore[arg-type]
    return ServicePort(spname, ip(vip), port, spname.protocol, **kw)  # type: ignore[arg-type]


def members(kit: Kit, name: str) -> set[str]:
    return kit.ipsets.members(name)


def test_sync_creates_exactly_the_expected_servers_addresses_and_members() -> None:
    world, kit = World(), Kit()
    world.add(cluster_ip("web", "172.30.0.10"), ep("10.180.0.2", local=True), ep("10.180.1.3"))
    world.add(
        cluster_ip("np", "172.30.0.11", 53, node_port=30053, proto=Protocol.UDP),
        ep("10.180.0.4", 5353),
    )
    backend = kit.backend()
    backend.sync(world.snapshot(), full())

    assert kit.ipvs.dump() == "\n".join(
        [
            "172.30.0.10:80/TCP rr flags=0x0 timeout=0",
            "  -> 10.180.0.2:8080 weight=1",
            "  -> 10.180.1.3:8080 weight=1",
            "172.30.0.11:53/UDP rr flags=0x0 timeout=0",
            "  -> 10.180.0.4:5353 weight=1",
            "192.168.0.2:30053/UDP rr flags=0x0 timeout=0",
            "  -> 10.180.0.4:5353 weight=1",
        ]
    )
    assert kit.links.links == {DUMMY_DEVICE: {ip("172.30.0.10"), ip("172.30.0.11")}}
    assert members(kit, "KUBE-CLUSTER-IP") == {"172.30.0.10,tcp:80", "172.30.0.11,udp:53"}
    assert members(kit, "KUBE-IPVS-IPS") == {"172.30.0.10", "172.30.0.11"}
    assert members(kit, "KUBE-NODE-PORT-UDP") == {"30053"}
    assert members(kit, "KUBE-NODE-PORT-TCP") == set()
    assert members(kit, "KUBE-LOOP-BACK") == {"10.180.0.2,tcp:8080,10.180.0.2"}
    assert len(kit.ipsets.sets) == 17
    nat = kit.iptables.dump(V4, "nat")
    assert '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES' in (
        nat
    )
    assert "--match-set KUBE-NODE-PORT-UDP dst -j KUBE-MARK-MASQ" in nat
    assert "--match-set KUBE-LOOP-BACK dst,dst,src -j MASQUERADE" in nat
    # No TCP NodePort: upstream writes a set's jump only when the set has members.
    assert "KUBE-NODE-PORT-TCP" not in nat
    # Virtual servers in address order, each followed by its real servers.
    assert kit.ipvs.operations == [
        "add vs 172.30.0.10:80/TCP rr flags=0x0 timeout=0",
        "add rs 172.30.0.10:80/TCP -> 10.180.0.2:8080 weight=1",
        "add rs 172.30.0.10:80/TCP -> 10.180.1.3:8080 weight=1",
        "add vs 172.30.0.11:53/UDP rr flags=0x0 timeout=0",
        "add rs 172.30.0.11:53/UDP -> 10.180.0.4:5353 weight=1",
        "add vs 192.168.0.2:30053/UDP rr flags=0x0 timeout=0",
        "add rs 192.168.0.2:30053/UDP -> 10.180.0.4:5353 weight=1",
    ]


def test_no_change_sends_nothing_and_one_changed_endpoint_touches_one_server() -> None:
    world, kit = World(), Kit()
    a = world.add(cluster_ip("a", "172.30.0.1"), ep("10.180.0.1"))
    world.add(cluster_ip("b", "172.30.0.2"), ep("10.180.0.2"))
    backend = kit.backend()
    backend.sync(world.snapshot(), full())
    kit.ipvs.clear_operations()
    restores = len(kit.iptables.restores)
    backend.sync(world.snapshot(), SyncChanges(full=False))
    assert kit.ipvs.operations == []
    assert len(kit.iptables.restores) == restores  # same rules: no restore

    world.add(world.services[a], ep("10.180.0.1"), ep("10.180.0.9"))
    backend.sync(world.snapshot(), changed(a))
    assert kit.ipvs.operations == ["add rs 172.30.0.1:80/TCP -> 10.180.0.9:8080 weight=1"]


def test_removed_endpoint_with_connections_goes_to_weight_0_then_is_deleted() -> None:
    world, kit = World(), Kit()
    name = world.add(cluster_ip("web", "172.30.0.10"), ep("10.180.0.2"), ep("10.180.0.3"))
    backend = kit.backend()
    backend.sync(world.snapshot(), full())
    vs = VirtualServer(ip("172.30.0.10"), Protocol.TCP, 80)
    kit.ipvs.set_connections(vs, ip("10.180.0.3"), 8080, active=2, inactive=1)

    world.add(world.services[name], ep("10.180.0.2"))
    kit.ipvs.clear_operations()
    backend.sync(world.snapshot(), changed(name))
    assert kit.ipvs.operations == ["update rs 172.30.0.10:80/TCP -> 10.180.0.3:8080 weight=0"]
    assert kit.ipvs.dests[vs.key][(ip("10.180.0.3"), 8080)].weight == 0
    assert backend.terminating == {(vs.key, (ip("10.180.0.3"), 8080))}

    # Still connected: a later sync leaves it draining.
    kit.ipvs.clear_operations()
    backend.sync(world.snapshot(), SyncChanges(full=False))
    assert kit.ipvs.operations == []
    kit.ipvs.set_connections(vs, ip("10.180.0.3"), 8080, active=0, inactive=0)
    backend.sync(world.snapshot(), SyncChanges(full=False))
    assert kit.ipvs.operations == ["del rs 172.30.0.10:80/TCP -> 10.180.0.3:8080"]
    assert backend.terminating == set()
    assert set(kit.ipvs.dests[vs.key]) == {(ip("10.180.0.2"), 8080)}


def test_idle_tcp_and_any_udp_endpoint_are_deleted_at_once() -> None:
    world, kit = World(), Kit()
    tcp = world.add(cluster_ip("t", "172.30.0.1"), ep("10.180.0.1"), ep("10.180.0.2"))
    udp = world.add(
        cluster_ip("u", "172.30.0.2", 53, proto=Protocol.UDP), ep("10.180.0.1"), ep("10.180.0.2")
    )
    backend = kit.backend()
    backend.sync(world.snapshot(), full())
    udp_vs = VirtualServer(ip("172.30.0.2"), Protocol.UDP, 53)
    kit.ipvs.set_connections(udp_vs, ip("10.180.0.2"), 8080, active=0, inactive=5)
    world.add(world.services[tcp], ep("10.180.0.1"))
    world.add(world.services[udp], ep("10.180.0.1"))
    kit.ipvs.clear_operations()
    backend.sync(world.snapshot(), changed(tcp, udp))
    assert sorted(kit.ipvs.operations) == [
        "del rs 172.30.0.1:80/TCP -> 10.180.0.2:8080",
        "del rs 172.30.0.2:53/UDP -> 10.180.0.2:8080",
    ]


def test_endpoint_back_while_draining_gets_its_weight_back() -> None:
    world, kit = World(), Kit()
    name = world.add(cluster_ip("web", "172.30.0.10"), ep("10.180.0.2"), ep("10.180.0.3"))
    backend = kit.backend()
    backend.sync(world.snapshot(), full())
    vs = VirtualServer(ip("172.30.0.10"), Protocol.TCP, 80)
    kit.ipvs.set_connections(vs, ip("10.180.0.3"), 8080, active=1, inactive=0)
    port = world.services[name]
    world.add(port, ep("10.180.0.2"))
    backend.sync(world.snapshot(), changed(name))
    world.add(port, ep("10.180.0.2"), ep("10.180.0.3"))
    kit.ipvs.clear_operations()
    backend.sync(world.snapshot(), changed(name))
    assert kit.ipvs.operations == ["update rs 172.30.0.10:80/TCP -> 10.180.0.3:8080 weight=1"]
    assert backend.terminating == set()
    assert kit.ipvs.dests[vs.key][(ip("10.180.0.3"), 8080)].active_connections == 1


def test_scheduler_persistence_and_source_hash_flag() -> None:
    world, kit = World(), Kit()
    config = ProxierConfig(node_name=NODE, ipvs=IPVSSettings(scheduler="mh"))
    name = world.add(cluster_ip("web", "172.30.0.10", session_affinity_seconds=300), ep("10.1.0.1"))
    backend = kit.backend(config)
    backend.sync(world.snapshot(), full())
    vs = kit.ipvs.services[(ip("172.30.0.10"), Protocol.TCP, 80)]
    assert (vs.scheduler, vs.flags, vs.timeout) == ("mh", 0x11, 300)

    world.add(cluster_ip("web", "172.30.0.10"), ep("10.1.0.1"))
    kit.ipvs.clear_operations()
    backend.sync(world.snapshot(), changed(name))
    assert kit.ipvs.operations == ["update vs 172.30.0.10:80/TCP mh flags=0x10 timeout=0"]


def test_bad_scheduler_name_is_refused_and_unknown_one_fails_the_sync() -> None:
    with pytest.raises(ValueError, match="scheduler"):
        Kit().backend(ProxierConfig(node_name=NODE, ipvs=IPVSSettings(scheduler="r r")))
    world, kit = World(), Kit()
    world.add(cluster_ip("web", "172.30.0.10"), ep("10.1.0.1"))
    backend = kit.backend(ProxierConfig(node_name=NODE, ipvs=IPVSSettings(scheduler="nosuch")))
    with pytest.raises(SyncError, match="unknown scheduler"):
        backend.sync(world.snapshot(), full())


def test_a_local_policy_without_local_endpoints_falls_back_as_upstream() -> None:
    # Upstream's syncEndpoint (kubernetes/kubernetes#97081): with no local endpoint an
    # externally Local Service's servers get the cluster's endpoints, so pods still reach
    # it; an internally Local ClusterIP Service has no cluster endpoints to fall back to.
    world, kit = World(), Kit()
    world.add(
        cluster_ip("ext", "172.30.0.10", node_port=30080, external_policy_local=True),
        ep("10.180.1.3"),
    )
    world.add(cluster_ip("int", "172.30.0.11", internal_policy_local=True), ep("10.180.1.4"))
    kit.backend().sync(world.snapshot(), full())
    reals = {
        str(VirtualServer(*key)): sorted(str(rs) for rs in dests.values())
        for key, dests in kit.ipvs.dests.items()
    }
    assert reals == {
        "172.30.0.10:80/TCP": ["10.180.1.3:8080"],
        "192.168.0.2:30080/TCP": ["10.180.1.3:8080"],
        "172.30.0.11:80/TCP": [],
    }


def test_external_policy_local_uses_local_endpoints_for_external_servers_only() -> None:
    world, kit = World(), Kit()
    world.add(
        cluster_ip(
            "lb",
            "172.30.0.10",
            node_port=30080,
            load_balancer_vips=(ip("198.51.100.7"),),
            external_ips=(ip("203.0.113.5"),),
            external_policy_local=True,
            health_check_node_port=31000,
        ),
        ep("10.180.0.2", local=True),
        ep("10.180.1.3"),
    )
    kit.backend().sync(world.snapshot(), full())
    reals = {
        str(VirtualServer(*key)): sorted(str(rs) for rs in dests.values())
        for key, dests in kit.ipvs.dests.items()
    }
    assert reals == {
        "172.30.0.10:80/TCP": ["10.180.0.2:8080", "10.180.1.3:8080"],
        "203.0.113.5:80/TCP": ["10.180.0.2:8080"],
        "198.51.100.7:80/TCP": ["10.180.0.2:8080"],
        "192.168.0.2:30080/TCP": ["10.180.0.2:8080"],
    }
    assert members(kit, "KUBE-EXTERNAL-IP-LOCAL") == {"203.0.113.5,tcp:80"}
    assert members(kit, "KUBE-EXTERNAL-IP") == set()
    assert members(kit, "KUBE-LOAD-BALANCER-LOCAL") == {"198.51.100.7,tcp:80"}
    assert members(kit, "KUBE-NODE-PORT-LOCAL-TCP") == {"30080"}
    assert members(kit, "KUBE-HEALTH-CHECK-NODE-PORT") == {"31000"}
    # The node IP is the node's: never bound to kube-ipvs0.
    assert kit.links.links[DUMMY_DEVICE] == {
        ip("172.30.0.10"),
        ip("198.51.100.7"),
        ip("203.0.113.5"),
    }


def test_source_ranges_let_the_node_in_only_when_they_cover_it() -> None:
    world, kit = World(), Kit()
    world.add(
        cluster_ip(
            "a",
            "172.30.0.1",
            load_balancer_vips=(ip("198.51.100.1"),),
            load_balancer_source_ranges=(net("192.168.0.0/24"),),
        ),
        ep("10.1.0.1"),
    )
    world.add(
        cluster_ip(
            "b",
            "172.30.0.2",
            load_balancer_vips=(ip("198.51.100.2"),),
            load_balancer_source_ranges=(net("203.0.113.0/24"), net("10.0.0.1/32")),
        ),
        ep("10.1.0.1"),
    )
    kit.backend().sync(world.snapshot(), full())
    assert members(kit, "KUBE-LOAD-BALANCER-FW") == {"198.51.100.1,tcp:80", "198.51.100.2,tcp:80"}
    assert members(kit, "KUBE-LOAD-BALANCER-SOURCE-CIDR") == {
        "198.51.100.1,tcp:80,192.168.0.0/24",
        "198.51.100.2,tcp:80,203.0.113.0/24",
        "198.51.100.2,tcp:80,10.0.0.1",
    }
    assert members(kit, "KUBE-LOAD-BALANCER-SOURCE-IP") == {"198.51.100.1,tcp:80,198.51.100.1"}
    out = [line for line in kit.iptables.dump(V4, "filter").splitlines() if "OUT-FILTER -s" in line]
    assert out == [
        "-A KUBE-IPVS-OUT-FILTER -s 198.51.100.2/32 -m ipvs --vaddr 198.51.100.2 "
        "--vproto tcp --vport 80 -j DROP"
    ]


def test_local_detector_and_masquerade_all_choose_the_cluster_ip_rule() -> None:
    def cluster_rule(config: ProxierConfig, detector: LocalDetector | None = None) -> str:
        world, kit = World(), Kit()
        if detector is not None:  # the snapshot's, as the core resolves it (NodeCIDR)
            world.detector = detector
        world.add(cluster_ip("web", "172.30.0.10"), ep("10.1.0.1"))
        kit.backend(config).sync(world.snapshot(), full())
        [line] = [
            x
            for x in kit.iptables.dump(V4, "nat").splitlines()
            if "KUBE-CLUSTER-IP" in x and "KUBE-MARK-MASQ" in x
        ]
        return line

    assert "KUBE-CLUSTER-IP src,dst -j" in cluster_rule(CONFIG)
    detector = LocalDetector(LocalDetectMode.CLUSTER_CIDR, (net("10.0.0.0/8"),))
    assert "! -s 10.0.0.0/8" in cluster_rule(CONFIG, detector)
    # NodeCIDR: the configuration holds no CIDR, the snapshot holds the node's pod CIDR
    # (this was read from the configuration, so NodeCIDR never masqueraded).
    node_cidr = ProxierConfig(
        node_name=NODE, local_detector=LocalDetector(LocalDetectMode.NODE_CIDR)
    )
    resolved = LocalDetector(LocalDetectMode.NODE_CIDR, (net("10.0.1.0/24"),))
    assert "! -s 10.0.1.0/24" in cluster_rule(node_cidr, resolved)
    line = cluster_rule(ProxierConfig(node_name=NODE, masquerade_all=True))
    assert "KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ" in line and "! -s" not in line


def test_removed_service_is_deleted_unbound_and_leaves_the_sets() -> None:
    world, kit = World(), Kit()
    gone = world.add(cluster_ip("gone", "172.30.0.9", node_port=30009), ep("10.1.0.1"))
    world.add(cluster_ip("stays", "172.30.0.10"), ep("10.1.0.2"))
    backend = kit.backend()
    backend.sync(world.snapshot(), full())
    world.remove(gone)
    backend.sync(world.snapshot(), changed(gone))
    assert set(kit.ipvs.services) == {(ip("172.30.0.10"), Protocol.TCP, 80)}
    assert kit.links.links[DUMMY_DEVICE] == {ip("172.30.0.10")}
    assert members(kit, "KUBE-CLUSTER-IP") == {"172.30.0.10,tcp:80"}
    assert members(kit, "KUBE-NODE-PORT-TCP") == set()
    assert members(kit, "KUBE-IPVS-IPS") == {"172.30.0.10"}
    assert "KUBE-NODE-PORT-TCP" not in kit.iptables.dump(V4, "nat")


def test_exclude_cidrs_protect_foreign_virtual_servers_and_addresses() -> None:
    world, kit = World(), Kit()
    mine = VirtualServer(ip("10.250.0.1"), Protocol.TCP, 443)
    foreign = VirtualServer(ip("10.99.0.1"), Protocol.TCP, 80)
    other_family = VirtualServer(ip("fd00::1"), Protocol.TCP, 80)
    for vs in (mine, foreign, other_family):
        kit.ipvs.add_virtual_server(vs)
    kit.ipvs.add_real_server(mine, RealServer(ip("10.250.0.5"), 443))
    kit.links.ensure_link(DUMMY_DEVICE)
    kit.links.add_address(DUMMY_DEVICE, ip("10.250.0.1"))
    kit.links.add_address(DUMMY_DEVICE, ip("10.99.0.1"))
    world.add(cluster_ip("web", "172.30.0.10"), ep("10.1.0.1"))
    config = ProxierConfig(node_name=NODE, ipvs=IPVSSettings(exclude_cidrs=(net("10.250.0.0/16"),)))
    backend = kit.backend(config)
    backend.sync(world.snapshot(), full())
    assert set(kit.ipvs.services) == {mine.key, other_family.key, (ip("172.30.0.10"), "TCP", 80)}
    assert len(kit.ipvs.dests[mine.key]) == 1
    assert kit.links.links[DUMMY_DEVICE] == {ip("10.250.0.1"), ip("172.30.0.10")}
    backend.cleanup()
    assert set(kit.ipvs.services) == {mine.key, other_family.key}


def test_refused_ipvs_change_keeps_previous_state_and_forces_a_full_sync() -> None:
    world, kit = World(), Kit()
    old = world.add(cluster_ip("old", "172.30.0.1"), ep("10.1.0.1"))
    backend = kit.backend()
    backend.sync(world.snapshot(), full())
    before = kit.state()
    world.remove(old)
    new = world.add(cluster_ip("new", "172.30.0.2"), ep("10.1.0.2"))
    kit.ipvs.fail_next("add vs 172.30.0.2")
    with pytest.raises(SyncError, match="injected"):
        backend.sync(world.snapshot(), changed(old, new))
    assert backend.sync_failures == 1
    # Nothing of the old Service was removed before the failure.
    assert kit.ipvs.dump() == before[0]
    assert "172.30.0.1" in before[1] and ip("172.30.0.1") in kit.links.links[DUMMY_DEVICE]
    assert "172.30.0.1,tcp:80" in members(kit, "KUBE-CLUSTER-IP")
    backend.sync(world.snapshot(), SyncChanges(full=False))
    assert backend.last_sync_full
    assert set(kit.ipvs.services) == {(ip("172.30.0.2"), Protocol.TCP, 80)}
    assert kit.links.links[DUMMY_DEVICE] == {ip("172.30.0.2")}


def test_refused_iptables_restore_keeps_rules_and_servers() -> None:
    world, kit = World(), Kit()
    old = world.add(cluster_ip("old", "172.30.0.1", node_port=30001), ep("10.1.0.1"))
    backend = kit.backend()
    backend.sync(world.snapshot(), full())
    rules = kit.iptables.dump(V4)
    world.remove(old)
    kit.iptables.fail_next()
    with pytest.raises(SyncError):
        backend.sync(world.snapshot(), changed(old))
    assert kit.iptables.dump(V4) == rules
    assert (ip("172.30.0.1"), Protocol.TCP, 80) in kit.ipvs.services


def test_bad_port_is_skipped_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    world, kit = World(), Kit()
    world.add(cluster_ip("bad", "172.30.0.1", session_affinity_seconds=100000), ep("10.1.0.1"))
    world.add(cluster_ip("good", "172.30.0.2"), ep("10.1.0.2"))
    with caplog.at_level(logging.WARNING):
        kit.backend().sync(world.snapshot(), full())
    assert set(kit.ipvs.services) == {(ip("172.30.0.2"), Protocol.TCP, 80)}
    assert [r.getMessage() for r in caplog.records if "ns/bad" in r.getMessage()] == [
        "Skipping service port ns/bad:http: session affinity timeout 100000s out of range"
    ]


def test_ipv6_uses_upstreams_set_names() -> None:
    world, kit = World(family=IPFamily.IPV6), Kit()
    world.node_port_addresses = NodePortAddresses(match_all=True)
    world.add(cluster_ip("web", "fd00:30::10", node_port=30080), ep("fd00:180::2"))
    kit.backend(family=IPFamily.IPV6).sync(world.snapshot(), full())
    assert "KUBE-6-LOAD-BALANCER-SOURCE-CID" in kit.ipsets.sets
    assert members(kit, "KUBE-6-CLUSTER-IP") == {"fd00:30::10,tcp:80"}
    assert members(kit, "KUBE-6-NODE-PORT-TCP") == {"30080"}
    assert set(kit.ipvs.services) == {
        (ip("fd00:30::10"), Protocol.TCP, 80),
        (ip("2001:db8::2"), Protocol.TCP, 30080),
    }
    assert "-s ::1/128 -j RETURN" in kit.iptables.dump(IPFamily.IPV6, "nat")


def test_full_sync_applies_sysctls_and_timeouts(tmp_path: Path) -> None:
    for name in ipvs_sysctls(IPVSSettings(strict_arp=True), V4):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("0\n")
    world, kit = World(), Kit()
    settings_ = IPVSSettings(strict_arp=True, tcp_timeout=900, udp_timeout=30)
    backend = IPVSBackend(
        V4,
        ProxierConfig(node_name=NODE, ipvs=settings_),
        ipvs=kit.ipvs,
        links=kit.links,
        ipsets=kit.ipsets,
        iptables=kit.iptables,
        sysctls=FileSysctlApplier(proc_root=tmp_path),
    )
    backend.sync(world.snapshot(), full())
    assert (tmp_path / "net/ipv4/vs/conntrack").read_text() == "1\n"
    assert (tmp_path / "net/ipv4/vs/expire_nodest_conn").read_text() == "1\n"
    assert (tmp_path / "net/ipv4/conf/all/arp_ignore").read_text() == "1\n"
    assert (tmp_path / "net/ipv4/conf/all/arp_announce").read_text() == "2\n"
    assert (tmp_path / "net/ipv4/ip_forward").read_text() == "1\n"
    assert kit.ipvs.timeouts == (900, 0, 30)
    assert "net/ipv4/conf/all/arp_ignore" not in ipvs_sysctls(IPVSSettings(), V4)


def test_cleanup_removes_ours_and_leaves_foreign_chains_and_sets() -> None:
    world, kit = World(), Kit()
    world.add(cluster_ip("web", "172.30.0.10", node_port=30080), ep("10.1.0.1"))
    kit.iptables.restore(V4, "*filter\n:FOREIGN - [0:0]\n-A INPUT -j FOREIGN\nCOMMIT\n")
    from kubeproxy.backends.ipvs.ipset import IPSetRestore, SetName, set_specs

    batch = IPSetRestore()
    spec = set_specs(V4)[SetName.CLUSTER_IP]
    batch.lines.append(spec.create_line().replace("KUBE-CLUSTER-IP", "FOREIGN-SET"))
    kit.ipsets.restore(batch)
    backend = kit.backend()
    backend.sync(world.snapshot(), full())
    backend.cleanup()
    assert kit.ipvs.services == {}
    assert kit.links.links == {}
    assert set(kit.ipsets.sets) == {"FOREIGN-SET"}
    dump = kit.iptables.dump(V4)
    assert "KUBE-" not in dump
    assert "-A INPUT -j FOREIGN" in dump


# Property: incremental syncs reach exactly the state a fresh full sync writes --------------

_NAMES = [spn(f"s{i}") for i in range(5)] + [spn("s0", "dns", proto=Protocol.UDP)]
_EPS = [f"10.180.{i}.{j}" for i in range(2) for j in range(1, 4)]


@st.composite
def service_ports(draw: st.DrawFn, name: ServicePortName) -> ServicePort:
    n = int(name.service.name[1:])
    return ServicePort(
        name,
        ip(f"172.30.0.{draw(st.sampled_from([n, n, 1]))}"),
        draw(st.sampled_from([80, 443])),
        name.protocol,
        node_port=draw(st.sampled_from([0, 30000 + n])),
        external_ips=tuple(draw(st.sets(st.sampled_from([ip("5.5.5.5"), ip("5.5.5.6")]))))
        if draw(st.booleans())
        else (),
        load_balancer_vips=tuple(draw(st.sets(st.sampled_from([ip("6.6.6.6")]), max_size=1))),
        load_balancer_source_ranges=tuple(
            draw(st.sets(st.sampled_from([net("203.0.113.0/25"), net("192.168.0.0/16")])))
        ),
        session_affinity_seconds=draw(st.sampled_from([0, 10])),
        internal_policy_local=draw(st.booleans()),
        external_policy_local=draw(st.booleans()),
    )


@st.composite
def endpoint_sets(draw: st.DrawFn) -> tuple[Endpoint, ...]:
    addrs = draw(st.lists(st.sampled_from(_EPS), max_size=3, unique=True))
    return tuple(
        ep(a, draw(st.sampled_from([8080, 9090])), local=draw(st.booleans())) for a in addrs
    )


class IncrementalEqualsFull(WorldMachine):
    names = _NAMES

    def __init__(self) -> None:
        super().__init__()
        self.kit = Kit()
        self.backend = self.kit.backend()
        self.backend.sync(self.world.snapshot(), full())

    def new_world(self) -> World:
        return World()

    def draw_port(self, data: st.DataObject, name: ServicePortName) -> ServicePort:
        return data.draw(service_ports(name))

    def draw_endpoints(self, data: st.DataObject) -> tuple[Endpoint, ...]:
        return data.draw(endpoint_sets())

    @rule(match_all=st.booleans())
    def node_ports_change(self, match_all: bool) -> None:
        self.world.node_port_addresses = (
            NodePortAddresses(match_all=True)
            if match_all
            else NodePortAddresses(addresses=(NODE_IP,))
        )

    @rule()
    def sync(self) -> None:
        self.backend.sync(self.world.snapshot(), self.changes())
        self.pending.clear()

    @rule()
    def refused_sync(self) -> None:
        self.kit.ipvs.fail_next("add")
        try:
            self.backend.sync(self.world.snapshot(), self.changes())
            self.pending.clear()
        except SyncError:
            pass  # the next sync is a full one
        self.kit.ipvs._failures = type(self.kit.ipvs._failures)()

    @invariant()
    def matches_a_fresh_full_sync(self) -> None:
        if self.pending or self.backend._need_full:
            return
        fresh = Kit()
        fresh.backend().sync(self.world.snapshot(), full())
        assert self.kit.state() == fresh.state()


TestIncrementalEqualsFull = IncrementalEqualsFull.TestCase
TestIncrementalEqualsFull.settings = settings(
    max_examples=60,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_cleanup_keeps_going_past_a_chain_still_referenced_elsewhere() -> None:
    world, kit = World(), Kit()
    world.add(cluster_ip("web", "172.30.0.10"), ep("10.1.0.1"))
    backend = kit.backend()
    backend.sync(world.snapshot(), full())
    # Say iptables mode's leftovers: a service chain marking for masquerade.
    kit.iptables.restore(V4, "*nat\n:KUBE-SVC-X - [0:0]\n-A KUBE-SVC-X -j KUBE-MARK-MASQ\nCOMMIT\n")
    with pytest.raises(IptablesError):
        backend.cleanup()
    chains = kit.iptables.chains(V4, "nat") | kit.iptables.chains(V4, "filter")
    assert {c for c in chains if c.startswith("KUBE-")} == {"KUBE-MARK-MASQ", "KUBE-SVC-X"}
    assert kit.ipvs.services == {}


class CountingIptables(FakeIptables):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def delete_rule(self, *args: object, **kwargs: object) -> bool:
        self.calls.append("delete_rule")
        return super().delete_rule(*args, **kwargs)  # type: ignore[arg-type]

    def restore(self, *args: object, **kwargs: object) -> None:
        self.calls.append("restore")
        super().restore(*args, **kwargs)  # type: ignore[arg-type]


def test_cleanup_where_ipvs_mode_never_ran_runs_no_iptables_command() -> None:
    iptables = CountingIptables()
    Kit(iptables=iptables).backend().cleanup()
    assert iptables.calls == []
