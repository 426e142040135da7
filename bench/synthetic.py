"""Synthetic clusters for the benchmarks: N Services x E endpoints, deterministic.

One :class:`SyntheticService` describes a single-port TCP ClusterIP Service and its ready
endpoints. The same descriptions feed both sides of a comparison: our proxy gets them as
Kubernetes JSON dicts (:meth:`SyntheticService.service_dict`,
:meth:`SyntheticService.slice_dicts`), the upstream-structure generator
(:mod:`bench.upstream_structure`) reads them directly.

Address plan (IPv4, no overlap between the ranges):

* ClusterIPs: ``10.96.0.0/12`` (the service CIDR), Service ``i`` gets ``10.96.0.1 + i``;
* endpoints of ordinary Services (at most 15 each): ``10.128.0.0/10``, 16 addresses per
  Service index;
* endpoints of wide Services (more than 15): ``10.192.0.0/10``, 4096 addresses per slot;
* both endpoint ranges sit in the pod CIDR ``10.128.0.0/9`` (inside ``10.0.0.0/8``), which
  the data-plane topology routes to one endpoint namespace as local addresses;
* the realistic mix (:func:`realistic_services`) adds load-balancer IPs in
  ``198.18.0.0/15``, external IPs in ``100.64.0.0/10``, and for its IPv6 and dual-stack
  Services ClusterIPs in ``fd00:96::/108``, endpoints in ``fd00:128::/64`` (narrow) and
  ``fd00:192::/64`` (wide), load-balancer IPs in ``2001:db8:18::/64``.
"""

from __future__ import annotations

import ipaddress
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

__all__ = [
    "CLUSTER_PORT",
    "MAX_SERVICES",
    "NODE_IP",
    "NODE_IP6",
    "NODE_NAME",
    "POD_CIDR",
    "POD_CIDR6",
    "SERVICE_CIDR",
    "SERVICE_CIDR6",
    "TARGET_PORT",
    "EndpointSwaps",
    "SyntheticService",
    "all_slice_dicts",
    "build_services",
    "endpoint_ips",
    "exposed_services",
    "mixed_services",
    "realistic_service",
    "realistic_services",
    "service_ip",
    "synthetic_service",
]

SERVICE_CIDR = ipaddress.IPv4Network("10.96.0.0/12")
SERVICE_CIDR6 = ipaddress.IPv6Network("fd00:96::/108")
POD_CIDR = ipaddress.IPv4Network("10.128.0.0/9")
POD_CIDR6 = ipaddress.IPv6Network("fd00:128::/56")
_NARROW_POOL6 = ipaddress.IPv6Network("fd00:128::/64")
_WIDE_POOL6 = ipaddress.IPv6Network("fd00:128:0:1::/64")
_LB_POOL = ipaddress.IPv4Network("198.18.0.0/15")
_LB_POOL6 = ipaddress.IPv6Network("2001:db8:18::/64")
_EXTERNAL_POOL = ipaddress.IPv4Network("100.64.0.0/10")
_SOURCE_RANGES = ["203.0.113.0/24", "198.51.100.0/24"]
_NODE_PORTS = range(30000, 32700)
_NARROW_POOL = ipaddress.IPv4Network("10.128.0.0/10")
_WIDE_POOL = ipaddress.IPv4Network("10.192.0.0/10")
_NARROW_STRIDE = 16
_WIDE_STRIDE = 4096
MAX_SERVICES = _NARROW_POOL.num_addresses // _NARROW_STRIDE
"""How many Service indexes the address plan holds (262144)."""

NODE_NAME = "kpxb-node"
"""The name of the node the benchmark proxy runs as; no endpoint lives on it."""
NODE_IP = ipaddress.IPv4Address("10.99.1.1")
"""The node's primary address (NodePorts would listen there; the data-plane topology's
node side of the link to the endpoints)."""
NODE_IP6 = ipaddress.IPv6Address("fd00:99:1::1")
"""The node's IPv6 address (the realistic mix's IPv6 NodePorts)."""

CLUSTER_PORT = 80
TARGET_PORT = 8080
_PORT_NAME = "http"
_SLICE_CAPACITY = 100  # the EndpointSlice controller's default maxEndpointsPerSlice
_OTHER_NODES = 8


def service_ip(index: int) -> ipaddress.IPv4Address:
    """The ClusterIP of Service ``index``."""
    if not 0 <= index < MAX_SERVICES:
        raise ValueError(f"service index {index} outside 0..{MAX_SERVICES - 1}")
    return SERVICE_CIDR.network_address + 1 + index


def endpoint_ips6(index: int, count: int) -> tuple[ipaddress.IPv6Address, ...]:
    """:func:`endpoint_ips`, in the IPv6 pools (the same layout)."""
    if count < _NARROW_STRIDE:
        base = _NARROW_POOL6.network_address + index * _NARROW_STRIDE + 1
    else:
        slots = _WIDE_POOL.num_addresses // _WIDE_STRIDE
        base = _WIDE_POOL6.network_address + (index % slots) * _WIDE_STRIDE + 1
    return tuple(base + k for k in range(count))


def endpoint_ips(index: int, count: int) -> tuple[ipaddress.IPv4Address, ...]:
    """The endpoint addresses of Service ``index`` with ``count`` endpoints.

    Up to 15 endpoints come from the Service's own 16-address block; more come from a
    4096-address slot of the wide pool chosen by ``index`` (so at most 1024 wide Services
    with distinct ``index % 1024`` can coexist, each with at most 4095 endpoints).
    """
    if count < 0:
        raise ValueError("endpoint count must not be negative")
    if count < _NARROW_STRIDE:
        base = _NARROW_POOL.network_address + index * _NARROW_STRIDE + 1
    elif count < _WIDE_STRIDE:
        slots = _WIDE_POOL.num_addresses // _WIDE_STRIDE
        base = _WIDE_POOL.network_address + (index % slots) * _WIDE_STRIDE + 1
    else:
        raise ValueError(f"at most {_WIDE_STRIDE - 1} endpoints per Service")
    return tuple(base + k for k in range(count))


# Constant parts of the dicts, one object each, shared by every Service and slice. The
# proxy never mutates what it is fed (kubeproxy/parse.py and the change trackers only read
# it and build their own objects), and the dicts stay plain dicts and lists, equal to
# unshared ones: sharing changes the benchmark's own memory (about half of the synthetic
# input at 100k Services), not what the proxy receives.
_NAMESPACES = tuple(f"ns{k}" for k in range(64))
_NODE_NAMES = tuple(f"node-{k}" for k in range(_OTHER_NODES))
_READY = {"ready": True, "serving": True, "terminating": False}
_IP_FAMILIES = ["IPv4"]
_FAMILY_LISTS = {"IPv4": _IP_FAMILIES, "IPv6": ["IPv6"], "dual": ["IPv4", "IPv6"]}
_MANAGED_BY = "endpointslice-controller.k8s.io"


@cache
def _service_ports(name: str, port: int, protocol: str, target_port: int) -> list[dict[str, Any]]:
    return [{"name": name, "port": port, "protocol": protocol, "targetPort": target_port}]


def _node_port_ports(
    name: str, port: int, protocol: str, target_port: int, node_port: int
) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "port": port,
            "protocol": protocol,
            "targetPort": target_port,
            "nodePort": node_port,
        }
    ]


@cache
def _slice_ports(name: str, port: int, protocol: str) -> list[dict[str, Any]]:
    return [{"name": name, "port": port, "protocol": protocol}]


@cache
def _affinity_config(seconds: int) -> dict[str, Any]:
    return {"clientIP": {"timeoutSeconds": seconds}}


@dataclass(frozen=True, slots=True)
class SyntheticService:
    """One single-port TCP ClusterIP Service with its ready endpoints.

    Only the index, the endpoint count and the affinity are stored: names, addresses and
    the endpoint list are computed on demand (:attr:`endpoints`), so 100k of these take a
    few MB instead of the 120 MB that stored tuples of addresses took.
    ``affinity_seconds`` is the ClientIP session-affinity timeout, 0 for none;
    ``explicit_endpoints`` replaces the computed list (:meth:`with_endpoints`).

    The realistic mix's shapes: ``service_type`` (``ClusterIP``, ``NodePort``,
    ``LoadBalancer``; ``node_port`` 0 for a LoadBalancer without one), the traffic
    policies, ``source_ranges`` (a LoadBalancer's), ``external_ip``, ``family``
    (``IPv4``, ``IPv6`` or ``dual``) and ``local_endpoints`` (how many of the endpoints,
    the first ones, run on this node).
    """

    index: int
    endpoint_count: int
    affinity_seconds: int = 0
    explicit_endpoints: tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...] | None = None
    port: int = CLUSTER_PORT
    target_port: int = TARGET_PORT
    port_name: str = _PORT_NAME
    protocol: str = "TCP"
    service_type: str = "ClusterIP"
    node_port: int = 0
    external_local: bool = False
    internal_local: bool = False
    source_ranges: bool = False
    external_ip: bool = False
    family: str = "IPv4"
    local_endpoints: int = 0

    @property
    def namespace(self) -> str:
        """``ns<index % 64>``."""
        return _NAMESPACES[self.index % len(_NAMESPACES)]

    @property
    def name(self) -> str:
        """``svc-<index>``."""
        return f"svc-{self.index}"

    @property
    def cluster_ip(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        """The ClusterIP of the primary family (:func:`service_ip`)."""
        if self.family == "IPv6":
            return SERVICE_CIDR6.network_address + 1 + self.index
        return service_ip(self.index)

    @property
    def cluster_ips(self) -> list[str]:
        """Every ClusterIP (both families for a dual-stack Service)."""
        ips = [str(self.cluster_ip)]
        if self.family == "dual":
            ips.append(str(SERVICE_CIDR6.network_address + 1 + self.index))
        return ips

    @property
    def endpoints(self) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...]:
        """The endpoint addresses of the primary family (:func:`endpoint_ips`, or the
        explicit ones)."""
        if self.explicit_endpoints is not None:
            return self.explicit_endpoints
        if self.family == "IPv6":
            return endpoint_ips6(self.index, self.endpoint_count)
        return endpoint_ips(self.index, self.endpoint_count)

    @property
    def load_balancer_ips(self) -> list[str]:
        """The ingress IPs of a LoadBalancer (both families for a dual-stack one)."""
        if self.service_type != "LoadBalancer":
            return []
        ips = []
        if self.family != "IPv6":
            ips.append(str(_LB_POOL.network_address + 1 + self.index))
        if self.family != "IPv4":
            ips.append(str(_LB_POOL6.network_address + 1 + self.index))
        return ips

    def frontends4(self) -> int:
        """How many IPv4 Service-IP frontends (``ip . proto . port``) the Service has."""
        if self.family == "IPv6":
            return 0
        lb = 1 if self.service_type == "LoadBalancer" else 0
        return 1 + lb + (1 if self.external_ip else 0)

    def with_endpoints(
        self, endpoints: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address]
    ) -> SyntheticService:
        """This Service with another endpoint list (an endpoint change)."""
        return replace(self, endpoint_count=len(endpoints), explicit_endpoints=tuple(endpoints))

    @property
    def port_identity(self) -> str:
        """``namespace/name/protocol/portName``: the string upstream hashes for chain names."""
        return f"{self.namespace}/{self.name}/{self.protocol.lower()}/{self.port_name}"

    @property
    def port_label(self) -> str:
        """``namespace/name:portName``, how upstream prints the Service port."""
        return f"{self.namespace}/{self.name}:{self.port_name}"

    def service_dict(self) -> dict[str, Any]:
        """The Service as the API server would return it (JSON form)."""
        name, cluster_ips = self.name, self.cluster_ips
        if self.node_port:
            ports = _node_port_ports(
                self.port_name, self.port, self.protocol, self.target_port, self.node_port
            )
        else:
            ports = _service_ports(self.port_name, self.port, self.protocol, self.target_port)
        spec: dict[str, Any] = {
            "type": self.service_type,
            "clusterIP": cluster_ips[0],
            "clusterIPs": cluster_ips,
            "ipFamilies": _FAMILY_LISTS[self.family],
            "ipFamilyPolicy": "RequireDualStack" if self.family == "dual" else "SingleStack",
            "internalTrafficPolicy": "Local" if self.internal_local else "Cluster",
            "ports": ports,
            "selector": {"app": name},
            "sessionAffinity": "ClientIP" if self.affinity_seconds else "None",
        }
        if self.affinity_seconds:
            spec["sessionAffinityConfig"] = _affinity_config(self.affinity_seconds)
        if self.service_type != "ClusterIP" or self.external_ip:
            spec["externalTrafficPolicy"] = "Local" if self.external_local else "Cluster"
        if self.external_ip:
            spec["externalIPs"] = [str(_EXTERNAL_POOL.network_address + 1 + self.index)]
        service: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "uid": f"00000000-0000-4000-8000-{self.index:012d}",
                "resourceVersion": "1",
            },
            "spec": spec,
        }
        if self.service_type == "LoadBalancer":
            if not self.node_port:
                spec["allocateLoadBalancerNodePorts"] = False
            if self.source_ranges:
                spec["loadBalancerSourceRanges"] = _SOURCE_RANGES
            service["status"] = {
                "loadBalancer": {"ingress": [{"ip": ip} for ip in self.load_balancer_ips]}
            }
        return service

    def slice_dicts(
        self,
        endpoints: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address] | None = None,
        generation: int = 1,
    ) -> list[dict[str, Any]]:
        """The Service's EndpointSlices (at most 100 endpoints each), JSON form.

        ``endpoints`` overrides the Service's own list (to build an update);
        ``generation`` goes into ``resourceVersion`` so updates differ from the original.
        """
        addresses = self.endpoints if endpoints is None else tuple(endpoints)
        slices = self._slices(addresses, "IPv6" if self.family == "IPv6" else "IPv4", generation)
        if self.family == "dual":
            second = endpoint_ips6(self.index, self.endpoint_count)
            slices += self._slices(second, "IPv6", generation, suffix="-v6")
        return slices

    def _slices(
        self,
        addresses: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address],
        address_type: str,
        generation: int,
        suffix: str = "",
    ) -> list[dict[str, Any]]:
        chunks = [
            addresses[start : start + _SLICE_CAPACITY]
            for start in range(0, len(addresses), _SLICE_CAPACITY)
        ] or [()]
        name, namespace, version = self.name, self.namespace, str(generation)
        ports = _slice_ports(self.port_name, self.target_port, self.protocol)
        local = self.local_endpoints
        return [
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{name}{suffix}-{number:05d}",
                    "namespace": namespace,
                    "labels": {
                        "kubernetes.io/service-name": name,
                        "endpointslice.kubernetes.io/managed-by": _MANAGED_BY,
                    },
                    "resourceVersion": version,
                },
                "addressType": address_type,
                "endpoints": [
                    {
                        "addresses": [str(ip)],
                        "conditions": _READY,
                        "nodeName": NODE_NAME
                        if number * _SLICE_CAPACITY + k < local
                        else _NODE_NAMES[int(ip) % _OTHER_NODES],
                    }
                    for k, ip in enumerate(chunk)
                ],
                "ports": ports,
            }
            for number, chunk in enumerate(chunks)
        ]


class EndpointSwaps:
    """Endpoint changes for the benchmarks: each swaps a Service's last endpoint for a
    spare address of its own 16-address block (past its endpoints), or back, and bumps its
    slices' generation. Remembers each changed Service's current endpoints."""

    SPARE_OFFSET = 14
    """Where the spare address sits in a Service's block (so at most 14 endpoints)."""

    def __init__(self) -> None:
        self._now: dict[int, tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...]] = {}
        self._generation: dict[int, int] = {}

    def swap(self, service: SyntheticService) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The slices of ``service`` before and after the swap; the new state is kept."""
        if len(service.endpoints) > self.SPARE_OFFSET:
            raise ValueError(f"{service.port_label}: no spare address for an endpoint change")
        current = self._now.get(service.index, service.endpoints)
        generation = self._generation.get(service.index, 1)
        spare = service.endpoints[0] + self.SPARE_OFFSET
        last = service.endpoints[-1] if current[-1] == spare else spare
        changed = (*current[:-1], last)
        old = service.slice_dicts(current, generation=generation)
        new = service.slice_dicts(changed, generation=generation + 1)
        self._now[service.index] = changed
        self._generation[service.index] = generation + 1
        return old, new

    def forget(self, service: SyntheticService) -> list[dict[str, Any]]:
        """The current slices of ``service`` (to delete them); its state is dropped."""
        return service.slice_dicts(
            self._now.pop(service.index, service.endpoints),
            generation=self._generation.pop(service.index, 1),
        )


def synthetic_service(
    index: int, endpoint_count: int, *, affinity_seconds: int = 0
) -> SyntheticService:
    """Service ``index`` with ``endpoint_count`` endpoints, named ``ns<index % 64>/svc-<index>``."""
    service_ip(index)  # raises when the index is outside the address plan
    if not 0 <= endpoint_count < _WIDE_STRIDE:
        raise ValueError(f"endpoint count {endpoint_count} outside 0..{_WIDE_STRIDE - 1}")
    return SyntheticService(index, endpoint_count, affinity_seconds)


def build_services(
    count: int, endpoints_per_service: int, *, first_index: int = 0, affinity_seconds: int = 0
) -> list[SyntheticService]:
    """``count`` Services with consecutive indexes from ``first_index``."""
    return [
        synthetic_service(index, endpoints_per_service, affinity_seconds=affinity_seconds)
        for index in range(first_index, first_index + count)
    ]


def mixed_services(
    count: int,
    endpoints_per_service: int,
    *,
    wide_every: int = 100,
    wide_endpoints: int = 250,
    affinity_seconds: int = 0,
) -> list[SyntheticService]:
    """``count`` Services, every ``wide_every``-th (from index 0) with ``wide_endpoints``.

    The "250-endpoint mix": mostly small Services and a few large ones, as real clusters
    have. Wide Services share the wide pool's 1024 slots by ``index % 1024``, so two of
    them may get the same endpoint addresses beyond 1024 wide Services (harmless for the
    rules: each Service still has its own chains).
    """
    if wide_every < 1:
        raise ValueError("wide_every must be at least 1")
    return [
        synthetic_service(
            index,
            wide_endpoints if index % wide_every == 0 else endpoints_per_service,
            affinity_seconds=affinity_seconds,
        )
        for index in range(count)
    ]


def exposed_services(
    count: int, endpoints_per_service: int, *, affinity_seconds: int = 0
) -> list[SyntheticService]:
    """``count`` Services of ``endpoints_per_service`` endpoints, every one reachable
    beyond its cluster IP, one in ten IPv6: the shapes whose ClientIP affinity the maps
    keyed by the cluster-IP frontend do not cover (issue 32 item 3).

    By index: ``% 4 == 0`` a NodePort Service, ``1`` a LoadBalancer with a NodePort,
    ``2`` a ClusterIP with an external IP (IPv6: a NodePort Service), ``3`` a
    LoadBalancer without NodePorts; ``% 10 == 9`` IPv6. NodePorts are handed out until
    the 30000-32699 range runs out (2700: at 10k and beyond, later Services of the first
    two shapes are LoadBalancers without one), so at scale most ports are reached through
    a load-balancer or external IP besides their cluster IP. Every policy Cluster.
    """
    node_ports = iter(_NODE_PORTS)
    services = []
    for index in range(count):
        shape = index % 4
        family = "IPv6" if index % 10 == 9 else "IPv4"
        external_ip = shape == 2 and family == "IPv4"
        service_type = "NodePort" if shape in (0, 2) else "LoadBalancer"
        if external_ip:
            service_type = "ClusterIP"
        node_port = 0
        if shape != 3 and not external_ip:
            node_port = next(node_ports, 0)
            if not node_port:
                service_type = "LoadBalancer"
        services.append(
            SyntheticService(
                index,
                endpoints_per_service,
                affinity_seconds=affinity_seconds,
                service_type=service_type,
                node_port=node_port,
                external_ip=external_ip,
                family=family,
            )
        )
    return services


def all_slice_dicts(services: Sequence[SyntheticService]) -> Iterator[dict[str, Any]]:
    """Every EndpointSlice of ``services``, in order."""
    for service in services:
        yield from service.slice_dicts()


REALISTIC_SEED = 19
"""The seed of the benchmarks' realistic mix (every run builds the same cluster)."""


def _endpoint_count(rng: random.Random) -> int:
    """Heavy-tailed: most Services have 1-3 endpoints, a Pareto tail reaches 1000."""
    draw = rng.random()
    if draw < 0.30:
        return 1
    if draw < 0.52:
        return 2
    if draw < 0.65:
        return 3
    return min(1000, int(4 / (1.0 - rng.random())))


def realistic_service(
    index: int, rng: random.Random, node_ports: Iterator[int]
) -> SyntheticService:
    """One Service of the realistic mix, drawn from ``rng`` (see
    :func:`realistic_services`); ``node_ports`` hands out NodePorts until it runs out."""
    count = _endpoint_count(rng)
    draw = rng.random()
    service_type = "ClusterIP"
    if draw < 0.08:
        service_type = "LoadBalancer"
    elif draw < 0.12:
        service_type = "NodePort"
    external_ip = service_type == "ClusterIP" and rng.random() < 0.02
    node_port = 0
    if service_type != "ClusterIP":
        node_port = next(node_ports, 0)
        if not node_port and service_type == "NodePort":
            service_type = "LoadBalancer"  # no NodePort left: a LoadBalancer without one
    external = service_type != "ClusterIP" or external_ip
    external_local = external and rng.random() < 0.30
    internal_local = rng.random() < 0.02
    family = rng.choices(("IPv4", "IPv6", "dual"), (0.85, 0.10, 0.05))[0]
    local = 0
    if external_local or internal_local:
        local = min(count, rng.choice((0, 1, 1, 2)))
    return SyntheticService(
        index,
        count,
        affinity_seconds=10800 if rng.random() < 0.03 else 0,
        service_type=service_type,
        node_port=node_port,
        external_local=external_local,
        internal_local=internal_local,
        source_ranges=service_type == "LoadBalancer" and rng.random() < 0.20,
        external_ip=external_ip,
        family=family,
        local_endpoints=local,
    )


def realistic_services(count: int, seed: int = REALISTIC_SEED) -> list[SyntheticService]:
    """``count`` Services shaped like a real cluster's (issue 19), deterministic by ``seed``.

    Endpoint counts are heavy-tailed (30 % one endpoint, 22 % two, 13 % three, the rest
    a Pareto tail from 4 to 1000: several hundred distinct counts at 30k Services); 8 %
    are LoadBalancers (a fifth with source ranges) and 4 % NodePorts, with NodePorts
    until the 30000-32699 range runs out (later LoadBalancers have none); 30 % of those
    and of the ClusterIPs with an external IP (2 %) have ``externalTrafficPolicy:
    Local``, 2 % ``internalTrafficPolicy: Local``, with 0-2 endpoints on this node; 3 %
    ClientIP affinity; 85 % IPv4, 10 % IPv6 and 5 % dual-stack.
    """
    rng = random.Random(seed)
    node_ports = iter(_NODE_PORTS)
    return [realistic_service(index, rng, node_ports) for index in range(count)]
