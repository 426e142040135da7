"""The Kubernetes source: which resources are watched, and what their changes mean.

:class:`KubernetesSource` runs one :class:`~kubeproxy.sources.kubernetes.reflector.
Reflector` thread per resource: Services, EndpointSlices (``discovery.k8s.io/v1``), this
node's Node, and ServiceCIDRs (``networking.k8s.io/v1``, only when API discovery says the
server has them). It turns their changes into :class:`~kubeproxy.handlers.ProxyHandler`
calls, one at a time (a lock serialises the reflector threads' calls), passes every state
of the Node to the :class:`~kubeproxy.sources.kubernetes.nodewatch.NodeWatcher` first,
and reduces the ServiceCIDR objects to the list of CIDRs a handler gets.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from kubernetes import client

from kubeproxy.handlers import KubeObject, ProxyHandler
from kubeproxy.objects import IPNetwork
from kubeproxy.sources.kubernetes.apiclient import describe_error, get
from kubeproxy.sources.kubernetes.nodewatch import NodeWatcher
from kubeproxy.sources.kubernetes.reflector import (
    Callbacks,
    Key,
    Reflector,
    Resource,
    object_metadata,
)

__all__ = [
    "LABEL_HEADLESS",
    "LABEL_SERVICE_PROXY_NAME",
    "PROXY_LABEL_SELECTOR",
    "SERVICE_FIELD_SELECTOR",
    "KubernetesSource",
]

# The whole Kubernetes source logs under one name, as it did when it was one module.
logger = logging.getLogger("kubeproxy.sources.kubernetes")

LABEL_SERVICE_PROXY_NAME = "service.kubernetes.io/service-proxy-name"
LABEL_HEADLESS = "service.kubernetes.io/headless"
# As upstream's shared informer factory: both labels are excluded from both resources.
PROXY_LABEL_SELECTOR = f"!{LABEL_SERVICE_PROXY_NAME},!{LABEL_HEADLESS}"
SERVICE_FIELD_SELECTOR = "spec.clusterIP!=None"


def _noop(*_: object) -> None:
    pass


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
        self._services = Reflector(
            self,
            Resource("services", "", "Service", "v1", PROXY_LABEL_SELECTOR, SERVICE_FIELD_SELECTOR),
            Callbacks(
                handler.on_service_add,
                handler.on_service_update,
                handler.on_service_delete,
                self._services_listed,
                _noop,
            ),
        )
        self._endpoint_slices = Reflector(
            self,
            Resource(
                "endpointslices",
                "discovery.k8s.io",
                "EndpointSlice",
                "discovery.k8s.io/v1",
                PROXY_LABEL_SELECTOR,
            ),
            Callbacks(
                handler.on_endpoint_slice_add,
                handler.on_endpoint_slice_update,
                handler.on_endpoint_slice_delete,
                self._endpoint_slices_listed,
                _noop,
            ),
        )
        self._node = Reflector(
            self,
            Resource("nodes", "", "Node", "v1", None, f"metadata.name={name}"),
            Callbacks(
                self._node_changed,
                lambda _old, new: self._node_changed(new),
                lambda _obj: self._node_changed(None),
                _noop,
                _noop,
            ),
            keep_objects=True,
        )
        self._service_cidrs = Reflector(
            self,
            Resource("servicecidrs", "networking.k8s.io", "ServiceCIDR", "networking.k8s.io/v1"),
            Callbacks(
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
        """What the handler has been told exists of ``services``, ``endpointslices``,
        ``nodes`` or ``servicecidrs``: the Node and ServiceCIDRs whole, the others'
        identities (what the handler gets as ``old``)."""
        with self._deliver_lock:
            return self._reflector(resource).objects()

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

    def _all(self) -> tuple[Reflector, ...]:
        return (self._services, self._endpoint_slices, self._node, self._service_cidrs)

    def _required(self) -> list[Reflector]:
        required = [self._services, self._endpoint_slices, self._node]
        if self._service_cidrs_served is not False:
            required.append(self._service_cidrs)
        return required

    def _reflector(self, resource: str) -> Reflector:
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
        if node is not None and object_metadata(node).get("name") != self.node_name:
            logger.warning(
                "kubernetes: ignoring Node %s: not this node (%s)",
                object_metadata(node).get("name"),
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
                    describe_error(err),
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
            resp = get(
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
            name = str(object_metadata(obj).get("name"))
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
