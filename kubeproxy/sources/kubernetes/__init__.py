"""A source fed by the Kubernetes API: list, then watch, through the official client.

:func:`make_api_client` builds a ``kubernetes.client.ApiClient`` from ``--kubeconfig``,
``--master`` or the in-cluster service account, with client-side rate limiting
(``--kube-api-qps``/``--kube-api-burst``) the Python client does not have.

:class:`KubernetesSource` runs one *reflector* thread per resource, as client-go's
informers do: Services, EndpointSlices (``discovery.k8s.io/v1``), this node's Node, and
ServiceCIDRs (``networking.k8s.io/v1``, only when API discovery says the server has
them). Each reflector

* lists in pages (``limit``/``continue``; an expired continue token restarts the list),
  reading the raw JSON (model objects cost 10-20 times more at 10k+ objects), then
  tells the handler ``on_*_synced`` once;
* watches from the list's ``resourceVersion`` with bookmarks, keeping a cache of what the
  handler was told and calling it for every change, with the cached old object on updates;
* on ``410 Gone`` (an expired resourceVersion) lists again and delivers only the
  difference against its cache;
* on any other failure (dropped connection, 5xx, 403, timeouts) logs one line, waits with
  jittered exponential backoff and resumes the watch from the last resourceVersion it saw.

While the API server is away nothing is delivered, so the proxy keeps its rules as they
are; the process never exits because of the API server. It exits (through
:class:`NodeWatcher`) only where upstream does: this Node's host IPs changed, its pod
CIDRs changed while local traffic is detected by node CIDR, or it was deleted.

Handler calls come from the reflector threads, one at a time (a lock serialises them).

One concept per module, the public names re-exported here (``__all__``):

* :mod:`~kubeproxy.sources.kubernetes.apiclient`: building the client, the GET it makes,
  its errors as log lines;
* :mod:`~kubeproxy.sources.kubernetes.ratelimit`: the client-side rate limit;
* :mod:`~kubeproxy.sources.kubernetes.nodewatch`: upstream's exit rules for this Node;
* :mod:`~kubeproxy.sources.kubernetes.reflector`: list and watch one resource;
* :mod:`~kubeproxy.sources.kubernetes.source`: the source, its resources and handler calls.
"""

# ruff: noqa: E402 (the modules below import the client: the check comes first)
from kubeproxy.extras import require_extra

# One line naming the extra, rather than "No module named 'kubernetes'" from deep inside.
require_extra("kubernetes", "kubernetes", "The Kubernetes API source")

from kubeproxy.sources.kubernetes.apiclient import (
    IN_CLUSTER_MESSAGE,
    RateLimitedApiClient,
    make_api_client,
)
from kubeproxy.sources.kubernetes.nodewatch import NodeWatcher, exit_process
from kubeproxy.sources.kubernetes.ratelimit import TokenBucket
from kubeproxy.sources.kubernetes.source import KubernetesSource

__all__ = [
    "IN_CLUSTER_MESSAGE",
    "KubernetesSource",
    "NodeWatcher",
    "RateLimitedApiClient",
    "TokenBucket",
    "exit_process",
    "make_api_client",
]
