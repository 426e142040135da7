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
  the data-plane topology routes to one endpoint namespace as local addresses.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

__all__ = [
    "CLUSTER_PORT",
    "MAX_SERVICES",
    "NODE_IP",
    "NODE_NAME",
    "POD_CIDR",
    "SERVICE_CIDR",
    "TARGET_PORT",
    "EndpointSwaps",
    "SyntheticService",
    "all_slice_dicts",
    "build_services",
    "endpoint_ips",
    "mixed_services",
    "service_ip",
    "synthetic_service",
]

SERVICE_CIDR = ipaddress.IPv4Network("10.96.0.0/12")
POD_CIDR = ipaddress.IPv4Network("10.128.0.0/9")
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
_MANAGED_BY = "endpointslice-controller.k8s.io"


@cache
def _service_ports(name: str, port: int, protocol: str, target_port: int) -> list[dict[str, Any]]:
    return [{"name": name, "port": port, "protocol": protocol, "targetPort": target_port}]


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
    """

    index: int
    endpoint_count: int
    affinity_seconds: int = 0
    explicit_endpoints: tuple[ipaddress.IPv4Address, ...] | None = None
    port: int = CLUSTER_PORT
    target_port: int = TARGET_PORT
    port_name: str = _PORT_NAME
    protocol: str = "TCP"

    @property
    def namespace(self) -> str:
        """``ns<index % 64>``."""
        return _NAMESPACES[self.index % len(_NAMESPACES)]

    @property
    def name(self) -> str:
        """``svc-<index>``."""
        return f"svc-{self.index}"

    @property
    def cluster_ip(self) -> ipaddress.IPv4Address:
        """The ClusterIP (:func:`service_ip`)."""
        return service_ip(self.index)

    @property
    def endpoints(self) -> tuple[ipaddress.IPv4Address, ...]:
        """The endpoint addresses (:func:`endpoint_ips`, or the explicit ones)."""
        if self.explicit_endpoints is not None:
            return self.explicit_endpoints
        return endpoint_ips(self.index, self.endpoint_count)

    def with_endpoints(self, endpoints: Sequence[ipaddress.IPv4Address]) -> SyntheticService:
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
        name, cluster_ip = self.name, str(self.cluster_ip)
        spec: dict[str, Any] = {
            "type": "ClusterIP",
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "ipFamilies": _IP_FAMILIES,
            "ipFamilyPolicy": "SingleStack",
            "internalTrafficPolicy": "Cluster",
            "ports": _service_ports(self.port_name, self.port, self.protocol, self.target_port),
            "selector": {"app": name},
            "sessionAffinity": "ClientIP" if self.affinity_seconds else "None",
        }
        if self.affinity_seconds:
            spec["sessionAffinityConfig"] = _affinity_config(self.affinity_seconds)
        return {
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

    def slice_dicts(
        self, endpoints: Sequence[ipaddress.IPv4Address] | None = None, generation: int = 1
    ) -> list[dict[str, Any]]:
        """The Service's EndpointSlices (at most 100 endpoints each), JSON form.

        ``endpoints`` overrides the Service's own list (to build an update);
        ``generation`` goes into ``resourceVersion`` so updates differ from the original.
        """
        addresses = self.endpoints if endpoints is None else tuple(endpoints)
        chunks = [
            addresses[start : start + _SLICE_CAPACITY]
            for start in range(0, len(addresses), _SLICE_CAPACITY)
        ] or [()]
        name, namespace, version = self.name, self.namespace, str(generation)
        ports = _slice_ports(self.port_name, self.target_port, self.protocol)
        return [
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{name}-{number:05d}",
                    "namespace": namespace,
                    "labels": {
                        "kubernetes.io/service-name": name,
                        "endpointslice.kubernetes.io/managed-by": _MANAGED_BY,
                    },
                    "resourceVersion": version,
                },
                "addressType": "IPv4",
                "endpoints": [
                    {
                        "addresses": [str(ip)],
                        "conditions": _READY,
                        "nodeName": _NODE_NAMES[int(ip) % _OTHER_NODES],
                    }
                    for ip in chunk
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
        self._now: dict[int, tuple[ipaddress.IPv4Address, ...]] = {}
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


def all_slice_dicts(services: Sequence[SyntheticService]) -> Iterator[dict[str, Any]]:
    """Every EndpointSlice of ``services``, in order."""
    for service in services:
        yield from service.slice_dicts()
