"""The resources the fake API server serves, and those its discovery only lists.

Apart from the server: a table (kinds, groups, versions, verbs, field selectors) that
routing, discovery and :meth:`~kubeproxy.testing.fakeapi.FakeAPIServer.apply` read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["BY_KIND", "OTHER_RESOURCES", "READ_VERBS", "RESOURCES", "JSONObject", "ResourceInfo"]

JSONObject = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ResourceInfo:
    """One API resource the fake serves."""

    resource: str
    kind: str
    group: str
    version: str
    namespaced: bool
    verbs: tuple[str, ...]
    field_labels: tuple[str, ...] = ("metadata.name",)

    @property
    def api_version(self) -> str:
        """``v1`` or ``group/version``."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        """The kind of a list of these."""
        return self.kind + "List"


READ_VERBS = ("get", "list", "watch")
"""The verbs of a read-only resource."""

RESOURCES: Mapping[str, ResourceInfo] = {
    info.resource: info
    for info in (
        ResourceInfo(
            "services",
            "Service",
            "",
            "v1",
            True,
            READ_VERBS,
            ("metadata.name", "metadata.namespace", "spec.clusterIP", "spec.type"),
        ),
        ResourceInfo(
            "endpointslices",
            "EndpointSlice",
            "discovery.k8s.io",
            "v1",
            True,
            READ_VERBS,
            ("metadata.name", "metadata.namespace", "addressType"),
        ),
        ResourceInfo(
            "nodes", "Node", "", "v1", False, READ_VERBS, ("metadata.name", "spec.unschedulable")
        ),
        ResourceInfo("servicecidrs", "ServiceCIDR", "networking.k8s.io", "v1", False, READ_VERBS),
        ResourceInfo(
            "events",
            "Event",
            "events.k8s.io",
            "v1",
            True,
            ("create", "get", "list"),
            ("metadata.name", "metadata.namespace"),
        ),
    )
}
"""The resources the fake serves, by resource name."""

BY_KIND = {info.kind: info for info in RESOURCES.values()}
"""The same resources, by kind."""

# Other resources a discovery document lists in these group/versions, so clients that look
# for "is X served" see a realistic neighbourhood.
OTHER_RESOURCES: Mapping[str, tuple[tuple[str, str, bool], ...]] = {
    "v1": (("configmaps", "ConfigMap", True), ("namespaces", "Namespace", False)),
    "networking.k8s.io/v1": (
        ("ingresses", "Ingress", True),
        ("networkpolicies", "NetworkPolicy", True),
        ("ipaddresses", "IPAddress", False),
    ),
    "discovery.k8s.io/v1": (),
    "events.k8s.io/v1": (),
}
