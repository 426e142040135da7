"""One reflector: list, then watch, one resource, keeping what the handler was told.

A :class:`Reflector` runs in a thread of its own, as client-go's informers do. It

* lists in pages (``limit``/``continue``; an expired continue token restarts the list),
  reading the raw JSON (model objects cost 10-20 times more at 10k+ objects), then
  tells its callbacks ``listed`` once per list;
* watches from the list's ``resourceVersion`` with bookmarks, keeping a cache of what the
  handler was told and calling back for every change, with the cached old object on
  updates;
* on ``410 Gone`` (an expired resourceVersion) lists again and delivers only the
  difference against its cache;
* on any other failure (dropped connection, 5xx, 403, timeouts) logs one line, waits with
  jittered exponential backoff and resumes the watch from the last resourceVersion it saw.

Apart from the source (:mod:`kubeproxy.sources.kubernetes.source`), which decides which
resources are watched and what their changes mean to a handler: a reflector knows only
its resource, its callbacks and what it reads of the source (:class:`ReflectorHost`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import random
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

from kubernetes import client

from kubeproxy.handlers import KubeObject
from kubeproxy.sources.identity import (
    OWNER_BITS,
    SliceOwner,
    code_owner,
    identity,
    interned_owner,
    owner_code,
    slice_owner,
)
from kubeproxy.sources.keymap import KeyMap
from kubeproxy.sources.kubernetes.apiclient import describe_error, get

__all__ = ["Callbacks", "Key", "Reflector", "ReflectorHost", "Resource", "object_metadata"]

# The whole Kubernetes source logs under one name, as it did when it was one module.
logger = logging.getLogger("kubeproxy.sources.kubernetes")

Key: TypeAlias = tuple[str, str]
"""namespace ("" for cluster-scoped objects), name."""


class ReflectorHost(Protocol):
    """What a reflector reads of the source that runs it: the client, the request and
    backoff settings, and the lock that serialises handler calls.

    :class:`~kubeproxy.sources.kubernetes.source.KubernetesSource` is the one host; a
    protocol rather than that class, as the source module imports this one.
    """

    api: client.ApiClient
    page_size: int
    watch_timeout: float
    request_timeout: float
    connect_timeout: float
    initial_backoff: float
    max_backoff: float
    clock: Callable[[], float]
    sleep: Callable[[float], None] | None
    rng: random.Random
    _deliver_lock: threading.RLock


class _Expired(Exception):
    """The resourceVersion (or continue token) is too old: relist."""


class _Stopped(Exception):
    """The source is stopping."""


class _WatchError(Exception):
    """The watch stream said something we cannot go on from (an ERROR event, bad JSON)."""


@dataclass(frozen=True, slots=True)
class Resource:
    """One resource a reflector lists and watches: where, what kind, which selectors."""

    resource: str
    group: str
    kind: str
    api_version: str
    label_selector: str | None = None
    field_selector: str | None = None

    @property
    def path(self) -> str:
        """The collection's URL path."""
        prefix = f"/apis/{self.api_version}" if self.group else f"/api/{self.api_version}"
        return f"{prefix}/{self.resource}"

    @property
    def rbac(self) -> str:
        """How an RBAC failure names the resource (the ClusterRole rule it needs)."""
        return f'"{self.resource}" in API group "{self.group}"'


@dataclass(frozen=True, slots=True)
class Callbacks:
    """What a reflector calls: for every change, and after every list and event."""

    add: Callable[[KubeObject], None]
    update: Callable[[KubeObject, KubeObject], None]
    delete: Callable[[KubeObject], None]
    listed: Callable[[bool], None]  # after every (re)list; True the first time
    after_event: Callable[[], None]


def object_metadata(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """An object's ``metadata`` ({} when it has none)."""
    metadata = obj.get("metadata")
    return metadata if isinstance(metadata, Mapping) else {}


def _key(obj: Mapping[str, Any]) -> Key | None:
    metadata = object_metadata(obj)
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        return None
    namespace = metadata.get("namespace")
    # Interned: a namespace's name repeats over its objects (one copy each otherwise).
    return (sys.intern(namespace) if isinstance(namespace, str) else "", name)


def _rv(obj: Mapping[str, Any]) -> str | None:
    value = object_metadata(obj).get("resourceVersion")
    return value if isinstance(value, str) and value else None


_OWNER_MASK = (1 << OWNER_BITS) - 1


def _entry(name: str, version: str | None, owner: SliceOwner | None) -> Any:
    """What the cache keeps of a delivered object named ``name`` (not kept whole): its
    resourceVersion and a slice's owner, as one int when the version is a plain decimal
    number (what the API server gives: etcd's revision) and the owner is in the name
    (:func:`~kubeproxy.sources.identity.owner_code`), else as a tuple of the two. 200k
    objects at 100k Services: an int of 32-36 bytes where the tuple, the version's text
    and a slice's owner tuple were 110-170 (issue 32)."""
    if (
        version is not None
        and version.isascii()
        and version.isdigit()
        and (version[0] != "0" or version == "0")  # str(int(version)) gives it back
    ):
        code = owner_code(name, owner)
        if code is not None:
            return (int(version) << OWNER_BITS) | code
    return (version, None if owner is None else interned_owner(owner))


def _entry_parts(name: str, entry: Any) -> tuple[str | None, SliceOwner | None]:
    """The resourceVersion and the owner :func:`_entry` kept."""
    if type(entry) is int:
        return str(entry >> OWNER_BITS), code_owner(name, entry & _OWNER_MASK)
    return entry  # type: ignore[no-any-return]


def _lines(resp: Any) -> Iterator[bytes]:
    """Lines of a watch response, as chunks arrive."""
    pending = b""
    for chunk in resp.stream(amt=None, decode_content=True):
        pending += chunk
        if b"\n" not in chunk:
            continue
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if pending.strip():
        yield pending


class Reflector:
    """List and watch one resource (see the module docstring)."""

    def __init__(
        self,
        source: ReflectorHost,
        resource: Resource,
        callbacks: Callbacks,
        *,
        keep_objects: bool = False,
    ) -> None:
        self.source = source
        self.resource = resource
        self.callbacks = callbacks
        # What the handler was told exists: the objects themselves (keep_objects: the
        # Node, the ServiceCIDRs), else (resourceVersion, slice owner) per object, from
        # which identity() builds what a handler gets as ``old`` and on deletions.
        self.keep_objects = keep_objects
        self.cache: KeyMap[Key, Any] = KeyMap()
        self.resource_version: str | None = None
        self.synced = threading.Event()
        self._failures = 0
        self._expirations = 0
        self._response: Any = None
        self._response_lock = threading.Lock()
        self._broken = False
        self._last_delay = 0.0

    @property
    def name(self) -> str:
        """The resource's name (``services``, ``nodes``...)."""
        return self.resource.resource

    # Loop

    def run(self, stop: threading.Event) -> None:
        """List, then watch, relisting and retrying as needed, until ``stop`` is set."""
        need_list = True
        while not stop.is_set():
            try:
                if need_list:
                    self._list_and_replace(stop)
                    need_list = False
                self._watch(stop)
            except _Stopped:
                break
            except _Expired as err:
                need_list = True
                self._expirations += 1
                if self._expirations == 1:
                    logger.info("kubernetes: %s: %s; relisting", self.name, err)
                    continue
                delay = self._next_delay()
                logger.warning(
                    "kubernetes: %s: %s again; relisting in %.2fs", self.name, err, delay
                )
                self._pause(stop, delay)
            except Exception as err:
                if stop.is_set():
                    break
                self._log_failure(err, need_list)
                self._pause(stop, self._last_delay)

    def _next_delay(self) -> float:
        self._failures += 1
        source = self.source
        base = min(source.max_backoff, source.initial_backoff * 2 ** (self._failures - 1))
        # "Equal jitter": spread reconnecting proxies, never beyond the cap.
        self._last_delay = base / 2 + source.rng.random() * base / 2
        return self._last_delay

    def _recovered(self, what: str) -> None:
        if self._broken:
            logger.info("kubernetes: %s: the API server answers again (%s)", self.name, what)
        self._broken = False
        self._failures = 0

    def _pause(self, stop: threading.Event, delay: float) -> None:
        if self.source.sleep is not None:
            self.source.sleep(delay)
        else:
            stop.wait(delay)

    def _log_failure(self, err: Exception, listing: bool) -> None:
        delay = self._next_delay()
        self._broken = True
        verb = "list" if listing else "watch"
        resume = (
            "retrying the list"
            if listing
            else f"resuming from resourceVersion {self.resource_version}"
        )
        if isinstance(err, client.ApiException) and err.status in (401, 403):
            logger.error(
                "kubernetes: cannot %s %s: %s; kube-proxy's ClusterRole must allow verb "
                '"%s" on %s; %s in %.2fs',
                verb,
                self.name,
                describe_error(err),
                verb,
                self.resource.rbac,
                resume,
                delay,
            )
            return
        logger.warning(
            "kubernetes: %s of %s failed: %s; %s in %.2fs",
            verb,
            self.name,
            describe_error(err),
            resume,
            delay,
        )

    # Requests

    def _request(
        self,
        stop: threading.Event,
        query: list[tuple[str, str]],
        timeout: tuple[float, float],
        *,
        throttle: bool = True,
    ) -> Any:
        resource = self.resource
        if resource.label_selector:
            query.append(("labelSelector", resource.label_selector))
        if resource.field_selector:
            query.append(("fieldSelector", resource.field_selector))
        try:
            resp = get(self.source.api, resource.path, query, timeout, throttle=throttle)
        except client.ApiException as err:
            if err.status == 410:
                raise _Expired(f"{describe_error(err)}") from None
            raise
        with self._response_lock:
            self._response = resp
        if stop.is_set():
            self._close(resp, reuse=False)
            raise _Stopped
        return resp

    def _close(self, resp: Any, *, reuse: bool) -> None:
        with self._response_lock:
            if self._response is resp:
                self._response = None
        try:
            if not reuse:
                # Unread or broken: the connection must not go back to the pool as is.
                resp.close()
            resp.release_conn()
        except Exception:  # closing a broken connection may fail too; nothing to do
            pass

    def interrupt(self) -> None:
        """Unblock a read in progress (the source is stopping)."""
        with self._response_lock:
            resp = self._response
        if resp is None:
            return
        with contextlib.suppress(Exception):  # already closed
            resp.shutdown()

    # List

    def _list_and_replace(self, stop: threading.Event) -> None:
        """List in pages, delivering each page as it comes (the difference against what
        was delivered before), then the deletions and ``listed``. Pages are delivered
        and dropped one at a time: at 100k EndpointSlices, the whole list as decoded
        JSON would be about 1 GB."""
        first = not self.synced.is_set()
        listed: KeyMap[Key, None] = KeyMap()
        count = 0
        resource_version = ""
        for page, version in self._pages(stop):
            resource_version = version
            with self.source._deliver_lock:
                for obj in page:
                    key = _key(obj)
                    if key is None:
                        logger.error("kubernetes: %s: skipping an object without a name", self.name)
                        continue
                    listed[key] = None
                    count += 1
                    self._store(key, obj)
            del page
        with self.source._deliver_lock:
            for key in [k for k in self.cache if k not in listed]:
                self._call(self.callbacks.delete, self._old(key, self.cache.pop(key)))
            self.resource_version = resource_version
            self._call(self.callbacks.listed, first)
        self._recovered(f"listed {count} objects")
        self.synced.set()
        logger.debug(
            "kubernetes: %s: listed %d at resourceVersion %s",
            self.name,
            count,
            resource_version,
        )

    def _store(self, key: Key, obj: KubeObject) -> None:
        """Remember ``obj`` and tell the handler (an add, or an update unless its
        resourceVersion is the one delivered)."""
        old = self.cache.get(key)
        version = _rv(obj)
        self._keep(key, obj, version)
        if old is None:
            self._call(self.callbacks.add, obj)
        elif self._version(old) != version or version is None:
            self._call(self.callbacks.update, self._old(key, old), obj)

    def _keep(self, key: Key, obj: KubeObject, version: str | None) -> None:
        """Cache what is kept of delivered ``obj`` (resourceVersion ``version``): the object
        itself, or its version and owner (:func:`_entry`)."""
        self.cache[key] = (
            obj if self.keep_objects else _entry(key[1], version, slice_owner(obj, intern=False))
        )

    def objects(self) -> dict[Key, KubeObject]:
        """What the handler has been told exists: the objects kept whole, else each
        object's identity (:func:`~kubeproxy.sources.identity.identity`)."""
        return {key: self._old(key, entry) for key, entry in self.cache.items()}

    def _version(self, entry: Any) -> str | None:
        return _rv(entry) if self.keep_objects else _entry_parts("", entry)[0]

    def _old(self, key: Key, entry: Any) -> KubeObject:
        """What the handler gets of a delivered object as ``old`` or on its deletion."""
        if self.keep_objects:
            return entry  # type: ignore[no-any-return]
        namespace, name = key
        version, owner = _entry_parts(name, entry)
        resource = self.resource
        return identity(
            resource.kind, resource.api_version, namespace, name, owner, resource_version=version
        )

    def _pages(self, stop: threading.Event) -> Iterator[tuple[list[dict[str, Any]], str]]:
        """The list's pages, each with the list's resourceVersion ("" until the last).

        One list takes one token of the client's rate limit, however many pages it has:
        upstream's informers list from the watch cache (``resourceVersion=0``) in one
        response, so its limit (5 a second by default) never meets pages; taken per
        page, it made the first sync of 30k Services through the API 35 s instead of 14.

        The next page is asked for (and decoded) in a thread of its own while the
        caller delivers this one: the API server's time to serve a page and ours to use
        it overlap instead of adding up.
        """
        restarts = 0
        with concurrent.futures.ThreadPoolExecutor(1, f"list-{self.name}") as pool:
            pending, continued = pool.submit(self._page, stop, None), False
            while True:
                try:
                    page, token, resource_version = pending.result()
                except _Expired:
                    if not continued or restarts >= 3:
                        raise
                    restarts += 1
                    logger.info(
                        "kubernetes: %s: the list's continue token expired; restarting the list",
                        self.name,
                    )
                    pending, continued = pool.submit(self._page, stop, None), False
                    continue
                if token is None:
                    yield page, resource_version
                    return
                pending, continued = pool.submit(self._page, stop, token), True
                yield page, ""

    def _page(
        self, stop: threading.Event, token: str | None
    ) -> tuple[list[dict[str, Any]], str | None, str]:
        """One page of the list (the first without ``token``): its items, the token of
        the next page (None after the last) and the list's resourceVersion (the last's)."""
        if stop.is_set():
            raise _Stopped
        source = self.source
        query = [("limit", str(source.page_size))]
        if token:
            query.append(("continue", token))
        resp = self._request(
            stop, query, (source.connect_timeout, source.request_timeout), throttle=token is None
        )
        complete = False
        try:
            body = json.loads(resp.data)
            complete = True
        finally:
            self._close(resp, reuse=complete)
        if not isinstance(body, dict):
            raise _WatchError(f"the list of {self.name} is not a JSON object")
        page = [item for item in body.get("items") or () if isinstance(item, dict)]
        for item in page:
            # Lists leave these out of their items; watch events have them.
            item.setdefault("kind", self.resource.kind)
            item.setdefault("apiVersion", self.resource.api_version)
        metadata = body.get("metadata") or {}
        following = metadata.get("continue") or None
        if following is not None:
            return page, following, ""
        resource_version = metadata.get("resourceVersion")
        if not isinstance(resource_version, str) or not resource_version:
            raise _WatchError(f"the list of {self.name} has no resourceVersion")
        return page, None, resource_version

    # Watch

    def _watch(self, stop: threading.Event) -> None:
        source = self.source
        timeout = max(1, int(source.watch_timeout * (1.0 + source.rng.random())))
        started = source.clock()
        resp = self._request(
            stop,
            [
                ("watch", "true"),
                ("resourceVersion", self.resource_version or ""),
                ("allowWatchBookmarks", "true"),
                ("timeoutSeconds", str(timeout)),
            ],
            (source.connect_timeout, timeout + source.request_timeout),
        )
        events = 0
        complete = False
        try:
            for line in _lines(resp):
                if stop.is_set():
                    raise _Stopped
                self._event(line)
                events += 1
                if events == 1:
                    self._expirations = 0
                    self._recovered(f"watching from resourceVersion {self.resource_version}")
            complete = True
        finally:
            self._close(resp, reuse=complete)
        if stop.is_set():
            raise _Stopped
        lasted = source.clock() - started
        if events == 0 and lasted < min(1.0, source.watch_timeout / 2):
            # A server that ends watches at once must not be hammered.
            delay = self._next_delay()
            logger.debug(
                "kubernetes: %s: the watch ended after %.2fs; waiting %.1fs",
                self.name,
                lasted,
                delay,
            )
            self._pause(stop, delay)
        else:
            self._recovered(f"watching from resourceVersion {self.resource_version}")

    def _event(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            raise _WatchError(f"malformed watch event {line[:120]!r}") from None
        if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
            raise _WatchError(f"malformed watch event {line[:120]!r}")
        type_ = event.get("type")
        obj: dict[str, Any] = event["object"]
        if type_ == "ERROR":
            code = obj.get("code")
            message = obj.get("message") or obj.get("reason") or "no message"
            if code == 410 or obj.get("reason") in ("Expired", "Gone"):
                raise _Expired(f"resourceVersion {self.resource_version} expired ({message})")
            raise _WatchError(f"the watch ended with an error: {code} {message}")
        resource_version = _rv(obj)
        if type_ == "BOOKMARK":
            if resource_version:
                self.resource_version = resource_version
            return
        if type_ not in ("ADDED", "MODIFIED", "DELETED"):
            logger.warning("kubernetes: %s: ignoring a watch event of type %r", self.name, type_)
            return
        key = _key(obj)
        if key is None:
            logger.error("kubernetes: %s: skipping a watch event without a name", self.name)
            return
        with self.source._deliver_lock:
            if type_ == "DELETED":
                if self.cache.pop(key) is not None:
                    self._call(self.callbacks.delete, obj)
            else:
                old = self.cache.get(key)
                self._keep(key, obj, resource_version)
                if old is None:
                    self._call(self.callbacks.add, obj)
                else:
                    self._call(self.callbacks.update, self._old(key, old), obj)
            if resource_version:
                self.resource_version = resource_version
            self._call(self.callbacks.after_event)

    def _call(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            callback(*args)
        except Exception:  # a handler's surprise must not stop the watch
            logger.exception("kubernetes: %s: the handler failed", self.name)
