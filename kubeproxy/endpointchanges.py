"""EndpointSlice change tracking: pending slices per Service, merged into endpoints per port.

Handlers call :meth:`EndpointsChangeTracker.update` for every EndpointSlice event; the
tracker keeps the applied and the pending version of every slice, by Service and slice
name, and says whether the event needs a sync. :meth:`EndpointsMap.apply` folds the
pending slices in, re-merges the slices of each changed Service and reports what changed.
Semantics follow upstream's ``EndpointSliceCache`` / ``EndpointsChangeTracker``:

* merging: every slice of a Service, every port of the slice, every endpoint with an
  address, keyed by :class:`ServicePortName` (Service, port name, protocol); an
  ``IP:port`` present in several slices keeps the non-terminating copy; each port's
  endpoints are sorted by their ``IP:port`` string;
* change detection per slice: an event changes something iff the slice's parsed content
  differs from its pending version, or, with nothing pending, from its applied version;
  removing a slice the tracker never saw changes nothing;
* a slice whose ``kubernetes.io/service-name`` label changed (or went) leaves the Service
  it named: an update given its ``previous`` version records the slice's removal from
  that Service before its new content (upstream keeps serving the old Service from it
  until a restart; a fresh start would not).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from kubeproxy.handlers import KubeObject
from kubeproxy.objects import (
    LOCAL_READY_MARKS,
    Endpoint,
    EndpointRows,
    Endpoints,
    IPFamily,
    NamespacedName,
    Protocol,
    ServicePortName,
    endpoint_keys,
)
from kubeproxy.parse import (
    LABEL_SERVICE_NAME,
    InvalidObject,
    ParsedEndpointSlice,
    endpoint_slice_key,
    endpoint_with_port,
    parse_endpoint_slice,
)

__all__ = [
    "ANNOTATION_LAST_CHANGE_TRIGGER_TIME",
    "EndpointsChangeTracker",
    "EndpointsMap",
    "EndpointsUpdateResult",
    "merge_endpoint_slices",
    "same_owner",
]

logger = logging.getLogger(__name__)

ANNOTATION_LAST_CHANGE_TRIGGER_TIME = "endpoints.kubernetes.io/last-change-trigger-time"
"""When the change a slice reflects happened (RFC 3339), for the programming-latency metric."""

_EndpointsByPort = dict[ServicePortName, Endpoints]
_NO_ENDPOINTS: Mapping[ServicePortName, Endpoints] = {}

_Slices = ParsedEndpointSlice | dict[str, ParsedEndpointSlice]
"""The applied slices of one Service: the slice itself when it is the only one (most
Services have one: a dict of one per Service was 22 MB at 100k Services, issue 32), else
a dict by slice name."""

_MergedPorts = tuple[tuple[ServicePortName, Endpoints], ...]
"""The merged endpoints of one Service's ports, as (port, endpoints) pairs: a tuple of
one pair is 104 bytes where a dict of one is 224 (12 MB at 100k Services)."""


def _slice_named(held: _Slices | None, name: str) -> ParsedEndpointSlice | None:
    """The slice called ``name`` among one Service's applied slices."""
    if held is None:
        return None
    if isinstance(held, ParsedEndpointSlice):
        return held if held.name == name else None
    return held.get(name)


def _slices_by_name(held: _Slices | None) -> dict[str, ParsedEndpointSlice]:
    """One Service's applied slices as a dict by name (a new dict)."""
    if held is None:
        return {}
    if isinstance(held, ParsedEndpointSlice):
        return {held.name: held}
    return dict(held)


@dataclass(frozen=True, slots=True)
class EndpointsUpdateResult:
    """What one :meth:`EndpointsMap.apply` changed.

    ``updated_services``: Services whose merged endpoints differ from before.
    ``stale_endpoints``: (port, endpoint) pairs of UDP ports whose ``IP:port`` was there
    before and is gone now, sorted. ``conntrack_cleanup_required``: some updated Service
    has a UDP port before or after. ``last_change_trigger_times``: per Service, the
    trigger times (unix seconds) of the slice changes consumed, newer than the tracker.
    """

    updated_services: frozenset[NamespacedName]
    stale_endpoints: tuple[tuple[ServicePortName, Endpoint], ...]
    conntrack_cleanup_required: bool
    last_change_trigger_times: dict[NamespacedName, list[float]]


def merge_endpoint_slices(
    service: NamespacedName, slices: Sequence[ParsedEndpointSlice]
) -> dict[ServicePortName, Endpoints]:
    """The endpoints of each port of ``service``, merged from its slices, as
    :class:`~kubeproxy.objects.EndpointRows`.

    Slices are visited in the order given (the tracker passes them sorted by name, so a
    duplicate ``IP:port`` resolves the same way every time); of duplicates the first
    non-terminating one wins. Ports without endpoints are left out.
    """
    if len(slices) == 1 and len(slices[0].ports) == 1:
        alone = _alone(service, slices[0])
        if alone is not None:
            return alone
    by_port: dict[ServicePortName, dict[str, Endpoint]] = {}
    for parsed in slices:
        if not parsed.endpoints:
            continue
        for port_name, number, protocol in parsed.ports:
            name = ServicePortName(service, port_name, protocol)
            merged = by_port.get(name)
            if merged is None:
                merged = by_port[name] = {}
            for endpoint in parsed.endpoints:
                if endpoint.port != number:
                    endpoint = endpoint_with_port(endpoint, number)
                seen = merged.get(endpoint.key)
                # A pod moving between slices, or a new pod reusing a terminating pod's
                # IP, shows up twice for a while; the live one is the one to use.
                if seen is None or (seen.terminating and not endpoint.terminating):
                    merged[endpoint.key] = endpoint
    return {name: EndpointRows.of(merged.values()) for name, merged in by_port.items()}


def _alone(
    service: NamespacedName, parsed: ParsedEndpointSlice
) -> dict[ServicePortName, Endpoints] | None:
    """The merge of a Service's only slice with one port, when it is that slice's own
    endpoint rows (parsed sorted by key, already at that port, no ``IP:port`` twice):
    no new list per Service (12 MB at 100k Services) and no merging. None otherwise,
    and for endpoints that are not rows (a tuple a library caller gave: merged as any)."""
    endpoints = parsed.endpoints
    if type(endpoints) is not EndpointRows:
        return None
    port_name, number, protocol = parsed.ports[0]
    if not endpoints or endpoints.port_at(0) != number:
        return None if endpoints else {}
    for before, after in itertools.pairwise(endpoints.keys):
        if before == after:
            return None
    return {ServicePortName(service, port_name, protocol): endpoints}


def _merged_alone(
    service: NamespacedName, held: _Slices | None
) -> dict[ServicePortName, Endpoints] | None:
    """The merge of a Service's applied slices when it is its only slice's own endpoint
    rows (:func:`_alone`); None otherwise."""
    if isinstance(held, ParsedEndpointSlice) and len(held.ports) == 1:
        return _alone(service, held)
    return None


def _parse_trigger_time(value: object) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return moment.timestamp()


@dataclass(slots=True)
class _ServiceChange:
    previous: Mapping[ServicePortName, Endpoints]
    current: _EndpointsByPort


def same_owner(previous: KubeObject, current: KubeObject) -> bool:
    """Whether two versions of an EndpointSlice have the same ``addressType``, namespace,
    name and ``kubernetes.io/service-name`` label, as given: all a slice's tracking key
    is made of, so an update between them leaves no Service.

    Read raw, without the key's validation: the common update (the endpoints changed,
    nothing else) then costs four dictionary reads instead of validating both versions'
    names twice (two calls of :func:`~kubeproxy.parse.endpoint_slice_key`, 30 us of the
    watch thread's 330 us an update in the daemon at 30k Services).
    """
    if not isinstance(previous, Mapping) or not isinstance(current, Mapping):
        return False
    if previous.get("addressType") != current.get("addressType"):
        return False
    before, after = previous.get("metadata"), current.get("metadata")
    if not isinstance(before, Mapping) or not isinstance(after, Mapping):
        return False
    if before.get("name") != after.get("name") or before.get("namespace") != after.get("namespace"):
        return False
    labels_before, labels_after = before.get("labels"), after.get("labels")
    if not isinstance(labels_before, Mapping) or not isinstance(labels_after, Mapping):
        return False
    return bool(labels_before.get(LABEL_SERVICE_NAME) == labels_after.get(LABEL_SERVICE_NAME))


class EndpointsChangeTracker:
    """Applied and pending EndpointSlices of one IP family, by Service and slice name.

    Slices of another address type (the other family, FQDN) are ignored. An invalid slice
    is logged once per event (the :class:`~kubeproxy.parse.InvalidObject` text, at
    warning level), counted in :attr:`invalid_objects`, and otherwise ignored: an update
    that makes a slice invalid keeps the slice's last valid content in place (deleting
    the slice still removes it; a deletion needs only the slice's name and Service).

    :meth:`update` may be called from other threads than :meth:`EndpointsMap.apply`.
    """

    def __init__(
        self, family: IPFamily, node_name: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.family = family
        self.node_name = node_name
        self.total_changes = 0
        """Slice events of this family received, for metrics."""
        self.invalid_objects = 0
        """Slices skipped as invalid, for metrics."""
        self._start_time = clock()
        self._lock = threading.Lock()
        self._applied: dict[NamespacedName, _Slices] = {}
        # slice name -> new content, or None for a removal.
        self._pending: dict[NamespacedName, dict[str, ParsedEndpointSlice | None]] = {}
        self._pending_slices = 0
        self._trigger_times: dict[NamespacedName, list[float]] = {}
        # The merged form of `_applied`, so a change needs to merge only the new state;
        # not for a Service whose merge is its only slice's own rows (_merged_alone),
        # the usual one: that is found again from the slice (15 MB at 100k Services).
        self._merged: dict[NamespacedName, _MergedPorts] = {}

    @property
    def pending_count(self) -> int:
        """How many slices have a pending change."""
        return self._pending_slices

    def update(
        self, slice_: KubeObject, remove: bool, *, previous: KubeObject | None = None
    ) -> bool:
        """Record an EndpointSlice add or update, or its removal (``remove``).

        ``previous`` is the slice as it was before an update (a source's ``old``): when
        it named another Service of this family than ``slice_`` does (a relabel, a label
        removed, an address type changed), the slice leaves that Service. Returns whether
        this event needs a sync (as upstream; unlike :meth:`ServiceChangeTracker.update`).
        """
        left = (
            previous is not None
            and not remove
            and not same_owner(previous, slice_)
            and self._leave(previous, slice_)
        )
        return self._update(slice_, remove) or left

    def _leave(self, previous: KubeObject, current: KubeObject) -> bool:
        """Record the removal of ``previous`` from its Service if ``current`` no longer
        belongs there; whether that changed anything."""
        before = self._key_of(previous)
        if before is None or self._key_of(current) == before:
            return False
        service, name = before
        with self._lock:
            applied = _slice_named(self._applied.get(service), name)
            pending = self._pending.get(service)
            known = pending[name] if pending is not None and name in pending else applied
            if known is None:
                return False
            self._set_pending(service, name, None, applied is None)
            self._trigger_times.pop(service, None)
            return True

    def _key_of(self, slice_: KubeObject) -> tuple[NamespacedName, str] | None:
        """The Service and name ``slice_`` is tracked under here; None when it is of
        another family or names no valid Service."""
        if not isinstance(slice_, Mapping) or slice_.get("addressType") != self.family:
            return None
        try:
            return endpoint_slice_key(slice_)
        except InvalidObject:
            return None

    def _update(self, slice_: KubeObject, remove: bool) -> bool:
        parsed: ParsedEndpointSlice | None = None
        try:
            if remove:
                if not isinstance(slice_, Mapping) or slice_.get("addressType") != self.family:
                    return False
                service, name = endpoint_slice_key(slice_)
            else:
                parsed = parse_endpoint_slice(slice_, self.family, self.node_name)
                if parsed is None:
                    return False
                service, name = parsed.service, parsed.name
        except InvalidObject as err:
            logger.warning("%s", err)
            with self._lock:
                self.invalid_objects += 1
            return False

        with self._lock:
            self.total_changes += 1
            applied = _slice_named(self._applied.get(service), name)
            pending = self._pending.get(service)
            # Each comparison walks both slices' endpoints: made once per event.
            if pending is not None and name in pending:
                if pending[name] == parsed:
                    return False
                back = parsed == applied
            else:
                if applied == parsed:
                    return False
                back = False
            self._set_pending(service, name, parsed, back)
            if remove:
                # A deletion carries the time of the slice's last update, not of this
                # change: no latency sample for it.
                self._trigger_times.pop(service, None)
            else:
                annotations = slice_.get("metadata", {}).get("annotations")
                if isinstance(annotations, Mapping):
                    moment = _parse_trigger_time(
                        annotations.get(ANNOTATION_LAST_CHANGE_TRIGGER_TIME)
                    )
                    if moment is not None and moment > self._start_time:
                        self._trigger_times.setdefault(service, []).append(moment)
            return True

    def _set_pending(
        self,
        service: NamespacedName,
        name: str,
        parsed: ParsedEndpointSlice | None,
        back: bool,
    ) -> None:
        """Record ``parsed`` as the slice's pending state; ``back``: it is what is applied."""
        pending = self._pending.get(service)
        if back:
            # Back to what is applied: nothing left to do for this slice.
            if pending is not None and name in pending:
                del pending[name]
                self._pending_slices -= 1
                if not pending:
                    del self._pending[service]
            return
        if pending is None:
            pending = self._pending[service] = {}
        if name not in pending:
            self._pending_slices += 1
        pending[name] = parsed

    def _checkout(
        self,
    ) -> tuple[dict[NamespacedName, _ServiceChange], dict[NamespacedName, list[float]]]:
        # Folding pending into applied happens under the lock: update() compares new
        # content with the applied one, and must not see a half-folded state. Each
        # Service's slices before and after are noted in one list, so that the merge
        # below looks nothing up again by Service (a NamespacedName's hash is a Python
        # call).
        folded: list[
            tuple[NamespacedName, _Slices | None, _Slices | None, list[ParsedEndpointSlice]]
        ] = []
        with self._lock:
            pending, self._pending = self._pending, {}
            self._pending_slices = 0
            trigger_times, self._trigger_times = self._trigger_times, {}
            applied_by_service = self._applied
            for service, slices in pending.items():
                held = applied_by_service.get(service)
                if held is None and len(slices) == 1:
                    # A Service's first slice (every Service of a start-up): it alone is
                    # applied, with no dict, sort or list made for it, as below would.
                    for only in slices.values():
                        if only is None:
                            folded.append((service, None, None, []))
                        else:
                            applied_by_service[service] = only
                            folded.append((service, None, only, [only]))
                    continue
                applied = _slices_by_name(held)
                for name, parsed in slices.items():
                    if parsed is None:
                        applied.pop(name, None)
                    else:
                        applied[name] = parsed
                if not applied:
                    self._applied.pop(service, None)
                    folded.append((service, held, None, []))
                    continue
                ordered = [applied[n] for n in sorted(applied)]
                now = ordered[0] if len(applied) == 1 else applied
                self._applied[service] = now
                folded.append((service, held, now, ordered))
        changes: dict[NamespacedName, _ServiceChange] = {}
        merged_by_service = self._merged
        for service, before, after, slices_now in folded:
            merged = merged_by_service.pop(service, None) if merged_by_service else None
            if merged is not None:
                previous: Mapping[ServicePortName, Endpoints] = dict(merged)
            else:
                previous = _merged_alone(service, before) or _NO_ENDPOINTS
            alone = _merged_alone(service, after)
            if alone is not None:
                current = alone
            else:
                current = merge_endpoint_slices(service, slices_now) if slices_now else {}
                if current:
                    merged_by_service[service] = tuple(current.items())
            changes[service] = _ServiceChange(previous, current)
        return changes, trigger_times


def _held_name(name: ServicePortName, held: Collection[ServicePortName]) -> ServicePortName:
    """The object of ``held`` equal to ``name``; ``name`` itself when there is none."""
    for other in held:
        if other == name:
            return other
    return name


class EndpointsMap(dict[ServicePortName, Endpoints]):
    """The merged endpoints of every Service port of one family, as of the last
    :meth:`apply`. Ports without endpoints are absent.

    Change it only through :meth:`apply`: the map keeps the number of local ready IPs
    per Service alongside, for the health-check server.
    """

    __slots__ = ("_local_ready",)

    def __init__(self) -> None:
        super().__init__()
        self._local_ready: dict[NamespacedName, int] = {}

    def apply(
        self,
        tracker: EndpointsChangeTracker,
        port_names: Mapping[NamespacedName, Collection[ServicePortName]] | None = None,
    ) -> EndpointsUpdateResult:
        """Fold the tracker's pending slices into this map, consuming them.

        ``port_names``, each Service's port names as the Service map holds them (its
        ``ports_by_service``): a port of this map is keyed by that very object when there
        is one, not by an equal one made from the slice. Why: a key made a port is 64
        bytes; 100k Services held one each twice, 6 MB of the peak (issue 32)."""
        changes, trigger_times = tracker._checkout()
        updated: list[NamespacedName] = []
        stale: list[tuple[ServicePortName, Endpoint]] = []
        conntrack_cleanup = False
        local_ready = self._local_ready
        for service, change in changes.items():
            previous, current = change.previous, change.current
            if previous == current:
                continue
            updated.append(service)
            for name in previous:
                self.pop(name, None)
            held = port_names.get(service) if port_names is not None else None
            if held:
                for name, endpoints in current.items():
                    self[_held_name(name, held)] = endpoints
            else:
                self.update(current)
            for name, endpoints in previous.items():
                if name.protocol is not Protocol.UDP:
                    continue
                conntrack_cleanup = True
                still = current.get(name, ())
                kept = set(endpoint_keys(still))
                stale.extend((name, e) for e in endpoints if e.key not in kept)
            if not conntrack_cleanup:
                # A loop, not any() over a generator: one generator a Service made.
                for name in current:
                    if name.protocol is Protocol.UDP:
                        conntrack_cleanup = True
                        break
            local_ips: set[str] | None = None  # made for the few Services with some
            for endpoints in current.values():
                if type(endpoints) is EndpointRows and 1 not in endpoints.flags.translate(
                    LOCAL_READY_MARKS
                ):
                    continue  # no endpoint made to find none local (most Services)
                if local_ips is None:
                    local_ips = set()
                local_ips.update(e.address for e in endpoints if e.is_local and e.ready)
            if local_ips:
                self._local_ready[service] = len(local_ips)
            elif local_ready:
                local_ready.pop(service, None)
        stale.sort(key=lambda pair: (pair[0], pair[1].key))
        return EndpointsUpdateResult(
            updated_services=frozenset(updated),
            stale_endpoints=tuple(stale),
            conntrack_cleanup_required=conntrack_cleanup,
            last_change_trigger_times=trigger_times,
        )

    def local_ready_endpoints(self) -> dict[NamespacedName, int]:
        """Per Service, how many distinct local IPs are ready (terminating ones are not)."""
        return dict(self._local_ready)

    def local_ready_count(self, service: NamespacedName) -> int:
        """How many distinct local IPs of ``service`` are ready (0 when none)."""
        return self._local_ready.get(service, 0)
