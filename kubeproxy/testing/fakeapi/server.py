"""The fake API server itself: the cluster state served over HTTP, and the tests' controls.

:class:`FakeAPIServer` is a :class:`~kubeproxy.testing.fakeapi.store.ClusterState` (what
tests apply, delete and compact, and what lists and watches read) with a server on top;
its methods are the tests' controls. Each concept it is made of lives in a module of its
own in this package: the state (:mod:`~kubeproxy.testing.fakeapi.store`), the injected
faults and the open watches they act on (:mod:`~kubeproxy.testing.fakeapi.faults`), the
socket, threads and connections (:mod:`~kubeproxy.testing.fakeapi.listener`), what each
request gets (:mod:`~kubeproxy.testing.fakeapi.serving`,
:mod:`~kubeproxy.testing.fakeapi.listwatch`), and below them the resource table, routing,
selectors, Status bodies, discovery documents and a watch's wire encoding.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any

from kubeproxy.extras import require_extra
from kubeproxy.testing.fakeapi.faults import Failures, OpenWatches
from kubeproxy.testing.fakeapi.listener import Listener
from kubeproxy.testing.fakeapi.requestinfo import APIRequest
from kubeproxy.testing.fakeapi.serving import Front
from kubeproxy.testing.fakeapi.store import ClusterState

__all__ = ["FakeAPIServer"]


class FakeAPIServer(ClusterState):
    """An in-process fake kube-apiserver (see :mod:`kubeproxy.testing.fakeapi`).

    ``service_cidrs`` says whether ``networking.k8s.io/v1`` serves ``servicecidrs``;
    ``bookmark_interval`` is how often a watch that asked for bookmarks gets one;
    ``default_watch_timeout`` ends watches that gave no ``timeoutSeconds``; ``token``, when
    set, is the bearer token every request must carry (else 401); ``tls``, when given,
    makes it serve HTTPS with that context (:mod:`~kubeproxy.testing.fakeapi.tls` makes
    the certificates and the context, one that asks for client certificates too).
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        service_cidrs: bool = True,
        bookmark_interval: float = 1.0,
        default_watch_timeout: float = 60.0,
        token: str | None = None,
        git_version: str = "v1.36.0",
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.tls = tls
        self.port = port
        self.service_cidrs = service_cidrs
        self.bookmark_interval = bookmark_interval
        self.default_watch_timeout = default_watch_timeout
        self.token = token
        self.git_version = git_version
        self.delay = 0.0
        """Seconds to wait before answering any request (a slow server)."""
        self.on_request: Callable[[APIRequest], None] | None = None
        """Called with each request once recorded, before it is answered (a test's hook
        to change the state at an exact point, e.g. compact between two list pages)."""
        super().__init__()
        self._failures = Failures()
        self._watches = OpenWatches(self.lock)
        self._requests: list[APIRequest] = []
        front = Front(self, self, self._failures, self._watches, self._requests)
        self._listener = Listener(front.serve, self._watches, self.lock)

    # Life cycle

    def start(self) -> FakeAPIServer:
        """Start serving (again, on the same port once it has one); returns ``self``."""
        self.port = self._listener.start(self.host, self.port, self.tls)
        return self

    def stop(self) -> None:
        """Stop as a killed server would: listener closed, every connection cut mid-stream.

        The state (objects, history, resource versions) is kept for :meth:`start`.
        """
        self._listener.stop()

    def restart(self) -> None:
        """:meth:`stop` then :meth:`start`, keeping the port and the state."""
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        """Whether the server is accepting requests."""
        return self._listener.server is not None

    @property
    def url(self) -> str:
        """The base URL (``http://127.0.0.1:<port>``, ``https://`` with ``tls``)."""
        scheme = "https" if self.tls is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    def api_client(self, *, token: str | None = None) -> Any:
        """An official ``kubernetes.client.ApiClient`` pointed at this server (it needs
        ``kubeproxy[kubernetes]``; the fake itself needs only the standard library)."""
        require_extra("kubernetes", "kubernetes", "FakeAPIServer.api_client()")
        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = self.url
        # No silent urllib3 retries: a test sees each failure as the client's caller does.
        configuration.retries = False
        bearer = token if token is not None else self.token
        if bearer:
            configuration.api_key = {"authorization": f"Bearer {bearer}"}
        return client.ApiClient(configuration)

    def __enter__(self) -> FakeAPIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # Faults

    def fail_next(
        self, resource: str, status: int, count: int = 1, *, verb: str | None = None
    ) -> None:
        """Answer the next ``count`` requests for ``resource`` (optionally only ``verb``)
        with ``status`` (403, 410, 429, 500, 503, ...) and a Status body."""
        self._failures.add(resource, status, count, verb)

    def clear_failures(self) -> None:
        """Forget the failures :meth:`fail_next` queued and that have not happened yet."""
        self._failures.clear()

    def drop_watches(self, resource: str | None = None) -> int:
        """Cut open watch connections mid-stream (no clean end); returns how many."""
        return self._watches.signal(resource, drop=True)

    def expire_watches(self, resource: str | None = None) -> int:
        """End open watches with an ``ERROR`` 410 "Expired" event; returns how many."""
        return self._watches.signal(resource, drop=False)

    def open_watches(self, resource: str | None = None) -> int:
        """How many watches are being served now."""
        return self._watches.count(resource)

    def wait_for_watches(self, resource: str, count: int = 1, timeout: float = 5.0) -> bool:
        """Block until at least ``count`` watches of ``resource`` are open."""
        return self._watches.wait_for(resource, count, timeout)

    # Request log

    @property
    def requests(self) -> list[APIRequest]:
        """Every request received, oldest first."""
        with self.lock:
            return list(self._requests)

    def clear_requests(self) -> None:
        """Forget the request log."""
        with self.lock:
            self._requests.clear()

    def resource_requests(self) -> set[tuple[str, str, str]]:
        """The distinct (API group, resource[/subresource], verb) triples requested."""
        return {
            (r.group, r.resource + (f"/{r.subresource}" if r.subresource else ""), r.verb)
            for r in self.requests
            if r.resource
        }
