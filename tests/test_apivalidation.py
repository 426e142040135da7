"""The API server's validation rules the manifests source applies (issue 31, item 4),
:mod:`kubeproxy.sources.apivalidation`, case by case against upstream's messages; the
clusters the benchmarks and the examples build pass them. What the source does with a
refused object is in ``tests/test_manifests.py``.
"""

from __future__ import annotations

import copy
import ipaddress
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.synthetic import NODE_NAME, all_slice_dicts, realistic_services
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPFamily
from kubeproxy.parse import (
    InvalidObject,
    hand_over,
    parse_checked_endpoint_slice,
    parse_endpoint_slice,
    parse_ip,
)
from kubeproxy.proxier import Proxier
from kubeproxy.sources.apivalidation import (
    _endpoint,
    _ip_problem,
    _node_name_ok,
    _plain_ipv4,
    _special,
    _strict_ipv4,
    _unclear_endpoints,
    checked_endpoint_slice,
    endpoint_slice_errors,
    service_errors,
)
from kubeproxy.sources.manifests import ManifestSource
from kubeproxy.testing.fakeapi import builders

V4 = IPFamily.IPV4


def svc(name: str, **spec: Any) -> dict[str, Any]:
    """A Service as a manifest may hold it: only what the test sets (the API server's
    defaults left out), ports as dicts so a test can break them."""
    body: dict[str, Any] = {
        "clusterIP": "172.30.0.10",
        "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
        **spec,
    }
    return {"metadata": {"name": name, "namespace": "demo"}, "spec": body}


def eps(name: str, service: str, *addresses: str, **extra: Any) -> dict[str, Any]:
    return {**builders.endpoint_slice(name, service, "demo", addresses=addresses), **extra}


# --- the rules -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"externalIPs": ["0.0.0.0"]}, "may not be unspecified (0.0.0.0)"),
        ({"externalIPs": ["::"]}, "may not be unspecified (::)"),
        ({"externalIPs": ["::1"]}, "loopback range"),
        ({"externalIPs": ["fe80::1"]}, "link-local range"),
        ({"externalIPs": ["ff02::1"]}, "link-local multicast range"),
        ({"externalIPs": ["010.1.2.3"]}, "must not have leading 0s"),
        ({"externalIPs": ["::ffff:10.1.2.3"]}, "must not be an IPv4-mapped IPv6 address"),
        ({"externalIPs": ["fe80::1%eth0"]}, "must be a valid IP address"),
        ({"externalIPs": ["a.b.c.d"]}, "must be a valid IP address"),
        ({"type": "Cluster"}, "spec.type"),
        ({"ports": []}, "spec.ports: Required value"),
        ({"ports": [{"port": 80}, {"port": 81}]}, "Required value (several ports)"),
        ({"ports": [{"name": "Http", "port": 80}]}, "DNS-1123 label"),
        ({"ports": [{"name": "a", "port": 0}]}, "must be between 1 and 65535"),
        ({"ports": [{"name": "a", "port": 80, "protocol": "ICMP"}]}, "spec.ports[0].protocol"),
        ({"ports": [{"name": "a", "port": 80}, {"name": "b", "port": 80}]}, "Duplicate value"),
        ({"ports": [{"name": "a", "port": 80, "nodePort": 30001}]}, "'ClusterIP'"),
        ({"clusterIPs": ["172.30.0.11"]}, "must be equal to clusterIP"),
        ({"clusterIPs": ["172.30.0.10", "172.30.0.11"]}, "one IP for each IP family"),
        ({"clusterIP": "None", "type": "NodePort"}, "may not be set to 'None'"),
        ({"sessionAffinity": "Sticky"}, "spec.sessionAffinity"),
        ({"sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 5}}}, "must not be set"),
        (
            {
                "sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 86401}},
            },
            "timeoutSeconds: 86401",
        ),
        ({"loadBalancerSourceRanges": ["10.0.0.0/8"]}, "only be used when `type` is"),
        ({"externalTrafficPolicy": "Local"}, "externally-accessible"),
        ({"internalTrafficPolicy": "Nearby"}, "spec.internalTrafficPolicy"),
        ({"healthCheckNodePort": 30000}, "spec.healthCheckNodePort"),
    ],
)
def test_service_rules(change: dict[str, Any], reason: str) -> None:
    errors = service_errors(svc("web", **change))
    assert any(reason in e for e in errors), errors


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"loadBalancerSourceRanges": ["10.0.0.1/8"]}, "bits set beyond the prefix length"),
        ({"loadBalancerSourceRanges": ["10.0.0.0/08"]}, "leading 0s"),
        ({"loadBalancerSourceRanges": ["10.0.0.0"]}, "must be a valid CIDR"),
        ({"externalTrafficPolicy": "Nearby"}, "must be Cluster or Local"),
        ({"healthCheckNodePort": 70000}, "between 1 and 65535"),
    ],
)
def test_load_balancer_rules(change: dict[str, Any], reason: str) -> None:
    spec: dict[str, Any] = {
        "type": "LoadBalancer",
        "externalTrafficPolicy": "Local",
        "ports": [{"name": "a", "port": 80, "nodePort": 30001}],
    }
    spec.update(change)
    errors = service_errors(svc("lb", **spec))
    assert any(reason in e for e in errors), errors


def test_load_balancer_status_rules() -> None:
    lb = svc("lb", type="LoadBalancer", ports=[{"name": "a", "port": 80, "nodePort": 30001}])
    lb["status"] = {"loadBalancer": {"ingress": [{"ip": "010.0.0.1"}, {"ipMode": "VIP"}]}}
    errors = service_errors(lb)
    assert any("ingress[0].ip" in e and "leading 0s" in e for e in errors)
    assert any("ingress[1].ipMode: may not be specified" in e for e in errors)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"addressType": "IP"}, "addressType"),
        ({"endpoints": [{"addresses": []}]}, "must contain at least 1 address"),
        ({"endpoints": [{"addresses": ["fd00::1"]}]}, "must be a valid IPv4 address"),
        ({"endpoints": [{"addresses": ["169.254.1.1"]}]}, "link-local range"),
        ({"endpoints": [{"addresses": ["10.0.0.1"], "nodeName": "Node_A"}]}, "nodeName"),
        (
            {"endpoints": [{"addresses": ["10.0.0.1"], "hints": {"forZones": [{"name": "a b"}]}}]},
            "forZones[0].name",
        ),
        ({"ports": [{"name": "a"}, {"name": "a"}]}, "Duplicate value"),
        ({"ports": [{"name": "a", "protocol": "ICMP"}]}, "ports[0].protocol"),
    ],
)
def test_endpoint_slice_rules(change: dict[str, Any], reason: str) -> None:
    errors = endpoint_slice_errors(eps("web-1", "web", **change))
    assert any(reason in e for e in errors), errors


def test_a_bad_label_refuses_the_slice() -> None:
    obj = eps("web-1", "web", "10.0.0.1")
    obj["metadata"]["labels"]["kubernetes.io/service-name"] = "-web-"
    assert endpoint_slice_errors(obj) == [
        "metadata.labels[kubernetes.io/service-name]: '-web-': must be a valid label value"
    ]


def test_defaults_need_not_be_written() -> None:
    # What the API server fills in before validating may be left out of a manifest.
    assert service_errors(svc("web", ports=[{"port": 80}])) == []
    assert service_errors(svc("web", sessionAffinity="ClientIP")) == []
    assert endpoint_slice_errors(eps("web-1", "web", "10.0.0.1", ports=[{"port": 80}])) == []


def test_the_benchmark_and_example_clusters_pass() -> None:
    services = realistic_services(2000)
    assert {s.family for s in services} == {"IPv4", "IPv6", "dual"}
    for synthetic in services:
        assert service_errors(synthetic.service_dict()) == [], synthetic.port_label
    for slice_ in all_slice_dicts(services):
        assert endpoint_slice_errors(slice_) == [], slice_["metadata"]["name"]
    assert NODE_NAME  # the mix's local endpoints name this node
    examples = Path(__file__).resolve().parent.parent / "examples" / "cluster"
    handler = Proxier(V4, ProxierConfig(node_name="demo-node"), _Null())
    source = ManifestSource(examples, handler, node_name="demo-node")
    source.load()
    assert source.refused == []


class _Null:
    family = V4

    def sync(self, snapshot: Any, changes: Any) -> None:
        pass

    def cleanup(self) -> None:
        pass


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.integers(0, 2**32 - 1).map(lambda n: str(ipaddress.IPv4Address(n))),
        st.sampled_from(["0.0.0.0", "127.0.0.1", "169.254.9.9", "224.0.0.251", "224.0.1.1"]),
        st.sampled_from(["169.253.1.1", "010.0.0.1", "1.2.3", "::ffff:10.0.0.1", " 1.2.3.4"]),
    )
)
def test_the_plain_ipv4_shortcut_refuses_what_the_full_checks_refuse(text: str) -> None:
    # The shortcut passes an address only when the full checks find no problem with it.
    if _plain_ipv4(text):
        assert _ip_problem(text, strict=False) is None
        assert _special(parse_ip(text)) is None
    # And what the slice's validation says is what the full checks say.
    full = _ip_problem(text, strict=False)
    if full is None:
        address = parse_ip(text)
        full = "must be a valid IPv4 address" if address.version != 4 else _special(address)
    errors = endpoint_slice_errors(eps("web-1", "web", text))
    assert bool(errors) == (full is not None), (errors, full)
    if full is not None:
        assert any(full in e for e in errors), errors


_ENDPOINT_PARTS: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(
    {},
    optional={
        "addresses": st.one_of(
            st.none(),
            st.just("10.0.0.1"),
            st.lists(
                st.sampled_from(["10.0.0.1", "10.1.2.3", "127.0.0.1", "0.0.0.0", "fd00::1", 7]),
                max_size=3,
            ),
            st.just(["10.0.0.1"] * 101),
        ),
        "nodeName": st.sampled_from([None, "node-1", "Node_1", "", 5, "a." * 130]),
        "hints": st.sampled_from(
            [None, {}, {"forZones": []}, {"forZones": [{"name": "a"}, {"name": "a"}]}, []]
        ),
    },
)


@settings(max_examples=300)
@given(
    endpoints=st.lists(st.one_of(_ENDPOINT_PARTS, st.just("text"), st.none()), max_size=5),
    address_type=st.sampled_from(["IPv4", "IPv6", "FQDN", None]),
)
def test_the_endpoints_left_unchecked_have_nothing_to_report(
    endpoints: list[Any], address_type: Any
) -> None:
    # The shortcut over a slice's endpoints leaves out only endpoints in which the full
    # check per endpoint finds nothing, and hands on every other one.
    unclear = set(_unclear_endpoints(endpoints, address_type))
    for index, raw in enumerate(endpoints):
        problems: list[str] = []
        _endpoint(index, raw, address_type, problems)
        if index not in unclear:
            assert problems == [], (raw, problems)
    assert unclear <= set(range(len(endpoints)))


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.integers(0, 2**32 - 1).map(lambda n: str(ipaddress.IPv4Address(n))),
        st.sampled_from(
            ["010.0.0.1", "1.2.3", "::ffff:10.0.0.1", " 1.2.3.4", "1.2.3.4 ", "fd00::1"]
        ),
        st.text(alphabet="0123456789.:", max_size=16),
    )
)
def test_the_strict_ipv4_shortcut_takes_only_what_the_full_checks_take(text: str) -> None:
    # What the shortcut passes parses both ways (sloppy and strict) as the same IPv4
    # address, so _ip_problem's own checks would have found nothing.
    if _strict_ipv4(text):
        assert _ip_problem(text) is None
        strict = ipaddress.ip_address(text)
        assert isinstance(strict, ipaddress.IPv4Address) and parse_ip(text) == strict
        assert str(strict) == text
    errors = service_errors(svc("web", clusterIP=text, clusterIPs=[text]))
    assert (not any("clusterIPs[0]" in e for e in errors)) == (
        _strict_ipv4(text) or (":" in text and _ip_problem(text) is None)
    ), errors


# --- the validation on the parse's walk (checked_endpoint_slice) ----------------------


# Endpoints the API server takes, mostly, in the shapes a cluster has.
_VALID_ENDPOINT: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(
    {
        "addresses": st.sampled_from(
            [["10.0.0.1"], ["10.1.2.3"], ["10.0.0.1", "10.1.2.3"], ["fd00::1"], ["224.0.1.1"]]
        )
    },
    optional={
        "nodeName": st.sampled_from([None, "node-1", "node-a", "a.b"]),
        "conditions": st.sampled_from([{"ready": True}, {"ready": False, "terminating": True}]),
        "hints": st.sampled_from([None, {"forZones": [{"name": "a"}]}]),
    },
)


@settings(max_examples=300, deadline=None)
@given(
    endpoints=st.lists(
        st.one_of(_VALID_ENDPOINT, _ENDPOINT_PARTS, st.just("text"), st.none()), max_size=5
    ),
    address_type=st.sampled_from(["IPv4", "IPv6", "FQDN", None]),
    ports=st.sampled_from(
        [
            [{"name": "http", "port": 8080}],
            [],
            [{"name": "a"}, {"name": "a"}],
            [{"name": "all"}],
            "x",
            None,
        ]
    ),
    node=st.sampled_from(["node-1", "", "node-a"]),
)
def test_the_validation_on_the_parse_says_what_the_validation_alone_says(
    endpoints: list[Any], address_type: Any, ports: Any, node: str
) -> None:
    # One walk (the parse, listing the unusual endpoints) against two: the same reasons,
    # and for a slice it passes, the very parse the tracker makes on its own.
    obj = eps("web-1", "web", addressType=address_type, endpoints=endpoints, ports=ports)
    errors, parsed = checked_endpoint_slice(obj, node)
    assert errors == endpoint_slice_errors(obj)
    if errors or address_type not in ("IPv4", "IPv6"):
        assert parsed is None
        return
    try:
        alone = parse_endpoint_slice(obj, IPFamily(address_type), node)
    except InvalidObject:
        assert parsed is None  # the tracker reports it, as before
        return
    if parsed is None and alone is not None:
        # A port the parse leaves out: the tracker parses (and says so) on its own.
        assert len(alone.ports) < len(ports)
        return
    assert parsed == alone


def test_the_usual_endpoints_are_not_checked_again() -> None:
    # What the parse lists as unusual: any endpoint the full checks must see, and only those
    # in this slice (10.0.0.1 on a node with a valid name is the usual shape).
    obj = eps("web-1", "web", "10.0.0.1", "127.0.0.1", "10.0.0.2")
    obj["endpoints"].append({"addresses": ["10.0.0.3", "10.0.0.4"]})
    obj["endpoints"].append({"addresses": ["10.0.0.5"], "nodeName": "Node_A"})
    obj["endpoints"].append({"addresses": ["10.0.0.6"], "hints": {"forZones": []}})
    checked = _node_name_ok
    parsed, unclear = parse_checked_endpoint_slice(obj, V4, "node-a", checked)
    assert parsed is not None
    assert unclear == [1, 3, 4, 5]
    six = eps("web-1", "web", addressType="IPv6", endpoints=[{"addresses": ["fd00::1"]}] * 2)
    assert parse_checked_endpoint_slice(six, IPFamily.IPV6, "node-a", checked)[1] == [0, 1]


def test_a_handed_over_parse_answers_only_for_its_object_family_and_node() -> None:
    obj = eps("web-1", "web", "10.0.0.1")
    errors, parsed = checked_endpoint_slice(obj, "node-a")
    assert errors == [] and parsed is not None
    try:
        hand_over(obj, parsed, "node-a")
        assert parse_endpoint_slice(obj, V4, "node-a") is parsed
        # Another object (an equal copy), another node, another family: parsed anew.
        other = parse_endpoint_slice(copy.deepcopy(obj), V4, "node-a")
        assert other == parsed and other is not parsed
        assert parse_endpoint_slice(obj, V4, "node-b") is not parsed
        assert parse_endpoint_slice(obj, IPFamily.IPV6, "node-a") is None
    finally:
        hand_over(None, None, "")
    again = parse_endpoint_slice(obj, V4, "node-a")
    assert again == parsed and again is not parsed
