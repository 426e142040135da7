"""The nftables backend: upstream kube-proxy's nftables behaviour, with rules that scale.

Public API:

* :func:`create_backend` - the ``kubeproxy.backends`` entry point: a backend for one
  family, programming the current network namespace or ``netns`` through libnftables;
* :class:`NftablesBackend` - the backend itself (the map structure); give it
  ``executor=FakeNft()`` for a dry run (the fake starts empty, so the first sync is a cold
  one) and read the fake's transactions (see :func:`render_transactions`);
* :class:`LocalhostNodePortsBackend` - the backend with upstream's localhost NodePorts
  (``KubeProxyNFTablesLocalhostNodePorts``), which :func:`create_backend` returns when the
  gate is on;
* :func:`create_chain_backend` and :class:`ChainNftablesBackend` - the previous,
  per-Service-chain structure, kept so benchmarks measure both side by side;
* :func:`cleanup` - delete our two tables (``ip kube-proxy``, ``ip6 kube-proxy``) and
  nothing else;
* :func:`watchers` - what finds changes others make to our tables, at once (self-healing,
  :mod:`kubeproxy.selfheal`; see :mod:`~kubeproxy.backends.nftables.monitor`).

The rule structure and its reasons are in this package's README.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kubeproxy.backends.nftables.backend import NftablesBackend
from kubeproxy.backends.nftables.localhost import OBJECT_NAMES, LocalhostNodePortsBackend
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.backends.nftables.proxier import ChainNftablesBackend
from kubeproxy.backends.nftables.structure import TABLE
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.config import ProxierConfig
from kubeproxy.featuregates import KUBE_PROXY_NFTABLES_LOCALHOST_NODEPORTS, NFTABLES_NETLINK
from kubeproxy.objects import IPFamily

if TYPE_CHECKING:
    from kubeproxy.backend import Backend
    from kubeproxy.selfheal import Watcher

__all__ = [
    "TABLE",
    "ChainNftablesBackend",
    "LocalhostNodePortsBackend",
    "NftablesBackend",
    "cleanup",
    "create_backend",
    "create_chain_backend",
    "render_transactions",
    "watchers",
]


def create_backend(
    family: IPFamily, config: ProxierConfig, *, netns: str | None = None
) -> NftablesBackend | LocalhostNodePortsBackend:
    """A backend for ``family`` writing through libnftables (in ``netns`` if given).

    Raises :class:`NftError` (from the support check) when nftables mode cannot run here.
    The ``NFTablesNetlink`` gate (on by default) picks how elements reach the kernel (see
    :class:`~kubeproxy.backends.nftables.exec.LibNftables`); with the
    ``KubeProxyNFTablesLocalhostNodePorts`` gate on, the backend comes wrapped in a
    :class:`~kubeproxy.backends.nftables.localhost.LocalhostNodePortsBackend`.
    """
    from kubeproxy.backends.nftables.exec import LibNftables

    netlink = config.feature_gates.enabled(NFTABLES_NETLINK)
    executor = LibNftables(netns=netns, netlink_elements=netlink)
    if not config.feature_gates.enabled(KUBE_PROXY_NFTABLES_LOCALHOST_NODEPORTS):
        return NftablesBackend(family, config, executor=executor)
    inner = NftablesBackend(family, config, executor=executor, kept=OBJECT_NAMES)
    return LocalhostNodePortsBackend.create(inner, config, executor, netns=netns)


def create_chain_backend(
    family: IPFamily, config: ProxierConfig, *, netns: str | None = None
) -> ChainNftablesBackend:
    """The per-Service-chain structure (the previous default), for comparisons."""
    from kubeproxy.backends.nftables.exec import LibNftables

    return ChainNftablesBackend(family, config, executor=LibNftables(netns=netns))


def cleanup(netns: str | None = None) -> None:
    """Delete ``table ip kube-proxy`` and ``table ip6 kube-proxy`` (missing ones are fine).

    Never touches any other table. Raises :class:`NftError` if a deletion fails for
    another reason than the table being absent.
    """
    from kubeproxy.backends.nftables.exec import LibNftables, delete_table

    executor = LibNftables(netns=netns)
    for family in (Family.IP, Family.IP6):
        delete_table(executor, family, TABLE)


def render_transactions(transactions: Iterable[Transaction]) -> str:
    """The ``nft -f`` text of transactions (e.g. a dry run's), separated by a comment line."""
    parts = []
    for number, tx in enumerate(transactions, 1):
        parts.append(f"# transaction {number}: {tx.num_operations} operations\n{tx.render()}")
    return "".join(parts)


def watchers(backends: Sequence[Backend], netns: str | None = None) -> list[Watcher]:
    """Watchers reporting other processes' changes to the tables of ``backends`` (one per
    family, in ``netns`` if given), for :class:`~kubeproxy.selfheal.SelfHealer`."""
    from kubeproxy.backends.nftables import monitor

    return monitor.watchers([b.family for b in backends], netns)
