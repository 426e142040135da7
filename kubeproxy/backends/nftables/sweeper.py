"""Deleting what a restart or a failed sync left, without waiting for the next sync.

A full sync leaves the generation it replaced (and what a process killed in the middle
of its own full sync built) in the kernel until the objects are due for deletion,
:data:`~kubeproxy.backends.nftables.stale.STALE_DELAY` later
(:mod:`~kubeproxy.backends.nftables.stale`). The backend deletes what is due at the start
of every sync, but on a quiet cluster the next sync is the periodic full one, an hour
later: a node restarted at 10k Services held its old generation (210k elements) and the
half-built one (60k) beside the live one for that long, 2.3 times the kernel state
(issue 31).

:class:`StaleSweeper`, an after-sync hook of the nftables mode, arms a timer for when the
first unused object is due and deletes them then, with the proxier's syncs held (one
transaction, serialized with syncs as any kernel write of the backend). A refused
deletion is tried again after the delay, doubling up to a minute while it keeps
failing (each failure is logged and counted in
``kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total``).

:class:`StaleObjectsMetric` reports, at each scrape,
``kubeproxy_sync_proxy_rules_nftables_stale_objects{ip_family}``: the chains, sets and
maps of our table that nothing uses and that wait for their deletion (0 within a second
or two of every full sync when all is well; a value that stays up says deletions fail).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from kubeproxy.backend import ProxySnapshot, SyncChanges
from kubeproxy.metrics import PerRegistry
from kubeproxy.objects import IPFamily
from kubeproxy.proxier import Proxier

__all__ = ["MAX_RETRY", "StaleObjectsMetric", "StaleSweeper", "Sweepable", "report_stale_objects"]

log = logging.getLogger(__name__)

MAX_RETRY = 60.0
"""Seconds between attempts at most while deletions keep failing."""


class Sweepable(Protocol):
    """What the sweeper needs of a backend (the nftables backend, or its localhost
    wrapper, which reads through to it)."""

    @property
    def family(self) -> IPFamily:
        """The IP family the backend programs."""
        ...

    @property
    def stale_objects(self) -> int:
        """How many unused objects wait for their deletion."""
        ...

    def stale_due(self) -> float | None:
        """When the first of them is due (the backend's clock); None: nothing waits."""
        ...

    def collect_stale(self, now: float | None = None) -> bool:
        """Delete those due; False when the kernel refused."""
        ...


class _Timer(Protocol):
    daemon: bool

    def start(self) -> None: ...

    def cancel(self) -> None: ...


class StaleSweeper:
    """An after-sync hook (:class:`~kubeproxy.proxier.SyncHook`) deleting ``backend``'s
    unused objects when they are due (see the module documentation).

    ``clock`` must be the backend's clock (monotonic seconds); ``timer`` makes the timer
    (:class:`threading.Timer` in production; tests pass their own).
    """

    def __init__(
        self,
        backend: Sweepable,
        *,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[float, Callable[[], None]], _Timer] = threading.Timer,
    ) -> None:
        self.backend = backend
        self._clock = clock
        self._make_timer = timer
        self._lock = threading.Lock()
        self._timer: _Timer | None = None
        self._at: float | None = None
        self._proxier: Proxier | None = None
        self._failures = 0
        self._closed = False

    def __call__(self, proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """After a successful sync: arm the timer if something waits for its deletion."""
        self._proxier = proxier
        self._failures = 0  # the sync itself deleted what was due, or found nothing to
        self._arm()

    def close(self) -> None:
        """Cancel the timer (a stopping daemon, a test)."""
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._at = None, None

    def _arm(self) -> None:
        due = self.backend.stale_due()
        if due is None:
            return
        if self._failures:
            due = max(due, self._clock() + min(MAX_RETRY, 2.0**self._failures))
        with self._lock:
            if self._closed or (self._at is not None and self._at <= due):
                return  # armed for an earlier (or the same) moment already
            if self._timer is not None:
                self._timer.cancel()
            self._at = due
            self._timer = self._make_timer(max(0.0, due - self._clock()), self._fire)
            self._timer.daemon = True
            self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._timer, self._at = None, None
        proxier = self._proxier
        if proxier is None:
            return
        try:
            with proxier.syncs_held():
                ok = self.backend.collect_stale()
        except Exception:  # the sweeper must survive anything; the next sync tries again
            log.exception("deleting unused nftables objects (%s) failed", self.backend.family)
            ok = False
        self._failures = 0 if ok else self._failures + 1
        self._arm()


class StaleObjectsMetric:
    """``kubeproxy_sync_proxy_rules_nftables_stale_objects{ip_family}`` for the backends
    given to :meth:`add`, read at each scrape. A prometheus-client collector; register one
    per registry (:func:`report_stale_objects`)."""

    def __init__(self) -> None:
        self.backends: dict[IPFamily, Sweepable] = {}

    def add(self, backend: Sweepable) -> None:
        """Report ``backend``'s family."""
        self.backends[backend.family] = backend

    def collect(self) -> Iterable[Any]:
        """The one gauge family."""
        from prometheus_client.core import GaugeMetricFamily

        gauge = GaugeMetricFamily(
            "kubeproxy_sync_proxy_rules_nftables_stale_objects",
            "Chains, sets and maps of the kube-proxy tables that nothing uses any more (an old"
            " generation, what a killed or failed full sync built), waiting for their deletion",
            labels=["ip_family"],
        )
        for family, backend in sorted(self.backends.items()):
            gauge.add_metric([family.value], float(backend.stale_objects))
        yield gauge


_COLLECTORS = PerRegistry(StaleObjectsMetric)


def report_stale_objects(registry: Any, backend: Sweepable) -> StaleObjectsMetric:
    """Report ``backend``'s family in ``registry``'s :class:`StaleObjectsMetric`
    (registered there the first time)."""
    collector = _COLLECTORS.of(registry)
    collector.add(backend)
    return collector
