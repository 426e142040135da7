"""Reading the counters of one chain's rules over netlink, by rule comment.

Why hand-written (measured on these machines): nft 1.0.6 fetches every set element of the
table before it lists one chain or the table's counters, 3.2 s for a table holding
300k elements (``nft -j list chain`` and ``nft -j list counters table`` alike), which a
metrics scrape cannot afford. Asking the kernel for the rules of one chain
(``NFT_MSG_GETRULE`` dump filtered by table and chain) costs what that chain holds, a few
rules, whatever else the table contains.

:func:`rule_counters` returns, for every rule of the chain that has a ``counter``
statement and a ``comment``, the comment and the packets counted.
"""

from __future__ import annotations

import errno
import socket
import struct
from typing import Final

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.host.netns import run_in_netns

__all__ = ["parse_rule", "rule_counters"]

_NFT_MSG_NEWRULE: Final = 6
_NFT_MSG_GETRULE: Final = 7
_NFTA_RULE_TABLE: Final = 1
_NFTA_RULE_CHAIN: Final = 2
_NFTA_RULE_EXPRESSIONS: Final = 4
_NFTA_RULE_USERDATA: Final = 7
_NFTA_LIST_ELEM: Final = 1
_NFTA_EXPR_NAME: Final = 1
_NFTA_EXPR_DATA: Final = 2
_NFTA_COUNTER_PACKETS: Final = 2
_NFTNL_UDATA_RULE_COMMENT: Final = 0
_FAMILIES: Final = {Family.IP: socket.AF_INET, Family.IP6: socket.AF_INET6}


def _comment(userdata: bytes) -> str | None:
    offset = 0
    while offset + 2 <= len(userdata):
        kind, length = userdata[offset], userdata[offset + 1]
        value = userdata[offset + 2 : offset + 2 + length]
        if kind == _NFTNL_UDATA_RULE_COMMENT:
            return value.split(b"\0", 1)[0].decode(errors="replace")
        offset += 2 + length
    return None


def _packets(expressions: bytes) -> int | None:
    for kind, element in nlmsg.attribute_values(expressions):
        if kind != _NFTA_LIST_ELEM:
            continue
        name, data = b"", b""
        for part, value in nlmsg.attribute_values(element):
            if part == _NFTA_EXPR_NAME:
                name = value.split(b"\0", 1)[0]
            elif part == _NFTA_EXPR_DATA:
                data = value
        if name == b"counter":
            for field, value in nlmsg.attribute_values(data):
                if field == _NFTA_COUNTER_PACKETS and len(value) == 8:
                    return int(struct.unpack(">Q", value)[0])
    return None


def parse_rule(payload: bytes) -> tuple[str, int] | None:
    """A ``NEWRULE`` message's attributes (after the nfgen header): its comment and the
    packets its counter counted, or None without either."""
    comment: str | None = None
    packets: int | None = None
    for kind, value in nlmsg.attribute_values(payload):
        if kind == _NFTA_RULE_USERDATA:
            comment = _comment(value)
        elif kind == _NFTA_RULE_EXPRESSIONS:
            packets = _packets(value)
    if comment is None or packets is None:
        return None
    return comment, packets


def _request(family: Family, table: str, chain: str, seq: int) -> bytes:
    payload = (
        nlmsg.NFGEN.pack(_FAMILIES[family], 0, 0)
        + nlmsg.attr(_NFTA_RULE_TABLE, nlmsg.string(table))
        + nlmsg.attr(_NFTA_RULE_CHAIN, nlmsg.string(chain))
    )
    kind = nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_NFTABLES, _NFT_MSG_GETRULE)
    return nlmsg.message(kind, nlmsg.NLM_F_REQUEST | nlmsg.NLM_F_DUMP, seq, payload)


def _counters(sock: socket.socket, request: bytes, seq: int) -> dict[str, int]:
    found: dict[str, int] = {}
    for kind, payload in nlmsg.dump(sock, request, seq, "listing rules"):
        if kind == nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_NFTABLES, _NFT_MSG_NEWRULE):
            parsed = parse_rule(payload[nlmsg.NFGEN.size :])
            if parsed is not None:
                found[parsed[0]] = parsed[1]
    return found


def rule_counters(
    family: Family, table: str, chain: str, *, netns: str | None = None, timeout: float = 2.0
) -> dict[str, int]:
    """Packets counted by each commented, counting rule of ``chain``: ``{comment: packets}``.

    A missing table or chain is an empty answer; any other refusal raises
    :class:`~kubeproxy.backends.nftables.objects.NftError`.
    """

    def opened() -> socket.socket:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, nlmsg.NETLINK_NETFILTER)
        sock.bind((0, 0))
        return sock

    try:
        sock = opened() if netns is None else run_in_netns(netns, opened)
    except (OSError, ValueError) as err:
        raise NftError(f"cannot open an nf_tables netlink socket: {err}") from err
    with sock:
        sock.settimeout(timeout)
        try:
            return _counters(sock, _request(family, table, chain, 1), 1)
        except OSError as err:
            if err.errno == errno.ENOENT:
                return {}
            raise NftError(f"listing rules of {family} {table} {chain}: {err}", err.errno) from err
