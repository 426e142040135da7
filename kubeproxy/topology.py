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

from kubeproxy.objects import CategorizedEndpoints, Endpoint, ServicePort

__all__ = ["TopologyMode", "categorize_endpoints", "topology_mode"]

logger = logging.getLogger(__name__)

_NOTHING = CategorizedEndpoints()


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


def _key(endpoint: Endpoint) -> str:
    return endpoint.key


def categorize_endpoints(
    endpoints: Sequence[Endpoint], service: ServicePort, node_name: str, zone: str
) -> CategorizedEndpoints:
    """Split a port's endpoints by traffic policy and topology.

    ``endpoints`` are the port's merged endpoints, sorted by key (as
    :class:`~kubeproxy.endpointchanges.EndpointsMap` holds them); ``cluster`` and
    ``local`` keep that order, and ``all_reachable`` is sorted by key.
    """
    if not endpoints:
        return _NOTHING
    uses_cluster = service.uses_cluster_endpoints
    mode = TopologyMode.NONE
    cluster: tuple[Endpoint, ...] = ()
    has_any = False
    if uses_cluster:
        mode = topology_mode(endpoints, node_name, zone)
        if mode is TopologyMode.NONE:
            cluster = tuple(e for e in endpoints if e.ready)
            if len(cluster) == len(endpoints) and isinstance(endpoints, tuple):
                cluster = endpoints  # share the common all-ready tuple
        elif mode is TopologyMode.PREFER_SAME_NODE:
            cluster = tuple(e for e in endpoints if e.ready and node_name in e.node_hints)
        else:
            cluster = tuple(e for e in endpoints if e.ready and zone in e.zone_hints)
        if not cluster:
            # Best effort to keep connections alive during a rollout: topology does
            # not apply here.
            cluster = tuple(e for e in endpoints if e.serving and e.terminating)
        has_any = bool(cluster)

    if not service.uses_local_endpoints:
        return CategorizedEndpoints(cluster, (), cluster, has_any)

    local_ready: list[Endpoint] = []
    local_terminating: list[Endpoint] = []
    for endpoint in endpoints:
        if endpoint.ready:
            has_any = True
            if endpoint.is_local:
                local_ready.append(endpoint)
        elif endpoint.serving and endpoint.terminating:
            has_any = True
            if endpoint.is_local:
                local_terminating.append(endpoint)
    local_fallback = not local_ready and bool(local_terminating)
    local = tuple(local_terminating if local_fallback else local_ready)

    if not uses_cluster:
        return CategorizedEndpoints((), local, local, has_any)
    if mode is TopologyMode.NONE and not local_fallback:
        # Cluster holds every ready endpoint, local only ready ones: a superset.
        return CategorizedEndpoints(cluster, local, cluster, has_any)
    union = {e.key: e for e in cluster}
    for endpoint in local:
        union.setdefault(endpoint.key, endpoint)
    reachable = tuple(sorted(union.values(), key=_key))
    return CategorizedEndpoints(cluster, local, reachable, has_any)
