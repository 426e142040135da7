"""kubeproxy: Kubernetes service proxying for Linux, as a reusable core plus renderers.

The core tracks Services, EndpointSlices and the Node, batches their changes, applies
traffic policy and topology once, and hands each backend a consistent, already computed
view (:class:`ProxySnapshot`). Backends (``kubeproxy.backends.nftables``, or your own)
implement :class:`Backend`. The public names are listed in ``__all__``; everything else is
internal and may change.
"""

from kubeproxy.backend import (
    Backend,
    BackendFactory,
    NodePortAddresses,
    ProxySnapshot,
    SkippedPorts,
    SyncChanges,
    SyncError,
)
from kubeproxy.config import IPVSSettings, LocalDetectMode, LocalDetector, ProxierConfig
from kubeproxy.endpointchanges import EndpointsChangeTracker, EndpointsMap
from kubeproxy.handlers import KubeObject, ProxyHandler
from kubeproxy.objects import (
    CategorizedEndpoints,
    Endpoint,
    IPFamily,
    NamespacedName,
    NodeInfo,
    Protocol,
    ServicePort,
    ServicePortName,
)
from kubeproxy.parse import InvalidObject
from kubeproxy.proxier import DualStackProxier, Proxier, SyncObserver
from kubeproxy.runner import BoundedFrequencyRunner
from kubeproxy.servicechanges import ServiceChangeTracker, ServicePortMap
from kubeproxy.sources.manifests import ManifestSource
from kubeproxy.topology import categorize_endpoints

__all__ = [
    "Backend",
    "BackendFactory",
    "BoundedFrequencyRunner",
    "CategorizedEndpoints",
    "DualStackProxier",
    "Endpoint",
    "EndpointsChangeTracker",
    "EndpointsMap",
    "IPFamily",
    "IPVSSettings",
    "InvalidObject",
    "KubeObject",
    "LocalDetectMode",
    "LocalDetector",
    "ManifestSource",
    "NamespacedName",
    "NodeInfo",
    "NodePortAddresses",
    "Protocol",
    "Proxier",
    "ProxierConfig",
    "ProxyHandler",
    "ProxySnapshot",
    "ServiceChangeTracker",
    "ServicePort",
    "ServicePortMap",
    "ServicePortName",
    "SkippedPorts",
    "SyncChanges",
    "SyncError",
    "SyncObserver",
    "categorize_endpoints",
]
