"""The fake API server's cluster state: objects, resource versions, history.

:class:`ClusterState` is what the tests change (apply, delete, compact) and what a list
and a watch read: the objects by resource, the resource version counter, the history a
watch replays from a ``resourceVersion``, the compaction revision below which both get
410, and the snapshots that continued list pages read. It knows nothing of HTTP. Its
``lock`` is notified on every change: a watch being served waits on it.
"""

from __future__ import annotations

import bisect
import copy as _copy
import itertools
import json
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubeproxy.testing.fakeapi.resources import BY_KIND, RESOURCES, JSONObject, ResourceInfo
from kubeproxy.testing.fakeapi.selectors import Selector
from kubeproxy.testing.fakeapi.watchstream import Change

__all__ = ["ClusterState"]


@dataclass(frozen=True, slots=True)
class _Snapshot:
    rv: int
    items: tuple[JSONObject, ...]


class ClusterState:
    """The objects of a fake cluster and their history (see the module).

    :class:`~kubeproxy.testing.fakeapi.FakeAPIServer` is one, so tests call these methods
    on the server; they work while it is stopped too.
    """

    def __init__(self) -> None:
        self.lock = threading.Condition(threading.RLock())
        """Held for every read and change, notified on each change (watches wait on it)."""
        self.compacted = 0
        """The compaction revision: older resource versions and continue tokens get 410."""
        self._objects: dict[str, dict[tuple[str, str], JSONObject]] = {r: {} for r in RESOURCES}
        self._rv = 0
        self._history: list[Change] = []
        self._history_rvs: list[int] = []
        self._snapshots: dict[str, _Snapshot] = {}
        self._snapshot_ids = itertools.count(1)

    @property
    def resource_version(self) -> int:
        """The newest resource version handed out."""
        with self.lock:
            return self._rv

    def apply(self, obj: Mapping[str, Any], *, copy: bool = True) -> JSONObject:
        """Create or replace an object (by kind, namespace, name); returns the stored copy.

        Sets ``metadata.resourceVersion`` (and ``uid``, ``creationTimestamp`` and, for
        namespaced kinds, ``namespace: default`` when missing) and records an ``ADDED`` or
        ``MODIFIED`` watch event. ``copy=False`` stores ``obj`` itself (a JSON-typed
        ``dict`` the caller hands over and never touches again) and returns it: loading
        hundreds of thousands of objects for a benchmark then costs no copies.
        """
        info = _info_of(obj)
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
        with self.lock:
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
        info = _info_of({"kind": kind})
        key = (namespace if info.namespaced else "", name)
        with self.lock:
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
        info = _info_of({"kind": kind})
        with self.lock:
            obj = self._objects[info.resource].get((namespace if info.namespaced else "", name))
            return _copy.deepcopy(obj) if obj is not None and copy else obj

    def objects(self, kind: str, *, copy: bool = True) -> list[JSONObject]:
        """Copies of every stored object of a kind, in list order (namespace, name).

        ``copy=False`` returns the stored objects themselves (not to be changed).
        """
        info = _info_of({"kind": kind})
        with self.lock:
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
        with self.lock:
            self.compacted = self._rv
            cut = bisect.bisect_right(self._history_rvs, self.compacted)
            del self._history[:cut]
            del self._history_rvs[:cut]
            self._snapshots.clear()
            self.lock.notify_all()
            return self.compacted

    # What lists and watches read

    def matching(
        self, info: ResourceInfo, namespace: str, selector: Selector
    ) -> tuple[int, list[JSONObject]]:
        """The resource version and the objects a list (or a watch's start) selects."""
        with self.lock:
            store = self._objects[info.resource]
            items = [
                store[key]
                for key in sorted(store)
                if (not namespace or key[0] == namespace) and selector.matches(store[key])
            ]
            return self._rv, items

    def keep_snapshot(self, rv: int, items: list[JSONObject]) -> str:
        """Keep a list's result for its next pages (until :meth:`compact`); its id."""
        with self.lock:
            snapshot_id = str(next(self._snapshot_ids))
            self._snapshots[snapshot_id] = _Snapshot(rv, tuple(items))
            return snapshot_id

    def snapshot(self, snapshot_id: str, rv: int) -> list[JSONObject] | None:
        """A kept list result, None when compaction forgot it (the client gets 410)."""
        with self.lock:
            snapshot = self._snapshots.get(snapshot_id)
            if snapshot is None or rv < self.compacted or snapshot.rv != rv:
                return None
            return list(snapshot.items)

    def changed_since(self, position: int) -> bool:
        """Whether the history has a change after ``position`` (the caller holds the lock)."""
        return self._rv > position and bool(self._history_rvs) and self._history_rvs[-1] > position

    def changes_since(self, position: int, resource: str) -> tuple[int, list[Change]]:
        """The newest resource version and the changes of ``resource`` after ``position``
        (the caller holds the lock)."""
        begin = bisect.bisect_right(self._history_rvs, position)
        return self._rv, [c for c in self._history[begin:] if c.resource == resource]

    def _record(self, resource: str, type_: str, obj: JSONObject, old: JSONObject | None) -> None:
        self._history.append(Change(self._rv, resource, type_, obj, old))
        self._history_rvs.append(self._rv)
        self.lock.notify_all()


def _info_of(obj: Mapping[str, Any]) -> ResourceInfo:
    kind = obj.get("kind")
    info = BY_KIND.get(kind) if isinstance(kind, str) else None
    if info is None:
        raise ValueError(f"the fake API server does not serve kind {kind!r}")
    return info


def _rfc3339(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
