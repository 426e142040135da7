"""EndpointsChangeTracker and EndpointsMap (kubeproxy.endpointchanges)."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubeproxy.endpointchanges import (
    EndpointsChangeTracker,
    EndpointsMap,
    merge_endpoint_slices,
    same_owner,
)
from kubeproxy.objects import Endpoint, IPFamily, NamespacedName, Protocol, ServicePortName
from kubeproxy.parse import (
    LABEL_SERVICE_NAME,
    InvalidObject,
    ParsedEndpointSlice,
    parse_endpoint_slice,
)

V4 = IPFamily.IPV4
NODE = "node-1"
WEB = NamespacedName("ns", "web")
DNS = NamespacedName("ns", "dns")
HTTP = ServicePortName(WEB, "http", Protocol.TCP)
ip = ipaddress.ip_address


def ep(address: str, **conditions: Any) -> dict[str, Any]:
    node = conditions.pop("node", None)
    entry: dict[str, Any] = {"addresses": [address]}
    if conditions:
        entry["conditions"] = conditions
    if node is not None:
        entry["nodeName"] = node
    return entry


def endpoint_slice(
    name: str,
    endpoints: list[dict[str, Any]],
    ports: list[dict[str, Any]] | None = None,
    *,
    service: str = "web",
    address_type: str = "IPv4",
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "namespace": "ns",
        "name": name,
        "labels": {"kubernetes.io/service-name": service},
    }
    if annotations:
        metadata["annotations"] = annotations
    return {
        "metadata": metadata,
        "addressType": address_type,
        "ports": [{"name": "http", "port": 80, "protocol": "TCP"}] if ports is None else ports,
        "endpoints": endpoints,
    }


def keys(endpoints: Sequence[Endpoint]) -> list[str]:
    return [e.key for e in endpoints]


def tracked(*slices: dict[str, Any]) -> tuple[EndpointsChangeTracker, EndpointsMap]:
    tracker = EndpointsChangeTracker(V4, NODE)
    endpoints = EndpointsMap()
    for obj in slices:
        tracker.update(obj, False)
    endpoints.apply(tracker)
    return tracker, endpoints


def test_merge_across_slices_sorted_by_string() -> None:
    _, endpoints = tracked(
        endpoint_slice("web-1", [ep("10.0.0.2"), ep("10.0.0.10")]),
        endpoint_slice("web-2", [ep("10.0.0.1"), ep("9.0.0.1")]),
    )
    # String order, as upstream: "10.0.0.10:80" < "10.0.0.1:80"? No: ':' > '0'.
    assert keys(endpoints[HTTP]) == ["10.0.0.10:80", "10.0.0.1:80", "10.0.0.2:80", "9.0.0.1:80"]


def test_multi_port_slices() -> None:
    ports = [
        {"name": "http", "port": 8080},
        {"name": "dns", "port": 53, "protocol": "UDP"},
        {"name": "dns", "port": 53, "protocol": "TCP"},
    ]
    _, endpoints = tracked(endpoint_slice("web-1", [ep("10.0.0.1"), ep("10.0.0.2")], ports))
    assert set(endpoints) == {
        HTTP,
        ServicePortName(WEB, "dns", Protocol.UDP),
        ServicePortName(WEB, "dns", Protocol.TCP),
    }
    assert keys(endpoints[HTTP]) == ["10.0.0.1:8080", "10.0.0.2:8080"]
    assert endpoints[ServicePortName(WEB, "dns", Protocol.UDP)] == (
        Endpoint(ip("10.0.0.1"), 53),
        Endpoint(ip("10.0.0.2"), 53),
    )


def test_slices_with_different_port_numbers_for_one_port_name() -> None:
    # A rolling update that changes the target port: both numbers are served meanwhile.
    _, endpoints = tracked(
        endpoint_slice("web-1", [ep("10.0.0.1")], [{"name": "http", "port": 80}]),
        endpoint_slice("web-2", [ep("10.0.0.2")], [{"name": "http", "port": 8080}]),
    )
    assert keys(endpoints[HTTP]) == ["10.0.0.1:80", "10.0.0.2:8080"]


@pytest.mark.parametrize("terminating_first", [True, False])
def test_duplicates_prefer_the_non_terminating_copy(terminating_first: bool) -> None:
    old = ep("10.0.0.1", ready=False, serving=True, terminating=True, node="node-9")
    new = ep("10.0.0.1", node=NODE)
    first, second = (old, new) if terminating_first else (new, old)
    _, endpoints = tracked(
        endpoint_slice("web-a", [first]),
        endpoint_slice("web-b", [second]),
    )
    assert endpoints[HTTP] == (Endpoint(ip("10.0.0.1"), 80, is_local=True),)


def test_ports_without_endpoints_are_absent() -> None:
    _, endpoints = tracked(
        endpoint_slice("web-1", []),
        endpoint_slice("dns-1", [{"addresses": []}], service="dns"),
    )
    assert dict(endpoints) == {}


def test_null_ports_and_endpoints() -> None:
    obj = endpoint_slice("web-1", [])
    obj["ports"] = None
    obj["endpoints"] = None
    tracker, endpoints = tracked(obj)
    assert dict(endpoints) == {}
    assert tracker.invalid_objects == 0


def test_change_detection() -> None:
    tracker = EndpointsChangeTracker(V4, NODE)
    endpoints = EndpointsMap()
    a = endpoint_slice("web-1", [ep("10.0.0.1")])
    b = endpoint_slice("web-1", [ep("10.0.0.2")])
    assert tracker.update(a, remove=True) is False  # unknown slice: nothing to remove
    assert tracker.update(a, False) is True
    assert tracker.update(a, False) is False  # same as pending
    assert tracker.pending_count == 1
    assert endpoints.apply(tracker).updated_services == {WEB}
    assert tracker.pending_count == 0
    assert tracker.update(a, False) is False  # same as applied
    # Reordering endpoints is no change.
    two = endpoint_slice("web-1", [ep("10.0.0.1"), ep("10.0.0.3")])
    two_reordered = endpoint_slice("web-1", [ep("10.0.0.3"), ep("10.0.0.1")])
    assert tracker.update(two, False) is True
    assert tracker.update(two_reordered, False) is False
    # Changing and changing back: each event needs a sync, but the result is no change.
    assert tracker.update(b, False) is True
    assert tracker.update(two, False) is True
    assert tracker.pending_count == 1
    assert tracker.update(a, False) is True
    assert tracker.pending_count == 0
    assert endpoints.apply(tracker).updated_services == frozenset()
    # Removing a known slice is a change; removing it twice is not.
    assert tracker.update(a, True) is True
    assert tracker.update(a, True) is False
    assert endpoints.apply(tracker).updated_services == {WEB}
    assert dict(endpoints) == {}
    assert tracker.total_changes == 11


def test_an_endpoint_moving_between_slices_is_no_update() -> None:
    tracker, endpoints = tracked(
        endpoint_slice("web-1", [ep("10.0.0.1"), ep("10.0.0.2")]),
        endpoint_slice("web-2", []),
    )
    tracker.update(endpoint_slice("web-1", [ep("10.0.0.1")]), False)
    tracker.update(endpoint_slice("web-2", [ep("10.0.0.2")]), False)
    result = endpoints.apply(tracker)
    assert result.updated_services == frozenset()
    assert keys(endpoints[HTTP]) == ["10.0.0.1:80", "10.0.0.2:80"]


def test_other_address_types_are_ignored(caplog: pytest.LogCaptureFixture) -> None:
    tracker = EndpointsChangeTracker(V4, NODE)
    with caplog.at_level(logging.DEBUG):
        assert not tracker.update(
            endpoint_slice("web-6", [ep("fd00::1")], address_type="IPv6"), False
        )
        assert not tracker.update(
            endpoint_slice("web-f", [ep("example.com")], address_type="FQDN"), False
        )
        assert not tracker.update(endpoint_slice("web-6", [], address_type="IPv6"), True)
    assert caplog.records == []
    assert tracker.pending_count == 0 and tracker.total_changes == 0


def test_an_invalid_slice_is_logged_once_and_the_rest_applies(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tracker, endpoints = tracked(endpoint_slice("web-1", [ep("10.0.0.1")]))
    before = endpoints[HTTP]
    broken = endpoint_slice("web-1", [ep("10.0.0.1"), ep("10.0.0.300")])
    dns = endpoint_slice("dns-1", [ep("10.0.1.1")], service="dns")
    with caplog.at_level(logging.WARNING):
        assert tracker.update(broken, False) is False
        assert tracker.update(dns, False) is True
        result = endpoints.apply(tracker)
    assert [r.getMessage() for r in caplog.records] == [
        "EndpointSlice ns/web-1: endpoints[1].addresses[0]: invalid IP address '10.0.0.300'"
    ]
    assert tracker.invalid_objects == 1
    assert result.updated_services == {DNS}
    assert endpoints[HTTP] == before  # the last valid content stays
    # Deleting the broken slice needs only its name: it removes the last valid content.
    assert tracker.update(broken, True) is True
    assert endpoints.apply(tracker).updated_services == {WEB}
    assert HTTP not in endpoints


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda s: s["metadata"]["labels"].clear(), "label kubernetes.io/service-name is missing"),
        (lambda s: s["metadata"].pop("name"), "metadata.name is missing"),
        (lambda s: s["ports"][0].update(port=70000), "ports[0].port: 70000 is out of range"),
        (lambda s: s["ports"][0].update(protocol="QUIC"), "unknown protocol 'QUIC'"),
        (lambda s: s["endpoints"][0].update(addresses=["fd00::1"]), "is not an IPv4 address"),
    ],
)
def test_invalid_slices(mutate: Any, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    obj = endpoint_slice("web-1", [ep("10.0.0.1")])
    mutate(obj)
    tracker = EndpointsChangeTracker(V4, NODE)
    with caplog.at_level(logging.WARNING):
        assert tracker.update(obj, False) is False
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith("EndpointSlice ns/")
    assert reason in caplog.text
    assert tracker.pending_count == 0


def test_removal_of_a_slice_without_a_service_label_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    obj = endpoint_slice("web-1", [ep("10.0.0.1")])
    del obj["metadata"]["labels"]
    tracker = EndpointsChangeTracker(V4, NODE)
    with caplog.at_level(logging.WARNING):
        assert tracker.update(obj, True) is False
    assert len(caplog.records) == 1 and tracker.invalid_objects == 1


def test_stale_udp_endpoints_and_conntrack_cleanup() -> None:
    dns_ports = [{"name": "dns", "port": 53, "protocol": "UDP"}]
    tracker, endpoints = tracked(
        endpoint_slice("dns-1", [ep("10.0.0.1"), ep("10.0.0.2")], dns_ports, service="dns"),
        endpoint_slice("web-1", [ep("10.0.1.1"), ep("10.0.1.2")]),
    )
    udp_port = ServicePortName(DNS, "dns", Protocol.UDP)
    # A TCP-only change needs no conntrack cleanup and has no stale endpoints.
    tracker.update(endpoint_slice("web-1", [ep("10.0.1.1")]), False)
    result = endpoints.apply(tracker)
    assert result.updated_services == {WEB}
    assert result.stale_endpoints == ()
    assert result.conntrack_cleanup_required is False
    # A UDP endpoint going away (or only going not-ready) is reported when it is gone.
    tracker.update(
        endpoint_slice("dns-1", [ep("10.0.0.2", ready=False)], dns_ports, service="dns"), False
    )
    result = endpoints.apply(tracker)
    assert result.stale_endpoints == ((udp_port, Endpoint(ip("10.0.0.1"), 53)),)
    assert result.conntrack_cleanup_required is True
    # A UDP Service appearing needs a cleanup too (flows that hit the REJECT rule).
    tracker.update(endpoint_slice("new-1", [ep("10.0.2.1")], dns_ports, service="new"), False)
    result = endpoints.apply(tracker)
    assert result.stale_endpoints == ()
    assert result.conntrack_cleanup_required is True
    # Removing everything: both remaining UDP endpoints are stale.
    tracker.update(endpoint_slice("dns-1", [], dns_ports, service="dns"), True)
    result = endpoints.apply(tracker)
    assert result.stale_endpoints == ((udp_port, Endpoint(ip("10.0.0.2"), 53, ready=False)),)


def test_trigger_times() -> None:
    now = 1_700_000_000.0
    tracker = EndpointsChangeTracker(V4, NODE, clock=lambda: now)
    endpoints = EndpointsMap()

    def annotated(stamp: str, address: str = "10.0.0.1", service: str = "web") -> dict[str, Any]:
        return endpoint_slice(
            f"{service}-1",
            [ep(address)],
            service=service,
            annotations={"endpoints.kubernetes.io/last-change-trigger-time": stamp},
        )

    tracker.update(annotated("2023-11-14T22:13:21.5Z"), False)  # after start
    tracker.update(annotated("2023-11-14T22:13:25+00:00", "10.0.0.2"), False)
    tracker.update(annotated("2023-11-14T22:13:19Z", "10.0.0.3"), False)  # before start
    tracker.update(annotated("garbage", "10.0.0.4"), False)
    tracker.update(annotated("2023-11-14T22:13:22.123456789Z", service="dns"), False)
    result = endpoints.apply(tracker)
    assert result.last_change_trigger_times == {
        WEB: [now + 1.5, now + 5.0],
        DNS: [pytest.approx(now + 2.123456)],
    }
    assert endpoints.apply(tracker).last_change_trigger_times == {}
    # A deletion discards what was collected for the Service.
    tracker.update(annotated("2023-11-14T22:14:00Z", "10.0.0.9"), False)
    tracker.update(annotated("2023-11-14T22:14:00Z", "10.0.0.9"), True)
    assert endpoints.apply(tracker).last_change_trigger_times == {}


def test_local_ready_endpoints() -> None:
    ports = [{"name": "a", "port": 80}, {"name": "b", "port": 81}]
    tracker, endpoints = tracked(
        endpoint_slice(
            "web-1",
            [
                ep("10.0.0.1", node=NODE),
                ep("10.0.0.2", node=NODE, ready=False, serving=True, terminating=True),
                ep("10.0.0.3", node="other"),
                ep("10.0.0.4", node=NODE),
            ],
            ports,
        ),
        endpoint_slice("dns-1", [ep("10.0.1.1", node="other")], service="dns"),
        endpoint_slice(
            "db-1", [ep("10.0.2.1", node=NODE, ready=False, terminating=True)], service="db"
        ),
    )
    # Two distinct local ready IPs, each on two ports.
    assert endpoints.local_ready_endpoints() == {WEB: 2}
    tracker.update(endpoint_slice("web-1", [], ports), True)
    endpoints.apply(tracker)
    assert endpoints.local_ready_endpoints() == {}


def test_is_local_follows_the_node_name() -> None:
    tracker = EndpointsChangeTracker(V4, "")
    endpoints = EndpointsMap()
    tracker.update(endpoint_slice("web-1", [ep("10.0.0.1", node=""), ep("10.0.0.2")]), False)
    endpoints.apply(tracker)
    assert [e.is_local for e in endpoints[HTTP]] == [False, False]


# ---------------------------------------------------------------------------------------
# Property: whatever the event sequence, the map is the merge of the last valid content
# of every slice, and the results are exactly the differences between applied states.

SLOTS = [("web", "web-a"), ("web", "web-b"), ("dns", "dns-a")]
ADDRESSES = ["10.0.0.1", "10.0.0.2", "10.0.0.10"]
PORT_CHOICES: list[dict[str, Any]] = [
    {"name": "http", "port": 80},
    {"name": "http", "port": 8080},
    {"name": "dns", "port": 53, "protocol": "UDP"},
    {"name": "dns", "port": 53, "protocol": "TCP"},
    {"name": "all"},  # no number: skipped
]

endpoint_entries = st.builds(
    lambda address, ready, serving, terminating, local, zone: {
        "addresses": [address],
        "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
        "nodeName": NODE if local else "node-2",
        **({"hints": {"forZones": [{"name": zone}]}} if zone else {}),
    },
    st.sampled_from(ADDRESSES),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from([None, "z1"]),
)


@st.composite
def slice_objects(draw: st.DrawFn, slot: int) -> dict[str, Any]:
    service, name = SLOTS[slot]
    ports: list[dict[str, Any]] = draw(st.lists(st.sampled_from(PORT_CHOICES), max_size=3))
    entries = draw(st.lists(endpoint_entries, max_size=4))
    if draw(st.integers(0, 9)) == 0:
        entries.append({"addresses": ["10.0.0.999"]})  # invalid
    obj = endpoint_slice(name, entries, ports, service=service)
    if draw(st.integers(0, 9)) == 0:
        obj["endpoints"] = None
    return obj


events = st.lists(
    st.one_of(
        st.integers(0, len(SLOTS) - 1).flatmap(
            lambda slot: st.tuples(st.just("set"), st.just(slot), slice_objects(slot))
        ),
        st.tuples(st.just("delete"), st.integers(0, len(SLOTS) - 1), st.none()),
        st.tuples(
            st.just("other-family"),
            st.integers(0, len(SLOTS) - 1),
            st.just(endpoint_slice("x", [ep("fd00::1")], address_type="IPv6")),
        ),
        st.tuples(st.just("apply"), st.just(0), st.none()),
    ),
    max_size=30,
)


def reference_merge(
    slices: Mapping[tuple[str, str], ParsedEndpointSlice],
) -> dict[ServicePortName, tuple[Endpoint, ...]]:
    """An independent, naive merge: collect every candidate, then pick per IP:port."""
    candidates: dict[ServicePortName, dict[str, list[Endpoint]]] = {}
    for (_, _), parsed in sorted(slices.items(), key=lambda item: item[0][1]):
        for port_name, number, protocol in parsed.ports:
            name = ServicePortName(parsed.service, port_name, protocol)
            for e in parsed.endpoints:
                copy = Endpoint(
                    e.ip,
                    number,
                    is_local=e.is_local,
                    ready=e.ready,
                    serving=e.serving,
                    terminating=e.terminating,
                    zone_hints=e.zone_hints,
                    node_hints=e.node_hints,
                    remote=e.remote,
                )
                candidates.setdefault(name, {}).setdefault(copy.key, []).append(copy)
    merged: dict[ServicePortName, tuple[Endpoint, ...]] = {}
    for name, by_key in candidates.items():
        chosen = [
            next((c for c in copies if not c.terminating), copies[0]) for copies in by_key.values()
        ]
        merged[name] = tuple(sorted(chosen, key=lambda e: e.key))
    return merged


def _of(state: Mapping[ServicePortName, Any], service: NamespacedName) -> dict[Any, Any]:
    return {name: value for name, value in state.items() if name.service == service}


@pytest.fixture(autouse=True)
def _restore_kubeproxy_log_level() -> Iterator[None]:
    # The property test silences the (expected) invalid-object warnings; every later
    # test must get the logger back as it was (restored only at the module's end, the
    # tests of this module that read log lines failed when they ran after it).
    logger = logging.getLogger("kubeproxy")
    level = logger.level
    yield
    logger.setLevel(level)


@settings(max_examples=400, deadline=None)
@given(events)
def test_tracker_and_map_follow_the_slices(sequence: list[tuple[str, int, Any]]) -> None:
    logging.getLogger("kubeproxy").setLevel(logging.CRITICAL)
    tracker = EndpointsChangeTracker(V4, NODE)
    endpoints = EndpointsMap()
    objects: dict[int, dict[str, Any]] = {}
    last_valid: dict[tuple[str, str], ParsedEndpointSlice] = {}
    needed_sync = False

    def check_apply() -> None:
        nonlocal needed_sync
        before = dict(endpoints)
        result = endpoints.apply(tracker)
        expected = reference_merge(last_valid)
        assert dict(endpoints) == expected
        services = {name.service for name in set(before) | set(expected)}
        changed = {s for s in services if _of(before, s) != _of(expected, s)}
        assert result.updated_services == changed
        if not needed_sync:
            assert not changed  # no update asked for a sync: nothing may change
        stale = {
            (name, e.key)
            for name, old in before.items()
            if name.protocol is Protocol.UDP
            for e in old
            if e.key not in {n.key for n in expected.get(name, ())}
        }
        assert {(name, e.key) for name, e in result.stale_endpoints} == stale
        assert len(result.stale_endpoints) == len(stale)
        assert result.conntrack_cleanup_required == any(
            name.protocol is Protocol.UDP
            for name in set(before) | set(expected)
            if name.service in changed
        )
        local: dict[NamespacedName, set[Any]] = {}
        for name, current in expected.items():
            for e in current:
                if e.is_local and e.ready:
                    local.setdefault(name.service, set()).add(e.ip)
        assert endpoints.local_ready_endpoints() == {s: len(ips) for s, ips in local.items()}
        assert tracker.pending_count == 0
        needed_sync = False

    for op, slot, obj in sequence:
        if op == "apply":
            check_apply()
            continue
        if op == "other-family":
            assert tracker.update(obj, slot == 0) is False
            continue
        service, name = SLOTS[slot]
        if op == "delete":
            old = objects.pop(slot, None)
            if old is not None:
                needed_sync |= tracker.update(old, True)
                last_valid.pop((service, name), None)
            continue
        needed_sync |= tracker.update(obj, False)
        objects[slot] = obj
        try:
            parsed = parse_endpoint_slice(obj, V4, NODE)
        except InvalidObject:
            continue
        assert parsed is not None
        last_valid[(service, name)] = parsed
    check_apply()


def test_merge_endpoint_slices_directly() -> None:
    parsed = parse_endpoint_slice(endpoint_slice("web-1", [ep("10.0.0.1")]), V4, NODE)
    assert parsed is not None
    assert merge_endpoint_slices(WEB, [parsed]) == {HTTP: (Endpoint(ip("10.0.0.1"), 80),)}
    assert merge_endpoint_slices(WEB, []) == {}


def test_merge_takes_a_slice_built_with_a_tuple_of_endpoints() -> None:
    # ParsedEndpointSlice.endpoints is typed Endpoints (CHANGELOG): a library caller may
    # build one from a tuple; the merge of a lone one-port slice read the rows' columns.
    endpoints = (Endpoint(ip("10.0.0.1"), 80), Endpoint(ip("10.0.0.2"), 80))
    parsed = ParsedEndpointSlice(WEB, "web-1", "IPv4", (("http", 80, Protocol.TCP),), endpoints)
    assert merge_endpoint_slices(WEB, [parsed]) == {HTTP: endpoints}
    twice = ParsedEndpointSlice(
        WEB, "web-2", "IPv4", (("http", 80, Protocol.TCP),), (*endpoints, endpoints[0])
    )
    assert merge_endpoint_slices(WEB, [twice]) == {HTTP: endpoints}


# same_owner: the watch's common update skips validating both versions' keys.

_OWNER_VALUES = {
    "addressType": st.sampled_from(["IPv4", "IPv6", "FQDN", None, 4]),
    "namespace": st.sampled_from(["ns", "other", "", None, "Bad_NS"]),
    "name": st.sampled_from(["s1", "s2", "", None, "-bad-"]),
    "service": st.sampled_from(["svc", "other", "", None, "Bad_Svc", 7]),
}


@st.composite
def _owned_slices(draw: st.DrawFn) -> Any:
    """A slice-like object built from a few values of each part of its key, any of them
    missing or malformed (metadata or labels not even a mapping, now and then)."""
    values = {key: draw(strategy) for key, strategy in _OWNER_VALUES.items()}
    labels: Any = {} if values["service"] is None else {LABEL_SERVICE_NAME: values["service"]}
    if draw(st.integers(0, 9)) == 0:
        labels = "not a mapping"
    metadata: Any = {
        key: values[key] for key in ("namespace", "name") if values[key] is not None
    } | {"labels": labels}
    if draw(st.integers(0, 9)) == 0:
        metadata = None
    obj: dict[str, Any] = {"kind": "EndpointSlice", "metadata": metadata}
    if values["addressType"] is not None:
        obj["addressType"] = values["addressType"]
    return obj


@settings(max_examples=300)
@given(previous=_owned_slices(), current=_owned_slices(), family=st.sampled_from(IPFamily))
def test_same_owner_implies_the_same_tracking_key(
    previous: Any, current: Any, family: IPFamily
) -> None:
    """Whenever the raw comparison says "same owner", the validated keys agree (both
    valid and equal, or both untracked), so skipping the leave check loses nothing."""
    tracker = EndpointsChangeTracker(family, NODE)
    if same_owner(previous, current):
        assert tracker._key_of(previous) == tracker._key_of(current)


def test_an_update_of_endpoints_only_skips_the_leave_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tracker = EndpointsChangeTracker(IPFamily.IPV4, NODE)
    first = endpoint_slice("s1", [ep("10.0.0.1")])
    assert tracker.update(first, False)
    left: list[Any] = []

    def leave(*args: Any) -> bool:
        left.append(args)
        return False

    monkeypatch.setattr(tracker, "_leave", leave)
    second = endpoint_slice("s1", [ep("10.0.0.2")])
    assert tracker.update(second, False, previous=first)
    assert left == []
    moved = endpoint_slice("s1", [ep("10.0.0.2")], service="dns")
    tracker.update(moved, False, previous=second)
    assert len(left) == 1


def test_the_map_keys_ports_by_the_service_maps_own_names() -> None:
    """Keyed by the Service map's object when it has the port (one key object a port,
    not two), by the slice's own otherwise; equal either way."""
    service = NamespacedName("ns", "web")
    held = ServicePortName(NamespacedName("ns", "web"), "http", Protocol.TCP)
    other = ServicePortName(service, "dns", Protocol.UDP)
    tracker = EndpointsChangeTracker(V4, NODE)
    tracker.update(
        endpoint_slice(
            "web-1",
            [ep("10.0.0.1")],
            [{"name": "http", "port": 80}, {"name": "dns", "port": 53, "protocol": "UDP"}],
        ),
        False,
    )
    endpoints = EndpointsMap()
    endpoints.apply(tracker, {service: (other, held)})
    by_key = {name: name for name in endpoints}
    assert by_key[held] is held
    assert by_key[other] is other
    tracker.update(endpoint_slice("web-1", [ep("10.0.0.2")]), False)
    endpoints.apply(tracker, {})
    assert list(endpoints) == [held]
    assert next(iter(endpoints)) is not held
    assert keys(endpoints[held]) == ["10.0.0.2:80"]
