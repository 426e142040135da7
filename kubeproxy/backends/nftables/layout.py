"""The map structure's table: fixed chains, one generation's containers, class chains.

Everything here is a pure function of its inputs. The table holds:

* fixed chains with upstream's names, hooks and priorities (base chains, ``services``,
  ``masquerading``, the filter checks ...), whose few rules read the containers of the
  current *generation*;
* per generation (names ending in ``.g<N>``): the endpoint-slot maps, the no-endpoint,
  firewall and hairpin sets, the affinity lookup and record verdict maps, one chain per
  frontend *class* and per endpoint *pick*, and the class *dispatch*: a decision tree of
  chains over "bit j of the frontend's class number is set" sets (:func:`tree_chains`);
* outside generations: ``cluster-ips`` and ``nodeport-ips`` (other components read them by
  name), and the content-named affinity maps and chains of ClientIP ports (packets fill
  the maps; a full sync keeps them).

How a new connection finds its class (issue 19): ``services`` looks the frontend up in
the generation's ``dispatch-ips`` set (one lookup, also for traffic to no Service), then
walks the tree: the chain of class number ``c`` tests, from high to low, the bits below
``c``'s lowest set bit and goes to the subtree of the first one set, or else to the
class chain of ``c``. A connection costs one lookup per bit of the class numbers (9 at
500 classes), whatever the class, and a frontend's class is data (its bits), so moving
to a class the generation has is element changes only (a class seen for the first time
adds its chains: the package README's "A never-seen endpoint count"; with
``precreate_counts`` a generation holds the classes of the counts up to it from its
start, :func:`precreated_classes`). The tree's gotos count towards the kernel's
16-level jump limit once per set bit, so class numbers are handed out by popularity in
order of fewer set bits, never more than :data:`MAX_CLASS_BITS` of them.
The previous dispatch (one rule per class in ``service-frontends``, every rule a lookup
for a connection to the last class or to no Service) stays selectable for the
benchmarks as :attr:`Dispatch.RULES`.

A full sync builds a new generation beside the current one, then switches the fixed
chains to it in one transaction (see :mod:`~kubeproxy.backends.nftables.backend`); an
incremental sync adds or deletes data elements of the current generation only, except
when a class or pick appears for the first time.
"""

from __future__ import annotations

import enum
import functools
import itertools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kubeproxy.backends.nftables.elements import supports
from kubeproxy.backends.nftables.frontends import (
    AFFINITY_LOCAL_ENDPOINTS,
    ClassSpec,
    Kind,
    NoEndpoint,
    Shape,
)
from kubeproxy.backends.nftables.table import (
    AFFINITY_FIND,
    AFFINITY_FULL,
    AFFINITY_SHARD_PREFIX,
    AFFINITY_SHARDS,
    AFFINITY_TIMEOUT,
    ContainerSpec,
    FamilyTokens,
    FixedChain,
    Names,
    RenderContext,
    base_chains,
)

__all__ = [
    "AFFINITY_FRONTEND_TYPE",
    "AFFINITY_FULL_COMMENT",
    "AFFINITY_MAPS",
    "AFFINITY_PER_PORT",
    "AFFINITY_PINNED",
    "AFFINITY_PROTOCOLS",
    "AFFINITY_SHARD_TYPES",
    "AFFINITY_SHARED",
    "AFFINITY_SHARED_IPV4",
    "CLASS_NAME",
    "FIREWALL_PROTOCOLS",
    "MAX_CLASS_BITS",
    "Dispatch",
    "GenNames",
    "Pick",
    "affinity_frontend_map",
    "affinity_shards",
    "class_bits",
    "class_chain",
    "class_numbers",
    "class_rule",
    "element_types",
    "firewall_allow_key",
    "firewall_allow_rule",
    "fixed_chain_names",
    "fixed_chains",
    "generation_of",
    "pick_chain",
    "picks_of",
    "precreated_classes",
    "public_containers",
    "slot_bucket",
    "tree_below",
    "tree_chains",
    "tree_depth",
    "tree_path",
]


class Dispatch(enum.StrEnum):
    """How a connection finds its frontend's class."""

    TREE = "tree"
    """A decision tree over class-number bit sets (the default)."""
    RULES = "rules"
    """One rule per class (the structure before issue 19, for benchmarks)."""


MAX_CLASS_BITS = 8
"""Most set bits a class number may have: each is one goto deeper in the tree, and the
kernel refuses paths of 16 levels (base chain, ``services``, the tree, the class, its pick,
the affinity lookup: 6 + this stays below)."""

AFFINITY_PROTOCOLS = ("tcp", "udp", "sctp")
SLOT_PROTOCOLS = AFFINITY_PROTOCOLS
"""The protocols a Service port may have; each has its own endpoint-slot maps."""
FIREWALL_PROTOCOLS = SLOT_PROTOCOLS
"""Each has its own ``firewall-allow-<protocol>`` set (see :func:`firewall_allow_key`)."""


def firewall_allow_key(ip: str) -> str:
    """The key of the ``firewall-allow-<protocol>`` sets (declared ``typeof``, ``flags
    interval``), as the firewall check looks it up: destination, port, source address.

    Why one set per protocol and no ``meta l4proto`` in the key (Debian's 6.12, found by
    ``make test-kernels``): before, one set held ``daddr . meta l4proto . th dport .
    saddr``. For a one-byte field in host byte order (``meta l4proto``) in an interval
    concatenation, nft before 1.1.0
    writes a byte-order conversion of length 1 and size 2 (``byteorder reg 9 =
    hton(reg 9, 2, 1)``, a no-op), and kernels with "netfilter: nft_byteorder: remove
    multi-register support" refuse any conversion whose length is not its size
    (``EOPNOTSUPP``): Debian's 6.12.117 refuses the rule with Debian 12's nft 1.0.6, so the
    proxy could not start there. Payload fields (addresses, ``th dport``) need no
    conversion, so this key loads the same on every kernel with every nft we support,
    and the rule's ``meta l4proto <protocol>`` is a plain comparison. Per-change cost
    stays data: a source range is one element, in its protocol's set.
    """
    return f"{ip} daddr . th dport . {ip} saddr"


def firewall_allow_rule(ip: str, proto: str, name: str) -> str:
    """The firewall check's rule letting allowed sources of ``proto`` frontends through
    (``name`` is that protocol's ``firewall-allow`` set)."""
    return f"meta l4proto {proto} {firewall_allow_key(ip)} @{name} return"


_GEN = re.compile(r"\.g([0-9]+)$")
CLASS_NAME = re.compile(
    r"(?:internal|external|nodeport)(?:-local)?-[0-9]+(?:-[0-9]+)?(?:-affinity)?\.g([0-9]+)"
)
"""What :meth:`GenNames.cls` names a class set and chain (group 1: the generation)."""
_L4 = "meta l4proto { tcp, udp, sctp }"


def generation_of(name: str) -> int | None:
    """The generation a container or chain name belongs to, or None for other names."""
    found = _GEN.search(name)
    return int(found.group(1)) if found else None


@dataclass(frozen=True, slots=True, order=True)
class Pick:
    """One way to choose an endpoint: ``count`` slots of the ``shortcut`` or main map of
    ``kind`` frontends, after the ClientIP ``affinity`` lookup when set.
    """

    kind: Kind
    shortcut: bool
    count: int
    affinity: bool


def picks_of(cls: ClassSpec) -> tuple[Pick, ...]:
    """The picks a class chain jumps to."""
    picks = []
    if cls.count:
        picks.append(Pick(cls.kind, False, cls.count, cls.affinity))
    if cls.shape == Shape.LOCAL and cls.shortcut:
        picks.append(Pick(cls.kind, True, cls.shortcut, cls.affinity))
    return tuple(picks)


class GenNames:
    """The names of one generation's containers and chains."""

    def __init__(self, gen: int) -> None:
        self.gen = gen
        suffix = f".g{gen}"
        self.suffix = suffix
        # Names are asked for per frontend (100k times in a big sync): built once each.
        self._memo: dict[tuple[object, ...], str] = {}
        self.no_endpoint_reject = f"no-endpoint-reject{suffix}"
        self.no_endpoint_drop = f"no-endpoint-drop{suffix}"
        self.no_endpoint_nodeports_reject = f"no-endpoint-nodeports-reject{suffix}"
        self.no_endpoint_nodeports_drop = f"no-endpoint-nodeports-drop{suffix}"
        self.firewall_ips = f"firewall-ips{suffix}"
        self._firewall_allow = {
            proto: f"firewall-allow-{proto}{suffix}" for proto in FIREWALL_PROTOCOLS
        }
        self.hairpin = f"hairpin-endpoints{suffix}"

    def firewall_allow(self, proto: str) -> str:
        """The set of allowed ``VIP . port . source`` of ``proto`` load balancers with
        source ranges (:func:`firewall_allow_key`)."""
        return self._firewall_allow[proto]

    def slots(self, kind: Kind, shortcut: bool, proto: str, count: int) -> str:
        """The endpoint-slot map of ``kind`` frontends of one protocol (main list, or the
        short-circuit list of Local-policy frontends) with ``count`` endpoints: one map
        per :func:`slot_bucket` of counts."""
        bucket = slot_bucket(count)
        memo = ("slots", kind, shortcut, proto, bucket)
        found = self._memo.get(memo)
        if found is not None:
            return found
        head = "endpoints" if kind == Kind.IP else "nodeport-endpoints"
        if shortcut:
            head = f"shortcut-{head}"
        name = self._memo[memo] = f"{head}-{proto}-b{bucket}{self.suffix}"
        return name

    def slot_maps(self, pick: Pick, tokens: FamilyTokens) -> tuple[ContainerSpec, ...]:
        """The endpoint-slot maps a pick reads, one per protocol."""
        key = f"{_frontend(pick.kind, tokens)} . numgen random mod 1"
        ip = tokens.table_family
        # One map per protocol: nft types the value's port by protocol, and a "th dport"
        # value would not list back into a valid declaration.
        return tuple(
            ContainerSpec(
                self.slots(pick.kind, pick.shortcut, proto, pick.count),
                True,
                f"{key} : {ip} daddr . {proto} dport",
                typeof=True,
            )
            for proto in SLOT_PROTOCOLS
        )

    def no_endpoint(self, kind: Kind, verdict: NoEndpoint) -> str:
        """The set of ``kind`` frontends without endpoints whose packets get ``verdict``."""
        if kind == Kind.IP:
            return (
                self.no_endpoint_reject if verdict == NoEndpoint.REJECT else self.no_endpoint_drop
            )
        if verdict == NoEndpoint.REJECT:
            return self.no_endpoint_nodeports_reject
        return self.no_endpoint_nodeports_drop

    def cls(self, spec: ClassSpec) -> str:
        """The set and the chain of one class (a set and a chain may share a name)."""
        memo = ("cls", spec)
        found = self._memo.get(memo)
        if found is not None:
            return found
        if spec.kind == Kind.IP:
            head = "internal" if spec.shape == Shape.INTERNAL else "external"
        else:
            head = "nodeport"
        name = f"{head}-{spec.count}"
        if spec.shape == Shape.LOCAL:
            name = f"{head}-local-{spec.count}-{spec.shortcut}"
        if spec.affinity:
            name += "-affinity"
        found = self._memo[memo] = name + self.suffix
        return found

    def pick(self, pick: Pick) -> str:
        """The chain of one pick."""
        head = "pick" if pick.kind == Kind.IP else "pick-nodeport"
        if pick.shortcut:
            head += "-shortcut"
        name = f"{head}-{pick.count}"
        if pick.affinity:
            name += "-affinity"
        return name + self.suffix

    def dispatch(self, kind: Kind) -> str:
        """The set of every dispatched ``kind`` frontend (tree dispatch)."""
        return f"dispatch-{_PLURAL[kind]}{self.suffix}"

    def class_bit(self, kind: Kind, bit: int) -> str:
        """The set of ``kind`` frontends whose class number has ``bit`` set."""
        memo = ("bit", kind, bit)
        found = self._memo.get(memo)
        if found is None:
            found = self._memo[memo] = f"class-bit-{_PLURAL[kind]}-{bit}{self.suffix}"
        return found

    def tree(self, kind: Kind, number: int) -> str:
        """The dispatch-tree chain of class number ``number`` (0: the root)."""
        return f"dispatch-{_PLURAL[kind]}-{number}{self.suffix}"

    def affinity_lookup(self, kind: Kind, shortcut: bool) -> str:
        """The verdict map (and the chain that reads it) sending ``kind`` frontends of
        affinity classes to their port's lookup chain, for the main or short-circuit pick."""
        head = "affinity-shortcut" if shortcut else "affinity-lookup"
        return f"{head}-{_PLURAL[kind]}{self.suffix}"

    def affinity_record(self, kind: Kind) -> str:
        """The verdict map sending new DNATed connections of ``kind`` frontends with
        affinity to their port's record chain."""
        return f"affinity-record-{_PLURAL[kind]}{self.suffix}"

    def affinity_canonical(self, kind: Kind) -> str:
        """The map turning ``kind`` frontends other than a cluster IP into their port's
        cluster IP, for the affinity entries keyed by that frontend (see
        :func:`affinity_dispatch_chains`)."""
        return f"affinity-canonical-{_PLURAL[kind]}{self.suffix}"

    @property
    def affinity_canonical_ports(self) -> str:
        """The map turning a NodePort (``protocol . nodePort``) into its Service port."""
        return f"affinity-canonical-ports{self.suffix}"

    def affinity_canonical_lookup(self, kind: Kind) -> str:
        """The chain that looks up a ``kind`` frontend's entry as its cluster IP's."""
        return f"affinity-canonical-lookup-{_PLURAL[kind]}{self.suffix}"

    def affinity_canonical_record(self, kind: Kind) -> str:
        """The chain that finds a ``kind`` frontend's record chain once its packet was
        turned into its cluster IP's."""
        return f"affinity-canonical-record-{_PLURAL[kind]}{self.suffix}"

    def containers(self, tokens: FamilyTokens, dispatch: Dispatch) -> tuple[ContainerSpec, ...]:
        """The generation's fixed containers (class and class-bit sets come on demand)."""
        ip = tokens.table_family
        addr = tokens.addr_type
        frontend = f"{addr} . inet_proto . inet_service"
        nodeport = "inet_proto . inet_service"
        specs = [
            ContainerSpec(self.no_endpoint_reject, False, frontend),
            ContainerSpec(self.no_endpoint_drop, False, frontend),
            ContainerSpec(self.no_endpoint_nodeports_reject, False, nodeport),
            ContainerSpec(self.no_endpoint_nodeports_drop, False, nodeport),
            ContainerSpec(self.firewall_ips, False, frontend, comment="LoadBalancerSourceRanges"),
            *(
                ContainerSpec(
                    self.firewall_allow(proto),
                    False,
                    firewall_allow_key(ip),
                    flags=("interval",),
                    typeof=True,
                )
                for proto in FIREWALL_PROTOCOLS
            ),
            ContainerSpec(self.hairpin, False, f"{addr} . {addr}"),
        ]
        for kind in (Kind.IP, Kind.NODEPORT):
            key_type = _key_type(kind, tokens)
            # Both dispatches keep it: affinity-record reads it too.
            specs.append(ContainerSpec(self.dispatch(kind), False, key_type))
            for name in (
                self.affinity_lookup(kind, False),
                self.affinity_lookup(kind, True),
                self.affinity_record(kind),
            ):
                specs.append(ContainerSpec(name, True, f"{key_type} : verdict"))
            specs.append(ContainerSpec(self.affinity_canonical(kind), True, f"{key_type} : {addr}"))
        nodeport_key = _key_type(Kind.NODEPORT, tokens)
        specs.append(
            ContainerSpec(self.affinity_canonical_ports, True, f"{nodeport_key} : inet_service")
        )
        return tuple(specs)

    def class_set(self, spec: ClassSpec, tokens: FamilyTokens) -> ContainerSpec:
        """The membership set of one class."""
        return ContainerSpec(self.cls(spec), False, _key_type(spec.kind, tokens))

    def bit_set(self, kind: Kind, bit: int, tokens: FamilyTokens) -> ContainerSpec:
        """The set of one class-number bit."""
        return ContainerSpec(self.class_bit(kind, bit), False, _key_type(kind, tokens))


_PLURAL = {Kind.IP: "ips", Kind.NODEPORT: "nodeports"}


def slot_bucket(count: int) -> int:
    """The slot map of frontends with ``count`` endpoints: counts share a map when they
    have the same bit length (1, 2-3, 4-7, ... 512-1023 ...).

    Why not one map for every count: the kernel checks each element added to a map
    against every rule that reads the map (``nft_validate_register_store`` per binding),
    and every pick chain, one per endpoint count, reads its slot maps. With the several
    hundred counts of a real cluster's 30k Services, filling the slots took 4 s of
    kernel time, against 0.9 s for the same number of elements in a cluster of one count.
    A frontend whose count changes bucket moves all its slots; within a bucket, one
    endpoint changed is still one slot rewritten.
    """
    return max(1, count).bit_length()


def precreated_classes(bound: int) -> tuple[ClassSpec, ...]:
    """The classes a generation holds from its start when it precreates endpoint counts
    up to ``bound`` (``precreate_counts``, issue 32): every shape whose class is its
    count alone (Service IPs internal and external, NodePorts external), without
    affinity, with 1 to ``bound`` endpoints. A frontend of one of these classes is then
    element changes only, whatever its count; the Local shapes (a class per pair of
    counts) and affinity classes (each pick jumps to the affinity lookup, which the
    kernel's validation would walk once per pick) still add theirs when first seen.
    """
    return tuple(
        ClassSpec(kind, shape, count)
        for count in range(1, bound + 1)
        for kind, shape in (
            (Kind.IP, Shape.INTERNAL),
            (Kind.IP, Shape.EXTERNAL),
            (Kind.NODEPORT, Shape.EXTERNAL),
        )
    )


@functools.cache
def _class_numbers(depth: int) -> tuple[int, ...]:
    numbers = []
    for ones in range(min(depth, MAX_CLASS_BITS) + 1):
        for bits in itertools.combinations(range(depth), ones):
            numbers.append(sum(1 << b for b in bits))
    return tuple(sorted(numbers, key=lambda n: (n.bit_count(), n)))


def class_numbers(depth: int) -> list[int]:
    """The class numbers a tree of ``depth`` bits hands out, in the order it hands them
    out: fewer set bits first (the most popular classes cost the fewest elements and
    gotos), at most :data:`MAX_CLASS_BITS` set bits. Computed once per depth (a class
    seen for the first time asks again, 2.7 ms at 30k Services' depth)."""
    return list(_class_numbers(depth))


def tree_depth(classes: int) -> int:
    """The fewest bits whose class numbers (:func:`class_numbers`) cover ``classes``."""
    depth = 0
    while len(_class_numbers(depth)) < classes:
        depth += 1
    return depth


def class_bits(number: int) -> tuple[int, ...]:
    """The bits set in a class number: the bit sets its frontends are members of."""
    return tuple(b for b in range(number.bit_length()) if number >> b & 1)


def tree_chains(
    names: GenNames,
    kind: Kind,
    classes: Mapping[int, ClassSpec],
    depth: int,
    tokens: FamilyTokens,
    only: Iterable[int] | None = None,
    below: set[tuple[int, int]] | None = None,
) -> dict[str, tuple[str, ...]]:
    """The dispatch tree of ``kind`` frontends: chain name -> rules.

    ``classes`` maps class numbers (below ``2 ** depth``) to classes. The chain of number
    ``c`` (the root is 0) tests the bits below ``c``'s lowest set bit (all ``depth`` for
    the root), highest first, each only if some class lies behind it, and goes to the
    first subtree whose bit is set; else to the class chain of ``c``, if ``c`` is a class.

    ``only``: just the chains a class number newly handed out among ``classes`` may
    have changed (:func:`tree_path` of each): a class seen for the first time then
    costs the chains on its path, not the whole tree (the whole tree took 6 ms at the
    900 classes of 30k Services, at every new class). ``below``: :func:`tree_below` of
    ``classes``, if the caller keeps it.
    """
    if below is None:
        below = tree_below(classes)
    if only is not None:
        return {
            names.tree(kind, number): _tree_rules(
                names, kind, number, level, below, classes, tokens
            )
            for n in only
            for number, level in tree_path(n, depth)
        }
    chains: dict[str, tuple[str, ...]] = {}
    pending = [(0, depth)]
    while pending:
        number, level = pending.pop()
        chains[names.tree(kind, number)] = _tree_rules(
            names, kind, number, level, below, classes, tokens
        )
        for bit in range(level - 1, -1, -1):
            child = number | 1 << bit
            if (bit, child >> bit) in below:
                pending.append((child, bit))
    return chains


def tree_below(numbers: Iterable[int]) -> set[tuple[int, int]]:
    """``(bit, c >> bit)`` for every class number ``c`` and set bit of it: whether some
    class lies behind the subtree a tree chain's test of ``bit`` goes to."""
    return {(bit, n >> bit) for n in numbers for bit in range(n.bit_length()) if n >> bit & 1}


def tree_path(number: int, depth: int) -> tuple[tuple[int, int], ...]:
    """The tree chains a connection to class ``number`` walks, ``(number, level)`` from
    the root (level: how many low bits the chain tests)."""
    path = [(0, depth)]
    current = 0
    for bit in range(depth - 1, -1, -1):
        if number >> bit & 1:
            current |= 1 << bit
            path.append((current, bit))
    return tuple(path)


def _tree_rules(
    names: GenNames,
    kind: Kind,
    number: int,
    level: int,
    below: set[tuple[int, int]],
    classes: Mapping[int, ClassSpec],
    tokens: FamilyTokens,
) -> tuple[str, ...]:
    frontend = _frontend(kind, tokens)
    rules = []
    for bit in range(level - 1, -1, -1):
        child = number | 1 << bit
        if (bit, child >> bit) in below:
            rules.append(f"{frontend} @{names.class_bit(kind, bit)} goto {names.tree(kind, child)}")
    spec = classes.get(number)
    if spec is not None:
        rules.append(f"goto {names.cls(spec)}")
    return tuple(rules)


def _key_type(kind: Kind, tokens: FamilyTokens) -> str:
    if kind == Kind.IP:
        return f"{tokens.addr_type} . inet_proto . inet_service"
    return "inet_proto . inet_service"


def _frontend(kind: Kind, tokens: FamilyTokens) -> str:
    if kind == Kind.IP:
        return f"{tokens.table_family} daddr . meta l4proto . th dport"
    return "meta l4proto . th dport"


_TYPEOF_TYPES = {
    "ip daddr": "ipv4_addr",
    "ip saddr": "ipv4_addr",
    "ip6 daddr": "ipv6_addr",
    "ip6 saddr": "ipv6_addr",
    "meta l4proto": "inet_proto",
    "th dport": "inet_service",
    **{f"{proto} dport": "inet_service" for proto in AFFINITY_PROTOCOLS},
}


def element_types(
    spec: ContainerSpec, tokens: FamilyTokens
) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The data types of a container's key and value parts, if its elements can be sent
    as a netlink batch (see :mod:`~kubeproxy.backends.nftables.elements`): not for
    interval sets, timeouts or verdict maps."""
    if "interval" in spec.flags or spec.timeout is not None or "timeout" in spec.flags:
        return None
    key, _, value = spec.type.partition(" : ")

    def parts(text: str) -> tuple[str, ...] | None:
        if not text:
            return ()
        out = []
        for part in text.split(" . "):
            if spec.typeof:
                datatype = "integer" if part.startswith("numgen ") else _TYPEOF_TYPES.get(part)
            else:
                datatype = part
            if datatype is None or not supports((datatype,)):
                return None
            out.append(datatype)
        return tuple(out)

    key_types, value_types = parts(key), parts(value)
    if key_types is None or value_types is None or (spec.is_map and not value_types):
        return None
    # The batch encoder packs every part as a concatenation's (4 bytes); a value of one
    # narrower part (``affinity-canonical-ports``: a port, 2 bytes) is sent unpadded,
    # which the declarations' encoder does (the kernel refuses the padded one: EINVAL).
    if len(value_types) == 1 and value_types[0] in _NARROW:
        return None
    return key_types, value_types


_NARROW = frozenset({"inet_service", "inet_proto"})


def pick_chain(names: GenNames, pick: Pick, tokens: FamilyTokens) -> FixedChain:
    """A pick chain: the ClientIP lookup (if any), then a uniform choice of a slot."""
    rules = []
    if pick.affinity:
        # The client's recorded endpoint, if any (a DNAT there ends the walk).
        rules.append(f"jump {names.affinity_lookup(pick.kind, pick.shortcut)}")
    for proto in SLOT_PROTOCOLS:
        # nft adds the "meta l4proto <proto>" match the map's value type implies.
        rules.append(
            f"dnat to {_frontend(pick.kind, tokens)} . numgen random mod {pick.count} "
            f"map @{names.slots(pick.kind, pick.shortcut, proto, pick.count)}"
        )
    return FixedChain(names.pick(pick), tuple(rules))


def class_chain(names: GenNames, spec: ClassSpec, ctx: RenderContext) -> FixedChain:
    """What a class does before its pick: masquerading and the Local short-circuits."""
    masq = f"jump {Names.MARK_FOR_MASQUERADE}"
    main = Pick(spec.kind, False, spec.count, spec.affinity)
    rules: list[str] = []
    if spec.shape == Shape.INTERNAL:
        if ctx.masquerade_match is not None:
            rules.append(f"{ctx.masquerade_match} {masq}".strip())
        rules.append(f"goto {names.pick(main)}")
    elif spec.shape == Shape.LOCAL:
        if spec.shortcut:
            short = names.pick(Pick(spec.kind, True, spec.shortcut, spec.affinity))
            if ctx.local_match is not None:
                rules.append(f"{ctx.local_match} goto {short}")
            rules.append(f"fib saddr type local {masq}")
            rules.append(f"fib saddr type local goto {short}")
        if spec.count:
            rules.append(f"goto {names.pick(main)}")
    else:
        rules.append(masq)
        rules.append(f"goto {names.pick(main)}")
    return FixedChain(names.cls(spec), tuple(rules))


def class_rule(names: GenNames, spec: ClassSpec, tokens: FamilyTokens) -> str:
    """The rule that sends a class's frontends to its chain."""
    name = names.cls(spec)
    return f"{_frontend(spec.kind, tokens)} @{name} goto {name}"


def affinity_dispatch_chains(names: GenNames, tokens: FamilyTokens) -> dict[str, tuple[str, ...]]:
    """The chains that read the affinity lookup verdict maps, one rule each: a verdict
    map read by many rules is slow to fill (each element is checked per binding), so the
    pick chains jump here rather than read the maps themselves.

    The main lookups then turn a frontend the ``affinity-canonical-*``
    maps hold (an external or load-balancer IP, a NodePort, of a port whose affinity
    entries are keyed by its cluster-IP frontend, see :mod:`.frontends`) into its
    cluster IP (and Service port), and jump to a chain that reads the cluster IP's
    lookup element and, when it found no entry, puts the packet back (from its
    connection's original direction) before the pick draws an endpoint. Only the
    frontends those maps hold are turned: any other misses the map and the rule stops.
    The chains ordered so each is created before a rule jumps to it."""
    chains: dict[str, tuple[str, ...]] = {}
    ip = tokens.table_family
    ip_lookup = (
        f"{ip} daddr . meta l4proto . th dport vmap @{names.affinity_lookup(Kind.IP, False)}"
    )
    chains[names.affinity_canonical_lookup(Kind.IP)] = (
        ip_lookup,
        f"{ip} daddr set ct original {ip} daddr",
    )
    nodeport = "meta l4proto . th dport"
    chains[names.affinity_canonical_lookup(Kind.NODEPORT)] = (
        *(
            f"{proto} dport set {nodeport} map @{names.affinity_canonical_ports}"
            for proto in AFFINITY_PROTOCOLS
        ),
        ip_lookup,
        *(
            f"meta l4proto {proto} {ip} daddr set ct original {ip} daddr "
            f"{proto} dport set ct original proto-dst"
            for proto in AFFINITY_PROTOCOLS
        ),
    )
    for kind in (Kind.IP, Kind.NODEPORT):
        for shortcut in (False, True):
            name = names.affinity_lookup(kind, shortcut)
            rules = [f"{_frontend(kind, tokens)} vmap @{name}"]
            if not shortcut:
                guard = "" if kind == Kind.IP else f"{_L4} "
                rules.append(
                    f"{guard}{ip} daddr set {_frontend(kind, tokens)} map "
                    f"@{names.affinity_canonical(kind)} "
                    f"jump {names.affinity_canonical_lookup(kind)}"
                )
            chains[name] = tuple(rules)
    chains.update(_canonical_record_chains(names, ip))
    return chains


def _canonical_record_chains(names: GenNames, ip: str) -> dict[str, tuple[str, ...]]:
    """The chains ``affinity-find`` goes to once it turned a new connection's packet to
    an address other than its port's cluster IP into the cluster IP's (``affinity-find``
    turned the address; a NodePort's Service port is turned here): each reads the
    frontend's record element (a shared record chain writing the cluster IP's entry),
    and puts the packet back when none is found (only when the canonical and record
    elements of a frontend disagree), accepting as ``affinity-find`` would."""
    original = "meta l4proto . ct original proto-dst"
    frontend = f"ct original {ip} daddr . {original}"
    return {
        names.affinity_canonical_record(Kind.IP): (
            f"{_L4} {frontend} vmap @{names.affinity_record(Kind.IP)}",
            f"{ip} daddr set ct reply {ip} saddr accept",
        ),
        names.affinity_canonical_record(Kind.NODEPORT): (
            *(
                f"{proto} dport set {original} map @{names.affinity_canonical_ports}"
                for proto in AFFINITY_PROTOCOLS
            ),
            f"{_L4} {original} vmap @{names.affinity_record(Kind.NODEPORT)}",
            *(
                f"meta l4proto {proto} {ip} daddr set ct reply {ip} saddr "
                f"{proto} dport set ct reply proto-src accept"
                for proto in AFFINITY_PROTOCOLS
            ),
        ),
    }


def _affinity_record_chains(
    names: GenNames, tokens: FamilyTokens, match_all_nodeports: bool, counted: bool = True
) -> tuple[FixedChain, FixedChain]:
    """``affinity-record`` and ``affinity-find``: after DNAT, a new connection to a
    frontend with affinity goes to its port's record chain, found by the original
    destination (``ct original``) in the ``affinity-record-*`` verdict maps. nft needs the
    protocol before it can type ``ct original proto-dst``; a set of protocols (unlike one
    protocol) survives ``nft list`` as written, so the listing reloads.

    ``counted`` (the shared maps): a record chain accepts once it recorded the
    connection. The maps' elements ``goto`` it from ``affinity-find``, which
    ``affinity-record`` jumps to, so a connection whose entry the kernel refused (its map
    is full) falls off the record chain's end back into ``affinity-record``, whose next
    rule counts it (``affinity-full``); one no map holds is accepted at the end of
    ``affinity-find`` (``affinity-record`` is the last rule of the filter chains, whose
    policy accepts, so ``accept`` ends them as their end would). Reading a verdict map
    as a plain set would say the same in one chain, but kernels before 6.5 (Debian 12's
    6.1) refuse a map lookup without a destination register (EINVAL), and a ``jump
    affinity-full`` at each record chain's end would cost a rule per port."""
    ip = tokens.table_family
    original = "meta l4proto . ct original proto-dst"
    frontend = f"ct original {ip} daddr . {original}"
    if match_all_nodeports:
        guard = f"ct original {ip} daddr != {tokens.loopback}"
    else:
        guard = f"ct original {ip} daddr @{Names.NODEPORT_IPS}"
    # A connection to a Service IP with no affinity may have the port of a NodePort with
    # one: only a destination no Service IP dispatches went through the NodePorts.
    not_ip = f"{frontend} != @{names.dispatch(Kind.IP)}"
    ips, nodeports = names.affinity_record(Kind.IP), names.affinity_record(Kind.NODEPORT)
    find = [f"{_L4} {frontend} vmap @{ips}", f"{guard} {_L4} {not_ip} {original} vmap @{nodeports}"]
    if counted:
        # An address other than its port's cluster IP, whose entries are the cluster
        # IP's: its packet turned into the cluster IP's before its record element is
        # read (first: its element's record chain keys the entry by the packet).
        find.insert(
            0,
            f"{_L4} {ip} daddr set {frontend} map @{names.affinity_canonical(Kind.IP)} "
            f"goto {names.affinity_canonical_record(Kind.IP)}",
        )
        find.insert(
            2,
            f"{guard} {_L4} {not_ip} {ip} daddr set {original} map "
            f"@{names.affinity_canonical(Kind.NODEPORT)} "
            f"goto {names.affinity_canonical_record(Kind.NODEPORT)}",
        )
    record = [f"jump {AFFINITY_FIND}"]
    if counted:
        find.append("accept")
        record.append(f"jump {AFFINITY_FULL}")
    return FixedChain(AFFINITY_RECORD, tuple(record)), FixedChain(AFFINITY_FIND, tuple(find))


FIXED_CHAINS = (
    Names.FILTER_PREROUTING_PRE_DNAT,
    Names.FILTER_OUTPUT_PRE_DNAT,
    Names.FILTER_INPUT,
    Names.FILTER_FORWARD,
    Names.FILTER_OUTPUT,
    Names.NAT_PREROUTING,
    Names.NAT_OUTPUT,
    Names.NAT_POSTROUTING,
    Names.SERVICES,
    "service-frontends",
    "nodeport-frontends",
    Names.SERVICE_ENDPOINTS_CHECK,
    Names.NODEPORT_ENDPOINTS_CHECK,
    Names.FIREWALL_CHECK,
    Names.CLUSTER_IPS_CHECK,
    Names.MARK_FOR_MASQUERADE,
    Names.MASQUERADING,
    "affinity-record",
    AFFINITY_FIND,
    AFFINITY_FULL,
)
"""Every chain that is not per generation, in creation order (the rule dispatch's; the
tree dispatch has no ``service-frontends`` and ``nodeport-frontends``)."""

SERVICE_FRONTENDS = "service-frontends"
NODEPORT_FRONTENDS = "nodeport-frontends"
AFFINITY_RECORD = "affinity-record"
AFFINITY_FULL_COMMENT = "not recorded"
"""The comment of :data:`~.table.AFFINITY_FULL`'s counted rule (what the metrics read)."""


def fixed_chain_names(dispatch: Dispatch) -> tuple[str, ...]:
    """The chains outside generations for a dispatch, in creation order."""
    if dispatch == Dispatch.TREE:
        return tuple(n for n in FIXED_CHAINS if n not in (SERVICE_FRONTENDS, NODEPORT_FRONTENDS))
    return FIXED_CHAINS


def public_containers(tokens: FamilyTokens) -> tuple[ContainerSpec, ...]:
    """The containers outside generations: other components read the first two by name;
    the content-named affinity record chains read the third."""
    addr = tokens.addr_type
    return (
        ContainerSpec(Names.CLUSTER_IPS, False, addr, comment="Active ClusterIPs"),
        ContainerSpec(Names.NODEPORT_IPS, False, addr, comment="IPs that accept NodePort traffic"),
        ContainerSpec(AFFINITY_LOCAL_ENDPOINTS, False, f"{addr} . inet_service"),
    )


AFFINITY_SHARED = "shared"
"""ClientIP affinity in the shared maps (:func:`affinity_shards`), the default: a port whose
every address picks from one endpoint list (both traffic policies Cluster) keys its
entries by its cluster-IP frontend (IPv6: two hashes of it, in the ``affinity-clients-*``
maps), whichever address a client came through (no chain of its own; its other addresses
in the ``affinity-canonical-*`` maps); the others (a Local traffic policy, UDP with a
NodePort, IPv6 with endpoints on several ports) by their pins."""
AFFINITY_SHARED_IPV4 = "shared-ipv4"
"""As :data:`AFFINITY_SHARED`, but IPv6 ports keep their pins (before the IPv6 frontend
keys; benchmarks). The IPv6 tables hold the canonical chains all the same (unused)."""
AFFINITY_PINNED = "pinned"
"""The shared maps with every port's entries keyed by its pins, each port with a lookup and
a record chain of its own (before the frontend-keyed maps; benchmarks)."""
AFFINITY_PER_PORT = "per-port"
"""ClientIP affinity in maps of each Service port's own (before issue 32; benchmarks)."""
AFFINITY_MAPS = (AFFINITY_SHARED, AFFINITY_SHARED_IPV4, AFFINITY_PINNED, AFFINITY_PER_PORT)

AFFINITY_SHARD_TYPES = {
    "ip": "numgen random mod 1 . numgen random mod 1 . ip saddr : ip daddr . th dport",
    "ip6": "numgen random mod 1 . numgen random mod 1 . numgen random mod 1 : ip6 daddr",
}
"""The ``typeof`` of the shared affinity maps: two 32-bit pin numbers (written as ``numgen
random mod 1 offset N``, see :mod:`.frontends`) and the client (IPv6: a 32-bit hash of
it, typed as any 32-bit number) : the endpoint."""
AFFINITY_FRONTEND_TYPE = "ip daddr . meta l4proto . th dport . ip saddr : ip daddr . th dport"
"""The ``typeof`` of the shared affinity maps keyed by the frontend (IPv4 only): the
cluster IP, protocol and port, and the client : the endpoint. The key is 16 bytes, one
register: nft 1.0.6 writes a dynamic map's value into the register after the first 16
bytes of the key (see the IPv6 key of :data:`AFFINITY_SHARD_TYPES`), so a longer key
would be overwritten; an IPv6 frontend does not fit, and an IPv6 port's entries are
keyed by hashes of it in the ``affinity-clients-*`` maps
(:func:`~.table.affinity_frontend6_pin`)."""


def affinity_shards(tokens: FamilyTokens, size: int | None = None) -> tuple[ContainerSpec, ...]:
    """The shared affinity maps of a family (:data:`~.table.AFFINITY_SHARDS`), outside
    generations: their entries outlive them.

    Without ``size`` each is bounded at 65535 entries by the kernel, allocating nothing
    up front (see :func:`affinity_container`): 16.7M clients per family in all, a Service
    port sharing its map with 1 in 256 of the others. ``size`` (tests) declares it."""
    kind = AFFINITY_SHARD_TYPES[tokens.table_family]
    return tuple(
        _dynamic_map(f"{AFFINITY_SHARD_PREFIX}{n}", kind, size) for n in range(AFFINITY_SHARDS)
    )


def affinity_frontend_map(name: str, size: int | None = None) -> ContainerSpec:
    """A shared affinity map keyed by the frontend (``affinity-frontends-<n>``, IPv4),
    outside generations. Declared when a port first uses it and deleted (with its
    entries) once no port does, as the content-named objects: 256 empty maps in every
    table made every full sync and every listing of the table longer (the fake's
    listing of a test's table, 1.6x). Bounded as :func:`affinity_shards`."""
    return _dynamic_map(name, AFFINITY_FRONTEND_TYPE, size)


def _dynamic_map(name: str, kind: str, size: int | None) -> ContainerSpec:
    return ContainerSpec(
        name,
        True,
        kind,
        flags=("dynamic", "timeout"),
        timeout=AFFINITY_TIMEOUT,
        size=size,
        typeof=True,
    )


def affinity_container(name: str, map_type: str) -> ContainerSpec:
    """A content-named affinity map (outside generations: its entries outlive them).

    No ``size``: the kernel bounds a set that rules ``update`` at 65535 entries when none
    is given (what upstream's per-endpoint affinity sets get, and what the map then
    lists), without allocating for them. A declared ``size 65535`` preallocates its hash
    table instead: 800 such maps took 4 s to create and 1.3 GB of kernel memory here.
    """
    return ContainerSpec(
        name, True, map_type, flags=("dynamic", "timeout"), timeout=AFFINITY_TIMEOUT
    )


def fixed_chains(
    names: GenNames,
    tokens: FamilyTokens,
    *,
    masquerade_mark: int,
    match_all_nodeports: bool,
    service_cidrs: Iterable[str],
    dispatch: Dispatch = Dispatch.TREE,
    classes: Iterable[ClassSpec] = (),
    shared_affinity: bool = True,
) -> tuple[FixedChain, ...]:
    """The chains outside generations, with rules reading generation ``names``.

    With the tree dispatch, ``services`` goes to each kind's tree for dispatched
    frontends: a class chain that ends without a verdict (a Local-policy frontend with no
    local endpoint, for a client outside the node) returns past the NodePort rule, as
    upstream's ``goto`` from its ``service-ips`` map does. With the rule dispatch
    (benchmarks only) ``classes`` are the classes whose rules the frontend chains hold.
    """
    ip = tokens.table_family
    mark = f"{masquerade_mark:#x}"
    lookup = f"{ip} daddr . meta l4proto . th dport"
    if match_all_nodeports:
        guard = f"fib daddr type local {ip} daddr != {tokens.loopback}"
        np_guard = f"{ip} daddr != {tokens.loopback}"
    else:
        guard = np_guard = f"{ip} daddr @{Names.NODEPORT_IPS}"

    record = (f"ct state new ct status dnat jump {AFFINITY_RECORD}",)
    frontend_chains: tuple[FixedChain, ...] = ()
    if dispatch == Dispatch.TREE:
        services = [
            f"{lookup} @{names.dispatch(Kind.IP)} goto {names.tree(Kind.IP, 0)}",
            f"{guard} meta l4proto . th dport @{names.dispatch(Kind.NODEPORT)} "
            f"goto {names.tree(Kind.NODEPORT, 0)}",
        ]
    else:
        services = [f"jump {SERVICE_FRONTENDS}", f"{guard} jump {NODEPORT_FRONTENDS}"]
        ip_classes: list[str] = []
        nodeports: list[str] = []
        for spec in classes:
            target = ip_classes if spec.kind == Kind.IP else nodeports
            target.append(class_rule(names, spec, tokens))
        frontend_chains = (
            FixedChain(SERVICE_FRONTENDS, tuple(ip_classes)),
            FixedChain(NODEPORT_FRONTENDS, tuple(nodeports)),
        )
    cidrs = list(service_cidrs)
    return (
        *base_chains(record),
        FixedChain(Names.SERVICES, tuple(services)),
        *frontend_chains,
        FixedChain(
            Names.SERVICE_ENDPOINTS_CHECK,
            (
                f"{lookup} @{names.no_endpoint_reject} reject",
                f"{lookup} @{names.no_endpoint_drop} drop",
            ),
        ),
        FixedChain(
            Names.NODEPORT_ENDPOINTS_CHECK,
            (
                f"{np_guard} meta l4proto . th dport @{names.no_endpoint_nodeports_reject} reject",
                f"{np_guard} meta l4proto . th dport @{names.no_endpoint_nodeports_drop} drop",
            ),
        ),
        FixedChain(
            Names.FIREWALL_CHECK,
            (
                *(
                    firewall_allow_rule(ip, proto, names.firewall_allow(proto))
                    for proto in FIREWALL_PROTOCOLS
                ),
                f"{lookup} @{names.firewall_ips} drop",
            ),
        ),
        FixedChain(
            Names.CLUSTER_IPS_CHECK,
            (
                f"{ip} daddr @{Names.CLUSTER_IPS} reject",
                *(f"{ip} daddr {cidr} drop" for cidr in cidrs),
            ),
        ),
        FixedChain(Names.MARK_FOR_MASQUERADE, (f"meta mark set meta mark or {mark}",)),
        FixedChain(
            Names.MASQUERADING,
            (
                f"ct status dnat {ip} saddr . {ip} daddr @{names.hairpin} "
                f"jump {Names.MARK_FOR_MASQUERADE}",
                f"meta mark & {mark} == 0 return",
                f"meta mark set meta mark xor {mark}",
                "masquerade fully-random",
            ),
        ),
        *_affinity_record_chains(names, tokens, match_all_nodeports, shared_affinity),
        FixedChain(AFFINITY_FULL, ("counter",), rule_comment=AFFINITY_FULL_COMMENT),
    )
