"""Objects for tests to :meth:`~kubeproxy.testing.fakeapi.FakeAPIServer.apply`.

A Service, an EndpointSlice, a Node and a ServiceCIDR, as JSON with the fields a proxy
reads and sensible defaults. Apart from the server: tests build objects without one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kubeproxy.testing.fakeapi.resources import JSONObject

__all__ = ["endpoint_slice", "node", "service", "service_cidr"]


def service(
    name: str,
    namespace: str = "default",
    *,
    cluster_ip: str = "10.96.0.10",
    ports: Sequence[tuple[str, int, str]] = (("http", 80, "TCP"),),
    labels: Mapping[str, str] | None = None,
    **spec: Any,
) -> JSONObject:
    """A ClusterIP Service with the given ports (name, port, protocol)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip] if cluster_ip != "None" else ["None"],
            "ports": [
                {"name": n, "port": p, "protocol": proto, "targetPort": p} for n, p, proto in ports
            ],
            **spec,
        },
    }


def endpoint_slice(
    name: str,
    service_name: str,
    namespace: str = "default",
    *,
    addresses: Sequence[str] = ("10.244.0.11",),
    ports: Sequence[tuple[str, int, str]] = (("http", 8080, "TCP"),),
    node_name: str = "node-a",
    labels: Mapping[str, str] | None = None,
) -> JSONObject:
    """An IPv4 EndpointSlice of a Service, ready endpoints on ``node_name``."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service_name, **(labels or {})},
        },
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": [a], "conditions": {"ready": True}, "nodeName": node_name}
            for a in addresses
        ],
        "ports": [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports],
    }


def node(
    name: str,
    *,
    addresses: Sequence[str] = ("192.168.0.10",),
    pod_cidrs: Sequence[str] = ("10.244.0.0/24",),
    zone: str | None = None,
    taints: Sequence[Mapping[str, Any]] = (),
) -> JSONObject:
    """A Node with InternalIP addresses, pod CIDRs and optionally a zone label."""
    labels = {"kubernetes.io/hostname": name}
    if zone is not None:
        labels["topology.kubernetes.io/zone"] = zone
    spec: JSONObject = {"podCIDRs": list(pod_cidrs)}
    if pod_cidrs:
        spec["podCIDR"] = pod_cidrs[0]
    if taints:
        spec["taints"] = [dict(t) for t in taints]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
        "status": {"addresses": [{"type": "InternalIP", "address": a} for a in addresses]},
    }


def service_cidr(name: str, *cidrs: str) -> JSONObject:
    """A ServiceCIDR object holding ``cidrs``."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "ServiceCIDR",
        "metadata": {"name": name},
        "spec": {"cidrs": list(cidrs)},
    }
