"""The socket subscribed to nf_tables events, its kernel filter, and the generation query."""

from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
import struct
import sys
import threading
from collections.abc import Iterable
from typing import Final

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.host.children import ChildProcesses
from kubeproxy.host.netns import run_in_netns
from kubeproxy.nftevents.messages import NETLINK_NETFILTER, Generation, parse_datagram
from kubeproxy.nftevents.ownership import socket_netns_cookie

__all__ = ["NFNLGRP_NFTABLES", "EventSocket", "EventsLost", "read_generation"]

NFNLGRP_NFTABLES: Final = 7
"""The multicast group carrying nf_tables change events."""

_NFT_MSG_GETGEN: Final = 16
_SO_RCVBUFFORCE: Final = 33
_SO_ATTACH_FILTER: Final = 26
_RCVBUF: Final = 32 << 20
_DATAGRAM_MAX: Final = 1 << 20


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
        self.netns_cookie = socket_netns_cookie(self._sock)
        self._filter: bytes | None = None
        # The watcher's thread and the threads spawning our tools both set the filter.
        self._filter_lock = threading.Lock()

    @staticmethod
    def _open() -> socket.socket:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            sock.bind((0, 0))
            sock.setsockopt(nlmsg.SOL_NETLINK, nlmsg.NETLINK_ADD_MEMBERSHIP, NFNLGRP_NFTABLES)
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
    kind = nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_NFTABLES, _NFT_MSG_GETGEN)
    return nlmsg.message(kind, nlmsg.NLM_F_REQUEST, sequence, nlmsg.NFGEN.pack(0, 0, 0))


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
        length, kind, *_ = nlmsg.HEADER.unpack_from(data, 0)
        if kind == nlmsg.NLMSG_ERROR and length >= nlmsg.HEADER.size + nlmsg.ERRNO.size:
            code = nlmsg.error_code(data, 0)
            raise OSError(code, f"GETGEN refused: {os.strerror(code)}")
        raise OSError(errno.EPROTO, "no generation in the kernel's answer")

    return run_in_netns(netns, ask) if netns is not None else ask()


class KernelFilter:
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
