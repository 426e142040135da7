"""Handing a node back to upstream's kube-proxy in nftables mode: what we leave behind.

Upstream's nftables mode writes the table of our name (``kube-proxy``, in ``ip`` and
``ip6``). Its first sync after it starts adds and deletes each of its base chains once,
re-creates them and rewrites its fixed chains, whose names ours share, all in one
transaction: from that commit on upstream's rules serve and ours are read by nothing,
with no moment without rules. But it deletes only what it knows of (chains whose names
hold a ``/``, ``affinity-`` *sets*), so ours stay (:func:`is_ours`):

* our generation: every chain, set and map named ``<name>.g<N>`` (slot maps hold one
  element per endpoint: about 150k elements at 10k Services of 10 endpoints);
* the affinity objects and the fixed ones around them: the shared maps
  ``affinity-clients-<n>``, ``affinity-frontends-<n>`` (an earlier version's per-port
  ``affinity-<16 characters>``), chains ``affinity-lookup-...``, ``affinity-record``,
  ``affinity-find``, ``affinity-full`` and the like, the set ``affinity-local-endpoints``;
* with ``KubeProxyNFTablesLocalhostNodePorts``, the ``localhost-nodeports`` base chain
  and its sets (``localhost.KEPT_OBJECTS``): they would go on rejecting loopback
  NodePorts of our last sync.

One of these upstream cannot cope with. A second after a sync, upstream deletes the
chains it found unused whose names hold a ``/`` (its per-Service chains), all in one
transaction; our per-port affinity chains hold one (``affinity-lookup-<hash>-ns/svc/
tcp/port``) and our verdict maps still name them, so the kernel refuses that
transaction, at every sync from then on: upstream's own stale chains stay too, and
``kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total`` counts up.

:func:`cleanup_leftovers` (``--cleanup-leftovers``) deletes exactly what :func:`is_ours`
names, in each family's table, and nothing upstream writes: safe while upstream's
kube-proxy runs. While our proxy still uses its rules, the kernel refuses the deletion as
a whole (a chain or map in use cannot be deleted) and nothing changes.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Iterable, Sequence

from kubeproxy.backends.nftables.exec import LibNftables, NftExecutor
from kubeproxy.backends.nftables.layout import generation_of
from kubeproxy.backends.nftables.localhost import KEPT_OBJECTS
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.owner import disown
from kubeproxy.backends.nftables.stale import (
    ObjectKind,
    TableObject,
    chain_object,
    deletion_order,
    queue_deletion,
    set_object,
)
from kubeproxy.backends.nftables.table import AFFINITY_MAP_PREFIX, TABLE
from kubeproxy.backends.nftables.transaction import Transaction

__all__ = ["cleanup_leftovers", "is_ours", "leftovers"]

log = logging.getLogger(__name__)

_LOCALHOST = frozenset(KEPT_OBJECTS)


def is_ours(obj: TableObject) -> bool:
    """Whether only our map structure writes ``obj`` (see the module): never a name
    upstream's nftables mode writes."""
    name = obj.name
    if generation_of(name) is not None or obj in _LOCALHOST:
        return True
    if not name.startswith(AFFINITY_MAP_PREFIX):
        return False
    # Upstream names no chain "affinity-..." and each of its affinity sets after an
    # endpoint: "affinity-<hash>-<namespace>/<service>/..."; ours hold no "/".
    return obj.kind is ObjectKind.CHAIN or "/" not in name


def leftovers(chains: Iterable[str], sets: Iterable[str]) -> tuple[list[TableObject], ...]:
    """Our objects among a table's ``chains`` and ``sets``, in the two groups
    :func:`cleanup_leftovers` deletes one after the other (each in deletion order): the
    structure that our base chains read while our proxy runs, then the localhost
    NodePorts' base chain and sets, which nothing else refers to."""
    found = [chain_object(c) for c in chains] + [set_object(s) for s in sets]
    ours = [obj for obj in found if is_ours(obj)]
    structure = sorted((o for o in ours if o not in _LOCALHOST), key=deletion_order)
    localhost = sorted((o for o in ours if o in _LOCALHOST), key=deletion_order)
    return structure, localhost


def _delete(executor: NftExecutor, family: Family, objects: Sequence[TableObject]) -> None:
    if not objects:
        return
    tx = Transaction(family, TABLE)
    queue_deletion(tx, objects)
    executor.run_deletions(tx)


def cleanup_leftovers(netns: str | None = None, *, executor: NftExecutor | None = None) -> int:
    """Delete what our proxy left in ``table ip kube-proxy`` and ``table ip6
    kube-proxy`` that upstream's nftables mode does not use (see the module), in the
    current namespace or ``netns``; return how many objects went.

    A missing table is fine (upstream's iptables and ipvs modes delete ours at start).
    A table an owning proxy of ours left (orphaned, ``persist``) is made unowned first,
    in place, both families before anything else (:func:`~.owner.disown`): upstream
    cannot write it before. Raises :class:`NftError` when the kernel refuses: with
    ``EBUSY`` when our rules are still in use (our proxy still runs there, or nothing
    took the table over), naming the table; nothing of that table is deleted then (a
    retry once upstream has synced finishes the job).
    """
    own = executor is None
    nft = executor if executor is not None else LibNftables(netns)
    deleted = 0
    try:
        if isinstance(nft, LibNftables):
            # Upstream cannot write a table an owning proxy of ours left (see disown):
            # both families first, before anything here can be refused.
            for family in (Family.IP, Family.IP6):
                disown(family, nft.netns, listing=nft)
        for family in (Family.IP, Family.IP6):
            if not nft.table_exists(family, TABLE):
                continue
            structure, localhost = leftovers(
                nft.list_chains(family, TABLE), nft.list_sets(family, TABLE)
            )
            try:
                _delete(nft, family, structure)
            except NftError as err:
                if err.errno != errno.EBUSY:
                    raise
                raise NftError(
                    f"table {family} {TABLE}: our rules are still in use (is our proxy still "
                    "running here? Remove what it left only after upstream's kube-proxy "
                    f"has taken the table over): {err}",
                    errno.EBUSY,
                ) from err
            _delete(nft, family, localhost)
            count = len(structure) + len(localhost)
            deleted += count
            if count:
                log.info("Deleted %d objects we left in table %s %s", count, family, TABLE)
    finally:
        if own and isinstance(nft, LibNftables):
            nft.close()
    return deleted
