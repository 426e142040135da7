"""Health and metrics wiring: upstream's servers (:func:`servers`), and the health checks
per family (:func:`health_checks`).

``/healthz`` and ``/livez`` (:class:`~kubeproxy.health.ProxyHealthServer`, unhealthy when
a change has waited two ``syncPeriod``s, or while a data-plane fault is reported),
``/metrics`` (with the feature gates' ``kubernetes_feature_enabled``), ``/proxyMode``,
``/configz``, and ``/statusz`` and ``/flagz`` under their gates
(:class:`~kubeproxy.metrics.MetricsServer`),
and one :class:`~kubeproxy.health.ServiceHealthServer` per family for the
HealthCheckNodePorts, whose listen failures become Events.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kubeproxy.configfile.codec import config_document
from kubeproxy.daemon.options import DaemonOptions
from kubeproxy.events import (
    ACTION_LISTEN,
    REASON_FAILED_SERVICE_HEALTHCHECK,
    WARNING,
    EventSink,
    ObjectReference,
)
from kubeproxy.featuregates import COMPONENT_FLAGZ, COMPONENT_STATUSZ, FeatureEnabledCollector
from kubeproxy.health import HealthObserver, ProxyHealth, ProxyHealthServer, ServiceHealthServer
from kubeproxy.metrics import MetricsServer, ProxyMetrics
from kubeproxy.objects import IPFamily, NamespacedName, NodeInfo

__all__ = ["Servers", "health_checks", "listen_error_reporter", "servers"]


def listen_error_reporter(events: EventSink) -> Callable[[NamespacedName, int, str], None]:
    """What a HealthCheckNodePort that cannot listen reports: a Warning Event about its
    Service (upstream's ``FailedToStartServiceHealthcheck``)."""

    def report(service: NamespacedName, port: int, message: str) -> None:
        ref = ObjectReference.service(service.namespace, service.name, uid=str(service))
        events.record(WARNING, REASON_FAILED_SERVICE_HEALTHCHECK, ACTION_LISTEN, message, ref)

    return report


@dataclass(frozen=True, slots=True)
class Servers:
    """The metrics and health state and their servers."""

    metrics: ProxyMetrics
    metrics_server: MetricsServer
    health: ProxyHealth
    health_server: ProxyHealthServer


def servers(
    options: DaemonOptions, mode: str, sync_period: float, node: NodeInfo | None = None
) -> Servers:
    """Upstream's servers: metrics, and /healthz and /livez (2 x syncPeriod).

    ``node`` None: not known yet (the node is not eligible until
    :meth:`~kubeproxy.health.ProxyHealth.set_node`).
    """
    hard_fail = options.bind_address_hard_fail
    metrics = ProxyMetrics(mode=mode)
    metrics.registry.register(FeatureEnabledCollector(options.gates))
    health = ProxyHealth(2 * sync_period, node=node)
    return Servers(
        metrics,
        MetricsServer(
            options.metrics_bind_address,
            metrics,
            hard_fail=hard_fail,
            configz=config_document(options.configuration),
            statusz=options.gates.enabled(COMPONENT_STATUSZ),
            flagz=options.flags if options.gates.enabled(COMPONENT_FLAGZ) else None,
        ),
        health,
        ProxyHealthServer(options.healthz_bind_address, health, metrics, hard_fail=hard_fail),
    )


def health_checks(
    options: DaemonOptions, health: ProxyHealth, families: Sequence[IPFamily], events: EventSink
) -> HealthObserver:
    """The per-family Service health checks (HealthCheckNodePorts), fed by the returned
    observer; a port that cannot listen is a Warning Event."""
    report = listen_error_reporter(events)
    service_health = {
        family: ServiceHealthServer(
            family, health, node_name=options.node_name, on_listen_error=report
        )
        for family in families
    }
    return HealthObserver(health, service_health)
