"""Building ``iptables-restore`` input: :class:`RestoreInput`, chain names, comments.

A :class:`RestoreInput` collects, per table, chain declarations (``:CHAIN - [0:0]``),
chain creations (``-N CHAIN``), rules (``-A CHAIN ...``) and chain deletions
(``-X CHAIN``), and :meth:`RestoreInput.render` writes them as one restore text, meant for
``iptables-restore --noflush`` (so chains this input does not name are left alone: other
components share the ``filter`` and ``nat`` tables).

Speed matters more than anything else here: a cold sync at 30k Services writes about a
million lines. Rules arrive pre-rendered by the caller (from parts it has validated
already) and are stored as strings; nothing is parsed. Chain names are checked once per
:class:`RestoreInput` and then remembered.

How to split a big sync per variant (iptables-nft slows down with the square of the
chains one restore touches; iptables-legacy with the size of the table) is in
:data:`COLD_SYNC_NOTE`, measured.
"""

from __future__ import annotations

import re

__all__ = [
    "BUILTIN_CHAINS",
    "CHAIN_NAME_MAX",
    "COLD_SYNC_NOTE",
    "COMMENT_MAX",
    "FILTER",
    "MANGLE",
    "NAT",
    "NFT_CHAINS_PER_RESTORE",
    "TABLES",
    "RestoreError",
    "RestoreInput",
    "check_chain_name",
    "check_table",
    "comment",
]

FILTER = "filter"
"""The ``filter`` table."""
NAT = "nat"
"""The ``nat`` table."""
MANGLE = "mangle"
"""The ``mangle`` table."""
TABLES = (FILTER, NAT, MANGLE)
"""The tables a :class:`RestoreInput` writes, in the order it renders them."""

BUILTIN_CHAINS: dict[str, tuple[str, ...]] = {
    FILTER: ("INPUT", "FORWARD", "OUTPUT"),
    NAT: ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    MANGLE: ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"),
}
"""Each table's built-in chains, in the order ``iptables-save`` prints them."""

CHAIN_NAME_MAX = 28
"""Longest user chain name iptables accepts (``XT_EXTENSION_MAXNAMELEN`` - 1 - 2)."""

NFT_CHAINS_PER_RESTORE = 2000
"""Chains per restore above which iptables-nft slows down sharply (see :data:`COLD_SYNC_NOTE`)."""

COMMENT_MAX = 255
"""Longest ``-m comment`` text the kernel keeps (``XT_MAX_COMMENT_LEN`` - 1)."""

COLD_SYNC_NOTE = """\
Measured with iptables 1.8.9 on 2 cores, kube-proxy-shaped nat table (per Service one
KUBE-SERVICES rule, a KUBE-SVC and a KUBE-SEP chain, 5 rules), always --noflush:

* iptables-nft: the cost of one restore grows with the square of the number of chains
  (and jumps to distinct chains) that restore creates or touches, not with the size of
  the table and not with plain rule count. 10k Services in one restore: 18-20 s, with
  ':CHAIN' declarations or '-N' alike (so flushing declared chains is not the cause);
  the same in restores of 1k Services each: about 2 s in total; 30k in 30 restores: 6.4 s.
  A small restore against a big table is cheap (one chain: 0.01 s at 10k Services), but
  rewriting KUBE-SERVICES with its 10k jumps costs about 3-4 s; '-D'/'-A' of the changed
  KUBE-SERVICES rules instead: 0.23 s.
  Fastest safe cold sync: first a restore declaring the shared chains (KUBE-SERVICES,
  KUBE-MARK-MASQ...) and their fixed rules, then restores of at most
  NFT_CHAINS_PER_RESTORE chains each, every one holding complete Services (their chains
  declared and filled, then their KUBE-SERVICES rules appended), so each committed step
  is consistent. On a failure part-way, fall back to a full resync.
* iptables-legacy: the cost grows with the whole table (each COMMIT replaces the
  table's blob in the kernel): 10k Services in one restore: 0.7-1.3 s, split in ten:
  1.8-2.4 s; even a one-chain restore costs 0.1-0.25 s at 10k. Fastest: one restore with
  everything, tables in one input.
* Neither variant needs '-N': declare() is as fast and is idempotent; create() exists for
  callers that want the restore to fail if the chain is unexpectedly present.
"""
"""How to do a fast cold sync with each variant (for the renderer)."""

_CHAIN_NAME = re.compile(r"[A-Za-z0-9_-]{1,28}")
_SAFE_COMMENT = re.compile(r"[A-Za-z0-9_-]+")
_BUILTIN_NAMES = frozenset(name for names in BUILTIN_CHAINS.values() for name in names)


class RestoreError(ValueError):
    """A chain name, table or argument that cannot go into iptables-restore input."""


def check_chain_name(name: str) -> str:
    """Return ``name`` if it is a valid user chain name, else raise :class:`RestoreError`.

    Valid: 1 to :data:`CHAIN_NAME_MAX` characters from ``[A-Za-z0-9_-]``. This is
    stricter than iptables (which takes most printable characters) on purpose: names are
    built from API objects, and this set needs no quoting anywhere.
    """
    if not isinstance(name, str) or _CHAIN_NAME.fullmatch(name) is None:
        raise RestoreError(
            f"invalid iptables chain name {name!r}: need 1-{CHAIN_NAME_MAX} characters "
            "from A-Z a-z 0-9 _ -"
        )
    return name


def check_table(table: str) -> str:
    """Return ``table`` if it is one of :data:`TABLES`, else raise :class:`RestoreError`."""
    if table not in BUILTIN_CHAINS:
        raise RestoreError(f"unknown iptables table {table!r}: want one of {', '.join(TABLES)}")
    return table


def quote(text: str) -> str:
    """``text`` as one iptables-restore word, quoted as ``iptables-save`` quotes it.

    Words made only of ``[A-Za-z0-9_-]`` stay bare; anything else is put in double quotes
    with ``"``, ``\\`` and ``'`` escaped by a backslash. Control characters (newlines
    included) are refused: iptables-restore reads one rule per line.
    """
    if _SAFE_COMMENT.fullmatch(text):
        return text
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in text):
        raise RestoreError(f"control character in iptables argument {text!r}")
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("'", "\\'")
    return f'"{escaped}"'


def comment(text: str) -> str:
    """The match ``-m comment --comment "text"`` for a rule.

    The text is always double-quoted (as upstream kube-proxy writes it), with ``"``, ``\\``
    and ``'`` escaped the way iptables-restore reads them back; empty text, control
    characters and texts longer than :data:`COMMENT_MAX` are refused with
    :class:`RestoreError`.
    """
    if not text:
        raise RestoreError("empty iptables comment")
    if len(text.encode()) > COMMENT_MAX:
        raise RestoreError(f"iptables comment longer than {COMMENT_MAX} bytes: {text[:40]!r}...")
    quoted = quote(text)
    if not quoted.startswith('"'):
        quoted = f'"{quoted}"'
    return f"-m comment --comment {quoted}"


class _TableInput:
    """What one table's block holds; kept apart so :meth:`RestoreInput.render` is a join."""

    __slots__ = ("created", "declared", "deleted", "rules")

    def __init__(self) -> None:
        self.declared: list[str] = []
        self.created: list[str] = []
        self.rules: list[str] = []
        self.deleted: list[str] = []

    def __len__(self) -> int:
        return len(self.declared) + len(self.created) + len(self.rules) + len(self.deleted)


class RestoreInput:
    """iptables-restore input for one family (run with ``--noflush``).

    Per table, :meth:`render` writes ``*table``, the chain declarations, the ``-N``
    creations, the rule lines (``-A``, ``-I``, ``-D``) in the order they were queued, the
    ``-X`` deletions, and
    ``COMMIT``; tables go in the order of :data:`TABLES`, and a table with nothing in it
    is left out. Every method raises :class:`RestoreError` at once for a bad table, chain
    name or rule, so callers can write straight-line code.

    Built-in chains (``INPUT``, ``PREROUTING``...) cannot be declared, created or deleted
    here: declaring one under ``--noflush`` would flush it, removing other components'
    rules. Jumps from built-in chains go through the executor's ``ensure_rule``.
    """

    __slots__ = ("_chains", "_rules", "_tables")

    def __init__(self) -> None:
        self._tables: dict[str, _TableInput] = {}
        # Each table's rule list, one lookup away: append is the hot path.
        self._rules: dict[str, list[str]] = {}
        # Chain names already checked; a set lookup is far cheaper than the regex.
        self._chains: set[str] = set()

    def _table(self, table: str) -> _TableInput:
        block = self._tables.get(table)
        if block is None:
            check_table(table)
            block = self._tables[table] = _TableInput()
        return block

    def _user_chain(self, chain: str) -> str:
        if chain not in self._chains:
            self._chains.add(check_chain_name(chain))
        if chain in _BUILTIN_NAMES:
            raise RestoreError(f"built-in chain {chain} cannot be declared, created or deleted")
        return chain

    def declare(self, table: str, chain: str) -> None:
        """``:CHAIN - [0:0]``: create ``chain`` in ``table``, or flush it if it exists."""
        self._table(table).declared.append(f":{self._user_chain(chain)} - [0:0]")

    def create(self, table: str, chain: str) -> None:
        """``-N CHAIN``: create ``chain``, which must not exist (the restore fails if it does).

        Cheaper than :meth:`declare` with iptables-nft on big tables (see
        :data:`COLD_SYNC_NOTE`); use it only for chains known to be absent.
        """
        self._table(table).created.append(f"-N {self._user_chain(chain)}")

    def append(self, table: str, chain: str, rule: str) -> None:
        """``-A CHAIN rule``: ``rule`` is the rest of the line, already rendered.

        The caller builds ``rule`` from validated parts (addresses parsed, ports ranged,
        comments through :func:`comment`); only line breaks are refused here, since they
        would smuggle in more lines. ``chain`` may be a built-in chain, but under
        ``--noflush`` such a rule is added again on every restore.
        """
        rules = self._rules.get(table)
        if rules is None:
            rules = self._rules[table] = self._table(table).rules
        if chain not in self._chains:
            self._chains.add(check_chain_name(chain))
        if "\n" in rule or "\r" in rule:
            raise RestoreError(f"line break in iptables rule for chain {chain}: {rule!r}")
        rules.append(f"-A {chain} {rule}")

    def insert(self, table: str, chain: str, rule: str) -> None:
        """``-I CHAIN rule``: put ``rule`` first in ``chain``; kept in order with the other
        rule lines (see :meth:`append` for what ``rule`` may hold)."""
        self._rule_line("-I", table, chain, rule)

    def delete_rule(self, table: str, chain: str, rule: str) -> None:
        """``-D CHAIN rule``: delete the rule equal to ``rule`` from ``chain`` (the restore
        fails if there is none); kept in order with the other rule lines.

        With iptables-nft, replacing a few rules of a big chain this way is far cheaper
        than declaring (flushing) and refilling it (see :data:`COLD_SYNC_NOTE`).
        """
        self._rule_line("-D", table, chain, rule)

    def _rule_line(self, op: str, table: str, chain: str, rule: str) -> None:
        block = self._table(table)
        check_chain_name(chain)
        if not rule or "\n" in rule or "\r" in rule:
            raise RestoreError(f"empty rule or line break in iptables rule for {chain}: {rule!r}")
        block.rules.append(f"{op} {chain} {rule}")

    def chain_count(self, table: str) -> int:
        """Chains declared or created in ``table`` so far (to size iptables-nft restores)."""
        block = self._tables.get(check_table(table))
        return 0 if block is None else len(block.declared) + len(block.created)

    def delete_chain(self, table: str, chain: str) -> None:
        """``-X CHAIN``, written after all rules of the table.

        The chain must exist and no rule may still jump to it. iptables-legacy also
        refuses to delete a chain with rules in it, so declare it in the same input
        (which flushes it) unless it is known to be empty.
        """
        self._table(table).deleted.append(f"-X {self._user_chain(chain)}")

    def render(self) -> str:
        """The restore text: one block per non-empty table, ending in a newline."""
        parts: list[str] = []
        for table in TABLES:
            block = self._tables.get(table)
            if block is None or not len(block):
                continue
            parts.append(f"*{table}")
            parts.extend(block.declared)
            parts.extend(block.created)
            parts.extend(block.rules)
            parts.extend(block.deleted)
            parts.append("COMMIT")
        if not parts:
            return ""
        parts.append("")
        return "\n".join(parts)

    @property
    def empty(self) -> bool:
        """True if nothing was declared, created, appended or deleted."""
        return not any(len(block) for block in self._tables.values())

    def line_count(self, table: str) -> int:
        """Lines ``table``'s block holds, without ``*table`` and ``COMMIT`` (0 if none)."""
        block = self._tables.get(check_table(table))
        return 0 if block is None else len(block)

    def tables(self) -> list[str]:
        """The tables that :meth:`render` will write, in order."""
        return [t for t in TABLES if (block := self._tables.get(t)) is not None and len(block)]
