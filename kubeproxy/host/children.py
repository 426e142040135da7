"""The processes a kernel tool executor spawned lately, so that their commits count as ours.

Neutral ground: the iptables and ipvs executors register their children here, and the
nf_tables event watcher (:mod:`kubeproxy.nftevents`) asks it whose commit it saw.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

__all__ = ["ChildProcesses"]


class ChildProcesses:
    """The processes a kernel tool executor spawned lately (iptables-restore...).

    A child commits through a socket of its own; its port id is normally its pid (as we
    see it), and the commit's ``NEWGEN`` pid is its pid where we share the initial pid
    namespace. The executor wraps each spawn in :meth:`spawning` so that a watcher
    judging a commit while a child is being started waits for its pid, and says when
    the child is gone (:meth:`exited`). The last ``remember`` pids are kept (a commit may
    be judged after its child exited); the ones still running are what
    :meth:`subscribe` callbacks get, so the watcher's kernel filter drops their messages
    (a full iptables sync at 10k Services sends hundreds of MB of them) without ever
    filtering a pid that a foreign process might get next.
    """

    def __init__(self, remember: int = 256) -> None:
        self._pids: deque[int] = deque(maxlen=remember)
        self._running: set[int] = set()
        self._pending = 0
        self._changed = threading.Condition()
        self._subscribers: list[Callable[[frozenset[int]], None]] = []

    @contextlib.contextmanager
    def spawning(self) -> Iterator[Callable[[int], None]]:
        """Wrap a spawn: call the function given with the child's pid once known."""
        with self._changed:
            self._pending += 1
        try:
            yield self._note
        finally:
            with self._changed:
                self._pending -= 1
                self._changed.notify_all()

    def _note(self, pid: int) -> None:
        with self._changed:
            self._pids.append(pid)
            self._running.add(pid)
            self._changed.notify_all()
            running = frozenset(self._running)
            subscribers = list(self._subscribers)
        for callback in subscribers:
            callback(running)

    def exited(self, pid: int) -> None:
        """The child ``pid`` is gone (its commits, if any, were all sent)."""
        with self._changed:
            self._running.discard(pid)
            running = frozenset(self._running)
            subscribers = list(self._subscribers)
        for callback in subscribers:
            callback(running)

    @property
    def running(self) -> frozenset[int]:
        """The children started and not yet gone."""
        with self._changed:
            return frozenset(self._running)

    def subscribe(self, callback: Callable[[frozenset[int]], None]) -> Callable[[], None]:
        """Call ``callback(running pids)`` whenever a child starts or ends; returns the
        function that stops it."""
        with self._changed:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._changed:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def spawned(self, *ids: int, wait: float = 1.0) -> bool:
        """Whether any of ``ids`` is a recent child; waits up to ``wait`` seconds for
        spawns under way to tell their pids."""
        deadline = time.monotonic() + wait
        with self._changed:
            while True:
                if any(i in self._pids for i in ids if i):
                    return True
                remaining = deadline - time.monotonic()
                if not self._pending or remaining <= 0:
                    return False
                self._changed.wait(remaining)
