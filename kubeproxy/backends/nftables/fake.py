"""An in-memory nftables that checks what the kernel checks, for unit tests.

:class:`FakeNft` runs the same :class:`~kubeproxy.backends.nftables.transaction.Transaction`
objects the real executor runs, transactionally (all or nothing), and refuses what the
kernel (6.x, with nft 1.0.6) refuses, with the same ``errno``. The rules below were
checked against the kernel; ``tests/test_nft_fake.py`` runs the same transactions on both.

* ``add`` of an existing table, chain, set or map is a no-op (its comment is kept), except:
  a base chain whose type differs, or a regular chain given a hook -> ``EEXIST``; a base
  chain whose hook or priority differs -> ``EOPNOTSUPP`` as 6.12 and 6.18 answer (6.1 says
  ``EEXIST``; either is a refusal) (its policy is updated); a set or
  map whose kind, type or flags differ -> ``EEXIST`` (its size and timeout are updated).
  ``create`` of an existing object -> ``EEXIST``.
* ``flush``/``delete`` of a missing object -> ``ENOENT``. ``flush table`` removes every
  rule, nothing else. ``delete chain`` removes its rules with it, but fails with ``EBUSY``
  while a rule (``jump``/``goto``) or a map element (``goto X``) refers to the chain;
  ``delete set``/``map`` fails with ``EBUSY`` while a rule refers to it (``@name``).
* A rule's chain, its ``@set``/``@map`` and its ``jump``/``goto`` targets must exist
  (``ENOENT``); jumping to a base chain -> ``EOPNOTSUPP``; ``vmap @set`` -> ``EINVAL``; a
  map looked up as a plain set (``ip daddr @map``, ``!= @map``: no ``vmap``, ``map`` or
  ``update``) -> ``EINVAL`` as Debian 12's 6.1 answers (Linux 6.5 and newer accept it).
* Elements: the container must exist (``ENOENT``); key and value must match the set's type
  (number of concatenated parts, addresses, ports, protocols, verdicts; prefixes and
  ranges only with ``flags interval``; a timeout only with ``flags timeout``) or
  ``EINVAL``; verdict targets must exist. ``add`` of an existing key with the same value
  is a no-op, with a different value ``EEXIST``; ``create`` of an existing key ``EEXIST``;
  ``delete`` of a missing key ``ENOENT``; a full set (``size``) ``ENFILE``; adding to or
  deleting from a ``constant`` set that a rule uses ``EBUSY``. Addresses are compared and
  stored in canonical form, as the kernel lists them.
* After the whole transaction: a chain reachable from a base chain through 16 or more
  jumps/gotos (or a loop), counting verdict maps a rule looks up -> ``EMLINK``.

Like nft, the fake checks in two passes, which decides *which* error a transaction with
several faults reports: first what nft resolves itself before sending anything (tables,
``@set`` references, ``flush set``, element containers and types; see :func:`_evaluate`),
then, in order, what the kernel refuses. It does not parse rule text beyond the
references above, and does not expire timed-out elements.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import ipaddress
import os
import re
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace

from kubeproxy.backends.nftables.elements import ElementBatch
from kubeproxy.backends.nftables.exec import NftExecutor
from kubeproxy.backends.nftables.objects import (
    Chain,
    Element,
    Family,
    Map,
    NftError,
    Rule,
    Set,
    Table,
    validate_name,
)
from kubeproxy.backends.nftables.transaction import NftObject, Transaction, render_operation

__all__ = ["FakeNft", "parse_commands"]

CANONICAL_CACHE = 1 << 16
"""Element parts whose canonical form is kept (see ``_canonical``): an evaluation and
the commit after it of a transaction of 10,000 elements hit it; a few MiB at most."""

_JUMP_DEPTH_MAX = 16  # NFT_JUMP_STACK_SIZE: a chain at this depth is refused
_QUOTED = re.compile(r'"[^"]*"')
_TARGET = re.compile(r"\b(?:jump|goto)\s+([A-Za-z_][A-Za-z0-9_./:-]*)")
_SET_REF = re.compile(r"@([A-Za-z_][A-Za-z0-9_./:-]*)")
_VMAP_REF = re.compile(r"\bvmap\s+@([A-Za-z_][A-Za-z0-9_./:-]*)")
# A map named where its value is read (vmap, map) or written (update): anywhere else the
# rule looks it up as a plain set, which kernels before 6.5 refuse.
_VALUE_REF = re.compile(r"\b(?:vmap|map|update)\s+@([A-Za-z_][A-Za-z0-9_./:-]*)")
_VERDICTS = frozenset({"accept", "drop", "return", "continue"})
_PROTOCOLS = frozenset({"tcp", "udp", "sctp", "icmp", "icmpv6", "ipv6-icmp", "udplite", "dccp"})
_SERVICE_NAME = re.compile(r"[a-z][a-z0-9-]*")
_ETHER = re.compile(r"[0-9a-fA-F]{2}(?::[0-9a-fA-F]{2}){5}")
_Key = tuple[Family, str]


def _error(code: int, command: str, detail: str) -> NftError:
    return NftError(f"{os.strerror(code)}: {command} ({detail})", code)


@dataclass(frozen=True, slots=True)
class _RuleState:
    rule: Rule
    targets: tuple[str, ...]  # chains it jumps or goes to
    refs: tuple[str, ...]  # sets and maps it names with @


@dataclass(slots=True)
class _ChainState:
    spec: Chain
    rules: list[_RuleState] = field(default_factory=list)


@dataclass(slots=True)
class _SetState:
    spec: Set | Map
    elements: dict[tuple[str, ...], Element] = field(default_factory=dict)

    @property
    def is_map(self) -> bool:
        return isinstance(self.spec, Map)

    @property
    def key_types(self) -> tuple[str, ...]:
        spec = self.spec
        return _datatypes(spec.key_type if isinstance(spec, Map) else spec.type, spec.typeof)

    @property
    def value_types(self) -> tuple[str, ...]:
        spec = self.spec
        return _datatypes(spec.value_type, spec.typeof) if isinstance(spec, Map) else ()

    @property
    def flags(self) -> frozenset[str]:
        # nft turns a default timeout into the timeout flag.
        flags = set(self.spec.flags)
        if self.spec.timeout is not None:
            flags.add("timeout")
        return frozenset(flags)


# The data type of each expression a ``typeof`` declaration may name (what nft derives).
_TYPEOF_TYPES = {
    "ip saddr": "ipv4_addr",
    "ip daddr": "ipv4_addr",
    "ip6 saddr": "ipv6_addr",
    "ip6 daddr": "ipv6_addr",
    "ct original ip daddr": "ipv4_addr",
    "ct original ip6 daddr": "ipv6_addr",
    "meta l4proto": "inet_proto",
    "th dport": "inet_service",
    "tcp dport": "inet_service",
    "udp dport": "inet_service",
    "sctp dport": "inet_service",
    "th sport": "inet_service",
    "meta mark": "mark",
}


@functools.lru_cache(maxsize=1024)
def _datatypes(text: str, typeof: bool) -> tuple[str, ...]:
    parts = tuple(text.split(" . "))
    if not typeof:
        return parts
    # A numgen or hash result is a plain 32-bit integer.
    return tuple(
        "integer" if part.startswith(("numgen ", "jhash ")) else _TYPEOF_TYPES.get(part, part)
        for part in parts
    )


@dataclass(slots=True)
class _TableState:
    spec: Table
    chains: dict[str, _ChainState] = field(default_factory=dict)
    sets: dict[str, _SetState] = field(default_factory=dict)
    # How many rules and map elements refer to each chain, and rules to each set.
    chain_refs: dict[str, int] = field(default_factory=dict)
    set_refs: dict[str, int] = field(default_factory=dict)

    def copy(self) -> _TableState:
        return _TableState(
            self.spec,
            dict(self.chains),
            dict(self.sets),
            dict(self.chain_refs),
            dict(self.set_refs),
        )


def _verdict_target(value: tuple[str, ...]) -> str | None:
    if len(value) == 1:
        verb, _, target = value[0].partition(" ")
        if verb in ("jump", "goto") and target:
            return target
    return None


class _Run:
    """One transaction being applied: copy-on-write views of the tables it touches."""

    def __init__(self, tables: dict[_Key, _TableState]) -> None:
        self.tables = dict(tables)
        self._owned_tables: set[_Key] = set()
        self._owned_chains: set[tuple[_Key, str]] = set()
        self._owned_sets: set[tuple[_Key, str]] = set()
        self.graph_changed: set[_Key] = set()

    def table(self, key: _Key) -> _TableState:
        if key not in self._owned_tables:
            self.tables[key] = self.tables[key].copy()
            self._owned_tables.add(key)
        return self.tables[key]

    def chain(self, key: _Key, name: str) -> _ChainState:
        table = self.table(key)
        if (key, name) not in self._owned_chains:
            old = table.chains[name]
            table.chains[name] = _ChainState(old.spec, list(old.rules))
            self._owned_chains.add((key, name))
        return table.chains[name]

    def set(self, key: _Key, name: str) -> _SetState:
        table = self.table(key)
        if (key, name) not in self._owned_sets:
            old = table.sets[name]
            table.sets[name] = _SetState(old.spec, dict(old.elements))
            self._owned_sets.add((key, name))
        return table.sets[name]

    def forget(self, key: _Key) -> None:
        """The table was deleted: later objects of that name are new."""
        self._owned_chains = {c for c in self._owned_chains if c[0] != key}
        self._owned_sets = {s for s in self._owned_sets if s[0] != key}


class FakeNft(NftExecutor):
    """An in-memory, multi-table nftables with kernel-like checks (see the module doc).

    ``transactions`` lists every transaction passed to :meth:`run`, in order (failed ones
    too). Set ``fail_next`` to make the next :meth:`run` raise that error without
    changing anything, as if the kernel had refused it.
    """

    def __init__(self, *, version: str = "1.0.6") -> None:
        self._tables: dict[_Key, _TableState] = {}
        self._lock = threading.Lock()
        self.transactions: list[Transaction] = []
        self.fail_next: NftError | None = None
        self.nft_version = version

    # NftExecutor ----------------------------------------------------------------------

    def run(self, tx: Transaction) -> None:
        """Apply ``tx`` atomically, or raise :class:`NftError` and change nothing."""
        with self._lock:
            self.transactions.append(tx)
            if tx.error is not None:
                raise tx.error
            if self.fail_next is not None:
                err, self.fail_next = self.fail_next, None
                raise err
            self._tables = self._apply(_ops_of(tx))

    def write_elements(self, batch: ElementBatch) -> None:
        """The batch as the ``delete``/``add element`` transaction it stands for (so it is
        checked, recorded in :attr:`transactions` and refused exactly like one)."""
        if not len(batch):
            return
        tx = Transaction(batch.family, batch.table)
        for container, key in batch.deletes:
            tx.delete_element(container, key)
        comments = batch.comments or {}
        for container, key, value in batch.adds:
            tx.add_element(
                container,
                key,
                value,
                is_map=bool(batch.types[container][1]),
                comment=comments.get((container, key)) if comments else None,
            )
        self.run(tx)

    def whole_table(self, family: Family, table: str) -> AbstractContextManager[None]:
        """Nothing to do: the fake writes as it goes."""
        return contextlib.nullcontext()

    def check(self, tx: Transaction) -> None:
        """Raise :class:`NftError` if :meth:`run` would; never change anything."""
        with self._lock:
            if tx.error is not None:
                raise tx.error
            self._apply(_ops_of(tx))

    def list_chains(self, family: Family, table: str) -> dict[str, str | None]:
        """Chain name -> comment; ``{}`` if the table does not exist."""
        state = self._tables.get((Family(family), table))
        if state is None:
            return {}
        return {name: chain.spec.comment for name, chain in state.chains.items()}

    def list_rules(self, family: Family, table: str, chain: str) -> list[Rule]:
        """The rules of a chain, in order (``[]`` if the table or chain does not exist)."""
        state = self._tables.get((Family(family), table))
        if state is None or chain not in state.chains:
            return []
        return [rule.rule for rule in state.chains[chain].rules]

    def list_sets(self, family: Family, table: str) -> list[str]:
        """Names of the table's sets and maps (``[]`` if the table does not exist)."""
        state = self._tables.get((Family(family), table))
        return [] if state is None else list(state.sets)

    def list_elements(self, family: Family, table: str, container: str) -> list[Element]:
        """The elements of a set or map, in insertion order."""
        state = self._tables.get((Family(family), table))
        if state is None or container not in state.sets:
            raise NftError(
                f"{os.strerror(errno.ENOENT)}: list set {family} {table} {container}",
                errno.ENOENT,
            )
        return list(state.sets[container].elements.values())

    def read_elements(
        self,
        family: Family,
        table: str,
        container: str,
        types: tuple[tuple[str, ...], tuple[str, ...]],
    ) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
        """:meth:`list_elements` as ``(key, value)`` pairs (``types`` are not needed)."""
        return [(e.key, e.value) for e in self.list_elements(family, table, container)]

    def table_exists(self, family: Family, table: str) -> bool:
        """Whether the table exists."""
        return (Family(family), table) in self._tables

    def version(self) -> str:
        """The nft version this fake claims to be (``nft_version``)."""
        return self.nft_version

    def run_text(self, text: str) -> str:
        """Run commands written as :meth:`Transaction.render` writes them (for instance a
        :meth:`dump`, to preload state), atomically. ``list ruleset`` and
        ``list table FAMILY NAME`` return :meth:`dump` text.
        """
        output: list[str] = []
        pending: list[tuple[_Key, str, NftObject]] = []
        with self._lock:
            for line in text.splitlines():
                words = line.split()
                if words[:1] == ["list"]:
                    if pending:
                        self._tables = self._apply(pending)
                        pending = []
                    output.append(self._list(words))
                    continue
                pending.extend(
                    ((family, table), verb, obj)
                    for family, table, verb, obj in parse_commands(line)
                )
            if pending:
                self._tables = self._apply(pending)
        return "".join(output)

    def _list(self, words: list[str]) -> str:
        if words == ["list", "ruleset"]:
            return self._dump(None, None)
        if len(words) == 4 and words[1] == "table":
            key = (_family(words[2]), words[3])
            if key not in self._tables:
                raise NftError(f"{os.strerror(errno.ENOENT)}: {' '.join(words)}", errno.ENOENT)
            return self._dump(*key)
        raise NftError(f"unsupported command: {' '.join(words)}", errno.EINVAL)

    # Dump -------------------------------------------------------------------------------

    def dump(self, family: Family | None = None, table: str | None = None) -> str:
        """The state as ``nft -f`` text, deterministic: per table (sorted), ``add table``,
        its chains and then sets and maps sorted by name, the rules of each chain in
        chain-name order, then the elements of each set and map sorted by key.
        """
        with self._lock:
            return self._dump(family, table)

    def _dump(self, family: Family | None, table: str | None) -> str:
        lines: list[str] = []
        for key in sorted(self._tables):
            if (family is not None and key[0] != family) or (table is not None and key[1] != table):
                continue
            lines.extend(_dump_table(key, self._tables[key]))
        return "".join(f"{line}\n" for line in lines)

    # Applying ---------------------------------------------------------------------------

    def _apply(self, ops: list[tuple[_Key, str, NftObject]]) -> dict[_Key, _TableState]:
        commands = [render_operation(key[0], key[1], verb, obj) for key, verb, obj in ops]
        _evaluate(self._tables, ops, commands)
        run = _Run(self._tables)
        for (key, verb, obj), command in zip(ops, commands, strict=True):
            if isinstance(obj, Table):
                _apply_table(run, key, verb, obj, command)
                continue
            if key not in run.tables:
                raise _error(errno.ENOENT, command, f"table {key[0]} {key[1]} does not exist")
            if isinstance(obj, Chain):
                _apply_chain(run, key, verb, obj, command)
            elif isinstance(obj, Rule):
                _apply_rule(run, key, verb, obj, command)
            elif isinstance(obj, Set | Map):
                _apply_set(run, key, verb, obj, command)
            else:
                _apply_element(run, key, verb, obj, command)
        for key in run.graph_changed:
            if key in run.tables:
                _check_jump_depth(run.tables[key])
        return run.tables


def _ops_of(tx: Transaction) -> list[tuple[_Key, str, NftObject]]:
    key = (tx.family, tx.table)
    return [(key, verb, obj) for verb, obj in tx.operations()]


def _family(word: str) -> Family:
    try:
        return Family(word)
    except ValueError:
        raise NftError(f"unknown family {word!r}", errno.EINVAL) from None


# What nft checks before sending anything ---------------------------------------------


def _evaluate(
    tables: dict[_Key, _TableState],
    ops: list[tuple[_Key, str, NftObject]],
    commands: list[str],
) -> None:
    """Refuse what nft itself refuses while evaluating the batch, before the kernel.

    nft resolves tables, sets and maps (not chains) in its cache, updating the cache as it
    goes (a set deleted earlier in the batch is gone for later commands), and checks
    element types; the first such error is the one reported, even when the kernel would
    have refused an earlier command. Checked against nft 1.0.6.
    """
    # Per table: set and map specs by name, or None once the table is deleted.
    cache: dict[_Key, dict[str, Set | Map] | None] = {}

    def lookup(key: _Key) -> dict[str, Set | Map] | None:
        if key not in cache:
            state = tables.get(key)
            cache[key] = None if state is None else {n: s.spec for n, s in state.sets.items()}
        return cache[key]

    for (key, verb, obj), command in zip(ops, commands, strict=True):
        sets = lookup(key)
        if isinstance(obj, Table):
            if verb in ("add", "create") and sets is None:
                cache[key] = {}
            elif verb == "delete" and sets is not None:
                cache[key] = None
            continue
        if sets is None:
            raise _error(errno.ENOENT, command, f"table {key[0]} {key[1]} does not exist")
        if isinstance(obj, Rule):
            text = _QUOTED.sub('""', obj.rule)
            for ref in _SET_REF.findall(text):
                if ref not in sets:
                    raise _error(errno.ENOENT, command, f"set or map {ref} does not exist")
            for ref in _VMAP_REF.findall(text):
                if not isinstance(sets[ref], Map):
                    raise _error(errno.EINVAL, command, f"{ref} is not a map")
        elif isinstance(obj, Set | Map):
            if verb in ("add", "create"):
                sets.setdefault(obj.name, obj)
            elif verb == "delete":
                sets.pop(obj.name, None)
            elif not isinstance(sets.get(obj.name), type(obj)):
                raise _error(errno.ENOENT, command, f"{obj.name} does not exist")
        elif isinstance(obj, Element):
            spec = sets.get(obj.container)
            if spec is None:
                raise _error(errno.ENOENT, command, f"set or map {obj.container} does not exist")
            _evaluate_element(_SetState(spec), obj, verb, command)


def _evaluate_element(state: _SetState, obj: Element, verb: str, command: str) -> None:
    _canonical_parts(state.key_types, obj.key, "interval" in state.flags, "key", command)
    if verb == "delete" or not obj.value:
        return  # a map element without a value is the kernel's to refuse
    if not state.is_map:
        raise _error(errno.EINVAL, command, f"{obj.container} is a set: no value allowed")
    if state.value_types != ("verdict",):
        _canonical_parts(state.value_types, obj.value, False, "value", command)
    elif len(obj.value) != 1 or (
        obj.value[0] not in _VERDICTS and _verdict_target(obj.value) is None
    ):
        raise _error(errno.EINVAL, command, f"{' . '.join(obj.value)!r} is not a verdict")


# Tables, chains, sets ---------------------------------------------------------------------


def _apply_table(run: _Run, key: _Key, verb: str, obj: Table, command: str) -> None:
    exists = key in run.tables
    if verb in ("add", "create"):
        if not exists:
            run.tables[key] = _TableState(obj)
            run.forget(key)
        elif verb == "create":
            raise _error(errno.EEXIST, command, "table exists")
        return
    if not exists:
        raise _error(errno.ENOENT, command, "table does not exist")
    if verb == "delete":
        del run.tables[key]
        run.forget(key)
        return
    table = run.table(key)
    for name in list(table.chains):
        _clear_rules(table, run.chain(key, name))


def _apply_chain(run: _Run, key: _Key, verb: str, obj: Chain, command: str) -> None:
    table = run.table(key)
    old = table.chains.get(obj.name)
    if verb in ("add", "create"):
        if old is None:
            table.chains[obj.name] = _ChainState(obj)
            run.chain(key, obj.name)  # owned from birth
            run.graph_changed.add(key)
            return
        if verb == "create":
            raise _error(errno.EEXIST, command, "chain exists")
        if obj.hook is None:
            return
        if old.spec.hook is None or old.spec.type != obj.type:
            raise _error(errno.EEXIST, command, "chain exists with another type")
        if old.spec.hook != obj.hook or old.spec.priority != obj.priority:
            raise _error(errno.EOPNOTSUPP, command, "cannot change a base chain's hook or priority")
        if obj.policy is not None and obj.policy != old.spec.policy:
            run.chain(key, obj.name).spec = replace(old.spec, policy=obj.policy)
        return
    if old is None:
        raise _error(errno.ENOENT, command, "chain does not exist")
    # The kernel counts references before removing the chain's own rules, so a chain
    # that jumps to itself cannot be deleted without a flush first.
    if verb == "delete" and table.chain_refs.get(obj.name, 0) > 0:
        raise _error(errno.EBUSY, command, "a rule or map element still refers to the chain")
    _clear_rules(table, run.chain(key, obj.name))
    if verb == "delete":
        del table.chains[obj.name]


def _clear_rules(table: _TableState, chain: _ChainState) -> None:
    for state in chain.rules:
        _release(table.chain_refs, state.targets)
        _release(table.set_refs, state.refs)
    chain.rules.clear()


def _release(counts: dict[str, int], names: tuple[str, ...]) -> None:
    for name in names:
        counts[name] -= 1


def _apply_set(run: _Run, key: _Key, verb: str, obj: Set | Map, command: str) -> None:
    table = run.table(key)
    old = table.sets.get(obj.name)
    noun = "map" if isinstance(obj, Map) else "set"
    if verb in ("add", "create"):
        new = _SetState(obj)
        if old is None:
            table.sets[obj.name] = new
            run.set(key, obj.name)
            return
        if verb == "create":
            raise _error(errno.EEXIST, command, f"{noun} exists")
        if (
            old.is_map != new.is_map
            or old.key_types + old.value_types != new.key_types + new.value_types
            or old.flags != new.flags
        ):
            raise _error(errno.EEXIST, command, f"{noun} exists with another type or flags")
        spec = old.spec
        if obj.size is not None:
            spec = replace(spec, size=obj.size)
        if obj.timeout is not None:
            spec = replace(spec, timeout=obj.timeout)
        if spec is not old.spec:
            run.set(key, obj.name).spec = spec
        return
    # nft checks the kind when flushing; the kernel does not when deleting.
    if old is None or (verb == "flush" and old.is_map != isinstance(obj, Map)):
        raise _error(errno.ENOENT, command, f"{noun} does not exist")
    if verb == "delete" and table.set_refs.get(obj.name, 0) > 0:
        raise _error(errno.EBUSY, command, f"a rule still refers to the {noun}")
    state = run.set(key, obj.name)
    for element in state.elements.values():
        target = _verdict_target(element.value)
        if target is not None:
            table.chain_refs[target] -= 1
    state.elements.clear()
    if verb == "delete":
        del table.sets[obj.name]


# Rules ----------------------------------------------------------------------------------


def _apply_rule(run: _Run, key: _Key, verb: str, obj: Rule, command: str) -> None:
    table = run.table(key)
    if obj.chain not in table.chains:
        raise _error(errno.ENOENT, command, f"chain {obj.chain} does not exist")
    text = _QUOTED.sub('""', obj.rule)
    targets = tuple(_TARGET.findall(text))
    refs = tuple(_SET_REF.findall(text))
    for target in targets:
        chain = table.chains.get(target)
        if chain is None:
            raise _error(errno.ENOENT, command, f"chain {target} does not exist")
        if chain.spec.hook is not None:
            raise _error(errno.EOPNOTSUPP, command, f"cannot jump to base chain {target}")
    for ref in refs:
        if ref not in table.sets:
            raise _error(errno.ENOENT, command, f"set or map {ref} does not exist")
    for ref in _VMAP_REF.findall(text):
        if not table.sets[ref].is_map:
            raise _error(errno.EINVAL, command, f"{ref} is not a map")
    valued = set(_VALUE_REF.findall(text))
    for ref in refs:
        if table.sets[ref].is_map and ref not in valued:
            # nft_lookup_init before Linux 6.5 ("relax set/map validation checks").
            raise _error(errno.EINVAL, command, f"{ref} is a map, looked up without its value")
    for target in targets:
        table.chain_refs[target] = table.chain_refs.get(target, 0) + 1
    for ref in refs:
        table.set_refs[ref] = table.set_refs.get(ref, 0) + 1
    chain_state = run.chain(key, obj.chain)
    state = _RuleState(obj, targets, refs)
    if verb == "insert":
        chain_state.rules.insert(0, state)
    else:
        chain_state.rules.append(state)
    run.graph_changed.add(key)


# Elements -------------------------------------------------------------------------------


def _apply_element(run: _Run, key: _Key, verb: str, obj: Element, command: str) -> None:
    table = run.table(key)
    old_set = table.sets.get(obj.container)
    if old_set is None:
        raise _error(errno.ENOENT, command, f"set or map {obj.container} does not exist")
    interval = "interval" in old_set.flags
    canonical_key = _canonical_parts(old_set.key_types, obj.key, interval, "key", command)
    if "constant" in old_set.flags and table.set_refs.get(obj.container, 0) > 0:
        raise _error(errno.EBUSY, command, "constant set is in use")
    if verb == "delete":
        if canonical_key not in old_set.elements:
            raise _error(errno.ENOENT, command, "element does not exist")
        state = run.set(key, obj.container)
        removed = state.elements.pop(canonical_key)
        target = _verdict_target(removed.value)
        if target is not None:
            table.chain_refs[target] -= 1
        return
    value = _check_value(table, old_set, obj, command)
    if obj.timeout is not None and "timeout" not in old_set.flags:
        raise _error(errno.EINVAL, command, "element timeout needs a set with flags timeout")
    existing = old_set.elements.get(canonical_key)
    if existing is not None:
        if verb == "create" or existing.value != value:
            raise _error(errno.EEXIST, command, "element exists")
        return
    if interval:
        _check_no_overlap(run.set(key, obj.container), canonical_key, command)
    size = old_set.spec.size
    if size is not None and len(old_set.elements) >= size:
        raise _error(errno.ENFILE, command, f"set is full (size {size})")
    element = Element(obj.container, canonical_key, value, obj.comment, old_set.is_map, obj.timeout)
    run.set(key, obj.container).elements[canonical_key] = element
    target = _verdict_target(value)
    if target is not None:
        table.chain_refs[target] = table.chain_refs.get(target, 0) + 1
        run.graph_changed.add(key)


def _check_no_overlap(state: _SetState, key: tuple[str, ...], command: str) -> None:
    """Refuse, as the kernel does, an interval element overlapping one the set holds (the
    other parts equal, the address or network parts overlapping)."""
    for other in state.elements:
        if len(other) != len(key):
            continue
        if all(a == b or _overlaps(a, b) for a, b in zip(key, other, strict=True)):
            raise _error(errno.EEXIST, command, f"interval overlaps {' . '.join(other)}")


def _overlaps(a: str, b: str) -> bool:
    try:
        first, second = ipaddress.ip_network(a, strict=False), ipaddress.ip_network(b, strict=False)
    except ValueError:
        return False
    return first.version == second.version and first.overlaps(second)


def _check_value(
    table: _TableState, state: _SetState, obj: Element, command: str
) -> tuple[str, ...]:
    if not state.is_map:
        if obj.value:
            raise _error(errno.EINVAL, command, f"{obj.container} is a set: no value allowed")
        return ()
    if not obj.value:
        raise _error(errno.EINVAL, command, f"{obj.container} is a map: the element needs a value")
    if state.value_types != ("verdict",):
        return _canonical_parts(state.value_types, obj.value, False, "value", command)
    if len(obj.value) != 1:
        raise _error(errno.EINVAL, command, "a verdict is one part")
    verdict = obj.value[0]
    target = _verdict_target(obj.value)
    if target is None:
        if verdict not in _VERDICTS:
            raise _error(errno.EINVAL, command, f"{verdict!r} is not a verdict")
        return obj.value
    chain = table.chains.get(target)
    if chain is None:
        raise _error(errno.ENOENT, command, f"chain {target} does not exist")
    if chain.spec.hook is not None:
        raise _error(errno.EOPNOTSUPP, command, f"cannot jump to base chain {target}")
    return obj.value


def _canonical_parts(
    types: tuple[str, ...], parts: tuple[str, ...], interval: bool, what: str, command: str
) -> tuple[str, ...]:
    if len(parts) != len(types):
        raise _error(
            errno.EINVAL, command, f"{what} has {len(parts)} parts, the type has {len(types)}"
        )
    out = []
    for datatype, part in zip(types, parts, strict=True):
        canonical = _canonical(datatype, part, interval)
        if canonical is None:
            raise _error(errno.EINVAL, command, f"{part!r} is not a valid {datatype}")
        out.append(canonical)
    return tuple(out)


@functools.lru_cache(maxsize=CANONICAL_CACHE)
def _canonical(datatype: str, part: str, interval: bool) -> str | None:
    """``part`` as the kernel lists it, or None if it is not a ``datatype``.

    Cached (a pure function): every element is checked twice, at evaluation and at
    commit, and the same addresses, ports and protocols recur in many sets; a dry-run
    render (``kubeproxy verify``, ``/debug/verify``) of 10k Services spent most of its
    time here, parsing addresses (``python -m bench.verify``; docs/operators.md, "On a
    node, when something is wrong")."""
    if interval and "-" in part and datatype != "ifname":
        low, _, high = part.partition("-")
        low_c, high_c = _canonical(datatype, low, False), _canonical(datatype, high, False)
        return None if low_c is None or high_c is None else f"{low_c}-{high_c}"
    try:
        if datatype in ("ipv4_addr", "ipv6_addr"):
            version = 4 if datatype == "ipv4_addr" else 6
            if "/" in part:
                if not interval:
                    return None
                network = ipaddress.ip_network(part, strict=False)
                return str(network) if network.version == version else None
            address = ipaddress.ip_address(part)
            return str(address) if address.version == version else None
        if datatype == "inet_service":
            if part.isdigit():
                port = int(part)
                return str(port) if port <= 65535 else None
            return part if _SERVICE_NAME.fullmatch(part) else None
        if datatype == "inet_proto":
            if part.isdigit():
                return part if int(part) <= 255 else None
            return part if part in _PROTOCOLS else None
        if datatype == "integer":
            return part if part.isdigit() and int(part) < 2**32 else None
        if datatype == "mark":
            value = int(part, 0)
            return part if 0 <= value < 2**32 else None
        if datatype == "ether_addr":
            return part.lower() if _ETHER.fullmatch(part) else None
    except ValueError:
        return None
    return part


# Jump depth -----------------------------------------------------------------------------


def _check_jump_depth(table: _TableState) -> None:
    """Refuse, as the kernel does at commit, chains reachable only through too many jumps."""
    verdict_targets: dict[str, set[str]] = {}
    for name, state in table.sets.items():
        if state.value_types == ("verdict",):
            targets = {t for e in state.elements.values() if (t := _verdict_target(e.value))}
            verdict_targets[name] = targets

    def edges(chain: _ChainState) -> Iterator[str]:
        for rule in chain.rules:
            yield from rule.targets
            for ref in rule.refs:
                yield from verdict_targets.get(ref, ())

    height: dict[str, int] = {}  # longest jump path starting at a chain
    on_path: set[str] = set()

    def walk(name: str, depth: int) -> int:
        known = height.get(name)
        if name in on_path or depth + (known or 0) >= _JUMP_DEPTH_MAX:
            raise NftError(
                f"{os.strerror(errno.EMLINK)}: chain {name} is in a jump loop or reached "
                f"through {_JUMP_DEPTH_MAX} or more jumps from a base chain",
                errno.EMLINK,
            )
        if known is not None:
            return known
        on_path.add(name)
        best = 0
        for target in edges(table.chains[name]):
            best = max(best, 1 + walk(target, depth + 1))
        on_path.discard(name)
        height[name] = best
        return best

    for name, chain in table.chains.items():
        if chain.spec.hook is not None:
            walk(name, 0)


# Dump and parse -------------------------------------------------------------------------


def _dump_table(key: _Key, table: _TableState) -> Iterator[str]:
    family, name = key
    yield render_operation(family, name, "add", table.spec)
    chains = sorted(table.chains)
    for chain in chains:
        yield render_operation(family, name, "add", table.chains[chain].spec)
    sets = sorted(n for n, s in table.sets.items() if not s.is_map)
    maps = sorted(n for n, s in table.sets.items() if s.is_map)
    for container in sets + maps:
        yield render_operation(family, name, "add", table.sets[container].spec)
    for chain in chains:
        for rule in table.chains[chain].rules:
            yield render_operation(family, name, "add", rule.rule)
    for container in sets + maps:
        elements = table.sets[container].elements
        for element_key in sorted(elements):
            yield render_operation(family, name, "add", elements[element_key])


_COMMAND = re.compile(
    r"(?P<verb>add|create|insert|flush|delete)\s+(?P<noun>table|chain|rule|set|map|element)"
    r"\s+(?P<family>\S+)\s+(?P<table>\S+)(?:\s+(?P<rest>.*?))?\s*"
)
_BODY = re.compile(r"(?P<name>\S+)\s*(?:\{(?P<body>.*)\})?")
_TRAILING_COMMENT = re.compile(r'\s+comment\s+"(?P<comment>[^"]*)"$')
_ELEMENT_COMMENT = re.compile(r'\s+comment\s+"(?P<comment>[^"]*)"')
_ELEMENT_TIMEOUT = re.compile(r"\s+timeout\s+(?P<timeout>\d+)s\b")


def parse_commands(text: str) -> list[tuple[Family, str, str, NftObject]]:
    """Parse commands as :meth:`Transaction.render` and :meth:`FakeNft.dump` write them.

    Blank lines and ``#`` comment lines are skipped. Returns ``(family, table, verb,
    object)`` tuples; raises :class:`NftError` (``EINVAL``) on anything else.
    """
    out: list[tuple[Family, str, str, NftObject]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _COMMAND.fullmatch(line)
        if match is None:
            raise NftError(f"cannot parse command: {line}", errno.EINVAL)
        family, table = _family(match["family"]), match["table"]
        verb, noun, rest = match["verb"], match["noun"], match["rest"] or ""
        try:
            objs = _parse_object(noun, rest)
        except (ValueError, KeyError) as err:
            raise NftError(f"cannot parse command: {line} ({err})", errno.EINVAL) from None
        for obj in objs:
            if verb in ("add", "create", "insert"):
                obj.validate()
            elif isinstance(obj, Chain | Set | Map):
                validate_name(noun, obj.name)
            out.append((family, table, verb, obj))
    return out


def _parse_object(noun: str, rest: str) -> list[NftObject]:
    if noun == "table":
        props = _properties(rest.strip().removeprefix("{").removesuffix("}")) if rest else {}
        return [Table(comment=_unquote(props.get("comment")))]
    if noun == "rule":
        chain, _, text = rest.partition(" ")
        comment = None
        found = _TRAILING_COMMENT.search(text)
        if found is not None:
            comment, text = found["comment"], text[: found.start()]
        return [Rule(chain, text.strip(), comment)]
    match = _BODY.fullmatch(rest)
    if match is None:
        raise ValueError("want NAME [{ ... }]")
    name, body = match["name"], match["body"]
    if noun == "element":
        return [_parse_element(name, item) for item in _split_outside_quotes(body or "", ",")]
    props = _properties(body or "")
    comment = _unquote(props.pop("comment", None))
    if noun == "chain":
        type_, hook, priority = None, None, None
        if "type" in props:
            words = props.pop("type").split()
            if len(words) != 5 or words[1] != "hook" or words[3] != "priority":
                raise ValueError("want 'type T hook H priority P'")
            type_, hook, priority = words[0], words[2], int(words[4])
        return [Chain(name, type_, hook, priority, props.pop("policy", None), comment)]
    flags = tuple(props.pop("flags").split(",")) if "flags" in props else ()
    timeout = int(props.pop("timeout").removesuffix("s")) if "timeout" in props else None
    size = int(props.pop("size")) if "size" in props else None
    kind = Map if noun == "map" else Set
    if "typeof" in props:
        return [kind(name, props.pop("typeof"), flags, timeout, size, comment, typeof=True)]
    return [kind(name, props.pop("type", ""), flags, timeout, size, comment)]


def _properties(body: str) -> dict[str, str]:
    props: dict[str, str] = {}
    for item in _split_outside_quotes(body, ";"):
        word, _, value = item.strip().partition(" ")
        if word:
            props[word] = value.strip()
    return props


def _unquote(value: str | None) -> str | None:
    if value is None:
        return None
    if len(value) < 2 or value[0] != '"' or value[-1] != '"':
        raise ValueError(f"want a quoted string, got {value!r}")
    return value[1:-1]


def _split_outside_quotes(text: str, separator: str) -> list[str]:
    items: list[str] = []
    current: list[str] = []
    quoted = False
    for char in text:
        if char == '"':
            quoted = not quoted
        if char == separator and not quoted:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def _parse_element(container: str, item: str) -> Element:
    comment, timeout = None, None
    found = _ELEMENT_COMMENT.search(item)
    if found is not None:
        comment, item = found["comment"], item[: found.start()] + item[found.end() :]
    found = _ELEMENT_TIMEOUT.search(item)
    if found is not None:
        timeout, item = int(found["timeout"]), item[: found.start()] + item[found.end() :]
    key_text, sep, value_text = item.partition(" : ")
    key = tuple(key_text.strip().split(" . "))
    value = tuple(value_text.strip().split(" . ")) if sep else ()
    return Element(container, key, value, comment, bool(sep), timeout)
