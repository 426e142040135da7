"""The iptables rules of ipvs mode, as upstream's ``writeIptablesRules`` writes them.

IPVS does the load balancing; iptables still marks packets for masquerading, lets
hairpin traffic out, filters LoadBalancerSourceRanges and stops host ports being reached
through service addresses. Every rule matches an ipset (:mod:`.ipset`), so the rule text
does not grow with the number of Services: the whole ruleset is rewritten on every sync
it changes in (one ``iptables-restore --noflush``, declaring our eleven chains).

Chains: nat ``KUBE-SERVICES`` (from PREROUTING and OUTPUT), ``KUBE-POSTROUTING`` (from
POSTROUTING), ``KUBE-NODE-PORT``, ``KUBE-LOAD-BALANCER``, ``KUBE-MARK-MASQ``; filter
``KUBE-FORWARD`` (from FORWARD), ``KUBE-NODE-PORT`` (INPUT), ``KUBE-PROXY-FIREWALL``
(INPUT, FORWARD), ``KUBE-SOURCE-RANGES-FIREWALL``, ``KUBE-IPVS-FILTER`` (INPUT),
``KUBE-IPVS-OUT-FILTER`` (OUTPUT).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Final

from kubeproxy.backends.iptables.restore import FILTER, NAT, RestoreInput, comment
from kubeproxy.backends.ipvs.ipset import SetName, SetSpec, SetType
from kubeproxy.config import LocalDetector
from kubeproxy.objects import IPAddress, IPFamily
from kubeproxy.objects import Protocol as L4Protocol

__all__ = [
    "CHAINS",
    "JUMPS",
    "JumpRule",
    "RuleInputs",
    "local_detector_not_local",
    "render_rules",
]

KUBE_SERVICES: Final = "KUBE-SERVICES"
KUBE_POSTROUTING: Final = "KUBE-POSTROUTING"
KUBE_NODE_PORT: Final = "KUBE-NODE-PORT"
KUBE_LOAD_BALANCER: Final = "KUBE-LOAD-BALANCER"
KUBE_MARK_MASQ: Final = "KUBE-MARK-MASQ"
KUBE_FORWARD: Final = "KUBE-FORWARD"
KUBE_PROXY_FIREWALL: Final = "KUBE-PROXY-FIREWALL"
KUBE_SOURCE_RANGES_FIREWALL: Final = "KUBE-SOURCE-RANGES-FIREWALL"
KUBE_IPVS_FILTER: Final = "KUBE-IPVS-FILTER"
KUBE_IPVS_OUT_FILTER: Final = "KUBE-IPVS-OUT-FILTER"

CHAINS: Final[tuple[tuple[str, str], ...]] = (
    (NAT, KUBE_SERVICES),
    (NAT, KUBE_POSTROUTING),
    (NAT, KUBE_NODE_PORT),
    (NAT, KUBE_LOAD_BALANCER),
    (NAT, KUBE_MARK_MASQ),
    (FILTER, KUBE_FORWARD),
    (FILTER, KUBE_NODE_PORT),
    (FILTER, KUBE_PROXY_FIREWALL),
    (FILTER, KUBE_SOURCE_RANGES_FIREWALL),
    (FILTER, KUBE_IPVS_FILTER),
    (FILTER, KUBE_IPVS_OUT_FILTER),
)
"""``(table, chain)`` of every chain ipvs mode owns (declared, so flushed, each restore)."""


@dataclass(frozen=True, slots=True)
class JumpRule:
    """A jump from a built-in chain into one of ours (kept with ``ensure_rule``)."""

    table: str
    chain: str
    target: str
    comment: str

    @property
    def args(self) -> list[str]:
        """The rule's arguments (after ``-A CHAIN``)."""
        return ["-m", "comment", "--comment", self.comment, "-j", self.target]


JUMPS: Final = (
    JumpRule(NAT, "OUTPUT", KUBE_SERVICES, "kubernetes service portals"),
    JumpRule(NAT, "PREROUTING", KUBE_SERVICES, "kubernetes service portals"),
    JumpRule(NAT, "POSTROUTING", KUBE_POSTROUTING, "kubernetes postrouting rules"),
    JumpRule(FILTER, "FORWARD", KUBE_FORWARD, "kubernetes forwarding rules"),
    JumpRule(FILTER, "INPUT", KUBE_NODE_PORT, "kubernetes health check rules"),
    JumpRule(FILTER, "INPUT", KUBE_PROXY_FIREWALL, "kube-proxy firewall rules"),
    JumpRule(FILTER, "FORWARD", KUBE_PROXY_FIREWALL, "kube-proxy firewall rules"),
    JumpRule(FILTER, "INPUT", KUBE_IPVS_FILTER, "kubernetes ipvs access filter"),
    JumpRule(FILTER, "OUTPUT", KUBE_IPVS_OUT_FILTER, "kubernetes ipvs access filter"),
)
"""Upstream's jumps from the built-in chains, in the order upstream ensures them."""

# (set, table, from chain, target, match direction, protocol match): upstream's
# ipsetWithIptablesChain. The LOCAL node-port sets must come before the others.
_SET_JUMPS: Final[tuple[tuple[SetName, str, str, str, str, L4Protocol | None], ...]] = (
    (SetName.LOOP_BACK, NAT, KUBE_POSTROUTING, "MASQUERADE", "dst,dst,src", None),
    (SetName.LOAD_BALANCER, NAT, KUBE_SERVICES, KUBE_LOAD_BALANCER, "dst,dst", None),
    (SetName.LOAD_BALANCER_LOCAL, NAT, KUBE_LOAD_BALANCER, "RETURN", "dst,dst", None),
    (SetName.NODE_PORT_LOCAL_TCP, NAT, KUBE_NODE_PORT, "RETURN", "dst", L4Protocol.TCP),
    (SetName.NODE_PORT_TCP, NAT, KUBE_NODE_PORT, KUBE_MARK_MASQ, "dst", L4Protocol.TCP),
    (SetName.NODE_PORT_LOCAL_UDP, NAT, KUBE_NODE_PORT, "RETURN", "dst", L4Protocol.UDP),
    (SetName.NODE_PORT_UDP, NAT, KUBE_NODE_PORT, KUBE_MARK_MASQ, "dst", L4Protocol.UDP),
    (SetName.NODE_PORT_LOCAL_SCTP, NAT, KUBE_NODE_PORT, "RETURN", "dst,dst", L4Protocol.SCTP),
    (SetName.NODE_PORT_SCTP, NAT, KUBE_NODE_PORT, KUBE_MARK_MASQ, "dst,dst", L4Protocol.SCTP),
    (
        SetName.LOAD_BALANCER_FW,
        FILTER,
        KUBE_PROXY_FIREWALL,
        KUBE_SOURCE_RANGES_FIREWALL,
        "dst,dst",
        None,
    ),
    (
        SetName.LOAD_BALANCER_SOURCE_CIDR,
        FILTER,
        KUBE_SOURCE_RANGES_FIREWALL,
        "RETURN",
        "dst,dst,src",
        None,
    ),
    (
        SetName.LOAD_BALANCER_SOURCE_IP,
        FILTER,
        KUBE_SOURCE_RANGES_FIREWALL,
        "RETURN",
        "dst,dst,src",
        None,
    ),
)

_INTERFACE = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")


@dataclass(frozen=True, slots=True)
class RuleInputs:
    """What the rules depend on.

    ``non_empty`` names the sets with members (upstream writes a set's jump only then);
    ``no_node_access`` lists ``(LB IP, protocol, port)`` of load balancers whose source
    ranges do not include the node: the node itself may not reach them.
    """

    family: IPFamily
    sets: dict[SetName, SetSpec]
    non_empty: frozenset[SetName]
    masquerade_mark: int
    masquerade_all: bool = False
    local_detector: LocalDetector = field(default_factory=LocalDetector)
    no_node_access: tuple[tuple[IPAddress, L4Protocol, int], ...] = ()


def local_detector_not_local(detector: LocalDetector, family: IPFamily) -> str:
    """The match for "not from a local pod" (empty when the detector cannot tell)."""
    found = detector.local_traffic(family, _INTERFACE, "+")
    if found is None:
        return ""
    return f"! {'-i' if found.by_interface else '-s'} {found.value}"


def render_rules(inputs: RuleInputs) -> RestoreInput:
    """The restore input for our eleven chains (each declared, so rewritten whole)."""
    out = RestoreInput()
    for table, chain in CHAINS:
        out.declare(table, chain)
    sets = inputs.sets
    mark = f"0x{inputs.masquerade_mark:x}/0x{inputs.masquerade_mark:x}"

    def set_match(key: SetName, direction: str) -> str:
        return f"-m set --match-set {sets[key].name} {direction}"

    def commented(key: SetName) -> str:
        return comment(sets[key].comment)

    loopback = "127.0.0.0/8" if inputs.family is IPFamily.IPV4 else "::1/128"
    out.append(NAT, KUBE_SERVICES, f"-s {loopback} -j RETURN")

    for key, table, source, target, direction, proto in _SET_JUMPS:
        if key not in inputs.non_empty:
            continue
        match = f"-p {proto.lower} " if proto is not None else ""
        out.append(
            table, source, f"{match}{commented(key)} {set_match(key, direction)} -j {target}"
        )

    if SetName.CLUSTER_IP in inputs.non_empty:
        key = SetName.CLUSTER_IP
        not_local = local_detector_not_local(inputs.local_detector, inputs.family)
        if inputs.masquerade_all:
            match = f"{set_match(key, 'dst,dst')} -j"
        elif not_local:
            match = f"{set_match(key, 'dst,dst')} {not_local} -j"
        else:
            # Without a detector, masquerade node traffic whose source is a service IP
            # (the kernel picks a kube-ipvs0 address as the source to reach a VIP).
            match = f"{set_match(key, 'src,dst')} -j"
        out.append(NAT, KUBE_SERVICES, f"{commented(key)} {match} {KUBE_MARK_MASQ}")

    def external_ip_rules(head: str) -> None:
        # Off-machine traffic (not bridged, not from a local process), and traffic to
        # external IPs the node happens to own, is accepted for IPVS.
        out.append(
            NAT,
            KUBE_SERVICES,
            f"{head} -m physdev ! --physdev-is-in -m addrtype ! --src-type LOCAL -j ACCEPT",
        )
        out.append(NAT, KUBE_SERVICES, f"{head} -m addrtype --dst-type LOCAL -j ACCEPT")

    if SetName.EXTERNAL_IP in inputs.non_empty:
        head = f"{commented(SetName.EXTERNAL_IP)} {set_match(SetName.EXTERNAL_IP, 'dst,dst')}"
        out.append(NAT, KUBE_SERVICES, f"{head} -j {KUBE_MARK_MASQ}")
        external_ip_rules(head)
    if SetName.EXTERNAL_IP_LOCAL in inputs.non_empty:
        key = SetName.EXTERNAL_IP_LOCAL
        external_ip_rules(f"{commented(key)} {set_match(key, 'dst,dst')}")

    out.append(NAT, KUBE_SERVICES, f"-m addrtype --dst-type LOCAL -j {KUBE_NODE_PORT}")
    out.append(NAT, KUBE_LOAD_BALANCER, f"-j {KUBE_MARK_MASQ}")
    out.append(FILTER, KUBE_SOURCE_RANGES_FIREWALL, "-j DROP")
    for address, proto, port in inputs.no_node_access:
        out.append(
            FILTER,
            KUBE_IPVS_OUT_FILTER,
            f"-s {address} -m ipvs --vaddr {address} --vproto {proto.lower} --vport {port} -j DROP",
        )
    # Accept everything bound for a virtual server, whatever other rules would say.
    for key in (SetName.CLUSTER_IP, SetName.LOAD_BALANCER):
        if key in inputs.non_empty:
            direction = "dst" if sets[key].type is SetType.BITMAP_PORT else "dst,dst"
            out.append(NAT, KUBE_SERVICES, f"{set_match(key, direction)} -j ACCEPT")

    out.append(
        FILTER,
        KUBE_FORWARD,
        f"{comment('kubernetes forwarding rules')} -m mark --mark {mark} -j ACCEPT",
    )
    out.append(
        FILTER,
        KUBE_FORWARD,
        f"{comment('kubernetes forwarding conntrack rule')} "
        "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    )
    health = SetName.HEALTH_CHECK_NODE_PORT
    out.append(FILTER, KUBE_NODE_PORT, f"{commented(health)} {set_match(health, 'dst')} -j ACCEPT")

    # Host ports must not be reachable through service addresses (kubernetes#72236).
    for key, direction in (
        (SetName.LOAD_BALANCER, "dst,dst"),
        (SetName.CLUSTER_IP, "dst,dst"),
        (SetName.EXTERNAL_IP, "dst,dst"),
        (SetName.EXTERNAL_IP_LOCAL, "dst,dst"),
        (SetName.HEALTH_CHECK_NODE_PORT, "dst"),
    ):
        out.append(FILTER, KUBE_IPVS_FILTER, f"{set_match(key, direction)} -j RETURN")
    out.append(
        FILTER,
        KUBE_IPVS_FILTER,
        f"-m conntrack --ctstate NEW {set_match(SetName.IPVS_IPS, 'dst')} -j REJECT",
    )

    out.append(NAT, KUBE_POSTROUTING, f"-m mark ! --mark {mark} -j RETURN")
    out.append(NAT, KUBE_POSTROUTING, f"-j MARK --xor-mark 0x{inputs.masquerade_mark:x}")
    out.append(
        NAT,
        KUBE_POSTROUTING,
        f"{comment('kubernetes service traffic requiring SNAT')} -j MASQUERADE --random-fully",
    )
    out.append(NAT, KUBE_MARK_MASQ, f"-j MARK --or-mark 0x{inputs.masquerade_mark:x}")
    return out


def cleanup_input(existing: dict[str, set[str]]) -> RestoreInput:
    """Flush and delete those of our chains that exist (``existing``: chains per table)."""
    out = RestoreInput()
    for table, chain in CHAINS:
        if chain in existing.get(table, set()):
            out.declare(table, chain)
            out.delete_chain(table, chain)
    return out
