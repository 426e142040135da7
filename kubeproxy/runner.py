"""A rate-limited sync loop: upstream's ``BoundedFrequencyRunner`` semantics, with a backoff.

The loop runs a function when asked (:meth:`BoundedFrequencyRunner.run`), at least every
``max_interval``, and never more often than once per ``min_interval``. Requests coalesce
in a single slot: any number of :meth:`~BoundedFrequencyRunner.run` calls while the loop
is busy or resting yield one run. Time is read and waited on through an injected
:class:`Clock`, so tests drive the loop with a fake clock and no real sleeping.

Where we differ from upstream: given a :class:`~kubeproxy.pacing.SyncPacing`, the rest
after a run follows what the run cost (its thread's CPU time) per change it carried
(what ``fn`` returns) instead of a fixed ``min_interval`` (nftables mode's default; an
operator's ``minSyncPeriod`` keeps upstream's fixed rest). After a failure the next run
comes after a backoff that starts at ``initial_retry`` (1 s) and doubles with each
consecutive failure up to ``retry_interval`` (the sync period), instead of a flat
``retry_interval``: a sync the
kernel refused because someone else removed what it built on is usually repaired by the
full sync that follows, and waiting 30 s for it leaves every Service dead meanwhile. A
function that raises :class:`RunFailed` with ``retry_now`` (a failed partial sync: the
next one is full) is run again at once, once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from kubeproxy.pacing import SyncPacing

__all__ = ["INITIAL_RETRY", "BoundedFrequencyRunner", "Clock", "MonotonicClock", "RunFailed"]

logger = logging.getLogger(__name__)

INITIAL_RETRY = 1.0
"""Seconds before the first retry after a failure; each further failure doubles it."""


class Clock(Protocol):
    """Where the runner reads time and waits."""

    def now(self) -> float:
        """Seconds on a monotonic scale."""
        ...

    def wait(self, event: threading.Event, timeout: float) -> bool:
        """Block until ``event`` is set or ``timeout`` seconds passed; True if it was set."""
        ...


class RunFailed(Exception):
    """Raised by a runner function whose failure it has already logged in full.

    The runner then logs one short line instead of a second traceback. ``retry_now``
    asks for the next run at once, without the backoff or the ``min_interval`` rest
    (granted once in a row: a second failure backs off).
    """

    def __init__(self, message: str, *, retry_now: bool = False) -> None:
        super().__init__(message)
        self.retry_now = retry_now


class MonotonicClock:
    """The real clock: :func:`time.monotonic` and :meth:`threading.Event.wait`."""

    def now(self) -> float:
        """Seconds since an arbitrary point, never going backwards."""
        return time.monotonic()

    def wait(self, event: threading.Event, timeout: float) -> bool:
        """Wait on ``event`` for at most ``timeout`` seconds."""
        return event.wait(max(timeout, 0.0))


class BoundedFrequencyRunner:
    """Runs ``fn`` on request, rate-limited, with a retry backoff and a periodic fallback.

    Rules (upstream ``pkg/proxy/runner``, but for the backoff):

    * :meth:`run` never blocks; requests made before the next run starts coalesce into one.
    * Without requests, ``fn`` runs ``max_interval`` after the previous run ended (and
      ``max_interval`` after :meth:`loop` started, for the first one).
    * When ``fn`` raises, the error is logged and the next run comes at the latest
      :meth:`backoff` seconds after the failed one ended: ``initial_retry`` after the first
      failure in a row, doubling with each further one, never more than
      ``min(retry_interval, max_interval)``. A success starts the count afresh.
      :class:`RunFailed` with ``retry_now`` runs again at once (once in a row).
    * :meth:`ran_outside` reports a run of ``fn``'s work made outside the loop (the caller
      did it itself): a failure counts as if the loop had run it (the next run comes after
      the backoff), a success starts the count afresh.
    * After every run the loop rests before starting another: ``min_interval``, or with
      ``pacing`` the longer of that and ``pacing.rest(cost, changes)``, ``cost`` being the
      CPU time the run took (``cost_clock``: the thread's CPU clock) and ``changes`` what
      ``fn`` returned (how many changes the run carried; None counts as 1). A request that arrived
      meanwhile, even during ``fn`` itself, starts the next run right after the rest.
    """

    def __init__(
        self,
        name: str,
        fn: Callable[[], int | None],
        min_interval: float,
        retry_interval: float,
        max_interval: float,
        *,
        clock: Clock | None = None,
        initial_retry: float = INITIAL_RETRY,
        pacing: SyncPacing | None = None,
        cost_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        if min_interval < 0 or retry_interval <= 0 or max_interval <= 0 or initial_retry <= 0:
            raise ValueError(
                f"{name}: intervals must be positive (min {min_interval}, "
                f"retry {initial_retry}..{retry_interval}, max {max_interval})"
            )
        if max_interval < min_interval:
            raise ValueError(
                f"{name}: max_interval ({max_interval}s) must be >= min_interval ({min_interval}s)"
            )
        self.name = name
        self._fn = fn
        self.min_interval = min_interval
        self.retry_interval = retry_interval
        self.max_interval = max_interval
        self.initial_retry = initial_retry
        self.pacing = pacing
        self._cost_clock = cost_clock
        self.last_rest = min_interval
        """The rest after the last run (seconds)."""
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        # Wakes the loop: a request, a failure outside the loop, or a stop.
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._requested = False
        # The outcome of the last run made outside the loop, not yet taken into account.
        self._outside: bool | None = None
        self._failures = 0

    def backoff(self, failures: int) -> float:
        """Seconds to wait after ``failures`` consecutive failures (1 or more)."""
        ceiling = min(self.retry_interval, self.max_interval)
        if failures < 1:
            return ceiling
        # 2**60 overflows nothing and exceeds any sane ceiling: no need to go further.
        return min(self.initial_retry * 2.0 ** min(failures - 1, 60), ceiling)

    def rest_after(self, cost: float, changes: int | None = None) -> float:
        """Seconds to rest after a run whose work cost ``cost`` CPU seconds and carried
        ``changes`` changes (and keep it as :attr:`last_rest`)."""
        rest = self.min_interval
        if self.pacing is not None:
            rest = max(rest, self.pacing.rest(cost, 1 if changes is None else changes))
        self.last_rest = rest
        return rest

    def run(self) -> None:
        """Ask for a run as soon as the rate limit allows; never blocks."""
        with self._lock:
            self._requested = True
        self._wake.set()

    def ran_outside(self, ok: bool) -> None:
        """``fn``'s work was run outside the loop: on failure retry after the backoff."""
        with self._lock:
            self._outside = ok
        self._wake.set()

    def loop(self, stop: threading.Event) -> None:
        """Run the loop in the calling thread until ``stop`` is set."""
        logger.debug("%s: loop running", self.name)
        # Event.wait cannot watch two events; a small thread turns `stop` into a wake-up.
        bridge = threading.Thread(
            target=self._wake_on_stop, args=(stop,), name=f"{self.name}-stop", daemon=True
        )
        bridge.start()
        next_run = self._clock.now() + self.max_interval
        retried_now = False
        while not stop.is_set():
            remaining = next_run - self._clock.now()
            if remaining > 0:
                self._clock.wait(self._wake, remaining)
            if stop.is_set():
                break
            with self._lock:
                requested, self._requested = self._requested, False
                outside, self._outside = self._outside, None
                self._wake.clear()
            if outside is True:
                self._failures = 0
            elif outside is False:
                self._failures += 1
                next_run = min(next_run, self._clock.now() + self.backoff(self._failures))
            if not requested and self._clock.now() < next_run:
                # A note about an outside run, or back early (a real-clock wait may end a
                # bit short).
                continue
            began = self._cost_clock()
            failure, changes = self._run_once()
            rest = self.rest_after(self._cost_clock() - began, changes)
            if failure is None:
                self._failures = 0
                retried_now = False
                next_run = self._clock.now() + self.max_interval
            else:
                at_once = isinstance(failure, RunFailed) and failure.retry_now and not retried_now
                if not at_once:
                    self._failures += 1
                self._log_failure(failure, at_once)
                retried_now = at_once
                if at_once:
                    next_run = self._clock.now()
                    continue
                next_run = self._clock.now() + self.backoff(self._failures)
            if rest > 0 and self._clock.wait(stop, rest):
                break
        logger.debug("%s: loop stopped", self.name)

    def _wake_on_stop(self, stop: threading.Event) -> None:
        stop.wait()
        self._wake.set()

    def _run_once(self) -> tuple[Exception | None, int | None]:
        """Call ``fn``; the exception it raised (never propagated), or what it returned."""
        try:
            return None, self._fn()
        except Exception as err:  # the loop must survive any failure of fn
            return err, None

    def _log_failure(self, err: Exception, at_once: bool) -> None:
        logger.error(
            "%s: run failed, retrying %s: %s",
            self.name,
            "at once" if at_once else f"within {self.backoff(self._failures):.3g}s",
            err,
            exc_info=(type(err), err, err.__traceback__)
            if not isinstance(err, RunFailed)
            else None,
        )
