"""``kubeproxy verify``'s comparison of what the backend writes with a table
(:func:`~kubeproxy.backends.nftables.verify.compare_written`), without a kernel: the
"kernel" is a second :class:`~kubeproxy.backends.nftables.written.WrittenTable`, written
by a backend that synced incrementally (other generations, class numbers and slots),
and then changed behind its back.

The property: on every state a random sequence of syncs reaches, the fast comparison
finds no difference where the whole-table comparison (:func:`compare`, every frontend
explained) finds none, and after each kind of change (an element deleted, an endpoint
replaced, a frontend added, a newer generation) it finds the same differences, in the
same words. What only the fast comparison reads (chains' rules, the sets outside the
frontends) has tests of its own. The kernel's side of the same (its dumps' bytes) is
``tests/test_explain_kernel.py``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from kubeproxy.backend import SyncChanges
from kubeproxy.backends.nftables import NftablesBackend
from kubeproxy.backends.nftables.declarations import Declaration
from kubeproxy.backends.nftables.explain import TableView
from kubeproxy.backends.nftables.layout import generation_of
from kubeproxy.backends.nftables.objects import Family, Set
from kubeproxy.backends.nftables.verify import Difference, compare, compare_written
from kubeproxy.backends.nftables.written import WrittenSource, WrittenTable
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName
from tests.snapshots import (
    PROPERTY_NAMES,
    World,
    WorldMachine,
    endpoint_sets,
    ep,
    service_ports,
    spn,
)

CONFIG = ProxierConfig(node_name="test-node")
FAMILY = Family.IP
Mutation = Callable[[WrittenTable, st.DataObject], str]
Key = tuple[str, ...]


def _backend(written: WrittenTable) -> NftablesBackend:
    return NftablesBackend(IPFamily.IPV4, CONFIG, executor=written, support_check=False)


def _written(world: World) -> WrittenTable:
    """What a fresh proxy writes for ``world`` (a full sync: generation 1)."""
    written = WrittenTable()
    _backend(written).sync(world.snapshot(), SyncChanges(full=True))
    return written


def _both(want: WrittenTable, have: WrittenTable) -> tuple[list[Difference], list[Difference]]:
    """The whole-table comparison's differences and the fast one's."""
    old = compare(TableView(WrittenSource(want), FAMILY), TableView(WrittenSource(have), FAMILY))
    new = compare_written(WrittenSource(want), WrittenSource(have), FAMILY)
    return old, new


def _live(have: WrittenTable) -> int:
    gen = TableView(WrittenSource(have), FAMILY).generation
    assert gen is not None
    return gen


def _containers(have: WrittenTable, *stems: str) -> list[str]:
    """The live generation's non-empty containers whose names start with ``stems``."""
    held = have.table(FAMILY)
    assert held is not None
    gen = _live(have)
    return sorted(
        name
        for name, items in held.elements.items()
        if items and generation_of(name) == gen and name.startswith(stems)
    )


_SLOTS = ("endpoints-", "nodeport-endpoints-", "shortcut-")


def _element(
    have: WrittenTable, data: st.DataObject, *stems: str
) -> tuple[dict[Key, Key], Key] | None:
    """A live-generation container of ``stems`` and one of its keys, drawn."""
    names = _containers(have, *stems)
    held = have.table(FAMILY)
    if not names or held is None:
        return None
    items = held.elements[data.draw(st.sampled_from(names))]
    return items, data.draw(st.sampled_from(sorted(items)))


def delete_element(have: WrittenTable, data: st.DataObject) -> str:
    stems = ("dispatch-", "no-endpoint-", *_SLOTS, "class-bit-", "firewall-ips", "affinity-")
    found = _element(have, data, *stems)
    if found is None:
        return "nothing to delete"
    items, key = found
    del items[key]
    return f"deleted {key}"


def replace_endpoint(have: WrittenTable, data: st.DataObject) -> str:
    found = _element(have, data, *_SLOTS)
    if found is None:
        return "no slot"
    items, key = found
    items[key] = ("10.99.99.99", "1")
    return f"replaced slot {key}"


def add_frontend(have: WrittenTable, data: st.DataObject) -> str:
    held = have.table(FAMILY)
    assert held is not None
    name = data.draw(st.sampled_from(["dispatch-ips", "no-endpoint-reject"]))
    container = f"{name}.g{_live(have)}"
    ghost = ("172.31.9.9", "tcp", "80")
    held.elements.setdefault(container, {})[ghost] = ()
    held.comments.setdefault(container, {})[ghost] = "ns/ghost:http"
    return f"added a ghost to {container}"


def newer_generation(have: WrittenTable, data: st.DataObject) -> str:
    held = have.table(FAMILY)
    assert held is not None
    name = f"dispatch-ips.g{_live(have) + 1}"
    held.declarations[name] = Declaration.of(Set(name, "ipv4_addr . inet_proto . inet_service"))
    held.elements[name] = {}
    return f"declared {name}"


MUTATIONS: list[Mutation] = [delete_element, replace_endpoint, add_frontend, newer_generation]


class FastAgreesWithWhole(WorldMachine):
    """The "kernel" follows the world by incremental syncs (and a full one now and
    then); what a fresh proxy would write is compared with it both ways."""

    names = PROPERTY_NAMES

    def __init__(self) -> None:
        super().__init__()
        self.have = WrittenTable()
        self.backend = _backend(self.have)
        self.backend.sync(self.world.snapshot(), SyncChanges(full=True))

    def draw_port(self, data: st.DataObject, name: ServicePortName) -> ServicePort:
        return data.draw(service_ports(name))

    def draw_endpoints(self, data: st.DataObject) -> tuple[Endpoint, ...]:
        return data.draw(endpoint_sets())

    @rule(full=st.booleans())
    def sync(self, full: bool) -> None:
        self.backend.sync(self.world.snapshot(), self.changes(full))
        self.pending.clear()
        old, new = _both(_written(self.world), self.have)
        assert old == [] and new == [], (old, new)

    @rule(data=st.data(), mutation=st.sampled_from(MUTATIONS))
    def a_change_behind_its_back(self, data: st.DataObject, mutation: Mutation) -> None:
        self.sync(full=False)
        changed = self.have.copy()
        what = mutation(changed, data)
        old, new = _both(_written(self.world), changed)
        assert new == old, what


TestFastAgreesWithWhole = FastAgreesWithWhole.TestCase
TestFastAgreesWithWhole.settings = settings(
    max_examples=50,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _port(name: str, address: str, port: int, **more: Any) -> ServicePort:
    return ServicePort(spn(name), ipaddress.ip_address(address), port, Protocol.TCP, **more)


def _world() -> World:
    world = World()
    world.add(_port("web", "172.30.0.1", 80, node_port=30080), ep("10.1.0.1"))
    world.add(
        _port("db", "172.30.0.2", 5432, session_affinity_seconds=60),
        ep("10.1.0.2"),
        ep("10.1.0.3"),
    )
    world.add(_port("empty", "172.30.0.3", 80))
    return world


@pytest.mark.parametrize("dump_over", [2000, 0], ids=["asked", "dumped first"])
def test_each_kind_of_difference_in_service_terms(
    dump_over: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past _DUMP_OVER frontends to explain, the kernel's containers are dumped first.
    monkeypatch.setattr("kubeproxy.backends.nftables.verify._DUMP_OVER", dump_over)
    want = _written(_world())
    have = want.copy()
    held = have.table(FAMILY)
    assert held is not None
    gen = _live(have)
    slots = held.elements[f"endpoints-tcp-b2.g{gen}"]
    slots[("172.30.0.2", "tcp", "5432", "1")] = ("10.1.0.9", "5432")
    del held.elements[f"dispatch-ips.g{gen}"][("172.30.0.1", "tcp", "80")]
    held.elements[f"dispatch-ips.g{gen}"][("172.30.0.9", "tcp", "80")] = ()
    held.comments[f"dispatch-ips.g{gen}"][("172.30.0.9", "tcp", "80")] = "ns/ghost:http"
    name = f"dispatch-ips.g{gen + 1}"
    held.declarations[name] = Declaration.of(Set(name, "ipv4_addr . inet_proto . inet_service"))
    differences = [
        str(d) for d in compare_written(WrittenSource(want), WrittenSource(have), FAMILY)
    ]
    assert "ns/db:http: 172.30.0.2:5432/tcp: endpoints: missing 10.1.0.3:8080" in differences
    assert "ns/db:http: 172.30.0.2:5432/tcp: endpoints: extra 10.1.0.9:5432" in differences
    assert any(d.startswith("ns/web:http: 172.30.0.1:80/tcp: missing (") for d in differences)
    assert "ns/ghost:http: 172.30.0.9:80/tcp: extra, the objects have no such frontend" in (
        differences
    )
    assert any("stale generation" in d for d in differences)


def test_rules_and_sets_outside_the_frontends() -> None:
    want = _written(_world())
    have = want.copy()
    held = have.table(FAMILY)
    assert held is not None
    gen = _live(have)
    pick = next(name for name in held.chains if name.startswith("pick-2"))
    held.chains[pick] = held.chains[pick][:-1]
    cls = next(name for name in held.chains if name.startswith("internal-1"))
    del held.chains[cls]
    del held.elements["cluster-ips"][("172.30.0.3",)]
    differences = [
        str(d) for d in compare_written(WrittenSource(want), WrittenSource(have), FAMILY)
    ]
    old = compare(TableView(WrittenSource(want), FAMILY), TableView(WrittenSource(have), FAMILY))
    assert old == []  # the whole-table comparison reads neither
    table = "table ip kube-proxy"
    assert f"{table}: chain {cls}: missing" in differences
    assert any(d.startswith(f"{table}: chain {pick}: ") for d in differences), differences
    assert f"{table}: set cluster-ips: missing 172.30.0.3" in differences
    assert f".g{gen}" in pick


def test_another_generation_with_other_class_numbers_and_slots_agrees() -> None:
    world = _world()
    have = WrittenTable()
    backend = _backend(have)
    backend.sync(World().snapshot(), SyncChanges(full=True))
    backend.sync(world.snapshot(), SyncChanges(full=True))
    # Classes that arrive one by one get numbers in that order, not by use.
    for n in range(4):
        name = world.add(
            _port(f"x{n}", f"172.30.1.{n}", 80),
            *(ep(f"10.2.{n}.{k}") for k in range(1, n + 3)),
        )
        backend.sync(world.snapshot(), SyncChanges(False, frozenset({name.service})))
    # An endpoint leaves and another comes: the slots are not a fresh sync's.
    db = world.add(
        _port("db", "172.30.0.2", 5432, session_affinity_seconds=60),
        ep("10.1.0.3"),
        ep("10.1.0.4"),
    )
    backend.sync(world.snapshot(), SyncChanges(False, frozenset({db.service})))
    want = _written(world)
    assert _live(have) != _live(want)
    old, new = _both(want, have)
    assert old == [] and new == []


def test_containers_read_by_key_find_the_same_but_extra_elements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    want = _written(_world())
    have = want.copy()
    held = have.table(FAMILY)
    assert held is not None
    gen = _live(have)
    held.elements[f"endpoints-tcp-b2.g{gen}"][("172.30.0.2", "tcp", "5432", "1")] = (
        "10.1.0.9",
        "5432",
    )
    del held.elements[f"endpoints-tcp-b1.g{gen}"][("172.30.0.1", "tcp", "80", "0")]
    held.elements[f"dispatch-ips.g{gen}"][("172.30.0.9", "tcp", "80")] = ()
    dumped = compare_written(WrittenSource(want), WrittenSource(have), FAMILY)
    monkeypatch.setattr("kubeproxy.backends.nftables.verify.PROBE_OVER", 0)
    probed = compare_written(WrittenSource(want), WrittenSource(have), FAMILY)
    assert any("extra, the objects have no such frontend" in d.what for d in dumped)
    assert probed == [d for d in dumped if "extra, the objects" not in d.what]
    assert any("endpoints: the kernel lacks slot(s) 0" in d.what for d in probed)
    assert any("endpoints: extra 10.1.0.9:5432" in d.what for d in probed)
