"""A fake Kubernetes API server, enough to drive a service proxy end to end.

:class:`FakeAPIServer` speaks HTTP/1.1 on 127.0.0.1 (stdlib only) the way kube-apiserver
does for the calls a proxy makes: ``/version`` and API discovery; list (with ``limit`` and
``continue``) and watch (one JSON event per line, chunked, ``BOOKMARK`` events when asked
for, an ``ERROR`` 410 event for a compacted ``resourceVersion``, closing after
``timeoutSeconds``) of Services, EndpointSlices, Nodes and ServiceCIDRs; label selectors
(``key``, ``!key``, ``key=value``, ``key!=value``) and the field selectors each resource
supports (``metadata.name=...``, ``spec.clusterIP!=None``, ...); and creating Events.

Tests change the cluster with :meth:`FakeAPIServer.apply` and :meth:`FakeAPIServer.delete`
(which work while the server is stopped too) and misbehave on purpose with
:meth:`~FakeAPIServer.fail_next` (403, 5xx, 410...), :meth:`~FakeAPIServer.drop_watches`,
:meth:`~FakeAPIServer.expire_watches`, :attr:`~FakeAPIServer.delay`,
:meth:`~FakeAPIServer.compact` and :meth:`~FakeAPIServer.stop` /
:meth:`~FakeAPIServer.start` (the same port, the same state). Every request is recorded in
:attr:`~FakeAPIServer.requests` with its verb as RBAC names it, so a test can compare what
a client did with what a ClusterRole allows (:func:`allowed_by`).

Like the real server, lists leave ``kind``/``apiVersion`` out of their items, watch events
carry them, and an EndpointSlice without endpoints or ports has them as ``null``.
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
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlsplit

__all__ = [
    "RESOURCES",
    "APIRequest",
    "FakeAPIServer",
    "ResourceInfo",
    "allowed_by",
    "endpoint_slice",
    "node",
    "service",
    "service_cidr",
]

logger = logging.getLogger(__name__)

JSONObject = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ResourceInfo:
    """One API resource the fake serves."""

    resource: str
    kind: str
    group: str
    version: str
    namespaced: bool
    verbs: tuple[str, ...]
    field_labels: tuple[str, ...] = ("metadata.name",)

    @property
    def api_version(self) -> str:
        """``v1`` or ``group/version``."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        """The kind of a list of these."""
        return self.kind + "List"


_READ = ("get", "list", "watch")

RESOURCES: Mapping[str, ResourceInfo] = {
    info.resource: info
    for info in (
        ResourceInfo(
            "services",
            "Service",
            "",
            "v1",
            True,
            _READ,
            ("metadata.name", "metadata.namespace", "spec.clusterIP", "spec.type"),
        ),
        ResourceInfo(
            "endpointslices",
            "EndpointSlice",
            "discovery.k8s.io",
            "v1",
            True,
            _READ,
            ("metadata.name", "metadata.namespace", "addressType"),
        ),
        ResourceInfo(
            "nodes", "Node", "", "v1", False, _READ, ("metadata.name", "spec.unschedulable")
        ),
        ResourceInfo("servicecidrs", "ServiceCIDR", "networking.k8s.io", "v1", False, _READ),
        ResourceInfo(
            "events",
            "Event",
            "events.k8s.io",
            "v1",
            True,
            ("create", "get", "list"),
            ("metadata.name", "metadata.namespace"),
        ),
    )
}
"""The resources the fake serves, by resource name."""

_BY_KIND = {info.kind: info for info in RESOURCES.values()}

# Other resources a discovery document lists in these group/versions, so clients that look
# for "is X served" see a realistic neighbourhood.
_OTHER_RESOURCES: Mapping[str, tuple[tuple[str, str, bool], ...]] = {
    "v1": (("configmaps", "ConfigMap", True), ("namespaces", "Namespace", False)),
    "networking.k8s.io/v1": (
        ("ingresses", "Ingress", True),
        ("networkpolicies", "NetworkPolicy", True),
        ("ipaddresses", "IPAddress", False),
    ),
    "discovery.k8s.io/v1": (),
    "events.k8s.io/v1": (),
}


class APIRequest(NamedTuple):
    """One request as RBAC sees it.

    ``verb`` is Kubernetes' (``get``, ``list``, ``watch``, ``create``, ``update``,
    ``patch``, ``delete``); ``resource`` is empty for a non-resource URL (discovery,
    ``/version``), whose ``path`` then says what was asked.
    """

    verb: str
    resource: str
    namespace: str
    subresource: str
    group: str = ""
    name: str = ""
    path: str = ""


def allowed_by(rules: Iterable[Mapping[str, Any]], request: APIRequest) -> bool:
    """Whether a ClusterRole's ``rules`` allow ``request`` (``*`` wildcards included)."""
    for rule in rules:
        verbs = rule.get("verbs") or ()
        if request.verb not in verbs and "*" not in verbs:
            continue
        if not request.resource:
            urls = rule.get("nonResourceURLs") or ()
            if any(
                url == request.path or (url.endswith("*") and request.path.startswith(url[:-1]))
                for url in urls
            ):
                return True
            continue
        groups = rule.get("apiGroups") or ()
        if request.group not in groups and "*" not in groups:
            continue
        wanted = request.resource + (f"/{request.subresource}" if request.subresource else "")
        resources = rule.get("resources") or ()
        if wanted not in resources and "*" not in resources:
            continue
        names = rule.get("resourceNames") or ()
        if names and request.name not in names:
            continue
        return True
    return False


class _BadRequest(Exception):
    """A request the real server would answer with 400."""


# Selectors


@dataclass(frozen=True, slots=True)
class _Requirement:
    key: str
    op: str  # "exists", "!exists", "=", "!="
    value: str = ""

    def matches(self, values: Mapping[str, Any]) -> bool:
        present = self.key in values
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        equal = present and str(values[self.key]) == self.value
        return equal if self.op == "=" else not equal


def _parse_selector(text: str | None, *, fields: bool) -> tuple[_Requirement, ...]:
    if not text:
        return ()
    requirements = []
    for term in text.split(","):
        term = term.strip()
        if not term:
            raise _BadRequest(f"invalid selector {text!r}: empty term")
        if "!=" in term:
            key, value = term.split("!=", 1)
            requirements.append(_Requirement(key.strip(), "!=", value.strip()))
        elif "==" in term:
            key, value = term.split("==", 1)
            requirements.append(_Requirement(key.strip(), "=", value.strip()))
        elif "=" in term:
            key, value = term.split("=", 1)
            requirements.append(_Requirement(key.strip(), "=", value.strip()))
        elif fields:
            raise _BadRequest(f"invalid field selector {text!r}: {term!r} has no operator")
        elif term.startswith("!"):
            requirements.append(_Requirement(term[1:].strip(), "!exists"))
        else:
            requirements.append(_Requirement(term, "exists"))
        if not requirements[-1].key or any(c in requirements[-1].key for c in " ()"):
            raise _BadRequest(f"invalid selector {text!r}: bad key in {term!r}")
    return tuple(requirements)


def _field_value(obj: Mapping[str, Any], path: str) -> Any:
    current: Any = obj
    for part in path.split("."):
        if not isinstance(current, Mapping):
            return ""
        current = current.get(part)
    return "" if current is None else current


@dataclass(frozen=True, slots=True)
class _Selector:
    labels: tuple[_Requirement, ...] = ()
    fields: tuple[_Requirement, ...] = ()

    def matches(self, obj: Mapping[str, Any]) -> bool:
        if self.labels:
            labels = obj.get("metadata", {}).get("labels") or {}
            if not all(r.matches(labels) for r in self.labels):
                return False
        if self.fields:
            values = {r.key: _field_value(obj, r.key) for r in self.fields}
            if not all(r.matches(values) for r in self.fields):
                return False
        return True


# State


@dataclass(frozen=True, slots=True)
class _Change:
    rv: int
    resource: str
    type: str
    obj: JSONObject
    old: JSONObject | None


@dataclass(slots=True)
class _Watch:
    resource: str
    sock: socket.socket
    generation: int
    dropped: bool = False
    expired: bool = False


@dataclass(slots=True)
class _Failure:
    status: int
    remaining: int
    verb: str | None


@dataclass(frozen=True, slots=True)
class _Snapshot:
    rv: int
    items: tuple[JSONObject, ...]


@dataclass(slots=True)
class _Route:
    verb: str
    info: ResourceInfo | None
    namespace: str = ""
    name: str = ""
    subresource: str = ""
    group: str = ""
    resource: str = ""


_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "AlreadyExists",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def _status(code: int, message: str, reason: str | None = None) -> JSONObject:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or _REASONS.get(code, ""),
        "code": code,
    }


def _rfc3339(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], fake: FakeAPIServer) -> None:
        self.fake = fake
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; Nagle plus delayed ACKs would add
    # 40 ms to every response.
    disable_nagle_algorithm = True
    server: _Server

    def setup(self) -> None:
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
    """An in-process fake kube-apiserver (see the module docstring).

    ``service_cidrs`` says whether ``networking.k8s.io/v1`` serves ``servicecidrs``;
    ``bookmark_interval`` is how often a watch that asked for bookmarks gets one;
    ``default_watch_timeout`` ends watches that gave no ``timeoutSeconds``; ``token``, when
    set, is the bearer token every request must carry (else 401).
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
    ) -> None:
        self.host = host
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
        self._history: list[_Change] = []
        self._history_rvs: list[int] = []
        self._snapshots: dict[str, _Snapshot] = {}
        self._snapshot_ids = itertools.count(1)
        self._failures: dict[str, list[_Failure]] = {}
        self._requests: list[APIRequest] = []
        self._watches: list[_Watch] = []
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
            server = _Server((self.host, self.port), self)
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
        """The base URL (``http://127.0.0.1:<port>``)."""
        return f"http://{self.host}:{self.port}"

    def api_client(self, *, token: str | None = None) -> Any:
        """An official ``kubernetes.client.ApiClient`` pointed at this server."""
        from kubernetes import client  # imported late: the fake itself needs only the stdlib

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
        info = _BY_KIND.get(kind) if isinstance(kind, str) else None
        if info is None:
            raise ValueError(f"the fake API server does not serve kind {kind!r}")
        return info

    def _record(self, resource: str, type_: str, obj: JSONObject, old: JSONObject | None) -> None:
        self._history.append(_Change(self._rv, resource, type_, obj, old))
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
        if self.token is not None and (
            request.headers.get("Authorization") != f"Bearer {self.token}"
        ):
            self._send(request, 401, _status(401, "Unauthorized"))
            return
        if not route.resource:
            self._serve_discovery(request, method, parts.path)
            return
        if route.info is None:
            self._send(
                request, 404, _status(404, "the server could not find the requested resource")
            )
            return
        info = route.info
        failure = self._take_failure(info.resource, route.verb)
        if failure is not None:
            self._send(request, failure, self._failure_status(failure, route))
            return
        if route.verb not in info.verbs or route.subresource:
            self._send(
                request, 405, _status(405, f"{route.verb} is not supported on {info.resource}")
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
        except _BadRequest as err:
            self._send(request, 400, _status(400, str(err)))

    def _route(self, method: str, path: str, query: Mapping[str, str]) -> _Route:
        parts = [p for p in path.split("/") if p]
        if parts[:1] == ["api"] and len(parts) >= 3:
            group, rest = "", parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 4:
            group, rest = parts[1], parts[3:]
        else:
            return _Route(method.lower(), None)
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
        return _Route(verb, info, namespace, name, subresource, group, resource)

    @staticmethod
    def _failure_status(code: int, route: _Route) -> JSONObject:
        assert route.info is not None
        info = route.info
        if code == 403:
            scope = (
                f'in the namespace "{route.namespace}"'
                if route.namespace
                else "at the cluster scope"
            )
            user = "system:serviceaccount:kube-system:kube-proxy"
            return _status(
                403,
                f'{info.resource} is forbidden: User "{user}" cannot {route.verb} resource '
                f'"{info.resource}" in API group "{info.group}" {scope}',
            )
        if code == 410:
            return _status(410, "The provided continue parameter is too old", "Expired")
        if code == 429:
            return _status(429, "Too many requests, please try again later.")
        return _status(code, f"fake failure injected for {route.verb} {info.resource}")

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

    def _selector(self, info: ResourceInfo, query: Mapping[str, str]) -> _Selector:
        labels = _parse_selector(query.get("labelSelector"), fields=False)
        fields = _parse_selector(query.get("fieldSelector"), fields=True)
        for requirement in fields:
            if requirement.key not in info.field_labels:
                raise _BadRequest(
                    f'"{requirement.key}" is not a known field selector: only '
                    f'"{", ".join(info.field_labels)}"'
                )
        return _Selector(labels, fields)

    # Discovery

    def _serve_discovery(self, request: _Handler, method: str, path: str) -> None:
        document = self._discovery(path.rstrip("/") or "/") if method == "GET" else None
        if document is None:
            self._send(
                request, 404, _status(404, "the server could not find the requested resource")
            )
        else:
            self._send(request, 200, document)

    def _discovery(self, path: str) -> JSONObject | None:
        if path == "/version":
            major, minor = self.git_version.lstrip("v").split(".")[:2]
            return {
                "major": major,
                "minor": minor,
                "gitVersion": self.git_version,
                "gitCommit": "fake",
                "gitTreeState": "clean",
                "buildDate": "2026-01-01T00:00:00Z",
                "goVersion": "go1.25",
                "compiler": "gc",
                "platform": "linux/amd64",
            }
        if path == "/api":
            return {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{self.host}:{self.port}"}
                ],
            }
        groups = sorted({info.group for info in RESOURCES.values() if info.group})
        if path == "/apis":
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [self._group(g) for g in groups],
            }
        if path.startswith("/apis/") and path.count("/") == 2 and path[6:] in groups:
            return {"kind": "APIGroup", "apiVersion": "v1", **self._group(path[6:])}
        if path == "/api/v1":
            return self._resource_list("v1")
        if path.startswith("/apis/") and path.count("/") == 3:
            group_version = path[6:]
            if group_version.split("/")[0] in groups and group_version in _OTHER_RESOURCES:
                return self._resource_list(group_version)
        return None

    @staticmethod
    def _group(group: str) -> JSONObject:
        version = {"groupVersion": f"{group}/v1", "version": "v1"}
        return {"name": group, "versions": [version], "preferredVersion": version}

    def _resource_list(self, group_version: str) -> JSONObject:
        resources = []
        for info in RESOURCES.values():
            if info.api_version != group_version:
                continue
            if info.resource == "servicecidrs" and not self.service_cidrs:
                continue
            resources.append(
                {
                    "name": info.resource,
                    "singularName": info.kind.lower(),
                    "namespaced": info.namespaced,
                    "kind": info.kind,
                    "verbs": list(info.verbs),
                }
            )
        for resource, kind, namespaced in _OTHER_RESOURCES.get(group_version, ()):
            resources.append(
                {
                    "name": resource,
                    "singularName": kind.lower(),
                    "namespaced": namespaced,
                    "kind": kind,
                    "verbs": list(_READ),
                }
            )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": group_version,
            "resources": sorted(resources, key=lambda r: str(r["name"])),
        }

    # Reads

    def _matching(self, route: _Route, selector: _Selector) -> tuple[int, list[JSONObject]]:
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

    def _serve_list(self, request: _Handler, route: _Route, query: Mapping[str, str]) -> None:
        assert route.info is not None
        info = route.info
        selector = self._selector(info, query)
        token = query.get("continue")
        try:
            limit = int(query.get("limit") or 0)
        except ValueError:
            raise _BadRequest(f"invalid limit {query.get('limit')!r}") from None
        if token:
            found = self._continue(token)
            if found is None:
                self._send(
                    request,
                    410,
                    _status(
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
            raise _BadRequest(f"invalid continue token {token!r}") from None
        with self._lock:
            snapshot = self._snapshots.get(snapshot_id)
            if snapshot is None or rv < self._compacted or snapshot.rv != rv:
                return None
            return snapshot_id, snapshot, offset

    def _serve_get(self, request: _Handler, route: _Route) -> None:
        assert route.info is not None
        with self._lock:
            obj = self._objects[route.info.resource].get((route.namespace, route.name))
            payload = _copy.deepcopy(obj) if obj is not None else None
        if payload is None:
            self._send(
                request, 404, _status(404, f'{route.info.resource} "{route.name}" not found')
            )
        else:
            self._send(request, 200, payload)

    def _serve_create(self, request: _Handler, route: _Route, body: bytes) -> None:
        assert route.info is not None
        try:
            obj = json.loads(body)
        except ValueError:
            raise _BadRequest("the request body is not JSON") from None
        if not isinstance(obj, dict) or obj.get("kind") != route.info.kind:
            raise _BadRequest(f"expected a {route.info.kind}")
        if obj.get("apiVersion") != route.info.api_version:
            raise _BadRequest(f"expected apiVersion {route.info.api_version}")
        metadata = obj.setdefault("metadata", {})
        if not isinstance(metadata, dict):
            raise _BadRequest("metadata is not an object")
        if metadata.get("namespace") not in (None, "", route.namespace):
            raise _BadRequest("the namespace of the object does not match the request's")
        metadata["namespace"] = route.namespace
        if not metadata.get("name"):
            prefix = metadata.get("generateName")
            if not prefix:
                raise _BadRequest("name or generateName is required")
            metadata["name"] = prefix + uuid.uuid4().hex[:5]
        with self._lock:
            if (route.namespace, metadata["name"]) in self._objects[route.info.resource]:
                self._send(request, 409, _status(409, f'"{metadata["name"]}" already exists'))
                return
            stored = self.apply(obj)
        self._send(request, 201, stored)

    # Watch

    def _serve_watch(self, request: _Handler, route: _Route, query: Mapping[str, str]) -> None:
        assert route.info is not None
        info = route.info
        selector = self._selector(info, query)
        bookmarks = query.get("allowWatchBookmarks", "").lower() in ("true", "1")
        try:
            timeout = float(query.get("timeoutSeconds") or self.default_watch_timeout)
            start_text = query.get("resourceVersion") or ""
            start = int(start_text) if start_text not in ("", "0") else None
        except ValueError:
            raise _BadRequest("invalid resourceVersion or timeoutSeconds") from None

        request.send_response(200)
        request.send_header("Content-Type", "application/json")
        request.send_header("Transfer-Encoding", "chunked")
        request.end_headers()
        with self._lock:
            watch = _Watch(info.resource, request.connection, self._generation)
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
        watch: _Watch,
        info: ResourceInfo,
        route: _Route,
        selector: _Selector,
        start: int | None,
        timeout: float,
        bookmarks: bool,
    ) -> None:
        write = _ChunkWriter(request)
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
                "ERROR", _status(410, f"too old resource version: {start} ({self._compacted})")
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
                    changes: list[_Change] = []
                else:
                    expired = False
                    begin = bisect.bisect_right(self._history_rvs, position)
                    changes = [c for c in self._history[begin:] if c.resource == info.resource]
                    position = self._rv
            if expired:
                write.event("ERROR", _status(410, "too old resource version", "Expired"))
                write.end()
                return
            for change in changes:
                event = _filtered(change, route, selector)
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


class _ChunkWriter:
    def __init__(self, request: _Handler) -> None:
        self._wfile = request.wfile

    def _chunk(self, data: bytes) -> None:
        self._wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self._wfile.flush()

    def event(self, type_: str, obj: JSONObject) -> None:
        line = json.dumps({"type": type_, "object": obj}, separators=(",", ":")).encode() + b"\n"
        self._chunk(line)

    def end(self) -> None:
        self._wfile.write(b"0\r\n\r\n")
        self._wfile.flush()


def _filtered(change: _Change, route: _Route, selector: _Selector) -> tuple[str, JSONObject] | None:
    """The event a selecting watch sees for a change (real watch-cache semantics)."""

    def visible(obj: JSONObject | None) -> bool:
        if obj is None:
            return False
        in_namespace = not route.namespace or obj["metadata"].get("namespace") == route.namespace
        return in_namespace and selector.matches(obj)

    if change.type == "ADDED":
        return ("ADDED", change.obj) if visible(change.obj) else None
    if change.type == "DELETED":
        return ("DELETED", change.obj) if visible(change.obj) else None
    was, now = visible(change.old), visible(change.obj)
    if was and now:
        return "MODIFIED", change.obj
    if now:
        return "ADDED", change.obj
    if was:
        assert change.old is not None
        metadata = {**change.old["metadata"], "resourceVersion": str(change.rv)}
        return "DELETED", {**change.old, "metadata": metadata}
    return None


def _without_type(item: JSONObject) -> JSONObject:
    # Stored objects are never mutated (apply stores a new one), so sharing is safe.
    return {k: v for k, v in item.items() if k not in ("kind", "apiVersion")}


def _token(snapshot_id: str, rv: int, start: int) -> str:
    raw = json.dumps({"id": snapshot_id, "rv": rv, "start": start}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _cut(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


# Helpers for tests building objects


def service(
    name: str,
    namespace: str = "default",
    *,
    cluster_ip: str = "10.96.0.10",
    ports: Sequence[tuple[str, int, str]] = (("http", 80, "TCP"),),
    labels: Mapping[str, str] | None = None,
    **spec: Any,
) -> JSONObject:
    """A ClusterIP Service with the given ports (name, port, protocol)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip] if cluster_ip != "None" else ["None"],
            "ports": [
                {"name": n, "port": p, "protocol": proto, "targetPort": p} for n, p, proto in ports
            ],
            **spec,
        },
    }


def endpoint_slice(
    name: str,
    service_name: str,
    namespace: str = "default",
    *,
    addresses: Sequence[str] = ("10.244.0.11",),
    ports: Sequence[tuple[str, int, str]] = (("http", 8080, "TCP"),),
    node_name: str = "node-a",
    labels: Mapping[str, str] | None = None,
) -> JSONObject:
    """An IPv4 EndpointSlice of a Service, ready endpoints on ``node_name``."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service_name, **(labels or {})},
        },
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": [a], "conditions": {"ready": True}, "nodeName": node_name}
            for a in addresses
        ],
        "ports": [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports],
    }


def node(
    name: str,
    *,
    addresses: Sequence[str] = ("192.168.0.10",),
    pod_cidrs: Sequence[str] = ("10.244.0.0/24",),
    zone: str | None = None,
    taints: Sequence[Mapping[str, Any]] = (),
) -> JSONObject:
    """A Node with InternalIP addresses, pod CIDRs and optionally a zone label."""
    labels = {"kubernetes.io/hostname": name}
    if zone is not None:
        labels["topology.kubernetes.io/zone"] = zone
    spec: JSONObject = {"podCIDRs": list(pod_cidrs)}
    if pod_cidrs:
        spec["podCIDR"] = pod_cidrs[0]
    if taints:
        spec["taints"] = [dict(t) for t in taints]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
        "status": {"addresses": [{"type": "InternalIP", "address": a} for a in addresses]},
    }


def service_cidr(name: str, *cidrs: str) -> JSONObject:
    """A ServiceCIDR object holding ``cidrs``."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "ServiceCIDR",
        "metadata": {"name": name},
        "spec": {"cidrs": list(cidrs)},
    }
