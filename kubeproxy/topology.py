"""Which endpoints serve a Service port on this node: traffic policy, topology, fallback.

The core computes this once per changed Service port and hands the result to every
backend (:class:`~kubeproxy.objects.CategorizedEndpoints`). Semantics are upstream's
``CategorizeEndpoints``: topology comes from the EndpointSlice hints alone (the
EndpointSlice controller writes them for ``trafficDistribution`` and topology-aware
routing); when no ready endpoint is usable, serving-and-terminating endpoints take over,
ignoring topology.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from enum import Enum

from kubeproxy.objects import (
    IS_LOCAL,
    LOCAL_READY_MARKS,
    READY,
    SERVING,
    TERMINATING,
    CategorizedEndpoints,
    Endpoint,
    EndpointRows,
    Endpoints,
    ServicePort,
    flag_marks,
)

__all__ = ["TopologyMode", "categorize_endpoints", "topology_mode"]

logger = logging.getLogger(__name__)

_NOTHING = CategorizedEndpoints()
_NO_ROWS = EndpointRows.of(())


class TopologyMode(Enum):
    """How the hints restrict the cluster-wide endpoints."""

    NONE = ""
    PREFER_SAME_NODE = "PreferSameNode"
    PREFER_SAME_ZONE = "PreferSameZone"


def topology_mode(endpoints: Sequence[Endpoint], node_name: str, zone: str) -> TopologyMode:
    """The topology mode the hints of the *ready* endpoints allow.

    PreferSameNode when every ready endpoint has node hints and one names this node;
    else PreferSameZone when every ready endpoint has zone hints and one names this
    node's zone; else none (also when no endpoint is ready).
    """
    all_node_hints = all_zone_hints = True
    node_hit = zone_hit = False
    for endpoint in endpoints:
        if not endpoint.ready:
            continue
        node_hints = endpoint.node_hints
        if not node_hints:
            all_node_hints = False
        elif node_name in node_hints:
            node_hit = True
        zone_hints = endpoint.zone_hints
        if not zone_hints:
            all_zone_hints = False
            if not all_node_hints:
                # The common case (no hints at all) ends at the first ready endpoint.
                return TopologyMode.NONE
        elif zone in zone_hints:
            zone_hit = True
    if all_node_hints and node_hit:
        return TopologyMode.PREFER_SAME_NODE
    if all_zone_hints and zone_hit:
        return TopologyMode.PREFER_SAME_ZONE
    return TopologyMode.NONE


_READY_MARKS = flag_marks(lambda bits: bits & READY)
_FALLBACK_MARKS = flag_marks(
    lambda bits: bits & SERVING and bits & TERMINATING
)  # serving and terminating: the fallback of a list without ready endpoints
_USABLE_MARKS = flag_marks(lambda bits: bits & READY or (bits & SERVING and bits & TERMINATING))
_LOCAL_FALLBACK_MARKS = flag_marks(
    lambda bits: bits & IS_LOCAL and not bits & READY and bits & SERVING and bits & TERMINATING
)


def _marked(rows: EndpointRows, table: bytes) -> EndpointRows:
    """The rows whose flags ``table`` maps to 1 (the rows themselves when all are)."""
    marks = rows.flags.translate(table)
    if 0 not in marks:
        return rows
    return rows.take([i for i, mark in enumerate(marks) if mark])


def categorize_endpoints(
    endpoints: Endpoints, service: ServicePort, node_name: str, zone: str
) -> CategorizedEndpoints:
    """Split a port's endpoints by traffic policy and topology.

    ``endpoints`` are the port's merged endpoints, sorted by key (as
    :class:`~kubeproxy.endpointchanges.EndpointsMap` holds them); ``cluster`` and
    ``local`` keep that order, and ``all_reachable`` is sorted by key. The lists are
    :class:`~kubeproxy.objects.EndpointRows`, chosen by their flags a whole list at a
    time (a byte translation per list, no object per endpoint) when no topology hint
    applies; the PreferSameNode and PreferSameZone modes and the local union read the
    endpoints one by one (hints are rare, and their lists short).
    """
    if not endpoints:
        return _NOTHING
    rows = EndpointRows.of(endpoints)
    flags = rows.flags
    uses_cluster = service.uses_cluster_endpoints
    mode = TopologyMode.NONE
    cluster = _NO_ROWS
    if uses_cluster:
        if rows.hints is not None:  # without hints the mode is NONE
            mode = topology_mode(rows, node_name, zone)
        if mode is TopologyMode.NONE:
            cluster = _marked(rows, _READY_MARKS)
        elif mode is TopologyMode.PREFER_SAME_NODE:
            cluster = rows.take(
                [i for i, e in enumerate(rows) if e.ready and node_name in e.node_hints]
            )
        else:
            cluster = rows.take([i for i, e in enumerate(rows) if e.ready and zone in e.zone_hints])
        if not cluster:
            # Best effort to keep connections alive during a rollout: topology does
            # not apply here.
            cluster = _marked(rows, _FALLBACK_MARKS)
    has_any = bool(cluster)

    if not service.uses_local_endpoints:
        return CategorizedEndpoints(cluster, _NO_ROWS, cluster, has_any)

    has_any = has_any or 1 in flags.translate(_USABLE_MARKS)
    local = _marked(rows, LOCAL_READY_MARKS)
    local_fallback = not local and 1 in flags.translate(_LOCAL_FALLBACK_MARKS)
    if local_fallback:
        local = _marked(rows, _LOCAL_FALLBACK_MARKS)

    if not uses_cluster:
        return CategorizedEndpoints(_NO_ROWS, local, local, has_any)
    if mode is TopologyMode.NONE and not local_fallback:
        # Cluster holds every ready endpoint, local only ready ones: a superset.
        return CategorizedEndpoints(cluster, local, cluster, has_any)
    union = {e.key: e for e in cluster}
    for endpoint in local:
        union.setdefault(endpoint.key, endpoint)
    return CategorizedEndpoints(cluster, local, EndpointRows.of(union.values()), has_any)
