"""ChainNftablesBackend: the per-Service-chain structure (the previous default).

Kept as a benchmark subject (:func:`bench.chain_structure.create_chain_backend`, the
"nftables (chains, before)" subject of :mod:`bench.subjects`) so every figure of the map
structure (:mod:`kubeproxy.backends.nftables.backend`) is measured next to it. Its
incremental syncs cost time proportional to the whole table (each adds jumps or verdict
elements, which make the kernel re-validate every chain); see the nftables README.

The backend remembers what it last applied (per-service chain names, the elements of every
set and map, reference counts of shared set elements) and sends only differences:

* a **full sync** lists chain names and the elements of the sets and maps once, renders
  every Service port and diffs; chains that already exist under their content-hashed name
  are reused without reading their rules back;
* an **incremental sync** renders only the ports of the changed Services and never lists;
* chains no longer wanted are remembered as *stale* and deleted by a separate transaction
  at the start of a sync at least a second later (older kernels still see a chain as in
  use right after the map element that pointed at it went away).

Large syncs are split into ordered transactions of at most ``ports_per_transaction``
Service ports (chains before the elements that jump to them), which bounds the memory of
libnftables and the time the kernel holds its commit lock.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from bench.chain_structure.fixed import FixedStructure, fixed_structure
from bench.chain_structure.naming import ChainPrefix, is_affinity_map, is_service_chain
from bench.chain_structure.render import PortRules, render_port
from kubeproxy.backend import ProxySnapshot, SkippedPorts, SyncChanges, SyncError
from kubeproxy.backends.nftables.claims import Claims
from kubeproxy.backends.nftables.exec import NftExecutor, delete_table
from kubeproxy.backends.nftables.objects import (
    Chain,
    Family,
    Map,
    NftError,
    Set,
    Table,
    is_not_found,
)
from kubeproxy.backends.nftables.support import check_support
from kubeproxy.backends.nftables.table import (
    AFFINITY6_MAP_TYPE,
    AFFINITY_TIMEOUT,
    TABLE,
    TABLE_COMMENT,
    Key,
    Names,
    RenderContext,
    context_or_default,
    tokens_for,
)
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import (
    CategorizedEndpoints,
    IPFamily,
    NamespacedName,
    ServicePort,
    ServicePortName,
)

__all__ = ["ChainNftablesBackend"]

log = logging.getLogger(__name__)

AFFINITY6_MAP_SIZE = 65536
"""Entries per per-port IPv6 affinity map (clients of one Service port)."""

STALE_CHAIN_DELAY = 1.0
"""Seconds between dropping the last reference to a chain and deleting it."""

_EMPTY = CategorizedEndpoints()
_FAMILIES = {IPFamily.IPV4: Family.IP, IPFamily.IPV6: Family.IP6}
_VALUE_NONE: tuple[str, ...] = ()
# The containers whose elements a full sync reads back and diffs. The affinity map is
# filled by packets, and nodeport-ips belongs to the fixed structure (diffed the same way).
_DIFFED = (
    Names.CLUSTER_IPS,
    Names.NODEPORT_IPS,
    Names.SERVICE_IPS,
    Names.SERVICE_NODEPORTS,
    Names.FIREWALL_IPS,
    Names.NO_ENDPOINT_SERVICES,
    Names.NO_ENDPOINT_NODEPORTS,
    Names.HAIRPIN_ENDPOINTS,
)
_SHARED_SETS = (Names.CLUSTER_IPS, Names.HAIRPIN_ENDPOINTS)
# Delete referring chains before the chains they jump to.
_DELETE_RANK = {
    ChainPrefix.EXTERNAL: 0,
    ChainPrefix.FIREWALL: 0,
    ChainPrefix.SERVICE: 1,
    ChainPrefix.LOCAL: 1,
    ChainPrefix.GROUP: 2,
}


@dataclass(frozen=True, slots=True)
class _Affinity:
    """What the affinity cleanup needs to know about one port with ClientIP affinity."""

    frontends: frozenset[Key]
    """``(ip, proto, port)`` of the cluster IP, external IPs and load-balancer VIPs."""
    node_port: Key | None
    endpoints: frozenset[Key]
    """``(ip, port)`` of every endpoint the port's chains may choose."""


@dataclass(frozen=True, slots=True)
class _PortState:
    """What one programmed Service port has in the kernel."""

    chains: tuple[str, ...]
    elements: tuple[tuple[str, Key, tuple[str, ...]], ...]
    set_elements: tuple[tuple[str, Key], ...]
    affinity: _Affinity | None
    maps: tuple[tuple[str, frozenset[str]], ...] = ()


def _affinity_of(port: ServicePort, eps: CategorizedEndpoints) -> _Affinity | None:
    if not port.session_affinity:
        return None
    proto = port.protocol.lower
    text = str(port.port)
    frontends = frozenset(
        (str(ip), proto, text)
        for ip in (port.cluster_ip, *port.external_ips, *port.load_balancer_vips)
    )
    node_port = (proto, str(port.node_port)) if port.node_port else None
    endpoints = frozenset((ep.address, str(ep.port)) for ep in (*eps.cluster, *eps.local))
    return _Affinity(frontends, node_port, endpoints)


def _ports_of(
    snapshot: ProxySnapshot, services: frozenset[NamespacedName]
) -> Iterable[ServicePortName]:
    """The snapshot's ports of ``services``.

    Uses the snapshot's per-Service index (the core always fills it); a hand-built
    snapshot without one is scanned, comparing
    the (cached-hash) name strings first, because hashing every key's NamespacedName
    dataclass costs milliseconds at 10k ports.
    """
    index = snapshot.ports_by_service
    if index is not None:
        found: list[ServicePortName] = []
        for service in services:
            found.extend(index.get(service, ()))
        return found
    names = {service.name for service in services}
    return [n for n in snapshot.services if n.service.name in names and n.service in services]


def _keeps(old: _Affinity, new: _Affinity | None) -> bool:
    """Whether every affinity entry valid under ``old`` is still valid under ``new``."""
    return (
        new is not None
        and old.endpoints <= new.endpoints
        and old.frontends <= new.frontends
        and old.node_port == new.node_port
    )


class _Batches:
    """Transactions of a sync, committed in order, each of bounded size.

    Chains and rules go into :attr:`tx` at once; element changes wait until the commit
    and then go in grouped by set (deletions first), so nft reads many elements per
    command, and every chain an element points at already exists.
    """

    def __init__(self, backend: ChainNftablesBackend) -> None:
        self._backend = backend
        self.tx = backend._new_transaction()
        self._ports = 0
        self._deletes: dict[str, list[Key]] = {}
        self._adds: dict[str, list[tuple[Key, tuple[str, ...]]]] = {}
        self.operations = 0
        self.transactions = 0

    def delete_element(self, container: str, key: Key) -> None:
        self._deletes.setdefault(container, []).append(key)

    def add_element(self, container: str, key: Key, value: tuple[str, ...]) -> None:
        self._adds.setdefault(container, []).append((key, value))

    def port_done(self) -> None:
        self._ports += 1
        if self._ports >= self._backend.ports_per_transaction:
            self.commit()

    def commit(self) -> None:
        tx = self.tx
        for container, keys in self._deletes.items():
            for key in keys:
                tx.delete_element(container, key)
        for container, items in self._adds.items():
            tx.add_elements(container, items)
        self._deletes = {}
        self._adds = {}
        if tx.num_operations:
            self._backend._run(tx)
            self.operations += tx.num_operations
            self.transactions += 1
        self.tx = self._backend._new_transaction()
        self._ports = 0


class ChainNftablesBackend:
    """The per-Service-chain nftables backend of one family (see the module documentation).

    ``executor`` runs transactions and lists (``LibNftables`` in production, ``FakeNft``
    in tests and for dry runs); ``clock`` is a monotonic clock in seconds. Attributes for
    metrics: :attr:`sync_failures`, :attr:`stale_chain_failures`; for tests and logs:
    :attr:`last_operations`, :attr:`last_transactions`, :attr:`last_sync_full`.
    """

    def __init__(
        self,
        family: IPFamily,
        config: ProxierConfig,
        *,
        executor: NftExecutor,
        clock: Callable[[], float] = time.monotonic,
        ports_per_transaction: int = 2000,
        support_check: bool = True,
    ) -> None:
        if ports_per_transaction < 1:
            raise ValueError("ports_per_transaction must be at least 1")
        self._family = family
        self._nft_family = _FAMILIES[family]
        self._config = config
        self._executor = executor
        self._clock = clock
        self.ports_per_transaction = ports_per_transaction
        self.sync_failures = 0
        self.stale_chain_failures = 0
        self.affinity_cleanup_failures = 0
        self.last_operations = 0
        self.last_transactions = 0
        self.last_sync_full = False
        if support_check:
            check_support(executor, self._nft_family)
        self._reset()

    def _reset(self) -> None:
        self._need_full = True
        self._base_recreated = False
        self._fixed: FixedStructure | None = None
        self._fixed_inputs: object = None
        self._ctx: RenderContext | None = None
        self._ctx_inputs: object = None
        self._ports: dict[ServicePortName, _PortState] = {}
        # Every port of the last snapshot, programmed or not, by Service.
        self._by_service: dict[NamespacedName, set[ServicePortName]] = {}
        self._claims = Claims(log)
        self._unrenderable = SkippedPorts(log)
        self._set_refs: dict[str, dict[Key, int]] = {name: {} for name in _SHARED_SETS}
        self._elements: dict[str, dict[Key, tuple[str, ...]]] = {name: {} for name in _DIFFED}
        self._chains: set[str] = set()
        self._stale: dict[str, float] = {}
        # Per-port IPv6 affinity maps in the kernel, and those no port uses any more.
        self._maps: set[str] = set()
        self._stale_maps: dict[str, float] = {}
        self._affinity_losses: list[_Affinity] = []
        self._map_losses: list[tuple[str, frozenset[str]]] = []

    # Backend protocol -----------------------------------------------------------------------

    @property
    def family(self) -> IPFamily:
        """The IP family this backend programs."""
        return self._family

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Make the kernel match ``snapshot`` (see the module documentation).

        Raises :class:`~kubeproxy.backend.SyncError` when nft refused a transaction; the
        rules of every committed transaction stay, and the next sync is a full one.
        """
        if snapshot.family is not self._family:
            raise ValueError(f"snapshot of {snapshot.family} given to the {self._family} backend")
        now = self._clock()
        self._delete_stale_chains(now)
        full = changes.full or self._need_full
        self.last_sync_full = full
        try:
            if full:
                batches = self._full_sync(snapshot, now)
            else:
                batches = self._partial_sync(snapshot, changes, now)
        except BaseException as err:
            # Whatever went wrong, the model of the kernel may be half advanced.
            self._need_full = True
            if not isinstance(err, NftError):
                raise

            self.sync_failures += 1
            # Our model of the kernel is unreliable now; the next full sync re-lists.
            self._stale.clear()
            self._stale_maps.clear()
            self._affinity_losses = []
            self._map_losses = []
            raise SyncError(f"nftables {self._nft_family} sync failed: {err}") from err
        self._need_full = False
        self._base_recreated = True
        self.last_operations = batches.operations
        self.last_transactions = batches.transactions
        self._clean_affinity(full)

    def cleanup(self) -> None:
        """Delete our table (a missing table is fine) and forget all state."""
        delete_table(self._executor, self._nft_family, TABLE)
        self._reset()

    # Syncs -------------------------------------------------------------------------------------

    def _new_transaction(self) -> Transaction:
        return Transaction(self._nft_family, TABLE)

    def _run(self, tx: Transaction) -> None:
        if tx.error is not None:
            raise tx.error
        self._executor.run(tx)

    def _full_sync(self, snapshot: ProxySnapshot, now: float) -> _Batches:
        self._read_kernel()
        self._ports = {}
        self._by_service = {}
        self._claims.reset()
        self._set_refs = {name: {} for name in _SHARED_SETS}
        fixed = self._fixed_for(snapshot)
        ctx = self._context_for(snapshot)
        batches = _Batches(self)
        self._write_fixed(batches.tx, fixed, recreate_base=not self._base_recreated)
        self._fixed = fixed
        self._ctx = ctx
        self._process(snapshot, snapshot.services.keys(), batches, ctx, now)
        # Whatever the kernel holds beyond what every port wants goes now.
        wanted_chains: set[str] = set()
        for state in self._ports.values():
            wanted_chains.update(state.chains)
        for name in list(self._chains):
            if name not in wanted_chains and name not in self._stale:
                self._stale[name] = now
        wanted_maps = {name for state in self._ports.values() for name, _hosts in state.maps}
        for name in self._maps:
            if name not in wanted_maps and name not in self._stale_maps:
                self._stale_maps[name] = now
        wanted: dict[str, set[Key]] = {name: set() for name in _DIFFED}
        for state in self._ports.values():
            for container, key, _value in state.elements:
                wanted[container].add(key)
        for container, refs in self._set_refs.items():
            wanted[container].update(k for k, n in refs.items() if n > 0)
        wanted[Names.NODEPORT_IPS].update((ip,) for ip in fixed.nodeport_ips)
        for container, present in self._elements.items():
            for key in [k for k in present if k not in wanted[container]]:
                batches.delete_element(container, key)
                del present[key]
        batches.commit()
        return batches

    def _partial_sync(self, snapshot: ProxySnapshot, changes: SyncChanges, now: float) -> _Batches:
        fixed = self._fixed_for(snapshot)
        ctx = self._context_for(snapshot)
        batches = _Batches(self)
        if self._fixed is None or fixed.fingerprint != self._fixed.fingerprint:
            self._write_fixed(batches.tx, fixed)
            self._fixed = fixed
        ports: set[ServicePortName] = set()
        if ctx != self._ctx:
            # Masquerading or detection changed: every port's chains change.
            ports.update(self._claims.wants)
            ports.update(self._unrenderable)
            ports.update(snapshot.services.keys())
            self._ctx = ctx
        elif changes.changed_services:
            changed = changes.changed_services
            for service in changed:
                ports.update(self._by_service.get(service, ()))
            ports.update(_ports_of(snapshot, changed))
        if ports:
            self._process(snapshot, sorted(ports), batches, ctx, now)
        batches.commit()
        return batches

    def _read_kernel(self) -> None:
        """Load chain names and elements from the kernel (full syncs only)."""
        ex = self._executor
        fam = self._nft_family
        self._elements = {name: {} for name in _DIFFED}
        if not ex.table_exists(fam, TABLE):
            self._chains = set()
            self._stale.clear()
            self._maps = set()
            self._stale_maps.clear()
            return
        self._chains = {name for name in ex.list_chains(fam, TABLE) if is_service_chain(name)}
        for name in list(self._stale):
            if name not in self._chains:
                del self._stale[name]
        self._maps = {name for name in ex.list_sets(fam, TABLE) if is_affinity_map(name)}
        for name in list(self._stale_maps):
            if name not in self._maps:
                del self._stale_maps[name]
        for container in _DIFFED:
            try:
                listed = ex.list_elements(fam, TABLE, container)
            except NftError as err:
                if is_not_found(err):
                    continue
                raise
            self._elements[container] = {el.key: el.value for el in listed}

    def _write_fixed(
        self, tx: Transaction, fixed: FixedStructure, *, recreate_base: bool = False
    ) -> None:
        """Queue the table, sets, maps and fixed chains (rules replaced atomically).

        With ``recreate_base``, base chains are deleted and added again in the same
        transaction: the kernel refuses to change a base chain's priority in place, and a
        table left by another version may have them elsewhere.
        """
        tx.add(Table(comment=TABLE_COMMENT))
        for spec in fixed.containers:
            if spec.is_map:
                tx.add(Map(spec.name, spec.type, spec.flags, spec.timeout, spec.size, spec.comment))
            else:
                tx.add(Set(spec.name, spec.type, spec.flags, spec.timeout, spec.size, spec.comment))
        if recreate_base:
            for chain in fixed.chains:
                if chain.hook is not None:
                    # "add" first so that the delete cannot fail on a missing chain.
                    tx.add(Chain(chain.name))
                    tx.delete(Chain(chain.name))
        for chain in fixed.chains:
            tx.add(Chain(chain.name, chain.type, chain.hook, chain.priority, comment=chain.comment))
        for chain in fixed.chains:
            tx.flush(Chain(chain.name))
        for chain in fixed.chains:
            for rule in chain.rules:
                tx.add_rule(chain.name, rule)
        present = self._elements[Names.NODEPORT_IPS]
        wanted = {(ip,) for ip in fixed.nodeport_ips}
        for key in [k for k in present if k not in wanted]:
            tx.delete_element(Names.NODEPORT_IPS, key)
            del present[key]
        for key in sorted(wanted - present.keys()):
            tx.add_element(Names.NODEPORT_IPS, key)
            present[key] = _VALUE_NONE

    def _fixed_for(self, snapshot: ProxySnapshot) -> FixedStructure:
        cidrs = snapshot.service_cidrs or self._config.service_cidrs
        inputs = (self._config.masquerade_mark, snapshot.node_port_addresses, tuple(cidrs))
        if self._fixed_inputs != inputs or self._fixed is None:
            structure = fixed_structure(
                self._family, self._config.masquerade_mark, snapshot.node_port_addresses, cidrs
            )
            self._fixed_inputs = inputs
            return structure
        return self._fixed

    def _context_for(self, snapshot: ProxySnapshot) -> RenderContext:
        detector = snapshot.local_detector.for_family(self._family)
        addresses = snapshot.node.addresses_of(self._family)
        inputs = (detector, self._config.masquerade_all, addresses)
        if self._ctx is not None and self._ctx_inputs == inputs:
            return self._ctx
        ctx = context_or_default(
            tokens_for(self._family),
            detector,
            masquerade_all=self._config.masquerade_all,
            node_addresses=addresses,
            logger=log,
        )
        self._ctx_inputs = inputs
        return ctx

    # Per-port work ------------------------------------------------------------------------------

    def _process(
        self,
        snapshot: ProxySnapshot,
        names: Iterable[ServicePortName],
        batches: _Batches,
        ctx: RenderContext,
        now: float,
    ) -> None:
        """Render ``names``, resolve key conflicts, and queue the differences.

        Additions go into the current (possibly a new) transaction right after the port's
        chains; deletions of keys and shared set elements nobody wants any more go last.
        """
        renders: dict[ServicePortName, PortRules | None] = {}
        claims = self._claims
        for name in names:
            claims.release(name)
            renders[name] = rules = self._render(snapshot, name, ctx)
            if rules is not None:
                claims.claim(name, rules.claims)
        if claims.unsettled:
            for name in claims.resolve():
                if name not in renders:
                    renders[name] = self._render(snapshot, name, ctx)
        dropped: list[tuple[str, Key]] = []
        services = snapshot.services
        added: list[tuple[tuple[str, Key, tuple[str, ...]], ...]] = []
        # Full syncs go in the snapshot's order; sorting 30k dataclass keys costs ~0.5 s.
        for name in renders:
            rules = None if name in claims.skipped else renders[name]
            old = self._ports.pop(name, None)
            new_chains: tuple[str, ...] = ()
            if rules is not None:
                new_chains = self._queue_port(batches, rules)
                service = services[name]
                self._ports[name] = _PortState(
                    new_chains,
                    rules.elements,
                    rules.set_elements,
                    _affinity_of(service, snapshot.categorized.get(name, _EMPTY)),
                    rules.affinity_maps,
                )
                added.append(rules.elements)
            if name in services:
                self._by_service.setdefault(name.service, set()).add(name)
            else:
                ports = self._by_service.get(name.service)
                if ports is not None:
                    ports.discard(name)
                    if not ports:
                        del self._by_service[name.service]
            if old is not None:
                self._forget_port(old, new_chains, now, dropped)
                self._forget_maps(old, self._ports.get(name), now)
                if old.affinity is not None:
                    state = self._ports.get(name)
                    if state is None or not _keeps(old.affinity, state.affinity):
                        self._affinity_losses.append(old.affinity)
            batches.port_done()
        if not dropped:
            return
        elements = self._elements
        refs = self._set_refs
        # A key an old state had may have moved to another port in this sync.
        kept = {(c, k) for group in added for c, k, _v in group}
        for container, key in dropped:
            present = elements[container]
            if key not in present:
                continue
            counts = refs.get(container)
            if counts is not None:
                if counts.get(key, 0) > 0:
                    continue
            elif (container, key) in kept:
                continue
            batches.delete_element(container, key)
            del present[key]

    def _render(
        self, snapshot: ProxySnapshot, name: ServicePortName, ctx: RenderContext
    ) -> PortRules | None:
        return self._unrenderable.render(snapshot, name, functools.partial(render_port, ctx))

    def _queue_port(self, batches: _Batches, rules: PortRules) -> tuple[str, ...]:
        """Queue the chains and elements of a port that the kernel lacks; return its chains."""
        chains = self._chains
        stale = self._stale
        tx = batches.tx
        for name, _hosts in rules.affinity_maps:
            if name in self._maps:
                self._stale_maps.pop(name, None)
                continue
            tx.add(
                Map(
                    name,
                    AFFINITY6_MAP_TYPE,
                    ("dynamic", "timeout"),
                    AFFINITY_TIMEOUT,
                    AFFINITY6_MAP_SIZE,
                )
            )
            self._maps.add(name)
        for chain in rules.chains:
            name = chain.name
            if name in chains:
                stale.pop(name, None)
                continue
            tx.add_chain(name)
            tx.add_rules(name, chain.rules)
            chains.add(name)
        elements = self._elements
        for container, key, value in rules.elements:
            present = elements[container]
            current = present.get(key)
            if current == value:
                continue
            if current is not None:
                batches.delete_element(container, key)
            batches.add_element(container, key, value)
            present[key] = value
        refs = self._set_refs
        for container, key in rules.set_elements:
            counts = refs[container]
            counts[key] = counts.get(key, 0) + 1
            present = elements[container]
            if key not in present:
                batches.add_element(container, key, _VALUE_NONE)
                present[key] = _VALUE_NONE
        return tuple(chain.name for chain in rules.chains)

    def _forget_port(
        self,
        old: _PortState,
        new_chains: tuple[str, ...],
        now: float,
        dropped: list[tuple[str, Key]],
    ) -> None:
        """Mark the old state's chains stale and collect its keys for deletion."""
        for name in old.chains:
            if name not in new_chains and name in self._chains:
                self._stale.setdefault(name, now)
        refs = self._set_refs
        for container, key in old.set_elements:
            counts = refs[container]
            left = counts.get(key, 0) - 1
            if left > 0:
                counts[key] = left
            else:
                counts.pop(key, None)
                dropped.append((container, key))
        dropped.extend((container, key) for container, key, _value in old.elements)

    def _forget_maps(self, old: _PortState, new: _PortState | None, now: float) -> None:
        """Mark maps the port no longer uses stale; note entries that may point astray."""
        if not old.maps:
            return
        wanted = dict(new.maps) if new is not None else {}
        for name, hosts in old.maps:
            if name not in wanted:
                if name in self._maps:
                    self._stale_maps.setdefault(name, now)
            elif not hosts <= wanted[name]:
                self._map_losses.append((name, wanted[name]))

    def _clean_affinity_maps(self) -> None:
        """Best effort: drop entries of per-port IPv6 maps whose endpoint went away."""
        losses = self._map_losses
        self._map_losses = []
        for name, allowed in losses:
            if name not in self._maps:
                continue
            try:
                entries = self._executor.list_elements(self._nft_family, TABLE, name)
                tx = self._new_transaction()
                for entry in entries:
                    if entry.value and entry.value[0] not in allowed:
                        tx.delete_element(name, entry.key)
                if tx.num_operations:
                    self._run(tx)
            except NftError as err:
                self.affinity_cleanup_failures += 1
                log.warning("cleaning session affinity map %s failed: %s", name, err)

    def _current_affinity(self, frontend: Key, into: dict[Key, set[Key]]) -> None:
        """Record the endpoints allowed behind ``frontend`` by the port that holds it now."""
        holder = self._claims.claimant.get(frontend)
        state = self._ports.get(holder) if holder is not None else None
        aff = state.affinity if state is not None else None
        if aff is not None and (frontend in aff.frontends or frontend == aff.node_port):
            into[frontend] = set(aff.endpoints)

    # Stale chains and affinity ----------------------------------------------------------------

    def _delete_stale_chains(self, now: float) -> None:
        due = [name for name, since in self._stale.items() if now - since >= STALE_CHAIN_DELAY]
        due_maps = [n for n, since in self._stale_maps.items() if now - since >= STALE_CHAIN_DELAY]
        if not due and not due_maps:
            return
        due.sort(key=lambda n: (_DELETE_RANK.get(n.partition("-")[0], 3), n))
        tx = self._new_transaction()
        for name in due:
            tx.delete_chain(name)
        # A map is stale no earlier than the chains that used it: delete it after them.
        for name in sorted(due_maps):
            tx.delete(Map(name, AFFINITY6_MAP_TYPE))
        try:
            self._run(tx)
        except NftError as err:
            self.stale_chain_failures += 1
            self._need_full = True
            log.error(
                "deleting %d stale chains and %d stale maps failed (a full sync follows): %s",
                len(due),
                len(due_maps),
                err,
            )
            return
        for name in due:
            del self._stale[name]
            self._chains.discard(name)
        for name in due_maps:
            del self._stale_maps[name]
            self._maps.discard(name)

    def _clean_affinity(self, full: bool) -> None:
        """Best effort: delete affinity entries that point at endpoints no longer in use.

        After a full sync every entry is checked; after an incremental one only entries of
        the frontends of ports that lost endpoints, changed frontends or lost affinity.
        """
        if full:
            # After a restart nothing says which endpoints went away: check every map.
            self._map_losses = [m for state in self._ports.values() for m in state.maps]
        self._clean_affinity_maps()
        losses = self._affinity_losses
        self._affinity_losses = []
        if not full and not losses:
            return
        if self._family is IPFamily.IPV6:
            return  # IPv6 keeps affinity in per-port maps (see _clean_affinity_maps)
        scope: set[Key] = set()
        scope_node_ports: set[Key] = set()
        for lost in losses:
            scope.update(lost.frontends)
            if lost.node_port is not None:
                scope_node_ports.add(lost.node_port)
        current: dict[Key, set[Key]] = {}
        current_node_ports: dict[Key, set[Key]] = {}
        if full:
            for state in self._ports.values():
                aff = state.affinity
                if aff is None:
                    continue
                for frontend in aff.frontends:
                    current.setdefault(frontend, set()).update(aff.endpoints)
                if aff.node_port is not None:
                    current_node_ports.setdefault(aff.node_port, set()).update(aff.endpoints)
        else:
            # Only the frontends in question: who holds each now, and with what endpoints.
            for frontend in scope:
                self._current_affinity(frontend, current)
            for node_port in scope_node_ports:
                self._current_affinity(node_port, current_node_ports)
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
            frontend = entry.key[1:]
            node_port = entry.key[2:]
            if frontend in current or frontend in scope:
                allowed = current.get(frontend)
            elif node_port in current_node_ports or node_port in scope_node_ports:
                # A NodePort entry: its address is a node's, no Service claims it.
                if self._claims.claimant.get(frontend) is not None:
                    continue
                allowed = current_node_ports.get(node_port)
            elif full:
                allowed = None
            else:
                continue
            if allowed is None or entry.value not in allowed:
                tx.delete_element(Names.AFFINITY, entry.key)
        if not tx.num_operations:
            return
        try:
            self._run(tx)
        except NftError as err:
            # An entry may have timed out meanwhile; the next cleanup catches up.
            self.affinity_cleanup_failures += 1
            log.warning("deleting %d stale session affinity entries failed: %s", len(tx), err)
