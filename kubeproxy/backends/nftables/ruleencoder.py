"""Our rules as nf_tables expressions, the bytecode nft (1.0.6) writes for them.

Why by hand: the owned table (:mod:`~kubeproxy.backends.nftables.owner`) belongs to one
netlink socket of ours, so its rules must be written on that socket, and nothing that
can do that knows nft's language: libnftables sends only on a socket of its own;
pyroute2's and libnftnl's rule messages are containers for expressions someone has
already compiled (register allocation, payload offsets, implicit protocol matches, the
anonymous set of ``{ tcp, udp, sctp }``); that compiling is nft's evaluation and
linearisation, which no library offers. Our tables use a small, fixed vocabulary (the
rules ``layout.py``, ``table.py``, ``frontends.py`` and ``localhost.py`` render), so
this module compiles exactly that vocabulary, the way nft does:

* matches of ``ip``/``ip6 daddr``/``saddr`` (addresses and prefixes: a byte-aligned prefix
  loads only its bytes, any other is masked), ``th``/``tcp``/``udp``/``sctp dport``
  (the named protocols insert nft's ``meta l4proto`` match unless the rule already
  made it), ``meta l4proto``, ``meta mark`` (``& mask == value``), ``iifname`` (a
  trailing ``*`` compares the prefix only), ``ct state``, ``ct status`` (flag tests),
  ``ct original`` addresses and ``proto-dst``, ``ct reply`` source address and
  ``proto-src``, ``fib saddr``/``daddr type``,
  ``numgen random mod N [offset M]``, ``jhash K mod N seed S`` (``K`` a selector or a
  concatenation; in a DNAT map lookup with a port, or a map update); concatenations of
  them; against a value, a named set
  (``@s``, ``!= @s``), a verdict map (``vmap @m``) or an anonymous set (``{ a, b }``);
* statements ``jump``/``goto`` X, ``accept``/``drop``/``return``, ``reject``,
  ``counter``, ``masquerade [fully-random]``, ``meta mark set meta mark or|xor V``,
  ``dnat to K map @m [: port]`` (the map's declaration says what its value holds, and
  its ``typeof`` which protocol match nft adds), ``update @m { K timeout Ns : V }``,
  ``ip``/``ip6 daddr set V`` and ``tcp``/``udp``/``sctp dport set V`` (payload writes with the
  checksum fix-ups nft asks for; ``V`` one selector or ``K map @m``, a map's value).

Registers are allocated as nft allocates them (``netlink_linearize.c``: a single
expression takes a 16-byte register, a concatenation its length in 4-byte registers,
and a statement's registers are free again after it), so the kernel holds the same
bytecode either way; ``tests/test_nft_owned_kernel.py`` writes every flow-case state
with this encoder and with nft and compares the kernel's dump of both and their
``nft list ruleset``. Anything outside the vocabulary raises :class:`NftError`
(``EINVAL``) naming the rule: an encoder that guessed would write a rule nobody meant.
"""

from __future__ import annotations

import errno
import ipaddress
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.backends.nftables.declarations import Declaration, encode_verdict
from kubeproxy.backends.nftables.objects import PROTOCOL_NUMBERS, Family, NftError

__all__ = ["AnonymousSet", "EncodedRule", "RuleEncoder", "register"]

# nf_tables.h: expression attributes.
_LIST_ELEM, _EXPR_NAME, _EXPR_DATA = 1, 1, 2
_DATA_VALUE = 1
_PAYLOAD_NETWORK, _PAYLOAD_TRANSPORT = 1, 2
_CSUM_INET, _CSUM_SCTP = 1, 2
_CSUM_L4_PSEUDOHDR = 1
_CT_ORIGINAL, _CT_REPLY = 0, 1
_META_MARK, _META_IIFNAME, _META_L4PROTO = 3, 6, 16
_CT_STATE, _CT_STATUS, _CT_PROTO_SRC, _CT_PROTO_DST = 0, 2, 11, 12
_CT_SRC_IP, _CT_DST_IP, _CT_SRC_IP6, _CT_DST_IP6 = 19, 20, 21, 22
_CMP_EQ, _CMP_NEQ = 0, 1
_LOOKUP_INV = 1
_FIB_SADDR, _FIB_DADDR, _FIB_ADDRTYPE = 1, 2, 3
_NG_RANDOM = 1
_HASH_JENKINS = 0
# Where nft 1.0.6 loads a hashed field (``jhash ip6 saddr``): in a DNAT's map lookup with
# a port, the 4-byte register 7; in a dynamic map update, the value's register (the value
# is loaded over it afterwards). Read from ``nft --debug=netlink``.
_HASH_SCRATCH_DNAT = 7
_OFFSET = re.compile(r"(?<=\boffset )[0-9]+")
# Numbers no rule of ours holds elsewhere, compiled in place of the offsets of a rule
# reused by RuleEncoder.encode (checked: each appears once in the compiled rule).
_SENTINELS = (0xA5C3E1F0, 0xA5C3E1F1, 0xA5C3E1F2, 0xA5C3E1F3)
_NAT_DNAT = 1
_NAT_PROTO_SPECIFIED = 0x2
_NAT_RANDOM_FULLY = 0x10
_REJECT_ICMP_UNREACH = 0
_DYNSET_UPDATE = 1
_NFPROTO = {Family.IP: 2, Family.IP6: 10}
_PORT_UNREACHABLE = {Family.IP: 3, Family.IP6: 4}
_CT_STATES = {"invalid": 1, "established": 2, "related": 4, "new": 8, "untracked": 64}
_CT_STATUSES = {"expected": 1, "seen-reply": 2, "assured": 4, "confirmed": 8, "snat": 16}
_CT_STATUSES["dnat"] = 32
_FIB_TYPES = {"unicast": 1, "local": 2, "broadcast": 3, "anycast": 4, "multicast": 5}
_IFNAMSIZ = 16
_SLOTS_OF_REGISTER = 4
_TOKEN = re.compile(r'"[^"]*"|[^\s,]+|,')


def register(slot: int) -> int:
    """The register number nft writes for 4-byte register slot ``slot`` (counted from
    ``NFT_REG_1``): the 16-byte register's number when the slot starts one, else the
    4-byte register's (``netlink_put_register``)."""
    if slot % _SLOTS_OF_REGISTER == 0:
        return 1 + slot // _SLOTS_OF_REGISTER
    return 8 + slot


def _u32(value: int) -> bytes:
    return struct.pack(">I", value)


def _expr(name: str, *attributes: bytes) -> bytes:
    return nlmsg.nested(
        _LIST_ELEM,
        nlmsg.attr(_EXPR_NAME, nlmsg.string(name)),
        nlmsg.nested(_EXPR_DATA, *attributes),
    )


def _value(data: bytes) -> bytes:
    return nlmsg.attr(_DATA_VALUE, data)


def _payload(base: int, offset: int, length: int, slot: int) -> bytes:
    return _expr(
        "payload",
        nlmsg.attr(1, _u32(register(slot))),
        nlmsg.attr(2, _u32(base)),
        nlmsg.attr(3, _u32(offset)),
        nlmsg.attr(4, _u32(length)),
    )


def _cmp(slot: int, op: int, data: bytes) -> bytes:
    return _expr(
        "cmp",
        nlmsg.attr(1, _u32(register(slot))),
        nlmsg.attr(2, _u32(op)),
        nlmsg.nested(3, _value(data)),
    )


def _bitwise(slot: int, mask: bytes, xor: bytes) -> bytes:
    reg = _u32(register(slot))
    return _expr(
        "bitwise",
        nlmsg.attr(1, reg),
        nlmsg.attr(2, reg),
        nlmsg.attr(3, _u32(len(mask))),
        nlmsg.nested(4, _value(mask)),
        nlmsg.nested(5, _value(xor)),
    )


def _meta(key: int, slot: int) -> bytes:
    return _expr("meta", nlmsg.attr(2, _u32(key)), nlmsg.attr(1, _u32(register(slot))))


def _ct(key: int, slot: int, direction: int | None) -> bytes:
    attributes = [nlmsg.attr(1, _u32(register(slot))), nlmsg.attr(2, _u32(key))]
    if direction is not None:
        attributes.append(nlmsg.attr(3, bytes((direction,))))
    return _expr("ct", *attributes)


@dataclass(frozen=True, slots=True)
class _Field:
    """A packet field a statement writes (``ip daddr set``, ``tcp dport set``): where it
    is and the checksum nft fixes up with it (``csum_type``, ``csum_off``, and whether
    the transport checksum covers it through the pseudo-header), as ``nft
    --debug=netlink`` shows nft 1.0.6 writing them."""

    base: int
    offset: int
    length: int
    csum_type: int
    csum_offset: int
    csum_flags: int = 0
    protocol: str | None = None

    def write(self, slot: int) -> bytes:
        return _expr(
            "payload",
            nlmsg.attr(5, _u32(register(slot))),
            nlmsg.attr(2, _u32(self.base)),
            nlmsg.attr(3, _u32(self.offset)),
            nlmsg.attr(4, _u32(self.length)),
            nlmsg.attr(6, _u32(self.csum_type)),
            nlmsg.attr(7, _u32(self.csum_offset)),
            nlmsg.attr(8, _u32(self.csum_flags)),
        )


# The IPv4 header checksum is at byte 10; a transport checksum covers the addresses
# through its pseudo-header. TCP's checksum is at byte 16, UDP's at 6, SCTP's CRC32c at 8.
_WRITABLE: dict[tuple[str, ...], _Field] = {
    ("ip", "daddr"): _Field(_PAYLOAD_NETWORK, 16, 4, _CSUM_INET, 10, _CSUM_L4_PSEUDOHDR),
    # IPv6 has no header checksum: only the transport's, through the pseudo-header.
    ("ip6", "daddr"): _Field(_PAYLOAD_NETWORK, 24, 16, 0, 0, _CSUM_L4_PSEUDOHDR),
    ("tcp", "dport"): _Field(_PAYLOAD_TRANSPORT, 2, 2, _CSUM_INET, 16, protocol="tcp"),
    ("udp", "dport"): _Field(_PAYLOAD_TRANSPORT, 2, 2, _CSUM_INET, 6, protocol="udp"),
    ("sctp", "dport"): _Field(_PAYLOAD_TRANSPORT, 2, 2, _CSUM_SCTP, 8, protocol="sctp"),
}


def _verdict(text: str) -> bytes:
    return _expr("immediate", nlmsg.attr(1, _u32(0)), nlmsg.nested(2, encode_verdict(text)))


def _lookup(
    name: str, slot: int, *, dreg: int | None = None, invert: bool = False, set_id: int | None
) -> bytes:
    attributes = [nlmsg.attr(1, nlmsg.string(name)), nlmsg.attr(2, _u32(register(slot)))]
    if dreg is not None:
        attributes.append(nlmsg.attr(3, _u32(dreg)))
    if set_id is not None:
        attributes.append(nlmsg.attr(4, _u32(set_id)))
    if invert:
        attributes.append(nlmsg.attr(5, _u32(_LOOKUP_INV)))
    return _expr("lookup", *attributes)


@dataclass(frozen=True, slots=True)
class _Selector:
    """What a match reads: how to load it into a register, its length and type."""

    load: Callable[[int], bytes]
    length: int
    kind: str
    """``addr4``, ``addr6``, ``proto``, ``port``, ``mark``, ``ifname``, ``ctstate``,
    ``ctstatus``, ``fibtype``, ``integer``."""
    protocol: str | None = None
    """The transport protocol the selector implies (``tcp dport``)."""
    field: tuple[int, int] | None = None
    """A payload field's base and offset (nft loads only a prefix's bytes of one)."""

    @property
    def slots(self) -> int:
        return (self.length + 3) // 4


def _payload_selector(base: int, offset: int, length: int, kind: str) -> _Selector:
    return _Selector(
        lambda slot: _payload(base, offset, length, slot), length, kind, field=(base, offset)
    )


_SELECTORS: dict[tuple[str, ...], _Selector] = {
    ("ip", "saddr"): _payload_selector(_PAYLOAD_NETWORK, 12, 4, "addr4"),
    ("ip", "daddr"): _payload_selector(_PAYLOAD_NETWORK, 16, 4, "addr4"),
    ("ip6", "saddr"): _payload_selector(_PAYLOAD_NETWORK, 8, 16, "addr6"),
    ("ip6", "daddr"): _payload_selector(_PAYLOAD_NETWORK, 24, 16, "addr6"),
    ("th", "dport"): _payload_selector(_PAYLOAD_TRANSPORT, 2, 2, "port"),
    ("meta", "l4proto"): _Selector(lambda slot: _meta(_META_L4PROTO, slot), 1, "proto"),
    ("meta", "mark"): _Selector(lambda slot: _meta(_META_MARK, slot), 4, "mark"),
    ("meta", "iifname"): _Selector(lambda slot: _meta(_META_IIFNAME, slot), 16, "ifname"),
    ("iifname",): _Selector(lambda slot: _meta(_META_IIFNAME, slot), 16, "ifname"),
    ("ct", "state"): _Selector(lambda slot: _ct(_CT_STATE, slot, None), 4, "ctstate"),
    ("ct", "status"): _Selector(lambda slot: _ct(_CT_STATUS, slot, None), 4, "ctstatus"),
    ("ct", "original", "ip", "saddr"): _Selector(
        lambda slot: _ct(_CT_SRC_IP, slot, _CT_ORIGINAL), 4, "addr4"
    ),
    ("ct", "original", "ip", "daddr"): _Selector(
        lambda slot: _ct(_CT_DST_IP, slot, _CT_ORIGINAL), 4, "addr4"
    ),
    ("ct", "original", "ip6", "saddr"): _Selector(
        lambda slot: _ct(_CT_SRC_IP6, slot, _CT_ORIGINAL), 16, "addr6"
    ),
    ("ct", "original", "ip6", "daddr"): _Selector(
        lambda slot: _ct(_CT_DST_IP6, slot, _CT_ORIGINAL), 16, "addr6"
    ),
    ("ct", "original", "proto-dst"): _Selector(
        lambda slot: _ct(_CT_PROTO_DST, slot, _CT_ORIGINAL), 2, "port"
    ),
    # The reply direction's source: the endpoint a DNATed connection went to.
    ("ct", "reply", "ip", "saddr"): _Selector(
        lambda slot: _ct(_CT_SRC_IP, slot, _CT_REPLY), 4, "addr4"
    ),
    ("ct", "reply", "ip6", "saddr"): _Selector(
        lambda slot: _ct(_CT_SRC_IP6, slot, _CT_REPLY), 16, "addr6"
    ),
    ("ct", "reply", "proto-src"): _Selector(
        lambda slot: _ct(_CT_PROTO_SRC, slot, _CT_REPLY), 2, "port"
    ),
}
for _proto in PROTOCOL_NUMBERS:
    _SELECTORS[(_proto, "dport")] = _Selector(
        lambda slot: _payload(_PAYLOAD_TRANSPORT, 2, 2, slot), 2, "port", _proto
    )
for _which, _flag in (("saddr", _FIB_SADDR), ("daddr", _FIB_DADDR)):
    _SELECTORS[("fib", _which, "type")] = _Selector(
        lambda slot, flag=_flag: _expr(  # type: ignore[misc]
            "fib",
            nlmsg.attr(1, _u32(register(slot))),
            nlmsg.attr(2, _u32(_FIB_ADDRTYPE)),
            nlmsg.attr(3, _u32(flag)),
        ),
        4,
        "fibtype",
    )
_SELECTOR_STARTS = frozenset(words[0] for words in _SELECTORS) | {"numgen", "jhash"}


def _numgen(modulus: int, offset: int = 0) -> _Selector:
    return _Selector(
        lambda slot: _expr(
            "numgen",
            nlmsg.attr(1, _u32(register(slot))),
            nlmsg.attr(2, _u32(modulus)),
            nlmsg.attr(3, _u32(_NG_RANDOM)),
            nlmsg.attr(4, _u32(offset)),
        ),
        4,
        "integer",
    )


def _jhash(
    sources: list[_Selector], modulus: int, seed: int, scratch: Callable[[], int]
) -> _Selector:
    """``jhash <source> mod M seed S``: nft loads the source (one selector, or a
    concatenation, each part in the 4-byte slots after the previous part's) into a
    scratch register of the statement (``scratch``: where nft 1.0.6 puts it there) and
    hashes it into the part's own: a concatenation's length is its slots'."""
    length = sources[0].length if len(sources) == 1 else 4 * sum(s.slots for s in sources)
    protocols = [s.protocol for s in sources if s.protocol is not None]

    def load(slot: int) -> bytes:
        at = scratch()
        loads = []
        for source in sources:
            loads.append(source.load(at))
            at += source.slots
        at = scratch()
        return b"".join(loads) + _expr(
            "hash",
            nlmsg.attr(1, _u32(register(at))),
            nlmsg.attr(2, _u32(register(slot))),
            nlmsg.attr(3, _u32(length)),
            nlmsg.attr(4, _u32(modulus)),
            nlmsg.attr(5, _u32(seed)),
            nlmsg.attr(6, _u32(0)),
            nlmsg.attr(7, _u32(_HASH_JENKINS)),
        )

    return _Selector(load, 4, "integer", protocols[0] if protocols else None)


@dataclass(frozen=True, slots=True)
class AnonymousSet:
    """A constant set a rule brings along (``{ tcp, udp, sctp }``): declared and filled
    in the same batch, before the rule, and found by ``set_id`` there."""

    declaration: Declaration
    set_id: int
    elements: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class EncodedRule:
    """A rule's ``NFTA_RULE_EXPRESSIONS`` payload and the anonymous sets it needs."""

    expressions: bytes
    anonymous: tuple[AnonymousSet, ...] = ()


class _Unsupported(ValueError):
    """The rule leaves the vocabulary this encoder knows."""


@dataclass
class _State:
    """One rule being encoded: its expressions, the protocol it already matched, and the
    next free register slot."""

    exprs: list[bytes] = field(default_factory=list)
    protocol: str | None = None
    anonymous: list[AnonymousSet] = field(default_factory=list)


class RuleEncoder:
    """Encodes rules of one family's table (see the module documentation).

    ``declaration`` returns the declaration of a named set or map of the table (the
    DNAT map statement reads it; raise :class:`NftError` when it is unknown);
    ``set_id`` hands out batch-unique ids for the anonymous sets rules bring. One
    encoder per transaction: like nft, it remembers what the transaction's earlier
    rules did (see :meth:`_dnat`).
    """

    def __init__(
        self,
        family: Family,
        declaration: Callable[[str], Declaration],
        set_id: Callable[[], int],
    ) -> None:
        if family not in _NFPROTO:
            raise NftError(f"the owned table is written in ip and ip6, not {family}")
        self.family = Family(family)
        self._declaration = declaration
        self._set_id = set_id
        self._protocol_maps: set[str] = set()
        self._scratch: int | None = None
        # Compiled rules by their text without offset numbers (see encode), and how many
        # rules added the protocol match of a map's first reader (such a rule is not
        # reused: the next reader of that map gets no match).
        self._templates: dict[str, tuple[bytes, tuple[bytes, ...]]] = {}
        self._same: dict[str, EncodedRule] = {}
        self._stateful = 0

    def _hash_scratch(self) -> int:
        if self._scratch is None:
            raise _Unsupported("jhash outside a DNAT map lookup or a map update")
        return self._scratch

    def encode(self, rule: str) -> EncodedRule:
        """The expressions of ``rule`` (raises :class:`NftError` naming it when it is not
        in the vocabulary, or names a value that is not of its type).

        Rules that differ only in their ``offset`` numbers (the ClientIP affinity chains
        of every Service port, a lookup and a record each, which name one of 256 shared
        maps) are compiled once per transaction and their numbers patched in: compiling
        was 100-200 us a rule, most of the affinity chains' cost at a cold sync."""
        numbers = _OFFSET.findall(rule) if "offset" in rule else []
        if not numbers:
            # The same rule again (one that many chains hold alike).
            same = self._same.get(rule)
            if same is not None:
                return same
            before = self._stateful
            compiled = self._compile(rule)
            if self._stateful == before and not compiled.anonymous:
                self._same[rule] = compiled
            return compiled
        if len(numbers) > len(_SENTINELS):
            return self._compile(rule)
        template = _OFFSET.sub("#", rule)
        patched = self._templates.get(template)
        if patched is None:
            before = self._stateful
            compiled = self._compile(rule)
            if self._stateful != before or compiled.anonymous:
                return compiled  # not reusable (see __init__)
            probe = rule
            for number, sentinel in zip(numbers, _SENTINELS, strict=False):
                probe = probe.replace(f"offset {number}", f"offset {sentinel}", 1)
            expressions = self._compile(probe).expressions
            marks = tuple(_u32(s) for s in _SENTINELS[: len(numbers)])
            if all(expressions.count(m) == 1 for m in marks):
                self._templates[template] = (expressions, marks)
            return compiled
        expressions, marks = patched
        for mark, number in zip(marks, numbers, strict=True):
            expressions = expressions.replace(mark, _u32(int(number)))
        return EncodedRule(expressions)

    def _compile(self, rule: str) -> EncodedRule:
        state = _State()
        try:
            tokens = _TOKEN.findall(rule)
            stream = _Tokens(tokens)
            while stream:
                self._item(stream, state)
        except (_Unsupported, ValueError) as err:
            raise NftError(f"cannot encode rule {rule!r}: {err}", errno.EINVAL) from None
        return EncodedRule(b"".join(state.exprs), tuple(state.anonymous))

    # Items ------------------------------------------------------------------------------

    def _item(self, stream: _Tokens, state: _State) -> None:
        word = stream.peek()
        if word in ("jump", "goto"):
            stream.take()
            state.exprs.append(_verdict(f"{word} {stream.name()}"))
        elif word in ("accept", "drop", "return", "continue"):
            stream.take()
            state.exprs.append(_verdict(word))
        elif word == "reject":
            stream.take()
            state.exprs.append(
                _expr(
                    "reject",
                    nlmsg.attr(1, _u32(_REJECT_ICMP_UNREACH)),
                    nlmsg.attr(2, bytes((_PORT_UNREACHABLE[self.family],))),
                )
            )
        elif word == "counter":
            stream.take()
            state.exprs.append(_expr("counter"))
        elif word == "masquerade":
            stream.take()
            attributes = []
            if stream.peek() == "fully-random":
                stream.take()
                attributes.append(nlmsg.attr(1, _u32(_NAT_RANDOM_FULLY)))
            state.exprs.append(_expr("masq", *attributes))
        elif word == "dnat":
            stream.take()
            self._dnat(stream, state)
        elif word == "update":
            stream.take()
            self._update(stream, state)
        elif word == "meta" and stream.peek(2) == "set":
            self._set_mark(stream, state)
        elif stream.peek(2) == "set" and (word, stream.peek(1)) in _WRITABLE:
            self._set_field(stream, state)
        elif word in _SELECTOR_STARTS:
            self._match(stream, state)
        else:
            raise _Unsupported(f"unexpected {word!r}")

    def _selectors(self, stream: _Tokens, state: _State) -> list[_Selector]:
        """A concatenation of selectors (``ip daddr . meta l4proto . th dport``)."""
        selectors = [self._selector(stream)]
        while stream.peek() == ".":
            stream.take()
            selectors.append(self._selector(stream))
        return selectors

    def _selector(self, stream: _Tokens) -> _Selector:
        if stream.peek() == "numgen":
            stream.expect("numgen")
            stream.expect("random")
            stream.expect("mod")
            modulus = _number(stream.take(), 1, 2**32 - 1)
            offset = 0
            if stream.peek() == "offset":
                stream.take()
                offset = _number(stream.take(), 0, 2**32 - 1)
            return _numgen(modulus, offset)
        if stream.peek() == "jhash":
            stream.take()
            sources = [self._selector(stream)]
            while stream.peek() == ".":
                stream.take()
                sources.append(self._selector(stream))
            stream.expect("mod")
            modulus = _number(stream.take(), 1, 2**32 - 1)
            stream.expect("seed")
            seed = _number(stream.take(), 0, 2**32 - 1)
            return _jhash(sources, modulus, seed, self._hash_scratch)
        for length in (4, 3, 2, 1):
            words = tuple(stream.peek(i) or "" for i in range(length))
            found = _SELECTORS.get(words)
            if found is not None:
                for _ in range(length):
                    stream.take()
                if found.kind == "addr4" and self.family is not Family.IP:
                    raise _Unsupported(f"{' '.join(words)} in an {self.family} table")
                if found.kind == "addr6" and self.family is not Family.IP6:
                    raise _Unsupported(f"{' '.join(words)} in an {self.family} table")
                return found
        raise _Unsupported(f"unknown selector at {stream.peek()!r}")

    def _load(self, selectors: list[_Selector], state: _State, first: int = 0) -> None:
        """Load a concatenation from register slot ``first`` on, nft's way: each part in
        the slots after the previous part's, inserting a protocol match a part implies."""
        for selector in selectors:
            self._depend(selector.protocol, state)
        slot = first
        for selector in selectors:
            state.exprs.append(selector.load(slot))
            slot += selector.slots

    def _depend(self, protocol: str | None, state: _State) -> None:
        """nft's implicit ``meta l4proto P`` before what needs protocol ``P``."""
        if protocol is None or state.protocol == protocol:
            return
        state.exprs.append(_meta(_META_L4PROTO, 0))
        state.exprs.append(_cmp(0, _CMP_EQ, bytes((PROTOCOL_NUMBERS[protocol],))))
        state.protocol = protocol

    def _match(self, stream: _Tokens, state: _State) -> None:
        selectors = self._selectors(stream, state)
        mask: int | None = None
        if stream.peek() == "&":
            stream.take()
            mask = _number(stream.take(), 0, 2**32 - 1)
        op = _CMP_EQ
        if stream.peek() in ("==", "!="):
            op = _CMP_NEQ if stream.take() == "!=" else _CMP_EQ
        rhs = stream.peek()
        if rhs is None:
            raise _Unsupported("a match without a value")
        if rhs.startswith("@"):
            stream.take()
            self._load(selectors, state)
            state.exprs.append(_lookup(_set_name(rhs), 0, invert=op == _CMP_NEQ, set_id=None))
            return
        if rhs == "vmap":
            stream.take()
            name = _set_name(stream.take())
            self._load(selectors, state)
            state.exprs.append(_lookup(name, 0, dreg=0, set_id=None))
            return
        if len(selectors) != 1:
            raise _Unsupported("a concatenation compared with a value")
        (selector,) = selectors
        if rhs == "{":
            self._anonymous(selector, stream, state, op)
            return
        stream.take()
        self._compare(selector, mask, op, rhs, state)

    def _compare(
        self, selector: _Selector, mask: int | None, op: int, text: str, state: _State
    ) -> None:
        kind = selector.kind
        self._depend(selector.protocol, state)
        if kind in ("addr4", "addr6"):
            self._compare_address(selector, op, text, state)
            return
        if kind in ("ctstate", "ctstatus") and mask is None:
            names = _CT_STATES if kind == "ctstate" else _CT_STATUSES
            bits = names.get(text)
            if bits is None:
                raise _Unsupported(f"{text!r} is not a conntrack {kind[2:]}")
            zero = bytes(4)
            state.exprs.append(selector.load(0))
            state.exprs.append(_bitwise(0, struct.pack("=I", bits), zero))
            state.exprs.append(_cmp(0, _CMP_EQ if op == _CMP_NEQ else _CMP_NEQ, zero))
            return
        if kind == "ifname":
            name = text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text
            if name.endswith("*"):
                data = name[:-1].encode()
            else:
                data = name.encode().ljust(_IFNAMSIZ, b"\0")
            if not data or len(data) > _IFNAMSIZ or b"\0" in name.encode():
                raise _Unsupported(f"interface name {text}")
            state.exprs.append(selector.load(0))
            state.exprs.append(_cmp(0, op, data))
            return
        if kind == "mark":
            value = _number(text, 0, 2**32 - 1)
            state.exprs.append(selector.load(0))
            if mask is not None:
                state.exprs.append(_bitwise(0, struct.pack("=I", mask), bytes(4)))
            state.exprs.append(_cmp(0, op, struct.pack("=I", value)))
            return
        if mask is not None:
            raise _Unsupported(f"a mask on {kind}")
        if kind == "proto":
            data = bytes((_protocol(text),))
            if op == _CMP_EQ:
                state.protocol = text if text in PROTOCOL_NUMBERS else None
        elif kind == "port":
            data = struct.pack(">H", _number(text, 0, 65535))
        elif kind == "fibtype":
            number = _FIB_TYPES.get(text)
            if number is None:
                raise _Unsupported(f"{text!r} is not an address type")
            data = struct.pack("=I", number)
        else:
            raise _Unsupported(f"a {kind} compared with a value")
        state.exprs.append(selector.load(0))
        state.exprs.append(_cmp(0, op, data))

    def _compare_address(self, selector: _Selector, op: int, text: str, state: _State) -> None:
        version = 4 if selector.kind == "addr4" else 6
        # nft takes a prefix with host bits set, and compares the network's bits.
        network = ipaddress.ip_network(text, strict=False)
        if network.version != version:
            raise _Unsupported(f"{text} is not an IPv{version} address")
        size = selector.length
        prefix = network.prefixlen
        address = network.network_address.packed
        if prefix == size * 8 or (prefix % 8 == 0 and prefix > 0):
            # nft loads only the prefix's bytes (a whole address: all of them).
            # nft compares only the prefix's bytes, and loads only those of a payload
            # field (a conntrack address is loaded whole).
            length = prefix // 8
            if length < size and selector.field is not None:
                state.exprs.append(_payload(*selector.field, length, 0))
            else:
                state.exprs.append(selector.load(0))
            state.exprs.append(_cmp(0, op, address[:length]))
            return
        mask = network.netmask.packed
        state.exprs.append(selector.load(0))
        state.exprs.append(_bitwise(0, mask, bytes(size)))
        state.exprs.append(_cmp(0, op, address))

    def _anonymous(self, selector: _Selector, stream: _Tokens, state: _State, op: int) -> None:
        stream.expect("{")
        values = []
        while stream.peek() != "}":
            token = stream.take()
            if token != ",":
                values.append(token)
        stream.expect("}")
        if selector.kind != "proto" or op != _CMP_EQ or not values:
            raise _Unsupported("an anonymous set other than of protocols")
        declaration = Declaration.anonymous("meta l4proto", len(values))
        set_id = self._set_id()
        elements = tuple(declaration.element((v,)) for v in values)
        state.anonymous.append(AnonymousSet(declaration, set_id, elements))
        state.exprs.append(selector.load(0))
        state.exprs.append(_lookup(declaration.name, 0, set_id=set_id))

    # Statements --------------------------------------------------------------------------

    def _set_mark(self, stream: _Tokens, state: _State) -> None:
        for word in ("meta", "mark", "set", "meta", "mark"):
            stream.expect(word)
        operator = stream.take()
        value = _number(stream.take(), 0, 2**32 - 1)
        if operator in ("or", "|"):
            mask, xor = ~value & 0xFFFFFFFF, value
        elif operator in ("xor", "^"):
            mask, xor = 0xFFFFFFFF, value
        else:
            raise _Unsupported(f"meta mark set ... {operator}")
        state.exprs.append(_meta(_META_MARK, 0))
        state.exprs.append(_bitwise(0, struct.pack("=I", mask), struct.pack("=I", xor)))
        state.exprs.append(_expr("meta", nlmsg.attr(2, _u32(_META_MARK)), nlmsg.attr(3, _u32(1))))

    def _set_field(self, stream: _Tokens, state: _State) -> None:
        """``ip daddr set V`` / ``tcp dport set V``: V one selector, or a concatenation
        looked up in a map (``K map @m``: the map's value is written), loaded from the
        first register, as nft does (a statement's registers are free after it). A
        transport field needs its protocol matched first (nft's implicit match, put where
        the statement begins)."""
        target = _WRITABLE[(stream.take(), stream.take())]
        stream.expect("set")
        self._depend(target.protocol, state)
        selectors = self._selectors(stream, state)
        if stream.peek() == "map":
            stream.take()
            name = _set_name(stream.take())
            declaration = self._declaration(name)
            if not declaration.is_map or not declaration.value or len(declaration.value) != 1:
                raise _Unsupported(f"{name} holds no single value to write")
            self._load(selectors, state)
            state.exprs.append(_lookup(name, 0, dreg=register(0), set_id=None))
        elif len(selectors) == 1:
            self._load(selectors, state)
        else:
            raise _Unsupported("a concatenation written into a field")
        state.exprs.append(target.write(0))

    def _dnat(self, stream: _Tokens, state: _State) -> None:
        if stream.peek() in ("ip", "ip6"):
            stream.take()
        stream.expect("to")
        selectors = self._selectors(stream, state)
        stream.expect("map")
        name = _set_name(stream.take())
        port: int | None = None
        if stream.peek() == ":":
            stream.take()
            port = _number(stream.take(), 0, 65535)
        declaration = self._declaration(name)
        if not declaration.is_map or not declaration.value:
            raise _Unsupported(f"dnat to a lookup in {name}, which holds no addresses")
        # The protocol match nft infers from the map's value (typeof ... . tcp dport).
        # nft 1.0.6 adds it to the first rule of a transaction that reads the map only:
        # evaluating that rule resolves the dependency in the map's own value expression,
        # which the later rules share (the kernel dump of nft's own writes shows it; the
        # later rules match the protocol through the key anyway).
        if name not in self._protocol_maps:
            self._protocol_maps.add(name)
            self._stateful += 1
            for value_field in declaration.value:
                words = (value_field.expression or "").split()
                if len(words) == 2 and words[1] == "dport" and words[0] in PROTOCOL_NUMBERS:
                    self._depend(words[0], state)
        addr_slots = 1 if self.family is Family.IP else _SLOTS_OF_REGISTER
        self._scratch = _HASH_SCRATCH_DNAT if port is not None else None
        try:
            self._load(selectors, state)
        finally:
            self._scratch = None
        state.exprs.append(_lookup(name, 0, dreg=register(0), set_id=None))
        attributes = [
            nlmsg.attr(1, _u32(_NAT_DNAT)),
            nlmsg.attr(2, _u32(_NFPROTO[self.family])),
            nlmsg.attr(3, _u32(register(0))),
        ]
        if len(declaration.value) > 1:
            # The value is address . port: the port follows the address's registers.
            if port is not None:
                raise _Unsupported("a port after a map that holds ports")
            attributes.append(nlmsg.attr(5, _u32(register(addr_slots))))
        elif port is not None:
            # nft's next register after the address's (the key was loaded over it).
            slot = _SLOTS_OF_REGISTER
            state.exprs.append(
                _expr(
                    "immediate",
                    nlmsg.attr(1, _u32(register(slot))),
                    nlmsg.nested(2, _value(struct.pack(">H", port))),
                )
            )
            attributes.append(nlmsg.attr(5, _u32(register(slot))))
            attributes.append(nlmsg.attr(7, _u32(_NAT_PROTO_SPECIFIED)))
        state.exprs.append(_expr("nat", *attributes))

    def _update(self, stream: _Tokens, state: _State) -> None:
        name = _set_name(stream.take())
        stream.expect("{")
        key = self._selectors(stream, state)
        stream.expect("timeout")
        timeout = _seconds(stream.take())
        stream.expect(":")
        data = self._selectors(stream, state)
        stream.expect("}")
        # nft 1.0.6 puts the value in the second 16-byte register, however long the key
        # (a longer key would be overwritten by it: refused here).
        if sum(s.slots for s in key) > _SLOTS_OF_REGISTER:
            raise _Unsupported("a dynamic map key longer than 16 bytes")
        key_slots = _SLOTS_OF_REGISTER
        self._scratch = key_slots
        try:
            self._load(key, state, 0)
        finally:
            self._scratch = None
        self._load(data, state, key_slots)
        state.exprs.append(
            _expr(
                "dynset",
                nlmsg.attr(1, nlmsg.string(name)),
                nlmsg.attr(3, _u32(_DYNSET_UPDATE)),
                nlmsg.attr(4, _u32(register(0))),
                nlmsg.attr(5, _u32(register(key_slots))),
                nlmsg.attr(6, struct.pack(">Q", timeout * 1000)),
            )
        )


class _Tokens:
    """The words of a rule, read front to back."""

    def __init__(self, tokens: list[str]) -> None:
        self._tokens = tokens
        self._at = 0

    def __bool__(self) -> bool:
        return self._at < len(self._tokens)

    def peek(self, ahead: int = 0) -> str | None:
        at = self._at + ahead
        return self._tokens[at] if at < len(self._tokens) else None

    def take(self) -> str:
        if self._at >= len(self._tokens):
            raise _Unsupported("the rule ends too early")
        token = self._tokens[self._at]
        self._at += 1
        return token

    def expect(self, word: str) -> None:
        token = self.take()
        if token != word:
            raise _Unsupported(f"expected {word!r}, found {token!r}")

    def name(self) -> str:
        token = self.take()
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_./-]*", token):
            raise _Unsupported(f"{token!r} is not a chain name")
        return token

    def __iter__(self) -> Iterator[str]:
        return iter(self._tokens[self._at :])


def _set_name(token: str) -> str:
    name = token[1:] if token.startswith("@") else ""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_./-]*", name):
        raise _Unsupported(f"{token!r} is not a set reference")
    return name


def _number(text: str, low: int, high: int) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise _Unsupported(f"{text!r} is not a number") from None
    if not low <= value <= high:
        raise _Unsupported(f"{text} is out of range")
    return value


def _protocol(text: str) -> int:
    if text in PROTOCOL_NUMBERS:
        return PROTOCOL_NUMBERS[text]
    return _number(text, 0, 255)


def _seconds(text: str) -> int:
    if not text.endswith("s") or not text[:-1].isdigit():
        raise _Unsupported(f"timeout {text!r} (want seconds, e.g. 300s)")
    return int(text[:-1])
