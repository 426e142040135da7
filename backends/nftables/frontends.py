"""What one Service port puts into the map structure's data (pure functions).

The map structure (see the package README) keeps no per-Service chain: every Service
port becomes *frontends* (its cluster IP, each external IP and load-balancer IP, its
NodePort), and each frontend becomes data elements only:

* membership of its *class* set (the class says how traffic to it is treated: which
  endpoint list, how many endpoints, masquerading, the Local-policy short-circuits,
  session affinity), read by one rule per class;
* its endpoints as numbered slots of a map read by ``numgen random mod N``;
* membership of the no-endpoint reject/drop sets, of the firewall sets, and of the
  affinity record sets.

An endpoint change therefore touches data elements only, and the kernel never
re-validates the table for it (see the package README).

Behaviour follows upstream kube-proxy's nftables mode (the same decisions as
:mod:`~kubeproxy.backends.nftables.services`, which renders the per-Service-chain
structure); this module only says *which* class and lists each frontend gets.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kubeproxy.backends.nftables.naming import port_identity
from kubeproxy.backends.nftables.services import (
    MAX_AFFINITY_SECONDS,
    ChainSpec,
    InvalidPort,
    Key,
    RenderContext,
    render_port,
)
from kubeproxy.backends.nftables.structure import Names
from kubeproxy.objects import CategorizedEndpoints, Endpoint, IPFamily, ServicePort

__all__ = [
    "DROP",
    "KIND_IP",
    "KIND_NODEPORT",
    "REJECT",
    "SHAPE_EXTERNAL",
    "SHAPE_INTERNAL",
    "SHAPE_LOCAL",
    "ClassSpec",
    "Dedicated",
    "Frontend",
    "PortPlan",
    "endpoint_value",
    "plan_port",
]

KIND_IP = "ip"
"""A frontend keyed by ``address . protocol . port`` (cluster, external, LB IPs)."""
KIND_NODEPORT = "nodeport"
"""A frontend keyed by ``protocol . port`` on the node's NodePort addresses."""

SHAPE_INTERNAL = "internal"
"""Cluster-IP traffic: the internal endpoint list, masqueraded as the detector says."""
SHAPE_EXTERNAL = "external"
"""External traffic under ``externalTrafficPolicy: Cluster``: always masqueraded."""
SHAPE_LOCAL = "local"
"""External traffic under ``externalTrafficPolicy: Local``: node-local endpoints, except
traffic from local pods and from the node itself, which uses every endpoint (the
short-circuits upstream has)."""

REJECT = "reject"
"""No endpoint anywhere: new connections are rejected."""
DROP = "drop"
"""Endpoints exist, none of them for this frontend's policy: new connections are dropped."""


@dataclass(frozen=True, slots=True, order=True)
class ClassSpec:
    """How traffic to a frontend is treated; frontends of one class share one rule.

    ``count`` endpoints are chosen from the frontend's main list (``shortcut`` from its
    short-circuit list, for :data:`SHAPE_LOCAL`); ``affinity`` adds the ClientIP lookup.
    """

    kind: str
    shape: str
    count: int
    shortcut: int = 0
    affinity: bool = False


@dataclass(frozen=True, slots=True)
class Frontend:
    """One frontend of a Service port and everything the data holds for it.

    ``endpoints`` and ``shortcut`` are endpoint keys (``IP:port``, sorted); the backend
    numbers them into stable slots. ``cls`` is None when nothing dispatches the
    frontend (no usable endpoint for it); ``no_endpoint`` is :data:`REJECT`,
    :data:`DROP` or None; ``affinity`` is the ClientIP timeout in seconds (0: none).
    ``dedicated`` (IPv6 session affinity only) is the chain the frontend jumps to
    instead of a class.
    """

    kind: str
    key: Key
    cls: ClassSpec | None
    endpoints: tuple[str, ...] = ()
    shortcut: tuple[str, ...] = ()
    no_endpoint: str | None = None
    affinity: int = 0
    dedicated: str | None = None


@dataclass(frozen=True, slots=True)
class Dedicated:
    """Per-port chains of the per-Service-chain structure, for IPv6 session affinity.

    nft 1.0.6 aborts on a map update whose key and value exceed 32 bytes, so IPv6
    affinity cannot live in the shared ``affinity`` map: those ports keep upstream's
    shape (a chain per port, per-endpoint rules, a ``client : endpoint`` map per port),
    rendered by :mod:`~kubeproxy.backends.nftables.services`.
    """

    chains: tuple[ChainSpec, ...]
    maps: tuple[tuple[str, frozenset[str]], ...]


@dataclass(frozen=True, slots=True)
class PortPlan:
    """Everything one Service port puts into the table.

    ``firewall`` pairs each load-balancer frontend subject to source ranges with the
    sources it accepts (CIDRs or addresses). ``set_elements`` are elements ports may
    share (``cluster-ips``, ``hairpin-endpoints``), reference-counted by the backend.
    ``claims`` are the keys no other port may use.
    """

    frontends: tuple[Frontend, ...]
    firewall: tuple[tuple[Key, tuple[str, ...]], ...]
    set_elements: tuple[tuple[str, Key], ...]
    claims: frozenset[Key]
    dedicated: Dedicated | None = None


def endpoint_value(key: str) -> Key:
    """An endpoint key (``10.0.0.1:80``, ``[fd00::1]:80``) as map value parts."""
    host, _, port = key.rpartition(":")
    if host.startswith("["):
        host = host[1:-1]
    return (host, port)


def _check_port(what: str, value: int, *, zero_ok: bool = False) -> None:
    if not (0 if zero_ok else 1) <= value <= 65535:
        raise InvalidPort(f"{what} {value} is out of range")


def _check(ctx: RenderContext, port: ServicePort, eps: CategorizedEndpoints) -> None:
    """Raise :class:`InvalidPort` for anything that must not reach nft."""
    port_identity(port.name)  # names must be safe: they appear in logs and comments
    _check_port("port", port.port)
    _check_port("nodePort", port.node_port, zero_ok=True)
    if port.session_affinity_seconds > MAX_AFFINITY_SECONDS:
        raise InvalidPort(f"session affinity timeout {port.session_affinity_seconds}s is too long")
    version = ctx.tokens.family.version
    for what, ip in (
        ("cluster IP", port.cluster_ip),
        *(("service IP", ip) for ip in (*port.external_ips, *port.load_balancer_vips)),
    ):
        if ip.version != version:
            raise InvalidPort(f"{what} {ip} is not {ctx.tokens.family}")
    # The three lists usually share endpoints (often the very same tuple): check each
    # distinct list once.
    for group in {id(g): g for g in (eps.cluster, eps.local, eps.all_reachable)}.values():
        for ep in group:
            if ep.ip.version != version:
                raise InvalidPort(f"endpoint {ep.ip} is not {ctx.tokens.family}")
            if not 1 <= ep.port <= 65535:
                raise InvalidPort(f"endpoint port {ep.port} is out of range")
    for cidr in port.load_balancer_source_ranges:
        if cidr.version != version:
            raise InvalidPort(f"source range {cidr} is not {ctx.tokens.family}")


# One object per distinct class, not one per frontend.
_class = functools.lru_cache(maxsize=4096)(ClassSpec)


@functools.lru_cache(maxsize=4096)
def _port_text(port: int) -> str:
    # One string per port number, not one per frontend (100k frontends hold a few).
    return str(port)


def _keys(endpoints: tuple[Endpoint, ...]) -> tuple[str, ...]:
    return tuple(sorted(ep.key for ep in endpoints))


def plan_port(ctx: RenderContext, port: ServicePort, eps: CategorizedEndpoints) -> PortPlan:
    """The frontends, firewall and shared elements of one Service port.

    ``eps`` is the core's categorisation; policy decisions are read from it and from the
    port's flags, never re-derived. Raises :class:`InvalidPort` (a :class:`ValueError`)
    when the port cannot be rendered safely.
    """
    _check(ctx, port, eps)
    ipv6 = ctx.tokens.family is IPFamily.IPV6
    proto = port.protocol.lower
    port_text = _port_text(port.port)
    cip = str(port.cluster_ip)
    affinity = port.session_affinity_seconds
    data_affinity = affinity > 0 and not ipv6

    cluster = _keys(eps.cluster) if port.uses_cluster_endpoints else ()
    local = _keys(eps.local) if port.uses_local_endpoints else ()
    internal = local if port.internal_policy_local else cluster
    no_endpoint = DROP if eps.has_any else REJECT

    dedicated: Dedicated | None = None
    targets: dict[Key, str] = {}
    if affinity and ipv6:
        dedicated, targets = _dedicated(ctx, port, eps)

    frontends: list[Frontend] = []
    cluster_key: Key = (cip, proto, port_text)
    claims: set[Key] = {cluster_key}
    internal_cls = (
        _class(KIND_IP, SHAPE_INTERNAL, len(internal), 0, data_affinity) if internal else None
    )
    frontends.append(
        Frontend(
            KIND_IP,
            cluster_key,
            None if dedicated else internal_cls,
            internal,
            (),
            None if internal else no_endpoint,
            affinity if data_affinity and internal else 0,
            targets.get(cluster_key),
        )
    )

    external_keys: list[tuple[str, Key]] = []
    for ext in (*port.external_ips, *port.load_balancer_vips):
        key: Key = (str(ext), proto, port_text)
        if key != cluster_key and key not in claims:
            claims.add(key)
            external_keys.append((KIND_IP, key))
    if port.node_port:
        node_key: Key = (proto, _port_text(port.node_port))
        claims.add(node_key)
        external_keys.append((KIND_NODEPORT, node_key))

    if external_keys:
        if port.external_policy_local:
            main, shortcut = local, cluster
            shape = SHAPE_LOCAL
            served = eps.has_any and bool(local or cluster)
        else:
            main, shortcut = cluster, ()
            shape = SHAPE_EXTERNAL
            served = bool(cluster)
        for kind, key in external_keys:
            cls = _class(kind, shape, len(main), len(shortcut), data_affinity) if served else None
            frontends.append(
                Frontend(
                    kind,
                    key,
                    None if dedicated else cls,
                    main if cls is not None else (),
                    shortcut if cls is not None else (),
                    None if main else no_endpoint,
                    affinity if data_affinity and cls is not None else 0,
                    targets.get(key),
                )
            )

    firewall: list[tuple[Key, tuple[str, ...]]] = []
    if port.load_balancer_vips and port.load_balancer_source_ranges:
        ranges = port.load_balancer_source_ranges
        allowed = [str(cidr) for cidr in ranges]
        # A VIP looped back to the node arrives from the VIP itself (upstream allows it).
        if any(a in cidr for a in ctx.node_addresses for cidr in ranges):
            allowed.extend(str(vip) for vip in port.load_balancer_vips)
        sources = tuple(dict.fromkeys(allowed))
        for vip in dict.fromkeys(port.load_balancer_vips):
            firewall.append(((str(vip), proto, port_text), sources))

    set_elements: list[tuple[str, Key]] = [(Names.CLUSTER_IPS, (cip,))]
    seen: set[str] = set()
    for ep in eps.all_reachable:
        # A hairpin connection comes from the endpoint itself, which must then be on
        # this node: an endpoint known to run elsewhere never needs the element.
        if ep.remote:
            continue
        host = endpoint_value(ep.key)[0]
        if host not in seen:
            seen.add(host)
            set_elements.append((Names.HAIRPIN_ENDPOINTS, (host, host)))
    return PortPlan(
        tuple(frontends), tuple(firewall), tuple(set_elements), frozenset(claims), dedicated
    )


def _dedicated(
    ctx: RenderContext, port: ServicePort, eps: CategorizedEndpoints
) -> tuple[Dedicated | None, dict[Key, str]]:
    """The per-port chains of an IPv6 affinity port, and the chain each frontend uses."""
    rules = render_port(ctx, port, eps)
    targets: dict[Key, str] = {}
    for container, key, value in rules.elements:
        if container in (Names.SERVICE_IPS, Names.SERVICE_NODEPORTS):
            targets[key] = value[0].removeprefix("goto ")
    # The firewall has its own data in the map structure; its chain is not needed.
    chains = tuple(c for c in rules.chains if not c.name.startswith("firewall-"))
    if not targets:
        return None, {}
    return Dedicated(chains, rules.affinity_maps), targets
