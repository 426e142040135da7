"""IptablesBackend: keeps upstream's iptables-mode chains in step with the core's snapshots.

Like upstream's "minimize iptables-restore", every sync is one ``iptables-restore
--noflush`` that rewrites the top-level chains whole; a **partial sync** adds only the
chains of the changed Services, a **full sync** (first sync, periodic, after a failure,
after someone flushed our chains) rewrites every chain, re-ensures the jumps from the
built-in chains and deletes the per-service chains ``iptables-save`` shows that no port
needs any more.

The restore text puts the ``nat`` block before the ``filter`` block: iptables-restore
commits table by table, and ``nat`` is where a refusal can come from (a foreign rule still
jumping to a chain we delete, a kernel without a match); when it is refused nothing at all
has changed. ``filter`` holds only rules with built-in targets and our own chains.
"""

from __future__ import annotations

import logging
import shlex
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kubeproxy.backend import ProxySnapshot, SyncChanges, SyncError
from kubeproxy.backends.iptables.exec import IptablesError, IptablesExecutor
from kubeproxy.backends.iptables.naming import (
    CANARY,
    EXTERNAL_SERVICES,
    FORWARD,
    MARK_MASQ,
    NODEPORTS,
    PER_SERVICE_PREFIXES,
    POSTROUTING,
    PROXY_FIREWALL,
    SERVICE_IPS,
    SERVICES,
    is_service_chain,
)
from kubeproxy.backends.iptables.restore import (
    BUILTIN_CHAINS,
    FILTER,
    MANGLE,
    NAT,
    RestoreInput,
)
from kubeproxy.backends.iptables.rules import (
    FixedRules,
    PortRules,
    RenderContext,
    fixed_rules,
    jump_rules,
    render_port,
)
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import CategorizedEndpoints, IPFamily, NamespacedName, ServicePortName

__all__ = ["LARGE_CLUSTER_ENDPOINTS", "IptablesBackend", "cleanup_family"]

log = logging.getLogger(__name__)

LARGE_CLUSTER_ENDPOINTS = 1000
"""Above this many endpoints (all Services), large-cluster mode: no per-endpoint comments,
and the ``iptables-save`` scan for stale chains at most once per sync period."""

_EMPTY = CategorizedEndpoints()


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one sync will write, and the state to keep if the kernel takes it."""

    text: str
    ports: dict[ServicePortName, PortRules]
    chains: set[str]
    nat_rules: int
    filter_rules: int
    nat_written: int
    filter_written: int


class IptablesBackend:
    """The iptables backend of one IP family (see the module documentation).

    ``executor`` runs iptables-restore and friends (``IptablesCommands`` in production,
    ``FakeIptables`` in tests); ``clock`` is a monotonic clock in seconds;
    ``route_localnet`` is called (once, on a full sync) when localhost NodePorts need
    ``net.ipv4.conf.all.route_localnet=1`` in the node's namespace.

    Metrics, read by the command's sync hook: :attr:`restore_failures`,
    :attr:`partial_restore_failures` (counters) and :attr:`rules_total` /
    :attr:`rules_last` (by table, ``"filter"`` and ``"nat"``: rules in our chains now, and
    rules written by the last sync, as upstream's ``sync_proxy_rules_iptables_total`` and
    ``..._last``). For tests and logs: :attr:`last_sync_full`, :attr:`large_cluster`.
    """

    def __init__(
        self,
        family: IPFamily,
        config: ProxierConfig,
        *,
        executor: IptablesExecutor,
        clock: Callable[[], float] = time.monotonic,
        route_localnet: Callable[[], None] | None = None,
    ) -> None:
        self._family = family
        self._config = config
        self._executor = executor
        self._clock = clock
        self._route_localnet = route_localnet
        self._route_localnet_done = False
        self.restore_failures = 0
        self.partial_restore_failures = 0
        self.rules_total: dict[str, int] = {FILTER: 0, NAT: 0}
        self.rules_last: dict[str, int] = {FILTER: 0, NAT: 0}
        self.last_sync_full = False
        self.large_cluster = False
        self._reset()

    def _reset(self) -> None:
        self._need_full = True
        self._need_scan = True
        self._last_scan: float | None = None
        self._ctx: RenderContext | None = None
        self._localnet: bool | None = None
        self._ports: dict[ServicePortName, PortRules] = {}
        self._by_service: dict[NamespacedName, set[ServicePortName]] = {}
        self._invalid: dict[ServicePortName, str] = {}
        # Per-service chains we believe are in the kernel's nat table.
        self._chains: set[str] = set()

    # Backend protocol -----------------------------------------------------------------------

    @property
    def family(self) -> IPFamily:
        """The IP family this backend programs."""
        return self._family

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Make the kernel match ``snapshot`` with one iptables-restore.

        Raises :class:`~kubeproxy.backend.SyncError` when the kernel refused it; the
        previous rules stay (see the module documentation) and the next sync is full.
        """
        if snapshot.family is not self._family:
            raise ValueError(f"snapshot of {snapshot.family} given to the {self._family} backend")
        now = self._clock()
        full = changes.full or self._need_full
        try:
            if not full and CANARY not in self._executor.chains(self._family, MANGLE):
                log.warning("iptables canary chain %s is gone: doing a full sync", CANARY)
                full = True
                self._need_scan = True
            large = self._count_endpoints(snapshot) > LARGE_CLUSTER_ENDPOINTS
            ctx = self._context_for(snapshot, large)
            if ctx != self._ctx:
                full = True  # every port's rules change (masquerading, detector, comments)
            fixed = self._fixed_for(snapshot)
            if fixed.localnet_firewall != self._localnet:
                full = True  # the jumps to KUBE-FIREWALL come and go with full syncs
            self.last_sync_full = full
            if full:
                scan = self._need_scan or not large or self._scan_due(now)
                plan = self._plan_full(snapshot, ctx, fixed, scan)
            else:
                plan = self._plan_partial(snapshot, changes, ctx, fixed)
            self._executor.restore(self._family, plan.text)
            if full:
                self._ensure_jumps(fixed)
        except IptablesError as err:
            self._need_full = True
            self._need_scan = True
            self.restore_failures += 1
            if not full:
                self.partial_restore_failures += 1
            raise SyncError(f"iptables {self._family} sync failed: {err}") from err
        except BaseException:
            self._need_full = True
            self._need_scan = True
            raise
        if full:
            if scan:
                self._last_scan = now
            self._need_scan = False
        self._need_full = False
        self._ctx = ctx
        self._localnet = fixed.localnet_firewall
        self.large_cluster = large
        self._ports = plan.ports
        self._chains = plan.chains
        self.rules_total = {FILTER: plan.filter_rules, NAT: plan.nat_rules}
        self.rules_last = {FILTER: plan.filter_written, NAT: plan.nat_written}
        self._index(snapshot, changes, full)
        if fixed.localnet_firewall and self._route_localnet and not self._route_localnet_done:
            try:
                self._route_localnet()
                self._route_localnet_done = True
            except OSError as err:
                log.error("cannot set route_localnet (localhost NodePorts will not work): %s", err)

    def cleanup(self) -> None:
        """Remove every chain and jump rule iptables mode made in this family; forget state."""
        cleanup_family(self._executor, self._family)
        self._reset()

    # Planning ---------------------------------------------------------------------------------

    def _count_endpoints(self, snapshot: ProxySnapshot) -> int:
        total = 0
        for endpoints in snapshot.endpoints.values():
            total += len(endpoints)
        return total

    def _scan_due(self, now: float) -> bool:
        last = self._last_scan
        return last is None or now - last >= self._config.sync_period

    def _context_for(self, snapshot: ProxySnapshot, large: bool) -> RenderContext:
        detector = snapshot.local_detector.for_family(self._family)
        addresses = snapshot.node.addresses_of(self._family)
        try:
            return RenderContext.build(
                self._family,
                detector,
                masquerade_all=self._config.masquerade_all,
                node_addresses=addresses,
                endpoint_comments=not large,
            )
        except ValueError as err:
            log.error("ignoring the local-traffic detector: %s", err)
            return RenderContext.build(
                self._family,
                type(detector)(),
                masquerade_all=self._config.masquerade_all,
                node_addresses=addresses,
                endpoint_comments=not large,
            )

    def _fixed_for(self, snapshot: ProxySnapshot) -> FixedRules:
        config = self._config
        return fixed_rules(
            self._family,
            masquerade_mark=config.masquerade_mark,
            node_port_addresses=snapshot.node_port_addresses,
            localhost_node_ports_enabled=config.localhost_node_ports,
            tcp_be_liberal=config.tcp_be_liberal,
            service_cidrs=snapshot.service_cidrs or config.service_cidrs,
        )

    def _render(
        self, snapshot: ProxySnapshot, name: ServicePortName, ctx: RenderContext
    ) -> PortRules | None:
        port = snapshot.services.get(name)
        if port is None:
            self._invalid.pop(name, None)
            return None
        try:
            rules = render_port(ctx, port, snapshot.categorized.get(name, _EMPTY))
        except ValueError as err:
            reason = str(err)
            if self._invalid.get(name) != reason:
                log.error("skipping service port %s: %s", name, reason)
            self._invalid[name] = reason
            return None
        self._invalid.pop(name, None)
        return rules

    def _plan_full(
        self, snapshot: ProxySnapshot, ctx: RenderContext, fixed: FixedRules, scan: bool
    ) -> _Plan:
        ports: dict[ServicePortName, PortRules] = {}
        for name in snapshot.services:
            rules = self._render(snapshot, name, ctx)
            if rules is not None:
                ports[name] = rules
        for name in [n for n in self._invalid if n not in snapshot.services]:
            del self._invalid[name]
        if scan:
            present = {c for c in self._executor.chains(self._family, NAT) if is_service_chain(c)}
        else:
            present = set(self._chains)
        nat = RestoreInput()
        wanted: set[str] = set()
        nat_rules = 0
        for rules in ports.values():
            for chain in rules.chains:
                nat.declare(NAT, chain.name)
                wanted.add(chain.name)
                for rule in chain.rules:
                    nat.append(NAT, chain.name, rule)
                nat_rules += len(chain.rules)
        stale = sorted(present - wanted)
        return self._finish(nat, ports, ports, wanted, stale, fixed, nat_rules, nat_rules, True)

    def _plan_partial(
        self,
        snapshot: ProxySnapshot,
        changes: SyncChanges,
        ctx: RenderContext,
        fixed: FixedRules,
    ) -> _Plan:
        names: set[ServicePortName] = set()
        for service in changes.changed_services:
            names.update(self._by_service.get(service, ()))
            names.update(snapshot.ports_of(service))
        ports = dict(self._ports)
        changed: dict[ServicePortName, PortRules] = {}
        old_chains: set[str] = set()
        for name in sorted(names):
            old = ports.get(name)
            if old is not None:
                old_chains.update(old.chain_names)
            rules = self._render(snapshot, name, ctx)
            # A changed port keeps its place in the top-level chains; a new one goes last.
            if rules is not None:
                ports[name] = rules
                changed[name] = rules
            elif old is not None:
                del ports[name]
        nat = RestoreInput()
        chains = set(self._chains)
        new_chains: set[str] = set()
        written = 0
        for rules in changed.values():
            for chain in rules.chains:
                nat.declare(NAT, chain.name)
                new_chains.add(chain.name)
                for rule in chain.rules:
                    nat.append(NAT, chain.name, rule)
                written += len(chain.rules)
        stale = sorted((old_chains - new_chains) & chains)
        chains -= set(stale)
        chains |= new_chains
        total = sum(r.nat_rule_count for r in ports.values())
        return self._finish(nat, ports, changed, chains, stale, fixed, total, written, False)

    def _finish(
        self,
        nat: RestoreInput,
        ports: dict[ServicePortName, PortRules],
        written_ports: dict[ServicePortName, PortRules],
        chains: set[str],
        stale: Iterable[str],
        fixed: FixedRules,
        nat_rules: int,
        nat_written: int,
        full: bool,
    ) -> _Plan:
        """Add the top-level chains, stale-chain deletions and the canaries; render."""
        del written_ports  # the per-port chains are already in ``nat``
        for chain in stale:
            nat.declare(NAT, chain)
            nat.delete_chain(NAT, chain)
        top_nat = 0
        for chain in fixed.nat_chains:
            nat.declare(NAT, chain)
        for chain, rule in fixed.nat:
            nat.append(NAT, chain, rule)
            top_nat += 1
        for rules in ports.values():
            for rule in rules.nat_services:
                nat.append(NAT, SERVICES, rule)
            for rule in rules.nat_nodeports:
                nat.append(NAT, NODEPORTS, rule)
            top_nat += len(rules.nat_services) + len(rules.nat_nodeports)
        for rule in fixed.nat_tail:
            nat.append(NAT, SERVICES, rule)
        top_nat += len(fixed.nat_tail)

        other = RestoreInput()
        for chain in fixed.filter_chains:
            other.declare(FILTER, chain)
        filter_rules = 0
        for chain, rule in fixed.filter:
            other.append(FILTER, chain, rule)
            filter_rules += 1
        cluster_ips: dict[str, None] = {}
        for rules in ports.values():
            for rule in rules.filter_services:
                other.append(FILTER, SERVICES, rule)
            for rule in rules.filter_external:
                other.append(FILTER, EXTERNAL_SERVICES, rule)
            for rule in rules.filter_nodeports:
                other.append(FILTER, NODEPORTS, rule)
            for rule in rules.filter_firewall:
                other.append(FILTER, PROXY_FIREWALL, rule)
            filter_rules += (
                len(rules.filter_services)
                + len(rules.filter_external)
                + len(rules.filter_nodeports)
                + len(rules.filter_firewall)
            )
            cluster_ips[rules.cluster_ip] = None
        if fixed.service_cidrs:
            # Our extension (see the README): what nat left addressed to the service range.
            for cidr in fixed.service_cidrs:
                other.append(FILTER, SERVICES, f"-d {cidr} -j {SERVICE_IPS}")
            for ip in cluster_ips:
                other.append(FILTER, SERVICE_IPS, f"-d {ip} -j REJECT")
            other.append(FILTER, SERVICE_IPS, "-j DROP")
            filter_rules += len(fixed.service_cidrs) + len(cluster_ips) + 1
        if full:
            for table in (NAT, FILTER, MANGLE):
                (nat if table == NAT else other).declare(table, CANARY)
        return _Plan(
            nat.render() + other.render(),
            ports,
            chains,
            nat_rules + top_nat,
            filter_rules,
            nat_written + top_nat,
            filter_rules,
        )

    def _ensure_jumps(self, fixed: FixedRules) -> None:
        for jump in jump_rules(localnet_firewall=fixed.localnet_firewall):
            self._executor.ensure_rule(self._family, jump.table, jump.chain, jump.args)

    def _index(self, snapshot: ProxySnapshot, changes: SyncChanges, full: bool) -> None:
        """Remember every port of the snapshot by Service (a deleted Service's ports too)."""
        if full:
            by_service: dict[NamespacedName, set[ServicePortName]] = {}
            for name in snapshot.services:
                by_service.setdefault(name.service, set()).add(name)
            self._by_service = by_service
            return
        for service in changes.changed_services:
            names = set(snapshot.ports_of(service))
            if names:
                self._by_service[service] = names
            else:
                self._by_service.pop(service, None)


_OUR_CHAINS = {
    FILTER: frozenset(
        (SERVICES, EXTERNAL_SERVICES, FORWARD, NODEPORTS, PROXY_FIREWALL, SERVICE_IPS, CANARY)
    ),
    NAT: frozenset((SERVICES, NODEPORTS, POSTROUTING, MARK_MASQ, CANARY)),
    MANGLE: frozenset((CANARY,)),
}
# Older kube-proxy versions called the Local-policy chains KUBE-XLB-.
_CLEANUP_PREFIXES = (*PER_SERVICE_PREFIXES, "KUBE-XLB-")


def _target(words: list[str]) -> str | None:
    for flag in ("-j", "-g"):
        if flag in words:
            index = words.index(flag)
            if index + 1 < len(words):
                return words[index + 1]
    return None


def cleanup_family(executor: IptablesExecutor, family: IPFamily) -> None:
    """Remove every chain iptables-mode kube-proxy makes, and the jumps to them.

    Reads each table with ``iptables-save``; deletes the rules of built-in chains that
    jump to one of our chains, then flushes and deletes our chains in one restore per
    table. Kubelet's ``KUBE-FIREWALL``, ``KUBE-KUBELET-CANARY`` and ``KUBE-IPTABLES-HINT``
    and every other chain are left alone. Raises :class:`IptablesError` on failure.
    """
    for table in (NAT, FILTER, MANGLE):
        text = executor.save(family, table)
        fixed = _OUR_CHAINS[table]
        ours = sorted(
            name
            for line in text.splitlines()
            if line.startswith(":")
            and ((name := line[1:].split(" ", 1)[0]) in fixed or name.startswith(_CLEANUP_PREFIXES))
        )
        if not ours:
            continue
        mine = set(ours)
        builtins = set(BUILTIN_CHAINS[table])
        for line in text.splitlines():
            if not line.startswith("-A "):
                continue
            try:
                words = shlex.split(line)
            except ValueError:
                continue
            if len(words) > 2 and words[1] in builtins and _target(words) in mine:
                executor.delete_rule(family, table, words[1], words[2:])
        restore = RestoreInput()
        for name in ours:
            restore.declare(table, name)
        for name in ours:
            restore.delete_chain(table, name)
        executor.restore(family, restore.render())
