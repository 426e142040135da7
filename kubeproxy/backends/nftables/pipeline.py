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
        self._queue: queue.Queue[T | _Stop] = queue.Queue(maxsize=depth)
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
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
        return self._thread is not None

    def post(self, item: T) -> None:
        """Hand ``item`` over (blocks while ``depth`` items wait); raise the first
        failure of an earlier item instead, if there was one (the run is then over:
        :meth:`settle` or :meth:`abandon` it)."""
        failure = self._failure
        if failure is not None:
            raise failure
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        start = time.perf_counter()
        self._queue.put(item)
        self.waited_s += time.perf_counter() - start

    def idle(self) -> None:
        """Wait until every posted item was sent (or skipped after a failure); the
        failure stays for the poster's :meth:`settle`."""
        if self._thread is not None:
            self._queue.join()

    def settle(self) -> None:
        """End the run: wait for every posted item, then raise the first failure."""
        start = time.perf_counter()
        self._end()
        self.waited_s += time.perf_counter() - start
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def abandon(self) -> None:
        """End the run without sending what still waits (the item in flight finishes);
        forget any failure (the caller is failing already, with its own error)."""
        self._dropping = True
        try:
            self._end()
        finally:
            self._dropping = False
            self._failure = None

    def _end(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self._queue.put(_STOP)
        thread.join()
        self._thread = None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if isinstance(item, _Stop):
                    return
                if self._failure is None and not self._dropping:
                    self._send(item)
                    self.sent += 1
            except BaseException as err:  # handed to the poster's thread
                self._failure = err
            finally:
                self._queue.task_done()
