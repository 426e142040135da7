"""The per-Service-chain structure: the chains and map elements of one Service port.

The previous default structure (:class:`~bench.chain_structure.backend.ChainNftablesBackend`),
kept for side-by-side benchmarks. Behaviour follows upstream kube-proxy's nftables mode;
the structure does not: no endpoint chains, no per-service anonymous sets, one shared
affinity map, endpoint choice by a cascade of plain ``numgen`` rules (two levels above
:data:`CASCADE_MAX` endpoints). The render context, keys and chain names are the map
structure's too (:mod:`kubeproxy.backends.nftables.table`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from bench.chain_structure.naming import ChainPrefix
from kubeproxy.backends.nftables.table import (
    MAX_AFFINITY_SECONDS,
    ChainSpec,
    InvalidPort,
    Key,
    Names,
    RenderContext,
    affinity_map_name,
    chain_name,
    port_identity,
)
from kubeproxy.objects import (
    CategorizedEndpoints,
    Endpoint,
    IPAddress,
    IPFamily,
    ServicePort,
)

__all__ = [
    "CASCADE_MAX",
    "PortRules",
    "render_port",
]

CASCADE_MAX = 16
"""Most endpoints chosen by one flat cascade; more are split into ``group-`` chains."""

_MASQ_JUMP = f"jump {Names.MARK_FOR_MASQUERADE}"
_REJECT = f"goto {Names.REJECT_CHAIN}"
_DROP = "drop"


@dataclass(frozen=True, slots=True)
class PortRules:
    """Everything one Service port puts into the table.

    ``chains`` are in creation order (a chain comes after every chain it jumps to).
    ``elements`` are map elements ``(map, key, value)`` whose keys this port owns (the
    value is a one-part tuple such as ``("goto service-...",)``);
    ``set_elements`` are set elements ``(set, key)`` that ports may share (``cluster-ips``
    for the ports of one Service, ``hairpin-endpoints`` for endpoints in several Services).
    ``claims`` are the keys no other port may also use (service IP . proto . port, and
    proto . NodePort). ``affinity_maps`` are the per-port IPv6 affinity maps the chains use
    (``client : endpoint`` maps, see
    :data:`~kubeproxy.backends.nftables.table.AFFINITY6_MAP_TYPE`), each with the endpoint
    addresses its entries may hold.
    """

    chains: tuple[ChainSpec, ...]
    elements: tuple[tuple[str, Key, tuple[str, ...]], ...]
    set_elements: tuple[tuple[str, Key], ...]
    claims: frozenset[Key]
    affinity_maps: tuple[tuple[str, frozenset[str]], ...] = ()


def _check_port(what: str, value: int, *, zero_ok: bool = False) -> None:
    low = 0 if zero_ok else 1
    if not low <= value <= 65535:
        raise InvalidPort(f"{what} {value} is out of range")


def _check_family(ctx: RenderContext, what: str, ip: IPAddress) -> None:
    if ip.version != ctx.tokens.family.version:
        raise InvalidPort(f"{what} {ip} is not {ctx.tokens.family}")


class _Renderer:
    """Renders one port; a class only to share the per-port words between helpers."""

    __slots__ = (
        "affinity_update",
        "chains",
        "ctx",
        "identity",
        "ip",
        "ipv6",
        "maps",
        "port",
        "proto",
    )

    def __init__(self, ctx: RenderContext, port: ServicePort, identity: str) -> None:
        self.ctx = ctx
        self.port = port
        self.identity = identity
        self.ip = ctx.tokens.table_family
        self.ipv6 = ctx.tokens.family is IPFamily.IPV6
        self.proto = port.protocol.lower
        self.chains: list[ChainSpec] = []
        self.maps: dict[str, set[str]] = {}
        self.affinity_update = ""
        if port.session_affinity and not self.ipv6:
            ip = self.ip
            self.affinity_update = (
                f"update @{Names.AFFINITY} {{ {ip} saddr . {ip} daddr . meta l4proto . th dport "
                f"timeout {port.session_affinity_seconds}s : "
            )

    def _add(self, prefix: str, rules: list[str], group: int | None = None) -> str:
        name = chain_name(prefix, self.identity, rules, group)
        self.chains.append(ChainSpec(name, tuple(rules)))
        return name

    def _endpoint_rules(self, prefix: str, endpoints: Sequence[Endpoint]) -> list[str]:
        proto = self.proto
        update = self.affinity_update
        rules = []
        for ep in endpoints:
            # Endpoint.key is "IP:port" ("[IP]:port" for IPv6), which is exactly what
            # "dnat to" takes; str(IPAddress) is slow enough to show at 100k endpoints.
            target = ep.key
            if update:
                host, _, port = target.rpartition(":")
                rules.append(f"{update}{host} . {port} }} meta l4proto {proto} dnat to {target}")
            elif self.port.session_affinity:
                host = target.rpartition(":")[0][1:-1]
                name = affinity_map_name(self.identity, prefix, ep.port)
                self.maps.setdefault(name, set()).add(host)
                rules.append(
                    f"update @{name} {{ ip6 saddr timeout {self.port.session_affinity_seconds}s"
                    f" : {host} }} meta l4proto {proto} dnat to {target}"
                )
            else:
                rules.append(f"meta l4proto {proto} dnat to {target}")
        return rules

    def _affinity_lookups(self, prefix: str, endpoints: Sequence[Endpoint]) -> list[str]:
        if not self.port.session_affinity:
            return []
        if not self.ipv6:
            # One shared lookup rule: every rule that reads a map from a different chain
            # costs the kernel a walk of all the map's users when it is added.
            return [f"jump {Names.AFFINITY_LOOKUP}"]
        # nft 1.0.6 cannot update an IPv6 map whose key and value exceed 32 bytes (it
        # aborts), so IPv6 keeps one "client : endpoint" map per dispatch chain and
        # endpoint port, as upstream keeps affinity per client and Service port.
        ports = sorted({ep.port for ep in endpoints})
        return [
            f"meta l4proto {self.proto} dnat to ip6 saddr map "
            f"@{affinity_map_name(self.identity, prefix, port)} : {port}"
            for port in ports
        ]

    @staticmethod
    def _cascade(choices: list[str]) -> list[str]:
        # Rule k matches with probability 1/(N-k) among what is left: uniform overall,
        # like iptables' statistic cascade.
        count = len(choices)
        rules = [f"numgen random mod {count - k} 0 {choice}" for k, choice in enumerate(choices)]
        rules[-1] = choices[-1]
        return rules

    def dispatch(self, prefix: str, endpoints: Sequence[Endpoint], masquerade: bool) -> str:
        """A ``service-`` or ``local-`` chain (and its group chains); returns its name."""
        ip = self.ip
        rules: list[str] = []
        masq = self.ctx.masquerade_match
        if masquerade and masq is not None:
            cip = self.port.cluster_ip
            cond = f"{ip} daddr {cip} {masq} " if masq else f"{ip} daddr {cip} "
            rules.append(cond + _MASQ_JUMP)
        ordered = sorted(endpoints, key=_endpoint_key)
        rules.extend(self._affinity_lookups(prefix, ordered))
        choices = self._endpoint_rules(prefix, ordered)
        if len(choices) <= CASCADE_MAX:
            rules.extend(self._cascade(choices))
        else:
            rules.extend(self._groups(prefix, choices))
        return self._add(prefix, rules)

    def _groups(self, prefix: str, choices: list[str]) -> list[str]:
        count = len(choices)
        groups = math.isqrt(count - 1) + 1  # ceil(sqrt(count))
        base, extra = divmod(count, groups)
        # Service and local dispatch of one port may both have groups; keep them apart.
        offset = 0 if prefix == ChainPrefix.SERVICE else groups
        rules: list[str] = []
        remaining = count
        start = 0
        for g in range(groups):
            size = base + (1 if g < extra else 0)
            group = self._add(
                ChainPrefix.GROUP, self._cascade(choices[start : start + size]), offset + g
            )
            start += size
            if g == groups - 1:
                rules.append(f"goto {group}")
            else:
                rules.append(f"numgen random mod {remaining} < {size} goto {group}")
            remaining -= size
        return rules


def _endpoint_key(ep: Endpoint) -> str:
    return ep.key


def render_port(ctx: RenderContext, port: ServicePort, eps: CategorizedEndpoints) -> PortRules:
    """The chains and elements of one Service port.

    ``eps`` is the core's categorisation; policy decisions are read from it and from the
    port's flags, never re-derived. Raises :class:`InvalidPort` (or its parent
    :class:`ValueError`) when the port cannot be rendered safely.
    """
    identity = port_identity(port.name)
    _check_port("port", port.port)
    _check_port("nodePort", port.node_port, zero_ok=True)
    if port.session_affinity_seconds > MAX_AFFINITY_SECONDS:
        raise InvalidPort(f"session affinity timeout {port.session_affinity_seconds}s is too long")
    _check_family(ctx, "cluster IP", port.cluster_ip)
    for service_ip in (*port.external_ips, *port.load_balancer_vips):
        _check_family(ctx, "service IP", service_ip)
    version = ctx.tokens.family.version
    # The three lists usually share endpoints (often the very same tuple): check each
    # distinct list once, inline (this runs for every endpoint of a full sync).
    groups = {id(group): group for group in (eps.cluster, eps.local, eps.all_reachable)}
    for group in groups.values():
        for ep in group:
            if ep.version != version:
                _check_family(ctx, "endpoint", ep.ip)
            if not 1 <= ep.port <= 65535:
                _check_port("endpoint port", ep.port)

    r = _Renderer(ctx, port, identity)
    ip = r.ip
    proto = r.proto
    port_text = str(port.port)
    cip = str(port.cluster_ip)

    cluster_chain = None
    local_chain = None
    if port.uses_cluster_endpoints and eps.cluster:
        cluster_chain = r.dispatch(
            ChainPrefix.SERVICE, eps.cluster, masquerade=not port.internal_policy_local
        )
    if port.uses_local_endpoints and eps.local:
        local_chain = r.dispatch(
            ChainPrefix.LOCAL, eps.local, masquerade=port.internal_policy_local
        )
    internal_chain = local_chain if port.internal_policy_local else cluster_chain
    external_chain = None
    external_target = local_chain if port.external_policy_local else cluster_chain
    no_endpoint = _DROP if eps.has_any else _REJECT

    if eps.has_any and port.externally_accessible:
        rules: list[str] = []
        if not port.external_policy_local:
            rules.append(_MASQ_JUMP)
        else:
            if ctx.local_match is not None and cluster_chain is not None:
                rules.append(f"{ctx.local_match} goto {cluster_chain}")
            rules.append(f"fib saddr type local {_MASQ_JUMP}")
            if cluster_chain is not None:
                rules.append(f"fib saddr type local goto {cluster_chain}")
        if external_target is not None:
            rules.append(f"goto {external_target}")
        external_chain = r._add(ChainPrefix.EXTERNAL, rules)

    firewall_chain = None
    if port.load_balancer_vips and port.load_balancer_source_ranges:
        rules = [f"{ip} saddr {cidr} return" for cidr in port.load_balancer_source_ranges]
        if any(a in cidr for a in ctx.node_addresses for cidr in port.load_balancer_source_ranges):
            rules.extend(f"{ip} saddr {vip} return" for vip in port.load_balancer_vips)
        rules.append(_DROP)
        firewall_chain = r._add(ChainPrefix.FIREWALL, rules)

    elements: list[tuple[str, Key, tuple[str, ...]]] = []
    seen: set[tuple[str, Key]] = set()

    def element(container: str, key: Key, value: str) -> None:
        if (container, key) not in seen:
            seen.add((container, key))
            elements.append((container, key, (value,)))

    cluster_key = (cip, proto, port_text)
    if internal_chain is not None:
        element(Names.SERVICE_IPS, cluster_key, f"goto {internal_chain}")
    else:
        element(Names.NO_ENDPOINT_SERVICES, cluster_key, no_endpoint)
    claims: set[Key] = {cluster_key}
    for ext in (*port.external_ips, *port.load_balancer_vips):
        key = (str(ext), proto, port_text)
        if key == cluster_key:
            continue
        claims.add(key)
        if external_chain is not None:
            element(Names.SERVICE_IPS, key, f"goto {external_chain}")
        if external_target is None:
            element(Names.NO_ENDPOINT_SERVICES, key, no_endpoint)
    if firewall_chain is not None:
        for vip in port.load_balancer_vips:
            element(Names.FIREWALL_IPS, (str(vip), proto, port_text), f"goto {firewall_chain}")
    if port.node_port:
        node_key = (proto, str(port.node_port))
        claims.add(node_key)
        if external_chain is not None:
            element(Names.SERVICE_NODEPORTS, node_key, f"goto {external_chain}")
        if external_target is None:
            element(Names.NO_ENDPOINT_NODEPORTS, node_key, no_endpoint)

    set_elements: list[tuple[str, Key]] = [(Names.CLUSTER_IPS, (cip,))]
    hairpin: set[str] = set()
    ipv6 = ctx.tokens.family is IPFamily.IPV6
    for ep in eps.all_reachable:
        text = ep.key.rpartition(":")[0]
        if ipv6:
            text = text[1:-1]
        if text not in hairpin:
            hairpin.add(text)
            set_elements.append((Names.HAIRPIN_ENDPOINTS, (text, text)))

    # A chain name may repeat only when two dispatch chains share a group verbatim.
    unique: dict[str, ChainSpec] = {}
    for chain in r.chains:
        unique.setdefault(chain.name, chain)
    maps = tuple((name, frozenset(hosts)) for name, hosts in sorted(r.maps.items()))
    return PortRules(
        tuple(unique.values()), tuple(elements), tuple(set_elements), frozenset(claims), maps
    )
