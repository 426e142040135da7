"""The fixed part of the per-Service-chain structure's table: what is not per Service.

Everything here is a pure function of a few inputs (family, masquerade mark, NodePort
addresses, service CIDRs); the per-Service part is in :mod:`bench.chain_structure.render`.
Names, hooks, priorities and the shape of the dispatch rules match upstream kube-proxy's
nftables mode (``service-ips`` and ``service-nodeports`` verdict maps, read by the
``services`` chain). The words both structures use are in
:mod:`kubeproxy.backends.nftables.table`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from kubeproxy.backend import NodePortAddresses
from kubeproxy.backends.nftables.table import (
    AFFINITY_TIMEOUT,
    ContainerSpec,
    FamilyTokens,
    FixedChain,
    Names,
    base_chains,
    tokens_for,
)
from kubeproxy.objects import IPFamily, IPNetwork

__all__ = [
    "AFFINITY_SIZE",
    "FixedStructure",
    "fixed_structure",
]

log = logging.getLogger(__name__)

AFFINITY_SIZE = 1048576
"""Entries of the shared IPv4 ``affinity`` map."""


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
