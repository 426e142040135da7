"""The nf_tables messages of the event group, read by hand (header and first attributes).

Decoding 100k messages with pyroute2's nfnetlink classes took 2.34 s (23.4 us a message),
with :func:`parse_datagram` 0.087 s (0.87 us): the listener shares the interpreter with
the sync it watches (see :mod:`kubeproxy.nftevents`). The messages are walked by the
shared codec's generator (:func:`kubeproxy.host.nlmsg.messages`): over the recorded payloads
that measured 6-10 % slower than the loop written here before (2.46 against 2.33 us a
message, this machine shared with other work), a price paid for one walk, with one
judgement of malformed input, in every netlink client; our own commits, the bulk of
the messages, never reach it (the kernel filter drops them).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import kubeproxy.host.nlmsg as nlmsg

__all__ = ["NETLINK_NETFILTER", "Generation", "ObjectChange", "parse_datagram"]

NETLINK_NETFILTER: Final = nlmsg.NETLINK_NETFILTER
"""The netlink protocol of nfnetlink (nf_tables, conntrack)."""

_NFT_MSG_NEWGEN: Final = 15

# nf_tables message types -> what they announce.
_OPS: Final = {
    0: "NEWTABLE",
    2: "DELTABLE",
    3: "NEWCHAIN",
    5: "DELCHAIN",
    6: "NEWRULE",
    8: "DELRULE",
    9: "NEWSET",
    11: "DELSET",
    12: "NEWSETELEM",
    14: "DELSETELEM",
    18: "NEWOBJ",
    20: "DELOBJ",
    22: "NEWFLOWTABLE",
    24: "DELFLOWTABLE",
}
# The attribute holding the object's name, per message type (the table is attribute 1 in
# all of them): NFTA_CHAIN_NAME, NFTA_RULE_CHAIN, NFTA_SET_NAME, NFTA_SET_ELEM_LIST_SET,
# NFTA_OBJ_NAME, NFTA_FLOWTABLE_NAME.
_NAME_ATTRIBUTE: Final = {3: 3, 5: 3, 6: 2, 8: 2, 9: 2, 11: 2, 12: 2, 14: 2, 18: 2, 20: 2}
_NAME_ATTRIBUTE.update({22: 2, 24: 2})
_FAMILIES: Final = {1: "inet", 2: "ip", 3: "arp", 5: "netdev", 7: "bridge", 10: "ip6"}

_NFGENMSG_LEN: Final = nlmsg.NFGEN.size


@dataclass(frozen=True, slots=True)
class ObjectChange:
    """One object added or deleted by a commit.

    ``op`` is the message type (``DELRULE``, ``NEWSETELEM``...), ``family`` the table's
    family as nft spells it (``ip``, ``ip6``, ``inet``...), ``name`` the chain, set or
    object the change is about (a rule's chain, an element's set; ``""`` for a table),
    ``portid`` the committing socket's port id, ``body`` the message's attributes (for an
    :class:`Interest` that looks inside, e.g. at a deleted rule's jump target).
    """

    op: str
    family: str
    table: str
    name: str
    portid: int
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class Generation:
    """A ``NEWGEN`` message: a commit ended (``pid`` and ``process`` are the committing
    thread's id in the initial pid namespace and its name)."""

    generation: int
    portid: int
    pid: int
    process: str


def _text(data: bytes, start: int, end: int) -> str:
    return data[start:end].split(b"\0", 1)[0].decode("utf-8", "replace")


def parse_datagram(data: bytes) -> Iterator[ObjectChange | Generation]:
    """The nf_tables messages of one datagram from the multicast group.

    Messages of other subsystems, types this module does not know and malformed ones
    are skipped.
    """
    try:
        for offset, length, kind, _flags, _seq, portid in nlmsg.messages(data):
            body = offset + nlmsg.HEADER.size
            if kind >> 8 == nlmsg.NFNL_SUBSYS_NFTABLES and body + _NFGENMSG_LEN <= offset + length:
                item = _message(data, kind & 0xFF, portid, body, offset + length)
                if item is not None:
                    yield item
    except nlmsg.MalformedMessage:
        return


def _message(
    data: bytes, kind: int, portid: int, body: int, end: int
) -> ObjectChange | Generation | None:
    attributes = body + _NFGENMSG_LEN
    if kind == _NFT_MSG_NEWGEN:
        generation = pid = 0
        process = ""
        for attribute, start, stop in nlmsg.attributes(data, attributes, end):
            if attribute == 1 and stop - start == 4:
                (generation,) = struct.unpack_from(">I", data, start)
            elif attribute == 2 and stop - start == 4:
                (pid,) = struct.unpack_from(">I", data, start)
            elif attribute == 3:
                process = _text(data, start, stop)
        return Generation(generation, portid, pid, process)
    op = _OPS.get(kind)
    if op is None:
        return None
    family = _FAMILIES.get(data[body], str(data[body]))
    table = name = ""
    wanted = _NAME_ATTRIBUTE.get(kind)
    for attribute, start, stop in nlmsg.attributes(data, attributes, end):
        if attribute == 1:
            table = _text(data, start, stop)
        elif attribute == wanted:
            name = _text(data, start, stop)
        if table and (name or wanted is None):
            break
    return ObjectChange(op, family, table, name, portid, data[attributes:end])
