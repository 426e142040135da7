"""Comparing the kernel's table with what the proxy would write: ``kubeproxy verify``.

What the node should hold is not computed here: the caller runs the proxy itself (its
sources, trackers, core and this backend) into a :class:`~.fake.FakeNft` (``--dry-run``),
and both tables are explained alike (:class:`~.explain.TableView`), so the comparison is
in Service terms and blind to what may rightly differ between two correct tables
(generation numbers, which slot an endpoint holds, class numbers).

A difference is one line per Service: a frontend missing or extra, a different class,
endpoints missing or extra (and slots the kernel lacks), a no-endpoint verdict, source
ranges, an affinity timeout, a Service name; and for the table, a live generation that
is not the newest (a switch that did not finish). Generations older than the live one
are left for a while by design (deleted a second later, at the next sync) and are
reported as notes, not differences.

Two ways to the same differences. :func:`compare` explains every frontend of both
tables (:class:`~.explain.TableView`) and compares the explanations: what a
:class:`~.fake.FakeNft` dry run is compared with. :func:`compare_written` is what
``kubeproxy verify`` and ``/debug/verify`` use, for the backend's writes recorded as
plain data (:class:`~.written.WrittenTable`): it compares each container of the live
generation as a set of elements in the kernel's own encoding (bytes: a C-speed set
difference, nothing decoded), maps each element that differs back to its frontend,
and explains only those frontends, both sides, as :func:`compare` does; so the
differences are the same, in the same words. The class of a frontend is compared
through each table's own class numbers (each side's dispatch tree walked for the
numbers in use), so two tables that number their classes differently still agree;
which slot an endpoint holds may differ (a frontend whose slots differ is explained,
and agrees). It also compares the rules of every chain the backend writes but the
dispatch tree's (class and pick chains, the fixed chains), and the sets outside the
frontends (cluster IPs, NodePort addresses, hairpin and affinity's local endpoints),
which :func:`compare` does not read. ``bench/verify.py`` measures both side by side.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from kubeproxy.backends.nftables.declarations import Declaration
from kubeproxy.backends.nftables.elements import element_encoder
from kubeproxy.backends.nftables.explain import (
    FakeSource,
    FrontendView,
    TableSource,
    TableView,
    parse_class,
)
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.frontends import Kind
from kubeproxy.backends.nftables.layout import SLOT_PROTOCOLS, generation_of
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.reader import Item, RuleRefs, TableReader
from kubeproxy.backends.nftables.written import WrittenSource, WrittenTable, blob_types

__all__ = ["PROBE_OVER", "Difference", "compare", "compare_written", "notes", "verify_tables"]

Key = tuple[str, ...]


@dataclass(frozen=True, slots=True, order=True)
class Difference:
    """One way the kernel differs: whose (a Service port's name, or the table), what."""

    subject: str
    what: str

    def __str__(self) -> str:
        return f"{self.subject}: {self.what}"


def _frontends(view: TableView) -> dict[tuple[str, Key], FrontendView]:
    """Every frontend explained. Every container of the live generation is dumped
    first, so each fact is then answered from the dumps: asking the kernel one
    element at a time took 28 s for 10k Services (about 15 questions a frontend), the
    dumps a fraction of it (README "Reading the table back")."""
    if view.generation is not None:
        for name in view.declarations:
            if generation_of(name) in (None, view.generation):
                view.dump(name)
    return {
        (str(kind), key): view.explain(kind, key, name)
        for kind, key, name in view.frontends_named(lambda _comment: True)
    }


def _listed(values: Iterable[str | None]) -> str:
    return ", ".join(sorted(v for v in values if v is not None)) or "none"


def _endpoint_differences(label: str, want: FrontendView, have: FrontendView) -> Iterable[str]:
    for what, wanted, held in (
        ("endpoints", want.endpoints, have.endpoints),
        ("short-circuit endpoints", want.shortcut, have.shortcut),
    ):
        empty = [str(slot) for slot, value in enumerate(held) if value is None]
        if empty:
            yield f"{label}: {what}: the kernel lacks slot(s) {', '.join(empty)}"
        missing = {v for v in wanted if v is not None} - set(held)
        extra = {v for v in held if v is not None} - set(wanted)
        if missing:
            yield f"{label}: {what}: missing {_listed(missing)}"
        if extra:
            yield f"{label}: {what}: extra {_listed(extra)}"


def _frontend_differences(want: FrontendView, have: FrontendView) -> Iterable[str]:
    label = have.address
    if want.name != have.name:
        yield f"{label}: named {have.name!r}, should be {want.name!r}"
    if want.cls != have.cls:
        yield (
            f"{label}: class {have.chain or 'none (not dispatched)'}: {have.what}; "
            f"should be {want.what}"
        )
    yield from _endpoint_differences(label, want, have)
    if want.no_endpoint != have.no_endpoint:
        yield (
            f"{label}: no-endpoint verdict {have.no_endpoint or 'none'},"
            f" should be {want.no_endpoint or 'none'}"
        )
    if want.source_ranges != have.source_ranges:
        held = "apply" if have.source_ranges else "do not apply"
        yield f"{label}: source ranges {held} in the kernel"
    if want.affinity_timeout_s != have.affinity_timeout_s:
        yield (
            f"{label}: affinity timeout {have.affinity_timeout_s} s,"
            f" should be {want.affinity_timeout_s} s"
        )


def compare(want: TableView, have: TableView) -> list[Difference]:
    """Every difference between the table the proxy would write (``want``) and the
    kernel's (``have``), one family, sorted by Service."""
    table = f"table {have.family} kube-proxy"
    expected = _frontends(want)
    if have.generation is None:
        if expected:
            return [Difference(table, "not there, or nothing dispatches from it")]
        return []
    out = _stale_generation(have)
    held = _frontends(have)
    for fkey, fe in expected.items():
        found = held.get(fkey)
        if found is None:
            out.append(_missing(fe))
            continue
        out.extend(Difference(fe.name or "?", d) for d in _frontend_differences(fe, found))
    out.extend(_extra(fe) for fkey, fe in held.items() if fkey not in expected)
    return sorted(out)


def _stale_generation(have: TableView) -> list[Difference]:
    """The difference a newer generation beside the live one is (a switch that did not
    finish), as a list to extend."""
    newer = [g for g in have.generations if have.generation is not None and g > have.generation]
    if not newer:
        return []
    what = (
        f"stale generation: new connections use generation {have.generation}, the"
        f" table holds generation {max(newer)} too (a switch that did not finish)"
    )
    return [Difference(f"table {have.family} kube-proxy", what)]


def _missing(want: FrontendView) -> Difference:
    """A frontend the objects ask for that the kernel lacks."""
    return Difference(want.name or "?", f"{want.address}: missing ({want.what})")


def _extra(have: FrontendView) -> Difference:
    """A frontend the kernel holds that the objects do not ask for."""
    return Difference(have.name or "?", f"{have.address}: extra, the objects have no such frontend")


def notes(have: TableView) -> list[str]:
    """What is not a difference but worth a line (older generations not yet deleted)."""
    if have.generation is None:
        return []
    older = [g for g in have.generations if g < have.generation]
    if not older:
        return []
    return [
        f"table {have.family} kube-proxy: generation(s) {', '.join(map(str, older))} still"
        f" held beside the live {have.generation} (deleted at a later sync)"
    ]


class BlobSource(TableSource, Protocol):
    """A :class:`~.explain.TableSource` that also gives a container's elements as the
    kernel dumps them: the kernel (:class:`~.reader.TableReader`) or what the backend
    wrote (:class:`~.written.WrittenSource`)."""

    def element_blobs(self, family: Family, name: str, declaration: Declaration) -> list[bytes]:
        """Every element of ``name``, each its ``NFTA_LIST_ELEM`` attribute's bytes."""
        ...

    def probe_blobs(
        self, family: Family, name: str, declaration: Declaration, elements: Sequence[bytes]
    ) -> list[bytes]:
        """The elements of ``name`` with the keys of ``elements`` (as
        :meth:`element_blobs`)."""
        ...


PROBE_OVER: Final = 100_000
"""Elements beyond which a container is read by asking for the wanted keys, not dumped
(:meth:`~.reader.TableReader.probe_blobs` says why: a dump costs the square of a hash
set's size). What such a container holds beyond the wanted keys is not seen: nothing
reads an endpoint slot beyond its frontend's count, or a hairpin pair no endpoint has."""
_DUMP_OVER: Final = 2000
"""Frontends to explain beyond which the kernel's live generation is dumped first (about
15 single-element gets a frontend otherwise: :func:`compare` measured both ways), but
the containers of more than :data:`PROBE_OVER` elements."""
_SHOWN: Final = 5
"""Elements named in one line about a set outside the frontends (the rest counted)."""
_TREE: Final = re.compile(r"dispatch-(ips|nodeports)-([0-9]+)\.g[0-9]+")
_BIT: Final = re.compile(r"class-bit-(ips|nodeports)-([0-9]+)\.g[0-9]+")
_KINDS: Final = {"ips": Kind.IP, "nodeports": Kind.NODEPORT}
_OUTSIDE_FRONTENDS: Final = ("hairpin-endpoints.g",)
"""Containers of a generation whose elements are not keyed by a frontend."""
_NOT_COMPARED: Final = ("firewall-allow-",)
"""Containers left out: source ranges are ranges, which a dump gives as their start
only (whether they apply is compared per frontend, ``firewall-ips``)."""
Frontend = tuple[Kind, Key]
Rename = Callable[[str], str]
"""A name of the wanted table's generation as the kernel's generation has it."""


class _Side:
    """One table read for :func:`compare_written`: its view (what is explained), and
    its containers' elements as bytes, each read once."""

    def __init__(self, source: BlobSource, family: Family) -> None:
        self.source = source
        self.family = family
        self.view = TableView(source, family)
        self.blobs: dict[str, set[bytes]] = {}

    def element_set(self, name: str) -> set[bytes]:
        found = self.blobs.get(name)
        if found is None:
            declaration = self.view.declarations[name]
            found = self.blobs[name] = set(
                self.source.element_blobs(self.family, name, declaration)
            )
        return found

    def keys(self, name: str) -> Collection[Key]:
        """The keys of a container's elements (what the backend wrote: no
        :class:`~.reader.Item` made for them)."""
        if isinstance(self.source, WrittenSource):
            return self.source.keys(self.family, name)
        return self.view.dump(name).keys()

    def rules(self, chain: str) -> list[RuleRefs] | None:
        """``chain``'s rules, None when there is no such chain."""
        try:
            return self.view.rules(chain)
        except NftError as err:
            if err.errno == errno.ENOENT:
                return None
            raise

    def class_of_numbers(self, kind: Kind) -> dict[int, str | None]:
        """The class chain (its name without generation) each class number of the
        dispatch tree reaches, walked as the kernel walks it (a frontend's membership in
        bit set ``b`` is bit ``b`` of its number), for every number a tree chain is named
        after."""
        names = self.view.names
        numbers: set[int] = {0}
        pending = [names.tree(kind, 0)]
        seen: set[str] = set()
        while pending:
            chain = pending.pop()
            if chain in seen:
                continue
            seen.add(chain)
            for rule in self.rules(chain) or ():
                target = rule.target
                found = _TREE.fullmatch(target or "")
                if found is not None and _KINDS[found[1]] == kind:
                    numbers.add(int(found[2]))
                    pending.append(str(target))
        return {n: self._walk(kind, n) for n in numbers}

    def _walk(self, kind: Kind, number: int) -> str | None:
        """:meth:`~.explain.TableView.class_chain`'s walk, for a class number rather
        than a frontend's membership in the bit sets."""
        chain = self.view.names.tree(kind, 0)
        for _depth in range(64):
            for rule in self.rules(chain) or ():
                target = rule.target
                if target is None:
                    continue
                if not rule.lookups:
                    return _stem(target) if parse_class(target) else None
                bit = _BIT.fullmatch(rule.lookups[0])
                if bit is not None and _KINDS[bit[1]] == kind and number >> int(bit[2]) & 1:
                    chain = target
                    break
            else:
                return None
        return None


def _stem(name: str) -> str:
    """A name without its generation suffix."""
    return re.sub(r"\.g[0-9]+$", "", name)


def _frontend_of(key: Key) -> Frontend:
    """The frontend an element of a frontend-keyed container belongs to."""
    if key[0] in SLOT_PROTOCOLS:
        return Kind.NODEPORT, key[:2]
    return Kind.IP, key[:3]


def _item_text(item: Item) -> str:
    text = " . ".join(item.key)
    if item.value:
        text += " : " + " ".join(item.value)
    return text


def _listed_items(items: Iterable[Item]) -> str:
    texts = sorted(_item_text(i) for i in items)
    more = f" and {len(texts) - _SHOWN} more" if len(texts) > _SHOWN else ""
    return ", ".join(texts[:_SHOWN]) + more


def _decoded(side: _Side, name: str, rename: Rename) -> set[Item]:
    """A container's elements decoded, verdicts naming the other side's generation."""
    items = side.source.elements(side.family, name, side.view.declarations[name])
    return {
        Item(i.key, tuple(rename(v) for v in i.value), i.comment) for i in items if not i.expires_ms
    }


def _differing(
    want: _Side, have: _Side, name: str, have_name: str, rename: Rename
) -> tuple[list[Item], list[Item]]:
    """The elements of container ``name`` (``have_name`` in the kernel) that the kernel
    lacks, and those it holds beyond; decoded, only these."""
    want_decl = want.view.declarations[name]
    have_decl = have.view.declarations[have_name]
    types = blob_types(want_decl)
    if types is not None and blob_types(have_decl) == types:
        wanted = want.element_set(name)
        if len(wanted) > PROBE_OVER:
            asked = list(wanted)
            held = set(have.source.probe_blobs(have.family, have_name, have_decl, asked))
        else:
            held = have.element_set(have_name)
        if wanted == held:
            return [], []
        decode = TableReader.decode_blobs
        return decode(want_decl, list(wanted - held)), decode(have_decl, list(held - wanted))
    wanted_items = _decoded(want, name, rename)
    held_items = _decoded(have, have_name, lambda v: v)
    return list(wanted_items - held_items), list(held_items - wanted_items)


def _class_bits(
    want: _Side, have: _Side, kind: Kind, dirty: set[Frontend], rename: Rename
) -> Iterable[str]:
    """Compare the class of every dispatched frontend of ``kind`` through each side's
    own class numbers: the kernel's bit sets against what they hold when the wanted
    classes get the kernel's numbers. Frontends whose bits differ (or whose class the
    kernel's tree does not reach) go to ``dirty``; yields the bit sets the kernel lacks."""
    wnames, hnames = want.view.names, have.view.names
    wanted_number: dict[Key, int] = {}
    bit = 0
    while want.view.has(wnames.class_bit(kind, bit)):
        for key in want.keys(wnames.class_bit(kind, bit)):
            wanted_number[key] = wanted_number.get(key, 0) | 1 << bit
        bit += 1
    want_classes = want.class_of_numbers(kind)
    have_numbers: dict[str, int] = {}
    for held_number, held_class in sorted(have.class_of_numbers(kind).items(), reverse=True):
        if held_class is not None:
            have_numbers[held_class] = held_number
    expected: dict[int, list[Key]] = {}
    for key in want.keys(wnames.dispatch(kind)):
        cls = want_classes.get(wanted_number.get(key, 0))
        number = have_numbers.get(cls) if cls is not None else None
        if number is None:
            dirty.add((kind, key))
            continue
        for b in range(number.bit_length()):
            if number >> b & 1:
                expected.setdefault(b, []).append(key)
    depth = 0
    while have.view.has(hnames.class_bit(kind, depth)):
        depth += 1
    for b in set(expected) | set(range(depth)):
        name = hnames.class_bit(kind, b)
        if name not in have.view.declarations:
            dirty.update((kind, key) for key in expected.get(b, ()))
            yield name
            continue
        declaration = have.view.declarations[name]
        types = blob_types(declaration)
        if types is None:
            continue
        encode = element_encoder(*types, dumped=True)
        try:
            wanted = {encode(key, ()) for key in expected.get(b, ())}
        except ValueError:
            dirty.update((kind, key) for key in expected.get(b, ()))
            continue
        held = have.element_set(name)
        if wanted != held:
            decode = TableReader.decode_blobs
            for item in decode(declaration, list(wanted ^ held)):
                dirty.add((kind, item.key))


def _refs(refs: Sequence[RuleRefs], rename: Rename) -> list[tuple[Any, ...]]:
    """What a chain's rules refer to, comparable across generations and between rules
    the kernel holds and rules written as text (anonymous sets left out)."""
    return [
        (
            tuple(rename(name) for name in r.lookups if not name.startswith("__")),
            tuple(rename(chain) for _verb, chain in r.verdicts if chain),
            rename(r.updates) if r.updates else None,
            r.timeout_s,
        )
        for r in refs
    ]


def _rule_text(refs: tuple[Any, ...]) -> str:
    lookups, targets, updates, timeout = refs
    words = [f"@{name}" for name in lookups] + [f"to {chain}" for chain in targets]
    if updates:
        words.append(f"update @{updates}" + (f" timeout {timeout}s" if timeout else ""))
    return " ".join(words) or "no set or chain named"


def _chain_differences(want: _Side, have: _Side, rename: Rename) -> Iterable[str]:
    """Every chain the backend writes (but the dispatch tree's: checked by walking it),
    compared rule by rule by what each rule refers to."""
    source = want.source
    assert isinstance(source, WrittenSource)
    for chain in source.chain_names(want.family):
        if _TREE.fullmatch(chain):
            continue
        wanted = _refs(want.view.rules(chain), rename)
        held_refs = have.rules(rename(chain))
        if held_refs is None:
            yield f"chain {rename(chain)}: missing"
            continue
        held = _refs(held_refs, lambda name: name)
        if wanted == held:
            continue
        first = next(
            (i for i, (w, h) in enumerate(zip(wanted, held, strict=False)) if w != h),
            min(len(wanted), len(held)),
        )
        if first < min(len(wanted), len(held)):
            yield (
                f"chain {rename(chain)}: rule {first + 1} refers to {_rule_text(held[first])},"
                f" should refer to {_rule_text(wanted[first])}"
            )
        else:
            yield f"chain {rename(chain)}: {len(held)} rule(s), should be {len(wanted)}"


def _named(side: _Side, frontend: Frontend) -> tuple[bool, str | None]:
    """Whether ``frontend`` has an element in the named containers, and its comment."""
    kind, key = frontend
    for k, container, _verdict in side.view.named_containers():
        if k == kind and (item := side.view.get(container, key)) is not None:
            return True, item.comment
    return False, None


def compare_written(
    want_source: BlobSource, have_source: BlobSource, family: Family
) -> list[Difference]:
    """Every difference between what the backend wrote (``want_source``, a
    :class:`~.written.WrittenSource`) and the kernel's table (``have_source``), one
    family, sorted by Service: :func:`compare`'s, found by comparing elements as bytes
    and explaining only the frontends whose elements differ (see the module
    documentation), with the chains' rules and the sets outside the frontends."""
    table = f"table {family} kube-proxy"
    want, have = _Side(want_source, family), _Side(have_source, family)
    if have.view.generation is None:
        wanted = any(
            any(True for _key in want.keys(container))
            for _k, container, _v in want.view.named_containers()
            if want.view.has(container)
        )
        return [Difference(table, "not there, or nothing dispatches from it")] if wanted else []
    out = _stale_generation(have.view)
    want_suffix = f".g{want.view.generation}" if want.view.generation is not None else None
    have_suffix = f".g{have.view.generation}"

    def rename(name: str) -> str:
        if want_suffix is not None and name.endswith(want_suffix):
            return name[: -len(want_suffix)] + have_suffix
        return name

    dirty: set[Frontend] = set()
    for name in want.view.declarations:
        generation = generation_of(name)
        if generation is not None and generation != want.view.generation:
            continue
        if _BIT.fullmatch(name) or name.startswith(_NOT_COMPARED):
            continue
        declaration = want.view.declarations[name]
        if declaration.timeout is not None or "timeout" in declaration.flags:
            continue  # affinity entries: what packets wrote, not the proxy
        have_name = rename(name)
        keyed = generation is not None and not name.startswith(_OUTSIDE_FRONTENDS)
        if have_name not in have.view.declarations:
            keys = list(want.keys(name))
            if keys:
                out.append(Difference(table, f"set {have_name}: missing"))
                if keyed:
                    dirty.update(_frontend_of(k) for k in keys)
            continue
        missing, extra = _differing(want, have, name, have_name, rename)
        if keyed:
            dirty.update(_frontend_of(i.key) for i in (*missing, *extra))
            continue
        if missing:
            out.append(Difference(table, f"set {have_name}: missing {_listed_items(missing)}"))
        if extra:
            out.append(Difference(table, f"set {have_name}: extra {_listed_items(extra)}"))
    for kind in (Kind.IP, Kind.NODEPORT):
        for name in _class_bits(want, have, kind, dirty, rename):
            out.append(Difference(table, f"set {name}: missing"))
    out.extend(Difference(table, what) for what in _chain_differences(want, have, rename))
    if len(dirty) > _DUMP_OVER:
        for name in want.view.declarations:
            kernel_name = rename(name)
            big = len(want.keys(name)) > PROBE_OVER  # asked for one by one still
            live = generation_of(name) == want.view.generation
            if live and have.view.has(kernel_name) and not big:
                have.view.dump(kernel_name)
    for frontend in sorted(dirty):
        kind, key = frontend
        (wanted, wanted_name), (held, held_name) = _named(want, frontend), _named(have, frontend)
        if not held:
            if wanted:
                out.append(_missing(want.view.explain(kind, key, wanted_name)))
            continue
        found = have.view.explain(kind, key, held_name)
        if not wanted:
            out.append(_extra(found))
            continue
        fe = want.view.explain(kind, key, wanted_name)
        out.extend(Difference(fe.name or "?", d) for d in _frontend_differences(fe, found))
    return sorted(out)


def verify_tables(
    fakes: Sequence[FakeNft | WrittenTable],
    families: Sequence[Family],
    *,
    netns: str | None = None,
) -> tuple[list[Difference], list[str]]:
    """The differences (and :func:`notes`) between the kernel's tables of ``families``
    in ``netns`` and what ``fakes`` hold (what the proxy would write): by
    :func:`compare_written` for a :class:`~.written.WrittenTable`, by :func:`compare`
    for a :class:`~.fake.FakeNft`."""
    differences: list[Difference] = []
    found_notes: list[str] = []
    with TableReader(netns) as reader:
        for family in families:
            have = TableView(reader, family)
            for fake in fakes:
                if isinstance(fake, WrittenTable):
                    if fake.table(family) is None:
                        continue
                    differences.extend(compare_written(WrittenSource(fake), reader, family))
                    break
                if FakeSource(fake).exists(family):
                    differences.extend(compare(TableView(FakeSource(fake), family), have))
                    break
            else:
                if have.generation is not None:
                    found_notes.append(f"table {family} kube-proxy: the proxy would not write it")
                continue
            found_notes.extend(notes(have))
    return differences, found_notes
