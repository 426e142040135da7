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

import functools
import logging
import shlex
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from kubeproxy.backend import ProxySnapshot, SkippedPorts, SyncChanges, SyncError
from kubeproxy.backends.iptables.exec import IptablesError, IptablesExecutor, IptablesVariant
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
from kubeproxy.backends.iptables.nfacct import (
    COUNTERS,
    CT_STATE_INVALID_DROPPED,
    LOCALHOST_NODEPORTS_ACCEPTED,
    NFAcctError,
    NFAcctExecutor,
)
from kubeproxy.backends.iptables.restore import (
    BUILTIN_CHAINS,
    FILTER,
    MANGLE,
    NAT,
    NFT_CHAINS_PER_RESTORE,
    RestoreInput,
)
from kubeproxy.backends.iptables.rules import (
    FixedRules,
    PortRules,
    RenderContext,
    fixed_rules,
    jump_rules,
    localhost_node_ports,
    render_port,
)
from kubeproxy.config import LocalDetector, ProxierConfig
from kubeproxy.objects import (
    IPAddress,
    IPFamily,
    NamespacedName,
    ServicePortName,
)

__all__ = [
    "LARGE_CLUSTER_ENDPOINTS",
    "IptablesBackend",
    "cleanup_family",
    "cleanup_leftovers_family",
    "owns_chain",
]

log = logging.getLogger(__name__)

LARGE_CLUSTER_ENDPOINTS = 1000
"""Above this many endpoints (all Services), large-cluster mode: no per-endpoint comments,
and the ``iptables-save`` scan for stale chains at most once per sync period."""

# The mangle canary's one rule: checking for it with "iptables -C" is cheap (see
# IptablesBackend._canary_present).
_CANARY_RULE = ("-j", "RETURN")


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one sync will write, and the state to keep if the kernel takes it.

    ``texts`` are the restores to run in order (none: nothing changed); ``cluster_ips``
    counts the ports of each cluster IP; ``total`` and ``written`` count rules by table.
    """

    texts: tuple[str, ...]
    ports: dict[ServicePortName, PortRules]
    chains: set[str]
    cluster_ips: dict[str, int]
    total: dict[str, int]
    written: dict[str, int]


def _top_rules(rules: PortRules) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """A port's rules in the shared top-level chains, as ``(table, chain, rules)``."""
    return (
        (NAT, SERVICES, rules.nat_services),
        (NAT, NODEPORTS, rules.nat_nodeports),
        (FILTER, SERVICES, rules.filter_services),
        (FILTER, EXTERNAL_SERVICES, rules.filter_external),
        (FILTER, NODEPORTS, rules.filter_nodeports),
        (FILTER, PROXY_FIREWALL, rules.filter_firewall),
    )


def _count(counts: dict[str, int], key: str, delta: int) -> None:
    left = counts.get(key, 0) + delta
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _totals(
    ports: dict[ServicePortName, PortRules], fixed: FixedRules, cluster_ips: dict[str, int]
) -> tuple[int, int]:
    """Rules in our nat and filter chains (upstream's ``sync_proxy_rules_iptables_total``)."""
    nat = len(fixed.nat) + len(fixed.nat_tail)
    flt = len(fixed.filter)
    for rules in ports.values():
        nat += rules.nat_rules
        flt += rules.filter_rules
    if fixed.service_cidrs:
        flt += len(fixed.service_cidrs) + len(cluster_ips) + 1
    return nat, flt


class IptablesBackend:
    """The iptables backend of one IP family (see the module documentation).

    ``executor`` runs iptables-restore and friends (``IptablesCommands`` in production,
    ``FakeIptables`` in tests); ``clock`` is a monotonic clock in seconds;
    ``route_localnet`` is called (once, on a full sync) when localhost NodePorts need
    ``net.ipv4.conf.all.route_localnet=1`` in the node's namespace. ``nfacct`` makes
    upstream's packet counters (:data:`~kubeproxy.backends.iptables.nfacct.COUNTERS`) at
    construction; the rules count through each one that could be made
    (:attr:`nfacct_counters`), and :meth:`packet_counts` reads them.

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
        chains_per_restore: int | None = None,
        nfacct: NFAcctExecutor | None = None,
    ) -> None:
        self._family = family
        self._config = config
        self._executor = executor
        self._clock = clock
        self._route_localnet = route_localnet
        self._route_localnet_done = False
        self._chains_per_restore = chains_per_restore
        self.restore_failures = 0
        self.partial_restore_failures = 0
        self.rules_total: dict[str, int] = {FILTER: 0, NAT: 0}
        self.rules_last: dict[str, int] = {FILTER: 0, NAT: 0}
        self.last_sync_full = False
        self.large_cluster = False
        self._nfacct = nfacct
        self.nfacct_counters = _make_counters(nfacct)
        self._reset()

    def packet_counts(self) -> dict[str, int]:
        """The packets of each nfacct counter the rules use (a counter that cannot be
        read is logged and left out), for upstream's ``kubeproxy_iptables_*_packets``."""
        counts: dict[str, int] = {}
        if self._nfacct is None:
            return counts
        for name in sorted(self.nfacct_counters):
            try:
                counts[name] = self._nfacct.packets(name)
            except NFAcctError as err:
                log.error("Failed to read nfacct counter %s: %s", name, err)
        return counts

    def _reset(self) -> None:
        self._need_full = True
        self._need_scan = True
        self._last_scan: float | None = None
        self._last_canary: float | None = None
        self._ctx: RenderContext | None = None
        self._ctx_inputs: object = None
        self._ctx_built: RenderContext | None = None
        self._fixed: FixedRules | None = None
        self._cluster_ips: dict[str, int] = {}
        self._ports: dict[ServicePortName, PortRules] = {}
        self._by_service: dict[NamespacedName, set[ServicePortName]] = {}
        self._unrenderable = SkippedPorts(log)
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
            if not full and self._canary_due(now) and not self._canary_present():
                log.warning("iptables canary chain %s is gone: doing a full sync", CANARY)
                full = True
                self._need_scan = True
            large = self._count_endpoints(snapshot) > LARGE_CLUSTER_ENDPOINTS
            ctx = self._context_for(snapshot, large)
            if ctx != self._ctx:
                full = True  # every port's rules change (masquerading, detector, comments)
            fixed = self._fixed_for(snapshot)
            if fixed != self._fixed:
                full = True  # fixed rules, and the jumps to KUBE-FIREWALL, go with full syncs
            self.last_sync_full = full
            if full:
                scan = self._need_scan or not large or self._scan_due(now)
                plan = self._plan_full(snapshot, ctx, fixed, scan)
            else:
                plan = self._plan_partial(snapshot, changes, ctx, fixed)
            for text in plan.texts:
                self._executor.restore(self._family, text)
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
        self._fixed = fixed
        self.large_cluster = large
        self._ports = plan.ports
        self._chains = plan.chains
        self._cluster_ips = plan.cluster_ips
        self.rules_total = plan.total
        self.rules_last = plan.written
        self._index(snapshot, changes, full)
        if fixed.localnet_firewall and self._route_localnet and not self._route_localnet_done:
            try:
                self._route_localnet()
                self._route_localnet_done = True
            except OSError as err:
                log.error("cannot set route_localnet (localhost NodePorts will not work): %s", err)

    @property
    def executor(self) -> IptablesExecutor:
        """What runs the iptables tools (the self-healing watchers read its children)."""
        return self._executor

    def missing_canaries(self) -> list[str]:
        """The tables whose ``KUBE-PROXY-CANARY`` someone removed (or, in mangle, flushed):
        someone flushed those tables. Empty before our first full sync and while one is
        due (nothing to compare with). Checks in milliseconds (``iptables -C``/``-S``);
        a flushed mangle canary gets its rule back on the way.
        """
        if self._fixed is None or self._need_full:
            return []
        missing = [] if self._canary_present() else [MANGLE]
        for table in (NAT, FILTER):
            try:
                present = self._executor.chain_exists(self._family, table, CANARY)
            except IptablesError as err:
                log.debug("cannot look for the %s canary: %s", table, err)
                continue
            if not present:
                missing.append(table)
        return missing

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

    def _canary_due(self, now: float) -> bool:
        """As upstream's monitor: look for the canary at most once per sync period."""
        last = self._last_canary
        if last is not None and now - last < self._config.sync_period:
            return False
        self._last_canary = now
        return True

    def _canary_present(self) -> bool:
        """Whether the mangle canary still holds its rule (the chain, not flushed).

        ``iptables -C`` costs milliseconds; ``iptables-nft-save -t mangle`` reads the whole
        ruleset (0.3 s at 1k Services x 10 endpoints, 3.6 s at 10k, measured). The rule
        also tells a flushed canary from a present one, which an empty chain cannot.
        """
        try:
            added = self._executor.ensure_rule(
                self._family, MANGLE, CANARY, _CANARY_RULE, prepend=False
            )
        except IptablesError:
            return False  # no chain to add the rule to
        return not added

    def _scan_due(self, now: float) -> bool:
        last = self._last_scan
        return last is None or now - last >= self._config.sync_period

    def _context_for(self, snapshot: ProxySnapshot, large: bool) -> RenderContext:
        detector = snapshot.local_detector.for_family(self._family)
        addresses = snapshot.node.addresses_of(self._family)
        counter = None
        if LOCALHOST_NODEPORTS_ACCEPTED in self.nfacct_counters and localhost_node_ports(
            self._family, self._config.localhost_node_ports, snapshot.node_port_addresses
        ):
            counter = LOCALHOST_NODEPORTS_ACCEPTED
        inputs = (detector, addresses, large, counter)
        if self._ctx_built is not None and inputs == self._ctx_inputs:
            return self._ctx_built  # and a bad detector is logged once, not every sync
        self._ctx_inputs = inputs
        self._ctx_built = self._build_context(detector, addresses, large, counter)
        return self._ctx_built

    def _build_context(
        self,
        detector: LocalDetector,
        addresses: tuple[IPAddress, ...],
        large: bool,
        counter: str | None,
    ) -> RenderContext:
        try:
            return RenderContext.build(
                self._family,
                detector,
                masquerade_all=self._config.masquerade_all,
                node_addresses=addresses,
                endpoint_comments=not large,
                localhost_nodeport_counter=counter,
            )
        except ValueError as err:
            log.error("ignoring the local-traffic detector: %s", err)
            return RenderContext.build(
                self._family,
                type(detector)(),
                masquerade_all=self._config.masquerade_all,
                node_addresses=addresses,
                endpoint_comments=not large,
                localhost_nodeport_counter=counter,
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
            invalid_drop_counter=(
                CT_STATE_INVALID_DROPPED
                if CT_STATE_INVALID_DROPPED in self.nfacct_counters
                else None
            ),
        )

    def _render(
        self, snapshot: ProxySnapshot, name: ServicePortName, ctx: RenderContext
    ) -> PortRules | None:
        return self._unrenderable.render(snapshot, name, functools.partial(render_port, ctx))

    def _chunk_limit(self) -> int | None:
        if self._chains_per_restore is not None:
            return self._chains_per_restore
        if self._executor.variant is IptablesVariant.NFT:
            return NFT_CHAINS_PER_RESTORE
        return None

    def _plan_full(
        self, snapshot: ProxySnapshot, ctx: RenderContext, fixed: FixedRules, scan: bool
    ) -> _Plan:
        ports: dict[ServicePortName, PortRules] = {}
        for name in snapshot.services:
            rules = self._render(snapshot, name, ctx)
            if rules is not None:
                ports[name] = rules
        self._unrenderable.forget_missing(snapshot)
        if scan:
            present = {c for c in self._executor.chains(self._family, NAT) if is_service_chain(c)}
        else:
            present = set(self._chains)
        limit = self._chunk_limit()
        texts: list[str] = []
        nat = RestoreInput()
        if limit is not None:
            # The endpoint chains jump to KUBE-MARK-MASQ: it must exist before the first
            # chunk's chains (rewritten in the same restore, so its rule never goes away).
            nat.declare(NAT, MARK_MASQ)
            for chain, rule in fixed.nat:
                if chain == MARK_MASQ:
                    nat.append(NAT, chain, rule)
        wanted: set[str] = set()
        for rules in ports.values():
            # iptables-nft: restores of complete Services, each a consistent step; the
            # top-level chains still point at the old rules until the last restore.
            if limit is not None and nat.chain_count(NAT) >= limit:
                texts.append(nat.render())
                nat = RestoreInput()
            for spec in rules.chains:
                nat.declare(NAT, spec.name)
                wanted.add(spec.name)
                for rule in spec.rules:
                    nat.append(NAT, spec.name, rule)
        if limit is not None:
            if not nat.empty:
                texts.append(nat.render())
            nat = RestoreInput()
        flt = RestoreInput()
        for chain in sorted(present - wanted):
            nat.declare(NAT, chain)
            nat.delete_chain(NAT, chain)
        for chain in fixed.nat_chains:
            nat.declare(NAT, chain)
        for chain, rule in fixed.nat:
            nat.append(NAT, chain, rule)
        for chain in fixed.filter_chains:
            flt.declare(FILTER, chain)
        for chain, rule in fixed.filter:
            flt.append(FILTER, chain, rule)
        cluster_ips: dict[str, int] = {}
        for rules in ports.values():
            for table, chain, lines in _top_rules(rules):
                target = nat if table == NAT else flt
                for rule in lines:
                    target.append(table, chain, rule)
            cluster_ips[rules.cluster_ip] = cluster_ips.get(rules.cluster_ip, 0) + 1
        for rule in fixed.nat_tail:
            nat.append(NAT, SERVICES, rule)
        if fixed.service_cidrs:
            # Our extension (see the README): what nat left addressed to the service range.
            for cidr in fixed.service_cidrs:
                flt.append(FILTER, SERVICES, f"-d {cidr} -j {SERVICE_IPS}")
            for ip in cluster_ips:
                flt.append(FILTER, SERVICE_IPS, f"-d {ip} -j REJECT")
            flt.append(FILTER, SERVICE_IPS, "-j DROP")
        for table in (NAT, FILTER, MANGLE):
            (nat if table == NAT else flt).declare(table, CANARY)
        flt.append(MANGLE, CANARY, " ".join(_CANARY_RULE))
        texts.append(nat.render() + flt.render())
        nat_total, filter_total = _totals(ports, fixed, cluster_ips)
        return _Plan(
            tuple(texts),
            ports,
            wanted,
            cluster_ips,
            {NAT: nat_total, FILTER: filter_total},
            {NAT: nat_total, FILTER: filter_total},
        )

    def _plan_partial(
        self,
        snapshot: ProxySnapshot,
        changes: SyncChanges,
        ctx: RenderContext,
        fixed: FixedRules,
    ) -> _Plan:
        """Chains of the changed ports, and ``-D``/``-I`` of their top-level rules only.

        Rewriting a top-level chain costs iptables-nft seconds at 10k Services (every jump
        in it is re-resolved); replacing the few rules that changed costs milliseconds.
        Per-port rules go first (``-I``), so the fixed rules at the end stay last.
        """
        names: set[ServicePortName] = set()
        for service in changes.changed_services:
            names.update(self._by_service.get(service, ()))
            names.update(snapshot.ports_of(service))
        ports = dict(self._ports)
        cluster_ips = dict(self._cluster_ips)
        nat = RestoreInput()
        flt = RestoreInput()
        inputs = {NAT: nat, FILTER: flt}
        old_chains: set[str] = set()
        new_chains: set[str] = set()
        deletes: list[tuple[str, str, str]] = []
        inserts: list[tuple[str, str, str]] = []
        cip_before = dict(cluster_ips)
        written = {NAT: 0, FILTER: 0}
        for name in sorted(names):
            old = ports.get(name)
            rules = self._render(snapshot, name, ctx)
            if old is None and rules is None:
                continue
            old_top = {(t, c): lines for t, c, lines in _top_rules(old)} if old else {}
            new_top = {(t, c): lines for t, c, lines in _top_rules(rules)} if rules else {}
            for key in old_top.keys() | new_top.keys():
                before = old_top.get(key, ())
                after = new_top.get(key, ())
                kept = set(before) & set(after)
                deletes.extend((*key, r) for r in before if r not in kept)
                inserts.extend((*key, r) for r in after if r not in kept)
            if old is not None:
                old_chains.update(old.chain_names)
                _count(cluster_ips, old.cluster_ip, -1)
            if rules is not None:
                for spec in rules.chains:
                    nat.declare(NAT, spec.name)
                    new_chains.add(spec.name)
                    for rule in spec.rules:
                        nat.append(NAT, spec.name, rule)
                    written[NAT] += len(spec.rules)
                _count(cluster_ips, rules.cluster_ip, 1)
                # A changed port keeps its place in the dict; a new one goes last.
                ports[name] = rules
            else:
                del ports[name]
        if fixed.service_cidrs:
            for ip in cip_before.keys() | cluster_ips.keys():
                was, now = ip in cip_before, ip in cluster_ips
                if was and not now:
                    deletes.append((FILTER, SERVICE_IPS, f"-d {ip} -j REJECT"))
                elif now and not was:
                    inserts.append((FILTER, SERVICE_IPS, f"-d {ip} -j REJECT"))
        for table, top, rule in deletes:
            inputs[table].delete_rule(table, top, rule)
            written[table] += 1
        for table, top, rule in inserts:
            inputs[table].insert(table, top, rule)
            written[table] += 1
        chains = set(self._chains)
        for stale in sorted((old_chains - new_chains) & chains):
            nat.declare(NAT, stale)
            nat.delete_chain(NAT, stale)
            chains.discard(stale)
        chains |= new_chains
        texts = () if nat.empty and flt.empty else (nat.render() + flt.render(),)
        nat_total, filter_total = _totals(ports, fixed, cluster_ips)
        return _Plan(
            texts, ports, chains, cluster_ips, {NAT: nat_total, FILTER: filter_total}, written
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


def owns_chain(table: str, name: str) -> bool:
    """Whether ``name`` in ``table`` is a chain iptables mode makes (kubelet's are not)."""
    return name in _OUR_CHAINS.get(table, ()) or name.startswith(_CLEANUP_PREFIXES)


def _target(words: list[str]) -> str | None:
    for flag in ("-j", "-g"):
        if flag in words:
            index = words.index(flag)
            if index + 1 < len(words):
                return words[index + 1]
    return None


def _make_counters(nfacct: NFAcctExecutor | None) -> frozenset[str]:
    """Make upstream's nfacct counters; the names that exist now (rules may use them)."""
    made: set[str] = set()
    if nfacct is None:
        return frozenset()
    for name in COUNTERS:
        try:
            nfacct.ensure(name)
        except NFAcctError as err:
            log.error(
                "Failed to create nfacct counter %s; the corresponding metric will not be "
                "updated: %s",
                name,
                err,
            )
            continue
        made.add(name)
    return frozenset(made)


def cleanup_family(
    executor: IptablesExecutor,
    family: IPFamily,
    tables: Collection[str] = (NAT, FILTER, MANGLE),
) -> None:
    """Remove every chain iptables-mode kube-proxy makes, and the jumps to them.

    Reads each of ``tables`` (of nat, filter and mangle: pass only those that exist where
    reading one would create it, as with iptables-legacy) with ``iptables-save``; deletes
    the rules of built-in chains that jump to one of our chains, then flushes and deletes
    our chains in one restore per table. Kubelet's ``KUBE-FIREWALL``,
    ``KUBE-KUBELET-CANARY`` and ``KUBE-IPTABLES-HINT`` and every other chain are left
    alone. Raises :class:`IptablesError` on failure.
    """
    for table in (NAT, FILTER, MANGLE):
        if table not in tables:
            continue
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


def cleanup_leftovers_family(
    executor: IptablesExecutor,
    family: IPFamily,
    tables: Collection[str] = (NAT, FILTER, MANGLE),
) -> bool:
    """Remove the chain only our iptables mode makes, ``KUBE-SERVICE-IPS``, once nothing
    jumps to it; whether it was removed.

    Upstream's iptables mode rewrites filter ``KUBE-SERVICES`` without our jumps to it at
    its first sync and never deletes a chain of that name, so after a handback it stays,
    unused, until this runs. While a rule still jumps to it (our proxy still runs), it is
    left alone. Raises :class:`IptablesError` on failure.
    """
    if FILTER not in tables:
        return False
    text = executor.save(family, FILTER)
    if f":{SERVICE_IPS} " not in text:
        return False
    for line in text.splitlines():
        if line.startswith("-A ") and _target(line.split()) == SERVICE_IPS:
            log.info("%s %s is still in use: left in place", family, SERVICE_IPS)
            return False
    restore = RestoreInput()
    restore.declare(FILTER, SERVICE_IPS)
    restore.delete_chain(FILTER, SERVICE_IPS)
    executor.restore(family, restore.render())
    return True
