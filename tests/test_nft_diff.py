"""The element diff as pure functions: held state against a new plan -> element changes.

The kernel refuses the addition of an element that is there with another value and the
deletion of one that is not, so the properties are checked against a strict in-memory
store: any sequence of plans for a frontend, diffed step by step, ends with exactly the
elements a fresh diff of the last plan writes, and never adds or deletes blindly.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubeproxy.backends.nftables.diff import (
    add_shared,
    add_shared_new,
    diff_firewall,
    diff_frontend,
    release_shared,
    write_frontend,
)
from kubeproxy.backends.nftables.frontends import (
    AFFINITY_LOCAL_ENDPOINTS,
    AffinityPlan,
    ClassSpec,
    Frontend,
    Kind,
    NoEndpoint,
    PortPlan,
    Shape,
)
from kubeproxy.backends.nftables.generation import (
    Held,
    HeldFrontend,
    PortState,
    SharedCounts,
)
from kubeproxy.backends.nftables.layout import GenNames, class_bits
from kubeproxy.backends.nftables.table import Key, Names

NAMES = GenNames(3)
IP_KEY: Key = ("172.30.0.10", "tcp", "80")
NODE_KEY: Key = ("udp", "30080")
ENDPOINTS = tuple(f"10.180.0.{i}:8080" for i in range(1, 13))


class Store:
    """Containers as the kernel holds them; refuses what the kernel refuses."""

    def __init__(self) -> None:
        self.elements: dict[str, dict[Key, tuple[str, ...]]] = {}
        self.comments: dict[tuple[str, Key], str] = {}
        self.changes = 0

    def add(
        self, container: str, key: Key, value: tuple[str, ...] = (), comment: str | None = None
    ) -> None:
        held = self.elements.setdefault(container, {})
        assert key not in held, f"add of {key} to {container}: already there"
        held[key] = value
        if comment is not None:
            self.comments[container, key] = comment
        self.changes += 1

    def delete(self, container: str, key: Key) -> None:
        held = self.elements.get(container, {})
        assert key in held, f"delete of {key} from {container}: not there"
        del held[key]
        self.comments.pop((container, key), None)
        if not held:
            del self.elements[container]
        self.changes += 1


CLASSES = [
    ClassSpec(kind, shape, count, shortcut, affinity)
    for kind in Kind
    for shape in (Shape.INTERNAL, Shape.LOCAL)
    for count in (1, 2, 3, 5)
    for shortcut in (0, 3)
    for affinity in (False, True)
]
NUMBERS = {cls: number for number, cls in enumerate(CLASSES)}
NAMES_OF_PORTS = ("demo/web:http", "demo/api:http")


@st.composite
def frontends(draw: st.DrawFn, kind: Kind) -> Frontend | None:
    """A plan of one frontend of ``kind``, or None (no such frontend)."""
    if draw(st.booleans()) and draw(st.booleans()):
        return None
    key = IP_KEY if kind is Kind.IP else NODE_KEY
    # The frontend may change hands (another Service port claims it): its name changes.
    name = draw(st.sampled_from(NAMES_OF_PORTS))
    count = draw(st.sampled_from((0, 1, 2, 5)))
    if count == 0:
        verdict = draw(st.sampled_from(NoEndpoint))
        return Frontend(kind, key, None, no_endpoint=verdict, name=name)
    shortcut = draw(st.sampled_from((0, 3)))
    affinity = draw(st.booleans())
    shape = Shape.LOCAL if shortcut else draw(st.sampled_from((Shape.INTERNAL, Shape.LOCAL)))
    cls = ClassSpec(kind, shape, count, shortcut, affinity)
    endpoints = tuple(sorted(draw(st.permutations(ENDPOINTS))[:count]))
    short = tuple(sorted(draw(st.permutations(ENDPOINTS))[:shortcut]))
    lookup = draw(st.sampled_from(("affinity-a", "affinity-b"))) if affinity else None
    return Frontend(
        kind,
        key,
        cls,
        endpoints,
        short,
        lookup=lookup,
        shortcut_lookup=lookup if affinity and shortcut else None,
        record="record-a" if affinity else None,
        no_endpoint=draw(st.sampled_from((None, *NoEndpoint))) if shape is Shape.LOCAL else None,
        name=name,
    )


def _write(store: Store, held: Held | None, plan: Frontend | None, tree: bool) -> Held | None:
    if held is None and plan is None:
        return None  # the backend diffs only keys held or planned
    key = plan.key if plan is not None else HeldFrontend.read(held).fe.key  # type: ignore[arg-type]
    return diff_frontend(store, NAMES, NUMBERS if tree else None, key, held, plan)


@pytest.mark.parametrize("tree", [True, False], ids=["tree", "rules"])
@pytest.mark.parametrize("kind", list(Kind))
@given(data=st.data())
def test_any_sequence_of_plans_ends_where_a_fresh_diff_starts(
    tree: bool, kind: Kind, data: st.DataObject
) -> None:
    plans = data.draw(st.lists(frontends(kind), min_size=1, max_size=6))
    store, held = Store(), None
    for plan in plans:
        held = _write(store, held, plan, tree)
    fresh = Store()
    again = _write(fresh, None, plans[-1], tree)
    # Slots may be numbered otherwise (endpoints keep theirs); compare the values per map.
    assert _by_value(store) == _by_value(fresh)
    # Every element that names the frontend's Service names the last plan's.
    assert store.comments == fresh.comments
    assert (held is None) == (plans[-1] is None) == (again is None)
    if held is not None:
        last = plans[-1]
        assert last is not None
        assert HeldFrontend.read(held).fe == last
        assert sorted(HeldFrontend.read(held).main) == sorted(last.endpoints)
    # And back to nothing: every element goes.
    _write(store, held, None, tree)
    assert store.elements == {}


def _by_value(store: Store) -> dict[str, list[tuple[tuple[str, ...], tuple[str, ...]]]]:
    return {
        container: sorted((key[:-1] if _slot(key) else key, v) for key, v in held.items())
        for container, held in store.elements.items()
    }


def _slot(key: Key) -> bool:
    # frontend . slot: an IP frontend has 3 parts, a NodePort frontend 2 (no address).
    return len(key) == 4 or (len(key) == 3 and key[0] in ("tcp", "udp", "sctp"))


def test_an_unchanged_frontend_costs_nothing_and_keeps_its_held_state() -> None:
    plan = Frontend(Kind.IP, IP_KEY, ClassSpec(Kind.IP, Shape.INTERNAL, 2), ENDPOINTS[:2])
    store = Store()
    held = _write(store, None, plan, True)
    before = store.changes
    assert _write(store, held, plan, True) is held
    assert store.changes == before


def test_one_endpoint_replaced_rewrites_one_slot() -> None:
    cls = ClassSpec(Kind.IP, Shape.INTERNAL, 3)
    store = Store()
    held = _write(store, None, Frontend(Kind.IP, IP_KEY, cls, ENDPOINTS[:3]), True)
    before = store.changes
    new = tuple(sorted((ENDPOINTS[0], ENDPOINTS[2], ENDPOINTS[5])))
    held = _write(store, held, Frontend(Kind.IP, IP_KEY, cls, new), True)
    assert store.changes - before == 2  # the slot of the endpoint gone: delete, add
    assert held is not None
    # Slots not in the plan's order: held apart from the frontend.
    assert type(held) is HeldFrontend
    assert held.main == (ENDPOINTS[0], ENDPOINTS[5], ENDPOINTS[2])


def test_a_class_change_moves_only_the_bits_that_differ() -> None:
    a, b = CLASSES[5], CLASSES[6]  # numbers 5 (bits 0, 2) and 6 (bits 1, 2)
    assert class_bits(NUMBERS[a]) == (0, 2) and class_bits(NUMBERS[b]) == (1, 2)
    store = Store()
    diff_frontend(store, NAMES, NUMBERS, IP_KEY, None, Frontend(a.kind, IP_KEY, a))
    assert set(store.elements) == {
        NAMES.dispatch(a.kind),
        NAMES.class_bit(a.kind, 0),
        NAMES.class_bit(a.kind, 2),
    }
    held = HeldFrontend(Frontend(a.kind, IP_KEY, a), (), ())
    changes = store.changes
    diff_frontend(store, NAMES, NUMBERS, IP_KEY, held, Frontend(b.kind, IP_KEY, b))
    assert store.changes - changes == 2
    assert NAMES.class_bit(a.kind, 1) in store.elements
    assert NAMES.class_bit(a.kind, 0) not in store.elements


firewalls = st.dictionaries(
    st.sampled_from(
        [("1.2.3.4", "tcp", "80"), ("1.2.3.4", "udp", "80"), ("5.6.7.8", "tcp", "443")]
    ),
    st.lists(st.sampled_from(["10.0.0.0/8", "192.168.0.0/16", "1.1.1.1/32"]), unique=True).map(
        tuple
    ),
)


@given(old=firewalls, new=firewalls)
def test_firewall_additions_then_deletions_end_at_the_new_ranges(
    old: dict[Key, tuple[str, ...]], new: dict[Key, tuple[str, ...]]
) -> None:
    store = Store()
    diff_firewall(store, NAMES, {}, old, adding=True)
    diff_firewall(store, NAMES, old, new, adding=True)
    # Between the two phases, every range old or new lets its sources in.
    for key, sources in {**old, **new}.items():
        vip, proto, port = key
        allowed = store.elements.get(NAMES.firewall_allow(proto), {})
        assert all((vip, port, s) in allowed for s in sources if s in new.get(key, ()))
    diff_firewall(store, NAMES, old, new, adding=False)
    expected = Store()
    diff_firewall(expected, NAMES, {}, new, adding=True)
    assert store.elements == expected.elements


def _plan(cluster_ip: str, hairpin: tuple[str, ...], members: tuple[Key, ...]) -> PortPlan:
    affinity = AffinityPlan((), (), members) if members else None
    return PortPlan((), (), cluster_ip, hairpin, (), affinity)


def test_shared_elements_are_written_once_and_go_with_the_last_port() -> None:
    counts, store = SharedCounts(), Store()
    member: Key = ("10.180.0.1", "8080")
    a = _plan("172.30.0.10", ("10.180.0.1",), (member,))
    b = _plan("172.30.0.10", ("10.180.0.1", "10.180.0.2"), (member,))
    add_shared(store, NAMES, counts, a, full=False)
    add_shared(store, NAMES, counts, b, full=False)
    assert store.elements == {
        NAMES.hairpin: {("10.180.0.1", "10.180.0.1"): (), ("10.180.0.2", "10.180.0.2"): ()},
        Names.CLUSTER_IPS: {("172.30.0.10",): ()},
        AFFINITY_LOCAL_ENDPOINTS: {member: ()},
    }
    release_shared(store, NAMES, counts, PortState.of(a))
    assert Names.CLUSTER_IPS in store.elements and AFFINITY_LOCAL_ENDPOINTS in store.elements
    release_shared(store, NAMES, counts, PortState.of(b))
    assert store.elements == {} and counts == SharedCounts()


def test_a_full_sync_leaves_the_public_shared_sets_to_the_switch() -> None:
    counts, store = SharedCounts(), Store()
    add_shared(store, NAMES, counts, _plan("172.30.0.10", ("10.180.0.1",), ()), full=True)
    assert set(store.elements) == {NAMES.hairpin}
    assert counts.cluster_ips == {"172.30.0.10": 1}


class Log:
    """Every queued change in order, a list of additions as the additions one by one
    (encoded ones, for the containers of ``types``, read back as text)."""

    def __init__(self, types: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] | None = None):
        self.changes: list[tuple[str, str, Key, tuple[str, ...], str | None]] = []
        self.types = types or {}

    def add(
        self, container: str, key: Key, value: tuple[str, ...] = (), comment: str | None = None
    ) -> None:
        self.changes.append(("add", container, key, value, comment))

    def delete(self, container: str, key: Key) -> None:
        self.changes.append(("delete", container, key, (), None))

    def add_all(self, container: str, pairs: Sequence[tuple[Key, tuple[str, ...]]]) -> None:
        self.changes.extend(("add", container, key, value, None) for key, value in pairs)


def _encoded_types() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """The netlink types of every slots map and the hairpin set of generation 3."""
    types: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
        NAMES.hairpin: (("ipv4_addr", "ipv4_addr"), ())
    }
    for kind, key in (
        (Kind.IP, ("ipv4_addr", "inet_proto", "inet_service")),
        (Kind.NODEPORT, ("inet_proto", "inet_service")),
    ):
        for shortcut in (False, True):
            for proto in ("tcp", "udp"):
                for count in range(1, 13):
                    name = NAMES.slots(kind, shortcut, proto, count)
                    types[name] = ((*key, "integer"), ("ipv4_addr", "inet_service"))
    return types


@pytest.mark.parametrize("tree", [True, False], ids=["tree", "rules"])
@pytest.mark.parametrize("kind", list(Kind))
@given(data=st.data())
def test_a_new_frontend_is_written_as_the_diff_against_nothing_writes_it(
    tree: bool, kind: Kind, data: st.DataObject
) -> None:
    plan = data.draw(frontends(kind))
    if plan is None:
        return
    numbers = NUMBERS if tree else None
    diffed, written, encoded = Log(), Log(), Log(_encoded_types())
    held = diff_frontend(diffed, NAMES, numbers, plan.key, None, plan)
    assert write_frontend(written, NAMES, numbers, plan) == held
    assert write_frontend(encoded, NAMES, numbers, plan) == held
    assert written.changes == diffed.changes
    assert encoded.changes == diffed.changes


def test_more_slots_than_the_slot_texts_are_written_in_order() -> None:
    endpoints = tuple(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}:80" for i in range(1500))
    cls = ClassSpec(Kind.IP, Shape.INTERNAL, 1500)
    plan = Frontend(Kind.IP, IP_KEY, cls, endpoints)
    numbers = {**NUMBERS, cls: 5}
    diffed, written = Log(), Log()
    diff_frontend(diffed, NAMES, numbers, IP_KEY, None, plan)
    write_frontend(written, NAMES, numbers, plan)
    assert written.changes == diffed.changes
    assert written.changes[-1][2] == (*IP_KEY, "1499")


def test_shared_elements_of_a_full_sync_are_counted_as_add_shared_counts_them() -> None:
    member: Key = ("10.180.0.1", "8080")
    plans = [
        _plan("172.30.0.10", ("10.180.0.1",), (member,)),
        _plan("172.30.0.10", ("10.180.0.1", "10.180.0.2"), (member,)),
        _plan("172.30.0.11", ("10.180.0.3",), ()),
    ]
    one, bulk, packed = SharedCounts(), SharedCounts(), SharedCounts()
    by_one, by_bulk, by_packed = Log(), Log(), Log(_encoded_types())
    for plan in plans:
        add_shared(by_one, NAMES, one, plan, full=True)
        add_shared_new(by_bulk, NAMES, bulk, plan)
        add_shared_new(by_packed, NAMES, packed, plan)
    assert bulk == one == packed
    assert by_bulk.changes == by_one.changes == by_packed.changes
    assert len(by_bulk.changes) == 3
