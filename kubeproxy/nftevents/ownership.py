"""Who we are: the nfnetlink sockets of this process and the children it spawned.

Our commits are recognised by the port id in each message's header (see
:mod:`kubeproxy.nftevents` for why not by the ``NEWGEN`` pid alone).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Sequence
from typing import Final

from kubeproxy.host.children import ChildProcesses
from kubeproxy.nftevents.messages import NETLINK_NETFILTER

__all__ = ["OwnWriters", "own_netlink_portids", "socket_netns_cookie"]

_SO_NETNS_COOKIE: Final = 71


def socket_netns_cookie(sock: socket.socket) -> int | None:
    """The cookie of the network namespace ``sock`` lives in (None before kernel 5.14)."""
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
                cookie = socket_netns_cookie(sock)
                if cookie is not None and cookie != netns_cookie:
                    continue
            portid = sock.getsockname()[0]
            if portid:
                found.add(portid)
    return found


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
