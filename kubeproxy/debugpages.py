"""The ``/debug/`` pages on the metrics port: what the daemon holds and did, for an
operator in an incident (issue 30).

Off unless asked for, as upstream's profiling is: ``enableProfiling`` (``--profiling``)
serves upstream's ``/debug/pprof`` on the metrics port; Python has no pprof, so the same
opt-in serves these pages there instead. They show Service names, addresses and
endpoints, so they stay behind the same explicit switch (and the metrics port binds to
``127.0.0.1`` unless told otherwise).

The core's pages (this module):

* ``/debug/`` lists the pages;
* ``/debug/syncs``: the last syncs of each family (when, full or partial, how long, the
  Service ports in the snapshot, the error of a failed one), newest first;
* ``/debug/plan``: what each family's last successful sync did: full or partial, when,
  the Services the sync was told changed (a partial one's; the first
  :data:`PLAN_SERVICES` named), and what the backend counted while doing it when it
  says (:class:`SyncPlanSource`; nftables: the generation, Service ports planned,
  operations, transactions, element additions and deletions per set and map);
* ``/debug/repairs``: self-healing's recent repairs, newest first (the under way ones
  first): what was reported changed, when, how long the repair took, its outcome
  (:meth:`kubeproxy.selfheal.SelfHealer.recent_repairs`, a bounded ring);
* ``/debug/services``: the daemon's view, as JSON: without a query, every Service with
  its port count; ``?service=NAMESPACE/NAME`` that Service's ports, each with its
  frontends' settings and endpoints (as the EndpointSlices say, and as the core
  categorised them: cluster, local, whether any is usable).

A mode adds its own (:data:`ModePages`): nftables mode reads the kernel for
``/debug/explain``, ``/debug/trace`` and ``/debug/verify`` (the kernel against this
view) and serves the last failed-sync dump.

:class:`DebugState` records the view as an after-sync hook following each sync's
changes (a full sync copies the snapshot's mappings; a partial one only the changed
Services' ports), keeping references to the snapshot's frozen values, never to its
mappings (which the core goes on changing). It costs nothing while the pages are off:
it is not made.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, runtime_checkable

from kubeproxy.backend import ProxySnapshot, SyncChanges
from kubeproxy.config import ProxierConfig
from kubeproxy.host.httpserving import QueryRoute, Response, Route
from kubeproxy.objects import (
    CategorizedEndpoints,
    Endpoint,
    Endpoints,
    IPFamily,
    NamespacedName,
    ServicePort,
    ServicePortName,
)
from kubeproxy.proxier import FinishedSync
from kubeproxy.selfheal import utc_text

__all__ = [
    "KEPT_SYNCS",
    "PLAN_SERVICES",
    "DebugState",
    "ModePages",
    "SyncPlanSource",
    "SyncRecord",
    "core_pages",
    "json_page",
    "parse_service",
    "text_page",
]

KEPT_SYNCS: Final = 20
"""Syncs kept per family for ``/debug/syncs``."""

PLAN_SERVICES: Final = 20
"""Changed Services named in ``/debug/plan`` (the others are counted)."""

_JSON: Final = {"Content-Type": "application/json"}
_TEXT: Final = {"Content-Type": "text/plain; charset=utf-8"}


def json_page(data: object, status: int = 200) -> Response:
    """``data`` as a JSON answer."""
    return status, _JSON, (json.dumps(data, indent=2, default=str) + "\n").encode()


def text_page(text: str, status: int = 200) -> Response:
    """``text`` as a plain-text answer."""
    return status, _TEXT, text.encode()


def parse_service(text: str | None) -> NamespacedName | None:
    """``NAMESPACE/NAME`` from a query (None: missing or malformed)."""
    namespace, slash, name = (text or "").partition("/")
    if not slash or not namespace or not name or "/" in name:
        return None
    return NamespacedName(namespace, name)


@runtime_checkable
class SyncPlanSource(Protocol):
    """A backend that can say what its last successful sync did, from what it counted
    while doing it (no extra work per sync): plain, JSON-ready data."""

    def last_sync_plan(self) -> Mapping[str, object]:
        """The last successful sync's plan."""
        ...


@dataclass(frozen=True, slots=True)
class SyncRecord:
    """One sync as ``/debug/syncs`` shows it."""

    family: str
    ended: float
    full: bool
    duration_s: float
    service_ports: int
    with_endpoints: int
    error: str | None = None


@dataclass
class _FamilyView:
    """One family's view: the snapshot's values by port, and its scalar fields."""

    snapshot: ProxySnapshot
    services: dict[ServicePortName, ServicePort] = field(default_factory=dict)
    endpoints: dict[ServicePortName, Endpoints] = field(default_factory=dict)
    categorized: dict[ServicePortName, CategorizedEndpoints] = field(default_factory=dict)
    ports: dict[NamespacedName, frozenset[ServicePortName]] = field(default_factory=dict)


class DebugState:
    """What the pages show: each family's view after its last successful sync (an
    after-sync hook: :meth:`__call__`) and the last syncs (a sync observer). ``config``
    is the proxier's configuration (what a mode's page needs to compute what it would
    write); ``clock`` gives wall-clock seconds."""

    def __init__(self, config: ProxierConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self._lock = threading.Lock()
        self._views: dict[IPFamily, _FamilyView] = {}
        self._syncs: dict[IPFamily, collections.deque[SyncRecord]] = {}
        self._plans: dict[IPFamily, dict[str, Any]] = {}
        self.repairs: Callable[[], Sequence[Mapping[str, object]]] = tuple
        """Self-healing's recent repairs (the daemon sets it to its healer's)."""

    # --- the hook and the observer ----------------------------------------------------

    def __call__(self, proxier: object, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Record the view a successful sync wrote (following ``changes``) and its plan."""
        self._record_plan(proxier, snapshot, changes)
        with self._lock:
            view = self._views.get(snapshot.family)
            if view is None or changes.full:
                view = _FamilyView(
                    snapshot,
                    dict(snapshot.services),
                    dict(snapshot.endpoints),
                    dict(snapshot.categorized),
                    {s: frozenset(names) for s, names in (snapshot.ports_by_service or {}).items()},
                )
                if snapshot.ports_by_service is None:
                    by_service: dict[NamespacedName, set[ServicePortName]] = {}
                    for name in snapshot.services:
                        by_service.setdefault(name.service, set()).add(name)
                    view.ports = {s: frozenset(n) for s, n in by_service.items()}
                self._views[snapshot.family] = view
                return
            view.snapshot = snapshot
            for service in changes.changed_services:
                for name in view.ports.pop(service, frozenset()):
                    view.services.pop(name, None)
                    view.endpoints.pop(name, None)
                    view.categorized.pop(name, None)
                names = frozenset(snapshot.ports_of(service))
                if names:
                    view.ports[service] = names
                for name in names:
                    view.services[name] = snapshot.services[name]
                    view.endpoints[name] = snapshot.endpoints.get(name, ())
                    view.categorized[name] = snapshot.categorized.get(name, CategorizedEndpoints())

    def _record_plan(self, proxier: object, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        changed = sorted(changes.changed_services, key=str)
        plan: dict[str, Any] = {
            "ended": utc_text(self.clock()),
            "full": changes.full,
            "service_ports": len(snapshot.services),
            "changed_services": len(changed),
            "changed_services_named": [str(s) for s in changed[:PLAN_SERVICES]],
        }
        backend = getattr(proxier, "backend", None)
        if isinstance(backend, SyncPlanSource):
            plan["backend"] = dict(backend.last_sync_plan())
        with self._lock:
            self._plans[snapshot.family] = plan

    def sync_queued(self, family: IPFamily) -> None:
        """Nothing to record."""

    def sync_finished(self, sync: FinishedSync) -> None:
        """Record the sync."""
        error = sync.error
        record = SyncRecord(
            str(sync.family),
            self.clock(),
            sync.full,
            round(sync.duration, 6),
            sync.service_ports,
            sync.ports_with_endpoints,
            None if error is None else f"{type(error).__name__}: {error}",
        )
        with self._lock:
            kept = self._syncs.setdefault(sync.family, collections.deque(maxlen=KEPT_SYNCS))
            kept.appendleft(record)

    def endpoints_trigger_times(self, family: IPFamily, times: list[float]) -> None:
        """Nothing to record."""

    # --- reading ----------------------------------------------------------------------

    @property
    def families(self) -> list[IPFamily]:
        """The families with a view."""
        with self._lock:
            return sorted(self._views, key=str)

    def snapshot(self, family: IPFamily) -> ProxySnapshot | None:
        """The family's view as a snapshot of its own (copies: the hook goes on), for
        a page that computes what the proxy writes from it; None before the first sync."""
        with self._lock:
            view = self._views.get(family)
            if view is None:
                return None
            base = view.snapshot
            return ProxySnapshot(
                family,
                base.node,
                dict(view.services),
                dict(view.endpoints),
                dict(view.categorized),
                service_cidrs=base.service_cidrs,
                node_port_addresses=base.node_port_addresses,
                local_detector=base.local_detector,
                ports_by_service={s: set(n) for s, n in view.ports.items()},
            )

    def service(self, service: NamespacedName) -> dict[str, Any]:
        """One Service as the daemon holds it, per family and port (plain data)."""
        out: dict[str, Any] = {"service": str(service), "families": {}}
        with self._lock:
            for family, view in sorted(self._views.items(), key=lambda i: str(i[0])):
                names = sorted(view.ports.get(service, ()), key=str)
                if not names:
                    continue
                out["families"][str(family)] = [
                    _port_json(view.services[n], view.endpoints.get(n, ()), view.categorized.get(n))
                    for n in names
                ]
        return out

    def services(self) -> dict[str, Any]:
        """Every Service the daemon holds, with its port count per family."""
        with self._lock:
            counts: dict[str, dict[str, int]] = {}
            for family, view in self._views.items():
                for service, names in view.ports.items():
                    counts.setdefault(str(service), {})[str(family)] = len(names)
        return {"services": dict(sorted(counts.items()))}

    def plans(self) -> dict[str, dict[str, Any]]:
        """The last successful sync's plan per family."""
        with self._lock:
            plans = sorted(self._plans.items(), key=lambda i: str(i[0]))
            return {str(family): dict(plan) for family, plan in plans}

    def syncs(self) -> dict[str, list[dict[str, Any]]]:
        """The last syncs per family, newest first."""
        with self._lock:
            return {
                str(family): [_sync_json(r) for r in records]
                for family, records in sorted(self._syncs.items(), key=lambda i: str(i[0]))
            }


def _endpoint(endpoint: Endpoint) -> str:
    return endpoint.key


def _port_json(
    port: ServicePort, endpoints: Endpoints, categorized: CategorizedEndpoints | None
) -> dict[str, Any]:
    data: dict[str, Any] = {
        "port": str(port.name),
        "cluster_ip": str(port.cluster_ip),
        "port_number": port.port,
        "protocol": str(port.protocol),
        "node_port": port.node_port or None,
        "external_ips": [str(ip) for ip in port.external_ips],
        "load_balancer_ips": [str(ip) for ip in port.load_balancer_vips],
        "load_balancer_source_ranges": [str(n) for n in port.load_balancer_source_ranges],
        "session_affinity_seconds": port.session_affinity_seconds or None,
        "internal_traffic_policy": "Local" if port.internal_policy_local else "Cluster",
        "external_traffic_policy": "Local" if port.external_policy_local else "Cluster",
        "health_check_node_port": port.health_check_node_port or None,
        "endpoints": [_endpoint(e) for e in endpoints],
    }
    if categorized is not None:
        data["cluster_endpoints"] = [_endpoint(e) for e in categorized.cluster]
        data["local_endpoints"] = [_endpoint(e) for e in categorized.local]
        data["has_usable_endpoints"] = categorized.has_any
    return data


def _sync_json(record: SyncRecord) -> dict[str, Any]:
    return {
        "ended": utc_text(record.ended),
        "full": record.full,
        "duration_s": record.duration_s,
        "service_ports": record.service_ports,
        "with_endpoints": record.with_endpoints,
        "error": record.error,
    }


ModePages = Callable[[DebugState, str | None], Mapping[str, Route]]
"""A mode's own ``/debug/`` pages, given the state and the daemon's network namespace
(None: this one)."""


def core_pages(state: DebugState, more: Mapping[str, Route] | None = None) -> dict[str, Route]:
    """The core's pages, the mode's (``more``) and the index of both."""
    pages: dict[str, Route] = {
        "/debug/syncs": lambda: json_page(state.syncs()),
        "/debug/plan": lambda: json_page(state.plans()),
        "/debug/repairs": lambda: json_page(state.repairs()),
        "/debug/services": QueryRoute(lambda query: _services(state, query)),
        **(more or {}),
    }
    index = "".join(f"{path}\n" for path in sorted(pages))
    pages["/debug/"] = lambda: text_page(index)
    return pages


def _services(state: DebugState, query: Mapping[str, str]) -> Response:
    if "service" not in query:
        return json_page(state.services())
    service = parse_service(query["service"])
    if service is None:
        return json_page({"error": "service must be NAMESPACE/NAME"}, 400)
    found = state.service(service)
    return json_page(found, 200 if found["families"] else 404)
