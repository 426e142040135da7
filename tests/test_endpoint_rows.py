"""Endpoints as columns (issue 32): :class:`EndpointRows` reads as the sorted tuple of
:class:`Endpoint` objects it replaces, whatever the endpoints, and the categorisation
that picks rows by their flag bytes picks what a walk over the objects picks."""

from __future__ import annotations

import ipaddress

from hypothesis import given, settings
from hypothesis import strategies as st

from kubeproxy.objects import (
    Endpoint,
    EndpointRows,
    IPFamily,
    NamespacedName,
    Protocol,
    ServicePort,
    ServicePortName,
    endpoint_addresses,
    endpoint_keys,
    endpoint_ports,
)
from kubeproxy.parse import parse_endpoint_slice
from kubeproxy.topology import categorize_endpoints

_POOL = ["10.0.0.1", "10.0.0.2", "10.0.0.10", "fd00::1", "fd00::a"]
_NAMES = st.frozensets(st.sampled_from(["z1", "z2", "node-a"]), max_size=2)

endpoints = st.builds(
    Endpoint,
    st.sampled_from(_POOL),
    st.sampled_from([80, 443, 8080]),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    _NAMES,
    _NAMES,
    st.booleans(),
)


def _sorted(items: list[Endpoint]) -> tuple[Endpoint, ...]:
    return tuple(sorted(items, key=lambda e: e.key))


@settings(max_examples=300, deadline=None)
@given(items=st.lists(endpoints, max_size=8), picks=st.lists(st.booleans(), max_size=8))
def test_rows_read_as_the_sorted_tuple_of_their_endpoints(
    items: list[Endpoint], picks: list[bool]
) -> None:
    rows = EndpointRows.of(items)
    expected = _sorted(items)
    assert tuple(rows) == expected and rows == expected and expected == rows
    assert len(rows) == len(expected) and bool(rows) == bool(expected)
    assert [rows[i] for i in range(len(rows))] == list(expected)
    if expected:
        assert rows[-1] == expected[-1]
    assert rows[1:3] == expected[1:3] and type(rows[1:3]) is EndpointRows
    # Backwards, the same endpoints as the tuple's slice; and whatever is rows is sorted.
    for backwards in (rows[::-1], rows[::-2], rows[-2::-1]):
        keys = endpoint_keys(backwards)
        assert type(backwards) is not EndpointRows or list(keys) == sorted(keys)
    assert rows[::-1] == expected[::-1] and rows[::-2] == expected[::-2]
    assert hash(rows) == hash(expected)
    assert EndpointRows.of(rows) is rows and EndpointRows.of(expected) == rows
    assert endpoint_keys(rows) == endpoint_keys(expected) == tuple(e.key for e in expected)
    assert endpoint_addresses(rows) == endpoint_addresses(expected)
    assert endpoint_ports(rows) == endpoint_ports(expected)
    chosen = [i for i, pick in zip(range(len(rows)), picks, strict=False) if pick]
    assert rows.take(chosen) == tuple(expected[i] for i in chosen)
    # The same endpoints built again are equal rows (what the slice tracker compares).
    again = EndpointRows.of(
        [Endpoint(e.address, e.port, flags=e.flags, hints=e.hints) for e in items]
    )
    assert again == rows


def test_rows_keep_one_port_and_shared_flags_and_no_hints_when_none_has_any() -> None:
    first = EndpointRows.of([Endpoint("10.0.0.2", 80), Endpoint("10.0.0.1", 80)])
    second = EndpointRows.of([Endpoint("10.0.0.3", 80), Endpoint("10.0.0.4", 80)])
    assert first.keys == ("10.0.0.1:80", "10.0.0.2:80")
    assert first.ports == (80, 80) and first.port_at(1) == 80
    assert first.hints is None and first.flags is second.flags
    hinted = EndpointRows.of([Endpoint("10.0.0.1", 80, zone_hints=frozenset({"z1"}))])
    assert hinted.hints == ((frozenset({"z1"}), frozenset()),)
    assert hinted != first and first != ("not", "endpoints")


def _slice(endpoints: list[dict[str, object]]) -> dict[str, object]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "web-abc",
            "namespace": "ns",
            "labels": {"kubernetes.io/service-name": "web"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def test_a_parsed_slice_holds_rows_sorted_with_its_conditions_and_hints() -> None:
    parsed = parse_endpoint_slice(
        _slice(
            [
                {"addresses": ["10.0.0.9"], "nodeName": "node-a"},
                {
                    "addresses": ["10.0.0.10"],
                    "conditions": {"ready": False, "serving": True, "terminating": True},
                    "nodeName": "node-b",
                    "hints": {"forZones": [{"name": "z1"}]},
                },
                {"addresses": ["10.0.0.1"]},
            ]
        ),
        IPFamily.IPV4,
        "node-a",
    )
    assert parsed is not None and type(parsed.endpoints) is EndpointRows
    # By key text: "10.0.0.10:8080" < "10.0.0.1:8080" < "10.0.0.9:8080".
    assert parsed.endpoints == (
        Endpoint(
            "10.0.0.10",
            8080,
            ready=False,
            terminating=True,
            zone_hints=frozenset({"z1"}),
            remote=True,
        ),
        Endpoint("10.0.0.1", 8080),
        Endpoint("10.0.0.9", 8080, is_local=True),
    )


def _port(internal_local: bool, external_local: bool, node_port: int) -> ServicePort:
    name = ServicePortName(NamespacedName("ns", "web"), "http", Protocol.TCP)
    return ServicePort(
        name,
        ipaddress.IPv4Address("10.96.0.1"),
        80,
        Protocol.TCP,
        node_port=node_port,
        internal_policy_local=internal_local,
        external_policy_local=external_local,
    )


def _reference(
    items: tuple[Endpoint, ...], port: ServicePort, node: str, zone: str
) -> tuple[tuple[Endpoint, ...], tuple[Endpoint, ...], tuple[Endpoint, ...], bool]:
    """Upstream's CategorizeEndpoints, one endpoint object at a time."""
    ready = [e for e in items if e.ready]
    cluster: tuple[Endpoint, ...] = ()
    has_any = False
    if port.uses_cluster_endpoints:
        chosen = ready
        if ready and all(e.node_hints for e in ready) and any(node in e.node_hints for e in ready):
            chosen = [e for e in ready if node in e.node_hints]
        elif (
            ready and all(e.zone_hints for e in ready) and any(zone in e.zone_hints for e in ready)
        ):
            chosen = [e for e in ready if zone in e.zone_hints]
        cluster = tuple(chosen) or tuple(e for e in items if e.serving and e.terminating)
        has_any = bool(cluster)
    if not port.uses_local_endpoints:
        return cluster, (), cluster, has_any
    has_any = has_any or any(e.ready or (e.serving and e.terminating) for e in items)
    local = tuple(e for e in ready if e.is_local) or tuple(
        e for e in items if e.is_local and e.serving and e.terminating
    )
    union = {e.key: e for e in cluster}
    for e in local:
        union.setdefault(e.key, e)
    reachable = _sorted(list(union.values())) if port.uses_cluster_endpoints else local
    return cluster, local, reachable, has_any


@settings(max_examples=400, deadline=None)
@given(
    items=st.lists(endpoints, max_size=8),
    internal_local=st.booleans(),
    external_local=st.booleans(),
    node_port=st.sampled_from([0, 30080]),
    zone=st.sampled_from(["z1", "z2"]),
)
def test_categorising_rows_picks_what_a_walk_over_the_objects_picks(
    items: list[Endpoint], internal_local: bool, external_local: bool, node_port: int, zone: str
) -> None:
    unique = _sorted(list({e.key: e for e in items}.values()))
    port = _port(internal_local, external_local, node_port)
    got = categorize_endpoints(EndpointRows.of(unique), port, "node-a", zone)
    assert (got.cluster, got.local, got.all_reachable, got.has_any) == _reference(
        unique, port, "node-a", zone
    )
