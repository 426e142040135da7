"""Names, family words and container specs shared by both structures, and the fixed part
of the per-Service-chain structure's table (the map structure's is in :mod:`.layout`).

Everything here is a pure function of a few inputs (family, masquerade mark, NodePort
addresses, service CIDRs). The per-service part lives in :mod:`.services`. Names, hooks,
priorities and the shape of the dispatch rules match upstream kube-proxy's nftables mode,
which other components treat as public (see the package README).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from kubeproxy.backend import NodePortAddresses
from kubeproxy.objects import IPAddress, IPFamily, IPNetwork

__all__ = [
    "AFFINITY_SIZE",
    "AFFINITY_TIMEOUT",
    "TABLE",
    "TABLE_COMMENT",
    "ContainerSpec",
    "FamilyTokens",
    "FixedChain",
    "FixedStructure",
    "Names",
    "base_chains",
    "fixed_structure",
    "tokens_for",
]

log = logging.getLogger(__name__)

TABLE = "kube-proxy"
"""Our table's name, in family ``ip`` and ``ip6``."""
TABLE_COMMENT = "rules for kube-proxy"

AFFINITY_TIMEOUT = 3 * 3600
"""Default lifetime (seconds) of an ``affinity`` entry; each entry carries its own."""
AFFINITY_SIZE = 1048576


class Names:
    """Names of the fixed chains, sets and maps."""

    FILTER_PREROUTING_PRE_DNAT = "filter-prerouting-pre-dnat"
    FILTER_OUTPUT_PRE_DNAT = "filter-output-pre-dnat"
    FILTER_INPUT = "filter-input"
    FILTER_FORWARD = "filter-forward"
    FILTER_OUTPUT = "filter-output"
    NAT_PREROUTING = "nat-prerouting"
    NAT_OUTPUT = "nat-output"
    NAT_POSTROUTING = "nat-postrouting"

    SERVICES = "services"
    SERVICE_ENDPOINTS_CHECK = "service-endpoints-check"
    NODEPORT_ENDPOINTS_CHECK = "nodeport-endpoints-check"
    FIREWALL_CHECK = "firewall-check"
    CLUSTER_IPS_CHECK = "cluster-ips-check"
    REJECT_CHAIN = "reject-chain"
    MARK_FOR_MASQUERADE = "mark-for-masquerade"
    MASQUERADING = "masquerading"
    AFFINITY_LOOKUP = "affinity-lookup"

    CLUSTER_IPS = "cluster-ips"
    NODEPORT_IPS = "nodeport-ips"
    SERVICE_IPS = "service-ips"
    SERVICE_NODEPORTS = "service-nodeports"
    FIREWALL_IPS = "firewall-ips"
    NO_ENDPOINT_SERVICES = "no-endpoint-services"
    NO_ENDPOINT_NODEPORTS = "no-endpoint-nodeports"
    HAIRPIN_ENDPOINTS = "hairpin-endpoints"
    AFFINITY = "affinity"


@dataclass(frozen=True, slots=True)
class FamilyTokens:
    """The words that differ between the ``ip`` and ``ip6`` tables."""

    family: IPFamily
    table_family: str
    """``ip`` or ``ip6``: the table family and the match prefix (``ip daddr``)."""
    addr_type: str
    """``ipv4_addr`` or ``ipv6_addr``."""
    loopback: str
    """What NodePort matching must exclude: ``127.0.0.0/8`` or ``::1``."""

    def address(self, ip: IPAddress) -> str:
        """An address as written in a rule or element (canonical text form)."""
        return str(ip)


_TOKENS = {
    IPFamily.IPV4: FamilyTokens(IPFamily.IPV4, "ip", "ipv4_addr", "127.0.0.0/8"),
    IPFamily.IPV6: FamilyTokens(IPFamily.IPV6, "ip6", "ipv6_addr", "::1"),
}


def tokens_for(family: IPFamily) -> FamilyTokens:
    """The tokens of one family."""
    return _TOKENS[family]


@dataclass(frozen=True, slots=True)
class ContainerSpec:
    """A named set (``is_map`` false) or map of the table."""

    name: str
    is_map: bool
    type: str
    flags: tuple[str, ...] = ()
    timeout: int | None = None
    size: int | None = None
    comment: str | None = None
    typeof: bool = False
    """``type`` holds expressions, written ``typeof`` (see :class:`~.objects.Set`)."""


@dataclass(frozen=True, slots=True)
class FixedChain:
    """A chain that does not depend on Services (``hook`` set: a base chain)."""

    name: str
    rules: tuple[str, ...]
    type: str | None = None
    hook: str | None = None
    priority: int | None = None
    comment: str | None = None


@dataclass(frozen=True, slots=True)
class FixedStructure:
    """Everything in the table that is not per Service, for one set of inputs.

    ``chains`` are in an order where every jump target precedes the chains that use it
    only by convention: a transaction adds all chains before any rule. ``fingerprint``
    changes exactly when any rule, chain, container or ``nodeport_ips`` element changes.
    """

    tokens: FamilyTokens
    containers: tuple[ContainerSpec, ...]
    chains: tuple[FixedChain, ...]
    nodeport_ips: tuple[str, ...]
    fingerprint: str


def _containers(tokens: FamilyTokens) -> tuple[ContainerSpec, ...]:
    addr = tokens.addr_type
    service_key = f"{addr} . inet_proto . inet_service"
    nodeport_key = "inet_proto . inet_service"
    return (
        ContainerSpec(Names.CLUSTER_IPS, False, addr, comment="Active ClusterIPs"),
        ContainerSpec(Names.NODEPORT_IPS, False, addr, comment="IPs that accept NodePort traffic"),
        ContainerSpec(
            Names.SERVICE_IPS,
            True,
            f"{service_key} : verdict",
            comment="ClusterIP, ExternalIP and LoadBalancer IP traffic",
        ),
        ContainerSpec(
            Names.SERVICE_NODEPORTS, True, f"{nodeport_key} : verdict", comment="NodePort traffic"
        ),
        ContainerSpec(
            Names.FIREWALL_IPS,
            True,
            f"{service_key} : verdict",
            comment="destinations that are subject to LoadBalancerSourceRanges",
        ),
        ContainerSpec(
            Names.NO_ENDPOINT_SERVICES,
            True,
            f"{service_key} : verdict",
            comment="vmap to drop or reject packets to services with no endpoints",
        ),
        ContainerSpec(
            Names.NO_ENDPOINT_NODEPORTS,
            True,
            f"{nodeport_key} : verdict",
            comment="vmap to drop or reject packets to service nodeports with no endpoints",
        ),
        ContainerSpec(
            Names.HAIRPIN_ENDPOINTS,
            False,
            f"{addr} . {addr}",
            comment="endpoint . endpoint, for connections from an endpoint to itself",
        ),
        ContainerSpec(
            Names.AFFINITY,
            True,
            f"{addr} . {addr} . inet_proto . inet_service : {addr} . inet_service",
            flags=("dynamic", "timeout"),
            timeout=AFFINITY_TIMEOUT,
            size=AFFINITY_SIZE,
            comment="session affinity: client . service . proto . port : endpoint",
        ),
    )


def _nodeport_ips(tokens: FamilyTokens, addresses: NodePortAddresses) -> tuple[str, ...]:
    if addresses.match_all:
        return ()
    result: list[str] = []
    for ip in addresses.addresses:
        if ip.version != tokens.family.version:
            continue
        if ip.is_loopback:
            log.error("skipping NodePort address %s: localhost NodePorts are not supported", ip)
            continue
        text = tokens.address(ip)
        if text not in result:
            result.append(text)
    return tuple(result)


def base_chains(after_dnat: tuple[str, ...] = ()) -> tuple[FixedChain, ...]:
    """Upstream's base chains (names, hooks, priorities) and the jumps they hold.

    Both structures have exactly these (other components rely on them); ``after_dnat``
    rules are appended to the three filter chains that see packets after DNAT.
    """

    def new(target: str) -> str:
        return f"ct state new jump {target}"

    return (
        FixedChain(
            Names.FILTER_PREROUTING_PRE_DNAT,
            (new(Names.FIREWALL_CHECK),),
            "filter",
            "prerouting",
            -110,
        ),
        FixedChain(
            Names.FILTER_OUTPUT_PRE_DNAT, (new(Names.FIREWALL_CHECK),), "filter", "output", -110
        ),
        FixedChain(
            Names.FILTER_INPUT,
            (new(Names.NODEPORT_ENDPOINTS_CHECK), new(Names.SERVICE_ENDPOINTS_CHECK), *after_dnat),
            "filter",
            "input",
            0,
        ),
        FixedChain(
            Names.FILTER_FORWARD,
            (new(Names.SERVICE_ENDPOINTS_CHECK), new(Names.CLUSTER_IPS_CHECK), *after_dnat),
            "filter",
            "forward",
            0,
        ),
        FixedChain(
            Names.FILTER_OUTPUT,
            (new(Names.SERVICE_ENDPOINTS_CHECK), new(Names.CLUSTER_IPS_CHECK), *after_dnat),
            "filter",
            "output",
            0,
        ),
        FixedChain(Names.NAT_PREROUTING, (f"jump {Names.SERVICES}",), "nat", "prerouting", -100),
        FixedChain(Names.NAT_OUTPUT, (f"jump {Names.SERVICES}",), "nat", "output", -100),
        FixedChain(
            Names.NAT_POSTROUTING, (f"jump {Names.MASQUERADING}",), "nat", "postrouting", 100
        ),
    )


def fixed_structure(
    family: IPFamily,
    masquerade_mark: int,
    node_port_addresses: NodePortAddresses,
    service_cidrs: Iterable[IPNetwork],
) -> FixedStructure:
    """The fixed chains, sets and maps of one family's table."""
    tokens = tokens_for(family)
    ip = tokens.table_family
    mark = f"{masquerade_mark:#x}"
    cidrs = [str(c) for c in service_cidrs if c.version == family.version]
    lookup = f"{ip} daddr . meta l4proto . th dport"

    if node_port_addresses.match_all:
        nodeport_dispatch = (
            f"fib daddr type local {ip} daddr != {tokens.loopback} "
            f"meta l4proto . th dport vmap @{Names.SERVICE_NODEPORTS}"
        )
        nodeport_check = (
            f"{ip} daddr != {tokens.loopback} "
            f"meta l4proto . th dport vmap @{Names.NO_ENDPOINT_NODEPORTS}"
        )
    else:
        nodeport_dispatch = (
            f"{ip} daddr @{Names.NODEPORT_IPS} "
            f"meta l4proto . th dport vmap @{Names.SERVICE_NODEPORTS}"
        )
        nodeport_check = (
            f"{ip} daddr @{Names.NODEPORT_IPS} "
            f"meta l4proto . th dport vmap @{Names.NO_ENDPOINT_NODEPORTS}"
        )

    chains = (
        *base_chains(),
        FixedChain(Names.SERVICES, (f"{lookup} vmap @{Names.SERVICE_IPS}", nodeport_dispatch)),
        FixedChain(
            Names.SERVICE_ENDPOINTS_CHECK, (f"{lookup} vmap @{Names.NO_ENDPOINT_SERVICES}",)
        ),
        FixedChain(Names.NODEPORT_ENDPOINTS_CHECK, (nodeport_check,)),
        FixedChain(Names.FIREWALL_CHECK, (f"{lookup} vmap @{Names.FIREWALL_IPS}",)),
        FixedChain(
            Names.CLUSTER_IPS_CHECK,
            (
                f"{ip} daddr @{Names.CLUSTER_IPS} reject",
                *(f"{ip} daddr {cidr} drop" for cidr in cidrs),
            ),
        ),
        FixedChain(
            Names.REJECT_CHAIN,
            ("reject",),
            comment="helper for @no-endpoint-services / @no-endpoint-nodeports",
        ),
        FixedChain(Names.MARK_FOR_MASQUERADE, (f"meta mark set meta mark or {mark}",)),
        FixedChain(
            Names.MASQUERADING,
            (
                f"ct status dnat {ip} saddr . {ip} daddr @{Names.HAIRPIN_ENDPOINTS} "
                f"jump {Names.MARK_FOR_MASQUERADE}",
                f"meta mark & {mark} == 0 return",
                f"meta mark set meta mark xor {mark}",
                "masquerade fully-random",
            ),
        ),
        FixedChain(
            Names.AFFINITY_LOOKUP,
            tuple(
                f"meta l4proto {proto} dnat to {ip} saddr . {ip} daddr . meta l4proto . th dport "
                f"map @{Names.AFFINITY}"
                for proto in ("tcp", "udp", "sctp")
            ),
        ),
    )
    containers = _containers(tokens)
    nodeport_ips = _nodeport_ips(tokens, node_port_addresses)
    digest = hashlib.sha256()
    for container in containers:
        digest.update(repr(container).encode())
    for chain in chains:
        digest.update(repr(chain).encode())
    digest.update(repr(nodeport_ips).encode())
    return FixedStructure(tokens, containers, chains, nodeport_ips, digest.hexdigest())
