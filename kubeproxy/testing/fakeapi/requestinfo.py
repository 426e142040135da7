"""What a request to the fake API server is: as RBAC sees it, and as the fake routes it.

:class:`APIRequest` is what the request log records and :func:`allowed_by` compares with
a ClusterRole's rules; :class:`Route` is the same request as the server dispatches it.
Apart from the server: pure data and a pure function, no state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from kubeproxy.testing.fakeapi.resources import ResourceInfo

__all__ = ["APIRequest", "Route", "allowed_by"]


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
