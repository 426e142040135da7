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
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CLUSTER_PORT",
    "MAX_SERVICES",
    "NODE_IP",
    "NODE_NAME",
    "POD_CIDR",
    "SERVICE_CIDR",
    "TARGET_PORT",
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


@dataclass(frozen=True, slots=True)
class SyntheticService:
    """One single-port TCP ClusterIP Service with its ready endpoints.

    ``affinity_seconds`` is the ClientIP session-affinity timeout, 0 for none.
    """

    index: int
    namespace: str
    name: str
    cluster_ip: ipaddress.IPv4Address
    endpoints: tuple[ipaddress.IPv4Address, ...]
    affinity_seconds: int = 0
    port: int = CLUSTER_PORT
    target_port: int = TARGET_PORT
    port_name: str = _PORT_NAME
    protocol: str = "TCP"

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
        spec: dict[str, Any] = {
            "type": "ClusterIP",
            "clusterIP": str(self.cluster_ip),
            "clusterIPs": [str(self.cluster_ip)],
            "ipFamilies": ["IPv4"],
            "ipFamilyPolicy": "SingleStack",
            "internalTrafficPolicy": "Cluster",
            "ports": [
                {
                    "name": self.port_name,
                    "port": self.port,
                    "protocol": self.protocol,
                    "targetPort": self.target_port,
                }
            ],
            "selector": {"app": self.name},
            "sessionAffinity": "ClientIP" if self.affinity_seconds else "None",
        }
        if self.affinity_seconds:
            spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": self.affinity_seconds}}
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": self.name,
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
        return [
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{self.name}-{number:05d}",
                    "namespace": self.namespace,
                    "labels": {
                        "kubernetes.io/service-name": self.name,
                        "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                    },
                    "resourceVersion": str(generation),
                },
                "addressType": "IPv4",
                "endpoints": [
                    {
                        "addresses": [str(ip)],
                        "conditions": {"ready": True, "serving": True, "terminating": False},
                        "nodeName": f"node-{int(ip) % _OTHER_NODES}",
                    }
                    for ip in chunk
                ],
                "ports": [
                    {"name": self.port_name, "port": self.target_port, "protocol": self.protocol}
                ],
            }
            for number, chunk in enumerate(chunks)
        ]


def synthetic_service(
    index: int, endpoint_count: int, *, affinity_seconds: int = 0
) -> SyntheticService:
    """Service ``index`` with ``endpoint_count`` endpoints, named ``ns<index % 64>/svc-<index>``."""
    return SyntheticService(
        index=index,
        namespace=f"ns{index % 64}",
        name=f"svc-{index}",
        cluster_ip=service_ip(index),
        endpoints=endpoint_ips(index, endpoint_count),
        affinity_seconds=affinity_seconds,
    )


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
