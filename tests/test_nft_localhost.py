"""Localhost NodePorts in nftables mode, in memory: what is served, what is rejected.

What the userspace proxy serves (:func:`~kubeproxy.localnodeports.nodeport_targets`, the
rules of upstream's ``localnodeportproxy`` and KEP-6032), when ``nodePortAddresses`` asks
for it (``ContainsExplicitLoopback``), the reject rules and their element changes over the
in-memory nftables (incremental syncs end where a full sync starts), the wrapper around
the nftables backend (its objects kept, the gate off removing them), the metrics, and the
daemon closing the proxy when it stops. The packets are in
``flowcases/nftables/localhost-nodeports.yaml`` and ``test_loopbackproxy.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from prometheus_client import CollectorRegistry

from kubeproxy.backend import SyncChanges
from kubeproxy.backends.nftables import create_backend
from kubeproxy.backends.nftables.backend import STALE_DELAY, NftablesBackend
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.localhost import (
    CHAIN,
    OBJECT_NAMES,
    LocalhostNodePortMetrics,
    LocalhostNodePortsBackend,
    LocalhostRejects,
    report_metrics,
    set_name,
)
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.cmd.modes import nftables_hooks
from kubeproxy.config import ProxierConfig
from kubeproxy.featuregates import resolve
from kubeproxy.localnodeports import (
    NodePortTarget,
    explicit_loopback,
    nodeport_targets,
    targets_of_services,
)
from kubeproxy.metrics import ProxyMetrics, expose
from kubeproxy.objects import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName
from tests.snapshots import Clock, World, WorldMachine, changed, ep, full, ip, spn

GATE_ON = resolve({"KubeProxyNFTablesLocalhostNodePorts": True})


def port(
    name: ServicePortName,
    node_port: int = 30001,
    *,
    etp_local: bool = False,
    itp_local: bool = False,
    affinity: int = 0,
) -> ServicePort:
    return ServicePort(
        name,
        ip("172.30.0.1"),
        80,
        name.protocol,
        node_port=node_port,
        session_affinity_seconds=affinity,
        internal_policy_local=itp_local,
        external_policy_local=etp_local,
    )


LOCAL, REMOTE = ep("10.180.0.1", 80, local=True), ep("10.180.1.1", 80)


# --- what the proxy serves ----------------------------------------------------------------


def test_cluster_endpoints_for_a_plain_nodeport() -> None:
    world = World()
    name = world.add(port(spn("web")), LOCAL, REMOTE)
    assert nodeport_targets(world.snapshot()) == {
        name: NodePortTarget(name, 30001, (("10.180.0.1", 80), ("10.180.1.1", 80)))
    }


def test_etp_local_serves_local_endpoints_only_and_none_without_them() -> None:
    world = World()
    local = world.add(port(spn("local"), 30001, etp_local=True), LOCAL, REMOTE)
    world.add(port(spn("remote"), 30002, etp_local=True), REMOTE)
    targets = nodeport_targets(world.snapshot())
    assert targets == {local: NodePortTarget(local, 30001, (("10.180.0.1", 80),))}


def test_itp_local_does_not_apply_to_nodeports() -> None:
    world = World()
    name = world.add(port(spn("web"), itp_local=True), LOCAL, REMOTE)
    assert len(nodeport_targets(world.snapshot())[name].endpoints) == 2


def test_only_tcp_nodeports_with_endpoints_and_affinity_carried() -> None:
    world = World()
    world.add(port(spn("dns", proto=Protocol.UDP)), LOCAL)
    world.add(port(spn("sctp", proto=Protocol.SCTP)), LOCAL)
    world.add(port(spn("cluster-only"), node_port=0), LOCAL)
    world.add(port(spn("empty")))
    world.add(port(spn("not-ready")), ep("10.180.0.9", 80, local=True, ready=False, serving=False))
    sticky = world.add(port(spn("sticky"), 30009, affinity=600), LOCAL)
    assert nodeport_targets(world.snapshot()) == {
        sticky: NodePortTarget(sticky, 30009, (("10.180.0.1", 80),), 600)
    }


def test_terminating_endpoints_serve_when_nothing_else_does() -> None:
    world = World()
    terminating = Endpoint(ip("10.180.0.7"), 80, True, ready=False, serving=True, terminating=True)
    name = world.add(port(spn("web")), terminating)
    assert nodeport_targets(world.snapshot())[name].endpoints == (("10.180.0.7", 80),)


def test_targets_of_changed_services_only() -> None:
    world = World()
    a = world.add(port(spn("a"), 30001), LOCAL)
    world.add(port(spn("b"), 30002), LOCAL)
    assert list(targets_of_services(world.snapshot(), [a.service])) == [a]


@pytest.mark.parametrize(
    ("addresses", "v4", "v6"),
    [
        (("primary", "localhost"), True, True),
        (("localhost",), True, True),
        (("192.168.0.2/32", "127.0.0.1/32"), True, False),
        (("127.0.0.0/8",), True, False),
        (("::1/128",), False, True),
        (("0.0.0.0/0", "127.0.0.1/32"), True, False),
        (("all",), False, False),
        (("0.0.0.0/0", "::/0"), False, False),
        (("primary",), False, False),
        (("100.0.0.0/1",), False, False),  # wide enough to hold loopback: not asked for
        ((), False, False),
    ],
)
def test_explicit_loopback(addresses: tuple[str, ...], v4: bool, v6: bool) -> None:
    assert explicit_loopback(addresses, IPFamily.IPV4) is v4
    assert explicit_loopback(addresses, IPFamily.IPV6) is v6


# --- the reject rules ---------------------------------------------------------------------


def elements(fake: FakeNft, family: Family = Family.IP) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for line in fake.dump(family, "kube-proxy").splitlines():
        for protocol in ("tcp", "udp", "sctp"):
            head = f"add element {family} kube-proxy {CHAIN}-{protocol} {{ "
            if line.startswith(head):
                found.setdefault(protocol, set()).add(line[len(head) : -2])
    return found


def test_full_sync_declares_the_chain_sets_and_rules() -> None:
    fake = FakeNft()
    fake.run_text("add table ip kube-proxy\n")
    world = World()
    world.add(port(spn("web", proto=Protocol.TCP), 30001), LOCAL)
    world.add(port(spn("dns", proto=Protocol.UDP), 30053), LOCAL)
    world.add(port(spn("none", proto=Protocol.UDP), 30054))  # rejected with no endpoints too
    rejects = LocalhostRejects(IPFamily.IPV4, fake, [Protocol.UDP, Protocol.SCTP])
    rejects.sync(world.snapshot(), full(), True)
    dump = fake.dump(Family.IP, "kube-proxy")
    assert (
        "add chain ip kube-proxy localhost-nodeports "
        "{ type filter hook input priority 0 ; }" in dump
    )
    assert (
        "add rule ip kube-proxy localhost-nodeports ip daddr 127.0.0.0/8 udp dport "
        '@localhost-nodeports-udp counter reject comment "UDP"' in dump
    )
    assert "tcp dport @localhost-nodeports-tcp" not in dump, "the proxy serves TCP"
    assert elements(fake) == {"udp": {"30053", "30054"}}


def test_without_the_proxy_tcp_is_rejected_too_and_ipv6_matches_its_loopback() -> None:
    fake = FakeNft()
    fake.run_text("add table ip6 kube-proxy\n")
    world = World(IPFamily.IPV6)
    world.add(ServicePort(spn("web"), ip("fd00:10:96::1"), 80, Protocol.TCP, node_port=30001))
    rejects = LocalhostRejects(IPFamily.IPV6, fake, [Protocol.TCP, Protocol.UDP, Protocol.SCTP])
    rejects.sync(world.snapshot(), full(), True)
    dump = fake.dump(Family.IP6, "kube-proxy")
    assert 'ip6 daddr ::1 tcp dport @localhost-nodeports-tcp counter reject comment "TCP"' in dump
    assert elements(fake, Family.IP6) == {"tcp": {"30001"}}


def test_partial_syncs_change_elements_only() -> None:
    fake = FakeNft()
    fake.run_text("add table ip kube-proxy\n")
    world = World()
    a = world.add(port(spn("a", proto=Protocol.UDP), 30001), LOCAL)
    rejects = LocalhostRejects(IPFamily.IPV4, fake, [Protocol.UDP])
    rejects.sync(world.snapshot(), full(), True)
    b = world.add(port(spn("b", proto=Protocol.UDP), 30002), LOCAL)
    world.remove(a)
    before = len(fake.transactions)
    rejects.sync(world.snapshot(), changed(a, b), False)
    (tx,) = fake.transactions[before:]
    assert {verb for verb, _obj in tx.operations()} == {"add", "delete"}
    assert "rule" not in tx.render() and "chain" not in tx.render()
    assert elements(fake) == {"udp": {"30002"}}
    # A change that moves nothing writes nothing.
    rejects.sync(world.snapshot(), changed(b), False)
    assert len(fake.transactions) == before + 1


class RejectMachine(WorldMachine):
    """Incremental syncs of the reject rules end where a full sync of the same world does."""

    names: ClassVar[list[ServicePortName]] = [
        spn(f"s{i}", proto=proto)
        for i in range(4)
        for proto in (Protocol.TCP, Protocol.UDP, Protocol.SCTP)
    ]

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeNft()
        self.fake.run_text("add table ip kube-proxy\n")
        self.rejects = LocalhostRejects(IPFamily.IPV4, self.fake, [Protocol.UDP, Protocol.SCTP])
        self.rejects.sync(self.world.snapshot(), full(), True)

    def draw_port(self, data: st.DataObject, name: ServicePortName) -> ServicePort:
        node_port = data.draw(st.sampled_from([0, 30001, 30002, 30003]))
        return port(name, node_port)

    def draw_endpoints(self, data: st.DataObject) -> tuple[Endpoint, ...]:
        return data.draw(st.sampled_from([(), (LOCAL,), (LOCAL, REMOTE)]))

    @rule()
    def sync(self) -> None:
        self.rejects.sync(self.world.snapshot(), self.changes(), False)
        self.pending.clear()

    @invariant()
    def incremental_equals_full(self) -> None:
        if self.pending:
            return
        fresh = FakeNft()
        fresh.run_text("add table ip kube-proxy\n")
        LocalhostRejects(IPFamily.IPV4, fresh, [Protocol.UDP, Protocol.SCTP]).sync(
            self.world.snapshot(), full(), True
        )
        assert elements(self.fake) == elements(fresh)


TestRejectMachine = RejectMachine.TestCase
TestRejectMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


# --- the wrapper around the nftables backend -----------------------------------------------


def config(*addresses: str, gates: Any = GATE_ON) -> ProxierConfig:
    return ProxierConfig(node_name="test-node", node_port_addresses=addresses, feature_gates=gates)


def wrapped(fake: FakeNft, cfg: ProxierConfig, clock: Clock) -> LocalhostNodePortsBackend:
    inner = NftablesBackend(IPFamily.IPV4, cfg, executor=fake, clock=clock, kept=OBJECT_NAMES)
    return LocalhostNodePortsBackend.create(inner, cfg, fake)


def test_the_backend_keeps_the_reject_objects_and_reads_through() -> None:
    fake, clock = FakeNft(), Clock()
    backend = wrapped(fake, config("192.168.0.2/32"), clock)  # no loopback: no proxy
    assert backend.proxy is None
    world = World()
    world.add(port(spn("web"), 30001), LOCAL)
    for _ in range(3):  # full syncs, a generation each, stale objects deleted in between
        backend.sync(world.snapshot(), full())
        clock.now += STALE_DELAY + 1
    dump = fake.dump(Family.IP, "kube-proxy")
    assert f"add chain ip kube-proxy {CHAIN}" in dump
    assert elements(fake) == {"tcp": {"30001"}}
    assert backend.generation == 3, "the wrapped backend's attributes read through"
    assert backend.stale_chain_failures == 0
    with pytest.raises(AttributeError):
        _ = backend.no_such_attribute


def test_with_the_gate_off_the_backend_removes_them() -> None:
    fake, clock = FakeNft(), Clock()
    world = World()
    world.add(port(spn("dns", proto=Protocol.UDP), 30053), LOCAL)
    wrapped(fake, config("localhost"), clock).sync(world.snapshot(), full())
    assert f"{CHAIN}-udp" in fake.dump(Family.IP, "kube-proxy")
    # The next start, gate off: a plain backend over the same table.
    off = NftablesBackend(
        IPFamily.IPV4, config("localhost", gates=resolve({})), executor=fake, clock=clock
    )
    off.sync(world.snapshot(), full())
    clock.now += STALE_DELAY + 1
    off.sync(world.snapshot(), SyncChanges(full=False))
    dump = fake.dump(Family.IP, "kube-proxy")
    assert CHAIN not in dump and set_name(Protocol.UDP) not in dump


def test_create_backend_wraps_only_with_the_gate_on(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[FakeNft] = []

    def executor(netns: str | None = None, **kwargs: Any) -> FakeNft:
        made.append(FakeNft())
        return made[-1]

    monkeypatch.setattr("kubeproxy.backends.nftables.exec.LibNftables", executor)
    # A kernel that cannot own the table: no probe, no socket, in this namespace.
    monkeypatch.setattr(
        "kubeproxy.backends.nftables.owner.probe_table_flags", lambda netns: (False, False)
    )
    plain = create_backend(IPFamily.IPV4, config("primary", gates=resolve({})))
    assert isinstance(plain, NftablesBackend)
    gated = create_backend(IPFamily.IPV4, config("primary"))
    assert isinstance(gated, LocalhostNodePortsBackend) and gated.proxy is None
    assert gated.rejects.rejected == {Protocol.TCP, Protocol.UDP, Protocol.SCTP}


def test_metrics_as_upstream_names_them() -> None:
    class Stub:
        def __init__(self, family: IPFamily, counts: Mapping[str, int]) -> None:
            self.family = family
            self.proxy = None
            self.counts = counts

        def rejected_packets(self) -> Mapping[str, int]:
            return self.counts

    collector = LocalhostNodePortMetrics()
    collector.add(Stub(IPFamily.IPV4, {"UDP": 7, "SCTP": 3}))  # type: ignore[arg-type]
    collector.add(Stub(IPFamily.IPV6, {"TCP": 2}))  # type: ignore[arg-type]
    registry = CollectorRegistry()
    registry.register(collector)
    text = expose(registry).decode()
    for line in (
        'kubeproxy_nftables_localhost_nodeport_rejected_packets_total{ip_family="IPv4",'
        'protocol="UDP"} 7',
        'kubeproxy_nftables_localhost_nodeport_rejected_packets_total{ip_family="IPv4",'
        'protocol="SCTP"} 3',
        'kubeproxy_nftables_localhost_nodeport_rejected_packets_total{ip_family="IPv6",'
        'protocol="TCP"} 2',
        'kubeproxy_nftables_localhost_nodeport_listeners{ip_family="IPv4"} 0',
        "kubeproxy_nftables_localhost_nodeport_listener_creation_failures_total"
        '{ip_family="IPv6"} 0',
        'kubeproxy_nftables_localhost_nodeport_connections{ip_family="IPv4"} 0',
        "kubeproxy_nftables_localhost_nodeport_timed_out_connections_total"
        '{ip_family="IPv6",reason="half-closed"} 0',
    ):
        assert line in text


def test_nftables_mode_reports_them_once_per_registry() -> None:
    fake = FakeNft()
    backends = [
        LocalhostNodePortsBackend.create(
            NftablesBackend(family, config("primary"), executor=fake, kept=OBJECT_NAMES),
            config("primary"),
            fake,
        )
        for family in (IPFamily.IPV4, IPFamily.IPV6)
    ]
    metrics = ProxyMetrics(mode="nftables")
    for backend in backends:
        hooks = nftables_hooks(backend, metrics)
        assert len(hooks) == 2  # the cleanup failure counter and the sweeper, as before
    collector = report_metrics(metrics.registry, backends[0])
    assert set(collector.backends) == {IPFamily.IPV4, IPFamily.IPV6}


def test_the_daemon_closes_backends_that_hold_more_than_rules() -> None:
    from kubeproxy.daemon import build_daemon
    from tests.test_daemon_library import Backends, cluster_options, offline

    closed: list[IPFamily] = []

    class Closing(Backends):
        def __call__(
            self, family: IPFamily, cfg: ProxierConfig, *, netns: str | None = None
        ) -> Any:
            backend = super().__call__(family, cfg, netns=netns)
            backend.close = lambda: closed.append(family)  # type: ignore[attr-defined]
            return backend

    factory: Any = Closing()
    daemon = build_daemon(cluster_options(once=True), factory, seams=offline())
    daemon.stop()
    assert closed == [IPFamily.IPV4]
