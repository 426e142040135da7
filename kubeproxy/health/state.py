"""The proxy's own health state: :class:`ProxyHealth` and what it reports.

Per IP family, when the proxier last synced successfully and since when an un-synced
change has been waiting (upstream's ``pkg/proxy/healthcheck`` rules), the data-plane
faults reported beyond upstream, the node's eligibility, and the JSON body upstream's
health answers carry (:meth:`HealthStatus.to_json`, :func:`format_time`). Apart from the
servers: this is the state they answer from, with no socket in it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from kubeproxy.objects import IPFamily, NodeInfo

__all__ = [
    "FAULT_FIRST_SYNC",
    "FAULT_RULES_REMOVED",
    "FAULT_SYNC_FAILURES",
    "JSON_HEADERS",
    "DataPlaneFault",
    "FamilyHealth",
    "HealthStatus",
    "ProxyHealth",
    "format_time",
]

# All of health logs under one name, as it did when it was one module.
logger = logging.getLogger("kubeproxy.health")

FAULT_RULES_REMOVED: Final = "rules-removed"
"""The ``cause`` for :meth:`ProxyHealth.report_data_plane_broken` when rules the proxy
wrote were removed (or changed) by someone else and not yet repaired."""

FAULT_SYNC_FAILURES: Final = "sync-failures"
"""The ``cause`` :class:`HealthObserver` reports when syncs fail repeatedly."""

FAULT_FIRST_SYNC: Final = "first-sync"
"""The ``cause`` of :meth:`ProxyHealth.await_first_sync`: the rules are not written yet."""


JSON_HEADERS: Final = {"Content-Type": "application/json", "X-Content-Type-Options": "nosniff"}
"""The headers of every health answer, as upstream sends them."""


def format_time(moment: float | None) -> str:
    """A wall-clock time (unix seconds) as Go's JSON encoding writes a ``time.Time``.

    RFC 3339 in UTC with the fraction trimmed of trailing zeros (``RFC3339Nano``);
    ``None`` is Go's zero time, ``0001-01-01T00:00:00Z``.
    """
    if moment is None:
        return "0001-01-01T00:00:00Z"
    when = datetime.fromtimestamp(moment, UTC)
    text = when.strftime("%Y-%m-%dT%H:%M:%S")
    fraction = f"{when.microsecond:06d}".rstrip("0")
    if fraction:
        text += "." + fraction
    return text + "Z"


@dataclass(frozen=True, slots=True)
class FamilyHealth:
    """The health of one IP family's proxier (``status[family]`` in the JSON body)."""

    last_updated: float
    healthy: bool


@dataclass(frozen=True, slots=True)
class DataPlaneFault:
    """Something the kernel lacks of what the proxy last wrote, as reported.

    ``cause`` names the detector (:data:`FAULT_RULES_REMOVED`,
    :data:`FAULT_SYNC_FAILURES`, or a name of the caller's own); ``since`` is the
    wall-clock time of the first report since the last repair.
    """

    family: IPFamily
    cause: str
    reason: str
    since: float

    def describe(self) -> str:
        """``IPv4: <reason>``: one line for logs and the ``/healthz`` body."""
        return f"{self.family}: {self.reason}"


@dataclass(frozen=True, slots=True)
class HealthStatus:
    """What :meth:`ProxyHealth.health` found.

    ``last_updated`` is the latest successful sync of any family (None before the
    first); ``status`` has an entry per family that has synced at least once.
    ``healthy`` is upstream's verdict (no change has waited too long); ``faults`` are
    the data-plane faults reported now, which :attr:`serving` adds to it.
    """

    last_updated: float | None
    current_time: float
    healthy: bool
    status: Mapping[IPFamily, FamilyHealth] = field(default_factory=dict)
    faults: tuple[DataPlaneFault, ...] = ()

    @property
    def serving(self) -> bool:
        """Healthy and no data-plane fault: whether traffic sent here is delivered."""
        return self.healthy and not self.faults

    def to_json(
        self,
        *,
        last_updated: float | None,
        node_eligible: bool | None,
        with_faults: bool = False,
    ) -> str:
        """The compact JSON body upstream sends (keys in upstream's order).

        ``last_updated`` is the top-level value to report (upstream reports the current
        time on a 200); ``node_eligible`` is left out when None (``/livez``). With
        ``with_faults`` (``/healthz``) a fault makes ``healthy`` false (for its family
        too) and adds ``reason``: every fault's description, joined by ``"; "``. Without
        faults the body has exactly upstream's keys.
        """
        faulty = {fault.family for fault in self.faults} if with_faults else set()
        body: dict[str, Any] = {
            "lastUpdated": format_time(last_updated),
            "currentTime": format_time(self.current_time),
        }
        if node_eligible is not None:
            body["nodeEligible"] = node_eligible
        body["healthy"] = self.healthy and not faulty
        if self.status:
            body["status"] = {
                family.value: {
                    "lastUpdated": format_time(state.last_updated),
                    "healthy": state.healthy and family not in faulty,
                }
                for family, state in sorted(self.status.items())
            }
        if faulty:
            body["reason"] = "; ".join(fault.describe() for fault in self.faults)
        return json.dumps(body, separators=(",", ":"))


class ProxyHealth:
    """Per-family sync timestamps, data-plane faults and the node's eligibility;
    thread-safe.

    ``clock`` returns wall-clock seconds (it also stamps the reported times).
    ``node`` is the node as known at start; None means unknown, which makes the node
    ineligible (as upstream's newest code) until :meth:`set_node` is called.

    Data-plane faults (:meth:`report_data_plane_broken`) are for whoever learns that the
    kernel no longer holds what the proxy last wrote; each is kept per family and cause
    until that cause's :meth:`report_data_plane_repaired`.
    """

    def __init__(
        self,
        health_timeout: float,
        clock: Callable[[], float] = time.time,
        *,
        node: NodeInfo | None = None,
    ) -> None:
        if health_timeout <= 0:
            raise ValueError(f"health timeout must be positive, got {health_timeout}")
        self.health_timeout = health_timeout
        self.clock = clock
        self._lock = threading.Lock()
        self._last_updated: dict[IPFamily, float] = {}
        self._oldest_queued: dict[IPFamily, float] = {}
        self._faults: dict[tuple[IPFamily, str], DataPlaneFault] = {}
        self._node = node

    def queued_update(self, family: IPFamily) -> None:
        """A change for ``family`` is waiting for a sync (keeps the oldest such time)."""
        with self._lock:
            self._oldest_queued.setdefault(family, self.clock())

    def updated(self, family: IPFamily) -> None:
        """``family`` synced successfully: nothing is waiting any more."""
        with self._lock:
            self._oldest_queued.pop(family, None)
            self._last_updated[family] = self.clock()
            self._faults.pop((family, FAULT_FIRST_SYNC), None)

    def await_first_sync(self, families: Iterable[IPFamily]) -> None:
        """Until each of ``families`` has synced once (:meth:`updated`), hold the
        :data:`FAULT_FIRST_SYNC` fault for it: ``/healthz`` and the HealthCheckNodePorts
        answer 503 ("waiting for the first sync"), ``/livez`` 200. A proxy serving its
        health endpoints from the first second of a long start (100k Services) must not
        draw load-balancer traffic to a node whose rules are not written yet."""
        with self._lock:
            now = self.clock()
            for family in families:
                if family not in self._last_updated:
                    self._faults.setdefault(
                        (family, FAULT_FIRST_SYNC),
                        DataPlaneFault(family, FAULT_FIRST_SYNC, "waiting for the first sync", now),
                    )

    def report_data_plane_broken(self, family: IPFamily, cause: str, reason: str) -> None:
        """Report that the kernel no longer holds what the proxy last wrote for ``family``.

        From now until :meth:`report_data_plane_repaired` with the same ``family`` and
        ``cause``, ``/healthz`` answers 503 with ``reason`` in its JSON body (``healthy``
        false, ``reason`` "IPv4: <reason>") and every HealthCheckNodePort answers 503
        (``serviceProxyHealthy`` false), so load balancers stop sending traffic the node
        cannot deliver. ``/livez`` is not affected: restarting the proxy is not the
        repair, the proxy's own full sync is.

        ``cause`` names the detector: :data:`FAULT_RULES_REMOVED` for rules removed or
        changed by someone else, :data:`FAULT_SYNC_FAILURES` (reported by
        :class:`HealthObserver`) for repeated failed syncs, or any name of the caller's.
        Faults of different causes are independent: one detector's repair never clears
        another's fault. Reporting again updates the reason and keeps the first time;
        the first report of a fault logs one warning.
        """
        if not cause or not reason:
            raise ValueError("a data-plane fault needs a cause and a reason")
        with self._lock:
            previous = self._faults.get((family, cause))
            since = self.clock() if previous is None else previous.since
            self._faults[family, cause] = DataPlaneFault(family, cause, reason, since)
        if previous is None:
            logger.warning("Data plane broken (%s), /healthz fails: %s: %s", cause, family, reason)

    def report_data_plane_repaired(self, family: IPFamily, cause: str) -> None:
        """Clear the fault ``cause`` reported for ``family`` (nothing if none is set).

        Call it once the kernel holds what the proxy wrote again (after the repairing
        sync succeeded). Logs one line when a fault was set.
        """
        with self._lock:
            fault = self._faults.pop((family, cause), None)
            now = self.clock()
        if fault is not None:
            logger.info(
                "Data plane repaired (%s) for %s after %.1fs", cause, family, now - fault.since
            )

    def data_plane_faults(self) -> tuple[DataPlaneFault, ...]:
        """The faults reported and not repaired, oldest first."""
        with self._lock:
            return self._sorted_faults()

    def _sorted_faults(self) -> tuple[DataPlaneFault, ...]:
        return tuple(sorted(self._faults.values(), key=lambda f: (f.since, f.family, f.cause)))

    def set_node(self, node: NodeInfo | None) -> None:
        """The node as last seen (None: not known)."""
        with self._lock:
            self._node = node

    def node_eligible(self) -> bool:
        """False when the node is unknown, being deleted, or tainted for deletion."""
        with self._lock:
            node = self._node
        return node is not None and not node.deleting and not node.to_be_deleted_taint

    def health(self) -> HealthStatus:
        """The health now: unhealthy if a synced family has had a change waiting too long.

        Families that never synced do not count (the proxy is healthy while starting).
        """
        with self._lock:
            now = self.clock()
            status: dict[IPFamily, FamilyHealth] = {}
            healthy = True
            for family, last in self._last_updated.items():
                queued = self._oldest_queued.get(family)
                family_healthy = queued is None or now - queued < self.health_timeout
                healthy = healthy and family_healthy
                status[family] = FamilyHealth(last, family_healthy)
            last_updated = max(self._last_updated.values(), default=None)
            faults = self._sorted_faults()
        return HealthStatus(last_updated, now, healthy, status, faults)

    def healthy(self) -> bool:
        """Shorthand for ``health().healthy`` (upstream's verdict, faults aside)."""
        return self.health().healthy

    def serving(self) -> bool:
        """Shorthand for ``health().serving``: healthy and no data-plane fault."""
        return self.health().serving
