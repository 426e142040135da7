"""The ctnetlink messages the executor sends and reads: a filtered dump request for the
UDP flows of a family, a delete request by original tuple, and the flow in each answer
to the dump.

They are written and read by hand over the shared codec (:mod:`kubeproxy.host.nlmsg`): pyroute2
spends over 1 ms parsing each dumped entry (the measurements are in
:mod:`kubeproxy.conntrack.ctnetlink`), and a listing reads thousands. Reading one answer
tries the layout the kernel writes a UDP tuple in first (one ``struct`` unpack per
tuple, its attribute headers compared with those expected) and walks the attributes
only when that layout does not match.
"""

from __future__ import annotations

import socket
import struct
from typing import Final

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.conntrack.flows import Flow
from kubeproxy.objects import IPFamily

__all__ = ["RawFlow", "delete_request", "dump_flow", "dump_request"]

_NFNL_SUBSYS_CTNETLINK: Final = nlmsg.NFNL_SUBSYS_CTNETLINK
_NLA_F_NESTED: Final = nlmsg.NLA_F_NESTED
_CT_GET: Final = nlmsg.nfnl_type(_NFNL_SUBSYS_CTNETLINK, 1)  # IPCTNL_MSG_CT_GET
_CT_DELETE: Final = nlmsg.nfnl_type(_NFNL_SUBSYS_CTNETLINK, 2)  # IPCTNL_MSG_CT_DELETE
_CTA_TUPLE_ORIG: Final = 1
_CTA_TUPLE_REPLY: Final = 2
_CTA_FILTER: Final = 25
_CTA_FILTER_ORIG_FLAGS: Final = 1
_CTA_FILTER_F_PROTO_NUM: Final = 1 << 3
_CTA_TUPLE_IP: Final = 1
_CTA_TUPLE_PROTO: Final = 2
_CTA_IP_V4_SRC: Final = 1
_CTA_IP_V4_DST: Final = 2
_CTA_IP_V6_SRC: Final = 3
_CTA_IP_V6_DST: Final = 4
_CTA_PROTO_NUM: Final = 1
_CTA_PROTO_SRC_PORT: Final = 2
_CTA_PROTO_DST_PORT: Final = 3
_IPPROTO_UDP: Final = 17

_PORT = struct.Struct(">H")

RawFlow = tuple[bytes, int, bytes, int, bytes, int]
"""Original source, source port, destination, destination port; reply source, port
(addresses as the kernel's bytes: 4 for IPv4, 16 for IPv6)."""


# Requests


def dump_request(family: IPFamily, seq: int, *, filtered: bool) -> bytes:
    """The request to dump the conntrack table of ``family``; ``filtered`` asks the
    kernel (5.10+) for UDP flows only."""
    address_family = socket.AF_INET if family is IPFamily.IPV4 else socket.AF_INET6
    body = nlmsg.NFGEN.pack(address_family, 0, 0)
    if filtered:
        body += nlmsg.nested(
            _CTA_TUPLE_ORIG, nlmsg.nested(_CTA_TUPLE_PROTO, nlmsg.attr(_CTA_PROTO_NUM, b"\x11"))
        )
        body += nlmsg.nested(
            _CTA_FILTER,
            nlmsg.attr(_CTA_FILTER_ORIG_FLAGS, struct.pack("=I", _CTA_FILTER_F_PROTO_NUM)),
        )
    return nlmsg.message(_CT_GET, nlmsg.NLM_F_REQUEST | nlmsg.NLM_F_DUMP, seq, body)


def delete_request(flow: Flow, seq: int) -> bytes:
    """The request (acknowledged) to delete the UDP flow with ``flow``'s original tuple."""
    if flow.orig_src.version == 4:
        address_family, src_kind, dst_kind = socket.AF_INET, _CTA_IP_V4_SRC, _CTA_IP_V4_DST
    else:
        address_family, src_kind, dst_kind = socket.AF_INET6, _CTA_IP_V6_SRC, _CTA_IP_V6_DST
    body = nlmsg.NFGEN.pack(address_family, 0, 0) + nlmsg.nested(
        _CTA_TUPLE_ORIG,
        nlmsg.nested(
            _CTA_TUPLE_IP,
            nlmsg.attr(src_kind, flow.orig_src.packed),
            nlmsg.attr(dst_kind, flow.orig_dst.packed),
        ),
        nlmsg.nested(
            _CTA_TUPLE_PROTO,
            nlmsg.attr(_CTA_PROTO_NUM, b"\x11"),
            nlmsg.attr(_CTA_PROTO_SRC_PORT, _PORT.pack(flow.orig_src_port)),
            nlmsg.attr(_CTA_PROTO_DST_PORT, _PORT.pack(flow.orig_dst_port)),
        ),
    )
    return nlmsg.message(_CT_DELETE, nlmsg.NLM_F_REQUEST | nlmsg.NLM_F_ACK, seq, body)


# Answers


def dump_flow(kind: int, view: memoryview, start: int, end: int) -> RawFlow | None:
    """The UDP flow in one answer to a dump (message type ``kind``, payload from
    ``start`` to ``end`` in ``view``); None for anything else."""
    if kind >> 8 != _NFNL_SUBSYS_CTNETLINK:
        return None
    offset = start + nlmsg.NFGEN.size
    fast = _fast_flow(view, offset, end)
    if fast is not None:
        return fast
    orig = reply = None
    for attr_kind, attr_start, attr_stop in nlmsg.attributes(view, offset, end):
        if attr_kind == _CTA_TUPLE_ORIG:
            orig = _parse_tuple(view, attr_start, attr_stop)
        elif attr_kind == _CTA_TUPLE_REPLY:
            reply = _parse_tuple(view, attr_start, attr_stop)
            break  # the reply tuple follows the original one
    if orig is None or reply is None or orig.proto != _IPPROTO_UDP:
        return None
    return orig.src, orig.sport, orig.dst, orig.dport, reply.src, reply.sport


class _Tuple:
    """A parsed conntrack tuple (address bytes, ports, protocol)."""

    __slots__ = ("dport", "dst", "proto", "sport", "src")

    def __init__(self) -> None:
        self.src = self.dst = b""
        self.proto = self.sport = self.dport = 0


def _parse_tuple(buffer: memoryview, offset: int, end: int) -> _Tuple:
    parsed = _Tuple()
    for kind, start, stop in nlmsg.attributes(buffer, offset, end):
        if kind == _CTA_TUPLE_IP:
            for ip_kind, ip_start, ip_stop in nlmsg.attributes(buffer, start, stop):
                if ip_kind in (_CTA_IP_V4_SRC, _CTA_IP_V6_SRC):
                    parsed.src = bytes(buffer[ip_start:ip_stop])
                elif ip_kind in (_CTA_IP_V4_DST, _CTA_IP_V6_DST):
                    parsed.dst = bytes(buffer[ip_start:ip_stop])
        elif kind == _CTA_TUPLE_PROTO:
            for proto_kind, proto_start, _ in nlmsg.attributes(buffer, start, stop):
                if proto_kind == _CTA_PROTO_NUM:
                    parsed.proto = buffer[proto_start]
                elif proto_kind == _CTA_PROTO_SRC_PORT:
                    parsed.sport = _PORT.unpack_from(buffer, proto_start)[0]
                elif proto_kind == _CTA_PROTO_DST_PORT:
                    parsed.dport = _PORT.unpack_from(buffer, proto_start)[0]
    return parsed


def _tuple_layout(
    address_size: int, src_kind: int, dst_kind: int
) -> tuple[struct.Struct, tuple[int, ...]]:
    """The layout the kernel writes a UDP tuple in, and the attribute headers expected."""
    layout = struct.Struct(f"=HHHH{address_size}sHH{address_size}sHHHHB3xHH2s2xHH2s2x")
    address_attr = 4 + address_size
    headers = (
        4 + 2 * address_attr,
        _CTA_TUPLE_IP | _NLA_F_NESTED,
        address_attr,
        src_kind,
        address_attr,
        dst_kind,
        28,
        _CTA_TUPLE_PROTO | _NLA_F_NESTED,
        5,
        _CTA_PROTO_NUM,
        6,
        _CTA_PROTO_SRC_PORT,
        6,
        _CTA_PROTO_DST_PORT,
    )
    return layout, headers


_LAYOUTS = (
    _tuple_layout(4, _CTA_IP_V4_SRC, _CTA_IP_V4_DST),
    _tuple_layout(16, _CTA_IP_V6_SRC, _CTA_IP_V6_DST),
)


def _fast_tuple(
    view: memoryview, offset: int, end: int, kind: int
) -> tuple[int, bytes, int, bytes, int, int] | None:
    """(attribute length, src, sport, dst, dport, protocol) if the tuple at ``offset`` has
    the kernel's usual layout; None to fall back to the generic parser."""
    if offset + 4 > end:
        return None
    length, found_kind = nlmsg.ATTR.unpack_from(view, offset)
    if found_kind != kind | _NLA_F_NESTED or offset + length > end:
        return None
    for layout, headers in _LAYOUTS:
        if length < 4 + layout.size:
            continue
        (
            ip_len, ip_kind, src_len, src_kind, src, dst_len, dst_kind, dst,
            proto_len, proto_kind, num_len, num_kind, proto,
            sport_len, sport_kind, sport, dport_len, dport_kind, dport,
        ) = layout.unpack_from(view, offset + 4)  # fmt: skip
        found = (
            ip_len, ip_kind, src_len, src_kind, dst_len, dst_kind, proto_len, proto_kind,
            num_len, num_kind, sport_len, sport_kind, dport_len, dport_kind,
        )  # fmt: skip
        if found == headers:
            return (
                length,
                src,
                int.from_bytes(sport, "big"),
                dst,
                int.from_bytes(dport, "big"),
                proto,
            )
    return None


def _fast_flow(view: memoryview, offset: int, end: int) -> RawFlow | None:
    """The flow of a dump message whose tuples have the usual layout (else None)."""
    orig = _fast_tuple(view, offset, end, _CTA_TUPLE_ORIG)
    if orig is None or orig[5] != _IPPROTO_UDP:
        return None
    reply = _fast_tuple(view, offset + ((orig[0] + 3) & ~3), end, _CTA_TUPLE_REPLY)
    if reply is None:
        return None
    return orig[1], orig[2], orig[3], orig[4], reply[1], reply[2]
