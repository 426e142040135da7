"""A watch's stream: the recorded changes, what a selecting watch sees of each, the wire.

:class:`Change` is one entry of the server's history, :class:`Watch` one open watch (cut
or expired by the tests' fault methods), :func:`filtered` the event a watch with a
namespace and selectors sees for a change (the watch cache's rules: an object leaving
the selection is a ``DELETED``, one entering it an ``ADDED``), and :class:`ChunkWriter`
the chunked, one-JSON-event-per-line encoding. Apart from the server: no lock and no
state of the server in it.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler

from kubeproxy.testing.fakeapi.requestinfo import Route
from kubeproxy.testing.fakeapi.resources import JSONObject
from kubeproxy.testing.fakeapi.selectors import Selector

__all__ = ["Change", "ChunkWriter", "Watch", "filtered"]


@dataclass(frozen=True, slots=True)
class Change:
    """One change in the server's history, at resource version ``rv`` (``old``: the
    object before it, None for an addition)."""

    rv: int
    resource: str
    type: str
    obj: JSONObject
    old: JSONObject | None


@dataclass(slots=True)
class Watch:
    """One watch being served, of the server's ``generation`` (a restart ends it)."""

    resource: str
    sock: socket.socket
    generation: int
    dropped: bool = False
    expired: bool = False


class ChunkWriter:
    """Writes a watch's events to the response, one JSON object per line, chunked."""

    def __init__(self, request: BaseHTTPRequestHandler) -> None:
        self._wfile = request.wfile

    def _chunk(self, data: bytes) -> None:
        self._wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self._wfile.flush()

    def event(self, type_: str, obj: JSONObject) -> None:
        """Send one event."""
        line = json.dumps({"type": type_, "object": obj}, separators=(",", ":")).encode() + b"\n"
        self._chunk(line)

    def end(self) -> None:
        """End the stream cleanly (the last chunk)."""
        self._wfile.write(b"0\r\n\r\n")
        self._wfile.flush()


def filtered(change: Change, route: Route, selector: Selector) -> tuple[str, JSONObject] | None:
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
