"""The element diff: what the kernel holds of a frontend or a port, against its new plan,
as element additions and deletions (pure functions over an :class:`ElementSink`).

Every per-Service change is data (see the package README): a frontend moves between
classes by its class-bit (or class-set) memberships, its endpoints are numbered slots
that keep their number while they stay (:func:`restitch`), and its no-endpoint verdict,
affinity verdicts and firewall sources are set and map elements. A sink queues the
changes (the backend's :class:`~kubeproxy.backends.nftables.commits.SyncOps` commits
them in bounded transactions); these functions only say which.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from kubeproxy.backends.nftables.elements import (
    ContainerTypes,
    EncodedPairs,
    SlotPacker,
    pair_elements,
    slot_packer,
)
from kubeproxy.backends.nftables.frontends import (
    AFFINITY_LOCAL_ENDPOINTS,
    ClassSpec,
    Frontend,
    Kind,
    PortPlan,
    endpoint_value,
)
from kubeproxy.backends.nftables.generation import (
    Held,
    HeldFrontend,
    PortState,
    SharedCounts,
    count_in,
    count_out,
)
from kubeproxy.backends.nftables.layout import GenNames, class_bits
from kubeproxy.backends.nftables.table import Key, Names

__all__ = [
    "BulkSink",
    "ElementSink",
    "FrontendWriter",
    "add_shared",
    "add_shared_new",
    "diff_class",
    "diff_firewall",
    "diff_frontend",
    "diff_slots",
    "release_shared",
    "restitch",
    "write_frontend",
]

_VALUE_NONE: tuple[str, ...] = ()
_SLOT_TEXTS = tuple(str(i) for i in range(1024))


class ElementSink(Protocol):
    """Where element changes are queued."""

    def add(
        self,
        container: str,
        key: Key,
        value: tuple[str, ...] = _VALUE_NONE,
        comment: str | None = None,
    ) -> None:
        """Queue the addition of ``key`` (with ``value`` in a map, and ``comment``) to
        ``container``."""

    def delete(self, container: str, key: Key) -> None:
        """Queue the deletion of ``key`` from ``container``."""


class BulkSink(ElementSink, Protocol):
    """A sink that also takes a list of additions at once (a full sync's), and says which
    containers' elements it sends encoded (:attr:`types`)."""

    @property
    def types(self) -> Mapping[str, ContainerTypes]:
        """The types of the containers whose additions may come encoded
        (:class:`~.elements.EncodedPairs`)."""

    def add_all(self, container: str, pairs: Sequence[tuple[Key, tuple[str, ...]]]) -> None:
        """Queue the additions ``(key, value)`` to ``container``, without comments (the
        sequence is the sink's from then on)."""


def _slot_text(index: int) -> str:
    # One string per slot number, shared by every key that has it.
    return _SLOT_TEXTS[index] if index < len(_SLOT_TEXTS) else str(index)


def restitch(old: tuple[str, ...], new: tuple[str, ...]) -> tuple[str, ...]:
    """Slots for the endpoints ``new``, moving as few as possible from ``old``.

    An endpoint that stays keeps its slot; a new one takes a freed slot (or the end);
    when the list shrinks, the last slots move into the holes. Choosing by ``numgen
    random mod N`` stays uniform whatever the order.
    """
    if old == new or not old:
        return old if old == new else new
    wanted = set(new)
    slots: list[str | None] = [e if e in wanted else None for e in old]
    placed = {e for e in slots if e is not None}
    incoming = [e for e in new if e not in placed]
    taken = 0
    for index, value in enumerate(slots):
        if value is None and taken < len(incoming):
            slots[index] = incoming[taken]
            taken += 1
    slots.extend(incoming[taken:])
    while None in slots:
        hole = slots.index(None)
        last = slots.pop()
        if hole < len(slots):
            slots[hole] = last
    return tuple(s for s in slots if s is not None)


def diff_class(
    sink: ElementSink,
    names: GenNames,
    numbers: Mapping[ClassSpec, int] | None,
    kind: Kind,
    key: Key,
    old: ClassSpec | None,
    new: ClassSpec | None,
    name: str | None = None,
    renamed: bool = False,
) -> None:
    """Queue the membership changes that move frontend ``key`` from class ``old`` to
    ``new`` (None: not dispatched): its class-number bits with the tree dispatch
    (``numbers``), its class set with one rule per class (``numbers`` None). Its
    dispatch element carries ``name`` (its Service port's comment); ``renamed``: the
    frontend changed hands, so an element it keeps is written again with the new name
    (the kernel keeps an element's comment when the element is added again)."""
    if (old is None) != (new is None) or (renamed and old is not None):
        if old is not None:
            sink.delete(names.dispatch(kind), key)
        if new is not None:
            sink.add(names.dispatch(kind), key, comment=name)
    if numbers is None:
        if old is not None:
            sink.delete(names.cls(old), key)
        if new is not None:
            sink.add(names.cls(new), key)
        return
    old_bits = set(class_bits(numbers[old])) if old is not None else set()
    new_bits = set(class_bits(numbers[new])) if new is not None else set()
    for bit in old_bits - new_bits:
        sink.delete(names.class_bit(kind, bit), key)
    for bit in new_bits - old_bits:
        sink.add(names.class_bit(kind, bit), key)


def diff_frontend(
    sink: ElementSink,
    names: GenNames,
    numbers: Mapping[ClassSpec, int] | None,
    key: Key,
    held: Held | None,
    new: Frontend | None,
) -> Held | None:
    """Queue the element changes that turn frontend ``key`` as held (``held``) into its
    new plan (``new``; None for either: absent); what the kernel then holds of it."""
    old = HeldFrontend.read(held) if held is not None else None
    before = old.fe if old is not None else None
    if before is not None and before == new:
        return held
    kind = new.kind if new is not None else before.kind  # type: ignore[union-attr]
    old_cls = before.cls if before else None
    new_cls = new.cls if new else None
    name = new.name if new is not None else None
    renamed = before is not None and new is not None and before.name != name
    if old_cls != new_cls or renamed:
        diff_class(sink, names, numbers, kind, key, old_cls, new_cls, name, renamed)
    proto = key[1] if kind == Kind.IP else key[0]
    main = diff_slots(
        sink,
        names,
        kind,
        False,
        proto,
        key,
        old.main if old else (),
        new.endpoints if new else (),
    )
    short = diff_slots(
        sink,
        names,
        kind,
        True,
        proto,
        key,
        old.short if old else (),
        new.shortcut if new else (),
    )
    old_ne = before.no_endpoint if before else None
    new_ne = new.no_endpoint if new else None
    if old_ne != new_ne or (renamed and old_ne is not None):
        if old_ne is not None:
            sink.delete(names.no_endpoint(kind, old_ne), key)
        if new_ne is not None:
            sink.add(names.no_endpoint(kind, new_ne), key, comment=name)
    for container, verdict, old_chain, new_chain in (
        (
            names.affinity_lookup(kind, False),
            "jump",
            before.lookup if before else None,
            new.lookup if new else None,
        ),
        (
            names.affinity_lookup(kind, True),
            "jump",
            before.shortcut_lookup if before else None,
            new.shortcut_lookup if new else None,
        ),
        (
            names.affinity_record(kind),
            "goto",
            before.record if before else None,
            new.record if new else None,
        ),
    ):
        if old_chain != new_chain:
            if old_chain is not None:
                sink.delete(container, key)
            if new_chain is not None:
                sink.add(container, key, _verdict(verdict, new_chain))
    old_canonical = before.canonical if before else None
    new_canonical = new.canonical if new else None
    if old_canonical != new_canonical:
        if old_canonical is not None:
            _delete_canonical(sink, names, kind, key)
        if new_canonical is not None:
            _add_canonical(sink, names, kind, key, new_canonical)
    return HeldFrontend.of(new, main, short) if new is not None else None


def _add_canonical(
    sink: ElementSink, names: GenNames, kind: Kind, key: Key, canonical: Key
) -> None:
    """A frontend's elements in the affinity-canonical maps: its cluster IP (and, for a
    NodePort, its Service port; see :attr:`Frontend.canonical`)."""
    sink.add(names.affinity_canonical(kind), key, canonical[:1])
    if kind == Kind.NODEPORT:
        sink.add(names.affinity_canonical_ports, key, canonical[1:])


def _delete_canonical(sink: ElementSink, names: GenNames, kind: Kind, key: Key) -> None:
    sink.delete(names.affinity_canonical(kind), key)
    if kind == Kind.NODEPORT:
        sink.delete(names.affinity_canonical_ports, key)


@functools.lru_cache(maxsize=4096)
def _verdict(verb: str, chain: str) -> tuple[str]:
    """An affinity verdict element's value: one tuple for every frontend of the chains
    ports share (the frontend-keyed maps'), not one per element."""
    return (f"{verb} {chain}",)


def write_frontend(
    sink: BulkSink, names: GenNames, numbers: Mapping[ClassSpec, int] | None, fe: Frontend
) -> Held:
    """Queue the elements of a frontend the kernel does not hold: what
    :func:`diff_frontend` queues for it against nothing, in the same order, with each
    list of slots queued in one call (:meth:`FrontendWriter.write`, for one frontend)."""
    return FrontendWriter(sink, names, numbers).write(fe)


_Packing = tuple[ContainerTypes, SlotPacker]


class FrontendWriter:
    """Queues the elements of frontends the kernel does not hold (every frontend of a
    full sync) into one sink: what :func:`diff_frontend` queues for each against
    nothing, in the same order, with each list of slots queued in one call, packed.

    Why a path of its own: a full sync has nothing to diff against, and at 30k Services
    x 10 endpoints :func:`diff_frontend` against nothing, its slot by slot
    :func:`diff_slots` and the sink's call per element were a fifth of the backend's
    part of a full sync (cProfile). Why an object: what every frontend of a class, or of
    a slots map, looks up (its class's containers, the slots map's name, its types and
    packer) is looked up once per writer, not once per frontend (the class bits of a
    frontend were a set difference of two sets a frontend). It lives for one sync's
    writing: the class numbers and the sink's packed containers do not change
    meanwhile. The comparison in ``tests/test_nft_diff.py`` and the bytes of
    ``tests/test_nft_sync_bytes.py`` keep the two paths the same."""

    __slots__ = ("_classes", "_names", "_numbers", "_sink", "_slots")

    def __init__(
        self, sink: BulkSink, names: GenNames, numbers: Mapping[ClassSpec, int] | None
    ) -> None:
        self._sink = sink
        self._names = names
        self._numbers = numbers
        self._classes: dict[tuple[Kind, ClassSpec], tuple[str, tuple[str, ...]]] = {}
        self._slots: dict[tuple[Kind, bool, str, int], tuple[str, _Packing | None]] = {}

    def _class(self, kind: Kind, cls: ClassSpec) -> tuple[str, tuple[str, ...]]:
        """The dispatch set a frontend of class ``cls`` joins, and its class set (one
        rule per class) or the class-bit sets of its number (in :func:`diff_class`'s
        order)."""
        names, numbers = self._names, self._numbers
        if numbers is None:
            members: tuple[str, ...] = (names.cls(cls),)
        else:
            members = tuple(names.class_bit(kind, bit) for bit in set(class_bits(numbers[cls])))
        found = self._classes[kind, cls] = (names.dispatch(kind), members)
        return found

    def _slots_of(
        self, kind: Kind, shortcut: bool, proto: str, count: int
    ) -> tuple[str, _Packing | None]:
        """The slots map of a list of ``count`` endpoints, its types and its packer (None
        when the sink takes its elements as text only)."""
        container = self._names.slots(kind, shortcut, proto, count)
        types = self._sink.types.get(container)
        packing = None
        if types is not None:
            try:
                packing = (types, slot_packer(types))
            except ValueError:
                packing = None
        found = self._slots[kind, shortcut, proto, count] = (container, packing)
        return found

    def _queue_slots(
        self, kind: Kind, shortcut: bool, proto: str, key: Key, endpoints: tuple[str, ...]
    ) -> None:
        """Queue one list of a frontend's slots into its slots map."""
        found = self._slots.get((kind, shortcut, proto, len(endpoints)))
        container, packing = found or self._slots_of(kind, shortcut, proto, len(endpoints))
        _write_slots(self._sink, container, packing, key, endpoints)

    def write(self, fe: Frontend) -> Held:
        """Queue frontend ``fe``'s elements; what the kernel then holds of it."""
        sink, names = self._sink, self._names
        key, kind, cls, name = fe.key, fe.kind, fe.cls, fe.name
        if cls is not None:
            dispatch, members = self._classes.get((kind, cls)) or self._class(kind, cls)
            sink.add(dispatch, key, comment=name)
            for member in members:
                sink.add(member, key)
        proto = key[1] if kind == Kind.IP else key[0]
        if fe.endpoints:
            self._queue_slots(kind, False, proto, key, fe.endpoints)
        if fe.shortcut:
            self._queue_slots(kind, True, proto, key, fe.shortcut)
        if fe.no_endpoint is not None:
            sink.add(names.no_endpoint(kind, fe.no_endpoint), key, comment=name)
        if fe.lookup is not None:
            sink.add(names.affinity_lookup(kind, False), key, _verdict("jump", fe.lookup))
        if fe.shortcut_lookup is not None:
            sink.add(names.affinity_lookup(kind, True), key, _verdict("jump", fe.shortcut_lookup))
        if fe.record is not None:
            sink.add(names.affinity_record(kind), key, _verdict("goto", fe.record))
        if fe.canonical is not None:
            _add_canonical(sink, names, kind, key, fe.canonical)
        return fe  # its slots are its endpoints (HeldFrontend.of)


_SPLIT_PORT = operator.methodcaller("rpartition", ":")


def _write_slots(
    sink: BulkSink,
    container: str,
    packing: _Packing | None,
    key: Key,
    endpoints: tuple[str, ...],
) -> None:
    """Queue a frontend's slots: packed (``packing``: the map's types and packer), or
    as text when the sink takes text only or the packer refuses a part (then refused
    at the commit naming the element, as ever)."""
    if packing is not None:
        types, packer = packing
        try:
            elements = packer(key, endpoints)
        except ValueError:
            pass
        else:
            sink.add_all(container, EncodedPairs(elements, types))
            return
    texts: Iterable[str] = _SLOT_TEXTS
    if len(endpoints) > len(_SLOT_TEXTS):
        texts = map(_slot_text, itertools.count())
    if endpoints[0].startswith("["):  # IPv6: every endpoint of a frontend is
        values: Iterable[Key] = map(endpoint_value, endpoints)
    else:
        # IPv4: endpoint_value without a call per endpoint (the split is C's).
        values = [(host, port) for host, _colon, port in map(_SPLIT_PORT, endpoints)]
    sink.add_all(
        container,
        [((*key, text), value) for text, value in zip(texts, values, strict=False)],
    )


def diff_slots(
    sink: ElementSink,
    names: GenNames,
    kind: Kind,
    shortcut: bool,
    proto: str,
    key: Key,
    old: tuple[str, ...],
    endpoints: tuple[str, ...],
) -> tuple[str, ...]:
    """Queue the slot changes that turn endpoint slots ``old`` into ``endpoints``; the
    slots then held."""
    if old == endpoints:
        return old
    before = names.slots(kind, shortcut, proto, len(old)) if old else None
    container = names.slots(kind, shortcut, proto, len(endpoints)) if endpoints else None
    if before != container:
        # A new frontend (every frontend of a full sync), one gone, or one whose count
        # moved to another bucket: all its slots, in order.
        if before is not None:
            for index in range(len(old)):
                sink.delete(before, (*key, _slot_text(index)))
        if container is not None:
            for index, endpoint in enumerate(endpoints):
                sink.add(container, (*key, _slot_text(index)), endpoint_value(endpoint))
        return endpoints
    assert container is not None
    slots = restitch(old, endpoints)
    if slots == old:
        return old
    for index in range(max(len(old), len(slots))):
        was = old[index] if index < len(old) else None
        now = slots[index] if index < len(slots) else None
        if was == now:
            continue
        slot = (*key, _slot_text(index))
        if was is not None:
            sink.delete(container, slot)
        if now is not None:
            sink.add(container, slot, endpoint_value(now))
    return slots


def diff_firewall(
    sink: ElementSink,
    names: GenNames,
    old_fw: Mapping[Key, tuple[str, ...]],
    new_fw: Mapping[Key, tuple[str, ...]],
    *,
    adding: bool,
) -> None:
    """Queue the firewall additions (``adding``) or deletions that turn the source
    ranges ``old_fw`` (frontend -> allowed sources) into ``new_fw``. The additions go
    before the frontends' changes and the deletions after them, so a load balancer is
    never reachable without its ranges."""
    for key in sorted(old_fw.keys() | new_fw.keys()):
        before, after = old_fw.get(key, ()), new_fw.get(key, ())
        if before == after:
            continue
        vip, proto, port = key  # each protocol's sources have a set of their own
        if adding:
            if after and not before:
                sink.add(names.firewall_ips, key)
            for source in after:
                if source not in before:
                    sink.add(names.firewall_allow(proto), (vip, port, source))
            continue
        if before and not after:
            sink.delete(names.firewall_ips, key)
        for source in before:
            if source not in after:
                sink.delete(names.firewall_allow(proto), (vip, port, source))


def add_shared(
    sink: ElementSink, names: GenNames, counts: SharedCounts, plan: PortPlan, *, full: bool
) -> None:
    """Count the shared elements of a port's plan in, queueing those new to the kernel.

    On a full sync (``full``) ``cluster-ips`` and the affinity's local endpoints are
    refilled by the switch (outside generations), not element by element.
    """
    hairpin = counts.hairpin
    assert hairpin is not None, "counted first: Generation.count_hairpin"
    for host in plan.hairpin:
        if count_in(hairpin, host):
            sink.add(names.hairpin, (host, host))
    if count_in(counts.cluster_ips, plan.cluster_ip) and not full:
        sink.add(Names.CLUSTER_IPS, (plan.cluster_ip,))
    for member in plan.affinity.local_members if plan.affinity is not None else ():
        if count_in(counts.local_members, member) and not full:
            sink.add(AFFINITY_LOCAL_ENDPOINTS, member)


def add_shared_new(
    sink: BulkSink,
    names: GenNames,
    counts: SharedCounts,
    plan: PortPlan,
    previous: tuple[str, ...] = (),
) -> None:
    """:func:`add_shared` on a full sync (``full``), the new hairpin elements of the port
    queued in one call, and counted without a call per endpoint (:func:`count_in`
    inlined: at 30k Services x 10 endpoints, 330k calls, 0.3 s of a 7.5 s profile).

    Uncounted hairpin (``counts.hairpin`` None, a full sync's: see
    :class:`~.generation.SharedCounts`): every address of the port is queued, but for a
    port whose addresses are the very tuple of the port before (``previous``: the ports
    of one Service over the same endpoints); an address two Services share is queued
    once by each, which the kernel takes as one element (an ``add`` of an element it
    holds, without ``NLM_F_EXCL``, changes nothing)."""
    hairpin = counts.hairpin
    fresh: Sequence[str]
    if hairpin is None:
        fresh = () if plan.hairpin is previous else plan.hairpin
    else:
        fresh = []
        for host in plan.hairpin:
            held = hairpin.get(host, 0)
            hairpin[host] = held + 1
            if not held:
                fresh.append(host)
    if fresh:
        container = names.hairpin
        types = sink.types.get(container)
        if types is not None:
            try:
                sink.add_all(container, pair_elements(types, fresh))
            except ValueError:
                types = None  # queued as text: refused at the commit, naming the element
        if types is None:
            sink.add_all(container, [((host, host), _VALUE_NONE) for host in fresh])
    count_in(counts.cluster_ips, plan.cluster_ip)
    for member in plan.affinity.local_members if plan.affinity is not None else ():
        count_in(counts.local_members, member)


def release_shared(
    sink: ElementSink, names: GenNames, counts: SharedCounts, old: PortState
) -> None:
    """Count a port's former shared elements out, queueing the deletion of those no port
    holds any more."""
    hairpin = counts.hairpin
    assert hairpin is not None, "counted first: Generation.count_hairpin"
    for host in old.hairpin:
        if count_out(hairpin, host):
            sink.delete(names.hairpin, (host, host))
    if count_out(counts.cluster_ips, old.cluster_ip):
        sink.delete(Names.CLUSTER_IPS, (old.cluster_ip,))
    for member in old.affinity.local_members if old.affinity is not None else ():
        if count_out(counts.local_members, member):
            sink.delete(AFFINITY_LOCAL_ENDPOINTS, member)
