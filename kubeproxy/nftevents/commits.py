"""Commits: the relevant changes of one foreign commit, counted, and how to say what it did."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Protocol

from kubeproxy.nftevents.messages import Generation, ObjectChange
from kubeproxy.objects import IPFamily
from kubeproxy.selfheal import ChangeKind, ExternalChange

__all__ = ["Commit", "CommitAssembler", "Interest", "ObjectKey", "summarize"]


ObjectKey = tuple[str, str, str, str]
"""(op, family, table, name) of an :class:`ObjectChange`: what a :class:`Commit` counts."""


@dataclass(frozen=True, slots=True)
class Commit:
    """A foreign commit's changes that an :class:`Interest` found relevant, counted by
    (op, family, table, name); beyond ``CommitAssembler.keep`` distinct objects the name
    is left out (``""``), so a commit of any size costs bounded memory."""

    generation: int
    portid: int
    pid: int
    process: str
    counts: dict[ObjectKey, int]

    @property
    def author(self) -> str:
        """``nft (pid 1234)`` for log lines."""
        process = self.process or "unknown process"
        return f"{process} (pid {self.pid})" if self.pid else process


class CommitAssembler:
    """Groups the relevant changes of a commit, counted by object, until its ``NEWGEN``."""

    def __init__(self, keep: int = 1000) -> None:
        self.keep = keep
        self._counts: dict[ObjectKey, int] = {}

    @property
    def pending(self) -> bool:
        """Whether relevant changes wait for their ``NEWGEN``."""
        return bool(self._counts)

    def add(self, change: ObjectChange) -> None:
        """Count one relevant change."""
        key = (change.op, change.family, change.table, change.name)
        if key not in self._counts and len(self._counts) >= self.keep:
            key = (change.op, change.family, change.table, "")
        self._counts[key] = self._counts.get(key, 0) + 1

    def close(self, generation: Generation) -> Commit | None:
        """The commit ``generation`` ends (None when it held nothing relevant)."""
        counts, self._counts = self._counts, {}
        if not counts:
            return None
        return Commit(
            generation.generation, generation.portid, generation.pid, generation.process, counts
        )

    def discard(self) -> None:
        """Forget a commit (ours, or cut by lost messages)."""
        self._counts = {}


class Interest(Protocol):
    """What a watcher reports: which changes matter, and how to say what happened."""

    @property
    def what(self) -> str:
        """What is watched, for log lines (``tables ip/ip6 kube-proxy``)."""
        ...

    def relevant(self, change: ObjectChange) -> bool:
        """Whether a change (by someone else) concerns us. Called for every message."""
        ...

    def describe(self, commit: Commit) -> list[ExternalChange]:
        """What a foreign commit of relevant changes did to us (none: nothing to repair)."""
        ...


_KIND_OF_OP: Final = {
    "DELTABLE": ChangeKind.TABLE,
    "DELCHAIN": ChangeKind.CHAIN,
    "DELSET": ChangeKind.SET,
    "DELRULE": ChangeKind.RULE,
    "DELSETELEM": ChangeKind.ELEMENT,
    "DELOBJ": ChangeKind.OBJECT,
    "DELFLOWTABLE": ChangeKind.OBJECT,
}
# How a summary names what an op did, in the order it lists them (most serious first).
_PHRASES: Final = (
    ("DELTABLE", "table", "deleted", ""),
    ("DELCHAIN", "chain", "deleted", ""),
    ("DELSET", "set or map", "deleted", ""),
    ("DELRULE", "rule", "deleted", "in "),
    ("DELSETELEM", "element", "deleted", "from "),
    ("DELOBJ", "object", "deleted", ""),
    ("DELFLOWTABLE", "flowtable", "deleted", ""),
    ("NEWTABLE", "table", "added", ""),
    ("NEWCHAIN", "chain", "added", ""),
    ("NEWSET", "set or map", "added", ""),
    ("NEWRULE", "rule", "added", "in "),
    ("NEWSETELEM", "element", "added", "to "),
    ("NEWOBJ", "object", "added", ""),
    ("NEWFLOWTABLE", "flowtable", "added", ""),
)
_NAMES_SHOWN: Final = 3


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    more = len(names) - _NAMES_SHOWN
    return f"{shown} and {more} more" if more > 0 else shown


def summarize(commit: Commit, families: Mapping[str, IPFamily]) -> list[ExternalChange]:
    """One :class:`~kubeproxy.selfheal.ExternalChange` per IP family a foreign commit
    touched (``families`` maps nft family names, ``ip``/``ip6``, to them): its kind is the
    most serious thing done (a deleted table before a deleted chain ... before anything
    added), its detail lists what was done, with a few names, and who did it."""
    by_family: dict[IPFamily, dict[str, dict[str, int]]] = {}
    tables: dict[IPFamily, set[str]] = {}
    for (op, nft_family, table, name), count in commit.counts.items():
        family = families.get(nft_family)
        if family is None:
            continue
        tables.setdefault(family, set()).add(f"{nft_family} {table}")
        names = by_family.setdefault(family, {}).setdefault(op, {})
        names[name] = names.get(name, 0) + count
    changes = []
    for family in sorted(by_family, key=lambda f: f.value):
        ops = by_family[family]
        kind = next(
            (_KIND_OF_OP[op] for op, *_ in _PHRASES if op in ops and op in _KIND_OF_OP),
            ChangeKind.OTHER,
        )
        parts = []
        for op, noun, verb, preposition in _PHRASES:
            if op not in ops:
                continue
            total = sum(ops[op].values())
            named = sorted(n for n in ops[op] if n)
            plural = (
                noun if total == 1 else ("sets or maps" if noun == "set or map" else noun + "s")
            )
            where = f" ({preposition}{_names(named)})" if named else ""
            parts.append(f"{total} {plural} {verb}{where}")
        where = ", ".join(sorted(tables[family]))
        detail = (
            f"table {where}: {'; '.join(parts)}, by {commit.author} "
            f"(generation {commit.generation})"
        )
        changes.append(ExternalChange(kind, detail, family))
    return changes
