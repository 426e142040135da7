"""The API server's validation of the Service and EndpointSlice fields the proxy reads.

With the API source, the API server has validated every object before the proxy sees it;
with the manifests source (:mod:`kubeproxy.sources.manifests`) nobody has, so the source
applies the same rules itself and refuses, with one line, what the API server would
refuse: before this, a manifest with ``externalIPs: [127.0.0.1]`` or ``[224.0.0.1]`` was
programmed (issue 31). The proxy's own parsing (:mod:`kubeproxy.parse`) stays lenient,
as upstream's kube-proxy is, for objects the API server stored under older rules.

The rules are upstream's, as of Kubernetes 1.37 with its default feature gates, after the
API server's defaulting (a field left out takes its default: protocol ``TCP``, type
``ClusterIP``, ``sessionAffinity: None`` and so on), for the fields the proxy reads
(``pkg/apis/core/validation/validation.go``: ``ValidateService``,
``validateServicePort``, ``ValidateServiceClusterIPsRelatedFields``,
``validateClientIPAffinityConfig``, ``validateServiceExternalTrafficPolicy``,
``validateServiceInternalTrafficFieldsValue``, ``ValidateLoadBalancerStatus``,
``ValidateEndpointIP``; ``pkg/apis/discovery/validation/validation.go``:
``ValidateEndpointSlice``; ``staging/src/k8s.io/apimachinery/pkg/util/validation``:
``IsValidIPForLegacyField``, ``IsValidCIDRForLegacyField``, names, labels):

Service
  * ``metadata.name`` and ``metadata.namespace``: DNS-1123 labels (Service names are
    labels since ``RelaxedServiceNameValidation``, GA in 1.37); ``metadata.labels``:
    qualified-name keys, label values.
  * ``spec.type``: ``ClusterIP``, ``NodePort``, ``LoadBalancer`` or ``ExternalName``.
  * ``spec.ports``: at least one unless headless or ExternalName; each a DNS-1123 label
    ``name`` (required when there are several, unique), ``port`` 1-65535, ``protocol``
    ``TCP``, ``UDP`` or ``SCTP``; no ``nodePort`` on a ClusterIP Service; no
    (protocol, port) and no (protocol, nodePort) twice.
  * ``spec.clusterIP`` / ``clusterIPs``: ``clusterIPs[0]`` equal to ``clusterIP``, at
    most two, of different families, ``None`` only alone and not for NodePort or
    LoadBalancer Services; each a valid IP.
  * ``spec.externalIPs``: valid IPs, and none unspecified (``0.0.0.0``, ``::``), loopback
    (``127.0.0.0/8``, ``::1``), link-local (``169.254.0.0/16``, ``fe80::/10``) or
    link-local multicast (``224.0.0.0/24``, ``ff02::/16``): ``ValidateEndpointIP``.
    Upstream's own comment there: it is almost, but not exactly, ``IsGlobalUnicast``:
    global multicast (``224.0.1.1``) and the broadcast address (``255.255.255.255``)
    are accepted, so they are here too.
  * ``spec.sessionAffinity``: ``None`` or ``ClientIP``; with ``ClientIP``,
    ``sessionAffinityConfig.clientIP.timeoutSeconds`` 1-86400; with ``None``, no
    ``sessionAffinityConfig``.
  * ``spec.loadBalancerSourceRanges``: only on LoadBalancer Services; valid CIDRs
    (spaces around them allowed, a historical accident upstream keeps).
  * ``spec.externalTrafficPolicy``: ``Cluster`` or ``Local``, and only on Services
    reachable from outside (NodePort, LoadBalancer, or with external IPs);
    ``spec.healthCheckNodePort`` 1-65535 and only on LoadBalancers with policy
    ``Local``; ``spec.internalTrafficPolicy``: ``Cluster`` or ``Local``.
  * ``status.loadBalancer.ingress[].ip``: a valid IP; ``ipMode``: ``VIP`` or ``Proxy``,
    and only with an ``ip``.

EndpointSlice
  * ``metadata.name``: a DNS-1123 subdomain; ``metadata.namespace``: a label;
    ``metadata.labels`` (``kubernetes.io/service-name`` among them): valid labels.
  * ``addressType``: ``IPv4``, ``IPv6`` or ``FQDN``.
  * ``endpoints``: at most 1000; each with 1 to 100 ``addresses``, valid addresses of
    the slice's type (``ValidateEndpointIP`` too, for IPv4 and IPv6), a DNS-1123
    subdomain ``nodeName``, at most 8 distinct ``hints.forZones`` of valid label values.
  * ``ports``: at most 20000; DNS-1123 label names, unique; ``protocol`` ``TCP``,
    ``UDP`` or ``SCTP``.

"Valid IP" and "valid CIDR" are upstream's strict forms (``StrictIPCIDRValidation``,
beta and on by default): no leading zeros (``010.0.0.1``), no IPv4-mapped IPv6
(``::ffff:10.0.0.1``), no bits set beyond a CIDR's prefix length. EndpointSlice
addresses keep the older, sloppy parse, as upstream's discovery validation does.

Each function returns the reasons, ``"<field>: <value>: <why>"``, in field order; an empty
list for an object the API server would store. :func:`checked_endpoint_slice` returns
the same reasons and the slice's parse, made on the same walk of its endpoints (the
source hands it to the change tracker: :func:`kubeproxy.parse.hand_over`).
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Final

from kubeproxy.objects import IPAddress, IPFamily
from kubeproxy.parse import (
    SPECIAL_FIRST_OCTETS,
    InvalidObject,
    ParsedEndpointSlice,
    parse_checked_endpoint_slice,
    parse_ip,
)

__all__ = ["checked_endpoint_slice", "endpoint_slice_errors", "service_errors"]

_DNS_LABEL: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN: Final = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)
_QUALIFIED: Final = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_SERVICE_TYPES: Final = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
_PROTOCOLS: Final = ("TCP", "UDP", "SCTP")
_ADDRESS_TYPES: Final = ("IPv4", "IPv6", "FQDN")
_POLICIES: Final = ("Cluster", "Local")
_IP_MODES: Final = ("VIP", "Proxy")
_MAX_AFFINITY_SECONDS: Final = 86400
_MAX_ENDPOINTS: Final = 1000
_MAX_ADDRESSES: Final = 100
_MAX_SLICE_PORTS: Final = 20000
_MAX_ZONE_HINTS: Final = 8
_LINK_LOCAL_MULTICAST4: Final = ipaddress.IPv4Network("224.0.0.0/24")
_FAMILIES: Final = {family.value: family for family in IPFamily}


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_label(value: object) -> bool:
    return isinstance(value, str) and len(value) <= 63 and _DNS_LABEL.fullmatch(value) is not None


@functools.lru_cache(maxsize=4096)
def _is_namespace(text: str) -> bool:
    # A cluster's few namespaces over every object: each matched once, not per object.
    return _is_label(text)


def _is_subdomain(value: object) -> bool:
    return (
        isinstance(value, str) and len(value) <= 253 and _DNS_SUBDOMAIN.fullmatch(value) is not None
    )


def _is_qualified_name(value: object) -> bool:
    if not isinstance(value, str):
        return False
    return _is_qualified_text(value)


@functools.lru_cache(maxsize=4096)
def _is_qualified_text(value: str) -> bool:
    # Label keys: a few ("app", "kubernetes.io/service-name") over every object.
    prefix, slash, name = value.rpartition("/")
    if slash and not (prefix and _is_subdomain(prefix)):
        return False
    return len(name) <= 63 and _QUALIFIED.fullmatch(name) is not None


def _is_label_value(value: object) -> bool:
    return isinstance(value, str) and (
        value == "" or (len(value) <= 63 and _QUALIFIED.fullmatch(value) is not None)
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _port_ok(value: object) -> bool:
    return (type(value) is int or _is_int(value)) and 1 <= value <= 65535  # type: ignore[operator]


def _items(value: object) -> Sequence[Any] | None:
    """A list field: the list, ``[]`` when absent, None when it is not a list."""
    if value is None:
        return []
    return value if isinstance(value, list) else None


def _mapping(value: object) -> Mapping[str, Any] | None:
    if value is None:
        return {}
    # type() first: isinstance against the Mapping ABC costs 0.2 us, per field.
    return value if type(value) is dict or isinstance(value, Mapping) else None


# --- addresses ------------------------------------------------------------------------


def _ip_problem(text: object, *, strict: bool = True) -> str | None:
    """Why ``text`` is no valid IP (upstream's ``IsValidIPForLegacyField``); None if it is."""
    if _strict_ipv4(text):
        return None
    if not isinstance(text, str):
        return "must be a valid IP address"
    try:
        parse_ip(text)
    except ValueError:
        return "must be a valid IP address"
    if not strict:
        return None
    try:
        strict_form = ipaddress.ip_address(text)
    except ValueError:
        return "must not have leading 0s"
    if isinstance(strict_form, ipaddress.IPv6Address) and strict_form.ipv4_mapped is not None:
        return "must not be an IPv4-mapped IPv6 address"
    return None


def _special(address: IPAddress) -> str | None:
    """Upstream's ``ValidateEndpointIP``: the addresses no endpoint or external IP may be."""
    if address.is_unspecified:
        return f"may not be unspecified ({address})"
    if address.is_loopback:
        return "may not be in the loopback range (127.0.0.0/8, ::1/128)"
    if address.is_link_local:
        return "may not be in the link-local range (169.254.0.0/16, fe80::/10)"
    if isinstance(address, ipaddress.IPv4Address):
        link_local_multicast = address in _LINK_LOCAL_MULTICAST4
    else:  # Go's IsLinkLocalMulticast: ffX2::/16, whatever the flags
        link_local_multicast = address.packed[0] == 0xFF and address.packed[1] & 0x0F == 0x02
    if link_local_multicast:
        return "may not be in the link-local multicast range (224.0.0.0/24, ff02::/10)"
    return None


def _plain_ipv4(text: object) -> bool:
    """Whether ``text`` is a strict dotted quad outside every range :func:`_special`
    refuses: an IPv4 endpoint address with no problem, known without an address object.

    The usual endpoint address; at 100k Services x 10 endpoints, parsing each twice into
    an ``IPv4Address`` and testing it against four networks was a quarter of the
    manifests' start-up (cProfile, 30k: 7.5 s of 32 s profiled). Anything else
    (another form, or a first octet of a special range) is left to the full checks."""
    if type(text) is not str or len(text) > 15:
        return False
    try:
        # inet_pton takes strict dotted-quad only: what parse_ip takes as it is.
        first = _inet_pton(_AF_INET, text)[0]
    except (OSError, ValueError):
        return False
    return first not in SPECIAL_FIRST_OCTETS


def _strict_ipv4(text: object) -> bool:
    """Whether ``text`` is a strict dotted quad (no leading zeros): valid in every form
    :func:`_ip_problem` knows, found without the two address objects it makes otherwise
    (a Service's cluster IP, validated at every start-up)."""
    if type(text) is not str or len(text) > 15:
        return False
    try:
        _inet_pton(_AF_INET, text)
    except (OSError, ValueError):
        return False
    return True


_inet_pton = socket.inet_pton
_AF_INET = socket.AF_INET


def _cidr_problem(text: object) -> str | None:
    """Why ``text`` is no valid CIDR (upstream's strict ``IsValidCIDRForLegacyField``)."""
    invalid = "must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)"
    if not isinstance(text, str) or text.count("/") != 1:
        return invalid
    address, _, prefix = text.partition("/")
    if _ip_problem(address, strict=False) is not None:
        return invalid
    if not (prefix.isascii() and prefix.isdigit()):
        return invalid
    if (len(prefix) > 1 and prefix[0] == "0") or _ip_problem(address) == "must not have leading 0s":
        return "must not have leading 0s in IP or prefix length"
    if _ip_problem(address) is not None:
        return "must not have an IPv4-mapped IPv6 address"
    try:
        ipaddress.ip_network(text, strict=True)
    except ValueError as err:
        if "host bits" in str(err):
            return "must not have bits set beyond the prefix length"
        return invalid
    return None


# --- Services ---------------------------------------------------------------------------


def service_errors(obj: Mapping[str, Any]) -> list[str]:
    """Why the API server would refuse Service ``obj`` (see the module); [] if it would not."""
    errors: list[str] = []
    _service(obj, errors)
    return errors


def _metadata(obj: Mapping[str, Any], name_ok: Any, name_kind: str, errors: list[str]) -> None:
    metadata = _mapping(obj.get("metadata"))
    if metadata is None:
        errors.append("metadata: must be an object")
        return
    name = metadata.get("name")
    if not name_ok(name):
        errors.append(f"metadata.name: {_show(name)}: must be a valid {name_kind}")
    namespace = metadata.get("namespace")
    if not (type(namespace) is str and len(namespace) <= 63 and _is_namespace(namespace)):
        errors.append(f"metadata.namespace: {_show(namespace)}: must be a valid DNS-1123 label")
    labels = _mapping(metadata.get("labels"))
    if labels is None:
        errors.append("metadata.labels: must be an object")
        return
    for key, value in labels.items():
        if not _is_qualified_name(key):
            errors.append(f"metadata.labels: {_show(key)}: must be a qualified name")
        elif not _is_label_value(value):
            errors.append(f"metadata.labels[{key}]: {_show(value)}: must be a valid label value")


def _service(obj: Mapping[str, Any], errors: list[str]) -> None:
    _metadata(obj, _is_label, "DNS-1123 label", errors)
    spec = _mapping(obj.get("spec"))
    if spec is None:
        errors.append("spec: must be an object")
        return
    kind = spec.get("type") or "ClusterIP"
    if kind not in _SERVICE_TYPES:
        errors.append(f"spec.type: {_show(kind)}: must be one of {', '.join(_SERVICE_TYPES)}")
        return
    _cluster_ips(spec, kind, errors)
    headless = spec.get("clusterIP") == "None"
    _ports(spec, kind, headless, errors)
    external_ips = _items(spec.get("externalIPs"))
    if external_ips is None:
        errors.append("spec.externalIPs: must be a list")
        external_ips = []
    for index, text in enumerate(external_ips):
        problem = _ip_problem(text)
        if problem is None:
            problem = _special(parse_ip(text))
        if problem is not None:
            errors.append(f"spec.externalIPs[{index}]: {_show(text)}: {problem}")
    _affinity(spec, errors)
    _source_ranges(spec, kind, errors)
    _traffic_policies(spec, kind, bool(external_ips), errors)
    _load_balancer_status(obj.get("status"), errors)


def _cluster_ips(spec: Mapping[str, Any], kind: str, errors: list[str]) -> None:
    primary = spec.get("clusterIP")
    listed = _items(spec.get("clusterIPs"))
    if listed is None:
        errors.append("spec.clusterIPs: must be a list")
        return
    if kind == "ExternalName":
        if listed or primary not in (None, ""):
            errors.append("spec.clusterIPs: may not be set for ExternalName services")
        return
    if listed and primary not in (None, "") and listed[0] != primary:
        errors.append(f"spec.clusterIPs[0]: {_show(listed[0])}: must be equal to clusterIP")
    ips = listed or ([primary] if primary not in (None, "") else [])
    if len(ips) > 2:
        errors.append("spec.clusterIPs: may have at most 2 values (one per IP family)")
        return
    if "None" in ips:
        if len(ips) > 1:
            errors.append("spec.clusterIPs: 'None' must be the only value")
        elif kind in ("NodePort", "LoadBalancer"):
            errors.append(
                f"spec.clusterIPs[0]: 'None': may not be set to 'None' for {kind} services"
            )
        return
    versions = []
    for index, text in enumerate(ips):
        problem = _ip_problem(text)
        if problem is not None:
            errors.append(f"spec.clusterIPs[{index}]: {_show(text)}: {problem}")
        else:
            # Valid and no IPv4-mapped IPv6 address: the family is in the text.
            versions.append(6 if ":" in text else 4)
    if len(versions) == 2 and versions[0] == versions[1]:
        errors.append("spec.clusterIPs: may specify no more than one IP for each IP family")


def _ports(spec: Mapping[str, Any], kind: str, headless: bool, errors: list[str]) -> None:
    ports = _items(spec.get("ports"))
    if ports is None:
        errors.append("spec.ports: must be a list")
        return
    if not ports and not headless and kind != "ExternalName":
        errors.append("spec.ports: Required value")
    names: set[str] = set()
    seen_ports: set[tuple[str, object]] = set()
    seen_node_ports: set[tuple[str, object]] = set()
    for index, raw in enumerate(ports):
        port = _mapping(raw)
        if port is None:
            errors.append(f"spec.ports[{index}]: must be an object")
            continue
        name = port.get("name") or ""
        if not name and len(ports) > 1:
            errors.append(f"spec.ports[{index}].name: Required value (several ports)")
        elif name:
            if not _is_label(name):
                errors.append(
                    f"spec.ports[{index}].name: {_show(name)}: must be a valid DNS-1123 label"
                )
            elif name in names:
                errors.append(f"spec.ports[{index}].name: {_show(name)}: Duplicate value")
            names.add(str(name))
        number = port.get("port")
        if not _port_ok(number):
            errors.append(
                f"spec.ports[{index}].port: {_show(number)}: must be between 1 and 65535, inclusive"
            )
        protocol = port.get("protocol") or "TCP"
        if protocol not in _PROTOCOLS:
            errors.append(
                f"spec.ports[{index}].protocol: {_show(protocol)}: must be one of"
                f" {', '.join(_PROTOCOLS)}"
            )
        if (protocol, number) in seen_ports:
            errors.append(f"spec.ports[{index}]: {protocol}/{_show(number)}: Duplicate value")
        seen_ports.add((protocol, number))
        node_port = port.get("nodePort") or 0
        if node_port:
            if kind == "ClusterIP":
                errors.append(
                    f"spec.ports[{index}].nodePort: may not be used when `type` is 'ClusterIP'"
                )
            elif not _port_ok(node_port):
                errors.append(
                    f"spec.ports[{index}].nodePort: {_show(node_port)}: must be between 1 and 65535"
                )
            elif (protocol, node_port) in seen_node_ports:
                errors.append(f"spec.ports[{index}].nodePort: {node_port}: Duplicate value")
            seen_node_ports.add((protocol, node_port))


def _affinity(spec: Mapping[str, Any], errors: list[str]) -> None:
    affinity = spec.get("sessionAffinity") or "None"
    config = spec.get("sessionAffinityConfig")
    if affinity not in ("None", "ClientIP"):
        errors.append(f"spec.sessionAffinity: {_show(affinity)}: must be None or ClientIP")
    elif affinity == "None":
        if config is not None:
            errors.append(
                "spec.sessionAffinityConfig: must not be set when session affinity is None"
            )
    else:
        # Left out, the config and its timeout are defaulted (10800 s) before validation.
        client_ip = _mapping((_mapping(config) or {}).get("clientIP"))
        timeout = (client_ip or {}).get("timeoutSeconds")
        if timeout is not None and not (_is_int(timeout) and 0 < timeout <= _MAX_AFFINITY_SECONDS):
            errors.append(
                "spec.sessionAffinityConfig.clientIP.timeoutSeconds:"
                f" {_show(timeout)}: must be greater than 0 and less than"
                f" {_MAX_AFFINITY_SECONDS}"
            )


def _source_ranges(spec: Mapping[str, Any], kind: str, errors: list[str]) -> None:
    ranges = _items(spec.get("loadBalancerSourceRanges"))
    if ranges is None:
        errors.append("spec.loadBalancerSourceRanges: must be a list")
        return
    if ranges and kind != "LoadBalancer":
        errors.append(
            "spec.loadBalancerSourceRanges: may only be used when `type` is 'LoadBalancer'"
        )
    for index, text in enumerate(ranges):
        value = text.strip() if isinstance(text, str) else text
        problem = _cidr_problem(value)
        if problem is not None:
            errors.append(f"spec.loadBalancerSourceRanges[{index}]: {_show(text)}: {problem}")


def _traffic_policies(
    spec: Mapping[str, Any], kind: str, external_ips: bool, errors: list[str]
) -> None:
    reachable = kind in ("NodePort", "LoadBalancer") or (kind == "ClusterIP" and external_ips)
    external = spec.get("externalTrafficPolicy") or ""
    if not reachable and external:
        errors.append(
            f"spec.externalTrafficPolicy: {_show(external)}: may only be set for"
            " externally-accessible services"
        )
    elif external and external not in _POLICIES:
        errors.append(f"spec.externalTrafficPolicy: {_show(external)}: must be Cluster or Local")
    health = spec.get("healthCheckNodePort") or 0
    needs_health = kind == "LoadBalancer" and external == "Local"
    if health and not needs_health:
        errors.append(
            f"spec.healthCheckNodePort: {_show(health)}: may only be set when `type` is"
            " 'LoadBalancer' and `externalTrafficPolicy` is 'Local'"
        )
    elif health and not _port_ok(health):
        errors.append(f"spec.healthCheckNodePort: {_show(health)}: must be between 1 and 65535")
    internal = spec.get("internalTrafficPolicy") or "Cluster"
    if internal not in _POLICIES:
        errors.append(f"spec.internalTrafficPolicy: {_show(internal)}: must be Cluster or Local")


def _load_balancer_status(status: object, errors: list[str]) -> None:
    if not status:
        return  # none, or empty: nothing to check (a Service's usual status)
    load_balancer = _mapping((_mapping(status) or {}).get("loadBalancer"))
    ingress = _items((load_balancer or {}).get("ingress"))
    if load_balancer is None or ingress is None:
        errors.append("status.loadBalancer: must be an object with an ingress list")
        return
    for index, raw in enumerate(ingress):
        where = f"status.loadBalancer.ingress[{index}]"
        entry = _mapping(raw)
        if entry is None:
            errors.append(f"{where}: must be an object")
            continue
        address = entry.get("ip") or ""
        if address:
            problem = _ip_problem(address)
            if problem is not None:
                errors.append(f"{where}.ip: {_show(address)}: {problem}")
        mode = entry.get("ipMode")
        if mode is not None:
            if not address:
                errors.append(f"{where}.ipMode: may not be specified when `ip` is not")
            elif mode not in _IP_MODES:
                errors.append(f"{where}.ipMode: {_show(mode)}: must be VIP or Proxy")


# --- EndpointSlices -----------------------------------------------------------------------


def endpoint_slice_errors(obj: Mapping[str, Any]) -> list[str]:
    """Why the API server would refuse EndpointSlice ``obj``; [] if it would not."""
    errors: list[str] = []
    _endpoint_slice(obj, errors)
    return errors


def checked_endpoint_slice(
    obj: Mapping[str, Any], node_name: str
) -> tuple[list[str], ParsedEndpointSlice | None]:
    """:func:`endpoint_slice_errors` of ``obj``, and the slice as the proxier of its
    address type on node ``node_name`` parses it (:func:`~kubeproxy.parse.
    parse_endpoint_slice`; None for a refused slice, an FQDN one, or one the parse
    refuses: its tracker reports that as before).

    One walk of the endpoints instead of two: the parse reads every field the checks
    need, and tells which endpoints are not in the usual shape
    (:func:`~kubeproxy.parse.parse_checked_endpoint_slice`); only those are checked
    here. At 100k Services x 10 endpoints the validation's own walk of every endpoint
    (:func:`_unclear_endpoints`) was 0.54 s of the manifests' cold start, and the
    tracker's parse 1.7 s (py-spy, issue 32); the source hands this parse to the tracker
    (:func:`~kubeproxy.parse.hand_over`).
    """
    errors: list[str] = []
    parsed = _endpoint_slice(obj, errors, node_name)
    return errors, (parsed if not errors else None)


def _endpoint_slice(
    obj: Mapping[str, Any], errors: list[str], node_name: str | None = None
) -> ParsedEndpointSlice | None:
    """Check ``obj`` into ``errors``; with a ``node_name``, parse it on the way when it
    is an IPv4 or IPv6 slice (see :func:`checked_endpoint_slice`)."""
    _metadata(obj, _is_subdomain, "DNS-1123 subdomain", errors)
    address_type = obj.get("addressType")
    if address_type not in _ADDRESS_TYPES:
        errors.append(
            f"addressType: {_show(address_type)}: must be one of {', '.join(_ADDRESS_TYPES)}"
        )
    parsed = None
    endpoints = _items(obj.get("endpoints"))
    if endpoints is None:
        errors.append("endpoints: must be a list")
    elif len(endpoints) > _MAX_ENDPOINTS:
        errors.append(
            f"endpoints: Too many: {len(endpoints)}: must have at most {_MAX_ENDPOINTS} items"
        )
    else:
        unclear: Iterable[int] | None = None
        if node_name is not None and address_type in _FAMILIES and type(obj) is dict:
            try:
                parsed, unclear = parse_checked_endpoint_slice(
                    obj, _FAMILIES[address_type], node_name, _node_name_ok
                )
            except InvalidObject:
                parsed = None  # the tracker it is delivered to reports it, as before
        if unclear is None:
            unclear = _unclear_endpoints(endpoints, address_type)
        for index in unclear:
            _endpoint(index, endpoints[index], address_type, errors)
    ports = _items(obj.get("ports"))
    if ports is None:
        errors.append("ports: must be a list")
    elif len(ports) > _MAX_SLICE_PORTS:
        errors.append(f"ports: Too many: {len(ports)}: must have at most {_MAX_SLICE_PORTS} items")
    else:
        _slice_ports(ports, errors)
    return parsed


def _unclear_endpoints(endpoints: Sequence[Any], address_type: object) -> Iterator[int]:
    """The indexes of the endpoints :func:`_endpoint` must check; the others, in the
    usual shape, have no problem it could find: IPv4 addresses that are plain dotted
    quads outside the special ranges (:func:`_plain_ipv4`), a valid node name or none,
    no hints.

    One loop per slice instead of a generator, a call and a formatted field name per
    endpoint: at 30k Services x 10 endpoints, :func:`_endpoint` for each was 3.2 s of
    the 37 s profiled (cProfile of the whole ``--once``), this loop is 0.4 s.
    """
    if address_type != "IPv4":
        yield from range(len(endpoints))
        return
    node_name_ok, pton, special_octets = _node_name_ok, _inet_pton, SPECIAL_FIRST_OCTETS
    for index, raw in enumerate(endpoints):
        if type(raw) is not dict:
            yield index
            continue
        addresses = raw.get("addresses")
        if (
            type(addresses) is not list
            or not addresses
            or len(addresses) > _MAX_ADDRESSES
            or raw.get("hints") is not None
        ):
            yield index
            continue
        node = raw.get("nodeName")
        if node is not None and (type(node) is not str or not node_name_ok(node)):
            yield index
            continue
        for text in addresses:
            # plain_ipv4(text), inline: the call was a third of this loop's time.
            try:
                plain = (
                    type(text) is str
                    and len(text) <= 15
                    and pton(_AF_INET, text)[0] not in special_octets
                )
            except (OSError, ValueError):
                plain = False
            if not plain:
                yield index
                break


@functools.lru_cache(maxsize=8192)
def _node_name_ok(name: str) -> bool:
    # A cluster has a few thousand nodes and each names many endpoints: each name's
    # regular expression is matched once, not once per endpoint.
    return _is_subdomain(name)


def _endpoint(index: int, raw: object, address_type: object, errors: list[str]) -> None:
    where = f"endpoints[{index}]"
    endpoint = _mapping(raw)
    if endpoint is None:
        errors.append(f"{where}: must be an object")
        return
    addresses = _items(endpoint.get("addresses"))
    if addresses is None:
        errors.append(f"{where}.addresses: must be a list")
        return
    if not addresses:
        errors.append(f"{where}.addresses: Required value: must contain at least 1 address")
    elif len(addresses) > _MAX_ADDRESSES:
        errors.append(f"{where}.addresses: Too many: must have at most {_MAX_ADDRESSES} items")
    for number, text in enumerate(addresses):
        if address_type not in ("IPv4", "IPv6"):
            continue  # FQDN slices are no business of a proxy's; unknown types fall through
        if address_type == "IPv4" and _plain_ipv4(text):
            continue
        problem = _ip_problem(text, strict=False)
        if problem is None:
            address = parse_ip(text)
            if address.version != (4 if address_type == "IPv4" else 6):
                problem = f"must be a valid {address_type} address"
            else:
                problem = _special(address)
        if problem is not None:
            errors.append(f"{where}.addresses[{number}]: {_show(text)}: {problem}")
    node = endpoint.get("nodeName")
    if node is not None and not _is_subdomain(node):
        errors.append(f"{where}.nodeName: {_show(node)}: must be a valid DNS-1123 subdomain")
    hints = _mapping(endpoint.get("hints"))
    zones = _items((hints or {}).get("forZones"))
    if hints is None or zones is None:
        errors.append(f"{where}.hints: must be an object with a forZones list")
        return
    if len(zones) > _MAX_ZONE_HINTS:
        errors.append(
            f"{where}.hints.forZones: Too many: must have at most {_MAX_ZONE_HINTS} items"
        )
        return
    seen: set[object] = set()
    for number, zone in enumerate(zones):
        name = (_mapping(zone) or {}).get("name")
        if not _is_label_value(name):
            errors.append(
                f"{where}.hints.forZones[{number}].name: {_show(name)}: must be a label value"
            )
        elif name in seen:
            errors.append(f"{where}.hints.forZones[{number}].name: {_show(name)}: Duplicate value")
        seen.add(name)


def _slice_ports(ports: Sequence[Any], errors: list[str]) -> None:
    names: set[object] = set()
    for index, raw in enumerate(ports):
        port = _mapping(raw)
        if port is None:
            errors.append(f"ports[{index}]: must be an object")
            continue
        name = port.get("name") or ""
        if name and not _is_label(name):
            errors.append(f"ports[{index}].name: {_show(name)}: must be a valid DNS-1123 label")
        elif name in names:
            errors.append(f"ports[{index}].name: {_show(name)}: Duplicate value")
        names.add(name)
        protocol = port.get("protocol") or "TCP"
        if protocol not in _PROTOCOLS:
            errors.append(
                f"ports[{index}].protocol: {_show(protocol)}: must be one of"
                f" {', '.join(_PROTOCOLS)}"
            )
