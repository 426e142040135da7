"""The stale-flow reconciler: after a sync, which UDP flows to delete, and deleting them.

Upstream's list-and-diff reconciler (kube-proxy 1.32+, ``pkg/proxy/conntrack``) with the
1.37 change: list the family's UDP flows and delete those whose original destination is
a Service frontend and whose reply source ``IP:port`` is not a *serving* endpoint of that
port (:func:`find_stale_flows`, a pure function; :class:`ConntrackReconciler` runs it over
an executor and records the round). The rules are explained in :mod:`kubeproxy.conntrack`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Protocol

from kubeproxy.conntrack.flows import ConntrackExecutor, Flow
from kubeproxy.objects import Endpoint, IPAddress, IPFamily, ServicePort, ServicePortName
from kubeproxy.objects import Protocol as L4Protocol

if TYPE_CHECKING:
    from kubeproxy.backend import ProxySnapshot, SyncChanges
    from kubeproxy.proxier import Proxier

__all__ = ["ConntrackMetrics", "ConntrackReconciler", "find_stale_flows", "udp_frontends"]

# All of conntrack logs under one name, as it did when it was one module.
logger = logging.getLogger("kubeproxy.conntrack")


class ConntrackMetrics(Protocol):
    """Records reconciliations (``kubeproxy_conntrack_reconciler_*``)."""

    def conntrack_reconciled(self, family: IPFamily, seconds: float, deleted: int) -> None:
        """One reconciliation of ``family`` took ``seconds`` and deleted ``deleted`` flows."""
        ...


_Backend = tuple[IPAddress, int]
_Frontends = tuple[
    Mapping[tuple[IPAddress, int], AbstractSet[ServicePortName]],
    Mapping[int, AbstractSet[ServicePortName]],
]


def udp_frontends(services: Mapping[ServicePortName, ServicePort]) -> _Frontends:
    """The UDP ports answering at each (address, port) frontend and at each NodePort,
    built from every port of ``services`` (the proxier keeps the same index up to date:
    :meth:`~kubeproxy.proxier.Proxier.udp_frontends`)."""
    by_frontend: dict[tuple[IPAddress, int], set[ServicePortName]] = {}
    by_node_port: dict[int, set[ServicePortName]] = {}
    for name, port in services.items():
        if port.protocol is not L4Protocol.UDP:
            continue
        for address in (port.cluster_ip, *port.load_balancer_vips, *port.external_ips):
            by_frontend.setdefault((address, port.port), set()).add(name)
        if port.node_port:
            by_node_port.setdefault(port.node_port, set()).add(name)
    return by_frontend, by_node_port


def find_stale_flows(
    services: Mapping[ServicePortName, ServicePort],
    endpoints: Mapping[ServicePortName, Sequence[Endpoint]],
    flows: Iterable[Flow],
    frontends: _Frontends | None = None,
) -> list[Flow]:
    """The flows to delete: frontends of UDP Service ports answered by a non-serving backend.

    A frontend is ``clusterIP:port``, ``externalIP:port``, ``loadBalancerVIP:port``, or
    the NodePort on any address. Frontends shared by several ports (an external IP used
    by two Services) accept the serving endpoints of all of them.

    ``frontends`` is the index of UDP frontends (:func:`udp_frontends`); given, the work
    follows the flows listed and the endpoints of the Services they reach, not the
    number of Services (without it the index is built from ``services`` first).
    """
    by_frontend, by_node_port = frontends if frontends is not None else udp_frontends(services)
    serving: dict[ServicePortName, set[_Backend]] = {}
    allowed_at: dict[object, set[_Backend]] = {}

    def allowed(key: object, names: AbstractSet[ServicePortName]) -> set[_Backend]:
        found = allowed_at.get(key)
        if found is None:
            found = allowed_at[key] = set()
            for name in names:
                backends = serving.get(name)
                if backends is None:
                    backends = serving[name] = {
                        (e.ip, e.port) for e in endpoints.get(name, ()) if e.serving
                    }
                found |= backends
        return found

    stale: list[Flow] = []
    for flow in flows:
        reply = (flow.reply_src, flow.reply_src_port)
        frontend = (flow.orig_dst, flow.orig_dst_port)
        names = by_frontend.get(frontend)
        if names and reply not in allowed(frontend, names):
            stale.append(flow)
            continue
        names = by_node_port.get(flow.orig_dst_port)
        if names and reply not in allowed(flow.orig_dst_port, names):
            stale.append(flow)
    return stale


class ConntrackReconciler:
    """Deletes stale UDP flows after syncs (upstream's list-and-diff reconciler, 1.37).

    Give it to :class:`~kubeproxy.proxier.Proxier` as ``conntrack=``: the proxier calls
    it after a successful sync whose changes say ``conntrack_cleanup_required``. Never
    raises: failures are logged (a listing failure skips the round, as upstream).
    """

    def __init__(
        self,
        executor: ConntrackExecutor,
        metrics: ConntrackMetrics | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.executor = executor
        self.metrics = metrics
        self.clock = clock

    def __call__(self, proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """The :class:`~kubeproxy.proxier.SyncHook` form of :meth:`reconcile`, over the
        proxier's own index of UDP frontends (no pass over every Service)."""
        self.reconcile(
            snapshot.family, snapshot.services, snapshot.endpoints, proxier.udp_frontends()
        )

    def reconcile(
        self,
        family: IPFamily,
        services: Mapping[ServicePortName, ServicePort],
        endpoints: Mapping[ServicePortName, Sequence[Endpoint]],
        frontends: _Frontends | None = None,
    ) -> int:
        """Delete the stale UDP flows of ``family``; return how many were deleted.

        ``frontends``: the index of UDP frontends, if the caller keeps one
        (:func:`find_stale_flows`)."""
        start = self.clock()
        try:
            flows = self.executor.list_udp(family)
        except OSError as err:
            logger.error(
                "Cannot list %s conntrack entries; not cleaning stale flows: %s", family, err
            )
            return 0
        stale = find_stale_flows(services, endpoints, flows, frontends)
        deleted = 0
        if stale:
            try:
                deleted = self.executor.delete(stale)
            except OSError as err:
                logger.error(
                    "Cannot delete %d stale %s conntrack entries: %s", len(stale), family, err
                )
        elapsed = self.clock() - start
        logger.debug(
            "Reconciled %s conntrack entries: %d listed, %d stale, %d deleted in %.1f ms",
            family,
            len(flows),
            len(stale),
            deleted,
            elapsed * 1000,
        )
        if self.metrics is not None:
            try:
                self.metrics.conntrack_reconciled(family, elapsed, deleted)
            except Exception:
                logger.exception("conntrack metrics failed")
        return deleted
