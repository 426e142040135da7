"""This node's IPs and the families to proxy, as upstream decides them at start-up.

:func:`detect_node_ips` picks a node IP per family and the primary family (from
``bindAddress``, else the Node's addresses, else loopback with upstream's warning);
:func:`detect_families` the families to proxy as upstream's ``platformCheckSupported``
and ``createProxier`` do: the primary family, which must be supported, and the other one
whenever the kernel supports it, whether or not the node has an address of it (its node
IP is then the loopback stand-in); :func:`expand_primary` turns ``primary`` in
``nodePortAddresses`` into those IPs, once, as upstream does.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Final

from kubeproxy.config import ProxierConfig
from kubeproxy.handlers import KubeObject
from kubeproxy.objects import IPAddress, IPFamily, NodeInfo
from kubeproxy.parse import InvalidObject, parse_node

__all__ = [
    "LOOPBACK_MESSAGE",
    "FamilyNotSupported",
    "NodeIPs",
    "detect_families",
    "detect_node_ips",
    "expand_primary",
    "host_ips",
    "kernel_supports_ipv6",
    "node_info",
]

logger = logging.getLogger(__name__)

LOOPBACK_MESSAGE: Final = (
    "Can't determine this node's IP, assuming loopback; if this is incorrect, please set the "
    "--bind-address flag"
)
"""Upstream's log line when neither the Node nor ``bindAddress`` gives a node IP."""

_LOOPBACK_V4: Final = ipaddress.IPv4Address("127.0.0.1")
_LOOPBACK_V6: Final = ipaddress.IPv6Address("::1")


def _family_of(address: IPAddress) -> IPFamily:
    return IPFamily.IPV4 if address.version == 4 else IPFamily.IPV6


@dataclass(frozen=True, slots=True)
class NodeIPs:
    """This node's IP of each family and its primary family (upstream's ``NodeIPs``).

    A family the node has no address of holds the loopback address, as upstream.
    """

    primary_family: IPFamily = IPFamily.IPV4
    ipv4: ipaddress.IPv4Address = _LOOPBACK_V4
    ipv6: ipaddress.IPv6Address = _LOOPBACK_V6

    def of(self, family: IPFamily) -> IPAddress:
        """The node IP of ``family`` (loopback when the node has none)."""
        return self.ipv4 if family is IPFamily.IPV4 else self.ipv6

    @property
    def primary(self) -> IPAddress:
        """The node IP of the primary family."""
        return self.of(self.primary_family)

    @property
    def real(self) -> tuple[IPAddress, ...]:
        """The node IPs that are not loopback stand-ins, primary first."""
        ordered = [self.primary, self.of(_other(self.primary_family))]
        return tuple(ip for ip in ordered if not ip.is_loopback)


def _other(family: IPFamily) -> IPFamily:
    return IPFamily.IPV6 if family is IPFamily.IPV4 else IPFamily.IPV4


def host_ips(addresses: Sequence[IPAddress]) -> tuple[IPAddress, ...]:
    """Upstream's node host IPs: the first address, then the first of the other family."""
    if not addresses:
        return ()
    first = addresses[0]
    other = next((a for a in addresses if a.version != first.version), None)
    return (first,) if other is None else (first, other)


def detect_node_ips(
    raw: Sequence[IPAddress], bind_address: str = "", *, explain_loopback: bool = True
) -> NodeIPs:
    """Node IPs as upstream decides them: ``bindAddress`` when set and not unspecified
    overrides the primary IP; else the Node's host IPs (the first one's family is
    primary); else loopback, logging upstream's :data:`LOOPBACK_MESSAGE` (unless
    ``explain_loopback`` is False: the caller said why already)."""
    primary = IPFamily.IPV4
    ips: dict[IPFamily, IPAddress] = {}
    for address in host_ips(raw):
        ips.setdefault(_family_of(address), address)
    if raw:
        primary = _family_of(raw[0])
    try:
        bind = ipaddress.ip_address(bind_address) if bind_address else None
    except ValueError:
        bind = None  # validation rejected it already; never guess
    if bind is not None and not bind.is_unspecified:
        primary = _family_of(bind)
        ips[primary] = bind
    v4, v6 = ips.get(IPFamily.IPV4), ips.get(IPFamily.IPV6)
    node_ips = NodeIPs(
        primary,
        v4 if isinstance(v4, ipaddress.IPv4Address) else _LOOPBACK_V4,
        v6 if isinstance(v6, ipaddress.IPv6Address) else _LOOPBACK_V6,
    )
    if node_ips.primary.is_loopback and explain_loopback:
        logger.warning(LOOPBACK_MESSAGE)
    return node_ips


_IF_INET6: Final = "/proc/net/if_inet6"


def kernel_supports_ipv6(path: str = _IF_INET6) -> bool:
    """Whether this kernel has IPv6 (the ``ipv6.disable=1`` boot option removes it), as
    upstream checks it; logs upstream's ``No kernel support for IPv6`` when it has not."""
    try:
        os.stat(path)
    except OSError as err:
        logger.info('No kernel support for IPv6 err="stat %s: %s"', path, err.strerror)
        return False
    return True


class FamilyNotSupported(ValueError):
    """The primary IP family cannot be proxied here (upstream's start-up error)."""


def detect_families(node_ips: NodeIPs, *, ipv6_supported: bool) -> list[IPFamily]:
    """The families to proxy, IPv4 first: the primary one, and the other one whenever the
    kernel supports it (the kernel always has IPv4). Raises :class:`FamilyNotSupported`,
    with upstream's message, when the primary family is IPv6 and the kernel has none."""
    primary = node_ips.primary_family
    supported = {IPFamily.IPV4: True, IPFamily.IPV6: ipv6_supported}
    if not supported[primary]:
        raise FamilyNotSupported(f'no support for primary IP family "{primary}"')
    return [family for family in (IPFamily.IPV4, IPFamily.IPV6) if supported[family]]


def expand_primary(config: ProxierConfig, node_ips: NodeIPs) -> ProxierConfig:
    """Replace ``primary`` in ``nodePortAddresses`` by the node IPs' host CIDRs.

    Upstream expands it once at start-up, which is how ``bindAddress`` reaches NodePorts;
    a Node IP change later makes the proxy exit and start again. Without a real node IP
    ``primary`` is left for the proxier to resolve.
    """
    spec = config.node_port_addresses
    if "primary" not in spec or not node_ips.real:
        return config
    cidrs = tuple(f"{ip}/{ip.max_prefixlen}" for ip in node_ips.real)
    others = tuple(entry for entry in spec if entry != "primary")
    return replace(config, node_port_addresses=cidrs + others)


def node_info(node: KubeObject | None, name: str, addresses: Sequence[IPAddress]) -> NodeInfo:
    """This node as the proxiers see it: the Node object parsed, or, without a usable
    one (manifests without this Node), ``name`` with this host's non-loopback
    ``addresses``."""
    if node is not None:
        try:
            return parse_node(node)
        except InvalidObject as err:
            logger.warning("%s; using this host's addresses", err)
    found = sorted((a for a in addresses if not a.is_loopback), key=lambda a: (a.version, int(a)))
    return NodeInfo(name=name, addresses=tuple(found))
