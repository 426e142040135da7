"""The faults tests inject into the fake API server, and the open watches they act on.

:class:`Failures` queues the answers :meth:`~kubeproxy.testing.fakeapi.FakeAPIServer.fail_next`
asks for (403, 410, 5xx... instead of the real answer). :class:`OpenWatches` is every
watch being served: what ``drop_watches`` cuts and ``expire_watches`` ends with a 410,
and what a stop or start of the server ends (its generation changes). Neither knows HTTP.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kubeproxy.testing.fakeapi.watchstream import Watch

__all__ = ["Failures", "OpenWatches", "cut"]


@dataclass(slots=True)
class _Failure:
    status: int
    remaining: int
    verb: str | None


class Failures:
    """The failures queued per resource, taken one request at a time, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: dict[str, list[_Failure]] = {}

    def add(self, resource: str, status: int, count: int, verb: str | None) -> None:
        """Answer the next ``count`` requests for ``resource`` (of ``verb``, or any) with
        ``status``."""
        with self._lock:
            self._queued.setdefault(resource, []).append(_Failure(status, count, verb))

    def clear(self) -> None:
        """Forget the failures that have not happened yet."""
        with self._lock:
            self._queued.clear()

    def take(self, resource: str, verb: str) -> int | None:
        """The status to answer this request with, None for the real answer."""
        with self._lock:
            queue = self._queued.get(resource, [])
            for failure in queue:
                if failure.verb is None or failure.verb == verb:
                    failure.remaining -= 1
                    if failure.remaining <= 0:
                        queue.remove(failure)
                    return failure.status
            return None


class OpenWatches:
    """The watches being served, under the cluster state's lock (a watch waits on it for
    changes and for these signals alike)."""

    def __init__(self, lock: threading.Condition) -> None:
        self._lock = lock
        self._watches: list[Watch] = []
        self._generation = 0

    def new_generation(self) -> None:
        """The server stopped or started: every watch of the old one is cut."""
        with self._lock:
            self._generation += 1
            self._lock.notify_all()

    @contextlib.contextmanager
    def serving(self, resource: str, sock: socket.socket) -> Iterator[Watch]:
        """Count a watch as open while it is served."""
        with self._lock:
            watch = Watch(resource, sock, self._generation)
            self._watches.append(watch)
            self._lock.notify_all()
        try:
            yield watch
        finally:
            with self._lock:
                self._watches.remove(watch)

    def is_cut(self, watch: Watch) -> bool:
        """Whether the watch ends without a clean end, as from a dead server (the caller
        holds the lock)."""
        return watch.dropped or watch.generation != self._generation

    def signal(self, resource: str | None, *, drop: bool) -> int:
        """Cut (``drop``) or expire the open watches of ``resource`` (None: all); how many."""
        with self._lock:
            chosen = [
                w
                for w in self._watches
                if (resource is None or w.resource == resource) and not (w.dropped or w.expired)
            ]
            for watch in chosen:
                if drop:
                    watch.dropped = True
                else:
                    watch.expired = True
            self._lock.notify_all()
        if drop:
            for watch in chosen:
                cut(watch.sock)
        return len(chosen)

    def count(self, resource: str | None = None) -> int:
        """How many watches (of ``resource``, None: of any) are being served now."""
        with self._lock:
            return sum(
                1
                for w in self._watches
                if (resource is None or w.resource == resource)
                and not (w.dropped or w.expired)
                and w.generation == self._generation
            )

    def wait_for(self, resource: str, count: int, timeout: float) -> bool:
        """Block until at least ``count`` watches of ``resource`` are open."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self.count(resource) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(min(remaining, 0.05))
            return True


def cut(conn: socket.socket) -> None:
    """Cut a connection mid-stream, as a dead server or a broken network would."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
