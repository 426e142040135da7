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
from collections.abc import Callable, Iterable, Iterator
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
    AFFINITY_LOCAL_ENDPOINTS,
    KIND_IP,
    KIND_NODEPORT,
    AffinityPlan,
    ClassSpec,
    Frontend,
    PortPlan,
    endpoint_value,
    plan_port,
)
from kubeproxy.backends.nftables.layout import (
    DISPATCH_RULES,
    DISPATCH_TREE,
    NODEPORT_FRONTENDS,
    SERVICE_FRONTENDS,
    GenNames,
    Pick,
    affinity_container,
    affinity_dispatch_chains,
    class_bits,
    class_chain,
    class_numbers,
    class_rule,
    element_types,
    fixed_chain_names,
    fixed_chains,
    generation_of,
    pick_chain,
    picks_of,
    public_containers,
    tree_chains,
    tree_depth,
)
from kubeproxy.backends.nftables.objects import (
    Chain,
    Family,
    Map,
    NftError,
    Set,
    Table,
)
from kubeproxy.backends.nftables.support import check_support
from kubeproxy.backends.nftables.table import (
    TABLE,
    TABLE_COMMENT,
    ContainerSpec,
    FamilyTokens,
    FixedChain,
    Key,
    Names,
    RenderContext,
    context_or_default,
    tokens_for,
)
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.config import ProxierConfig
from kubeproxy.featuregates import KUBE_PROXY_NFTABLES_LOCALHOST_NODEPORTS
from kubeproxy.objects import IPFamily, NamespacedName, ServicePortName

__all__ = ["NftablesBackend"]

log = logging.getLogger(__name__)

STALE_DELAY = 1.0
"""Seconds between the last reference to an object going and its deletion."""

_FAMILIES = {IPFamily.IPV4: Family.IP, IPFamily.IPV6: Family.IP6}
_KINDS = (KIND_IP, KIND_NODEPORT)
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
    cluster_ip: str
    hairpin: tuple[str, ...]
    affinity: AffinityPlan | None


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

    Elements of containers whose types :mod:`~kubeproxy.backends.nftables.elements`
    packs go as one netlink batch; the others (interval and verdict maps: source ranges,
    affinity dispatch) as nft text. A commit runs, in order: the chains and sets queued
    in :attr:`tx` with the text additions (and the text deletions of keys re-added), then
    the netlink batch (deletions first: a rewritten slot is a delete and an add), then the
    remaining text deletions. So a frontend's firewall elements are in before the batch
    that dispatches it, and out only after the batch that stops dispatching it; affinity
    verdicts likewise. :meth:`cut` commits once the budget is spent; callers call it only
    between frontends, so one frontend's netlink changes are always in one transaction.
    """

    def __init__(self, backend: NftablesBackend, budget: int, *, text_last: bool = False) -> None:
        self._backend = backend
        self._budget = budget
        # Full syncs: nothing reads the generation yet, so its text elements can wait for
        # one transaction at the end (each libnftables run lists the table first: 70 runs
        # took 6 s of a 30k-Service cold sync of the realistic mix).
        self._text_last = text_last
        self._types = backend._element_types
        self.tx = backend._new_transaction()
        self._deletes: dict[str, list[Key]] = {}
        self._adds: dict[str, list[tuple[Key, tuple[str, ...]]]] = {}
        self._text_deletes: dict[str, list[Key]] = {}
        self._text_adds: dict[str, list[tuple[Key, tuple[str, ...]]]] = {}
        self._count = 0
        self.operations = 0
        self.transactions = 0

    def delete(self, container: str, key: Key) -> None:
        target = self._deletes if container in self._types else self._text_deletes
        target.setdefault(container, []).append(key)
        self._count += 1

    def add(self, container: str, key: Key, value: tuple[str, ...] = _VALUE_NONE) -> None:
        target = self._adds if container in self._types else self._text_adds
        target.setdefault(container, []).append((key, value))
        self._count += 1

    def cut(self) -> None:
        if self._count >= self._budget:
            self.commit()

    def commit(self, *, last: bool = False) -> None:
        """Commit what is queued (see the class documentation); ``last`` ends the sync
        (text elements held back until then go too)."""
        tx = self.tx
        deletes, adds = self._deletes, self._adds
        self._deletes, self._adds, self._count = {}, {}, 0
        if self._text_last and not last:
            text_deletes, text_adds = {}, {}
        else:
            text_deletes, text_adds = self._text_deletes, self._text_adds
            self._text_deletes, self._text_adds = {}, {}
        self.tx = self._backend._new_transaction()
        later: dict[str, list[Key]] = {}
        for container, keys in text_deletes.items():
            readded = {k for k, _v in text_adds.get(container, ())}
            for key in keys:
                if key in readded:
                    tx.delete_element(container, key)
                else:
                    later.setdefault(container, []).append(key)
        for container, items in text_adds.items():
            tx.add_elements(container, items)
        self._run(tx)
        batch = ElementBatch(
            tx.family,
            tx.table,
            self._types,
            [(c, k) for c, keys in deletes.items() for k in keys],
            [(c, k, v) for c, items in adds.items() for k, v in items],
        )
        if len(batch):
            self._backend._executor.write_elements(batch)
            self.operations += len(batch)
            self.transactions += 1
        if later:
            final = self._backend._new_transaction()
            for container, keys in later.items():
                for key in keys:
                    final.delete_element(container, key)
            self._run(final)

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
    the time the kernel holds its commit lock); ``dispatch`` picks how a connection finds
    its class (:data:`~kubeproxy.backends.nftables.layout.DISPATCH_TREE`, or the
    benchmarks' :data:`~kubeproxy.backends.nftables.layout.DISPATCH_RULES`). Counters for
    metrics: :attr:`sync_failures`, :attr:`stale_chain_failures` (failed deletions of
    unused objects), :attr:`affinity_cleanup_failures`; for tests and logs:
    :attr:`last_operations`, :attr:`last_transactions`, :attr:`last_sync_full`,
    :attr:`generation`. ``kept`` names objects (``chain NAME``, ``set NAME``) that another
    part of this proxy keeps in our table (localhost NodePorts' reject rules): never
    deleted as unused.
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
        dispatch: str = DISPATCH_TREE,
        kept: Iterable[str] = (),
    ) -> None:
        if elements_per_transaction < 1:
            raise ValueError("elements_per_transaction must be at least 1")
        if dispatch not in (DISPATCH_TREE, DISPATCH_RULES):
            raise ValueError(f"unknown class dispatch {dispatch!r}")
        self._family = family
        self._nft_family = _FAMILIES[family]
        self._tokens: FamilyTokens = tokens_for(family)
        self._config = config
        self._executor = executor
        self._clock = clock
        self._dispatch = dispatch
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
        # "chain NAME" / "set NAME" of content-named affinity objects the kernel holds.
        self._present: set[str] = set()
        self._content_refs: dict[str, int] = {}
        self._base_recreated = False
        # Objects other parts of this proxy keep in our table ("chain NAME", "set NAME").
        self._kept = frozenset(kept)
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
        # How many ports hold each cluster IP and each hairpin endpoint address.
        self._cluster_ips: dict[str, int] = {}
        self._hairpin: dict[str, int] = {}
        self._local_members: dict[Key, int] = {}
        self._classes: list[ClassSpec] = []  # rule dispatch: the class rules, in order
        self._class_chains: set[ClassSpec] = set()
        self._picks: set[Pick] = set()
        self._slot_maps: set[str] = set()
        # Tree dispatch: class -> number, per kind number -> class, bits, chains held.
        self._numbers: dict[ClassSpec, int] = {}
        self._by_number: dict[str, dict[int, ClassSpec]] = {kind: {} for kind in _KINDS}
        self._depth: dict[str, int] = dict.fromkeys(_KINDS, 0)
        self._tree: dict[str, tuple[str, ...]] = {}
        # Whether a class got a number since the tree chains were written.
        self._tree_stale = True
        self._content_refs = {}
        # Affinity maps whose entries may point at endpoints gone: name -> allowed values.
        self._map_losses: dict[str, frozenset[Key]] = {}
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
        self._present.clear()
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
                if not self._config.feature_gates.enabled(KUBE_PROXY_NFTABLES_LOCALHOST_NODEPORTS):
                    log.error(
                        "skipping NodePort address %s: localhost NodePorts are not supported", ip
                    )
                # With the gate on, a userspace proxy serves them (localhost.py).
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
        self._present = {f"chain {c}" for c in chains} | {f"set {s}" for s in sets}
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
        if self._dispatch == DISPATCH_TREE:
            self._number_classes(plans.values())
        try:
            ops = self._write_generation(plans)
        except BaseException:
            self._discard_generation(gen)
            raise
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

    def _write_generation(self, plans: dict[ServicePortName, PortPlan]) -> _Ops:
        """Every chain and container the elements need, then the elements in bounded
        transactions, then the switch; nothing of the new generation is read before it."""
        ops = _Ops(self, self.elements_per_transaction, text_last=True)
        tx = ops.tx
        tx.add(Table(comment=TABLE_COMMENT))
        containers = self._names.containers(self._tokens, self._dispatch)
        for spec in (*public_containers(self._tokens), *containers):
            self._declare(tx, spec)
        for kind in _KINDS:
            for bit in range(self._depth[kind]):
                self._declare(tx, self._names.bit_set(kind, bit, self._tokens))
        hooked = {c.name for c in self._fixed_chains() if c.hook is not None}
        for chain_name in fixed_chain_names(self._dispatch):
            if chain_name not in hooked:
                tx.add_chain(chain_name)
        for chain_name, rules in affinity_dispatch_chains(self._names, self._tokens).items():
            tx.add_chain(chain_name)
            tx.add_rules(chain_name, rules)
        for plan in plans.values():
            self._add_structure(tx, plan)
        self._update_tree(tx)
        ops.commit()
        for name, plan in plans.items():
            for fe in plan.frontends:
                self._diff_frontend(ops, fe.key, None, fe)
            self._diff_firewall(ops, {}, dict(plan.firewall), adding=True)
            self._add_shared(ops, plan, full=True)
            self._follow_affinity(None, plan.affinity, 0.0)
            self._ports[name] = self._port_state(plan)
            ops.cut()
        ops.commit(last=True)
        switch = self._new_transaction()
        self._write_switch(switch)
        self._run(switch)
        ops.transactions += 1
        ops.operations += switch.num_operations
        return ops

    def _discard_generation(self, gen: int) -> None:
        """Best effort, after a failed full sync: delete what it built of generation
        ``gen`` (nothing reads it), so no half generation stays in the kernel."""
        try:
            chains, sets = self._list_names()
            tx = self._new_transaction()
            ours = [c for c in chains if generation_of(c) == gen]
            for name in ours:
                tx.flush(Chain(name))
            for name in ours:
                tx.delete_chain(name)
            for name in sets:
                if generation_of(name) == gen:
                    tx.delete(Set(name, "ipv4_addr"))
            if tx.num_operations:
                self._run(tx)
        except NftError as err:
            log.warning("deleting what a failed full sync built (generation %d): %s", gen, err)

    def _number_classes(self, plans: Iterable[PortPlan]) -> None:
        """Class numbers for a new generation: the most used classes get the numbers with
        the fewest bits set (fewer elements, fewer gotos per connection)."""
        use: dict[ClassSpec, int] = {}
        for plan in plans:
            for fe in plan.frontends:
                if fe.cls is not None:
                    use[fe.cls] = use.get(fe.cls, 0) + 1
        for kind in _KINDS:
            ranked = sorted((c for c in use if c.kind == kind), key=lambda c: (-use[c], c))
            depth = tree_depth(len(ranked))
            self._depth[kind] = depth
            for cls, number in zip(ranked, class_numbers(depth), strict=False):
                self._numbers[cls] = number
                self._by_number[kind][number] = cls

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
        names, tokens = self._names, self._tokens
        wanted = {f"chain {n}" for n in fixed_chain_names(self._dispatch)} | self._kept
        wanted.update(f"set {c.name}" for c in public_containers(tokens))
        wanted.update(f"set {c.name}" for c in names.containers(tokens, self._dispatch))
        wanted.update(f"chain {n}" for n in affinity_dispatch_chains(names, tokens))
        wanted.update(f"chain {names.cls(spec)}" for spec in self._class_chains)
        wanted.update(f"set {names.cls(spec)}" for spec in self._classes)
        for kind in _KINDS:
            wanted.update(f"set {names.class_bit(kind, b)}" for b in range(self._depth[kind]))
        wanted.update(f"chain {name}" for name in self._tree)
        wanted.update(f"chain {names.pick(p)}" for p in self._picks)
        wanted.update(f"set {name}" for name in self._slot_maps)
        wanted.update(self._content_refs)
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
            dispatch=self._dispatch,
            classes=self._classes,
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
        tx.add_elements(Names.CLUSTER_IPS, [((k,), _VALUE_NONE) for k in self._cluster_ips])
        tx.flush(Set(AFFINITY_LOCAL_ENDPOINTS, self._tokens.addr_type))
        tx.add_elements(AFFINITY_LOCAL_ENDPOINTS, [(k, _VALUE_NONE) for k in self._local_members])
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
        for plan in plans.values():
            if plan is not None:
                self._add_structure(ops.tx, plan)
        self._update_tree(ops.tx)
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
        # Source ranges are in before the batch that makes a new LoadBalancer IP reachable
        # (a cut may split the sync), and go only after it stopped being reachable. Keyed
        # by frontend over every port in question, as a VIP may move between ports.
        old_fw = {k: v for state in old_states.values() for k, v in state.firewall}
        new_fw = {k: v for plan in plans.values() if plan is not None for k, v in plan.firewall}
        self._diff_firewall(ops, old_fw, new_fw, adding=True)
        # Shared elements (hairpin, cluster IPs, affinity's local endpoints) come in before
        # the frontends that need them and go after, however the sync is cut.
        for plan in plans.values():
            self._add_shared(ops, plan, full=False)
        new: dict[Key, Frontend] = {}
        for plan in plans.values():
            for fe in plan.frontends if plan is not None else ():
                new[fe.key] = fe
        for key in sorted(old.keys() | new.keys()):
            self._diff_frontend(ops, key, old.get(key), new.get(key))
            ops.cut()
        for name, plan in plans.items():
            self._release_shared(ops, old_states.get(name))
            self._follow_affinity(
                state.affinity if (state := old_states.get(name)) else None,
                plan.affinity if plan else None,
                now,
            )
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
        self._diff_firewall(ops, old_fw, new_fw, adding=False)
        self._unrenderable.forget_missing(snapshot)
        ops.commit()
        return ops

    # Structure on demand ----------------------------------------------------------------

    def _add_structure(self, tx: Transaction, plan: PortPlan) -> None:
        """Queue the classes, picks and affinity maps and chains ``plan`` needs and the
        kernel lacks (dispatch-tree chains follow in :meth:`_update_tree`)."""
        names, tokens = self._names, self._tokens
        assert self._ctx is not None
        tree = self._dispatch == DISPATCH_TREE
        for fe in plan.frontends:
            cls = fe.cls
            if cls is None or cls in self._class_chains:
                continue
            for pick in picks_of(cls):
                if pick not in self._picks:
                    for spec in names.slot_maps(pick, tokens):
                        if spec.name not in self._slot_maps:
                            self._declare(tx, spec)
                            self._slot_maps.add(spec.name)
                    chain = pick_chain(names, pick, tokens)
                    tx.add_chain(chain.name)
                    tx.add_rules(chain.name, chain.rules)
                    self._picks.add(pick)
            chain = class_chain(names, cls, self._ctx)
            tx.add_chain(chain.name)
            tx.add_rules(chain.name, chain.rules)
            self._class_chains.add(cls)
            if tree:
                if cls not in self._numbers:
                    self._new_number(tx, cls)
                continue
            self._declare(tx, names.class_set(cls, tokens))
            frontends = SERVICE_FRONTENDS if cls.kind == KIND_IP else NODEPORT_FRONTENDS
            if self.generation == names.gen:
                tx.add_rule(frontends, class_rule(names, cls, tokens))
            self._classes.append(cls)
        if plan.affinity is not None:
            self._add_affinity(tx, plan.affinity)

    def _new_number(self, tx: Transaction, cls: ClassSpec) -> None:
        """Give a class seen for the first time in this generation a free number, one
        more bit (and its set) if all numbers of the current depth are taken."""
        kind = cls.kind
        taken = self._by_number[kind]
        depth = self._depth[kind]
        while True:
            free = next((n for n in class_numbers(depth) if n not in taken), None)
            if free is not None:
                break
            depth += 1
        for bit in range(self._depth[kind], depth):
            self._declare(tx, self._names.bit_set(kind, bit, self._tokens))
        self._depth[kind] = depth
        self._numbers[cls] = free
        taken[free] = cls
        self._tree_stale = True

    def _update_tree(self, tx: Transaction) -> None:
        """Write the dispatch-tree chains that are new or changed: new chains first
        (a parent's rules go to them), then their rules."""
        if self._dispatch != DISPATCH_TREE or not self._tree_stale:
            return
        self._tree_stale = False
        wanted: dict[str, tuple[str, ...]] = {}
        for kind in _KINDS:
            wanted.update(
                tree_chains(
                    self._names, kind, self._by_number[kind], self._depth[kind], self._tokens
                )
            )
        changed = [name for name, rules in wanted.items() if self._tree.get(name) != rules]
        for name in changed:
            if name not in self._tree:
                tx.add_chain(name)
        for name in changed:
            if name in self._tree:
                tx.flush(Chain(name))
            tx.add_rules(name, wanted[name])
            self._tree[name] = wanted[name]

    def _add_affinity(self, tx: Transaction, plan: AffinityPlan) -> None:
        """Queue the content-named affinity maps and chains of a port the kernel lacks."""
        for spec in plan.maps:
            entry = f"set {spec.name}"
            self._stale.pop(entry, None)
            if entry not in self._present:
                _add_container(tx, affinity_container(spec.name, spec.type))
                self._present.add(entry)
        for chain in plan.chains:
            entry = f"chain {chain.name}"
            self._stale.pop(entry, None)
            if entry not in self._present:
                # A content-named chain the kernel still holds has these very rules.
                tx.add_chain(chain.name)
                tx.add_rules(chain.name, chain.rules)
                self._present.add(entry)

    # Element diffs ----------------------------------------------------------------------

    @staticmethod
    def _port_state(plan: PortPlan) -> _PortState:
        return _PortState(
            tuple(fe.key for fe in plan.frontends),
            plan.firewall,
            plan.cluster_ip,
            plan.hairpin,
            plan.affinity,
        )

    def _diff_class(
        self, ops: _Ops, kind: str, key: Key, old: ClassSpec | None, new: ClassSpec | None
    ) -> None:
        """Queue the membership changes that move frontend ``key`` between classes."""
        names = self._names
        if (old is None) != (new is None):
            if old is None:
                ops.add(names.dispatch(kind), key)
            else:
                ops.delete(names.dispatch(kind), key)
        if self._dispatch != DISPATCH_TREE:
            if old is not None:
                ops.delete(names.cls(old), key)
            if new is not None:
                ops.add(names.cls(new), key)
            return
        old_bits = set(class_bits(self._numbers[old])) if old is not None else set()
        new_bits = set(class_bits(self._numbers[new])) if new is not None else set()
        for bit in old_bits - new_bits:
            ops.delete(names.class_bit(kind, bit), key)
        for bit in new_bits - old_bits:
            ops.add(names.class_bit(kind, bit), key)

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
            self._diff_class(ops, kind, key, old_cls, new_cls)
        proto = key[1] if kind == KIND_IP else key[0]
        main = self._slots(
            ops,
            names,
            kind,
            False,
            proto,
            key,
            old.main if old else (),
            new.endpoints if new else (),
        )
        short = self._slots(
            ops,
            names,
            kind,
            True,
            proto,
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
        for container, verdict, old_chain, new_chain in (
            (
                names.affinity_lookup(kind, False),
                "jump",
                before.lookup if before else None,
                new.lookup if new else None,
            ),
            (
                names.affinity_lookup(kind, True),
                "jump",
                before.shortcut_lookup if before else None,
                new.shortcut_lookup if new else None,
            ),
            (
                names.affinity_record(kind),
                "goto",
                before.record if before else None,
                new.record if new else None,
            ),
        ):
            if old_chain != new_chain:
                if old_chain is not None:
                    ops.delete(container, key)
                if new_chain is not None:
                    ops.add(container, key, (f"{verdict} {new_chain}",))
        if new is not None:
            self._held[key] = _Held(new, main, short)

    @staticmethod
    def _slots(
        ops: _Ops,
        names: GenNames,
        kind: str,
        shortcut: bool,
        proto: str,
        key: Key,
        old: tuple[str, ...],
        endpoints: tuple[str, ...],
    ) -> tuple[str, ...]:
        """Queue the slot changes that turn endpoint slots ``old`` into ``endpoints``."""
        if old == endpoints:
            return old
        before = names.slots(kind, shortcut, proto, len(old)) if old else None
        container = names.slots(kind, shortcut, proto, len(endpoints)) if endpoints else None
        if before != container:
            # A new frontend (every frontend of a full sync), one gone, or one whose count
            # moved to another bucket: all its slots, in order.
            if before is not None:
                for index in range(len(old)):
                    ops.delete(before, (*key, _slot_text(index)))
            if container is not None:
                for index, endpoint in enumerate(endpoints):
                    ops.add(container, (*key, _slot_text(index)), endpoint_value(endpoint))
            return endpoints
        assert container is not None
        slots = restitch(old, endpoints)
        if slots == old:
            return old
        for index in range(max(len(old), len(slots))):
            was = old[index] if index < len(old) else None
            now = slots[index] if index < len(slots) else None
            if was == now:
                continue
            slot = (*key, _slot_text(index))
            if was is not None:
                ops.delete(container, slot)
            if now is not None:
                ops.add(container, slot, endpoint_value(now))
        return slots

    def _diff_firewall(
        self,
        ops: _Ops,
        old_fw: dict[Key, tuple[str, ...]],
        new_fw: dict[Key, tuple[str, ...]],
        *,
        adding: bool,
    ) -> None:
        """Queue the firewall additions (``adding``) or deletions that turn the source
        ranges ``old_fw`` (frontend -> allowed sources) into ``new_fw``."""
        names = self._names
        for key in sorted(old_fw.keys() | new_fw.keys()):
            before, after = old_fw.get(key, ()), new_fw.get(key, ())
            if before == after:
                continue
            vip, proto, port = key  # each protocol's sources have a set of their own
            if adding:
                if after and not before:
                    ops.add(names.firewall_ips, key)
                for source in after:
                    if source not in before:
                        ops.add(names.firewall_allow(proto), (vip, port, source))
                continue
            if before and not after:
                ops.delete(names.firewall_ips, key)
            for source in before:
                if source not in after:
                    ops.delete(names.firewall_allow(proto), (vip, port, source))

    def _add_shared(self, ops: _Ops, plan: PortPlan | None, *, full: bool) -> None:
        """Count the shared elements of a port's plan, adding those new to the kernel.

        On a full sync ``cluster-ips`` and the affinity's local endpoints are refilled by
        the switch (outside generations), not element by element.
        """
        if plan is None:
            return
        names = self._names
        hairpin, cluster_ips, members = self._hairpin, self._cluster_ips, self._local_members
        for host in plan.hairpin:
            count = hairpin.get(host, 0) + 1
            hairpin[host] = count
            if count == 1:
                ops.add(names.hairpin, (host, host))
        count = cluster_ips.get(plan.cluster_ip, 0) + 1
        cluster_ips[plan.cluster_ip] = count
        if count == 1 and not full:
            ops.add(Names.CLUSTER_IPS, (plan.cluster_ip,))
        for member in plan.affinity.local_members if plan.affinity is not None else ():
            count = members.get(member, 0) + 1
            members[member] = count
            if count == 1 and not full:
                ops.add(AFFINITY_LOCAL_ENDPOINTS, member)

    def _release_shared(self, ops: _Ops, old: _PortState | None) -> None:
        """Count a port's former shared elements out, deleting those no port holds."""
        if old is None:
            return
        names = self._names
        for host in old.hairpin:
            if _release(self._hairpin, host):
                ops.delete(names.hairpin, (host, host))
        if _release(self._cluster_ips, old.cluster_ip):
            ops.delete(Names.CLUSTER_IPS, (old.cluster_ip,))
        for member in old.affinity.local_members if old.affinity is not None else ():
            if _release(self._local_members, member):
                ops.delete(AFFINITY_LOCAL_ENDPOINTS, member)

    def _follow_affinity(
        self, old: AffinityPlan | None, new: AffinityPlan | None, now: float
    ) -> None:
        """Count the content-named affinity objects ports use; an object no port uses
        goes stale (deleted later), a map whose endpoints shrank is cleaned after the
        sync."""
        refs = self._content_refs
        for entry in _content_entries(new):
            refs[entry] = refs.get(entry, 0) + 1
        for entry in _content_entries(old):
            left = refs.get(entry, 0) - 1
            if left > 0:
                refs[entry] = left
            else:
                refs.pop(entry, None)
                self._stale.setdefault(entry, now)
        if new is not None:
            allowed = {m.name: m.allowed for m in (old.maps if old is not None else ())}
            for spec in new.maps:
                before = allowed.get(spec.name)
                if before is None or not before <= spec.allowed:
                    self._map_losses[spec.name] = spec.allowed

    # Unused objects and affinity entries -------------------------------------------------

    def _delete_stale(self, now: float) -> None:
        """Delete the objects unused for at least :data:`STALE_DELAY`, in one transaction.

        Their chains are flushed first (so no rule of theirs holds another), then verdict
        maps go (their elements hold chains), then the chains, then the other sets. A
        refusal is counted and logged; the objects are tried again later.
        """
        due = [name for name, since in self._stale.items() if now - since >= STALE_DELAY]
        if not due:
            return
        due.sort(key=_deletion_order)
        tx = self._new_transaction()
        for entry in due:
            kind, _, name = entry.partition(" ")
            if kind == "chain":
                tx.flush(Chain(name))
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
                    self._present.discard(entry)
            return
        for entry in due:
            del self._stale[entry]
            self._present.discard(entry)

    def _clean_affinity(self, full: bool) -> None:
        """Best effort: delete affinity entries that point at endpoints no longer in the
        list their map serves (after a full sync, in every map; else in the maps whose
        lists lost an endpoint), including the entries of short-circuit picks."""
        losses = self._map_losses
        self._map_losses = {}
        if full:
            losses = {}
            for state in self._ports.values():
                for spec in state.affinity.maps if state.affinity is not None else ():
                    losses[spec.name] = spec.allowed
        deletes: list[tuple[str, Key]] = []
        types: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        for name, allowed in losses.items():
            if f"set {name}" not in self._present or f"set {name}" in self._stale:
                continue
            types[name] = map_types = _AFFINITY_TYPES[self._family]
            try:
                entries = self._executor.read_elements(self._nft_family, TABLE, name, map_types)
            except NftError as err:
                self.affinity_cleanup_failures += 1
                log.warning("listing session affinity map %s failed: %s", name, err)
                continue
            deletes.extend((name, key) for key, value in entries if value not in allowed)
        if not deletes:
            return
        try:
            self._executor.write_elements(
                ElementBatch(self._nft_family, TABLE, types, deletes=deletes)
            )
        except NftError as err:
            # An entry may have timed out meanwhile: the next sync tries these maps again.
            self.affinity_cleanup_failures += 1
            log.warning("deleting %d stale session affinity entries failed: %s", len(deletes), err)
            for name in types:
                self._map_losses.setdefault(name, losses[name])


_AFFINITY_TYPES = {
    IPFamily.IPV4: (("ipv4_addr",), ("ipv4_addr", "inet_service")),
    IPFamily.IPV6: (("ipv6_addr",), ("ipv6_addr",)),
}
"""The data types of the affinity maps (:data:`~.frontends.AFFINITY4_MAP_TYPE`, the
IPv6 one), to read and delete their entries over netlink."""


def _release(counts: dict[Any, int], key: object) -> bool:
    """Count one user of ``key`` less; True when that was the last."""
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
        return False
    counts.pop(key, None)
    return True


def _content_entries(plan: AffinityPlan | None) -> Iterator[str]:
    if plan is None:
        return
    yield from (f"set {m.name}" for m in plan.maps)
    yield from (f"chain {c.name}" for c in plan.chains)


_VERDICT_MAPS = frozenset(
    {
        Names.SERVICE_IPS,
        Names.SERVICE_NODEPORTS,
        Names.FIREWALL_IPS,
        Names.NO_ENDPOINT_SERVICES,
        Names.NO_ENDPOINT_NODEPORTS,
    }
)
_VERDICT_PREFIXES = ("dedicated-", "affinity-lookup-", "affinity-shortcut-", "affinity-record-")
# Chains that jump or go to others are deleted before their targets (older tables).
_CHAIN_RANKS = (
    ("internal-", 0),
    ("external-", 0),
    ("nodeport-", 0),
    ("firewall-", 0),
    ("dispatch-", 0),
    ("affinity-split-", 0),
    ("service-", 1),
    ("local-", 1),
    ("pick", 2),
    ("group-", 2),
)


def _deletion_order(entry: str) -> tuple[int, int, str]:
    kind, _, name = entry.partition(" ")
    if kind == "set":
        verdicts = name in _VERDICT_MAPS or name.startswith(_VERDICT_PREFIXES)
        return (0 if verdicts else 2, 0, name)
    rank = next((r for prefix, r in _CHAIN_RANKS if name.startswith(prefix)), 3)
    return (1, rank, name)


def _add_container(tx: Transaction, spec: ContainerSpec) -> None:
    kind = Map if spec.is_map else Set
    tx.add(
        kind(spec.name, spec.type, spec.flags, spec.timeout, spec.size, spec.comment, spec.typeof)
    )
