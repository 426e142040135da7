"""Health: the proxy's own health state, its ``/healthz`` and ``/livez`` server, and the
per-Service health-check servers that load balancers probe.

Semantics follow upstream kube-proxy (``pkg/proxy/healthcheck``, 1.33+):

* :class:`ProxyHealth` keeps, per IP family, when the proxier last synced successfully
  and since when an un-synced change has been waiting. The proxy is healthy when no
  family that has synced at least once has had a change waiting for ``health_timeout``
  (upstream: twice ``syncPeriod``). The node is *eligible* unless it is being deleted or
  carries the cluster autoscaler's ``ToBeDeletedByClusterAutoscaler`` taint (or is not
  known yet).
* Beyond upstream, :class:`ProxyHealth` also holds *data-plane faults*: what the proxy
  knows the kernel lacks of what it last wrote (rules removed by someone else and not yet
  repaired, syncs failing repeatedly), reported and cleared by whoever detects them
  (:meth:`ProxyHealth.report_data_plane_broken`,
  :meth:`ProxyHealth.report_data_plane_repaired`). A node that answers 200 while its
  rules are gone receives load-balancer traffic it cannot deliver.
* :class:`ProxyHealthServer` serves ``/healthz`` (200 iff healthy, no data-plane fault and
  the node eligible; a fault's reason is in the body) and ``/livez`` (200 iff healthy)
  with upstream's JSON body and headers.
* :class:`ServiceHealthServer` opens one listener per ``healthCheckNodePort`` (Services
  of type LoadBalancer with ``externalTrafficPolicy: Local``) and answers 200 when the
  Service has local ready endpoints and the proxy is healthy with no data-plane fault,
  503 otherwise.
* :class:`HealthObserver` ties them to a :class:`~kubeproxy.proxier.Proxier`: it is a
  :class:`~kubeproxy.proxier.SyncObserver` (queued / finished syncs; repeated failed
  syncs become a data-plane fault) and its :meth:`HealthObserver.after_sync` is a
  :class:`~kubeproxy.proxier.SyncHook`.

Every listener here is :mod:`kubeproxy.host.httpserving`'s (long accept queues, a bound on
the handlers at once, binding and retrying as upstream); its names are imported from
there.

One concept per module, the public names re-exported here (``__all__``):

* :mod:`~kubeproxy.health.state`: :class:`ProxyHealth`, the faults, the JSON body;
* :mod:`~kubeproxy.health.proxy`: :class:`ProxyHealthServer` (``/healthz``, ``/livez``);
* :mod:`~kubeproxy.health.services`: :class:`ServiceHealthServer` (the
  HealthCheckNodePorts), on the one accept thread of :mod:`~kubeproxy.health.acceptloop`;
* :mod:`~kubeproxy.health.observer`: :class:`HealthObserver`, the wiring to the proxier.

The listener machinery, a concept of its own, lives in :mod:`kubeproxy.host.httpserving`.
"""

from kubeproxy.health.observer import SYNC_FAILURE_THRESHOLD, HealthObserver
from kubeproxy.health.proxy import DEFAULT_HEALTHZ_ADDRESS, HealthMetrics, ProxyHealthServer
from kubeproxy.health.services import ListenErrorCallback, ServiceHealthServer
from kubeproxy.health.state import (
    FAULT_FIRST_SYNC,
    FAULT_RULES_REMOVED,
    FAULT_SYNC_FAILURES,
    DataPlaneFault,
    FamilyHealth,
    HealthStatus,
    ProxyHealth,
    format_time,
)

__all__ = [
    "DEFAULT_HEALTHZ_ADDRESS",
    "FAULT_FIRST_SYNC",
    "FAULT_RULES_REMOVED",
    "FAULT_SYNC_FAILURES",
    "SYNC_FAILURE_THRESHOLD",
    "DataPlaneFault",
    "FamilyHealth",
    "HealthMetrics",
    "HealthObserver",
    "HealthStatus",
    "ListenErrorCallback",
    "ProxyHealth",
    "ProxyHealthServer",
    "ServiceHealthServer",
    "format_time",
]
