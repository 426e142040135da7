"""Chain names of iptables mode: upstream kube-proxy's, hash for hash.

Other components (network policy agents, monitoring, people with ``iptables-save``) know
these names, so they are upstream's exactly:

* fixed chains: ``KUBE-SERVICES``, ``KUBE-NODEPORTS``, ``KUBE-POSTROUTING``,
  ``KUBE-MARK-MASQ``, ``KUBE-EXTERNAL-SERVICES``, ``KUBE-FORWARD``,
  ``KUBE-PROXY-FIREWALL``, ``KUBE-PROXY-CANARY``;
* per Service port: ``KUBE-SVC-``, ``KUBE-SVL-``, ``KUBE-EXT-``, ``KUBE-FW-`` followed by
  16 characters of ``base32(sha256(servicePortName + protocol))``, where the service port
  name is ``namespace/name:port`` (``namespace/name`` for an unnamed port) and the
  protocol is lower case;
* per endpoint: ``KUBE-SEP-`` and 16 characters of
  ``base32(sha256(servicePortName + protocol + "IP:port"))``.

One chain is ours alone (not upstream's): ``KUBE-SERVICE-IPS``, the filter chain that
rejects unknown ports of cluster IPs and drops unallocated service IPs (see the package
README).
"""

from __future__ import annotations

import base64
import hashlib
import re

from kubeproxy.objects import ServicePortName

__all__ = [
    "CANARY",
    "EXTERNAL_SERVICES",
    "FORWARD",
    "KUBELET_FIREWALL",
    "MARK_MASQ",
    "NODEPORTS",
    "PER_SERVICE_PREFIXES",
    "POSTROUTING",
    "PROXY_FIREWALL",
    "SERVICES",
    "SERVICE_IPS",
    "InvalidName",
    "endpoint_chain",
    "is_service_chain",
    "port_hash",
    "service_chains",
    "service_port_string",
]

SERVICES = "KUBE-SERVICES"
"""nat: the service dispatch; filter: no-endpoint rejects/drops of cluster IPs."""
NODEPORTS = "KUBE-NODEPORTS"
"""nat: NodePort dispatch; filter: health-check NodePort accepts."""
POSTROUTING = "KUBE-POSTROUTING"
"""nat: masquerade of marked packets."""
MARK_MASQ = "KUBE-MARK-MASQ"
"""nat: set the masquerade mark."""
EXTERNAL_SERVICES = "KUBE-EXTERNAL-SERVICES"
"""filter: no-endpoint rejects/drops of external IPs, load-balancer IPs and NodePorts."""
FORWARD = "KUBE-FORWARD"
"""filter: accept forwarded service traffic (marked, or of a known connection)."""
PROXY_FIREWALL = "KUBE-PROXY-FIREWALL"
"""filter: drops load-balancer traffic that ``loadBalancerSourceRanges`` did not allow."""
CANARY = "KUBE-PROXY-CANARY"
"""An empty chain in mangle, nat and filter: when it is gone, someone flushed the tables."""
KUBELET_FIREWALL = "KUBE-FIREWALL"
"""filter: kubelet's chain; we write its localnet drop rule when localhost NodePorts work."""
SERVICE_IPS = "KUBE-SERVICE-IPS"
"""filter (our extension): reject unknown ports of cluster IPs, drop unallocated ones."""

PER_SERVICE_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-")
"""Prefixes of the chains that exist per Service port or endpoint (all in nat)."""

_HASH_CHARS = 16
# Namespaces and Service names are DNS labels, port names IANA service names, after API
# validation; this is the last check before they appear in a rule comment.
# The same check as the nftables backend's, so both modes skip the same ports.
_NAME_PART = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_PORT_PART = re.compile(r"([A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?)?")


class InvalidName(ValueError):
    """A Service port whose names cannot appear in a rule comment."""


def service_port_string(name: ServicePortName) -> str:
    """``ns/svc:port`` (``ns/svc`` when unnamed), after checking every part.

    Raises :class:`InvalidName` for a part that is not made of letters, digits, ``.``,
    ``_`` and ``-`` (starting and ending alphanumeric; empty allowed for the port), so
    nothing that needs quoting ever reaches a comment.
    """
    service = name.service
    if len(service.namespace) > 63 or _NAME_PART.fullmatch(service.namespace) is None:
        raise InvalidName(f"namespace {service.namespace!r} is not a valid name")
    if len(service.name) > 63 or _NAME_PART.fullmatch(service.name) is None:
        raise InvalidName(f"service name {service.name!r} is not a valid name")
    if len(name.port) > 63 or _PORT_PART.fullmatch(name.port) is None:
        raise InvalidName(f"port name {name.port!r} is not valid")
    return str(name)


def _hash(text: str) -> str:
    digest = hashlib.sha256(text.encode()).digest()
    return base64.b32encode(digest).decode()[:_HASH_CHARS]


def port_hash(port_string: str, protocol: str) -> str:
    """The 16-character hash shared by a port's SVC, SVL, EXT and FW chains.

    ``port_string`` is :func:`service_port_string`'s result; ``protocol`` lower case.
    """
    return _hash(port_string + protocol)


def service_chains(port_string: str, protocol: str) -> tuple[str, str, str, str]:
    """``(KUBE-SVC-H, KUBE-SVL-H, KUBE-EXT-H, KUBE-FW-H)`` of one Service port."""
    h = port_hash(port_string, protocol)
    return f"KUBE-SVC-{h}", f"KUBE-SVL-{h}", f"KUBE-EXT-{h}", f"KUBE-FW-{h}"


def endpoint_chain(port_string: str, protocol: str, endpoint: str) -> str:
    """``KUBE-SEP-H`` of one endpoint (``endpoint`` is ``IP:port`` / ``[IPv6]:port``)."""
    return f"KUBE-SEP-{_hash(port_string + protocol + endpoint)}"


def is_service_chain(name: str) -> bool:
    """Whether ``name`` is a per-Service-port or per-endpoint chain of any kube-proxy."""
    return name.startswith(PER_SERVICE_PREFIXES)
