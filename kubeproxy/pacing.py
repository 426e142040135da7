"""How long the sync loop rests after a sync when no ``minSyncPeriod`` is set: by its cost.

Upstream's sync loop rests a fixed ``minSyncPeriod`` after every sync (1 s by default), a
default chosen for syncs that cost hundreds of milliseconds. Ours cost about a millisecond
(a partial sync at 30k Services), so a fixed second is most of every change's network
programming latency under churn. :class:`SyncPacing` rests instead in proportion to what
the sync just cost per change it carried, within bounds::

    rest = min(ceiling, max(floor, ratio x cost / changes))

* ``cost`` is the CPU time of the sync thread during the sync (kernel time included: the
  netlink commit runs in the sending thread), not its wall time: a sync that waited for a
  core on a busy node has not cost more, and should not slow the proxy down further;
* ``changes`` is how many Services the sync changed (1 for a full sync, whose cost is
  all overhead): batching amortises a sync's fixed cost (snapshot, observers, the commit's
  round trip), never the work each change needs, which is done however the syncs are
  spaced. So the rest follows the cost *per change*: a sync of one change costing ``c``
  rests ``ratio x c`` (its fixed cost takes at most ``1 / (1 + ratio)`` of a core, a fifth
  with the default 4), and a big batch rests no longer than a small one would. Resting
  ``ratio x`` the whole batch's cost instead (issue 29's first pacing) made the rest grow
  with the batch and the batch with the rest: once ``(ratio + 1) x`` the CPU per change
  times the rate neared a core (a busy node stretching each sync's wall time counts as
  well), every period was longer than the last, up to the ceiling, and the changes
  queued (30k Services, 1,000 updates a second: p50 0.7 s, p99 5.5 s and growing, syncs
  of 2,000 changes, 1 s rests; ``bench/test_programming.py``);
* ``floor`` bounds the syncs' fixed overhead (about 0.8-1.2 ms of CPU a sync in the daemon
  at 30k Services, whatever the sync carries) when syncs are cheap: at most one sync per
  ``floor`` (50 ms) under churn, so changes are batched and that overhead stays near 2 %
  of a core; a change arriving while the loop is idle still syncs at once;
* ``ceiling``: never longer than upstream's default ``minSyncPeriod`` (1 s), so no change
  waits longer for its sync than it would have under upstream's default.

Under overload the loop is then bounded by its real capacity only: each sync carries what
arrived during the previous rest and sync, the rest stays near the floor, and a change
waits about ``floor + 2 x`` a sync's wall time, however long the overload lasts.

Measured reasons for the defaults: ``bench/test_programming.py`` and docs/benchmarks.md,
"Network programming latency".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["DEFAULT_PACING", "SyncPacing"]


@dataclass(frozen=True, slots=True)
class SyncPacing:
    """The rest after a sync: ``min(ceiling, max(floor, ratio x cost / changes))`` seconds."""

    floor: float = 0.05
    ratio: float = 4.0
    ceiling: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.floor <= self.ceiling or self.ceiling <= 0 or self.ratio < 0:
            raise ValueError(
                f"sync pacing: need 0 <= floor <= ceiling, ceiling > 0 and ratio >= 0 "
                f"(floor {self.floor}, ratio {self.ratio}, ceiling {self.ceiling})"
            )

    def rest(self, cost: float, changes: int = 1) -> float:
        """Seconds to rest after a sync whose work cost ``cost`` CPU seconds and carried
        ``changes`` changes (fewer than 1 counts as 1)."""
        return min(self.ceiling, max(self.floor, self.ratio * max(cost, 0.0) / max(changes, 1)))


DEFAULT_PACING: Final = SyncPacing()
"""nftables mode's pacing when ``minSyncPeriod`` is unset (and any proxier's by default)."""
