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
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from kubeproxy.backends.nftables.backend import NftablesBackend
from kubeproxy.backends.nftables.layout import AFFINITY_SHARED
from kubeproxy.backends.nftables.localhost import KEPT_OBJECTS, LocalhostNodePortsBackend
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.table import TABLE
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.config import ProxierConfig
from kubeproxy.featuregates import KUBE_PROXY_NFTABLES_LOCALHOST_NODEPORTS, NFTABLES_NETLINK
from kubeproxy.objects import IPFamily

if TYPE_CHECKING:
    from kubeproxy.backend import Backend
    from kubeproxy.backends.nftables.exec import NftExecutor
    from kubeproxy.selfheal import Watcher

log = logging.getLogger(__name__)

__all__ = [
    "TABLE",
    "LocalhostNodePortsBackend",
    "NftablesBackend",
    "backend_over",
    "cleanup",
    "cleanup_leftovers",
    "create_backend",
    "render_transactions",
    "watchers",
]


def create_backend(
    family: IPFamily,
    config: ProxierConfig,
    *,
    netns: str | None = None,
    affinity: str = AFFINITY_SHARED,
    precreate_counts: int = 0,
) -> NftablesBackend | LocalhostNodePortsBackend:
    """A backend for ``family`` in ``netns`` (the current namespace if None).

    On a kernel with the owner and persist table flags, and with the
    ``NFTablesOwnedTable`` and ``NFTablesNetlink`` gates on (the defaults), our table is
    owned (:mod:`~kubeproxy.backends.nftables.owner`): written over a netlink socket of
    ours that no other process can get past; otherwise through libnftables, where the
    ``NFTablesNetlink`` gate picks how elements reach the kernel (see
    :class:`~kubeproxy.backends.nftables.exec.LibNftables`). The choice and its reason
    are logged (:func:`~kubeproxy.backends.nftables.support.table_ownership`).

    ``precreate_counts``: the classes of every endpoint count up to it are in each
    generation from its start (see :class:`NftablesBackend`; 0, the default, for none).

    Raises :class:`NftError` when nftables mode cannot run here (the support check), or
    when another process owns the table (another proxy on this node). With the
    ``KubeProxyNFTablesLocalhostNodePorts`` gate on, the backend comes wrapped in a
    :class:`~kubeproxy.backends.nftables.localhost.LocalhostNodePortsBackend`.
    ``affinity`` picks where ClientIP entries live (the shared maps; the benchmarks keep
    the per-port maps before them, :data:`~.layout.AFFINITY_PER_PORT`).
    """
    from kubeproxy.backends.nftables.exec import LibNftables
    from kubeproxy.backends.nftables.owner import OwnedNftables, probe_table_flags
    from kubeproxy.backends.nftables.support import table_ownership

    gates = config.feature_gates
    nft_family = Family.IP if family is IPFamily.IPV4 else Family.IP6
    ownership = table_ownership(gates, lambda: probe_table_flags(netns))
    executor: NftExecutor
    if ownership.owned:
        executor = OwnedNftables(netns)
    else:
        executor = LibNftables(netns=netns, netlink_elements=gates.enabled(NFTABLES_NETLINK))
    backend = backend_over(
        executor,
        family,
        config,
        netns=netns,
        affinity=affinity,
        precreate_counts=precreate_counts,
    )
    if isinstance(executor, OwnedNftables):
        # Refused at once when another process owns the table (another proxy); created
        # or adopted with the first write (nothing is written before the daemon starts).
        executor.refuse_another_owner(nft_family)
    log.info("nftables: %s", ownership.describe(nft_family, TABLE))
    return backend


def backend_over(
    executor: NftExecutor,
    family: IPFamily,
    config: ProxierConfig,
    *,
    netns: str | None = None,
    clock: Callable[[], float] = time.monotonic,
    affinity: str = AFFINITY_SHARED,
    precreate_counts: int = 0,
) -> NftablesBackend | LocalhostNodePortsBackend:
    """The backend :func:`create_backend` builds, over a given executor and clock (tests
    compare two executors writing the same syncs)."""
    localhost = config.feature_gates.enabled(KUBE_PROXY_NFTABLES_LOCALHOST_NODEPORTS)
    inner = NftablesBackend(
        family,
        config,
        executor=executor,
        clock=clock,
        kept=KEPT_OBJECTS if localhost else (),
        affinity=affinity,
        precreate_counts=precreate_counts,
    )
    if not localhost:
        return inner
    return LocalhostNodePortsBackend.create(inner, config, executor, netns=netns)


def cleanup(netns: str | None = None) -> None:
    """Delete ``table ip kube-proxy`` and ``table ip6 kube-proxy`` (missing ones are fine).

    Never touches any other table. An owned table whose proxy has ended (orphaned) is
    deleted like any other; one that a running proxy owns is refused, in one line
    naming that process. Raises :class:`NftError` if a deletion fails for another reason
    than the table being absent.
    """
    from kubeproxy.backends.nftables.exec import LibNftables, delete_table
    from kubeproxy.backends.nftables.owner import running_owner

    executor = LibNftables(netns=netns)
    for family in (Family.IP, Family.IP6):
        try:
            delete_table(executor, family, TABLE)
        except NftError as err:
            owner = running_owner(family, TABLE, netns) if err.errno == errno.EPERM else None
            if owner is None:
                raise
            raise NftError(
                f"table {family} {TABLE} belongs to a running proxy ({owner}): stop it first",
                errno.EPERM,
            ) from None


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
