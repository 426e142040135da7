"""The host's own IP addresses, read over netlink (the executor behind ``nodePortAddresses``).

:class:`HostAddresses` asks the kernel through pyroute2; :class:`FakeHostAddresses` holds
addresses in memory for tests. Both satisfy :class:`HostAddressLister`.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from kubeproxy.objects import IPAddress

__all__ = [
    "NETNS_DIR",
    "FakeHostAddresses",
    "HostAddressLister",
    "HostAddresses",
    "NetnsNotFoundError",
    "check_netns",
]

logger = logging.getLogger(__name__)

NETNS_DIR = Path("/run/netns")
"""Where ``ip netns`` keeps named network namespaces."""


class NetnsNotFoundError(LookupError):
    """A named network namespace does not exist."""


def check_netns(netns: str, netns_dir: Path = NETNS_DIR) -> None:
    """Raise unless ``netns`` is a valid name of an existing named network namespace.

    pyroute2 silently creates a missing namespace, so a typo would otherwise program an
    empty one.
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
    """:class:`HostAddressLister` over netlink (pyroute2 ``IPRoute``)."""

    def __init__(self, netns_dir: Path = NETNS_DIR) -> None:
        self._netns_dir = netns_dir

    def list_addresses(self, netns: str | None = None) -> list[IPAddress]:
        """Dump the addresses of every interface, sorted by family then value, unique."""
        # Imported here: pyroute2 is heavy and only this executor needs it.
        from pyroute2 import IPRoute

        # groups=0: a dump-only socket must not subscribe to address/route events.
        kwargs: dict[str, Any] = {"groups": 0}
        if netns is not None:
            check_netns(netns, self._netns_dir)
            kwargs["netns"] = netns
            # Never let pyroute2 create the namespace should it vanish after the check.
            kwargs["flags"] = 0
        with IPRoute(**kwargs) as ipr:
            messages = list(ipr.addr("dump"))
        return _unique_sorted(_address_of(m) for m in messages)


def _address_of(message: Mapping[str, Any] | Any) -> IPAddress | None:
    # IFA_LOCAL is the local end on point-to-point links (IFA_ADDRESS is then the peer);
    # IPv6 messages carry only IFA_ADDRESS.
    text = message.get("IFA_LOCAL") or message.get("IFA_ADDRESS")
    if not text:
        return None
    try:
        return ipaddress.ip_address(str(text).split("%", 1)[0])
    except ValueError:
        logger.warning("netlink: ignoring unparsable interface address %r", text)
        return None


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
