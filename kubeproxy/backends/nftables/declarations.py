"""Sets and maps as nf_tables netlink messages: their declarations and element values,
byte for byte as nft (1.0.6, Debian 12's) writes them.

The owned table (:mod:`~kubeproxy.backends.nftables.owner`) is written over our own
netlink socket only, so nothing of it may need nft's parser. A set's declaration is more
than its kernel types: nft stores in the set's user data how to list it (the key's and
value's byte order, the ``typeof`` expressions, the comment), and ``nft list ruleset``
prints a set from that. :class:`Declaration` writes exactly those bytes for the types
and ``typeof`` expressions our tables use (:data:`DATATYPES`, :data:`TYPEOF`); the kernel
test that writes every flow-case state both ways compares what the kernel then holds,
attribute by attribute, and what ``nft list ruleset`` prints.

Elements are encoded here too, for any declared container: data values, verdicts
(``goto X``), prefixes and ranges of interval concatenations (a key and a key end, as
nft sends them). The element batches of ``elements.py`` stay the fast path for the
plain data maps of a sync; these are what a transaction holds (verdict maps, source
ranges, the few plain elements of the fixed sets).
"""

from __future__ import annotations

import errno
import ipaddress
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.backends.nftables.elements import encode_part
from kubeproxy.backends.nftables.objects import Map, NftError, Set

__all__ = [
    "DATATYPES",
    "TYPEOF",
    "Datatype",
    "Declaration",
    "Field",
    "encode_verdict",
]

# nf_tables.h
NFTA_SET_TABLE, NFTA_SET_NAME, NFTA_SET_FLAGS = 1, 2, 3
NFTA_SET_KEY_TYPE, NFTA_SET_KEY_LEN, NFTA_SET_DATA_TYPE, NFTA_SET_DATA_LEN = 4, 5, 6, 7
NFTA_SET_DESC, NFTA_SET_ID, NFTA_SET_TIMEOUT, NFTA_SET_USERDATA = 9, 10, 11, 13
NFTA_SET_DESC_SIZE, NFTA_SET_DESC_CONCAT = 1, 2
NFTA_LIST_ELEM = 1
NFTA_SET_FIELD_LEN = 1
NFTA_SET_ELEM_KEY, NFTA_SET_ELEM_DATA, NFTA_SET_ELEM_KEY_END = 1, 2, 10
NFTA_DATA_VALUE, NFTA_DATA_VERDICT = 1, 2
NFTA_VERDICT_CODE, NFTA_VERDICT_CHAIN = 1, 2
NFT_SET_ANONYMOUS, NFT_SET_CONSTANT, NFT_SET_INTERVAL, NFT_SET_MAP = 0x1, 0x2, 0x4, 0x8
NFT_SET_TIMEOUT, NFT_SET_EVAL, NFT_SET_CONCAT = 0x10, 0x20, 0x80
NFT_DATA_VERDICT = 0xFFFFFF00
VERDICTS = {"drop": 0, "accept": 1, "continue": -1, "return": -5, "jump": -3, "goto": -4}
"""Verdict codes (``NF_DROP``, ``NF_ACCEPT``, ``NFT_CONTINUE`` ...)."""

# nft's byte orders and user-data types (nftables' datatype.h, libnftnl's udata.h).
_INVALID, _HOST, _BIG = 0, 1, 2
_UDATA_KEY_BYTEORDER, _UDATA_DATA_BYTEORDER = 0, 1
_UDATA_KEY_TYPEOF, _UDATA_DATA_TYPEOF, _UDATA_DATA_INTERVAL, _UDATA_COMMENT = 3, 4, 6, 7
_TYPEOF_EXPR, _TYPEOF_DATA = 0, 1
# nft's expression types (nftables' expression.h) and protocol descriptions (proto.h).
_EXPR_VERDICT, _EXPR_PAYLOAD, _EXPR_META, _EXPR_CONCAT, _EXPR_NUMGEN = 1, 7, 9, 13, 23
_TYPE_BITS = 6

_FLAG_BITS = {
    "constant": NFT_SET_CONSTANT,
    "interval": NFT_SET_INTERVAL,
    "timeout": NFT_SET_TIMEOUT,
    "dynamic": NFT_SET_EVAL,
}


@dataclass(frozen=True, slots=True)
class Datatype:
    """One of nft's data types: its kernel number, length in bytes and byte order."""

    name: str
    number: int
    size: int
    byteorder: int


DATATYPES = {
    t.name: t
    for t in (
        Datatype("integer", 4, 4, _HOST),
        Datatype("ipv4_addr", 7, 4, _BIG),
        Datatype("ipv6_addr", 8, 16, _BIG),
        Datatype("inet_proto", 12, 1, _HOST),
        Datatype("inet_service", 13, 2, _BIG),
    )
}
"""The data types our sets and maps use (``verdict`` is a map value of its own)."""


def _tlv(kind: int, value: bytes) -> bytes:
    """One user-data attribute (libnftnl's udata: type and length bytes, no padding)."""
    return bytes((kind, len(value))) + value


def _u32(value: int) -> bytes:
    return struct.pack("=I", value)


def _payload_udata(desc: int, field: int) -> bytes:
    return _tlv(_TYPEOF_EXPR, _u32(_EXPR_PAYLOAD)) + _tlv(
        _TYPEOF_DATA, _tlv(0, _u32(desc)) + _tlv(1, _u32(field))
    )


_PROTO_TH, _PROTO_IP, _PROTO_IP6 = 11, 12, 13
_PROTO_DESCS = {"tcp": 8, "udp": 6, "sctp": 10, "th": _PROTO_TH}
_DPORT = 2

TYPEOF = {
    "ip daddr": ("ipv4_addr", _payload_udata(_PROTO_IP, 12)),
    "ip saddr": ("ipv4_addr", _payload_udata(_PROTO_IP, 11)),
    "ip6 daddr": ("ipv6_addr", _payload_udata(_PROTO_IP6, 9)),
    "ip6 saddr": ("ipv6_addr", _payload_udata(_PROTO_IP6, 8)),
    "meta l4proto": (
        "inet_proto",
        _tlv(_TYPEOF_EXPR, _u32(_EXPR_META)) + _tlv(_TYPEOF_DATA, _tlv(0, _u32(16))),
    ),
    **{
        f"{proto} dport": ("inet_service", _payload_udata(desc, _DPORT))
        for proto, desc in _PROTO_DESCS.items()
    },
}
"""``typeof`` expressions our sets use: the data type each stands for, and the user data
nft writes for it (a payload field by protocol description and field number, a meta key;
``numgen random mod N`` is built by :func:`_typeof`)."""


@dataclass(frozen=True, slots=True)
class Field:
    """One part of a key or value: its data type and, for ``typeof``, its expression."""

    datatype: Datatype
    expression: str | None = None


def _typeof(expression: str) -> Field:
    words = expression.split()
    if len(words) == 4 and words[:3] == ["numgen", "random", "mod"] and words[3].isdigit():
        return Field(DATATYPES["integer"], expression)
    found = TYPEOF.get(expression)
    if found is None:
        raise NftError(f"typeof {expression!r} is not one the owned table writes", errno.EINVAL)
    return Field(DATATYPES[found[0]], expression)


def _typeof_udata(expression: str) -> bytes:
    words = expression.split()
    if words[0] == "numgen":
        data = _tlv(0, _u32(1)) + _tlv(1, _u32(int(words[3]))) + _tlv(2, _u32(0))
        return _tlv(_TYPEOF_EXPR, _u32(_EXPR_NUMGEN)) + _tlv(_TYPEOF_DATA, data)
    return TYPEOF[expression][1]


def _fields(text: str, typeof: bool) -> tuple[Field, ...]:
    parts = text.split(" . ")
    if typeof:
        return tuple(_typeof(part) for part in parts)
    fields = []
    for part in parts:
        datatype = DATATYPES.get(part)
        if datatype is None:
            raise NftError(f"data type {part!r} is not one the owned table writes", errno.EINVAL)
        fields.append(Field(datatype))
    return tuple(fields)


def _type_number(fields: Sequence[Field]) -> int:
    number = 0
    for field in fields:
        number = (number << _TYPE_BITS) | field.datatype.number
    return number


def _length(fields: Sequence[Field]) -> int:
    if len(fields) == 1:
        return fields[0].datatype.size
    return sum(nlmsg.align(f.datatype.size) for f in fields)


def _byteorder(fields: Sequence[Field]) -> int:
    return fields[0].datatype.byteorder if len(fields) == 1 else _INVALID


def _expressions_udata(kind: int, fields: Sequence[Field], typeof: bool) -> bytes:
    """nft's record of a key's (or value's) expressions: for a concatenation (``type``
    or ``typeof``) a concat of its parts' expressions (none for ``type``), for a single
    ``typeof`` expression that expression, else nothing."""
    if len(fields) > 1:
        parts = b""
        if typeof:
            for index, field in enumerate(fields):
                assert field.expression is not None
                parts += _tlv(index, _typeof_udata(field.expression))
        body = _tlv(_TYPEOF_EXPR, _u32(_EXPR_CONCAT)) + _tlv(_TYPEOF_DATA, parts)
        return _tlv(kind, body)
    if typeof and fields[0].expression is not None:
        return _tlv(kind, _typeof_udata(fields[0].expression))
    return b""


@dataclass(frozen=True, slots=True)
class Declaration:
    """A named set or map of one table, as the kernel and nft's listing need it.

    Built from a :class:`~.objects.Set` or :class:`~.objects.Map` by :meth:`of`; an
    ``anonymous`` one (``{ tcp, udp, sctp }`` in a rule) by :meth:`anonymous`.
    ``value`` is empty for a set, ``None`` for a verdict map.
    """

    name: str
    key: tuple[Field, ...]
    value: tuple[Field, ...] | None
    is_map: bool
    flags: tuple[str, ...] = ()
    timeout: int | None = None
    comment: str | None = None
    typeof: bool = False
    anonymous_size: int = 0

    @classmethod
    def of(cls, obj: Set | Map) -> Declaration:
        """The declaration of a queued set or map (raises :class:`NftError` for a type
        or ``typeof`` expression outside what our tables use)."""
        if isinstance(obj, Map):
            key_text, value_text = obj.key_type, obj.value_type
            value = None if value_text == "verdict" else _fields(value_text, obj.typeof)
            return cls(
                obj.name,
                _fields(key_text, obj.typeof),
                value,
                True,
                tuple(sorted(obj.flags)),
                obj.timeout,
                obj.comment,
                obj.typeof,
            )
        return cls(
            obj.name,
            _fields(obj.type, obj.typeof),
            (),
            False,
            tuple(sorted(obj.flags)),
            obj.timeout,
            obj.comment,
            obj.typeof,
        )

    @classmethod
    def anonymous(cls, expression: str, size: int) -> Declaration:
        """The anonymous constant set nft makes for ``{ a, b, c }`` after
        ``expression`` (named ``__set%d``: the kernel numbers it)."""
        return cls("__set%d", (_typeof(expression),), (), False, typeof=True, anonymous_size=size)

    @classmethod
    def from_kernel(cls, attributes: bytes) -> Declaration:
        """The declaration of a set as the kernel dumps it (``NFT_MSG_NEWSET``
        attributes after ``nfgenmsg``): its types, flags and timeout, and the ``typeof``
        expressions and comment nft keeps in its user data, where we know them. Raises
        :class:`NftError` for a type outside :data:`DATATYPES`."""
        values = dict(nlmsg.attribute_values(attributes))
        name = values.get(NFTA_SET_NAME, b"").rstrip(b"\0").decode(errors="replace")
        bits = struct.unpack(">I", values.get(NFTA_SET_FLAGS, bytes(4)))[0]
        udata = _udata(values.get(NFTA_SET_USERDATA, b""))
        key_exprs = _typeof_parts(udata.get(_UDATA_KEY_TYPEOF, b""))
        key = _kernel_fields(values.get(NFTA_SET_KEY_TYPE, bytes(4)), key_exprs, name)
        is_map = bool(bits & NFT_SET_MAP)
        value: tuple[Field, ...] | None = ()
        if is_map:
            (number,) = struct.unpack(">I", values.get(NFTA_SET_DATA_TYPE, bytes(4)))
            if number == NFT_DATA_VERDICT:
                value = None
            else:
                value_exprs = _typeof_parts(udata.get(_UDATA_DATA_TYPEOF, b""))
                value = _kernel_fields(values[NFTA_SET_DATA_TYPE], value_exprs, name)
        flags = tuple(sorted(flag for flag, bit in _FLAG_BITS.items() if bits & bit))
        timeout = None
        if NFTA_SET_TIMEOUT in values:
            timeout = struct.unpack(">Q", values[NFTA_SET_TIMEOUT])[0] // 1000
        comment = None
        if _UDATA_COMMENT in udata:
            comment = udata[_UDATA_COMMENT].rstrip(b"\0").decode(errors="replace")
        typeof = any(f.expression for f in key) or any(f.expression for f in value or ())
        return cls(name, key, value, is_map, flags, timeout, comment, typeof)

    @property
    def verdicts(self) -> bool:
        """Whether this is a verdict map."""
        return self.is_map and self.value is None

    @property
    def interval(self) -> bool:
        """Whether elements are ranges."""
        return "interval" in self.flags

    def data_types(self) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """The data type names of key and value, for the fast element encoder of
        :mod:`.elements` (None for ranges and verdicts, which it does not write, and for
        a lone field shorter than 4 bytes, which it would pad)."""
        if self.interval or self.value is None:
            return None
        for fields in (self.key, self.value):
            if len(fields) == 1 and fields[0].datatype.size % 4:
                return None
        return (
            tuple(f.datatype.name for f in self.key),
            tuple(f.datatype.name for f in self.value),
        )

    def flag_bits(self) -> int:
        """``NFTA_SET_FLAGS``."""
        bits = NFT_SET_MAP if self.is_map else 0
        for flag in self.flags:
            bits |= _FLAG_BITS[flag]
        if self.interval and len(self.key) > 1:
            bits |= NFT_SET_CONCAT
        if self.anonymous_size:
            bits |= NFT_SET_ANONYMOUS | NFT_SET_CONSTANT
        return bits

    def attributes(self, table: str, set_id: int | None = None) -> bytes:
        """The attributes of an ``NFT_MSG_NEWSET`` declaring this set (after ``nfgenmsg``),
        in nft's order."""
        attr = nlmsg.attr
        out = [
            attr(NFTA_SET_TABLE, nlmsg.string(table)),
            attr(NFTA_SET_NAME, nlmsg.string(self.name)),
            attr(NFTA_SET_FLAGS, struct.pack(">I", self.flag_bits())),
            attr(NFTA_SET_KEY_TYPE, struct.pack(">I", _type_number(self.key))),
            attr(NFTA_SET_KEY_LEN, struct.pack(">I", _length(self.key))),
        ]
        if self.is_map:
            if self.value is None:
                out.append(attr(NFTA_SET_DATA_TYPE, struct.pack(">I", NFT_DATA_VERDICT)))
                out.append(attr(NFTA_SET_DATA_LEN, struct.pack(">I", 0)))
            else:
                out.append(attr(NFTA_SET_DATA_TYPE, struct.pack(">I", _type_number(self.value))))
                out.append(attr(NFTA_SET_DATA_LEN, struct.pack(">I", _length(self.value))))
        if self.timeout is not None:
            out.append(attr(NFTA_SET_TIMEOUT, struct.pack(">Q", self.timeout * 1000)))
        if set_id is not None:
            out.append(attr(NFTA_SET_ID, struct.pack(">I", set_id)))
        if self.anonymous_size:
            out.append(
                nlmsg.nested(
                    NFTA_SET_DESC, attr(NFTA_SET_DESC_SIZE, struct.pack(">I", self.anonymous_size))
                )
            )
        elif self.interval and len(self.key) > 1:
            lengths = [
                nlmsg.nested(
                    NFTA_LIST_ELEM,
                    attr(NFTA_SET_FIELD_LEN, struct.pack(">I", f.datatype.size)),
                )
                for f in self.key
            ]
            out.append(nlmsg.nested(NFTA_SET_DESC, nlmsg.nested(NFTA_SET_DESC_CONCAT, *lengths)))
        out.append(attr(NFTA_SET_USERDATA, self.user_data()))
        return b"".join(out)

    def user_data(self) -> bytes:
        """What nft stores to list the set (``NFTA_SET_USERDATA``)."""
        data = _tlv(_UDATA_KEY_BYTEORDER, _u32(_byteorder(self.key)))
        if self.is_map:
            order = _INVALID if self.value is None else _byteorder(self.value)
            data += _tlv(_UDATA_DATA_BYTEORDER, _u32(order))
        data += _expressions_udata(_UDATA_KEY_TYPEOF, self.key, self.typeof)
        if self.value:
            data += _expressions_udata(_UDATA_DATA_TYPEOF, self.value, self.typeof)
        elif self.verdicts and self.typeof:
            # "typeof ... : verdict": nft records the value as a verdict expression
            # (with no data of its own), as it records any typeof map's value.
            verdict = _tlv(_TYPEOF_EXPR, _u32(_EXPR_VERDICT)) + _tlv(_TYPEOF_DATA, b"")
            data += _tlv(_UDATA_DATA_TYPEOF, verdict)
        if self.is_map:
            data += _tlv(_UDATA_DATA_INTERVAL, _u32(0))
        if self.comment is not None:
            data += _tlv(_UDATA_COMMENT, self.comment.encode() + b"\0")
        return data

    # Elements -----------------------------------------------------------------------------

    def element(self, key: Sequence[str], value: Sequence[str] = ()) -> bytes:
        """One element's ``NFTA_LIST_ELEM`` (raises :class:`NftError` for a part that is
        not of its type): the key (and its end, for ranges), and the value of a map."""
        try:
            low, high = _encode_key(self.key, key, self.interval)
            parts = [nlmsg.nested(NFTA_SET_ELEM_KEY, nlmsg.attr(NFTA_DATA_VALUE, low))]
            if high is not None:
                parts.append(nlmsg.nested(NFTA_SET_ELEM_KEY_END, nlmsg.attr(NFTA_DATA_VALUE, high)))
            if value:
                if self.value is None:
                    if len(value) != 1:
                        raise ValueError("a verdict is one part")
                    data = encode_verdict(value[0])
                else:
                    data = nlmsg.attr(NFTA_DATA_VALUE, _encode_parts(self.value, value))
                parts.append(nlmsg.nested(NFTA_SET_ELEM_DATA, data))
        except ValueError as err:
            shown = " . ".join(key) + (f" : {' . '.join(value)}" if value else "")
            raise NftError(f"element {shown} of {self.name}: {err}", errno.EINVAL) from None
        return nlmsg.nested(NFTA_LIST_ELEM, *parts)


def _udata(data: bytes) -> dict[int, bytes]:
    """User-data attributes by type (a malformed tail is ignored)."""
    out = {}
    at = 0
    while at + 2 <= len(data):
        kind, length = data[at], data[at + 1]
        out[kind] = data[at + 2 : at + 2 + length]
        at += 2 + length
    return out


_KNOWN_TYPEOF = {udata: expression for expression, (_t, udata) in TYPEOF.items()}


def _typeof_parts(data: bytes) -> list[str | None]:
    """The expressions of a ``typeof`` record (one, or a concatenation's parts; None for
    a part we do not know, and for a concatenation of types)."""
    if not data:
        return []
    record = _udata(data)
    (etype,) = struct.unpack("=I", record.get(_TYPEOF_EXPR, bytes(4)))
    if etype != _EXPR_CONCAT:
        return [_known_expression(data)]
    parts = _udata(record.get(_TYPEOF_DATA, b""))
    return [_known_expression(parts[index]) for index in sorted(parts)]


def _known_expression(data: bytes) -> str | None:
    found = _KNOWN_TYPEOF.get(data)
    if found is not None:
        return found
    record = _udata(data)
    (etype,) = struct.unpack("=I", record.get(_TYPEOF_EXPR, bytes(4)))
    if etype == _EXPR_NUMGEN:
        numgen = _udata(record.get(_TYPEOF_DATA, b""))
        (modulus,) = struct.unpack("=I", numgen.get(1, bytes(4)))
        return f"numgen random mod {modulus}"
    return None


_BY_NUMBER = {t.number: t for t in DATATYPES.values()}


def _kernel_fields(raw: bytes, expressions: list[str | None], name: str) -> tuple[Field, ...]:
    (number,) = struct.unpack(">I", raw)
    numbers = []
    while number:
        numbers.append(number & ((1 << _TYPE_BITS) - 1))
        number >>= _TYPE_BITS
    numbers.reverse()
    fields = []
    for index, part in enumerate(numbers):
        datatype = _BY_NUMBER.get(part)
        if datatype is None:
            raise NftError(f"set {name} has a data type ({part}) the owned table does not write")
        expression = expressions[index] if index < len(expressions) else None
        fields.append(Field(datatype, expression))
    return tuple(fields)


def encode_verdict(text: str) -> bytes:
    """``NFTA_DATA_VERDICT`` of ``drop``, ``accept``, ``return``, ``jump X``, ``goto X``."""
    word, _, chain = text.partition(" ")
    code = VERDICTS.get(word)
    if code is None or bool(chain) != (word in ("jump", "goto")):
        raise ValueError(f"{text!r} is not a verdict")
    parts = [nlmsg.attr(NFTA_VERDICT_CODE, struct.pack(">i", code))]
    if chain:
        parts.append(nlmsg.attr(NFTA_VERDICT_CHAIN, nlmsg.string(chain)))
    return nlmsg.nested(NFTA_DATA_VERDICT, *parts)


def encode_value(datatype: Datatype, text: str) -> bytes:
    """One value of ``datatype`` as the kernel holds it (unpadded): what
    :func:`~.elements.encode_part` packs, without the padding of a concatenation's part."""
    return encode_part(datatype.name, text)[: datatype.size]


def _pad(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 4)


def _encode_parts(fields: Sequence[Field], parts: Sequence[str]) -> bytes:
    if len(parts) != len(fields):
        raise ValueError(f"expected {len(fields)} parts, got {len(parts)}")
    if len(fields) == 1:
        return encode_value(fields[0].datatype, parts[0])
    return b"".join(_pad(encode_value(f.datatype, p)) for f, p in zip(fields, parts, strict=True))


def _bounds(datatype: Datatype, text: str) -> tuple[bytes, bytes]:
    """The first and last value of a part of an interval key: a value, ``a-b`` or a
    prefix (addresses)."""
    if "/" in text and datatype.name in ("ipv4_addr", "ipv6_addr"):
        try:
            network = ipaddress.ip_network(text, strict=True)
        except ValueError:
            raise ValueError(f"{text!r} is not a network") from None
        if network.version != (4 if datatype.name == "ipv4_addr" else 6):
            raise ValueError(f"{text!r} is not an {datatype.name} network")
        return network.network_address.packed, network.broadcast_address.packed
    low, dash, high = text.partition("-")
    if dash and datatype.name not in ("ipv6_addr",):
        return encode_value(datatype, low), encode_value(datatype, high)
    value = encode_value(datatype, text)
    return value, value


def _encode_key(
    fields: Sequence[Field], parts: Sequence[str], interval: bool
) -> tuple[bytes, bytes | None]:
    if not interval:
        return _encode_parts(fields, parts), None
    if len(parts) != len(fields):
        raise ValueError(f"expected {len(fields)} parts, got {len(parts)}")
    if len(fields) == 1:
        raise ValueError("intervals of one field are not written by the owned table")
    lows, highs = [], []
    for field, part in zip(fields, parts, strict=True):
        low, high = _bounds(field.datatype, part)
        lows.append(_pad(low))
        highs.append(_pad(high))
    return b"".join(lows), b"".join(highs)
