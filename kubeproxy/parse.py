"""Validate Kubernetes objects (JSON form) and convert them into the core's plain data.

Everything that reaches the kernel passes through here first: names are checked against
the Kubernetes syntax, IPs and CIDRs are parsed (accepting the legacy leading-zero IPv4
form the way upstream does, then re-serialised canonically), ports are ranged, enums are
checked. A malformed object raises :class:`InvalidObject` with one message naming the
object and the reason; the change trackers turn that into one log line and skip the
object. Objects the proxy ignores on purpose (ExternalName or headless Services, Services
owned by another proxy, EndpointSlices of another address family) are not errors.

Conversion is per IP family, as upstream: a dual-stack Service yields one view per family.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import re
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Final

from kubeproxy.handlers import KubeObject
from kubeproxy.objects import (
    IS_LOCAL,
    NO_HINTS,
    READY,
    REMOTE,
    SERVING,
    TERMINATING,
    Endpoint,
    EndpointRows,
    Endpoints,
    IPAddress,
    IPFamily,
    IPNetwork,
    NamespacedName,
    NodeInfo,
    Protocol,
    ServicePort,
    ServicePortName,
    slot_init,
)

__all__ = [
    "LABEL_HEADLESS",
    "LABEL_SERVICE_NAME",
    "LABEL_SERVICE_PROXY_NAME",
    "SPECIAL_FIRST_OCTETS",
    "InvalidObject",
    "ParsedEndpointSlice",
    "describe",
    "endpoint_slice_key",
    "endpoint_with_port",
    "hand_over",
    "parse_checked_endpoint_slice",
    "parse_cidr",
    "parse_endpoint_slice",
    "parse_frontend",
    "parse_host",
    "parse_ip",
    "parse_node",
    "parse_service",
    "service_key",
]

logger = logging.getLogger(__name__)

# Namespaces repeat over every object, a Service's name over its slices: one string each
# instead of one per object decoded (about 15 MB at 100k Services x 10).
_intern = sys.intern

LABEL_SERVICE_PROXY_NAME: Final = "service.kubernetes.io/service-proxy-name"
"""A Service with this label belongs to another proxy."""
LABEL_HEADLESS: Final = "service.kubernetes.io/headless"
"""A Service with this label is headless (no virtual IP to program)."""
LABEL_SERVICE_NAME: Final = "kubernetes.io/service-name"
"""The EndpointSlice label naming the Service the slice belongs to."""
LABEL_ZONE: Final = "topology.kubernetes.io/zone"
TAINT_TO_BE_DELETED: Final = "ToBeDeletedByClusterAutoscaler"

DEFAULT_AFFINITY_SECONDS: Final = 10800
MAX_AFFINITY_SECONDS: Final = 86400

_SERVICE_TYPES: Final = frozenset({"ClusterIP", "NodePort", "LoadBalancer", "ExternalName"})
_PROTOCOLS: Final = {p.value: p for p in Protocol}
_DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(
    r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*"
)
_SLOPPY_IPV4 = re.compile(r"([0-9]+)\.([0-9]+)\.([0-9]+)\.([0-9]+)")
_EMPTY: frozenset[str] = frozenset()
_NEVER: Final = object()
# Longer than any textual IP (IPv6 with an embedded IPv4 is at most 45 characters); the
# cap keeps absurd input from reaching int() and the regex engine.
_MAX_IP_TEXT = 64


class InvalidObject(ValueError):
    """An object the proxy cannot use. ``str()`` is ``"<Kind> <ns>/<name>: <reason>"``."""

    def __init__(self, kind: str, name: str, reason: str) -> None:
        super().__init__(f"{kind} {name}: {reason}")
        self.kind = kind
        self.name = name
        self.reason = reason

    def __reduce__(self) -> tuple[type[InvalidObject], tuple[str, str, str]]:
        return (InvalidObject, (self.kind, self.name, self.reason))


# ---------------------------------------------------------------------------------------
# Addresses


def parse_ip(text: str) -> IPAddress:
    """Parse an IP address the way upstream's sloppy parser does.

    Legacy IPv4 with leading zeros is accepted and read as decimal (``010.1.1.1`` is
    ``10.1.1.1``); an IPv4-mapped IPv6 address is an IPv4 address (as Go sees it); IPv6
    zones and surrounding whitespace are rejected. Raises :class:`ValueError`.
    """
    return _parse_ip_text(text)[0]


def _parse_ip_text(text: str) -> tuple[IPAddress, str | None]:
    """:func:`parse_ip`, plus ``text`` itself when it already is the canonical form
    (``None`` when unknown), which saves re-serialising the usual IPv4 address."""
    if not isinstance(text, str) or len(text) > _MAX_IP_TEXT:
        raise ValueError(f"invalid IP address {_show(text)}")
    if ":" in text:
        try:
            address = ipaddress.IPv6Address(socket.inet_pton(socket.AF_INET6, text))
        except (OSError, ValueError):
            raise ValueError(f"invalid IP address {_show(text)}") from None
        mapped = address.ipv4_mapped
        return (mapped, None) if mapped is not None else (address, None)
    try:
        # inet_pton takes strict dotted-quad only (no leading zeros), the canonical form.
        packed = socket.inet_pton(socket.AF_INET, text)
        return ipaddress.IPv4Address(int.from_bytes(packed, "big")), text
    except (OSError, ValueError):
        pass
    match = _SLOPPY_IPV4.fullmatch(text)
    if match is not None:
        value = 0
        for part in match.groups():
            octet = int(part)
            if octet > 255:
                break
            value = (value << 8) | octet
        else:
            return ipaddress.IPv4Address(value), None
    raise ValueError(f"invalid IP address {_show(text)}")


def _address_text(text: str) -> str:
    """The canonical text of an endpoint's address, validated as :func:`parse_ip` does:
    ``text`` itself for the usual strict dotted quad (no address object made: at 1M
    endpoints one per address was 84 MB and a fifth of the parse time), otherwise
    ``str(parse_ip(text))``. Raises :class:`ValueError`."""
    if type(text) is str and len(text) <= 15 and ":" not in text:
        try:
            # inet_pton takes strict dotted-quad only (no leading zeros), the canonical form.
            _inet_pton(_AF_INET, text)
            return text
        except (OSError, ValueError):
            pass
    return str(_parse_ip_text(text)[0])


_inet_pton = socket.inet_pton
_AF_INET = socket.AF_INET
_AF_INET6 = socket.AF_INET6


def parse_host(text: str) -> tuple[IPAddress, str]:
    """An operator's ``IP[:REST]`` or ``[IPv6][:REST]`` (a bare IPv6 address too):
    (address, rest). Raises ``ValueError`` naming the text."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        rest = rest.removeprefix(":")
    elif text.count(":") > 1:
        host, rest = text, ""
    else:
        host, _, rest = text.partition(":")
    try:
        return ipaddress.ip_address(host), rest
    except ValueError:
        raise ValueError(f"{text!r}: {host!r} is not an IP address") from None


def parse_frontend(text: str) -> tuple[IPAddress, int, str]:
    """An operator's ``IP:PORT[/PROTO]`` (``tcp`` when no protocol is given): (address,
    port, protocol in lower case). Raises ``ValueError`` naming the text."""
    ip, rest = parse_host(text)
    port, _, proto = rest.partition("/")
    proto = proto.lower() or "tcp"
    if not port.isdigit() or not 0 < int(port) < 65536 or proto not in ("tcp", "udp", "sctp"):
        raise ValueError(f"{text!r} is not IP:PORT/tcp|udp|sctp")
    return ip, int(port), proto


def parse_cidr(text: str) -> IPNetwork:
    """Parse a CIDR like upstream's sloppy parser: leading-zero IPv4, host bits allowed.

    The result is the network (host bits cleared). Raises :class:`ValueError`.
    """
    if not isinstance(text, str) or len(text) > _MAX_IP_TEXT + 4 or text.count("/") != 1:
        raise ValueError(f"invalid CIDR {_show(text)}")
    address_text, _, prefix_text = text.partition("/")
    if not prefix_text.isascii() or not prefix_text.isdigit() or len(prefix_text) > 3:
        raise ValueError(f"invalid CIDR {_show(text)}")
    prefix = int(prefix_text)
    try:
        if ":" in address_text:
            # No IPv4-mapped conversion here: the prefix length counts IPv6 bits.
            v6 = ipaddress.IPv6Address(socket.inet_pton(socket.AF_INET6, address_text))
            if prefix <= 128:
                return ipaddress.IPv6Network((v6, prefix), strict=False)
        else:
            v4 = parse_ip(address_text)
            if prefix <= 32:
                return ipaddress.IPv4Network((v4, prefix), strict=False)
    except (OSError, ValueError):
        pass
    raise ValueError(f"invalid CIDR {_show(text)}")


# ---------------------------------------------------------------------------------------
# Naming and error reporting


def _show(value: object) -> str:
    """A short, single-line, quoted rendering of untrusted input for messages."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return text


def _name_part(value: object) -> str:
    if isinstance(value, str) and value and value.isprintable() and len(value) <= 253:
        return value
    if value is None or value == "":
        return "<none>"
    return _show(value)


def _guess_kind(obj: Mapping[str, Any]) -> str:
    kind = obj.get("kind")
    if isinstance(kind, str) and kind.isidentifier():
        return kind
    # Objects from a List or watch often carry no kind; guess from the shape.
    if "addressType" in obj or "endpoints" in obj:
        return "EndpointSlice"
    if isinstance(obj.get("spec"), Mapping) and "ports" in obj["spec"]:
        return "Service"
    return "object"


def describe(obj: KubeObject, kind: str | None = None) -> str:
    """``"<Kind> <ns>/<name>"`` for log lines; never raises, whatever ``obj`` holds.

    ``kind`` overrides the object's own ``kind`` (objects from a List often have none).
    """
    if not isinstance(obj, Mapping):
        return f"{kind or 'object'} <not an object: {_show(obj)}>"
    metadata = obj.get("metadata")
    if not isinstance(metadata, Mapping):
        metadata = {}
    where = f"{_name_part(metadata.get('namespace'))}/{_name_part(metadata.get('name'))}"
    return f"{kind or _guess_kind(obj)} {where}"


class _Context:
    """The object being parsed, for error messages.

    ``field`` arguments are templates: ``{}`` stands for ``index``. They are formatted
    only on error, because building a message per field per endpoint would dominate
    the cost of parsing a large slice.
    """

    __slots__ = ("_where", "kind")

    def __init__(self, kind: str, where: object) -> None:
        self.kind = kind
        # Its text is made when a message needs it: a Service's key is formatted for
        # none of the Services that parse (two calls per Service, one per family).
        self._where = where

    @property
    def name(self) -> str:
        """``namespace/name`` of the object, for messages."""
        return str(self._where)

    def error(self, reason: str) -> InvalidObject:
        return InvalidObject(self.kind, self.name, reason)

    def fail(self, field: str, index: int, reason: str) -> InvalidObject:
        return self.error(f"{field.format(index)}: {reason}")

    def mapping(self, value: Any, field: str, index: int = 0) -> Mapping[str, Any]:
        """``value`` as a mapping, with ``None`` (JSON null or absent) as empty."""
        if type(value) is dict:
            return value
        if value is None:
            return {}
        if isinstance(value, Mapping):
            return value
        raise self.fail(field, index, f"expected an object, got {_show(value)}")

    def sequence(self, value: Any, field: str, index: int = 0) -> Sequence[Any]:
        """``value`` as a list, with ``None`` (JSON null or absent) as empty."""
        if type(value) is list or isinstance(value, tuple):
            return value
        if value is None:
            return ()
        raise self.fail(field, index, f"expected a list, got {_show(value)}")

    def integer(self, value: Any, field: str, low: int, high: int, index: int = 0) -> int:
        if type(value) is not int and (not isinstance(value, int) or isinstance(value, bool)):
            raise self.fail(field, index, f"expected an integer, got {_show(value)}")
        if not low <= value <= high:
            raise self.fail(field, index, f"{value} is out of range [{low}, {high}]")
        return int(value)

    def boolean(self, value: Any, field: str, default: bool, index: int = 0) -> bool:
        if value is True or value is False:
            return value
        if value is None:
            return default
        raise self.fail(field, index, f"expected true or false, got {_show(value)}")

    def ip(self, value: Any, field: str, index: int = 0) -> IPAddress:
        try:
            return parse_ip(value)
        except ValueError:
            raise self.fail(field, index, f"invalid IP address {_show(value)}") from None

    def protocol(self, value: Any, field: str, index: int = 0) -> Protocol:
        if value is None:
            return Protocol.TCP
        protocol = _PROTOCOLS.get(value) if isinstance(value, str) else None
        if protocol is None:
            raise self.fail(field, index, f"unknown protocol {_show(value)}")
        return protocol

    def port_name(self, value: Any, field: str, index: int = 0) -> str:
        if value is None or value == "":
            return ""
        if not _is_dns_label(value):
            raise self.fail(field, index, f"{_show(value)} is not a valid DNS-1123 label")
        # A few port names ("http", "dns") repeat over every Service and slice: one
        # string each instead of two per Service kept from the JSON (issue 32).
        return _intern(str(value))


def _is_dns_label(value: Any) -> bool:
    return isinstance(value, str) and _DNS_LABEL.fullmatch(value) is not None


def _is_dns_subdomain(value: Any) -> bool:
    return (
        isinstance(value, str) and len(value) <= 253 and _DNS_SUBDOMAIN.fullmatch(value) is not None
    )


def _metadata(obj: Any, kind: str) -> tuple[Mapping[str, Any], _Context]:
    """The object's metadata, checked to hold a valid namespace and name."""
    # `type(x) is dict` first, here and below: isinstance against the Mapping ABC costs
    # 0.2 us, and these run a few times per object of the cluster (issue 32).
    usual = _usual_metadata(obj)
    if usual is not None and usual[2] and usual[2].isprintable():
        # The usual object: valid namespace, a printable name (the callers check it).
        return usual[0], _Context(kind, _Where(usual[1], usual[2]))
    if type(obj) is not dict and not isinstance(obj, Mapping):
        raise InvalidObject(kind, "<unknown>", f"expected an object, got {_show(obj)}")
    metadata = obj.get("metadata")
    if type(metadata) is not dict and not isinstance(metadata, Mapping):
        raise InvalidObject(kind, "<none>/<none>", "metadata is missing")
    namespace = metadata.get("namespace")
    name = metadata.get("name")
    if (
        isinstance(namespace, str)
        and isinstance(name, str)
        and namespace
        and name
        and namespace.isprintable()
        and name.isprintable()
    ):
        context = _Context(kind, f"{namespace}/{name}")
    else:
        context = _Context(kind, describe(obj).partition(" ")[2])
    if namespace is None or namespace == "":
        raise context.error("metadata.namespace is missing")
    if name is None or name == "":
        raise context.error("metadata.name is missing")
    if not _is_dns_label(namespace):
        raise context.error(f"metadata.namespace {_show(namespace)} is not a valid DNS-1123 label")
    return metadata, context


class _Where:
    """``namespace/name``, formatted when printed (:class:`_Context`)."""

    __slots__ = ("name", "namespace")

    def __init__(self, namespace: str, name: str) -> None:
        self.namespace = namespace
        self.name = name

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@functools.lru_cache(maxsize=4096)
def _is_namespace(text: str) -> bool:
    # A cluster's few namespaces over every object: each matched once, not per object.
    return text.isprintable() and _is_dns_label(text)


def _usual_metadata(obj: Any) -> tuple[dict[str, Any], str, str] | None:
    """The metadata, namespace and name of an object in the usual shape (a dict with a
    valid namespace and a string name, unchecked), None otherwise: what :func:`_metadata`
    accepts, without the context its messages need."""
    metadata = obj.get("metadata") if type(obj) is dict else None
    if type(metadata) is not dict:
        return None
    namespace, name = metadata.get("namespace"), metadata.get("name")
    if (
        type(namespace) is str
        and type(name) is str
        and 0 < len(namespace) <= 63
        and _is_namespace(namespace)
    ):
        return metadata, namespace, name
    return None


def service_key(obj: KubeObject) -> NamespacedName:
    """The namespace and name of a Service; raises :class:`InvalidObject` if either is
    missing or is not a DNS-1123 label."""
    # The usual Service, checked as below without the context a message needs (two
    # objects made and dropped per call: 2.56-2.73 against 1.68-1.74 us, main and this,
    # timeit in turn, the shared machine).
    usual = _usual_metadata(obj)
    if usual is not None and _is_dns_label(usual[2]):
        return NamespacedName(_intern(usual[1]), _intern(usual[2]))
    metadata, context = _metadata(obj, "Service")
    name = metadata["name"]
    if not _is_dns_label(name):
        raise context.error(f"metadata.name {_show(name)} is not a valid DNS-1123 label")
    return NamespacedName(_intern(metadata["namespace"]), _intern(name))


# ---------------------------------------------------------------------------------------
# Services


def parse_service(
    obj: KubeObject, family: IPFamily, *, key: NamespacedName | None = None
) -> dict[ServicePortName, ServicePort]:
    """The ports of a Service as the proxier of ``family`` sees them.

    Returns ``{}`` for Services the proxy skips on purpose: ExternalName, headless
    (``clusterIP`` None, empty or absent, or the ``service.kubernetes.io/headless``
    label), owned by another proxy (``service.kubernetes.io/service-proxy-name``), or
    without a cluster IP of this family. Raises :class:`InvalidObject` when the Service
    is malformed (only the cluster IPs are checked when none is of this family).
    Addresses of the other family in ``externalIPs``, load-balancer ingress and
    ``loadBalancerSourceRanges`` are filtered out, not errors. ``key`` is
    :func:`service_key` of ``obj`` when the caller has it already (not checked twice).
    """
    if key is None:
        key = service_key(obj)
    context = _Context("Service", key)
    metadata = obj["metadata"]
    labels = context.mapping(metadata.get("labels"), "metadata.labels")
    if LABEL_SERVICE_PROXY_NAME in labels or LABEL_HEADLESS in labels:
        return {}
    spec = context.mapping(obj.get("spec"), "spec")
    service_type = spec.get("type") or "ClusterIP"
    if not isinstance(service_type, str) or service_type not in _SERVICE_TYPES:
        raise context.error(f"spec.type: unknown type {_show(service_type)}")
    if service_type == "ExternalName":
        return {}
    primary_ip = spec.get("clusterIP")
    if primary_ip is None or primary_ip in ("", "None"):
        return {}

    cluster_ip = _cluster_ip(context, spec, primary_ip, family)
    if cluster_ip is None:
        # Not this family's Service: the other family's proxier validates the rest, so a
        # single-stack Service with a mistake is reported once on a dual-stack node.
        return {}
    ports = _service_ports(context, spec)
    if not ports:
        return {}

    # Most Services have none of these: an absent field (None, as its validation reads
    # it) is no address without the calls that would find none.
    raw_external = spec.get("externalIPs")
    external_ips = (
        ()
        if raw_external is None
        else _family_ips(context, raw_external, "spec.externalIPs", family)
    )
    status = obj.get("status")
    lb_vips = () if status is None else _load_balancer_vips(context, status, family)
    raw_ranges = spec.get("loadBalancerSourceRanges")
    source_ranges = () if raw_ranges is None else _source_ranges(context, raw_ranges, family)
    affinity_seconds = _affinity_seconds(context, spec)
    internal_local = _policy_is_local(context, spec, "internalTrafficPolicy")
    # As upstream: eTP only matters for Services reachable from outside by their type.
    externally_accessible = service_type in ("NodePort", "LoadBalancer") or (
        service_type == "ClusterIP"
        and raw_external is not None
        and bool(context.sequence(raw_external, "spec.externalIPs"))
    )
    external_local = (
        _policy_is_local(context, spec, "externalTrafficPolicy") and externally_accessible
    )
    health_check_node_port = 0
    raw_hcnp = spec.get("healthCheckNodePort")
    if raw_hcnp is not None:
        checked = context.integer(raw_hcnp, "spec.healthCheckNodePort", 0, 65535)
        if service_type == "LoadBalancer" and external_local:
            health_check_node_port = checked
    elif service_type == "LoadBalancer" and external_local:
        logger.debug("Service %s needs a health check but has no healthCheckNodePort", key)

    result: dict[ServicePortName, ServicePort] = {}
    for port_name, protocol, port, node_port in ports:
        name = ServicePortName(key, port_name, protocol)
        result[name] = ServicePort(
            name=name,
            cluster_ip=cluster_ip,
            port=port,
            protocol=protocol,
            node_port=node_port,
            external_ips=external_ips,
            load_balancer_vips=lb_vips,
            load_balancer_source_ranges=source_ranges,
            session_affinity_seconds=affinity_seconds,
            internal_policy_local=internal_local,
            external_policy_local=external_local,
            health_check_node_port=health_check_node_port,
        )
    return result


def _cluster_ip(
    context: _Context, spec: Mapping[str, Any], primary: Any, family: IPFamily
) -> IPAddress | None:
    """The Service's cluster IP of ``family`` (``spec.clusterIPs``, else ``spec.clusterIP``)."""
    candidates = context.sequence(spec.get("clusterIPs"), "spec.clusterIPs")
    field = "spec.clusterIPs"
    if not candidates:
        candidates = (primary,)
        field = "spec.clusterIP"
    # Each text is validated as parse_ip does, but only the one kept becomes an address
    # object: the proxier of the other family (every Service is parsed by both on a
    # dual-stack node) makes none.
    want_ipv6 = family is IPFamily.IPV6
    found: str | None = None
    for text in candidates:
        try:
            address = _address_text(text)
        except ValueError:
            raise context.fail(field, 0, f"invalid IP address {_show(text)}") from None
        if found is None and (":" in address) is want_ipv6:
            found = address
    if found is None:
        return None
    # From the canonical text's bytes: ip_address(text) parses it again in Python.
    if want_ipv6:
        return ipaddress.IPv6Address(_inet_pton(_AF_INET6, found))
    return ipaddress.IPv4Address(int.from_bytes(_inet_pton(_AF_INET, found), "big"))


def _service_ports(
    context: _Context, spec: Mapping[str, Any]
) -> list[tuple[str, Protocol, int, int]]:
    ports: list[tuple[str, Protocol, int, int]] = []
    seen: set[tuple[str, Protocol]] = set()
    for index, raw in enumerate(context.sequence(spec.get("ports"), "spec.ports")):
        entry = context.mapping(raw, "spec.ports[{}]", index)
        name = context.port_name(entry.get("name"), "spec.ports[{}].name", index)
        protocol = context.protocol(entry.get("protocol"), "spec.ports[{}].protocol", index)
        port = context.integer(entry.get("port"), "spec.ports[{}].port", 1, 65535, index)
        node_port = entry.get("nodePort")
        if node_port is None:
            node_port = 0
        else:
            node_port = context.integer(node_port, "spec.ports[{}].nodePort", 0, 65535, index)
        if (name, protocol) in seen:
            raise context.fail(
                "spec.ports[{}]", index, f"duplicate port {name or '<unnamed>'}/{protocol.value}"
            )
        seen.add((name, protocol))
        ports.append((name, protocol, port, node_port))
    return ports


def _family_ips(
    context: _Context, value: Any, field: str, family: IPFamily
) -> tuple[IPAddress, ...]:
    """Every IP of a list is validated; those of ``family`` are kept, in order, once."""
    kept: dict[IPAddress, None] = {}
    for index, text in enumerate(context.sequence(value, field)):
        address = context.ip(text, field + "[{}]", index)
        if address.version == family.version:
            kept[address] = None
    return tuple(kept)


def _load_balancer_vips(context: _Context, status: Any, family: IPFamily) -> tuple[IPAddress, ...]:
    load_balancer = context.mapping(
        context.mapping(status, "status").get("loadBalancer"), "status.loadBalancer"
    )
    field = "status.loadBalancer.ingress"
    kept: dict[IPAddress, None] = {}
    for index, raw in enumerate(context.sequence(load_balancer.get("ingress"), field)):
        ingress = context.mapping(raw, field + "[{}]", index)
        text = ingress.get("ip")
        # Proxy-mode load balancers deliver to the node themselves: no VIP rules for them.
        if text is None or text == "" or ingress.get("ipMode") not in (None, "VIP"):
            continue
        address = context.ip(text, field + "[{}].ip", index)
        if address.version == family.version:
            kept[address] = None
    return tuple(kept)


def _source_ranges(context: _Context, value: Any, family: IPFamily) -> tuple[IPNetwork, ...]:
    field = "spec.loadBalancerSourceRanges"
    kept: dict[IPNetwork, None] = {}
    for index, text in enumerate(context.sequence(value, field)):
        try:
            # API validation used to let whitespace padding through; upstream trims it.
            network = parse_cidr(text.strip() if isinstance(text, str) else text)
        except ValueError:
            raise context.error(f"{field}[{index}]: invalid CIDR {_show(text)}") from None
        if network.version == family.version:
            kept[network] = None
    return tuple(kept)


def _affinity_seconds(context: _Context, spec: Mapping[str, Any]) -> int:
    affinity = spec.get("sessionAffinity")
    if affinity is None or affinity == "None":
        return 0
    if affinity != "ClientIP":
        raise context.error(f"spec.sessionAffinity: unknown value {_show(affinity)}")
    config = context.mapping(spec.get("sessionAffinityConfig"), "spec.sessionAffinityConfig")
    client_ip = context.mapping(config.get("clientIP"), "spec.sessionAffinityConfig.clientIP")
    timeout = client_ip.get("timeoutSeconds")
    if timeout is None:
        return DEFAULT_AFFINITY_SECONDS
    return context.integer(
        timeout, "spec.sessionAffinityConfig.clientIP.timeoutSeconds", 1, MAX_AFFINITY_SECONDS
    )


def _policy_is_local(context: _Context, spec: Mapping[str, Any], field: str) -> bool:
    policy = spec.get(field)
    if policy is None or policy == "Cluster":
        return False
    if policy == "Local":
        return True
    raise context.error(f"spec.{field}: unknown value {_show(policy)}")


# ---------------------------------------------------------------------------------------
# EndpointSlices


def endpoint_with_port(endpoint: Endpoint, port: int) -> Endpoint:
    """A copy of ``endpoint`` with another port (:meth:`Endpoint.with_port`, as
    ``dataclasses.replace`` but faster); the copy shares the address text."""
    return endpoint.with_port(port)


@slot_init
@dataclass(frozen=True, slots=True)
class ParsedEndpointSlice:
    """The parts of an EndpointSlice the proxy uses, validated.

    ``ports`` holds (port name, port number, protocol), sorted; ports without a number are
    left out. ``endpoints`` holds one endpoint per slice endpoint that has an address
    (only ``addresses[0]`` counts), sorted by key, as :class:`EndpointRows` (no object
    per endpoint: 80 MB less at 100k Services x 10; one built by hand may hold a tuple of
    :class:`Endpoint`, which the merge takes too). Their ``port`` is the slice's
    first port (0 when it has none): the usual single-port slice then needs no copies
    when merged; the merge makes one copy per further port.

    Equality is what the change tracker uses to decide whether a slice changed.
    """

    service: NamespacedName
    name: str
    address_type: str
    ports: tuple[tuple[str, int, Protocol], ...]
    endpoints: Endpoints


def endpoint_slice_key(obj: KubeObject) -> tuple[NamespacedName, str]:
    """The Service an EndpointSlice belongs to (its ``kubernetes.io/service-name``
    label) and the slice's name; raises :class:`InvalidObject` when either is missing
    or malformed."""
    # The usual slice, checked as below without the context a message needs (as
    # service_key does): 2.93-3.49 against 2.75-2.79 us (as there).
    usual = _usual_metadata(obj)
    if usual is not None and _is_dns_subdomain(usual[2]):
        labels = usual[0].get("labels")
        service = labels.get(LABEL_SERVICE_NAME) if type(labels) is dict else None
        if type(service) is str and _is_dns_label(service):
            return NamespacedName(_intern(usual[1]), _intern(service)), usual[2]
    metadata, context = _metadata(obj, "EndpointSlice")
    name = metadata["name"]
    if not _is_dns_subdomain(name):
        raise context.error(f"metadata.name {_show(name)} is not a valid DNS-1123 subdomain")
    labels = context.mapping(metadata.get("labels"), "metadata.labels")
    service = labels.get(LABEL_SERVICE_NAME)
    if service is None or service == "":
        raise context.error(f"label {LABEL_SERVICE_NAME} is missing")
    if not _is_dns_label(service):
        raise context.error(f"label {LABEL_SERVICE_NAME}: {_show(service)} is not a valid name")
    return NamespacedName(_intern(metadata["namespace"]), _intern(service)), name


def parse_endpoint_slice(
    obj: KubeObject, family: IPFamily, node_name: str
) -> ParsedEndpointSlice | None:
    """An EndpointSlice as the proxier of ``family`` on node ``node_name`` sees it.

    Returns ``None`` when the slice's ``addressType`` is not this family's (the other
    family, FQDN, or absent). Raises :class:`InvalidObject` when the slice is malformed.
    A port without a number (it means "all ports", which a proxy cannot program) or with
    number 0 is left out with one log line for the slice, as upstream skips it.

    A slice handed over (:func:`hand_over`) for this family and node is returned as it
    was parsed then, not walked again.
    """
    handed = _handed
    if handed is not None and handed[0] is obj and handed[1] is family and handed[2] == node_name:
        return handed[3]
    return _parse_slice(obj, family, node_name, None)


# One EndpointSlice parsed already, for the tracker it is being delivered to:
# (object, family, node name, parsed). See hand_over.
_handed: tuple[KubeObject, IPFamily, str, ParsedEndpointSlice] | None = None


def hand_over(obj: KubeObject | None, parsed: ParsedEndpointSlice | None, node_name: str) -> None:
    """Make :func:`parse_endpoint_slice` of ``obj`` (this very object, for ``parsed``'s
    family and ``node_name``) answer ``parsed`` without walking ``obj`` again, until the
    next call; ``hand_over(None, None, "")`` forgets it.

    Why: the manifests source validates a slice with the parse itself
    (:func:`parse_checked_endpoint_slice`) just before it delivers the slice to the
    change tracker, which parses it again; at 100k Services x 10 endpoints that second
    walk was 1.7 s of a cold start (py-spy, issue 32). The source hands the parse over
    around its delivery only, so one object is held at most, and only while it is
    delivered; it is known by identity (the reference held keeps its id from being
    reused), and a source never changes an object it delivered.
    """
    global _handed
    if obj is None or parsed is None:
        _handed = None
        return
    family = IPFamily.IPV6 if parsed.address_type == IPFamily.IPV6.value else IPFamily.IPV4
    _handed = (obj, family, node_name, parsed)


def parse_checked_endpoint_slice(
    obj: KubeObject,
    family: IPFamily,
    node_name: str,
    node_name_ok: Callable[[str], bool],
) -> tuple[ParsedEndpointSlice | None, list[int]]:
    """:func:`parse_endpoint_slice`, plus the indexes of the endpoints that are not in
    the usual shape the API server's validation passes without looking further: an
    object with one address, a strict dotted quad outside the ranges no endpoint may be
    in (first octet 0, 127, 169 or 224, checked in full by the validation), no hints,
    and no node name or one ``node_name_ok`` accepts. Every endpoint of an IPv6 slice
    is listed (they are all checked in full), as is every endpoint the parse skips.

    For :mod:`kubeproxy.sources.apivalidation`: the checks ride on the parse's own walk
    of the endpoints, which reads those fields anyway, instead of a walk of their own
    (see :func:`hand_over`). Raises :class:`InvalidObject` as the parse does. A slice
    with a port the parse leaves out (no number) gives no parse (None) and no log line:
    its tracker parses it and says so once, as before, whether or not it is valid.
    """
    unclear: list[int] = []
    parsed = _parse_slice(obj, family, node_name, (unclear, node_name_ok))
    if parsed is not None:
        raw_ports = obj.get("ports")
        if len(parsed.ports) != (len(raw_ports) if raw_ports is not None else 0):
            parsed = None
    return parsed, unclear


SPECIAL_FIRST_OCTETS: Final = frozenset({0, 127, 169, 224})
"""The first octets of the IPv4 ranges no endpoint address may be in (0.0.0.0,
127.0.0.0/8, 169.254.0.0/16, 224.0.0.0/24): an address starting so is checked in full, by
the parse's walk and by the API validation alike."""


def _parse_slice(
    obj: KubeObject,
    family: IPFamily,
    node_name: str,
    check: tuple[list[int], Callable[[str], bool]] | None,
) -> ParsedEndpointSlice | None:
    if type(obj) is not dict and not isinstance(obj, Mapping):
        return None
    if obj.get("addressType") != family.value:
        return None
    service, slice_name = endpoint_slice_key(obj)
    context = _Context("EndpointSlice", _Where(service.namespace, slice_name))

    ports: list[tuple[str, int, Protocol]] = []
    skipped = 0
    for index, raw in enumerate(context.sequence(obj.get("ports"), "ports")):
        entry = context.mapping(raw, "ports[{}]", index)
        name = context.port_name(entry.get("name"), "ports[{}].name", index)
        protocol = context.protocol(entry.get("protocol"), "ports[{}].protocol", index)
        number = entry.get("port")
        if number is None or number == 0:
            skipped += 1
            continue
        ports.append((name, context.integer(number, "ports[{}].port", 1, 65535, index), protocol))
    if skipped and check is None:  # checked: see parse_checked_endpoint_slice
        logger.warning(
            "EndpointSlice %s: ignoring %d port(s) without a port number",
            context.name,
            skipped,
        )
    ports.sort()
    first_port = ports[0][1] if ports else 0
    # An endpoint's key is its address and this text: the port formatted once a slice,
    # not once an endpoint (timeit, shared machine: 120 against 50 ns an endpoint).
    port_suffix = f":{first_port}"

    # Columns, not an Endpoint per endpoint (kubeproxy.objects.EndpointRows).
    keys: list[str] = []
    addresses_of: list[str] = []
    flags = bytearray()
    hints_of: list[tuple[frozenset[str], frozenset[str]]] | None = None
    is_ipv6 = family is IPFamily.IPV6
    # Never equal to a nodeName when this proxy has no node name.
    local_node: object = node_name if node_name else _NEVER
    known_node = bool(node_name)
    pton, inet, special_octets = _inet_pton, _AF_INET, SPECIAL_FIRST_OCTETS
    # With a check (parse_checked_endpoint_slice): where the unusual endpoints go.
    unclear: list[int] | None = None
    node_ok: Callable[[str], bool] = _is_dns_subdomain
    if check is not None:
        unclear, node_ok = check
    for index, raw in enumerate(context.sequence(obj.get("endpoints"), "endpoints")):
        # The common shapes are checked inline: this loop runs for every endpoint of
        # the cluster at start-up.
        entry = raw if type(raw) is dict else context.mapping(raw, "endpoints[{}]", index)
        addresses = entry.get("addresses")
        if type(addresses) is not list:
            addresses = context.sequence(addresses, "endpoints[{}].addresses", index)
        if not addresses:
            if unclear is not None:
                unclear.append(index)
            continue
        address = addresses[0]
        packed = None
        try:
            # _address_text's usual case inline (a strict dotted quad is its own text):
            # a call less per endpoint of the cluster.
            if type(address) is not str or len(address) > 15 or ":" in address:
                address = _address_text(address)
            else:
                try:
                    packed = pton(inet, address)
                except (OSError, ValueError):
                    address = _address_text(address)
        except ValueError:
            raise context.fail(
                "endpoints[{}].addresses[0]", index, f"invalid IP address {_show(addresses[0])}"
            ) from None
        if (":" in address) is not is_ipv6:
            raise context.fail(
                "endpoints[{}].addresses[0]", index, f"{address} is not an {family.value} address"
            )
        bits = _READY_SERVING
        conditions = entry.get("conditions")
        if conditions is not None:
            if type(conditions) is not dict:
                conditions = context.mapping(conditions, "endpoints[{}].conditions", index)
            ready = conditions.get("ready", True)
            serving = conditions.get("serving", True)
            terminating = conditions.get("terminating", False)
            if ready is not True and ready is not False:
                ready = context.boolean(ready, "endpoints[{}].conditions.ready", True, index)
            if serving is not True and serving is not False:
                serving = context.boolean(serving, "endpoints[{}].conditions.serving", True, index)
            if terminating is not True and terminating is not False:
                terminating = context.boolean(
                    terminating, "endpoints[{}].conditions.terminating", False, index
                )
            bits = (READY if ready else 0) | (SERVING if serving else 0)
            if terminating:
                bits |= TERMINATING
        node = entry.get("nodeName")
        if node == local_node:
            bits |= IS_LOCAL
        elif known_node and type(node) is str:
            bits |= REMOTE
        hints = entry.get("hints")
        if unclear is not None and (
            packed is None
            or packed[0] in special_octets
            or hints is not None
            or type(raw) is not dict
            or type(addresses) is not list
            or len(addresses) != 1
            or (node is not None and (type(node) is not str or not node_ok(node)))
        ):
            unclear.append(index)
        if hints is not None:
            where = f"endpoints[{index}].hints"
            hints = context.mapping(hints, where)
            zone_hints = _hint_names(context, hints.get("forZones"), where + ".forZones")
            node_hints = _hint_names(context, hints.get("forNodes"), where + ".forNodes")
            if hints_of is None:
                hints_of = [NO_HINTS] * len(keys)
            hints_of.append((zone_hints, node_hints) if zone_hints or node_hints else NO_HINTS)
        elif hints_of is not None:
            hints_of.append(NO_HINTS)
        keys.append(f"[{address}]{port_suffix}" if is_ipv6 else address + port_suffix)
        addresses_of.append(address)
        flags.append(bits)
    return ParsedEndpointSlice(
        service=service,
        name=slice_name,
        address_type=family.value,
        ports=_shared_ports(tuple(ports)),
        endpoints=_sorted_rows(keys, addresses_of, first_port, flags, hints_of),
    )


_READY_SERVING: Final = READY | SERVING


def _sorted_rows(
    keys: list[str],
    addresses: list[str],
    port: int,
    flags: bytearray,
    hints: list[tuple[frozenset[str], frozenset[str]]] | None,
) -> EndpointRows:
    """A slice's endpoint columns as rows sorted by key (stably, as the objects were)."""
    # Compared with its sorted copy, in C, not by a generator over the pairs: 0.24
    # against 0.93 us for a sorted slice of 10 (timeit, the shared machine).
    ordered = sorted(keys)
    if keys == ordered:
        return EndpointRows.columns(
            tuple(keys),
            tuple(addresses),
            port,
            bytes(flags),
            None if hints is None else tuple(hints),
        )
    # Out of order (10.0.0.10 sorts before 10.0.0.2: most slices of ten or more): the
    # other columns picked in key order by one itemgetter, in C, not a comprehension
    # each. Instructions counted by callgrind for a slice of 10: 26.6k against 38.0k
    # (bench/README.md, issue 32). Two or more keys here, so it gives tuples.
    pick = itemgetter(*sorted(range(len(keys)), key=keys.__getitem__))
    return EndpointRows.columns(
        tuple(ordered),
        pick(addresses),
        port,
        bytes(pick(flags)),
        None if hints is None else pick(hints),
    )


_SlicePorts = tuple[tuple[str, int, Protocol], ...]


@functools.lru_cache(maxsize=4096)
def _shared_ports(ports: _SlicePorts) -> _SlicePorts:
    # Most slices of a cluster have one of a few port lists ("http", 8080, TCP): one
    # tuple each instead of two per slice (13 MB at 100k Services; issue 32).
    return ports


def _hint_names(context: _Context, value: Any, field: str) -> frozenset[str]:
    names: list[str] = []
    for index, raw in enumerate(context.sequence(value, field)):
        name = context.mapping(raw, field + "[{}]", index).get("name")
        if not isinstance(name, str) or not name:
            raise context.fail(field + "[{}].name", index, f"expected a name, got {_show(name)}")
        names.append(name)
    return frozenset(names) if names else _EMPTY


# ---------------------------------------------------------------------------------------
# Node


def parse_node(obj: KubeObject) -> NodeInfo:
    """What the proxy needs of its own Node.

    Raises :class:`InvalidObject` only when the Node has no name; an unparseable address
    or pod CIDR is logged and left out (the rest of the Node is still useful).
    """
    if not isinstance(obj, Mapping):
        raise InvalidObject("Node", "<unknown>", f"expected an object, got {_show(obj)}")
    metadata = obj.get("metadata")
    metadata = metadata if isinstance(metadata, Mapping) else {}
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidObject("Node", _name_part(name), "metadata.name is missing")
    labels = metadata.get("labels")
    zone = labels.get(LABEL_ZONE, "") if isinstance(labels, Mapping) else ""
    spec = obj.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    status = obj.get("status")
    status = status if isinstance(status, Mapping) else {}

    by_type: dict[str, list[IPAddress]] = {"InternalIP": [], "ExternalIP": []}
    raw_addresses = status.get("addresses")
    for entry in raw_addresses if isinstance(raw_addresses, list) else ():
        if not isinstance(entry, Mapping):
            continue
        kind = entry.get("type")
        if not isinstance(kind, str) or kind not in by_type:
            continue
        text = entry.get("address")
        try:
            by_type[kind].append(parse_ip(text if isinstance(text, str) else repr(text)))
        except ValueError as err:
            logger.warning("Node %s: ignoring address: %s", name, err)
    addresses = tuple(dict.fromkeys(by_type["InternalIP"] + by_type["ExternalIP"]))

    raw_cidrs = spec.get("podCIDRs")
    if not isinstance(raw_cidrs, list) or not raw_cidrs:
        single = spec.get("podCIDR")
        raw_cidrs = [single] if single else []
    pod_cidrs: list[IPNetwork] = []
    for text in raw_cidrs:
        try:
            pod_cidrs.append(parse_cidr(text))
        except ValueError as err:
            logger.warning("Node %s: ignoring pod CIDR: %s", name, err)

    taints = spec.get("taints")
    tainted = any(
        isinstance(taint, Mapping) and taint.get("key") == TAINT_TO_BE_DELETED
        for taint in (taints if isinstance(taints, list) else ())
    )
    return NodeInfo(
        name=name,
        zone=zone if isinstance(zone, str) else "",
        addresses=addresses,
        pod_cidrs=tuple(dict.fromkeys(pod_cidrs)),
        deleting=bool(metadata.get("deletionTimestamp")),
        to_be_deleted_taint=tainted,
    )
