"""kubeproxy: Kubernetes service proxying for Linux, as a reusable core plus renderers.

The core tracks Services, EndpointSlices and the Node, batches their changes, applies
traffic policy and topology once, and hands each backend a consistent, already computed
view (:class:`ProxySnapshot`). Backends (``kubeproxy.backends.nftables``, or your own)
implement :class:`Backend`. The whole node daemon (upstream's start-up, the API source
with its wait for the Node, health and metrics servers, Events, the run loop) is
:mod:`kubeproxy.daemon`: :func:`run_daemon` runs a backend of yours as a node's proxy.
The public names are listed in ``__all__``; everything else is internal and may change.

Where things are. The core stands at the top of this package: the objects and their
parsing (``objects``, ``parse``, ``handlers``), the change trackers (``servicechanges``,
``endpointchanges``, ``portindex``), ``topology``, the sync loop (``runner``, ``pacing``,
``proxier``), the backend contract (``backend``) and the settings a proxier runs with
(``config``, ``featuregates``). Beside it, one concern each: ``sources`` (the API,
manifests), ``health``, ``metrics``, ``conntrack``, ``nftevents``, ``selfheal``,
``events``, ``logs``. Under them, ``host``: Linux and HTTP plumbing that knows no Service
(of the core it uses ``objects`` only). Above the core: ``configfile`` (upstream's
configuration file, made into ``config``'s settings), ``daemon`` (the node daemon),
``backends`` (the renderers) and ``cmd`` (the binaries); nothing else here imports the
last two. ``testing`` is the flow-case kit.
"""

from typing import TYPE_CHECKING, Any

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
    EndpointRows,
    Endpoints,
    IPFamily,
    NamespacedName,
    NodeInfo,
    Protocol,
    ServicePort,
    ServicePortName,
)
from kubeproxy.pacing import SyncPacing
from kubeproxy.parse import InvalidObject
from kubeproxy.proxier import DualStackProxier, FinishedSync, Proxier, SyncObserver
from kubeproxy.runner import BoundedFrequencyRunner
from kubeproxy.servicechanges import ServiceChangeTracker, ServicePortMap
from kubeproxy.sources.manifests import ManifestSource
from kubeproxy.topology import categorize_endpoints

if TYPE_CHECKING:
    from kubeproxy.daemon import (
        BackendContext,
        BackendHooks,
        Daemon,
        DaemonOptions,
        DaemonPlugins,
        DaemonSeams,
        StartupError,
        build_daemon,
        run_daemon,
    )

# The daemon's names are imported on first use: its servers and metrics (prometheus-client,
# http.server) took ``import kubeproxy`` from 74 to 188 ms here (python -X importtime),
# which every flow-case run and backend import would pay without using them.
_DAEMON_NAMES = frozenset(
    {
        "BackendContext",
        "BackendHooks",
        "Daemon",
        "DaemonOptions",
        "DaemonPlugins",
        "DaemonSeams",
        "StartupError",
        "build_daemon",
        "run_daemon",
    }
)


def __getattr__(name: str) -> Any:
    """The daemon's public names (:mod:`kubeproxy.daemon`), imported when first asked for."""
    if name in _DAEMON_NAMES:
        from kubeproxy import daemon

        return getattr(daemon, name)
    raise AttributeError(f"module 'kubeproxy' has no attribute {name!r}")


def __dir__() -> list[str]:
    """Every name, the daemon's included (for completion and documentation tools)."""
    return sorted(set(globals()) | _DAEMON_NAMES)


__all__ = [
    "Backend",
    "BackendContext",
    "BackendFactory",
    "BackendHooks",
    "BoundedFrequencyRunner",
    "CategorizedEndpoints",
    "Daemon",
    "DaemonOptions",
    "DaemonPlugins",
    "DaemonSeams",
    "DualStackProxier",
    "Endpoint",
    "EndpointRows",
    "Endpoints",
    "EndpointsChangeTracker",
    "EndpointsMap",
    "FinishedSync",
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
    "StartupError",
    "SyncChanges",
    "SyncError",
    "SyncObserver",
    "SyncPacing",
    "build_daemon",
    "categorize_endpoints",
    "run_daemon",
]
