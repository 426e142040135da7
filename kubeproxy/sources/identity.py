"""What a source remembers of an object it delivered: its identity, not the object.

Upstream's informers keep every object they delivered; at 100k Services with 10
endpoints each that is the Services and EndpointSlices as decoded JSON, about 1 GB in
Python, more than the proxy's own state. Our handlers never need the old content (the
change trackers keep what they parsed: :mod:`kubeproxy.servicechanges`,
:mod:`kubeproxy.endpointchanges`), only who the object was: its kind, namespace and name,
for an EndpointSlice also its Service (``kubernetes.io/service-name``) and
``addressType``, which is all a deletion, or the ``old`` side of an update, is read for.

So a source keeps, per object, its key, a version (the API server's
``resourceVersion``, or a fingerprint of a manifest's text) to tell a changed object
from an unchanged one, and an EndpointSlice's :func:`slice_owner`; and hands handlers
the :func:`identity` object built from them as ``old`` and on deletions: about 300 bytes
an object instead of 2-8 kB.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Final, TypeAlias, TypeGuard

from kubeproxy.handlers import KubeObject

__all__ = [
    "ENDPOINT_SLICE",
    "LABEL_SERVICE_NAME",
    "OWNER_BITS",
    "SERVICE",
    "SliceOwner",
    "code_owner",
    "identity",
    "interned_owner",
    "owner_code",
    "owner_text",
    "slice_owner",
]

SERVICE: Final = "Service"
ENDPOINT_SLICE: Final = "EndpointSlice"
LABEL_SERVICE_NAME: Final = "kubernetes.io/service-name"

SliceOwner: TypeAlias = tuple[Any, Any]
"""An EndpointSlice's ``kubernetes.io/service-name`` label and ``addressType``, as given
(validated by whoever parses the slice, not here)."""

_intern = sys.intern


def owner_text(value: object) -> object:
    """``value`` interned if it is a string: names repeat across objects (a Service's
    name is its slices' label), so what is kept of them is one copy each."""
    return _intern(value) if type(value) is str else value


def _is_mapping(value: object) -> TypeGuard[Mapping[str, Any]]:
    # type() first: isinstance against the Mapping ABC costs 0.2 us.
    return type(value) is dict or isinstance(value, Mapping)


def slice_owner(obj: KubeObject, *, intern: bool = True) -> SliceOwner | None:
    """What to keep of ``obj`` besides its key to build its :func:`identity`: an
    EndpointSlice's Service and address type; None for other kinds. Interned
    (:func:`owner_text`) unless ``intern`` is false (a caller that keeps them some other
    way)."""
    if obj.get("kind") != ENDPOINT_SLICE:
        return None
    metadata = obj.get("metadata")
    labels = metadata.get("labels") if _is_mapping(metadata) else None
    owner = labels.get(LABEL_SERVICE_NAME) if _is_mapping(labels) else None
    found = (owner, obj.get("addressType"))
    return interned_owner(found) if intern else found


def interned_owner(owner: SliceOwner) -> SliceOwner:
    """``owner`` with its texts interned (:func:`owner_text`): what a source keeps of an
    owner it cannot keep as a number (:func:`owner_code`)."""
    return owner_text(owner[0]), owner_text(owner[1])


def identity(
    kind: str,
    api_version: str,
    namespace: str,
    name: str,
    owner: SliceOwner | None,
    *,
    resource_version: str | None = None,
) -> dict[str, Any]:
    """The object a handler gets as ``old`` or on a deletion: ``apiVersion``, ``kind``,
    ``metadata`` (``name``, ``namespace`` when namespaced, ``resourceVersion`` when
    given, the ``kubernetes.io/service-name`` label of a slice) and a slice's
    ``addressType``."""
    metadata: dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    if resource_version is not None:
        metadata["resourceVersion"] = resource_version
    obj: dict[str, Any] = {"apiVersion": api_version, "kind": kind, "metadata": metadata}
    if owner is not None:
        service, address_type = owner
        if service is not None:
            metadata["labels"] = {LABEL_SERVICE_NAME: service}
        if address_type is not None:
            obj["addressType"] = address_type
    return obj


# An owner as a number (owner_code), for a source that keeps one int per object rather
# than an owner tuple beside it: none (not a slice), or a slice of the Service its name
# starts with (the EndpointSlice controller names a slice "<service>-<random>") and one
# of the usual address types. Any other owner has no number and is kept as it is.
OWNER_BITS: Final = 2
"""How many bits :func:`owner_code` needs."""
_NO_OWNER = 0
_OWNER_ADDRESS_TYPES = (None, "IPv4", "IPv6")


def owner_code(name: str, owner: SliceOwner | None) -> int | None:
    """``owner`` (:func:`slice_owner`) of the object named ``name`` as a number of
    :data:`OWNER_BITS` bits (0 for None), or None when it has none."""
    if owner is None:
        return _NO_OWNER
    service, address_type = owner
    if address_type == "IPv4":
        code = 1
    elif address_type == "IPv6":
        code = 2
    else:
        return None
    if type(service) is not str or name.rpartition("-")[0] != service:
        return None
    return code


def code_owner(name: str, code: int) -> SliceOwner | None:
    """The owner :func:`owner_code` gave ``code`` for the object named ``name``."""
    if code == _NO_OWNER:
        return None
    return (name.rpartition("-")[0], _OWNER_ADDRESS_TYPES[code])
