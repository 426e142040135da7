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
* :func:`cleanup` - delete our two tables (``ip kube-proxy``, ``ip6 kube-proxy``) and
  nothing else; :func:`cleanup_leftovers` - only what of ours upstream's nftables mode
  leaves in them when it takes a node back (:mod:`~kubeproxy.backends.nftables.handback`);
* :func:`watchers` - what finds changes others make to our tables, at once (self-healing,
  :mod:`kubeproxy.selfheal`; see :mod:`~kubeproxy.backends.nftables.monitor`).

The rule structure and its reasons are in this package's README.

Deprecated: ``create_chain_backend`` and ``ChainNftablesBackend``, the previous,
per-Service-chain structure, moved to the benchmarks (``bench.chain_structure`` in a source
checkout), which measure it next to this one. Until the next release they are still found
here, with a :class:`DeprecationWarning`, where ``bench`` can be imported; elsewhere
(an installed package has no ``bench``) the :class:`AttributeError` names the new place.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kubeproxy.backends.nftables.backend import NftablesBackend
from kubeproxy.backends.nftables.localhost import (  # noqa: F401 (OBJECT_NAMES: importable here before)
    KEPT_OBJECTS,
    OBJECT_NAMES,
    LocalhostNodePortsBackend,
)
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.backends.nftables.table import TABLE
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.config import ProxierConfig
from kubeproxy.featuregates import KUBE_PROXY_NFTABLES_LOCALHOST_NODEPORTS, NFTABLES_NETLINK
from kubeproxy.objects import IPFamily

if TYPE_CHECKING:
    from kubeproxy.backend import Backend
    from kubeproxy.selfheal import Watcher

__all__ = [
    "TABLE",
    "LocalhostNodePortsBackend",
    "NftablesBackend",
    "cleanup",
    "cleanup_leftovers",
    "create_backend",
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
    inner = NftablesBackend(family, config, executor=executor, kept=KEPT_OBJECTS)
    return LocalhostNodePortsBackend.create(inner, config, executor, netns=netns)


def cleanup(netns: str | None = None) -> None:
    """Delete ``table ip kube-proxy`` and ``table ip6 kube-proxy`` (missing ones are fine).

    Never touches any other table. Raises :class:`NftError` if a deletion fails for
    another reason than the table being absent.
    """
    from kubeproxy.backends.nftables.exec import LibNftables, delete_table

    executor = LibNftables(netns=netns)
    for family in (Family.IP, Family.IP6):
        delete_table(executor, family, TABLE)


def cleanup_leftovers(netns: str | None = None) -> None:
    """Delete what we leave in the tables that upstream's nftables mode does not use and
    does not delete when it takes a node back (``--cleanup-leftovers``; see
    :mod:`~kubeproxy.backends.nftables.handback`); refused, changing nothing, while our
    rules are still in use."""
    from kubeproxy.backends.nftables.handback import cleanup_leftovers as remove

    remove(netns)


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


_MOVED_TO_BENCH = frozenset({"ChainNftablesBackend", "create_chain_backend"})
"""Names this package had until the per-Service-chain structure moved to the benchmarks
(issue 22); found through :func:`__getattr__` for one release."""

if not TYPE_CHECKING:  # type checkers see the package's own names only

    def __getattr__(name: str) -> object:
        """A deprecated name of :data:`_MOVED_TO_BENCH`, from ``bench.chain_structure``."""
        if name not in _MOVED_TO_BENCH:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        where = f"bench.chain_structure.{name}"
        try:
            import bench.chain_structure as moved
        except ImportError:
            raise AttributeError(
                f"{__name__}.{name} moved to {where}, the benchmarks of a source checkout"
                " (not part of the installed package)"
            ) from None
        warnings.warn(
            f"{__name__}.{name} moved to {where}; this name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(moved, name)
