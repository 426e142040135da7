"""Set and map elements sent as one nf_tables netlink batch, without nft's parser.

Why hand-written (measured on these machines, and in ``bench/``): libnftables parses
every element as text and builds its own objects before it encodes them; in the map
structure's cold sync that was 12 us per element, two thirds of a 10k-Service sync, and
nft's memory grows with every element of a transaction.
pyroute2's nfnetlink messages took 47 us per element to encode, and each of its writes
waits on an asyncio loop (0.5 ms for one element). Packing the few data types our
containers use ourselves costs well under 1 us per element (0.5-0.6 us for the slots
map: :class:`_Codec`) and sends a batch of any size as one transaction (the netlink
framing is :mod:`kubeproxy.host.nlmsg`'s). Only *elements* go this way: they carry no
bytecode, so ``nft list`` shows them exactly as if nft had added them; chains, rules and
sets stay nft text.

An :class:`ElementBatch` names its containers' data types (the backend declared them),
so nothing is read from the kernel first. Supported types: ``ipv4_addr``, ``ipv6_addr``,
``inet_proto``, ``inet_service``, ``integer`` (a 32-bit host-order number, what
``numgen`` yields). Interval sets and verdict maps are not supported here.
"""

from __future__ import annotations

import bisect
import errno as _errno
import functools
import itertools
import operator
import os
import socket
import struct
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar, overload

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.backends.nftables.batchsocket import BatchSocket, Frame
from kubeproxy.backends.nftables.objects import (
    PROTOCOL_NUMBERS,
    Family,
    NftError,
    validate_name,
)

__all__ = [
    "COMMENT_MAX",
    "ContainerTypes",
    "ElementBatch",
    "ElementWriter",
    "EncodedPairs",
    "GroupedAdds",
    "GroupedDeletes",
    "SlotPacker",
    "comment_userdata",
    "decode_part",
    "decode_parts",
    "each_key_once",
    "each_once",
    "element_encoder",
    "element_frames",
    "encode_part",
    "pair_elements",
    "read_whole",
    "slot_elements",
    "slot_packer",
    "supports",
    "with_comment",
]

Key = tuple[str, ...]

_FAMILY_NUMBERS = {Family.IP: socket.AF_INET, Family.IP6: socket.AF_INET6, Family.INET: 1}
SUPPORTED_TYPES = frozenset({"ipv4_addr", "ipv6_addr", "inet_proto", "inet_service", "integer"})

# nf_tables constants (linux/netfilter/nf_tables.h); netlink's are in kubeproxy.host.nlmsg.
_NFT_MSG_NEWSETELEM = 12
_NFT_MSG_GETSETELEM = 13
_NFT_MSG_DELSETELEM = 14
_DUMP_ATTEMPTS: Final = 5
"""Dumps of one container asked before :func:`read_whole` gives up."""
_DUMP_PAUSE: Final = 0.005
"""Seconds before a second dump (twice that before a third, ...): a hash table's resize
is a kernel worker's, scheduled by the insertion that filled the table, and is done in
well under a millisecond per thousand elements."""
_NFTA_SET_ELEM_LIST_TABLE = 1
_NFTA_SET_ELEM_LIST_SET = 2
_NFTA_SET_ELEM_LIST_ELEMENTS = 3
_NFTA_LIST_ELEM = 1
_NFTA_SET_ELEM_KEY = 1
_NFTA_SET_ELEM_DATA = 2
_NFTA_SET_ELEM_USERDATA = 6
_NFTA_DATA_VALUE = 1
# libnftnl's udata type of an element's comment (NFTNL_UDATA_SET_ELEM_COMMENT).
_UDATA_SET_ELEM_COMMENT = 0
COMMENT_MAX = 128
"""Longest element comment we write, in bytes (nft allows 128 characters; the kernel
keeps up to 256 bytes of user data per element)."""
# What a comment may add to an element: its attribute header, udata type and length, the
# text, its NUL, the padding.
_COMMENT_ROOM = nlmsg.align(4 + 2 + COMMENT_MAX + 1)


def supports(types: Sequence[str]) -> bool:
    """Whether elements of these concatenated types can be sent by :class:`ElementWriter`."""
    return all(t in SUPPORTED_TYPES for t in types)


def comment_userdata(comment: str) -> bytes:
    """An element comment as nft stores it in the element's user data (libnftnl's udata:
    type, length, the text with its terminating NUL), so ``nft list`` shows it as its own.

    Raises :class:`ValueError` for a comment nft could not have written (too long, a
    double quote, a control character).
    """
    data = comment.encode()
    if len(data) > COMMENT_MAX or '"' in comment or not comment.isprintable():
        raise ValueError(f"{comment!r} cannot be an element comment")
    return bytes((_UDATA_SET_ELEM_COMMENT, len(data) + 1)) + data + b"\0"


def with_comment(element: bytes, comment: str) -> bytes:
    """An encoded ``NFTA_LIST_ELEM`` attribute with ``comment`` added as its user data
    (``NFTA_SET_ELEM_USERDATA``): what an element written with a comment carries, for any
    encoder of elements (this module's, or one that encodes whole transactions)."""
    extra = nlmsg.attr(_NFTA_SET_ELEM_USERDATA, comment_userdata(comment))
    length, kind = nlmsg.ATTR.unpack_from(element)
    return nlmsg.ATTR.pack(length + len(extra), kind) + element[nlmsg.ATTR.size :] + extra


def encode_part(datatype: str, text: str) -> bytes:
    """One part of a key or value as the kernel stores it (padded to 4 bytes).

    Raises :class:`ValueError` for text that is not a ``datatype`` (nothing unchecked is
    ever sent: ``inet_aton``/``inet_pton`` parse addresses strictly, numbers are ranged).
    """
    if datatype in ("ipv4_addr", "ipv6_addr"):
        family = socket.AF_INET if datatype == "ipv4_addr" else socket.AF_INET6
        try:
            return socket.inet_pton(family, text)
        except OSError:
            raise ValueError(f"{text!r} is not an {datatype}") from None
    if datatype == "inet_proto":
        number = PROTOCOL_NUMBERS.get(text)
        if number is None:
            raise ValueError(f"{text!r} is not a protocol we send")
        return bytes((number, 0, 0, 0))
    if datatype == "inet_service":
        port = int(text)
        if not 0 <= port <= 65535 or not text.isdigit():
            raise ValueError(f"{text!r} is not a port")
        return struct.pack(">HH", port, 0)
    if datatype == "integer":
        value = int(text)
        if not 0 <= value < 2**32 or not text.isdigit():
            raise ValueError(f"{text!r} is not a 32-bit number")
        return struct.pack("=I", value)
    raise ValueError(f"data type {datatype!r} is not supported")


_PROTOCOL_NAMES = {number: name for name, number in PROTOCOL_NUMBERS.items()}


def decode_part(datatype: str, data: bytes) -> str:
    """One part of a key or value as nft writes it (the inverse of :func:`encode_part`)."""
    if datatype == "ipv4_addr":
        return socket.inet_ntop(socket.AF_INET, data[:4])
    if datatype == "ipv6_addr":
        return socket.inet_ntop(socket.AF_INET6, data[:16])
    if datatype == "inet_proto":
        return _PROTOCOL_NAMES.get(data[0], str(data[0]))
    if datatype == "inet_service":
        return str(struct.unpack_from(">H", data)[0])
    if datatype == "integer":
        return str(struct.unpack_from("=I", data)[0])
    raise ValueError(f"data type {datatype!r} is not supported")


def decode_parts(types: tuple[str, ...], data: bytes) -> Key:
    """A key or value of ``types`` as nft writes it (the inverse of the encoder)."""
    parts = []
    offset = 0
    for datatype in types:
        parts.append(decode_part(datatype, data[offset:]))
        offset += _SIZES[datatype]
    return tuple(parts)


_SIZES = {"ipv4_addr": 4, "ipv6_addr": 16, "inet_proto": 4, "inet_service": 4, "integer": 4}


class _PartCache(dict[str, bytes]):
    """Packed parts of one data type by text, filled by :func:`encode_part` on a miss.

    A dict subclass so that a hit is ``dict.__getitem__`` (no Python frame): protocols,
    ports and slot numbers repeat across elements, addresses do not (they are packed by
    ``inet_pton`` every time instead)."""

    __slots__ = ("datatype",)

    def __init__(self, datatype: str) -> None:
        super().__init__()
        self.datatype = datatype

    def __missing__(self, text: str) -> bytes:
        packed = encode_part(self.datatype, text)
        if len(self) < 65536:
            self[text] = packed
        return packed


def _part_encoder(datatype: str) -> Callable[[str], bytes]:
    """What packs one part of ``datatype``: C-level callables only (see :class:`_Codec`)."""
    if datatype == "ipv4_addr":
        return functools.partial(socket.inet_pton, socket.AF_INET)
    if datatype == "ipv6_addr":
        return functools.partial(socket.inet_pton, socket.AF_INET6)
    return _PartCache(datatype).__getitem__


_Packer = Callable[[Key], bytes]


def _packer(encoders: Sequence[Callable[[str], bytes]]) -> _Packer:
    """Packs a key or value of ``len(encoders)`` parts, each by its encoder.

    One closure per arity up to four (what our containers use), each unpacking its parts
    and calling the encoders directly: measured, that costs a third less than a loop over
    the parts (``map(operator.call, ...)``), which remains for longer keys. A key of the
    wrong length raises :class:`ValueError` either way.
    """
    if len(encoders) == 1:
        (f0,) = encoders

        def pack1(parts: Key) -> bytes:
            (p0,) = parts
            return f0(p0)

        return pack1
    if len(encoders) == 2:
        f0, f1 = encoders

        def pack2(parts: Key) -> bytes:
            p0, p1 = parts
            return f0(p0) + f1(p1)

        return pack2
    if len(encoders) == 3:
        f0, f1, f2 = encoders

        def pack3(parts: Key) -> bytes:
            p0, p1, p2 = parts
            return f0(p0) + f1(p1) + f2(p2)

        return pack3
    if len(encoders) == 4:
        f0, f1, f2, f3 = encoders

        def pack4(parts: Key) -> bytes:
            p0, p1, p2, p3 = parts
            return f0(p0) + f1(p1) + f2(p2) + f3(p3)

        return pack4
    fixed = tuple(encoders)

    def pack(parts: Key) -> bytes:
        if len(parts) != len(fixed):
            raise ValueError(f"expected {len(fixed)} parts, got {len(parts)}")
        return b"".join(map(operator.call, fixed, parts))

    return pack


def _element_encoder(
    head: bytes, head_key: bytes, middle: bytes, key: _Packer, value: _Packer | None
) -> Callable[[Key, Key], bytes]:
    """One element's ``NFTA_LIST_ELEM`` attribute (see :meth:`_Codec.element`)."""

    def element(key_parts: Key, value_parts: Key) -> bytes:
        try:
            packed = key(key_parts)
            if not value_parts:
                return head_key + packed
            if value is None:
                raise ValueError("a set element has no value")
            return head + packed + middle + value(value_parts)
        except OSError as err:  # inet_pton: not an address
            raise ValueError(str(err)) from None

    return element


def _many_encoder(
    head: bytes,
    head_key: bytes,
    middle: bytes,
    key: _Packer,
    value: _Packer | None,
    element: Callable[[Key, Key], bytes],
) -> Callable[[Sequence[tuple[Key, Key]], bool], list[bytes]]:
    """Every element of a list of ``(key, value)`` pairs (see :meth:`_Codec.many`).

    One list comprehension per kind of list, the headers joined in it, rather than a
    call of :attr:`_Codec.element` per element. Measured on the slots map (100k elements,
    best of 5, ``/tmp``-style ``timeit`` on the shared machine, the same bytes out): 0.80
    us an element through ``element``, 0.74 us joined here; the encoding is a few
    percent of a full sync, the calls and tuples around it the rest. A list the
    comprehension cannot take (a part of the wrong type, a value where a set has none,
    a map element without one) goes through ``element`` one by one, which raises as it
    always did or encodes exactly as before."""

    def many(pairs: Sequence[tuple[Key, Key]], keys_only: bool) -> list[bytes]:
        try:
            if keys_only or value is None:
                # Deletions and set elements: keys alone (a pair with a value, which a
                # set element cannot have, leaves the list to ``element``).
                out = [head_key + key(k) for k, v in pairs if not v]
                if len(out) == len(pairs):
                    return out
            else:
                return [head + key(k) + middle + value(v) for k, v in pairs]
        except (ValueError, OSError):
            pass
        return [element(k, v) for k, v in pairs]

    return many


class _Codec:
    """Packs the elements of one container type.

    Every element of a container has the same attribute layout, so the headers around
    its key and value are computed once, and each part is packed by a callable chosen
    once per part (:func:`_part_encoder`): ``inet_pton`` for addresses, a cache's
    ``__getitem__`` for the parts that repeat, called from a closure made for the
    number of parts (:func:`_packer`). Measured encoding 100k elements of the slots map
    (4 key parts, 2 value parts; ``timeit``, best of 7, on a machine shared with other
    work; the same bytes out): source generated for each container's parts and compiled
    with ``exec`` (which neither mypy nor a debugger could see) took 0.49-0.53 us an
    element (set elements of 3 parts: 0.28-0.30 us); this 0.58-0.60 us (0.31-0.33 us),
    within the 1.5x we accept for code that can be checked; one
    ``map(operator.call, encoders, parts)`` for every arity took 0.88 us (0.56 us).
    Earlier still, a Python loop over part encoders took three times as long.
    ``nested`` is the flag its nested attributes carry (0: as the kernel's dumps carry
    them, :func:`element_encoder`'s ``dumped``).
    """

    __slots__ = ("element", "heads", "key_parts", "many", "prefixes", "size", "value_parts")

    def __init__(
        self,
        key_types: tuple[str, ...],
        value_types: tuple[str, ...],
        nested: int = nlmsg.NLA_F_NESTED,
    ) -> None:
        key_len = sum(_SIZES[t] for t in key_types)
        value_len = sum(_SIZES[t] for t in value_types)
        key_nest = 4 + 4 + key_len
        data_nest = 4 + 4 + value_len if value_types else 0
        self.size = 4 + key_nest + data_nest
        key_head = nlmsg.ATTR.pack(key_nest, _NFTA_SET_ELEM_KEY | nested)
        key_head += nlmsg.ATTR.pack(4 + key_len, _NFTA_DATA_VALUE)
        list_elem = _NFTA_LIST_ELEM | nested
        middle = nlmsg.ATTR.pack(data_nest, _NFTA_SET_ELEM_DATA | nested)
        middle += nlmsg.ATTR.pack(4 + value_len, _NFTA_DATA_VALUE)
        # With a value (additions to a map), and without (set elements, deletions).
        head = nlmsg.ATTR.pack(self.size, list_elem) + key_head
        head_key = nlmsg.ATTR.pack(4 + key_nest, list_elem) + key_head
        self.key_parts = [_part_encoder(t) for t in key_types]
        self.value_parts = [_part_encoder(t) for t in value_types]
        # A packer per length of key prefix (see key_prefix).
        self.prefixes = [_packer(self.key_parts[:n]) for n in range(len(key_types) + 1)]
        self.heads = (head, head_key, middle)
        """What comes before the key (with a value, and without), and between key and
        value (see :func:`slot_elements`)."""
        key = _packer(self.key_parts)
        value = _packer(self.value_parts) if value_types else None
        self.element: Callable[[Key, Key], bytes] = _element_encoder(
            head, head_key, middle, key, value
        )
        """One element's ``NFTA_LIST_ELEM`` attribute: the key alone when the value is
        empty (set elements, deletions), else key and value. Raises :class:`ValueError`
        for a part that is not of its type, or a key or value of the wrong length."""
        self.many: Callable[[Sequence[tuple[Key, Key]], bool], list[bytes]] = _many_encoder(
            head, head_key, middle, key, value, self.element
        )
        """The elements of a list of pairs, as :attr:`element` encodes each (its second
        argument: every value is empty, as in deletions and set elements; the first
        element that :attr:`element` refuses raises its :class:`ValueError`)."""

    def key_prefix(self, parts: Key) -> bytes:
        """The first ``len(parts)`` parts of a key, packed (raises :class:`ValueError`
        for a part that is not of its type, or for more parts than the key has).

        By :func:`_packer`'s closure for that many parts: :func:`slot_elements` packs
        every frontend's key this way; a three-part key took 0.35 us, against 0.98 us
        joined from a generator over the parts (``timeit``, CPU time, best of 5,
        2026-11-29, the shared machine)."""
        if len(parts) >= len(self.prefixes):
            raise ValueError(f"a key of {len(self.key_parts)} parts, not {len(parts)}")
        try:
            return self.prefixes[len(parts)](parts)
        except OSError as err:
            raise ValueError(str(err)) from None

    def valid(self, key: Key, value: Key) -> bool:
        """Whether :meth:`element` takes this key and value."""
        try:
            self.element(key, value)
        except ValueError:
            return False
        return True


@functools.lru_cache(maxsize=64)
def _codec(
    key_types: tuple[str, ...], value_types: tuple[str, ...], nested: int = nlmsg.NLA_F_NESTED
) -> _Codec:
    return _Codec(key_types, value_types, nested)


def element_encoder(
    key_types: tuple[str, ...], value_types: tuple[str, ...], *, dumped: bool = False
) -> Callable[[Key, Key], bytes]:
    """The fast encoder of one element's ``NFTA_LIST_ELEM`` for containers of these
    :func:`supports` ed types (:class:`_Codec`; raises :class:`ValueError` for a part
    that is not of its type, or a key or value of the wrong length).

    ``dumped``: the bytes the kernel's dump of the element holds instead, the same but
    for ``NLA_F_NESTED``, which the kernel does not set on what it sends (``kubeproxy
    verify`` compares the big containers as sets of these, without decoding them)."""
    return _codec(key_types, value_types, 0 if dumped else nlmsg.NLA_F_NESTED).element


ContainerTypes = tuple[tuple[str, ...], tuple[str, ...]]
"""A container's key types and value types (empty for a set)."""


class EncodedPairs(Sequence[tuple[Key, Key]]):
    """Additions to one container already encoded (each its ``NFTA_LIST_ELEM``
    attribute, as :func:`element_encoder` encodes it), read as the ``(key, value)``
    text pairs they stand for (decoded when read: by the fake, a dry run, or an error
    that names one). The encoder sends the bytes as they are. Made by
    :func:`slot_elements` and :func:`pair_elements`."""

    __slots__ = ("elements", "types")

    def __init__(self, elements: list[bytes], types: ContainerTypes) -> None:
        self.elements = elements
        self.types = types

    def __len__(self) -> int:
        return len(self.elements)

    @overload
    def __getitem__(self, index: int) -> tuple[Key, Key]: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[tuple[Key, Key]]: ...
    def __getitem__(self, index: int | slice) -> tuple[Key, Key] | Sequence[tuple[Key, Key]]:
        if isinstance(index, slice):
            return EncodedPairs(self.elements[index], self.types)
        wrapped = nlmsg.attr(_NFTA_SET_ELEM_LIST_ELEMENTS, self.elements[index])
        return next(_elements(wrapped, 0, len(wrapped), self.types))

    def extend(self, pairs: Sequence[tuple[Key, Key]]) -> None:
        """Add more pairs: encoded ones as they are, text ones encoded now (raises
        :class:`ValueError` for a part that is not of its type)."""
        if isinstance(pairs, EncodedPairs):
            self.elements.extend(pairs.elements)
        else:
            self.elements.extend(_codec(*self.types).many(pairs, False))


_SLOT_NUMBERS = [struct.pack("=I", number) for number in range(1024)]
_SPLIT_PORT = operator.methodcaller("rpartition", ":")
_BARE6, _WHOLE = slice(1, -1), slice(None)

SlotPacker = Callable[[Key, Sequence[str]], list[bytes]]
"""Packs the elements of one frontend's slots (its key, its endpoint keys): see
:func:`slot_packer`."""


def slot_elements(types: ContainerTypes, key: Key, endpoints: Sequence[str]) -> EncodedPairs:
    """The elements ``key . i : address . port`` of a slots map for ``endpoints`` (each
    ``address:port``, an IPv6 address in brackets), slot ``i`` holding ``endpoints[i]``:
    what :func:`element_encoder` makes of each, the head and the key's parts packed
    once for them all (raises :class:`ValueError` for a part that is not of its type).

    Why: every endpoint of every frontend of a full sync is one of these; packed this
    way, 10k frontends x 10 endpoints took 1.9 us an element against 3.3 us as text
    tuples queued and then packed (``timeit``, best of 5, the shared machine under load;
    the same bytes out, ``tests/test_nft_sync_bytes.py``)."""
    return EncodedPairs(slot_packer(types)(key, endpoints), types)


@functools.lru_cache(maxsize=64)
def slot_packer(types: ContainerTypes) -> SlotPacker:
    """What :func:`slot_elements` does for one slots map's ``types``, as a function of
    the key and the endpoints returning the bytes (raises :class:`ValueError` for
    types that are not a slots map's at once, for a part not of its type when called):
    for a caller that packs many frontends into one map, with the checks of the types
    and the codec's lookups made once (a full sync calls it for every frontend)."""
    key_types, value_types = types
    if len(key_types) < 2 or key_types[-1] != "integer" or len(value_types) != 2:
        raise ValueError(f"{types} are not a slots map's types")
    codec = _codec(*types)
    head, _head_key, middle = codec.heads
    key_prefix = codec.key_prefix
    prefix_parts = len(key_types) - 1
    address, port = codec.value_parts
    # Slot number and the value's header, joined once per map: each element is then
    # three concatenations of the frontend's prefix, this, the address and the port.
    # Measured against the join of five parts it replaces: 0.52 against 0.66-0.72 us
    # an element, 200k elements in 20k frontends (``timeit`` with
    # ``time.process_time``, best of 5, 2026-11-29, the shared machine; the same
    # bytes, ``tests/test_nft_elements.py``). The address sliced by one ``slice`` for
    # both families costs 0.60 against 0.58 us with a comprehension per family (the same
    # 200k elements, quiet machine): not worth two copies of the loop.
    middles = [number + middle for number in _SLOT_NUMBERS]
    split = _SPLIT_PORT

    def pack(key: Key, endpoints: Sequence[str]) -> list[bytes]:
        if len(key) != prefix_parts:
            raise ValueError(f"{types} are not the types of a slots map keyed by {key}")
        prefix = head + key_prefix(key)
        numbered: Sequence[bytes] = middles
        if len(endpoints) > len(middles):
            numbered = [struct.pack("=I", n) + middle for n in range(len(endpoints))]
        # An IPv6 address without its brackets (every endpoint of a frontend is of one
        # family); ``host[:]`` of an IPv4 one is the string itself, no copy.
        bare = _BARE6 if endpoints and endpoints[0].startswith("[") else _WHOLE
        try:
            return [
                prefix + numbers + address(host[bare]) + port(text)
                for numbers, (host, _colon, text) in zip(
                    numbered, map(split, endpoints), strict=False
                )
            ]
        except OSError as err:  # inet_pton: not an address
            raise ValueError(str(err)) from None

    return pack


def pair_elements(types: ContainerTypes, hosts: Sequence[str]) -> EncodedPairs:
    """The elements ``host . host`` of a set of two addresses (the hairpin set), each
    address packed once (raises :class:`ValueError` for text that is not an address of
    the set's type). Why: with :func:`slot_elements`, the other per-endpoint element of
    a full sync; packed here, an address is packed once, not twice."""
    key_types, value_types = types
    if len(key_types) != 2 or key_types[0] != key_types[1] or value_types:
        raise ValueError(f"{types} are not a set of address pairs")
    codec = _codec(*types)
    head_key, address = codec.heads[1], codec.key_parts[0]
    try:
        return EncodedPairs([head_key + packed + packed for packed in map(address, hosts)], types)
    except OSError as err:
        raise ValueError(str(err)) from None


_Item = TypeVar("_Item")


class _Grouped(Sequence[_Item]):
    """Changes held as lists by container (in the order the containers first appear):
    what :class:`~.commits.SyncOps` queues, handed to the encoder without being
    flattened and grouped again. Read as a sequence, it is the flat list (each
    container's changes in turn, built on the first index)."""

    __slots__ = ("_flat", "groups")

    def __init__(self, groups: Mapping[str, Sequence[Any]]) -> None:
        self.groups = groups
        self._flat: list[_Item] | None = None

    def __len__(self) -> int:
        return sum(map(len, self.groups.values()))

    @overload
    def __getitem__(self, index: int) -> _Item: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[_Item]: ...
    def __getitem__(self, index: int | slice) -> _Item | Sequence[_Item]:
        if self._flat is None:
            self._flat = list(self)
        return self._flat[index]


class GroupedDeletes(_Grouped[tuple[str, Key]]):
    """Deletions ``(container, key)``, held as lists of keys by container."""

    __slots__ = ()

    def __iter__(self) -> Iterator[tuple[str, Key]]:
        for container, keys in self.groups.items():
            for key in keys:
                yield container, key


class GroupedAdds(_Grouped[tuple[str, Key, Key]]):
    """Additions ``(container, key, value)``, held as ``(key, value)`` lists by
    container."""

    __slots__ = ()

    def __iter__(self) -> Iterator[tuple[str, Key, Key]]:
        for container, pairs in self.groups.items():
            for key, value in pairs:
                yield container, key, value


@dataclass(frozen=True, slots=True)
class ElementBatch:
    """Element changes for one table, committed as one transaction.

    ``types`` gives each container's key types and value types (empty for a set);
    deletions are applied before additions. Parts are text as nft writes them. Given as
    :class:`GroupedDeletes` and :class:`GroupedAdds`, the changes reach the encoder in
    their lists by container; as plain sequences, the encoder groups them by container
    (in the order the containers first appear) itself: the same messages either way.
    ``comments`` names the comment of an added element (``(container, key)`` -> text), for
    the few containers whose elements carry one (the frontends' Service names).
    """

    family: Family
    table: str
    types: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]
    deletes: Sequence[tuple[str, Key]] = ()
    adds: Sequence[tuple[str, Key, Key]] = ()
    comments: Mapping[tuple[str, Key], str] | None = None

    def __len__(self) -> int:
        return len(self.deletes) + len(self.adds)

    def commands(self) -> list[str]:
        """The same changes as nft commands (for fakes, dry runs and error messages)."""
        prefix = f"{self.family} {self.table}"
        lines = [f"delete element {prefix} {c} {{ {' . '.join(k)} }}" for c, k in self.deletes]
        comments = self.comments or {}
        for container, key, value in self.adds:
            text = " . ".join(key)
            comment = comments.get((container, key)) if comments else None
            if comment is not None:
                text += f' comment "{comment}"'
            if value:
                text += " : " + " . ".join(value)
            lines.append(f"add element {prefix} {container} {{ {text} }}")
        return lines


@dataclass(frozen=True, slots=True)
class _Message:
    """One element message of a batch, and where each of its elements starts in it (byte
    offsets from the message's netlink header, as the kernel's extended ack reports)."""

    verb: str
    container: str
    keys: Sequence[Key]
    offsets: Sequence[int]

    def element_at(self, offset: int) -> Key | None:
        """The key of the element whose attribute holds ``offset``."""
        index = bisect.bisect_right(self.offsets, offset) - 1
        return self.keys[index] if 0 <= index < len(self.keys) else None

    def refusal(self, code: int, offset: int | None, message: str) -> NftError:
        """The error for a refusal of this message, naming the element refused."""
        reason = os.strerror(code) + (f" ({message})" if message else "")
        bad = self.element_at(offset) if offset is not None else None
        if bad is not None:
            shown = " . ".join(bad)
        else:
            keys = self.keys
            shown = "one of " + ", ".join(" . ".join(keys[i]) for i in range(min(3, len(keys))))
            shown += f" and {len(keys) - 3} more" if len(keys) > 3 else ""
        return NftError(f"{self.verb} element {self.container} {{ {shown} }}: {reason}", code)


class ElementWriter:
    """Sends :class:`ElementBatch` es over a netlink socket (in ``netns``): its own, or
    ``channel``, a :class:`~.batchsocket.BatchSocket` it shares (the owned table's).

    One batch is one nf_tables transaction: all of it commits, or none of it (the kernel
    aborts a batch with any refused message). Thread-safe. How the answers are read is
    the socket's part (:mod:`.batchsocket`). :meth:`send` commits a batch before it
    returns; :meth:`post` hands it to the socket's writer thread (a full sync's batches:
    the kernel commits one while the next is encoded), :meth:`settle` waits for them.
    """

    def __init__(
        self, netns: str | None = None, *, timeout: float = 5.0, channel: BatchSocket | None = None
    ) -> None:
        self._own_channel = channel is None
        self.channel = channel if channel is not None else BatchSocket(netns, timeout=timeout)

    @property
    def replaced(self) -> int:
        """How many times the socket was replaced after a failure whose outcome was
        unknown (for tests and logs)."""
        return self.channel.replaced

    def close(self) -> None:
        """Close the socket (unless it is shared)."""
        if self._own_channel:
            self.channel.close()

    def send(self, batch: ElementBatch) -> None:
        """Commit ``batch``; raise :class:`NftError` (with the kernel's errno) if refused.

        Every failure is an :class:`NftError`: a refusal names the element the kernel
        refused and its reason; a failure whose outcome is unknown (a socket error, lost
        or missing answers) says so, with ``errno`` set to the cause.
        """
        if not len(batch):
            return
        frames = element_frames(batch)
        self.channel.send(_FAMILY_NUMBERS[batch.family], frames, "element transaction")

    def post(
        self, batch: ElementBatch, refused: Callable[[ElementBatch], None] | None = None
    ) -> None:
        """Encode ``batch`` here and hand it to the socket's writer thread
        (:meth:`.BatchSocket.post`), which commits it after the batches posted before;
        ``refused`` is called with it if the kernel refuses it. A failure surfaces as the
        :class:`NftError` :meth:`send` would raise, at the next post or at
        :meth:`settle`. An element that cannot be encoded raises here, at once (and
        ``refused`` is called with the batch as well)."""
        if not len(batch):
            return
        try:
            frames = element_frames(batch)
        except NftError:
            if refused is not None:
                refused(batch)
            raise
        encoded = self.channel.encode(
            _FAMILY_NUMBERS[batch.family],
            frames,
            "element transaction",
            refused=None if refused is None else lambda _err: refused(batch),
        )
        self.channel.post(encoded)

    def settle(self) -> None:
        """Wait until every posted batch is committed; raise the first failure."""
        self.channel.settle()

    def abandon(self) -> None:
        """Commit no more of the posted batches (see :meth:`.BatchSocket.abandon`)."""
        self.channel.abandon()

    def read(
        self,
        family: Family,
        table: str,
        container: str,
        types: tuple[tuple[str, ...], tuple[str, ...]],
    ) -> list[tuple[Key, Key]]:
        """Every element of a set or map as ``(key, value)`` text parts (value ``()`` for
        a set), by a netlink dump of that container alone.

        Why not libnftables: it builds its cache of the table first, about 11 ms per map
        in a table of 30k Services, where a dump of a small map takes well under one;
        reading every affinity map after a restart took 10 s of a 30k-Service cold sync.
        Raises :class:`NftError` (``ENOENT`` for a missing set) as a refusal would, and
        ``EINTR`` when every dump was disturbed (:func:`read_whole`).
        """
        validate_name("table", table)
        validate_name("set", container)
        if not supports(types[0]) or not supports(types[1]):
            raise NftError(f"no supported data types known for {container}", _errno.EINVAL)
        body = nlmsg.NFGEN.pack(_FAMILY_NUMBERS[family], 0, 0) + _container(table, container)

        def dump() -> list[tuple[Key, Key]] | None:
            with self.channel.lock:
                return self._read_once(body, container, types)

        return read_whole(dump, each_key_once(operator.itemgetter(0)), f"listing {container}")

    def _read_once(
        self, body: bytes, container: str, types: tuple[tuple[str, ...], tuple[str, ...]]
    ) -> list[tuple[Key, Key]] | None:
        """One dump; None when a commit interrupted it (:meth:`.BatchSocket.request`:
        what it returned may miss elements)."""
        channel = self.channel
        seq = channel.next_seq()
        message_type = nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_NFTABLES, _NFT_MSG_GETSETELEM)
        request = nlmsg.message(message_type, nlmsg.NLM_F_REQUEST | nlmsg.NLM_F_DUMP, seq, body)
        answers, interrupted = channel.request(
            request, seq, f"listing {container}", dump=True, bufsize=1 << 20
        )
        if interrupted:
            return None
        out: list[tuple[Key, Key]] = []
        for kind, payload in answers:
            if kind & 0xFF == _NFT_MSG_NEWSETELEM:
                data = payload[nlmsg.NFGEN.size :]
                out.extend(_elements(data, 0, len(data), types))
        return out


_Read = TypeVar("_Read")


def read_whole(
    dump: Callable[[], list[_Read] | None],
    once: Callable[[list[_Read]], bool] | None,
    what: str,
) -> list[_Read]:
    """What ``dump`` (one dump; None when a commit interrupted it:
    :meth:`.BatchSocket.request`) gives, asked again until it is whole: not interrupted
    and, for the elements of a hash set or map, each given ``once`` (:func:`each_once`,
    :func:`each_key_once`; None: a dump of rules, sets or ranges, which the kernel walks
    in a stable order).

    Why a repeat means asking again: a set of ours is a hash table that the kernel
    resizes, in a worker, after the insertions that filled it (or the deletions that
    emptied it). A dump that does not fit one netlink message walks the table afresh
    for each message and skips as many elements as it already sent; it also starts its
    walk over when the table is replaced under it, still counting. A resize between
    or during the messages therefore repeats elements, and may leave out as many, and
    no commit happened, so nothing else says so. Seen in the kernel test of the
    pipeline: 6 dumps in 150 of a set of 800 just-added addresses repeated some (504
    repeats, none missed). A set holds a key once, so a repeat means the dump was
    disturbed; and with no element removed between two messages the last message's walk
    goes on to the table's end, so a dump gives at least as many elements as the set
    holds: one left out means another was repeated. Removals are what is not caught
    this way: a commit's (:func:`.batchsocket.one_generation` catches those) and the
    kernel's collector's, removing expired elements of a map with timeouts (the affinity maps)
    between two messages: every later message skips as many live elements, unseen.
    Raises :class:`NftError` (``EINTR``) after :data:`_DUMP_ATTEMPTS` disturbed dumps."""
    for attempt in range(_DUMP_ATTEMPTS):
        if attempt:
            time.sleep(_DUMP_PAUSE * attempt)
        found = dump()
        if found is not None and (once is None or once(found)):
            return found
    raise NftError(f"{what}: interrupted by other changes", _errno.EINTR)


def each_once(items: Sequence[Hashable]) -> bool:
    """Whether no item repeats (for items that are their own keys, as a dumped
    element's bytes are when it carries no expiration: a C-speed check)."""
    return len(set(items)) == len(items)


def each_key_once(key: Callable[[_Read], Hashable]) -> Callable[[Sequence[_Read]], bool]:
    """A check that no two items have one ``key``."""
    return lambda items: len({key(item) for item in items}) == len(items)


def element_frames(batch: ElementBatch) -> list[Frame]:
    """The messages of ``batch``, for a batch of the caller's (raises :class:`NftError`
    for an element that is not of its container's types)."""
    validate_name("table", batch.table)
    frames: list[Frame] = []
    deletes = batch.deletes
    if isinstance(deletes, GroupedDeletes):
        by_container: Mapping[str, Sequence[tuple[Key, Key]]] = {
            c: [(k, ()) for k in keys] for c, keys in deletes.groups.items()
        }
    else:
        grouped: dict[str, list[tuple[Key, Key]]] = {}
        for container, key in deletes:
            grouped.setdefault(container, []).append((key, ()))
        by_container = grouped
    for container, pairs in by_container.items():
        frames.extend(_encode(batch, "delete", container, pairs))
    adds = batch.adds
    if isinstance(adds, GroupedAdds):
        by_container = adds.groups
    else:
        grouped = {}
        for container, key, value in adds:
            grouped.setdefault(container, []).append((key, value))
        by_container = grouped
    named = {c for c, _key in batch.comments} if batch.comments else set()
    for container, pairs in by_container.items():
        # Only the containers whose elements carry comments take the second pass
        # (and the room a comment needs when messages are cut).
        comments = batch.comments if container in named else None
        frames.extend(_encode(batch, "add", container, pairs, comments))
    return frames


class _Keys(Sequence[Key]):
    """The keys of a message's ``(key, value)`` pairs, read only when a refusal names
    one (no tuple of keys built per message)."""

    __slots__ = ("_pairs",)

    def __init__(self, pairs: Sequence[tuple[Key, Key]]) -> None:
        self._pairs = pairs

    def __len__(self) -> int:
        return len(self._pairs)

    @overload
    def __getitem__(self, index: int) -> Key: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Key]: ...
    def __getitem__(self, index: int | slice) -> Key | Sequence[Key]:
        if isinstance(index, slice):
            return [pair[0] for pair in self._pairs[index]]
        return self._pairs[index][0]


def _encode(
    batch: ElementBatch,
    verb: str,
    container: str,
    pairs: Sequence[tuple[Key, Key]],
    comments: Mapping[tuple[str, Key], str] | None = None,
) -> list[Frame]:
    validate_name("set", container)
    types = batch.types.get(container)
    if types is None or not supports(types[0]) or not supports(types[1]):
        raise NftError(f"no supported data types known for {container}", _errno.EINVAL)
    codec = _codec(*types)
    deleting = verb == "delete"
    kind = _NFT_MSG_DELSETELEM if deleting else _NFT_MSG_NEWSETELEM
    flags = 0 if deleting else nlmsg.NLM_F_CREATE
    head = _container(batch.table, container)
    # One attribute holds at most 64 KiB: elements are split into messages below that.
    size = codec.size + (_COMMENT_ROOM if comments else 0)
    per_message = max(1, nlmsg.MESSAGE_BYTES // size)
    frames: list[Frame] = []
    first = nlmsg.HEADER.size + nlmsg.NFGEN.size + len(head) + nlmsg.ATTR.size
    encoded = isinstance(pairs, EncodedPairs) and pairs.types == types
    for start in range(0, len(pairs), per_message):
        chunk = pairs[start : start + per_message]
        if encoded and isinstance(chunk, EncodedPairs):
            elements = chunk.elements  # packed when queued (slot_elements, pair_elements)
        else:
            try:
                elements = codec.many(chunk, deleting)
            except ValueError as err:
                bad = next(k for k, v in chunk if not codec.valid(k, v))
                raise NftError(
                    f"element {' . '.join(bad)} of {container}: {err}", _errno.EINVAL
                ) from None
        offsets: Sequence[int]
        if comments:
            elements = _commented(elements, chunk, container, comments)
            positions = []
            position = first
            for element in elements:
                positions.append(position)
                position += len(element)
            offsets = positions
        else:
            # Elements of one size (all of them, but for a map addition without a value):
            # their offsets are a range, not a list built per element.
            step = len(elements[0]) if elements else codec.size
            if sum(map(len, elements)) == step * len(elements):
                offsets = range(first, first + step * len(elements), step)
            else:
                offsets = list(itertools.accumulate(map(len, elements[:-1]), initial=first))
        body = head + nlmsg.nested(_NFTA_SET_ELEM_LIST_ELEMENTS, *elements)
        frames.append(Frame(kind, flags, body, _Message(verb, container, _Keys(chunk), offsets)))
    return frames


def _commented(
    elements: list[bytes],
    chunk: Sequence[tuple[Key, Key]],
    container: str,
    comments: Mapping[tuple[str, Key], str],
) -> list[bytes]:
    """``elements`` with the comments ``comments`` name for them (a separate pass: the
    containers without comments keep the encoder's one list comprehension)."""
    out = []
    for element, (key, _value) in zip(elements, chunk, strict=True):
        comment = comments.get((container, key))
        if comment is not None:
            try:
                element = with_comment(element, comment)
            except ValueError as err:
                raise NftError(
                    f"element {' . '.join(key)} of {container}: {err}", _errno.EINVAL
                ) from None
        out.append(element)
    return out


def _elements(
    data: bytes, start: int, end: int, types: tuple[tuple[str, ...], tuple[str, ...]]
) -> Iterator[tuple[Key, Key]]:
    """The ``(key, value)`` of every element in one NEWSETELEM message's attributes."""
    for kind, payload in nlmsg.attribute_values(data, start, end):
        if kind != _NFTA_SET_ELEM_LIST_ELEMENTS:
            continue
        for item_kind, item in nlmsg.attribute_values(payload):
            if item_kind != _NFTA_LIST_ELEM:
                continue
            key: Key = ()
            value: Key = ()
            for part_kind, part in nlmsg.attribute_values(item):
                if part_kind in (_NFTA_SET_ELEM_KEY, _NFTA_SET_ELEM_DATA):
                    raw = next((v for k, v in nlmsg.attribute_values(part) if k == 1), b"")
                    if part_kind == _NFTA_SET_ELEM_KEY:
                        key = decode_parts(types[0], raw)
                    else:
                        value = decode_parts(types[1], raw)
            if key:
                yield key, value


def _container(table: str, container: str) -> bytes:
    """The start of a message about one set's elements, after ``nfgenmsg``: table, set."""
    return nlmsg.attr(_NFTA_SET_ELEM_LIST_TABLE, nlmsg.string(table)) + nlmsg.attr(
        _NFTA_SET_ELEM_LIST_SET, nlmsg.string(container)
    )
