"""A rate-limited sync loop: upstream's ``BoundedFrequencyRunner`` semantics.

The loop runs a function when asked (:meth:`BoundedFrequencyRunner.run`), at least every
``max_interval``, again after ``retry_interval`` when the function failed, and never
more often than once per ``min_interval``. Requests coalesce in a single slot: any number
of :meth:`~BoundedFrequencyRunner.run` calls while the loop is busy or resting yield one
run. Time is read and waited on through an injected :class:`Clock`, so tests drive the
loop with a fake clock and no real sleeping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["BoundedFrequencyRunner", "Clock", "MonotonicClock", "RunFailed"]

logger = logging.getLogger(__name__)


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

    The runner then logs one short line instead of a second traceback.
    """


class MonotonicClock:
    """The real clock: :func:`time.monotonic` and :meth:`threading.Event.wait`."""

    def now(self) -> float:
        """Seconds since an arbitrary point, never going backwards."""
        return time.monotonic()

    def wait(self, event: threading.Event, timeout: float) -> bool:
        """Wait on ``event`` for at most ``timeout`` seconds."""
        return event.wait(max(timeout, 0.0))


class BoundedFrequencyRunner:
    """Runs ``fn`` on request, rate-limited, with a retry and a periodic fallback.

    Rules (upstream ``pkg/proxy/runner``):

    * :meth:`run` never blocks; requests made before the next run starts coalesce into one.
    * Without requests, ``fn`` runs ``max_interval`` after the previous run ended (and
      ``max_interval`` after :meth:`loop` started, for the first one).
    * When ``fn`` raises, the error is logged and the next run comes at the latest
      ``min(retry_interval, max_interval)`` after the failed one ended.
    * After every run the loop rests ``min_interval`` before starting another; a request
      that arrived meanwhile, even during ``fn`` itself, starts the next run right after.
    """

    def __init__(
        self,
        name: str,
        fn: Callable[[], None],
        min_interval: float,
        retry_interval: float,
        max_interval: float,
        *,
        clock: Clock | None = None,
    ) -> None:
        if min_interval < 0 or retry_interval <= 0 or max_interval <= 0:
            raise ValueError(
                f"{name}: intervals must be positive (min {min_interval}, "
                f"retry {retry_interval}, max {max_interval})"
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
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        # The one-slot request channel; also set when the loop must wake up to stop.
        self._requested = threading.Event()

    def run(self) -> None:
        """Ask for a run as soon as the rate limit allows; never blocks."""
        self._requested.set()

    def loop(self, stop: threading.Event) -> None:
        """Run the loop in the calling thread until ``stop`` is set."""
        logger.debug("%s: loop running", self.name)
        # Event.wait cannot watch two events; a small thread turns `stop` into a wake-up.
        bridge = threading.Thread(
            target=self._wake_on_stop, args=(stop,), name=f"{self.name}-stop", daemon=True
        )
        bridge.start()
        next_run = self._clock.now() + self.max_interval
        while not stop.is_set():
            remaining = next_run - self._clock.now()
            woken = remaining <= 0 or self._clock.wait(self._requested, remaining)
            if not woken and self._clock.now() < next_run:
                # Back early without a request (a real-clock wait may end a bit short).
                continue
            if stop.is_set():
                break
            self._requested.clear()
            failed = self._run_once()
            interval = min(self.retry_interval, self.max_interval) if failed else self.max_interval
            next_run = self._clock.now() + interval
            if self.min_interval > 0 and self._clock.wait(stop, self.min_interval):
                break
        logger.debug("%s: loop stopped", self.name)

    def _wake_on_stop(self, stop: threading.Event) -> None:
        stop.wait()
        self._requested.set()

    def _run_once(self) -> bool:
        """Call ``fn``; True if it raised (logged here, never propagated)."""
        try:
            self._fn()
        except Exception as err:  # the loop must survive any failure of fn
            logger.error(
                "%s: run failed, retrying within %.3gs: %s",
                self.name,
                min(self.retry_interval, self.max_interval),
                err,
                exc_info=not isinstance(err, RunFailed),
            )
            return True
        return False
