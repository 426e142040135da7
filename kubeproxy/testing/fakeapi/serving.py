"""The fake API server's HTTP front: what each request gets, in the order the real one decides.

:class:`Front` records a request, checks its bearer token, routes it, answers an injected
failure instead when one is queued, and otherwise serves discovery, a get, a create
(Events), a list or a watch (:mod:`~kubeproxy.testing.fakeapi.listwatch`). The knobs it
reads (:class:`Settings`: ``delay``, ``token``, ``on_request``...) are the server's
attributes, read at each request, so a test may change them at any time.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Protocol
from urllib.parse import parse_qs, urlsplit

from kubeproxy.testing.fakeapi.discovery import discovery_document
from kubeproxy.testing.fakeapi.faults import Failures, OpenWatches
from kubeproxy.testing.fakeapi.listener import send
from kubeproxy.testing.fakeapi.listwatch import serve_list, serve_watch
from kubeproxy.testing.fakeapi.requestinfo import APIRequest, Route, route
from kubeproxy.testing.fakeapi.selectors import BadRequest
from kubeproxy.testing.fakeapi.status import failure_status, status
from kubeproxy.testing.fakeapi.store import ClusterState

__all__ = ["Front", "Settings"]

_NOT_FOUND = "the server could not find the requested resource"


class Settings(Protocol):
    """The server's settings a request reads (:class:`~kubeproxy.testing.fakeapi.FakeAPIServer`'s
    attributes, read at each request: a test may change them at any time)."""

    host: str
    port: int
    service_cidrs: bool
    bookmark_interval: float
    default_watch_timeout: float
    token: str | None
    git_version: str
    delay: float
    on_request: Callable[[APIRequest], None] | None


class Front:
    """Answers the requests of one fake server from its settings, state and faults."""

    def __init__(
        self,
        settings: Settings,
        state: ClusterState,
        failures: Failures,
        watches: OpenWatches,
        log: list[APIRequest],
    ) -> None:
        self.settings = settings
        self.state = state
        self.failures = failures
        self.watches = watches
        self.log = log
        """The request log, changed under the fake's lock."""

    def serve(self, request: BaseHTTPRequestHandler, method: str) -> None:
        """Answer one request (in its connection's thread)."""
        settings, state = self.settings, self.state
        if settings.delay:
            time.sleep(settings.delay)
        parts = urlsplit(request.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else b""
        found = route(method, parts.path, query, service_cidrs=settings.service_cidrs)
        recorded = APIRequest(
            found.verb,
            found.resource,
            found.namespace,
            found.subresource,
            found.group,
            found.name,
            parts.path,
        )
        with state.lock:
            self.log.append(recorded)
        hook = settings.on_request
        if hook is not None:
            hook(recorded)
        if settings.token is not None and not _bearer(
            request.headers.get("Authorization"), settings.token
        ):
            send(request, 401, status(401, "Unauthorized"))
            return
        if not found.resource:
            self._discovery(request, method, parts.path)
            return
        info = found.info
        if info is None:
            send(request, 404, status(404, _NOT_FOUND))
            return
        failure = self.failures.take(info.resource, found.verb)
        if failure is not None:
            send(request, failure, failure_status(failure, found))
            return
        if found.verb not in info.verbs or found.subresource:
            send(request, 405, status(405, f"{found.verb} is not supported on {info.resource}"))
            return
        try:
            if found.verb == "list":
                serve_list(request, state, found, query)
            elif found.verb == "watch":
                serve_watch(
                    request,
                    state,
                    self.watches,
                    found,
                    query,
                    bookmark_interval=settings.bookmark_interval,
                    default_timeout=settings.default_watch_timeout,
                )
            elif found.verb == "get":
                self._get(request, found)
            elif found.verb == "create":
                self._create(request, found, body)
        except BadRequest as err:
            send(request, 400, status(400, str(err)))

    def _discovery(self, request: BaseHTTPRequestHandler, method: str, path: str) -> None:
        settings = self.settings
        document = (
            discovery_document(
                path.rstrip("/") or "/",
                git_version=settings.git_version,
                address=f"{settings.host}:{settings.port}",
                service_cidrs=settings.service_cidrs,
            )
            if method == "GET"
            else None
        )
        if document is None:
            send(request, 404, status(404, _NOT_FOUND))
        else:
            send(request, 200, document)

    def _get(self, request: BaseHTTPRequestHandler, found: Route) -> None:
        assert found.info is not None
        obj = self.state.get(found.info.kind, found.namespace, found.name)
        if obj is None:
            send(request, 404, status(404, f'{found.info.resource} "{found.name}" not found'))
        else:
            send(request, 200, obj)

    def _create(self, request: BaseHTTPRequestHandler, found: Route, body: bytes) -> None:
        info = found.info
        assert info is not None
        try:
            obj = json.loads(body)
        except ValueError:
            raise BadRequest("the request body is not JSON") from None
        if not isinstance(obj, dict) or obj.get("kind") != info.kind:
            raise BadRequest(f"expected a {info.kind}")
        if obj.get("apiVersion") != info.api_version:
            raise BadRequest(f"expected apiVersion {info.api_version}")
        metadata = obj.setdefault("metadata", {})
        if not isinstance(metadata, dict):
            raise BadRequest("metadata is not an object")
        if metadata.get("namespace") not in (None, "", found.namespace):
            raise BadRequest("the namespace of the object does not match the request's")
        metadata["namespace"] = found.namespace
        if not metadata.get("name"):
            prefix = metadata.get("generateName")
            if not prefix:
                raise BadRequest("name or generateName is required")
            metadata["name"] = prefix + uuid.uuid4().hex[:5]
        with self.state.lock:
            exists = self.state.get(info.kind, found.namespace, metadata["name"], copy=False)
            stored = None if exists else self.state.apply(obj)
        if stored is None:
            send(request, 409, status(409, f'"{metadata["name"]}" already exists'))
        else:
            send(request, 201, stored)


def _bearer(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries ``token``: the scheme in any case, as
    kube-apiserver reads it (the official client's in-cluster loader sends ``bearer``)."""
    scheme, _, credentials = (header or "").partition(" ")
    return scheme.lower() == "bearer" and credentials.strip() == token
