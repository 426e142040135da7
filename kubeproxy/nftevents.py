"""nf_tables change events: what someone committed, and whether it was us.

The kernel announces every committed nftables change of a network namespace on the
netlink multicast group ``NFNLGRP_NFTABLES``: one message per object added or deleted
(table, chain, rule, set, element, ...), then a ``NEWGEN`` message closing the commit,
carrying the new generation id, the committing thread's id and its name. Every message's
header carries the *port id* of the netlink socket that committed. This module reads
those messages (:class:`EventSocket`), groups them into commits (:class:`CommitAssembler`),
tells our own commits from everyone else's (:class:`OwnWriters`) and, in
:class:`NftablesEventWatcher`, reports the foreign commits an :class:`Interest` cares about
to the self-healing core (:mod:`kubeproxy.selfheal`).

What was measured on this project's machine (kernel 6.18), and why the code looks so:

* ``NEWGEN``'s pid is the id of the committing *thread* (a commit from the sync thread
  reported that thread's id, not ``os.getpid()``) in the *initial* pid namespace (``nft``
  run inside ``unshare --pid`` reported its host pid, 15113, while it was pid 4 inside).
  A proxy in a container without ``hostPID`` cannot compare it with anything of its own.
  The header's port id can: it names the socket, and a new process's first netlink socket
  gets its pid *in the process's own pid namespace* (4 in that test). So our commits are
  recognised by port id: the sockets this process holds (libnftables' own, found through
  ``/proc/self/fd``) and the processes it spawned (iptables-restore), with the ``NEWGEN``
  pid as a second key where it is meaningful.
* Loading 100k map elements produced 100,004 messages in 2,566 datagrams (9.6 MB);
  deleting the table afterwards produced 7 (the table, its chains and sets: no message per
  element), flushing a 10k-element set 10,000. Decoding the 100k messages with pyroute2's
  nfnetlink classes took 2.34 s (23.4 us a message), with :func:`parse_datagram` 0.087 s
  (0.87 us): the listener shares the interpreter with the sync it watches, so the
  messages are read by hand (header and the first attributes only).
* Our own syncs are the largest source of messages (a cold sync at 10k Services sends
  over 100k). A classic BPF filter on the socket drops every message from our own
  sockets in the kernel (:meth:`EventSocket.ignore_portids`), so they cost nothing here
  and cannot overflow the socket buffer.
* Expiring set elements (timeouts) and the packet path's ``update @map`` send nothing.

When messages are lost anyway (``ENOBUFS``: the buffer overflowed), the watcher cannot
know what it missed and reports it as a change of kind ``missed-events`` (one full sync).
When the socket cannot be had at all, it falls back to comparing the ruleset generation
every few seconds (:data:`FALLBACK_INTERVAL`) and says so once in the log.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import select
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

from kubeproxy.netns import run_in_netns
from kubeproxy.objects import IPFamily
from kubeproxy.selfheal import (
    KIND_CHAIN,
    KIND_ELEMENT,
    KIND_MISSED,
    KIND_OBJECT,
    KIND_OTHER,
    KIND_RULE,
    KIND_SET,
    KIND_TABLE,
    ExternalChange,
    WatchHost,
)

if TYPE_CHECKING:
    from kubeproxy.backend import ProxySnapshot, SyncChanges
    from kubeproxy.proxier import Proxier

__all__ = [
    "FALLBACK_INTERVAL",
    "NETLINK_NETFILTER",
    "NFNLGRP_NFTABLES",
    "ChildProcesses",
    "Commit",
    "CommitAssembler",
    "EventSocket",
    "EventsLost",
    "Generation",
    "Interest",
    "NftablesEventWatcher",
    "ObjectChange",
    "ObjectKey",
    "OwnWriters",
    "own_netlink_portids",
    "parse_datagram",
    "read_generation",
    "summarize",
]

logger = logging.getLogger(__name__)

NETLINK_NETFILTER: Final = 12
"""The netlink protocol of nfnetlink (nf_tables, conntrack)."""

NFNLGRP_NFTABLES: Final = 7
"""The multicast group carrying nf_tables change events."""

FALLBACK_INTERVAL: Final = 3.0
"""Seconds between generation checks when events cannot be had."""

_NFNL_SUBSYS_NFTABLES: Final = 10
_NFT_MSG_NEWGEN: Final = 15
_NFT_MSG_GETGEN: Final = 16
_NLMSG_ERROR: Final = 2
_NLM_F_REQUEST: Final = 1
_SOL_NETLINK: Final = 270
_NETLINK_ADD_MEMBERSHIP: Final = 1
_SO_RCVBUFFORCE: Final = 33
_SO_ATTACH_FILTER: Final = 26
_SO_NETNS_COOKIE: Final = 71
_RCVBUF: Final = 32 << 20
_DATAGRAM_MAX: Final = 1 << 20

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

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
_ATTRIBUTE = struct.Struct("=HH")  # nlattr: length, type
_NLMSG_HEADER_LEN: Final = 16
_NFGENMSG_LEN: Final = 4


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


def _attributes(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(type, value start, value end) of each netlink attribute in ``data[start:end]``."""
    offset = start
    while offset + 4 <= end:
        length, kind = _ATTRIBUTE.unpack_from(data, offset)
        if length < 4 or offset + length > end:
            return
        yield kind & 0x3FFF, offset + 4, offset + length
        offset += (length + 3) & ~3


def _text(data: bytes, start: int, end: int) -> str:
    return data[start:end].split(b"\0", 1)[0].decode("utf-8", "replace")


def parse_datagram(data: bytes) -> Iterator[ObjectChange | Generation]:
    """The nf_tables messages of one datagram from the multicast group.

    Messages of other subsystems, types this module does not know and malformed ones
    are skipped.
    """
    offset, end = 0, len(data)
    while offset + _NLMSG_HEADER_LEN <= end:
        length, kind, _flags, _seq, portid = _HEADER.unpack_from(data, offset)
        if length < _NLMSG_HEADER_LEN or offset + length > end:
            return
        message_end = offset + length
        body = offset + _NLMSG_HEADER_LEN
        if kind >> 8 == _NFNL_SUBSYS_NFTABLES and body + _NFGENMSG_LEN <= message_end:
            item = _message(data, kind & 0xFF, portid, body, message_end)
            if item is not None:
                yield item
        offset += (length + 3) & ~3


def _message(
    data: bytes, kind: int, portid: int, body: int, end: int
) -> ObjectChange | Generation | None:
    attributes = body + _NFGENMSG_LEN
    if kind == _NFT_MSG_NEWGEN:
        generation = pid = 0
        process = ""
        for attribute, start, stop in _attributes(data, attributes, end):
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
    for attribute, start, stop in _attributes(data, attributes, end):
        if attribute == 1:
            table = _text(data, start, stop)
        elif attribute == wanted:
            name = _text(data, start, stop)
        if table and (name or wanted is None):
            break
    return ObjectChange(op, family, table, name, portid, data[attributes:end])


# --- commits --------------------------------------------------------------------------------


ObjectKey = tuple[str, str, str, str]
"""(op, family, table, name) of an :class:`ObjectChange`: what a :class:`Commit` counts."""


@dataclass(frozen=True, slots=True)
class Commit:
    """A foreign commit's changes that an :class:`Interest` found relevant, counted by
    (op, family, table, name); beyond ``CommitAssembler.keep`` distinct objects the name
    is left out (``""``), so a commit of any size costs bounded memory."""

    generation: int
    portid: int
    pid: int
    process: str
    counts: dict[ObjectKey, int]

    @property
    def author(self) -> str:
        """``nft (pid 1234)`` for log lines."""
        process = self.process or "unknown process"
        return f"{process} (pid {self.pid})" if self.pid else process


class CommitAssembler:
    """Groups the relevant changes of a commit, counted by object, until its ``NEWGEN``."""

    def __init__(self, keep: int = 1000) -> None:
        self.keep = keep
        self._counts: dict[ObjectKey, int] = {}

    @property
    def pending(self) -> bool:
        """Whether relevant changes wait for their ``NEWGEN``."""
        return bool(self._counts)

    def add(self, change: ObjectChange) -> None:
        """Count one relevant change."""
        key = (change.op, change.family, change.table, change.name)
        if key not in self._counts and len(self._counts) >= self.keep:
            key = (change.op, change.family, change.table, "")
        self._counts[key] = self._counts.get(key, 0) + 1

    def close(self, generation: Generation) -> Commit | None:
        """The commit ``generation`` ends (None when it held nothing relevant)."""
        counts, self._counts = self._counts, {}
        if not counts:
            return None
        return Commit(
            generation.generation, generation.portid, generation.pid, generation.process, counts
        )

    def discard(self) -> None:
        """Forget a commit (ours, or cut by lost messages)."""
        self._counts = {}


class Interest(Protocol):
    """What a watcher reports: which changes matter, and how to say what happened."""

    @property
    def what(self) -> str:
        """What is watched, for log lines (``tables ip/ip6 kube-proxy``)."""
        ...

    def relevant(self, change: ObjectChange) -> bool:
        """Whether a change (by someone else) concerns us. Called for every message."""
        ...

    def describe(self, commit: Commit) -> list[ExternalChange]:
        """What a foreign commit of relevant changes did to us (none: nothing to repair)."""
        ...


_KIND_OF_OP: Final = {
    "DELTABLE": KIND_TABLE,
    "DELCHAIN": KIND_CHAIN,
    "DELSET": KIND_SET,
    "DELRULE": KIND_RULE,
    "DELSETELEM": KIND_ELEMENT,
    "DELOBJ": KIND_OBJECT,
    "DELFLOWTABLE": KIND_OBJECT,
}
# How a summary names what an op did, in the order it lists them (most serious first).
_PHRASES: Final = (
    ("DELTABLE", "table", "deleted", ""),
    ("DELCHAIN", "chain", "deleted", ""),
    ("DELSET", "set or map", "deleted", ""),
    ("DELRULE", "rule", "deleted", "in "),
    ("DELSETELEM", "element", "deleted", "from "),
    ("DELOBJ", "object", "deleted", ""),
    ("DELFLOWTABLE", "flowtable", "deleted", ""),
    ("NEWTABLE", "table", "added", ""),
    ("NEWCHAIN", "chain", "added", ""),
    ("NEWSET", "set or map", "added", ""),
    ("NEWRULE", "rule", "added", "in "),
    ("NEWSETELEM", "element", "added", "to "),
    ("NEWOBJ", "object", "added", ""),
    ("NEWFLOWTABLE", "flowtable", "added", ""),
)
_NAMES_SHOWN: Final = 3


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    more = len(names) - _NAMES_SHOWN
    return f"{shown} and {more} more" if more > 0 else shown


def summarize(commit: Commit, families: Mapping[str, IPFamily]) -> list[ExternalChange]:
    """One :class:`~kubeproxy.selfheal.ExternalChange` per IP family a foreign commit
    touched (``families`` maps nft family names, ``ip``/``ip6``, to them): its kind is the
    most serious thing done (a deleted table before a deleted chain ... before anything
    added), its detail lists what was done, with a few names, and who did it."""
    by_family: dict[IPFamily, dict[str, dict[str, int]]] = {}
    tables: dict[IPFamily, set[str]] = {}
    for (op, nft_family, table, name), count in commit.counts.items():
        family = families.get(nft_family)
        if family is None:
            continue
        tables.setdefault(family, set()).add(f"{nft_family} {table}")
        names = by_family.setdefault(family, {}).setdefault(op, {})
        names[name] = names.get(name, 0) + count
    changes = []
    for family in sorted(by_family, key=lambda f: f.value):
        ops = by_family[family]
        kind = next(
            (_KIND_OF_OP[op] for op, *_ in _PHRASES if op in ops and op in _KIND_OF_OP),
            KIND_OTHER,
        )
        parts = []
        for op, noun, verb, preposition in _PHRASES:
            if op not in ops:
                continue
            total = sum(ops[op].values())
            named = sorted(n for n in ops[op] if n)
            plural = (
                noun if total == 1 else ("sets or maps" if noun == "set or map" else noun + "s")
            )
            where = f" ({preposition}{_names(named)})" if named else ""
            parts.append(f"{total} {plural} {verb}{where}")
        where = ", ".join(sorted(tables[family]))
        detail = (
            f"table {where}: {'; '.join(parts)}, by {commit.author} "
            f"(generation {commit.generation})"
        )
        changes.append(ExternalChange(kind, detail, family))
    return changes


# --- who we are -------------------------------------------------------------------------------


def _netns_cookie(sock: socket.socket) -> int | None:
    try:
        return int.from_bytes(sock.getsockopt(socket.SOL_SOCKET, _SO_NETNS_COOKIE, 8), "little")
    except OSError:
        return None  # kernels before 5.14


def own_netlink_portids(netns_cookie: int | None = None) -> set[int]:
    """Port ids of this process's bound nfnetlink sockets (libnftables' among them).

    Found through ``/proc/self/fd``: each socket descriptor is duplicated and asked for its
    address. With ``netns_cookie``, only sockets of that network namespace count (where
    the kernel can say, 5.14 and later).
    """
    found: set[int] = set()
    with contextlib.suppress(OSError):
        names = os.listdir("/proc/self/fd")
    for name in names:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            duplicate = os.dup(int(name))
        except (OSError, ValueError):
            continue  # closed meanwhile
        try:
            sock = socket.socket(fileno=duplicate)
        except OSError:
            os.close(duplicate)
            continue
        with sock:
            if sock.family != socket.AF_NETLINK or sock.proto != NETLINK_NETFILTER:
                continue
            if netns_cookie is not None:
                cookie = _netns_cookie(sock)
                if cookie is not None and cookie != netns_cookie:
                    continue
            portid = sock.getsockname()[0]
            if portid:
                found.add(portid)
    return found


class ChildProcesses:
    """The processes a kernel tool executor spawned lately (iptables-restore...).

    A child commits through a socket of its own; its port id is normally its pid (as we
    see it), and the commit's ``NEWGEN`` pid is its pid where we share the initial pid
    namespace. The executor wraps each spawn in :meth:`spawning` so that a watcher
    judging a commit while a child is being started waits for its pid, and says when
    the child is gone (:meth:`exited`). The last ``remember`` pids are kept (a commit may
    be judged after its child exited); the ones still running are what
    :meth:`subscribe` callbacks get, so the watcher's kernel filter drops their messages
    (a full iptables sync at 10k Services sends hundreds of MB of them) without ever
    filtering a pid that a foreign process might get next.
    """

    def __init__(self, remember: int = 256) -> None:
        self._pids: deque[int] = deque(maxlen=remember)
        self._running: set[int] = set()
        self._pending = 0
        self._changed = threading.Condition()
        self._subscribers: list[Callable[[frozenset[int]], None]] = []

    @contextlib.contextmanager
    def spawning(self) -> Iterator[Callable[[int], None]]:
        """Wrap a spawn: call the function given with the child's pid once known."""
        with self._changed:
            self._pending += 1
        try:
            yield self._note
        finally:
            with self._changed:
                self._pending -= 1
                self._changed.notify_all()

    def _note(self, pid: int) -> None:
        with self._changed:
            self._pids.append(pid)
            self._running.add(pid)
            self._changed.notify_all()
            running = frozenset(self._running)
            subscribers = list(self._subscribers)
        for callback in subscribers:
            callback(running)

    def exited(self, pid: int) -> None:
        """The child ``pid`` is gone (its commits, if any, were all sent)."""
        with self._changed:
            self._running.discard(pid)
            running = frozenset(self._running)
            subscribers = list(self._subscribers)
        for callback in subscribers:
            callback(running)

    @property
    def running(self) -> frozenset[int]:
        """The children started and not yet gone."""
        with self._changed:
            return frozenset(self._running)

    def subscribe(self, callback: Callable[[frozenset[int]], None]) -> Callable[[], None]:
        """Call ``callback(running pids)`` whenever a child starts or ends; returns the
        function that stops it."""
        with self._changed:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._changed:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def spawned(self, *ids: int, wait: float = 1.0) -> bool:
        """Whether any of ``ids`` is a recent child; waits up to ``wait`` seconds for
        spawns under way to tell their pids."""
        deadline = time.monotonic() + wait
        with self._changed:
            while True:
                if any(i in self._pids for i in ids if i):
                    return True
                remaining = deadline - time.monotonic()
                if not self._pending or remaining <= 0:
                    return False
                self._changed.wait(remaining)


class OwnWriters:
    """Tells our commits from everyone else's (see the module documentation).

    Ours: a commit through one of this process's nfnetlink sockets in the watched
    namespace, or by a child a :class:`ChildProcesses` registry knows. ``portids``
    replaces the ``/proc`` lookup (tests).
    """

    def __init__(
        self,
        children: Sequence[ChildProcesses] = (),
        *,
        portids: Callable[[], set[int]] | None = None,
    ) -> None:
        self.children = tuple(children)
        self._lookup = portids
        self.netns_cookie: int | None = None
        self.sockets: set[int] = set()

    def refresh(self) -> set[int]:
        """Look our sockets up again; their port ids."""
        if self._lookup is not None:
            self.sockets = set(self._lookup())
        else:
            self.sockets = own_netlink_portids(self.netns_cookie)
        return self.sockets

    def is_ours(self, portid: int, pid: int, *, wait: float = 1.0) -> bool:
        """Whether a commit through ``portid`` (by thread ``pid``, 0 when not known yet)
        was ours; waits up to ``wait`` seconds for children being spawned."""
        if portid in self.sockets or portid in self.refresh():
            return True
        return any(c.spawned(portid, pid, wait=wait) for c in self.children)


# --- the socket -------------------------------------------------------------------------------


class EventsLost(OSError):
    """The socket buffer overflowed: messages were dropped (``ENOBUFS``)."""


_FILTER_MAX_PORTIDS: Final = 1000


def _drop_portids_program(portids: Iterable[int]) -> bytes:
    """A classic BPF program dropping datagrams whose first message came from ``portids``.

    ``ld [12]`` loads ``nlmsg_pid`` big-endian while the kernel wrote it in host order, so
    the constants are byte-swapped on little-endian hosts. One commit's messages share a
    port id, and the kernel packs only one commit's messages into a datagram, so the first
    message speaks for the whole datagram. Each ``jeq`` is followed by its own ``ret #0``
    (jump offsets are 8 bits: no common drop instruction can be reached from far away).
    """
    wanted = sorted({p for p in portids if p})[:_FILTER_MAX_PORTIDS]
    program = [(0x20, 0, 0, 12)]  # ld [12]
    for portid in wanted:
        key = int.from_bytes(portid.to_bytes(4, sys.byteorder), "big")
        program.append((0x15, 0, 1, key))  # jeq #key: the next instruction, else skip it
        program.append((0x06, 0, 0, 0))  # ret #0: drop
    program.append((0x06, 0, 0, 0xFFFFFFFF))  # ret #-1: keep
    return b"".join(struct.pack("=HBBI", *insn) for insn in program)


class EventSocket:
    """A netlink socket subscribed to nf_tables events, in ``netns`` or the current one.

    Raises ``OSError`` when it cannot be opened or subscribed (e.g. ``EPERM``).
    """

    def __init__(self, netns: str | None = None, *, rcvbuf: int = _RCVBUF) -> None:
        self._sock = run_in_netns(netns, self._open) if netns is not None else self._open()
        self._sock.setblocking(False)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, rcvbuf)
        except OSError:
            # Without CAP_NET_ADMIN in the namespace's owner: as much as rmem_max allows.
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.netns_cookie = _netns_cookie(self._sock)
        self._filter: bytes | None = None
        # The watcher's thread and the threads spawning our tools both set the filter.
        self._filter_lock = threading.Lock()

    @staticmethod
    def _open() -> socket.socket:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            sock.bind((0, 0))
            sock.setsockopt(_SOL_NETLINK, _NETLINK_ADD_MEMBERSHIP, NFNLGRP_NFTABLES)
        except OSError:
            sock.close()
            raise
        return sock

    def fileno(self) -> int:
        """The socket's descriptor (for ``select``)."""
        return self._sock.fileno()

    @property
    def portid(self) -> int:
        """This socket's own port id."""
        return int(self._sock.getsockname()[0])

    def ignore_portids(self, portids: Iterable[int]) -> None:
        """Have the kernel drop messages committed through these sockets (ours)."""
        code = _drop_portids_program(portids)
        with self._filter_lock:
            if code == self._filter or self._sock.fileno() < 0:
                return
            buffer = ctypes.create_string_buffer(code)
            fprog = struct.pack("@HP", len(code) // 8, ctypes.addressof(buffer))
            self._sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
            self._filter = code

    def receive(self, timeout: float) -> list[bytes]:
        """The datagrams waiting, after waiting up to ``timeout`` seconds for the first.

        Raises :class:`EventsLost` when the kernel dropped messages.
        """
        ready, _, _ = select.select([self._sock], [], [], timeout)
        datagrams: list[bytes] = []
        if not ready:
            return datagrams
        while True:
            try:
                datagrams.append(self._sock.recv(_DATAGRAM_MAX))
            except BlockingIOError:
                return datagrams
            except OSError as err:
                if err.errno == errno.ENOBUFS:
                    raise EventsLost(errno.ENOBUFS, "nf_tables events were dropped") from err
                raise

    def close(self) -> None:
        """Close the socket."""
        with self._filter_lock:
            self._sock.close()


def _getgen_request(sequence: int) -> bytes:
    kind = (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_GETGEN
    return _HEADER.pack(_NLMSG_HEADER_LEN + _NFGENMSG_LEN, kind, _NLM_F_REQUEST, sequence, 0) + (
        b"\0\0\0\0"
    )


def read_generation(netns: str | None = None, timeout: float = 2.0) -> int:
    """The ruleset's current generation id (``NFT_MSG_GETGEN``); raises ``OSError``."""

    def ask() -> int:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as sock:
            sock.settimeout(timeout)
            sock.bind((0, 0))
            sock.send(_getgen_request(1))
            data = sock.recv(65536)
        for item in parse_datagram(data):
            if isinstance(item, Generation):
                return item.generation
        length, kind, *_ = _HEADER.unpack_from(data, 0)
        if kind == _NLMSG_ERROR and length >= 20:
            (code,) = struct.unpack_from("=i", data, 16)
            raise OSError(-code, f"GETGEN refused: {os.strerror(-code)}")
        raise OSError(errno.EPROTO, "no generation in the kernel's answer")

    return run_in_netns(netns, ask) if netns is not None else ask()


class _KernelFilter:
    """What a watcher's socket has the kernel drop: our sockets' messages, and those of
    the children of ours running now (updated from the threads that spawn them)."""

    def __init__(self, events: EventSocket, sockets: set[int]) -> None:
        self._events = events
        self._lock = threading.Lock()
        self.sockets = frozenset(sockets)
        self._running: dict[int, frozenset[int]] = {}
        self._apply()

    def set_sockets(self, sockets: set[int]) -> None:
        """Our sockets' port ids changed (a new one sent its first commit)."""
        with self._lock:
            self.sockets = frozenset(sockets)
            self._apply()

    def set_running(self, registry: ChildProcesses, running: frozenset[int]) -> None:
        """The children of ``registry`` running now."""
        with self._lock:
            self._running[id(registry)] = running
            self._apply()

    def _apply(self) -> None:
        self._events.ignore_portids(self.sockets.union(*self._running.values()))


# --- the watcher ------------------------------------------------------------------------------


@dataclass
class _Fallback:
    """State of the generation-compare fallback."""

    expected: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class NftablesEventWatcher:
    """A :class:`~kubeproxy.selfheal.Watcher` over nf_tables events.

    Reports the foreign commits ``interest`` cares about, a ``missed-events`` change when
    messages were lost, and, when the event socket cannot be opened, falls back to
    comparing the ruleset generation every ``fallback_interval`` seconds with the one
    our last sync left (any foreign commit then counts, relevant or not: there is no
    telling which objects it touched). ``socket_factory`` and ``generation`` replace the
    kernel (tests).
    """

    def __init__(
        self,
        interest: Interest,
        *,
        netns: str | None = None,
        own: OwnWriters | None = None,
        fallback_interval: float = FALLBACK_INTERVAL,
        socket_factory: Callable[[str | None], EventSocket] | None = None,
        generation: Callable[[], int] | None = None,
    ) -> None:
        self.interest = interest
        self.netns = netns
        self.own = own if own is not None else OwnWriters()
        self.fallback_interval = fallback_interval
        self._socket_factory = socket_factory or (lambda ns: EventSocket(ns))
        self._generation = generation or (lambda: read_generation(netns))
        self._fallback: _Fallback | None = None
        self._lost_logged = False
        self.ready = threading.Event()
        """Set once the watcher listens (or has fallen back to polling)."""

    @property
    def name(self) -> str:
        """For thread names and log lines."""
        return f"nft-events ({self.interest.what})"

    def run(self, stop: threading.Event, host: WatchHost) -> None:
        """Watch until ``stop`` is set."""
        try:
            events = self._socket_factory(self.netns)
        except OSError as err:
            logger.warning(
                "Cannot listen to nf_tables events for %s (%s); checking the ruleset "
                "generation every %gs instead",
                self.interest.what,
                err,
                self.fallback_interval,
            )
            self._poll_generation(stop, host)
            return
        try:
            self._listen(events, stop, host.report)
        finally:
            events.close()

    def after_sync(self, proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """In fallback mode, remember the generation our sync left."""
        fallback = self._fallback
        if fallback is None:
            return
        try:
            current = self._generation()
        except OSError as err:
            logger.debug("cannot read the ruleset generation: %s", err)
            return
        with fallback.lock:
            fallback.expected = current

    def _listen(
        self, events: EventSocket, stop: threading.Event, report: Callable[[ExternalChange], None]
    ) -> None:
        own = self.own
        own.netns_cookie = events.netns_cookie
        dropped = _KernelFilter(events, own.refresh() | {events.portid})
        stops = [c.subscribe(functools.partial(dropped.set_running, c)) for c in own.children]
        try:
            self._read(events, stop, report, dropped)
        finally:
            for unsubscribe in stops:
                unsubscribe()

    def _read(
        self,
        events: EventSocket,
        stop: threading.Event,
        report: Callable[[ExternalChange], None],
        dropped: _KernelFilter,
    ) -> None:
        own = self.own
        assembler = CommitAssembler()
        relevant = self.interest.relevant
        # Commits never interleave (the kernel serializes them), so the messages of one
        # run from its first to its NEWGEN, all from one port id. A message from another
        # port id starts the next commit: if the previous one's NEWGEN never came (lost
        # with an overflow, already reported), its changes are dropped rather than
        # counted into the next one. The sender is judged at its commit's first relevant
        # message (a commit touching nothing of ours costs no look at /proc at all). The
        # rest of a commit cut by an overflow is reported like any other: a second full
        # sync rather than a change gone unseen.
        sender: int | None = None
        sender_is_us: bool | None = None
        self.ready.set()
        logger.info("Watching %s for changes by others (nf_tables events)", self.interest.what)
        while not stop.is_set():
            try:
                datagrams = events.receive(0.5)
            except EventsLost:
                assembler.discard()
                sender = None
                self._lost(report)
                continue
            for datagram in datagrams:
                for item in parse_datagram(datagram):
                    if item.portid in dropped.sockets:
                        continue  # ours, queued before the filter knew the socket
                    if item.portid != sender:
                        assembler.discard()  # a commit whose NEWGEN was lost
                        sender, sender_is_us = item.portid, None
                    if isinstance(item, Generation):
                        sender = None
                        if not assembler.pending:
                            continue
                        if sender_is_us or own.is_ours(item.portid, item.pid):
                            assembler.discard()
                            continue
                        commit = assembler.close(item)
                        if commit is not None:
                            for change in self.interest.describe(commit):
                                report(change)
                        continue
                    if sender_is_us or not relevant(item):
                        continue
                    if sender_is_us is None:
                        sender_is_us = own.is_ours(item.portid, 0, wait=0.0)
                        if own.sockets - dropped.sockets:
                            # A socket of ours sent its first commit: filter it from now on.
                            dropped.set_sockets(own.sockets | {events.portid})
                        if sender_is_us:
                            continue
                    assembler.add(item)

    def _lost(self, report: Callable[[ExternalChange], None]) -> None:
        level = logging.DEBUG if self._lost_logged else logging.WARNING
        logger.log(
            level,
            "nf_tables events were lost (socket buffer overflow) while watching %s; "
            "comparing with the kernel once (full sync)%s",
            self.interest.what,
            "" if self._lost_logged else "; later losses are logged at debug level",
        )
        self._lost_logged = True
        report(ExternalChange(KIND_MISSED, f"nf_tables events about {self.interest.what} lost"))

    def _poll_generation(self, stop: threading.Event, host: WatchHost) -> None:
        # Read under the sync locks, so that a sync of ours is never half done when
        # compared; after_sync records what each of our syncs left. A foreign commit
        # landing between a check and our next sync is missed (that sync records the
        # generation it leaves): the fallback is coarser than the events.
        fallback = self._fallback = _Fallback()
        self.ready.set()
        while not stop.wait(self.fallback_interval):
            try:
                with host.syncs_held():
                    current = self._generation()
            except OSError as err:
                logger.debug("cannot read the ruleset generation: %s", err)
                continue
            with fallback.lock:
                expected, fallback.expected = fallback.expected, current
            if expected is not None and current != expected:
                host.report(
                    ExternalChange(
                        KIND_MISSED,
                        f"the ruleset changed (generation {expected} -> {current}) and "
                        f"nf_tables events cannot be had to tell whether {self.interest.what} "
                        "were touched",
                    )
                )
