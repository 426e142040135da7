"""A source fed by the Kubernetes API: list, then watch, through the official client.

:func:`make_api_client` builds a ``kubernetes.client.ApiClient`` from ``--kubeconfig``,
``--master`` or the in-cluster service account, with client-side rate limiting
(``--kube-api-qps``/``--kube-api-burst``) the Python client does not have.

:class:`KubernetesSource` runs one *reflector* thread per resource, as client-go's
informers do: Services, EndpointSlices (``discovery.k8s.io/v1``), this node's Node, and
ServiceCIDRs (``networking.k8s.io/v1``, only when API discovery says the server has
them). Each reflector

* lists in pages (``limit``/``continue``; an expired continue token restarts the list),
  reading the raw JSON (model objects cost 10-20 times more at 10k+ objects), then
  tells the handler ``on_*_synced`` once;
* watches from the list's ``resourceVersion`` with bookmarks, keeping a cache of what the
  handler was told and calling it for every change, with the cached old object on updates;
* on ``410 Gone`` (an expired resourceVersion) lists again and delivers only the
  difference against its cache;
* on any other failure (dropped connection, 5xx, 403, timeouts) logs one line, waits with
  jittered exponential backoff and resumes the watch from the last resourceVersion it saw.

While the API server is away nothing is delivered, so the proxy keeps its rules as they
are; the process never exits because of the API server. It exits (through
:class:`NodeWatcher`) only where upstream does: this Node's host IPs changed, its pod
CIDRs changed while local traffic is detected by node CIDR, or it was deleted.

Handler calls come from the reflector threads, one at a time (a lock serialises them).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ipaddress
import json
import logging
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import urllib3
from kubernetes import client, config

from kubeproxy.handlers import KubeObject, ProxyHandler
from kubeproxy.objects import IPAddress, IPNetwork
from kubeproxy.parse import parse_node
from kubeproxy.sources.identity import identity, slice_owner

__all__ = [
    "IN_CLUSTER_MESSAGE",
    "KubernetesSource",
    "NodeWatcher",
    "RateLimitedApiClient",
    "TokenBucket",
    "exit_process",
    "make_api_client",
]

logger = logging.getLogger(__name__)

IN_CLUSTER_MESSAGE = (
    "Neither kubeconfig file nor master URL was specified, falling back to in-cluster config"
)
"""Upstream's log line when neither ``--kubeconfig`` nor ``--master`` is given."""

LABEL_SERVICE_PROXY_NAME = "service.kubernetes.io/service-proxy-name"
LABEL_HEADLESS = "service.kubernetes.io/headless"
# As upstream's shared informer factory: both labels are excluded from both resources.
PROXY_LABEL_SELECTOR = f"!{LABEL_SERVICE_PROXY_NAME},!{LABEL_HEADLESS}"
SERVICE_FIELD_SELECTOR = "spec.clusterIP!=None"

_JSON = "application/json"
_PROTOBUF = "application/vnd.kubernetes.protobuf"

Key: TypeAlias = tuple[str, str]
"""namespace ("" for cluster-scoped objects), name."""


# Client construction


class TokenBucket:
    """Client-side rate limiting: ``qps`` requests a second, bursts of up to ``burst``.

    ``qps <= 0`` disables the limit. Thread-safe; each caller reserves its slot under the
    lock and waits outside it.
    """

    def __init__(
        self,
        qps: float,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.qps = qps
        self.burst = max(1, burst)
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(self.burst)
        self._last = clock()
        self._lock = threading.Lock()

    def acquire(self) -> float:
        """Take one token, waiting for it if need be; returns the seconds waited."""
        if self.qps <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.qps)
            self._last = now
            self._tokens -= 1.0
            wait = -self._tokens / self.qps if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)
        return wait


class RateLimitedApiClient(client.ApiClient):
    """An ``ApiClient`` whose every request first takes a token from a :class:`TokenBucket`."""

    def __init__(self, configuration: client.Configuration, bucket: TokenBucket) -> None:
        super().__init__(configuration)
        self.bucket = bucket

    def call_api(self, *args: Any, **kwargs: Any) -> Any:
        """Wait for the rate limit, then make the request."""
        self.bucket.acquire()
        return super().call_api(*args, **kwargs)

    def call_api_unthrottled(self, *args: Any, **kwargs: Any) -> Any:
        """Make the request at once: a further page of a list already let through."""
        return super().call_api(*args, **kwargs)


def make_api_client(
    kubeconfig: str | None,
    master: str | None,
    *,
    qps: float = 5.0,
    burst: int = 10,
    content_type: str = _PROTOBUF,
) -> RateLimitedApiClient:
    """An API client as upstream builds it from ``--kubeconfig`` and ``--master``.

    A kubeconfig file if given (``master``, if also given, overrides its server), else
    ``master`` alone (no credentials), else the in-cluster service account (logging
    upstream's :data:`IN_CLUSTER_MESSAGE`). ``content_type`` is ``application/json`` or
    upstream's default protobuf, which the Python client cannot speak: JSON is used then.
    Raises ``kubernetes.config.ConfigException`` when the configuration cannot be loaded
    (naming the kubeconfig file, and saying so when it cannot be read at all) and
    :class:`ValueError` for an unknown content type.
    """
    if content_type not in (_JSON, _PROTOBUF):
        raise ValueError(
            f"unsupported API content type {content_type!r}: use {_JSON} or {_PROTOBUF}"
        )
    if content_type == _PROTOBUF:
        logger.debug("The Python Kubernetes client has no protobuf codec; using %s", _JSON)
    configuration = client.Configuration()
    if kubeconfig:
        try:
            with open(kubeconfig, "rb"):
                pass
        except OSError as err:
            # The client would say only "Invalid kube-config file. No configuration found."
            raise config.ConfigException(
                f"cannot read the kubeconfig file {kubeconfig}: {err.strerror or err}"
            ) from None
        try:
            # persist_config=False: a token refresh must not rewrite the operator's file.
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, client_configuration=configuration, persist_config=False
            )
        except config.ConfigException as err:
            if kubeconfig in str(err):
                raise
            raise config.ConfigException(f"kubeconfig file {kubeconfig}: {err}") from None
        if master:
            configuration.host = master
            refresh = configuration.refresh_api_key_hook
            if refresh is not None:
                # The kubeconfig loader's token refresh hook, run before every request,
                # writes the file's server back into the configuration.
                def refresh_keeping_master(cfg: Any, _refresh: Any = refresh) -> None:
                    _refresh(cfg)
                    cfg.host = master

                configuration.refresh_api_key_hook = refresh_keeping_master
    elif master:
        configuration.host = master
    else:
        logger.warning(IN_CLUSTER_MESSAGE)
        config.load_incluster_config(  # type: ignore[no-untyped-call]
            client_configuration=configuration
        )
    # urllib3 would retry a refused connection three times, logging a warning each time;
    # the reflectors retry with backoff and log one line themselves.
    configuration.retries = False
    api = RateLimitedApiClient(configuration, TokenBucket(qps, burst))
    api.user_agent = "kube-proxy/kubeproxy (python)"
    return api


# The Node


def _host_ips(addresses: Sequence[IPAddress]) -> tuple[IPAddress, ...]:
    """Upstream's node host IPs: the first address, and the first of the other family."""
    if not addresses:
        return ()
    first = addresses[0]
    other = next((a for a in addresses if a.version != first.version), None)
    return (first,) if other is None else (first, other)


def exit_process(code: int) -> None:
    """Flush the logs and end the whole process now, as upstream's ``os.Exit`` does.

    ``sys.exit`` would only end the calling (reflector) thread. The kernel rules are left
    as they are; the DaemonSet restarts the container.
    """
    for handler in logging.getLogger().handlers:
        # A broken log handler must not keep the process alive.
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(code)


class NodeWatcher:
    """Upstream's NodeManager policy for this proxy's own Node.

    The Node is *ready* once it exists with host IPs (and pod CIDRs when
    ``watch_pod_cidrs``, i.e. detect-local-mode NodeCIDR); :meth:`wait_until_ready` waits
    for that at start-up. After that, ``exit(1)`` is called when the host IPs change, when
    the pod CIDRs change while ``watch_pod_cidrs``, or when the Node is deleted.
    """

    def __init__(
        self,
        node_name: str,
        *,
        watch_pod_cidrs: bool = False,
        exit: Callable[[int], object] = exit_process,
    ) -> None:
        self.node_name = node_name
        self.watch_pod_cidrs = watch_pod_cidrs
        self._exit = exit
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._node: KubeObject | None = None
        self._host_ips: tuple[IPAddress, ...] = ()
        self._pod_cidrs: tuple[IPNetwork, ...] = ()
        self._eligible = False

    @property
    def node(self) -> KubeObject | None:
        """The Node as last seen (None before it exists or after it was deleted)."""
        with self._lock:
            return self._node

    @property
    def node_ips(self) -> tuple[IPAddress, ...]:
        """The host IPs (primary first, at most one per family) of the ready Node."""
        with self._lock:
            return self._host_ips

    @property
    def pod_cidrs(self) -> tuple[IPNetwork, ...]:
        """``spec.podCIDRs`` of the ready Node."""
        with self._lock:
            return self._pod_cidrs

    @property
    def ready(self) -> bool:
        """Whether the Node has been seen with host IPs (and pod CIDRs if watched)."""
        return self._ready.is_set()

    @property
    def eligible(self) -> bool:
        """For ``/healthz``: the Node exists, is not being deleted and has no
        ``ToBeDeletedByClusterAutoscaler`` taint."""
        with self._lock:
            return self._eligible

    def wait_until_ready(self, timeout: float | None = None) -> bool:
        """Block until :attr:`ready` (upstream waits up to 5 minutes); False on timeout."""
        return self._ready.wait(timeout)

    def observe(self, node: KubeObject | None) -> None:
        """Take a new state of the Node (None: deleted); may call ``exit(1)``."""
        if node is None:
            with self._lock:
                known = self._node is not None
                self._node = None
                self._eligible = False
            if known:
                logger.error("Node %s is being deleted; exiting", self.node_name)
                self._exit(1)
            return
        try:
            info = parse_node(node)
        except ValueError as err:
            logger.error("Ignoring a state of Node %s: %s", self.node_name, err)
            return
        host_ips = _host_ips(info.addresses)
        pod_cidrs = info.pod_cidrs
        with self._lock:
            self._node = node
            self._eligible = not (info.deleting or info.to_be_deleted_taint)
            if not self._ready.is_set():
                if not host_ips:
                    logger.info("Node %s has no host IPs yet; waiting", self.node_name)
                    return
                if self.watch_pod_cidrs and not pod_cidrs:
                    logger.info("Node %s has no PodCIDR allocated yet; waiting", self.node_name)
                    return
                self._host_ips, self._pod_cidrs = host_ips, pod_cidrs
                self._ready.set()
                logger.info(
                    "Node %s: host IPs %s, pod CIDRs %s",
                    self.node_name,
                    ", ".join(map(str, host_ips)),
                    ", ".join(map(str, pod_cidrs)) or "none",
                )
                return
            old_ips, old_cidrs = self._host_ips, self._pod_cidrs
            self._pod_cidrs = pod_cidrs
            if host_ips:
                self._host_ips = host_ips
        if self.watch_pod_cidrs and pod_cidrs != old_cidrs:
            logger.error(
                "PodCIDRs changed for Node %s from [%s] to [%s]; exiting",
                self.node_name,
                ", ".join(map(str, old_cidrs)),
                ", ".join(map(str, pod_cidrs)),
            )
            self._exit(1)
        if not host_ips:
            logger.error("Failed to retrieve the host IPs of Node %s; ignoring", self.node_name)
            return
        if host_ips != old_ips:
            logger.error(
                "NodeIPs changed for Node %s from [%s] to [%s]; exiting",
                self.node_name,
                ", ".join(map(str, old_ips)),
                ", ".join(map(str, host_ips)),
            )
            self._exit(1)


# Reflectors


class _Expired(Exception):
    """The resourceVersion (or continue token) is too old: relist."""


class _Stopped(Exception):
    """The source is stopping."""


class _WatchError(Exception):
    """The watch stream said something we cannot go on from (an ERROR event, bad JSON)."""


@dataclass(frozen=True, slots=True)
class _Resource:
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
        return f'"{self.resource}" in API group "{self.group}"'


@dataclass(frozen=True, slots=True)
class _Callbacks:
    add: Callable[[KubeObject], None]
    update: Callable[[KubeObject, KubeObject], None]
    delete: Callable[[KubeObject], None]
    listed: Callable[[bool], None]  # after every (re)list; True the first time
    after_event: Callable[[], None]


def _noop(*_: object) -> None:
    pass


def _metadata(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    metadata = obj.get("metadata")
    return metadata if isinstance(metadata, Mapping) else {}


def _key(obj: Mapping[str, Any]) -> Key | None:
    metadata = _metadata(obj)
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        return None
    namespace = metadata.get("namespace")
    # Interned: a namespace's name repeats over its objects (one copy each otherwise).
    return (sys.intern(namespace) if isinstance(namespace, str) else "", name)


def _rv(obj: Mapping[str, Any]) -> str | None:
    value = _metadata(obj).get("resourceVersion")
    return value if isinstance(value, str) and value else None


def _describe_error(err: BaseException) -> str:
    if isinstance(err, client.ApiException):
        reason = ""
        try:
            body = json.loads(err.body) if err.body else {}
            reason = body.get("message", "") if isinstance(body, dict) else ""
        except ValueError:
            reason = str(err.body)[:200]
        text = f"{err.status} {err.reason}"
        return f"{text}: {reason}" if reason else text
    if isinstance(err, urllib3.exceptions.MaxRetryError) and err.reason is not None:
        return _describe_error(err.reason)
    if isinstance(err, urllib3.exceptions.NewConnectionError):
        cause = err.__cause__ or err.__context__
        why = cause.strerror if isinstance(cause, OSError) and cause.strerror else None
        return f"cannot reach the API server ({why or str(err).rsplit(': ', 1)[-1]})"
    if isinstance(err, urllib3.exceptions.ConnectTimeoutError):
        return "cannot reach the API server (connect timeout)"
    if isinstance(err, urllib3.exceptions.ReadTimeoutError):
        return "the API server did not answer in time"
    if isinstance(err, urllib3.exceptions.ProtocolError):
        cause = err.args[1] if len(err.args) > 1 else None
        return f"connection lost ({cause or err})"
    text = str(err) or type(err).__name__
    return " ".join(f"{type(err).__name__}: {text}".split())


def _get(
    api: client.ApiClient,
    path: str,
    query: Sequence[tuple[str, str]],
    timeout: tuple[float, float],
    *,
    throttle: bool = True,
) -> Any:
    """GET through the official client's transport, auth and rate limit (unless not
    ``throttle``: the next page of a list); the urllib3 response, unread. Raises
    ``ApiException`` for a non-2xx status.

    The generated API classes are skipped on purpose: constructing ``CoreV1Api`` alone
    builds its pydantic models for seconds, a cost every proxy start would pay.
    """
    method, url, headers, body, post_params = api.param_serialize(
        method="GET",
        resource_path=path,
        query_params=list(query),
        header_params={"Accept": _JSON},
        auth_settings=["BearerToken"],
    )
    call = api.call_api
    if not throttle and isinstance(api, RateLimitedApiClient):
        call = api.call_api_unthrottled
    response: Any = call(method, url, headers, body, post_params, _request_timeout=timeout)
    if not 200 <= response.status <= 299:
        response.read()
        raise client.ApiException.from_response(http_resp=response, body=None, data=None)
    return response.response


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


class _Reflector:
    """List and watch one resource (see the module docstring)."""

    def __init__(
        self,
        source: KubernetesSource,
        resource: _Resource,
        callbacks: _Callbacks,
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
        self.cache: dict[Key, Any] = {}
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
        return self.resource.resource

    # Loop

    def run(self, stop: threading.Event) -> None:
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
                _describe_error(err),
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
            _describe_error(err),
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
            resp = _get(self.source.api, resource.path, query, timeout, throttle=throttle)
        except client.ApiException as err:
            if err.status == 410:
                raise _Expired(f"{_describe_error(err)}") from None
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
        listed: set[Key] = set()
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
                    listed.add(key)
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
        self.cache[key] = obj if self.keep_objects else (version, slice_owner(obj))
        if old is None:
            self._call(self.callbacks.add, obj)
        elif self._version(old) != version or version is None:
            self._call(self.callbacks.update, self._old(key, old), obj)

    def _version(self, entry: Any) -> str | None:
        return _rv(entry) if self.keep_objects else entry[0]

    def _old(self, key: Key, entry: Any) -> KubeObject:
        """What the handler gets of a delivered object as ``old`` or on its deletion."""
        if self.keep_objects:
            return entry  # type: ignore[no-any-return]
        namespace, name = key
        version, owner = entry
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
                if self.cache.pop(key, None) is not None:
                    self._call(self.callbacks.delete, obj)
            else:
                old = self.cache.get(key)
                self.cache[key] = obj if self.keep_objects else (resource_version, slice_owner(obj))
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


# The source


class KubernetesSource:
    """Feeds a :class:`~kubeproxy.handlers.ProxyHandler` from the API server.

    ``node_watcher`` (optional) sees every state of this node's Node before the handler
    does. ``watch_service_cidrs``: None asks API discovery once whether
    ``networking.k8s.io/v1`` serves ``servicecidrs``; True/False decide without asking.
    ``page_size`` is the list ``limit``; ``watch_timeout`` the minimum server-side watch
    timeout (each watch asks for a random one between it and twice it);
    ``request_timeout`` bounds a list request and how long a watch may stay silent past
    its timeout; ``initial_backoff``/``max_backoff`` shape the retry waits. ``clock``,
    ``sleep`` (default: wait on the stop event) and ``rng`` are injectable for tests.
    """

    def __init__(
        self,
        api: client.ApiClient,
        handler: ProxyHandler,
        node_name: str,
        *,
        node_watcher: NodeWatcher | None = None,
        watch_service_cidrs: bool | None = None,
        page_size: int = 500,
        watch_timeout: float = 300.0,
        request_timeout: float = 60.0,
        connect_timeout: float = 10.0,
        initial_backoff: float = 0.8,
        max_backoff: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.api = api
        self.handler = handler
        self.node_name = node_name
        self.node_watcher = node_watcher
        self.page_size = page_size
        self.watch_timeout = watch_timeout
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.clock = clock
        self.sleep = sleep
        self.rng = rng if rng is not None else random.Random()
        self._deliver_lock = threading.RLock()
        self._service_cidrs_wanted = watch_service_cidrs
        self._service_cidrs_served: bool | None = watch_service_cidrs
        self._service_cidrs_known = threading.Event()
        if watch_service_cidrs is not None:
            self._service_cidrs_known.set()
        self._cidrs: tuple[IPNetwork, ...] | None = None
        self._reported_cidrs: set[tuple[str, str]] = set()
        self._threads: list[threading.Thread] = []
        self._started_node = False
        self._started_services = False
        self._discovery_failures = 0

        name = node_name
        self._services = _Reflector(
            self,
            _Resource(
                "services", "", "Service", "v1", PROXY_LABEL_SELECTOR, SERVICE_FIELD_SELECTOR
            ),
            _Callbacks(
                handler.on_service_add,
                handler.on_service_update,
                handler.on_service_delete,
                self._services_listed,
                _noop,
            ),
        )
        self._endpoint_slices = _Reflector(
            self,
            _Resource(
                "endpointslices",
                "discovery.k8s.io",
                "EndpointSlice",
                "discovery.k8s.io/v1",
                PROXY_LABEL_SELECTOR,
            ),
            _Callbacks(
                handler.on_endpoint_slice_add,
                handler.on_endpoint_slice_update,
                handler.on_endpoint_slice_delete,
                self._endpoint_slices_listed,
                _noop,
            ),
        )
        self._node = _Reflector(
            self,
            _Resource("nodes", "", "Node", "v1", None, f"metadata.name={name}"),
            _Callbacks(
                self._node_changed,
                lambda _old, new: self._node_changed(new),
                lambda _obj: self._node_changed(None),
                _noop,
                _noop,
            ),
            keep_objects=True,
        )
        self._service_cidrs = _Reflector(
            self,
            _Resource("servicecidrs", "networking.k8s.io", "ServiceCIDR", "networking.k8s.io/v1"),
            _Callbacks(
                _noop,
                _noop,
                _noop,
                lambda first: self._service_cidrs_changed(force=first),
                lambda: self._service_cidrs_changed(force=False),
            ),
            keep_objects=True,
        )

    # Public API

    @property
    def synced(self) -> bool:
        """Whether every resource has been listed once (ServiceCIDRs only if served)."""
        return all(r.synced.is_set() for r in self._required())

    def wait_for_sync(self, timeout: float | None = None) -> bool:
        """Block until :attr:`synced`; False if ``timeout`` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._service_cidrs_known.wait(self._remaining(deadline)):
            return False
        for reflector in self._required():
            if not reflector.synced.wait(self._remaining(deadline)):
                return False
        return True

    @property
    def service_cidrs_served(self) -> bool | None:
        """Whether the server serves ServiceCIDRs (None: not known yet)."""
        return self._service_cidrs_served

    def objects(self, resource: str) -> dict[Key, KubeObject]:
        """A copy of the cache of ``services``, ``endpointslices``, ``nodes`` or
        ``servicecidrs``: what the handler has been told exists."""
        with self._deliver_lock:
            return dict(self._reflector(resource).cache)

    def resource_version(self, resource: str) -> str | None:
        """The resourceVersion a resource's watch resumes from."""
        return self._reflector(resource).resource_version

    def start(self, stop: threading.Event) -> None:
        """Start the reflector threads (daemons); they run until ``stop`` is set.

        The same as :meth:`start_node` then :meth:`start_services`.
        """
        if self._threads:
            raise RuntimeError("the Kubernetes source is already running")
        self.start_node(stop)
        self.start_services(stop)

    def start_node(self, stop: threading.Event) -> None:
        """Start watching this Node and the ServiceCIDRs only: what a daemon needs to
        build its proxiers (upstream waits for its Node first, too)."""
        if self._started_node:
            raise RuntimeError("the Kubernetes source's Node watch is already running")
        self._started_node = True
        self._spawn(stop, ("node", self._node.run), ("servicecidrs", self._run_service_cidrs))

    def start_services(self, stop: threading.Event) -> None:
        """Start listing and watching the Services and EndpointSlices: once the
        handler can take them (held until then, 100k Services would wait in memory)."""
        if self._started_services:
            raise RuntimeError("the Kubernetes source's Service watches are already running")
        self._started_services = True
        self._spawn(
            stop,
            ("services", self._services.run),
            ("endpointslices", self._endpoint_slices.run),
        )

    def _spawn(
        self, stop: threading.Event, *targets: tuple[str, Callable[[threading.Event], None]]
    ) -> None:
        for label, target in targets:
            thread = threading.Thread(
                target=target, args=(stop,), name=f"kubernetes-{label}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def run(self, stop: threading.Event) -> None:
        """:meth:`start`, block until ``stop`` is set, then :meth:`join`."""
        self.start(stop)
        stop.wait()
        self.join()

    def join(self, timeout: float = 5.0) -> bool:
        """After ``stop`` was set: unblock reads in progress and wait for the threads."""
        for reflector in self._all():
            reflector.interrupt()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = any(t.is_alive() for t in self._threads)
        if not alive:
            self._threads = []
            self._started_node = self._started_services = False
        return not alive

    # Internals

    def _all(self) -> tuple[_Reflector, ...]:
        return (self._services, self._endpoint_slices, self._node, self._service_cidrs)

    def _required(self) -> list[_Reflector]:
        required = [self._services, self._endpoint_slices, self._node]
        if self._service_cidrs_served is not False:
            required.append(self._service_cidrs)
        return required

    def _reflector(self, resource: str) -> _Reflector:
        for reflector in self._all():
            if reflector.name == resource:
                return reflector
        raise KeyError(resource)

    def _remaining(self, deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _services_listed(self, first: bool) -> None:
        if first:
            self.handler.on_services_synced()

    def _endpoint_slices_listed(self, first: bool) -> None:
        if first:
            self.handler.on_endpoint_slices_synced()

    def _node_changed(self, node: KubeObject | None) -> None:
        if node is not None and _metadata(node).get("name") != self.node_name:
            logger.warning(
                "kubernetes: ignoring Node %s: not this node (%s)",
                _metadata(node).get("name"),
                self.node_name,
            )
            return
        if self.node_watcher is not None:
            try:
                self.node_watcher.observe(node)
            except Exception:  # the policy must not keep the handler from the news
                logger.exception("kubernetes: the node watcher failed")
        self.handler.on_node_update(node)

    def _run_service_cidrs(self, stop: threading.Event) -> None:
        while self._service_cidrs_served is None and not stop.is_set():
            try:
                self._service_cidrs_served = self._discover_service_cidrs()
            except Exception as err:
                self._discovery_failures += 1
                base = min(
                    self.max_backoff, self.initial_backoff * 2 ** (self._discovery_failures - 1)
                )
                delay = base / 2 + self.rng.random() * base / 2
                logger.warning(
                    "kubernetes: cannot tell whether the API server serves ServiceCIDRs: %s; "
                    "asking again in %.2fs",
                    _describe_error(err),
                    delay,
                )
                if self.sleep is not None:
                    self.sleep(delay)
                else:
                    stop.wait(delay)
                continue
            self._service_cidrs_known.set()
            if not self._service_cidrs_served:
                logger.info(
                    "kubernetes: the API server does not serve networking.k8s.io/v1 "
                    "servicecidrs; not watching ServiceCIDRs"
                )
        if self._service_cidrs_served:
            self._service_cidrs.run(stop)

    def _discover_service_cidrs(self) -> bool:
        try:
            resp = _get(
                self.api,
                "/apis/networking.k8s.io/v1",
                (),
                (self.connect_timeout, self.request_timeout),
            )
        except client.ApiException as err:
            if err.status == 404:
                return False
            raise
        complete = False
        try:
            body = json.loads(resp.data)
            complete = True
        finally:
            if not complete:
                resp.close()
            resp.release_conn()
        resources = body.get("resources") if isinstance(body, dict) else None
        return any(isinstance(r, dict) and r.get("name") == "servicecidrs" for r in resources or ())

    def _service_cidrs_changed(self, *, force: bool) -> None:
        cidrs = self._parse_service_cidrs(self._service_cidrs.cache.values())
        if not force and cidrs == self._cidrs:
            return
        self._cidrs = cidrs
        self.handler.on_service_cidrs_changed(list(cidrs))

    def _parse_service_cidrs(self, objects: Iterable[KubeObject]) -> tuple[IPNetwork, ...]:
        found: set[IPNetwork] = set()
        reported: set[tuple[str, str]] = set()
        for obj in objects:
            name = str(_metadata(obj).get("name"))
            spec = obj.get("spec")
            raw = spec.get("cidrs") if isinstance(spec, Mapping) else None
            if not isinstance(raw, list):
                self._report_cidr(reported, name, "", "has no spec.cidrs list; skipped")
                continue
            for text in raw:
                try:
                    found.add(ipaddress.ip_network(str(text), strict=True))
                except ValueError as err:
                    self._report_cidr(
                        reported, name, str(text), f"bad CIDR {text!r} ({err}); skipped"
                    )
        self._reported_cidrs = reported
        return tuple(sorted(found, key=lambda c: (c.version, int(c.network_address), c.prefixlen)))

    def _report_cidr(self, reported: set[tuple[str, str]], name: str, text: str, what: str) -> None:
        # One line per bad CIDR, not one per recomputation.
        reported.add((name, text))
        if (name, text) not in self._reported_cidrs:
            logger.error("kubernetes: ServiceCIDR %s %s", name, what)
