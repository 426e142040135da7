"""Health: ProxyHealth rules (fake clock), /healthz and /livez over real HTTP on
127.0.0.1 (codes, headers, exact JSON), the per-Service health-check listeners (codes,
body, headers, opening/closing/moving, bind failures), and the HealthObserver wired to a
real Proxier. A kernel test checks wildcard IPv4 and IPv6 listeners sharing a port inside
a network namespace of our own."""

from __future__ import annotations

import errno
import http.client
import ipaddress
import json
import os
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

import kubeproxy.host.httpserving as httpserving_module
from kubeproxy.backend import ProxySnapshot, SyncChanges, SyncError
from kubeproxy.config import ProxierConfig
from kubeproxy.health import (
    FAULT_RULES_REMOVED,
    FAULT_SYNC_FAILURES,
    DataPlaneFault,
    HealthObserver,
    ProxyHealth,
    ProxyHealthServer,
    ServiceHealthServer,
    format_time,
)
from kubeproxy.host.netns import in_netns as entered
from kubeproxy.metrics import ProxyMetrics
from kubeproxy.objects import IPAddress, IPFamily, NamespacedName, NodeInfo
from kubeproxy.proxier import ObserverGroup, Proxier

V4 = IPFamily.IPV4
V6 = IPFamily.IPV6
NODE = "node-a"
T0 = 1_767_323_045.0  # 2026-01-02T03:04:05Z
LOCALHOST = ipaddress.IPv4Address("127.0.0.1")


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing holds, never one handed out before: the kernel draws ``bind(0)``
    ports from about 14,000, so two draws in a test were equal once in 14,000 runs (20
    draws: 1 in 70), and a test that asked for two distinct ports saw one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    while True:
        with socket.socket(family) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def get(host: str, port: int, path: str = "/") -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection(host, port, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def nn(name: str) -> NamespacedName:
    return NamespacedName("demo", name)


# --- time format and health rules -----------------------------------------------------


@pytest.mark.parametrize(
    ("moment", "text"),
    [
        (None, "0001-01-01T00:00:00Z"),
        (0.0, "1970-01-01T00:00:00Z"),
        (T0, "2026-01-02T03:04:05Z"),
        (T0 + 0.5, "2026-01-02T03:04:05.5Z"),
        (T0 + 0.000125, "2026-01-02T03:04:05.000125Z"),
    ],
)
def test_format_time_is_go_rfc3339nano(moment: float | None, text: str) -> None:
    assert format_time(moment) == text


def test_health_follows_queued_and_updated_per_family() -> None:
    clock = Clock()
    health = ProxyHealth(60.0, clock, node=NodeInfo(NODE))
    # Nothing synced yet: healthy, even with a change queued for ages.
    health.queued_update(V4)
    clock.now += 600
    status = health.health()
    assert status.healthy and status.last_updated is None and not status.status

    health.updated(V4)
    assert health.health().status == {V4: health.health().status[V4]}
    assert health.health().status[V4].last_updated == clock.now

    # A change queued less than the timeout ago is fine; the oldest queue time counts.
    clock.now += 10
    health.queued_update(V4)
    clock.now += 30
    health.queued_update(V4)
    clock.now += 29.9
    assert health.healthy()
    clock.now += 0.1
    status = health.health()
    assert not status.healthy
    assert not status.status[V4].healthy
    assert status.current_time == clock.now

    # IPv6 syncs fine, but one unhealthy family makes the proxy unhealthy.
    health.updated(V6)
    assert not health.healthy()
    assert health.health().status[V6].healthy
    health.updated(V4)
    status = health.health()
    assert status.healthy
    assert status.last_updated == clock.now


def test_node_eligibility() -> None:
    health = ProxyHealth(60.0, Clock())
    assert not health.node_eligible()  # not known yet
    health.set_node(NodeInfo(NODE))
    assert health.node_eligible()
    health.set_node(NodeInfo(NODE, deleting=True))
    assert not health.node_eligible()
    health.set_node(NodeInfo(NODE, to_be_deleted_taint=True))
    assert not health.node_eligible()
    with pytest.raises(ValueError):
        ProxyHealth(0, Clock())


def test_data_plane_faults_are_kept_per_family_and_cause() -> None:
    clock = Clock()
    health = ProxyHealth(60.0, clock, node=NodeInfo(NODE))
    health.updated(V4)
    assert health.serving() and health.data_plane_faults() == ()

    health.report_data_plane_broken(V4, FAULT_RULES_REMOVED, "chain services deleted")
    clock.now += 1
    health.report_data_plane_broken(V6, FAULT_SYNC_FAILURES, "2 syncs in a row failed")
    status = health.health()
    assert status.healthy, "upstream's verdict is about waiting changes only"
    assert not status.serving and not health.serving()
    assert status.faults == (
        DataPlaneFault(V4, FAULT_RULES_REMOVED, "chain services deleted", T0),
        DataPlaneFault(V6, FAULT_SYNC_FAILURES, "2 syncs in a row failed", T0 + 1),
    )

    # Reporting again updates the reason and keeps the first time.
    clock.now += 1
    health.report_data_plane_broken(V4, FAULT_RULES_REMOVED, "map service-ips flushed")
    assert health.data_plane_faults()[0] == DataPlaneFault(
        V4, FAULT_RULES_REMOVED, "map service-ips flushed", T0
    )
    # A repair clears its own cause and family only.
    health.report_data_plane_repaired(V4, FAULT_SYNC_FAILURES)
    health.report_data_plane_repaired(V6, FAULT_RULES_REMOVED)
    assert len(health.data_plane_faults()) == 2
    health.report_data_plane_repaired(V4, FAULT_RULES_REMOVED)
    assert [f.family for f in health.data_plane_faults()] == [V6]
    health.report_data_plane_repaired(V6, FAULT_SYNC_FAILURES)
    assert health.serving() and health.data_plane_faults() == ()
    with pytest.raises(ValueError):
        health.report_data_plane_broken(V4, FAULT_RULES_REMOVED, "")


# --- /healthz and /livez --------------------------------------------------------------


@pytest.fixture
def proxy_health() -> Iterator[tuple[ProxyHealth, Clock, ProxyMetrics, ProxyHealthServer]]:
    clock = Clock()
    health = ProxyHealth(60.0, clock, node=NodeInfo(NODE))
    metrics = ProxyMetrics(process_metrics=False)
    server = ProxyHealthServer("127.0.0.1:0", health, metrics)
    server.start()
    try:
        yield health, clock, metrics, server
    finally:
        server.stop()


def failing_healthz(port: int) -> dict[str, Any]:
    """The body of a ``/healthz`` answer that must be a JSON 503."""
    status, headers, body = get("127.0.0.1", port, "/healthz")
    assert status == 503
    assert headers["content-type"] == "application/json"
    parsed: dict[str, Any] = json.loads(body)
    return parsed


def ipv4_unhealthy(*, current_time: str) -> dict[str, Any]:
    """The body when both families synced at T0 and IPv4 is unhealthy."""
    synced = "2026-01-02T03:04:05Z"
    return {
        "lastUpdated": synced,
        "currentTime": current_time,
        "nodeEligible": True,
        "healthy": False,
        "status": {
            "IPv4": {"lastUpdated": synced, "healthy": False},
            "IPv6": {"lastUpdated": synced, "healthy": True},
        },
    }


def counted(metrics: ProxyMetrics, name: str, code: str) -> float:
    line = f'kubeproxy_proxy_{name}_total{{code="{code}"}} '
    for text in metrics.expose().decode().splitlines():
        if text.startswith(line):
            return float(text[len(line) :])
    return 0.0


def test_healthz_and_livez_bodies_codes_and_headers(
    proxy_health: tuple[ProxyHealth, Clock, ProxyMetrics, ProxyHealthServer],
) -> None:
    health, clock, metrics, server = proxy_health
    assert server.port
    port = server.port

    # Starting up: healthy, no family yet; lastUpdated reported as now on a 200.
    status, headers, body = get("127.0.0.1", port, "/healthz")
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert headers["x-content-type-options"] == "nosniff"
    assert body == (
        b'{"lastUpdated":"2026-01-02T03:04:05Z","currentTime":"2026-01-02T03:04:05Z",'
        b'"nodeEligible":true,"healthy":true}'
    )

    health.updated(V4)
    health.updated(V6)
    clock.now += 5
    health.queued_update(V4)
    clock.now += 60.25
    failed = failing_healthz(port)
    assert failed == ipv4_unhealthy(current_time="2026-01-02T03:05:10.25Z")
    assert list(failed) == [
        "lastUpdated",
        "currentTime",
        "nodeEligible",
        "healthy",
        "status",
    ]
    status, _, body = get("127.0.0.1", port, "/livez")
    assert status == 503
    assert "nodeEligible" not in json.loads(body)

    health.updated(V4)
    status, _, body = get("127.0.0.1", port, "/livez")
    assert status == 200
    assert body == (
        b'{"lastUpdated":"2026-01-02T03:05:10.25Z","currentTime":"2026-01-02T03:05:10.25Z",'
        b'"healthy":true,"status":{"IPv4":{"lastUpdated":"2026-01-02T03:05:10.25Z",'
        b'"healthy":true},"IPv6":{"lastUpdated":"2026-01-02T03:04:05Z","healthy":true}}}'
    )

    # A node being deleted fails /healthz but not /livez.
    health.set_node(NodeInfo(NODE, to_be_deleted_taint=True))
    status, _, body = get("127.0.0.1", port, "/healthz")
    assert status == 503
    assert json.loads(body)["nodeEligible"] is False
    assert json.loads(body)["healthy"] is True
    assert get("127.0.0.1", port, "/livez")[0] == 200
    assert get("127.0.0.1", port, "/other")[0] == 404

    assert counted(metrics, "healthz", "200") == 1
    assert counted(metrics, "healthz", "503") == 2
    assert counted(metrics, "livez", "200") == 2
    assert counted(metrics, "livez", "503") == 1


def test_healthz_fails_with_the_reason_while_the_data_plane_is_broken(
    proxy_health: tuple[ProxyHealth, Clock, ProxyMetrics, ProxyHealthServer],
) -> None:
    health, clock, metrics, server = proxy_health
    assert server.port
    port = server.port
    health.updated(V4)
    health.updated(V6)
    clock.now += 2
    health.report_data_plane_broken(V4, FAULT_RULES_REMOVED, "table ip kube-proxy deleted")

    assert failing_healthz(port) == {
        **ipv4_unhealthy(current_time="2026-01-02T03:04:07Z"),
        "reason": "IPv4: table ip kube-proxy deleted",
    }
    # Liveness is not the data plane's business: a restart is not the repair.
    status, _, body = get("127.0.0.1", port, "/livez")
    assert status == 200 and "reason" not in json.loads(body)

    health.report_data_plane_broken(V6, FAULT_SYNC_FAILURES, "2 syncs in a row failed")
    reason = json.loads(get("127.0.0.1", port, "/healthz")[2])["reason"]
    assert reason == "IPv4: table ip kube-proxy deleted; IPv6: 2 syncs in a row failed"

    # Repaired: 200 again, with upstream's keys only.
    health.report_data_plane_repaired(V4, FAULT_RULES_REMOVED)
    health.report_data_plane_repaired(V6, FAULT_SYNC_FAILURES)
    status, _, body = get("127.0.0.1", port, "/healthz")
    assert status == 200
    assert list(json.loads(body)) == [
        "lastUpdated",
        "currentTime",
        "nodeEligible",
        "healthy",
        "status",
    ]
    assert counted(metrics, "healthz", "503") == 2
    assert counted(metrics, "healthz", "200") == 1


def test_health_server_on_ipv6_loopback() -> None:
    health = ProxyHealth(60.0, Clock(), node=NodeInfo(NODE))
    server = ProxyHealthServer("[::1]:0", health)
    server.start()
    try:
        assert server.port
        assert get("::1", server.port, "/livez")[0] == 200
    finally:
        server.stop()


# --- per-Service health checks --------------------------------------------------------


class ListenErrors:
    def __init__(self) -> None:
        self.seen: list[tuple[NamespacedName, int, str]] = []

    def __call__(self, service: NamespacedName, port: int, message: str) -> None:
        self.seen.append((service, port, message))


@pytest.fixture
def service_health() -> Iterator[tuple[ServiceHealthServer, ProxyHealth, Clock, ListenErrors]]:
    clock = Clock()
    health = ProxyHealth(60.0, clock, node=NodeInfo(NODE))
    errors = ListenErrors()
    server = ServiceHealthServer(
        V4, health, addresses=[LOCALHOST], node_name=NODE, on_listen_error=errors
    )
    try:
        yield server, health, clock, errors
    finally:
        server.close()


def expected_body(name: str, count: int, healthy: bool) -> bytes:
    return (
        "{\n"
        '\t"service": {\n'
        '\t\t"namespace": "demo",\n'
        f'\t\t"name": "{name}"\n'
        "\t},\n"
        f'\t"localEndpoints": {count},\n'
        f'\t"serviceProxyHealthy": {"true" if healthy else "false"}\n'
        "}"
    ).encode()


def test_service_health_answers(
    service_health: tuple[ServiceHealthServer, ProxyHealth, Clock, ListenErrors],
) -> None:
    server, health, clock, errors = service_health
    web, db = free_port(), free_port()
    server.sync_services({nn("web"): web, nn("db"): db})
    server.sync_endpoints({nn("web"): 2, nn("other"): 5})
    assert server.listening() == {nn("web"): [("127.0.0.1", web)], nn("db"): [("127.0.0.1", db)]}

    status, headers, body = get("127.0.0.1", web)
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["x-load-balancing-endpoint-weight"] == "2"
    assert body == expected_body("web", 2, True)
    status, headers, body = get("127.0.0.1", db, "/any/path")
    assert status == 503
    assert headers["x-load-balancing-endpoint-weight"] == "0"
    assert body == expected_body("db", 0, True)

    # An unhealthy proxy fails every health check, endpoints or not.
    health.updated(V4)
    health.queued_update(V4)
    clock.now += 61
    status, _, body = get("127.0.0.1", web)
    assert status == 503
    assert body == expected_body("web", 2, False)
    health.updated(V4)

    # So does a broken data plane, until it is repaired.
    health.report_data_plane_broken(V4, FAULT_RULES_REMOVED, "rules removed")
    status, headers, body = get("127.0.0.1", web)
    assert status == 503
    assert headers["x-load-balancing-endpoint-weight"] == "2"
    assert body == expected_body("web", 2, False)
    health.report_data_plane_repaired(V4, FAULT_RULES_REMOVED)
    assert get("127.0.0.1", web)[0] == 200

    # Endpoints absent from the map count as zero.
    server.sync_endpoints({})
    assert get("127.0.0.1", web)[0] == 503
    assert errors.seen == []


def test_service_health_listeners_open_close_and_move(
    service_health: tuple[ServiceHealthServer, ProxyHealth, Clock, ListenErrors],
) -> None:
    server, _, _, _ = service_health
    first, second = free_port(), free_port()
    server.sync_services({nn("web"): first})
    server.sync_endpoints({nn("web"): 1})
    assert get("127.0.0.1", first)[0] == 200

    # A new port closes the old listener and opens the new one (count starts at 0).
    server.sync_services({nn("web"): second})
    with pytest.raises(ConnectionRefusedError):
        get("127.0.0.1", first)
    assert get("127.0.0.1", second)[0] == 503
    server.sync_endpoints({nn("web"): 1})
    assert get("127.0.0.1", second)[0] == 200

    # Unchanged entries keep their listener and count.
    server.sync_services({nn("web"): second})
    assert get("127.0.0.1", second)[0] == 200

    # Moving to no address closes everything; moving back reopens at the next sync.
    server.set_addresses([])
    server.sync_services({nn("web"): second})
    assert server.listening() == {nn("web"): []}
    with pytest.raises(ConnectionRefusedError):
        get("127.0.0.1", second)
    server.set_addresses([LOCALHOST])
    server.sync_services({nn("web"): second})
    assert get("127.0.0.1", second)[0] == 503

    server.sync_services({})
    assert server.listening() == {}
    with pytest.raises(ConnectionRefusedError):
        get("127.0.0.1", second)
    with pytest.raises(ValueError):
        server.set_addresses([ipaddress.IPv6Address("::1")])


def test_service_health_bind_failure_is_reported_and_retried(
    service_health: tuple[ServiceHealthServer, ProxyHealth, Clock, ListenErrors],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, _, _, errors = service_health
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    good = free_port()
    try:
        server.sync_services({nn("web"): port, nn("db"): good})
        assert set(server.listening()) == {nn("db")}
        assert len(errors.seen) == 1
        service, failed_port, message = errors.seen[0]
        assert (service, failed_port) == (nn("web"), port)
        assert message.startswith(
            f'node {NODE} failed to start healthcheck "demo/web" on port {port}:'
        )
        assert "failed to start healthcheck" in caplog.text
        server.sync_services({nn("web"): port, nn("db"): good})
        assert len(errors.seen) == 2  # retried at every sync
    finally:
        blocker.close()
    server.sync_services({nn("web"): port, nn("db"): good})
    assert set(server.listening()) == {nn("web"), nn("db")}
    assert get("127.0.0.1", port)[0] == 503
    assert len(errors.seen) == 2


def test_service_health_partial_updates_touch_only_the_services_given(
    service_health: tuple[ServiceHealthServer, ProxyHealth, Clock, ListenErrors],
) -> None:
    server, _, _, errors = service_health
    web, db, moved = free_port(), free_port(), free_port()
    server.sync_services({nn("web"): web, nn("db"): db})
    server.sync_endpoints({nn("web"): 2})
    assert get("127.0.0.1", web)[1]["x-load-balancing-endpoint-weight"] == "2"

    # Only db changes: web keeps its listener and its count.
    server.update_services({nn("db"): (moved, 3)})
    assert server.listening().keys() == {nn("web"), nn("db")}
    assert server.listening()[nn("db")][0][1] == moved
    with pytest.raises(ConnectionRefusedError):
        get("127.0.0.1", db)
    assert get("127.0.0.1", moved)[1]["x-load-balancing-endpoint-weight"] == "3"
    assert get("127.0.0.1", web)[1]["x-load-balancing-endpoint-weight"] == "2"

    # A port that cannot be opened is retried at every later update, with its count.
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    try:
        server.update_services({nn("api"): (taken, 1), nn("db"): (0, 0)})
        assert server.listening().keys() == {nn("web")}
        assert [(s, p) for s, p, _ in errors.seen] == [(nn("api"), taken)]
        server.update_services({nn("web"): (web, 1)})
        assert len(errors.seen) == 2
    finally:
        blocker.close()
    server.update_services({})
    assert server.listening().keys() == {nn("web"), nn("api")}
    assert get("127.0.0.1", taken)[1]["x-load-balancing-endpoint-weight"] == "1"
    assert get("127.0.0.1", web)[1]["x-load-balancing-endpoint-weight"] == "1"
    server.update_services({nn("web"): (0, 0)})
    assert server.listening().keys() == {nn("api")}


def test_service_health_serves_concurrent_probes(
    service_health: tuple[ServiceHealthServer, ProxyHealth, Clock, ListenErrors],
) -> None:
    server, _, _, _ = service_health
    ports = {nn(f"svc-{i}"): free_port() for i in range(20)}
    server.sync_services(ports)
    server.sync_endpoints({name: 1 for name in ports})
    results: list[int] = []
    lock = threading.Lock()

    def probe(port: int) -> None:
        status = get("127.0.0.1", port)[0]
        with lock:
            results.append(status)

    threads = [threading.Thread(target=probe, args=(p,)) for p in ports.values() for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert results == [200] * 60


# --- wired to a proxier ---------------------------------------------------------------


class Backend:
    def __init__(self) -> None:
        self.failures: list[BaseException] = []

    @property
    def family(self) -> IPFamily:
        return V4

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        if self.failures:
            raise self.failures.pop(0)

    def cleanup(self) -> None:
        pass


def lb_service(hcnp: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "lb", "namespace": "demo"},
        "spec": {
            "type": "LoadBalancer",
            "clusterIP": "172.30.0.20",
            "externalTrafficPolicy": "Local",
            "healthCheckNodePort": hcnp,
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080}],
        },
    }


def lb_slice(endpoints: Sequence[tuple[str, str, bool]]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "lb-1",
            "namespace": "demo",
            "labels": {"kubernetes.io/service-name": "lb"},
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [ip],
                "nodeName": node,
                "conditions": {"ready": ready, "serving": ready, "terminating": False},
            }
            for ip, node, ready in endpoints
        ],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }


def test_health_observer_drives_health_and_service_checks() -> None:
    clock = Clock()
    health = ProxyHealth(60.0, clock)
    service_health = ServiceHealthServer(V4, health, node_name=NODE)
    observer = HealthObserver(health, {V4: service_health})
    backend = Backend()
    proxier = Proxier(
        V4,
        ProxierConfig(node_name=NODE, node_port_addresses=("localhost",)),
        backend,
        host_addresses=lambda: [LOCALHOST, ipaddress.IPv4Address("192.0.2.1")],
        observer=ObserverGroup([observer]),
        after_sync=[observer.after_sync],
        wall_clock=lambda: 0.0,
    )
    port = free_port()
    try:
        proxier.on_service_add(lb_service(port))
        proxier.on_endpoint_slice_add(
            lb_slice(
                [
                    ("10.244.0.5", NODE, True),
                    ("10.244.0.6", NODE, True),
                    ("10.244.1.5", "node-b", True),
                ]
            )
        )
        assert not health.node_eligible()
        proxier.on_services_synced()
        proxier.on_endpoint_slices_synced()
        # The node is known after the sync; health checks listen on localhost only.
        assert health.node_eligible()
        assert service_health.addresses == (LOCALHOST,)
        status, headers, body = get("127.0.0.1", port)
        assert status == 200
        assert headers["x-load-balancing-endpoint-weight"] == "2"
        assert body == expected_body("lb", 2, True)

        proxier.on_endpoint_slice_update(
            lb_slice([]), lb_slice([("10.244.0.5", NODE, False), ("10.244.1.5", "node-b", True)])
        )
        assert proxier.sync_now()
        assert get("127.0.0.1", port)[2] == expected_body("lb", 0, True)

        # A change waits while syncs fail: after the timeout the proxy is unhealthy.
        proxier.sync()  # queued (the runner is not running)
        backend.failures.append(SyncError("refused"))
        assert not proxier.sync_now()
        clock.now += 61
        assert not health.healthy()
        assert proxier.sync_now()
        assert health.healthy()

        proxier.on_service_delete(lb_service(port))
        assert proxier.sync_now()
        with pytest.raises(ConnectionRefusedError):
            get("127.0.0.1", port)
    finally:
        observer.close()


def test_syncs_failing_repeatedly_fail_healthz_and_health_checks_until_one_succeeds() -> None:
    clock = Clock()
    health = ProxyHealth(60.0, clock)
    service_health = ServiceHealthServer(V4, health, node_name=NODE)
    observer = HealthObserver(health, {V4: service_health}, sync_failure_threshold=2)
    healthz = ProxyHealthServer("127.0.0.1:0", health)
    backend = Backend()
    proxier = Proxier(
        V4,
        ProxierConfig(node_name=NODE, node_port_addresses=("localhost",)),
        backend,
        host_addresses=lambda: [LOCALHOST],
        observer=ObserverGroup([observer]),
        after_sync=[observer.after_sync],
        wall_clock=lambda: 0.0,
    )
    port = free_port()
    healthz.start()
    try:
        assert healthz.port
        proxier.on_service_add(lb_service(port))
        proxier.on_endpoint_slice_add(lb_slice([("10.244.0.5", NODE, True)]))
        proxier.on_services_synced()
        proxier.on_endpoint_slices_synced()
        assert get("127.0.0.1", port)[0] == 200
        assert get("127.0.0.1", healthz.port, "/healthz")[0] == 200

        # One failed sync is forgiven (the retry may mend it); the second is a fault,
        # long before a waiting change would time out.
        backend.failures += [SyncError("nft: Operation not permitted\n(details)")] * 3
        assert not proxier.sync_now()
        assert health.serving()
        assert not proxier.sync_now()
        assert health.healthy() and not health.serving()
        status, _, body = get("127.0.0.1", healthz.port, "/healthz")
        assert status == 503
        assert json.loads(body)["reason"] == (
            "IPv4: 2 syncs in a row failed, the last (full): nft: Operation not permitted"
        )
        assert get("127.0.0.1", port)[0] == 503
        assert not proxier.sync_now()
        assert (
            "3 syncs in a row"
            in json.loads(get("127.0.0.1", healthz.port, "/healthz")[2])["reason"]
        )

        # A successful sync repairs it.
        assert proxier.sync_now()
        assert health.serving()
        assert get("127.0.0.1", healthz.port, "/healthz")[0] == 200
        assert get("127.0.0.1", port)[0] == 200
    finally:
        healthz.stop()
        observer.close()
    with pytest.raises(ValueError):
        HealthObserver(health, sync_failure_threshold=0)


# --- kernel: wildcard listeners in a namespace of our own -----------------------------


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"kpxm-h{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def in_namespace(namespace: str, action: Callable[[], Any]) -> Any:
    with entered(namespace):
        return action()


@pytest.mark.kernel
def test_wildcard_listeners_of_both_families_share_ports(namespace: str) -> None:
    health = ProxyHealth(60.0, Clock(), node=NodeInfo(NODE))
    ipv4 = ServiceHealthServer(V4, health)
    ipv6 = ServiceHealthServer(V6, health)
    port = 30111
    try:
        in_namespace(namespace, lambda: ipv4.sync_services({nn("web"): port}))
        in_namespace(namespace, lambda: ipv6.sync_services({nn("web"): port}))
        ipv4.sync_endpoints({nn("web"): 1})
        ipv6.sync_endpoints({nn("web"): 3})
        assert ipv4.listening() == {nn("web"): [("0.0.0.0", port)]}
        assert ipv6.listening() == {nn("web"): [("::", port)]}

        def probe(host: str) -> tuple[int, dict[str, str], bytes]:
            return in_namespace(namespace, lambda: get(host, port))  # type: ignore[no-any-return]

        assert probe("127.0.0.1")[1]["x-load-balancing-endpoint-weight"] == "1"
        assert probe("::1")[1]["x-load-balancing-endpoint-weight"] == "3"
        addresses: list[IPAddress] = [ipaddress.IPv6Address("::1")]
        in_namespace(namespace, lambda: ipv6.set_addresses(addresses))
        in_namespace(namespace, lambda: ipv6.sync_services({nn("web"): port}))
        assert ipv6.listening() == {nn("web"): [("::1", port)]}
        assert probe("::1")[0] == 503
    finally:
        ipv4.close()
        ipv6.close()


@pytest.mark.kernel
def test_wildcard_health_address_is_dual_stack(namespace: str) -> None:
    health = ProxyHealth(60.0, Clock(), node=NodeInfo(NODE))
    server = ProxyHealthServer("0.0.0.0:0", health)
    in_namespace(namespace, server.start)
    try:
        port = server.port
        assert port
        assert in_namespace(namespace, lambda: get("127.0.0.1", port, "/healthz"))[0] == 200
        assert in_namespace(namespace, lambda: get("::1", port, "/livez"))[0] == 200
    finally:
        server.stop()


@pytest.mark.kernel
def test_wildcard_falls_back_to_ipv4_when_ipv6_is_missing(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = httpserving_module._RoutedServer

    class WithoutIPv6(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, dual_stack: bool = True, **kwargs: Any) -> None:
            if dual_stack:
                raise OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))
            super().__init__(*args, dual_stack=False, **kwargs)

    monkeypatch.setattr(httpserving_module, "_RoutedServer", WithoutIPv6)
    server = ProxyHealthServer("0.0.0.0:0", ProxyHealth(60.0, Clock(), node=NodeInfo(NODE)))
    in_namespace(namespace, server.start)
    try:
        port = server.port
        assert port
        assert in_namespace(namespace, lambda: get("127.0.0.1", port, "/healthz"))[0] == 200
        with pytest.raises(ConnectionRefusedError):
            in_namespace(namespace, lambda: get("::1", port, "/healthz"))
    finally:
        server.stop()
