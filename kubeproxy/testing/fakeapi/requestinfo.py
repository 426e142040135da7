"""What a request to the fake API server is: as RBAC sees it, and as the fake routes it.

:class:`APIRequest` is what the request log records and :func:`allowed_by` compares with
a ClusterRole's rules; :class:`Route` is the same request as the server dispatches it,
made by :func:`route` from the URL. Apart from the server: pure data and pure functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from kubeproxy.testing.fakeapi.resources import RESOURCES, ResourceInfo

__all__ = ["APIRequest", "Route", "allowed_by", "route"]


class APIRequest(NamedTuple):
    """One request as RBAC sees it.

    ``verb`` is Kubernetes' (``get``, ``list``, ``watch``, ``create``, ``update``,
    ``patch``, ``delete``); ``resource`` is empty for a non-resource URL (discovery,
    ``/version``), whose ``path`` then says what was asked.
    """

    verb: str
    resource: str
    namespace: str
    subresource: str
    group: str = ""
    name: str = ""
    path: str = ""


def allowed_by(rules: Iterable[Mapping[str, Any]], request: APIRequest) -> bool:
    """Whether a ClusterRole's ``rules`` allow ``request`` (``*`` wildcards included)."""
    for rule in rules:
        verbs = rule.get("verbs") or ()
        if request.verb not in verbs and "*" not in verbs:
            continue
        if not request.resource:
            urls = rule.get("nonResourceURLs") or ()
            if any(
                url == request.path or (url.endswith("*") and request.path.startswith(url[:-1]))
                for url in urls
            ):
                return True
            continue
        groups = rule.get("apiGroups") or ()
        if request.group not in groups and "*" not in groups:
            continue
        wanted = request.resource + (f"/{request.subresource}" if request.subresource else "")
        resources = rule.get("resources") or ()
        if wanted not in resources and "*" not in resources:
            continue
        names = rule.get("resourceNames") or ()
        if names and request.name not in names:
            continue
        return True
    return False


@dataclass(slots=True)
class Route:
    """A request as the server dispatches it: its verb and resource (``info`` None when
    the fake does not serve it), namespace, name and subresource."""

    verb: str
    info: ResourceInfo | None
    namespace: str = ""
    name: str = ""
    subresource: str = ""
    group: str = ""
    resource: str = ""


def route(method: str, path: str, query: Mapping[str, str], *, service_cidrs: bool) -> Route:
    """Route a request as kube-apiserver does (``service_cidrs``: whether
    ``servicecidrs`` is served); a path the fake does not serve gets ``info`` None."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 3:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        group, rest = parts[1], parts[3:]
    else:
        return Route(method.lower(), None)
    version = parts[1] if parts[0] == "api" else parts[2]
    namespace = ""
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else ""
    subresource = "/".join(rest[2:])
    info: ResourceInfo | None = RESOURCES.get(resource)
    if (
        info is None
        or info.group != group
        or info.version != version
        or (resource == "servicecidrs" and not service_cidrs)
        or (namespace and not info.namespaced)
    ):
        info = None
    watching = query.get("watch", "").lower() in ("true", "1")
    verb = {
        "GET": "watch" if watching else ("get" if name else "list"),
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if name else "deletecollection",
    }[method]
    return Route(verb, info, namespace, name, subresource, group, resource)
