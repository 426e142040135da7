"""Names of the per-service chains: readable, bounded, and a function of their content.

A per-service chain is called ``<prefix>-<H>-<ns>/<svc>/<proto>/<port>`` (a group chain
adds ``/<k>``), where ``H`` is the first 8 characters of the base32 SHA-256 of the chain's
identity and its rendered rules. A chain of a given name therefore always holds the same
rules: a backend that finds the name in the kernel (after a restart, or at a periodic full
sync) can reuse the chain without reading its rules back, and a chain whose rules change
becomes a new chain that the map elements switch to atomically.

Every per-service chain name contains ``/``; no fixed chain does (:func:`is_service_chain`).
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterable

from kubeproxy.objects import ServicePortName

__all__ = [
    "AFFINITY_MAP_PREFIX",
    "CHAIN_NAME_MAX",
    "ChainPrefix",
    "InvalidName",
    "affinity_map_name",
    "chain_name",
    "is_affinity_map",
    "is_service_chain",
    "port_identity",
]

CHAIN_NAME_MAX = 240
"""Longest chain name we write (the kernel allows 255; upstream keeps 16 spare)."""

AFFINITY_MAP_PREFIX = "affinity-"
"""Prefix of the per-port IPv6 affinity maps."""

_HASH_CHARS = 8
# Namespaces, Service names and port names are DNS labels / IANA service names after API
# validation; this is the last check before they become part of a kernel object name.
_NAME_PART = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_PORT_PART = re.compile(r"([A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?)?")


class ChainPrefix:
    """The chain prefixes, one per role (see the package README)."""

    SERVICE = "service"
    LOCAL = "local"
    EXTERNAL = "external"
    FIREWALL = "firewall"
    GROUP = "group"


class InvalidName(ValueError):
    """A Service port whose names cannot appear in a kernel object name."""


def port_identity(name: ServicePortName) -> str:
    """``<ns>/<svc>/<proto lower>/<port name>``: the readable part of the port's chain names.

    Raises :class:`InvalidName` when a part has characters nft would not accept in a name.
    """
    ns = name.service.namespace
    svc = name.service.name
    if _NAME_PART.fullmatch(ns) is None:
        raise InvalidName(f"namespace {ns!r} is not a valid name")
    if _NAME_PART.fullmatch(svc) is None:
        raise InvalidName(f"service name {svc!r} is not a valid name")
    if _PORT_PART.fullmatch(name.port) is None:
        raise InvalidName(f"port name {name.port!r} is not a valid name")
    return f"{ns}/{svc}/{name.protocol.lower}/{name.port}"


def chain_name(prefix: str, identity: str, rules: Iterable[str], group: int | None = None) -> str:
    """The name of a per-service chain with these ``rules``.

    ``identity`` comes from :func:`port_identity`; ``group`` numbers a group chain. The
    result is at most :data:`CHAIN_NAME_MAX` characters; truncation keeps the prefix and
    the hash (which covers the full identity), so truncated names stay unique.
    """
    suffix = identity if group is None else f"{identity}/{group}"
    # prefix NUL suffix, then each rule after a newline (one update: it runs per chain).
    text = "\n".join((f"{prefix}\0{suffix}", *rules))
    tag = _b32_tag(hashlib.sha256(text.encode()).digest())
    name = f"{prefix}-{tag}-{suffix}"
    if len(name) > CHAIN_NAME_MAX:
        name = name[: CHAIN_NAME_MAX - 3] + "..."
    return name


_B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"


def _b32_tag(digest: bytes) -> str:
    # The first _HASH_CHARS characters of base64.b32encode(digest) (5 bits each, from the
    # top); b32encode is pure Python and encodes the whole digest, noticeable at 10k chains.
    bits = int.from_bytes(digest[: (_HASH_CHARS * 5 + 7) // 8], "big")
    top = ((_HASH_CHARS * 5 + 7) // 8) * 8 - 5
    return "".join([_B32[(bits >> (top - 5 * i)) & 31] for i in range(_HASH_CHARS)])


def affinity_map_name(identity: str, prefix: str, port: int) -> str:
    """Name of a per-port IPv6 affinity map: ``affinity-<16 hash chars>``.

    One map per port identity, dispatch-chain kind (``service``/``local``) and endpoint
    port. The name is stable while those are, so the map (and its entries) survive
    endpoint changes.
    """
    digest = hashlib.sha256(f"{identity}\0{prefix}\0{port}".encode()).digest()
    return f"{AFFINITY_MAP_PREFIX}{base64.b32encode(digest)[:16].decode()}"


def is_affinity_map(name: str) -> bool:
    """Whether ``name`` is a per-port affinity map (not the shared ``affinity`` map)."""
    return name.startswith(AFFINITY_MAP_PREFIX)


def is_service_chain(name: str) -> bool:
    """Whether ``name`` is a per-service chain (they all contain ``/``; fixed chains never)."""
    return "/" in name
