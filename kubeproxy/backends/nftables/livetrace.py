"""Watching real packets go through our table: ``kubeproxy trace --live``.

``trace`` without ``--live`` computes a path (:mod:`.trace`); this follows real ones.
The kernel's own tracing does the work: a packet whose ``nftrace`` bit is set makes
every rule it matches, every chain it returns from and every base chain's policy send an
event (``NFT_MSG_TRACE``) to the ``NFNLGRP_NFTRACE`` group, naming the table, chain,
rule handle and verdict, with the packet's headers as they are at that hop (after a DNAT,
the endpoint's address). This module sets that bit for the packets of one frontend and
prints each hop in our names.

Where the bit is set: in a table of its own, ``kube-proxy-trace`` (:func:`trace_table`),
never in ``kube-proxy`` and never in anyone else's table. Two chains at the ``raw``
priority of ``prerouting`` and ``output`` (before conntrack and before our DNAT) hold
one rule each: ``ip daddr D meta l4proto P th dport N [ip saddr S] meta nftrace set 1``.
Why a table of its own (the issue asked for one; writing into ``kube-proxy`` would not
work anyway while the proxy owns it: ``owner.py``, every other socket gets ``EPERM``):

* it is created with ``flags owner``, so it belongs to this process's libnftables socket:
  the kernel deletes it when the process ends, however it ends (``kill -9`` too), and
  ``kubeproxy trace --live`` deletes it itself on exit, Ctrl-C or error;
* the proxy's self-healing watches only ``kube-proxy``: adding it starts no repair;
* it changes no verdict (a ``filter`` chain with policy ``accept`` and a rule without a
  verdict), so the node's traffic is as before, with one more chain per packet.

Events of other tables are shown only when they drop or reject a traced packet (the host
firewall refusing what we DNAT is an answer too); the rest of theirs is left out.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import select
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final, Protocol, TextIO

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.backends.nftables.declarations import Declaration
from kubeproxy.backends.nftables.exec import LibNftables
from kubeproxy.backends.nftables.explain import describe_class, parse_class
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.reader import RuleRefs, TableReader, verdict_of
from kubeproxy.backends.nftables.table import TABLE
from kubeproxy.host.netns import run_in_netns
from kubeproxy.objects import IPAddress

__all__ = [
    "TRACE_TABLE",
    "Hop",
    "HopSource",
    "Namer",
    "TableRules",
    "TraceEvents",
    "describe_hop",
    "follow",
    "frontend_key",
    "parse_trace",
    "trace_rules",
    "trace_table",
]

TRACE_TABLE: Final = "kube-proxy-trace"
"""The table that sets ``nftrace`` on the traced packets (ours, owned, short-lived)."""

NFNLGRP_NFTRACE: Final = 9
_NFT_MSG_TRACE: Final = 17
# enum nft_trace_attributes (linux/netfilter/nf_tables.h).
_TABLE, _CHAIN, _RULE_HANDLE, _TYPE, _VERDICT, _ID = 1, 2, 3, 4, 5, 6
_NETWORK_HEADER, _TRANSPORT_HEADER, _IIF, _OIF, _NFPROTO, _POLICY = 8, 9, 10, 12, 15, 16
_TYPES: Final = {1: "policy", 2: "return", 3: "rule"}
_PROTOCOLS: Final = {6: "tcp", 17: "udp", 132: "sctp", 1: "icmp", 58: "ipv6-icmp"}
_POLICIES: Final = {0: "drop", 1: "accept"}
_HOOKS: Final = (("prerouting", "prerouting"), ("output", "output"))


def trace_rules(
    family: Family, dest: IPAddress, port: int, proto: str, source: IPAddress | None = None
) -> str:
    """The nft text of the trace table for packets to ``dest:port/proto`` (from
    ``source``, when given): what :func:`trace_table` loads. Arguments are parsed
    values, never text from elsewhere."""
    if proto not in ("tcp", "udp", "sctp") or not 0 < port < 65536:
        raise ValueError(f"cannot trace {port}/{proto}")
    ip = "ip" if family == Family.IP else "ip6"
    match = f"{ip} daddr {dest} meta l4proto {proto} th dport {port}"
    if source is not None:
        match += f" {ip} saddr {source}"
    lines = [f"add table {family} {TRACE_TABLE} {{ flags owner; }}"]
    for chain, hook in _HOOKS:
        lines.append(
            f"add chain {family} {TRACE_TABLE} {chain}"
            f" {{ type filter hook {hook} priority raw; policy accept; }}"
        )
        lines.append(f"add rule {family} {TRACE_TABLE} {chain} {match} meta nftrace set 1")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def trace_table(rules: str, family: Family, netns: str | None = None) -> Iterator[None]:
    """The trace table loaded from ``rules`` (:func:`trace_rules`) while the block runs,
    deleted after it whatever happens (and by the kernel if this process dies first: the
    table is owned by this libnftables context's socket)."""
    executor = LibNftables(netns)
    try:
        executor.run_text(rules)
        try:
            yield
        finally:
            with contextlib.suppress(NftError):
                executor.run_text(f"delete table {family} {TRACE_TABLE}\n")
    finally:
        executor.close()


@dataclass(frozen=True, slots=True)
class Hop:
    """One trace event: packet ``id`` at rule ``handle`` of ``table``/``chain``
    (``kind``: ``rule``, ``return`` at a chain's end, ``policy`` of a base chain),
    the ``verdict`` (``("goto", CHAIN)``, ``("accept", "")``...), and the packet's
    addresses as they are at this hop."""

    id: int
    family: int
    table: str
    chain: str
    kind: str
    handle: int | None = None
    verdict: tuple[str, ...] | None = None
    policy: str | None = None
    source: str | None = None
    dest: str | None = None
    proto: str | None = None
    sport: int | None = None
    dport: int | None = None
    iif: int | None = None
    oif: int | None = None

    @property
    def packet(self) -> str:
        """The packet at this hop: ``SRC:PORT -> DST:PORT/PROTO``."""
        if self.source is None or self.dest is None:
            return "?"
        if self.sport is None or self.dport is None:
            return f"{self.source} -> {self.dest} {self.proto or ''}".rstrip()
        return f"{_hostport(self.source, self.sport)} -> {_hostport(self.dest, self.dport)}/" + (
            self.proto or "?"
        )


def _hostport(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _u32(raw: bytes) -> int:
    return int(struct.unpack(">I", raw[:4])[0]) if len(raw) >= 4 else 0


def parse_trace(payload: bytes) -> Hop | None:
    """The hop one ``NFT_MSG_TRACE`` message's payload (after ``nlmsghdr``) describes
    (None: not a trace of a table and chain)."""
    if len(payload) < nlmsg.NFGEN.size:
        return None
    family = payload[0]
    fields: dict[int, bytes] = {}
    for kind, value in nlmsg.attribute_values(payload, nlmsg.NFGEN.size):
        fields[kind] = value
    if _TABLE not in fields or _CHAIN not in fields:
        return None
    handle = None
    if len(fields.get(_RULE_HANDLE, b"")) == 8:
        handle = int(struct.unpack(">Q", fields[_RULE_HANDLE])[0])
    verdict = verdict_of(fields[_VERDICT]) if _VERDICT in fields else None
    policy = _POLICIES.get(_u32(fields[_POLICY])) if _POLICY in fields else None
    source = dest = proto = None
    sport = dport = None
    header = fields.get(_NETWORK_HEADER, b"")
    number = None
    if len(header) >= 20 and header[0] >> 4 == 4:
        source = str(ipaddress.IPv4Address(header[12:16]))
        dest = str(ipaddress.IPv4Address(header[16:20]))
        number = header[9]
    elif len(header) >= 40 and header[0] >> 4 == 6:
        source = str(ipaddress.IPv6Address(header[8:24]))
        dest = str(ipaddress.IPv6Address(header[24:40]))
        number = header[6]
    if number is not None:
        proto = _PROTOCOLS.get(number, str(number))
        transport = fields.get(_TRANSPORT_HEADER, b"")
        if proto in ("tcp", "udp", "sctp") and len(transport) >= 4:
            sport, dport = struct.unpack(">HH", transport[:4])
    return Hop(
        id=_u32(fields.get(_ID, b"")),
        family=family,
        table=_text(fields[_TABLE]),
        chain=_text(fields[_CHAIN]),
        kind=_TYPES.get(_u32(fields.get(_TYPE, b"")), "?"),
        handle=handle,
        verdict=verdict,
        policy=policy,
        source=source,
        dest=dest,
        proto=proto,
        sport=sport,
        dport=dport,
        iif=_u32(fields[_IIF]) if _IIF in fields else None,
        oif=_u32(fields[_OIF]) if _OIF in fields else None,
    )


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def parse_datagram(data: bytes) -> list[Hop]:
    """The trace events of one datagram of the ``NFNLGRP_NFTRACE`` group."""
    hops: list[Hop] = []
    try:
        for offset, length, kind, _flags, _seq, _pid in nlmsg.messages(data):
            if kind != nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_NFTABLES, _NFT_MSG_TRACE):
                continue
            hop = parse_trace(data[offset + nlmsg.HEADER.size : offset + length])
            if hop is not None:
                hops.append(hop)
    except nlmsg.MalformedMessage:
        pass
    return hops


def _verdict_words(verdict: tuple[str, ...] | None) -> str:
    if not verdict:
        return ""
    return " ".join(part for part in verdict if part)


_NAMED_SET = re.compile(r"(?:dispatch|no-endpoint)-(?:ips|nodeports|reject|drop)[-a-z]*\.g[0-9]+")


def frontend_key(container: str, packet: Hop) -> tuple[str, ...] | None:
    """The key a packet has in one of the sets whose elements name Services
    (``dispatch-*``, ``no-endpoint-*``): ``(ip, proto, port)`` or, in a NodePort set,
    ``(proto, port)`` (None: not such a set, or a packet without ports)."""
    if not _NAMED_SET.fullmatch(container) or packet.dport is None or packet.dest is None:
        return None
    if "nodeports" in container:
        return (str(packet.proto), str(packet.dport))
    return (packet.dest, str(packet.proto), str(packet.dport))


class Namer(Protocol):
    """What :func:`describe_hop` asks of our table (:class:`TableRules` reads the
    kernel's)."""

    def rule(self, chain: str, handle: int) -> RuleRefs | None:
        """The rule at ``handle`` of ``chain`` (None: gone)."""
        ...

    def frontend(self, container: str, key: tuple[str, ...]) -> str | None:
        """The comment (a Service port's name) of element ``key`` of ``container``."""
        ...


def _rule_words(rule: RuleRefs | None) -> list[str]:
    if rule is None:
        return []
    parts = [f"@{name}" for name in rule.lookups]
    if rule.updates:
        parts.append(f"updates @{rule.updates}")
    names = {name for name, _ in rule.expressions}
    if "numgen" in names:
        parts.append("picks a slot at random")
    if "nat" in names:
        parts.append("DNAT")
    if "masq" in names:
        parts.append("masquerade")
    return parts


def describe_hop(
    hop: Hop, table: Namer, packet: Hop | None = None, first_in_chain: bool = True
) -> str | None:
    """One line for a hop, in our names (None: not worth one: another table's hop that
    let the packet go on). ``packet`` is the packet's latest hop with headers (the
    kernel sends them at the first hop of each hook only), for naming the frontend a
    dispatch matched; ``first_in_chain``: say what a class chain does (once a packet)."""
    verdict = _verdict_words(hop.verdict)
    seen = f"  [{hop.packet}]" if hop.source is not None else ""
    if hop.table != TABLE:
        refused = hop.policy == "drop" or (hop.verdict or ("",))[0] in ("drop", "reject")
        if hop.table == TRACE_TABLE or not refused:
            return None
        where = f"rule {hop.handle}" if hop.handle is not None else "policy"
        return f"{hop.table} {hop.chain} {where}: {verdict or hop.policy} (not our table){seen}"
    chain = hop.chain
    spec = parse_class(chain)
    if spec is not None and first_in_chain:
        chain += f" (class: {describe_class(spec)})"
    if hop.kind == "policy":
        return f"{chain}: end of base chain, policy {hop.policy or verdict}{seen}"
    if hop.kind == "return" or hop.handle is None:
        return f"{chain}: no rule decided, {verdict or 'continue'}{seen}"
    rule = table.rule(hop.chain, hop.handle)
    words = _rule_words(rule)
    if rule is not None and packet is not None and hop.verdict and hop.verdict[0] != "continue":
        for container in rule.lookups:
            key = frontend_key(container, packet)
            name = table.frontend(container, key) if key is not None else None
            if key is not None:
                words.append(f"{' . '.join(key)} is {name or 'an unnamed frontend'}")
    text = f"{chain} rule {hop.handle}"
    if words:
        text += f" ({'; '.join(words)})"
    return f"{text}: {verdict or 'continue'}{seen}"


class HopSource(Protocol):
    """Where :func:`follow` gets hops (:class:`TraceEvents`, or a list in tests)."""

    def receive(self, timeout: float) -> list[Hop]:
        """The hops that arrived within ``timeout`` seconds."""
        ...


def follow(
    events: HopSource,
    table: Namer,
    out: TextIO,
    *,
    packets: int,
    seconds: float,
    clock: Callable[[], float],
    settle: float = 0.5,
) -> int:
    """Print the hops of traced packets, each line marked with the packet's number in
    order of arrival, until ``packets`` packets were seen (and ``settle`` seconds more
    for the last one's hops) or ``seconds`` passed. Returns the packets seen.

    A packet begins at the trace table's marking rule (its first event, with its
    headers): the kernel's trace id is a hash of the packet buffer's address, which a
    later packet may reuse, so the id alone does not tell packets apart."""
    current: dict[int, int] = {}
    seen = 0
    headers: dict[int, Hop] = {}
    described: set[tuple[int, str]] = set()
    deadline = clock() + seconds
    while True:
        now = clock()
        if now >= deadline:
            return seen
        for hop in events.receive(min(deadline - now, 0.5)):
            if hop.table == TRACE_TABLE:
                if hop.kind == "rule" and hop.handle is not None:
                    current.pop(hop.id, None)
                    if seen < packets:
                        seen += 1
                        current[hop.id] = seen
                        where = "arrives" if hop.chain == "prerouting" else "leaves this node"
                        print(f"#{seen} {hop.packet} {where}", file=out, flush=True)
                continue
            number = current.get(hop.id)
            if number is None:
                continue  # a packet not followed (over the count)
            if hop.source is not None:
                headers[number] = hop
            first = (number, hop.chain) not in described
            described.add((number, hop.chain))
            line = describe_hop(hop, table, headers.get(number), first)
            if line is not None:
                print(f"#{number} {line}", file=out, flush=True)
        if seen >= packets:
            deadline = min(deadline, clock() + settle)


class TableRules:
    """Our table as :func:`describe_hop` asks about it, read from the kernel: rules per
    chain when first needed (and again when a handle is new: a sync replaced the chain's
    rules meanwhile), elements by key."""

    def __init__(self, reader: TableReader, family: Family) -> None:
        self.reader = reader
        self.family = family
        self._chains: dict[str, dict[int, RuleRefs]] = {}
        self._sets: dict[str, Declaration] | None = None

    def _read(self, chain: str) -> dict[int, RuleRefs]:
        try:
            rules = self.reader.rules(self.family, chain)
        except NftError:
            rules = []  # deleted meanwhile (an old generation): described by name only
        found = {rule.handle: rule for rule in rules if rule.handle is not None}
        self._chains[chain] = found
        return found

    def rule(self, chain: str, handle: int) -> RuleRefs | None:
        """The rule at ``handle`` of ``chain`` (None: gone)."""
        held = self._chains.get(chain)
        if held is None or handle not in held:
            held = self._read(chain)
        return held.get(handle)

    def frontend(self, container: str, key: tuple[str, ...]) -> str | None:
        """The comment of element ``key`` of ``container`` (None: none, or gone)."""
        if self._sets is None or container not in self._sets:
            self._sets = self.reader.sets(self.family)
        declaration = self._sets.get(container)
        if declaration is None:
            return None
        try:
            item = self.reader.get(self.family, container, declaration, key)
        except NftError:
            return None
        return item.comment if item is not None else None


class TraceEvents:
    """A netlink socket subscribed to the nftables trace group, in ``netns`` or this
    namespace (``OSError`` when it cannot be opened, e.g. ``EPERM`` without
    ``CAP_NET_ADMIN``)."""

    def __init__(self, netns: str | None = None) -> None:
        self._sock = run_in_netns(netns, self._open) if netns is not None else self._open()

    @staticmethod
    def _open() -> socket.socket:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, nlmsg.NETLINK_NETFILTER)
        try:
            sock.bind((0, 0))
            sock.setsockopt(nlmsg.SOL_NETLINK, nlmsg.NETLINK_ADD_MEMBERSHIP, NFNLGRP_NFTRACE)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        except OSError:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        """Close the socket."""
        self._sock.close()

    def __enter__(self) -> TraceEvents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def receive(self, timeout: float) -> list[Hop]:
        """The hops waiting, after waiting up to ``timeout`` seconds for the first
        (``ENOBUFS``, events lost to a full buffer, is raised as ``OSError``)."""
        ready, _, _ = select.select([self._sock], [], [], max(timeout, 0.0))
        hops: list[Hop] = []
        while ready:
            try:
                data = self._sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            hops.extend(parse_datagram(data))
        return hops
