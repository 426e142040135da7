"""Taking a node over from the proxy that ran there before, without a gap.

The node's previous proxy is upstream's kube-proxy in any mode, or ours in another mode;
its rules keep serving until ours are written, then they go. The order:

1. Our backends are made (their support checks pass: a mode that cannot run here stops
   before anything is touched) and our first sync of every family is written *beside*
   what the previous proxy left. Both serve correctly meanwhile: the kernel translates a
   connection once, in the first NAT chain that translates its first packet (an nftables
   table, iptables-nft or iptables-legacy, at the same hooks), and both send it to an
   endpoint of the same Service; IPVS sees only what no NAT chain translated, for no
   Service address is local to the node once ours DNAT it. Established connections keep
   their conntrack entries, whoever translated them, and keep flowing.
2. Then (:class:`Takeover`, the daemon's ``after_first_sync`` step) our own table is
   swept: what the first full sync found in it and does not use is deleted at once,
   without waiting for a change to bring the next sync. That is all of upstream's
   nftables structure when it ran in nftables mode (the same table name, 11 chains per
   Service of 10 endpoints: 110k chains at 10k Services, which every later commit and
   every libnftables run would pay for), or our own previous generation after a restart.
   The daemon's sweeper (:mod:`~kubeproxy.backends.nftables.sweeper`) would delete them
   too when due; the takeover does it in this order so that its one line says when all
   of the previous proxy's state is gone. With the owned table, upstream's nftables table
   is not swept but replaced, with everything of ours in it, in the first sync's one
   transaction (:class:`~kubeproxy.backends.nftables.owner.OwnedNftables`).
3. Then the other kind of mode's leftovers: upstream's ``platformCleanup``, which upstream
   runs before its first sync (its Services are down from there until that sync; ours
   are not): iptables-mode and ipvs-mode chains, ipsets, IPVS virtual servers and
   ``kube-ipvs0`` in nftables mode, the nftables tables in iptables and ipvs modes. The
   names are upstream's, so this removes upstream's as well as ours. A daemon lets ipvs
   mode hand over (:mod:`kubeproxy.backends.ipvs.handover`): the virtual servers of
   established IPVS connections stay until those end, IPVS forwards them itself; a
   one-shot run (``--once``) removes everything at once.

A failure in steps 2 and 3 is a warning: our rules are in place, the proxy runs on, and
the next syncs (step 2) or ``--cleanup`` (step 3) finish the job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol, cast, runtime_checkable

from kubeproxy.cmd.modes import Mode, platform_cleanup
from kubeproxy.objects import IPFamily
from kubeproxy.proxier import Proxier

__all__ = ["SWEEP_ATTEMPTS", "SWEEP_DELAY", "Sweepable", "Takeover", "TakeoverResult"]

logger = logging.getLogger(__name__)

SWEEP_DELAY: Final = 1.0
"""Seconds between our first sync and the sweep of our table (then between attempts):
the nftables backend deletes an object at least this long after it went unused
(``STALE_DELAY``: older kernels still count a chain as used just after its last
reference went)."""

SWEEP_ATTEMPTS: Final = 5
"""How many times the sweep tries before it leaves what is left to the next syncs."""


@runtime_checkable
class Sweepable(Protocol):
    """A backend whose table may hold objects it does not use (the nftables backend)."""

    @property
    def stale_objects(self) -> int:
        """How many unused objects wait for their deletion."""
        ...

    def collect_stale(self, now: float | None = None) -> bool:
        """Delete those due now; False when the kernel refused."""
        ...


@dataclass(frozen=True, slots=True)
class TakeoverResult:
    """What one :class:`Takeover` did: unused objects of our tables deleted (and left, by
    family), the other modes' cleanup errors (one line each), and how long it took (in
    all, and the sweep of our tables)."""

    deleted: int = 0
    left: Mapping[IPFamily, int] = field(default_factory=dict)
    errors: tuple[str, ...] = ()
    seconds: float = 0.0
    sweep_seconds: float = 0.0

    @property
    def complete(self) -> bool:
        """Whether nothing of the previous proxy is known to be left."""
        return not self.errors and not any(self.left.values())


class Takeover:
    """The daemon's ``after_first_sync`` step of a binary running ``mode`` (see the
    module): sweep our tables, then remove the other kind of mode's leftovers.

    ``modes`` is the mode table (:data:`~kubeproxy.cmd.modes.MODES` by default; tests
    pass fakes), ``netns`` where the cleanups act; ``delay`` and ``attempts`` pace the
    sweep (:data:`SWEEP_DELAY`, :data:`SWEEP_ATTEMPTS`); ``clock`` times it. A daemon's
    takeover lets the other modes hand over (``Mode.handover``: ipvs mode keeps the
    virtual servers of established connections until they end); a one-shot run
    (``once``) removes everything at once. The last run's :class:`TakeoverResult` is
    :attr:`result`.
    """

    def __init__(
        self,
        mode: str,
        modes: Mapping[str, Mode] | None = None,
        netns: str | None = None,
        *,
        delay: float = SWEEP_DELAY,
        attempts: int = SWEEP_ATTEMPTS,
        clock: Callable[[], float] = time.monotonic,
        once: bool = False,
    ) -> None:
        self.once = once
        self.mode = mode
        self.modes = modes
        self.netns = netns
        self.delay = delay
        self.attempts = attempts
        self.clock = clock
        self.result: TakeoverResult | None = None

    def __call__(
        self, proxiers: Mapping[IPFamily, Proxier], stop: threading.Event
    ) -> TakeoverResult:
        """Run the takeover (see the module); returns and keeps its result."""
        start = self.clock()
        deleted, left = self._sweep(proxiers, stop)
        swept = self.clock() - start
        errors: list[str] = []
        if not stop.is_set():
            handing = None if self.once else stop
            errors = platform_cleanup(self.mode, self.modes, self.netns, stop=handing)
        result = TakeoverResult(deleted, left, tuple(errors), self.clock() - start, swept)
        self.result = result
        self._report(result)
        return result

    def _sweep(
        self, proxiers: Mapping[IPFamily, Proxier], stop: threading.Event
    ) -> tuple[int, dict[IPFamily, int]]:
        """Delete the unused objects of our tables; (how many went, how many are left
        by family)."""
        pending = {
            family: proxier
            for family, proxier in proxiers.items()
            if isinstance(proxier.backend, Sweepable) and proxier.backend.stale_objects
        }
        # Counted from here: the daemon's sweeper may delete some of them first.
        found = {f: cast(Sweepable, p.backend).stale_objects for f, p in pending.items()}
        left: dict[IPFamily, int] = {}
        for _attempt in range(self.attempts):
            if not pending or stop.wait(self.delay):
                break
            for family, proxier in list(pending.items()):
                backend = proxier.backend
                assert isinstance(backend, Sweepable)
                with proxier.syncs_held():
                    backend.collect_stale()
                    remaining = backend.stale_objects
                left[family] = remaining
                if not remaining:
                    del pending[family]
        for family, proxier in pending.items():
            backend = proxier.backend
            assert isinstance(backend, Sweepable)
            left[family] = backend.stale_objects
        deleted = sum(max(0, count - left.get(family, 0)) for family, count in found.items())
        return deleted, {f: n for f, n in left.items() if n}

    def _report(self, result: TakeoverResult) -> None:
        if self.mode in ("iptables", "ipvs"):
            others = "nftables mode's tables"
        else:
            others = "iptables and ipvs modes' chains, sets and interface"
        if result.complete:
            logger.info(
                "Took the node over in %.1fs after the first sync: %d unused objects deleted "
                "from our tables (%.1fs), %s removed (if any)",
                result.seconds,
                result.deleted,
                result.sweep_seconds,
                others,
            )
            return
        for family, count in sorted(result.left.items()):
            logger.warning(
                "%s: %d unused objects are still in our table; the next syncs delete them",
                family,
                count,
            )
        if result.errors:
            logger.warning(
                "What the previous proxy left is not all gone (%s); `--cleanup` removes it "
                "once this proxy is stopped",
                "; ".join(result.errors),
            )
