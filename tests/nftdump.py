"""What the kernel stores of a namespace's nf_tables tables, raw, for comparing two writers.

``nft list ruleset`` is what operators read; this is what the kernel holds: every table,
chain, set, rule and element of a family as the kernel dumps them over netlink (attribute
by attribute, the rules' expressions byte for byte), without what differs between two
equal rulesets written at different times or by different sockets (handles, positions,
use counts, the owner's port id and the table's flags, counters, set ids, timeouts left).
Two writers that hold the same :func:`dump` wrote the same bytecode.
"""

from __future__ import annotations

import errno
import functools
import socket
from collections.abc import Iterator

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.backends.nftables.batchsocket import one_generation
from kubeproxy.backends.nftables.elements import each_once, read_whole
from kubeproxy.host.netns import run_in_netns

__all__ = ["dump", "dump_text"]

_GETTABLE, _GETCHAIN, _GETRULE, _GETSET, _GETSETELEM = 1, 4, 7, 10, 13
_FAMILIES = {"ip": socket.AF_INET, "ip6": socket.AF_INET6, "inet": 1}

# Attributes left out (per message kind): handles, use counts, owners, flags that say
# who owns a table, counters and set ids; positions; elements' expirations.
_SKIP = {
    _GETTABLE: {2, 3, 4, 5, 7},  # FLAGS, USE, HANDLE, PAD, OWNER
    _GETCHAIN: {2, 6, 8, 9, 11},  # HANDLE, USE, COUNTERS, PAD, ID
    _GETRULE: {3, 6, 8, 9, 10, 11},  # HANDLE, POSITION, PAD, ID, POSITION_ID, CHAIN_ID
    _GETSET: {10, 14, 16},  # ID, PAD, HANDLE
    _GETSETELEM: set(),
}
_ELEM_EXPIRATION = 5
_ELEM_LIST_ELEMENTS = 3


def _request(kind: int, family: int, seq: int, body: bytes = b"") -> bytes:
    return nlmsg.message(
        nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_NFTABLES, kind),
        nlmsg.NLM_F_REQUEST | nlmsg.NLM_F_DUMP,
        seq,
        nlmsg.NFGEN.pack(family, 0, 0) + body,
    )


def _attrs(data: bytes, skip: set[int], depth: int = 0) -> Iterator[str]:
    for kind, value in nlmsg.attribute_values(data):
        if kind in skip:
            continue
        yield f"{'  ' * depth}{kind}: {value.hex()}"


def _expressions(value: bytes) -> Iterator[str]:
    """A rule's expressions: name, then each data attribute (counters' values dropped)."""
    for _kind, item in nlmsg.attribute_values(value):
        name = b""
        data = b""
        for part, content in nlmsg.attribute_values(item):
            if part == 1:
                name = content.rstrip(b"\0")
            elif part == 2:
                data = content
        if name == b"counter":
            yield "  expr counter"
            continue
        yield f"  expr {name.decode()}"
        yield from _attrs(data, set(), 2)


def _element_lines(value: bytes) -> Iterator[str]:
    for _kind, item in nlmsg.attribute_values(value):
        yield "  elem " + " ".join(
            f"{k}={v.hex()}" for k, v in nlmsg.attribute_values(item) if k != _ELEM_EXPIRATION
        )


def _read(sock: socket.socket, request: bytes, seq: int, what: str) -> list[bytes]:
    return [payload[nlmsg.NFGEN.size :] for _kind, payload in nlmsg.dump(sock, request, seq, what)]


def _name(body: bytes, attribute: int) -> str:
    for kind, value in nlmsg.attribute_values(body):
        if kind == attribute:
            return value.rstrip(b"\0").decode()
    return ""


def _elements(
    sock: socket.socket, family: int, seq: int, body: bytes, name: str
) -> list[str] | None:
    """One dump of a set's elements; None when a commit came between two of its messages
    (:func:`read_whole` asks again then, and when the kernel's resize of the set made
    the dump repeat an element: an element appears once in a set)."""
    request = _request(_GETSETELEM, family, seq, body)
    answers = [payload for _kind, payload in nlmsg.dump(sock, request, seq, name)]
    if not one_generation(answers):
        return None
    elements: list[str] = []
    for answer in answers:
        for kind, value in nlmsg.attribute_values(answer[nlmsg.NFGEN.size :]):
            if kind == _ELEM_LIST_ELEMENTS:
                elements.extend(_element_lines(value))
    return elements


def _dump(family: str, table: str) -> list[str]:
    fam = _FAMILIES[family]
    out: list[str] = []
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, nlmsg.NETLINK_NETFILTER)
    with sock:
        sock.bind((0, 0))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        table_attr = nlmsg.attr(1, nlmsg.string(table))
        for body in _read(sock, _request(_GETTABLE, fam, 1), 1, "tables"):
            if _name(body, 1) == table:
                out.append(f"table {table}")
                out.extend(_attrs(body, _SKIP[_GETTABLE], 1))
        chains = []
        for body in _read(sock, _request(_GETCHAIN, fam, 2, table_attr), 2, "chains"):
            if _name(body, 1) == table:
                chains.append(
                    "\n".join([f"chain {_name(body, 3)}", *_attrs(body, _SKIP[_GETCHAIN], 1)])
                )
        out.extend(line for chain in sorted(chains) for line in chain.split("\n"))
        sets = []
        names = []
        for body in _read(sock, _request(_GETSET, fam, 3, table_attr), 3, "sets"):
            if _name(body, 1) != table:
                continue
            name = _name(body, 2)
            names.append(name)
            sets.append("\n".join([f"set {name}", *_attrs(body, _SKIP[_GETSET], 1)]))
        out.extend(line for one in sorted(sets) for line in one.split("\n"))
        seq = 4
        for name in sorted(names):
            seq += 1
            body = table_attr + nlmsg.attr(2, nlmsg.string(name))
            out.append(f"elements of {name}")
            dumped = functools.partial(_elements, sock, fam, seq, body, name)
            out.extend(sorted(read_whole(dumped, each_once, name)))
        seq += 1
        by_chain: dict[str, list[list[str]]] = {}
        for body in _read(sock, _request(_GETRULE, fam, seq, table_attr), seq, "rules"):
            if _name(body, 1) != table:
                continue
            lines: list[str] = []
            for kind, value in nlmsg.attribute_values(body):
                if kind == 4:  # NFTA_RULE_EXPRESSIONS
                    lines.extend(_expressions(value))
                elif kind not in _SKIP[_GETRULE] and kind not in (1, 2):
                    lines.append(f"  {kind}: {value.hex()}")
            by_chain.setdefault(_name(body, 2), []).append(["rule", *lines])
        for chain in sorted(by_chain):
            out.append(f"rules of {chain}")
            for rule in by_chain[chain]:
                out.extend(rule)
    return out


def dump(netns: str | None, family: str, table: str = "kube-proxy") -> list[str]:
    """What the kernel holds of ``family table`` in ``netns``, one line per attribute,
    in an order that does not depend on how it was written (see the module); ``[]``
    when there is no such table."""

    def read() -> list[str]:
        try:
            return _dump(family, table)
        except nlmsg.NetlinkError as err:
            if err.errno == errno.ENOENT:
                return []
            raise

    return read() if netns is None else run_in_netns(netns, read)


def dump_text(netns: str | None, family: str, table: str = "kube-proxy") -> str:
    """:func:`dump` as one text."""
    return "\n".join(dump(netns, family, table))
