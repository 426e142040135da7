"""Sources: where Services, EndpointSlices, the Node and service CIDRs come from.

A source feeds a :class:`kubeproxy.handlers.ProxyHandler`: the initial list as add calls,
then ``on_*_synced`` once, then changes as they happen.

* :class:`ManifestSource` reads a directory of manifest files;
* :class:`KubernetesSource` lists and watches the API server (with :class:`NodeWatcher`,
  upstream's exit rules for this node's Node, and :func:`make_api_client`). It is imported
  on first use: the Kubernetes client costs about half a second to import, which users of
  the manifests source and of the rest of the core should not pay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kubeproxy.sources.manifests import ManifestSource

if TYPE_CHECKING:
    from kubeproxy.sources.kubernetes import KubernetesSource, NodeWatcher, make_api_client

__all__ = ["KubernetesSource", "ManifestSource", "NodeWatcher", "make_api_client"]

_LAZY = frozenset({"KubernetesSource", "NodeWatcher", "make_api_client"})


def __getattr__(name: str) -> Any:
    """Import the Kubernetes source's names when first asked for."""
    if name in _LAZY:
        from kubeproxy.sources import kubernetes

        return getattr(kubernetes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
