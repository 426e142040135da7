"""Metrics: upstream's names, types, help, labels and buckets; the observer, tracker and
no-local-endpoint semantics (against a real Proxier with a fake backend); the exposition
format as Go writes it; and the metrics HTTP server over real sockets on 127.0.0.1."""

from __future__ import annotations

import http.client
import re
import socket
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge

from kubeproxy.backend import ProxySnapshot, SyncChanges, SyncError
from kubeproxy.config import ProxierConfig
from kubeproxy.host.httpserving import ServerBindError
from kubeproxy.metrics import (
    CONTENT_TYPE,
    NETWORK_PROGRAMMING_BUCKETS,
    MetricsServer,
    ProxyMetrics,
    expose,
    go_float,
)
from kubeproxy.objects import IPFamily
from kubeproxy.proxier import FinishedSync, Proxier

V4 = IPFamily.IPV4
V6 = IPFamily.IPV6
NODE = "node-a"


class Clock:
    def __init__(self, now: float = 1_767_323_045.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Backend:
    def __init__(self, family: IPFamily = V4) -> None:
        self._family = family
        self.failures: list[BaseException] = []
        self.syncs = 0

    @property
    def family(self) -> IPFamily:
        return self._family

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        self.syncs += 1
        if self.failures:
            raise self.failures.pop(0)

    def cleanup(self) -> None:
        pass


def service(
    name: str,
    ip: str,
    *,
    ports: Sequence[tuple[str, int, str]] = (("p", 80, "TCP"),),
    **spec: Any,
) -> dict[str, Any]:
    port_list = []
    for index, (port_name, port, proto) in enumerate(ports):
        entry: dict[str, Any] = {"name": port_name, "port": port, "protocol": proto}
        if spec.get("type") in ("NodePort", "LoadBalancer"):
            entry["nodePort"] = 30000 + port + index
        port_list.append(entry)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "demo"},
        "spec": {"clusterIP": ip, "ports": port_list, **spec},
    }


def endpoint_slice(
    name: str,
    svc: str,
    nodes: Sequence[tuple[str, str]],
    *,
    ports: Sequence[tuple[str, int, str]] = (("p", 8080, "TCP"),),
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "demo",
            "labels": {"kubernetes.io/service-name": svc},
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [ip],
                "nodeName": node,
                "conditions": {"ready": True, "serving": True, "terminating": False},
            }
            for ip, node in nodes
        ],
        "ports": [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports],
    }


def make_proxier(metrics: ProxyMetrics, backend: Backend | None = None) -> Proxier:
    proxier = Proxier(
        V4,
        ProxierConfig(node_name=NODE),
        backend or Backend(),
        observer=metrics,
        after_sync=[metrics.after_sync],
        wall_clock=lambda: 0.0,
    )
    metrics.track(proxier)
    return proxier


# --- reading the exposition -----------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[str, dict[str, Any]]:
    """Families by name: help, type, samples as (name, labels, value string)."""
    families: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            current = families.setdefault(name, {"samples": []})
            current["help"] = help_text
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            families.setdefault(name, {"samples": []})["type"] = kind
        else:
            match = _SAMPLE.match(line)
            assert match, f"unparsable line {line!r}"
            assert current is not None
            labels = dict(_LABEL.findall(match.group(2) or ""))
            current["samples"].append((match.group(1), labels, match.group(3)))
    return families


def value(text: str, name: str, **labels: str) -> float:
    for family in parse(text).values():
        for sample_name, sample_labels, raw in family["samples"]:
            if sample_name == name and sample_labels == labels:
                return float(raw)
    raise AssertionError(f"no sample {name}{labels}")


def les(text: str, family: str, **labels: str) -> list[str]:
    return [
        sample_labels["le"]
        for sample_name, sample_labels, _ in parse(text)[family]["samples"]
        if sample_name == family + "_bucket"
        and {k: v for k, v in sample_labels.items() if k != "le"} == labels
    ]


# --- names, types, labels, buckets ----------------------------------------------------

UPSTREAM = {
    # name: (type, help, labels)
    "kubeproxy_sync_proxy_rules_duration_seconds": (
        "histogram",
        "SyncProxyRules latency in seconds",
        {"ip_family"},
    ),
    "kubeproxy_sync_full_proxy_rules_duration_seconds": (
        "histogram",
        "SyncProxyRules latency in seconds for full resyncs",
        {"ip_family"},
    ),
    "kubeproxy_sync_partial_proxy_rules_duration_seconds": (
        "histogram",
        "SyncProxyRules latency in seconds for partial resyncs",
        {"ip_family"},
    ),
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds": (
        "gauge",
        "The last time proxy rules were successfully synced",
        {"ip_family"},
    ),
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds": (
        "gauge",
        "The last time a sync of proxy rules was queued",
        {"ip_family"},
    ),
    "kubeproxy_network_programming_duration_seconds": (
        "histogram",
        "In Cluster Network Programming Latency in seconds",
        {"ip_family"},
    ),
    "kubeproxy_sync_proxy_rules_endpoint_changes_pending": (
        "gauge",
        "Pending proxy rules Endpoint changes",
        set(),
    ),
    "kubeproxy_sync_proxy_rules_endpoint_changes_total": (
        "counter",
        "Cumulative proxy rules Endpoint changes",
        set(),
    ),
    "kubeproxy_sync_proxy_rules_service_changes_pending": (
        "gauge",
        "Pending proxy rules Service changes",
        set(),
    ),
    "kubeproxy_sync_proxy_rules_service_changes_total": (
        "counter",
        "Cumulative proxy rules Service changes",
        set(),
    ),
    "kubeproxy_sync_proxy_rules_no_local_endpoints_total": (
        "gauge",
        "Number of services with a Local traffic policy and no endpoints",
        {"traffic_policy", "ip_family"},
    ),
    "kubeproxy_proxy_healthz_total": ("counter", "Cumulative proxy healthz HTTP status", {"code"}),
    "kubeproxy_proxy_livez_total": ("counter", "Cumulative proxy livez HTTP status", {"code"}),
    "kubeproxy_conntrack_reconciler_sync_duration_seconds": (
        "histogram",
        "ReconcileConntrackFlowsLatency latency in seconds",
        {"ip_family"},
    ),
    "kubeproxy_conntrack_reconciler_deleted_entries_total": (
        "counter",
        "Cumulative conntrack flows deleted by conntrack reconciler",
        {"ip_family"},
    ),
}
# Ours, not upstream's, in every mode: repairs of rules someone else changed.
OURS_IN_EVERY_MODE = {
    "kubeproxy_sync_proxy_rules_external_changes_total": (
        "counter",
        "Cumulative changes of the proxy rules by someone else, found and repaired, by what"
        " was found",
        {"ip_family", "kind"},
    ),
}
NFTABLES_ONLY = {
    "kubeproxy_sync_proxy_rules_nftables_sync_failures_total": (
        "counter",
        "Cumulative proxy nftables sync failures",
        {"ip_family"},
    ),
    "kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total": (
        "counter",
        "Cumulative proxy nftables cleanup failures",
        {"ip_family"},
    ),
}
IPTABLES_ONLY = {
    "kubeproxy_sync_proxy_rules_iptables_restore_failures_total": (
        "counter",
        "Cumulative proxy iptables restore failures",
        {"ip_family"},
    ),
    "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total": (
        "counter",
        "Cumulative proxy iptables partial restore failures",
        {"ip_family"},
    ),
    "kubeproxy_sync_proxy_rules_iptables_total": (
        "gauge",
        "Total number of iptables rules owned by kube-proxy",
        {"table", "ip_family"},
    ),
    "kubeproxy_sync_proxy_rules_iptables_last": (
        "gauge",
        "Number of iptables rules written by kube-proxy in last sync",
        {"table", "ip_family"},
    ),
}


def exercise(metrics: ProxyMetrics) -> None:
    """Touch every metric once so that each labelled series exists."""
    for family in (V4, V6):
        metrics.sync_queued(family)
        metrics.sync_finished(FinishedSync(family, True, 0.003, None, 0, 0))
        metrics.sync_finished(FinishedSync(family, False, 0.5, SyncError("refused"), 0, 0))
        metrics.endpoints_trigger_times(family, [metrics.clock() - 2.0])
        metrics.conntrack_reconciled(family, 0.01, 3)
        metrics.nftables_cleanup_failed(family)
        metrics.iptables_partial_restore_failed(family)
        metrics.iptables_rules(family, "nat", 10, 4)
        metrics.external_change(family, "table")
        metrics.no_local_endpoints.labels("internal", family.value).set(0)
        metrics.no_local_endpoints.labels("external", family.value).set(0)
    metrics.healthz_response(200)
    metrics.livez_response(503)


@pytest.mark.parametrize(
    ("mode", "specific", "absent"),
    [
        ("nftables", NFTABLES_ONLY, IPTABLES_ONLY),
        ("iptables", IPTABLES_ONLY, NFTABLES_ONLY),
        (
            "ipvs",
            {
                **{
                    k: v
                    for k, v in IPTABLES_ONLY.items()
                    if "restore_failures" in k and "partial" not in k
                },
                # Ours, not upstream's: says the deprecated mode is in use.
                "kubeproxy_deprecated_proxy_mode": (
                    "gauge",
                    "1 while this proxy runs in a deprecated mode (ipvs); migrate to nftables",
                    {"mode"},
                ),
            },
            {**NFTABLES_ONLY, **{k: v for k, v in IPTABLES_ONLY.items() if "partial" in k}},
        ),
    ],
)
def test_names_types_help_and_labels_are_upstreams(
    mode: str, specific: dict[str, Any], absent: dict[str, Any]
) -> None:
    metrics = ProxyMetrics(mode=mode, process_metrics=False)
    exercise(metrics)
    families = parse(metrics.expose().decode())
    expected = {**UPSTREAM, **OURS_IN_EVERY_MODE, **specific}
    ours = {name: f for name, f in families.items() if name.startswith("kubeproxy_")}
    assert set(ours) == set(expected)
    for name, (kind, help_text, labels) in expected.items():
        family = ours[name]
        assert family["type"] == kind, name
        assert family["help"] == help_text, name
        assert family["samples"], name
        for sample_name, sample_labels, _ in family["samples"]:
            assert set(sample_labels) - {"le"} == labels, (name, sample_name)
    assert not set(absent) & set(families)


def test_ip_family_values_are_kubernetes_spelling() -> None:
    metrics = ProxyMetrics(process_metrics=False)
    exercise(metrics)
    text = metrics.expose().decode()
    families = {
        labels["ip_family"]
        for family in parse(text).values()
        for _, labels, _ in family["samples"]
        if "ip_family" in labels
    }
    assert families == {"IPv4", "IPv6"}
    traffic = {
        labels["traffic_policy"]
        for _, labels, _ in parse(text)["kubeproxy_sync_proxy_rules_no_local_endpoints_total"][
            "samples"
        ]
    }
    assert traffic == {"internal", "external"}


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown proxy mode"):
        ProxyMetrics(mode="userspace")


SYNC_LE = [
    "0.001",
    "0.002",
    "0.004",
    "0.008",
    "0.016",
    "0.032",
    "0.064",
    "0.128",
    "0.256",
    "0.512",
    "1.024",
    "2.048",
    "4.096",
    "8.192",
    "16.384",
    "+Inf",
]


def test_bucket_bounds_are_written_as_go_writes_them() -> None:
    metrics = ProxyMetrics(process_metrics=False)
    exercise(metrics)
    text = metrics.expose().decode()
    for name in (
        "kubeproxy_sync_proxy_rules_duration_seconds",
        "kubeproxy_sync_full_proxy_rules_duration_seconds",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds",
        "kubeproxy_conntrack_reconciler_sync_duration_seconds",
    ):
        assert les(text, name, ip_family="IPv4") == SYNC_LE, name
    network = les(text, "kubeproxy_network_programming_duration_seconds", ip_family="IPv6")
    # Upstream's buckets, and ours below 0.25 s (issue 29).
    expected = (
        ["0", "0.005", "0.01", "0.025", "0.05", "0.1", "0.15", "0.2", "0.25", "0.5"]
        + [str(s) for s in range(1, 60)]
        + [str(s) for s in range(60, 120, 5)]
        + [str(s) for s in range(120, 301, 30)]
        + ["+Inf"]
    )
    assert network == expected
    assert len(NETWORK_PROGRAMMING_BUCKETS) == 88


@pytest.mark.parametrize(
    ("number", "text"),
    [
        (1.0, "1"),
        (0.0, "0"),
        (-0.0, "-0"),
        (0.25, "0.25"),
        (16.384, "16.384"),
        (100000.0, "100000"),
        (1e6, "1e+06"),
        (1234567.0, "1.234567e+06"),
        (1767323045.5, "1.7673230455e+09"),
        (0.0001, "0.0001"),
        (0.00001, "1e-05"),
        (-2.5, "-2.5"),
        (0.1 + 0.2, "0.30000000000000004"),
        (float("inf"), "+Inf"),
        (float("-inf"), "-Inf"),
        (float("nan"), "NaN"),
    ],
)
def test_go_float(number: float, text: str) -> None:
    assert go_float(number) == text


def test_exposition_sorts_escapes_and_drops_created() -> None:
    registry = CollectorRegistry()
    gauge = Gauge("zz_last", "help with \\ and\nnewline", ["b", "a"], registry=registry)
    gauge.labels(b="2", a='quote " back \\ nl \n').set(3)
    gauge.labels(b="1", a="x").set(1)
    metrics = ProxyMetrics(registry, process_metrics=False)
    metrics.healthz_response(200)
    text = expose(metrics.registry).decode()
    assert "_created" not in text
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert names == sorted(names)
    assert "# HELP zz_last help with \\\\ and\\nnewline" in text
    assert 'zz_last{a="quote \\" back \\\\ nl \\n",b="2"} 3' in text
    lines = [line for line in text.splitlines() if line.startswith("zz_last{")]
    assert lines == ['zz_last{a="quote \\" back \\\\ nl \\n",b="2"} 3', 'zz_last{a="x",b="1"} 1']
    assert 'kubeproxy_proxy_healthz_total{code="200"} 1' in text


def test_process_metrics_are_exported() -> None:
    text = ProxyMetrics().expose().decode()
    families = parse(text)
    for name, kind in (
        ("process_cpu_seconds_total", "counter"),
        ("process_resident_memory_bytes", "gauge"),
        ("process_start_time_seconds", "gauge"),
        ("process_open_fds", "gauge"),
    ):
        assert families[name]["type"] == kind
    assert "process_" not in ProxyMetrics(process_metrics=False).expose().decode()


# --- observer semantics ---------------------------------------------------------------


def test_sync_observer_semantics() -> None:
    clock = Clock()
    metrics = ProxyMetrics(process_metrics=False, clock=clock)
    metrics.sync_queued(V4)
    text = metrics.expose().decode()
    assert (
        value(text, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", ip_family="IPv4")
        == clock.now
    )

    clock.now += 10
    metrics.sync_finished(FinishedSync(V4, True, 0.003, None, 5, 4))
    clock.now += 10
    metrics.sync_finished(FinishedSync(V4, False, 0.3, SyncError("kernel said no"), 5, 4))
    text = metrics.expose().decode()
    name = "kubeproxy_sync_proxy_rules_duration_seconds"
    assert value(text, name + "_count", ip_family="IPv4") == 2
    assert value(text, name + "_sum", ip_family="IPv4") == pytest.approx(0.303)
    assert value(text, name + "_bucket", ip_family="IPv4", le="0.004") == 1
    full = "kubeproxy_sync_full_proxy_rules_duration_seconds"
    partial = "kubeproxy_sync_partial_proxy_rules_duration_seconds"
    assert value(text, full + "_count", ip_family="IPv4") == 1
    assert value(text, partial + "_count", ip_family="IPv4") == 1
    assert value(text, partial + "_bucket", ip_family="IPv4", le="0.256") == 0
    assert value(text, partial + "_bucket", ip_family="IPv4", le="0.512") == 1
    # Only the successful sync stamps the last-sync time; the failure is counted.
    last = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
    assert value(text, last, ip_family="IPv4") == clock.now - 10
    failures = "kubeproxy_sync_proxy_rules_nftables_sync_failures_total"
    assert value(text, failures, ip_family="IPv4") == 1
    with pytest.raises(AssertionError):
        value(text, last, ip_family="IPv6")

    metrics.sync_loop_started(V6)
    assert value(metrics.expose().decode(), last, ip_family="IPv6") == clock.now


def test_iptables_mode_counts_restore_failures() -> None:
    metrics = ProxyMetrics(mode="iptables", process_metrics=False)
    metrics.sync_finished(
        FinishedSync(V6, True, 0.1, SyncError("iptables-restore: line 3 failed"), 0, 0)
    )
    metrics.iptables_rules(V6, "filter", 12, 3)
    text = metrics.expose().decode()
    assert (
        value(text, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", ip_family="IPv6")
        == 1
    )
    assert (
        value(text, "kubeproxy_sync_proxy_rules_iptables_total", table="filter", ip_family="IPv6")
        == 12
    )
    assert (
        value(text, "kubeproxy_sync_proxy_rules_iptables_last", table="filter", ip_family="IPv6")
        == 3
    )


def test_only_the_deprecated_mode_says_so() -> None:
    ipvs = ProxyMetrics(mode="ipvs", process_metrics=False).expose().decode()
    assert value(ipvs, "kubeproxy_deprecated_proxy_mode", mode="ipvs") == 1
    for mode in ("nftables", "iptables"):
        text = ProxyMetrics(mode=mode, process_metrics=False).expose().decode()
        assert "kubeproxy_deprecated_proxy_mode" not in text


@pytest.mark.parametrize("mode", ["iptables", "ipvs"])
def test_restore_failures_counted_by_the_backend_are_not_counted_twice(mode: str) -> None:
    metrics = ProxyMetrics(mode=mode, process_metrics=False)
    name = "kubeproxy_sync_proxy_rules_iptables_restore_failures_total"
    metrics.sync_finished(FinishedSync(V4, True, 0.1, SyncError("refused"), 0, 0))
    assert value(metrics.expose().decode(), name, ip_family="IPv4") == 1
    metrics.count_failures_from_backend()
    # The failed sync is now counted from the backend's own count only: two failed
    # restores (a partial one, then the full one) in one sync.
    metrics.sync_finished(FinishedSync(V4, True, 0.1, SyncError("refused"), 0, 0))
    metrics.restore_failed(V4, 2)
    metrics.restore_failed(V4, 0)
    assert value(metrics.expose().decode(), name, ip_family="IPv4") == 3


def test_restore_failed_does_nothing_in_nftables_mode() -> None:
    metrics = ProxyMetrics(mode="nftables", process_metrics=False)
    metrics.restore_failed(V4, 3)
    text = metrics.expose().decode()
    assert "iptables_restore_failures" not in text
    assert "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{" not in text


def test_network_programming_latency_is_now_minus_trigger_time() -> None:
    clock = Clock()
    metrics = ProxyMetrics(process_metrics=False, clock=clock)
    moments = [clock.now - 0.3, clock.now - 70.0, clock.now - 400.0, clock.now - 0.004]
    metrics.endpoints_trigger_times(V4, [*moments, clock.now - 0.07])
    text = metrics.expose().decode()
    name = "kubeproxy_network_programming_duration_seconds"
    assert value(text, name + "_bucket", ip_family="IPv4", le="0.005") == 1
    assert value(text, name + "_bucket", ip_family="IPv4", le="0.05") == 1
    assert value(text, name + "_bucket", ip_family="IPv4", le="0.1") == 2
    assert value(text, name + "_bucket", ip_family="IPv4", le="0.25") == 2
    assert value(text, name + "_bucket", ip_family="IPv4", le="0.5") == 3
    assert value(text, name + "_bucket", ip_family="IPv4", le="65") == 3
    assert value(text, name + "_bucket", ip_family="IPv4", le="70") == 4
    assert value(text, name + "_bucket", ip_family="IPv4", le="300") == 4
    assert value(text, name + "_bucket", ip_family="IPv4", le="+Inf") == 5
    assert value(text, name + "_sum", ip_family="IPv4") == pytest.approx(470.374)


def test_proxier_feeds_trigger_times_and_durations() -> None:
    clock = Clock()
    metrics = ProxyMetrics(process_metrics=False, clock=clock)
    proxier = make_proxier(metrics)
    proxier.on_services_synced()
    proxier.on_endpoint_slices_synced()
    proxier.on_service_add(service("web", "172.30.0.10"))
    slice_ = endpoint_slice("web-1", "web", [("10.244.0.11", NODE)])
    trigger = "2026-01-02T03:03:00Z"  # 65 s before the clock
    slice_["metadata"]["annotations"] = {
        "endpoints.kubernetes.io/last-change-trigger-time": trigger
    }
    proxier.on_endpoint_slice_add(slice_)
    assert proxier.sync_now()
    text = metrics.expose().decode()
    name = "kubeproxy_network_programming_duration_seconds"
    assert value(text, name + "_count", ip_family="IPv4") == 1
    assert value(text, name + "_sum", ip_family="IPv4") == pytest.approx(65.0)
    assert value(text, "kubeproxy_sync_proxy_rules_duration_seconds_count", ip_family="IPv4") == 2
    assert (
        value(text, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", ip_family="IPv4")
        == clock.now
    )


# --- tracker counters -----------------------------------------------------------------


def test_change_counters_read_the_trackers() -> None:
    metrics = ProxyMetrics(process_metrics=False)
    backend = Backend()
    proxier = make_proxier(metrics, backend)
    proxier.on_service_add(service("web", "172.30.0.10"))
    proxier.on_service_add(service("db", "172.30.0.11"))
    proxier.on_service_update(
        service("db", "172.30.0.11"), service("db", "172.30.0.11", ports=[("p", 81, "TCP")])
    )
    proxier.on_endpoint_slice_add(endpoint_slice("web-1", "web", [("10.244.0.11", NODE)]))
    text = metrics.expose().decode()
    assert value(text, "kubeproxy_sync_proxy_rules_service_changes_pending") == 2
    assert value(text, "kubeproxy_sync_proxy_rules_service_changes_total") == 3
    assert value(text, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 1
    assert value(text, "kubeproxy_sync_proxy_rules_endpoint_changes_total") == 1
    proxier.on_services_synced()
    proxier.on_endpoint_slices_synced()
    assert backend.syncs == 1
    text = metrics.expose().decode()
    assert value(text, "kubeproxy_sync_proxy_rules_service_changes_pending") == 0
    assert value(text, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 0
    assert value(text, "kubeproxy_sync_proxy_rules_service_changes_total") == 3

    # Dual stack: both families' trackers add up (a Service event counts per family).
    ipv6 = Proxier(V6, ProxierConfig(node_name=NODE), Backend(V6), observer=metrics)
    metrics.track(ipv6)
    ipv6.on_service_add(service("web6", "fd00::10", ipFamilies=["IPv6"], clusterIPs=["fd00::10"]))
    text = metrics.expose().decode()
    assert value(text, "kubeproxy_sync_proxy_rules_service_changes_total") == 4
    assert value(text, "kubeproxy_sync_proxy_rules_service_changes_pending") == 1


# --- no local endpoints ---------------------------------------------------------------


def no_local(metrics: ProxyMetrics, policy: str, family: IPFamily = V4) -> float:
    return value(
        metrics.expose().decode(),
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
        traffic_policy=policy,
        ip_family=family.value,
    )


def test_no_local_endpoints_gauges() -> None:
    metrics = ProxyMetrics(process_metrics=False)
    proxier = make_proxier(metrics)
    proxier.on_service_add(service("internal", "172.30.0.10", internalTrafficPolicy="Local"))
    proxier.on_endpoint_slice_add(
        endpoint_slice("internal-1", "internal", [("10.244.1.5", "node-b")])
    )
    proxier.on_service_add(
        service(
            "lb",
            "172.30.0.11",
            type="LoadBalancer",
            externalTrafficPolicy="Local",
            healthCheckNodePort=32000,
            ports=[("a", 80, "TCP"), ("b", 81, "TCP")],
        )
    )
    proxier.on_service_add(service("cluster", "172.30.0.12", type="NodePort"))
    proxier.on_services_synced()
    proxier.on_endpoint_slices_synced()
    # "internal" has no local endpoint; both ports of "lb" have none at all.
    assert no_local(metrics, "internal") == 1
    assert no_local(metrics, "external") == 2

    # A local endpoint for "lb" (partial sync) clears its two ports.
    proxier.on_endpoint_slice_add(
        endpoint_slice(
            "lb-1", "lb", [("10.244.0.7", NODE)], ports=[("a", 8080, "TCP"), ("b", 8081, "TCP")]
        )
    )
    assert proxier.sync_now()
    assert no_local(metrics, "internal") == 1
    assert no_local(metrics, "external") == 0

    proxier.on_service_delete(service("internal", "172.30.0.10", internalTrafficPolicy="Local"))
    assert proxier.sync_now()
    assert no_local(metrics, "internal") == 0


OPS = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from(["svc-local-internal", "svc-local-external", "svc-cluster", "svc-delete"]),
        st.sampled_from(["none", "local", "remote", "both"]),
        st.booleans(),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_incremental_no_local_counts_match_a_recount(ops: list[tuple[str, str, str, bool]]) -> None:
    metrics = ProxyMetrics(process_metrics=False)
    backend = Backend()
    proxier = make_proxier(metrics, backend)
    proxier.on_services_synced()
    proxier.on_endpoint_slices_synced()
    ips = {"a": "172.30.0.10", "b": "172.30.0.11", "c": "172.30.0.12"}
    for index, (name, kind, where, fail) in enumerate(ops):
        ip = ips[name]
        if kind == "svc-delete":
            proxier.on_service_delete(service(name, ip))
        elif kind == "svc-local-internal":
            proxier.on_service_update(
                service(name, ip), service(name, ip, internalTrafficPolicy="Local")
            )
        elif kind == "svc-local-external":
            proxier.on_service_update(
                service(name, ip),
                service(name, ip, type="NodePort", externalTrafficPolicy="Local"),
            )
        else:
            proxier.on_service_update(service(name, ip), service(name, ip, type="NodePort"))
        nodes = {
            "none": [],
            "local": [(f"10.244.0.{index + 10}", NODE)],
            "remote": [(f"10.244.1.{index + 10}", "node-b")],
            "both": [(f"10.244.0.{index + 10}", NODE), (f"10.244.1.{index + 10}", "node-b")],
        }[where]
        proxier.on_endpoint_slice_update(
            endpoint_slice(f"{name}-1", name, []), endpoint_slice(f"{name}-1", name, nodes)
        )
        if fail:
            backend.failures.append(SyncError("refused"))
        proxier.sync_now()
        internal = sum(
            1
            for port_name, port in proxier.services.items()
            if port.internal_policy_local and not proxier.categorized[port_name].local
        )
        external = sum(
            1
            for port_name, port in proxier.services.items()
            if port.external_policy_local
            and port.externally_accessible
            and not proxier.categorized[port_name].local
        )
        if not fail:
            assert (no_local(metrics, "internal"), no_local(metrics, "external")) == (
                internal,
                external,
            )


# --- the HTTP server ------------------------------------------------------------------


def get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def test_metrics_server_serves_metrics_healthz_and_mode() -> None:
    metrics = ProxyMetrics(mode="iptables")
    metrics.sync_finished(FinishedSync(V4, True, 0.01, None, 0, 0))
    server = MetricsServer("127.0.0.1:0", metrics)
    server.start()
    try:
        port = server.port
        assert port
        status, headers, body = get(port, "/metrics")
        assert status == 200
        assert headers["content-type"] == CONTENT_TYPE
        families = parse(body.decode())
        assert families["kubeproxy_sync_proxy_rules_duration_seconds"]["type"] == "histogram"
        assert "process_cpu_seconds_total" in families
        assert not any(name.endswith("_created") for name in families)
        assert get(port, "/healthz")[::2] == (200, b"ok")
        status, headers, body = get(port, "/proxyMode")
        assert (status, body) == (200, b"iptables")
        assert headers["content-type"] == "text/plain; charset=utf-8"
        assert get(port, "/metrics/other")[0] == 404
        assert get(port, "/metrics?x=1")[0] == 200
    finally:
        server.stop()
    with pytest.raises(OSError):
        get(port, "/healthz")


def test_bind_failure_raises_with_hard_fail_and_is_retried_without() -> None:
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    metrics = ProxyMetrics(process_metrics=False)
    hard = MetricsServer(f"127.0.0.1:{port}", metrics, hard_fail=True)
    with pytest.raises(ServerBindError, match="cannot bind"):
        hard.start()
    soft = MetricsServer(f"127.0.0.1:{port}", metrics, retry_interval=0.05)
    soft.start()
    try:
        assert soft.port is None
        assert not soft.server.wait_bound(0.2)
        blocker.close()
        assert soft.server.wait_bound(5)
        assert soft.port == port
        assert get(port, "/healthz")[2] == b"ok"
    finally:
        soft.stop()
        blocker.close()


def test_empty_address_disables_the_server() -> None:
    server = MetricsServer("", ProxyMetrics(process_metrics=False))
    server.start()
    assert server.port is None
    assert not server.server.enabled
    server.stop()


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost:10249", "127.0.0.1:70000", "[::1]:x"])
def test_bad_addresses_are_refused(address: str) -> None:
    with pytest.raises(ValueError):
        MetricsServer(address, ProxyMetrics(process_metrics=False))
