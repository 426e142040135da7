"""Resolving ``nodePortAddresses`` into the addresses one family's NodePorts listen on.

Entries are CIDRs and the keywords ``primary`` (the Node's primary IP of the family, as a
host CIDR), ``localhost`` (``127.0.0.0/8`` and ``::1/128``) and ``all`` (the zero CIDRs).
As upstream, each family keeps only its own CIDRs, and a family left with none matches
every address: an empty list, a list naming only the other family, ``all`` or a zero CIDR
all mean "every local address".
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Sequence

from kubeproxy.backend import NodePortAddresses
from kubeproxy.objects import IPAddress, IPFamily, IPNetwork, NodeInfo

__all__ = ["expand_node_port_cidrs", "resolve_node_port_addresses"]

logger = logging.getLogger(__name__)

_LOCALHOST: tuple[IPNetwork, ...] = (
    ipaddress.IPv4Network("127.0.0.0/8"),
    ipaddress.IPv6Network("::1/128"),
)
_ZERO: tuple[IPNetwork, ...] = (
    ipaddress.IPv4Network("0.0.0.0/0"),
    ipaddress.IPv6Network("::/0"),
)


def _zero_cidr(family: IPFamily) -> IPNetwork:
    return _ZERO[0] if family is IPFamily.IPV4 else _ZERO[1]


def expand_node_port_cidrs(
    spec: Sequence[str], family: IPFamily, node: NodeInfo
) -> tuple[IPNetwork, ...]:
    """The CIDRs of ``family`` that ``spec`` names, keywords expanded, in order, deduplicated.

    Returns the family's zero CIDR alone when nothing of the family is named. Raises
    :class:`ValueError` for an entry that is neither a keyword nor a CIDR (the
    configuration has normally rejected it already).
    """
    expanded: list[IPNetwork] = []
    for entry in spec:
        expanded.extend(_expand_entry(entry, family, node))
    mine = list(dict.fromkeys(c for c in expanded if c.version == family.version))
    if not mine:
        return (_zero_cidr(family),)
    return tuple(mine)


def _expand_entry(entry: str, family: IPFamily, node: NodeInfo) -> Iterable[IPNetwork]:
    if entry == "all":
        return _ZERO
    if entry == "localhost":
        return _LOCALHOST
    if entry == "primary":
        primary = node.addresses_of(family)[:1]
        if not primary:
            logger.debug(
                "nodePortAddresses: node %s has no %s address for 'primary'", node.name, family
            )
            return ()
        if primary[0].is_loopback:
            logger.warning(
                "nodePortAddresses: primary %s address %s of node %s is a loopback address;"
                " ignored",
                family,
                primary[0],
                node.name,
            )
            return ()
        return (ipaddress.ip_network(primary[0]),)
    try:
        return (ipaddress.ip_network(entry.strip(), strict=False),)
    except ValueError:
        raise ValueError(
            f"nodePortAddresses: {entry!r} is neither a CIDR nor one of primary, localhost, all"
        ) from None


def resolve_node_port_addresses(
    spec: Sequence[str],
    family: IPFamily,
    node: NodeInfo,
    host_addresses: Sequence[IPAddress],
) -> NodePortAddresses:
    """Where ``family``'s NodePorts are accepted, given the host's current addresses.

    ``match_all`` is set when the family's CIDRs include a zero CIDR (or none was given);
    ``addresses`` then lists every non-loopback host address of the family, for backends
    that need explicit addresses. Otherwise ``addresses`` are the host addresses inside
    the family's CIDRs. ``cidrs`` are the family's CIDRs. Addresses are sorted and unique.
    """
    cidrs = expand_node_port_cidrs(spec, family, node)
    match_all = any(c.prefixlen == 0 for c in cidrs)
    mine = {a for a in host_addresses if a.version == family.version}
    if match_all:
        selected = {a for a in mine if not a.is_loopback}
    else:
        selected = {a for a in mine if any(a in c for c in cidrs)}
    return NodePortAddresses(
        match_all=match_all,
        addresses=tuple(sorted(selected, key=int)),
        cidrs=cidrs,
    )
