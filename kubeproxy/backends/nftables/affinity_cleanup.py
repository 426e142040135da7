"""Session affinity entries that point at endpoints gone (:class:`AffinityCleaner`).

An affinity map (``client : endpoint``, one per Service port and endpoint list, see the
package README) keeps a client's endpoint for the affinity timeout. When the list loses
an endpoint, the entries pointing at it must go, or the clients they name keep being
sent to an address that no longer serves them. The kernel cannot do it (nothing links
a map's values to the endpoint lists), so after a sync in which a list lost endpoints,
its map is read over netlink and those entries deleted: best effort, a failure is
counted and the map tried again after the next sync.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from kubeproxy.backends.nftables.elements import ElementBatch
from kubeproxy.backends.nftables.exec import NftExecutor
from kubeproxy.backends.nftables.frontends import AffinityMap, AffinityPlan
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.table import TABLE, Key
from kubeproxy.objects import IPFamily

__all__ = ["AFFINITY_TYPES", "AffinityCleaner"]

log = logging.getLogger("kubeproxy.backends.nftables.backend")

AFFINITY_TYPES = {
    IPFamily.IPV4: (("ipv4_addr",), ("ipv4_addr", "inet_service")),
    IPFamily.IPV6: (("ipv6_addr",), ("ipv6_addr",)),
}
"""The data types of the affinity maps (:data:`~.frontends.AFFINITY4_MAP_TYPE`, the
IPv6 one), to read and delete their entries over netlink."""


class AffinityCleaner:
    """Which affinity maps may hold entries pointing at endpoints gone, and their
    cleaning: ``executor`` reads and deletes the entries of family ``family``'s maps."""

    def __init__(self, family: IPFamily, nft_family: Family, executor: NftExecutor) -> None:
        self._types = AFFINITY_TYPES[family]
        self._nft_family = nft_family
        self._executor = executor
        # Maps whose entries may point at endpoints gone: name -> allowed values.
        self.losses: dict[str, frozenset[Key]] = {}

    def follow(self, old: AffinityPlan | None, new: AffinityPlan | None) -> None:
        """A port's affinity went from ``old`` to ``new``: note its maps whose allowed
        values shrank (or that are new to the port), to clean after the sync."""
        if new is None:
            return
        allowed = {m.name: m.allowed for m in (old.maps if old is not None else ())}
        for spec in new.maps:
            before = allowed.get(spec.name)
            if before is None or not before <= spec.allowed:
                self.losses[spec.name] = spec.allowed

    def forget(self) -> None:
        """Drop what was noted (a new generation: a full sync cleans every map)."""
        self.losses = {}

    def clean(self, live: Callable[[str], bool], every: Iterable[AffinityMap] | None = None) -> int:
        """Best effort: delete the entries that point at endpoints no longer allowed,
        in the maps noted since the last cleaning, or (after a full sync) in ``every``
        map, including the entries of short-circuit picks. Maps that ``live`` says the
        kernel does not hold in use are skipped. Returns the number of failures (each
        logged); after a failed deletion the maps are tried again next time."""
        losses = self.losses
        self.losses = {}
        if every is not None:
            losses = {spec.name: spec.allowed for spec in every}
        failures = 0
        deletes: list[tuple[str, Key]] = []
        types: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        for name, allowed in losses.items():
            if not live(name):
                continue
            types[name] = self._types
            try:
                entries = self._executor.read_elements(self._nft_family, TABLE, name, self._types)
            except NftError as err:
                failures += 1
                log.warning("listing session affinity map %s failed: %s", name, err)
                continue
            deletes.extend((name, key) for key, value in entries if value not in allowed)
        if not deletes:
            return failures
        try:
            self._executor.write_elements(
                ElementBatch(self._nft_family, TABLE, types, deletes=deletes)
            )
        except NftError as err:
            # An entry may have timed out meanwhile: the next sync tries these maps again.
            failures += 1
            log.warning("deleting %d stale session affinity entries failed: %s", len(deletes), err)
            for name in types:
                self.losses.setdefault(name, losses[name])
        return failures
