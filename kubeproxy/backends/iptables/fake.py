"""An in-memory :class:`~kubeproxy.backends.iptables.exec.IptablesExecutor`.

:class:`FakeIptables` reads real ``iptables-restore`` input (``*table``, ``:CHAIN``
declarations, ``-A``/``-I``/``-D``/``-N``/``-F``/``-X``, ``COMMIT``, ``#`` comments, words
quoted as iptables-restore reads them) with ``--noflush`` semantics, and checks what the
kernel checks (measured against iptables 1.8.9, both variants):

* an unknown table, a line outside a table block, a missing ``COMMIT``;
* ``-A``/``-I``/``-D`` on a chain that does not exist, ``-N`` of one that does;
* a jump (``-j``/``-g``) to a chain that does not exist or is built-in (built-in targets
  are fine), ``DNAT``/``SNAT``/``MASQUERADE``/``REDIRECT`` outside the ``nat`` table and
  ``REJECT`` outside ``filter``;
* ``-X`` of a missing, built-in, non-empty or still-referenced chain;
* a malformed line (an unknown command, a dangling option, an unterminated quote).

Each table block is all-or-nothing and is committed at its ``COMMIT``, like the real
tools: when a later block fails, earlier blocks of the same input stay applied.

:meth:`FakeIptables.dump` writes ``iptables-save`` text without the comment lines and
with ``[0:0]`` counters. Rules are stored in the form iptables-save prints them for the
matches kube-proxy uses (``-s``/``-d``/``-i``/``-o``/``-p`` first, host addresses with
``/32`` or ``/128``, the implicit ``-m tcp`` before ``--dport``, comments quoted only when
needed, ``--probability`` with 11 decimals), so a dump of the fake and a real
``iptables-save`` agree for such rules.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from kubeproxy.backends.iptables.exec import IptablesError, IptablesVariant
from kubeproxy.backends.iptables.restore import BUILTIN_CHAINS, FILTER, NAT, TABLES
from kubeproxy.objects import IPFamily

__all__ = ["BUILTIN_TARGETS", "FakeIptables", "save_form", "tokenize"]

BUILTIN_TARGETS = frozenset(
    {
        "ACCEPT",
        "DROP",
        "RETURN",
        "QUEUE",
        "REJECT",
        "DNAT",
        "SNAT",
        "MASQUERADE",
        "REDIRECT",
        "MARK",
        "CONNMARK",
        "LOG",
        "NOTRACK",
        "CT",
        "TPROXY",
        "CHECKSUM",
        "TCPMSS",
        "NFLOG",
    }
)
"""Targets that are extensions, not chains (``-j`` to them needs no chain)."""

_NAT_ONLY_TARGETS = frozenset({"DNAT", "SNAT", "MASQUERADE", "REDIRECT"})
_CHAIN_NAME = re.compile(r"[^\s!\"']{1,28}")
_FRONT_OPTIONS = {
    "-s": "-s",
    "--source": "-s",
    "--src": "-s",
    "-d": "-d",
    "--destination": "-d",
    "--dst": "-d",
    "-i": "-i",
    "--in-interface": "-i",
    "-o": "-o",
    "--out-interface": "-o",
    "-p": "-p",
    "--protocol": "-p",
}
_FRONT_ORDER = ("-s", "-d", "-i", "-o", "-p")
_PORT_OPTIONS = frozenset({"--dport", "--sport", "--destination-port", "--source-port"})
_PORT_PROTOCOLS = frozenset({"tcp", "udp", "sctp"})


class _RestoreFailure(Exception):
    """One line of restore input the fake refuses (turned into an IptablesError)."""

    def __init__(self, reason: str, returncode: int = 1) -> None:
        super().__init__(reason)
        self.returncode = returncode


def tokenize(line: str) -> list[str]:
    """Split a restore line into words the way iptables-restore does.

    Words are split on blanks; a ``"`` opens a quoted part (which may start mid-word), in
    which blanks are kept and ``\\`` escapes the next character; the closing ``"`` ends the
    word. Raises ValueError for an unterminated quote.
    """
    if '"' not in line and "\\" not in line:
        return line.split()
    if "\\" not in line:
        # No escapes: every quote is a real one; odd parts of a split on '"' are quoted.
        parts = line.split('"')
        if len(parts) % 2 == 0:
            raise ValueError("unterminated quote")
        words: list[str] = []
        prefix = ""
        for index, part in enumerate(parts):
            if index % 2:
                words.append(prefix + part)
                continue
            bare = part.split()
            # A quote right after a word continues it ("ab"c d"" is one word, "abc d").
            glued = index + 1 < len(parts) and bare and not part[-1].isspace()
            prefix = bare.pop() if glued else ""
            words.extend(bare)
        return words
    return _tokenize_chars(line)


def _tokenize_chars(line: str) -> list[str]:
    """:func:`tokenize`, character by character (the general case, with escapes)."""
    words: list[str] = []
    buffer: list[str] = []
    quoted = escaped = False
    for char in line:
        if quoted:
            if escaped:
                buffer.append(char)
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                quoted = False
                words.append("".join(buffer))
                buffer = []
            else:
                buffer.append(char)
        elif char == '"':
            quoted = True
        elif char in " \t\r\n":
            if buffer:
                words.append("".join(buffer))
                buffer = []
        else:
            buffer.append(char)
    if quoted:
        raise ValueError("unterminated quote")
    if buffer:
        words.append("".join(buffer))
    return words


def _host_prefix(address: str, family: IPFamily) -> str:
    if "/" in address:
        return address
    return f"{address}/{128 if family == IPFamily.IPV6 else 32}"


def save_form(args: Sequence[str], family: IPFamily) -> tuple[str, ...]:
    """A rule's words (after ``-A CHAIN``) in the order and form iptables-save prints them.

    Raises ValueError for an option that lacks its value.
    """
    front: dict[str, list[str]] = {}
    rest: list[str] = []
    index = 0
    negate = False
    while index < len(args):
        word = args[index]
        if word == "!":
            negate = True
            index += 1
            continue
        canonical = _FRONT_OPTIONS.get(word)
        if canonical is not None:
            if index + 1 >= len(args):
                raise ValueError(f"option {word} needs a value")
            value = args[index + 1]
            if canonical in ("-s", "-d"):
                value = _host_prefix(value, family)
            elif canonical == "-p":
                value = value.lower()
            front[canonical] = [*(["!"] if negate else []), canonical, value]
            negate = False
            index += 2
            continue
        if negate:
            rest.append("!")
            negate = False
        rest.append(word)
        index += 1
    if negate:
        raise ValueError("'!' at the end of the rule")
    protocol = front.get("-p", [""])[-1]
    if protocol in _PORT_PROTOCOLS and f"-m {protocol}" not in " ".join(rest):
        for position, word in enumerate(rest):
            if word in _PORT_OPTIONS:
                if position > 0 and rest[position - 1] == "!":
                    position -= 1
                rest[position:position] = ["-m", protocol]
                break
    for position, word in enumerate(rest[:-1]):
        if word == "--probability":
            try:
                rest[position + 1] = f"{float(rest[position + 1]):.11f}"
            except ValueError as err:
                raise ValueError(f"bad probability {rest[position + 1]!r}") from err
    _target_form(rest, family)
    words: list[str] = []
    for option in _FRONT_ORDER:
        words.extend(front.get(option, ()))
    words.extend(rest)
    return tuple(words)


_MARK_ALL = 0xFFFFFFFF


def _mark_form(option: str, value: str) -> str | None:
    """``--set-xmark value/mask`` for a MARK target option, as iptables-save prints it."""
    mark, _, mask = value.partition("/")
    try:
        number = int(mark, 0)
        mask_number = int(mask, 0) if mask else _MARK_ALL
    except ValueError:
        return None
    if option == "--set-mark":
        return f"{number:#x}/{mask_number:#x}"
    if option == "--or-mark":
        return f"{number:#x}/{number:#x}"
    if option == "--xor-mark":
        return f"{number:#x}/0x0"
    if option == "--and-mark":
        return f"0x0/{~number & _MARK_ALL:#x}"
    return None


def _target_form(rest: list[str], family: IPFamily) -> None:
    """Rewrite the MARK and REJECT targets' options in place into iptables-save's form:
    the MARK shorthands become ``--set-xmark value/mask`` and a bare REJECT gets the
    default ``--reject-with`` (both tools print these, whatever the input said)."""
    for position, word in enumerate(rest[:-1]):
        if word != "-j":
            continue
        target = rest[position + 1]
        if target == "MARK" and position + 3 < len(rest):
            form = _mark_form(rest[position + 2], rest[position + 3])
            if form is not None:
                rest[position + 2 : position + 4] = ["--set-xmark", form]
        elif target == "REJECT" and "--reject-with" not in rest[position + 2 :]:
            default = (
                "icmp6-port-unreachable" if family == IPFamily.IPV6 else "icmp-port-unreachable"
            )
            rest[position + 2 : position + 2] = ["--reject-with", default]
        return


def _save_word(word: str) -> str:
    escaped = word.replace("\\", "\\\\").replace('"', '\\"').replace("'", "\\'")
    return f'"{escaped}"'


@functools.lru_cache(maxsize=1 << 16)
def _render(words: tuple[str, ...]) -> str:
    """Words joined as iptables-save prints them: comments through its quoting rule."""
    out = list(words)
    for index, word in enumerate(out):
        comment_text = index > 0 and words[index - 1] == "--comment"
        if not (_SAFE if comment_text else _BARE).fullmatch(word):
            out[index] = _save_word(word)
    return " ".join(out)


# iptables-save prints a comment bare only if it is made of these; other words are bare
# unless they hold blanks or quotes.
_SAFE = re.compile(r"[A-Za-z0-9_-]+")
_BARE = re.compile(r"[^\s\"'\\]+")


def _target(words: Sequence[str]) -> tuple[str, str] | None:
    """``("-j", target)`` or ``("-g", chain)`` of a rule, if it has one."""
    found: tuple[str, str] | None = None
    for index, word in enumerate(words):
        if word in ("-j", "--jump", "-g", "--goto"):
            if index + 1 >= len(words):
                raise _RestoreFailure(f"option {word} needs a target", 2)
            found = ("-g" if word in ("-g", "--goto") else "-j", words[index + 1])
    return found


class _Chain:
    __slots__ = ("policy", "rules")

    def __init__(self, policy: str = "-", rules: list[tuple[str, ...]] | None = None) -> None:
        self.policy = policy
        self.rules: list[tuple[str, ...]] = rules if rules is not None else []


_Table = dict[str, _Chain]


def _new_table(table: str) -> _Table:
    return {name: _Chain("ACCEPT") for name in BUILTIN_CHAINS[table]}


def _copy(table: _Table) -> _Table:
    return {name: _Chain(chain.policy, list(chain.rules)) for name, chain in table.items()}


class FakeIptables:
    """:class:`~kubeproxy.backends.iptables.exec.IptablesExecutor` in memory.

    Holds, per family and table, the chains (built-in ones from the start) and their rules.
    ``restores`` records every restore input received, in order (failed ones included).
    """

    def __init__(self, variant: IptablesVariant = IptablesVariant.NFT) -> None:
        self.variant = variant
        self.restores: list[tuple[IPFamily, str]] = []
        self._state: dict[tuple[IPFamily, str], _Table] = {}
        self._fail: list[str] = []

    def _table(self, family: IPFamily, table: str) -> _Table:
        key = (family, table)
        state = self._state.get(key)
        if state is None:
            if table not in BUILTIN_CHAINS:
                raise IptablesError(f"unknown table {table!r}", returncode=2)
            state = self._state[key] = _new_table(table)
        return state

    def fail_next(self, message: str = "fake iptables-restore: injected failure") -> None:
        """Make the next :meth:`restore` fail with ``message``, changing nothing."""
        self._fail.append(message)

    # -- restore ---------------------------------------------------------------------

    def restore(self, family: IPFamily, text: str, *, counters: bool = False) -> None:
        """Apply ``text`` as ``iptables-restore --noflush`` would; raises IptablesError."""
        self.restores.append((family, text))
        if self._fail:
            message = self._fail.pop(0)
            raise IptablesError(message, returncode=1, stderr=message)
        table_name: str | None = None
        work: _Table = {}
        lines = text.splitlines()
        for number, line in enumerate(lines, 1):
            stripped = line.strip()
            try:
                if not stripped or stripped.startswith("#"):
                    continue
                if stripped.startswith("*"):
                    if table_name is not None:
                        raise _RestoreFailure(f"COMMIT expected at line {number}")
                    table_name = stripped[1:]
                    if table_name not in BUILTIN_CHAINS:
                        raise _RestoreFailure(f"table name {table_name!r} invalid", 2)
                    work = _copy(self._table(family, table_name))
                    continue
                if table_name is None:
                    raise _RestoreFailure("no table specified", 2)
                if stripped == "COMMIT":
                    self._state[(family, table_name)] = work
                    table_name = None
                    continue
                if stripped.startswith(":"):
                    self._declare(table_name, work, stripped)
                    continue
                try:
                    words = tokenize(stripped)
                except ValueError as err:
                    raise _RestoreFailure(str(err), 2) from err
                self._command(family, table_name, work, words, counters)
            except _RestoreFailure as failure:
                message = f"fake iptables-restore: line {number} failed: {failure}"
                raise IptablesError(
                    message,
                    returncode=failure.returncode,
                    stderr=message,
                    line_number=number,
                    line=line,
                ) from None
        if table_name is not None:
            message = f"fake iptables-restore: COMMIT expected at line {len(lines) + 1}"
            raise IptablesError(message, returncode=1, stderr=message)

    @staticmethod
    def _declare(table: str, work: _Table, line: str) -> None:
        parts = line[1:].split()
        if len(parts) < 2 or _CHAIN_NAME.fullmatch(parts[0]) is None:
            raise _RestoreFailure(f"bad chain declaration {line!r}", 2)
        name, policy = parts[0], parts[1]
        builtin = name in BUILTIN_CHAINS[table]
        if builtin and policy not in ("ACCEPT", "DROP"):
            raise _RestoreFailure(f"bad policy {policy!r} for built-in chain {name}", 2)
        if not builtin and policy != "-":
            raise _RestoreFailure(f"user chain {name} cannot have a policy", 2)
        chain = work.get(name)
        if chain is None:
            work[name] = _Chain(policy)
        else:
            chain.rules.clear()
            if builtin:
                chain.policy = policy

    def _command(
        self, family: IPFamily, table: str, work: _Table, words: list[str], counters: bool
    ) -> None:
        if counters and words and words[0].startswith("["):
            words = words[1:]
        if len(words) < 2 and words[:1] != ["-F"]:
            raise _RestoreFailure(f"malformed command {' '.join(words)!r}", 2)
        op = words[0]
        if op == "-F":
            for name in words[1:2] or list(work):
                self._chain(work, name).rules.clear()
            return
        name = words[1]
        if op == "-N":
            if _CHAIN_NAME.fullmatch(name) is None:
                raise _RestoreFailure(f"invalid chain name {name!r}", 2)
            if name in work:
                raise _RestoreFailure("Chain already exists.")
            work[name] = _Chain()
            return
        if op == "-X":
            self._delete_chain(table, work, name)
            return
        chain = self._chain(work, name)
        args = words[2:]
        if op == "-A":
            chain.rules.append(self._rule(family, table, work, args))
        elif op == "-I":
            position = 1
            if args and args[0].isdigit():
                position, args = int(args[0]), args[1:]
            if not 1 <= position <= len(chain.rules) + 1:
                raise _RestoreFailure("Index of insertion too big.")
            chain.rules.insert(position - 1, self._rule(family, table, work, args))
        elif op == "-D":
            if len(args) == 1 and args[0].isdigit():
                index = int(args[0]) - 1
                if not 0 <= index < len(chain.rules):
                    raise _RestoreFailure("Index of deletion too big.")
                del chain.rules[index]
                return
            rule = self._rule(family, table, work, args)
            if rule not in chain.rules:
                raise _RestoreFailure("Bad rule (does a matching rule exist in that chain?).")
            chain.rules.remove(rule)
        else:
            raise _RestoreFailure(f"unknown command {op!r}", 2)

    @staticmethod
    def _chain(work: _Table, name: str) -> _Chain:
        chain = work.get(name)
        if chain is None:
            raise _RestoreFailure(f"No chain/target/match by that name ({name}).")
        return chain

    @staticmethod
    def _rule(family: IPFamily, table: str, work: _Table, args: Sequence[str]) -> tuple[str, ...]:
        try:
            words = save_form(args, family)
        except ValueError as err:
            raise _RestoreFailure(str(err), 2) from err
        target = _target(words)
        if target is not None:
            kind, name = target
            if name in BUILTIN_TARGETS and kind == "-j":
                if name in _NAT_ONLY_TARGETS and table != NAT:
                    raise _RestoreFailure(f"{name} target is only valid in the nat table")
                if name == "REJECT" and table != FILTER:
                    raise _RestoreFailure("REJECT target is only valid in the filter table")
            elif name not in work or name in BUILTIN_CHAINS[table]:
                raise _RestoreFailure(f"Chain '{name}' does not exist", 2)
        return words

    @staticmethod
    def _delete_chain(table: str, work: _Table, name: str) -> None:
        chain = work.get(name)
        if chain is None:
            raise _RestoreFailure(f"No chain/target/match by that name ({name}).")
        if name in BUILTIN_CHAINS[table]:
            raise _RestoreFailure(f"cannot delete built-in chain {name}")
        if chain.rules:
            raise _RestoreFailure(f"chain {name} is not empty (Directory not empty)")
        for other, holder in work.items():
            for rule in holder.rules:
                target = _target(rule)
                if target is not None and target[1] == name:
                    raise _RestoreFailure(
                        f"chain {name} is still referenced from {other} (Device or resource busy)"
                    )
        del work[name]

    # -- reads and single rules ---------------------------------------------------------

    def save(self, family: IPFamily, table: str) -> str:
        """The table in ``iptables-save -t table`` form (see :meth:`dump`)."""
        self._table(family, table)
        return self.dump(family, table)

    def dump(self, family: IPFamily, table: str | None = None) -> str:
        """iptables-save text of ``table``, or of every table touched so far, in
        :data:`~kubeproxy.backends.iptables.restore.TABLES` order.

        Built-in chains come first in their usual order, then user chains sorted by name
        (as iptables-save prints them); rules per chain in order; no comment lines.
        """
        names = [table] if table is not None else [t for t in TABLES if (family, t) in self._state]
        out: list[str] = []
        for name in names:
            state = self._state.get((family, name))
            if state is None:
                state = _new_table(name) if name in BUILTIN_CHAINS else {}
            builtins = BUILTIN_CHAINS.get(name, ())
            order = [c for c in builtins if c in state] + sorted(
                c for c in state if c not in builtins
            )
            out.append(f"*{name}")
            out.extend(f":{chain} {state[chain].policy} [0:0]" for chain in order)
            for chain in order:
                out.extend(
                    f"-A {chain} {_render(rule)}" if rule else f"-A {chain}"
                    for rule in state[chain].rules
                )
            out.append("COMMIT")
        return "".join(f"{line}\n" for line in out)

    def chains(self, family: IPFamily, table: str) -> set[str]:
        """All chain names in ``table``, built-in ones included."""
        return set(self._table(family, table))

    def chain_exists(self, family: IPFamily, table: str, chain: str) -> bool:
        """Whether ``chain`` is in ``table``."""
        return chain in self._table(family, table)

    def _single_rule(
        self, family: IPFamily, table: str, chain: str, args: Sequence[str]
    ) -> tuple[_Chain, tuple[str, ...]]:
        state = self._table(family, table)
        try:
            return self._chain(state, chain), self._rule(family, table, state, list(args))
        except _RestoreFailure as failure:
            raise IptablesError(
                f"fake iptables -t {table} {chain}: {failure}", returncode=failure.returncode
            ) from None

    def ensure_rule(
        self,
        family: IPFamily,
        table: str,
        chain: str,
        args: Sequence[str],
        *,
        prepend: bool = True,
    ) -> bool:
        """Add the rule first (``prepend``) or last in ``chain`` unless present; True if added."""
        holder, rule = self._single_rule(family, table, chain, args)
        if rule in holder.rules:
            return False
        if prepend:
            holder.rules.insert(0, rule)
        else:
            holder.rules.append(rule)
        return True

    def delete_rule(self, family: IPFamily, table: str, chain: str, args: Sequence[str]) -> bool:
        """Delete the first rule equal to ``args`` from ``chain``; True if there was one."""
        state = self._table(family, table)
        if chain not in state:
            return False
        try:
            rule = save_form(list(args), family)
        except ValueError as err:
            raise IptablesError(
                f"fake iptables -t {table} -D {chain}: {err}", returncode=2
            ) from None
        # A rule jumping to a missing chain is simply not there (as iptables -C says).
        holder = state[chain]
        if rule not in holder.rules:
            return False
        holder.rules.remove(rule)
        return True
