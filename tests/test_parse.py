"""Validation and conversion of Services, EndpointSlices and Nodes (kubeproxy.parse)."""

from __future__ import annotations

import copy
import dataclasses
import ipaddress
import logging
import pickle
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubeproxy.objects import (
    READY,
    Endpoint,
    IPFamily,
    NamespacedName,
    Protocol,
    ServicePortName,
)
from kubeproxy.parse import (
    InvalidObject,
    describe,
    endpoint_slice_key,
    endpoint_with_port,
    parse_cidr,
    parse_endpoint_slice,
    parse_ip,
    parse_node,
    parse_service,
    service_key,
)
from kubeproxy.testing.fakeapi import builders

V4 = IPFamily.IPV4
V6 = IPFamily.IPV6
ip = ipaddress.ip_address
net = ipaddress.ip_network
KEY = NamespacedName("ns", "web")


def service(**spec: Any) -> dict[str, Any]:
    """A valid single-stack ClusterIP Service ns/web, with ``spec`` fields overridden."""
    base: dict[str, Any] = {
        "clusterIP": "10.96.0.10",
        "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
    }
    base.update(spec)
    return {"kind": "Service", "metadata": {"namespace": "ns", "name": "web"}, "spec": base}


def only_port(ports: dict[ServicePortName, Any]) -> Any:
    assert len(ports) == 1
    return next(iter(ports.values()))


# ---------------------------------------------------------------------------------------
# Addresses


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.1.2.3", "10.1.2.3"),
        ("010.001.002.003", "10.1.2.3"),  # legacy leading zeros are decimal, not octal
        ("0000255.0.0.0", "255.0.0.0"),
        ("FD00:0:0::1", "fd00::1"),
        ("::ffff:10.1.2.3", "10.1.2.3"),  # IPv4-mapped is IPv4, as Go sees it
        ("::ffff:a01:203", "10.1.2.3"),
        ("::1", "::1"),
    ],
)
def test_parse_ip_accepts_and_canonicalises(text: str, expected: str) -> None:
    assert str(parse_ip(text)) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        " 10.1.2.3",
        "10.1.2.3 ",
        "10.1.2",
        "10.1.2.256",
        "10.1.2.3.4",
        "0x0a.1.2.3",
        "fe80::1%eth0",
        "\u0661.2.3.4",  # an Arabic-Indic digit one
        "1" * 100,
        "::g",
        "None",
    ],
)
def test_parse_ip_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_ip(text)


def test_parse_ip_rejects_non_strings() -> None:
    for value in (None, 167837953, b"\n\x01\x02\x03", ["10.1.2.3"]):
        with pytest.raises(ValueError):
            parse_ip(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.0/8", "10.0.0.0/8"),
        ("10.1.2.3/8", "10.0.0.0/8"),  # host bits allowed, cleared
        ("010.000.0.0/08", "10.0.0.0/8"),
        ("0.0.0.0/0", "0.0.0.0/0"),
        ("2001:DB8::1/32", "2001:db8::/32"),
        ("1.2.3.4/32", "1.2.3.4/32"),
    ],
)
def test_parse_cidr(text: str, expected: str) -> None:
    assert str(parse_cidr(text)) == expected


@pytest.mark.parametrize(
    "text",
    ["10.0.0.0", "10.0.0.0/33", "::/129", "10.0.0.0/8/8", "10.0.0.0/-1", "x/8", "10.0.0.0/ 8"],
)
def test_parse_cidr_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cidr(text)


# ---------------------------------------------------------------------------------------
# Services: the good paths


def test_plain_cluster_ip_service() -> None:
    ports = parse_service(service(), V4)
    name = ServicePortName(KEY, "http", Protocol.TCP)
    assert list(ports) == [name]
    port = ports[name]
    assert port.name == name
    assert port.cluster_ip == ip("10.96.0.10")
    assert (port.port, port.protocol, port.node_port) == (80, Protocol.TCP, 0)
    assert port.external_ips == port.load_balancer_vips == port.load_balancer_source_ranges == ()
    assert port.session_affinity_seconds == 0
    assert not port.internal_policy_local and not port.external_policy_local
    assert port.health_check_node_port == 0
    assert str(port) == "10.96.0.10:80/TCP"


def test_protocol_defaults_to_tcp_and_name_to_empty() -> None:
    port = only_port(parse_service(service(ports=[{"port": 53}]), V4))
    assert port.name == ServicePortName(KEY, "", Protocol.TCP)


def test_same_port_name_with_two_protocols_is_two_ports() -> None:
    ports = parse_service(
        service(
            ports=[
                {"name": "dns", "port": 53, "protocol": "UDP"},
                {"name": "dns", "port": 53, "protocol": "TCP"},
                {"name": "sctp", "port": 99, "protocol": "SCTP"},
            ]
        ),
        V4,
    )
    assert set(ports) == {
        ServicePortName(KEY, "dns", Protocol.UDP),
        ServicePortName(KEY, "dns", Protocol.TCP),
        ServicePortName(KEY, "sctp", Protocol.SCTP),
    }


@pytest.mark.parametrize(
    "obj",
    [
        service(type="ExternalName", externalName="example.com", clusterIP=None),
        service(type="ExternalName", externalName="example.com"),
        service(clusterIP="None"),
        service(clusterIP=""),
        service(clusterIP=None),
        service(),  # no IPv6 cluster IP: nothing for the IPv6 proxier
        service(ports=[]),
        service(ports=None),
    ],
    ids=[
        "externalname",
        "externalname-with-ip",
        "headless-None",
        "empty-cluster-ip",
        "no-cluster-ip",
        "single-stack-v4",
        "no-ports",
        "null-ports",
    ],
)
def test_services_skipped_on_purpose(obj: dict[str, Any]) -> None:
    family = V6 if obj["spec"].get("clusterIP") == "10.96.0.10" and obj["spec"]["ports"] else V4
    assert parse_service(obj, family) == {}


def test_missing_cluster_ip_field_is_skipped() -> None:
    obj = service()
    del obj["spec"]["clusterIP"]
    obj["spec"]["clusterIPs"] = ["10.96.0.10"]
    assert parse_service(obj, V4) == {}


@pytest.mark.parametrize(
    "label", ["service.kubernetes.io/service-proxy-name", "service.kubernetes.io/headless"]
)
def test_labels_that_skip_a_service(label: str) -> None:
    obj = service()
    obj["metadata"]["labels"] = {label: ""}
    assert parse_service(obj, V4) == {}
    # The labels only skip: even a malformed Service with them is not reported.
    obj["spec"]["ports"] = [{"port": 0}]
    assert parse_service(obj, V4) == {}


def test_dual_stack_cluster_ips_by_family() -> None:
    obj = service(clusterIP="fd00::10", clusterIPs=["fd00::10", "10.96.0.10"])
    assert only_port(parse_service(obj, V4)).cluster_ip == ip("10.96.0.10")
    assert only_port(parse_service(obj, V6)).cluster_ip == ip("fd00::10")


def test_cluster_ip_falls_back_to_cluster_ip_field_and_is_normalised() -> None:
    obj = service(clusterIP="010.096.000.010")
    assert only_port(parse_service(obj, V4)).cluster_ip == ip("10.96.0.10")
    obj = service(clusterIP="FD00:0::10")
    assert only_port(parse_service(obj, V6)).cluster_ip == ip("fd00::10")
    assert parse_service(obj, V4) == {}


def test_external_ips_filtered_to_family_normalised_and_deduplicated() -> None:
    obj = service(
        clusterIPs=["10.96.0.10", "fd00::10"],
        externalIPs=["1.2.3.4", "2001:db8::1", "001.002.003.004", "5.6.7.8"],
    )
    assert only_port(parse_service(obj, V4)).external_ips == (ip("1.2.3.4"), ip("5.6.7.8"))
    assert only_port(parse_service(obj, V6)).external_ips == (ip("2001:db8::1"),)


def test_load_balancer_vips() -> None:
    obj = service(type="LoadBalancer", clusterIPs=["10.96.0.10", "fd00::10"])
    obj["status"] = {
        "loadBalancer": {
            "ingress": [
                {"ip": "192.0.2.1"},
                {"ip": "192.0.2.2", "ipMode": "VIP"},
                {"ip": "192.0.2.3", "ipMode": "Proxy"},
                {"hostname": "lb.example.com"},
                {"ip": "2001:db8::2"},
                {"ip": "not-checked", "ipMode": "Proxy"},
            ]
        }
    }
    assert only_port(parse_service(obj, V4)).load_balancer_vips == (
        ip("192.0.2.1"),
        ip("192.0.2.2"),
    )
    assert only_port(parse_service(obj, V6)).load_balancer_vips == (ip("2001:db8::2"),)


def test_load_balancer_source_ranges_trimmed_and_filtered() -> None:
    obj = service(
        type="LoadBalancer",
        clusterIPs=["10.96.0.10", "fd00::10"],
        loadBalancerSourceRanges=[
            " 10.0.0.0/8",
            "192.168.1.7/24 ",
            "2001:db8::/32",
            "\t1.2.3.4/32",
        ],
    )
    assert only_port(parse_service(obj, V4)).load_balancer_source_ranges == (
        net("10.0.0.0/8"),
        net("192.168.1.0/24"),
        net("1.2.3.4/32"),
    )
    assert only_port(parse_service(obj, V6)).load_balancer_source_ranges == (net("2001:db8::/32"),)


@pytest.mark.parametrize(
    ("spec", "seconds"),
    [
        ({}, 0),
        ({"sessionAffinity": "None"}, 0),
        ({"sessionAffinity": "ClientIP"}, 10800),
        ({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {}}}, 10800),
        (
            {
                "sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
            },
            60,
        ),
        (
            {
                "sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 86400}},
            },
            86400,
        ),
        # The timeout only matters with ClientIP affinity.
        ({"sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}}}, 0),
    ],
)
def test_session_affinity(spec: dict[str, Any], seconds: int) -> None:
    port = only_port(parse_service(service(**spec), V4))
    assert port.session_affinity_seconds == seconds
    assert port.session_affinity == (seconds > 0)


@pytest.mark.parametrize(
    ("spec", "internal", "external", "hcnp"),
    [
        ({"internalTrafficPolicy": "Local"}, True, False, 0),
        ({"internalTrafficPolicy": "Cluster"}, False, False, 0),
        # eTP only counts for Services reachable from outside by their type.
        ({"externalTrafficPolicy": "Local"}, False, False, 0),
        ({"externalTrafficPolicy": "Local", "externalIPs": ["1.2.3.4"]}, False, True, 0),
        # ... even when the external IPs are all of the other family.
        ({"externalTrafficPolicy": "Local", "externalIPs": ["2001:db8::1"]}, False, True, 0),
        ({"type": "NodePort", "externalTrafficPolicy": "Local"}, False, True, 0),
        (
            {"type": "NodePort", "externalTrafficPolicy": "Local", "healthCheckNodePort": 32000},
            False,
            True,
            0,
        ),
        (
            {
                "type": "LoadBalancer",
                "externalTrafficPolicy": "Local",
                "healthCheckNodePort": 32000,
            },
            False,
            True,
            32000,
        ),
        ({"type": "LoadBalancer", "externalTrafficPolicy": "Local"}, False, True, 0),
        (
            {
                "type": "LoadBalancer",
                "externalTrafficPolicy": "Cluster",
                "healthCheckNodePort": 32000,
            },
            False,
            False,
            0,
        ),
    ],
)
def test_traffic_policies_and_health_check(
    spec: dict[str, Any], internal: bool, external: bool, hcnp: int
) -> None:
    port = only_port(parse_service(service(**spec), V4))
    assert port.internal_policy_local is internal
    assert port.external_policy_local is external
    assert port.health_check_node_port == hcnp


def test_node_port_is_carried_per_port() -> None:
    ports = parse_service(
        service(
            type="NodePort",
            ports=[
                {"name": "a", "port": 80, "nodePort": 30080},
                {"name": "b", "port": 81, "nodePort": 0},
                {"name": "c", "port": 82},
            ],
        ),
        V4,
    )
    assert [p.node_port for p in ports.values()] == [30080, 0, 0]


def test_a_wrong_family_address_in_one_place_is_filtered_not_an_error() -> None:
    obj = service(
        type="LoadBalancer",
        externalIPs=["2001:db8::1"],
        loadBalancerSourceRanges=["2001:db8::/32"],
    )
    obj["status"] = {"loadBalancer": {"ingress": [{"ip": "2001:db8::2"}]}}
    port = only_port(parse_service(obj, V4))
    assert port.external_ips == port.load_balancer_vips == port.load_balancer_source_ranges == ()


def test_parse_service_accepts_any_mapping() -> None:
    frozen = MappingProxyType(
        {
            "metadata": MappingProxyType({"namespace": "ns", "name": "web"}),
            "spec": MappingProxyType(
                {"clusterIP": "10.96.0.10", "ports": (MappingProxyType({"port": 80}),)}
            ),
        }
    )
    assert only_port(parse_service(frozen, V4)).port == 80


# ---------------------------------------------------------------------------------------
# Services: malformed ones


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = obj
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if value is _DELETE:
            del target[last]
        elif isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value

    return mutate


_DELETE = object()


@pytest.mark.parametrize(
    ("mutate", "where", "reason"),
    [
        (_set("metadata.name", _DELETE), "ns/<none>", "metadata.name is missing"),
        (_set("metadata.name", ""), "ns/<none>", "metadata.name is missing"),
        (_set("metadata.namespace", _DELETE), "<none>/web", "metadata.namespace is missing"),
        (_set("metadata", None), "<none>/<none>", "metadata is missing"),
        (_set("metadata.name", "Web_1"), "ns/Web_1", "metadata.name 'Web_1' is not a valid"),
        (_set("metadata.name", "a" * 64), "ns/" + "a" * 64, "is not a valid DNS-1123 label"),
        (_set("metadata.namespace", "-ns"), "-ns/web", "metadata.namespace '-ns' is not"),
        (_set("metadata.name", 7), "ns/7", "metadata.name 7 is not a valid"),
        (_set("spec", []), "ns/web", "spec: expected an object"),
        (_set("spec.type", "Magic"), "ns/web", "spec.type: unknown type 'Magic'"),
        (_set("spec.clusterIP", "10.96.0.300"), "ns/web", "spec.clusterIP: invalid IP address"),
        (
            _set("spec.clusterIPs", ["10.96.0.10", "fd00::zz"]),
            "ns/web",
            "spec.clusterIPs: invalid IP address 'fd00::zz'",
        ),
        (_set("spec.ports", {"port": 80}), "ns/web", "spec.ports: expected a list"),
        (_set("spec.ports.0", "80"), "ns/web", "spec.ports[0]: expected an object"),
        (_set("spec.ports.0.port", 0), "ns/web", "spec.ports[0].port: 0 is out of range"),
        (_set("spec.ports.0.port", 65536), "ns/web", "spec.ports[0].port: 65536 is out of range"),
        (_set("spec.ports.0.port", _DELETE), "ns/web", "spec.ports[0].port: expected an integer"),
        (_set("spec.ports.0.port", "80"), "ns/web", "spec.ports[0].port: expected an integer"),
        (_set("spec.ports.0.port", True), "ns/web", "spec.ports[0].port: expected an integer"),
        (_set("spec.ports.0.port", 80.0), "ns/web", "spec.ports[0].port: expected an integer"),
        (_set("spec.ports.0.nodePort", -1), "ns/web", "spec.ports[0].nodePort: -1 is out of"),
        (_set("spec.ports.0.nodePort", 65536), "ns/web", "spec.ports[0].nodePort: 65536 is out"),
        (_set("spec.ports.0.protocol", "HTTP"), "ns/web", "unknown protocol 'HTTP'"),
        (_set("spec.ports.0.protocol", "tcp"), "ns/web", "unknown protocol 'tcp'"),
        (_set("spec.ports.0.name", "HTTP!"), "ns/web", "spec.ports[0].name: 'HTTP!' is not"),
        (
            _set("spec.ports", [{"port": 80}, {"port": 81}]),
            "ns/web",
            "spec.ports[1]: duplicate port <unnamed>/TCP",
        ),
        (
            _set("spec.ports", [{"name": "a", "port": 80}, {"name": "a", "port": 81}]),
            "ns/web",
            "spec.ports[1]: duplicate port a/TCP",
        ),
        (
            _set("spec.externalIPs", ["1.2.3.4", "1.2.3"]),
            "ns/web",
            "spec.externalIPs[1]: invalid IP address '1.2.3'",
        ),
        (
            _set("spec.loadBalancerSourceRanges", ["10.0.0.0/33"]),
            "ns/web",
            "spec.loadBalancerSourceRanges[0]: invalid CIDR '10.0.0.0/33'",
        ),
        (
            _set("spec.loadBalancerSourceRanges", ["10.0.0.0"]),
            "ns/web",
            "spec.loadBalancerSourceRanges[0]: invalid CIDR",
        ),
        (_set("spec.sessionAffinity", "Cookie"), "ns/web", "spec.sessionAffinity: unknown value"),
        (
            _set(
                "spec.sessionAffinityConfig",
                {"clientIP": {"timeoutSeconds": 0}},
            ),
            "ns/web",
            "timeoutSeconds: 0 is out of range [1, 86400]",
        ),
        (
            _set(
                "spec.sessionAffinityConfig",
                {"clientIP": {"timeoutSeconds": 86401}},
            ),
            "ns/web",
            "timeoutSeconds: 86401 is out of range [1, 86400]",
        ),
        (
            _set("spec.healthCheckNodePort", 70000),
            "ns/web",
            "spec.healthCheckNodePort: 70000 is out of range",
        ),
        (
            _set("spec.internalTrafficPolicy", "Nearby"),
            "ns/web",
            "spec.internalTrafficPolicy: unknown value 'Nearby'",
        ),
        (
            _set("spec.externalTrafficPolicy", "local"),
            "ns/web",
            "spec.externalTrafficPolicy: unknown value 'local'",
        ),
    ],
)
def test_malformed_services(
    mutate: Callable[[dict[str, Any]], None], where: str, reason: str
) -> None:
    obj = service(sessionAffinity="ClientIP", type="LoadBalancer", externalTrafficPolicy="Cluster")
    mutate(obj)
    with pytest.raises(InvalidObject) as caught:
        parse_service(obj, V4)
    message = str(caught.value)
    assert message.startswith(f"Service {where}: "), message
    assert reason in message
    assert "\n" not in message


def test_only_the_families_of_a_service_report_its_mistakes() -> None:
    single = service(externalIPs=["bogus"])
    with pytest.raises(InvalidObject, match=r"spec\.externalIPs"):
        parse_service(single, V4)
    assert parse_service(single, V6) == {}  # reported once on a dual-stack node
    dual = service(clusterIPs=["10.96.0.10", "fd00::10"], externalIPs=["bogus"])
    for family in (V4, V6):
        with pytest.raises(InvalidObject, match=r"spec\.externalIPs"):
            parse_service(dual, family)
    bad_ip = service(clusterIPs=["10.96.0.10", "fd00::zz"])
    for family in (V4, V6):
        with pytest.raises(InvalidObject, match=r"spec\.clusterIPs"):
            parse_service(bad_ip, family)


def test_bad_load_balancer_ingress_ip_is_an_error() -> None:
    obj = service(type="LoadBalancer")
    obj["status"] = {"loadBalancer": {"ingress": [{"ip": "192.0.2.300"}]}}
    with pytest.raises(InvalidObject, match=r"status\.loadBalancer\.ingress\[0\]\.ip: invalid"):
        parse_service(obj, V4)


def test_garbage_is_reported_not_crashed_on() -> None:
    garbage: Any
    for garbage in (None, 42, "Service", [], {"metadata": "x"}):
        with pytest.raises(InvalidObject):
            parse_service(garbage, V4)


def test_invalid_object_pickles() -> None:
    err = InvalidObject("Service", "ns/web", "bad")
    clone = pickle.loads(pickle.dumps(err))
    assert (str(clone), clone.kind, clone.name, clone.reason) == (
        "Service ns/web: bad",
        "Service",
        "ns/web",
        "bad",
    )


def test_external_traffic_policy_is_checked_for_every_type() -> None:
    with pytest.raises(InvalidObject, match="externalTrafficPolicy"):
        parse_service(service(externalTrafficPolicy="Nope"), V4)


def test_service_key() -> None:
    assert service_key(service()) == KEY
    with pytest.raises(InvalidObject, match=r"^Service ns/<none>: metadata\.name is missing$"):
        service_key({"metadata": {"namespace": "ns"}})


# ---------------------------------------------------------------------------------------
# EndpointSlices


def endpoint_slice(
    endpoints: list[Any] | None = None,
    ports: list[Any] | None = None,
    *,
    address_type: str = "IPv4",
    name: str = "web-abc12",
    service_name: str = "web",
) -> dict[str, Any]:
    return {
        "kind": "EndpointSlice",
        "metadata": {
            "namespace": "ns",
            "name": name,
            "labels": {"kubernetes.io/service-name": service_name},
        },
        "addressType": address_type,
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}] if ports is None else ports,
        "endpoints": [{"addresses": ["10.0.0.1"]}] if endpoints is None else endpoints,
    }


def test_endpoint_slice_basics() -> None:
    obj = endpoint_slice(
        endpoints=[
            {"addresses": ["10.0.0.2"], "nodeName": "node-1", "conditions": {"ready": True}},
            {
                "addresses": ["10.0.0.10", "10.0.0.99"],
                "nodeName": "node-2",
                "conditions": {"ready": False, "serving": True, "terminating": True},
                "hints": {
                    "forZones": [{"name": "z1"}, {"name": "z2"}],
                    "forNodes": [{"name": "n"}],
                },
            },
            {"addresses": []},
            {"addresses": None},
        ],
        ports=[
            {"name": "metrics", "port": 9090, "protocol": "TCP"},
            {"name": "http", "port": 8080},
        ],
    )
    parsed = parse_endpoint_slice(obj, V4, "node-1")
    assert parsed is not None
    assert parsed.service == KEY
    assert parsed.name == "web-abc12"
    assert parsed.address_type == "IPv4"
    assert parsed.ports == (("http", 8080, Protocol.TCP), ("metrics", 9090, Protocol.TCP))
    # Sorted by the IP:port string, so 10.0.0.10 before 10.0.0.2; the first port is used.
    assert parsed.endpoints == (
        Endpoint(
            ip("10.0.0.10"),
            8080,
            is_local=False,
            ready=False,
            serving=True,
            terminating=True,
            zone_hints=frozenset({"z1", "z2"}),
            node_hints=frozenset({"n"}),
            remote=True,
        ),
        Endpoint(ip("10.0.0.2"), 8080, is_local=True),
    )
    assert [e.key for e in parsed.endpoints] == ["10.0.0.10:8080", "10.0.0.2:8080"]
    # Without a node name of its own, the proxy cannot tell another node's endpoints.
    anonymous = parse_endpoint_slice(obj, V4, "")
    assert anonymous is not None
    assert not any(e.remote or e.is_local for e in anonymous.endpoints)


@pytest.mark.parametrize(
    ("conditions", "expected"),
    [
        (None, (True, True, False)),
        ({}, (True, True, False)),
        ({"ready": None, "serving": None, "terminating": None}, (True, True, False)),
        ({"ready": False}, (False, True, False)),
        ({"ready": False, "serving": False, "terminating": True}, (False, False, True)),
        ({"ready": True, "terminating": True}, (True, True, True)),
    ],
)
def test_endpoint_conditions(conditions: Any, expected: tuple[bool, bool, bool]) -> None:
    parsed = parse_endpoint_slice(
        endpoint_slice([{"addresses": ["10.0.0.1"], "conditions": conditions}]), V4, "n"
    )
    assert parsed is not None
    endpoint = parsed.endpoints[0]
    assert (endpoint.ready, endpoint.serving, endpoint.terminating) == expected


def test_is_local_needs_a_node_name() -> None:
    obj = endpoint_slice([{"addresses": ["10.0.0.1"]}, {"addresses": ["10.0.0.2"], "nodeName": ""}])
    parsed = parse_endpoint_slice(obj, V4, "")
    assert parsed is not None
    assert [e.is_local for e in parsed.endpoints] == [False, False]


@pytest.mark.parametrize("address_type", ["IPv6", "FQDN", None, "ipv4"])
def test_slices_of_another_address_type_are_ignored(address_type: str | None) -> None:
    # Even a malformed one: it is not this proxier's business.
    obj = endpoint_slice([{"addresses": ["bogus"]}], address_type=address_type)  # type: ignore[arg-type]
    del obj["metadata"]["labels"]
    assert parse_endpoint_slice(obj, V4, "n") is None


def test_ipv6_slice() -> None:
    obj = endpoint_slice([{"addresses": ["FD00::0:1"]}], address_type="IPv6")
    parsed = parse_endpoint_slice(obj, V6, "n")
    assert parsed is not None
    assert parsed.endpoints == (Endpoint(ip("fd00::1"), 8080),)
    assert parsed.endpoints[0].key == "[fd00::1]:8080"
    assert parse_endpoint_slice(obj, V4, "n") is None


def test_null_ports_and_endpoints_are_empty() -> None:
    obj = endpoint_slice()
    obj["ports"] = None
    obj["endpoints"] = None
    parsed = parse_endpoint_slice(obj, V4, "n")
    assert parsed is not None
    assert parsed.ports == () and parsed.endpoints == ()
    del obj["ports"], obj["endpoints"]
    assert parse_endpoint_slice(obj, V4, "n") == parsed


def test_slice_port_defaults() -> None:
    parsed = parse_endpoint_slice(endpoint_slice(ports=[{"port": 53}]), V4, "n")
    assert parsed is not None
    assert parsed.ports == (("", 53, Protocol.TCP),)


def test_ports_without_a_number_are_skipped_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    obj = endpoint_slice(
        ports=[
            {"name": "all", "port": None, "protocol": "TCP"},
            {"name": "http", "port": 8080},
            {"name": "zero", "port": 0},
            {"name": "absent"},
        ]
    )
    with caplog.at_level(logging.WARNING, logger="kubeproxy.parse"):
        parsed = parse_endpoint_slice(obj, V4, "n")
    assert parsed is not None
    assert parsed.ports == (("http", 8080, Protocol.TCP),)
    assert [r.getMessage() for r in caplog.records] == [
        "EndpointSlice ns/web-abc12: ignoring 3 port(s) without a port number"
    ]


def test_leading_zero_endpoint_ips_are_normalised() -> None:
    parsed = parse_endpoint_slice(endpoint_slice([{"addresses": ["010.000.000.001"]}]), V4, "n")
    assert parsed is not None
    assert parsed.endpoints[0] == Endpoint(ip("10.0.0.1"), 8080)
    assert parsed.endpoints[0].key == "10.0.0.1:8080"


@pytest.mark.parametrize(
    ("mutate", "where", "reason"),
    [
        (
            _set("metadata.labels", {}),
            "ns/web-abc12",
            "label kubernetes.io/service-name is missing",
        ),
        (_set("metadata.labels", None), "ns/web-abc12", "label kubernetes.io/service-name"),
        (
            _set("metadata.labels", {"kubernetes.io/service-name": "Web!"}),
            "ns/web-abc12",
            "label kubernetes.io/service-name: 'Web!' is not a valid name",
        ),
        (_set("metadata.name", _DELETE), "ns/<none>", "metadata.name is missing"),
        (_set("metadata.namespace", ""), "<none>/web-abc12", "metadata.namespace is missing"),
        (_set("metadata.name", "Web.Slice"), "ns/Web.Slice", "not a valid DNS-1123 subdomain"),
        (
            _set("endpoints.0.addresses.0", "10.0.0.256"),
            "ns/web-abc12",
            "endpoints[0].addresses[0]: invalid IP address '10.0.0.256'",
        ),
        (
            _set("endpoints.0.addresses.0", "fd00::1"),
            "ns/web-abc12",
            "endpoints[0].addresses[0]: fd00::1 is not an IPv4 address",
        ),
        (
            _set("endpoints.0.addresses", "10.0.0.1"),
            "ns/web-abc12",
            "endpoints[0].addresses: expected a list",
        ),
        (_set("endpoints.0", "10.0.0.1"), "ns/web-abc12", "endpoints[0]: expected an object"),
        (_set("endpoints", {}), "ns/web-abc12", "endpoints: expected a list"),
        (
            _set("ports.0.port", 65536),
            "ns/web-abc12",
            "ports[0].port: 65536 is out of range [1, 65535]",
        ),
        (_set("ports.0.port", -5), "ns/web-abc12", "ports[0].port: -5 is out of range"),
        (_set("ports.0.port", "8080"), "ns/web-abc12", "ports[0].port: expected an integer"),
        (_set("ports.0.protocol", "ICMP"), "ns/web-abc12", "ports[0].protocol: unknown protocol"),
        (_set("ports.0.name", "Bad Name"), "ns/web-abc12", "ports[0].name: 'Bad Name' is not"),
        (
            _set("endpoints.0.conditions", {"ready": "yes"}),
            "ns/web-abc12",
            "endpoints[0].conditions.ready: expected true or false, got 'yes'",
        ),
        (
            _set("endpoints.0.conditions", {"terminating": 1}),
            "ns/web-abc12",
            "endpoints[0].conditions.terminating: expected true or false",
        ),
        (
            _set("endpoints.0.conditions", ["ready"]),
            "ns/web-abc12",
            "endpoints[0].conditions: expected an object",
        ),
        (
            _set("endpoints.0.hints", {"forZones": [{"zone": "z"}]}),
            "ns/web-abc12",
            "endpoints[0].hints.forZones[0].name: expected a name",
        ),
        (
            _set("endpoints.0.hints", {"forNodes": "n1"}),
            "ns/web-abc12",
            "endpoints[0].hints.forNodes: expected a list",
        ),
    ],
)
def test_malformed_endpoint_slices(
    mutate: Callable[[dict[str, Any]], None], where: str, reason: str
) -> None:
    obj = endpoint_slice()
    mutate(obj)
    with pytest.raises(InvalidObject) as caught:
        parse_endpoint_slice(obj, V4, "n")
    message = str(caught.value)
    assert message.startswith(f"EndpointSlice {where}: "), message
    assert reason in message


def test_endpoint_slice_key() -> None:
    assert endpoint_slice_key(endpoint_slice()) == (KEY, "web-abc12")


def test_fast_endpoints_are_ordinary_endpoints() -> None:
    obj = endpoint_slice(
        [
            {
                "addresses": ["10.0.0.1"],
                "nodeName": "n",
                "conditions": {"ready": False, "serving": True, "terminating": True},
                "hints": {"forZones": [{"name": "z"}]},
            }
        ]
    )
    parsed = parse_endpoint_slice(obj, V4, "n")
    assert parsed is not None
    fast = parsed.endpoints[0]
    slow = Endpoint(
        ip("10.0.0.1"),
        8080,
        is_local=True,
        ready=False,
        serving=True,
        terminating=True,
        zone_hints=frozenset({"z"}),
    )
    assert fast == slow and hash(fast) == hash(slow)
    assert fast.key == slow.key and repr(fast) == repr(slow)
    assert dataclasses.astuple(fast) == dataclasses.astuple(slow)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.port = 1  # type: ignore[misc]
    moved = endpoint_with_port(fast, 9)
    assert moved == dataclasses.replace(slow, port=9)
    assert moved.key == "10.0.0.1:9"
    v6 = Endpoint(ip("fd00::1"), 80)
    assert endpoint_with_port(v6, 443).key == "[fd00::1]:443"
    assert endpoint_with_port(v6, 443) == Endpoint(ip("fd00::1"), 443)


def test_parsing_does_not_modify_the_object() -> None:
    obj = endpoint_slice(
        [{"addresses": ["010.0.0.1"], "hints": {"forZones": [{"name": "z"}]}}],
        ports=[{"port": None}, {"port": 80}],
    )
    before = copy.deepcopy(obj)
    parse_endpoint_slice(obj, V4, "n")
    svc = service(externalIPs=["010.1.1.1"])
    svc_before = copy.deepcopy(svc)
    parse_service(svc, V4)
    assert obj == before and svc == svc_before


# ---------------------------------------------------------------------------------------
# Node and describe


def test_parse_node() -> None:
    node = parse_node(
        {
            "metadata": {
                "name": "node-1",
                "labels": {"topology.kubernetes.io/zone": "zone-a"},
                "deletionTimestamp": "2026-01-01T00:00:00Z",
            },
            "spec": {
                "podCIDRs": ["10.244.1.0/24", "fd00:244:1::/64"],
                "podCIDR": "10.99.0.0/24",
                "taints": [{"key": "other"}, {"key": "ToBeDeletedByClusterAutoscaler"}],
            },
            "status": {
                "addresses": [
                    {"type": "Hostname", "address": "node-1"},
                    {"type": "ExternalIP", "address": "203.0.113.5"},
                    {"type": "InternalIP", "address": "10.0.0.5"},
                    {"type": "InternalIP", "address": "fd00::5"},
                    {"type": "ExternalIP", "address": "10.0.0.5"},
                ]
            },
        }
    )
    assert node.name == "node-1"
    assert node.zone == "zone-a"
    assert node.addresses == (ip("10.0.0.5"), ip("fd00::5"), ip("203.0.113.5"))
    assert node.pod_cidrs == (net("10.244.1.0/24"), net("fd00:244:1::/64"))
    assert node.deleting and node.to_be_deleted_taint
    assert node.addresses_of(V4) == (ip("10.0.0.5"), ip("203.0.113.5"))


def test_parse_node_minimal_and_legacy_pod_cidr(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kubeproxy.parse"):
        node = parse_node(
            {
                "metadata": {"name": "n"},
                "spec": {"podCIDR": "10.244.0.0/24"},
                "status": {"addresses": [{"type": "InternalIP", "address": "bogus"}]},
            }
        )
    assert node.zone == "" and node.addresses == ()
    assert node.pod_cidrs == (net("10.244.0.0/24"),)
    assert not node.deleting and not node.to_be_deleted_taint
    assert len(caplog.records) == 1 and "Node n: ignoring address" in caplog.text
    with pytest.raises(InvalidObject, match=r"metadata\.name is missing"):
        parse_node({"metadata": {}})


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        (service(), "Service ns/web"),
        ({"metadata": {"namespace": "ns", "name": "x"}, "spec": {"ports": []}}, "Service ns/x"),
        (
            {"metadata": {"namespace": "ns", "name": "x"}, "addressType": "IPv4"},
            "EndpointSlice ns/x",
        ),
        ({"metadata": {"name": "x"}}, "object <none>/x"),
        ({"metadata": {"namespace": "a\nb", "name": "x" * 300}}, "object 'a\\nb'/'xxxxx"),
        ({}, "object <none>/<none>"),
        ([1, 2], "object <not an object: [1, 2]>"),
        (None, "object <not an object: None>"),
    ],
)
def test_describe(obj: Any, expected: str) -> None:
    text = describe(obj)
    assert text.startswith(expected)
    assert "\n" not in text and len(text) < 200


def test_describe_with_kind() -> None:
    assert describe({"metadata": {"namespace": "ns", "name": "x"}}, "Service") == "Service ns/x"


# ---------------------------------------------------------------------------------------
# Robustness: whatever garbage sits anywhere in an object, parsing either succeeds or
# raises InvalidObject; it never crashes with anything else.

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.sampled_from(["", "None", "10.0.0.1", "fd00::1", "Local", "UDP", "IPv4", "ClientIP"]),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(["name", "port", "ip", "ready", "x"]), children, max_size=3
        )
    ),
    max_leaves=6,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _paths(child, (*prefix, index))
    return found


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    clone = copy.deepcopy(value)
    target = clone
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = new
    return clone


FULL_SERVICE = service(
    type="LoadBalancer",
    clusterIPs=["10.96.0.10", "fd00::10"],
    externalIPs=["1.2.3.4"],
    loadBalancerSourceRanges=["10.0.0.0/8"],
    sessionAffinity="ClientIP",
    sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
    externalTrafficPolicy="Local",
    internalTrafficPolicy="Cluster",
    healthCheckNodePort=32000,
    ports=[{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}],
)
FULL_SERVICE["metadata"]["labels"] = {"app": "web"}
FULL_SERVICE["status"] = {"loadBalancer": {"ingress": [{"ip": "192.0.2.1", "ipMode": "VIP"}]}}
FULL_SLICE = endpoint_slice(
    [
        {
            "addresses": ["10.0.0.1"],
            "conditions": {"ready": True, "serving": True, "terminating": False},
            "nodeName": "n",
            "hints": {"forZones": [{"name": "z"}], "forNodes": [{"name": "n"}]},
        }
    ]
)
FULL_NODE = {
    "metadata": {"name": "n", "labels": {"topology.kubernetes.io/zone": "z"}},
    "spec": {"podCIDRs": ["10.244.0.0/24"], "taints": [{"key": "k"}]},
    "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.5"}]},
}


@settings(max_examples=200, deadline=None)
@given(st.data(), json_values)
def test_garbage_anywhere_is_an_invalid_object_or_fine(data: st.DataObject, junk: Any) -> None:
    for original in (FULL_SERVICE, FULL_SLICE, FULL_NODE):
        path = data.draw(st.sampled_from(_paths(original)))
        mangled = _replace(original, path, junk)
        try:
            if original is FULL_SERVICE:
                for family in (V4, V6):
                    parse_service(mangled, family)
                service_key(mangled)
            elif original is FULL_SLICE:
                for family in (V4, V6):
                    parse_endpoint_slice(mangled, family, "n")
            else:
                parse_node(mangled)
        except InvalidObject as err:
            assert str(err).count("\n") == 0
        describe(mangled)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.10", "10.0.0.100", "9.0.0.1"]),
            st.booleans(),
            st.sampled_from([None, "a", "b"]),
        ),
        max_size=12,
    )
)
def test_a_slices_endpoints_are_sorted_by_key_stably(
    rows: list[tuple[str, bool, str | None]],
) -> None:
    # Each endpoint keeps its own conditions and hints through the sort, and endpoints
    # with the same key (the same address twice) keep the slice's order.
    obj = builders.endpoint_slice("web-1", "web", "ns", addresses=[a for a, _, _ in rows])
    for (_, ready, zone), endpoint in zip(rows, obj["endpoints"], strict=True):
        endpoint["conditions"] = {"ready": ready}
        if zone is not None:
            endpoint["hints"] = {"forZones": [{"name": zone}]}
    parsed = parse_endpoint_slice(obj, V4, "node-a")
    assert parsed is not None
    expected = sorted(rows, key=lambda row: f"{row[0]}:8080")
    got = [
        (e.address, bool(e.flags & READY), next(iter(e.hints[0]), None)) for e in parsed.endpoints
    ]
    assert got == expected
