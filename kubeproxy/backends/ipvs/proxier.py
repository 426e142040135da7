"""IPVSBackend: upstream's (deprecated) ipvs mode over narrow executors.

Per Service port the backend renders a plan (:func:`render_port`): IPVS virtual servers
with their real servers, the addresses to bind to ``kube-ipvs0``, and ipset members. The
backend keeps every plan, the claimants of each virtual server (two ports wanting the
same address, protocol and port: the first in name order gets it, the other is logged)
and reference counts of addresses and set members, so a sync reconciles only the keys
the changed ports touch against its model of the kernel. A full sync (first sync, after
a failure, the core's periodic one, a node address change) reads the kernel back first:
virtual and real servers of our family, the addresses on ``kube-ipvs0``, our sets'
members; everything found there and not wanted goes.

Order of a sync, so that what worked before keeps working until its replacement exists:

1. ipset additions (and on a full sync the ``create`` of every set);
2. addresses bound to ``kube-ipvs0``;
3. IPVS virtual servers and real servers added or updated;
4. the iptables rules (one ``iptables-restore --noflush`` of our chains, only when the
   text changed or on a full sync, then the jumps from the built-in chains);
5. removals: real servers gracefully (below), virtual servers (never one inside
   ``ipvs.excludeCIDRs``), addresses, ipset members.

A kernel refusal at any step raises :class:`~kubeproxy.backend.SyncError`; everything
before the failing step stays (removals only happen after every addition succeeded),
and the next sync is a full one.

Graceful termination, as upstream's ``GracefulTerminationManager``: a real server no
longer wanted is deleted at once when it is UDP or SCTP or has no connections; otherwise
its weight becomes 0 (no new connections) and every later sync reads its connection
counts again and deletes it once they are 0. A real server that comes back while
draining gets its weight back.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kubeproxy.backend import ProxySnapshot, SyncChanges, SyncError
from kubeproxy.backends.iptables.exec import IptablesError, IptablesExecutor
from kubeproxy.backends.iptables.restore import RestoreError
from kubeproxy.backends.ipvs.ipset import (
    IPSetError,
    IPSetExecutor,
    IPSetRestore,
    SetName,
    SetSpec,
    member_ip,
    member_ip_port,
    member_ip_port_ip,
    member_ip_port_net,
    member_port,
    set_specs,
)
from kubeproxy.backends.ipvs.netlink import (
    DUMMY_DEVICE,
    FLAG_PERSISTENT,
    FLAG_SOURCE_HASH,
    IPVSError,
    IPVSExecutor,
    LinkError,
    LinkExecutor,
    RealServer,
    VirtualServer,
)
from kubeproxy.backends.ipvs.rules import CHAINS, JUMPS, RuleInputs, cleanup_input, render_rules
from kubeproxy.backends.ipvs.sysctls import SysctlApplier, ipvs_sysctls
from kubeproxy.config import LocalDetector, ProxierConfig
from kubeproxy.objects import (
    CategorizedEndpoints,
    Endpoint,
    IPAddress,
    IPFamily,
    IPNetwork,
    NamespacedName,
    ServicePort,
    ServicePortName,
)
from kubeproxy.objects import Protocol as L4Protocol

__all__ = [
    "KERNEL_ERRORS",
    "IPVSBackend",
    "PortPlan",
    "RenderContext",
    "cleanup_family",
    "render_port",
]

log = logging.getLogger(__name__)

KERNEL_ERRORS = (IPVSError, LinkError, IPSetError, IptablesError, RestoreError)
"""The executor errors a sync turns into :class:`~kubeproxy.backend.SyncError`."""

MAX_AFFINITY_SECONDS = 86400
"""Longest ClientIP affinity timeout the API accepts (one day)."""

_SCHEDULER = re.compile(r"[a-z][a-z0-9]{0,14}")
_GRACEFUL = frozenset({L4Protocol.TCP})

VSKey = tuple[IPAddress, L4Protocol, int]
RSKey = tuple[IPAddress, int]
AccessKey = tuple[IPAddress, L4Protocol, int]
ServerPlan = tuple[VirtualServer, tuple[RealServer, ...]]


@dataclass(frozen=True, slots=True)
class RenderContext:
    """What rendering a port needs besides the port: family, scheduler, node addresses.

    ``node_port_ips`` are where NodePort virtual servers go; ``node_ips`` are the node's
    own addresses (never bound to ``kube-ipvs0``); ``primary_ip`` decides whether a load
    balancer's source ranges let the node itself in; ``local_detector`` is the
    snapshot's (the core resolves NodeCIDR to the node's pod CIDRs, which the
    configuration does not hold).
    """

    family: IPFamily
    scheduler: str
    node_port_ips: tuple[IPAddress, ...]
    node_ips: frozenset[IPAddress]
    primary_ip: IPAddress | None
    local_detector: LocalDetector = field(default_factory=LocalDetector)


@dataclass(frozen=True, slots=True)
class PortPlan:
    """What one Service port puts into the kernel."""

    servers: tuple[ServerPlan, ...] = ()
    addresses: frozenset[IPAddress] = frozenset()
    members: frozenset[tuple[SetName, str]] = frozenset()
    no_node_access: tuple[AccessKey, ...] = ()


def _real_servers(endpoints: Iterable[Endpoint], family: IPFamily) -> tuple[RealServer, ...]:
    seen: dict[RSKey, RealServer] = {}
    for ep in endpoints:
        if ep.version != family.version or not 0 < ep.port < 65536:
            continue
        ip = ep.ip
        seen.setdefault((ip, ep.port), RealServer(ip, ep.port, 1))
    return tuple(seen.values())


def render_port(port: ServicePort, eps: CategorizedEndpoints, ctx: RenderContext) -> PortPlan:
    """The plan of one Service port (raises ValueError for a port it cannot program)."""
    family = ctx.family
    proto = port.protocol
    if not 0 < port.port < 65536:
        raise ValueError(f"port {port.port} out of range")
    if not 0 <= port.node_port < 65536 or not 0 <= port.health_check_node_port < 65536:
        raise ValueError("nodePort or healthCheckNodePort out of range")
    if not 0 <= port.session_affinity_seconds <= MAX_AFFINITY_SECONDS:
        raise ValueError(f"session affinity timeout {port.session_affinity_seconds}s out of range")
    if port.cluster_ip.version != family.version:
        raise ValueError(f"cluster IP {port.cluster_ip} is not {family}")

    flags = FLAG_SOURCE_HASH if ctx.scheduler == "mh" else 0
    timeout = 0
    if port.session_affinity:
        flags |= FLAG_PERSISTENT
        timeout = port.session_affinity_seconds
    cluster_rs = _real_servers(eps.cluster, family)
    local_rs = _real_servers(eps.local, family)
    # A Local policy without local endpoints falls back to the cluster's endpoints, as
    # upstream's syncEndpoint does (kubernetes/kubernetes#97081: pods must still reach
    # the Service; an external client's packet goes out unmasqueraded, so on a real
    # network its reply, from the pod, is discarded). For a ClusterIP Service with an
    # internal Local policy the cluster endpoints are empty, so nothing is left.
    internal = (local_rs or cluster_rs) if port.internal_policy_local else cluster_rs
    external = (local_rs or cluster_rs) if port.external_policy_local else cluster_rs

    servers: list[tuple[VirtualServer, tuple[RealServer, ...]]] = []
    addresses: set[IPAddress] = set()
    members: set[tuple[SetName, str]] = set()
    no_access: list[AccessKey] = []

    def serve(address: IPAddress, number: int, reals: tuple[RealServer, ...], bind: bool) -> None:
        servers.append(
            (VirtualServer(address, proto, number, ctx.scheduler, flags, timeout), reals)
        )
        if bind and address not in ctx.node_ips:
            addresses.add(address)

    serve(port.cluster_ip, port.port, internal, True)
    members.add((SetName.CLUSTER_IP, member_ip_port(port.cluster_ip, proto, port.port)))

    external_set = SetName.EXTERNAL_IP_LOCAL if port.external_policy_local else SetName.EXTERNAL_IP
    for ip in dict.fromkeys(port.external_ips):
        if ip.version != family.version or ip == port.cluster_ip:
            continue
        serve(ip, port.port, external, True)
        members.add((external_set, member_ip_port(ip, proto, port.port)))

    ranges = [c for c in port.load_balancer_source_ranges if c.version == family.version]
    for ip in dict.fromkeys(port.load_balancer_vips):
        if ip.version != family.version or ip == port.cluster_ip or ip in port.external_ips:
            continue
        serve(ip, port.port, external, True)
        entry = member_ip_port(ip, proto, port.port)
        members.add((SetName.LOAD_BALANCER, entry))
        if port.external_policy_local:
            members.add((SetName.LOAD_BALANCER_LOCAL, entry))
        if ranges:
            members.add((SetName.LOAD_BALANCER_FW, entry))
            for cidr in ranges:
                members.add(
                    (
                        SetName.LOAD_BALANCER_SOURCE_CIDR,
                        member_ip_port_net(ip, proto, port.port, cidr),
                    )
                )
            if ctx.primary_ip is not None and any(ctx.primary_ip in c for c in ranges):
                members.add(
                    (SetName.LOAD_BALANCER_SOURCE_IP, member_ip_port_ip(ip, proto, port.port, ip))
                )
            else:
                no_access.append((ip, proto, port.port))

    if port.node_port:
        for ip in ctx.node_port_ips:
            serve(ip, port.node_port, external, False)
        if proto is L4Protocol.SCTP:
            for ip in ctx.node_port_ips:
                entry = member_ip_port(ip, proto, port.node_port)
                members.add((SetName.NODE_PORT_SCTP, entry))
                if port.external_policy_local:
                    members.add((SetName.NODE_PORT_LOCAL_SCTP, entry))
        else:
            tcp = proto is L4Protocol.TCP
            entry = member_port(port.node_port)
            members.add((SetName.NODE_PORT_TCP if tcp else SetName.NODE_PORT_UDP, entry))
            if port.external_policy_local:
                local = SetName.NODE_PORT_LOCAL_TCP if tcp else SetName.NODE_PORT_LOCAL_UDP
                members.add((local, entry))
    if port.health_check_node_port:
        members.add((SetName.HEALTH_CHECK_NODE_PORT, member_port(port.health_check_node_port)))

    # Hairpin: a local endpoint reaching its own Service is masqueraded.
    for ep in dict.fromkeys((*eps.cluster, *eps.local)):
        if ep.is_local and ep.version == family.version and 0 < ep.port < 65536:
            ip = ep.ip
            members.add((SetName.LOOP_BACK, member_ip_port_ip(ip, proto, ep.port, ip)))

    return PortPlan(tuple(servers), frozenset(addresses), frozenset(members), tuple(no_access))


@dataclass(slots=True)
class _Touched:
    """Keys a sync must reconcile: virtual servers, addresses, ``(set, member)`` pairs."""

    vs: set[VSKey] = field(default_factory=set)
    addresses: set[IPAddress] = field(default_factory=set)
    members: set[tuple[str, str]] = field(default_factory=set)


class IPVSBackend:
    """The ipvs mode for one IP family (deprecated upstream; see the package README).

    Executors are injected: ``ipvs`` (virtual/real servers), ``links`` (``kube-ipvs0``
    and its addresses), ``ipsets``, ``iptables``; ``sysctls`` applies the IPVS sysctls on
    full syncs (None: leave them alone). Attributes for tests and metrics:
    :attr:`sync_failures`, :attr:`last_sync_full`, :attr:`terminating` (real servers
    draining at weight 0).
    """

    def __init__(
        self,
        family: IPFamily,
        config: ProxierConfig,
        *,
        ipvs: IPVSExecutor,
        links: LinkExecutor,
        ipsets: IPSetExecutor,
        iptables: IptablesExecutor,
        sysctls: SysctlApplier | None = None,
        device: str = DUMMY_DEVICE,
    ) -> None:
        scheduler = config.ipvs.scheduler or "rr"
        if _SCHEDULER.fullmatch(scheduler) is None:
            raise ValueError(f"invalid IPVS scheduler name {scheduler!r}")
        self._family = family
        self._config = config
        self._scheduler = scheduler
        self._ipvs = ipvs
        self._links = links
        self._ipsets = ipsets
        self._iptables = iptables
        self._sysctls = sysctls
        self._device = device
        self._specs: dict[SetName, SetSpec] = set_specs(family)
        self._set_names = {key: spec.name for key, spec in self._specs.items()}
        self._exclude = tuple(c for c in config.ipvs.exclude_cidrs if c.version == family.version)
        self.sync_failures = 0
        self.last_sync_full = False
        self._reset()

    def _reset(self) -> None:
        self._need_full = True
        self._ctx: RenderContext | None = None
        self._clear_wanted()
        # The model of the kernel: what is there now, ours or not (this family only).
        self._vs: dict[VSKey, VirtualServer] = {}
        self._rs: dict[VSKey, dict[RSKey, RealServer]] = {}
        self._addresses: set[IPAddress] = set()
        self._members: dict[str, set[str]] = {}
        self._rules: str | None = None
        self.terminating: set[tuple[VSKey, RSKey]] = set()

    def _clear_wanted(self) -> None:
        # What the plans want, with every claimant / reference counted, so an incremental
        # sync reconciles only the keys its changed ports touch.
        self._plans: dict[ServicePortName, PortPlan] = {}
        self._by_service: dict[NamespacedName, set[ServicePortName]] = {}
        self._claims: dict[VSKey, dict[ServicePortName, ServerPlan]] = {}
        self._address_refs: dict[IPAddress, int] = {}
        self._member_refs: dict[tuple[str, str], int] = {}
        self._set_sizes: dict[str, int] = {}
        self._access_refs: dict[AccessKey, int] = {}

    # Backend protocol -----------------------------------------------------------------------

    @property
    def iptables(self) -> IptablesExecutor:
        """What runs the iptables tools (the self-healing watcher reads its children)."""
        return self._iptables

    @property
    def family(self) -> IPFamily:
        """The IP family this backend programs."""
        return self._family

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Make the kernel match ``snapshot`` (see the module documentation)."""
        if snapshot.family is not self._family:
            raise ValueError(f"snapshot of {snapshot.family} given to the {self._family} backend")
        full = changes.full or self._need_full
        self.last_sync_full = full
        # Until this sync succeeds, the next one must be full (the bookkeeping below is
        # updated as it goes).
        self._need_full = True
        try:
            touched = _Touched()
            if full:
                self._read_kernel()
                self._clear_wanted()
                touched.vs.update(self._vs)
                touched.addresses.update(self._addresses)
                touched.members.update((n, m) for n, ms in self._members.items() for m in ms)
            ctx = self._context(snapshot)
            self._replan(snapshot, changes, ctx, full or ctx != self._ctx, touched)
            self._ctx = ctx
            self._apply(touched, full)
        except BaseException as err:
            if not isinstance(err, KERNEL_ERRORS):
                raise
            self.sync_failures += 1
            raise SyncError(f"ipvs {self._family} sync failed: {err}") from err
        self._need_full = False

    def cleanup(self) -> None:
        """Remove our virtual servers, addresses, iptables chains and ipsets of this family.

        ``kube-ipvs0`` itself is deleted when no address is left on it (the other family's
        backend may still use it).
        """
        cleanup_family(
            self._family,
            ipvs=self._ipvs,
            links=self._links,
            ipsets=self._ipsets,
            iptables=self._iptables,
            device=self._device,
            exclude_cidrs=self._exclude,
            known=self._vs.values(),
        )
        if not self._links.addresses(self._device):
            self._links.delete_link(self._device)
        self._reset()

    # Planning ------------------------------------------------------------------------------

    def _context(self, snapshot: ProxySnapshot) -> RenderContext:
        family = self._family
        node_ips = snapshot.node.addresses_of(family)
        npa = snapshot.node_port_addresses
        candidates = node_ips if npa.match_all else npa.addresses
        node_port_ips = tuple(
            ip
            for ip in dict.fromkeys(candidates)
            if ip.version == family.version and not ip.is_loopback and not ip.is_link_local
        )
        return RenderContext(
            family,
            self._scheduler,
            node_port_ips,
            frozenset(node_ips),
            node_ips[0] if node_ips else None,
            snapshot.local_detector,
        )

    def _replan(
        self,
        snapshot: ProxySnapshot,
        changes: SyncChanges,
        ctx: RenderContext,
        everything: bool,
        touched: _Touched,
    ) -> None:
        names: list[ServicePortName]
        if everything:
            for name in list(self._plans):
                self._withdraw(name, touched)
            names = list(snapshot.services)
        else:
            names = []
            for service in sorted(changes.changed_services):
                for old in self._by_service.pop(service, set()):
                    self._withdraw(old, touched)
                names.extend(snapshot.ports_of(service))
        empty = CategorizedEndpoints()
        for name in names:
            port = snapshot.services[name]
            try:
                plan = render_port(port, snapshot.categorized.get(name, empty), ctx)
            except ValueError as err:
                log.warning("Skipping service port %s: %s", name, err)
                continue
            self._contribute(name, plan, touched)

    def _count_member(self, key: tuple[str, str], delta: int, touched: _Touched) -> None:
        refs = self._member_refs.get(key, 0) + delta
        if refs:
            self._member_refs[key] = refs
        else:
            del self._member_refs[key]
        if refs == 0 or (refs == 1 and delta == 1):
            self._set_sizes[key[0]] = self._set_sizes.get(key[0], 0) + delta
        touched.members.add(key)

    def _contribute(self, name: ServicePortName, plan: PortPlan, touched: _Touched) -> None:
        self._plans[name] = plan
        self._by_service.setdefault(name.service, set()).add(name)
        for server in plan.servers:
            key = server[0].key
            claims = self._claims.setdefault(key, {})
            if claims and name not in claims:
                log.warning(
                    "Service port %s also wants virtual server %s, which %s has",
                    name,
                    server[0],
                    min(claims),
                )
            claims[name] = server
            touched.vs.add(key)
        ipvs_ips = self._set_names[SetName.IPVS_IPS]
        for address in plan.addresses:
            self._address_refs[address] = self._address_refs.get(address, 0) + 1
            touched.addresses.add(address)
            self._count_member((ipvs_ips, member_ip(address)), 1, touched)
        for set_key, member in plan.members:
            self._count_member((self._set_names[set_key], member), 1, touched)
        for access in plan.no_node_access:
            self._access_refs[access] = self._access_refs.get(access, 0) + 1

    def _withdraw(self, name: ServicePortName, touched: _Touched) -> None:
        plan = self._plans.pop(name)
        ports = self._by_service.get(name.service)
        if ports is not None:
            ports.discard(name)
            if not ports:
                del self._by_service[name.service]
        for server in plan.servers:
            key = server[0].key
            claims = self._claims[key]
            del claims[name]
            if not claims:
                del self._claims[key]
            touched.vs.add(key)
        ipvs_ips = self._set_names[SetName.IPVS_IPS]
        for address in plan.addresses:
            refs = self._address_refs[address] - 1
            if refs:
                self._address_refs[address] = refs
            else:
                del self._address_refs[address]
            touched.addresses.add(address)
            self._count_member((ipvs_ips, member_ip(address)), -1, touched)
        for set_key, member in plan.members:
            self._count_member((self._set_names[set_key], member), -1, touched)
        for access in plan.no_node_access:
            refs = self._access_refs[access] - 1
            if refs:
                self._access_refs[access] = refs
            else:
                del self._access_refs[access]

    def _wanted_server(self, key: VSKey) -> ServerPlan | None:
        claims = self._claims.get(key)
        if not claims:
            return None
        # The first claimant in name order keeps a contested virtual server.
        return claims[min(claims)] if len(claims) > 1 else next(iter(claims.values()))

    # Kernel --------------------------------------------------------------------------------

    def _excluded(self, address: IPAddress) -> bool:
        return any(address in cidr for cidr in self._exclude)

    def _read_kernel(self) -> None:
        if self._sysctls is not None:
            self._sysctls(ipvs_sysctls(self._config.ipvs, self._family))
        settings = self._config.ipvs
        timeouts = (
            int(settings.tcp_timeout),
            int(settings.tcp_fin_timeout),
            int(settings.udp_timeout),
        )
        if any(timeouts):
            self._ipvs.set_timeouts(*timeouts)
        version = self._family.version
        self._links.ensure_link(self._device)
        self._addresses = _bindable(self._links.addresses(self._device), self._family)
        self._vs = {
            vs.key: vs for vs in self._ipvs.virtual_servers() if vs.address.version == version
        }
        self._rs = {
            key: {rs.key: rs for rs in self._ipvs.real_servers(vs)} for key, vs in self._vs.items()
        }
        names = list(self._set_names.values())
        saved = self._ipsets.save(names)
        self._members = {
            name: set(saved[name].members) if name in saved else set() for name in names
        }
        self._rules = None

    def _apply(self, touched: _Touched, full: bool) -> None:
        refs = self._member_refs
        current = self._members
        additions = sorted(
            (n, m) for n, m in touched.members if (n, m) in refs and m not in current.get(n, ())
        )
        deletions = sorted(
            (n, m) for n, m in touched.members if (n, m) not in refs and m in current.get(n, ())
        )
        batch = IPSetRestore()
        if full:
            for spec in self._specs.values():
                batch.create(spec)
        for name, member in additions:
            batch.add(name, member)
        self._ipsets.restore(batch)
        for name, member in additions:
            current.setdefault(name, set()).add(member)

        for address in sorted(touched.addresses, key=_address_order):
            if address in self._address_refs and address not in self._addresses:
                self._links.add_address(self._device, address)
                self._addresses.add(address)

        keys = sorted(touched.vs | {key for key, _ in self.terminating}, key=_vs_order)
        for key in keys:
            wanted = self._wanted_server(key)
            if wanted is not None:
                self._add_server(*wanted)

        inputs = RuleInputs(
            self._family,
            self._specs,
            frozenset(k for k, name in self._set_names.items() if self._set_sizes.get(name)),
            self._config.masquerade_mark,
            self._config.masquerade_all,
            self._ctx.local_detector if self._ctx is not None else LocalDetector(),
            tuple(sorted(self._access_refs, key=_access_order)),
        )
        text = render_rules(inputs).render()
        if full or text != self._rules:
            self._iptables.restore(self._family, text)
            self._rules = text
        if full:
            for jump in JUMPS:
                self._iptables.ensure_rule(self._family, jump.table, jump.chain, jump.args)

        for key in keys:
            self._remove_server(key, self._wanted_server(key))
        for address in sorted(touched.addresses, key=_address_order):
            if (
                address not in self._address_refs
                and address in self._addresses
                and not self._excluded(address)
            ):
                self._links.delete_address(self._device, address)
                self._addresses.discard(address)
        if deletions:
            batch = IPSetRestore()
            for name, member in deletions:
                batch.delete(name, member)
            self._ipsets.restore(batch)
            for name, member in deletions:
                current[name].discard(member)

    def _add_server(self, vs: VirtualServer, reals: tuple[RealServer, ...]) -> None:
        key = vs.key
        current_vs = self._vs.get(key)
        if current_vs is None:
            self._ipvs.add_virtual_server(vs)
            self._vs[key] = vs
            self._rs[key] = {}
        elif not current_vs.same_settings(vs):
            self._ipvs.update_virtual_server(vs)
            self._vs[key] = vs
        current = self._rs.setdefault(key, {})
        for rs in reals:
            have = current.get(rs.key)
            if have is None:
                self._ipvs.add_real_server(vs, rs)
                current[rs.key] = rs
            elif have.weight != rs.weight:
                self._ipvs.update_real_server(vs, rs)
                current[rs.key] = dataclasses.replace(have, weight=rs.weight)
            self.terminating.discard((key, rs.key))

    def _remove_server(self, key: VSKey, wanted: ServerPlan | None) -> None:
        vs = self._vs.get(key)
        if vs is None:
            return
        if wanted is None:
            if self._excluded(vs.address):
                return
            self._ipvs.delete_virtual_server(vs)
            del self._vs[key]
            self._rs.pop(key, None)
            self.terminating = {t for t in self.terminating if t[0] != key}
            return
        keep = {rs.key for rs in wanted[1]}
        extra = [rs for rs_key, rs in self._rs.get(key, {}).items() if rs_key not in keep]
        if extra:
            self._drain(vs, extra)

    def _drain(self, vs: VirtualServer, extra: list[RealServer]) -> None:
        """Delete real servers no longer wanted, or weight them 0 while connections last."""
        current = self._rs[vs.key]
        fresh: dict[RSKey, RealServer] = {}
        if vs.protocol in _GRACEFUL:
            fresh = {rs.key: rs for rs in self._ipvs.real_servers(vs)}
        for rs in extra:
            if vs.protocol in _GRACEFUL:
                live = fresh.get(rs.key)
                if live is None:  # gone already
                    current.pop(rs.key, None)
                    self.terminating.discard((vs.key, rs.key))
                    continue
                if live.connections:
                    if live.weight != 0:
                        self._ipvs.update_real_server(vs, dataclasses.replace(live, weight=0))
                    current[rs.key] = dataclasses.replace(live, weight=0)
                    self.terminating.add((vs.key, rs.key))
                    continue
            self._ipvs.delete_real_server(vs, rs)
            current.pop(rs.key, None)
            self.terminating.discard((vs.key, rs.key))


def _vs_order(key: VSKey) -> tuple[int, int, str, int]:
    return (key[0].version, int(key[0]), key[1].value, key[2])


def _bindable(addresses: Iterable[IPAddress], family: IPFamily) -> set[IPAddress]:
    """The service addresses among a link's: this family's, the kernel's link-local ones
    (IPv6 gives every link that is up one) left out, as upstream does."""
    return {a for a in addresses if a.version == family.version and not a.is_link_local}


def _address_order(address: IPAddress) -> tuple[int, int]:
    return (address.version, int(address))


def _access_order(key: AccessKey) -> tuple[int, int, str, int]:
    return (key[0].version, int(key[0]), key[1].value, key[2])


# Cleanup ---------------------------------------------------------------------------------------

_SERVICE_SETS = (
    SetName.CLUSTER_IP,
    SetName.EXTERNAL_IP,
    SetName.EXTERNAL_IP_LOCAL,
    SetName.LOAD_BALANCER,
    SetName.NODE_PORT_SCTP,
)
_NODE_PORT_SETS = {
    SetName.NODE_PORT_TCP: L4Protocol.TCP,
    SetName.NODE_PORT_UDP: L4Protocol.UDP,
}


def _ours(
    family: IPFamily, saved: Mapping[str, set[str]], addresses: set[IPAddress]
) -> tuple[set[str], set[tuple[str, int]]]:
    specs = set_specs(family)
    frontends: set[str] = set()
    for key in _SERVICE_SETS:
        frontends |= saved.get(specs[key].name, set())
    node_ports: set[tuple[str, int]] = set()
    for key, proto in _NODE_PORT_SETS.items():
        node_ports |= {(proto.lower, int(m)) for m in saved.get(specs[key].name, set())}
    frontends |= {f"{a}" for a in addresses}
    return frontends, node_ports


def cleanup_family(
    family: IPFamily,
    *,
    ipvs: IPVSExecutor | None,
    links: LinkExecutor,
    ipsets: IPSetExecutor,
    iptables: IptablesExecutor,
    device: str = DUMMY_DEVICE,
    exclude_cidrs: tuple[IPNetwork, ...] = (),
    known: Iterable[VirtualServer] = (),
    keep: Callable[[VirtualServer], bool] | None = None,
) -> list[VirtualServer]:
    """Remove ipvs mode's state of one family; raise the first error after trying it all.

    Our virtual servers are those of ``known``, those whose ``address,proto:port`` is in
    our service ipsets, whose address is on ``device``, or whose port is in our NodePort
    sets (``ipvs`` None, or a kernel without IPVS: skipped). Then the jumps and our
    chains, our ipsets, and this family's addresses on ``device``.

    With ``keep``, our virtual servers it holds true for stay, and so do their addresses
    and our ipsets (what tells a later cleanup those servers are ours); they are returned
    (:mod:`~kubeproxy.backends.ipvs.handover` keeps those with connections).
    """
    kept: list[VirtualServer] = []
    errors: list[Exception] = []
    specs = set_specs(family)
    names = [spec.name for spec in specs.values()]
    try:
        saved = {name: state.members for name, state in ipsets.save(names).items()}
    except IPSetError as err:
        errors.append(err)
        saved = {}
    try:
        addresses = _bindable(links.addresses(device), family)
    except LinkError as err:
        errors.append(err)
        addresses = set()
    if ipvs is not None:
        frontends, node_ports = _ours(family, saved, addresses)
        known_keys = {vs.key for vs in known}
        try:
            for vs in ipvs.virtual_servers():
                if vs.address.version != family.version:
                    continue
                if any(vs.address in cidr for cidr in exclude_cidrs):
                    continue
                mine = (
                    vs.key in known_keys
                    or str(vs.address) in frontends
                    or member_ip_port(vs.address, vs.protocol, vs.port) in frontends
                    or (vs.protocol.lower, vs.port) in node_ports
                )
                if mine and keep is not None and keep(vs):
                    kept.append(vs)
                elif mine:
                    ipvs.delete_virtual_server(vs)
        except IPVSError as err:
            if "kernel lacks" not in str(err):
                errors.append(err)
    try:
        existing = {table: iptables.chains(family, table) for table in ("filter", "nat")}
    except IptablesError as err:
        errors.append(err)
        existing = {}
    # A jump to a chain that does not exist cannot exist: without our chains (a node that
    # never ran ipvs mode) there is nothing to delete and no tool to run.
    for jump in JUMPS:
        if jump.target not in existing.get(jump.table, set()):
            continue
        try:
            iptables.delete_rule(family, jump.table, jump.chain, jump.args)
        except IptablesError as err:
            errors.append(err)
    text = cleanup_input(existing).render()
    if text:
        try:
            iptables.restore(family, text)
        except IptablesError:
            # One chain still referenced (say by iptables mode's chains) must not keep
            # the others: retry chain by chain and report what still fails.
            for table, chain in CHAINS:
                if chain not in existing.get(table, set()):
                    continue
                try:
                    iptables.restore(family, cleanup_input({table: {chain}}).render())
                except IptablesError as err:
                    errors.append(err)
    batch = IPSetRestore()
    for name in names:
        if name in saved and not kept:
            batch.destroy(name)
    try:
        ipsets.restore(batch)
    except IPSetError as err:
        errors.append(err)
    for address in sorted(addresses - {vs.address for vs in kept}, key=_address_order):
        try:
            links.delete_address(device, address)
        except LinkError as err:
            errors.append(err)
    if errors:
        raise errors[0]
    return kept
