"""The element changes of one sync, committed in bounded transactions (:class:`SyncOps`).

Elements of containers whose types :mod:`~kubeproxy.backends.nftables.elements` packs go
as one netlink batch; the others (interval and verdict maps: source ranges, affinity
dispatch) as nft text, queued in the same transactions as the chains and sets a sync
adds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Sized
from typing import Protocol, runtime_checkable

from kubeproxy.backends.nftables.elements import (
    ElementBatch,
    EncodedPairs,
    GroupedAdds,
    GroupedDeletes,
)
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.backends.nftables.table import TABLE, Key
from kubeproxy.backends.nftables.transaction import Transaction

__all__ = ["PostsElements", "SyncOps"]

_VALUE_NONE: tuple[str, ...] = ()


@runtime_checkable
class PostsElements(Protocol):
    """An executor that can hand element batches to a writer thread (the owned table's:
    :meth:`~.owner.OwnedNftables.post_elements`), so a full sync encodes the next batch
    while the kernel commits this one."""

    def post_elements(
        self, batch: ElementBatch, refused: Callable[[ElementBatch], None] | None = None
    ) -> None:
        """Hand ``batch`` over (committed after the batches posted before it);
        ``refused`` is called with it if it is refused. Raises an earlier batch's
        failure."""
        ...

    def settle_elements(self) -> None:
        """Wait until every posted batch is committed; raise the first failure."""
        ...

    def abandon_elements(self) -> None:
        """Commit no more of the posted batches; forget their failure."""
        ...


class SyncOps:
    """Element changes of one sync, committed in bounded transactions.

    ``family``'s transactions are committed by ``run`` and element batches by
    ``write_elements``; ``types`` are the element types of the containers whose elements
    go over netlink (read at each commit: containers declared during the sync count).
    A commit runs, in order: the chains and sets queued in :attr:`tx` with the text
    additions (and the text deletions of keys re-added), then the netlink batch
    (deletions first: a rewritten slot is a delete and an add), then the remaining text
    deletions. So a frontend's firewall elements are in before the batch that dispatches
    it, and out only after the batch that stops dispatching it; affinity verdicts
    likewise. ``packed``: additions may come packed (see :attr:`types`). :meth:`cut`
    commits once ``budget`` changes are queued; callers call it only
    between frontends, so one frontend's netlink changes are always in one transaction.
    :attr:`operations` and :attr:`transactions` count what was committed;
    :attr:`elements` the element additions and deletions committed per container (tallied
    per container at each commit, not per element: what ``/debug/plan`` shows).

    ``settle``: ``write_elements`` only hands a batch over (:class:`PostsElements`: a
    full sync's batches, committed by a writer thread in order), and ``settle`` waits
    until every batch handed over is committed, raising the first failure. It is called
    before each transaction ``run`` commits (nothing passes a batch: a transaction's
    chains and deletions come after the batches queued before them, as without a
    writer thread) and at the end of the last commit; counted as committed is what
    was handed over.
    """

    def __init__(
        self,
        family: Family,
        types: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]],
        *,
        run: Callable[[Transaction], None],
        write_elements: Callable[[ElementBatch], None],
        budget: int,
        text_last: bool = False,
        comments: bool = True,
        packed: bool = True,
        settle: Callable[[], None] | None = None,
    ) -> None:
        self._family = family
        self._run_tx = run
        self._write_elements = write_elements
        self._settle = settle
        self._budget = budget
        # Full syncs: nothing reads the generation yet, so its text elements can wait for
        # one transaction at the end (each libnftables run lists the table first: 70 runs
        # took 6 s of a 30k-Service cold sync of the realistic mix).
        self._text_last = text_last
        self._types = types
        # Additions packed as queued only where they go to the kernel as bytes: the fake
        # and the written-table model read elements as text, and would decode each one.
        self._packed_types = types if packed else {}
        self.tx = self.new_transaction()
        self._deletes: dict[str, list[Key]] = {}
        self._adds: dict[str, Sequence[tuple[Key, tuple[str, ...]]]] = {}
        self._text_deletes: dict[str, list[Key]] = {}
        self._text_adds: dict[str, Sequence[tuple[Key, tuple[str, ...]]]] = {}
        self._keep_comments = comments
        self._comments: dict[tuple[str, Key], str] = {}
        self._text_comments: dict[str, dict[Key, str]] = {}
        self._count = 0
        self.operations = 0
        self.transactions = 0
        self.elements: dict[str, list[int]] = {}
        """``[added, deleted]`` by container, of what was committed."""

    @property
    def types(self) -> Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]:
        """The element types of the containers whose additions may be queued packed
        (:class:`~.elements.EncodedPairs`): those whose elements go over netlink, none
        when the executor reads them as text (``packed`` False)."""
        return self._packed_types

    def new_transaction(self) -> Transaction:
        """An empty transaction of our table in this family."""
        return Transaction(self._family, TABLE)

    def delete(self, container: str, key: Key) -> None:
        """Queue the deletion of ``key`` from ``container``."""
        target = self._deletes if container in self._types else self._text_deletes
        target.setdefault(container, []).append(key)
        self._count += 1

    def add(
        self,
        container: str,
        key: Key,
        value: tuple[str, ...] = _VALUE_NONE,
        comment: str | None = None,
    ) -> None:
        """Queue the addition of ``key`` (with ``value`` in a map, and ``comment``) to
        ``container``."""
        netlink = container in self._types
        target = self._adds if netlink else self._text_adds
        queued = target.get(container)
        if queued is None:
            target[container] = [(key, value)]
        elif isinstance(queued, list):
            queued.append((key, value))
        else:
            target[container] = [*queued, (key, value)]  # encoded ones read as text
        if comment is not None and self._keep_comments:
            if netlink:
                self._comments[container, key] = comment
            else:
                self._text_comments.setdefault(container, {})[key] = comment
        self._count += 1

    def add_all(self, container: str, pairs: Sequence[tuple[Key, tuple[str, ...]]]) -> None:
        """Queue the additions ``(key, value)`` to ``container``, without comments (as
        :meth:`add` one by one: a frontend's slots, a port's hairpin elements on a full
        sync, in one call each). ``pairs`` (a list, or :class:`EncodedPairs` the encoder
        sends as they are) is the queue's from then on. Encoded and text additions to
        one container (which no sync makes) are queued as text, so a bad element is
        refused at the commit as ever."""
        target = self._adds if container in self._types else self._text_adds
        queued = target.get(container)
        if queued is None:
            target[container] = pairs if isinstance(pairs, (list, EncodedPairs)) else list(pairs)
        elif (
            isinstance(queued, EncodedPairs)
            and isinstance(pairs, EncodedPairs)
            and queued.types == pairs.types
        ):
            queued.elements.extend(pairs.elements)
        elif isinstance(queued, list):
            queued.extend(pairs)
        else:
            target[container] = [*queued, *pairs]
        self._count += len(pairs)

    def cut(self) -> None:
        """Commit if the budget is spent (call between frontends only)."""
        if self._count >= self._budget:
            self.commit()

    def commit(self, *, last: bool = False) -> None:
        """Commit what is queued (see the class documentation); ``last`` ends the sync
        (text elements held back until then go too)."""
        tx = self.tx
        deletes, adds, comments = self._deletes, self._adds, self._comments
        self._deletes, self._adds, self._comments, self._count = {}, {}, {}, 0
        text_comments: dict[str, dict[Key, str]] = {}
        if self._text_last and not last:
            text_deletes, text_adds = {}, {}
        else:
            text_deletes, text_adds = self._text_deletes, self._text_adds
            text_comments = self._text_comments
            self._text_deletes, self._text_adds, self._text_comments = {}, {}, {}
        self.tx = self.new_transaction()
        self._tally(adds, 0)
        self._tally(deletes, 1)
        self._tally(text_adds, 0)
        self._tally(text_deletes, 1)
        later: dict[str, list[Key]] = {}
        for container, keys in text_deletes.items():
            readded = {k for k, _v in text_adds.get(container, ())}
            for key in keys:
                if key in readded:
                    tx.delete_element(container, key)
                else:
                    later.setdefault(container, []).append(key)
        for container, items in text_adds.items():
            tx.add_elements(container, items, text_comments.get(container))
        self.run(tx)
        batch = ElementBatch(
            tx.family,
            tx.table,
            self._types,
            GroupedDeletes(deletes),
            GroupedAdds(adds),
            comments or None,
        )
        if len(batch):
            self._write_elements(batch)
            self.operations += len(batch)
            self.transactions += 1
        if later:
            final = self.new_transaction()
            for container, keys in later.items():
                for key in keys:
                    final.delete_element(container, key)
            self.run(final)
        if last and self._settle is not None:
            self._settle()

    def _tally(self, queued: Mapping[str, Sized], which: int) -> None:
        for container, items in queued.items():
            self.elements.setdefault(container, [0, 0])[which] += len(items)

    def run(self, tx: Transaction) -> None:
        """Commit ``tx`` if it holds anything, and count it."""
        if tx.num_operations:
            if self._settle is not None:
                self._settle()
            self._run_tx(tx)
            self.operations += tx.num_operations
            self.transactions += 1
