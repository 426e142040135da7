"""The fake's ``/version`` and API discovery documents.

Apart from the server: documents computed from the resource table and three settings
(the version, the address, whether ServiceCIDRs are served), no state.
"""

from __future__ import annotations

from kubeproxy.testing.fakeapi.resources import OTHER_RESOURCES, READ_VERBS, RESOURCES, JSONObject

__all__ = ["discovery_document"]


def discovery_document(
    path: str, *, git_version: str, address: str, service_cidrs: bool
) -> JSONObject | None:
    """The document at ``path`` (``/version``, ``/api``, ``/apis``, a group or a
    group/version's resource list), or None for a path discovery does not serve.

    ``address`` is the server's ``host:port``; ``service_cidrs`` whether
    ``networking.k8s.io/v1`` lists ``servicecidrs``.
    """
    if path == "/version":
        major, minor = git_version.lstrip("v").split(".")[:2]
        return {
            "major": major,
            "minor": minor,
            "gitVersion": git_version,
            "gitCommit": "fake",
            "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z",
            "goVersion": "go1.25",
            "compiler": "gc",
            "platform": "linux/amd64",
        }
    if path == "/api":
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}],
        }
    groups = sorted({info.group for info in RESOURCES.values() if info.group})
    if path == "/apis":
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [_group(g) for g in groups],
        }
    if path.startswith("/apis/") and path.count("/") == 2 and path[6:] in groups:
        return {"kind": "APIGroup", "apiVersion": "v1", **_group(path[6:])}
    if path == "/api/v1":
        return _resource_list("v1", service_cidrs)
    if path.startswith("/apis/") and path.count("/") == 3:
        group_version = path[6:]
        if group_version.split("/")[0] in groups and group_version in OTHER_RESOURCES:
            return _resource_list(group_version, service_cidrs)
    return None


def _group(group: str) -> JSONObject:
    version = {"groupVersion": f"{group}/v1", "version": "v1"}
    return {"name": group, "versions": [version], "preferredVersion": version}


def _resource_list(group_version: str, service_cidrs: bool) -> JSONObject:
    resources = []
    for info in RESOURCES.values():
        if info.api_version != group_version:
            continue
        if info.resource == "servicecidrs" and not service_cidrs:
            continue
        resources.append(
            {
                "name": info.resource,
                "singularName": info.kind.lower(),
                "namespaced": info.namespaced,
                "kind": info.kind,
                "verbs": list(info.verbs),
            }
        )
    for resource, kind, namespaced in OTHER_RESOURCES.get(group_version, ()):
        resources.append(
            {
                "name": resource,
                "singularName": kind.lower(),
                "namespaced": namespaced,
                "kind": kind,
                "verbs": list(READ_VERBS),
            }
        )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": sorted(resources, key=lambda r: str(r["name"])),
    }
