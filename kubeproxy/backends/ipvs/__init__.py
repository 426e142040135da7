"""The ipvs backend (DEPRECATED): upstream kube-proxy's ipvs mode.

Upstream deprecated the ipvs proxier in v1.35 (KEP-5495) and plans to remove it; this
backend exists for clusters still on it and warns (a DeprecationWarning, once per process;
the binaries log the deprecation and post an Event). Use ``nftables``.

Public API:

* :func:`create_backend` - the ``kubeproxy.backends`` entry point: warns
  (:class:`DeprecationWarning`, once per process), checks that IPVS works here (raising
  :class:`IPVSUnsupported` saying ``kernel lacks IP_VS`` when the kernel has no IPVS,
  which the flow-case runner reports as a skip), then builds an :class:`IPVSBackend`
  over pyroute2 (IPVS, ``kube-ipvs0``), the ``ipset`` tool and iptables;
* :class:`IPVSBackend` - the backend, for any executors (the fakes in
  :mod:`kubeproxy.backends.ipvs.fake` for tests and dry runs);
* :func:`cleanup` - remove everything ipvs mode creates, on any kernel;
  :func:`handover` - the same once another mode serves the node, keeping the virtual
  servers of established connections until they end
  (:mod:`~kubeproxy.backends.ipvs.handover`).

Structure and limits are in this package's README.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from kubeproxy.backends.ipvs.handover import DRAIN_LIMIT
from kubeproxy.backends.ipvs.ipset import IPSetCommands, IPSetError
from kubeproxy.backends.ipvs.netlink import (
    DUMMY_DEVICE,
    IPVSError,
    IPVSUnsupported,
    LinkError,
    LinkExecutor,
    PyrouteIPVS,
    PyrouteLinks,
    check_ipvs_support,
)
from kubeproxy.backends.ipvs.proxier import IPVSBackend
from kubeproxy.backends.ipvs.sysctls import FileSysctlApplier
from kubeproxy.config import ProxierConfig
from kubeproxy.extras import require_extra
from kubeproxy.host.netlink import check_netns
from kubeproxy.host.netns import run_in_netns
from kubeproxy.objects import IPAddress, IPFamily

if TYPE_CHECKING:
    from kubeproxy.selfheal import Watcher

__all__ = [
    "DEPRECATION_MESSAGE",
    "DUMMY_DEVICE",
    "IPVSBackend",
    "IPVSUnsupported",
    "cleanup",
    "create_backend",
    "handover",
    "watchers",
]

log = logging.getLogger(__name__)

DEPRECATION_MESSAGE: Final = (
    "The ipvs proxier is now deprecated and may be removed in a future release. "
    "Please use 'nftables' instead."
)
"""Upstream's deprecation text (kubernetes/kubernetes#134539)."""

_warned = False


def _warn_deprecated() -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(DEPRECATION_MESSAGE, DeprecationWarning, stacklevel=3)


def create_backend(
    family: IPFamily, config: ProxierConfig, *, netns: str | None = None
) -> IPVSBackend:
    """A deprecated ipvs-mode backend for ``family`` (in ``netns`` if given).

    Raises :class:`IPVSUnsupported` (``kernel lacks IP_VS ...``) when the kernel has no
    IPVS, or the scheduler cannot be used; :class:`IPSetError` when the ``ipset`` tool
    is missing; ``IptablesError`` when iptables cannot run;
    :class:`~kubeproxy.extras.MissingExtra` without pyroute2 (``kubeproxy[ipvs]``).
    """
    _warn_deprecated()
    require_extra("pyroute2", "ipvs", "ipvs mode")
    from kubeproxy.backends.iptables.exec import IptablesCommands, check_support

    if netns is not None:
        check_netns(netns)
    ipvs = PyrouteIPVS(netns=netns)
    check_ipvs_support(ipvs, config.ipvs.scheduler or "rr")
    ipsets = IPSetCommands(netns=netns)
    try:
        ipsets.version()
    except IPSetError as err:
        raise IPSetError(f"ipvs mode needs the ipset tool: {err}") from err
    iptables = IptablesCommands(netns=netns)
    check_support(iptables, (family,))
    return IPVSBackend(
        family,
        config,
        ipvs=ipvs,
        links=PyrouteLinks(netns=netns),
        ipsets=ipsets,
        iptables=iptables,
        sysctls=FileSysctlApplier(netns=netns),
    )


def cleanup(netns: str | None = None) -> None:
    """Remove ipvs mode's virtual servers, ``kube-ipvs0``, iptables chains and ipsets.

    Works without IPVS in the kernel (the virtual-server part is then skipped). Only our
    virtual servers are deleted (see :func:`~.proxier.cleanup_family`; upstream flushes
    every one), only our chains, jumps and sets. Raises the first error met after trying
    everything.
    """
    _remove(netns, None, limit=0.0)


def handover(netns: str | None = None, stop: threading.Event | None = None) -> None:
    """:func:`cleanup` once another mode's rules serve the node, keeping each virtual
    server that carries connections until they end (at most
    :data:`~kubeproxy.backends.ipvs.handover.DRAIN_LIMIT`), then the IPVS sysctls back
    to the kernel's defaults (:mod:`~kubeproxy.backends.ipvs.handover`); ``stop`` cuts
    the wait short."""
    _remove(netns, stop, limit=DRAIN_LIMIT)


def _remove(netns: str | None, stop: threading.Event | None, *, limit: float) -> None:
    from kubeproxy.backends.iptables.exec import IptablesCommands
    from kubeproxy.backends.ipvs.handover import Executors, handover

    if netns is not None:
        check_netns(netns)
    loaded, device = _traces(netns)
    if loaded or device:  # only then is there IPVS state or a link to read through netlink
        require_extra("pyroute2", "ipvs", "Removing ipvs mode's virtual servers")
    ipvs: PyrouteIPVS | None = None
    if loaded:
        probe = PyrouteIPVS(netns=netns)
        ipvs = probe
        try:
            probe.virtual_servers()
        except IPVSError:
            probe.close()
            ipvs = None
    links: LinkExecutor = PyrouteLinks(netns=netns) if device else _NoDevice()
    executors = Executors(ipvs, links, IPSetCommands(netns=netns), IptablesCommands(netns=netns))
    try:
        handover(executors, stop, netns=netns, limit=limit)
    finally:
        executors.close()


def _traces(netns: str | None) -> tuple[bool, bool]:
    """Whether IPVS is loaded in the namespace's kernel, and whether ``kube-ipvs0`` exists.

    Without either, no virtual server and no dummy device of ipvs mode can be there, and
    the cleanup needs no pyroute2 (its import and IPVS lookup were about 0.1 s of every
    nftables-mode start).
    """

    def look() -> tuple[bool, bool]:
        loaded = os.path.exists("/proc/thread-self/net/ip_vs")
        try:
            socket.if_nametoindex(DUMMY_DEVICE)
        except OSError:
            return loaded, False
        return loaded, True

    return look() if netns is None else run_in_netns(netns, look)


class _NoDevice:
    """The :class:`~.netlink.LinkExecutor` of a namespace without ``kube-ipvs0``: nothing
    to list or delete (a cleanup never adds)."""

    def ensure_link(self, name: str) -> bool:
        raise LinkError(f"cannot create {name} during a cleanup")

    def delete_link(self, name: str) -> bool:
        return False

    def addresses(self, name: str) -> set[IPAddress]:
        return set()

    def add_address(self, name: str, address: IPAddress) -> None:
        raise LinkError(f"cannot add {address} to {name} during a cleanup")

    def delete_address(self, name: str, address: IPAddress) -> None:
        raise LinkError(f"no link {name}")


def watchers(backends: Sequence[IPVSBackend], netns: str | None = None) -> list[Watcher]:
    """Watchers reporting others' changes to the iptables chains of ``backends`` (one per
    family, in ``netns`` if given): nf_tables events where iptables is iptables-nft.

    ipvs mode writes no canary chains, and neither IPVS nor ipsets announce changes, so
    its virtual servers and sets are put back by the periodic full sync only.
    """
    from kubeproxy.backends.iptables.exec import IptablesVariant
    from kubeproxy.backends.iptables.monitor import event_watcher
    from kubeproxy.backends.ipvs.rules import CHAINS
    from kubeproxy.host.children import ChildProcesses

    nft = [b for b in backends if b.iptables.variant is IptablesVariant.NFT]
    if not nft:
        return []
    children = [
        c for b in nft if isinstance(c := getattr(b.iptables, "children", None), ChildProcesses)
    ]
    owned = frozenset(CHAINS)
    return [
        event_watcher(
            lambda table, chain: (table, chain) in owned, [b.family for b in nft], children, netns
        )
    ]
