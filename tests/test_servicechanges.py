"""ServiceChangeTracker and ServicePortMap (kubeproxy.servicechanges)."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubeproxy.objects import IPAddress, IPFamily, NamespacedName, Protocol, ServicePortName
from kubeproxy.parse import InvalidObject, parse_service
from kubeproxy.servicechanges import ServiceChangeTracker, ServicePortMap, ServiceUpdateResult

V4 = IPFamily.IPV4
WEB = NamespacedName("ns", "web")
DNS = NamespacedName("ns", "dns")


def service(
    name: str = "web",
    cluster_ip: str = "10.96.0.10",
    ports: list[dict[str, Any]] | None = None,
    namespace: str = "ns",
    **spec: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "clusterIP": cluster_ip,
        "ports": [{"name": "http", "port": 80}] if ports is None else ports,
    }
    body.update(spec)
    return {"metadata": {"namespace": namespace, "name": name}, "spec": body}


def udp(*numbers: int) -> list[dict[str, Any]]:
    return [{"name": f"p{n}", "port": n, "protocol": "UDP"} for n in numbers]


def test_add_apply_update_delete() -> None:
    tracker = ServiceChangeTracker(V4)
    ports = ServicePortMap()
    web = service()
    assert tracker.update(None, web) is True
    assert tracker.pending_count == 1
    result = ports.apply(tracker)
    assert result.updated_services == {WEB}
    assert result.deleted_udp_cluster_ips == frozenset()
    assert dict(ports) == parse_service(web, V4)
    assert tracker.pending_count == 0

    changed = service(ports=[{"name": "https", "port": 443}])
    assert tracker.update(web, changed) is True
    result = ports.apply(tracker)
    assert result.updated_services == {WEB}
    assert list(ports) == [ServicePortName(WEB, "https", Protocol.TCP)]

    assert tracker.update(changed, None) is True
    result = ports.apply(tracker)
    assert result.updated_services == {WEB}
    assert dict(ports) == {}
    assert tracker.total_changes == 3


def test_add_then_delete_before_apply_is_nothing() -> None:
    tracker = ServiceChangeTracker(V4)
    web = service()
    assert tracker.update(None, web) is True
    assert tracker.update(web, None) is False
    assert tracker.pending_count == 0
    ports = ServicePortMap()
    assert ports.apply(tracker) == ServiceUpdateResult(frozenset(), frozenset())


def test_no_op_update_and_revert_collapse() -> None:
    tracker = ServiceChangeTracker(V4)
    ports = ServicePortMap()
    web = service()
    tracker.update(None, web)
    ports.apply(tracker)
    # A resync delivers the same object: nothing to do.
    assert tracker.update(web, dict(web)) is False
    # Change and change back before the sync: nothing to do either.
    other = service(cluster_ip="10.96.0.11")
    assert tracker.update(web, other) is True
    assert tracker.update(other, web) is False
    assert ports.apply(tracker).updated_services == frozenset()
    # Only the proxied parts count: a label change is no change.
    labelled = service()
    labelled["metadata"]["labels"] = {"app": "web"}
    assert tracker.update(web, labelled) is False


def test_update_returns_whether_anything_is_pending() -> None:
    tracker = ServiceChangeTracker(V4)
    tracker.update(None, service())
    dns = service("dns", "10.96.0.53")
    # This call changes nothing (same object twice) but another change is pending.
    assert tracker.update(None, dns) is True
    assert tracker.update(dns, dns) is True
    assert tracker.pending_count == 2
    assert tracker.update(None, None) is True


def test_deleted_udp_cluster_ips() -> None:
    tracker = ServiceChangeTracker(V4)
    ports = ServicePortMap()
    dns = service("dns", "10.96.0.53", ports=udp(53, 5353))
    tcp = service("web", "10.96.0.10")
    tracker.update(None, dns)
    tracker.update(None, tcp)
    ports.apply(tracker)
    assert ports.udp_cluster_ips() == {ipaddress.ip_address("10.96.0.53")}

    # One UDP port goes: the IP still has a UDP port, its flows are not stale.
    fewer = service("dns", "10.96.0.53", ports=udp(53))
    tracker.update(dns, fewer)
    assert ports.apply(tracker).deleted_udp_cluster_ips == frozenset()

    tracker.update(fewer, None)
    tracker.update(tcp, None)
    result = ports.apply(tracker)
    assert result.updated_services == {DNS, WEB}
    assert result.deleted_udp_cluster_ips == {ipaddress.ip_address("10.96.0.53")}
    assert ports.udp_cluster_ips() == frozenset()


def test_udp_to_tcp_reports_the_ip() -> None:
    tracker = ServiceChangeTracker(V4)
    ports = ServicePortMap()
    dns = service("dns", "10.96.0.53", ports=udp(53))
    tracker.update(None, dns)
    ports.apply(tracker)
    tcp_only = service("dns", "10.96.0.53", ports=[{"name": "p53", "port": 53}])
    tracker.update(dns, tcp_only)
    assert ports.apply(tracker).deleted_udp_cluster_ips == {ipaddress.ip_address("10.96.0.53")}


def test_health_check_node_ports() -> None:
    tracker = ServiceChangeTracker(V4)
    ports = ServicePortMap()
    lb = service(
        type="LoadBalancer",
        externalTrafficPolicy="Local",
        healthCheckNodePort=32100,
        ports=[{"name": "a", "port": 80, "nodePort": 30080}, {"name": "b", "port": 81}],
    )
    tracker.update(None, lb)
    tracker.update(None, service("dns", "10.96.0.53"))
    ports.apply(tracker)
    assert ports.health_check_node_ports() == {WEB: 32100}


def test_an_invalid_update_keeps_the_last_valid_ports(caplog: pytest.LogCaptureFixture) -> None:
    tracker = ServiceChangeTracker(V4)
    ports = ServicePortMap()
    web = service()
    dns = service("dns", "10.96.0.53", ports=udp(53))
    tracker.update(None, web)
    ports.apply(tracker)
    good = dict(ports)

    broken = service(externalIPs=["1.2.3.999"])
    with caplog.at_level(logging.WARNING):
        tracker.update(web, broken)
        tracker.update(None, dns)  # another Service in the same batch still works
        result = ports.apply(tracker)
    assert [r.getMessage() for r in caplog.records] == [
        "Service ns/web: spec.externalIPs[0]: invalid IP address '1.2.3.999'"
    ]
    assert caplog.records[0].levelno == logging.WARNING
    assert tracker.invalid_objects == 1
    assert result.updated_services == {DNS}
    assert {k: v for k, v in ports.items() if k.service == WEB} == good

    # Fixing it applies the fix; deleting the broken object removes the last good ports.
    fixed = service(cluster_ip="10.96.0.10", ports=[{"name": "http", "port": 8080}])
    tracker.update(broken, fixed)
    assert ports.apply(tracker).updated_services == {WEB}
    assert ports[ServicePortName(WEB, "http", Protocol.TCP)].port == 8080
    tracker.update(fixed, broken)
    tracker.update(broken, None)
    assert ports.apply(tracker).updated_services == {WEB}
    assert all(k.service != WEB for k in ports)
    assert tracker.invalid_objects == 2


def test_a_service_invalid_from_the_start(caplog: pytest.LogCaptureFixture) -> None:
    tracker = ServiceChangeTracker(V4)
    ports = ServicePortMap()
    broken = service(ports=[{"port": 80, "protocol": "HTTP"}])
    with caplog.at_level(logging.WARNING):
        assert tracker.update(None, broken) is False
    assert len(caplog.records) == 1
    assert "Service ns/web: spec.ports[0].protocol: unknown protocol 'HTTP'" in caplog.text
    assert ports.apply(tracker).updated_services == frozenset()
    # Its deletion is no change at all.
    assert tracker.update(broken, None) is False
    tracker.update(None, broken)
    tracker.update(broken, service())
    assert ports.apply(tracker).updated_services == {WEB}


@pytest.mark.parametrize(
    ("broken", "reason"),
    [
        (service(cluster_ip="10.96.0.256"), "spec.clusterIP: invalid IP address '10.96.0.256'"),
        (service(externalIPs=["fd00::1", "1.2.3"]), "spec.externalIPs[1]: invalid IP address"),
        (service(ports=[{"port": 65536}]), "spec.ports[0].port: 65536 is out of range"),
        (service(ports=[{"port": 80, "nodePort": 70000}]), "nodePort: 70000 is out of range"),
        (service(ports=[{"port": 80, "protocol": "ICMP"}]), "unknown protocol 'ICMP'"),
        (
            service(ports=[{"name": "a", "port": 80}, {"name": "a", "port": 81}]),
            "duplicate port a/TCP",
        ),
        (service(name="Bad_Name"), "metadata.name 'Bad_Name' is not a valid DNS-1123 label"),
        (
            service(loadBalancerSourceRanges=["10.0.0.0/40"]),
            "loadBalancerSourceRanges[0]: invalid CIDR",
        ),
        (
            service(
                sessionAffinity="ClientIP",
                sessionAffinityConfig={"clientIP": {"timeoutSeconds": 0}},
            ),
            "timeoutSeconds: 0 is out of range",
        ),
    ],
)
def test_each_malformed_service_is_one_log_line_and_others_still_apply(
    broken: dict[str, Any], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = ServiceChangeTracker(V4)
    ports = ServicePortMap()
    good = service("dns", "10.96.0.53", ports=udp(53))
    with caplog.at_level(logging.DEBUG, logger="kubeproxy"):
        tracker.update(None, broken)
        tracker.update(None, good)
        result = ports.apply(tracker)
    assert len(caplog.records) == 1, caplog.text
    record = caplog.records[0]
    assert record.levelno == logging.WARNING
    name = broken["metadata"]["name"]
    assert record.getMessage().startswith(f"Service ns/{name}: ")
    assert reason in record.getMessage()
    assert result.updated_services == {DNS}
    assert dict(ports) == parse_service(good, V4)


@pytest.mark.parametrize(
    "obj",
    [
        {"metadata": {"namespace": "ns"}, "spec": {}},
        {"metadata": {"name": "x"}, "spec": {}},
        {"spec": {}},
        {"metadata": {"namespace": "ns", "name": "UPPER"}, "spec": {}},
        "not an object",
    ],
)
@pytest.mark.parametrize("deleting", [False, True])
def test_objects_without_a_usable_name(
    obj: Any, deleting: bool, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = ServiceChangeTracker(V4)
    tracker.update(None, service())
    with caplog.at_level(logging.WARNING):
        pending = tracker.update(obj, None) if deleting else tracker.update(None, obj)
    assert pending is True  # the other Service's change is still pending
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith("Service ")
    assert tracker.invalid_objects == 1


def test_skipped_services_come_and_go() -> None:
    tracker = ServiceChangeTracker(V4)
    ports = ServicePortMap()
    external = service(type="ExternalName", externalName="example.com", cluster_ip="")
    tracker.update(None, external)
    assert tracker.pending_count == 0  # nothing to proxy, nothing pending
    normal = service()
    tracker.update(external, normal)
    assert ports.apply(tracker).updated_services == {WEB}
    headless = service(cluster_ip="None")
    tracker.update(normal, headless)
    assert ports.apply(tracker).updated_services == {WEB}
    assert dict(ports) == {}


def test_rename_is_delete_plus_add() -> None:
    tracker = ServiceChangeTracker(V4)
    ports = ServicePortMap()
    web = service()
    tracker.update(None, web)
    ports.apply(tracker)
    renamed = service("dns")
    tracker.update(web, renamed)
    assert ports.apply(tracker).updated_services == {WEB, DNS}
    assert {k.service for k in ports} == {DNS}


def test_ipv6_tracker_sees_ipv6_ports_only() -> None:
    tracker = ServiceChangeTracker(IPFamily.IPV6)
    ports = ServicePortMap()
    tracker.update(None, service())  # single-stack IPv4
    dual = service("dns", "10.96.0.53", clusterIPs=["10.96.0.53", "fd00::53"], ports=udp(53))
    tracker.update(None, dual)
    result = ports.apply(tracker)
    assert result.updated_services == {DNS}
    assert [str(p) for p in ports.values()] == ["[fd00::53]:53/UDP"]


def test_ipv6_tracker_follows_its_services_to_ipv4_and_through_renames() -> None:
    tracker = ServiceChangeTracker(IPFamily.IPV6)
    ports = ServicePortMap()
    web6 = service(cluster_ip="fd00::10")
    tracker.update(None, web6)
    ports.apply(tracker)
    assert {k.service for k in ports} == {WEB}
    # Renamed and IPv4 only now: the old name goes, though the new one is not IPv6's.
    dns4 = service("dns")
    tracker.update(web6, dns4)
    assert ports.apply(tracker).updated_services == {WEB}
    assert dict(ports) == {}
    # Back to IPv6 under the new name, then IPv4 only: held, so its ports go.
    dns6 = service("dns", "fd00::53")
    tracker.update(dns4, dns6)
    tracker.update(dns6, service("dns"))
    assert ports.apply(tracker).updated_services == frozenset()
    tracker.update(None, dns6)
    ports.apply(tracker)
    tracker.update(dns6, service("dns"))
    assert ports.apply(tracker).updated_services == {DNS}
    assert dict(ports) == {}
    assert tracker.total_changes == 6  # every event counted, passed over or not


def test_map_built_from_ports_counts_udp() -> None:
    initial = parse_service(service("dns", "10.96.0.53", ports=udp(53)), V4)
    ports = ServicePortMap(initial)
    assert dict(ports) == initial
    assert ports.udp_cluster_ips() == {ipaddress.ip_address("10.96.0.53")}


# ---------------------------------------------------------------------------------------
# Property: whatever the event sequence, the map is what the objects say, and the results
# are exactly the differences between consecutive applied states.

NAMES = [("ns", "a"), ("ns", "b"), ("other", "a")]
SHARED_UDP_IP = "10.96.1.1"


def _variants(index: int, namespace: str, name: str) -> list[dict[str, Any]]:
    own = f"10.96.0.{index + 1}"
    # Variants overlap on purpose (the same UDP port name and IP across variants, one
    # UDP IP shared by every Service) so that short event sequences hit the cases
    # where a UDP IP stays in use.
    return [
        service(name, own, namespace=namespace),
        service(name, own, namespace=namespace, ports=[*udp(53), {"name": "t", "port": 53}]),
        service(name, own, namespace=namespace, ports=udp(53, 5353)),
        service(name, SHARED_UDP_IP, namespace=namespace, ports=udp(53)),
        service(name, SHARED_UDP_IP, namespace=namespace, ports=udp(5353)),
        service(
            name,
            own,
            namespace=namespace,
            type="LoadBalancer",
            externalTrafficPolicy="Local",
            healthCheckNodePort=32000 + index,
            ports=[{"name": "http", "port": 80, "nodePort": 30000 + index}],
        ),
        service(name, "", namespace=namespace, type="ExternalName", externalName="x.example"),
        service(name, "fd00::1", namespace=namespace, ports=udp(53)),  # IPv6 only
        service(name, own, namespace=namespace, clusterIPs=[own, f"fd00::{index + 1}"]),
        service(name, "None", namespace=namespace),  # headless
        service(name, f"::ffff:{own}", namespace=namespace),  # IPv4, written as IPv6
        service(name, "fd00::1", namespace=namespace, ports=[{"port": 0}]),  # invalid
        service(name, own, namespace=namespace, ports=[{"port": 70000}]),  # invalid
    ]


VARIANTS = {key: _variants(i, *key) for i, key in enumerate(NAMES)}

events = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from(["set", "delete"]),
            st.integers(0, len(NAMES) - 1),
            st.integers(0, len(VARIANTS[NAMES[0]]) - 1),
        ),
        st.just(("apply", 0, 0)),
    ),
    max_size=40,
)


def _udp_ips(ports: Mapping[ServicePortName, Any]) -> set[IPAddress]:
    return {p.cluster_ip for p in ports.values() if p.protocol is Protocol.UDP}


def _by_service(ports: Mapping[ServicePortName, Any], key: NamespacedName) -> dict[Any, Any]:
    return {name: port for name, port in ports.items() if name.service == key}


@pytest.fixture(autouse=True)
def _restore_tracker_log_level() -> Iterator[None]:
    # The property test silences the (expected) invalid-object warnings; every later
    # test must get the logger back as it was (restored only at the module's end, the
    # tests of this module that read log lines failed when they ran after it).
    logger = logging.getLogger("kubeproxy.servicechanges")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.mark.parametrize("family", list(IPFamily))
@settings(max_examples=400, deadline=None)
@given(sequence=events)
def test_tracker_and_map_follow_the_objects(
    family: IPFamily, sequence: list[tuple[str, int, int]]
) -> None:
    # The IPv6 tracker passes over a Service with IPv4 cluster IPs only unless it holds
    # it (or the one it was renamed from): the same map as parsing each event.
    logging.getLogger("kubeproxy.servicechanges").setLevel(logging.CRITICAL)
    tracker = ServiceChangeTracker(family)
    ports = ServicePortMap()
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    last_valid: dict[tuple[str, str], dict[ServicePortName, Any]] = {}
    invalid_events = 0

    def check_apply() -> None:
        before = dict(ports)
        result = ports.apply(tracker)
        expected: dict[ServicePortName, Any] = {}
        for valid in last_valid.values():
            expected.update(valid)
        assert dict(ports) == expected
        candidates = {name.service for name in set(before) | set(expected)}
        changed = {k for k in candidates if _by_service(before, k) != _by_service(expected, k)}
        assert result.updated_services == changed
        assert result.deleted_udp_cluster_ips == _udp_ips(before) - _udp_ips(expected)
        assert ports.udp_cluster_ips() == _udp_ips(expected)
        grouped: dict[NamespacedName, set[ServicePortName]] = {}
        for name in expected:
            grouped.setdefault(name.service, set()).add(name)
        assert {s: set(n) for s, n in ports.ports_by_service.items()} == grouped
        # Each Service's names once each.
        assert all(len(set(n)) == len(n) for n in ports.ports_by_service.values())
        assert tracker.pending_count == 0

    for op, index, variant in sequence:
        key = NAMES[index]
        if op == "apply":
            check_apply()
            continue
        old = objects.get(key)
        if op == "delete":
            if old is None:
                continue
            tracker.update(old, None)
            del objects[key]
            last_valid.pop(key, None)
            continue
        new = VARIANTS[key][variant]
        tracker.update(old, new)
        objects[key] = new
        try:
            last_valid[key] = parse_service(new, family)
        except InvalidObject:
            invalid_events += 1
    check_apply()
    assert tracker.invalid_objects == invalid_events
