"""The soak's cluster: the bench's realistic mix in the fake API server, under churn.

:class:`SoakCluster` loads :func:`bench.synthetic.realistic_services` (and their
EndpointSlices and this node's Node) into a :class:`~kubeproxy.testing.fakeapi.FakeAPIServer`,
then changes it one object at a time (:meth:`SoakCluster.change`) as a busy cluster does:

* ``endpoint``: a slice's last endpoint turns not ready, or ready again (a pod's
  readiness), or a narrow Service's last endpoint moves to a spare address (a pod
  replaced);
* ``add`` and ``remove``: a Service of the mix's shapes appears (with its slices), or
  one goes with its slices (whichever keeps the cluster at its size);
* ``relabel``: a slice's ``kubernetes.io/service-name`` moves it to another Service of
  the same namespace (issue 31's relabel, which must leave the old Service);
* ``update``: a Service's ``internalTrafficPolicy``, or for one reachable from outside its
  ``externalTrafficPolicy``, or its session affinity, flips.

A few Services are left out of the churn: the affinity clients' (a client pinned to an
endpoint must keep it through restarts and full syncs) and the hung backend's (a NodePort
whose endpoints accept and never answer: ``hung_service``).

:func:`expectations` reads the API's objects as they are and says, for every frontend a
client can try, which endpoints may answer it (none: it must not answer), from the
Service and slice fields alone: the check the kernel's rules must pass, whatever their
shape.
"""

from __future__ import annotations

import copy
import ipaddress
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.daemonbench import flip_last_endpoint
from bench.soaknet import (
    CLIENT_SOURCES,
    EXTRA_NODE_IP,
    HUNG_PORT,
    RANGE_SOURCE,
)
from bench.synthetic import (
    NODE_IP,
    NODE_IP6,
    NODE_NAME,
    SyntheticService,
    endpoint_ips,
    realistic_service,
    realistic_services,
)
from kubeproxy.testing.fakeapi import FakeAPIServer

__all__ = [
    "CHANGES",
    "HUNG_NODE_PORT",
    "SoakCluster",
    "Target",
    "expectations",
    "hung_service",
    "localhost_targets",
    "node_object",
]

CHANGES = ("endpoint", "endpoint", "endpoint", "endpoint", "update", "relabel", "add", "remove")
"""The churn's mix, drawn uniformly: half endpoint changes, the rest one of each."""
HUNG_NODE_PORT = 32700
"""The hung backend's NodePort (outside the mix's 30000-32699)."""
_HUNG_NAMESPACE = "soak"
_SPARE = 14  # a narrow Service's spare address: its block's 15th
_LABEL = "kubernetes.io/service-name"


def node_object(zone: str = "zone-a") -> dict[str, Any]:
    """This node (both families' addresses) with a zone label (a zone change re-sorts
    every Service's endpoints: a full sync)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE_NAME, "labels": {"topology.kubernetes.io/zone": zone}},
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": str(NODE_IP)},
                {"type": "InternalIP", "address": str(NODE_IP6)},
            ]
        },
    }


def hung_service() -> tuple[dict[str, Any], dict[str, Any]]:
    """A NodePort Service whose two endpoints accept and never answer, and its slice."""
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "hung", "namespace": _HUNG_NAMESPACE},
        "spec": {
            "type": "NodePort",
            "clusterIP": "10.111.255.1",
            "clusterIPs": ["10.111.255.1"],
            "ipFamilies": ["IPv4"],
            "externalTrafficPolicy": "Cluster",
            "internalTrafficPolicy": "Cluster",
            "sessionAffinity": "None",
            "ports": [
                {
                    "name": "http",
                    "port": 80,
                    "protocol": "TCP",
                    "targetPort": HUNG_PORT,
                    "nodePort": HUNG_NODE_PORT,
                },
            ],
        },
    }
    slice_ = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "hung-00000",
            "namespace": _HUNG_NAMESPACE,
            "labels": {_LABEL: "hung"},
        },
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": [str(ip)], "conditions": {"ready": True}, "nodeName": "node-1"}
            for ip in endpoint_ips(262_000, 2)
        ],
        "ports": [{"name": "http", "port": HUNG_PORT, "protocol": "TCP"}],
    }
    return service, slice_


class SoakCluster:
    """The mix of ``count`` Services in ``fake``, changed by :meth:`change` (see the
    module). ``pinned``: how many ClientIP Services the affinity clients use (kept out of
    the churn)."""

    def __init__(self, fake: FakeAPIServer, count: int, *, seed: int = 31, pinned: int = 6):
        self.fake = fake
        self.rng = random.Random(seed)
        mix = realistic_services(count)
        self._free_node_ports = [p for p in range(30000, 32700)]
        for service in mix:
            if service.node_port:
                self._free_node_ports.remove(service.node_port)
        self._next_index = count
        self.size = count
        self.services: dict[int, SyntheticService] = {s.index: s for s in mix}
        self.pinned = self._pin(pinned)
        self.counts: dict[str, int] = {}
        for service in self.services.values():
            fake.apply(service.service_dict(), copy=False)
            for slice_ in service.slice_dicts():
                fake.apply(slice_, copy=False)
        hung, hung_slice = hung_service()
        fake.apply(hung)
        fake.apply(hung_slice)
        fake.apply(node_object())

    def _pin(self, wanted: int) -> list[SyntheticService]:
        """ClientIP Services for the affinity clients: narrow, IPv4, several endpoints,
        no Local policy; made so where the mix has too few."""
        chosen = [
            s
            for s in self.services.values()
            if s.affinity_seconds and s.family == "IPv4" and 2 <= s.endpoint_count <= 10
            and not s.internal_local
        ][:wanted]  # fmt: skip
        for service in self.services.values():
            if len(chosen) >= wanted:
                break
            if (
                service not in chosen
                and service.family == "IPv4"
                and 2 <= service.endpoint_count <= 10
                and service.service_type == "ClusterIP"
                and not service.internal_local
            ):
                pinned = SyntheticService(
                    service.index, service.endpoint_count, affinity_seconds=10800
                )
                self.services[service.index] = pinned
                chosen.append(pinned)
        return chosen

    # The churn ------------------------------------------------------------------------

    def change(self) -> str:
        """Make one change (see the module); its kind."""
        kind = self.rng.choice(CHANGES)
        if kind in ("add", "remove"):  # the cluster's size stays put
            kind = "add" if len(self.services) < self.size else "remove"
        done = getattr(self, f"_{kind}")()
        kind = kind if done else "none"
        self.counts[kind] = self.counts.get(kind, 0) + 1
        return kind

    def _churnable(self) -> list[SyntheticService]:
        pinned = {s.index for s in self.pinned}
        return [s for s in self.services.values() if s.index not in pinned]

    def _slices_of(self, service: SyntheticService) -> list[dict[str, Any]]:
        return [
            s
            for s in self.fake.objects("EndpointSlice", copy=False)
            if s["metadata"]["namespace"] == service.namespace
            and s["metadata"].get("labels", {}).get(_LABEL) == service.name
        ]

    def _pick_slice(self) -> dict[str, Any] | None:
        for _ in range(20):
            service = self.rng.choice(self._churnable())
            slices = [s for s in self._slices_of(service) if s.get("endpoints")]
            if slices:
                return self.rng.choice(slices)
        return None

    def _endpoint(self) -> bool:
        slice_ = self._pick_slice()
        if slice_ is None:
            return False
        endpoints = slice_["endpoints"]
        last = ipaddress.ip_address(endpoints[-1]["addresses"][0])
        first = ipaddress.ip_address(endpoints[0]["addresses"][0])
        if len(endpoints) < _SPARE and self.rng.random() < 0.3:
            moved = copy.deepcopy(slice_)
            spare = first + _SPARE if last != first + _SPARE else first + len(endpoints) - 1
            if spare in {ipaddress.ip_address(e["addresses"][0]) for e in endpoints}:
                return False
            moved["endpoints"][-1]["addresses"] = [str(spare)]
            self.fake.apply(moved)
        else:
            self.fake.apply(flip_last_endpoint(slice_, 0.0))
        return True

    def _add(self) -> bool:
        index = self._next_index
        self._next_index += 1
        ports = iter(self._free_node_ports)
        service = realistic_service(index, self.rng, ports)
        if service.node_port:
            self._free_node_ports.remove(service.node_port)
        self.services[index] = service
        self.fake.apply(service.service_dict())
        for slice_ in service.slice_dicts():
            self.fake.apply(slice_)
        return True

    def _remove(self) -> bool:
        service = self.rng.choice(self._churnable())
        for slice_ in self._slices_of(service):
            meta = slice_["metadata"]
            self.fake.delete("EndpointSlice", meta["namespace"], meta["name"])
        self.fake.delete("Service", service.namespace, service.name)
        del self.services[service.index]
        if service.node_port:
            self._free_node_ports.append(service.node_port)
        return True

    def _relabel(self) -> bool:
        slice_ = self._pick_slice()
        if slice_ is None:
            return False
        namespace = slice_["metadata"]["namespace"]
        owner = slice_["metadata"]["labels"][_LABEL]
        others = [s for s in self._churnable() if s.namespace == namespace and s.name != owner]
        if not others:
            return False
        moved = copy.deepcopy(slice_)
        moved["metadata"]["labels"][_LABEL] = self.rng.choice(others).name
        self.fake.apply(moved)
        return True

    def _update(self) -> bool:
        service = self.rng.choice(self._churnable())
        current = self.fake.get("Service", service.namespace, service.name)
        if current is None:
            return False
        spec = current["spec"]
        draw = self.rng.random()
        if draw < 0.4 and "externalTrafficPolicy" in spec:
            # (No health-check port, as the mix's own Local LoadBalancers have none.)
            spec["externalTrafficPolicy"] = (
                "Cluster" if spec["externalTrafficPolicy"] == "Local" else "Local"
            )
        elif draw < 0.7:
            spec["internalTrafficPolicy"] = (
                "Cluster" if spec.get("internalTrafficPolicy") == "Local" else "Local"
            )
        elif spec.get("sessionAffinity") == "ClientIP":
            spec["sessionAffinity"] = "None"
            spec.pop("sessionAffinityConfig", None)
        else:
            spec["sessionAffinity"] = "ClientIP"
            spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 10800}}
        self.fake.apply(current)
        return True


# What must answer --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """One frontend a client tries: from ``source`` to ``ip:port``, answered by one of
    ``endpoints`` (empty: it must not answer)."""

    id: str
    ip: str
    port: int
    source: str
    endpoints: frozenset[str]

    def probe(self) -> dict[str, object]:
        """What ``bench.soakprobe connect`` reads."""
        return {"id": self.id, "ip": self.ip, "port": self.port, "source": self.source}


def _ready(slices: Sequence[Mapping[str, Any]], family: str, local_only: bool) -> frozenset[str]:
    found: set[str] = set()
    for slice_ in slices:
        if slice_.get("addressType") != family:
            continue
        if not any(p.get("name", "") == "http" for p in slice_.get("ports") or ()):
            continue
        for endpoint in slice_.get("endpoints") or ():
            conditions = endpoint.get("conditions") or {}
            if conditions.get("ready", True) is False:
                continue
            if local_only and endpoint.get("nodeName") != NODE_NAME:
                continue
            found.add(str(ipaddress.ip_address(endpoint["addresses"][0])))
    return frozenset(found)


def expectations(
    services: Sequence[Mapping[str, Any]],
    slices: Sequence[Mapping[str, Any]],
    *,
    extra_node_ip: bool,
) -> list[Target]:
    """Every frontend of ``services`` a client outside the node can try, with the
    endpoints that may answer it (see the module). The hung Service is left out."""
    by_owner: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for slice_ in slices:
        meta = slice_["metadata"]
        owner = (meta["namespace"], meta.get("labels", {}).get(_LABEL, ""))
        by_owner.setdefault(owner, []).append(slice_)
    targets: list[Target] = []
    for number, service in enumerate(services):
        meta, spec = service["metadata"], service["spec"]
        if meta["namespace"] == _HUNG_NAMESPACE:
            continue
        owned = by_owner.get((meta["namespace"], meta["name"]), [])
        targets.extend(_frontends(number, meta, spec, service, owned, extra_node_ip))
    return targets


def _frontends(
    number: int,
    meta: Mapping[str, Any],
    spec: Mapping[str, Any],
    service: Mapping[str, Any],
    owned: Sequence[Mapping[str, Any]],
    extra_node_ip: bool,
) -> Iterator[Target]:
    name = f"{meta['namespace']}/{meta['name']}"
    port = spec["ports"][0]
    source4 = CLIENT_SOURCES[number % len(CLIENT_SOURCES)]
    internal_local = spec.get("internalTrafficPolicy") == "Local"
    external_local = spec.get("externalTrafficPolicy") == "Local"
    ingress = [
        i["ip"] for i in service.get("status", {}).get("loadBalancer", {}).get("ingress", ())
    ]
    ranged = bool(spec.get("loadBalancerSourceRanges"))
    for cluster_ip in spec.get("clusterIPs") or ():
        family = "IPv6" if ":" in cluster_ip else "IPv4"
        source = source4 if family == "IPv4" else "fd00:99::2"
        internal = _ready(owned, family, internal_local)
        external = _ready(owned, family, external_local)
        yield Target(f"{name} cluster {cluster_ip}", cluster_ip, 80, source, internal)
        if port.get("nodePort"):
            node_ips = [str(NODE_IP)] if family == "IPv4" else [str(NODE_IP6)]
            if family == "IPv4" and extra_node_ip:
                node_ips.append(EXTRA_NODE_IP)
            for node_ip in node_ips:
                yield Target(
                    f"{name} nodeport {node_ip}", node_ip, int(port["nodePort"]), source, external
                )
        for external_ip in spec.get("externalIPs") or ():
            if (":" in external_ip) == (family == "IPv6"):
                yield Target(f"{name} external {external_ip}", external_ip, 80, source, external)
        for lb_ip in ingress:
            if (":" in lb_ip) != (family == "IPv6"):
                continue
            allowed = RANGE_SOURCE if ranged and family == "IPv4" else source
            yield Target(f"{name} lb {lb_ip}", lb_ip, 80, allowed, external)
            if ranged and family == "IPv4":  # the firewall: any other source is dropped
                yield Target(f"{name} lb-outside {lb_ip}", lb_ip, 80, source, frozenset())


def localhost_targets(
    services: Sequence[Mapping[str, Any]], slices: Sequence[Mapping[str, Any]], count: int
) -> list[Target]:
    """``count`` NodePorts of IPv4 Services (the first, by name) on ``127.0.0.1``, what the
    node's own clients reach through the localhost NodePort proxy, with their endpoints
    (the node's own under ``externalTrafficPolicy: Local``)."""
    by_owner: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for slice_ in slices:
        meta = slice_["metadata"]
        by_owner.setdefault((meta["namespace"], meta.get("labels", {}).get(_LABEL, "")), []).append(
            slice_
        )
    found: list[Target] = []
    for service in sorted(
        services, key=lambda s: (s["metadata"]["namespace"], s["metadata"]["name"])
    ):
        meta, spec = service["metadata"], service["spec"]
        node_port = spec["ports"][0].get("nodePort")
        if meta["namespace"] == _HUNG_NAMESPACE or not node_port:
            continue
        if "IPv4" not in (spec.get("ipFamilies") or ()):
            continue
        owned = by_owner.get((meta["namespace"], meta["name"]), [])
        local = spec.get("externalTrafficPolicy") == "Local"
        name = f"{meta['namespace']}/{meta['name']} localhost"
        found.append(Target(name, "127.0.0.1", int(node_port), "", _ready(owned, "IPv4", local)))
        if len(found) >= count:
            break
    return found
