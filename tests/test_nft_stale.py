"""The stale collector: typed objects, their deletion order, the delay, failures."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.stale import (
    STALE_DELAY,
    ObjectKind,
    StaleCollector,
    TableObject,
    chain_object,
    deletion_order,
    queue_deletion,
    set_object,
)
from kubeproxy.backends.nftables.table import TABLE
from kubeproxy.backends.nftables.transaction import Transaction


def tx() -> Transaction:
    return Transaction(Family.IP, TABLE)


def test_an_object_reads_and_writes_its_text() -> None:
    obj = TableObject.parse("chain pick-3.g2")
    assert obj == chain_object("pick-3.g2") and obj.kind is ObjectKind.CHAIN
    assert str(obj) == "chain pick-3.g2"
    assert str(set_object("affinity-0a1b")) == "set affinity-0a1b"
    for bad in ("map x", "chain", "chain a b", "set ", ""):
        with pytest.raises(ValueError, match="not a table object"):
            TableObject.parse(bad)


def test_verdict_maps_go_first_then_chains_callers_first_then_other_sets() -> None:
    objects = [
        set_object("endpoints-tcp-b2.g1"),
        chain_object("pick-2.g1"),
        chain_object("service-ABC-tcp"),
        set_object("affinity-lookup-ips.g1"),
        chain_object("internal-2.g1"),
        chain_object("mystery"),
        set_object("service-ips"),
        chain_object("group-x"),
    ]
    assert sorted(objects, key=deletion_order) == [
        set_object("affinity-lookup-ips.g1"),
        set_object("service-ips"),
        chain_object("internal-2.g1"),
        chain_object("service-ABC-tcp"),
        chain_object("group-x"),
        chain_object("pick-2.g1"),
        chain_object("mystery"),
        set_object("endpoints-tcp-b2.g1"),
    ]


def test_the_deletion_flushes_every_chain_before_deleting_anything() -> None:
    t = tx()
    queue_deletion(t, [set_object("service-ips"), chain_object("a"), chain_object("b")])
    verbs = [line.split()[:2] for line in t.render().splitlines()]
    assert verbs == [
        ["flush", "chain"],
        ["flush", "chain"],
        ["delete", "set"],
        ["delete", "chain"],
        ["delete", "chain"],
    ]


class Kernel:
    """Runs deletion transactions, or refuses them; lists what is left."""

    def __init__(self, held: set[TableObject]) -> None:
        self.held = set(held)
        self.refuse = False
        self.runs: list[str] = []

    def run(self, t: Transaction) -> None:
        self.runs.append(t.render())
        if self.refuse:
            raise NftError("Device or resource busy")
        for line in t.render().splitlines():
            verb, kind, *_rest, name = line.split()
            if verb == "delete":
                self.held.discard(TableObject(ObjectKind(kind), name))

    def listed(self) -> tuple[set[str], set[str]]:
        chains = {o.name for o in self.held if o.kind is ObjectKind.CHAIN}
        return chains, {o.name for o in self.held if o.kind is ObjectKind.SET}


def test_objects_go_a_delay_after_their_last_use_in_one_transaction() -> None:
    kernel = Kernel({chain_object("pick-1.g1"), set_object("endpoints-tcp-b1.g1")})
    stale = StaleCollector()
    stale.listed(*kernel.listed())
    stale.sweep({chain_object("pick-1.g1")}, now=10.0)
    assert set_object("endpoints-tcp-b1.g1") in stale and len(stale) == 1
    assert stale.collect(10.5, tx, kernel.run, kernel.listed) and kernel.runs == []
    assert stale.collect(10.0 + STALE_DELAY, tx, kernel.run, kernel.listed)
    assert len(kernel.runs) == 1 and kernel.held == {chain_object("pick-1.g1")}
    assert len(stale) == 0 and not stale.live(set_object("endpoints-tcp-b1.g1"))


def test_taking_an_object_keeps_it_and_says_whether_the_kernel_lacks_it() -> None:
    stale = StaleCollector()
    stale.listed(["affinity-lookup-1"], [])
    held, new = chain_object("affinity-lookup-1"), set_object("affinity-0a1b")
    stale.unused(held, 5.0)
    assert stale.take(held) is False and held not in stale
    assert stale.take(new) is True and stale.live(new)
    assert stale.take(new) is False


def test_a_refused_deletion_is_retried_later_and_forgets_what_is_gone() -> None:
    gone, busy = chain_object("pick-1.g1"), chain_object("pick-2.g1")
    kernel = Kernel({gone, busy})
    stale = StaleCollector()
    stale.listed(*kernel.listed())
    stale.sweep(set(), now=0.0)
    kernel.held.discard(gone)  # someone else deleted it
    kernel.refuse = True
    assert not stale.collect(5.0, tx, kernel.run, kernel.listed)
    assert gone not in stale and gone not in stale.held
    assert busy in stale and stale.due(5.5) == []  # its delay starts again
    kernel.refuse = False
    assert stale.collect(6.0, tx, kernel.run, kernel.listed) and kernel.held == set()


OBJECTS = [chain_object("pick-1.g1"), chain_object("internal-1.g1"), set_object("affinity-x")]


class CollectorMachine(RuleBasedStateMachine):
    """Against a model: an object is deleted only once it has been unused for the delay
    (since the first time it went unused), never while used, and exactly once."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.kernel = Kernel(set(OBJECTS))
        self.stale = StaleCollector()
        self.stale.listed(*self.kernel.listed())
        self.since: dict[TableObject, float] = {}

    @rule(obj=st.sampled_from(OBJECTS))
    def unused(self, obj: TableObject) -> None:
        self.stale.unused(obj, self.now)
        self.since.setdefault(obj, self.now)

    @rule(obj=st.sampled_from(OBJECTS))
    def used(self, obj: TableObject) -> None:
        self.stale.used(obj)
        self.since.pop(obj, None)

    @rule(seconds=st.sampled_from([0.25, 0.5, 1.0]))
    def wait(self, seconds: float) -> None:
        self.now += seconds

    @rule(refuse=st.booleans())
    def collect(self, refuse: bool) -> None:
        self.kernel.refuse = refuse
        due = {o for o, since in self.since.items() if self.now - since >= STALE_DELAY}
        before = set(self.kernel.held)
        ok = self.stale.collect(self.now, tx, self.kernel.run, self.kernel.listed)
        assert ok == (not (refuse and due))
        if refuse and due:
            assert self.kernel.held == before
            for obj in due:
                if obj in self.kernel.held:
                    self.since[obj] = self.now  # tried again a delay later
                else:
                    del self.since[obj]  # gone already: forgotten
            return
        assert before - self.kernel.held == due & before
        for obj in due:
            del self.since[obj]

    @invariant()
    def agrees(self) -> None:
        assert {o for o in OBJECTS if o in self.stale} == set(self.since)
        assert self.stale.held <= self.kernel.held


TestCollectorMachine = CollectorMachine.TestCase
