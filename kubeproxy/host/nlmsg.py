"""Netlink on the wire: the one codec every hand-written netlink client here shares.

Message headers (``nlmsghdr``), attributes (``nlattr``, nested too), acknowledgements and
errors (extended acks: the kernel's message and the offset of the refused attribute),
nfnetlink batches and the dump loop. The clients built on it say next to their code why
they talk netlink by hand rather than through pyroute2 or libnftables (measured costs):
host addresses (:mod:`kubeproxy.host.netlink`), conntrack (:mod:`kubeproxy.conntrack`),
nf_tables events (:mod:`kubeproxy.nftevents`), nf_tables elements and rule counters
(``kubeproxy.backends.nftables.elements``, ``.rulecounters``).

Malformed input is judged the same way everywhere: a message shorter than its header or
running past the end of what was received ends the walk (:class:`MalformedMessage`), and
an attribute shorter than its header or running past its parent ends that attribute list.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from typing import Final

__all__ = [
    "ATTR",
    "ERRNO",
    "HEADER",
    "MESSAGE_BYTES",
    "NFGEN",
    "Dump",
    "MalformedMessage",
    "NetlinkError",
    "align",
    "attr",
    "attribute_values",
    "attributes",
    "dump",
    "error_code",
    "extended_ack",
    "message",
    "messages",
    "nested",
    "nfnl_batch",
    "nfnl_control",
    "nfnl_type",
    "string",
]

# linux/netlink.h
NETLINK_ROUTE: Final = 0
NETLINK_NETFILTER: Final = 12
NLMSG_ERROR: Final = 2
NLMSG_DONE: Final = 3
NLM_F_REQUEST: Final = 0x1
NLM_F_MULTI: Final = 0x2
NLM_F_ACK: Final = 0x4
NLM_F_DUMP_INTR: Final = 0x10
NLM_F_CAPPED: Final = 0x100
NLM_F_ACK_TLVS: Final = 0x200
NLM_F_DUMP: Final = 0x300
NLM_F_CREATE: Final = 0x400
NLA_F_NESTED: Final = 0x8000
NLA_TYPE_MASK: Final = 0x3FFF
"""An attribute's type without ``NLA_F_NESTED`` and ``NLA_F_NET_BYTEORDER``."""
NLMSGERR_ATTR_MSG: Final = 1
NLMSGERR_ATTR_OFFS: Final = 2
SOL_NETLINK: Final = 270
NETLINK_ADD_MEMBERSHIP: Final = 1
NETLINK_CAP_ACK: Final = 10
NETLINK_EXT_ACK: Final = 11
# linux/netfilter/nfnetlink.h
NFNL_SUBSYS_CTNETLINK: Final = 1
NFNL_SUBSYS_NFTABLES: Final = 10
NFNL_MSG_BATCH_BEGIN: Final = 0x10
NFNL_MSG_BATCH_END: Final = 0x11

HEADER: Final = struct.Struct("=IHHII")
"""``nlmsghdr``: length, type, flags, sequence number, port id."""
ATTR: Final = struct.Struct("=HH")
"""``nlattr``: length, type."""
NFGEN: Final = struct.Struct("=BBH")
"""``nfgenmsg``: family, version, resource id (big-endian)."""
ERRNO: Final = struct.Struct("=i")
"""The (negative) errno opening an ``NLMSG_ERROR`` message's payload."""
MESSAGE_BYTES: Final = 48 * 1024
"""What one message's attributes should stay below: an attribute holds at most 64 KiB, so
a list of many (elements, deletions) is split into messages of this size."""


class MalformedMessage(ValueError):
    """A message shorter than its header, or longer than what was received."""


class NetlinkError(OSError):
    """The kernel refused a request: ``errno`` is its error, ``strerror`` says what failed."""


def align(length: int) -> int:
    """``length`` rounded up to netlink's 4-byte alignment."""
    return (length + 3) & ~3


def message(kind: int, flags: int, seq: int, payload: bytes = b"") -> bytes:
    """One message: its header (port id 0: the kernel's) and ``payload``."""
    return HEADER.pack(HEADER.size + len(payload), kind, flags, seq, 0) + payload


def attr(kind: int, payload: bytes) -> bytes:
    """One attribute, padded to 4 bytes."""
    length = ATTR.size + len(payload)
    return ATTR.pack(length, kind) + payload + b"\0" * (-length % 4)


def nested(kind: int, *children: bytes) -> bytes:
    """An attribute holding the (already encoded) attributes ``children``."""
    return attr(kind | NLA_F_NESTED, b"".join(children))


def string(text: str) -> bytes:
    """A NUL-terminated string attribute's payload."""
    return text.encode() + b"\0"


def nfnl_type(subsystem: int, kind: int) -> int:
    """The message type of an nfnetlink subsystem's message ``kind``."""
    return (subsystem << 8) | kind


def nfnl_control(kind: int, seq: int, subsystem: int = NFNL_SUBSYS_NFTABLES) -> bytes:
    """A batch begin or end message (its resource id names the subsystem)."""
    payload = NFGEN.pack(socket.AF_UNSPEC, 0, socket.htons(subsystem))
    return message(kind, NLM_F_REQUEST, seq, payload)


def nfnl_batch(begin: int, parts: list[bytes], end: int) -> bytes:
    """``parts`` (encoded messages) between a batch begin (``begin``: its sequence number)
    and end: one nf_tables transaction."""
    return b"".join(
        [nfnl_control(NFNL_MSG_BATCH_BEGIN, begin), *parts, nfnl_control(NFNL_MSG_BATCH_END, end)]
    )


def messages(
    data: bytes | bytearray | memoryview, end: int | None = None
) -> Iterator[tuple[int, int, int, int, int, int]]:
    """(offset, length, type, flags, seq, port id) of each message in ``data[:end]``.

    Raises :class:`MalformedMessage` at a message shorter than its header or running
    past ``end`` (each caller says what that means for it)."""
    end = len(data) if end is None else end
    offset = 0
    unpack = HEADER.unpack_from
    while offset + 16 <= end:
        length, kind, flags, seq, portid = unpack(data, offset)
        if length < 16 or offset + length > end:
            raise MalformedMessage(f"netlink message of {length} bytes at {offset} of {end}")
        yield offset, length, kind, flags, seq, portid
        offset += (length + 3) & ~3


def attributes(
    data: bytes | bytearray | memoryview, start: int, end: int
) -> Iterator[tuple[int, int, int]]:
    """(type without flags, value start, value end) of each attribute in ``data[start:end]``."""
    offset = start
    unpack = ATTR.unpack_from
    while offset + 4 <= end:
        length, kind = unpack(data, offset)
        if length < 4 or offset + length > end:
            return
        yield kind & NLA_TYPE_MASK, offset + 4, offset + length
        offset += (length + 3) & ~3


def attribute_values(
    data: bytes, start: int = 0, end: int | None = None
) -> Iterator[tuple[int, bytes]]:
    """(type without flags, value) of each attribute in ``data[start:end]``."""
    for kind, first, last in attributes(data, start, len(data) if end is None else end):
        yield kind, data[first:last]


def error_code(data: bytes | bytearray | memoryview, offset: int) -> int:
    """The errno (positive; 0 for an acknowledgement) of the ``NLMSG_ERROR`` at ``offset``."""
    return -int(ERRNO.unpack_from(data, offset + HEADER.size)[0])


def extended_ack(data: bytes, offset: int, length: int, flags: int) -> tuple[int | None, str]:
    """The refused attribute's offset (in the refused message) and the kernel's message,
    from the ``NLMSG_ERROR`` at ``offset`` (``NETLINK_EXT_ACK``; None and ``""`` when the
    kernel said nothing more).

    The error is followed by the refused message: its header only with ``NLM_F_CAPPED``
    (``NETLINK_CAP_ACK``), else the whole of it; the attributes come after that.
    """
    where: int | None = None
    text = ""
    body = offset + HEADER.size
    if flags & NLM_F_ACK_TLVS and length >= HEADER.size + ERRNO.size + HEADER.size:
        (original,) = struct.unpack_from("=I", data, body + ERRNO.size)
        copied = HEADER.size if flags & NLM_F_CAPPED else original
        position = body + ERRNO.size + align(copied)
        for kind, value in attribute_values(data, position, offset + length):
            if kind == NLMSGERR_ATTR_OFFS and len(value) >= 4:
                (where,) = struct.unpack_from("=I", value)
            elif kind == NLMSGERR_ATTR_MSG:
                text = value.split(b"\0", 1)[0].decode(errors="replace")
    return where, text


class Dump:
    """Reads the answers to one dump request (sequence number ``seq``) on ``sock``.

    Iterating yields ``(type, flags, buffer, payload start, message end)`` of each answer
    until ``NLMSG_DONE``; the buffer is reused by the next read, so a caller copies what
    it keeps. Answers to other requests are skipped. A refusal (an ``NLMSG_ERROR``, or a
    ``NLMSG_DONE`` carrying an error) raises :class:`NetlinkError` with ``what`` in its
    message; an error acknowledgement of 0 ends the dump. :attr:`interrupted` tells
    whether the kernel marked any answer ``NLM_F_DUMP_INTR`` (a commit ran during the
    dump: what it returned may be inconsistent). Socket errors and
    :class:`MalformedMessage` propagate.
    """

    def __init__(self, sock: socket.socket, seq: int, what: str, bufsize: int = 1 << 16) -> None:
        self._sock = sock
        self._seq = seq
        self._what = what
        self._bufsize = bufsize
        self.interrupted = False

    def _refused(self, code: int) -> NetlinkError:
        return NetlinkError(code, f"{self._what}: {os.strerror(code)}")

    def __iter__(self) -> Iterator[tuple[int, int, memoryview, int, int]]:
        buffer = bytearray(self._bufsize)
        view = memoryview(buffer)
        while True:
            size = self._sock.recv_into(buffer)
            for offset, length, kind, flags, seq, _portid in messages(view, size):
                if seq != self._seq:
                    continue
                self.interrupted = self.interrupted or bool(flags & NLM_F_DUMP_INTR)
                if kind == NLMSG_DONE:
                    if length >= HEADER.size + ERRNO.size and (code := error_code(view, offset)):
                        raise self._refused(code)
                    return
                if kind == NLMSG_ERROR:
                    if code := error_code(view, offset):
                        raise self._refused(code)
                    return
                yield kind, flags, view, offset + HEADER.size, offset + length


def dump(sock: socket.socket, request: bytes, seq: int, what: str) -> Iterator[tuple[int, bytes]]:
    """Send a dump ``request`` (sequence number ``seq``) and yield each answer's type and
    payload (after the netlink header) until the dump is done (:class:`Dump`; a malformed
    answer ends it too). A refusal raises :class:`NetlinkError` (an ``OSError`` with the
    kernel's errno; ``what`` names the request in its message)."""
    sock.send(request)
    try:
        for kind, _flags, data, start, end in Dump(sock, seq, what):
            yield kind, bytes(data[start:end])
    except MalformedMessage:
        return
