"""Client-side rate limiting for the API client: a token bucket.

Upstream's client-go limits its requests (``--kube-api-qps``/``--kube-api-burst``); the
Python client has no such limit, so :class:`~kubeproxy.sources.kubernetes.apiclient.
RateLimitedApiClient` takes a token from this bucket before every request. Apart from the
client: it is plain arithmetic on a clock, tested with a fake one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["TokenBucket"]


class TokenBucket:
    """Client-side rate limiting: ``qps`` requests a second, bursts of up to ``burst``.

    ``qps <= 0`` disables the limit. Thread-safe; each caller reserves its slot under the
    lock and waits outside it.
    """

    def __init__(
        self,
        qps: float,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.qps = qps
        self.burst = max(1, burst)
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(self.burst)
        self._last = clock()
        self._lock = threading.Lock()

    def acquire(self) -> float:
        """Take one token, waiting for it if need be; returns the seconds waited."""
        if self.qps <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.qps)
            self._last = now
            self._tokens -= 1.0
            wait = -self._tokens / self.qps if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)
        return wait
