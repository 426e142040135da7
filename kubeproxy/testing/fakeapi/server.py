"""The fake API server itself: its state, its HTTP front, its list and watch serving.

:class:`FakeAPIServer` holds the cluster's objects, their history and the open watches
under one lock, and answers requests from that state; its tests' controls (apply,
delete, compact, the injected faults, the request log) are its public methods. What
needs none of that state lives beside it in this package: the resource table
(:mod:`~kubeproxy.testing.fakeapi.resources`), what a request is
(:mod:`~kubeproxy.testing.fakeapi.requestinfo`), selectors
(:mod:`~kubeproxy.testing.fakeapi.selectors`), Status bodies
(:mod:`~kubeproxy.testing.fakeapi.status`), discovery documents
(:mod:`~kubeproxy.testing.fakeapi.discovery`) and a watch's events and their encoding
(:mod:`~kubeproxy.testing.fakeapi.watchstream`).
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import copy as _copy
import itertools
import json
import logging
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kubeproxy.extras import require_extra
from kubeproxy.testing.fakeapi.discovery import discovery_document
from kubeproxy.testing.fakeapi.requestinfo import APIRequest, Route
from kubeproxy.testing.fakeapi.resources import BY_KIND, RESOURCES, JSONObject, ResourceInfo
from kubeproxy.testing.fakeapi.selectors import BadRequest, Selector, parse_selector
from kubeproxy.testing.fakeapi.status import status
from kubeproxy.testing.fakeapi.watchstream import Change, ChunkWriter, Watch, filtered

__all__ = ["FakeAPIServer"]

# The whole fake logs under one name, as it did when it was one module.
logger = logging.getLogger("kubeproxy.testing.fakeapi")


@dataclass(slots=True)
class _Failure:
    status: int
    remaining: int
    verb: str | None


@dataclass(frozen=True, slots=True)
class _Snapshot:
    rv: int
    items: tuple[JSONObject, ...]


def _rfc3339(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], fake: FakeAPIServer, tls: ssl.SSLContext | None
    ) -> None:
        self.fake = fake
        self.tls = tls
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, address = super().get_request()
        if self.tls is not None:
            # The handshake happens in the connection's own thread (_Handler.setup), so a
            # slow or failing client never holds up the accept loop.
            conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        return conn, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that refuses our certificate (or that we refuse) is the test's
        # business, not a traceback on stderr.
        logger.debug("fakeapi: connection from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; Nagle plus delayed ACKs would add
    # 40 ms to every response.
    disable_nagle_algorithm = True
    server: _Server

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()
        super().setup()
        self.server.fake._connection_opened(self.connection, self.server)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.fake._connection_closed(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("fakeapi: " + format, *args)

    def do_GET(self) -> None:
        self.server.fake._handle(self, "GET")

    def do_POST(self) -> None:
        self.server.fake._handle(self, "POST")

    def do_PUT(self) -> None:
        self.server.fake._handle(self, "PUT")

    def do_PATCH(self) -> None:
        self.server.fake._handle(self, "PATCH")

    def do_DELETE(self) -> None:
        self.server.fake._handle(self, "DELETE")


class FakeAPIServer:
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
        self._lock = threading.Condition(threading.RLock())
        self._objects: dict[str, dict[tuple[str, str], JSONObject]] = {r: {} for r in RESOURCES}
        self._rv = 0
        self._compacted = 0
        self._history: list[Change] = []
        self._history_rvs: list[int] = []
        self._snapshots: dict[str, _Snapshot] = {}
        self._snapshot_ids = itertools.count(1)
        self._failures: dict[str, list[_Failure]] = {}
        self._requests: list[APIRequest] = []
        self._watches: list[Watch] = []
        self._connections: set[socket.socket] = set()
        self._generation = 0
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # Life cycle

    def start(self) -> FakeAPIServer:
        """Start serving (again, on the same port once it has one); returns ``self``."""
        with self._lock:
            if self._server is not None:
                return self
            server = _Server((self.host, self.port), self, self.tls)
            self.port = server.server_address[1]
            self._generation += 1
            self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"fakeapi-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop as a killed server would: listener closed, every connection cut mid-stream.

        The state (objects, history, resource versions) is kept for :meth:`start`.
        """
        with self._lock:
            server, self._server = self._server, None
            if server is None:
                return
            self._generation += 1
            connections = list(self._connections)
            self._lock.notify_all()
        server.shutdown()
        server.server_close()
        for conn in connections:
            _cut(conn)
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def restart(self) -> None:
        """:meth:`stop` then :meth:`start`, keeping the port and the state."""
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        """Whether the server is accepting requests."""
        return self._server is not None

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

    # The cluster's state

    @property
    def resource_version(self) -> int:
        """The newest resource version handed out."""
        with self._lock:
            return self._rv

    def apply(self, obj: Mapping[str, Any], *, copy: bool = True) -> JSONObject:
        """Create or replace an object (by kind, namespace, name); returns the stored copy.

        Sets ``metadata.resourceVersion`` (and ``uid``, ``creationTimestamp`` and, for
        namespaced kinds, ``namespace: default`` when missing) and records an ``ADDED`` or
        ``MODIFIED`` watch event. ``copy=False`` stores ``obj`` itself (a JSON-typed
        ``dict`` the caller hands over and never touches again) and returns it: loading
        hundreds of thousands of objects for a benchmark then costs no copies.
        """
        info = self._info_of(obj)
        stored: JSONObject = json.loads(json.dumps(obj)) if copy else dict(obj)
        stored["kind"] = info.kind
        stored["apiVersion"] = info.api_version
        metadata = stored.setdefault("metadata", {})
        name = metadata.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{info.kind} without metadata.name")
        if info.namespaced:
            metadata["namespace"] = metadata.get("namespace") or "default"
        else:
            metadata.pop("namespace", None)
        if info.kind == "EndpointSlice":
            # As the real server serializes an empty list: null.
            for field_name in ("endpoints", "ports"):
                if not stored.get(field_name):
                    stored[field_name] = None
        key = (metadata.get("namespace", ""), name)
        with self._lock:
            old = self._objects[info.resource].get(key)
            if old is not None:
                metadata["uid"] = old["metadata"]["uid"]
                metadata["creationTimestamp"] = old["metadata"]["creationTimestamp"]
            else:
                metadata.setdefault("uid", str(uuid.uuid4()))
                metadata.setdefault("creationTimestamp", _rfc3339(time.time()))
            self._rv += 1
            metadata["resourceVersion"] = str(self._rv)
            self._objects[info.resource][key] = stored
            self._record(info.resource, "ADDED" if old is None else "MODIFIED", stored, old)
            return _copy.deepcopy(stored) if copy else stored

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete an object; records a ``DELETED`` event. False if there was none."""
        info = self._info_of({"kind": kind})
        key = (namespace if info.namespaced else "", name)
        with self._lock:
            old = self._objects[info.resource].pop(key, None)
            if old is None:
                return False
            self._rv += 1
            gone = _copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = str(self._rv)
            self._record(info.resource, "DELETED", gone, old)
            return True

    def get(self, kind: str, namespace: str, name: str, *, copy: bool = True) -> JSONObject | None:
        """A copy of one stored object, or None (``copy=False``: the stored object itself,
        not to be changed)."""
        info = self._info_of({"kind": kind})
        with self._lock:
            obj = self._objects[info.resource].get((namespace if info.namespaced else "", name))
            return _copy.deepcopy(obj) if obj is not None and copy else obj

    def objects(self, kind: str, *, copy: bool = True) -> list[JSONObject]:
        """Copies of every stored object of a kind, in list order (namespace, name).

        ``copy=False`` returns the stored objects themselves (not to be changed).
        """
        info = self._info_of({"kind": kind})
        with self._lock:
            store = self._objects[info.resource]
            return [_copy.deepcopy(store[key]) if copy else store[key] for key in sorted(store)]

    @property
    def posted_events(self) -> list[JSONObject]:
        """The Events clients created, oldest first."""
        return self.objects("Event")

    def compact(self) -> int:
        """Forget history up to now: older resource versions and continue tokens get 410.

        Open watches that are behind get an ``ERROR`` 410 event, as a real watch cache
        does with a watcher it cannot serve. Returns the compaction revision.
        """
        with self._lock:
            self._compacted = self._rv
            cut = bisect.bisect_right(self._history_rvs, self._compacted)
            del self._history[:cut]
            del self._history_rvs[:cut]
            self._snapshots.clear()
            self._lock.notify_all()
            return self._compacted

    # Faults

    def fail_next(
        self, resource: str, status: int, count: int = 1, *, verb: str | None = None
    ) -> None:
        """Answer the next ``count`` requests for ``resource`` (optionally only ``verb``)
        with ``status`` (403, 410, 429, 500, 503, ...) and a Status body."""
        with self._lock:
            self._failures.setdefault(resource, []).append(_Failure(status, count, verb))

    def clear_failures(self) -> None:
        """Forget the failures :meth:`fail_next` queued and that have not happened yet."""
        with self._lock:
            self._failures.clear()

    def drop_watches(self, resource: str | None = None) -> int:
        """Cut open watch connections mid-stream (no clean end); returns how many."""
        return self._signal_watches(resource, drop=True)

    def expire_watches(self, resource: str | None = None) -> int:
        """End open watches with an ``ERROR`` 410 "Expired" event; returns how many."""
        return self._signal_watches(resource, drop=False)

    def open_watches(self, resource: str | None = None) -> int:
        """How many watches are being served now."""
        with self._lock:
            return sum(
                1
                for w in self._watches
                if (resource is None or w.resource == resource)
                and not (w.dropped or w.expired)
                and w.generation == self._generation
            )

    def wait_for_watches(self, resource: str, count: int = 1, timeout: float = 5.0) -> bool:
        """Block until at least ``count`` watches of ``resource`` are open."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self.open_watches(resource) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(min(remaining, 0.05))
            return True

    # Request log

    @property
    def requests(self) -> list[APIRequest]:
        """Every request received, oldest first."""
        with self._lock:
            return list(self._requests)

    def clear_requests(self) -> None:
        """Forget the request log."""
        with self._lock:
            self._requests.clear()

    def resource_requests(self) -> set[tuple[str, str, str]]:
        """The distinct (API group, resource[/subresource], verb) triples requested."""
        return {
            (r.group, r.resource + (f"/{r.subresource}" if r.subresource else ""), r.verb)
            for r in self.requests
            if r.resource
        }

    # Internals: state

    @staticmethod
    def _info_of(obj: Mapping[str, Any]) -> ResourceInfo:
        kind = obj.get("kind")
        info = BY_KIND.get(kind) if isinstance(kind, str) else None
        if info is None:
            raise ValueError(f"the fake API server does not serve kind {kind!r}")
        return info

    def _record(self, resource: str, type_: str, obj: JSONObject, old: JSONObject | None) -> None:
        self._history.append(Change(self._rv, resource, type_, obj, old))
        self._history_rvs.append(self._rv)
        self._lock.notify_all()

    def _signal_watches(self, resource: str | None, *, drop: bool) -> int:
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
                _cut(watch.sock)
        return len(chosen)

    def _connection_opened(self, conn: socket.socket, server: object) -> None:
        # A connection the listener accepted after stop() began (it serves until its
        # shutdown returns, up to half a second later) is cut at once, as a dead server
        # would never have answered it: a client reconnecting in that window used to get
        # a watch of the new generation, and events applied while "away" reached it.
        with self._lock:
            live = server is self._server
            if live:
                self._connections.add(conn)
        if not live:
            _cut(conn)

    def _connection_closed(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.discard(conn)

    def _take_failure(self, resource: str, verb: str) -> int | None:
        with self._lock:
            queue = self._failures.get(resource, [])
            for failure in queue:
                if failure.verb is None or failure.verb == verb:
                    failure.remaining -= 1
                    if failure.remaining <= 0:
                        queue.remove(failure)
                    return failure.status
            return None

    # Internals: HTTP

    def _handle(self, request: _Handler, method: str) -> None:
        if self.delay:
            time.sleep(self.delay)
        parts = urlsplit(request.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        body = b""
        length = int(request.headers.get("Content-Length") or 0)
        if length:
            body = request.rfile.read(length)
        route = self._route(method, parts.path, query)
        recorded = APIRequest(
            route.verb,
            route.resource,
            route.namespace,
            route.subresource,
            route.group,
            route.name,
            parts.path,
        )
        with self._lock:
            self._requests.append(recorded)
        hook = self.on_request
        if hook is not None:
            hook(recorded)
        if self.token is not None and not _bearer(request.headers.get("Authorization"), self.token):
            self._send(request, 401, status(401, "Unauthorized"))
            return
        if not route.resource:
            self._serve_discovery(request, method, parts.path)
            return
        if route.info is None:
            self._send(
                request, 404, status(404, "the server could not find the requested resource")
            )
            return
        info = route.info
        failure = self._take_failure(info.resource, route.verb)
        if failure is not None:
            self._send(request, failure, self._failure_status(failure, route))
            return
        if route.verb not in info.verbs or route.subresource:
            self._send(
                request, 405, status(405, f"{route.verb} is not supported on {info.resource}")
            )
            return
        try:
            if route.verb == "list":
                self._serve_list(request, route, query)
            elif route.verb == "watch":
                self._serve_watch(request, route, query)
            elif route.verb == "get":
                self._serve_get(request, route)
            elif route.verb == "create":
                self._serve_create(request, route, body)
        except BadRequest as err:
            self._send(request, 400, status(400, str(err)))

    def _route(self, method: str, path: str, query: Mapping[str, str]) -> Route:
        parts = [p for p in path.split("/") if p]
        if parts[:1] == ["api"] and len(parts) >= 3:
            group, rest = "", parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 4:
            group, rest = parts[1], parts[3:]
        else:
            return Route(method.lower(), None)
        version = parts[1] if parts[0] == "api" else parts[2]
        namespace = ""
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        resource = rest[0]
        name = rest[1] if len(rest) > 1 else ""
        subresource = "/".join(rest[2:])
        info: ResourceInfo | None = RESOURCES.get(resource)
        if (
            info is None
            or info.group != group
            or info.version != version
            or (resource == "servicecidrs" and not self.service_cidrs)
            or (namespace and not info.namespaced)
        ):
            info = None
        watching = query.get("watch", "").lower() in ("true", "1")
        verb = {
            "GET": "watch" if watching else ("get" if name else "list"),
            "POST": "create",
            "PUT": "update",
            "PATCH": "patch",
            "DELETE": "delete" if name else "deletecollection",
        }[method]
        return Route(verb, info, namespace, name, subresource, group, resource)

    @staticmethod
    def _failure_status(code: int, route: Route) -> JSONObject:
        assert route.info is not None
        info = route.info
        if code == 403:
            scope = (
                f'in the namespace "{route.namespace}"'
                if route.namespace
                else "at the cluster scope"
            )
            user = "system:serviceaccount:kube-system:kube-proxy"
            return status(
                403,
                f'{info.resource} is forbidden: User "{user}" cannot {route.verb} resource '
                f'"{info.resource}" in API group "{info.group}" {scope}',
            )
        if code == 410:
            return status(410, "The provided continue parameter is too old", "Expired")
        if code == 429:
            return status(429, "Too many requests, please try again later.")
        return status(code, f"fake failure injected for {route.verb} {info.resource}")

    @staticmethod
    def _send(
        request: _Handler, code: int, payload: Any, headers: Mapping[str, str] | None = None
    ) -> None:
        data = json.dumps(payload, separators=(",", ":")).encode()
        try:
            request.send_response(code)
            request.send_header("Content-Type", "application/json")
            request.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                request.send_header(key, value)
            request.end_headers()
            request.wfile.write(data)
        except OSError:
            request.close_connection = True

    def _selector(self, info: ResourceInfo, query: Mapping[str, str]) -> Selector:
        labels = parse_selector(query.get("labelSelector"), fields=False)
        fields = parse_selector(query.get("fieldSelector"), fields=True)
        for requirement in fields:
            if requirement.key not in info.field_labels:
                raise BadRequest(
                    f'"{requirement.key}" is not a known field selector: only '
                    f'"{", ".join(info.field_labels)}"'
                )
        return Selector(labels, fields)

    # Discovery

    def _serve_discovery(self, request: _Handler, method: str, path: str) -> None:
        document = (
            discovery_document(
                path.rstrip("/") or "/",
                git_version=self.git_version,
                address=f"{self.host}:{self.port}",
                service_cidrs=self.service_cidrs,
            )
            if method == "GET"
            else None
        )
        if document is None:
            self._send(
                request, 404, status(404, "the server could not find the requested resource")
            )
        else:
            self._send(request, 200, document)

    # Reads

    def _matching(self, route: Route, selector: Selector) -> tuple[int, list[JSONObject]]:
        assert route.info is not None
        with self._lock:
            store = self._objects[route.info.resource]
            items = [
                store[key]
                for key in sorted(store)
                if (not route.namespace or key[0] == route.namespace)
                and selector.matches(store[key])
            ]
            return self._rv, items

    def _serve_list(self, request: _Handler, route: Route, query: Mapping[str, str]) -> None:
        assert route.info is not None
        info = route.info
        selector = self._selector(info, query)
        token = query.get("continue")
        try:
            limit = int(query.get("limit") or 0)
        except ValueError:
            raise BadRequest(f"invalid limit {query.get('limit')!r}") from None
        if token:
            found = self._continue(token)
            if found is None:
                self._send(
                    request,
                    410,
                    status(
                        410,
                        "The provided continue parameter is too old to display a consistent "
                        "list result. You can start a new list without the continue parameter.",
                        "Expired",
                    ),
                )
                return
            snapshot_id, snapshot, offset = found
            rv, items = snapshot.rv, list(snapshot.items)
        else:
            snapshot_id, offset = "", 0
            rv, items = self._matching(route, selector)
        page = items[offset:] if limit <= 0 else items[offset : offset + limit]
        metadata: JSONObject = {"resourceVersion": str(rv)}
        following = offset + len(page)
        if limit > 0 and following < len(items):
            with self._lock:
                if not snapshot_id:
                    snapshot_id = str(next(self._snapshot_ids))
                    self._snapshots[snapshot_id] = _Snapshot(rv, tuple(items))
            metadata["continue"] = _token(snapshot_id, rv, following)
            metadata["remainingItemCount"] = len(items) - following
        body = {
            "kind": info.list_kind,
            "apiVersion": info.api_version,
            "metadata": metadata,
            "items": [_without_type(item) for item in page],
        }
        self._send(request, 200, body)

    def _continue(self, token: str) -> tuple[str, _Snapshot, int] | None:
        try:
            decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
            snapshot_id, rv, offset = str(decoded["id"]), int(decoded["rv"]), int(decoded["start"])
        except (ValueError, KeyError, TypeError):
            raise BadRequest(f"invalid continue token {token!r}") from None
        with self._lock:
            snapshot = self._snapshots.get(snapshot_id)
            if snapshot is None or rv < self._compacted or snapshot.rv != rv:
                return None
            return snapshot_id, snapshot, offset

    def _serve_get(self, request: _Handler, route: Route) -> None:
        assert route.info is not None
        with self._lock:
            obj = self._objects[route.info.resource].get((route.namespace, route.name))
            payload = _copy.deepcopy(obj) if obj is not None else None
        if payload is None:
            self._send(request, 404, status(404, f'{route.info.resource} "{route.name}" not found'))
        else:
            self._send(request, 200, payload)

    def _serve_create(self, request: _Handler, route: Route, body: bytes) -> None:
        assert route.info is not None
        try:
            obj = json.loads(body)
        except ValueError:
            raise BadRequest("the request body is not JSON") from None
        if not isinstance(obj, dict) or obj.get("kind") != route.info.kind:
            raise BadRequest(f"expected a {route.info.kind}")
        if obj.get("apiVersion") != route.info.api_version:
            raise BadRequest(f"expected apiVersion {route.info.api_version}")
        metadata = obj.setdefault("metadata", {})
        if not isinstance(metadata, dict):
            raise BadRequest("metadata is not an object")
        if metadata.get("namespace") not in (None, "", route.namespace):
            raise BadRequest("the namespace of the object does not match the request's")
        metadata["namespace"] = route.namespace
        if not metadata.get("name"):
            prefix = metadata.get("generateName")
            if not prefix:
                raise BadRequest("name or generateName is required")
            metadata["name"] = prefix + uuid.uuid4().hex[:5]
        with self._lock:
            if (route.namespace, metadata["name"]) in self._objects[route.info.resource]:
                self._send(request, 409, status(409, f'"{metadata["name"]}" already exists'))
                return
            stored = self.apply(obj)
        self._send(request, 201, stored)

    # Watch

    def _serve_watch(self, request: _Handler, route: Route, query: Mapping[str, str]) -> None:
        assert route.info is not None
        info = route.info
        selector = self._selector(info, query)
        bookmarks = query.get("allowWatchBookmarks", "").lower() in ("true", "1")
        try:
            timeout = float(query.get("timeoutSeconds") or self.default_watch_timeout)
            start_text = query.get("resourceVersion") or ""
            start = int(start_text) if start_text not in ("", "0") else None
        except ValueError:
            raise BadRequest("invalid resourceVersion or timeoutSeconds") from None

        request.send_response(200)
        request.send_header("Content-Type", "application/json")
        request.send_header("Transfer-Encoding", "chunked")
        request.end_headers()
        with self._lock:
            watch = Watch(info.resource, request.connection, self._generation)
            self._watches.append(watch)
            self._lock.notify_all()
        try:
            self._stream(request, watch, info, route, selector, start, timeout, bookmarks)
        except OSError:
            request.close_connection = True
        finally:
            with self._lock:
                self._watches.remove(watch)

    def _stream(
        self,
        request: _Handler,
        watch: Watch,
        info: ResourceInfo,
        route: Route,
        selector: Selector,
        start: int | None,
        timeout: float,
        bookmarks: bool,
    ) -> None:
        write = ChunkWriter(request)
        initial: list[JSONObject] = []
        with self._lock:
            if start is None:
                position, initial = self._matching(route, selector)
            elif start < self._compacted:
                position = -1
            else:
                position = start
        if position < 0:
            write.event(
                "ERROR", status(410, f"too old resource version: {start} ({self._compacted})")
            )
            write.end()
            return
        for obj in initial:
            write.event("ADDED", obj)
        now = time.monotonic()
        deadline = now + timeout
        next_bookmark = now + self.bookmark_interval
        while True:
            with self._lock:
                while True:
                    if watch.dropped or watch.generation != self._generation:
                        request.close_connection = True
                        return  # cut: no clean end, as from a dead server
                    if watch.expired or position < self._compacted:
                        break
                    if (
                        self._rv > position
                        and self._history_rvs
                        and self._history_rvs[-1] > position
                    ):
                        break
                    now = time.monotonic()
                    wake = min(deadline, next_bookmark) if bookmarks else deadline
                    if now >= wake:
                        break
                    self._lock.wait(wake - now)
                if watch.expired or position < self._compacted:
                    expired = True
                    changes: list[Change] = []
                else:
                    expired = False
                    begin = bisect.bisect_right(self._history_rvs, position)
                    changes = [c for c in self._history[begin:] if c.resource == info.resource]
                    position = self._rv
            if expired:
                write.event("ERROR", status(410, "too old resource version", "Expired"))
                write.end()
                return
            for change in changes:
                event = filtered(change, route, selector)
                if event is not None:
                    write.event(*event)
            now = time.monotonic()
            if now >= deadline:
                write.end()
                return
            if bookmarks and now >= next_bookmark:
                write.event(
                    "BOOKMARK",
                    {
                        "kind": info.kind,
                        "apiVersion": info.api_version,
                        "metadata": {"resourceVersion": str(position)},
                    },
                )
                next_bookmark = now + self.bookmark_interval


def _bearer(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries ``token``: the scheme in any case, as
    kube-apiserver reads it (the official client's in-cluster loader sends ``bearer``)."""
    scheme, _, credentials = (header or "").partition(" ")
    return scheme.lower() == "bearer" and credentials.strip() == token


def _without_type(item: JSONObject) -> JSONObject:
    # Stored objects are never mutated (apply stores a new one), so sharing is safe.
    return {k: v for k, v in item.items() if k not in ("kind", "apiVersion")}


def _token(snapshot_id: str, rv: int, start: int) -> str:
    raw = json.dumps({"id": snapshot_id, "rv": rv, "start": start}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _cut(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
