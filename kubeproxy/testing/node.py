"""The standard test node of ``flowcases/FORMAT.md`` and the proxier settings derived from it."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Final

from kubeproxy.config import LocalDetectMode, LocalDetector, ProxierConfig
from kubeproxy.featuregates import resolve
from kubeproxy.objects import IPAddress, IPFamily, IPNetwork, NodeInfo
from kubeproxy.testing.cases import ProxierOverrides

__all__ = [
    "BRIDGE_INTERFACE",
    "POD_INTERFACE_PREFIX",
    "STANDARD_NODE",
    "StandardNode",
]

BRIDGE_INTERFACE: Final = "kpxfbr0"
"""The node's pod bridge (for a BridgeInterface local-traffic detector)."""
POD_INTERFACE_PREFIX: Final = "kpxfpod"
"""The node-side name prefix of every pod veth, bridged or routed (for an
InterfaceNamePrefix detector: it matches only routed pods, whose traffic enters the node
on the veth; bridged pods' traffic enters on the bridge)."""


@dataclass(frozen=True, slots=True)
class StandardNode:
    """The node every flow case runs on unless overridden (see FORMAT.md's table).

    ``interfaces`` are the node addresses with their prefix, primary first per family.
    """

    name: str
    interfaces: tuple[ipaddress.IPv4Interface | ipaddress.IPv6Interface, ...]
    pod_cidrs: tuple[IPNetwork, ...]
    service_cidrs: tuple[IPNetwork, ...]
    node_port_addresses: tuple[str, ...]

    @property
    def addresses(self) -> tuple[IPAddress, ...]:
        """All node addresses, IPv4 first, primary first per family."""
        return tuple(interface.ip for interface in self.interfaces)

    def addresses_of(self, family: IPFamily) -> tuple[IPAddress, ...]:
        """The node addresses of one family, primary first."""
        return tuple(a for a in self.addresses if a.version == family.version)

    def pod_cidr(self, family: IPFamily) -> IPNetwork:
        """The pod network (cluster CIDR) of one family."""
        return next(c for c in self.pod_cidrs if c.version == family.version)

    def node_info(self) -> NodeInfo:
        """The :class:`NodeInfo` the proxiers get; its pod CIDRs are the pod network.

        Only the NodeCIDR local-traffic detector reads them.
        """
        return NodeInfo(name=self.name, addresses=self.addresses, pod_cidrs=self.pod_cidrs)

    def local_detector(self, mode: LocalDetectMode | None) -> LocalDetector:
        """The local-traffic detector of a ``localDetector`` override (``None``: ClusterCIDR).

        NodeCIDR carries no CIDRs: the proxier takes them from :meth:`node_info`. The
        interface modes name the scene's pod bridge and pod veth prefix.
        """
        if mode is None or mode is LocalDetectMode.CLUSTER_CIDR:
            return LocalDetector(LocalDetectMode.CLUSTER_CIDR, self.pod_cidrs)
        if mode is LocalDetectMode.BRIDGE_INTERFACE:
            return LocalDetector(mode, interface=BRIDGE_INTERFACE)
        if mode is LocalDetectMode.INTERFACE_NAME_PREFIX:
            return LocalDetector(mode, interface=POD_INTERFACE_PREFIX)
        return LocalDetector(mode)

    def proxier_config(self, overrides: ProxierOverrides) -> ProxierConfig:
        """The proxier configuration of this node with a case's ``proxierOverrides``.

        The same configuration serves both families; each proxier keeps its own family's
        CIDRs and addresses. Feature gates upstream does not know raise
        :class:`~kubeproxy.featuregates.FeatureGateError`.
        """
        mode = overrides.local_detector
        if overrides.local_detector_none:
            mode = LocalDetectMode.NONE
        detector = self.local_detector(mode)
        node_port_addresses = self.node_port_addresses
        if overrides.node_port_addresses is not None:
            node_port_addresses = overrides.node_port_addresses
        return ProxierConfig(
            node_name=self.name,
            masquerade_all=bool(overrides.masquerade_all),
            local_detector=detector,
            node_port_addresses=node_port_addresses,
            service_cidrs=self.service_cidrs,
            feature_gates=resolve(dict(overrides.feature_gates)),
        )


STANDARD_NODE: Final = StandardNode(
    name="test-node",
    interfaces=(
        ipaddress.IPv4Interface("192.168.0.2/24"),
        ipaddress.IPv4Interface("192.168.1.2/24"),
        ipaddress.IPv4Interface("192.168.99.11/24"),
        ipaddress.IPv6Interface("2001:db8::1/64"),
        ipaddress.IPv6Interface("2001:db8:1::2/64"),
    ),
    pod_cidrs=(ipaddress.IPv4Network("10.0.0.0/8"), ipaddress.IPv6Network("fd00:10::/64")),
    service_cidrs=(
        ipaddress.IPv4Network("172.30.0.0/16"),
        ipaddress.IPv6Network("fd00:10:96::/112"),
    ),
    node_port_addresses=("192.168.0.2/32", "2001:db8::1/128"),
)
"""The standard test node of FORMAT.md."""
