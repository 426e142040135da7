"""The map structure's table: fixed chains, one generation's containers, class chains.

Everything here is a pure function of its inputs. The table holds:

* fixed chains with upstream's names, hooks and priorities (base chains, ``services``,
  ``masquerading``, the filter checks ...), whose few rules read the containers of the
  current *generation*;
* per generation (names ending in ``.g<N>``): the endpoint-slot maps, the no-endpoint,
  firewall, hairpin and affinity-record sets, and one set plus one chain per frontend
  *class* and per endpoint *pick*;
* outside generations: ``cluster-ips`` and ``nodeport-ips`` (other components read them by
  name), the dynamic ``affinity`` map (packets fill it), and, for IPv6 session affinity
  only, content-named per-port chains and maps of the per-Service-chain structure.

A full sync builds a new generation beside the current one, then switches the fixed
chains to it in one transaction (see :mod:`~kubeproxy.backends.nftables.backend`); an
incremental sync adds or deletes data elements of the current generation only, except
when a class or pick appears for the first time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from kubeproxy.backends.nftables.elements import supports
from kubeproxy.backends.nftables.frontends import (
    KIND_IP,
    KIND_NODEPORT,
    SHAPE_INTERNAL,
    SHAPE_LOCAL,
    ClassSpec,
)
from kubeproxy.backends.nftables.services import RenderContext
from kubeproxy.backends.nftables.structure import (
    AFFINITY_SIZE,
    AFFINITY_TIMEOUT,
    ContainerSpec,
    FamilyTokens,
    FixedChain,
    Names,
    base_chains,
)
from kubeproxy.objects import IPFamily

__all__ = [
    "AFFINITY_PROTOCOLS",
    "CLASS_NAME",
    "FIXED_CHAINS",
    "GenNames",
    "Pick",
    "class_chain",
    "class_rule",
    "element_types",
    "fixed_chains",
    "generation_of",
    "pick_chain",
    "picks_of",
    "public_containers",
]

AFFINITY_PROTOCOLS = ("tcp", "udp", "sctp")
SLOT_PROTOCOLS = AFFINITY_PROTOCOLS
"""The protocols a Service port may have; each has its own endpoint-slot maps."""

_GEN = re.compile(r"\.g([0-9]+)$")
CLASS_NAME = re.compile(
    r"(?:internal|external|nodeport)(?:-local)?-[0-9]+(?:-[0-9]+)?(?:-affinity)?\.g([0-9]+)"
)
"""What :meth:`GenNames.cls` names a class set and chain (group 1: the generation)."""
_L4 = "meta l4proto { tcp, udp, sctp }"


def generation_of(name: str) -> int | None:
    """The generation a container or chain name belongs to, or None for other names."""
    found = _GEN.search(name)
    return int(found.group(1)) if found else None


@dataclass(frozen=True, slots=True, order=True)
class Pick:
    """One way to choose an endpoint: ``count`` slots of the ``shortcut`` or main map of
    ``kind`` frontends, after the ClientIP ``affinity`` lookup when set.
    """

    kind: str
    shortcut: bool
    count: int
    affinity: bool


def picks_of(cls: ClassSpec) -> tuple[Pick, ...]:
    """The picks a class chain jumps to."""
    picks = []
    if cls.count:
        picks.append(Pick(cls.kind, False, cls.count, cls.affinity))
    if cls.shape == SHAPE_LOCAL and cls.shortcut:
        picks.append(Pick(cls.kind, True, cls.shortcut, cls.affinity))
    return tuple(picks)


class GenNames:
    """The names of one generation's containers and chains."""

    def __init__(self, gen: int) -> None:
        self.gen = gen
        suffix = f".g{gen}"
        self.suffix = suffix
        # Names are asked for per frontend (100k times in a big sync): built once each.
        self._memo: dict[tuple[object, ...], str] = {}
        self.no_endpoint_reject = f"no-endpoint-reject{suffix}"
        self.no_endpoint_drop = f"no-endpoint-drop{suffix}"
        self.no_endpoint_nodeports_reject = f"no-endpoint-nodeports-reject{suffix}"
        self.no_endpoint_nodeports_drop = f"no-endpoint-nodeports-drop{suffix}"
        self.firewall_ips = f"firewall-ips{suffix}"
        self.firewall_allow = f"firewall-allow{suffix}"
        self.hairpin = f"hairpin-endpoints{suffix}"
        self.dedicated_ips = f"dedicated-ips{suffix}"
        self.dedicated_nodeports = f"dedicated-nodeports{suffix}"

    def slots(self, kind: str, shortcut: bool, proto: str) -> str:
        """The endpoint-slot map of ``kind`` frontends of one protocol (main list, or the
        short-circuit list of Local-policy frontends)."""
        memo = ("slots", kind, shortcut, proto)
        found = self._memo.get(memo)
        if found is not None:
            return found
        head = "endpoints" if kind == KIND_IP else "nodeport-endpoints"
        if shortcut:
            head = f"shortcut-{head}"
        name = self._memo[memo] = f"{head}-{proto}{self.suffix}"
        return name

    def no_endpoint(self, kind: str, verdict: str) -> str:
        """The set of ``kind`` frontends without endpoints whose packets get ``verdict``."""
        if kind == KIND_IP:
            return self.no_endpoint_reject if verdict == "reject" else self.no_endpoint_drop
        if verdict == "reject":
            return self.no_endpoint_nodeports_reject
        return self.no_endpoint_nodeports_drop

    def cls(self, spec: ClassSpec) -> str:
        """The set and the chain of one class (a set and a chain may share a name)."""
        memo = ("cls", spec)
        found = self._memo.get(memo)
        if found is not None:
            return found
        if spec.kind == KIND_IP:
            head = "internal" if spec.shape == SHAPE_INTERNAL else "external"
        else:
            head = "nodeport"
        name = f"{head}-{spec.count}"
        if spec.shape == SHAPE_LOCAL:
            name = f"{head}-local-{spec.count}-{spec.shortcut}"
        if spec.affinity:
            name += "-affinity"
        found = self._memo[memo] = name + self.suffix
        return found

    def pick(self, pick: Pick) -> str:
        """The chain of one pick."""
        head = "pick" if pick.kind == KIND_IP else "pick-nodeport"
        if pick.shortcut:
            head += "-shortcut"
        name = f"{head}-{pick.count}"
        if pick.affinity:
            name += "-affinity"
        return name + self.suffix

    def affinity(self, kind: str, timeout: int) -> str:
        """The set of ``kind`` frontends whose choices are recorded for ``timeout`` seconds."""
        head = "affinity" if kind == KIND_IP else "affinity-nodeports"
        return f"{head}-{timeout}{self.suffix}"

    def containers(self, tokens: FamilyTokens) -> tuple[ContainerSpec, ...]:
        """The generation's fixed containers (class and affinity sets come on demand)."""
        ip = tokens.table_family
        addr = tokens.addr_type
        frontend = f"{addr} . inet_proto . inet_service"
        nodeport = "inet_proto . inet_service"
        specs = []
        for kind in (KIND_IP, KIND_NODEPORT):
            key = f"{_frontend(kind, tokens)} . numgen random mod 1"
            for shortcut in (False, True):
                for proto in SLOT_PROTOCOLS:
                    # One map per protocol: nft types the value's port by protocol, and a
                    # "th dport" value would not list back into a valid declaration.
                    specs.append(
                        ContainerSpec(
                            self.slots(kind, shortcut, proto),
                            True,
                            f"{key} : {ip} daddr . {proto} dport",
                            typeof=True,
                        )
                    )
        specs += [
            ContainerSpec(self.no_endpoint_reject, False, frontend),
            ContainerSpec(self.no_endpoint_drop, False, frontend),
            ContainerSpec(self.no_endpoint_nodeports_reject, False, nodeport),
            ContainerSpec(self.no_endpoint_nodeports_drop, False, nodeport),
            ContainerSpec(self.firewall_ips, False, frontend, comment="LoadBalancerSourceRanges"),
            ContainerSpec(
                self.firewall_allow,
                False,
                f"{ip} daddr . meta l4proto . th dport . {ip} saddr",
                flags=("interval",),
                typeof=True,
            ),
            ContainerSpec(self.hairpin, False, f"{addr} . {addr}"),
        ]
        if tokens.family is IPFamily.IPV6:
            specs.append(ContainerSpec(self.dedicated_ips, True, f"{frontend} : verdict"))
            specs.append(ContainerSpec(self.dedicated_nodeports, True, f"{nodeport} : verdict"))
        return tuple(specs)

    def class_set(self, spec: ClassSpec, tokens: FamilyTokens) -> ContainerSpec:
        """The membership set of one class."""
        return ContainerSpec(self.cls(spec), False, _key_type(spec.kind, tokens))

    def affinity_set(self, kind: str, timeout: int, tokens: FamilyTokens) -> ContainerSpec:
        """The membership set of frontends recorded for ``timeout`` seconds."""
        return ContainerSpec(self.affinity(kind, timeout), False, _key_type(kind, tokens))


def _key_type(kind: str, tokens: FamilyTokens) -> str:
    if kind == KIND_IP:
        return f"{tokens.addr_type} . inet_proto . inet_service"
    return "inet_proto . inet_service"


def _frontend(kind: str, tokens: FamilyTokens) -> str:
    if kind == KIND_IP:
        return f"{tokens.table_family} daddr . meta l4proto . th dport"
    return "meta l4proto . th dport"


_TYPEOF_TYPES = {
    "ip daddr": "ipv4_addr",
    "ip saddr": "ipv4_addr",
    "ip6 daddr": "ipv6_addr",
    "ip6 saddr": "ipv6_addr",
    "meta l4proto": "inet_proto",
    "th dport": "inet_service",
    **{f"{proto} dport": "inet_service" for proto in AFFINITY_PROTOCOLS},
}


def element_types(
    spec: ContainerSpec, tokens: FamilyTokens
) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The data types of a container's key and value parts, if its elements can be sent
    as a netlink batch (see :mod:`~kubeproxy.backends.nftables.elements`): not for
    interval sets, timeouts or verdict maps."""
    if "interval" in spec.flags or spec.timeout is not None or "timeout" in spec.flags:
        return None
    key, _, value = spec.type.partition(" : ")

    def parts(text: str) -> tuple[str, ...] | None:
        if not text:
            return ()
        out = []
        for part in text.split(" . "):
            if spec.typeof:
                datatype = "integer" if part.startswith("numgen ") else _TYPEOF_TYPES.get(part)
            else:
                datatype = part
            if datatype is None or not supports((datatype,)):
                return None
            out.append(datatype)
        return tuple(out)

    key_types, value_types = parts(key), parts(value)
    if key_types is None or value_types is None or (spec.is_map and not value_types):
        return None
    return key_types, value_types


def pick_chain(names: GenNames, pick: Pick, tokens: FamilyTokens) -> FixedChain:
    """A pick chain: the ClientIP lookup (if any), then a uniform choice of a slot."""
    ip = tokens.table_family
    rules = []
    if pick.affinity:
        rules.append(
            f"{_L4} dnat to {ip} saddr . {ip} daddr . meta l4proto . th dport map @{Names.AFFINITY}"
        )
    for proto in SLOT_PROTOCOLS:
        # nft adds the "meta l4proto <proto>" match the map's value type implies.
        rules.append(
            f"dnat to {_frontend(pick.kind, tokens)} . numgen random mod {pick.count} "
            f"map @{names.slots(pick.kind, pick.shortcut, proto)}"
        )
    return FixedChain(names.pick(pick), tuple(rules))


def class_chain(names: GenNames, spec: ClassSpec, ctx: RenderContext) -> FixedChain:
    """What a class does before its pick: masquerading and the Local short-circuits."""
    masq = f"jump {Names.MARK_FOR_MASQUERADE}"
    main = Pick(spec.kind, False, spec.count, spec.affinity)
    rules: list[str] = []
    if spec.shape == SHAPE_INTERNAL:
        if ctx.masquerade_match is not None:
            rules.append(f"{ctx.masquerade_match} {masq}".strip())
        rules.append(f"goto {names.pick(main)}")
    elif spec.shape == SHAPE_LOCAL:
        if spec.shortcut:
            short = names.pick(Pick(spec.kind, True, spec.shortcut, spec.affinity))
            if ctx.local_match is not None:
                rules.append(f"{ctx.local_match} goto {short}")
            rules.append(f"fib saddr type local {masq}")
            rules.append(f"fib saddr type local goto {short}")
        if spec.count:
            rules.append(f"goto {names.pick(main)}")
    else:
        rules.append(masq)
        rules.append(f"goto {names.pick(main)}")
    return FixedChain(names.cls(spec), tuple(rules))


def class_rule(names: GenNames, spec: ClassSpec, tokens: FamilyTokens) -> str:
    """The rule that sends a class's frontends to its chain."""
    name = names.cls(spec)
    return f"{_frontend(spec.kind, tokens)} @{name} goto {name}"


def affinity_rules(
    names: GenNames, kind: str, timeout: int, tokens: FamilyTokens
) -> tuple[str, ...]:
    """Rules (run after DNAT) that record a connection's endpoint for ClientIP affinity.

    The key is the original destination (``ct original``), as the pick chains look it up
    before DNAT; nft needs the protocol before it can type ``ct original proto-dst``.
    """
    ip = tokens.table_family
    member = names.affinity(kind, timeout)
    frontend = "meta l4proto . ct original proto-dst"
    if kind == KIND_IP:
        frontend = f"ct original {ip} daddr . {frontend}"
    update = (
        f"update @{Names.AFFINITY} {{ {ip} saddr . ct original {ip} daddr . meta l4proto . "
        f"ct original proto-dst timeout {timeout}s : {ip} daddr . th dport }}"
    )
    return tuple(
        f"meta l4proto {proto} {frontend} @{member} {update}" for proto in AFFINITY_PROTOCOLS
    )


FIXED_CHAINS = (
    Names.FILTER_PREROUTING_PRE_DNAT,
    Names.FILTER_OUTPUT_PRE_DNAT,
    Names.FILTER_INPUT,
    Names.FILTER_FORWARD,
    Names.FILTER_OUTPUT,
    Names.NAT_PREROUTING,
    Names.NAT_OUTPUT,
    Names.NAT_POSTROUTING,
    Names.SERVICES,
    "service-frontends",
    "nodeport-frontends",
    Names.SERVICE_ENDPOINTS_CHECK,
    Names.NODEPORT_ENDPOINTS_CHECK,
    Names.FIREWALL_CHECK,
    Names.CLUSTER_IPS_CHECK,
    Names.MARK_FOR_MASQUERADE,
    Names.MASQUERADING,
    "affinity-record",
)
"""Every chain that is not per generation, in creation order."""

SERVICE_FRONTENDS = "service-frontends"
NODEPORT_FRONTENDS = "nodeport-frontends"
AFFINITY_RECORD = "affinity-record"


def public_containers(tokens: FamilyTokens) -> tuple[ContainerSpec, ...]:
    """The containers outside generations: read by other components, or by packets."""
    addr = tokens.addr_type
    specs = [
        ContainerSpec(Names.CLUSTER_IPS, False, addr, comment="Active ClusterIPs"),
        ContainerSpec(Names.NODEPORT_IPS, False, addr, comment="IPs that accept NodePort traffic"),
    ]
    if tokens.family is IPFamily.IPV4:
        specs.append(
            ContainerSpec(
                Names.AFFINITY,
                True,
                f"{addr} . {addr} . inet_proto . inet_service : {addr} . inet_service",
                flags=("dynamic", "timeout"),
                timeout=AFFINITY_TIMEOUT,
                size=AFFINITY_SIZE,
                comment="session affinity: client . service . proto . port : endpoint",
            )
        )
    return tuple(specs)


def fixed_chains(
    names: GenNames,
    tokens: FamilyTokens,
    *,
    masquerade_mark: int,
    match_all_nodeports: bool,
    service_cidrs: Iterable[str],
    classes: Iterable[ClassSpec],
    affinity: Iterable[tuple[str, int]],
) -> tuple[FixedChain, ...]:
    """The chains outside generations, with rules reading generation ``names``.

    ``classes`` are the classes whose rules the frontend chains hold (in order);
    ``affinity`` the ``(kind, timeout)`` pairs whose record rules exist.
    """
    ip = tokens.table_family
    mark = f"{masquerade_mark:#x}"
    lookup = f"{ip} daddr . meta l4proto . th dport"
    if match_all_nodeports:
        guard = f"fib daddr type local {ip} daddr != {tokens.loopback}"
        np_guard = f"{ip} daddr != {tokens.loopback}"
    else:
        guard = np_guard = f"{ip} daddr @{Names.NODEPORT_IPS}"
    ipv6 = tokens.family is IPFamily.IPV6

    record = () if ipv6 else (f"ct state new ct status dnat jump {AFFINITY_RECORD}",)
    services: list[str] = []
    nodeports: list[str] = []
    if ipv6:
        services.append(f"{lookup} vmap @{names.dedicated_ips}")
        nodeports.append(f"meta l4proto . th dport vmap @{names.dedicated_nodeports}")
    services.append(f"jump {SERVICE_FRONTENDS}")
    services.append(f"{guard} jump {NODEPORT_FRONTENDS}")
    ip_classes: list[str] = []
    for spec in classes:
        target = ip_classes if spec.kind == KIND_IP else nodeports
        target.append(class_rule(names, spec, tokens))
    record_rules: list[str] = []
    for kind, timeout in affinity:
        record_rules.extend(affinity_rules(names, kind, timeout, tokens))
    cidrs = list(service_cidrs)
    return (
        *base_chains(record),
        FixedChain(Names.SERVICES, tuple(services)),
        FixedChain(SERVICE_FRONTENDS, tuple(ip_classes)),
        FixedChain(NODEPORT_FRONTENDS, tuple(nodeports)),
        FixedChain(
            Names.SERVICE_ENDPOINTS_CHECK,
            (
                f"{lookup} @{names.no_endpoint_reject} reject",
                f"{lookup} @{names.no_endpoint_drop} drop",
            ),
        ),
        FixedChain(
            Names.NODEPORT_ENDPOINTS_CHECK,
            (
                f"{np_guard} meta l4proto . th dport @{names.no_endpoint_nodeports_reject} reject",
                f"{np_guard} meta l4proto . th dport @{names.no_endpoint_nodeports_drop} drop",
            ),
        ),
        FixedChain(
            Names.FIREWALL_CHECK,
            (
                f"{lookup} . {ip} saddr @{names.firewall_allow} return",
                f"{lookup} @{names.firewall_ips} drop",
            ),
        ),
        FixedChain(
            Names.CLUSTER_IPS_CHECK,
            (
                f"{ip} daddr @{Names.CLUSTER_IPS} reject",
                *(f"{ip} daddr {cidr} drop" for cidr in cidrs),
            ),
        ),
        FixedChain(Names.MARK_FOR_MASQUERADE, (f"meta mark set meta mark or {mark}",)),
        FixedChain(
            Names.MASQUERADING,
            (
                f"ct status dnat {ip} saddr . {ip} daddr @{names.hairpin} "
                f"jump {Names.MARK_FOR_MASQUERADE}",
                f"meta mark & {mark} == 0 return",
                f"meta mark set meta mark xor {mark}",
                "masquerade fully-random",
            ),
        ),
        FixedChain(AFFINITY_RECORD, tuple(record_rules)),
    )
