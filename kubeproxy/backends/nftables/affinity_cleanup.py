"""Session affinity entries that point at endpoints gone (:class:`AffinityCleaner`).

An affinity entry (``pin . client : endpoint`` in a shared map, ``frontend . client :
endpoint`` in a shared map keyed by the frontend, or ``client : endpoint`` in a map of
the port's own, see the package README) keeps a client's endpoint for the
affinity timeout. When the list loses an endpoint, the entries pointing at it must go,
or the clients they name keep being sent to an address that no longer serves them. The
kernel cannot do it (nothing links a map's values to the endpoint lists, and nft 1.0.6
cannot test a map's result against another set before the DNAT that uses it), so after
a sync in which a list lost endpoints, its map is read over netlink and those entries
deleted: best effort, a failure is counted and the map tried again after the next sync.
A shared map holds the entries of 1 in 256 ports: reading it costs what those hold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kubeproxy.backends.nftables.elements import ContainerTypes, ElementBatch
from kubeproxy.backends.nftables.exec import NftExecutor
from kubeproxy.backends.nftables.frontends import AffinityMap, AffinityPin, AffinityPlan
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.table import AFFINITY_FRONTEND_PREFIX, TABLE, Key
from kubeproxy.objects import IPFamily

__all__ = ["AFFINITY_TYPES", "FRONTEND_SHARD_TYPES", "SHARD_TYPES", "AffinityCleaner", "Every"]

log = logging.getLogger("kubeproxy.backends.nftables.backend")

AFFINITY_TYPES = {
    IPFamily.IPV4: (("ipv4_addr",), ("ipv4_addr", "inet_service")),
    IPFamily.IPV6: (("ipv6_addr",), ("ipv6_addr",)),
}
"""The data types of the per-port affinity maps (:data:`~.frontends.AFFINITY4_MAP_TYPE`,
the IPv6 one), to read and delete their entries over netlink."""
SHARD_TYPES = {
    IPFamily.IPV4: (("integer", "integer", "ipv4_addr"), ("ipv4_addr", "inet_service")),
    IPFamily.IPV6: (("integer", "integer", "integer"), ("ipv6_addr",)),
}
"""The data types of the shared affinity maps (:data:`~.layout.AFFINITY_SHARD_TYPES`)."""
FRONTEND_SHARD_TYPES: ContainerTypes = (
    ("ipv4_addr", "inet_proto", "inet_service", "ipv4_addr"),
    ("ipv4_addr", "inet_service"),
)
"""The data types of the shared maps keyed by the frontend
(:data:`~.layout.AFFINITY_FRONTEND_TYPE`, IPv4 only): their pins are the key's first
three parts."""


@dataclass(frozen=True, slots=True)
class Every:
    """What a full sync cleans: every per-port map (``maps``), and the ``shards`` (shared
    maps the kernel held before it) with every port's ``pins``; entries of a pin no port
    has (a port gone) are deleted too."""

    maps: Sequence[AffinityMap]
    pins: Sequence[AffinityPin]
    shards: Sequence[str]


class AffinityCleaner:
    """Which affinity maps may hold entries pointing at endpoints gone, and their
    cleaning: ``executor`` reads and deletes the entries of family ``family``'s maps."""

    def __init__(self, family: IPFamily, nft_family: Family, executor: NftExecutor) -> None:
        self._types = AFFINITY_TYPES[family]
        self._shard_types = SHARD_TYPES[family]
        self._nft_family = nft_family
        self._executor = executor
        # Maps whose entries may point at endpoints gone: name -> allowed values.
        self.losses: dict[str, frozenset[Key]] = {}
        # The same for the shared maps: shard -> pin -> the pin (its allowed values are
        # worked out only for the pins of entries a map holds).
        self.pin_losses: dict[str, dict[Key, AffinityPin]] = {}

    def follow(self, old: AffinityPlan | None, new: AffinityPlan | None) -> None:
        """A port's affinity went from ``old`` to ``new``: note its maps (and pins) whose
        allowed values shrank (or that are new to the port), to clean after the sync."""
        if new is None:
            return
        allowed = {m.name: m.allowed for m in (old.maps if old is not None else ())}
        for spec in new.maps:
            before = allowed.get(spec.name)
            if before is None or not before <= spec.allowed:
                self.losses[spec.name] = spec.allowed
        pinned = {p.pin: p for p in (old.pins if old is not None else ())}
        for pin in new.pins:
            held = pinned.get(pin.pin)
            if held is None or (
                held.endpoints != pin.endpoints and not held.allowed <= pin.allowed
            ):
                self.pin_losses.setdefault(pin.shard, {})[pin.pin] = pin

    def forget(self) -> None:
        """Drop what was noted (a new generation: a full sync cleans every map)."""
        self.losses = {}
        self.pin_losses = {}

    def _shared_test(
        self, name: str, pins: dict[Key, AffinityPin], strict: bool
    ) -> tuple[ContainerTypes, Callable[[Key, Key], bool]]:
        """The data types of shared map ``name`` and which of its entries go."""
        if name.startswith(AFFINITY_FRONTEND_PREFIX):
            return FRONTEND_SHARD_TYPES, _shared(pins, strict, 3)
        return self._shard_types, _shared(pins, strict, 2)

    def clean(self, live: Callable[[str], bool], every: Every | None = None) -> int:
        """Best effort: delete the entries that point at endpoints no longer allowed,
        in the maps noted since the last cleaning, or (after a full sync) in ``every``
        map, including the entries of short-circuit picks. Maps that ``live`` says the
        kernel does not hold in use are skipped. Returns the number of failures (each
        logged); after a failed deletion the maps are tried again next time."""
        losses, pin_losses = self.losses, self.pin_losses
        self.losses, self.pin_losses = {}, {}
        if every is not None:
            losses = {spec.name: spec.allowed for spec in every.maps}
            pin_losses = {shard: {} for shard in every.shards}
            for pin in every.pins:
                if pin.shard in pin_losses:
                    pin_losses[pin.shard][pin.pin] = pin
        failures = 0
        # A dict: a dump of a map the kernel is resizing can repeat an entry (our
        # netlink reads ask again, :func:`~.elements.read_whole`; libnftables' listing
        # does not), and a batch deleting one entry twice is refused whole (ENOENT).
        deletes: dict[tuple[str, Key], None] = {}
        types: dict[str, ContainerTypes] = {}
        for name, kinds, test in (
            *((n, self._types, _per_port(a)) for n, a in losses.items()),
            *((n, *self._shared_test(n, p, every is not None)) for n, p in pin_losses.items()),
        ):
            if not live(name):
                continue
            types[name] = kinds
            try:
                entries = self._executor.read_elements(self._nft_family, TABLE, name, kinds)
            except NftError as err:
                failures += 1
                log.warning("listing session affinity map %s failed: %s", name, err)
                self._again(name, losses, pin_losses)
                continue
            deletes.update(((name, key), None) for key, value in entries if test(key, value))
        if not deletes:
            return failures
        try:
            self._executor.write_elements(
                ElementBatch(self._nft_family, TABLE, types, deletes=list(deletes))
            )
        except NftError as err:
            # An entry may have timed out meanwhile: the next sync tries these maps again.
            failures += 1
            log.warning("deleting %d stale session affinity entries failed: %s", len(deletes), err)
            for name in types:
                self._again(name, losses, pin_losses)
        return failures

    def _again(
        self,
        name: str,
        losses: dict[str, frozenset[Key]],
        pin_losses: dict[str, dict[Key, AffinityPin]],
    ) -> None:
        """Note map ``name``'s losses again, for the next cleaning (its listing or the
        deletion failed)."""
        if name in losses:
            self.losses.setdefault(name, losses[name])
        else:
            self.pin_losses.setdefault(name, {}).update(pin_losses[name])


def _per_port(allowed: frozenset[Key]) -> Callable[[Key, Key], bool]:
    """Whether an entry of a per-port map goes: its endpoint is not allowed."""
    return lambda _key, value: value not in allowed


def _shared(pins: dict[Key, AffinityPin], strict: bool, width: int) -> Callable[[Key, Key], bool]:
    """Whether an entry of a shared map goes: its pin (the key's first ``width`` parts)'s
    endpoint is not allowed, or (``strict``, after a full sync) no port has its pin."""
    allowed: dict[Key, frozenset[Key]] = {}

    def gone(key: Key, value: Key) -> bool:
        head = key[:width]
        values = allowed.get(head)
        if values is None:
            pin = pins.get(head)
            if pin is None:
                return strict
            values = allowed[head] = pin.allowed
        return value not in values

    return gone
