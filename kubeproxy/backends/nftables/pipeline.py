"""A writer thread that sends what one thread hands over, in order, while that thread
goes on (:class:`Pipeline`).

Why a thread: nfnetlink handles a batch inside the sender's ``sendmsg`` (the messages
parsed, the elements inserted, the transaction committed), and a socket send releases
the GIL. So the kernel's work on transaction k can run on another core while our thread
encodes transaction k+1. A cold start at 100k Services x 10 endpoints spent about 2 s
of its 16 s in the element batches' exchanges (224 ``sendall``, a py-spy sample of
d4d5b59), with no Python running meanwhile. Measured with the writer thread
(``python -m bench.pipeline --services 100000``): the syncing thread's CPU time went from
10.0-10.2 s to 8.4-8.5 s, the process's the same; details in the package README ("A full
sync's element batches, pipelined").

What it keeps: the order things were handed over (one thread sends them, one at a time);
bounded memory (:meth:`Pipeline.post` blocks while ``depth`` items wait: at most
``depth`` queued, one in flight and the caller's next one); the first failure, which
:meth:`Pipeline.post` or :meth:`Pipeline.settle` raises in the caller's thread, after
which nothing more is sent until :meth:`Pipeline.settle` or :meth:`Pipeline.abandon`
(the caller's transaction is failing: sending the rest would only add to what it must
take back). The thread lives from the first hand-over to the settle: no thread is left
behind between syncs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Pipeline"]

T = TypeVar("T")


class _Stop:
    """The end of a run, queued after the last item."""


_STOP = _Stop()


class _Run(Generic[T]):
    """One run's queue and thread. A run's own queue: an end queued twice (an end
    interrupted in its join, then abandoned; or a ``close`` from another thread during a
    settle) leaves its second stop marker in that run's queue, never in the next run's,
    whose thread it would end before its first item (found by a second read: the next
    sync then waited for ever)."""

    __slots__ = ("failure", "queue", "thread")

    def __init__(self, depth: int) -> None:
        self.queue: queue.Queue[T | _Stop] = queue.Queue(maxsize=depth)
        self.thread: threading.Thread | None = None
        self.failure: BaseException | None = None


class Pipeline(Generic[T]):
    """Calls ``send`` on each posted item, in order, in a thread of its own (see the
    module). ``depth``: how many items may wait for the thread (at least one).

    One thread posts (the sync's); any thread may wait for the pipeline to be idle
    (:meth:`idle`: other users of the same socket, whose writes must not pass the
    posted ones)."""

    def __init__(self, send: Callable[[T], None], *, depth: int = 1, name: str = "pipeline"):
        if depth < 1:
            raise ValueError("a pipeline holds at least one item")
        self._send = send
        self._name = name
        self._depth = depth
        self._run: _Run[T] | None = None
        self._ending = threading.Lock()
        self._dropping = False
        self.sent = 0
        """How many items were sent (for tests and benches)."""
        self.waited_s = 0.0
        """How long the poster waited for the thread, in :meth:`post` and :meth:`settle`
        (benches: with a core to spare, the poster's wall time is its CPU time and
        this)."""

    @property
    def busy(self) -> bool:
        """Whether a run is under way (items posted and not yet settled)."""
        return self._run is not None

    @property
    def dropping(self) -> bool:
        """Whether the run is being abandoned (what is in flight finishes, unreported)."""
        return self._dropping

    def post(self, item: T) -> None:
        """Hand ``item`` over (blocks while ``depth`` items wait); raise the first
        failure of an earlier item instead, if there was one (the run is then over:
        :meth:`settle` or :meth:`abandon` it)."""
        run = self._run
        if run is None:
            run = _Run[T](self._depth)
            run.thread = threading.Thread(
                target=self._serve, args=(run,), name=self._name, daemon=True
            )
            self._run = run
            run.thread.start()
        elif run.failure is not None:
            raise run.failure
        start = time.perf_counter()
        run.queue.put(item)
        self.waited_s += time.perf_counter() - start

    def idle(self) -> None:
        """Wait until every posted item was sent (or skipped after a failure); the
        failure stays for the poster's :meth:`settle`."""
        run = self._run
        if run is not None:
            run.queue.join()

    def settle(self) -> None:
        """End the run: wait for every posted item, then raise the first failure."""
        start = time.perf_counter()
        run = self._end()
        self.waited_s += time.perf_counter() - start
        if run is not None and run.failure is not None:
            raise run.failure

    def abandon(self) -> None:
        """End the run without sending what still waits (the item in flight finishes);
        forget any failure (the caller is failing already, with its own error)."""
        self._dropping = True
        try:
            self._end()
        finally:
            self._dropping = False

    def _end(self) -> _Run[T] | None:
        """Queue the run's stop marker, let the run go, wait for its thread; the run."""
        with self._ending:
            run = self._run
            if run is None:
                return None
            run.queue.put(_STOP)
            self._run = None
        assert run.thread is not None
        run.thread.join()
        return run

    def _serve(self, run: _Run[T]) -> None:
        while True:
            item = run.queue.get()
            try:
                if isinstance(item, _Stop):
                    return
                if run.failure is None and not self._dropping:
                    self._send(item)
                    self.sent += 1
            except BaseException as err:  # handed to the poster's thread
                run.failure = err
            finally:
                run.queue.task_done()
