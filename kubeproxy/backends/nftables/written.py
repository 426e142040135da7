"""What the backend writes, recorded as plain data: the want side of ``kubeproxy verify``.

:class:`WrittenTable` is an :class:`~.exec.NftExecutor` that applies each transaction
and element batch to dictionaries (declarations, rules per chain, elements per
container) and checks nothing. Why not :class:`~.fake.FakeNft`: the fake validates and
canonicalises every element the way the kernel would, which is what tests need and what
a dry run that is compared with the kernel does not: rendering 10k Services into it took
5.5 s, where the backend's own work is under 1 s (``bench/verify.py`` measures both).
The kernel checks what the backend really writes; verify compares what it would write.

:class:`WrittenSource` reads a :class:`WrittenTable` as :class:`~.explain.TableView`
reads the kernel (:class:`~.explain.TableSource`), and gives a container's elements as
the kernel dumps them (:meth:`WrittenSource.element_blobs`, bytes), so the comparison
of the big containers is a set difference of bytes (:mod:`.verify`).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from kubeproxy.backends.nftables.declarations import Declaration
from kubeproxy.backends.nftables.elements import (
    SUPPORTED_TYPES,
    ElementBatch,
    element_encoder,
    with_comment,
)
from kubeproxy.backends.nftables.explain import refs_of_text
from kubeproxy.backends.nftables.objects import (
    Chain,
    Element,
    Family,
    Map,
    NftError,
    Rule,
    Set,
    Table,
)
from kubeproxy.backends.nftables.reader import Item, RuleRefs, TableReader
from kubeproxy.backends.nftables.table import TABLE
from kubeproxy.backends.nftables.transaction import Transaction

__all__ = ["WrittenSource", "WrittenTable", "blob_types"]

Key = tuple[str, ...]


@dataclass(slots=True)
class _Table:
    """One table: declarations, each container's elements (key -> value, ``()`` in a
    set), the comments of the elements that have one, each chain's rules."""

    declarations: dict[str, Declaration] = field(default_factory=dict)
    elements: dict[str, dict[Key, Key]] = field(default_factory=dict)
    comments: dict[str, dict[Key, str]] = field(default_factory=dict)
    chains: dict[str, list[str]] = field(default_factory=dict)


def blob_types(declaration: Declaration) -> tuple[Key, Key] | None:
    """The data types of a container whose elements are compared as the kernel dumps
    them (keys and values of :data:`~.elements.SUPPORTED_TYPES`, no ranges, no
    verdicts, no timeouts); None for the others (compared decoded)."""
    if declaration.verdicts or declaration.interval or declaration.timeout is not None:
        return None
    if "timeout" in declaration.flags or "dynamic" in declaration.flags:
        return None
    keys = tuple(f.datatype.name for f in declaration.key)
    values = tuple(f.datatype.name for f in declaration.value or ())
    if not set(keys + values) <= SUPPORTED_TYPES:
        return None
    return keys, values


class WrittenTable:
    """An executor that records what it is given (see the module documentation): one
    ``kube-proxy`` table per family, others ignored. Never refuses anything."""

    def __init__(self, *, version: str = "1.0.6") -> None:
        self._tables: dict[Family, _Table] = {}
        self.nft_version = version

    def table(self, family: Family) -> _Table | None:
        """What was written to ``family``'s table (None: no table)."""
        return self._tables.get(Family(family))

    def copy(self) -> WrittenTable:
        """A copy of the recorded state (a replay's state at one step)."""
        out = WrittenTable(version=self.nft_version)
        for family, held in self._tables.items():
            out._tables[family] = _Table(
                dict(held.declarations),
                {name: dict(items) for name, items in held.elements.items()},
                {name: dict(items) for name, items in held.comments.items()},
                {name: list(rules) for name, rules in held.chains.items()},
            )
        return out

    # NftExecutor ------------------------------------------------------------------------

    def run(self, tx: Transaction) -> None:
        """Apply ``tx`` (the first invalid operation queued is raised, as nft would)."""
        if tx.error is not None:
            raise tx.error
        if tx.table != TABLE:
            return
        family = Family(tx.family)
        for verb, obj in tx.operations():
            if isinstance(obj, Table):
                if verb == "delete":
                    self._tables.pop(family, None)
                elif verb == "flush":
                    held = self._tables.get(family)
                    for rules in held.chains.values() if held else ():
                        rules.clear()
                else:
                    self._tables.setdefault(family, _Table())
                continue
            held = self._tables.setdefault(family, _Table())
            if isinstance(obj, Chain):
                if verb == "delete":
                    held.chains.pop(obj.name, None)
                elif verb == "flush":
                    held.chains[obj.name] = []
                else:
                    held.chains.setdefault(obj.name, [])
            elif isinstance(obj, Rule):
                rules = held.chains.setdefault(obj.chain, [])
                if verb == "insert":
                    rules.insert(0, obj.rule)
                else:
                    rules.append(obj.rule)
            elif isinstance(obj, Set | Map):
                self._container(held, verb, obj)
            elif isinstance(obj, Element):
                items = held.elements.setdefault(obj.container, {})
                comments = held.comments.setdefault(obj.container, {})
                comments.pop(obj.key, None)
                if verb == "delete":
                    items.pop(obj.key, None)
                    continue
                items[obj.key] = obj.value
                if obj.comment is not None:
                    comments[obj.key] = obj.comment

    @staticmethod
    def _container(held: _Table, verb: str, obj: Set | Map) -> None:
        if verb == "delete":
            held.declarations.pop(obj.name, None)
            held.elements.pop(obj.name, None)
            held.comments.pop(obj.name, None)
        elif verb == "flush":
            held.elements[obj.name] = {}
            held.comments[obj.name] = {}
        elif obj.name not in held.declarations:
            try:
                held.declarations[obj.name] = Declaration.of(obj)
            except NftError:
                return  # a type verify does not read: not compared
            held.elements.setdefault(obj.name, {})

    def check(self, tx: Transaction) -> None:
        """Nothing is checked (see the module documentation)."""
        if tx.error is not None:
            raise tx.error

    def write_elements(self, batch: ElementBatch) -> None:
        """Apply an element batch: deletions, then additions."""
        if batch.table != TABLE or not len(batch):
            return
        held = self._tables.setdefault(Family(batch.family), _Table())
        elements, comments = held.elements, held.comments
        for container, key in batch.deletes:
            elements.setdefault(container, {}).pop(key, None)
            comments.get(container, {}).pop(key, None)
        current = ""
        items: dict[Key, Key] = {}
        for container, key, value in batch.adds:
            if container != current:
                current = container
                items = elements.setdefault(container, {})
            items[key] = value
        for (container, key), comment in (batch.comments or {}).items():
            comments.setdefault(container, {})[key] = comment

    def run_deletions(self, tx: Transaction) -> None:
        """As :meth:`run`."""
        self.run(tx)

    def whole_table(self, family: Family, table: str) -> AbstractContextManager[None]:
        """Nothing to do: writes apply as they come."""
        return contextlib.nullcontext()

    def list_chains(self, family: Family, table: str) -> dict[str, str | None]:
        """Chain names (no comments are kept)."""
        held = self.table(family) if table == TABLE else None
        return dict.fromkeys(held.chains) if held else {}

    def list_sets(self, family: Family, table: str) -> list[str]:
        """Set and map names."""
        held = self.table(family) if table == TABLE else None
        return list(held.declarations) if held else []

    def list_elements(self, family: Family, table: str, container: str) -> list[Element]:
        """A container's elements (raises ``ENOENT`` for one not declared)."""
        held = self.table(family) if table == TABLE else None
        if held is None or container not in held.declarations:
            raise NftError(f"no set {container}", errno.ENOENT)
        is_map = held.declarations[container].is_map
        comments = held.comments.get(container, {})
        return [
            Element(container, key, value, comments.get(key), is_map)
            for key, value in held.elements.get(container, {}).items()
        ]

    def read_elements(
        self,
        family: Family,
        table: str,
        container: str,
        types: tuple[tuple[str, ...], tuple[str, ...]],
    ) -> list[tuple[Key, Key]]:
        """:meth:`list_elements` as ``(key, value)`` pairs."""
        return [(e.key, e.value) for e in self.list_elements(family, table, container)]

    def table_exists(self, family: Family, table: str) -> bool:
        """Whether the table was written."""
        return table == TABLE and Family(family) in self._tables

    def run_text(self, text: str) -> str:
        """Not supported: the backend never writes text around its transactions."""
        raise NftError("WrittenTable does not run nft text", errno.EOPNOTSUPP)

    def version(self) -> str:
        """The nft version this recorder claims to be."""
        return self.nft_version


class WrittenSource:
    """A :class:`~.explain.TableSource` over a :class:`WrittenTable`, with elements as
    the kernel dumps them (:meth:`element_blobs`)."""

    def __init__(self, written: WrittenTable) -> None:
        self.written = written
        self._rules: dict[tuple[Family, str], list[RuleRefs]] = {}

    def _held(self, family: Family) -> _Table:
        held = self.written.table(family)
        if held is None:
            raise NftError(f"no table {family} {TABLE}", errno.ENOENT)
        return held

    def exists(self, family: Family) -> bool:
        """Whether the table was written."""
        return self.written.table(family) is not None

    def sets(self, family: Family) -> Mapping[str, Declaration]:
        """The declarations by name."""
        return self._held(family).declarations

    def keys(self, family: Family, name: str) -> Collection[Key]:
        """The keys of a container's elements (no :class:`Item` made)."""
        return self._held(family).elements.get(name, {}).keys()

    @staticmethod
    def _item(key: Key, value: Key, comment: str | None) -> Item:
        if len(value) == 1 and " " in value[0]:  # a verdict: "goto CHAIN"
            verb, _, chain = value[0].partition(" ")
            value = (verb, chain)
        return Item(key, value, comment, None)

    def elements(
        self, family: Family, name: str, declaration: object, containing: str | None = None
    ) -> list[Item]:
        """A container's elements as the kernel reader returns them."""
        held = self._held(family)
        comments = held.comments.get(name, {})
        out = [self._item(k, v, comments.get(k)) for k, v in held.elements.get(name, {}).items()]
        if containing is None:
            return out
        return [i for i in out if i.comment is not None and containing in i.comment]

    def get(self, family: Family, name: str, declaration: object, key: Key) -> Item | None:
        """One element."""
        held = self._held(family)
        value = held.elements.get(name, {}).get(key)
        return (
            None if value is None else self._item(key, value, held.comments.get(name, {}).get(key))
        )

    def rules(self, family: Family, chain: str) -> list[RuleRefs]:
        """What each rule of ``chain`` refers to, from its text (raises ``ENOENT`` for a
        chain not written, as the kernel does)."""
        memo = (family, chain)
        found = self._rules.get(memo)
        if found is None:
            chains = self._held(family).chains
            if chain not in chains:
                raise NftError(f"no chain {chain}", errno.ENOENT)
            found = self._rules[memo] = [refs_of_text(rule) for rule in chains[chain]]
        return found

    def element_blobs(self, family: Family, name: str, declaration: Declaration) -> list[bytes]:
        """Every element of ``name`` encoded as the kernel's dump carries it (each an
        ``NFTA_LIST_ELEM`` attribute: :func:`~.elements.element_encoder` with
        ``dumped``). Only for containers :func:`blob_types` accepts."""
        types = blob_types(declaration)
        if types is None:
            raise NftError(f"set {name}: not compared as bytes", errno.EINVAL)
        encode = element_encoder(*types, dumped=True)
        held = self._held(family)
        items = held.elements.get(name, {})
        out = [encode(key, value) for key, value in items.items()]
        comments = held.comments.get(name)
        if comments:
            out = [
                with_comment(blob, comments[key]) if key in comments else blob
                for blob, key in zip(out, items, strict=True)
            ]
        return out

    def probe_blobs(
        self, family: Family, name: str, declaration: Declaration, elements: Sequence[bytes]
    ) -> list[bytes]:
        """The elements of ``name`` with the keys of ``elements``, as
        :meth:`element_blobs`."""
        wanted = {item.key for item in TableReader.decode_blobs(declaration, list(elements))}
        items = self._held(family).elements.get(name, {})
        return [
            blob
            for blob, key in zip(self.element_blobs(family, name, declaration), items, strict=True)
            if key in wanted
        ]

    def chain_names(self, family: Family) -> Iterator[str]:
        """Every chain written."""
        return iter(self._held(family).chains)
