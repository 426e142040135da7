"""The objects of our table nothing uses any more: which, since when, and their deletion.

A full sync writes a new generation next to the current one and switches the fixed
chains over; the old generation (and what a process killed in the middle of a full sync
built, and a table left by another version, the per-Service-chain structure's chains and
maps included) is then unused, and so is a content-named affinity map or chain no port
uses after a sync. They are deleted :data:`STALE_DELAY` after they went unused (by the
daemon's :class:`~kubeproxy.backends.nftables.sweeper.StaleSweeper`, or at the first
sync from then on), in one transaction:
older kernels still count a chain as used right after its last reference went, and the
deletion order matters (a chain jumped to, a set looked up, cannot be deleted while a
rule or a verdict element refers to it).

Objects are :class:`TableObject` values (a kind and a name); ``str()`` of one is the
``chain NAME`` / ``set NAME`` text the backend used before, which :meth:`TableObject.parse`
reads back (the localhost NodePorts' :data:`~.localhost.OBJECT_NAMES` are such texts).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kubeproxy.backends.nftables.objects import Chain, NftError, Set
from kubeproxy.backends.nftables.table import Names
from kubeproxy.backends.nftables.transaction import Transaction

__all__ = [
    "STALE_DELAY",
    "ObjectKind",
    "StaleCollector",
    "TableObject",
    "deletion_order",
    "queue_deletion",
]

log = logging.getLogger("kubeproxy.backends.nftables.backend")

STALE_DELAY = 1.0
"""Seconds between the last reference to an object going and its deletion."""


class ObjectKind(enum.StrEnum):
    """The two kinds of named objects in our table (a map is a set to nft's ``delete``)."""

    CHAIN = "chain"
    SET = "set"


@dataclass(frozen=True, slots=True)
class TableObject:
    """One named object of our table: a chain, or a set or map."""

    kind: ObjectKind
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"

    @classmethod
    def parse(cls, text: str) -> TableObject:
        """The object ``text`` (``chain NAME`` or ``set NAME``) names; ``ValueError``
        for anything else."""
        kind, _, name = text.partition(" ")
        if kind not in _KINDS or not name or " " in name:
            raise ValueError(f"not a table object (chain NAME or set NAME): {text!r}")
        return cls(ObjectKind(kind), name)


_KINDS = frozenset(k.value for k in ObjectKind)


def chain_object(name: str) -> TableObject:
    """The chain ``name``."""
    return TableObject(ObjectKind.CHAIN, name)


def set_object(name: str) -> TableObject:
    """The set or map ``name``."""
    return TableObject(ObjectKind.SET, name)


_VERDICT_MAPS = frozenset(
    {
        Names.SERVICE_IPS,
        Names.SERVICE_NODEPORTS,
        Names.FIREWALL_IPS,
        Names.NO_ENDPOINT_SERVICES,
        Names.NO_ENDPOINT_NODEPORTS,
    }
)
_VERDICT_PREFIXES = ("dedicated-", "affinity-lookup-", "affinity-shortcut-", "affinity-record-")
# Chains that jump or go to others are deleted before their targets (older tables).
_CHAIN_RANKS = (
    ("internal-", 0),
    ("external-", 0),
    ("nodeport-", 0),
    ("firewall-", 0),
    ("dispatch-", 0),
    ("affinity-split-", 0),
    ("service-", 1),
    ("local-", 1),
    ("pick", 2),
    ("group-", 2),
)


def deletion_order(obj: TableObject) -> tuple[int, int, str]:
    """Sort key of the deletion: verdict maps first (their elements hold chains), then the
    chains (those that jump or go to others before their targets), then the other sets."""
    name = obj.name
    if obj.kind is ObjectKind.SET:
        verdicts = name in _VERDICT_MAPS or name.startswith(_VERDICT_PREFIXES)
        return (0 if verdicts else 2, 0, name)
    rank = next((r for prefix, r in _CHAIN_RANKS if name.startswith(prefix)), 3)
    return (1, rank, name)


def queue_deletion(tx: Transaction, objects: Sequence[TableObject]) -> None:
    """Queue the deletion of ``objects`` (in :func:`deletion_order`) into ``tx``: every
    chain flushed first, so no rule of theirs holds another object, then each deleted."""
    for obj in objects:
        if obj.kind is ObjectKind.CHAIN:
            tx.flush(Chain(obj.name))
    for obj in objects:
        if obj.kind is ObjectKind.CHAIN:
            tx.delete_chain(obj.name)
        else:
            tx.delete(Set(obj.name, "ipv4_addr"))  # the type is not part of a deletion


class StaleCollector:
    """Which objects the kernel holds (:attr:`held`: as last listed, plus those added
    since) and which of them nothing uses any more since when; deletes those due.

    ``delay`` is :data:`STALE_DELAY` in production.
    """

    def __init__(self, delay: float = STALE_DELAY) -> None:
        self.delay = delay
        self.held: set[TableObject] = set()
        self._since: dict[TableObject, float] = {}

    def __contains__(self, obj: object) -> bool:
        """Whether ``obj`` is waiting for its deletion."""
        return obj in self._since

    def __len__(self) -> int:
        return len(self._since)

    def listed(self, chains: Iterable[str], sets: Iterable[str]) -> None:
        """What the kernel holds, as a full sync listed it."""
        self.held = {chain_object(c) for c in chains} | {set_object(s) for s in sets}

    def unused(self, obj: TableObject, now: float) -> None:
        """``obj`` is no longer used (the earliest time counts)."""
        self._since.setdefault(obj, now)

    def used(self, obj: TableObject) -> None:
        """``obj`` is used again: keep it."""
        self._since.pop(obj, None)

    def take(self, obj: TableObject) -> bool:
        """``obj`` is used; True when the kernel lacks it, so the caller adds it now (it
        counts as held from here on)."""
        self._since.pop(obj, None)
        if obj in self.held:
            return False
        self.held.add(obj)
        return True

    def live(self, obj: TableObject) -> bool:
        """Whether the kernel holds ``obj`` and it is in use."""
        return obj in self.held and obj not in self._since

    def sweep(self, wanted: set[TableObject], now: float) -> None:
        """After a full sync: everything held and not ``wanted`` is unused, everything
        ``wanted`` is kept."""
        for obj in self.held:
            if obj not in wanted:
                self._since.setdefault(obj, now)
        for obj in [o for o in self._since if o in wanted]:
            del self._since[obj]

    def next_due(self) -> float | None:
        """When the first object waiting for its deletion is due (None: none waits)."""
        if not self._since:
            return None
        return min(self._since.values()) + self.delay

    def due(self, now: float) -> list[TableObject]:
        """The objects unused for at least :attr:`delay`, in :func:`deletion_order`."""
        due = [obj for obj, since in self._since.items() if now - since >= self.delay]
        due.sort(key=deletion_order)
        return due

    def collect(
        self,
        now: float,
        transaction: Callable[[], Transaction],
        run: Callable[[Transaction], None],
        list_held: Callable[[], tuple[set[str], set[str]]],
    ) -> bool:
        """Delete the objects :meth:`due` at ``now`` in one transaction (made by
        ``transaction``, committed by ``run``: flushes and deletions only, so
        :meth:`~kubeproxy.backends.nftables.exec.NftExecutor.run_deletions` will do);
        False when the kernel refused it (logged): what is gone already (``list_held``
        lists the chains and sets left) is forgotten, the rest is tried again at least
        :attr:`delay` later."""
        due = self.due(now)
        if not due:
            return True
        tx = transaction()
        queue_deletion(tx, due)
        try:
            run(tx)
        except NftError as err:
            if self._unreference(due, now, transaction, run):
                # Older kernels (upstream names those before 6.2) release a chain that a
                # verdict map's element named only a moment after the element went, so
                # the chains and the map could not go in one transaction: the map went
                # and the chains were flushed; they go at least a delay later.
                log.info(
                    "deleting %d unused objects at once was refused (%s); the references "
                    "went first, the rest goes next",
                    len(due),
                    err,
                )
                return True
            log.error("deleting %d unused chains, sets and maps failed: %s", len(due), err)
            chains, sets = list_held()
            present = {chain_object(c) for c in chains} | {set_object(s) for s in sets}
            for obj in due:
                if obj in present:
                    self._since[obj] = now
                else:
                    self._gone(obj)
            return False
        for obj in due:
            self._gone(obj)
        return True

    def _unreference(
        self,
        due: Sequence[TableObject],
        now: float,
        transaction: Callable[[], Transaction],
        run: Callable[[Transaction], None],
    ) -> bool:
        """After a refused deletion: delete the verdict maps among ``due`` and flush its
        chains, in one transaction; the rest is unused from ``now``. False when there were
        no verdict maps, or the kernel refused that too (nothing changed)."""
        maps = [obj for obj in due if obj.kind is ObjectKind.SET and deletion_order(obj)[0] == 0]
        if not maps:
            return False
        tx = transaction()
        for obj in due:
            if obj.kind is ObjectKind.CHAIN:
                tx.flush(Chain(obj.name))
        for obj in maps:
            tx.delete(Set(obj.name, "ipv4_addr"))  # the type is not part of a deletion
        try:
            run(tx)
        except NftError:
            return False
        for obj in maps:
            self._gone(obj)
        for obj in due:
            if obj not in maps:
                self._since[obj] = now
        return True

    def _gone(self, obj: TableObject) -> None:
        del self._since[obj]
        self.held.discard(obj)

    def clear(self) -> None:
        """Forget everything (the table is gone)."""
        self._since.clear()
        self.held.clear()
