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
  rewritten). A class or pick that appears for the first time adds its chains and the
  tree chains on its path, the only case that makes the kernel validate the table
  (``precreate_counts``, off by default, makes the classes of counts up to it exist from
  the full sync on).
* a **full sync** (start, restart, the periodic one, after a failure) never reads rules
  or elements back: it writes a complete new *generation* of the containers, class and
  pick chains next to the current one, in bounded transactions, then rewrites the fixed
  chains to read the new generation in one atomic transaction. New connections are
  served by the old generation until that switch and by the new one after it; a table
  left by another version (the per-Service-chain structure included) is switched over
  the same way. Whatever the kernel held that the new generation does not use is
  deleted a second later, in its own transaction (older kernels still count a chain as
  used right after the last reference goes): by the daemon's sweeper
  (:class:`~kubeproxy.backends.nftables.sweeper.StaleSweeper`, through
  :meth:`NftablesBackend.collect_stale`) without waiting for the next sync.

Nothing is listed on an incremental sync; a full sync lists only chain and set names.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from kubeproxy.backend import (
    NodePortAddresses,
    ProxySnapshot,
    SkippedPorts,
    SyncChanges,
    SyncError,
)
from kubeproxy.backends.nftables.affinity_cleanup import AffinityCleaner, Every
from kubeproxy.backends.nftables.claims import Claims
from kubeproxy.backends.nftables.commits import PostsElements, SyncOps
from kubeproxy.backends.nftables.diff import (
    FrontendWriter,
    add_shared,
    add_shared_new,
    diff_firewall,
    diff_frontend,
    release_shared,
    restitch,
)
from kubeproxy.backends.nftables.elements import ElementBatch
from kubeproxy.backends.nftables.exec import LibNftables, NftExecutor, delete_table
from kubeproxy.backends.nftables.failures import FailureDump
from kubeproxy.backends.nftables.frontends import AffinityPlan, Frontend, PortPlan, plan_port
from kubeproxy.backends.nftables.generation import (
    Generation,
    Held,
    PortState,
    add_container,
)
from kubeproxy.backends.nftables.layout import (
    AFFINITY_FULL_COMMENT,
    AFFINITY_MAPS,
    AFFINITY_PINNED,
    AFFINITY_SHARED,
    AFFINITY_SHARED_IPV4,
    Dispatch,
    affinity_container,
    affinity_frontend_map,
    affinity_shards,
    generation_of,
    precreated_classes,
)
from kubeproxy.backends.nftables.objects import Chain, Family, NftError, Set, Table
from kubeproxy.backends.nftables.owner import OwnedNftables
from kubeproxy.backends.nftables.rulecounters import rule_counters
from kubeproxy.backends.nftables.stale import (
    STALE_DELAY,
    StaleCollector,
    TableObject,
    chain_object,
    set_object,
)
from kubeproxy.backends.nftables.support import check_support
from kubeproxy.backends.nftables.table import (
    AFFINITY_FRONTEND_PREFIX,
    AFFINITY_FULL,
    TABLE,
    TABLE_COMMENT,
    FamilyTokens,
    FixedChain,
    Key,
    RenderContext,
    context_or_default,
    tokens_for,
)
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.config import ProxierConfig
from kubeproxy.featuregates import KUBE_PROXY_NFTABLES_LOCALHOST_NODEPORTS
from kubeproxy.objects import IPFamily, ServicePortName
from kubeproxy.portindex import PortsByService

__all__ = ["PLAN_CONTAINERS", "STALE_DELAY", "NftablesBackend", "restitch"]

log = logging.getLogger(__name__)

_FAMILIES = {IPFamily.IPV4: Family.IP, IPFamily.IPV6: Family.IP6}

PLAN_CONTAINERS: Final = 20
"""Containers named in :meth:`NftablesBackend.last_sync_plan` (content-named affinity
maps can make thousands; the page stays small)."""


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

    A coordinator: the model of the current generation is a
    :class:`~kubeproxy.backends.nftables.generation.Generation`, the element changes of
    a sync come from :mod:`~kubeproxy.backends.nftables.diff` and are committed by a
    :class:`~kubeproxy.backends.nftables.commits.SyncOps`, unused objects are deleted by
    a :class:`~kubeproxy.backends.nftables.stale.StaleCollector`, affinity entries of
    endpoints gone by an
    :class:`~kubeproxy.backends.nftables.affinity_cleanup.AffinityCleaner`.

    ``executor`` runs transactions and lists names (``LibNftables`` in production,
    ``FakeNft`` in tests and dry runs); ``clock`` is a monotonic clock in seconds;
    ``elements_per_transaction`` bounds a transaction (and so libnftables' memory and
    the time the kernel holds its commit lock); ``dispatch`` picks how a connection finds
    its class (:attr:`~kubeproxy.backends.nftables.layout.Dispatch.TREE`, or the
    benchmarks' :attr:`~kubeproxy.backends.nftables.layout.Dispatch.RULES`). Counters for
    metrics: :attr:`sync_failures`, :attr:`stale_chain_failures` (failed deletions of
    unused objects), :attr:`affinity_cleanup_failures`, :attr:`stale_objects` (unused
    objects waiting for their deletion, which :meth:`collect_stale` does when due); for
    tests and logs:
    :attr:`last_operations`, :attr:`last_transactions`, :attr:`last_sync_full`,
    :attr:`generation`; :meth:`last_sync_plan` for ``/debug/plan``. ``kept`` names
    objects that another part of this proxy keeps in our table (localhost NodePorts'
    reject rules), as
    :class:`~kubeproxy.backends.nftables.stale.TableObject` values or their text
    (``chain NAME``, ``set NAME``): never deleted as unused. ``element_names``: a
    frontend's dispatch and no-endpoint elements carry its Service port's name as their
    comment (what ``kubeproxy explain`` reads); off, they carry none (the structure before
    issue 30, kept for ``make bench``). A refused transaction or element batch is kept
    in ``failure_dir`` (default: the state directory) and named in the sync's error
    (:mod:`~kubeproxy.backends.nftables.failures`). ``precreate_counts`` N (tree dispatch
    only; 0, the default, for none): every generation holds the classes of 1 to N
    endpoints of the shapes whose class is their count alone from its start
    (:func:`~kubeproxy.backends.nftables.layout.precreated_classes`), so a Service
    reaching such a count is element changes only; measured against the default in the
    package README ("A never-seen endpoint count": every commit pays for the chains).
    ``packed_elements``: a full sync's slots and hairpin pairs (and a new frontend's
    slots) are packed into netlink bytes as they are queued (:func:`.elements.slot_packer`);
    None, the default, does so when the executor sends elements over netlink
    (:class:`~.owner.OwnedNftables`, :class:`~.exec.LibNftables` with its netlink
    elements), not for executors that read elements as text (the fake, the written-table
    model of ``kubeproxy verify``), which would decode each one.
    ``pipelined_elements``: a full sync hands its element batches to the executor's
    writer thread (:class:`~.commits.PostsElements`: the owned table's), which commits
    batch k while this thread encodes batch k+1; None, the default, does so when the
    executor can and the process may run on more than one CPU. Off, each batch is
    committed before the sync goes on (the structure before issue 32's pipeline, kept
    for the benches). Partial syncs commit theirs at once either way.
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
        dispatch: str = Dispatch.TREE,
        kept: Iterable[TableObject | str] = (),
        element_names: bool = True,
        failure_dir: Path | None = None,
        affinity: str = AFFINITY_SHARED,
        affinity_size: int | None = None,
        precreate_counts: int = 0,
        packed_elements: bool | None = None,
        pipelined_elements: bool | None = None,
    ) -> None:
        if elements_per_transaction < 1:
            raise ValueError("elements_per_transaction must be at least 1")
        if affinity not in AFFINITY_MAPS:
            raise ValueError(f"unknown affinity maps {affinity!r}")
        if affinity_size is not None and not 1 <= affinity_size <= 2**31:
            raise ValueError(f"affinity map size {affinity_size} is out of range")
        try:
            self._dispatch = Dispatch(dispatch)
        except ValueError:
            raise ValueError(f"unknown class dispatch {dispatch!r}") from None
        if precreate_counts < 0 or (precreate_counts and self._dispatch != Dispatch.TREE):
            raise ValueError("precreate_counts needs the tree dispatch and a count >= 0")
        self._precreated = precreated_classes(precreate_counts)
        if packed_elements is None:
            packed_elements = isinstance(executor, OwnedNftables) or (
                isinstance(executor, LibNftables) and executor.netlink_elements
            )
        self._packed = packed_elements
        posts = isinstance(executor, PostsElements)
        if pipelined_elements is None:
            pipelined_elements = posts and len(os.sched_getaffinity(0)) > 1
        elif pipelined_elements and not posts:
            raise ValueError("pipelined_elements needs an executor that posts element batches")
        self._poster: PostsElements | None = (
            executor if pipelined_elements and isinstance(executor, PostsElements) else None
        )
        self._family = family
        self._nft_family = _FAMILIES[family]
        self._tokens: FamilyTokens = tokens_for(family)
        self._shared_affinity = affinity in (AFFINITY_SHARED, AFFINITY_SHARED_IPV4, AFFINITY_PINNED)
        self._frontend_affinity = affinity in (AFFINITY_SHARED, AFFINITY_SHARED_IPV4)
        self._frontend_affinity6 = affinity == AFFINITY_SHARED
        self._affinity_size = affinity_size
        self._shards = affinity_shards(self._tokens, affinity_size) if self._shared_affinity else ()
        self._config = config
        self._executor = executor
        self._clock = clock
        self.elements_per_transaction = elements_per_transaction
        self.element_names = element_names
        self.failures = FailureDump(str(self._nft_family), failure_dir)
        self.sync_failures = 0
        self.stale_chain_failures = 0
        self.affinity_cleanup_failures = 0
        self.last_operations = 0
        self.last_transactions = 0
        self.last_sync_full = False
        self._last_ports = 0
        self._last_elements: dict[str, list[int]] = {}
        self.generation: int | None = None
        """The generation the fixed chains read (None before the first full sync)."""
        if support_check:
            check_support(executor, self._nft_family)
        self._stale = StaleCollector()
        self._affinity = AffinityCleaner(family, self._nft_family, executor)
        self._base_recreated = False
        self._kept = frozenset(
            k if isinstance(k, TableObject) else TableObject.parse(k) for k in kept
        )
        self._claims = Claims(log)
        self._unrenderable = SkippedPorts(log)
        self._need_full = True
        self._inputs: _Inputs | None = None
        self._ctx: RenderContext | None = None
        self._node_ports: NodePortAddresses | None = None
        self._nodeport_keys: tuple[Key, ...] = ()
        self._held_shards: tuple[str, ...] = ()
        # The affinity plans of the ports the last full sync wrote, gathered as it wrote
        # them: read back from every port's state they were a pass over 100k states,
        # 0.19 s of a whole-process cold start at 100k (py-spy, 2026-11-29).
        self._written_affinity: list[AffinityPlan] = []
        self._gen = Generation(0, self._tokens, self._dispatch, self._shards)

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
        self.collect_stale(now)
        inputs = self._inputs_of(snapshot)
        full = changes.full or self._need_full or inputs != self._inputs
        self.last_sync_full = full
        try:
            if full:
                # An owned table that replaces an unowned one gets all of it at once.
                with self._executor.whole_table(self._nft_family, TABLE):
                    ops = self._full_sync(snapshot, inputs, now)
            else:
                ops = self._partial_sync(snapshot, changes, now)
        except BaseException as err:
            self._need_full = True
            if not isinstance(err, NftError):
                raise
            self.sync_failures += 1
            kept = self.failures.write(err)
            where = f" (the refused write is in {kept})" if kept is not None else ""
            raise SyncError(f"nftables {self._nft_family} sync failed: {err}{where}") from err
        self._need_full = False
        self.last_operations = ops.operations
        self.last_transactions = ops.transactions
        self._last_elements = ops.elements
        every = None
        if full:
            plans, self._written_affinity = self._written_affinity, []
            every = Every(
                [spec for plan in plans for spec in plan.maps],
                [pin for plan in plans for pin in plan.pins],
                self._held_shards,
            )
        self.affinity_cleanup_failures += self._affinity.clean(self._map_live, every)

    def last_sync_plan(self) -> dict[str, Any]:
        """What the last successful sync did, as counted while doing it (for
        ``/debug/plan``): full or partial, the generation, the Service ports planned (a
        partial sync's changed ones), the operations and transactions committed, and the
        element additions and deletions of the :data:`PLAN_CONTAINERS` containers that
        changed most (the others summed)."""
        ranked = sorted(self._last_elements.items(), key=lambda i: (-sum(i[1]), i[0]))
        shown, rest = ranked[:PLAN_CONTAINERS], ranked[PLAN_CONTAINERS:]
        return {
            "full": self.last_sync_full,
            "generation": self.generation,
            "ports_planned": self._last_ports,
            "operations": self.last_operations,
            "transactions": self.last_transactions,
            "elements": {c: {"added": a, "deleted": d} for c, (a, d) in shown},
            "other_containers": {
                "containers": len(rest),
                "added": sum(a for _c, (a, _d) in rest),
                "deleted": sum(d for _c, (_a, d) in rest),
            },
        }

    def affinity_unrecorded(self) -> int:
        """New connections whose ClientIP affinity entry could not be written (a full
        shared map), as the kernel counted them (0 without a kernel: the fake, tools)."""
        if not isinstance(self._executor, (LibNftables, OwnedNftables)):
            return 0
        counts = rule_counters(self._nft_family, TABLE, AFFINITY_FULL, netns=self._executor.netns)
        return counts.get(AFFINITY_FULL_COMMENT, 0)

    # Unused objects --------------------------------------------------------------------

    @property
    def stale_objects(self) -> int:
        """Chains, sets and maps of our table that nothing uses any more (an old
        generation, what a killed or failed full sync built, what another proxy left in
        the table before we took it over), waiting for their deletion."""
        return len(self._stale)

    def stale_due(self) -> float | None:
        """When (on this backend's clock) the first of :attr:`stale_objects` is due for
        deletion; None when nothing waits."""
        return self._stale.next_due()

    def collect_stale(self, now: float | None = None) -> bool:
        """Delete the unused objects that are due (every sync starts with this; the
        daemon's sweeper calls it between syncs, and a takeover right after the first
        sync, with syncs held); False when the kernel refused (logged, counted in
        :attr:`stale_chain_failures`, tried again later).

        They go through the executor's
        :meth:`~kubeproxy.backends.nftables.exec.NftExecutor.run_deletions`: libnftables
        sends them as one netlink batch with ``NFTablesNetlink`` (upstream's 110k chains
        at 10k Services in 0.8 s, where an nft transaction took 8.7 s); the owned table
        over its owner's socket, as every write."""
        if not len(self._stale):
            return True
        moment = self._clock() if now is None else now
        if self._stale.collect(
            moment, self._new_transaction, self._run_deletions, self._list_names
        ):
            return True
        self.stale_chain_failures += 1
        return False

    def cleanup(self) -> None:
        """Delete our table (a missing table is fine) and forget all state."""
        delete_table(self._executor, self._nft_family, TABLE)
        self._new_generation(0)
        self._stale.clear()
        self.generation = None
        self._need_full = True

    def close(self) -> None:
        """Let go of an owned table (its owner socket closed: the table stays, orphaned,
        for the next proxy to adopt); the rules stay, and a later :meth:`cleanup` or
        sync still works (it adopts the table again)."""
        if isinstance(self._executor, OwnedNftables):
            self._executor.close()

    @property
    def executor(self) -> NftExecutor:
        """What this backend writes through (tools and tests: the owned table takes
        writes from its owner's socket only)."""
        return self._executor

    # Plumbing ---------------------------------------------------------------------------

    def _new_generation(self, gen: int) -> None:
        self._gen = Generation(gen, self._tokens, self._dispatch, self._shards)
        self._affinity.forget()

    def _new_transaction(self) -> Transaction:
        return Transaction(self._nft_family, TABLE)

    def _run(self, tx: Transaction) -> None:
        if tx.error is not None:
            raise tx.error
        try:
            self._executor.run(tx)
        except NftError:
            self.failures.keep(tx)
            raise

    def _write_elements(self, batch: ElementBatch) -> None:
        try:
            self._executor.write_elements(batch)
        except NftError:
            self.failures.keep(batch)
            raise

    def _post_elements(self, batch: ElementBatch) -> None:
        assert self._poster is not None
        self._poster.post_elements(batch, self.failures.keep)

    def _run_deletions(self, tx: Transaction) -> None:
        if tx.error is not None:
            raise tx.error
        self._executor.run_deletions(tx)

    def _ops(self, *, text_last: bool = False, posted: bool = False) -> SyncOps:
        poster = self._poster if posted else None
        return SyncOps(
            self._nft_family,
            self._gen.element_types,
            run=self._run,
            write_elements=self._write_elements if poster is None else self._post_elements,
            budget=self.elements_per_transaction,
            text_last=text_last,
            comments=self.element_names,
            packed=self._packed,
            settle=None if poster is None else poster.settle_elements,
        )

    def _map_live(self, name: str) -> bool:
        return self._stale.live(set_object(name))

    def _list_names(self) -> tuple[set[str], set[str]]:
        ex = self._executor
        if not ex.table_exists(self._nft_family, TABLE):
            return set(), set()
        chains = set(ex.list_chains(self._nft_family, TABLE))
        return chains, set(ex.list_sets(self._nft_family, TABLE))

    def _inputs_of(self, snapshot: ProxySnapshot) -> _Inputs:
        detector = snapshot.local_detector.for_family(self._family)
        addresses = snapshot.node.addresses_of(self._family)
        context = (detector, self._config.masquerade_all, addresses)
        if self._inputs is None or self._inputs.context != context or self._ctx is None:
            self._ctx = replace(
                context_or_default(
                    self._tokens,
                    detector,
                    masquerade_all=self._config.masquerade_all,
                    node_addresses=addresses,
                    logger=log,
                ),
                shared_affinity=self._shared_affinity,
                frontend_affinity=self._frontend_affinity,
                frontend_affinity6=self._frontend_affinity6,
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

    def _full_sync(self, snapshot: ProxySnapshot, inputs: _Inputs, now: float) -> SyncOps:
        chains, sets = self._list_names()
        gens = [g for n in (*chains, *sets) if (g := generation_of(n)) is not None]
        gen = max([*gens, self.generation or 0]) + 1
        self._new_generation(gen)
        model = self._gen
        self._stale.listed(chains, sets)
        # The shared affinity maps the kernel held (a new one holds nothing to clean);
        # every full sync declares them all.
        self._held_shards = tuple(c.name for c in self._shards if c.name in sets) + tuple(
            s for s in sets if s.startswith(AFFINITY_FRONTEND_PREFIX)
        )
        for spec in self._shards:
            self._stale.take(set_object(spec.name))
        self._inputs = inputs
        claims = self._claims
        claims.reset()
        plans: dict[ServicePortName, PortPlan] = {}
        index = snapshot.ports_by_service
        if type(index) is PortsByService:
            # The core's index of the snapshot's ports (its contract: every port of
            # ``services``), copied: an add per port was a pass over the cluster.
            model.by_service = index.copy()
        else:
            for name in snapshot.services:
                model.by_service.add(name)
        for name in snapshot.services:
            plan = self._plan(snapshot, name)
            if plan is not None:
                plans[name] = plan
                claims.claim(name, plan.claims)
        self._unrenderable.forget_missing(snapshot)
        if claims.unsettled:
            claims.resolve()
        for name in claims.skipped:
            plans.pop(name, None)
        self._last_ports = len(plans)
        if self._dispatch == Dispatch.TREE:
            model.number_classes(plans.values(), self._precreated)
        try:
            ops = self._write_generation(plans)
        except BaseException:
            if self._poster is not None:
                # Nothing more of the generation is sent before it is taken back.
                self._poster.abandon_elements()
            self._discard_generation(gen)
            raise
        self._base_recreated = True
        self.generation = gen
        self._stale.sweep(model.wanted(self._kept), now)
        return ops

    def _write_generation(self, plans: dict[ServicePortName, PortPlan]) -> SyncOps:
        """Every chain and container the elements need, then the elements in bounded
        transactions, then the switch; nothing of the new generation is read before it.
        Empties ``plans`` as it writes them. The element batches go to the executor's
        writer thread when pipelined (see the class): the kernel's work on them, about
        2 s of a 16 s cold start at 100k Services, is then done there, not in this
        thread (measured: this thread's CPU time 8.4-8.5 s against 10.0-10.2 s,
        ``bench/pipeline.py``); the last commit waits for them all, so the switch comes
        after every one."""
        model = self._gen
        names, counts, held, numbers = model.names, model.shared, model.held, model.numbered
        assert self._ctx is not None
        ops = self._ops(text_last=True, posted=True)
        tx = ops.tx
        tx.add(Table(comment=TABLE_COMMENT))
        fixed = self._fixed_chains()
        model.declare_fixed(tx, {c.name for c in fixed if c.hook is not None})
        for plan in plans.values():
            self._add_structure(tx, plan, live=False)
        for cls in self._precreated:
            if cls not in model.class_chains:
                model.add_class(tx, cls, self._ctx, live=False)
        model.update_tree(tx)
        ops.commit()
        ports = model.ports
        previous_hairpin: tuple[str, ...] = ()
        writer = FrontendWriter(ops, names, numbers)
        written_affinity = self._written_affinity
        written_affinity.clear()
        # Each plan let go once written (what is kept of it is its frontends and its
        # PortState): at 100k Services the plans held 10 MB to the end of the sync,
        # where the peak is; let go as they go, what the writing makes reuses their room.
        for name in list(plans):
            plan = plans.pop(name)
            for fe in plan.frontends:
                held[fe.key] = writer.write(fe)
            if plan.firewall:
                diff_firewall(ops, names, {}, dict(plan.firewall), adding=True)
            add_shared_new(ops, names, counts, plan, previous_hairpin)
            previous_hairpin = plan.hairpin
            if plan.affinity is not None:
                self._follow_affinity(None, plan.affinity, 0.0)
                written_affinity.append(plan.affinity)
            ports[name] = PortState.of(plan)
            ops.cut()
        ops.commit(last=True)
        switch = self._new_transaction()
        assert self._inputs is not None
        model.queue_switch(
            switch,
            self._fixed_chains(),
            self._inputs.nodeport_ips,
            recreate_base=not self._base_recreated,
        )
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

    def _fixed_chains(self) -> tuple[FixedChain, ...]:
        inputs = self._inputs
        assert inputs is not None
        return self._gen.fixed_chains(
            masquerade_mark=self._config.masquerade_mark,
            match_all_nodeports=inputs.match_all_nodeports,
            service_cidrs=inputs.service_cidrs,
        )

    # Incremental sync -------------------------------------------------------------------

    def _partial_sync(self, snapshot: ProxySnapshot, changes: SyncChanges, now: float) -> SyncOps:
        model = self._gen
        names, counts, numbers = model.names, model.shared, model.numbered
        by_service, held, states = model.by_service, model.held, model.ports
        ports: set[ServicePortName] = set()
        for service in changes.changed_services:
            ports.update(by_service.get(service, ()))
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
        self._last_ports = len(plans)
        ops = self._ops()
        live = self.generation == model.gen
        for plan in plans.values():
            if plan is not None:
                self._add_structure(ops.tx, plan, live=live)
        model.update_tree(ops.tx)
        # Old frontends of every port in question first, so a key that moves from one
        # port to another in this sync is diffed once, against what the kernel holds.
        old: dict[Key, Held] = {}
        old_states: dict[ServicePortName, PortState] = {}
        if plans:
            model.count_hairpin()  # before any state is popped: from them all
        for name in plans:
            state = states.pop(name, None)
            if state is not None:
                old_states[name] = state
                for key in state.keys:
                    was = held.pop(key, None)
                    if was is not None:
                        old[key] = was
        # Source ranges are in before the batch that makes a new LoadBalancer IP reachable
        # (a cut may split the sync), and go only after it stopped being reachable. Keyed
        # by frontend over every port in question, as a VIP may move between ports.
        old_fw = {k: v for state in old_states.values() for k, v in state.firewall}
        new_fw = {k: v for plan in plans.values() if plan is not None for k, v in plan.firewall}
        diff_firewall(ops, names, old_fw, new_fw, adding=True)
        # Shared elements (hairpin, cluster IPs, affinity's local endpoints) come in before
        # the frontends that need them and go after, however the sync is cut.
        for plan in plans.values():
            if plan is not None:
                add_shared(ops, names, counts, plan, full=False)
        new: dict[Key, Frontend] = {}
        for plan in plans.values():
            for fe in plan.frontends if plan is not None else ():
                new[fe.key] = fe
        writer = FrontendWriter(ops, names, numbers)
        for key in sorted(old.keys() | new.keys()):
            was, planned = old.get(key), new.get(key)
            if was is None and planned is not None:
                # A frontend the kernel lacks (a new Service's): its slots packed at once.
                held[key] = writer.write(planned)
            else:
                now_held = diff_frontend(ops, names, numbers, key, was, planned)
                if now_held is not None:
                    held[key] = now_held
            ops.cut()
        for name, plan in plans.items():
            state = old_states.get(name)
            if state is not None:
                release_shared(ops, names, counts, state)
            self._follow_affinity(
                state.affinity if state is not None else None,
                plan.affinity if plan else None,
                now,
            )
            if plan is not None:
                states[name] = PortState.of(plan)
            if name in snapshot.services:
                by_service.add(name)
            else:
                by_service.discard(name)
        diff_firewall(ops, names, old_fw, new_fw, adding=False)
        self._unrenderable.forget_missing(snapshot)
        ops.commit()
        return ops

    # Structure on demand and content-named affinity objects -----------------------------

    def _add_structure(self, tx: Transaction, plan: PortPlan, *, live: bool) -> None:
        """Queue what ``plan`` needs and the kernel lacks: classes and picks of the
        generation, and the port's content-named affinity maps and chains."""
        assert self._ctx is not None
        self._gen.add_structure(tx, plan, self._ctx, live=live)
        if plan.affinity is not None:
            self._add_affinity(tx, plan.affinity)

    def _add_affinity(self, tx: Transaction, plan: AffinityPlan) -> None:
        """Queue the content-named affinity maps and chains of a port the kernel lacks
        (a content-named chain the kernel still holds has these very rules)."""
        stale = self._stale
        for spec in plan.maps:
            if stale.take(set_object(spec.name)):
                add_container(tx, affinity_container(spec.name, spec.type))
        for name in plan.shared_maps:
            if stale.take(set_object(name)):
                add_container(tx, affinity_frontend_map(name, self._affinity_size))
        for chain in plan.chains:
            if stale.take(chain_object(chain.name)):
                tx.add_chain(chain.name)
                tx.add_rules(chain.name, chain.rules)

    def _follow_affinity(
        self, old: AffinityPlan | None, new: AffinityPlan | None, now: float
    ) -> None:
        """Count the content-named affinity objects ports use; an object no port uses
        goes stale (deleted later), a map whose endpoints shrank is cleaned after the
        sync."""
        if old is None and new is None:
            return
        for obj in self._gen.follow_content(old, new):
            self._stale.unused(obj, now)
        self._affinity.follow(old, new)
