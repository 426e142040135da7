"""What the Proxier offers observability: ObserverGroup fan-out, after-sync hooks and the
conntrack hook (when they run, in which order, what they may call), and ports_of."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from kubeproxy.backend import ProxySnapshot, SyncChanges, SyncError
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPFamily, NamespacedName, Protocol, ServicePortName
from kubeproxy.proxier import FinishedSync, NullObserver, ObserverGroup, Proxier

V4 = IPFamily.IPV4
NODE = "node-a"


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


def service(name: str, ip: str, protocol: str = "UDP") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "demo"},
        "spec": {
            "clusterIP": ip,
            "type": "LoadBalancer",
            "externalTrafficPolicy": "Local",
            "healthCheckNodePort": 32100,
            "ports": [
                {"name": "a", "port": 53, "protocol": protocol, "nodePort": 30053},
                {"name": "b", "port": 54, "protocol": protocol, "nodePort": 30054},
            ],
        },
    }


def endpoint_slice(name: str, ips: list[str], protocol: str = "UDP") -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"{name}-1",
            "namespace": "demo",
            "labels": {"kubernetes.io/service-name": name},
        },
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": [ip], "nodeName": NODE, "conditions": {"ready": True}} for ip in ips
        ],
        "ports": [
            {"name": "a", "port": 5353, "protocol": protocol},
            {"name": "b", "port": 5354, "protocol": protocol},
        ],
    }


def failures(caplog: pytest.LogCaptureFixture, message: str) -> int:
    return sum(
        1
        for record in caplog.records
        if record.exc_info is not None and str(record.exc_info[1]) == message
    )


class Hook:
    def __init__(self, log: list[tuple[str, SyncChanges]], name: str) -> None:
        self.log = log
        self.name = name
        self.seen: list[Any] = []

    def __call__(self, proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        self.log.append((self.name, changes))
        # Hooks run under the sync lock and may use the locking read methods.
        self.seen.append(
            (
                proxier.health_check_node_ports(),
                proxier.local_ready_endpoints(),
                proxier.ports_of(NamespacedName("demo", "dns")),
                len(snapshot.services),
            )
        )


def test_hooks_run_after_successful_syncs_conntrack_first_and_only_when_needed() -> None:
    log: list[tuple[str, SyncChanges]] = []
    conntrack, first, second = Hook(log, "conntrack"), Hook(log, "first"), Hook(log, "second")
    backend = Backend()
    proxier = Proxier(
        V4,
        ProxierConfig(node_name=NODE),
        backend,
        conntrack=conntrack,
        after_sync=[first, second],
    )
    proxier.on_service_add(service("dns", "10.96.0.10"))
    proxier.on_endpoint_slice_add(endpoint_slice("dns", ["10.244.0.11"]))
    proxier.on_services_synced()
    proxier.on_endpoint_slices_synced()
    assert [name for name, _ in log] == ["conntrack", "first", "second"]
    assert all(changes.conntrack_cleanup_required for _, changes in log)
    dns = NamespacedName("demo", "dns")
    ports = frozenset(ServicePortName(dns, p, Protocol.UDP) for p in ("a", "b"))
    assert first.seen[0] == ({dns: 32100}, {dns: 1}, ports, 2)

    # A failed sync runs no hook; the retry carries the conntrack hint.
    log.clear()
    proxier.on_endpoint_slice_update(
        endpoint_slice("dns", ["10.244.0.11"]), endpoint_slice("dns", ["10.244.0.12"])
    )
    backend.failures.append(SyncError("refused"))
    assert not proxier.sync_now()
    assert log == []
    assert proxier.sync_now()
    assert [name for name, _ in log] == ["conntrack", "first", "second"]

    # No UDP change: the after-sync hooks run, conntrack does not.
    log.clear()
    proxier.on_service_add(service("web", "10.96.0.11", protocol="TCP"))
    assert proxier.sync_now()
    assert [name for name, _ in log] == ["first", "second"]
    assert proxier.ports_of(NamespacedName("demo", "nope")) == frozenset()


def test_a_failing_hook_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log: list[tuple[str, SyncChanges]] = []

    def broken(proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        raise RuntimeError("hook down")

    after = Hook(log, "after")
    proxier = Proxier(
        V4, ProxierConfig(node_name=NODE), Backend(), conntrack=broken, after_sync=[broken, after]
    )
    proxier.on_service_add(service("dns", "10.96.0.10"))
    proxier.on_endpoint_slice_add(endpoint_slice("dns", ["10.244.0.11"]))
    with caplog.at_level(logging.ERROR):
        proxier.on_services_synced()
        proxier.on_endpoint_slices_synced()
    assert [name for name, _ in log] == ["after"]
    assert failures(caplog, "hook down") == 2


class Recorder(NullObserver):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    def sync_queued(self, family: IPFamily) -> None:
        self.log.append(f"{self.name} queued {family}")

    def sync_finished(self, sync: FinishedSync) -> None:
        self.log.append(f"{self.name} finished {sync.family} {sync.full} {sync.error}")

    def endpoints_trigger_times(self, family: IPFamily, times: list[float]) -> None:
        self.log.append(f"{self.name} times {times}")


class Broken(NullObserver):
    def sync_queued(self, family: IPFamily) -> None:
        raise RuntimeError("observer down")

    def sync_finished(self, *args: Any) -> None:
        raise RuntimeError("observer down")


def test_observer_group_fans_out_in_order_and_isolates_failures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log: list[str] = []
    group = ObserverGroup([Recorder("a", log), Broken(), Recorder("b", log)])
    with caplog.at_level(logging.ERROR):
        group.sync_queued(V4)
        group.sync_finished(FinishedSync(V4, True, 0.1, None, 1, 1))
        group.endpoints_trigger_times(V4, [1.0])
    assert log == [
        "a queued IPv4",
        "b queued IPv4",
        "a finished IPv4 True None",
        "b finished IPv4 True None",
        "a times [1.0]",
        "b times [1.0]",
    ]
    assert failures(caplog, "observer down") == 2


def test_other_threads_wait_for_the_hook_and_then_read_the_synced_state() -> None:
    waiting: list[bool] = []
    results: list[dict[NamespacedName, int]] = []
    threads: list[threading.Thread] = []

    def reader_hook(proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        thread = threading.Thread(target=lambda: results.append(proxier.local_ready_endpoints()))
        thread.start()
        threads.append(thread)
        thread.join(0.2)
        waiting.append(thread.is_alive())  # held off by the sync lock the hook runs under

    proxier = Proxier(V4, ProxierConfig(node_name=NODE), Backend(), after_sync=[reader_hook])
    proxier.on_service_add(service("dns", "10.96.0.10"))
    proxier.on_endpoint_slice_add(endpoint_slice("dns", ["10.244.0.11", "10.244.0.12"]))
    proxier.on_services_synced()
    proxier.on_endpoint_slices_synced()
    threads[0].join(5)
    assert waiting == [True]
    assert results == [{NamespacedName("demo", "dns"): 2}]


def test_the_group_calls_only_the_methods_an_observer_does_not_ignore() -> None:
    calls: list[str] = []

    class Finishing(NullObserver):
        def sync_finished(self, *args: Any) -> None:
            calls.append("finished")

    class Queueing(NullObserver):
        def sync_queued(self, family: IPFamily) -> None:
            calls.append(f"queued {family.value}")

    group = ObserverGroup([Finishing(), NullObserver(), Queueing()])
    assert len(group._queued) == 1 and len(group._finished) == 1
    assert group._trigger_times == ()
    group.sync_queued(IPFamily.IPV4)
    group.sync_finished(FinishedSync(IPFamily.IPV4, False, 0.001, None, 1, 1))
    group.endpoints_trigger_times(IPFamily.IPV4, [1.0])
    assert calls == ["queued IPv4", "finished"]
