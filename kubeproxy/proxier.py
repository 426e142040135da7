"""The proxier: the glue between a source, the change trackers and one backend.

A :class:`Proxier` serves one IP family. Handlers (called by a source) feed the change
trackers; a sync folds the pending changes into the Service and endpoint maps,
re-categorizes the endpoints of the Services that changed, and hands the backend a
:class:`~kubeproxy.backend.ProxySnapshot` (read-only views of the live maps) plus the
:class:`~kubeproxy.backend.SyncChanges`. An incremental sync costs time in proportion to
what changed, never to the number of Services.

Syncs are requested with :meth:`Proxier.sync` and run by a
:class:`~kubeproxy.runner.BoundedFrequencyRunner` (:meth:`Proxier.run`), or run at once
with :meth:`Proxier.sync_now`; :meth:`Proxier.request_full_sync` asks for a full one (the
self-healing core does, when someone else changed our rules). A failed partial sync is
followed at once by a full one; a failed full sync is retried after the runner's backoff
(1 s, doubling up to the sync period). Nothing is synced before the source has delivered
both its initial Services and EndpointSlices.

What happens around a sync plugs in from outside: a :class:`SyncObserver` (several through
:class:`ObserverGroup`) hears about queued and finished syncs; :class:`SyncHook` callables
run after each successful sync (health-check servers, gauges computed from the synced
state), and an optional conntrack hook runs after a successful sync that changed UDP
endpoints.

:class:`DualStackProxier` fans one source out to an IPv4 and an IPv6 proxier.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kubeproxy.backend import Backend, NodePortAddresses, ProxySnapshot, SyncChanges, SyncError
from kubeproxy.config import LocalDetectMode, LocalDetector, ProxierConfig
from kubeproxy.endpointchanges import EndpointsChangeTracker, EndpointsMap
from kubeproxy.handlers import KubeObject
from kubeproxy.nodeports import resolve_node_port_addresses
from kubeproxy.objects import (
    CategorizedEndpoints,
    Endpoint,
    Endpoints,
    IPAddress,
    IPFamily,
    IPNetwork,
    NamespacedName,
    NodeInfo,
    Protocol,
    ServicePort,
    ServicePortName,
)
from kubeproxy.parse import InvalidObject, describe, parse_node
from kubeproxy.runner import BoundedFrequencyRunner, Clock, RunFailed
from kubeproxy.servicechanges import ServiceChangeTracker, ServicePortMap, UdpFrontend
from kubeproxy.topology import categorize_endpoints

__all__ = [
    "FULL_SYNC_PERIOD",
    "DualStackProxier",
    "FinishedSync",
    "NullObserver",
    "ObserverGroup",
    "Proxier",
    "SyncHook",
    "SyncObserver",
]

logger = logging.getLogger(__name__)

FULL_SYNC_PERIOD = 3600.0
"""Seconds between periodic full syncs (upstream's ``FullSyncPeriod``, one hour)."""

_NO_ENDPOINTS: tuple[Endpoint, ...] = ()
_K = typing.TypeVar("_K")
_PortsAt: typing.TypeAlias = Mapping[_K, AbstractSet[ServicePortName]]
_NO_CATEGORIES = CategorizedEndpoints()


@dataclass(frozen=True, slots=True)
class FinishedSync:
    """One finished sync as a :class:`SyncObserver` hears of it: one value read by field
    name, so that the observers do not each repeat a list of positional arguments (and a
    field can be added without touching every one)."""

    family: IPFamily
    full: bool
    duration: float
    """Seconds, on the proxier's clock."""
    error: BaseException | None
    """None on success."""
    service_ports: int
    ports_with_endpoints: int


class SyncObserver(typing.Protocol):
    """Hears about syncs (metrics and health plug in here)."""

    def sync_queued(self, family: IPFamily) -> None:
        """A sync was requested."""
        ...

    def sync_finished(self, sync: FinishedSync) -> None:
        """A sync ended (``sync.error`` is None on success)."""
        ...

    def endpoints_trigger_times(self, family: IPFamily, times: list[float]) -> None:
        """EndpointSlice trigger times (wall-clock seconds) that a successful sync applied."""
        ...


class NullObserver:
    """A :class:`SyncObserver` that ignores everything."""

    def sync_queued(self, family: IPFamily) -> None:
        """Ignore."""

    def sync_finished(self, sync: FinishedSync) -> None:
        """Ignore."""

    def endpoints_trigger_times(self, family: IPFamily, times: list[float]) -> None:
        """Ignore."""


class ObserverGroup:
    """A :class:`SyncObserver` that passes every event to several observers, in order.

    One observer failing does not keep the event from the others (the failure is logged).
    An observer whose method is :class:`NullObserver`'s (it ignores that event) is not
    called for it: ``sync_queued`` comes with every change the source delivers, and the
    calls cost the watch thread about 5 us each on a busy node (30k Services, 50 updates a
    second: the group took 28 us a change for four observers, two of which ignore it).
    """

    def __init__(self, observers: Iterable[SyncObserver]) -> None:
        self.observers: tuple[SyncObserver, ...] = tuple(observers)
        self._queued = _listening(self.observers, "sync_queued")
        self._finished = _listening(self.observers, "sync_finished")
        self._trigger_times = _listening(self.observers, "endpoints_trigger_times")

    def sync_queued(self, family: IPFamily) -> None:
        """Tell every observer."""
        for method in self._queued:
            _notify(method, family)

    def sync_finished(self, sync: FinishedSync) -> None:
        """Tell every observer."""
        for method in self._finished:
            _notify(method, sync)

    def endpoints_trigger_times(self, family: IPFamily, times: list[float]) -> None:
        """Tell every observer."""
        for method in self._trigger_times:
            _notify(method, family, times)


def _listening(observers: Iterable[SyncObserver], name: str) -> tuple[Callable[..., None], ...]:
    """The observers' bound methods ``name``, but those that are :class:`NullObserver`'s."""
    ignored = getattr(NullObserver, name)
    return tuple(
        getattr(observer, name)
        for observer in observers
        if getattr(type(observer), name, None) is not ignored
    )


class SyncHook(typing.Protocol):
    """Work to do after a successful sync, in the sync thread, while syncs are held off.

    ``snapshot`` is what the backend was given (valid only during the call); ``changes``
    what changed. The hook may call the proxier's read methods
    (:meth:`Proxier.health_check_node_port`, :meth:`Proxier.local_ready_count`,
    :meth:`Proxier.ports_of`, :meth:`Proxier.udp_frontends`...), not
    :meth:`Proxier.sync_now`. Exceptions are logged. A hook's work should follow
    ``changes`` (the changed Services on a partial sync), never the whole snapshot.
    """

    def __call__(self, proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Run after a successful sync."""
        ...


def _notify(callback: Callable[..., None], *args: Any) -> None:
    try:
        callback(*args)
    except Exception:  # metrics and health must never break proxying
        logger.exception("sync observer or hook %r failed", callback)


class Proxier:
    """Proxies one IP family: a :class:`~kubeproxy.handlers.ProxyHandler` over one backend.

    Handlers may be called from any thread; syncs are serialized. Logs, never raises, on
    invalid objects and failed syncs.

    ``node`` is the node as known before any Node object arrives (default: just its name).
    ``host_addresses`` lists the host's addresses for ``nodePortAddresses``; it is called
    on full syncs, node changes and after :meth:`host_addresses_changed`, and a sync that
    finds them resolving differently is a full one; when absent the node's own addresses
    stand in. ``clock`` (monotonic) times
    syncs and the periodic full sync; ``wall_clock`` is the EndpointSlice tracker's
    clock for trigger times. ``full_sync_period`` is both the
    longest time between syncs and between full syncs. ``runner_clock`` drives the sync
    loop and ``cost_clock`` (the thread's CPU time) measures what a sync cost, for the
    pacing of the rest after it (tests pass fake ones).

    ``after_sync`` hooks run after every successful sync; ``conntrack`` runs after a
    successful sync whose changes say ``conntrack_cleanup_required`` (stale UDP flows),
    before the ``after_sync`` hooks.
    """

    def __init__(
        self,
        family: IPFamily,
        config: ProxierConfig,
        backend: Backend,
        *,
        node: NodeInfo | None = None,
        host_addresses: Callable[[], Sequence[IPAddress]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        observer: SyncObserver | None = None,
        full_sync_period: float = FULL_SYNC_PERIOD,
        runner_clock: Clock | None = None,
        cost_clock: Callable[[], float] = time.thread_time,
        conntrack: SyncHook | None = None,
        after_sync: Sequence[SyncHook] = (),
    ) -> None:
        if backend.family != family:
            raise ValueError(f"backend for {backend.family} given to the {family} proxier")
        self._family = family
        self._config = config
        self._backend = backend
        self._host_addresses = host_addresses
        self._clock = clock
        self._observer: SyncObserver = observer if observer is not None else NullObserver()
        self._conntrack = conntrack
        self._after_sync = tuple(after_sync)
        self.full_sync_period = full_sync_period

        self._service_changes = ServiceChangeTracker(family)
        self._endpoint_changes = EndpointsChangeTracker(family, config.node_name, clock=wall_clock)
        self._services = ServicePortMap()
        self._endpoints = EndpointsMap()
        self._categorized: dict[ServicePortName, CategorizedEndpoints] = {}
        # Tuples, not frozensets: 48 bytes instead of 216 a Service (20 MB at 100k).
        self._categorized_ports: dict[NamespacedName, tuple[ServicePortName, ...]] = {}
        self._snapshot_views = (
            MappingProxyType(self._services),
            MappingProxyType(self._endpoints),
            MappingProxyType(self._categorized),
        )

        # State set by handlers, read by syncs.
        self._state_lock = threading.Lock()
        self._node = node if node is not None else NodeInfo(name=config.node_name)
        # A node or service-CIDR change: the next sync is full.
        self._full_requested = False
        # The host's addresses changed: read them at the next sync.
        self._addresses_changed = False
        self._recategorize_all = True
        self._service_cidrs_override: tuple[IPNetwork, ...] | None = None
        self._services_synced = False
        self._endpoint_slices_synced = False

        # Sync state, owned by whoever holds the sync lock. Re-entrant so that hooks run
        # under it may call the locking read methods.
        self._sync_lock = threading.RLock()
        self._needs_full = True
        self._last_full_sync: float | None = None
        self._attempted_full = False
        self._node_port_addresses: NodePortAddresses | None = None
        self._node_ports_stale = True
        # With NodeCIDR the pod CIDRs come with the Node object: no warning before it.
        self._local_detector = self._detector_for(
            self._node, warn=config.local_detector.mode is not LocalDetectMode.NODE_CIDR
        )
        # Changes not yet delivered by a successful sync (they accumulate across failures).
        # Frozen: it becomes the sync's changed_services as it is, no copy.
        self._pending_services: frozenset[NamespacedName] = frozenset()
        self._pending_deleted_udp_ips: set[IPAddress] = set()
        self._pending_stale_udp: list[tuple[ServicePortName, Endpoint]] = []
        self._pending_conntrack_cleanup = False
        self._pending_trigger_times: list[float] = []
        # How many Services the last sync changed (1 for a full one), for the pacing.
        self._last_sync_changes = 1

        fixed_rest = config.min_sync_period
        self._runner = BoundedFrequencyRunner(
            f"sync-runner-{family.value}",
            self._run_sync,
            fixed_rest if fixed_rest is not None else 0.0,
            config.sync_period,
            full_sync_period,
            clock=runner_clock,
            pacing=config.sync_pacing if fixed_rest is None else None,
            cost_clock=cost_clock,
        )

    # Properties

    @property
    def family(self) -> IPFamily:
        """The IP family this proxier serves."""
        return self._family

    @property
    def backend(self) -> Backend:
        """The backend this proxier programs."""
        return self._backend

    @property
    def initialized(self) -> bool:
        """Whether both the Services and the EndpointSlices have synced from the source."""
        return self._services_synced and self._endpoint_slices_synced

    @property
    def node(self) -> NodeInfo:
        """The node as last seen."""
        return self._node

    @property
    def service_changes(self) -> ServiceChangeTracker:
        """The Service change tracker (for metrics: totals, invalid objects)."""
        return self._service_changes

    @property
    def endpoint_changes(self) -> EndpointsChangeTracker:
        """The EndpointSlice change tracker (for metrics: totals, invalid objects)."""
        return self._endpoint_changes

    @property
    def services(self) -> MappingProxyType[ServicePortName, ServicePort]:
        """Read-only view of the Service ports as of the last sync."""
        return self._snapshot_views[0]

    @property
    def endpoints(self) -> MappingProxyType[ServicePortName, Endpoints]:
        """Read-only view of the endpoints per Service port as of the last sync."""
        return self._snapshot_views[1]

    @property
    def categorized(self) -> MappingProxyType[ServicePortName, CategorizedEndpoints]:
        """Read-only view of the categorized endpoints as of the last sync."""
        return self._snapshot_views[2]

    def health_check_node_ports(self) -> dict[NamespacedName, int]:
        """Health-check node ports of the Services as of the last sync."""
        with self._sync_lock:
            return self._services.health_check_node_ports()

    def health_check_node_port(self, service: NamespacedName) -> int:
        """The health-check node port of one Service as of the last sync (0: none)."""
        with self._sync_lock:
            return self._services.health_check_node_port(service)

    def local_ready_endpoints(self) -> dict[NamespacedName, int]:
        """Distinct local ready endpoint IPs per Service, as of the last sync."""
        with self._sync_lock:
            return self._endpoints.local_ready_endpoints()

    def local_ready_count(self, service: NamespacedName) -> int:
        """Distinct local ready endpoint IPs of one Service, as of the last sync."""
        with self._sync_lock:
            return self._endpoints.local_ready_count(service)

    def udp_frontends(self) -> tuple[_PortsAt[UdpFrontend], _PortsAt[int]]:
        """The UDP ports answering at each (address, port) frontend and at each NodePort,
        as of the last sync: read-only views, valid while syncs are held (in a hook)."""
        return self._services.udp_frontends, self._services.udp_node_ports

    def ports_of(self, service: NamespacedName) -> frozenset[ServicePortName]:
        """The port names of one Service as of the last sync (empty if it has none)."""
        with self._sync_lock:
            return frozenset(self._categorized_ports.get(service, ()))

    # ProxyHandler

    def on_service_add(self, service: KubeObject) -> None:
        """A Service appeared."""
        if self._service_changes.update(None, service):
            self._sync_if_initialized()

    def on_service_update(self, old: KubeObject, new: KubeObject) -> None:
        """A Service changed."""
        if self._service_changes.update(old, new):
            self._sync_if_initialized()

    def on_service_delete(self, service: KubeObject) -> None:
        """A Service went away."""
        if self._service_changes.update(service, None):
            self._sync_if_initialized()

    def on_services_synced(self) -> None:
        """The source delivered its initial Services; sync at once if everything is in."""
        with self._state_lock:
            self._services_synced = True
        if self.initialized:
            self.sync_now()

    def on_endpoint_slice_add(self, slice_: KubeObject) -> None:
        """An EndpointSlice appeared."""
        if self._endpoint_changes.update(slice_, False):
            self._sync_if_initialized()

    def on_endpoint_slice_update(self, old: KubeObject, new: KubeObject) -> None:
        """An EndpointSlice changed (a relabelled one leaves the Service ``old`` named)."""
        if self._endpoint_changes.update(new, False, previous=old):
            self._sync_if_initialized()

    def on_endpoint_slice_delete(self, slice_: KubeObject) -> None:
        """An EndpointSlice went away."""
        if self._endpoint_changes.update(slice_, True):
            self._sync_if_initialized()

    def on_endpoint_slices_synced(self) -> None:
        """The source delivered its initial EndpointSlices; sync at once if all is in."""
        with self._state_lock:
            self._endpoint_slices_synced = True
        if self.initialized:
            self.sync_now()

    def on_node_update(self, node: KubeObject | None) -> None:
        """This node changed: a zone change re-categorizes everything; any change syncs fully.

        A deleted Node (``None``) leaves the last known node in place.
        """
        if node is None:
            logger.warning(
                "Node %s was deleted; %s proxier keeps its last known state",
                self._config.node_name,
                self._family,
            )
            return
        try:
            info = parse_node(node)
        except InvalidObject as err:
            logger.warning("%s; keeping the last known node", err)
            return
        if info.name != self._config.node_name:
            logger.debug(
                "Ignoring %s: not this node (%s)", describe(node, "Node"), self._config.node_name
            )
            return
        with self._state_lock:
            if info == self._node:
                return
            if info.zone != self._node.zone:
                logger.info(
                    "Node %s zone changed from %r to %r; re-categorizing every Service",
                    info.name,
                    self._node.zone,
                    info.zone,
                )
                self._recategorize_all = True
            self._node = info
            self._full_requested = True
        self._sync_if_initialized()

    def on_service_cidrs_changed(self, cidrs: Sequence[IPNetwork]) -> None:
        """The complete list of service CIDRs changed (this family's are kept)."""
        mine = tuple(dict.fromkeys(c for c in cidrs if c.version == self._family.version))
        with self._state_lock:
            if mine == self._service_cidrs_override:
                return
            self._service_cidrs_override = mine
            # A backend may program the CIDRs only on full syncs.
            self._full_requested = True
        self._sync_if_initialized()

    # Syncing

    def sync(self) -> None:
        """Ask for a sync soon (coalesced and rate-limited by the runner)."""
        self._notify(self._observer.sync_queued, self._family)
        self._runner.run()

    def host_addresses_changed(self) -> None:
        """An address was added to or removed from the host (an
        :class:`~kubeproxy.host.netlink.AddressWatcher` says so): read them again and sync
        soon; the sync is a full one if ``nodePortAddresses`` resolve differently."""
        with self._state_lock:
            self._addresses_changed = True
        self._sync_if_initialized()

    def request_full_sync(self) -> None:
        """Ask for a full sync soon: the kernel may no longer hold what we wrote (someone
        else changed it). Coalesced with every other request; nothing happens before the
        proxier is initialized (its first sync is full anyway)."""
        with self._state_lock:
            self._full_requested = True
        self._sync_if_initialized()

    @contextlib.contextmanager
    def syncs_held(self) -> Iterator[None]:
        """A block during which no sync of this proxier runs (it waits for one under way)."""
        with self._sync_lock:
            yield

    def run(self, stop: threading.Event) -> None:
        """Run the sync loop in this thread until ``stop`` is set."""
        self._runner.loop(stop)

    def sync_now(self) -> bool:
        """Sync once, now, in this thread; True on success.

        Returns False without doing anything before the proxier is initialized. A failure
        has the sync loop retry after its backoff.
        """
        with self._sync_lock:
            if not self.initialized:
                logger.debug("%s proxier not initialized yet; not syncing", self._family)
                return False
            ok = self._sync_locked()
        self._runner.ran_outside(ok)
        return ok

    def _sync_if_initialized(self) -> None:
        if self.initialized:
            self.sync()

    def _run_sync(self) -> int:
        """One sync of the loop; how many changes it carried (the runner's pacing rests
        by the cost per change: :mod:`kubeproxy.pacing`)."""
        with self._sync_lock:
            if not self.initialized:
                return 1
            ok = self._sync_locked()
            partial = not self._attempted_full
            changes = self._last_sync_changes
        if not ok:
            # A failed partial sync is followed at once by a full one (the next sync is
            # full after any failure); a failed full sync waits for the backoff.
            raise RunFailed(f"{self._family} sync failed", retry_now=partial)
        return changes

    def _sync_locked(self) -> bool:
        start = self._clock()
        self._attempted_full = False
        error: BaseException | None = None
        synced: tuple[ProxySnapshot, SyncChanges] | None = None
        try:
            synced = self._apply_and_sync(start)
        except SyncError as err:
            error = err
            logger.error("%s sync failed; the next sync will be full: %s", self._family, err)
        except Exception as err:  # a backend or bug must not stop proxying
            error = err
            logger.exception("%s sync failed; the next sync will be full: %s", self._family, err)
        full = self._attempted_full
        if error is not None:
            self._needs_full = True
        duration = self._clock() - start
        sizes = len(self._services), len(self._endpoints)
        finished = FinishedSync(self._family, full, duration, error, *sizes)
        self._notify(self._observer.sync_finished, finished)
        if error is None and self._pending_trigger_times:
            times, self._pending_trigger_times = self._pending_trigger_times, []
            self._notify(self._observer.endpoints_trigger_times, self._family, times)
        if error is None:
            logger.debug(
                "%s %s sync took %.1f ms",
                self._family,
                "full" if full else "partial",
                duration * 1000,
            )
        self._last_sync_changes = 1
        if synced is not None:
            snapshot, changes = synced
            if not changes.full:
                self._last_sync_changes = max(1, len(changes.changed_services))
            if self._conntrack is not None and changes.conntrack_cleanup_required:
                self._notify(self._conntrack, self, snapshot, changes)
            for hook in self._after_sync:
                self._notify(hook, self, snapshot, changes)
        return error is None

    def _apply_and_sync(self, start: float) -> tuple[ProxySnapshot, SyncChanges]:
        """Fold in pending changes and call the backend; return what it was given."""
        try:
            service_result = self._services.apply(self._service_changes)
            endpoints_result = self._endpoints.apply(
                self._endpoint_changes, self._services.ports_by_service
            )
        except Exception:
            # Maps may be half-updated: derive everything afresh next time.
            with self._state_lock:
                self._recategorize_all = True
            raise
        changed = service_result.updated_services | endpoints_result.updated_services
        if self._pending_services:
            self._pending_services = self._pending_services | changed
        else:
            self._pending_services = changed
        self._pending_deleted_udp_ips |= service_result.deleted_udp_cluster_ips
        self._pending_stale_udp.extend(
            (name, endpoint)
            for name, endpoint in endpoints_result.stale_endpoints
            if name.protocol is Protocol.UDP
        )
        self._pending_conntrack_cleanup |= endpoints_result.conntrack_cleanup_required
        for times in endpoints_result.last_change_trigger_times.values():
            self._pending_trigger_times.extend(times)
        # At a first sync each of these holds every Service (4 MB per 100k): not held
        # through the backend's sync, the peak of a start-up (issue 32).
        del service_result, endpoints_result

        with self._state_lock:
            node = self._node
            full_requested, self._full_requested = self._full_requested, False
            addresses_changed, self._addresses_changed = self._addresses_changed, False
            recategorize_all, self._recategorize_all = self._recategorize_all, False
            override = self._service_cidrs_override
        try:
            if recategorize_all:
                self._recategorize_everything(node)
            else:
                self._recategorize(changed, node)
        except Exception:
            with self._state_lock:
                self._recategorize_all = True
            raise
        del changed

        full = (
            self._needs_full
            or full_requested
            or self._last_full_sync is None
            or start - self._last_full_sync >= self.full_sync_period
        )
        # The host's addresses are read on full syncs and when they changed (an address
        # watcher says so: host_addresses_changed); a change of what they resolve to
        # makes this sync a full one.
        previous_node_ports = node_ports = self._node_port_addresses
        if full or self._node_ports_stale or node_ports is None or addresses_changed:
            node_ports = self._node_port_addresses = self._resolve_node_ports(node)
            if previous_node_ports is not None and node_ports != previous_node_ports:
                logger.info(
                    "%s: nodePortAddresses now resolve to %s",
                    self._family,
                    _describe_node_ports(node_ports),
                )
                full = True
        self._attempted_full = full
        if full_requested and self._config.local_detector.mode is LocalDetectMode.NODE_CIDR:
            self._local_detector = self._detector_for(node)
        cidrs = override if override is not None else self._config.service_cidrs
        services, endpoints, categorized = self._snapshot_views
        snapshot = ProxySnapshot(
            family=self._family,
            node=node,
            services=services,
            endpoints=endpoints,
            categorized=categorized,
            service_cidrs=tuple(c for c in cidrs if c.version == self._family.version),
            node_port_addresses=node_ports,
            local_detector=self._local_detector,
            ports_by_service=self._services.ports_by_service,
        )
        changes = SyncChanges(
            full=full,
            changed_services=self._pending_services,
            deleted_udp_cluster_ips=frozenset(self._pending_deleted_udp_ips),
            stale_udp_endpoints=tuple(self._pending_stale_udp),
            conntrack_cleanup_required=self._pending_conntrack_cleanup,
        )
        self._backend.sync(snapshot, changes)

        self._needs_full = False
        if full:
            self._last_full_sync = start
        self._pending_services = frozenset()
        self._pending_deleted_udp_ips = set()
        self._pending_stale_udp = []
        self._pending_conntrack_cleanup = False
        return snapshot, changes

    def _recategorize_everything(self, node: NodeInfo) -> None:
        ports_by_service = self._services.ports_by_service
        for service in [s for s in self._categorized_ports if s not in ports_by_service]:
            for name in self._categorized_ports.pop(service):
                del self._categorized[name]
        self._recategorize(list(ports_by_service), node)

    def _recategorize(self, services: Iterable[NamespacedName], node: NodeInfo) -> None:
        """Categorize the endpoints of every port of ``services`` afresh."""
        # Locals for what the loop reads: it runs once per Service of the cluster at a
        # full sync.
        service_map = self._services
        ports_by_service = service_map.ports_by_service
        categorized = self._categorized
        categorized_ports = self._categorized_ports
        endpoints = self._endpoints
        node_name = self._config.node_name
        zone = node.zone
        for service in services:
            ports = tuple(ports_by_service.get(service, ()))
            for name in categorized_ports.get(service, ()):
                if name not in ports:
                    del categorized[name]
            for name in ports:
                found = endpoints.get(name, _NO_ENDPOINTS)
                categorized[name] = (
                    categorize_endpoints(found, service_map[name], node_name, zone)
                    if found
                    else _NO_CATEGORIES
                )
            if ports:
                categorized_ports[service] = ports
            else:
                categorized_ports.pop(service, None)

    def _detector_for(self, node: NodeInfo, *, warn: bool = True) -> LocalDetector:
        detector = self._config.local_detector
        if detector.mode is LocalDetectMode.NODE_CIDR:
            detector = LocalDetector(LocalDetectMode.NODE_CIDR, node.pod_cidrs)
        local = detector.for_family(self._family)
        if warn and detector.mode is not LocalDetectMode.NONE and not local.implemented:
            # Info, as upstream logs it: a node runs both families whenever the kernel has
            # IPv6, and a single-stack cluster has no pod CIDR of the other family.
            logger.info(
                "%s: no %s CIDR for local-traffic detection mode %s; not detecting local traffic",
                self._family,
                self._family,
                detector.mode,
            )
        return local

    def _resolve_node_ports(self, node: NodeInfo) -> NodePortAddresses:
        previous = self._node_port_addresses
        failing = self._node_ports_stale and previous is not None
        self._node_ports_stale = False
        addresses: Sequence[IPAddress]
        if self._host_addresses is None:
            addresses = node.addresses
        else:
            try:
                addresses = self._host_addresses()
            except Exception as err:  # netlink trouble must not stop proxying
                if not failing:  # one line per outage, not one per sync
                    logger.error(
                        "%s: cannot list host addresses for nodePortAddresses (%s); keeping"
                        " the previous ones",
                        self._family,
                        err,
                    )
                self._node_ports_stale = True  # retry on the next sync
                if previous is not None:
                    return previous
                addresses = node.addresses
        return resolve_node_port_addresses(
            self._config.node_port_addresses, self._family, node, addresses
        )

    @staticmethod
    def _notify(callback: Callable[..., None], *args: Any) -> None:
        _notify(callback, *args)


def _describe_node_ports(node_ports: NodePortAddresses) -> str:
    if node_ports.match_all:
        return "every local address"
    return ", ".join(map(str, node_ports.addresses)) or "no address"


class DualStackProxier:
    """A :class:`~kubeproxy.handlers.ProxyHandler` feeding an IPv4 and an IPv6 proxier.

    Services, the Node and service CIDRs go to both; EndpointSlices go by ``addressType``
    (FQDN and unknown address types are ignored).
    """

    def __init__(self, ipv4: Proxier, ipv6: Proxier) -> None:
        if ipv4.family is not IPFamily.IPV4 or ipv6.family is not IPFamily.IPV6:
            raise ValueError(
                f"DualStackProxier needs an IPv4 and an IPv6 proxier, got {ipv4.family} and"
                f" {ipv6.family}"
            )
        self.ipv4 = ipv4
        self.ipv6 = ipv6

    @property
    def proxiers(self) -> tuple[Proxier, Proxier]:
        """The IPv4 and the IPv6 proxier."""
        return (self.ipv4, self.ipv6)

    @property
    def initialized(self) -> bool:
        """Whether both proxiers are initialized."""
        return self.ipv4.initialized and self.ipv6.initialized

    def _for_slice(self, slice_: KubeObject) -> Proxier | None:
        # type() first: isinstance against the Mapping ABC costs 0.2 us, per slice.
        is_mapping = type(slice_) is dict or isinstance(slice_, Mapping)
        address_type = slice_.get("addressType") if is_mapping else None
        if address_type == IPFamily.IPV4.value:
            return self.ipv4
        if address_type == IPFamily.IPV6.value:
            return self.ipv6
        logger.debug("Ignoring %s: addressType %r", describe(slice_, "EndpointSlice"), address_type)
        return None

    def on_service_add(self, service: KubeObject) -> None:
        """Give the Service to both proxiers."""
        self.ipv4.on_service_add(service)
        self.ipv6.on_service_add(service)

    def on_service_update(self, old: KubeObject, new: KubeObject) -> None:
        """Give the change to both proxiers."""
        self.ipv4.on_service_update(old, new)
        self.ipv6.on_service_update(old, new)

    def on_service_delete(self, service: KubeObject) -> None:
        """Give the deletion to both proxiers."""
        self.ipv4.on_service_delete(service)
        self.ipv6.on_service_delete(service)

    def on_services_synced(self) -> None:
        """Tell both proxiers."""
        self.ipv4.on_services_synced()
        self.ipv6.on_services_synced()

    def on_endpoint_slice_add(self, slice_: KubeObject) -> None:
        """Give the slice to the proxier of its address type."""
        proxier = self._for_slice(slice_)
        if proxier is not None:
            proxier.on_endpoint_slice_add(slice_)

    def on_endpoint_slice_update(self, old: KubeObject, new: KubeObject) -> None:
        """Give the change to the proxier of the slice's address type."""
        before, after = self._for_slice(old), self._for_slice(new)
        if before is after:
            if after is not None:
                after.on_endpoint_slice_update(old, new)
            return
        # addressType is immutable in the API; should it change anyway, move the slice.
        if before is not None:
            before.on_endpoint_slice_delete(old)
        if after is not None:
            after.on_endpoint_slice_add(new)

    def on_endpoint_slice_delete(self, slice_: KubeObject) -> None:
        """Give the deletion to the proxier of the slice's address type."""
        proxier = self._for_slice(slice_)
        if proxier is not None:
            proxier.on_endpoint_slice_delete(slice_)

    def on_endpoint_slices_synced(self) -> None:
        """Tell both proxiers."""
        self.ipv4.on_endpoint_slices_synced()
        self.ipv6.on_endpoint_slices_synced()

    def on_node_update(self, node: KubeObject | None) -> None:
        """Give the Node to both proxiers."""
        self.ipv4.on_node_update(node)
        self.ipv6.on_node_update(node)

    def on_service_cidrs_changed(self, cidrs: Sequence[IPNetwork]) -> None:
        """Give the CIDRs to both proxiers (each keeps its family's)."""
        self.ipv4.on_service_cidrs_changed(cidrs)
        self.ipv6.on_service_cidrs_changed(cidrs)

    def host_addresses_changed(self) -> None:
        """Tell both proxiers."""
        self.ipv4.host_addresses_changed()
        self.ipv6.host_addresses_changed()

    def sync(self) -> None:
        """Ask both proxiers for a sync."""
        self.ipv4.sync()
        self.ipv6.sync()

    def sync_now(self) -> bool:
        """Sync both proxiers now; True if both succeeded."""
        ipv4_ok = self.ipv4.sync_now()
        ipv6_ok = self.ipv6.sync_now()
        return ipv4_ok and ipv6_ok

    def run(self, stop: threading.Event) -> None:
        """Run both sync loops (the IPv6 one in a thread of its own) until ``stop``."""
        thread = threading.Thread(
            target=self.ipv6.run, args=(stop,), name="sync-runner-IPv6", daemon=True
        )
        thread.start()
        try:
            self.ipv4.run(stop)
        finally:
            thread.join()
