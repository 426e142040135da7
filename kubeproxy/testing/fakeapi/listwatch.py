"""Serving a list (pages, continue tokens) and a watch (events, bookmarks, 410s).

What a list and a watch read is the :class:`~kubeproxy.testing.fakeapi.store.ClusterState`;
how a watch ends early is :class:`~kubeproxy.testing.fakeapi.faults.OpenWatches`' business.
These functions answer one request each, in its connection's thread.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler

from kubeproxy.testing.fakeapi.faults import OpenWatches
from kubeproxy.testing.fakeapi.listener import send
from kubeproxy.testing.fakeapi.requestinfo import Route
from kubeproxy.testing.fakeapi.resources import JSONObject, ResourceInfo
from kubeproxy.testing.fakeapi.selectors import BadRequest, Selector, parse_selector
from kubeproxy.testing.fakeapi.status import status
from kubeproxy.testing.fakeapi.store import ClusterState
from kubeproxy.testing.fakeapi.watchstream import Change, ChunkWriter, Watch, filtered

__all__ = ["serve_list", "serve_watch"]


def serve_list(
    request: BaseHTTPRequestHandler, state: ClusterState, route: Route, query: Mapping[str, str]
) -> None:
    """Answer a list: one page of ``limit`` items, the next ones from the same snapshot."""
    assert route.info is not None
    info = route.info
    selector = _selector(info, query)
    token = query.get("continue")
    try:
        limit = int(query.get("limit") or 0)
    except ValueError:
        raise BadRequest(f"invalid limit {query.get('limit')!r}") from None
    if token:
        snapshot_id, rv, offset = _continued(token)
        kept = state.snapshot(snapshot_id, rv)
        if kept is None:
            message = (
                "The provided continue parameter is too old to display a consistent "
                "list result. You can start a new list without the continue parameter."
            )
            send(request, 410, status(410, message, "Expired"))
            return
        items = kept
    else:
        snapshot_id, offset = "", 0
        rv, items = state.matching(info, route.namespace, selector)
    page = items[offset:] if limit <= 0 else items[offset : offset + limit]
    metadata: JSONObject = {"resourceVersion": str(rv)}
    following = offset + len(page)
    if limit > 0 and following < len(items):
        snapshot_id = snapshot_id or state.keep_snapshot(rv, items)
        metadata["continue"] = _token(snapshot_id, rv, following)
        metadata["remainingItemCount"] = len(items) - following
    body = {
        "kind": info.list_kind,
        "apiVersion": info.api_version,
        "metadata": metadata,
        "items": [_without_type(item) for item in page],
    }
    send(request, 200, body)


def serve_watch(
    request: BaseHTTPRequestHandler,
    state: ClusterState,
    watches: OpenWatches,
    route: Route,
    query: Mapping[str, str],
    *,
    bookmark_interval: float,
    default_timeout: float,
) -> None:
    """Answer a watch: its events until ``timeoutSeconds``, a 410, or a cut."""
    assert route.info is not None
    info = route.info
    selector = _selector(info, query)
    bookmarks = query.get("allowWatchBookmarks", "").lower() in ("true", "1")
    try:
        timeout = float(query.get("timeoutSeconds") or default_timeout)
        start_text = query.get("resourceVersion") or ""
        start = int(start_text) if start_text not in ("", "0") else None
    except ValueError:
        raise BadRequest("invalid resourceVersion or timeoutSeconds") from None

    request.send_response(200)
    request.send_header("Content-Type", "application/json")
    request.send_header("Transfer-Encoding", "chunked")
    request.end_headers()
    interval = bookmark_interval if bookmarks else None
    with watches.serving(info.resource, request.connection) as watch:
        try:
            _stream(request, state, watches, watch, route, selector, start, timeout, interval)
        except OSError:
            request.close_connection = True


def _stream(
    request: BaseHTTPRequestHandler,
    state: ClusterState,
    watches: OpenWatches,
    watch: Watch,
    route: Route,
    selector: Selector,
    start: int | None,
    timeout: float,
    bookmark_interval: float | None,
) -> None:
    info = route.info
    assert info is not None
    write = ChunkWriter(request)
    initial: list[JSONObject] = []
    with state.lock:
        if start is None:
            position, initial = state.matching(info, route.namespace, selector)
        elif start < state.compacted:
            position = -1
        else:
            position = start
    if position < 0:
        write.event("ERROR", status(410, f"too old resource version: {start} ({state.compacted})"))
        write.end()
        return
    for obj in initial:
        write.event("ADDED", obj)
    now = time.monotonic()
    deadline = now + timeout
    next_bookmark = now + (bookmark_interval or 0.0)
    while True:
        with state.lock:
            while True:
                if watches.is_cut(watch):
                    request.close_connection = True
                    return  # cut: no clean end, as from a dead server
                if watch.expired or position < state.compacted or state.changed_since(position):
                    break
                now = time.monotonic()
                wake = deadline if bookmark_interval is None else min(deadline, next_bookmark)
                if now >= wake:
                    break
                state.lock.wait(wake - now)
            expired = watch.expired or position < state.compacted
            changes: list[Change] = []
            if not expired:
                position, changes = state.changes_since(position, info.resource)
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
        if bookmark_interval is not None and now >= next_bookmark:
            metadata = {"resourceVersion": str(position)}
            bookmark = {"kind": info.kind, "apiVersion": info.api_version, "metadata": metadata}
            write.event("BOOKMARK", bookmark)
            next_bookmark = now + bookmark_interval


def _selector(info: ResourceInfo, query: Mapping[str, str]) -> Selector:
    labels = parse_selector(query.get("labelSelector"), fields=False)
    fields = parse_selector(query.get("fieldSelector"), fields=True)
    for requirement in fields:
        if requirement.key not in info.field_labels:
            raise BadRequest(
                f'"{requirement.key}" is not a known field selector: only '
                f'"{", ".join(info.field_labels)}"'
            )
    return Selector(labels, fields)


def _without_type(item: JSONObject) -> JSONObject:
    # Stored objects are never mutated (apply stores a new one), so sharing is safe.
    return {k: v for k, v in item.items() if k not in ("kind", "apiVersion")}


def _token(snapshot_id: str, rv: int, start: int) -> str:
    raw = json.dumps({"id": snapshot_id, "rv": rv, "start": start}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _continued(token: str) -> tuple[str, int, int]:
    try:
        decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
        return str(decoded["id"]), int(decoded["rv"]), int(decoded["start"])
    except (ValueError, KeyError, TypeError):
        raise BadRequest(f"invalid continue token {token!r}") from None
