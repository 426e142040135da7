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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kubeproxy.backends.nftables.explain import FakeSource, FrontendView, TableView
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.layout import generation_of
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.backends.nftables.reader import TableReader

__all__ = ["Difference", "compare", "notes", "verify_tables"]

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
    out: list[Difference] = []
    newer = [g for g in have.generations if g > have.generation]
    if newer:
        out.append(
            Difference(
                table,
                f"stale generation: new connections use generation {have.generation}, the"
                f" table holds generation {max(newer)} too (a switch that did not finish)",
            )
        )
    held = _frontends(have)
    for fkey, fe in expected.items():
        subject = fe.name or "?"
        found = held.get(fkey)
        if found is None:
            out.append(Difference(subject, f"{fe.address}: missing ({fe.what})"))
            continue
        out.extend(Difference(subject, d) for d in _frontend_differences(fe, found))
    for fkey, fe in held.items():
        if fkey not in expected:
            what = f"{fe.address}: extra, the objects have no such frontend"
            out.append(Difference(fe.name or "?", what))
    return sorted(out)


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


def verify_tables(
    fakes: Sequence[FakeNft], families: Sequence[Family], *, netns: str | None = None
) -> tuple[list[Difference], list[str]]:
    """The differences (and :func:`notes`) between the kernel's tables of ``families``
    in ``netns`` and what ``fakes`` hold (what the proxy would write)."""
    differences: list[Difference] = []
    found_notes: list[str] = []
    with TableReader(netns) as reader:
        for family in families:
            want = next((FakeSource(f) for f in fakes if FakeSource(f).exists(family)), None)
            have = TableView(reader, family)
            if want is None:
                if have.generation is not None:
                    found_notes.append(f"table {family} kube-proxy: the proxy would not write it")
                continue
            differences.extend(compare(TableView(want, family), have))
            found_notes.extend(notes(have))
    return differences, found_notes
