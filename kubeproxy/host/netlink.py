"""The host's own IP addresses, read over netlink (the executor behind ``nodePortAddresses``).

:class:`HostAddresses` asks the kernel (an ``RTM_GETADDR`` dump); :class:`FakeHostAddresses`
holds addresses in memory for tests. Both satisfy :class:`HostAddressLister`.
:class:`AddressWatcher` listens for the kernel's address events, so the proxy reads the
addresses again when, and only when, one was added or removed.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import selectors
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.host.netns import run_in_netns
from kubeproxy.objects import IPAddress

__all__ = [
    "NETNS_DIR",
    "AddressWatcher",
    "FakeHostAddresses",
    "HostAddressLister",
    "HostAddresses",
    "NetnsNotFoundError",
    "check_netns",
    "netlink_dump",
]

logger = logging.getLogger(__name__)

NETNS_DIR = Path("/run/netns")
"""Where ``ip netns`` keeps named network namespaces."""


class NetnsNotFoundError(LookupError):
    """A named network namespace does not exist."""


def check_netns(netns: str, netns_dir: Path = NETNS_DIR) -> None:
    """Raise unless ``netns`` is a valid name of an existing named network namespace.

    Checked first so a typo names the missing namespace (and netlink libraries that
    create a missing namespace never get the chance to program an empty one).
    """
    if not netns or netns in (".", "..") or "/" in netns or "\0" in netns:
        raise ValueError(f"invalid network namespace name {netns!r}")
    if not (netns_dir / netns).exists():
        raise NetnsNotFoundError(f"network namespace {netns!r} not found in {netns_dir}")


class HostAddressLister(Protocol):
    """Lists the IP addresses configured on the host's interfaces."""

    def list_addresses(self, netns: str | None = None) -> list[IPAddress]:
        """Every address on every interface (of ``netns`` when given), loopback included."""
        ...


class HostAddresses:
    """:class:`HostAddressLister` over a netlink socket of its own (``RTM_GETADDR`` dump).

    Hand-written rather than pyroute2's ``IPRoute``: measured at start-up of the binaries,
    pyroute2 took 120 ms for the first dump of a process (its import and event loop) and
    28 ms for each later one, this about 1 ms; and pyroute2's ``netns=`` forks the
    process, where this opens its socket from a helper thread inside the namespace
    (:func:`kubeproxy.host.netns.run_in_netns`).
    """

    def __init__(self, netns_dir: Path = NETNS_DIR) -> None:
        self._netns_dir = netns_dir

    def list_addresses(self, netns: str | None = None) -> list[IPAddress]:
        """Dump the addresses of every interface, sorted by family then value, unique."""
        if netns is None:
            return _dump_addresses()
        check_netns(netns, self._netns_dir)
        return run_in_netns(netns, _dump_addresses)


_RTM_NEWADDR = 20
_RTM_DELADDR = 21
_RTM_GETADDR = 22
# Multicast groups (the bit masks bind() takes): addresses added or removed.
_RTMGRP_IPV4_IFADDR = 0x10
_RTMGRP_IPV6_IFADDR = 0x100
_IFA_ADDRESS = 1
_IFA_LOCAL = 2
_IFADDRMSG = struct.Struct("=BBBBI")


netlink_dump = nlmsg.dump
"""Send a dump request and yield each answer's type and payload
(:func:`kubeproxy.host.nlmsg.dump`; the name stays here for code that imported it from here)."""


def _dump_addresses() -> list[IPAddress]:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.bind((0, 0))
        sock.settimeout(10.0)
        request = _IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        dump = nlmsg.message(_RTM_GETADDR, nlmsg.NLM_F_REQUEST | nlmsg.NLM_F_DUMP, 1, request)
        found = [
            _address_of(payload)
            for kind, payload in nlmsg.dump(sock, dump, 1, "RTM_GETADDR")
            if kind == _RTM_NEWADDR
        ]
        return _unique_sorted(found)


def _address_of(data: bytes) -> IPAddress | None:
    family = data[0]
    size = 4 if family == socket.AF_INET else 16 if family == socket.AF_INET6 else 0
    attrs = dict(nlmsg.attribute_values(data, _IFADDRMSG.size))
    # IFA_LOCAL is the local end on point-to-point links (IFA_ADDRESS is then the peer);
    # IPv6 messages carry only IFA_ADDRESS.
    raw = attrs.get(_IFA_LOCAL) or attrs.get(_IFA_ADDRESS)
    if not size or raw is None or len(raw) != size:
        logger.warning("netlink: ignoring an interface address of family %d", family)
        return None
    return ipaddress.ip_address(raw)


def _unique_sorted(addresses: Iterable[IPAddress | None]) -> list[IPAddress]:
    unique = {a for a in addresses if a is not None}
    return sorted(unique, key=lambda a: (a.version, int(a)))


class FakeHostAddresses:
    """In-memory :class:`HostAddressLister`: addresses per namespace (``None`` = current).

    Asking for a namespace it does not know raises :class:`NetnsNotFoundError`, like the
    real one. ``calls`` counts queries so tests can check how often addresses are read.
    """

    def __init__(
        self,
        addresses: Sequence[IPAddress] = (),
        namespaces: Mapping[str, Sequence[IPAddress]] | None = None,
    ) -> None:
        self.by_netns: dict[str | None, list[IPAddress]] = {None: list(addresses)}
        for name, addrs in (namespaces or {}).items():
            self.by_netns[name] = list(addrs)
        self.calls = 0

    def set_addresses(self, addresses: Sequence[IPAddress], netns: str | None = None) -> None:
        """Replace the addresses of one namespace (creating it in the fake)."""
        self.by_netns[netns] = list(addresses)

    def list_addresses(self, netns: str | None = None) -> list[IPAddress]:
        """The stored addresses, sorted and unique."""
        self.calls += 1
        if netns not in self.by_netns:
            raise NetnsNotFoundError(f"network namespace {netns!r} not found (fake)")
        return _unique_sorted(self.by_netns[netns])


class AddressWatcher:
    """Calls ``changed()`` whenever an address is added to or removed from an interface
    (of ``netns`` when given), from a thread of its own (:meth:`run`).

    Upstream reads the node's addresses at every sync; a netlink dump of them costs
    about 0.03 ms on a warm machine and 0.17 ms in a daemon that syncs once a second
    (caches cold: measured at 30k Services, a quarter of such a partial sync). Listening
    to the kernel's ``RTM_NEWADDR``/``RTM_DELADDR`` events costs nothing while nothing
    changes, and a new address is followed at once instead of at the next unrelated
    sync. A lost event (the socket's buffer overflowed) counts as a change. The thread
    sleeps until an event comes, :meth:`close` is called, or ``poll_interval`` passes
    (then it looks at ``stop``). :attr:`listening` is set once the thread is subscribed:
    a change made before that is not heard (only the next full sync follows it).
    """

    def __init__(
        self,
        changed: Callable[[], None],
        netns: str | None = None,
        *,
        netns_dir: Path = NETNS_DIR,
        poll_interval: float = 5.0,
    ) -> None:
        self.changed = changed
        self.netns = netns
        self._netns_dir = netns_dir
        self.poll_interval = poll_interval
        self._lock = threading.Lock()
        self._wake: socket.socket | None = None
        self._closed = False
        self.listening = threading.Event()
        """Set once :meth:`run` is subscribed to the address events (never if it cannot
        be): a caller that must hear a change it makes next waits for it, since the
        thread that subscribes may start late on a busy machine."""

    def close(self) -> None:
        """Have :meth:`run` return now (or as soon as it starts)."""
        with self._lock:
            self._closed = True
            if self._wake is not None:
                with contextlib.suppress(OSError):
                    self._wake.send(b"x")

    def _open(self) -> socket.socket:
        def make() -> socket.socket:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
            try:
                sock.bind((0, _RTMGRP_IPV4_IFADDR | _RTMGRP_IPV6_IFADDR))
            except OSError:
                sock.close()
                raise
            return sock

        if self.netns is None:
            return make()
        check_netns(self.netns, self._netns_dir)
        return run_in_netns(self.netns, make)

    def run(self, stop: threading.Event) -> None:
        """Listen until ``stop`` is set (seen within ``poll_interval``) or :meth:`close`."""
        try:
            sock = self._open()
        except (OSError, LookupError, ValueError) as err:  # LookupError: no such netns
            logger.error(
                "Cannot watch the host's addresses (%s); nodePortAddresses follow them only "
                "at full syncs",
                err,
            )
            return
        woken, wake = socket.socketpair()
        with self._lock:
            self._wake = wake
        self.listening.set()  # bound: every event from here on is queued on ``sock``
        with sock, woken, wake, selectors.DefaultSelector() as selector:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
            selector.register(woken, selectors.EVENT_READ)
            while not stop.is_set() and not self._closed:
                if not selector.select(self.poll_interval):
                    continue
                try:
                    data = sock.recv(1 << 16)
                except BlockingIOError:
                    continue  # the wake-up, not an event
                except OSError as err:
                    if err.errno != errno.ENOBUFS:
                        logger.error("Watching the host's addresses failed: %s", err)
                        return
                    self._notify()  # events were lost: one of them may have been ours
                    continue
                if _has_address_event(data):
                    self._notify()
        with self._lock:
            self._wake = None
        self.listening.clear()

    def _notify(self) -> None:
        try:
            self.changed()
        except Exception:  # a listener's surprise must not stop the watch
            logger.exception("host address listener failed")


def _has_address_event(data: bytes) -> bool:
    try:
        return any(
            kind in (_RTM_NEWADDR, _RTM_DELADDR) for _o, _l, kind, *_ in nlmsg.messages(data)
        )
    except nlmsg.MalformedMessage:
        return False
