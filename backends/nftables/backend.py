"""NftablesBackend: the map structure, kept in step with the core's snapshots.

Why this shape (measured on these machines; ``make bench`` shows it side by side): the
kernel re-validates a whole table whenever a commit adds a rule or a verdict element
that can jump, goto or NAT (12 ms in a near-empty table on these machines, growing with
every chain), libnftables lists a table's chains and sets before every run, and each
commit walks every chain of the namespace. So the table has a few dozen chains whatever
the cluster's size, and everything per Service is *data* (see
:mod:`~kubeproxy.backends.nftables.frontends` and
:mod:`~kubeproxy.backends.nftables.layout`):

* an **incremental sync** renders the changed Service ports, diffs them frontend by
  frontend against what it last wrote, and commits one transaction of element additions
  and deletions (endpoints keep their slot numbers, so one endpoint changed is one slot
  rewritten). A class or pick that appears for the first time adds its chain and one
  rule, the only case that makes the kernel validate the table.
* a **full sync** (start, restart, the periodic one, after a failure) never reads rules
  or elements back: it writes a complete new *generation* of the containers, class and
  pick chains next to the current one, in bounded transactions, then rewrites the fixed
  chains to read the new generation in one atomic transaction. New connections are
  served by the old generation until that switch and by the new one after it; a table
  left by another version (the per-Service-chain structure included) is switched over
  the same way. Whatever the kernel held that the new generation does not use is
  deleted at least a second later, in its own transaction (older kernels still count a
  chain as used right after the last reference goes).

Nothing is listed on an incremental sync; a full sync lists only chain and set names.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kubeproxy.backend import (
    NodePortAddresses,
    ProxySnapshot,
    SkippedPorts,
    SyncChanges,
    SyncError,
)
from kubeproxy.backends.nftables.claims import Claims
from kubeproxy.backends.nftables.elements import ElementBatch
from kubeproxy.backends.nftables.exec import NftExecutor, delete_table
from kubeproxy.backends.nftables.frontends import (
    KIND_IP,
    ClassSpec,
    Dedicated,
    Frontend,
    PortPlan,
    endpoint_value,
    plan_port,
)
from kubeproxy.backends.nftables.layout import (
    AFFINITY_RECORD,
    FIXED_CHAINS,
    NODEPORT_FRONTENDS,
    SERVICE_FRONTENDS,
    GenNames,
    Pick,
    affinity_rules,
    class_chain,
    class_rule,
    element_types,
    fixed_chains,
    generation_of,
    pick_chain,
    picks_of,
    public_containers,
)
from kubeproxy.backends.nftables.objects import (
    Chain,
    Family,
    Map,
    NftError,
    Set,
    Table,
)
from kubeproxy.backends.nftables.services import (
    AFFINITY6_MAP_TYPE,
    Key,
    RenderContext,
    context_or_default,
)
from kubeproxy.backends.nftables.structure import (
    AFFINITY_TIMEOUT,
    TABLE,
    TABLE_COMMENT,
    ContainerSpec,
    FamilyTokens,
    FixedChain,
    Names,
    tokens_for,
)
from kubeproxy.backends.nftables.support import check_support
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPFamily, NamespacedName, ServicePortName

__all__ = ["NftablesBackend"]

log = logging.getLogger(__name__)

STALE_DELAY = 1.0
"""Seconds between the last reference to an object going and its deletion."""
AFFINITY6_MAP_SIZE = 65536
"""Entries per per-port IPv6 affinity map (clients of one Service port)."""

_FAMILIES = {IPFamily.IPV4: Family.IP, IPFamily.IPV6: Family.IP6}
_SHARED = (Names.CLUSTER_IPS, Names.HAIRPIN_ENDPOINTS)
_VALUE_NONE: tuple[str, ...] = ()


@dataclass(slots=True)
class _Held:
    """One frontend as the kernel holds it: its plan and its endpoint slots."""

    fe: Frontend
    main: tuple[str, ...]
    short: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _PortState:
    """What one programmed Service port has in the kernel (beyond its frontends)."""

    keys: tuple[Key, ...]
    firewall: tuple[tuple[Key, tuple[str, ...]], ...]
    set_elements: tuple[tuple[str, Key], ...]
    dedicated: Dedicated | None


_SLOT_TEXTS = tuple(str(i) for i in range(1024))


def _slot_text(index: int) -> str:
    # One string per slot number, shared by every key that has it.
    return _SLOT_TEXTS[index] if index < len(_SLOT_TEXTS) else str(index)


def restitch(old: tuple[str, ...], new: tuple[str, ...]) -> tuple[str, ...]:
    """Slots for the endpoints ``new``, moving as few as possible from ``old``.

    An endpoint that stays keeps its slot; a new one takes a freed slot (or the end);
    when the list shrinks, the last slots move into the holes. Choosing by ``numgen
    random mod N`` stays uniform whatever the order.
    """
    if old == new or not old:
        return old if old == new else new
    wanted = set(new)
    slots: list[str | None] = [e if e in wanted else None for e in old]
    placed = {e for e in slots if e is not None}
    incoming = [e for e in new if e not in placed]
    taken = 0
    for index, value in enumerate(slots):
        if value is None and taken < len(incoming):
            slots[index] = incoming[taken]
            taken += 1
    slots.extend(incoming[taken:])
    while None in slots:
        hole = slots.index(None)
        last = slots.pop()
        if hole < len(slots):
            slots[hole] = last
    return tuple(s for s in slots if s is not None)


class _Ops:
    """Element changes of one sync, committed in bounded transactions.

    Deletions go before additions (a slot rewritten is a delete and an add of the same
    key) and each container's elements share commands. :meth:`cut` commits once the
    budget is spent; callers call it only between frontends, so the changes of one
    frontend are always in one transaction.
    """

    def __init__(self, backend: NftablesBackend, budget: int) -> None:
        self._backend = backend
        self._budget = budget
        self.tx = backend._new_transaction()
        self._deletes: dict[str, list[Key]] = {}
        self._adds: dict[str, list[tuple[Key, tuple[str, ...]]]] = {}
        self._count = 0
        self.operations = 0
        self.transactions = 0

    def delete(self, container: str, key: Key) -> None:
        self._deletes.setdefault(container, []).append(key)
        self._count += 1

    def add(self, container: str, key: Key, value: tuple[str, ...] = _VALUE_NONE) -> None:
        self._adds.setdefault(container, []).append((key, value))
        self._count += 1

    def cut(self) -> None:
        if self._count >= self._budget:
            self.commit()

    def commit(self) -> None:
        """Commit what is queued: the chains and sets of :attr:`tx` first (nft text),
        then the elements as one netlink batch when every container's types allow it,
        else as part of the same text transaction (which keeps them atomic with it)."""
        tx = self.tx
        types = self._backend._element_types
        deletes, adds = self._deletes, self._adds
        self._deletes, self._adds, self._count = {}, {}, 0
        self.tx = self._backend._new_transaction()
        if all(c in types for c in (*deletes, *adds)):
            self._run(tx)
            batch = ElementBatch(
                tx.family,
                tx.table,
                types,
                [(c, k) for c, keys in deletes.items() for k in keys],
                [(c, k, v) for c, items in adds.items() for k, v in items],
            )
            if len(batch):
                self._backend._executor.write_elements(batch)
                self.operations += len(batch)
                self.transactions += 1
            return
        for container, keys in deletes.items():
            for key in keys:
                tx.delete_element(container, key)
        for container, items in adds.items():
            tx.add_elements(container, items)
        self._run(tx)

    def _run(self, tx: Transaction) -> None:
        if tx.num_operations:
            self._backend._run(tx)
            self.operations += tx.num_operations
            self.transactions += 1


@dataclass(frozen=True, slots=True)
class _Inputs:
    """Everything the fixed chains and the render context depend on; a change of any of
    it makes the next sync a full one (a new generation)."""

    context: object
    match_all_nodeports: bool
    nodeport_ips: tuple[Key, ...]
    service_cidrs: tuple[str, ...]


class NftablesBackend:
    """The nftables backend of one IP family (see the module documentation).

    ``executor`` runs transactions and lists names (``LibNftables`` in production,
    ``FakeNft`` in tests and dry runs); ``clock`` is a monotonic clock in seconds;
    ``elements_per_transaction`` bounds a transaction (and so libnftables' memory and
    the time the kernel holds its commit lock). Counters for metrics:
    :attr:`sync_failures`, :attr:`stale_chain_failures` (failed deletions of unused
    objects), :attr:`affinity_cleanup_failures`; for tests and logs:
    :attr:`last_operations`, :attr:`last_transactions`, :attr:`last_sync_full`,
    :attr:`generation`.
    """

    def __init__(
        self,
        family: IPFamily,
        config: ProxierConfig,
        *,
        executor: NftExecutor,
        clock: Callable[[], float] = time.monotonic,
        elements_per_transaction: int = 10_000,
        support_check: bool = True,
    ) -> None:
        if elements_per_transaction < 1:
            raise ValueError("elements_per_transaction must be at least 1")
        self._family = family
        self._nft_family = _FAMILIES[family]
        self._tokens: FamilyTokens = tokens_for(family)
        self._config = config
        self._executor = executor
        self._clock = clock
        self.elements_per_transaction = elements_per_transaction
        self.sync_failures = 0
        self.stale_chain_failures = 0
        self.affinity_cleanup_failures = 0
        self.last_operations = 0
        self.last_transactions = 0
        self.last_sync_full = False
        self.generation: int | None = None
        """The generation the fixed chains read (None before the first full sync)."""
        if support_check:
            check_support(executor, self._nft_family)
        # "chain NAME" / "set NAME" of objects nothing uses any more -> since when.
        self._stale: dict[str, float] = {}
        self._base_recreated = False
        self._claims = Claims(log)
        self._unrenderable = SkippedPorts(log)
        self._need_full = True
        self._inputs: _Inputs | None = None
        self._ctx: RenderContext | None = None
        self._node_ports: NodePortAddresses | None = None
        self._nodeport_keys: tuple[Key, ...] = ()
        self._reset_model(0)

    def _reset_model(self, gen: int) -> None:
        self._names = GenNames(gen)
        self._ports: dict[ServicePortName, _PortState] = {}
        self._by_service: dict[NamespacedName, set[ServicePortName]] = {}
        self._held: dict[Key, _Held] = {}
        self._refs: dict[str, dict[Key, int]] = {name: {} for name in _SHARED}
        self._classes: list[ClassSpec] = []
        self._picks: set[Pick] = set()
        self._affinity: list[tuple[str, int]] = []
        self._dedicated_chains: set[str] = set()
        self._dedicated_maps: set[str] = set()
        # Affinity frontends whose entries may point astray, and IPv6 per-port maps.
        self._affinity_losses: set[Key] = set()
        self._map_losses: dict[str, frozenset[str]] = {}
        # The data types of every container whose elements go over netlink.
        self._element_types: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}

    # Backend protocol -------------------------------------------------------------------

    @property
    def family(self) -> IPFamily:
        """The IP family this backend programs."""
        return self._family

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Make the kernel match ``snapshot`` (see the module documentation).

        Raises :class:`~kubeproxy.backend.SyncError` when nft refused a transaction; the
        rules the fixed chains read stay as they were, and the next sync is a full one.
        """
        if snapshot.family is not self._family:
            raise ValueError(f"snapshot of {snapshot.family} given to the {self._family} backend")
        now = self._clock()
        self._delete_stale(now)
        inputs = self._inputs_of(snapshot)
        full = changes.full or self._need_full or inputs != self._inputs
        self.last_sync_full = full
        try:
            if full:
                ops = self._full_sync(snapshot, inputs, now)
            else:
                ops = self._partial_sync(snapshot, changes, now)
        except BaseException as err:
            self._need_full = True
            if not isinstance(err, NftError):
                raise
            self.sync_failures += 1
            raise SyncError(f"nftables {self._nft_family} sync failed: {err}") from err
        self._need_full = False
        self.last_operations = ops.operations
        self.last_transactions = ops.transactions
        self._clean_affinity(full)

    def cleanup(self) -> None:
        """Delete our table (a missing table is fine) and forget all state."""
        delete_table(self._executor, self._nft_family, TABLE)
        self._reset_model(0)
        self._stale.clear()
        self.generation = None
        self._need_full = True

    # Plumbing ---------------------------------------------------------------------------

    def _new_transaction(self) -> Transaction:
        return Transaction(self._nft_family, TABLE)

    def _run(self, tx: Transaction) -> None:
        if tx.error is not None:
            raise tx.error
        self._executor.run(tx)

    def _inputs_of(self, snapshot: ProxySnapshot) -> _Inputs:
        detector = snapshot.local_detector.for_family(self._family)
        addresses = snapshot.node.addresses_of(self._family)
        context = (detector, self._config.masquerade_all, addresses)
        if self._inputs is None or self._inputs.context != context or self._ctx is None:
            self._ctx = context_or_default(
                self._tokens,
                detector,
                masquerade_all=self._config.masquerade_all,
                node_addresses=addresses,
                logger=log,
            )
        node_ports = snapshot.node_port_addresses
        if node_ports != self._node_ports:
            # Resolved (and a loopback address logged) once per change, not every sync.
            self._node_ports = node_ports
            self._nodeport_keys = (
                () if node_ports.match_all else self._nodeport_ips(node_ports.addresses)
            )
        cidrs = snapshot.service_cidrs or self._config.service_cidrs
        return _Inputs(
            context,
            node_ports.match_all,
            self._nodeport_keys,
            tuple(str(c) for c in cidrs if c.version == self._family.version),
        )

    def _nodeport_ips(self, addresses: Iterable[Any]) -> tuple[Key, ...]:
        out: list[Key] = []
        for ip in addresses:
            if ip.version != self._family.version:
                continue
            if ip.is_loopback:
                log.error("skipping NodePort address %s: localhost NodePorts are not supported", ip)
                continue
            if (str(ip),) not in out:
                out.append((str(ip),))
        return tuple(out)

    def _plan(self, snapshot: ProxySnapshot, name: ServicePortName) -> PortPlan | None:
        assert self._ctx is not None
        return self._unrenderable.render(snapshot, name, functools.partial(plan_port, self._ctx))

    # Full sync --------------------------------------------------------------------------

    def _full_sync(self, snapshot: ProxySnapshot, inputs: _Inputs, now: float) -> _Ops:
        chains, sets = self._list_names()
        gens = [g for n in (*chains, *sets) if (g := generation_of(n)) is not None]
        gen = max([*gens, self.generation or 0]) + 1
        self._reset_model(gen)
        self._inputs = inputs
        claims = self._claims
        claims.reset()
        plans: dict[ServicePortName, PortPlan] = {}
        for name in snapshot.services:
            self._by_service.setdefault(name.service, set()).add(name)
            plan = self._plan(snapshot, name)
            if plan is not None:
                plans[name] = plan
                claims.claim(name, plan.claims)
        self._unrenderable.forget_missing(snapshot)
        if claims.unsettled:
            claims.resolve()
        for name in claims.skipped:
            plans.pop(name, None)

        # Every chain and container the elements need, then the elements in bounded
        # transactions, then the switch; nothing of the new generation is read before it.
        ops = _Ops(self, self.elements_per_transaction)
        tx = ops.tx
        tx.add(Table(comment=TABLE_COMMENT))
        for spec in (*public_containers(self._tokens), *self._names.containers(self._tokens)):
            self._declare(tx, spec)
        for chain in self._fixed_chains():
            if chain.hook is None:
                tx.add_chain(chain.name)
        for plan in plans.values():
            self._add_structure(tx, plan, chains)
        ops.commit()
        for name, plan in plans.items():
            self._ports[name] = self._apply_port(ops, None, plan)
            ops.cut()
        ops.commit()
        switch = self._new_transaction()
        self._write_switch(switch)
        self._run(switch)
        ops.transactions += 1
        ops.operations += switch.num_operations
        self._base_recreated = True
        self.generation = gen

        wanted = self._wanted_names()
        for kind, present in (("chain", chains), ("set", sets)):
            for found in present:
                if f"{kind} {found}" not in wanted:
                    self._stale.setdefault(f"{kind} {found}", now)
        for key in [k for k in self._stale if k in wanted]:
            del self._stale[key]
        return ops

    def _declare(self, tx: Transaction, spec: ContainerSpec) -> None:
        """Queue ``add`` of a container, and note its element types if netlink can send
        its elements."""
        _add_container(tx, spec)
        types = element_types(spec, self._tokens)
        if types is not None:
            self._element_types[spec.name] = types

    def _list_names(self) -> tuple[set[str], set[str]]:
        ex = self._executor
        if not ex.table_exists(self._nft_family, TABLE):
            return set(), set()
        chains = set(ex.list_chains(self._nft_family, TABLE))
        return chains, set(ex.list_sets(self._nft_family, TABLE))

    def _wanted_names(self) -> set[str]:
        names = self._names
        wanted = {f"chain {n}" for n in FIXED_CHAINS}
        wanted.update(f"set {c.name}" for c in public_containers(self._tokens))
        wanted.update(f"set {c.name}" for c in names.containers(self._tokens))
        for spec in self._classes:
            wanted.add(f"chain {names.cls(spec)}")
            wanted.add(f"set {names.cls(spec)}")
        wanted.update(f"chain {names.pick(p)}" for p in self._picks)
        wanted.update(f"set {names.affinity(kind, t)}" for kind, t in self._affinity)
        wanted.update(f"chain {c}" for c in self._dedicated_chains)
        wanted.update(f"set {m}" for m in self._dedicated_maps)
        return wanted

    def _fixed_chains(self) -> tuple[FixedChain, ...]:
        inputs = self._inputs
        assert inputs is not None
        return fixed_chains(
            self._names,
            self._tokens,
            masquerade_mark=self._config.masquerade_mark,
            match_all_nodeports=inputs.match_all_nodeports,
            service_cidrs=inputs.service_cidrs,
            classes=self._classes,
            affinity=self._affinity,
        )

    def _write_switch(self, tx: Transaction) -> None:
        """Point the fixed chains at the new generation, and refill the public sets."""
        assert self._inputs is not None
        fixed = self._fixed_chains()
        for chain in fixed:
            if chain.hook is None:
                continue
            if not self._base_recreated:
                # A base chain's priority cannot change in place, and a table left by
                # another version may have them elsewhere: re-create them, atomically.
                tx.add(Chain(chain.name))
                tx.delete(Chain(chain.name))
            tx.add(Chain(chain.name, chain.type, chain.hook, chain.priority))
        for chain in fixed:
            tx.flush(Chain(chain.name))
        for chain in fixed:
            tx.add_rules(chain.name, chain.rules)
        tx.flush(Set(Names.CLUSTER_IPS, self._tokens.addr_type))
        tx.add_elements(
            Names.CLUSTER_IPS, [(k, _VALUE_NONE) for k in self._refs[Names.CLUSTER_IPS]]
        )
        tx.flush(Set(Names.NODEPORT_IPS, self._tokens.addr_type))
        tx.add_elements(Names.NODEPORT_IPS, [(k, _VALUE_NONE) for k in self._inputs.nodeport_ips])

    # Incremental sync -------------------------------------------------------------------

    def _partial_sync(self, snapshot: ProxySnapshot, changes: SyncChanges, now: float) -> _Ops:
        ports: set[ServicePortName] = set()
        for service in changes.changed_services:
            ports.update(self._by_service.get(service, ()))
            ports.update(snapshot.ports_of(service))
        claims = self._claims
        plans: dict[ServicePortName, PortPlan | None] = {}
        for name in sorted(ports):
            claims.release(name)
            plans[name] = plan = self._plan(snapshot, name)
            if plan is not None:
                claims.claim(name, plan.claims)
        if claims.unsettled:
            for name in claims.resolve():
                if name not in plans:
                    plans[name] = self._plan(snapshot, name)
        for name in plans:
            if name in claims.skipped:
                plans[name] = None
        ops = _Ops(self, self.elements_per_transaction)
        chains = self._dedicated_chains
        for plan in plans.values():
            if plan is not None:
                self._add_structure(ops.tx, plan, chains)
        # Old frontends of every port in question first, so a key that moves from one
        # port to another in this sync is diffed once, against what the kernel holds.
        old: dict[Key, _Held] = {}
        old_states: dict[ServicePortName, _PortState] = {}
        for name in plans:
            state = self._ports.pop(name, None)
            if state is not None:
                old_states[name] = state
                for key in state.keys:
                    held = self._held.pop(key, None)
                    if held is not None:
                        old[key] = held
        new: dict[Key, Frontend] = {}
        for plan in plans.values():
            for fe in plan.frontends if plan is not None else ():
                new[fe.key] = fe
        for key in sorted(old.keys() | new.keys()):
            self._diff_frontend(ops, key, old.get(key), new.get(key))
            ops.cut()
        for name, plan in plans.items():
            self._diff_port(ops, old_states.get(name), plan, now, full=False)
            if plan is not None:
                self._ports[name] = self._port_state(plan)
            if name in snapshot.services:
                self._by_service.setdefault(name.service, set()).add(name)
            else:
                members = self._by_service.get(name.service)
                if members is not None:
                    members.discard(name)
                    if not members:
                        del self._by_service[name.service]
        self._unrenderable.forget_missing(snapshot)
        ops.commit()
        return ops

    # Structure on demand ----------------------------------------------------------------

    def _add_structure(self, tx: Transaction, plan: PortPlan, chains: set[str]) -> None:
        """Queue the classes, picks, affinity sets and IPv6 affinity chains ``plan`` needs
        and the current generation lacks (``chains`` are chains known to exist)."""
        names, tokens = self._names, self._tokens
        assert self._ctx is not None
        for fe in plan.frontends:
            cls = fe.cls
            if cls is not None and cls not in self._classes:
                for pick in picks_of(cls):
                    if pick not in self._picks:
                        chain = pick_chain(names, pick, tokens)
                        tx.add_chain(chain.name)
                        tx.add_rules(chain.name, chain.rules)
                        self._picks.add(pick)
                self._declare(tx, names.class_set(cls, tokens))
                chain = class_chain(names, cls, self._ctx)
                tx.add_chain(chain.name)
                tx.add_rules(chain.name, chain.rules)
                frontends = SERVICE_FRONTENDS if cls.kind == KIND_IP else NODEPORT_FRONTENDS
                if self.generation == names.gen:
                    tx.add_rule(frontends, class_rule(names, cls, tokens))
                self._classes.append(cls)
            if fe.affinity and (fe.kind, fe.affinity) not in self._affinity:
                self._declare(tx, names.affinity_set(fe.kind, fe.affinity, tokens))
                if self.generation == names.gen:
                    tx.add_rules(
                        AFFINITY_RECORD, affinity_rules(names, fe.kind, fe.affinity, tokens)
                    )
                self._affinity.append((fe.kind, fe.affinity))
        dedicated = plan.dedicated
        if dedicated is None:
            return
        for map_name, _hosts in dedicated.maps:
            if map_name in self._dedicated_maps:
                continue
            if self._stale.pop(f"set {map_name}", None) is None:
                tx.add(
                    Map(
                        map_name,
                        AFFINITY6_MAP_TYPE,
                        ("dynamic", "timeout"),
                        AFFINITY_TIMEOUT,
                        AFFINITY6_MAP_SIZE,
                    )
                )
            self._dedicated_maps.add(map_name)
        for spec in dedicated.chains:
            if spec.name in self._dedicated_chains:
                continue
            # A content-named chain the kernel still holds has these very rules.
            stale = self._stale.pop(f"chain {spec.name}", None)
            if stale is None and spec.name not in chains:
                tx.add_chain(spec.name)
                tx.add_rules(spec.name, spec.rules)
            self._dedicated_chains.add(spec.name)

    # Element diffs ----------------------------------------------------------------------

    def _apply_port(self, ops: _Ops, old: _PortState | None, plan: PortPlan) -> _PortState:
        """Queue everything of ``plan`` on an empty generation (full syncs)."""
        for fe in plan.frontends:
            self._diff_frontend(ops, fe.key, None, fe)
        self._diff_port(ops, old, plan, 0.0, full=True)
        return self._port_state(plan)

    @staticmethod
    def _port_state(plan: PortPlan) -> _PortState:
        return _PortState(
            tuple(fe.key for fe in plan.frontends), plan.firewall, plan.set_elements, plan.dedicated
        )

    def _diff_frontend(self, ops: _Ops, key: Key, old: _Held | None, new: Frontend | None) -> None:
        """Queue the element changes that turn frontend ``old`` into ``new``."""
        names = self._names
        before = old.fe if old is not None else None
        if before is not None and before == new:
            self._held[key] = old  # type: ignore[assignment]
            return
        kind = (new or before).kind  # type: ignore[union-attr]
        old_cls = before.cls if before else None
        new_cls = new.cls if new else None
        if old_cls != new_cls:
            if old_cls is not None:
                ops.delete(names.cls(old_cls), key)
            if new_cls is not None:
                ops.add(names.cls(new_cls), key)
        proto = key[1] if kind == KIND_IP else key[0]
        main = self._slots(
            ops,
            names.slots(kind, False, proto),
            key,
            old.main if old else (),
            new.endpoints if new else (),
        )
        short = self._slots(
            ops,
            names.slots(kind, True, proto),
            key,
            old.short if old else (),
            new.shortcut if new else (),
        )
        old_ne = before.no_endpoint if before else None
        new_ne = new.no_endpoint if new else None
        if old_ne != new_ne:
            if old_ne is not None:
                ops.delete(names.no_endpoint(kind, old_ne), key)
            if new_ne is not None:
                ops.add(names.no_endpoint(kind, new_ne), key)
        old_aff = before.affinity if before else 0
        new_aff = new.affinity if new else 0
        if old_aff != new_aff:
            if old_aff:
                ops.delete(names.affinity(kind, old_aff), key)
            if new_aff:
                ops.add(names.affinity(kind, new_aff), key)
        if old_aff and (not new_aff or not set(old.main) <= set(main)):  # type: ignore[union-attr]
            self._affinity_losses.add(key)
        old_ded = before.dedicated if before else None
        new_ded = new.dedicated if new else None
        if old_ded != new_ded:
            vmap = names.dedicated_ips if kind == KIND_IP else names.dedicated_nodeports
            if old_ded is not None:
                ops.delete(vmap, key)
            if new_ded is not None:
                ops.add(vmap, key, (f"goto {new_ded}",))
        if new is not None:
            self._held[key] = _Held(new, main, short)

    @staticmethod
    def _slots(
        ops: _Ops, container: str, key: Key, old: tuple[str, ...], endpoints: tuple[str, ...]
    ) -> tuple[str, ...]:
        if not old:
            # A new frontend (every frontend of a full sync): its endpoints in order.
            for index, endpoint in enumerate(endpoints):
                ops.add(container, (*key, _slot_text(index)), endpoint_value(endpoint))
            return endpoints
        slots = restitch(old, endpoints)
        if slots == old:
            return old
        for index in range(max(len(old), len(slots))):
            before = old[index] if index < len(old) else None
            after = slots[index] if index < len(slots) else None
            if before == after:
                continue
            slot = (*key, _slot_text(index))
            if before is not None:
                ops.delete(container, slot)
            if after is not None:
                ops.add(container, slot, endpoint_value(after))
        return slots

    def _diff_port(
        self, ops: _Ops, old: _PortState | None, plan: PortPlan | None, now: float, *, full: bool
    ) -> None:
        """Queue the firewall, shared-set and IPv6 affinity changes of one port.

        On a full sync ``cluster-ips`` is refilled by the switch, not element by element.
        """
        names = self._names
        old_fw = dict(old.firewall) if old else {}
        new_fw = dict(plan.firewall) if plan else {}
        for key in old_fw.keys() | new_fw.keys():
            before, after = old_fw.get(key, ()), new_fw.get(key, ())
            if before == after:
                continue
            if before and not after:
                ops.delete(names.firewall_ips, key)
            if after and not before:
                ops.add(names.firewall_ips, key)
            for source in before:
                if source not in after:
                    ops.delete(names.firewall_allow, (*key, source))
            for source in after:
                if source not in before:
                    ops.add(names.firewall_allow, (*key, source))
        refs = self._refs
        for container, key in plan.set_elements if plan else ():
            counts = refs[container]
            counts[key] = counts.get(key, 0) + 1
            if counts[key] == 1:
                if container == Names.HAIRPIN_ENDPOINTS:
                    ops.add(names.hairpin, key)
                elif not full:
                    ops.add(container, key)
        for container, key in old.set_elements if old else ():
            counts = refs[container]
            left = counts.get(key, 0) - 1
            if left > 0:
                counts[key] = left
                continue
            counts.pop(key, None)
            ops.delete(names.hairpin if container == Names.HAIRPIN_ENDPOINTS else container, key)
        old_maps = dict(old.dedicated.maps) if old and old.dedicated else {}
        new_maps = dict(plan.dedicated.maps) if plan and plan.dedicated else {}
        for map_name, hosts in old_maps.items():
            if map_name not in new_maps:
                self._stale.setdefault(f"set {map_name}", now)
                self._dedicated_maps.discard(map_name)
            elif not hosts <= new_maps[map_name]:
                self._map_losses[map_name] = new_maps[map_name]
        new_chains = {c.name for c in plan.dedicated.chains} if plan and plan.dedicated else set()
        for spec in old.dedicated.chains if old and old.dedicated else ():
            if spec.name not in new_chains:
                self._stale.setdefault(f"chain {spec.name}", now)
                self._dedicated_chains.discard(spec.name)

    # Unused objects and affinity entries -------------------------------------------------

    def _delete_stale(self, now: float) -> None:
        """Delete the objects unused for at least :data:`STALE_DELAY`, in one transaction.

        Verdict maps go first (their elements hold chains), then chains (those that jump
        before their targets), then the other sets and maps (rules of the deleted chains
        read them). A refusal is counted and logged; the objects are tried again later.
        """
        due = [name for name, since in self._stale.items() if now - since >= STALE_DELAY]
        if not due:
            return
        due.sort(key=_deletion_order)
        tx = self._new_transaction()
        for entry in due:
            kind, _, name = entry.partition(" ")
            if kind == "chain":
                tx.delete_chain(name)
            else:
                tx.delete(Set(name, "ipv4_addr"))
        try:
            self._run(tx)
        except NftError as err:
            self.stale_chain_failures += 1
            log.error("deleting %d unused chains, sets and maps failed: %s", len(due), err)
            # Forget what is gone already (someone deleted it); retry the rest later.
            chains, sets = self._list_names()
            present = {f"chain {c}" for c in chains} | {f"set {c}" for c in sets}
            for entry in due:
                if entry in present:
                    self._stale[entry] = now
                else:
                    del self._stale[entry]
            return
        for entry in due:
            del self._stale[entry]

    def _clean_affinity(self, full: bool) -> None:
        """Best effort: delete affinity entries that point at endpoints no longer in use.

        After a full sync every entry is checked; after an incremental one only entries of
        frontends that lost endpoints, lost affinity or went away.
        """
        if self._family is IPFamily.IPV6:
            self._clean_affinity_maps(full)
            return
        losses = self._affinity_losses
        self._affinity_losses = set()
        if not full and not losses:
            return
        try:
            entries = self._executor.list_elements(self._nft_family, TABLE, Names.AFFINITY)
        except NftError as err:
            self.affinity_cleanup_failures += 1
            log.warning("listing session affinity entries failed: %s", err)
            return
        tx = self._new_transaction()
        for entry in entries:
            if len(entry.key) != 4:
                continue
            held = self._held.get(entry.key[1:])
            scope: Key = entry.key[1:]
            if held is None or not held.fe.affinity:
                held = self._held.get(entry.key[2:])
                scope = entry.key[2:]
            if not full and scope not in losses and entry.key[1:] not in losses:
                continue
            if held is not None and held.fe.affinity:
                allowed = {endpoint_value(e) for e in (*held.main, *held.short)}
                if entry.value in allowed:
                    continue
            tx.delete_element(Names.AFFINITY, entry.key)
        self._run_cleanup(tx)

    def _clean_affinity_maps(self, full: bool) -> None:
        """The same for the per-port IPv6 affinity maps (``client : endpoint``)."""
        losses = self._map_losses
        self._map_losses = {}
        if full:
            losses = {}
            for state in self._ports.values():
                if state.dedicated is not None:
                    losses.update(state.dedicated.maps)
        for name, allowed in losses.items():
            if name not in self._dedicated_maps:
                continue
            try:
                entries = self._executor.list_elements(self._nft_family, TABLE, name)
            except NftError as err:
                self.affinity_cleanup_failures += 1
                log.warning("listing session affinity map %s failed: %s", name, err)
                continue
            tx = self._new_transaction()
            for entry in entries:
                if entry.value and entry.value[0] not in allowed:
                    tx.delete_element(name, entry.key)
            self._run_cleanup(tx)

    def _run_cleanup(self, tx: Transaction) -> None:
        if not tx.num_operations:
            return
        try:
            self._run(tx)
        except NftError as err:
            # An entry may have timed out meanwhile; the next cleanup catches up.
            self.affinity_cleanup_failures += 1
            log.warning("deleting %d stale session affinity entries failed: %s", len(tx), err)


_VERDICT_MAPS = frozenset(
    {
        Names.SERVICE_IPS,
        Names.SERVICE_NODEPORTS,
        Names.FIREWALL_IPS,
        Names.NO_ENDPOINT_SERVICES,
        Names.NO_ENDPOINT_NODEPORTS,
    }
)
# Chains that jump or go to others are deleted before their targets.
_CHAIN_RANKS = (
    ("internal-", 0),
    ("external-", 0),
    ("nodeport-", 0),
    ("firewall-", 0),
    ("service-", 1),
    ("local-", 1),
    ("pick", 2),
    ("group-", 2),
)


def _deletion_order(entry: str) -> tuple[int, int, str]:
    kind, _, name = entry.partition(" ")
    if kind == "set":
        verdicts = name in _VERDICT_MAPS or name.startswith("dedicated-")
        return (0 if verdicts else 2, 0, name)
    rank = next((r for prefix, r in _CHAIN_RANKS if name.startswith(prefix)), 3)
    return (1, rank, name)


def _add_container(tx: Transaction, spec: ContainerSpec) -> None:
    kind = Map if spec.is_map else Set
    tx.add(
        kind(spec.name, spec.type, spec.flags, spec.timeout, spec.size, spec.comment, spec.typeof)
    )
