"""Reading ``table <family> kube-proxy`` back from the kernel over netlink, for tools.

What ``kubeproxy explain``, ``verify`` and ``trace`` read: the table's sets and maps
(declarations), the elements of one container with their comments (a frontend's
Service name), verdicts (``goto CHAIN``) and expirations (affinity entries), and what the
rules of one chain refer to (sets looked up, chains jumped or gone to, sets updated and
their timeouts).

Why netlink and not libnftables: nft 1.0.6 fetches every element of the table before it
lists anything of it (``rulecounters.py``: 3.2 s at 300k elements), and its JSON listing
of a 100k-Service table takes seconds more to parse; asking the kernel for one set's
elements or one chain's rules costs what that object holds (``bench/explain.py`` measures
both at 100k Services). The socket is a :class:`~.batchsocket.BatchSocket` of its own,
read-only: nothing is ever written.
"""

from __future__ import annotations

import errno
import operator
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Final, TypeVar

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.backends.nftables.batchsocket import BatchSocket
from kubeproxy.backends.nftables.declarations import Declaration
from kubeproxy.backends.nftables.elements import (
    SUPPORTED_TYPES,
    decode_parts,
    each_key_once,
    each_once,
    element_encoder,
    read_whole,
)
from kubeproxy.backends.nftables.objects import Family, NftError, validate_name
from kubeproxy.backends.nftables.table import TABLE

__all__ = ["PROBE_BATCH", "VERDICTS", "Item", "RuleRefs", "TableReader", "verdict_of"]

Key = tuple[str, ...]

_Element = TypeVar("_Element")
"""What one dump of a set gives per element: an :class:`Item`, or its bytes."""
_FAMILY_NUMBERS: Final = {Family.IP: 2, Family.IP6: 10}
_NEWRULE, _GETRULE, _NEWSET, _GETSET, _NEWSETELEM, _GETSETELEM = 6, 7, 9, 10, 12, 13
_LIST_TABLE, _LIST_SET, _LIST_ELEMENTS = 1, 2, 3
_LIST_ELEM = 1
_ELEM_KEY, _ELEM_DATA, _ELEM_EXPIRATION, _ELEM_USERDATA = 1, 2, 5, 6
_DATA_VALUE, _DATA_VERDICT = 1, 2
_VERDICT_CODE, _VERDICT_CHAIN = 1, 2
_RULE_TABLE, _RULE_CHAIN, _RULE_HANDLE, _RULE_EXPRESSIONS = 1, 2, 3, 4
_EXPR_NAME, _EXPR_DATA = 1, 2
_IMMEDIATE_DATA = 2
_LOOKUP_SET = 1
_DYNSET_SET_NAME, _DYNSET_TIMEOUT = 1, 6
_NG_MODULUS = 2
_NG_OFFSET = 4
_UDATA_COMMENT = 0
PROBE_BATCH: Final = 1024
"""Keys asked for in one request by :meth:`TableReader.probe_blobs` (their answers,
some 5 KiB of receive buffer each, must all fit)."""
# Verdict codes (linux/netfilter/nf_tables.h, netfilter.h).
VERDICTS: Final = {
    0: "drop",
    1: "accept",
    -1: "continue",
    -2: "break",
    -3: "jump",
    -4: "goto",
    -5: "return",
}


@dataclass(frozen=True, slots=True)
class Item:
    """One element: its key and value as nft writes them (``()`` for a set element; a
    verdict map's value is ``("goto", CHAIN)``), its comment, and for an element with a
    timeout the milliseconds until it expires."""

    key: Key
    value: Key = ()
    comment: str | None = None
    expires_ms: int | None = None


@dataclass(frozen=True, slots=True)
class RuleRefs:
    """What one rule refers to: the sets it looks up, the chains it jumps or goes to
    (``("goto", CHAIN)``) and its other verdicts, the set it updates and the timeout
    it gives (seconds), the modulus of its ``numgen``, and its raw expressions."""

    lookups: tuple[str, ...] = ()
    verdicts: tuple[tuple[str, str], ...] = ()
    updates: str | None = None
    timeout_s: int | None = None
    modulus: int | None = None
    expressions: tuple[tuple[str, tuple[tuple[int, bytes], ...]], ...] = ()
    offsets: tuple[int, ...] = ()
    """The offsets of its ``numgen`` expressions, in order (a shared affinity map's pin
    numbers)."""
    """Every expression as the kernel holds it: its name and attributes (what ``trace``
    evaluates a rule's matches from)."""
    handle: int | None = None
    """The kernel's handle of the rule (what ``trace --live``'s events name a rule by)."""

    @property
    def target(self) -> str | None:
        """The chain this rule jumps or goes to, if any."""
        return next((chain for verb, chain in self.verdicts if chain), None)


class TableReader:
    """Reads one table (``kube-proxy`` unless told) over a socket of its own in
    ``netns`` (None: this one). Raises :class:`NftError` (``ENOENT``: no such table, set
    or chain)."""

    def __init__(self, netns: str | None = None, *, table: str = TABLE, timeout: float = 5.0):
        validate_name("table", table)
        self.table = table
        self.channel = BatchSocket(netns, timeout=timeout)

    def close(self) -> None:
        """Close the socket."""
        self.channel.close()

    def __enter__(self) -> TableReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _dump(self, family: Family, kind: int, body: bytes, what: str) -> list[bytes]:
        """The payloads (after ``nfgenmsg``) of a dump, asked again when a commit
        interrupted it."""
        return read_whole(lambda: self._dump_once(family, kind, body, what), None, what)

    def _dump_once(self, family: Family, kind: int, body: bytes, what: str) -> list[bytes] | None:
        """The payloads of one dump; None when a commit interrupted it
        (:meth:`.BatchSocket.request`)."""
        seq = self.channel.next_seq()
        request = nlmsg.message(
            nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_NFTABLES, kind),
            nlmsg.NLM_F_REQUEST | nlmsg.NLM_F_DUMP,
            seq,
            nlmsg.NFGEN.pack(_FAMILY_NUMBERS[family], 0, 0) + body,
        )
        with self.channel.lock:
            answers, interrupted = self.channel.request(
                request, seq, what, dump=True, bufsize=1 << 20
            )
        if interrupted:
            return None
        return [payload[nlmsg.NFGEN.size :] for _kind, payload in answers]

    def exists(self, family: Family) -> bool:
        """Whether the table exists in ``family``."""
        try:
            self.sets(family)
        except NftError as err:
            if err.errno == errno.ENOENT:
                return False
            raise
        return True

    def sets(self, family: Family) -> dict[str, Declaration]:
        """Every named set and map of the table, by name."""
        body = nlmsg.attr(_LIST_TABLE, nlmsg.string(self.table))
        found: dict[str, Declaration] = {}
        for payload in self._dump(family, _GETSET, body, f"sets of {family} {self.table}"):
            try:
                declaration = Declaration.from_kernel(payload)
            except NftError:
                continue  # a type we never write: not ours to explain
            if not declaration.name.startswith("__"):
                found[declaration.name] = declaration
        return found

    def elements(
        self, family: Family, name: str, declaration: Declaration, containing: str | None = None
    ) -> list[Item]:
        """Every element of set or map ``name`` (an interval set's ranges are left out:
        they list as their start only); with ``containing``, only those whose comment
        contains that text.

        ``containing`` is what makes finding a Service by name cheap: the kernel still
        sends every element, but an answer message (a few hundred elements) whose bytes
        do not contain the text is skipped without being decoded (one C-speed ``in``),
        and decoding was almost all of a 100k-element dump's time (README "Reading the
        table back" has the figures, ``bench/explain.py`` measures both ways)."""
        validate_name("set", name)
        key_types = tuple(f.datatype.name for f in declaration.key)
        value_types = tuple(f.datatype.name for f in declaration.value or ())
        if not set(key_types + value_types) <= SUPPORTED_TYPES:
            raise NftError(f"set {name}: data types not read here", errno.EINVAL)
        needle = containing.encode() if containing is not None else None

        def decode(payload: bytes) -> list[Item]:
            if needle is not None and needle not in payload:
                return []
            items: list[Item] = []
            for kind, value in nlmsg.attribute_values(payload):
                if kind == _LIST_ELEMENTS:
                    items.extend(_items(value, key_types, value_types))
            return items

        once = None if declaration.interval else each_key_once(operator.attrgetter("key"))
        items = self._element_dump(family, name, decode, once)
        if containing is not None:
            items = [i for i in items if i.comment is not None and containing in i.comment]
        return items

    def element_blobs(self, family: Family, name: str, declaration: Declaration) -> list[bytes]:
        """Every element of set or map ``name`` as the dump carries it, undecoded: each
        its ``NFTA_LIST_ELEM`` attribute's bytes (what
        :func:`~.elements.element_encoder` with ``dumped`` encodes).

        Why bytes: ``kubeproxy verify`` compares the big containers (a million endpoint
        slots at 100k Services) as sets, and decoding each element in Python was most of
        a dump's time; the elements that differ are decoded afterwards
        (:meth:`decode_blobs`). A message whose elements all have one length (every
        container without comments) is cut by slicing."""
        validate_name("set", name)

        def decode(payload: bytes) -> list[bytes]:
            blobs: list[bytes] = []
            for kind, start, end in nlmsg.attributes(payload, 0, len(payload)):
                if kind == _LIST_ELEMENTS:
                    blobs.extend(_blobs(payload, start, end))
            return blobs

        # A range's end is an element of its own, keyed as the next range's start: the
        # kernel walks ranges in order (no resize), so they are not checked. A dumped
        # element's bytes differ between two dumps only by its expiration.
        once: Callable[[list[bytes]], bool] | None = each_once
        if declaration.interval:
            once = None
        elif declaration.timeout is not None or "timeout" in declaration.flags:
            once = each_key_once(_blob_key)
        return self._element_dump(family, name, decode, once)

    def _element_dump(
        self,
        family: Family,
        name: str,
        decode: Callable[[bytes], list[_Element]],
        once: Callable[[list[_Element]], bool] | None,
    ) -> list[_Element]:
        """What ``decode`` makes of each answer of a dump of set ``name``'s elements,
        the dump asked again until it is whole (:func:`~.elements.read_whole`)."""
        body = nlmsg.attr(_LIST_TABLE, nlmsg.string(self.table))
        body += nlmsg.attr(_LIST_SET, nlmsg.string(name))
        what = f"listing {name}"

        def dump() -> list[_Element] | None:
            payloads = self._dump_once(family, _GETSETELEM, body, what)
            if payloads is None:
                return None
            return [element for payload in payloads for element in decode(payload)]

        return read_whole(dump, once, what)

    def probe_blobs(
        self, family: Family, name: str, declaration: Declaration, elements: Sequence[bytes]
    ) -> list[bytes]:
        """The elements of set or map ``name`` with the keys of ``elements`` (each an
        ``NFTA_LIST_ELEM`` holding a key, as :meth:`element_blobs` gives them: a get
        reads only the key) that it holds, as :meth:`element_blobs` gives them:
        single-element gets, up to :data:`PROBE_BATCH` in one request (the kernel
        answers each in a message of its own, and stops at the first key it lacks: the
        request goes on after it).

        Why not a dump for a big container: the kernel walks a hash set from its start
        again for every answer buffer of a dump (32 KiB, some 700 elements), so a dump
        costs the square of the set's size: 1M endpoint slots took 49 s, a 100k set
        0.4 s. Asking for the keys costs what they are. What the container holds
        beyond them is not seen."""
        validate_name("set", name)
        head = nlmsg.NFGEN.pack(_FAMILY_NUMBERS[family], 0, 0)
        head += nlmsg.attr(_LIST_TABLE, nlmsg.string(self.table))
        head += nlmsg.attr(_LIST_SET, nlmsg.string(name))
        message_type = nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_NFTABLES, _GETSETELEM)
        flags = nlmsg.NLM_F_REQUEST | nlmsg.NLM_F_ACK
        answer_head = head[nlmsg.NFGEN.size :]
        # Where the element starts in an answer: after nlmsghdr, nfgenmsg, table, set
        # and the element list's header.
        skip = nlmsg.HEADER.size + nlmsg.NFGEN.size + len(answer_head) + nlmsg.ATTR.size
        out: list[bytes] = []
        start = 0
        while start < len(elements):
            chunk: list[bytes] = []
            size = 0
            for element in elements[start : start + PROBE_BATCH]:
                size += len(element)
                if chunk and size > nlmsg.MESSAGE_BYTES:
                    break  # an attribute holds at most 64 KiB
                chunk.append(element)
            body = head + nlmsg.nested(_LIST_ELEMENTS, *chunk)
            seq = self.channel.next_seq()
            with self.channel.lock:
                answers, code = self.channel.ask(
                    nlmsg.message(message_type, flags, seq, body),
                    seq,
                    f"elements of {name}",
                    len(chunk),
                )
            # Every answer is this set's head, then the one element in its list: cut
            # there (one comprehension: a million answers at 100k Services).
            first = nlmsg.HEADER.size + nlmsg.NFGEN.size
            cut = [a[skip:] for a in answers if a.startswith(answer_head, first)]
            out.extend(cut)
            if len(cut) < len(answers):  # another layout (not seen from our kernels)
                for answer in answers:
                    if not answer.startswith(answer_head, first):
                        for kind, begin, end in nlmsg.attributes(answer, first, len(answer)):
                            if kind == _LIST_ELEMENTS:
                                out.extend(_blobs(answer, begin, end))
            if code not in (0, errno.ENOENT):
                raise NftError(f"elements of {name}: {os.strerror(code)}", code)
            # Stopped at a key it lacks (ENOENT), or done: go on after what was answered.
            start += len(answers) + (1 if code else 0)
        return out

    @staticmethod
    def decode_blobs(declaration: Declaration, blobs: list[bytes]) -> list[Item]:
        """The elements ``blobs`` (from :meth:`element_blobs`) hold, decoded."""
        key_types = tuple(f.datatype.name for f in declaration.key)
        value_types = tuple(f.datatype.name for f in declaration.value or ())
        return _items(b"".join(blobs), key_types, value_types)

    def get(self, family: Family, name: str, declaration: Declaration, key: Key) -> Item | None:
        """The element ``key`` of set or map ``name`` (None when it holds none): one
        question to the kernel, whatever the set holds (``nft get element``)."""
        validate_name("set", name)
        key_types = tuple(f.datatype.name for f in declaration.key)
        value_types = tuple(f.datatype.name for f in declaration.value or ())
        if not set(key_types + value_types) <= SUPPORTED_TYPES:
            raise NftError(f"set {name}: data types not read here", errno.EINVAL)
        try:
            element = element_encoder(key_types, ())(key, ())
        except ValueError as err:
            raise NftError(f"element {' . '.join(key)} of {name}: {err}", errno.EINVAL) from None
        seq = self.channel.next_seq()
        body = nlmsg.NFGEN.pack(_FAMILY_NUMBERS[family], 0, 0)
        body += nlmsg.attr(_LIST_TABLE, nlmsg.string(self.table))
        body += nlmsg.attr(_LIST_SET, nlmsg.string(name))
        body += nlmsg.nested(_LIST_ELEMENTS, element)
        request = nlmsg.message(
            nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_NFTABLES, _GETSETELEM), nlmsg.NLM_F_REQUEST, seq, body
        )
        try:
            with self.channel.lock:
                answers, _interrupted = self.channel.request(request, seq, f"element of {name}")
        except NftError as err:
            if err.errno == errno.ENOENT:
                return None
            raise
        for _kind, payload in answers:
            for kind, value in nlmsg.attribute_values(payload[nlmsg.NFGEN.size :]):
                if kind == _LIST_ELEMENTS:
                    found = _items(value, key_types, value_types)
                    if found:
                        return found[0]
        return None

    def rules(self, family: Family, chain: str) -> list[RuleRefs]:
        """What each rule of ``chain`` refers to, in order."""
        validate_name("chain", chain)
        body = nlmsg.attr(_RULE_TABLE, nlmsg.string(self.table))
        body += nlmsg.attr(_RULE_CHAIN, nlmsg.string(chain))
        out = []
        for payload in self._dump(family, _GETRULE, body, f"rules of {chain}"):
            handle = None
            for kind, value in nlmsg.attribute_values(payload):
                if kind == _RULE_HANDLE and len(value) == 8:
                    handle = struct.unpack(">Q", value)[0]
                elif kind == _RULE_EXPRESSIONS:
                    out.append(replace(_rule_refs(value), handle=handle))
        return out


def _items(data: bytes, key_types: Key, value_types: Key) -> list[Item]:
    items = []
    for kind, element in nlmsg.attribute_values(data):
        if kind != _LIST_ELEM:
            continue
        key: Key = ()
        value: Key = ()
        comment = None
        expires = None
        for part, raw in nlmsg.attribute_values(element):
            if part == _ELEM_KEY:
                key = decode_parts(key_types, _nested(raw, _DATA_VALUE))
            elif part == _ELEM_DATA:
                verdict = _nested(raw, _DATA_VERDICT)
                if verdict:
                    value = verdict_of(verdict)
                else:
                    value = decode_parts(value_types, _nested(raw, _DATA_VALUE))
            elif part == _ELEM_EXPIRATION:
                expires = struct.unpack(">Q", raw[:8])[0]
            elif part == _ELEM_USERDATA:
                comment = _comment(raw)
        if key:
            items.append(Item(key, value, comment, expires))
    return items


def _blobs(payload: bytes, start: int, end: int) -> list[bytes]:
    """The ``NFTA_LIST_ELEM`` attributes in ``payload[start:end]``, each whole."""
    if end - start < 4:
        return []
    length = int.from_bytes(payload[start : start + 2], "little")
    step = nlmsg.align(length)
    if length >= 4 and (end - start) % step == 0:
        head = payload[start : start + 4]
        if all(payload[i : i + 4] == head for i in range(start, end, step)):
            return [payload[i : i + length] for i in range(start, end, step)]
    out = []
    for _kind, first, last in nlmsg.attributes(payload, start, end):
        out.append(payload[first - 4 : last])
    return out


def _blob_key(blob: bytes) -> bytes:
    """The key attribute of an element as :func:`_blobs` cuts it: the kernel dumps an
    element's key first (so two dumps of one element with different expirations share
    it)."""
    return blob[4 : 4 + int.from_bytes(blob[4:6], "little")]


def _nested(data: bytes, wanted: int) -> bytes:
    return next((v for k, v in nlmsg.attribute_values(data) if k == wanted), b"")


def verdict_of(data: bytes) -> Key:
    """A verdict's (verb, chain) from its ``NFTA_VERDICT_*`` attributes (chain ``""``
    when it names none)."""
    code = 0
    chain = ""
    for kind, raw in nlmsg.attribute_values(data):
        if kind == _VERDICT_CODE:
            code = struct.unpack(">i", raw[:4])[0]
        elif kind == _VERDICT_CHAIN:
            chain = raw.split(b"\0", 1)[0].decode(errors="replace")
    return (VERDICTS.get(code, str(code)), chain)


def _comment(userdata: bytes) -> str | None:
    """The comment in an element's user data (libnftnl's udata: type, length, text)."""
    offset = 0
    while offset + 2 <= len(userdata):
        kind, length = userdata[offset], userdata[offset + 1]
        if kind == _UDATA_COMMENT:
            return userdata[offset + 2 : offset + 2 + length].split(b"\0", 1)[0].decode()
        offset += 2 + length
    return None


def _rule_refs(expressions: bytes) -> RuleRefs:
    lookups: list[str] = []
    verdicts: list[tuple[str, str]] = []
    updates = None
    timeout = None
    modulus = None
    offsets: list[int] = []
    seen: list[tuple[str, tuple[tuple[int, bytes], ...]]] = []
    for kind, element in nlmsg.attribute_values(expressions):
        if kind != _LIST_ELEM:
            continue
        name = b""
        data = b""
        for part, raw in nlmsg.attribute_values(element):
            if part == _EXPR_NAME:
                name = raw.split(b"\0", 1)[0]
            elif part == _EXPR_DATA:
                data = raw
        fields = dict(nlmsg.attribute_values(data))
        seen.append((_text(name), tuple(fields.items())))
        if name == b"lookup" and _LOOKUP_SET in fields:
            lookups.append(_text(fields[_LOOKUP_SET]))
        elif name == b"immediate" and _IMMEDIATE_DATA in fields:
            verdict = _nested(fields[_IMMEDIATE_DATA], _DATA_VERDICT)
            if verdict:
                verb, chain = verdict_of(verdict)
                verdicts.append((verb, chain))
        elif name == b"dynset":
            updates = _text(fields.get(_DYNSET_SET_NAME, b""))
            if _DYNSET_TIMEOUT in fields:
                timeout = struct.unpack(">Q", fields[_DYNSET_TIMEOUT][:8])[0] // 1000
        elif name == b"numgen" and _NG_MODULUS in fields:
            modulus = struct.unpack(">I", fields[_NG_MODULUS][:4])[0]
            if _NG_OFFSET in fields:
                offsets.append(struct.unpack(">I", fields[_NG_OFFSET][:4])[0])
        elif name in (b"reject",):
            verdicts.append(("reject", ""))
    return RuleRefs(
        tuple(lookups), tuple(verdicts), updates, timeout, modulus, tuple(seen), tuple(offsets)
    )


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode(errors="replace")
