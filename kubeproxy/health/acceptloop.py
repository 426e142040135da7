"""One thread accepting connections on many listening sockets: the HealthCheckNodePorts'.

Apart from the Service health server (:mod:`kubeproxy.health.services`), which decides
which ports are open and what a probe is answered: this is only the socket loop (an
epoll set, a wake-up pair, handler slots), with no HTTP in it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from kubeproxy.host.httpserving import HandlerSlots

__all__ = ["AcceptLoop"]

# All of health logs under one name, as it did when it was one module.
logger = logging.getLogger("kubeproxy.health")


class AcceptLoop:
    """One thread accepting on many listening sockets; each connection gets a thread.

    A thread per listener would wake up hundreds of times a second with many
    LoadBalancer Services; one epoll set costs nothing while idle. Handler threads take
    a slot of ``slots`` before the connection is accepted: while all are busy the loop
    waits and connections queue in the listeners' accept queues.
    """

    def __init__(self, name: str, slots: HandlerSlots) -> None:
        self.slots = slots
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, sock: socket.socket, handle: Callable[[socket.socket], None]) -> None:
        """Start accepting on ``sock`` (non-blocking, listening); ``handle`` runs in a
        thread of its own for each connection, which it must close."""
        self._selector.register(sock, selectors.EVENT_READ, handle)

    def remove(self, sock: socket.socket) -> None:
        """Stop accepting on ``sock`` and close it."""
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        sock.close()

    def close(self) -> None:
        """Stop the loop (listeners still registered are closed)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for key in list(self._selector.get_map().values()):
            if key.data is not None:
                self.remove(key.fileobj)  # type: ignore[arg-type]
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _run(self) -> None:
        while not self._closed:
            try:
                ready = self._selector.select()
            except OSError as err:
                logger.error("health-check accept loop: %s", err)
                time.sleep(0.1)
                continue
            for key, _ in ready:
                if key.data is None:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(64)
                    continue
                if not self.slots.acquire(lambda: self._closed):
                    return
                listener: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    conn, _ = listener.accept()
                except OSError:  # nothing to accept any more, or closed under us by remove()
                    self.slots.release()
                    continue
                self.slots.run(functools.partial(key.data, conn))
