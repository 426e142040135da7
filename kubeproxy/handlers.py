"""The handler interfaces a source (manifest directory, Kubernetes API) feeds.

Objects arrive as the Kubernetes JSON form (plain mappings, as ``json.loads`` or YAML
gives them); the core validates and converts them. A source calls ``on_*_synced`` once it
has delivered its initial list; nothing is programmed before every source has synced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeAlias

from kubeproxy.objects import IPNetwork

__all__ = ["KubeObject", "ProxyHandler"]

KubeObject: TypeAlias = Mapping[str, Any]
"""A Kubernetes object in its JSON form (``apiVersion``, ``kind``, ``metadata``, ...)."""


class ProxyHandler(Protocol):
    """Everything a source may tell a proxy."""

    def on_service_add(self, service: KubeObject) -> None:
        """A Service appeared."""
        ...

    def on_service_update(self, old: KubeObject, new: KubeObject) -> None:
        """A Service changed."""
        ...

    def on_service_delete(self, service: KubeObject) -> None:
        """A Service went away."""
        ...

    def on_services_synced(self) -> None:
        """The source has delivered every Service it had at start."""
        ...

    def on_endpoint_slice_add(self, slice_: KubeObject) -> None:
        """An EndpointSlice appeared."""
        ...

    def on_endpoint_slice_update(self, old: KubeObject, new: KubeObject) -> None:
        """An EndpointSlice changed."""
        ...

    def on_endpoint_slice_delete(self, slice_: KubeObject) -> None:
        """An EndpointSlice went away."""
        ...

    def on_endpoint_slices_synced(self) -> None:
        """The source has delivered every EndpointSlice it had at start."""
        ...

    def on_node_update(self, node: KubeObject | None) -> None:
        """This proxy's own Node was added or changed (``None``: deleted)."""
        ...

    def on_service_cidrs_changed(self, cidrs: Sequence[IPNetwork]) -> None:
        """The complete list of service CIDRs (from ServiceCIDR objects) changed."""
        ...
