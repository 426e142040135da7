"""The iptables rules of one Service port and the fixed chains (pure functions).

Rule text follows upstream kube-proxy's iptables mode (``pkg/proxy/iptables/proxier.go``)
argument for argument, so ``iptables-save`` of a node looks the same under either proxy.
Every rule is returned without its ``-A CHAIN`` prefix; the caller adds it through
:class:`~kubeproxy.backends.iptables.restore.RestoreInput`.

Nothing here re-derives traffic policy or topology: the endpoints come categorised by
the core (:class:`~kubeproxy.objects.CategorizedEndpoints`).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kubeproxy.backend import NodePortAddresses
from kubeproxy.backends.iptables.naming import (
    EXTERNAL_SERVICES,
    FORWARD,
    KUBELET_FIREWALL,
    MARK_MASQ,
    NODEPORTS,
    POSTROUTING,
    PROXY_FIREWALL,
    SERVICE_IPS,
    SERVICES,
    endpoint_chain,
    service_chains,
    service_port_string,
)
from kubeproxy.config import LocalDetector
from kubeproxy.objects import (
    CategorizedEndpoints,
    Endpoint,
    IPAddress,
    IPFamily,
    IPNetwork,
    ServicePort,
)

__all__ = [
    "MAX_AFFINITY_SECONDS",
    "ChainRules",
    "FixedRules",
    "InvalidPort",
    "JumpRule",
    "PortRules",
    "RenderContext",
    "fixed_rules",
    "jump_rules",
    "localhost_node_ports",
    "probability",
    "render_port",
]

MAX_AFFINITY_SECONDS = 86400
"""Upper bound of ``sessionAffinityConfig.clientIP.timeoutSeconds`` (as the API)."""

_INTERFACE = re.compile(r"[A-Za-z0-9_.-]{1,15}")
_LOOPBACK4 = "127.0.0.0/8"
_LOOPBACK_IP = ipaddress.IPv4Address("127.0.0.1")
_LOOPBACK_NET = ipaddress.IPv4Network(_LOOPBACK4)
_NODEPORTS_COMMENT = (
    '-m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule '
    'in this chain"'
)


class InvalidPort(ValueError):
    """A Service port that cannot be rendered (bad name, port or address)."""


def probability(n: int) -> str:
    """``1/n`` as upstream writes a ``statistic`` probability (``%0.10f``)."""
    return f"{1.0 / n:0.10f}"


@dataclass(frozen=True, slots=True)
class ChainRules:
    """One per-service nat chain and its rules (each without ``-A CHAIN``)."""

    name: str
    rules: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PortRules:
    """Everything one Service port writes.

    ``chains`` are its own nat chains (SEP, SVC, SVL, EXT, FW); the other fields are its
    rules in the shared top-level chains. ``cluster_ip`` is the address our
    ``KUBE-SERVICE-IPS`` chain rejects on other ports. ``nat_rules`` and ``filter_rules``
    count every rule the port writes per table (its chains' and its top-level ones), for
    the rules-total metric.
    """

    chains: tuple[ChainRules, ...]
    nat_services: tuple[str, ...]
    nat_nodeports: tuple[str, ...]
    filter_services: tuple[str, ...]
    filter_external: tuple[str, ...]
    filter_nodeports: tuple[str, ...]
    filter_firewall: tuple[str, ...]
    cluster_ip: str
    nat_rules: int = 0
    filter_rules: int = 0

    @property
    def chain_names(self) -> frozenset[str]:
        """The names of :attr:`chains`."""
        return frozenset(chain.name for chain in self.chains)


@dataclass(frozen=True, slots=True)
class RenderContext:
    """What rendering needs besides the port.

    ``masquerade_match`` is the condition under which cluster-IP traffic is masqueraded
    (``""`` for masqueradeAll, ``None`` for never: no detector); ``local_match`` tells
    traffic from local pods (``None``: no detector); ``endpoint_comments`` is off in
    large-cluster mode. ``localhost_nodeport_counter`` names the nfacct counter that
    NodePort packets to a loopback address go through, as upstream counts them (``None``:
    no counter, or localhost NodePorts off).
    """

    family: IPFamily
    masquerade_match: str | None
    local_match: str | None
    node_addresses: tuple[IPAddress, ...] = ()
    endpoint_comments: bool = True
    localhost_nodeport_counter: str | None = None

    @classmethod
    def build(
        cls,
        family: IPFamily,
        detector: LocalDetector,
        *,
        masquerade_all: bool,
        node_addresses: Sequence[IPAddress] = (),
        endpoint_comments: bool = True,
        localhost_nodeport_counter: str | None = None,
    ) -> RenderContext:
        """The context for a detector (already for ``family``) and the masquerade flag.

        Raises :class:`ValueError` for a detector CIDR of the wrong family or an
        interface name iptables could misread.
        """
        local: str | None = None
        masq: str | None = None
        found = detector.local_traffic(family, _INTERFACE, "+")
        if found is not None:
            option = "-i" if found.by_interface else "-s"
            local, masq = f"{option} {found.value}", f"! {option} {found.value}"
        if masquerade_all:
            masq = ""
        addresses = tuple(a for a in node_addresses if a.version == family.version)
        return cls(family, masq, local, addresses, endpoint_comments, localhost_nodeport_counter)


def _check_port(what: str, value: int, *, zero_ok: bool = False) -> None:
    low = 0 if zero_ok else 1
    if not low <= value <= 65535:
        raise InvalidPort(f"{what} {value} is out of range")


def _check_family(family: IPFamily, what: str, ip: IPAddress | IPNetwork) -> None:
    if ip.version != family.version:
        raise InvalidPort(f"{what} {ip} is not {family}")


def _endpoint_key(ep: Endpoint) -> str:
    return ep.key


class _Port:
    """Renders one port; a class only to share the per-port words between helpers."""

    __slots__ = ("chains", "ctx", "match", "name", "port", "proto", "sep_comment", "seps")

    def __init__(self, ctx: RenderContext, port: ServicePort, name: str) -> None:
        self.ctx = ctx
        self.port = port
        self.name = name
        self.proto = port.protocol.lower
        self.match = f"-m {self.proto} -p {self.proto}"
        self.chains: list[ChainRules] = []
        self.seps: dict[str, str] = {}
        self.sep_comment = f'-m comment --comment "{name}" ' if ctx.endpoint_comments else ""

    def endpoint_chain(self, ep: Endpoint) -> str:
        """The SEP chain of ``ep`` (written once per port even if two policies use it)."""
        chain = self.seps.get(ep.key)
        if chain is not None:
            return chain
        chain = endpoint_chain(self.name, self.proto, ep.key)
        self.seps[ep.key] = chain
        c = self.sep_comment
        rules = [f"{c}-s {ep.address} -j {MARK_MASQ}"]
        recent = f"-m recent --name {chain} --set " if self.port.session_affinity else ""
        rules.append(f"{c}{recent}{self.match} -j DNAT --to-destination {ep.key}")
        self.chains.append(ChainRules(chain, tuple(rules)))
        return chain

    def dispatch(
        self, chain: str, endpoints: Sequence[Endpoint], masquerade_rule: str | None
    ) -> None:
        """A KUBE-SVC or KUBE-SVL chain: [masquerade], [affinity], the statistic cascade."""
        rules: list[str] = []
        if masquerade_rule is not None:
            rules.append(masquerade_rule)
        ordered = sorted(endpoints, key=_endpoint_key)
        targets = [(ep, self.endpoint_chain(ep)) for ep in ordered]
        comments = self.ctx.endpoint_comments
        name = self.name

        def comment(ep: Endpoint) -> str:
            return f'-m comment --comment "{name} -> {ep.key}" ' if comments else ""

        seconds = self.port.session_affinity_seconds
        if seconds:
            for ep, sep in targets:
                rules.append(
                    f"{comment(ep)}-m recent --name {sep} --rcheck --seconds {seconds} "
                    f"--reap -j {sep}"
                )
        count = len(targets)
        for i, (ep, sep) in enumerate(targets):
            if i < count - 1:
                rules.append(
                    f"{comment(ep)}-m statistic --mode random --probability "
                    f"{probability(count - i)} -j {sep}"
                )
            else:
                rules.append(f"{comment(ep)}-j {sep}")
        self.chains.append(ChainRules(chain, tuple(rules)))


def _validate(ctx: RenderContext, port: ServicePort, eps: CategorizedEndpoints) -> str:
    try:
        name = service_port_string(port.name)
    except ValueError as err:
        raise InvalidPort(str(err)) from None
    family = ctx.family
    _check_port("port", port.port)
    _check_port("nodePort", port.node_port, zero_ok=True)
    _check_port("healthCheckNodePort", port.health_check_node_port, zero_ok=True)
    if not 0 <= port.session_affinity_seconds <= MAX_AFFINITY_SECONDS:
        raise InvalidPort(f"session affinity timeout {port.session_affinity_seconds}s is invalid")
    _check_family(family, "cluster IP", port.cluster_ip)
    for ip in (*port.external_ips, *port.load_balancer_vips):
        _check_family(family, "service IP", ip)
    for cidr in port.load_balancer_source_ranges:
        _check_family(family, "source range", cidr)
    version = family.version
    groups = {id(group): group for group in (eps.cluster, eps.local, eps.all_reachable)}
    for group in groups.values():
        for ep in group:
            if ep.version != version:
                _check_family(family, "endpoint", ep.ip)
            if not 1 <= ep.port <= 65535:
                _check_port("endpoint port", ep.port)
    return name


def render_port(ctx: RenderContext, port: ServicePort, eps: CategorizedEndpoints) -> PortRules:
    """The chains and top-level rules of one Service port, as upstream writes them.

    Raises :class:`InvalidPort` when the port cannot be rendered safely.
    """
    name = _validate(ctx, port, eps)
    r = _Port(ctx, port, name)
    proto_match = r.match
    svc_chain, svl_chain, ext_chain, fw_chain = service_chains(name, r.proto)
    cip = str(port.cluster_ip)
    dport = f"--dport {port.port}"

    cluster_chain: str | None = None
    local_chain: str | None = None
    cluster_args = f'-m comment --comment "{name} cluster IP" {proto_match} -d {cip} {dport}'
    masq = ctx.masquerade_match
    masq_rule = None
    if masq is not None:
        cond = f" {masq}" if masq else ""
        masq_rule = f"{cluster_args}{cond} -j {MARK_MASQ}"
    if port.uses_cluster_endpoints and eps.cluster:
        cluster_chain = svc_chain
        r.dispatch(svc_chain, eps.cluster, None if port.internal_policy_local else masq_rule)
    if port.uses_local_endpoints and eps.local:
        local_chain = svl_chain
        r.dispatch(svl_chain, eps.local, masq_rule if port.internal_policy_local else None)
    internal_chain = local_chain if port.internal_policy_local else cluster_chain
    external_target = local_chain if port.external_policy_local else cluster_chain

    has_endpoints = eps.has_any
    if not has_endpoints:
        internal_target = external_target_filter = "REJECT"
        internal_comment = external_comment = f"{name} has no endpoints"
    else:
        internal_target = "DROP"
        internal_comment = f"{name} has no local endpoints"
        external_target_filter = "DROP"
        external_comment = internal_comment

    ext_used = has_endpoints and port.externally_accessible
    if ext_used:
        rules: list[str] = []
        if not port.external_policy_local:
            rules.append(
                f'-m comment --comment "masquerade traffic for {name} external destinations" '
                f"-j {MARK_MASQ}"
            )
        elif cluster_chain is not None:
            if ctx.local_match is not None:
                rules.append(
                    f'-m comment --comment "pod traffic for {name} external destinations" '
                    f"{ctx.local_match} -j {cluster_chain}"
                )
            rules.append(
                f'-m comment --comment "masquerade LOCAL traffic for {name} external '
                f'destinations" -m addrtype --src-type LOCAL -j {MARK_MASQ}'
            )
            rules.append(
                f'-m comment --comment "route LOCAL traffic for {name} external '
                f'destinations" -m addrtype --src-type LOCAL -j {cluster_chain}'
            )
        if external_target is not None:
            rules.append(f"-j {external_target}")
        r.chains.append(ChainRules(ext_chain, tuple(rules)))

    # Duplicates would write a rule twice, and a partial sync's -D removes one copy only.
    external_ips = tuple(dict.fromkeys(port.external_ips))
    vips = tuple(dict.fromkeys(port.load_balancer_vips))
    ranges = tuple(dict.fromkeys(port.load_balancer_source_ranges))
    uses_fw = has_endpoints and bool(vips and ranges)
    if uses_fw:
        fw_comment = f'-m comment --comment "{name} loadbalancer IP"'
        rules = [f"{fw_comment} -s {cidr} -j {ext_chain}" for cidr in ranges]
        if any(a in c for a in ctx.node_addresses for c in ranges):
            rules.extend(f"{fw_comment} -s {vip} -j {ext_chain}" for vip in vips)
        r.chains.append(ChainRules(fw_chain, tuple(rules)))

    nat_services: list[str] = []
    filter_services: list[str] = []
    filter_external: list[str] = []
    filter_firewall: list[str] = []
    nat_nodeports: list[str] = []
    filter_nodeports: list[str] = []

    if internal_chain is not None:
        nat_services.append(f"{cluster_args} -j {internal_chain}")
    else:
        filter_services.append(
            f'-m comment --comment "{internal_comment}" {proto_match} -d {cip} {dport} '
            f"-j {internal_target}"
        )
    for ip in external_ips:
        if has_endpoints:
            nat_services.append(
                f'-m comment --comment "{name} external IP" {proto_match} -d {ip} {dport} '
                f"-j {ext_chain}"
            )
        if external_target is None:
            filter_external.append(
                f'-m comment --comment "{external_comment}" {proto_match} -d {ip} {dport} '
                f"-j {external_target_filter}"
            )
    lb_chain = fw_chain if uses_fw else ext_chain
    for ip in vips:
        if has_endpoints:
            nat_services.append(
                f'-m comment --comment "{name} loadbalancer IP" {proto_match} -d {ip} {dport} '
                f"-j {lb_chain}"
            )
        if uses_fw:
            filter_firewall.append(
                f'-m comment --comment "{name} traffic not accepted by {fw_chain}" '
                f"{proto_match} -d {ip} {dport} -j DROP"
            )
    if external_target is None:
        for ip in vips:
            filter_external.append(
                f'-m comment --comment "{external_comment}" {proto_match} -d {ip} {dport} '
                f"-j {external_target_filter}"
            )
    if port.node_port:
        counter = r.ctx.localhost_nodeport_counter
        if has_endpoints and counter is not None:
            # Upstream's: the same jump for loopback destinations, through the counter.
            nat_nodeports.append(
                f'-m comment --comment "{name}" {proto_match} -d {_LOOPBACK4} '
                f"--dport {port.node_port} -m nfacct --nfacct-name {counter} -j {ext_chain}"
            )
        if has_endpoints:
            nat_nodeports.append(
                f'-m comment --comment "{name}" {proto_match} --dport {port.node_port} '
                f"-j {ext_chain}"
            )
        if external_target is None:
            filter_external.append(
                f'-m comment --comment "{external_comment}" -m addrtype --dst-type LOCAL '
                f"{proto_match} --dport {port.node_port} -j {external_target_filter}"
            )
    if port.health_check_node_port:
        filter_nodeports.append(
            f'-m comment --comment "{name} health check node port" -m tcp -p tcp '
            f"--dport {port.health_check_node_port} -j ACCEPT"
        )
    nat_rules = sum(len(chain.rules) for chain in r.chains)
    return PortRules(
        tuple(r.chains),
        tuple(nat_services),
        tuple(nat_nodeports),
        tuple(filter_services),
        tuple(filter_external),
        tuple(filter_nodeports),
        tuple(filter_firewall),
        cip,
        nat_rules + len(nat_services) + len(nat_nodeports),
        len(filter_services) + len(filter_external) + len(filter_nodeports) + len(filter_firewall),
    )


@dataclass(frozen=True, slots=True)
class JumpRule:
    """A jump from a built-in chain to one of ours (kept by ``ensure_rule``)."""

    table: str
    chain: str
    args: tuple[str, ...]


_NEW = ("-m", "conntrack", "--ctstate", "NEW")


def _jump(
    table: str, builtin: str, target: str, comment: str, extra: tuple[str, ...] = ()
) -> JumpRule:
    args: tuple[str, ...] = ()
    if comment:
        args = ("-m", "comment", "--comment", comment)
    return JumpRule(table, builtin, (*args, *extra, "-j", target))


def jump_rules(*, localnet_firewall: bool) -> tuple[JumpRule, ...]:
    """The jumps from built-in chains, as upstream's ``iptablesJumpChains``.

    With ``localnet_firewall`` (localhost NodePorts on), also the jumps to kubelet's
    ``KUBE-FIREWALL`` from INPUT and OUTPUT, as upstream adds them.
    """
    portals = "kubernetes service portals"
    external = "kubernetes externally-visible service portals"
    firewall = "kubernetes load balancer firewall"
    jumps = [
        _jump("filter", "INPUT", EXTERNAL_SERVICES, external, _NEW),
        _jump("filter", "FORWARD", EXTERNAL_SERVICES, external, _NEW),
        _jump("filter", "INPUT", NODEPORTS, "kubernetes health check service ports"),
        _jump("filter", "FORWARD", SERVICES, portals, _NEW),
        _jump("filter", "OUTPUT", SERVICES, portals, _NEW),
        _jump("filter", "FORWARD", FORWARD, "kubernetes forwarding rules"),
        _jump("filter", "INPUT", PROXY_FIREWALL, firewall, _NEW),
        _jump("filter", "OUTPUT", PROXY_FIREWALL, firewall, _NEW),
        _jump("filter", "FORWARD", PROXY_FIREWALL, firewall, _NEW),
        _jump("nat", "OUTPUT", SERVICES, portals),
        _jump("nat", "PREROUTING", SERVICES, portals),
        _jump("nat", "POSTROUTING", POSTROUTING, "kubernetes postrouting rules"),
    ]
    if localnet_firewall:
        jumps.append(_jump("filter", "INPUT", KUBELET_FIREWALL, ""))
        jumps.append(_jump("filter", "OUTPUT", KUBELET_FIREWALL, ""))
    return tuple(jumps)


@dataclass(frozen=True, slots=True)
class FixedRules:
    """The rules of the fixed chains that do not depend on Services, per table.

    ``filter_chains`` and ``nat_chains`` are declared (flushed) on every sync;
    ``filter``/``nat`` map a chain to its rules, the Service-independent ones, written
    before the per-port rules of the same chain (``nat_tail`` goes after them: the
    NodePort jump must be last in nat ``KUBE-SERVICES``).
    """

    filter_chains: tuple[str, ...]
    nat_chains: tuple[str, ...]
    filter: tuple[tuple[str, str], ...]
    nat: tuple[tuple[str, str], ...]
    nat_tail: tuple[str, ...]
    service_cidrs: tuple[str, ...]
    localnet_firewall: bool


def localhost_node_ports(family: IPFamily, enabled: bool, addresses: NodePortAddresses) -> bool:
    """Whether localhost NodePorts work: IPv4, enabled, and loopback among the addresses."""
    if family is not IPFamily.IPV4 or not enabled:
        return False
    if addresses.match_all:
        return True
    # As upstream's ContainsIPv4Loopback: a configured CIDR holding 127.0.0.1.
    return any(_LOOPBACK_IP in c for c in addresses.cidrs if c.version == 4)


def fixed_rules(
    family: IPFamily,
    *,
    masquerade_mark: int,
    node_port_addresses: NodePortAddresses,
    localhost_node_ports_enabled: bool,
    tcp_be_liberal: bool,
    service_cidrs: Sequence[IPNetwork],
    invalid_drop_counter: str | None = None,
) -> FixedRules:
    """The fixed chains' rules for one family (see :class:`FixedRules`).

    ``invalid_drop_counter`` names the nfacct counter the INVALID drop goes through
    (upstream's ``ct_state_invalid_dropped_pkts``; ``None``: no counter).
    """
    mark = f"{masquerade_mark:#x}"
    localnet = localhost_node_ports(family, localhost_node_ports_enabled, node_port_addresses)
    cidrs = tuple(str(c) for c in service_cidrs if c.version == family.version)

    filter_chains = [SERVICES, EXTERNAL_SERVICES, FORWARD, NODEPORTS, PROXY_FIREWALL]
    filter_rules: list[tuple[str, str]] = []
    if not tcp_be_liberal:
        count = f"-m nfacct --nfacct-name {invalid_drop_counter} " if invalid_drop_counter else ""
        filter_rules.append((FORWARD, f"-m conntrack --ctstate INVALID {count}-j DROP"))
    filter_rules.append(
        (
            FORWARD,
            f'-m comment --comment "kubernetes forwarding rules" -m mark --mark {mark}/{mark} '
            "-j ACCEPT",
        )
    )
    filter_rules.append(
        (
            FORWARD,
            '-m comment --comment "kubernetes forwarding conntrack rule" -m conntrack '
            "--ctstate RELATED,ESTABLISHED -j ACCEPT",
        )
    )
    if cidrs:
        filter_chains.append(SERVICE_IPS)
    if localnet:
        filter_chains.append(KUBELET_FIREWALL)
        filter_rules.append(
            (
                KUBELET_FIREWALL,
                '-m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 '
                "! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP",
            )
        )

    nat_chains = (SERVICES, NODEPORTS, POSTROUTING, MARK_MASQ)
    nat_rules = [
        (POSTROUTING, f"-m mark ! --mark {mark}/{mark} -j RETURN"),
        (POSTROUTING, f"-j MARK --xor-mark {mark}"),
        (
            POSTROUTING,
            '-m comment --comment "kubernetes service traffic requiring SNAT" '
            "-j MASQUERADE --random-fully",
        ),
        (MARK_MASQ, f"-j MARK --or-mark {mark}"),
    ]
    tail: list[str] = []
    if node_port_addresses.match_all:
        dest = "-m addrtype --dst-type LOCAL"
        if family is IPFamily.IPV6:
            dest += " ! -d ::1/128"
        elif not localnet:
            dest += f" ! -d {_LOOPBACK4}"
        tail.append(f"{_NODEPORTS_COMMENT} {dest} -j {NODEPORTS}")
    else:
        seen: set[IPAddress] = set()
        for ip in node_port_addresses.addresses:
            if ip.version != family.version or ip in seen:
                continue
            seen.add(ip)
            if ip.is_loopback:
                continue
            tail.append(f"{_NODEPORTS_COMMENT} -d {ip} -j {NODEPORTS}")
        if localnet:
            # Upstream lists the loopback interface's addresses here; the configured
            # loopback CIDRs say the same without depending on how the host's addresses
            # were gathered.
            for cidr in node_port_addresses.cidrs:
                if cidr.version == 4 and _LOOPBACK_IP in cidr:
                    loop = cidr if cidr.subnet_of(_LOOPBACK_NET) else _LOOPBACK_NET
                    tail.append(f"{_NODEPORTS_COMMENT} -d {loop} -j {NODEPORTS}")
    return FixedRules(
        tuple(filter_chains),
        nat_chains,
        tuple(filter_rules),
        tuple(nat_rules),
        tuple(tail),
        cidrs,
        localnet,
    )
