"""The Proxier glue: gating, full/partial syncs, failures, incremental categorization,
node and CIDR handling, and the dual-stack fan-out. Backends are recording fakes."""

from __future__ import annotations

import copy
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from ipaddress import ip_address, ip_network
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kubeproxy.proxier as proxier_module
from kubeproxy.backend import NodePortAddresses, ProxySnapshot, SyncChanges, SyncError
from kubeproxy.config import LocalDetectMode, LocalDetector, ProxierConfig
from kubeproxy.objects import (
    CategorizedEndpoints,
    Endpoint,
    IPAddress,
    IPFamily,
    IPNetwork,
    NamespacedName,
    NodeInfo,
    Protocol,
    ServicePort,
    ServicePortName,
)
from kubeproxy.proxier import DualStackProxier, FinishedSync, NullObserver, Proxier
from kubeproxy.sources.manifests import ManifestSource
from kubeproxy.topology import categorize_endpoints
from tests.test_runner import FakeClock as RunnerClock

V4 = IPFamily.IPV4
V6 = IPFamily.IPV6
NODE = "node-a"


# --- objects ------------------------------------------------------------------------


def service(
    name: str,
    ip: str = "172.30.0.10",
    *,
    ns: str = "demo",
    ports: Sequence[tuple[str, int, str]] = (("http", 80, "TCP"),),
    ips: Sequence[str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "clusterIP": ip,
        "ports": [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports],
    }
    if ips is not None:
        body["clusterIPs"] = list(ips)
    body.update(spec)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": body,
    }


def ep(
    ip: str,
    node: str = NODE,
    *,
    ready: bool = True,
    serving: bool | None = None,
    terminating: bool = False,
    zones: Sequence[str] = (),
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "addresses": [ip],
        "nodeName": node,
        "conditions": {
            "ready": ready,
            "serving": ready if serving is None else serving,
            "terminating": terminating,
        },
    }
    if zones:
        entry["hints"] = {"forZones": [{"name": z} for z in zones]}
    return entry


def endpoint_slice(
    name: str,
    svc: str,
    endpoints: Sequence[dict[str, Any]],
    *,
    ns: str = "demo",
    ports: Sequence[tuple[str, int, str]] = (("http", 8080, "TCP"),),
    address_type: str = "IPv4",
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {"kubernetes.io/service-name": svc},
        },
        "addressType": address_type,
        "endpoints": list(endpoints),
        "ports": [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports],
    }


def node_object(
    name: str = NODE,
    zone: str = "zone-a",
    addresses: Sequence[str] = ("192.168.50.2",),
    pod_cidrs: Sequence[str] = ("10.244.0.0/24",),
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}},
        "spec": {"podCIDRs": list(pod_cidrs)},
        "status": {"addresses": [{"type": "InternalIP", "address": a} for a in addresses]},
    }


def spn(name: str, port: str = "http", protocol: Protocol = Protocol.TCP) -> ServicePortName:
    return ServicePortName(NamespacedName("demo", name), port, protocol)


def nn(name: str) -> NamespacedName:
    return NamespacedName("demo", name)


# --- fakes --------------------------------------------------------------------------


@dataclass
class Recorded:
    """What one backend sync saw, copied (the snapshot's maps are live views)."""

    changes: SyncChanges
    node: NodeInfo
    services: dict[ServicePortName, ServicePort]
    endpoints: dict[ServicePortName, Sequence[Endpoint]]
    categorized: dict[ServicePortName, CategorizedEndpoints]
    service_cidrs: tuple[IPNetwork, ...]
    node_port_addresses: NodePortAddresses
    local_detector: LocalDetector
    views_read_only: bool

    @property
    def full(self) -> bool:
        return self.changes.full


class RecordingBackend:
    def __init__(self, family: IPFamily = V4) -> None:
        self._family = family
        self.syncs: list[Recorded] = []
        self.failures: list[BaseException] = []

    @property
    def family(self) -> IPFamily:
        return self._family

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        self.syncs.append(
            Recorded(
                changes=changes,
                node=snapshot.node,
                services=dict(snapshot.services),
                endpoints=dict(snapshot.endpoints),
                categorized=dict(snapshot.categorized),
                service_cidrs=snapshot.service_cidrs,
                node_port_addresses=snapshot.node_port_addresses,
                local_detector=snapshot.local_detector,
                views_read_only=all(
                    isinstance(m, MappingProxyType)
                    for m in (snapshot.services, snapshot.endpoints, snapshot.categorized)
                ),
            )
        )
        if self.failures:
            raise self.failures.pop(0)

    def cleanup(self) -> None:
        pass

    @property
    def last(self) -> Recorded:
        return self.syncs[-1]


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class RecordingObserver:
    queued: list[IPFamily] = field(default_factory=list)
    finished: list[FinishedSync] = field(default_factory=list)
    trigger_times: list[list[float]] = field(default_factory=list)

    def sync_queued(self, family: IPFamily) -> None:
        self.queued.append(family)

    def sync_finished(self, sync: FinishedSync) -> None:
        self.finished.append(sync)

    def endpoints_trigger_times(self, family: IPFamily, times: list[float]) -> None:
        self.trigger_times.append(times)


class Counting:
    """Wraps categorize_endpoints to count which ports get (re)categorized."""

    def __init__(self) -> None:
        self.ports: list[ServicePortName] = []

    def __call__(
        self, endpoints: Sequence[Endpoint], svc: ServicePort, node_name: str, zone: str
    ) -> CategorizedEndpoints:
        self.ports.append(svc.name)
        return categorize_endpoints(endpoints, svc, node_name, zone)

    def take(self) -> list[ServicePortName]:
        ports, self.ports = self.ports, []
        return sorted(ports)


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> Counting:
    counter = Counting()
    monkeypatch.setattr(proxier_module, "categorize_endpoints", counter)
    return counter


def make_proxier(
    family: IPFamily = V4,
    *,
    config: ProxierConfig | None = None,
    backend: RecordingBackend | None = None,
    node: NodeInfo | None = None,
    host_addresses: Callable[[], Sequence[IPAddress]] | None = None,
    clock: FakeClock | None = None,
    observer: RecordingObserver | None = None,
) -> tuple[Proxier, RecordingBackend]:
    backend = backend or RecordingBackend(family)
    proxier = Proxier(
        family,
        config or ProxierConfig(node_name=NODE),
        backend,
        node=node,
        host_addresses=host_addresses,
        clock=clock or FakeClock(),
        wall_clock=lambda: 0.0,
        observer=observer,
    )
    return proxier, backend


def initialized(proxier: Proxier) -> None:
    proxier.on_services_synced()
    proxier.on_endpoint_slices_synced()


def two_services(proxier: Proxier) -> None:
    proxier.on_service_add(service("web", "172.30.0.10"))
    proxier.on_service_add(service("db", "172.30.0.11", ports=[("sql", 5432, "TCP")]))
    proxier.on_endpoint_slice_add(endpoint_slice("web-1", "web", [ep("10.244.0.11")]))
    proxier.on_endpoint_slice_add(
        endpoint_slice("db-1", "db", [ep("10.244.0.20", "node-b")], ports=[("sql", 5432, "TCP")])
    )


# --- initialization -----------------------------------------------------------------


def test_nothing_synced_before_both_sources_synced() -> None:
    proxier, backend = make_proxier()
    two_services(proxier)
    assert not proxier.initialized
    assert proxier.sync_now() is False
    proxier.on_services_synced()
    assert not proxier.initialized
    assert backend.syncs == []
    proxier.on_endpoint_slices_synced()
    assert proxier.initialized
    assert len(backend.syncs) == 1
    first = backend.last
    assert first.full
    assert first.changes.changed_services == {nn("web"), nn("db")}
    assert set(first.services) == {spn("web"), spn("db", "sql")}
    assert [e.key for e in first.endpoints[spn("web")]] == ["10.244.0.11:8080"]
    assert first.categorized[spn("web")].cluster == first.endpoints[spn("web")]
    assert first.categorized[spn("db", "sql")].has_any
    assert first.views_read_only


def test_synced_in_other_order_also_syncs_once() -> None:
    proxier, backend = make_proxier()
    two_services(proxier)
    proxier.on_endpoint_slices_synced()
    assert backend.syncs == []
    proxier.on_services_synced()
    assert len(backend.syncs) == 1


def test_handlers_before_initialization_do_not_queue_syncs() -> None:
    observer = RecordingObserver()
    proxier, _ = make_proxier(observer=observer)
    two_services(proxier)
    assert observer.queued == []
    initialized(proxier)
    proxier.on_service_add(service("late", "172.30.0.99"))
    assert observer.queued == [V4]


def test_backend_family_must_match() -> None:
    with pytest.raises(ValueError):
        Proxier(V4, ProxierConfig(node_name=NODE), RecordingBackend(V6))


# --- full vs partial ----------------------------------------------------------------


def test_incremental_sync_lists_only_changed_services(counting: Counting) -> None:
    proxier, backend = make_proxier()
    two_services(proxier)
    initialized(proxier)
    counting.take()
    before = backend.last.categorized

    proxier.on_endpoint_slice_update(
        endpoint_slice("web-1", "web", [ep("10.244.0.11")]),
        endpoint_slice("web-1", "web", [ep("10.244.0.11"), ep("10.244.0.12")]),
    )
    assert proxier.sync_now()
    last = backend.last
    assert not last.full
    assert last.changes.changed_services == {nn("web")}
    assert counting.take() == [spn("web")]
    assert [e.key for e in last.categorized[spn("web")].cluster] == [
        "10.244.0.11:8080",
        "10.244.0.12:8080",
    ]
    # The untouched Service's categories are the very same object: not recomputed.
    assert last.categorized[spn("db", "sql")] is before[spn("db", "sql")]


def test_sync_without_changes_is_partial_and_empty(counting: Counting) -> None:
    proxier, backend = make_proxier()
    two_services(proxier)
    initialized(proxier)
    counting.take()
    assert proxier.sync_now()
    assert not backend.last.full
    assert backend.last.changes.changed_services == frozenset()
    assert counting.take() == []


def test_full_sync_after_full_sync_period() -> None:
    clock = FakeClock()
    proxier, backend = make_proxier(clock=clock)
    initialized(proxier)
    assert backend.last.full
    clock.t += 3599
    proxier.sync_now()
    assert not backend.last.full
    clock.t += 1
    proxier.sync_now()
    assert backend.last.full
    clock.t += 10
    proxier.sync_now()
    assert not backend.last.full


def test_full_sync_period_is_configurable() -> None:
    clock = FakeClock()
    backend = RecordingBackend()
    proxier = Proxier(V4, ProxierConfig(node_name=NODE), backend, clock=clock, full_sync_period=60)
    initialized(proxier)
    clock.t += 61
    proxier.sync_now()
    assert backend.last.full


# --- failures -----------------------------------------------------------------------


@pytest.mark.parametrize("failure", [SyncError("nft: no such chain"), RuntimeError("bug")])
def test_failure_makes_next_sync_full_and_keeps_changes(
    failure: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    observer = RecordingObserver()
    proxier, backend = make_proxier(observer=observer)
    two_services(proxier)
    initialized(proxier)

    backend.failures.append(failure)
    proxier.on_endpoint_slice_delete(endpoint_slice("web-1", "web", [ep("10.244.0.11")]))
    with caplog.at_level(logging.ERROR, logger="kubeproxy.proxier"):
        assert proxier.sync_now() is False
    [record] = caplog.records
    assert str(failure) in record.getMessage()
    assert bool(record.exc_info) == (not isinstance(failure, SyncError))
    failed = backend.last
    assert not failed.full
    assert observer.finished[-1].error is failure
    assert observer.finished[-1].full is False

    proxier.on_service_delete(service("db", "172.30.0.11", ports=[("sql", 5432, "TCP")]))
    assert proxier.sync_now()
    retry = backend.last
    assert retry.full
    # The change of the failed sync is still there, and still listed.
    assert retry.changes.changed_services == {nn("web"), nn("db")}
    assert spn("web") not in retry.endpoints
    assert retry.categorized[spn("web")] == CategorizedEndpoints()
    assert set(retry.services) == {spn("web")}
    assert set(retry.categorized) == {spn("web")}

    assert proxier.sync_now()
    assert not backend.last.full
    assert backend.last.changes.changed_services == frozenset()


def test_failures_accumulate_conntrack_hints() -> None:
    proxier, backend = make_proxier()
    proxier.on_service_add(service("dns", "172.30.0.53", ports=[("dns", 53, "UDP")]))
    proxier.on_service_add(service("dns2", "172.30.0.54", ports=[("dns", 53, "UDP")]))
    proxier.on_endpoint_slice_add(
        endpoint_slice(
            "dns-1", "dns", [ep("10.244.0.13"), ep("10.244.0.14")], ports=[("dns", 5353, "UDP")]
        )
    )
    initialized(proxier)
    backend.failures.append(SyncError("boom"))
    proxier.on_endpoint_slice_update(
        endpoint_slice("dns-1", "dns", [], ports=[("dns", 5353, "UDP")]),
        endpoint_slice("dns-1", "dns", [ep("10.244.0.13")], ports=[("dns", 5353, "UDP")]),
    )
    assert not proxier.sync_now()
    proxier.on_service_delete(service("dns2", "172.30.0.54", ports=[("dns", 53, "UDP")]))
    assert proxier.sync_now()
    changes = backend.last.changes
    assert changes.full
    assert changes.conntrack_cleanup_required
    assert changes.deleted_udp_cluster_ips == {ip_address("172.30.0.54")}
    assert [(name, e.key) for name, e in changes.stale_udp_endpoints] == [
        (spn("dns", "dns", Protocol.UDP), "10.244.0.14:5353")
    ]
    assert proxier.sync_now()
    assert backend.last.changes.stale_udp_endpoints == ()
    assert backend.last.changes.deleted_udp_cluster_ips == frozenset()
    assert not backend.last.changes.conntrack_cleanup_required


def test_observer_failure_does_not_break_sync(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(NullObserver):
        def sync_finished(self, *args: Any) -> None:
            raise RuntimeError("metrics down")

    backend = RecordingBackend()
    proxier = Proxier(V4, ProxierConfig(node_name=NODE), backend, observer=Broken())
    with caplog.at_level(logging.ERROR):
        initialized(proxier)
    assert len(backend.syncs) == 1
    assert "metrics down" in caplog.text


def test_observer_sees_queue_finish_and_trigger_times() -> None:
    observer = RecordingObserver()
    proxier, backend = make_proxier(observer=observer)
    two_services(proxier)
    initialized(proxier)
    assert observer.finished[-1] == FinishedSync(
        V4, True, observer.finished[-1].duration, None, 2, 2
    )
    updated = endpoint_slice("web-1", "web", [ep("10.244.0.12")])
    updated["metadata"]["annotations"] = {
        "endpoints.kubernetes.io/last-change-trigger-time": "2026-01-02T03:04:05Z"
    }
    proxier.on_endpoint_slice_update(updated, updated)
    assert observer.queued == [V4]
    backend.failures.append(SyncError("x"))
    proxier.sync_now()
    assert observer.trigger_times == []  # only after a successful sync
    proxier.sync_now()
    assert observer.trigger_times == [[1767323045.0]]


# --- categorized state --------------------------------------------------------------


def test_service_and_port_removal_drop_categories() -> None:
    proxier, backend = make_proxier()
    two_ports = service("web", ports=[("http", 80, "TCP"), ("https", 443, "TCP")])
    proxier.on_service_add(two_ports)
    proxier.on_endpoint_slice_add(
        endpoint_slice(
            "web-1",
            "web",
            [ep("10.244.0.11")],
            ports=[("http", 8080, "TCP"), ("https", 8443, "TCP")],
        )
    )
    initialized(proxier)
    assert set(backend.last.categorized) == {spn("web"), spn("web", "https")}
    one_port = service("web", ports=[("https", 443, "TCP")])
    proxier.on_service_update(two_ports, one_port)
    proxier.sync_now()
    assert set(backend.last.categorized) == {spn("web", "https")}
    assert set(backend.last.services) == {spn("web", "https")}
    # The endpoints map still has the port (the slice says so), the categories do not.
    assert spn("web") in backend.last.endpoints
    proxier.on_service_delete(one_port)
    proxier.sync_now()
    assert backend.last.categorized == {}
    assert backend.last.services == {}


def test_endpoints_arriving_before_their_service(counting: Counting) -> None:
    proxier, backend = make_proxier()
    initialized(proxier)
    proxier.on_endpoint_slice_add(endpoint_slice("web-1", "web", [ep("10.244.0.11")]))
    proxier.sync_now()
    assert backend.last.categorized == {}
    assert spn("web") in backend.last.endpoints
    counting.take()
    proxier.on_service_add(service("web"))
    proxier.sync_now()
    assert counting.take() == [spn("web")]
    assert [e.key for e in backend.last.categorized[spn("web")].cluster] == ["10.244.0.11:8080"]


def test_service_without_endpoints_gets_empty_categories() -> None:
    proxier, backend = make_proxier()
    proxier.on_service_add(service("web"))
    initialized(proxier)
    assert backend.last.categorized == {spn("web"): CategorizedEndpoints()}


def test_traffic_policy_local() -> None:
    proxier, backend = make_proxier()
    proxier.on_service_add(service("web", internalTrafficPolicy="Local"))
    proxier.on_endpoint_slice_add(
        endpoint_slice("web-1", "web", [ep("10.244.0.11"), ep("10.244.1.5", "node-b")])
    )
    initialized(proxier)
    categories = backend.last.categorized[spn("web")]
    assert [e.key for e in categories.local] == ["10.244.0.11:8080"]
    assert categories.cluster == ()
    assert categories.has_any


# --- node ---------------------------------------------------------------------------


ZONED = [ep("10.244.0.11", zones=["zone-a"]), ep("10.244.1.11", "node-b", zones=["zone-b"])]


def test_zone_change_recategorizes_everything_and_syncs_full(counting: Counting) -> None:
    proxier, backend = make_proxier()
    proxier.on_node_update(node_object(zone="zone-a"))
    two_services(proxier)
    proxier.on_endpoint_slice_update(
        endpoint_slice("web-1", "web", []), endpoint_slice("web-1", "web", ZONED)
    )
    initialized(proxier)
    assert [e.key for e in backend.last.categorized[spn("web")].cluster] == ["10.244.0.11:8080"]
    counting.take()
    proxier.sync_now()
    assert not backend.last.full

    proxier.on_node_update(node_object(zone="zone-b"))
    assert proxier.node.zone == "zone-b"
    proxier.sync_now()
    assert backend.last.full
    assert counting.take() == [spn("db", "sql"), spn("web")]
    assert [e.key for e in backend.last.categorized[spn("web")].cluster] == ["10.244.1.11:8080"]
    assert backend.last.node.zone == "zone-b"
    proxier.sync_now()
    assert not backend.last.full


def test_node_change_without_zone_change_is_full_but_not_recategorized(
    counting: Counting,
) -> None:
    calls: list[int] = []

    def host() -> list[IPAddress]:
        calls.append(1)
        return [ip_address("192.168.50.2"), ip_address("192.168.50.3")]

    config = ProxierConfig(node_name=NODE, node_port_addresses=("primary",))
    proxier, backend = make_proxier(config=config, host_addresses=host)
    proxier.on_node_update(node_object(addresses=["192.168.50.2"]))
    two_services(proxier)
    initialized(proxier)
    assert backend.last.node_port_addresses.addresses == (ip_address("192.168.50.2"),)
    assert len(calls) == 1
    counting.take()

    proxier.on_node_update(node_object(addresses=["192.168.50.3"]))
    proxier.sync_now()
    assert backend.last.full
    assert counting.take() == []
    assert backend.last.node_port_addresses.addresses == (ip_address("192.168.50.3"),)
    assert len(calls) == 2

    # An identical Node (a status heartbeat, say) changes nothing.
    proxier.on_node_update(node_object(addresses=["192.168.50.3"]))
    proxier.sync_now()
    assert not backend.last.full
    assert len(calls) == 2


def test_node_deletion_and_foreign_or_invalid_nodes_keep_last_node(
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxier, backend = make_proxier()
    proxier.on_node_update(node_object(zone="zone-a"))
    initialized(proxier)
    with caplog.at_level(logging.WARNING, logger="kubeproxy.proxier"):
        proxier.on_node_update(None)
    assert "node-a" in caplog.text and "deleted" in caplog.text
    proxier.on_node_update(node_object(name="node-b", zone="zone-z"))
    proxier.on_node_update({"kind": "Node", "metadata": {}})
    proxier.sync_now()
    assert backend.last.node.zone == "zone-a"
    assert backend.last.node.name == NODE
    assert not backend.last.full


def test_default_node_is_named_after_config() -> None:
    proxier, backend = make_proxier()
    initialized(proxier)
    assert backend.last.node == NodeInfo(name=NODE)


# --- node ports, local detector, service CIDRs --------------------------------------


def test_node_port_addresses_follow_the_host_when_told() -> None:
    host = [ip_address("192.168.50.2"), ip_address("10.0.0.1"), ip_address("127.0.0.1")]
    calls: list[int] = []

    def host_addresses() -> list[IPAddress]:
        calls.append(1)
        return list(host)

    clock = FakeClock()
    config = ProxierConfig(node_name=NODE, node_port_addresses=("192.168.50.0/24", "localhost"))
    proxier, backend = make_proxier(config=config, host_addresses=host_addresses, clock=clock)
    initialized(proxier)
    assert backend.last.node_port_addresses == NodePortAddresses(
        match_all=False,
        addresses=(ip_address("127.0.0.1"), ip_address("192.168.50.2")),
        cidrs=(ip_network("192.168.50.0/24"), ip_network("127.0.0.0/8")),
    )
    # A partial sync does not read them.
    proxier.on_service_add(service("web"))
    proxier.sync_now()
    assert len(calls) == 1 and not backend.last.full
    # Told of a change, a sync reads them; unchanged, it stays partial.
    proxier.host_addresses_changed()
    proxier.sync_now()
    assert len(calls) == 2 and not backend.last.full
    # A new address in the CIDRs is served by the next sync, a full one.
    host.append(ip_address("192.168.50.9"))
    proxier.host_addresses_changed()
    proxier.sync_now()
    assert len(calls) == 3
    assert backend.last.full
    assert ip_address("192.168.50.9") in backend.last.node_port_addresses.addresses
    # And one that goes away, too.
    host.remove(ip_address("192.168.50.2"))
    proxier.host_addresses_changed()
    proxier.sync_now()
    assert backend.last.full
    assert ip_address("192.168.50.2") not in backend.last.node_port_addresses.addresses
    proxier.sync_now()
    assert len(calls) == 4 and not backend.last.full


def test_host_address_failure_keeps_previous_and_retries(
    caplog: pytest.LogCaptureFixture,
) -> None:
    results: list[list[IPAddress] | Exception] = [
        [ip_address("192.168.50.2")],
        OSError("netlink down"),
        [ip_address("192.168.50.2"), ip_address("192.168.50.7")],
    ]

    def host_addresses() -> list[IPAddress]:
        result = results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    clock = FakeClock()
    config = ProxierConfig(node_name=NODE, node_port_addresses=("192.168.50.0/24",))
    proxier, backend = make_proxier(config=config, host_addresses=host_addresses, clock=clock)
    initialized(proxier)
    clock.t += 3600
    with caplog.at_level(logging.ERROR, logger="kubeproxy.proxier"):
        assert proxier.sync_now()
    assert "netlink down" in caplog.text
    assert backend.last.node_port_addresses.addresses == (ip_address("192.168.50.2"),)
    # Logged once per outage; the retry at the next sync finds the new address.
    proxier.sync_now()
    assert backend.last.full
    assert caplog.text.count("netlink down") == 1
    assert list(backend.last.node_port_addresses.addresses) == [
        ip_address("192.168.50.2"),
        ip_address("192.168.50.7"),
    ]


def test_without_host_addresses_node_addresses_stand_in() -> None:
    config = ProxierConfig(node_name=NODE, node_port_addresses=("primary",))
    proxier, backend = make_proxier(config=config)
    proxier.on_node_update(node_object(addresses=["192.168.50.2", "fd00::2"]))
    initialized(proxier)
    assert backend.last.node_port_addresses.addresses == (ip_address("192.168.50.2"),)


def test_default_node_port_addresses_match_all() -> None:
    proxier, backend = make_proxier(host_addresses=lambda: [ip_address("192.168.50.2")])
    initialized(proxier)
    assert backend.last.node_port_addresses.match_all


def test_local_detector_node_cidr_comes_from_the_node() -> None:
    config = ProxierConfig(node_name=NODE, local_detector=LocalDetector(LocalDetectMode.NODE_CIDR))
    proxier, backend = make_proxier(config=config)
    initialized(proxier)
    assert not backend.last.local_detector.implemented
    proxier.on_node_update(node_object(pod_cidrs=["fd00:244::/64", "10.244.3.0/24"]))
    proxier.sync_now()
    assert backend.last.local_detector == LocalDetector(
        LocalDetectMode.NODE_CIDR, (ip_network("10.244.3.0/24"),)
    )
    v6, backend6 = make_proxier(V6, config=config)
    v6.on_node_update(node_object(pod_cidrs=["10.244.3.0/24", "fd00:244::/64"]))
    initialized(v6)
    assert backend6.last.local_detector.cidrs == (ip_network("fd00:244::/64"),)


def test_local_detector_cluster_cidr_and_interface() -> None:
    cidr = LocalDetector(
        LocalDetectMode.CLUSTER_CIDR, (ip_network("fd00::/48"), ip_network("10.244.0.0/16"))
    )
    proxier, backend = make_proxier(config=ProxierConfig(node_name=NODE, local_detector=cidr))
    initialized(proxier)
    assert backend.last.local_detector.cidrs == (ip_network("10.244.0.0/16"),)
    bridge = LocalDetector(LocalDetectMode.BRIDGE_INTERFACE, interface="cbr0")
    proxier, backend = make_proxier(config=ProxierConfig(node_name=NODE, local_detector=bridge))
    initialized(proxier)
    assert backend.last.local_detector == bridge


def test_service_cidrs_fallback_then_override() -> None:
    config = ProxierConfig(
        node_name=NODE, service_cidrs=(ip_network("172.30.0.0/16"), ip_network("fd00:30::/108"))
    )
    proxier, backend = make_proxier(config=config)
    initialized(proxier)
    assert backend.last.service_cidrs == (ip_network("172.30.0.0/16"),)
    proxier.on_service_cidrs_changed([ip_network("fd00:31::/108"), ip_network("10.96.0.0/12")])
    proxier.sync_now()
    assert backend.last.full
    assert backend.last.service_cidrs == (ip_network("10.96.0.0/12"),)
    # The same list again changes nothing.
    proxier.on_service_cidrs_changed([ip_network("10.96.0.0/12")])
    proxier.sync_now()
    assert not backend.last.full
    proxier.on_service_cidrs_changed([])
    proxier.sync_now()
    assert backend.last.service_cidrs == ()


# --- running ------------------------------------------------------------------------


def test_run_loop_syncs_on_request() -> None:
    synced = threading.Event()

    class Signalling(RecordingBackend):
        def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
            super().sync(snapshot, changes)
            synced.set()

    backend = Signalling()
    proxier = Proxier(
        V4, ProxierConfig(node_name=NODE, min_sync_period=0.01, sync_period=1), backend
    )
    initialized(proxier)
    synced.clear()
    stop = threading.Event()
    thread = threading.Thread(target=proxier.run, args=(stop,))
    thread.start()
    try:
        proxier.on_service_add(service("web"))
        assert synced.wait(5)
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()
    assert spn("web") in backend.last.services


def looped(
    backend: RecordingBackend, end: float, *, min_sync: float = 0.5
) -> tuple[Proxier, list[tuple[float, bool]], Callable[[], None], RunnerClock]:
    """A proxier whose loop runs on the runner tests' fake clock until ``end``; the
    (clock time, full) of each sync, what runs the loop, and the clock."""
    stop = threading.Event()
    clock = RunnerClock(stop)
    syncs: list[tuple[float, bool]] = []
    original = backend.sync

    def sync(snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        syncs.append((clock.t, changes.full))
        original(snapshot, changes)

    backend.sync = sync  # type: ignore[method-assign]
    config = ProxierConfig(node_name=NODE, min_sync_period=min_sync, sync_period=30)
    proxier = Proxier(V4, config, backend, runner_clock=clock)
    clock.at(end, stop.set)
    return proxier, syncs, lambda: proxier.run(stop), clock


def _add_numbered(proxier: Proxier, number: int) -> None:
    proxier.on_service_add(service(f"s{number}", f"172.30.0.{number}"))


def test_by_default_the_loop_rests_in_proportion_to_what_a_sync_cost() -> None:
    """No minSyncPeriod: after each sync the loop rests ``max(50 ms, 4 x its CPU time)``
    (issue 29); changes meanwhile are batched, a change after an idle time syncs at once."""
    backend = RecordingBackend()
    stop = threading.Event()
    clock = RunnerClock(stop)
    cpu = [0.0]
    syncs: list[tuple[float, frozenset[NamespacedName]]] = []
    original = backend.sync

    def sync(snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        syncs.append((clock.t, changes.changed_services))
        cpu[0] += 0.1  # each sync costs 100 ms of CPU
        original(snapshot, changes)

    backend.sync = sync  # type: ignore[method-assign]
    config = ProxierConfig(node_name=NODE, sync_period=30)
    assert config.min_sync_period is None
    proxier = Proxier(V4, config, backend, runner_clock=clock, cost_clock=lambda: cpu[0])
    initialized(proxier)  # the first (full) sync, outside the loop
    for at, number in ((1.0, 1), (1.05, 2), (1.1, 3), (3.0, 4)):
        clock.at(at, functools.partial(_add_numbered, proxier, number))
    clock.at(5, stop.set)
    proxier.run(stop)
    names = [frozenset(s.name for s in changed) for _, changed in syncs]
    assert [t for t, _ in syncs] == [0.0, 1.0, pytest.approx(1.4), 3.0]
    assert names == [frozenset(), {"s1"}, {"s2", "s3"}, {"s4"}]


def test_a_min_sync_period_set_is_upstreams_fixed_rest() -> None:
    backend = RecordingBackend()
    proxier, syncs, run, clock = looped(backend, 5, min_sync=0.5)
    initialized(proxier)
    for at, number in ((1.0, 1), (1.05, 2)):
        clock.at(at, functools.partial(_add_numbered, proxier, number))
    run()
    assert [t for t, _ in syncs] == [0.0, 1.0, 1.5]


def test_a_failed_partial_sync_is_followed_at_once_by_a_full_one() -> None:
    backend = RecordingBackend()
    proxier, syncs, run, clock = looped(backend, 5)
    two_services(proxier)
    initialized(proxier)  # the first (full) sync, outside the loop
    backend.failures.append(SyncError("No such file or directory"))
    clock.at(2, lambda: proxier.on_service_delete(service("web", "172.30.0.10")))
    run()
    # The partial sync at 2 fails; the full one follows at once, not a sync period later.
    assert syncs == [(0.0, True), (2.0, False), (2.0, True)]


def test_a_failed_first_sync_is_retried_after_the_backoff() -> None:
    backend = RecordingBackend()
    backend.failures.append(SyncError("refused"))
    proxier, syncs, run, _ = looped(backend, 5)
    two_services(proxier)
    initialized(proxier)  # fails, outside the loop
    run()
    assert syncs == [(0.0, True), (1.0, True)]


# --- dual stack ---------------------------------------------------------------------


def dual() -> tuple[DualStackProxier, RecordingBackend, RecordingBackend]:
    p4, b4 = make_proxier(V4)
    p6, b6 = make_proxier(V6)
    return DualStackProxier(p4, p6), b4, b6


def test_dual_stack_routes_slices_by_address_type() -> None:
    proxy, b4, b6 = dual()
    proxy.on_service_add(
        service(
            "web", "172.30.0.10", ips=["172.30.0.10", "fd00:30::10"], ipFamilies=["IPv4", "IPv6"]
        )
    )
    proxy.on_endpoint_slice_add(endpoint_slice("web-v4", "web", [ep("10.244.0.11")]))
    proxy.on_endpoint_slice_add(
        endpoint_slice("web-v6", "web", [ep("fd00:244::11")], address_type="IPv6")
    )
    fqdn = endpoint_slice("web-fqdn", "web", [ep("example.com")], address_type="FQDN")
    proxy.on_endpoint_slice_add(fqdn)
    proxy.on_endpoint_slice_delete(fqdn)
    assert not proxy.initialized
    proxy.on_services_synced()
    proxy.on_endpoint_slices_synced()
    assert proxy.initialized
    assert b4.last.services[spn("web")].cluster_ip == ip_address("172.30.0.10")
    assert b6.last.services[spn("web")].cluster_ip == ip_address("fd00:30::10")
    assert [e.key for e in b4.last.endpoints[spn("web")]] == ["10.244.0.11:8080"]
    assert [e.key for e in b6.last.endpoints[spn("web")]] == ["[fd00:244::11]:8080"]

    proxy.on_endpoint_slice_update(
        endpoint_slice("web-v6", "web", [ep("fd00:244::11")], address_type="IPv6"),
        endpoint_slice("web-v6", "web", [ep("fd00:244::12")], address_type="IPv6"),
    )
    assert proxy.sync_now()
    assert not b4.last.changes.changed_services
    assert b6.last.changes.changed_services == {nn("web")}
    proxy.on_endpoint_slice_delete(
        endpoint_slice("web-v4", "web", [ep("10.244.0.11")], address_type="IPv4")
    )
    assert proxy.sync_now()
    assert spn("web") not in b4.last.endpoints
    assert spn("web") in b6.last.endpoints


def test_dual_stack_fans_out_node_cidrs_and_syncs() -> None:
    proxy, b4, b6 = dual()
    proxy.on_services_synced()
    proxy.on_endpoint_slices_synced()
    proxy.on_node_update(node_object(zone="zone-q", addresses=["192.168.50.2", "fd00::2"]))
    proxy.on_service_cidrs_changed([ip_network("172.30.0.0/16"), ip_network("fd00:30::/108")])
    assert proxy.sync_now()
    assert b4.last.node.zone == b6.last.node.zone == "zone-q"
    assert b4.last.service_cidrs == (ip_network("172.30.0.0/16"),)
    assert b6.last.service_cidrs == (ip_network("fd00:30::/108"),)
    b6.failures.append(SyncError("v6 broke"))
    assert proxy.sync_now() is False
    assert len(b4.syncs) == len(b6.syncs) == 3


def test_dual_stack_needs_one_proxier_per_family() -> None:
    p4, _ = make_proxier(V4)
    with pytest.raises(ValueError):
        DualStackProxier(p4, make_proxier(V4)[0])


def test_dual_stack_run_runs_both_loops() -> None:
    events = {V4: threading.Event(), V6: threading.Event()}

    class Signalling(RecordingBackend):
        def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
            super().sync(snapshot, changes)
            events[self.family].set()

    config = ProxierConfig(node_name=NODE, min_sync_period=0.01, sync_period=1)
    proxy = DualStackProxier(
        Proxier(V4, config, Signalling(V4)), Proxier(V6, config, Signalling(V6))
    )
    proxy.on_services_synced()
    proxy.on_endpoint_slices_synced()
    for event in events.values():
        event.clear()
    stop = threading.Event()
    thread = threading.Thread(target=proxy.run, args=(stop,))
    thread.start()
    try:
        proxy.sync()
        assert events[V4].wait(5) and events[V6].wait(5)
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()


# --- property: incremental state equals state computed from scratch ------------------


NAMES = ["a", "b", "c"]
IPS = ["10.244.0.11", "10.244.0.12", "10.244.1.13"]


def _service_for(name: str, variant: int) -> dict[str, Any]:
    ports: list[tuple[str, int, str]] = [("http", 80, "TCP")]
    if variant % 2:
        ports.append(("dns", 53, "UDP"))
    spec: dict[str, Any] = {}
    if variant >= 2:
        spec["internalTrafficPolicy"] = "Local"
    return service(name, f"172.30.0.{NAMES.index(name) + 10}", ports=ports, **spec)


def _slice_for(name: str, index: int, ips: Sequence[int], zoned: bool) -> dict[str, Any]:
    endpoints = [
        ep(
            IPS[i],
            NODE if i < 2 else "node-b",
            zones=(["zone-a"] if i % 2 == 0 else ["zone-b"]) if zoned else (),
        )
        for i in ips
    ]
    return endpoint_slice(
        f"{name}-{index}",
        name,
        endpoints,
        ports=[("http", 8080, "TCP"), ("dns", 5353, "UDP")],
    )


operations = st.one_of(
    st.tuples(st.just("service"), st.sampled_from(NAMES), st.integers(0, 4)),
    st.tuples(
        st.just("slice"),
        st.sampled_from(NAMES),
        st.integers(0, 1),
        st.lists(st.integers(0, 2), max_size=3, unique=True),
        st.booleans(),
    ),
    st.tuples(st.just("delete-slice"), st.sampled_from(NAMES), st.integers(0, 1)),
    st.tuples(
        st.just("relabel"), st.sampled_from(NAMES), st.integers(0, 1), st.sampled_from(NAMES)
    ),
    st.tuples(st.just("zone"), st.sampled_from(["zone-a", "zone-b"])),
    st.tuples(st.just("sync"), st.booleans()),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(operations, max_size=25))
def test_incremental_state_matches_recomputation(ops: list[tuple[Any, ...]]) -> None:
    proxier, backend = make_proxier()
    initialized(proxier)
    services: dict[str, dict[str, Any]] = {}
    slices: dict[str, dict[str, Any]] = {}
    for op in ops:
        kind = op[0]
        if kind == "service":
            _, name, variant = op
            old = services.get(name)
            if variant == 4:
                if old is not None:
                    proxier.on_service_delete(services.pop(name))
                continue
            new = _service_for(name, variant)
            services[name] = new
            if old is None:
                proxier.on_service_add(new)
            else:
                proxier.on_service_update(old, new)
        elif kind == "slice":
            _, name, index, ips, zoned = op
            new = _slice_for(name, index, ips, zoned)
            key = new["metadata"]["name"]
            old = slices.get(key)
            slices[key] = new
            if old is None:
                proxier.on_endpoint_slice_add(new)
            else:
                proxier.on_endpoint_slice_update(old, new)
        elif kind == "delete-slice":
            _, name, index = op
            gone = slices.pop(f"{name}-{index}", None)
            if gone is not None:
                proxier.on_endpoint_slice_delete(gone)
        elif kind == "relabel":
            _, name, index, other = op
            old = slices.get(f"{name}-{index}")
            if old is not None:
                new = copy.deepcopy(old)
                new["metadata"]["labels"]["kubernetes.io/service-name"] = other
                slices[f"{name}-{index}"] = new
                proxier.on_endpoint_slice_update(old, new)
        elif kind == "zone":
            proxier.on_node_update(node_object(zone=op[1]))
        else:
            if op[1]:
                backend.failures.append(SyncError("injected"))
            proxier.sync_now()
    proxier.sync_now()
    last = backend.last
    zone = proxier.node.zone
    expected = {
        name: categorize_endpoints(last.endpoints.get(name, ()), port, NODE, zone)
        for name, port in last.services.items()
    }
    assert last.categorized == expected
    assert {s: set(n) for s, n in proxier._services.ports_by_service.items()} == {
        s: {n for n in last.services if n.service == s} for s in {n.service for n in last.services}
    }
    assert {NamespacedName("demo", n) for n in services} >= {n.service for n in last.services}
    # A fresh proxier fed the final objects sees the same (relabelled slices included).
    fresh, fresh_backend = make_proxier()
    if zone:
        fresh.on_node_update(node_object(zone=zone))
    for obj in services.values():
        fresh.on_service_add(obj)
    for obj in slices.values():
        fresh.on_endpoint_slice_add(obj)
    initialized(fresh)
    assert fresh_backend.last.endpoints == last.endpoints
    assert fresh_backend.last.categorized == last.categorized


def test_example_cluster_through_the_manifest_source() -> None:
    examples = Path(__file__).resolve().parent.parent / "examples" / "cluster"
    backend = RecordingBackend()
    proxier = Proxier(V4, ProxierConfig(node_name="demo-node"), backend)
    ManifestSource(examples, proxier, node_name="demo-node").load()
    assert len(backend.syncs) == 1
    first = backend.last
    assert first.full
    assert first.node.zone == "zone-a"
    assert {str(name) for name in first.services} == {
        "demo/web:http",
        "demo/dns:dns",
        "demo/shop:http",
    }
    web = ServicePortName(NamespacedName("demo", "web"), "http", Protocol.TCP)
    assert [e.key for e in first.categorized[web].cluster] == [
        "10.244.0.11:8080",
        "10.244.0.12:8080",
    ]
    assert all(e.is_local for e in first.categorized[web].cluster)


def test_the_loop_is_told_how_many_services_each_sync_changed() -> None:
    """The runner paces by the cost per change (kubeproxy.pacing): a partial sync
    reports the Services it changed, a full one and an empty one count as one."""
    proxier, backend = make_proxier()
    two_services(proxier)
    initialized(proxier)  # the first sync, full
    proxier.on_endpoint_slice_update(
        endpoint_slice("web-1", "web", [ep("10.244.0.11")]),
        endpoint_slice("web-1", "web", [ep("10.244.0.12")]),
    )
    proxier.on_endpoint_slice_update(
        endpoint_slice("db-1", "db", [ep("10.244.0.20", "node-b")], ports=[("sql", 5432, "TCP")]),
        endpoint_slice("db-1", "db", [ep("10.244.0.21", "node-b")], ports=[("sql", 5432, "TCP")]),
    )
    assert proxier._run_sync() == 2
    assert not backend.last.full
    assert proxier._run_sync() == 1  # nothing changed
    proxier.request_full_sync()
    assert proxier._run_sync() == 1
    assert backend.last.full
