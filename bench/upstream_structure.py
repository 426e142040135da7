"""Upstream kube-proxy's nftables rule structure, as the `nft -f` input of a cold full sync.

Written from a description of what upstream's ``pkg/proxy/nftables`` writes, not from
upstream's code: the table, the base and fixed chains with their rules, the sets and maps,
and per Service port a ``service-<hash>-ns/name/proto/port`` chain dispatching with an
anonymous ``numgen random mod N vmap { ... }`` to one ``endpoint-<hash>-...`` chain per
endpoint (hairpin masquerade, then DNAT), plus the map elements. With session affinity,
every endpoint also gets its own dynamic ``affinity-<hash>-...`` set.

Operations come in the order upstream queues them on its first full sync after start:
table, the one-time add+delete of every base chain, base chains, fixed chains (add+flush,
rules), sets and maps, then per Service port its chains (add+flush, rules) and elements.
The benchmark applies the text with ``nft -f`` into a fresh namespace, as upstream's
knftables does (``nft -f -``), to compare with our own structure on the same Services.

:class:`UpstreamOptions` picks the family (``ip`` or ``ip6``: upstream's IPv6 proxier
writes the same structure into ``table ip6 kube-proxy``) and the layout of the base
chains: ``1.34`` (1.34 to 1.37: ``filter-prerouting-pre-dnat`` and
``filter-output-pre-dnat`` at ``dstnat-10``, the other filter chains at ``filter``; PR
132456) or ``1.33`` (every filter chain at ``dstnat-10`` plus ``filter-output-post-dnat``
at ``dstnat+10``, and the port in the service chains' masquerade rule). The takeover
tests and benchmark write both over a node before our proxy starts there.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.synthetic import NODE_IP, POD_CIDR, SERVICE_CIDR, SyntheticService

__all__ = [
    "LIST_EVERY_SYNC",
    "LIST_FULL_SYNC",
    "UpstreamModel",
    "UpstreamOptions",
    "endpoint_chain_base",
    "hash_and_truncate",
    "list_argv",
    "restart_ruleset",
    "service_chain_base",
    "upstream_ruleset",
    "write_upstream_ruleset",
]

TABLE = "ip kube-proxy"
_NAME_MAX = 240  # knftables.NameLengthMax (256) minus the longest chain prefix (16)

# name, type, hook, numeric priority (knftables prints priorities as numbers); 1.34+
_BASE_CHAINS = (
    ("filter-prerouting-pre-dnat", "filter", "prerouting", -110),
    ("filter-output-pre-dnat", "filter", "output", -110),
    ("filter-input", "filter", "input", 0),
    ("filter-forward", "filter", "forward", 0),
    ("filter-output", "filter", "output", 0),
    ("nat-prerouting", "nat", "prerouting", -100),
    ("nat-output", "nat", "output", -100),
    ("nat-postrouting", "nat", "postrouting", 100),
)

# Jump rules in upstream's order (nftablesJumpChains): (base chain, rule).
_JUMPS = (
    ("filter-input", "ct state new jump nodeport-endpoints-check"),
    ("filter-input", "ct state new jump service-endpoints-check"),
    ("filter-forward", "ct state new jump service-endpoints-check"),
    ("filter-output", "ct state new jump service-endpoints-check"),
    ("filter-prerouting-pre-dnat", "ct state new jump firewall-check"),
    ("filter-output-pre-dnat", "ct state new jump firewall-check"),
    ("nat-output", "jump services"),
    ("nat-prerouting", "jump services"),
    ("nat-postrouting", "jump masquerading"),
    ("filter-forward", "ct state new jump cluster-ips-check"),
    ("filter-output", "ct state new jump cluster-ips-check"),
)

# 1.33 (before PR 132456): the filter chains before DNAT, the cluster IP check after it.
_BASE_CHAINS_1_33 = (
    ("filter-prerouting", "filter", "prerouting", -110),
    ("filter-input", "filter", "input", -110),
    ("filter-forward", "filter", "forward", -110),
    ("filter-output", "filter", "output", -110),
    ("filter-output-post-dnat", "filter", "output", -90),
    ("nat-prerouting", "nat", "prerouting", -100),
    ("nat-output", "nat", "output", -100),
    ("nat-postrouting", "nat", "postrouting", 100),
)
_JUMPS_1_33 = (
    ("filter-input", "ct state new jump nodeport-endpoints-check"),
    ("filter-input", "ct state new jump service-endpoints-check"),
    ("filter-forward", "ct state new jump service-endpoints-check"),
    ("filter-output", "ct state new jump service-endpoints-check"),
    ("filter-prerouting", "ct state new jump firewall-check"),
    ("filter-output", "ct state new jump firewall-check"),
    ("nat-output", "jump services"),
    ("nat-prerouting", "jump services"),
    ("nat-postrouting", "jump masquerading"),
    ("filter-forward", "ct state new jump cluster-ips-check"),
    ("filter-output-post-dnat", "ct state new jump cluster-ips-check"),
)
LAYOUTS = ("1.33", "1.34")
"""Upstream's layouts of the base chains: ``1.33``, and ``1.34`` (1.34 to 1.37)."""

_FIXED_CHAINS = (
    "nodeport-endpoints-check",
    "service-endpoints-check",
    "firewall-check",
    "services",
    "masquerading",
    "cluster-ips-check",
    "mark-for-masquerade",
    "reject-chain",
)

# (kind, name, type with ADDR for the family's address type, comment)
_SETS = (
    ("set", "cluster-ips", "ADDR", "Active ClusterIPs"),
    ("set", "nodeport-ips", "ADDR", "IPs that accept NodePort traffic"),
    (
        "map",
        "service-ips",
        "ADDR . inet_proto . inet_service : verdict",
        "ClusterIP, ExternalIP and LoadBalancer IP traffic",
    ),
    ("map", "service-nodeports", "inet_proto . inet_service : verdict", "NodePort traffic"),
    (
        "map",
        "firewall-ips",
        "ADDR . inet_proto . inet_service : verdict",
        "destinations that are subject to LoadBalancerSourceRanges",
    ),
    (
        "map",
        "no-endpoint-services",
        "ADDR . inet_proto . inet_service : verdict",
        "vmap to drop or reject packets to services with no endpoints",
    ),
    (
        "map",
        "no-endpoint-nodeports",
        "inet_proto . inet_service : verdict",
        "vmap to drop or reject packets to service nodeports with no endpoints",
    ),
)


@dataclass(frozen=True, slots=True)
class UpstreamOptions:
    """The proxier settings that shape upstream's ruleset.

    ``cluster_cidr`` is the ClusterCIDR local-traffic detector (None: no detector);
    ``node_ips`` fill ``nodeport-ips`` (upstream's default ``primary``: the node's IP).
    ``family`` is ``ip`` or ``ip6`` (give the addresses of that family), ``layout`` one of
    :data:`LAYOUTS`.
    """

    masquerade_mark: int = 0x4000
    masquerade_all: bool = False
    cluster_cidr: ipaddress.IPv4Network | ipaddress.IPv6Network | None = POD_CIDR
    service_cidrs: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = (SERVICE_CIDR,)
    node_ips: tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...] = (NODE_IP,)
    family: str = "ip"
    layout: str = "1.34"

    def __post_init__(self) -> None:
        if self.family not in ("ip", "ip6"):
            raise ValueError(f"family must be ip or ip6, not {self.family!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, not {self.layout!r}")

    @property
    def table(self) -> str:
        """``ip kube-proxy`` or ``ip6 kube-proxy``."""
        return f"{self.family} kube-proxy"

    @property
    def address_type(self) -> str:
        """``ipv4_addr`` or ``ipv6_addr``."""
        return "ipv4_addr" if self.family == "ip" else "ipv6_addr"

    @property
    def base_chains(self) -> tuple[tuple[str, str, str, int], ...]:
        """The layout's base chains: (name, type, hook, priority)."""
        return _BASE_CHAINS_1_33 if self.layout == "1.33" else _BASE_CHAINS

    @property
    def jumps(self) -> tuple[tuple[str, str], ...]:
        """The layout's jump rules from the base chains: (chain, rule)."""
        return _JUMPS_1_33 if self.layout == "1.33" else _JUMPS


def hash_and_truncate(name: str) -> str:
    """``base32(sha256(name))[:8] + "-" + name``, cut to 240 characters with ``...``."""
    digest = base64.b32encode(hashlib.sha256(name.encode()).digest()).decode()[:8]
    base = f"{digest}-{name}"
    if len(base) > _NAME_MAX:
        base = base[: _NAME_MAX - 3] + "..."
    return base


def service_chain_base(service: SyntheticService) -> str:
    """The hashed base name of a Service port's chains (``service-<base>`` and friends)."""
    return hash_and_truncate(service.port_identity)


def endpoint_chain_base(
    service: SyntheticService, endpoint: ipaddress.IPv4Address | ipaddress.IPv6Address
) -> str:
    """The hashed base name of an endpoint's chain and affinity set (an IPv6 address with
    its colons made dots, as upstream's)."""
    host = str(endpoint).replace(":", ".")
    return hash_and_truncate(f"{service.port_identity}__{host}/{service.target_port}")


def _mark(options: UpstreamOptions) -> str:
    return f"{options.masquerade_mark:#08x}"


def _preamble(options: UpstreamOptions) -> Iterator[str]:
    table, ip = options.table, options.family
    yield f'add table {table} {{ comment "rules for kube-proxy" ; }}'
    # First sync after start: upstream adds and deletes every base chain once, so that a
    # chain left by an older version with another priority is recreated.
    for name, _type, _hook, _prio in options.base_chains:
        yield f"add chain {table} {name}"
        yield f"delete chain {table} {name}"
    for name, chain_type, hook, priority in options.base_chains:
        yield (
            f"add chain {table} {name} {{ type {chain_type} hook {hook} priority {priority} ; }}"
        )
        yield f"flush chain {table} {name}"
    for name in _FIXED_CHAINS:
        if name == "reject-chain":
            yield (
                f"add chain {table} {name} "
                '{ comment "helper for @no-endpoint-services / @no-endpoint-nodeports" ; }'
            )
        else:
            yield f"add chain {table} {name}"
        yield f"flush chain {table} {name}"
    for kind, name, key_type, comment in _SETS:
        key_type = key_type.replace("ADDR", options.address_type)
        yield f'add {kind} {table} {name} {{ type {key_type} ; comment "{comment}" ; }}'
    yield f"flush set {table} nodeport-ips"
    for node_ip in options.node_ips:
        yield f"add element {table} nodeport-ips {{ {node_ip} }}"
    for chain, rule in options.jumps:
        yield f"add rule {table} {chain} {rule}"
    mark = _mark(options)
    fixed_rules = (
        ("services", f"{ip} daddr . meta l4proto . th dport vmap @service-ips"),
        (
            "services",
            f"{ip} daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports",
        ),
        (
            "service-endpoints-check",
            f"{ip} daddr . meta l4proto . th dport vmap @no-endpoint-services",
        ),
        (
            "nodeport-endpoints-check",
            f"{ip} daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports",
        ),
        ("firewall-check", f"{ip} daddr . meta l4proto . th dport vmap @firewall-ips"),
        (
            "cluster-ips-check",
            f"{ip} daddr @cluster-ips reject "
            'comment "Reject traffic to invalid ports of ClusterIPs"',
        ),
        ("reject-chain", "reject"),
        ("mark-for-masquerade", f"mark set mark or {mark}"),
        ("masquerading", f"mark and {mark} == 0 return"),
        ("masquerading", f"mark set mark xor {mark}"),
        ("masquerading", "masquerade fully-random"),
    )
    for chain, rule in fixed_rules:
        yield f"add rule {table} {chain} {rule}"
    if options.service_cidrs:
        cidrs = ",".join(str(c) for c in options.service_cidrs)
        yield (
            f"add rule {table} cluster-ips-check {ip} daddr {{ {cidrs} }} drop "
            'comment "Drop traffic to unallocated ClusterIPs"'
        )


def _service(
    service: SyntheticService,
    options: UpstreamOptions,
    *,
    endpoint_chains: bool = True,
    elements: bool = True,
) -> Iterator[str]:
    """A Service port's operations; without ``endpoint_chains`` only its service chain
    (upstream's first sync after a restart keeps existing endpoint chains), without
    ``elements`` no map or set elements (already present: ``ensureElem`` queues nothing)."""
    table, ip = options.table, options.family
    base = service_chain_base(service)
    chain = f"service-{base}"
    # The EndpointsMap order: endpoints sorted by their "IP:port" string.
    endpoints = sorted(service.endpoints, key=lambda ep: _host_port(ep, service.target_port))
    ep_bases = [endpoint_chain_base(service, ep) for ep in endpoints]
    proto = service.protocol.lower()
    if endpoints and not endpoint_chains:
        yield f"add chain {table} {chain}"
        yield f"flush chain {table} {chain}"
        yield from _service_rules(service, chain, ep_bases, options)
    elif endpoints:
        # Every chain and set of the port exists before a rule refers to it.
        for name in (chain, *(f"endpoint-{b}" for b in ep_bases)):
            yield f"add chain {table} {name}"
            yield f"flush chain {table} {name}"
        if service.affinity_seconds:
            for ep_base in ep_bases:
                yield (
                    f"add set {table} affinity-{ep_base} {{ type {options.address_type} ; "
                    f"flags dynamic,timeout ; timeout {service.affinity_seconds}s ; }}"
                )
        yield from _service_rules(service, chain, ep_bases, options)
        for endpoint, ep_base in zip(endpoints, ep_bases, strict=True):
            ep_chain = f"endpoint-{ep_base}"
            yield f"add rule {table} {ep_chain} {ip} saddr {endpoint} jump mark-for-masquerade"
            if service.affinity_seconds:
                yield f"add rule {table} {ep_chain} update @affinity-{ep_base} {{ {ip} saddr }}"
            yield (
                f"add rule {table} {ep_chain} "
                f"meta l4proto {proto} dnat to {_host_port(endpoint, service.target_port)}"
            )
    if not elements:
        return
    yield f"add element {table} cluster-ips {{ {service.cluster_ip} }}"
    key = f"{service.cluster_ip} . {proto} . {service.port}"
    if endpoints:
        yield f"add element {table} service-ips {{ {key} : goto {chain} }}"
    else:
        yield (
            f'add element {table} no-endpoint-services {{ {key} comment "{service.port_label}" '
            ": goto reject-chain }"
        )


def _host_port(address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    """``IP:port``, ``[IPv6]:port``: an endpoint's string (its sort key, its DNAT target)."""
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


def _service_rules(
    service: SyntheticService, chain: str, ep_bases: Sequence[str], options: UpstreamOptions
) -> Iterator[str]:
    ip = options.family
    prefix = f"add rule {options.table} {chain}"
    # 1.33's masquerade rule also matched the Service's port (dropped in 1.34).
    port = f" {service.protocol.lower()} dport {service.port}" if options.layout == "1.33" else ""
    if options.masquerade_all:
        yield f"{prefix} {ip} daddr {service.cluster_ip}{port} jump mark-for-masquerade"
    elif options.cluster_cidr is not None:
        yield (
            f"{prefix} {ip} daddr {service.cluster_ip}{port} "
            f"{ip} saddr != {options.cluster_cidr} jump mark-for-masquerade"
        )
    if service.affinity_seconds:
        for ep_base in ep_bases:
            yield f"{prefix} {ip} saddr @affinity-{ep_base} goto endpoint-{ep_base}"
    entries = " , ".join(f"{k} : goto endpoint-{b}" for k, b in enumerate(ep_bases))
    yield f"{prefix} numgen random mod {len(ep_bases)} vmap {{ {entries} }}"


def upstream_ruleset(
    services: Iterable[SyntheticService], options: UpstreamOptions | None = None
) -> Iterator[str]:
    """The lines of upstream's cold full-sync transaction for ``services`` (no newlines)."""
    opts = options or UpstreamOptions()
    yield from _preamble(opts)
    for service in services:
        yield from _service(service, opts)


def write_upstream_ruleset(
    path: Path, services: Sequence[SyntheticService], options: UpstreamOptions | None = None
) -> int:
    """Write the ruleset to ``path`` for ``nft -f``; returns the number of lines."""
    count = 0
    with path.open("w") as out:
        for line in upstream_ruleset(services, options):
            out.write(line)
            out.write("\n")
            count += 1
    return count


# Restart and incremental syncs ---------------------------------------------------------

LIST_EVERY_SYNC = (("chains",), ("sets",))
"""What upstream lists before every sync's transaction (``knftables.List``): the existing
chains (to find stale ones) and sets (stale affinity sets)."""
LIST_FULL_SYNC = (
    ("set", "cluster-ips"),
    ("map", "service-ips"),
    ("map", "service-nodeports"),
    ("map", "firewall-ips"),
    ("map", "no-endpoint-services"),
    ("map", "no-endpoint-nodeports"),
)
"""What a full sync lists too: the elements of the six element containers it does not
flush (``readOrReset`` / ``ListElements``)."""
STALE_CHAIN_AGE_S = 1.0


def list_argv(what: Sequence[str]) -> list[str]:
    """The ``nft`` command line of one knftables listing (``--json``).

    ``("chains",)`` and ``("sets",)`` list the whole family, as knftables does (nft takes
    no table there) and keeps its table's entries.
    """
    if len(what) == 1:
        return ["nft", "--json", "list", what[0], TABLE.split()[0]]
    kind, name = what
    return ["nft", "--json", "list", kind, *TABLE.split(), name]


def restart_ruleset(
    services: Iterable[SyntheticService], options: UpstreamOptions | None = None
) -> Iterator[str]:
    """Upstream's first full sync after a restart over the table it left behind.

    The preamble as on any first sync, and every service chain rewritten; endpoint chains
    that already exist are skipped (``epChainSkipUpdate``) and elements already present
    queue nothing, so neither appears.
    """
    opts = options or UpstreamOptions()
    yield from _preamble(opts)
    for service in services:
        yield from _service(service, opts, endpoint_chains=False, elements=False)


class UpstreamModel:
    """Upstream's partial syncs on the table of ``services``, as ``nft -f`` inputs.

    Each change returns the main transaction of the sync that follows it; chains that
    the change left unused are flushed there and remembered, and
    :meth:`stale_deletion` deletes those older than a second in the separate, earlier
    transaction upstream runs at the start of a sync.
    """

    def __init__(
        self, services: Sequence[SyntheticService], options: UpstreamOptions | None = None
    ) -> None:
        self.options = options or UpstreamOptions()
        self.services = {s.index: s for s in services}
        self._order = [s.index for s in services]
        self._stale: dict[str, float] = {}
        self._turn = 0
        self._added = 0
        self._removed = 0

    def _chains(self, service: SyntheticService) -> list[str]:
        return [
            f"service-{service_chain_base(service)}",
            *(f"endpoint-{endpoint_chain_base(service, ip)}" for ip in service.endpoints),
        ]

    def _retire(self, chains: Iterable[str], now: float) -> Iterator[str]:
        for chain in chains:
            self._stale[chain] = now
            yield f"flush chain {TABLE} {chain}"

    def stale_deletion(self, now: float) -> list[str]:
        """The stale-chain deletion transaction due at ``now`` (empty: none due)."""
        due = [c for c, since in self._stale.items() if now - since >= STALE_CHAIN_AGE_S]
        for chain in due:
            del self._stale[chain]
        return [f"delete chain {TABLE} {chain}" for chain in due]

    def restale(self, deletions: Sequence[str], now: float) -> None:
        """Keep the chains of a failed :meth:`stale_deletion` stale, for a later attempt."""
        prefix = f"delete chain {TABLE} "
        for line in deletions:
            self._stale[line.removeprefix(prefix)] = now

    def change_endpoint(self, now: float, spare_offset: int = 14) -> list[str]:
        """Replace the last endpoint of the next Service; the Service is rewritten whole."""
        index = self._order[self._turn % len(self._order)]
        self._turn += 1
        service = self.services[index]
        first = service.endpoints[0]
        spare = first + spare_offset
        original_last = first + (len(service.endpoints) - 1)
        last = original_last if service.endpoints[-1] == spare else spare
        changed = service.with_endpoints((*service.endpoints[:-1], last))
        self.services[index] = changed
        lines = list(_service(changed, self.options, elements=False))
        gone = set(self._chains(service)) - set(self._chains(changed))
        lines += self._retire(sorted(gone), now)
        return lines

    def add_service(self, service: SyntheticService) -> list[str]:
        """Add ``service``: its chains, rules and elements."""
        self._added += 1
        self.services[service.index] = service
        return list(_service(service, self.options))

    def remove_service(self, now: float) -> list[str]:
        """Delete one of the original Services (from the end): elements out, chains stale."""
        self._removed += 1
        index = self._order[-self._removed]
        service = self.services.pop(index)
        proto = service.protocol.lower()
        key = f"{service.cluster_ip} . {proto} . {service.port}"
        lines = [
            f"delete element {TABLE} cluster-ips {{ {service.cluster_ip} }}",
            f"delete element {TABLE} service-ips {{ {key} }}",
        ]
        lines += self._retire(self._chains(service), now)
        return lines
