"""The model of one generation: what the kernel holds of it, and what it lacks for a plan.

Nothing is read back from the kernel on an incremental sync (see the package README):
the backend diffs each Service port's new plan against this model of what it last wrote.
A :class:`Generation` holds, for the generation the fixed chains read (or the one a full
sync is writing):

* every programmed frontend as the kernel holds it (:class:`HeldFrontend`: its plan and
  its endpoint slots), every programmed port's other elements (:class:`PortState`), and
  which ports each Service has;
* how many ports share each cluster IP, hairpin endpoint and affinity local endpoint
  (:class:`SharedCounts`: one element each, deleted when the last port lets go);
* the class, pick and tree chains and the slot maps it has, the class numbers of the
  tree dispatch, and the element types of the containers whose elements go over netlink;
* how many ports use each content-named affinity map and chain.

Its methods queue what a plan needs and the generation lacks (class and pick chains,
slot maps, class numbers and the tree chains that lead to them) and the switch that
points the fixed chains at it.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kubeproxy.backends.nftables.frontends import (
    AFFINITY_LOCAL_ENDPOINTS,
    AffinityPlan,
    ClassSpec,
    Frontend,
    Kind,
    PortPlan,
)
from kubeproxy.backends.nftables.layout import (
    NODEPORT_FRONTENDS,
    SERVICE_FRONTENDS,
    Dispatch,
    GenNames,
    Pick,
    affinity_dispatch_chains,
    class_chain,
    class_numbers,
    class_rule,
    element_types,
    fixed_chain_names,
    fixed_chains,
    pick_chain,
    picks_of,
    public_containers,
    tree_below,
    tree_chains,
    tree_depth,
)
from kubeproxy.backends.nftables.objects import Chain, Map, Set, readable_by_every_nft
from kubeproxy.backends.nftables.stale import TableObject, chain_object, set_object
from kubeproxy.backends.nftables.table import (
    ContainerSpec,
    FamilyTokens,
    FixedChain,
    Key,
    Names,
    RenderContext,
)
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.objects import ServicePortName
from kubeproxy.portindex import PortsByService

__all__ = [
    "KINDS",
    "ElementTypes",
    "Generation",
    "Held",
    "HeldFrontend",
    "PortState",
    "SharedCounts",
    "add_container",
    "content_objects",
    "count_in",
    "count_out",
]

KINDS: tuple[Kind, ...] = (Kind.IP, Kind.NODEPORT)
"""Every frontend kind, in the order their containers and chains are written."""

ElementTypes = dict[str, tuple[tuple[str, ...], tuple[str, ...]]]
"""Container name -> the data types of its keys and values, for the containers whose
elements go over netlink (:func:`~kubeproxy.backends.nftables.layout.element_types`)."""

_VALUE_NONE: tuple[str, ...] = ()


@dataclass(slots=True)
class HeldFrontend:
    """One frontend as the kernel holds it: its plan and its endpoint slots (the main
    and the short-circuit list, slot ``i`` holding endpoint ``main[i]``)."""

    fe: Frontend
    main: tuple[str, ...]
    short: tuple[str, ...]

    @staticmethod
    def of(fe: Frontend, main: tuple[str, ...], short: tuple[str, ...]) -> Held:
        """What :attr:`Generation.held` keeps of ``fe`` with these slots: the frontend
        itself when they are its own endpoints in its order (every frontend a full sync
        writes: 5 MB of these at 100k Services, issue 32), else a :class:`HeldFrontend`."""
        if main == fe.endpoints and short == fe.shortcut:
            return fe
        return HeldFrontend(fe, main, short)

    @staticmethod
    def read(held: Held) -> HeldFrontend:
        """A frontend as :attr:`Generation.held` keeps it (:meth:`of`), as one."""
        if type(held) is HeldFrontend:
            return held
        assert isinstance(held, Frontend)
        return HeldFrontend(held, held.endpoints, held.shortcut)


Held = HeldFrontend | Frontend
"""A frontend as the kernel holds it: the frontend itself when its slots are its own
endpoints in order (:meth:`HeldFrontend.of`)."""


@dataclass(frozen=True, slots=True)
class PortState:
    """What one programmed Service port has in the kernel (beyond its frontends)."""

    keys: tuple[Key, ...]
    firewall: tuple[tuple[Key, tuple[str, ...]], ...]
    cluster_ip: str
    hairpin: tuple[str, ...]
    affinity: AffinityPlan | None

    @classmethod
    def of(cls, plan: PortPlan) -> PortState:
        """The state ``plan`` leaves once written."""
        keys = tuple([fe.key for fe in plan.frontends])  # no generator a port
        if keys == plan.claims:
            # The same keys as the claims tuple the claims keep, in the same order (a
            # port's cluster IP, then its NodePort): that tuple, not a second one (6 MB
            # at 100k Services).
            keys = plan.claims
        return cls(
            keys,
            plan.firewall,
            plan.cluster_ip,
            plan.hairpin,
            plan.affinity,
        )


@dataclass(slots=True)
class SharedCounts:
    """How many ports hold each element several ports may share (one element each).

    ``hairpin`` is None after a full sync: it wrote every port's hairpin elements
    without counting them, and :meth:`Generation.count_hairpin` counts them from the
    ports before the next change. At 100k Services x 10 endpoints the count is a dict of
    1M addresses, 29 MB at the full sync's peak (issue 32), used only to tell, at a
    later change, whether another port still holds an address; a one-shot sync never
    needs it, a daemon counts once (a C loop over the ports' tuples) after the sync's
    transactions are gone.
    """

    cluster_ips: dict[str, int] = field(default_factory=dict)
    hairpin: dict[str, int] | None = field(default_factory=dict)
    local_members: dict[Key, int] = field(default_factory=dict)


def count_in(counts: dict[Any, int], key: object) -> bool:
    """Count one more user of ``key``; True when it is the first."""
    count = counts.get(key, 0) + 1
    counts[key] = count
    return count == 1


def count_out(counts: dict[Any, int], key: object) -> bool:
    """Count one user of ``key`` less; True when that was the last."""
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
        return False
    counts.pop(key, None)
    return True


def content_objects(plan: AffinityPlan | None) -> Iterator[TableObject]:
    """The content-named affinity maps and chains of a port's affinity plan."""
    if plan is None:
        return
    yield from (set_object(m.name) for m in plan.maps)
    yield from (set_object(name) for name in plan.shared_maps)
    yield from (chain_object(c.name) for c in plan.chains)


def add_container(tx: Transaction, spec: ContainerSpec) -> None:
    """Queue ``add`` of the set or map ``spec``, declared so that every nft reads it
    (:func:`~.objects.readable_by_every_nft`)."""
    kind = Map if spec.is_map else Set
    tx.add(
        readable_by_every_nft(
            kind(
                spec.name, spec.type, spec.flags, spec.timeout, spec.size, spec.comment, spec.typeof
            )
        )
    )


class Generation:
    """What the kernel holds of generation ``gen`` of one family (``tokens``) with class
    dispatch ``dispatch`` (see the module documentation). The backend owns one and
    replaces it at every full sync; the element diff reads and updates :attr:`held` and
    :attr:`shared`."""

    def __init__(
        self,
        gen: int,
        tokens: FamilyTokens,
        dispatch: Dispatch,
        shards: tuple[ContainerSpec, ...] = (),
    ) -> None:
        self.names = GenNames(gen)
        self.tokens = tokens
        self.dispatch = dispatch
        # The shared affinity maps (outside generations, declared by every full sync).
        self.shards = shards
        self.ports: dict[ServicePortName, PortState] = {}
        self.by_service = PortsByService()
        self.held: dict[Key, Held] = {}
        # A full sync writes the hairpin elements uncounted (see SharedCounts).
        self.shared = SharedCounts(hairpin=None)
        self.classes: list[ClassSpec] = []  # rule dispatch: the class rules, in order
        self.class_chains: set[ClassSpec] = set()
        self.picks: set[Pick] = set()
        self.slot_maps: set[str] = set()
        # Tree dispatch: class -> number, per kind number -> class, bits, chains held.
        self.numbers: dict[ClassSpec, int] = {}
        self.by_number: dict[Kind, dict[int, ClassSpec]] = {kind: {} for kind in KINDS}
        self.depth: dict[Kind, int] = dict.fromkeys(KINDS, 0)
        self.tree: dict[str, tuple[str, ...]] = {}
        # Per kind: the numbers handed out since the tree chains were written (None: all
        # of them, the tree is written whole), and tree_below of every number.
        self._new_numbers: dict[Kind, list[int] | None] = dict.fromkeys(KINDS)
        self._below: dict[Kind, set[tuple[int, int]]] = {kind: set() for kind in KINDS}
        # How many ports use each content-named affinity map and chain.
        self.content_refs: dict[TableObject, int] = {}
        self.element_types: ElementTypes = {}

    def count_hairpin(self) -> dict[str, int]:
        """The hairpin counts (:class:`SharedCounts`), counted from the ports' states if
        the full sync left them uncounted: call before a change pops any port's state."""
        counts = self.shared.hairpin
        if counts is None:
            # Counter's update is a C loop: 1M addresses in 0.26-0.31 s of CPU (three
            # runs in process at 100k Services, the shared machine), once per full sync.
            counts = Counter(
                itertools.chain.from_iterable(state.hairpin for state in self.ports.values())
            )
            self.shared.hairpin = counts
        return counts

    @property
    def gen(self) -> int:
        """The generation's number (the ``.gN`` of its names)."""
        return self.names.gen

    @property
    def numbered(self) -> dict[ClassSpec, int] | None:
        """The class numbers (tree dispatch), None with one rule per class."""
        return self.numbers if self.dispatch == Dispatch.TREE else None

    # Containers and chains ----------------------------------------------------------------

    def declare(self, tx: Transaction, spec: ContainerSpec) -> None:
        """Queue ``add`` of a container, and note its element types if netlink can send
        its elements."""
        add_container(tx, spec)
        types = element_types(spec, self.tokens)
        if types is not None:
            self.element_types[spec.name] = types

    def declare_fixed(self, tx: Transaction, hooked: set[str]) -> None:
        """Queue the generation's containers, the public containers, the class-bit sets
        numbered so far, and the chains outside generations that are not base chains
        (``hooked``) with the affinity dispatch chains (a full sync's first
        transaction)."""
        names, tokens = self.names, self.tokens
        for spec in (
            *public_containers(tokens),
            *self.shards,
            *names.containers(tokens, self.dispatch),
        ):
            self.declare(tx, spec)
        for kind in KINDS:
            for bit in range(self.depth[kind]):
                self.declare(tx, names.bit_set(kind, bit, tokens))
        for chain_name in fixed_chain_names(self.dispatch):
            if chain_name not in hooked:
                tx.add_chain(chain_name)
        for chain_name, rules in affinity_dispatch_chains(names, tokens).items():
            tx.add_chain(chain_name)
            tx.add_rules(chain_name, rules)

    def wanted(self, kept: Iterable[TableObject]) -> set[TableObject]:
        """Every object this generation uses, with the chains outside generations and
        ``kept`` (objects other parts of the proxy keep in our table)."""
        names, tokens, dispatch = self.names, self.tokens, self.dispatch
        wanted = {chain_object(n) for n in fixed_chain_names(dispatch)}
        wanted.update(kept)
        wanted.update(set_object(c.name) for c in public_containers(tokens))
        wanted.update(set_object(c.name) for c in self.shards)
        wanted.update(set_object(c.name) for c in names.containers(tokens, dispatch))
        wanted.update(chain_object(n) for n in affinity_dispatch_chains(names, tokens))
        wanted.update(chain_object(names.cls(spec)) for spec in self.class_chains)
        wanted.update(set_object(names.cls(spec)) for spec in self.classes)
        for kind in KINDS:
            wanted.update(set_object(names.class_bit(kind, b)) for b in range(self.depth[kind]))
        wanted.update(chain_object(name) for name in self.tree)
        wanted.update(chain_object(names.pick(p)) for p in self.picks)
        wanted.update(set_object(name) for name in self.slot_maps)
        wanted.update(self.content_refs)
        return wanted

    # Classes and their dispatch -------------------------------------------------------------

    def number_classes(
        self, plans: Iterable[PortPlan], precreated: Iterable[ClassSpec] = ()
    ) -> None:
        """Class numbers for a new generation: the most used classes get the numbers with
        the fewest bits set (fewer elements, fewer gotos per connection); the
        ``precreated`` classes no frontend uses yet come after them, fewest endpoints
        first."""
        use: dict[ClassSpec, int] = {}
        for plan in plans:
            for fe in plan.frontends:
                if fe.cls is not None:
                    use[fe.cls] = use.get(fe.cls, 0) + 1
        for cls in precreated:
            use.setdefault(cls, 0)
        for kind in KINDS:
            ranked = sorted(
                (c for c in use if c.kind == kind),
                key=lambda c: (-use[c], c.count if not use[c] else 0, c),
            )
            depth = tree_depth(len(ranked))
            self.depth[kind] = depth
            for cls, number in zip(ranked, class_numbers(depth), strict=False):
                self.numbers[cls] = number
                self.by_number[kind][number] = cls
            self._below[kind] = tree_below(self.by_number[kind])
            self._new_numbers[kind] = None

    def add_structure(
        self, tx: Transaction, plan: PortPlan, ctx: RenderContext, *, live: bool
    ) -> None:
        """Queue the classes and picks ``plan`` needs and the generation lacks (the
        dispatch-tree chains follow in :meth:`update_tree`). ``live``: the fixed chains
        read this generation already (with one rule per class, a new class's rule goes
        into them now; else the switch writes it)."""
        for fe in plan.frontends:
            cls = fe.cls
            if cls is not None and cls not in self.class_chains:
                self.add_class(tx, cls, ctx, live=live)

    def add_class(self, tx: Transaction, cls: ClassSpec, ctx: RenderContext, *, live: bool) -> None:
        """Queue one class the generation lacks: its picks and their slot maps, its chain,
        and its number (tree dispatch) or its rule (see :meth:`add_structure`)."""
        names, tokens = self.names, self.tokens
        tree = self.dispatch == Dispatch.TREE
        for pick in picks_of(cls):
            if pick not in self.picks:
                for spec in names.slot_maps(pick, tokens):
                    if spec.name not in self.slot_maps:
                        self.declare(tx, spec)
                        self.slot_maps.add(spec.name)
                chain = pick_chain(names, pick, tokens)
                tx.add_chain(chain.name)
                tx.add_rules(chain.name, chain.rules)
                self.picks.add(pick)
        chain = class_chain(names, cls, ctx)
        tx.add_chain(chain.name)
        tx.add_rules(chain.name, chain.rules)
        self.class_chains.add(cls)
        if tree:
            if cls not in self.numbers:
                self._new_number(tx, cls)
            return
        self.declare(tx, names.class_set(cls, tokens))
        frontends = SERVICE_FRONTENDS if cls.kind == Kind.IP else NODEPORT_FRONTENDS
        if live:
            tx.add_rule(frontends, class_rule(names, cls, tokens))
        self.classes.append(cls)

    def _new_number(self, tx: Transaction, cls: ClassSpec) -> None:
        """Give a class seen for the first time in this generation a free number, one
        more bit (and its set) if all numbers of the current depth are taken."""
        kind = cls.kind
        taken = self.by_number[kind]
        depth = self.depth[kind]
        while True:
            free = next((n for n in class_numbers(depth) if n not in taken), None)
            if free is not None:
                break
            depth += 1
        for bit in range(self.depth[kind], depth):
            self.declare(tx, self.names.bit_set(kind, bit, self.tokens))
        self.depth[kind] = depth
        self.numbers[cls] = free
        taken[free] = cls
        self._below[kind].update(tree_below((free,)))
        pending = self._new_numbers[kind]
        if pending is not None:
            pending.append(free)

    def update_tree(self, tx: Transaction) -> None:
        """Queue the dispatch-tree chains that are new or changed: new chains first
        (a parent's rules go to them), then their rules. Only the chains on the paths of
        numbers handed out since the last call can change (:func:`tree_chains`)."""
        if self.dispatch != Dispatch.TREE:
            return
        wanted: dict[str, tuple[str, ...]] = {}
        for kind in KINDS:
            pending = self._new_numbers[kind]
            if pending == []:
                continue
            wanted.update(
                tree_chains(
                    self.names,
                    kind,
                    self.by_number[kind],
                    self.depth[kind],
                    self.tokens,
                    only=pending,
                    below=self._below[kind],
                )
            )
            self._new_numbers[kind] = []
        changed = [name for name, rules in wanted.items() if self.tree.get(name) != rules]
        for name in changed:
            if name not in self.tree:
                tx.add_chain(name)
        for name in changed:
            if name in self.tree:
                tx.flush(Chain(name))
            tx.add_rules(name, wanted[name])
            self.tree[name] = wanted[name]

    # Content-named affinity objects ---------------------------------------------------------

    def follow_content(
        self, old: AffinityPlan | None, new: AffinityPlan | None
    ) -> list[TableObject]:
        """Count the content-named affinity objects a port uses now (``new``) instead of
        before (``old``); the objects no port uses any more."""
        refs = self.content_refs
        for obj in content_objects(new):
            count_in(refs, obj)
        return [obj for obj in content_objects(old) if count_out(refs, obj)]

    # The switch -------------------------------------------------------------------------------

    def fixed_chains(
        self, *, masquerade_mark: int, match_all_nodeports: bool, service_cidrs: Iterable[str]
    ) -> tuple[FixedChain, ...]:
        """The chains outside generations, with rules reading this one."""
        return fixed_chains(
            self.names,
            self.tokens,
            masquerade_mark=masquerade_mark,
            match_all_nodeports=match_all_nodeports,
            service_cidrs=service_cidrs,
            dispatch=self.dispatch,
            classes=self.classes,
            shared_affinity=bool(self.shards),
        )

    def queue_switch(
        self,
        tx: Transaction,
        fixed: Iterable[FixedChain],
        nodeport_ips: Iterable[Key],
        *,
        recreate_base: bool,
    ) -> None:
        """Point the ``fixed`` chains at this generation, and refill the public sets.

        ``recreate_base``: a base chain's priority cannot change in place, and a table
        left by another version may have them elsewhere: re-create them, atomically
        (once per process)."""
        fixed = tuple(fixed)
        addr_type = self.tokens.addr_type
        for chain in fixed:
            if chain.hook is None:
                continue
            if recreate_base:
                tx.add(Chain(chain.name))
                tx.delete(Chain(chain.name))
            tx.add(Chain(chain.name, chain.type, chain.hook, chain.priority))
        for chain in fixed:
            tx.flush(Chain(chain.name))
        for chain in fixed:
            if chain.rule_comment is None:
                tx.add_rules(chain.name, chain.rules)
            else:
                for rule in chain.rules:
                    tx.add_rule(chain.name, rule, chain.rule_comment)
        tx.flush(Set(Names.CLUSTER_IPS, addr_type))
        tx.add_elements(Names.CLUSTER_IPS, [((k,), _VALUE_NONE) for k in self.shared.cluster_ips])
        tx.flush(Set(AFFINITY_LOCAL_ENDPOINTS, addr_type))
        tx.add_elements(
            AFFINITY_LOCAL_ENDPOINTS, [(k, _VALUE_NONE) for k in self.shared.local_members]
        )
        tx.flush(Set(Names.NODEPORT_IPS, addr_type))
        tx.add_elements(Names.NODEPORT_IPS, [(k, _VALUE_NONE) for k in nodeport_ips])
