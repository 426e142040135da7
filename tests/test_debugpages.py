"""The ``/debug/`` pages without a kernel: the view :class:`DebugState` records through
full and partial syncs (a hypothesis state machine against the snapshot it follows), the
core's pages, and a daemon over fakes serving them only when ``--profiling`` asks
(nftables mode's kernel pages: test_debugpages_kernel.py)."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import yaml
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kubeproxy.backend import SyncChanges
from kubeproxy.cmd.modes import MODES
from kubeproxy.config import ProxierConfig
from kubeproxy.conntrack import FakeConntrack
from kubeproxy.daemon import Daemon, DaemonPlugins, DaemonSeams, build_daemon
from kubeproxy.debugpages import DebugState, core_pages
from kubeproxy.host.httpserving import QueryRoute
from kubeproxy.host.netlink import FakeHostAddresses
from kubeproxy.objects import IPFamily, NamespacedName, Protocol, ServicePort, ServicePortName
from kubeproxy.proxier import FinishedSync
from kubeproxy.selfheal import ChangeKind, ExternalChange
from kubeproxy.testing.fakeapi import node, service
from tests.snapshots import World, ep
from tests.test_daemon import NODE, FakeBackends, get, options_for, running, slice_of, wait_for

ip = ipaddress.ip_address


def _port(service_name: str, port_name: str, number: int) -> ServicePort:
    name = ServicePortName(NamespacedName("ns", service_name), port_name, Protocol.TCP)
    return ServicePort(name, ip(f"172.30.0.{number}"), 80 + number, Protocol.TCP)


class ViewFollowsSyncs(RuleBasedStateMachine):
    """Services' ports come and go in a world; each sync tells the state which Services
    changed (or that it is full); the recorded view is always the world's."""

    def __init__(self) -> None:
        super().__init__()
        self.world = World()
        self.state = DebugState(ProxierConfig(node_name="n"))
        self.changed: set[NamespacedName] = set()
        self.state(None, self.world.snapshot(), SyncChanges(full=True))

    @rule(
        svc=st.sampled_from(["a", "b", "c"]),
        port=st.sampled_from(["http", "dns"]),
        number=st.integers(1, 9),
        endpoints=st.integers(0, 2),
    )
    def set_port(self, svc: str, port: str, number: int, endpoints: int) -> None:
        sp = _port(svc, port, number)
        if sp.name in self.world.services:
            self.world.remove(sp.name)
        self.world.add(sp, *(ep(f"10.180.0.{number + k}") for k in range(endpoints)))
        self.changed.add(sp.name.service)

    @rule(svc=st.sampled_from(["a", "b", "c"]), port=st.sampled_from(["http", "dns"]))
    def remove_port(self, svc: str, port: str) -> None:
        name = ServicePortName(NamespacedName("ns", svc), port, Protocol.TCP)
        if name in self.world.services:
            self.world.remove(name)
        self.changed.add(name.service)

    @rule(full=st.booleans())
    def sync(self, full: bool) -> None:
        changes = SyncChanges(full=full, changed_services=frozenset(self.changed))
        self.state(None, self.world.snapshot(), changes)
        self.changed.clear()

    @invariant()
    def view_is_the_last_synced_world(self) -> None:
        if self.changed:
            return  # not synced yet
        want = self.world.snapshot()
        held = self.state.snapshot(IPFamily.IPV4)
        assert held is not None
        assert dict(held.services) == dict(want.services)
        assert dict(held.categorized) == dict(want.categorized)
        grouped: dict[NamespacedName, set[ServicePortName]] = {}
        for name in want.services:
            grouped.setdefault(name.service, set()).add(name)
        assert {s: set(n) for s, n in (held.ports_by_service or {}).items()} == grouped


TestViewFollowsSyncs = ViewFollowsSyncs.TestCase
TestViewFollowsSyncs.settings = settings(max_examples=30, stateful_step_count=15, deadline=None)


def test_core_pages_show_the_view_and_the_syncs() -> None:
    world = World()
    world.add(_port("web", "http", 10), ep("10.180.0.1"), ep("10.180.0.2"))
    state = DebugState(ProxierConfig(node_name="n"), clock=lambda: 0.0)
    state(None, world.snapshot(), SyncChanges(full=True))
    state.sync_finished(FinishedSync(IPFamily.IPV4, True, 0.25, None, 1, 1))
    state.sync_finished(FinishedSync(IPFamily.IPV4, False, 0.01, RuntimeError("refused"), 1, 1))
    pages = core_pages(state, {"/debug/mode": lambda: (200, {}, b"")})
    assert pages["/debug/"]()[2].decode().splitlines() == [
        "/debug/mode",
        "/debug/plan",
        "/debug/repairs",
        "/debug/services",
        "/debug/syncs",
    ]
    syncs = json.loads(pages["/debug/syncs"]()[2])["IPv4"]
    assert [s["full"] for s in syncs] == [False, True]  # newest first
    assert syncs[0]["error"] == "RuntimeError: refused"
    assert syncs[1]["ended"] == "1970-01-01T00:00:00Z" and syncs[1]["duration_s"] == 0.25
    services = pages["/debug/services"]
    assert isinstance(services, QueryRoute)
    assert json.loads(services.answer({})[2]) == {"services": {"ns/web": {"IPv4": 1}}}
    status, _, body = services.answer({"service": "ns/web"})
    (port,) = json.loads(body)["families"]["IPv4"]
    assert status == 200 and port["cluster_ip"] == "172.30.0.10" and port["port_number"] == 90
    assert port["cluster_endpoints"] == ["10.180.0.1:8080", "10.180.0.2:8080"]
    assert port["external_traffic_policy"] == "Cluster" and port["has_usable_endpoints"]
    assert services.answer({"service": "ns/nothing"})[0] == 404
    assert services.answer({"service": "no-slash"})[0] == 400


class _PlanningBackend:
    def last_sync_plan(self) -> dict[str, object]:
        return {"operations": 7}


class _Proxier:
    backend = _PlanningBackend()


def test_the_plan_page_shows_each_familys_last_sync_and_the_repairs_page_the_healers() -> None:
    world = World()
    web = world.add(_port("web", "http", 10), ep("10.180.0.1"))
    state = DebugState(ProxierConfig(node_name="n"), clock=lambda: 60.0)
    pages = core_pages(state)
    assert json.loads(pages["/debug/plan"]()[2]) == {}
    assert json.loads(pages["/debug/repairs"]()[2]) == []
    state(None, world.snapshot(), SyncChanges(full=True))
    world.add(_port("db", "sql", 11))
    changed = frozenset({web.service, NamespacedName("ns", "db")})
    state(_Proxier(), world.snapshot(), SyncChanges(full=False, changed_services=changed))
    assert json.loads(pages["/debug/plan"]()[2]) == {
        "IPv4": {
            "ended": "1970-01-01T00:01:00Z",
            "full": False,
            "service_ports": 2,
            "changed_services": 2,
            "changed_services_named": ["ns/db", "ns/web"],
            "backend": {"operations": 7},
        }
    }
    state.repairs = lambda: [{"family": "IPv4", "outcome": "repaired"}]
    assert json.loads(pages["/debug/repairs"]()[2]) == [{"family": "IPv4", "outcome": "repaired"}]


def _daemon(where: Path, *flags: str) -> Daemon:
    manifests = where / "cluster"
    manifests.mkdir(parents=True)
    objects = [
        node(NODE, addresses=["203.0.113.7"]),
        service("web", cluster_ip="172.30.0.10"),
        slice_of("web-a", "web", "10.244.0.11"),
    ]
    (manifests / "all.yaml").write_text(yaml.safe_dump_all(objects))
    return build_daemon(
        options_for("--manifests", str(manifests), *flags),
        FakeBackends(),
        plugins=DaemonPlugins(debug_pages=MODES["nftables"].debug_pages),
        seams=DaemonSeams(
            host_addresses=FakeHostAddresses([ip("198.51.100.1")]),
            conntrack=FakeConntrack(),
            privileged=False,
            ipv6_supported=False,
        ),
    )


def test_a_daemon_serves_the_pages_only_when_asked(tmp_path: Path) -> None:
    with running(_daemon(tmp_path / "on", "--profiling")) as on:
        port = on.metrics_server.port

        def synced() -> bool:
            return get(port, "/debug/syncs")[2] != b"{}\n"

        wait_for(synced, "the first sync on /debug/syncs")
        code, _, body = get(port, "/debug/services?service=default/web")
        assert code == 200, body
        (held,) = json.loads(body)["families"]["IPv4"]
        assert held["cluster_ip"] == "172.30.0.10" and held["endpoints"] == ["10.244.0.11:8080"]
        # nftables mode's pages are there too (their kernel test: test_debugpages_kernel).
        (plan,) = json.loads(get(port, "/debug/plan")[2]).values()
        assert plan["full"] and plan["service_ports"] == 1
        # The daemon's healer keeps the repairs the page shows.
        on.healer.report(ExternalChange(ChangeKind.TABLE, "table deleted", IPFamily.IPV4))
        (repair,) = json.loads(get(port, "/debug/repairs")[2])
        assert repair["family"] == "IPv4" and repair["details"] == ["table deleted"]
        index = set(get(port, "/debug/")[2].decode().split())
        assert {"/debug/explain", "/debug/verify", "/debug/trace", "/debug/failed-sync"} <= index
    with running(_daemon(tmp_path / "off")) as off:
        assert get(off.metrics_server.port, "/debug/")[0] == 404
        assert get(off.metrics_server.port, "/debug/services")[0] == 404
