"""Which Service port owns each kernel key, when two ports claim the same one.

Two Service ports may claim the same ``IP . protocol . port`` (or ``protocol . NodePort``),
for a moment during a change or for good through a mistake. The kernel must never see
a duplicate key, and the outcome must not depend on the order of events: the first port
in :class:`~kubeproxy.objects.ServicePortName` order that claims a key keeps it, and a
port that loses any of its keys is skipped as a whole, with one log line.

Both nftables structures keep their claims here; the work per sync is proportional to
the ports that changed, plus the contested ones.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from kubeproxy.objects import ServicePortName

__all__ = ["Claims"]

Key = tuple[str, ...]


class Claims:
    """The keys each port wants, who holds each key, and which ports are skipped."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self.wants: dict[ServicePortName, Collection[Key]] = {}
        """The keys each port (rendered and not deleted) claims."""
        self.claimant: dict[Key, ServicePortName] = {}
        """One claimant of each key (the holder, once conflicts are resolved)."""
        self._contested: dict[Key, set[ServicePortName]] = {}
        self.skipped: dict[ServicePortName, str] = {}
        """Ports that lost a key, with the reason logged."""

    def reset(self) -> None:
        """Forget every claim (a full sync claims again); skipped ports stay known, so a
        port that keeps losing is not logged again."""
        self.wants = {}
        self.claimant = {}
        self._contested = {}

    @property
    def unsettled(self) -> bool:
        """Whether :meth:`resolve` has anything to decide."""
        return bool(self._contested or self.skipped)

    def claim(self, name: ServicePortName, keys: Collection[Key]) -> None:
        """Record that ``name`` wants ``keys``, each once (after :meth:`release` of its
        old ones); the collection is kept as given."""
        self.wants[name] = keys
        claimant = self.claimant
        for key in keys:
            other = claimant.setdefault(key, name)
            if other != name:
                self._contested.setdefault(key, {other}).add(name)

    def release(self, name: ServicePortName) -> None:
        """Forget the keys ``name`` wanted."""
        keys = self.wants.pop(name, None)
        if not keys:
            return
        claimant = self.claimant
        contested = self._contested
        for key in keys:
            rivals = contested.get(key)
            if rivals is None:
                if claimant.get(key) == name:
                    del claimant[key]
                continue
            rivals.discard(name)
            claimant[key] = next(iter(rivals))
            if len(rivals) == 1:
                del contested[key]

    def resolve(self) -> list[ServicePortName]:
        """Decide which contested ports are skipped; return the ports whose fate changed.

        Ports with no contested key never lose. The holder of a contested key is then
        also its :attr:`claimant`.
        """
        candidates: set[ServicePortName] = set(self.skipped)
        for rivals in self._contested.values():
            candidates.update(rivals)
        owner: dict[Key, ServicePortName] = {}
        skipped: dict[ServicePortName, str] = {}
        for name in sorted(candidates):
            keys = self.wants.get(name)
            if keys is None:
                continue
            clash = sorted(k for k in keys if k in owner)
            if clash:
                key = clash[0]
                skipped[name] = f"{' . '.join(key)} is already used by service port {owner[key]}"
                continue
            for key in keys:
                if key in self._contested:
                    owner[key] = name
        for key, name in owner.items():
            self.claimant[key] = name
        changed = [n for n in self.skipped if n not in skipped]
        for name, reason in skipped.items():
            if self.skipped.get(name) != reason:
                self._log.error("skipping service port %s: %s", name, reason)
                changed.append(name)
        self.skipped = skipped
        return changed
