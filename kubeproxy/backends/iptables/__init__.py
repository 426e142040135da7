"""The iptables backend: upstream kube-proxy's iptables mode, chain for chain.

Public API:

* :func:`create_backend` - the ``kubeproxy.backends`` entry point: a backend for one
  family, programming the current network namespace or ``netns`` with the node's
  iptables variant (nft or legacy, detected as upstream's iptables-wrapper does);
* :func:`create_legacy_backend` - the same with the legacy variant fixed (tests, nodes
  whose detection would guess wrong);
* :class:`IptablesBackend` - the backend itself; give it ``executor=FakeIptables()``
  for a dry run and read the fake's ``restores`` or ``dump()``; ``nfacct`` (the real
  backend's :class:`~kubeproxy.backends.iptables.nfacct.NetlinkNFAcct`) adds upstream's
  packet counters to the rules;
* :func:`cleanup` - remove every chain any iptables-mode kube-proxy made, in both
  families and both variants, and nothing else; :func:`cleanup_leftovers` - only the one
  of ours upstream's iptables mode leaves when it takes a node back;
* :func:`watchers` - what finds changes others make to our chains (self-healing,
  :mod:`kubeproxy.selfheal`; see :mod:`~kubeproxy.backends.iptables.monitor`).

The chains, the rule structure and our one extension (rejecting unknown ports of cluster
IPs, dropping unallocated service IPs) are described in this package's README.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kubeproxy.backends.iptables.exec import (
    IptablesCommands,
    IptablesError,
    IptablesPermissionError,
    IptablesVariant,
    check_support,
    legacy_tables,
    tool_name,
)
from kubeproxy.backends.iptables.nfacct import NetlinkNFAcct
from kubeproxy.backends.iptables.nftchains import remove_ours
from kubeproxy.backends.iptables.proxier import (
    IptablesBackend,
    cleanup_family,
    cleanup_leftovers_family,
    owns_chain,
)
from kubeproxy.backends.iptables.restore import FILTER, MANGLE, NAT
from kubeproxy.config import ProxierConfig
from kubeproxy.host.netns import run_in_netns
from kubeproxy.objects import IPFamily

if TYPE_CHECKING:
    from kubeproxy.selfheal import Watcher

__all__ = [
    "IptablesBackend",
    "cleanup",
    "cleanup_leftovers",
    "create_backend",
    "create_legacy_backend",
    "watchers",
]

log = logging.getLogger(__name__)

_ROUTE_LOCALNET = Path("/proc/sys/net/ipv4/conf/all/route_localnet")


def _route_localnet_setter(netns: str | None) -> Callable[[], None]:
    """Set ``route_localnet=1`` in the node's namespace (localhost NodePorts, as upstream)."""

    def write() -> None:
        if _ROUTE_LOCALNET.read_text().strip() != "1":
            _ROUTE_LOCALNET.write_text("1\n")

    if netns is None:
        return write
    name = netns
    return lambda: run_in_netns(name, write)


def _create(
    family: IPFamily,
    config: ProxierConfig,
    netns: str | None,
    variant: IptablesVariant | None,
) -> IptablesBackend:
    executor = IptablesCommands(variant, netns=netns)
    check_support(executor, (family,))
    return IptablesBackend(
        family,
        config,
        executor=executor,
        route_localnet=_route_localnet_setter(netns),
        nfacct=NetlinkNFAcct(netns),
    )


def create_backend(
    family: IPFamily, config: ProxierConfig, *, netns: str | None = None
) -> IptablesBackend:
    """A backend for ``family`` with the node's iptables variant (in ``netns`` if given).

    Raises :class:`~kubeproxy.backends.iptables.exec.IptablesError` when iptables mode
    cannot run here (tools missing, no nat table).
    """
    return _create(family, config, netns, None)


def create_legacy_backend(
    family: IPFamily, config: ProxierConfig, *, netns: str | None = None
) -> IptablesBackend:
    """Like :func:`create_backend`, with iptables-legacy whatever the node uses."""
    return _create(family, config, netns, IptablesVariant.LEGACY)


def cleanup(netns: str | None = None, *, wait: float = 5.0) -> None:
    """Remove what any iptables-mode kube-proxy made, in both families and both variants.

    A variant whose tools are not installed is skipped, as is a family whose tables
    cannot be read (no IPv6, say). iptables-legacy is looked at only where it has tables
    (``/proc/net/ip_tables_names``), and only those tables are read, so a node without
    legacy tables does not get empty ones. Kubelet's chains and everyone else's are left
    alone. ``wait`` is how long iptables-legacy waits for the host's xtables lock.

    Raises :class:`~kubeproxy.backends.iptables.exec.IptablesError` when a removal fails,
    and :class:`~kubeproxy.backends.iptables.exec.IptablesPermissionError` (naming the
    capability, ``CAP_NET_RAW`` for iptables-legacy) when tables that may hold our chains
    cannot be read for want of privilege; the other variants and families are cleaned
    first.
    """
    _each_variant(netns, wait, _remove_chains)


def _remove_chains(executor: IptablesCommands, family: IPFamily, tables: Collection[str]) -> None:
    """:func:`~kubeproxy.backends.iptables.proxier.cleanup_family`; with iptables-nft as
    one nf_tables transaction per table (:mod:`~kubeproxy.backends.iptables.nftchains`:
    iptables-nft-restore's cost grows with the square of the chains), the tools doing it
    only if the kernel refuses that."""
    if executor.variant is IptablesVariant.NFT:
        try:
            remove_ours(family, tables, owns_chain, executor.netns)
        except OSError as err:  # NftError is one; a refusal changed nothing
            log.info("%s: removing our chains in one batch failed (%s)", family, err)
        else:
            return
        try:
            executor.save(family, NAT)
        except IptablesPermissionError:
            raise
        except IptablesError as err:
            log.debug("skipping %s %s cleanup: %s", executor.variant, family, err)
            return
    cleanup_family(executor, family, tables)


def cleanup_leftovers(netns: str | None = None, *, wait: float = 5.0) -> None:
    """Remove what only our iptables mode makes and nothing uses any more (``--cleanup-
    leftovers``, after upstream's kube-proxy took the node back): ``KUBE-SERVICE-IPS``,
    in both families and variants, when no rule jumps to it
    (:func:`~kubeproxy.backends.iptables.proxier.cleanup_leftovers_family`). Everything
    else iptables mode writes is upstream's, by name. Raises as :func:`cleanup`.
    """
    _each_variant(netns, wait, cleanup_leftovers_family)


def _each_variant(
    netns: str | None,
    wait: float,
    action: Callable[[IptablesCommands, IPFamily, Collection[str]], object],
) -> None:
    """``action(executor, family, tables)`` for both variants and families whose tools
    exist and whose tables can be read (see :func:`cleanup`)."""
    denied: list[IptablesPermissionError] = []
    for variant in (IptablesVariant.NFT, IptablesVariant.LEGACY):
        executor = IptablesCommands(variant, netns=netns, wait=wait)
        for family in (IPFamily.IPV4, IPFamily.IPV6):
            if shutil.which(tool_name(variant, family, "-restore")) is None:
                continue
            tables: Collection[str] = (NAT, FILTER, MANGLE)
            if variant is IptablesVariant.LEGACY:
                tables = legacy_tables(family, netns) & {NAT, FILTER, MANGLE}
                if not tables:
                    log.debug("no iptables-legacy %s tables of ours: nothing to remove", family)
                    continue
                try:
                    # Whether this process may read them (iptables-legacy's raw socket).
                    executor.save(family, NAT if NAT in tables else min(tables))
                except IptablesPermissionError as err:
                    denied.append(err)
                    continue
                except IptablesError as err:
                    log.debug("skipping %s %s cleanup: %s", variant, family, err)
                    continue
            try:
                action(executor, family, tables)
            except IptablesPermissionError as err:
                denied.append(err)
    if denied:
        raise denied[0]


def watchers(backends: Sequence[IptablesBackend], netns: str | None = None) -> list[Watcher]:
    """Watchers reporting others' changes to the chains of ``backends`` (one per family,
    in ``netns`` if given), for :class:`~kubeproxy.selfheal.SelfHealer`: canary checks,
    and nf_tables events with iptables-nft."""
    from kubeproxy.backends.iptables import monitor

    return monitor.watchers(backends, netns)
