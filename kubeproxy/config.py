"""Settings a proxier needs, independent of where they came from (flags, config file, tests).

These are the proxier-facing part of upstream's KubeProxyConfiguration: field meanings and
defaults follow upstream. Decoding the configuration file lives elsewhere; this module only
holds validated values.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from enum import StrEnum

from kubeproxy.featuregates import DEFAULT_GATES, FeatureGates
from kubeproxy.objects import IPFamily, IPNetwork
from kubeproxy.pacing import DEFAULT_PACING, SyncPacing

__all__ = [
    "IPVSSettings",
    "LocalDetectMode",
    "LocalDetector",
    "LocalTraffic",
    "ProxierConfig",
]


class LocalDetectMode(StrEnum):
    """How a proxier tells traffic from local pods apart from other traffic."""

    NONE = "None"
    CLUSTER_CIDR = "ClusterCIDR"
    NODE_CIDR = "NodeCIDR"
    BRIDGE_INTERFACE = "BridgeInterface"
    INTERFACE_NAME_PREFIX = "InterfaceNamePrefix"


_CIDR_MODES = (LocalDetectMode.CLUSTER_CIDR, LocalDetectMode.NODE_CIDR)
_INTERFACE_MODES = (LocalDetectMode.BRIDGE_INTERFACE, LocalDetectMode.INTERFACE_NAME_PREFIX)


@dataclass(frozen=True, slots=True)
class LocalTraffic:
    """What tells traffic from local pods, for a backend to write in its own syntax: the
    source CIDR, or (``by_interface``) the input interface's name (a prefix already ends
    in the backend's wildcard)."""

    by_interface: bool
    value: str


@dataclass(frozen=True, slots=True)
class LocalDetector:
    """The local-traffic detector: by source CIDR, by input interface, or none.

    ``cidrs`` serves the two CIDR modes (for NodeCIDR they are filled from the Node's
    pod CIDRs); ``interface`` is the bridge name or the interface-name prefix.
    """

    mode: LocalDetectMode = LocalDetectMode.NONE
    cidrs: tuple[IPNetwork, ...] = ()
    interface: str = ""

    def for_family(self, family: IPFamily) -> LocalDetector:
        """The detector as the proxier of one family sees it.

        A CIDR mode without a CIDR of this family detects nothing (upstream logs this and
        runs without detection for that family).
        """
        if self.mode in _CIDR_MODES:
            mine = tuple(c for c in self.cidrs if c.version == family.version)
            if not mine:
                return LocalDetector()
            return LocalDetector(self.mode, mine[:1])
        return self

    @property
    def implemented(self) -> bool:
        """Whether this detector can tell local traffic at all."""
        if self.mode in _CIDR_MODES:
            return bool(self.cidrs)
        if self.mode in _INTERFACE_MODES:
            return bool(self.interface)
        return False

    def local_traffic(
        self, family: IPFamily, valid_interface: re.Pattern[str], wildcard: str
    ) -> LocalTraffic | None:
        """The match of this detector (already for ``family``), None when it cannot tell:
        the mode is dispatched here once, each backend only spells the result.

        Raises :class:`ValueError` for a CIDR of another family or an interface name the
        backend's ``valid_interface`` refuses (each kernel tool reads names its own way).
        """
        if self.mode in _CIDR_MODES and self.cidrs:
            cidr = self.cidrs[0]
            if cidr.version != family.version:
                raise ValueError(f"local detector CIDR {cidr} is not {family}")
            return LocalTraffic(False, str(cidr))
        if self.mode in _INTERFACE_MODES and self.interface:
            if valid_interface.fullmatch(self.interface) is None:
                raise ValueError(f"local detector interface {self.interface!r} is not valid")
            prefix = self.mode is LocalDetectMode.INTERFACE_NAME_PREFIX
            return LocalTraffic(True, self.interface + (wildcard if prefix else ""))
        return None


@dataclass(frozen=True, slots=True)
class IPVSSettings:
    """The (deprecated) ipvs mode's settings, from the configuration's ``ipvs`` section.

    Timeouts are in seconds; 0 leaves the kernel's value alone. ``exclude_cidrs`` are
    addresses whose IPVS virtual servers the proxy never deletes (someone else's).
    """

    scheduler: str = "rr"
    exclude_cidrs: tuple[IPNetwork, ...] = ()
    strict_arp: bool = False
    tcp_timeout: float = 0.0
    tcp_fin_timeout: float = 0.0
    udp_timeout: float = 0.0


@dataclass(frozen=True, slots=True)
class ProxierConfig:
    """Everything a proxier of one node needs besides the objects it proxies.

    ``node_port_addresses`` holds CIDRs and the keywords ``primary``, ``localhost`` and
    ``all`` as upstream's ``nodePortAddresses``; empty means the backend's default
    (``primary`` for nftables, all addresses for iptables and ipvs). ``service_cidrs``
    is the fallback used to drop traffic to unallocated service IPs when the API offers
    no ServiceCIDR objects. Periods are in seconds. ``min_sync_period`` is upstream's
    ``minSyncPeriod``, a fixed rest after every sync; None (the default, and nftables
    mode's when the configuration leaves it unset) rests as ``sync_pacing`` says, by what
    each sync cost (:mod:`kubeproxy.pacing`).

    Mode-specific settings: ``localhost_node_ports`` (iptables mode: accept NodePorts on
    127.0.0.1, upstream's ``iptables.localhostNodePorts``), ``tcp_be_liberal`` (the
    ``conntrack.tcpBeLiberal`` setting: iptables mode then keeps its INVALID-state drop
    out), ``ipvs`` (ipvs mode's scheduler, timeouts and excluded CIDRs).
    """

    node_name: str
    masquerade_all: bool = False
    masquerade_bit: int = 14
    local_detector: LocalDetector = field(default_factory=LocalDetector)
    node_port_addresses: tuple[str, ...] = ()
    service_cidrs: tuple[IPNetwork, ...] = ()
    sync_period: float = 30.0
    min_sync_period: float | None = None
    sync_pacing: SyncPacing = DEFAULT_PACING
    localhost_node_ports: bool = True
    tcp_be_liberal: bool = False
    ipvs: IPVSSettings = field(default_factory=IPVSSettings)
    feature_gates: FeatureGates = DEFAULT_GATES

    def __post_init__(self) -> None:
        if not 0 <= self.masquerade_bit <= 31:
            raise ValueError(f"masqueradeBit: must be in [0, 31], got {self.masquerade_bit}")
        if self.sync_period <= 0:
            raise ValueError(f"syncPeriod: must be greater than 0, got {self.sync_period}")
        if self.min_sync_period is not None and not 0 <= self.min_sync_period <= self.sync_period:
            raise ValueError(
                "minSyncPeriod: must be between 0 and syncPeriod "
                f"({self.sync_period}s), got {self.min_sync_period}"
            )
        for entry in self.node_port_addresses:
            if entry in ("primary", "localhost", "all"):
                continue
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(
                    f"nodePortAddresses: {entry!r} is neither a CIDR nor one of "
                    "primary, localhost, all"
                ) from None

    @property
    def masquerade_mark(self) -> int:
        """The packet-mark bit that asks for masquerading (``1 << masqueradeBit``)."""
        return 1 << self.masquerade_bit
