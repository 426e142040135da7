"""How long the sync loop rests after a sync when no ``minSyncPeriod`` is set: by its cost.

Upstream's sync loop rests a fixed ``minSyncPeriod`` after every sync (1 s by default), a
default chosen for syncs that cost hundreds of milliseconds. Ours cost about a millisecond
(a partial sync at 30k Services), so a fixed second is most of every change's network
programming latency under churn. :class:`SyncPacing` rests instead in proportion to what
the sync just cost, within bounds::

    rest = min(ceiling, max(floor, ratio x cost))

* ``cost`` is the CPU time of the sync thread during the sync (kernel time included: the
  netlink commit runs in the sending thread), not its wall time: a sync that waited for a
  core on a busy node has not cost more, and should not slow the proxy down further;
* ``ratio`` bounds the share of a core that syncs take when changes keep coming: a sync
  costing ``c`` is followed by at least ``ratio x c`` of rest, so syncs use at most
  ``1 / (1 + ratio)`` of a core (a fifth with the default 4), whatever they cost;
* ``floor`` bounds the syncs' fixed overhead (snapshot, observers, health checks, the
  commit's round trip: about 0.8 ms of CPU a sync in the daemon at 30k Services, whatever the
  sync carries) when syncs are cheap: at most one sync per ``floor`` (50 ms) under
  churn, so changes are batched and that overhead stays under 2 % of a core; a change
  arriving while the loop is idle still syncs at once;
* ``ceiling``: never longer than upstream's default ``minSyncPeriod`` (1 s), so no change
  waits longer for its sync than it would have under upstream's default.

Measured reasons for the defaults: ``bench/test_programming.py`` and the README section
"Network programming latency".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["DEFAULT_PACING", "SyncPacing"]


@dataclass(frozen=True, slots=True)
class SyncPacing:
    """The rest after a sync: ``min(ceiling, max(floor, ratio x cost))`` seconds."""

    floor: float = 0.05
    ratio: float = 4.0
    ceiling: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.floor <= self.ceiling or self.ceiling <= 0 or self.ratio < 0:
            raise ValueError(
                f"sync pacing: need 0 <= floor <= ceiling, ceiling > 0 and ratio >= 0 "
                f"(floor {self.floor}, ratio {self.ratio}, ceiling {self.ceiling})"
            )

    def rest(self, cost: float) -> float:
        """Seconds to rest after a sync whose work cost ``cost`` CPU seconds."""
        return min(self.ceiling, max(self.floor, self.ratio * max(cost, 0.0)))


DEFAULT_PACING: Final = SyncPacing()
"""nftables mode's pacing when ``minSyncPeriod`` is unset (and any proxier's by default)."""
