"""Sources: where Services, EndpointSlices, the Node and service CIDRs come from.

A source feeds a :class:`kubeproxy.handlers.ProxyHandler`: the initial list as add calls,
then ``on_*_synced`` once, then changes as they happen.
"""

from __future__ import annotations

from kubeproxy.sources.manifests import ManifestSource

__all__ = ["ManifestSource"]
