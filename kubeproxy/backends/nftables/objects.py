"""Typed nftables objects (table, chain, rule, set, map, element) and their validation.

Each object is a frozen, slotted dataclass naming one thing in *one* table; the table and
family come from the :class:`~kubeproxy.backends.nftables.transaction.Transaction` it is
queued in. ``validate()`` checks everything that would otherwise only fail when nft parses
the text, or worse, change its meaning (a ``;`` or newline in a rule would start a new
command), so nothing unchecked ever reaches ``nft -f``.

:class:`NftError` lives here (not in ``transaction``) because validation raises it and the
transaction, the fake and the executors all import this module.
"""

from __future__ import annotations

import errno as _errno
import re
from dataclasses import dataclass, field, replace
from enum import StrEnum

__all__ = [
    "COMMENT_LENGTH_MAX",
    "ELEMENT_PART",
    "NAME_LENGTH_MAX",
    "PROTOCOL_NUMBERS",
    "SET_FLAGS",
    "Chain",
    "Element",
    "Family",
    "Map",
    "NftError",
    "Rule",
    "Set",
    "Table",
    "is_already_exists",
    "is_busy",
    "is_not_found",
    "readable_by_every_nft",
    "validate_comment",
    "validate_element_part",
    "validate_element_parts",
    "validate_name",
    "validate_rule_text",
]

NAME_LENGTH_MAX = 256
"""Longest table, chain, set or map name the kernel accepts (``NFT_NAME_MAXLEN``)."""

COMMENT_LENGTH_MAX = 128
"""Longest comment the kernel stores (``NFT_USERDATA_MAXLEN`` for comments)."""

PROTOCOL_NUMBERS = {"tcp": 6, "udp": 17, "sctp": 132}
"""The transport protocols a Service port may have, by the IP protocol number the kernel
reads (``meta l4proto``, ``ct original protocol``): what the encoders write for them."""

SET_FLAGS = frozenset({"constant", "dynamic", "interval", "timeout"})
"""Set and map flags we allow."""

CHAIN_TYPES = frozenset({"filter", "nat", "route"})
CHAIN_HOOKS = frozenset({"prerouting", "input", "forward", "output", "postrouting", "ingress"})
CHAIN_POLICIES = frozenset({"accept", "drop"})

# nft's lexer reads an unquoted name that starts with a digit as a number, so a name must
# start with a letter or '_'; ':' and '/' are accepted (upstream's chain names carry '/').
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")
# A data type name ("ipv4_addr") or a concatenation of them ("ipv4_addr . inet_service").
_TYPE_RE = re.compile(r"[a-z][a-z0-9_]*(?: \. [a-z][a-z0-9_]*)*")
# A ``typeof`` declaration: expressions of one or more words ("ip daddr", "numgen random
# mod 1"), concatenated with " . ". Needed where no named type fits: a numgen result in a
# concatenated key is a plain 32-bit integer, which ``type`` cannot spell.
_TYPEOF_WORD = r"[a-z0-9][a-z0-9_-]*"
_TYPEOF_EXPR = rf"{_TYPEOF_WORD}(?: {_TYPEOF_WORD})*"
_TYPEOF_RE = re.compile(rf"{_TYPEOF_EXPR}(?: \. {_TYPEOF_EXPR})*")
# One element key/value part: words separated by single spaces, none of them a lone '.' or
# ':' (the concatenation and key/value separators); no character that ends an element, a
# command or a line ('#' starts an nft comment).
_WORD = r'(?![.:](?: |$))[^\s{},;#"]+'
_ELEMENT_PART_RE = re.compile(rf"{_WORD}(?: {_WORD})*")
ELEMENT_PART = _ELEMENT_PART_RE
"""What :func:`validate_element_part` accepts, for callers that check many parts inline."""
_PRIORITY_MIN, _PRIORITY_MAX = -(2**31), 2**31 - 1


class NftError(Exception):
    """An nftables operation was invalid or refused; the kernel state did not change.

    ``errno`` is set when the failure maps to one (``ENOENT`` for a missing object,
    ``EEXIST``, ``EBUSY`` for an object still in use, ``EINVAL`` for invalid input ...).
    """

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


def is_not_found(err: BaseException) -> bool:
    """Whether ``err`` says an object did not exist (``ENOENT``)."""
    return isinstance(err, NftError) and err.errno == _errno.ENOENT


def is_already_exists(err: BaseException) -> bool:
    """Whether ``err`` says an object already existed (``EEXIST``)."""
    return isinstance(err, NftError) and err.errno == _errno.EEXIST


def is_busy(err: BaseException) -> bool:
    """Whether ``err`` says an object is still referenced (``EBUSY``)."""
    return isinstance(err, NftError) and err.errno == _errno.EBUSY


def _invalid(message: str) -> NftError:
    return NftError(message, _errno.EINVAL)


class Family(StrEnum):
    """An nftables address family we write tables in."""

    IP = "ip"
    IP6 = "ip6"
    INET = "inet"


def validate_name(kind: str, name: object) -> None:
    """Raise :class:`NftError` unless ``name`` is a valid nftables ``kind`` name.

    A name that is exactly an nft keyword (``dnat``, ``missing``, ``tcp`` ...) is also
    refused by nft, but not caught here; names with a prefix (``service-...``) are safe.
    """
    if not isinstance(name, str):
        raise _invalid(f"{kind} name must be a string, not {type(name).__name__}")
    if len(name) > NAME_LENGTH_MAX:
        raise _invalid(f"{kind} name {name[:40]!r}... is longer than {NAME_LENGTH_MAX}")
    if _NAME_RE.fullmatch(name) is None:
        raise _invalid(
            f"invalid {kind} name {name!r}: must start with a letter or '_' and use only "
            "letters, digits and _ . / : -"
        )


def validate_comment(comment: object) -> None:
    """Raise :class:`NftError` unless ``comment`` is ``None`` or a comment nft can store."""
    if comment is None:
        return
    if not isinstance(comment, str):
        raise _invalid(f"comment must be a string, not {type(comment).__name__}")
    if len(comment) > COMMENT_LENGTH_MAX:
        raise _invalid(f"comment {comment[:40]!r}... is longer than {COMMENT_LENGTH_MAX}")
    if '"' in comment or "\n" in comment or "\r" in comment:
        raise _invalid(f"comment {comment!r} contains a quote or a line break")


def validate_rule_text(rule: object) -> None:
    """Raise :class:`NftError` unless ``rule`` is one non-empty rule on one line."""
    if not isinstance(rule, str):
        raise _invalid(f"rule must be a string, not {type(rule).__name__}")
    if not rule or rule.isspace():
        raise _invalid("rule text is empty")
    if ";" in rule or "\n" in rule or "\r" in rule:
        raise _invalid(f"rule {rule!r} contains ';' or a line break")


def validate_element_part(what: str, part: object) -> None:
    """Raise :class:`NftError` unless ``part`` is one part of an element key or value.

    A part is one or more words separated by single spaces (``10.0.0.1``, ``tcp``,
    ``goto service-X``); none of ``{ } , ; # "`` or line breaks, and no word that is
    just ``.`` or ``:`` (those separate concatenation parts and keys from values).
    """
    if not isinstance(part, str):
        raise _invalid(f"element {what} part {part!r} is not a string")
    if _ELEMENT_PART_RE.fullmatch(part) is None:
        raise _invalid(
            f"invalid element {what} part {part!r}: want words separated by single spaces, "
            'without { } , ; # " or a lone . or :'
        )


def validate_element_parts(what: str, parts: object, *, allow_empty: bool) -> None:
    """Raise :class:`NftError` unless ``parts`` is a tuple of element key/value parts."""
    if not isinstance(parts, tuple):
        raise _invalid(f"element {what} must be a tuple of strings, not {type(parts).__name__}")
    if not parts and not allow_empty:
        raise _invalid(f"element {what} is empty")
    for part in parts:
        validate_element_part(what, part)


def _validate_positive(what: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _invalid(f"{what} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class Table:
    """The transaction's table (its family and name belong to the transaction)."""

    comment: str | None = None

    def validate(self) -> None:
        """Raise :class:`NftError` if the table cannot be written."""
        validate_comment(self.comment)


@dataclass(frozen=True, slots=True)
class Chain:
    """A chain; a base chain (attached to a netfilter hook) iff ``hook`` is set.

    ``priority`` is numeric (``-100`` is ``dstnat``, ``100`` is ``srcnat``, ``0`` is
    ``filter``); a base chain needs ``type``, ``hook`` and ``priority``.
    """

    name: str
    type: str | None = None
    hook: str | None = None
    priority: int | None = None
    policy: str | None = None
    comment: str | None = None

    @property
    def is_base(self) -> bool:
        """Whether this is a base chain."""
        return self.hook is not None

    def validate(self) -> None:
        """Raise :class:`NftError` if the chain cannot be written."""
        validate_name("chain", self.name)
        validate_comment(self.comment)
        if self.hook is None:
            if self.type is not None or self.priority is not None or self.policy is not None:
                raise _invalid(f"chain {self.name}: type, priority and policy need a hook")
            return
        if self.hook not in CHAIN_HOOKS:
            raise _invalid(f"chain {self.name}: unknown hook {self.hook!r}")
        if self.type not in CHAIN_TYPES:
            raise _invalid(f"chain {self.name}: a base chain needs a type in {sorted(CHAIN_TYPES)}")
        if (
            not isinstance(self.priority, int)
            or isinstance(self.priority, bool)
            or not _PRIORITY_MIN <= self.priority <= _PRIORITY_MAX
        ):
            raise _invalid(f"chain {self.name}: a base chain needs an integer priority")
        if self.policy is not None and self.policy not in CHAIN_POLICIES:
            raise _invalid(f"chain {self.name}: unknown policy {self.policy!r}")


@dataclass(frozen=True, slots=True)
class Rule:
    """A rule appended to (or, with ``insert``, prepended to) ``chain``."""

    chain: str
    rule: str
    comment: str | None = None

    def validate(self) -> None:
        """Raise :class:`NftError` if the rule cannot be written."""
        validate_name("chain", self.chain)
        validate_rule_text(self.rule)
        validate_comment(self.comment)


def _validate_set_common(
    kind: str,
    name: str,
    flags: tuple[str, ...],
    timeout: int | None,
    size: int | None,
    comment: str | None,
) -> None:
    validate_name(kind, name)
    validate_comment(comment)
    if not isinstance(flags, tuple):
        raise _invalid(f"{kind} {name}: flags must be a tuple")
    for flag in flags:
        if flag not in SET_FLAGS:
            raise _invalid(f"{kind} {name}: unknown flag {flag!r} (allowed: {sorted(SET_FLAGS)})")
    if len(set(flags)) != len(flags):
        raise _invalid(f"{kind} {name}: repeated flag in {flags!r}")
    _validate_positive(f"{kind} {name}: timeout", timeout)
    _validate_positive(f"{kind} {name}: size", size)


def _type_ok(text: object, typeof: bool) -> bool:
    pattern = _TYPEOF_RE if typeof else _TYPE_RE
    return isinstance(text, str) and pattern.fullmatch(text) is not None


@dataclass(frozen=True, slots=True)
class Set:
    """A named set; ``type`` is a data type or a concatenation (``ipv4_addr . inet_service``).

    ``timeout`` is in seconds. With ``typeof``, ``type`` holds expressions instead of
    type names (``ip daddr . numgen random mod 1``) and is written ``typeof ...``.
    """

    name: str
    type: str
    flags: tuple[str, ...] = ()
    timeout: int | None = None
    size: int | None = None
    comment: str | None = None
    typeof: bool = False

    def validate(self) -> None:
        """Raise :class:`NftError` if the set cannot be written."""
        _validate_set_common("set", self.name, self.flags, self.timeout, self.size, self.comment)
        if not _type_ok(self.type, self.typeof):
            raise _invalid(f"set {self.name}: invalid type {self.type!r}")


@dataclass(frozen=True, slots=True)
class Map:
    """A named map; ``type`` is ``"<key type> : <value type>"``, e.g.
    ``"ipv4_addr . inet_proto . inet_service : verdict"``. ``timeout`` is in seconds.
    With ``typeof``, both sides hold expressions (see :class:`Set`).
    """

    name: str
    type: str
    flags: tuple[str, ...] = ()
    timeout: int | None = None
    size: int | None = None
    comment: str | None = None
    typeof: bool = False

    def validate(self) -> None:
        """Raise :class:`NftError` if the map cannot be written."""
        _validate_set_common("map", self.name, self.flags, self.timeout, self.size, self.comment)
        key, sep, value = self.type.partition(" : ") if isinstance(self.type, str) else ("", "", "")
        if not sep or not _type_ok(key, self.typeof) or not _type_ok(value, self.typeof):
            raise _invalid(f"map {self.name}: invalid type {self.type!r} (want 'KEY : VALUE')")

    @property
    def key_type(self) -> str:
        """The key part of :attr:`type`."""
        return self.type.partition(" : ")[0]

    @property
    def value_type(self) -> str:
        """The value part of :attr:`type` (``"verdict"`` for a verdict map)."""
        return self.type.partition(" : ")[2]


# The expression a ``typeof`` declaration names for each data type our tables declare
# (any expression of the type would do: a declaration says what the key holds, not where
# a rule reads it).
_TYPE_EXPRESSIONS = {
    "ipv4_addr": "ip daddr",
    "ipv6_addr": "ip6 daddr",
    "inet_proto": "meta l4proto",
    "inet_service": "th dport",
    "mark": "meta mark",
    "verdict": "verdict",
}


def readable_by_every_nft(container: Set | Map) -> Set | Map:
    """``container`` declared so that every nft can list it: ``typeof`` expressions
    instead of a lone data type on either side (``type ipv4_addr``, ``... : verdict``).

    Why: nft 1.1.2 (nftables commit 05824601) records in a set's user data a description
    of a key or value declared with one data type, and nft before 1.1.4 and 1.0.6.1 (fix
    be737a19) crash (SIGSEGV) on every command that loads such a set: listing, adding
    elements, adding rules that name a set (kubernetes/kubernetes#136786). Measured with
    ``make test-userspace``: our table written through Debian 13's nft 1.1.3 or sid's
    1.1.7 crashed Debian 12's nft 1.0.6 and a proxy using it; declared with ``typeof``,
    the same sets are recorded as expressions, which every nft since 0.9.4 reads back. A
    concatenation of data types is recorded part by part, which older nft skips safely,
    so it is kept as written.
    """
    if container.typeof:
        return container
    sides = [side.split(" . ") for side in container.type.split(" : ")]
    if all(len(parts) > 1 for parts in sides):
        return container
    spelled = [[_TYPE_EXPRESSIONS.get(part) for part in parts] for parts in sides]
    if any(None in parts for parts in spelled):
        return container
    text = " : ".join(" . ".join(str(part) for part in parts) for parts in spelled)
    return replace(container, type=text, typeof=True)


@dataclass(frozen=True, slots=True)
class Element:
    """An element of the set or map ``container``.

    ``key`` (and for a map element, ``value``) hold the parts of a concatenation, each
    written as nft writes it: ``("10.0.0.1", "tcp", "80")``, ``("goto service-X",)``,
    ``("drop",)``. Set elements have an empty ``value`` and ``is_map`` false.
    ``timeout`` (seconds) is for sets with the ``timeout`` flag; ``expires`` is only
    reported by listings and is ignored when comparing elements.
    """

    container: str
    key: tuple[str, ...]
    value: tuple[str, ...] = ()
    comment: str | None = None
    is_map: bool = False
    timeout: int | None = None
    expires: int | None = field(default=None, compare=False)

    def validate(self) -> None:
        """Raise :class:`NftError` if the element cannot be written."""
        validate_name("set", self.container)
        validate_element_parts("key", self.key, allow_empty=False)
        validate_element_parts("value", self.value, allow_empty=not self.is_map)
        if not self.is_map and self.value:
            raise _invalid(f"element {self.key!r} of set {self.container} has a value")
        validate_comment(self.comment)
        _validate_positive("element timeout", self.timeout)
