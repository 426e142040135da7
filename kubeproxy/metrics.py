"""kube-proxy's Prometheus metrics, and the metrics HTTP server.

:class:`ProxyMetrics` registers upstream's ``kubeproxy_*`` metrics (names, types, help
texts, labels and buckets as kube-proxy 1.33+ exports them, ``ip_family`` being ``IPv4``
or ``IPv6``) plus the process collector's ``process_*`` metrics, and is fed by:

* the proxier, as a :class:`~kubeproxy.proxier.SyncObserver` (sync durations, last
  queued and last successful sync times, sync failures, network programming latency);
* :meth:`ProxyMetrics.after_sync`, a :class:`~kubeproxy.proxier.SyncHook` keeping the
  ``no_local_endpoints`` gauges (incrementally: only changed Services are looked at on a
  partial sync);
* :meth:`ProxyMetrics.track`, which makes the change-tracker counters (pending and
  total Service and EndpointSlice changes) readable at scrape time;
* the health servers (:class:`~kubeproxy.health.HealthMetrics`) and the conntrack
  reconciler (:meth:`ProxyMetrics.conntrack_reconciled`);
* the self-healing core (:meth:`ProxyMetrics.external_change`): our
  ``kubeproxy_sync_proxy_rules_external_changes_total{ip_family,kind}``, changes of our
  rules made by someone else and repaired (not an upstream metric).

:class:`MetricsServer` serves ``/metrics``, ``/healthz`` (``ok``), ``/proxyMode`` and
``/configz`` (the effective configuration, as upstream), and upstream's ``/statusz`` and
``/flagz`` when their gates are on, on the metrics address (default ``127.0.0.1:10249``).
The text is written the way Go's client writes it (:func:`expose`): no ``_created``
series, numbers and ``le`` bounds formatted as Go formats floats (``le="1"``, not
``le="1.0"``), families sorted by name, so dashboards and alerts written against upstream
keep matching.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from kubeproxy.host.httpserving import DEFAULT_MAX_HANDLERS, BackgroundServer, Response, Route
from kubeproxy.objects import IPFamily, NamespacedName, ServicePort, ServicePortName
from kubeproxy.selfheal import ChangeKind
from kubeproxy.zpages import flagz_page, statusz_page

if TYPE_CHECKING:
    from kubeproxy.backend import ProxySnapshot, SyncChanges
    from kubeproxy.endpointchanges import EndpointsChangeTracker
    from kubeproxy.objects import CategorizedEndpoints
    from kubeproxy.proxier import FinishedSync, Proxier
    from kubeproxy.servicechanges import ServiceChangeTracker

__all__ = [
    "CONFIGZ_GROUP",
    "CONTENT_TYPE",
    "DEFAULT_METRICS_ADDRESS",
    "DEPRECATED_MODES",
    "MODES",
    "NETWORK_PROGRAMMING_BUCKETS",
    "PACKET_COUNTERS",
    "SYNC_BUCKETS",
    "MetricsServer",
    "PerRegistry",
    "ProxyMetrics",
    "expose",
    "go_float",
]

DEFAULT_METRICS_ADDRESS: Final = "127.0.0.1:10249"
"""Upstream's default ``metricsBindAddress``."""

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
"""The content type of :func:`expose`'s output (Prometheus text format 0.0.4)."""

MODES: Final = ("nftables", "iptables", "ipvs")
"""Proxy modes; each registers its own failure counters, as upstream."""

DEPRECATED_MODES: Final = ("ipvs",)
"""Modes that set ``kubeproxy_deprecated_proxy_mode{mode=...} 1`` (ours, not upstream's)."""

SYNC_BUCKETS: Final = tuple(0.001 * 2**i for i in range(15))
"""Sync-duration buckets: 1 ms doubling to 16.384 s (Go's ``ExponentialBuckets(0.001, 2, 15)``)."""

NETWORK_PROGRAMMING_BUCKETS: Final = (
    0.0,  # upstream's bucket-merging helper starts from a zero bucket
    # Ours: changes are programmed in milliseconds here, where upstream's first bucket
    # (0.25 s) would put every one of them (issue 29).
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.15,
    0.2,
    0.25,
    0.5,
    *map(float, range(1, 60)),
    *map(float, range(60, 120, 5)),
    *map(float, range(120, 301, 30)),
)
"""Network-programming buckets: upstream's (0, 0.25, 0.5, 1..59 s, 60..115 s by 5,
120..300 s by 30) and ours below 0.25 s (5, 10, 25, 50, 100, 150 and 200 ms), so the
histogram can tell a p99 under 100 ms."""

_PREFIX: Final = "kubeproxy_"

logger = logging.getLogger(__name__)


# --- exposition -----------------------------------------------------------------------


def go_float(value: float) -> str:
    """``value`` as Go's Prometheus client writes it (``strconv`` 'g' format, shortest).

    ``1`` not ``1.0``; ``1e+06`` and ``1.767323045e+09`` for large values, ``1e-05`` for
    small ones; ``+Inf``, ``-Inf``, ``NaN``.
    """
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "-0" if math.copysign(1.0, value) < 0 else "0"
    sign, digit_tuple, exponent = Decimal(repr(float(value))).as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(map(str, digit_tuple)).lstrip("0")
    stripped = digits.rstrip("0")
    exponent += len(digits) - len(stripped)
    digits = stripped
    # value = 0.<digits> * 10**point
    point = len(digits) + exponent
    decimal_exponent = point - 1
    prefix = "-" if sign else ""
    # Go's shortest 'g' switches to an exponent from 1e+06 on (1.767323045e+09).
    if decimal_exponent < -4 or decimal_exponent >= 6:
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        sign_char = "-" if decimal_exponent < 0 else "+"
        return f"{prefix}{mantissa}e{sign_char}{abs(decimal_exponent):02d}"
    if point <= 0:
        return f"{prefix}0.{'0' * -point}{digits}"
    if point >= len(digits):
        return f"{prefix}{digits}{'0' * (point - len(digits))}"
    return f"{prefix}{digits[:point]}.{digits[point:]}"


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


_TYPES: Final = {"unknown": "untyped", "gaugehistogram": "histogram", "stateset": "gauge"}


def _exposed_name(metric: Metric) -> str:
    if metric.type == "counter":
        return metric.name + "_total"
    if metric.type == "info":
        return metric.name + "_info"
    return metric.name


def _family_lines(metric: Metric) -> Iterator[str]:
    name = _exposed_name(metric)
    kind = "gauge" if metric.type == "info" else metric.type
    yield f"# HELP {name} {_escape_help(metric.documentation)}\n"
    yield f"# TYPE {name} {_TYPES.get(kind, kind)}\n"
    # Go sorts a family's series by label values; a histogram's buckets stay in order.
    groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for sample in metric.samples:
        if sample.name.endswith("_created") or sample.name.endswith(("_gsum", "_gcount")):
            continue
        key = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("le", "quantile")))
        labels = ",".join(
            f'{label}="{_escape_label(value)}"'
            for label, value in sorted(
                sample.labels.items(), key=lambda item: (item[0] in ("le", "quantile"), item[0])
            )
        )
        text = sample.name + (f"{{{labels}}}" if labels else "")
        groups.setdefault(key, []).append(f"{text} {go_float(sample.value)}\n")
    for key in sorted(groups):
        yield from groups[key]


def _bucket_labels(metric: Metric) -> Metric:
    """Rewrite ``le`` bound labels into Go's float format."""
    for index, sample in enumerate(metric.samples):
        bound = sample.labels.get("le")
        if bound is not None:
            labels = dict(sample.labels)
            labels["le"] = go_float(float(bound))
            metric.samples[index] = sample._replace(labels=labels)
    return metric


def expose(registry: Collector) -> bytes:
    """Everything ``registry`` collects, in the Prometheus text format as Go writes it."""
    families = sorted(registry.collect(), key=_exposed_name)
    return "".join(
        line for metric in families for line in _family_lines(_bucket_labels(metric))
    ).encode()


# --- the metrics ----------------------------------------------------------------------


PACKET_COUNTERS: Final = {
    "ct_state_invalid_dropped_pkts": (
        "iptables_ct_state_invalid_dropped_packets",
        "packets dropped by iptables to work around conntrack problems",
    ),
    "localhost_nps_accepted_pkts": (
        "iptables_localhost_nodeports_accepted_packets",
        "Number of packets accepted on nodeports of loopback interface",
    ),
}
"""Upstream's iptables-mode counters: nfacct counter name -> (metric name, help text)."""


class _PacketCounters(Collector):
    """Reads the iptables backend's nfacct counters at scrape time (upstream's custom
    collectors: a counter that cannot be read is left out of the scrape)."""

    def __init__(self, read: Callable[[], Mapping[str, int]]) -> None:
        self.read = read

    def collect(self) -> Iterable[Metric]:
        """One counter family per nfacct counter read."""
        try:
            counts = self.read()
        except Exception:  # a scrape must not fail for a counter
            logger.exception("Reading the nfacct packet counters failed")
            return
        for counter, (name, help_text) in PACKET_COUNTERS.items():
            if counter in counts:
                yield CounterMetricFamily(_PREFIX + name, help_text, value=counts[counter])


class _ChangeCounters(Collector):
    """Reads the trackers' counters at scrape time (pending and total changes)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.service_trackers: list[ServiceChangeTracker] = []
        self.endpoint_trackers: list[EndpointsChangeTracker] = []

    def collect(self) -> Iterable[Metric]:
        """The four change metrics, summed over the tracked proxiers."""
        with self.lock:
            services = list(self.service_trackers)
            endpoints = list(self.endpoint_trackers)
        yield GaugeMetricFamily(
            _PREFIX + "sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            value=sum(t.pending_count for t in endpoints),
        )
        yield CounterMetricFamily(
            _PREFIX + "sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            value=sum(t.total_changes for t in endpoints),
        )
        yield GaugeMetricFamily(
            _PREFIX + "sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            value=sum(t.pending_count for t in services),
        )
        yield CounterMetricFamily(
            _PREFIX + "sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            value=sum(t.total_changes for t in services),
        )


def _no_local(port: ServicePort, categorized: CategorizedEndpoints | None) -> tuple[bool, bool]:
    """(internal, external): whether a Local policy of the port finds no local endpoint."""
    if categorized is not None and categorized.local:
        return False, False
    return port.internal_policy_local, port.external_policy_local and port.externally_accessible


class _NoLocalEndpoints:
    """Ports whose Local traffic policy has no local endpoint, of one family, by Service."""

    __slots__ = ("by_service", "external", "internal")

    def __init__(self) -> None:
        self.by_service: dict[NamespacedName, dict[ServicePortName, tuple[bool, bool]]] = {}
        self.internal = 0
        self.external = 0

    def _drop(self, service: NamespacedName) -> None:
        for internal, external in self.by_service.pop(service, {}).values():
            self.internal -= internal
            self.external -= external

    def _add(self, name: ServicePortName, flags: tuple[bool, bool]) -> None:
        if flags == (False, False):
            return
        self.by_service.setdefault(name.service, {})[name] = flags
        self.internal += flags[0]
        self.external += flags[1]

    def recount(self, snapshot: ProxySnapshot) -> None:
        """Count every port afresh."""
        self.by_service.clear()
        self.internal = self.external = 0
        categorized = snapshot.categorized
        for name, port in snapshot.services.items():
            self._add(name, _no_local(port, categorized.get(name)))

    def update(
        self, snapshot: ProxySnapshot, services: Iterable[NamespacedName], ports_of: PortsOf
    ) -> None:
        """Count the ports of ``services`` afresh."""
        for service in services:
            self._drop(service)
            for name in ports_of(service):
                port = snapshot.services.get(name)
                if port is not None:
                    self._add(name, _no_local(port, snapshot.categorized.get(name)))


PortsOf = Callable[[NamespacedName], Iterable[ServicePortName]]


_C = TypeVar("_C", bound=Collector)


class PerRegistry(Generic[_C]):
    """One collector of a kind per registry, made by ``make`` and registered there the
    first time :meth:`of` is asked (a backend's collectors serve every family of the
    daemon, which calls its hooks once per backend)."""

    def __init__(self, make: Callable[[], _C]) -> None:
        self._make = make
        self._made: weakref.WeakKeyDictionary[Any, _C] = weakref.WeakKeyDictionary()

    def of(self, registry: CollectorRegistry) -> _C:
        """``registry``'s collector, registered now if it had none."""
        collector = self._made.get(registry)
        if collector is None:
            collector = self._made[registry] = self._make()
            registry.register(collector)
        return collector


class _LabelledChildren:
    """``metric.labels(*values)``, each child made once and kept.

    prometheus-client's ``labels()`` validates the values, builds a tuple and takes the
    metric's lock every time: 10.6 us a call against 0.9 us to set the child it returns
    (``python -m timeit`` here). The sync observers call it on every sync, and
    ``sync_queued`` on every change the watch delivers: about 7 calls a sync, one a
    change, 2-4 % of the daemon's CPU under churn (30k Services, 50 updates a second).
    The children of a metric never change while it lives (we remove none), so they are
    kept by metric and values. Safe from several threads: two threads making the same
    child at once both get the one ``labels()`` keeps.
    """

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def __call__(self, metric: Any, *values: str) -> Any:
        """The child of ``metric`` for ``values``."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child


class ProxyMetrics:
    """Upstream's kube-proxy metrics in a registry of their own (or the one given).

    ``mode`` (``nftables``, ``iptables`` or ``ipvs``) picks the mode-specific metrics, as
    upstream: nftables registers ``..._nftables_sync_failures_total`` and
    ``..._nftables_cleanup_failures_total``; iptables ``..._iptables_restore_failures_total``,
    ``..._iptables_partial_restore_failures_total``, ``..._iptables_total`` and
    ``..._iptables_last`` (and, through :meth:`count_packets`, the nfacct packet
    counters); ipvs ``..._iptables_restore_failures_total``. The full and
    partial sync histograms are registered in every mode (every backend here has both
    kinds of sync). A deprecated mode (:data:`DEPRECATED_MODES`) also sets
    ``kubeproxy_deprecated_proxy_mode{mode="ipvs"}`` to 1: our metric, not upstream's, so
    an alert can find the nodes still to migrate.

    A failed sync counts in the mode's sync-failure counter (``..._nftables_sync_failures``
    or ``..._iptables_restore_failures``) unless :meth:`count_failures_from_backend` was
    called: then the backend's own count of failed restores is fed in through
    :meth:`restore_failed` (upstream counts every failed iptables-restore, partial or
    full, and nothing else; a backend may run several restores in one sync).

    ``process_metrics`` adds prometheus-client's process collector
    (``process_cpu_seconds_total``, ``process_resident_memory_bytes``, ...); leave it
    off when the registry given already has one. ``clock`` gives wall-clock seconds.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        mode: str = "nftables",
        process_metrics: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown proxy mode {mode!r}; want one of {', '.join(MODES)}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self.mode = mode
        self.clock = clock
        self._child = _LabelledChildren()
        reg = self.registry
        family = ["ip_family"]

        def histogram(name: str, help_text: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(_PREFIX + name, help_text, family, buckets=buckets, registry=reg)

        def counter(name: str, help_text: str, labels: Sequence[str] = family) -> Counter:
            return Counter(_PREFIX + name, help_text, labels, registry=reg)

        def gauge(name: str, help_text: str, labels: Sequence[str] = family) -> Gauge:
            return Gauge(_PREFIX + name, help_text, labels, registry=reg)

        self.sync_duration = histogram(
            "sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds", SYNC_BUCKETS
        )
        self.sync_full_duration = histogram(
            "sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            SYNC_BUCKETS,
        )
        self.sync_partial_duration = histogram(
            "sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            SYNC_BUCKETS,
        )
        self.last_sync = gauge(
            "sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
        )
        self.last_queued = gauge(
            "sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
        )
        self.network_programming = histogram(
            "network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            NETWORK_PROGRAMMING_BUCKETS,
        )
        self.no_local_endpoints = gauge(
            "sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            ["traffic_policy", "ip_family"],
        )
        self.healthz_total = counter(
            "proxy_healthz_total", "Cumulative proxy healthz HTTP status", ["code"]
        )
        self.livez_total = counter(
            "proxy_livez_total", "Cumulative proxy livez HTTP status", ["code"]
        )
        self.conntrack_duration = histogram(
            "conntrack_reconciler_sync_duration_seconds",
            "ReconcileConntrackFlowsLatency latency in seconds",
            SYNC_BUCKETS,
        )
        self.conntrack_deleted = counter(
            "conntrack_reconciler_deleted_entries_total",
            "Cumulative conntrack flows deleted by conntrack reconciler",
        )
        # Ours, not upstream's: see kubeproxy.selfheal.
        self.external_changes = counter(
            "sync_proxy_rules_external_changes_total",
            "Cumulative changes of the proxy rules by someone else, found and repaired, by"
            " what was found",
            ["ip_family", "kind"],
        )
        self.sync_failures: Counter | None = None
        self.nftables_cleanup_failures: Counter | None = None
        self.iptables_partial_restore_failures: Counter | None = None
        self.iptables_rules_total: Gauge | None = None
        self.iptables_rules_last: Gauge | None = None
        if mode == "nftables":
            self.sync_failures = counter(
                "sync_proxy_rules_nftables_sync_failures_total",
                "Cumulative proxy nftables sync failures",
            )
            self.nftables_cleanup_failures = counter(
                "sync_proxy_rules_nftables_cleanup_failures_total",
                "Cumulative proxy nftables cleanup failures",
            )
        else:
            self.sync_failures = counter(
                "sync_proxy_rules_iptables_restore_failures_total",
                "Cumulative proxy iptables restore failures",
            )
        if mode == "iptables":
            self.iptables_partial_restore_failures = counter(
                "sync_proxy_rules_iptables_partial_restore_failures_total",
                "Cumulative proxy iptables partial restore failures",
            )
            self.iptables_rules_total = gauge(
                "sync_proxy_rules_iptables_total",
                "Total number of iptables rules owned by kube-proxy",
                ["table", "ip_family"],
            )
            self.iptables_rules_last = gauge(
                "sync_proxy_rules_iptables_last",
                "Number of iptables rules written by kube-proxy in last sync",
                ["table", "ip_family"],
            )
        self.deprecated_mode: Gauge | None = None
        if mode in DEPRECATED_MODES:
            self.deprecated_mode = Gauge(
                _PREFIX + "deprecated_proxy_mode",
                "1 while this proxy runs in a deprecated mode (ipvs); migrate to nftables",
                ["mode"],
                registry=reg,
            )
            self.deprecated_mode.labels(mode).set(1)
        self._failures_from_backend = False
        self._packet_counters: _PacketCounters | None = None
        self._changes = _ChangeCounters()
        reg.register(self._changes)
        if process_metrics:
            ProcessCollector(registry=reg)
        self._no_local: dict[IPFamily, _NoLocalEndpoints] = {}
        self._no_local_lock = threading.Lock()

    # Wiring

    def track(self, proxier: Proxier) -> None:
        """Report ``proxier``'s change trackers in the pending/total change metrics.

        Track both proxiers of a dual-stack pair: totals add up (a Service event counts
        once per family, as upstream), pending counts add up. The family's external-change
        counters start at 0 for every kind, so that rates and alerts see them.
        """
        self.track_trackers(proxier.service_changes, proxier.endpoint_changes)
        for kind in ChangeKind:
            self.external_changes.labels(proxier.family.value, kind)

    def track_trackers(
        self, services: ServiceChangeTracker, endpoints: EndpointsChangeTracker
    ) -> None:
        """Report these change trackers (what :meth:`track` does for a proxier)."""
        with self._changes.lock:
            self._changes.service_trackers.append(services)
            self._changes.endpoint_trackers.append(endpoints)

    # SyncObserver

    def sync_queued(self, family: IPFamily) -> None:
        """A sync was requested: stamp the last-queued time."""
        self._child(self.last_queued, family.value).set(self.clock())

    def sync_finished(self, sync: FinishedSync) -> None:
        """Observe the duration (every sync); stamp success or count the failure."""
        label, child, duration = sync.family.value, self._child, sync.duration
        child(self.sync_duration, label).observe(duration)
        child(self.sync_full_duration if sync.full else self.sync_partial_duration, label).observe(
            duration
        )
        if sync.error is None:
            child(self.last_sync, label).set(self.clock())
        elif self.sync_failures is not None and not self._failures_from_backend:
            self.sync_failures.labels(label).inc()

    def endpoints_trigger_times(self, family: IPFamily, times: list[float]) -> None:
        """Observe ``now - t`` for every EndpointSlice trigger time a sync applied."""
        now = self.clock()
        histogram = self._child(self.network_programming, family.value)
        for moment in times:
            histogram.observe(now - moment)

    def sync_loop_started(self, family: IPFamily) -> None:
        """The sync loop of ``family`` started (upstream stamps the last-sync time then)."""
        self.last_sync.labels(family.value).set(self.clock())

    # SyncHook

    def after_sync(self, proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Update the no-local-endpoints gauges (only changed Services on partial syncs)."""
        family = snapshot.family
        with self._no_local_lock:
            counts = self._no_local.get(family)
            if counts is None or changes.full:
                counts = self._no_local[family] = _NoLocalEndpoints()
                counts.recount(snapshot)
            else:
                counts.update(snapshot, changes.changed_services, proxier.ports_of)
            internal, external = counts.internal, counts.external
        self._child(self.no_local_endpoints, "internal", family.value).set(internal)
        self._child(self.no_local_endpoints, "external", family.value).set(external)

    # Health and conntrack

    def healthz_response(self, code: int) -> None:
        """Count a ``/healthz`` answer."""
        self.healthz_total.labels(str(code)).inc()

    def livez_response(self, code: int) -> None:
        """Count a ``/livez`` answer."""
        self.livez_total.labels(str(code)).inc()

    def conntrack_reconciled(self, family: IPFamily, seconds: float, deleted: int) -> None:
        """Record one conntrack reconciliation: its duration and the flows it deleted."""
        self.conntrack_duration.labels(family.value).observe(seconds)
        self.conntrack_deleted.labels(family.value).inc(deleted)

    def external_change(self, family: IPFamily, kind: str) -> None:
        """Someone else changed our rules in ``family``; ``kind`` says what was found
        (:class:`kubeproxy.selfheal.ChangeKind`)."""
        self.external_changes.labels(family.value, kind).inc()

    # Backend-specific

    def count_failures_from_backend(self) -> None:
        """From now on failed syncs are counted through :meth:`restore_failed` only."""
        self._failures_from_backend = True

    def restore_failed(self, family: IPFamily, count: int = 1) -> None:
        """``count`` iptables-restore runs failed (iptables and ipvs modes)."""
        if self.sync_failures is not None and self.mode != "nftables" and count > 0:
            self.sync_failures.labels(family.value).inc(count)

    def nftables_cleanup_failed(self, family: IPFamily) -> None:
        """An nftables stale-object cleanup failed (nftables mode only)."""
        if self.nftables_cleanup_failures is not None:
            self.nftables_cleanup_failures.labels(family.value).inc()

    def iptables_partial_restore_failed(self, family: IPFamily) -> None:
        """A partial iptables-restore failed and fell back to a full one (iptables mode)."""
        if self.iptables_partial_restore_failures is not None:
            self.iptables_partial_restore_failures.labels(family.value).inc()

    def count_packets(self, read: Callable[[], Mapping[str, int]]) -> None:
        """iptables mode: export the nfacct counters ``read`` returns (by counter name, see
        :data:`PACKET_COUNTERS`) at every scrape. Both families' backends read the same
        counters, so only the first call registers; other modes ignore it."""
        if self.mode != "iptables" or self._packet_counters is not None:
            return
        self._packet_counters = _PacketCounters(read)
        self.registry.register(self._packet_counters)

    def iptables_rules(self, family: IPFamily, table: str, total: int, last: int) -> None:
        """Rules owned in ``table`` and rules written by the last sync (iptables mode)."""
        if self.iptables_rules_total is not None and self.iptables_rules_last is not None:
            self.iptables_rules_total.labels(table, family.value).set(total)
            self.iptables_rules_last.labels(table, family.value).set(last)

    # Exposition

    def expose(self) -> bytes:
        """The registry in the Prometheus text format (see :func:`expose`)."""
        return expose(self.registry)


CONFIGZ_GROUP: Final = "kubeproxy.config.k8s.io"
"""The key ``/configz`` files the configuration under (upstream's configz name)."""


_TEXT: Final[Mapping[str, str]] = {
    "Content-Type": "text/plain; charset=utf-8",
    "X-Content-Type-Options": "nosniff",
}


class MetricsServer:
    """``/metrics``, ``/healthz``, ``/proxyMode``, ``/configz`` (and the z-pages) on the
    metrics address.

    ``/metrics`` is :meth:`ProxyMetrics.expose`; ``/healthz`` answers ``ok`` (the
    component's generic liveness check, unrelated to the proxy's own health);
    ``/proxyMode`` the mode's name; ``/configz`` the effective configuration ``configz``
    as JSON under :data:`CONFIGZ_GROUP`, as upstream serves it (upstream shows its
    internal configuration type; this is the ``v1alpha1`` document ``--write-config-to``
    writes, the form an operator can read back). ``statusz`` adds ``/statusz`` and
    ``flagz`` (flag name -> value) ``/flagz``, upstream's z-pages (:mod:`kubeproxy.zpages`).
    An empty ``address`` disables the server; binding follows
    :class:`~kubeproxy.host.httpserving.BackgroundServer` (retry every 5 s, or raise
    :class:`~kubeproxy.host.httpserving.ServerBindError` at :meth:`start` with ``hard_fail``), and
    so do ``backlog`` and ``max_handlers``.
    """

    def __init__(
        self,
        address: str,
        metrics: ProxyMetrics,
        *,
        hard_fail: bool = False,
        retry_interval: float = 5.0,
        configz: Mapping[str, object] | None = None,
        statusz: bool = False,
        flagz: Mapping[str, str] | None = None,
        backlog: int | None = None,
        max_handlers: int | None = DEFAULT_MAX_HANDLERS,
    ) -> None:
        self.metrics = metrics
        self._configz = json.dumps({CONFIGZ_GROUP: dict(configz or {})}).encode()
        self._started = time.time()
        routes: dict[str, Route] = {
            "/metrics": self._metrics,
            "/healthz": self._healthz,
            "/proxyMode": self._mode,
            "/configz": self._config,
        }
        if flagz is not None:
            flags_page = flagz_page(flagz)
            routes["/flagz"] = lambda: (200, _TEXT, flags_page)
        if statusz:
            routes["/statusz"] = lambda: (200, _TEXT, statusz_page(self._started, routes))
        self.server = BackgroundServer(
            "metrics",
            address,
            routes,
            hard_fail=hard_fail,
            retry_interval=retry_interval,
            backlog=backlog,
            max_handlers=max_handlers,
        )

    @property
    def port(self) -> int | None:
        """The bound port, or None while not bound."""
        return self.server.port

    def start(self) -> None:
        """Start serving."""
        self.server.start()

    def stop(self) -> None:
        """Stop serving."""
        self.server.stop()

    def add_routes(self, routes: Mapping[str, Route]) -> None:
        """Serve ``routes`` too (the ``/debug/`` pages, added once the backends exist)."""
        self.server.add_routes(routes)

    def _metrics(self) -> Response:
        return 200, {"Content-Type": CONTENT_TYPE}, self.metrics.expose()

    @staticmethod
    def _healthz() -> Response:
        return 200, _TEXT, b"ok"

    def _config(self) -> Response:
        return 200, {"Content-Type": "application/json"}, self._configz

    def _mode(self) -> Response:
        return 200, _TEXT, self.metrics.mode.encode()
