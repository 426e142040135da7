"""Extended accounting objects (nfacct): the packet counters iptables mode's metrics read.

Upstream's iptables mode counts two kinds of packets with named nfacct objects that its
rules reference (``-m nfacct --nfacct-name NAME``), and exports them as
``kubeproxy_iptables_ct_state_invalid_dropped_packets_total`` (packets dropped in
``KUBE-FORWARD`` because conntrack marked them INVALID) and
``kubeproxy_iptables_localhost_nodeports_accepted_packets_total`` (packets to a NodePort
on a loopback address; upstream's iptables-to-nftables migration guide asks operators to
check it, since nftables mode does not serve such NodePorts).

:class:`NFAcctExecutor` is the narrow interface: make a counter (:meth:`~NFAcctExecutor.ensure`)
and read its packets (:meth:`~NFAcctExecutor.packets`). :class:`NetlinkNFAcct` speaks the
nfnetlink accounting subsystem through pyroute2's netlink sockets and message classes
(pyroute2 has no nfacct API of its own; only the message layout is declared here);
:class:`FakeNFAcct` keeps counters in memory. An object must exist before a rule can name
it, so the backend uses a counter in its rules only once :meth:`~NFAcctExecutor.ensure`
succeeded, as upstream does.
"""

from __future__ import annotations

import errno
import logging
from typing import Any, Final, Protocol

from kubeproxy.extras import missing_extra
from kubeproxy.host.netlink import check_netns
from kubeproxy.host.netns import run_in_netns
from kubeproxy.host.nlmsg import NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST

__all__ = [
    "COUNTERS",
    "CT_STATE_INVALID_DROPPED",
    "LOCALHOST_NODEPORTS_ACCEPTED",
    "FakeNFAcct",
    "NFAcctError",
    "NFAcctExecutor",
    "NetlinkNFAcct",
]

log = logging.getLogger(__name__)

CT_STATE_INVALID_DROPPED: Final = "ct_state_invalid_dropped_pkts"
"""Upstream's counter of packets dropped as conntrack-INVALID in ``KUBE-FORWARD``."""

LOCALHOST_NODEPORTS_ACCEPTED: Final = "localhost_nps_accepted_pkts"
"""Upstream's counter of packets accepted on a NodePort of a loopback address."""

COUNTERS: Final = (CT_STATE_INVALID_DROPPED, LOCALHOST_NODEPORTS_ACCEPTED)
"""Every counter iptables mode makes, in upstream's order."""

_MAX_NAME: Final = 31  # NFACCT_NAME_MAX (32) less the terminating NUL

# nfnetlink_acct message types (linux/netfilter/nfnetlink_acct.h).
_NFNL_MSG_ACCT_NEW: Final = 0
_NFNL_MSG_ACCT_GET: Final = 1
_NLM_F_EXCL: Final = 0x200  # linux/netlink.h, for NEW requests (kubeproxy.host.nlmsg has the rest)


class NFAcctError(OSError):
    """An nfacct request failed; ``errno`` says why (EEXIST, ENOENT, EPERM...)."""


class NFAcctExecutor(Protocol):
    """Named packet counters in the kernel (or in a fake)."""

    def ensure(self, name: str) -> None:
        """Create the counter ``name`` unless it exists; raise :class:`NFAcctError`."""
        ...

    def packets(self, name: str) -> int:
        """The packets counted by ``name``; raise :class:`NFAcctError` (ENOENT if missing)."""
        ...


def _check_name(name: str) -> str:
    if not name or len(name) > _MAX_NAME or not name.isascii() or not name.isprintable():
        raise NFAcctError(errno.EINVAL, f"invalid nfacct counter name {name!r}")
    return name


class FakeNFAcct:
    """:class:`NFAcctExecutor` in memory: ``counters`` maps a name to its packets.

    ``refuse`` (an errno) makes every :meth:`ensure` fail, as a kernel without nfacct or
    a process without ``CAP_NET_ADMIN`` would.
    """

    def __init__(self, refuse: int | None = None) -> None:
        self.counters: dict[str, int] = {}
        self.refuse = refuse

    def ensure(self, name: str) -> None:
        """Create the counter (at 0) unless it exists."""
        if self.refuse is not None:
            raise NFAcctError(self.refuse, f"nfacct {name}: refused (fake)")
        self.counters.setdefault(_check_name(name), 0)

    def packets(self, name: str) -> int:
        """The counter's packets."""
        try:
            return self.counters[name]
        except KeyError:
            raise NFAcctError(errno.ENOENT, f"nfacct {name}: no such counter") from None


def _request_here(name: str, kind: int, flags: int) -> list[Any]:
    """One nfacct request on a socket of the calling thread's namespace: the replies.

    Without pyroute2 (an installation without ``kubeproxy[iptables]``) every request fails
    with :class:`NFAcctError`: the backend then runs without the two counters, after one
    error line per counter naming the extra, as it does when the kernel refuses them.
    """
    try:
        from pyroute2.netlink.exceptions import NetlinkError
    except ModuleNotFoundError:
        what = "Counting packets with nfacct (iptables mode)"
        missing = missing_extra("pyroute2", "iptables", what)
        raise NFAcctError(errno.ENOPKG, f"nfacct {name}: {missing}") from None

    message_class, socket_class = _socket_classes()
    msg = message_class()
    msg["attrs"] = [("NFACCT_NAME", name)]
    try:
        with socket_class(groups=0) as sock:
            return list(sock.acct(msg, kind, flags))
    except NetlinkError as err:
        raise NFAcctError(err.code, f"nfacct {name}: {err}") from None
    except OSError as err:
        raise NFAcctError(err.errno or errno.EIO, f"nfacct {name}: {err}") from None


def _socket_classes() -> tuple[Any, Any]:
    """pyroute2's message and socket classes for nfacct (imported only when used)."""
    from pyroute2.netlink.core import SyncAPI
    from pyroute2.netlink.nfnetlink import NFNL_SUBSYS_ACCT, nfgen_msg
    from pyroute2.netlink.nlsocket import AsyncNetlinkSocket

    class NFAcctMessage(nfgen_msg):  # type: ignore[misc]
        """An nfnetlink_acct message: its attributes (``enum nfnl_acct_type``)."""

        nla_map = (
            ("NFACCT_UNSPEC", "none"),
            ("NFACCT_NAME", "asciiz"),
            ("NFACCT_PKTS", "be64"),
            ("NFACCT_BYTES", "be64"),
            ("NFACCT_USE", "be32"),
            ("NFACCT_FLAGS", "be32"),
            ("NFACCT_QUOTA", "be64"),
            ("NFACCT_FILTER", "hex"),
            ("NFACCT_PAD", "hex"),
        )

    class AsyncNFAcctSocket(AsyncNetlinkSocket):  # type: ignore[misc]
        """A netfilter netlink socket that decodes accounting messages."""

        def __init__(self, **kwargs: Any) -> None:
            from pyroute2.netlink import NETLINK_NETFILTER

            super().__init__(family=NETLINK_NETFILTER, **kwargs)
            self.register_policy(
                {
                    (NFNL_SUBSYS_ACCT << 8) | kind: NFAcctMessage
                    for kind in (_NFNL_MSG_ACCT_NEW, _NFNL_MSG_ACCT_GET)
                }
            )

        async def acct(self, msg: Any, kind: int, flags: int) -> Any:
            return await self.nlm_request(msg, (NFNL_SUBSYS_ACCT << 8) | kind, msg_flags=flags)

    class NFAcctSocket(SyncAPI):  # type: ignore[misc]
        """The synchronous face of :class:`AsyncNFAcctSocket`."""

        def __init__(self, **kwargs: Any) -> None:
            self.asyncore = AsyncNFAcctSocket(**kwargs)

        def acct(self, msg: Any, kind: int, flags: int) -> Any:
            return self._run_sync_cleanup(self.asyncore.acct, msg, kind, flags)

    return NFAcctMessage, NFAcctSocket


class NetlinkNFAcct:
    """:class:`NFAcctExecutor` over nfnetlink (in ``netns`` if given).

    Each call opens a socket and closes it again: counters are made once at start-up and
    read once per scrape, so nothing is gained by holding one open. In a named namespace
    the whole request runs in a helper thread that entered it
    (:func:`~kubeproxy.host.netns.run_in_netns`), not through pyroute2's own ``netns=``, which
    forks the process to open the socket.
    """

    def __init__(self, netns: str | None = None) -> None:
        if netns is not None:
            check_netns(netns)
        self.netns = netns

    def _request(self, name: str, kind: int, flags: int) -> list[Any]:
        msg_name = _check_name(name)
        if self.netns is None:
            return _request_here(msg_name, kind, flags)
        try:
            return run_in_netns(self.netns, lambda: _request_here(msg_name, kind, flags))
        except NFAcctError:
            raise
        except OSError as err:
            raise NFAcctError(err.errno or errno.EIO, f"nfacct {name}: {err}") from None

    def ensure(self, name: str) -> None:
        """``NFNL_MSG_ACCT_NEW`` with ``NLM_F_EXCL``; an existing counter is kept as it is."""
        try:
            self._request(
                name, _NFNL_MSG_ACCT_NEW, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | _NLM_F_EXCL
            )
        except NFAcctError as err:
            if err.errno != errno.EEXIST:
                raise

    def packets(self, name: str) -> int:
        """``NFNL_MSG_ACCT_GET`` of one counter: its packets."""
        for reply in self._request(name, _NFNL_MSG_ACCT_GET, NLM_F_REQUEST | NLM_F_ACK):
            packets = reply.get_attr("NFACCT_PKTS")
            if reply.get_attr("NFACCT_NAME") == name and packets is not None:
                return int(packets)
        raise NFAcctError(errno.ENOENT, f"nfacct {name}: no such counter")
