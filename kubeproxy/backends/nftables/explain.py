"""A Service as the kernel holds it, in Service terms: what ``kubeproxy explain`` prints.

The map structure (README "Structure") keeps a Service port as data spread over many
containers of the current generation: its frontends' elements in ``dispatch-ips`` /
``dispatch-nodeports`` (named by their comment, :func:`.frontends.frontend_comment`), the
class-number bits of the dispatch tree, numbered slots in ``endpoints-<proto>-b<k>``, the
no-endpoint sets, the affinity verdict maps and maps. :func:`explain_service` reads them
back (:class:`~.reader.TableReader`: one dump of the sets that hold names, then one
question per fact about each frontend) and puts them together per frontend:
:class:`FrontendView`. Nothing here comes from the daemon: a wedged or stopped proxy's
table explains the same.

The dispatch tree is walked as the kernel walks it (each tree chain's rules in order, a
bit set's membership asked of the kernel), so a frontend explains to the class chain a new
connection really reaches; the class chain's name says what the class does
(:func:`parse_class`, the inverse of :meth:`.layout.GenNames.cls`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.frontends import (
    COMMENT_LIMIT,
    ClassSpec,
    Kind,
    NoEndpoint,
    Shape,
    comment_names,
)
from kubeproxy.backends.nftables.layout import SLOT_PROTOCOLS, GenNames, generation_of
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.backends.nftables.reader import Item, RuleRefs
from kubeproxy.backends.nftables.table import (
    AFFINITY_FRONTEND_PREFIX,
    AFFINITY_SHARD_PREFIX,
    TABLE,
    Names,
    affinity_frontend6_pin,
)
from kubeproxy.objects import IPAddress, NamespacedName

__all__ = [
    "EVERY_LOCAL_ADDRESS",
    "FakeSource",
    "FrontendView",
    "ServiceView",
    "TableSource",
    "TableView",
    "describe_class",
    "explain_address",
    "explain_service",
    "parse_class",
    "refs_of_text",
]

Key = tuple[str, ...]

_CLASS = re.compile(
    r"(?P<head>internal|external|nodeport)(?P<local>-local)?-(?P<count>[0-9]+)"
    r"(?:-(?P<shortcut>[0-9]+))?(?P<affinity>-affinity)?\.g[0-9]+"
)


def parse_class(chain: str) -> ClassSpec | None:
    """The class a class chain's name stands for (None for any other name)."""
    found = _CLASS.fullmatch(chain)
    if found is None:
        return None
    head = found["head"]
    kind = Kind.NODEPORT if head == "nodeport" else Kind.IP
    if found["local"]:
        if found["shortcut"] is None:
            return None
        shape = Shape.LOCAL
    else:
        if found["shortcut"] is not None:
            return None
        shape = Shape.INTERNAL if head == "internal" else Shape.EXTERNAL
    return ClassSpec(
        kind, shape, int(found["count"]), int(found["shortcut"] or 0), bool(found["affinity"])
    )


def describe_class(spec: ClassSpec, timeout_s: int | None = None) -> str:
    """A class in words: who is masqueraded, which endpoints are picked, affinity."""
    where = "NodePort" if spec.kind == Kind.NODEPORT else "address"
    if spec.shape == Shape.INTERNAL:
        words = (
            f"cluster IP: {spec.count} endpoint(s), picked at random; masqueraded when the"
            " client is not a pod (the local-traffic detector)"
        )
    elif spec.shape == Shape.EXTERNAL:
        words = (
            f"external {where}, externalTrafficPolicy Cluster: {spec.count} endpoint(s),"
            " picked at random; always masqueraded"
        )
    else:
        words = (
            f"external {where}, externalTrafficPolicy Local: clients from outside go to"
            f" {spec.count} node-local endpoint(s), not masqueraded (their source kept)"
            + ("" if spec.count else ", so they are dropped")
            + f"; pods and this node are short-circuited to {spec.shortcut} endpoint(s)"
            " (this node masqueraded)"
        )
    if spec.affinity:
        timeout = f" {timeout_s} s" if timeout_s is not None else ""
        words += f"; ClientIP session affinity{timeout}"
    return words


@dataclass(frozen=True, slots=True)
class Affinity:
    """A client's affinity entry: the endpoint it is held to, for how long still."""

    client: str
    endpoint: str
    expires_s: float | None


@dataclass(frozen=True, slots=True)
class FrontendView:
    """One frontend as the kernel holds it.

    ``kind`` is ``ip`` (``address . proto . port``) or ``nodeport`` (``proto .
    port`` on every NodePort address); ``name`` its element's comment. ``chain`` is the
    class chain a new connection reaches (None: not dispatched) and ``cls`` that class;
    ``endpoints`` and ``shortcut`` the main and short-circuit lists slot by slot
    (``None`` for a slot the kernel lacks); ``no_endpoint`` the no-endpoint verdict
    (``reject`` / ``drop``) its packets get when not dispatched, or dropped for clients
    from outside (Local); ``source_ranges``: LoadBalancerSourceRanges apply;
    ``cluster_ip``: the address is a cluster IP; ``nodeport_addresses``: the node
    addresses a NodePort answers on (``nodeport-ips``).
    """

    kind: str
    key: Key
    name: str | None
    chain: str | None = None
    cls: ClassSpec | None = None
    endpoints: tuple[str | None, ...] = ()
    shortcut: tuple[str | None, ...] = ()
    no_endpoint: str | None = None
    source_ranges: bool = False
    cluster_ip: bool = False
    affinity_maps: tuple[str, ...] = ()
    affinity_timeout_s: int | None = None
    affinity: tuple[Affinity, ...] = ()
    nodeport_addresses: tuple[str, ...] = ()

    @property
    def address(self) -> str:
        """The frontend as an operator writes it: ``IP:port/proto`` or
        ``NodePort port/proto``."""
        if self.kind == Kind.NODEPORT:
            return f"NodePort {self.key[1]}/{self.key[0]}"
        ip, proto, port = self.key
        return f"[{ip}]:{port}/{proto}" if ":" in ip else f"{ip}:{port}/{proto}"

    @property
    def what(self) -> str:
        """What the frontend does, in words."""
        if self.cls is not None:
            return describe_class(self.cls, self.affinity_timeout_s)
        if self.no_endpoint is not None:
            return f"no endpoint: new connections get {self.no_endpoint}"
        return "not dispatched"

    def as_json(self) -> dict[str, Any]:
        """The view as plain data (``--json``)."""
        cls = self.cls
        return {
            "frontend": self.address,
            "kind": self.kind,
            "key": list(self.key),
            "name": self.name,
            "cluster_ip": self.cluster_ip,
            "class_chain": self.chain,
            "class": None
            if cls is None
            else {
                "shape": str(cls.shape),
                "endpoints": cls.count,
                "shortcut_endpoints": cls.shortcut,
                "affinity": cls.affinity,
            },
            "what": self.what,
            "endpoints": list(self.endpoints),
            "shortcut_endpoints": list(self.shortcut),
            "no_endpoint": self.no_endpoint,
            "source_ranges": self.source_ranges,
            "nodeport_addresses": list(self.nodeport_addresses),
            "affinity_maps": list(self.affinity_maps),
            "affinity_timeout_s": self.affinity_timeout_s,
            "affinity_entries": [
                {"client": a.client, "endpoint": a.endpoint, "expires_s": a.expires_s}
                for a in self.affinity
            ],
        }


@dataclass(frozen=True, slots=True)
class ServiceView:
    """A Service (or one port of it) in one family's table: its frontends."""

    service: NamespacedName
    family: Family
    generation: int | None
    frontends: tuple[FrontendView, ...] = field(default=())

    def as_json(self) -> dict[str, Any]:
        """The view as plain data (``--json``)."""
        return {
            "service": str(self.service),
            "family": str(self.family),
            "generation": self.generation,
            "frontends": [f.as_json() for f in self.frontends],
        }


def _endpoint(value: Key) -> str:
    ip, port = value
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


EVERY_LOCAL_ADDRESS = "every local address"
"""What NodePorts answer on without nodePortAddresses (but loopback)."""


class TableSource(Protocol):
    """Where a :class:`TableView` reads a table: the kernel (:class:`~.reader.TableReader`)
    or a fake (:class:`FakeSource`, what ``kubeproxy verify`` computes)."""

    def exists(self, family: Family) -> bool:
        """Whether the table exists."""
        ...

    def sets(self, family: Family) -> Mapping[str, Any]:
        """The table's sets and maps by name (with what :meth:`elements` needs)."""
        ...

    def elements(
        self, family: Family, name: str, declaration: Any, containing: str | None = None
    ) -> list[Item]:
        """Every element of one set or map (with ``containing``: those whose comment
        contains that text)."""
        ...

    def get(self, family: Family, name: str, declaration: Any, key: Key) -> Item | None:
        """One element, or None."""
        ...

    def rules(self, family: Family, chain: str) -> list[RuleRefs]:
        """What each rule of ``chain`` refers to."""
        ...


class FakeSource:
    """A :class:`TableSource` over a :class:`~.fake.FakeNft` (what the proxy would write);
    read once, as a kernel reader's answers are one moment's."""

    def __init__(self, fake: FakeNft, table: str = TABLE) -> None:
        self.fake = fake
        self.table = table
        self._elements: dict[tuple[Family, str], dict[Key, Item]] = {}
        self._chains: dict[Family, dict[str, list[RuleRefs]]] = {}

    def exists(self, family: Family) -> bool:
        """Whether the fake holds the table."""
        return self.fake.table_exists(family, self.table)

    def sets(self, family: Family) -> Mapping[str, Any]:
        """The fake's sets and maps."""
        return dict.fromkeys(self.fake.list_sets(family, self.table))

    def _held(self, family: Family, name: str) -> dict[Key, Item]:
        found = self._elements.get((family, name))
        if found is None:
            found = self._elements[family, name] = {}
            for element in self.fake.list_elements(family, self.table, name):
                value = element.value
                if len(value) == 1 and " " in value[0]:  # a verdict: "goto CHAIN"
                    verb, _, chain = value[0].partition(" ")
                    value = (verb, chain)
                found[element.key] = Item(element.key, value, element.comment, None)
        return found

    def elements(
        self, family: Family, name: str, declaration: Any, containing: str | None = None
    ) -> list[Item]:
        """A set's elements as the kernel reader returns them."""
        held = self._held(family, name).values()
        if containing is None:
            return list(held)
        return [i for i in held if i.comment is not None and containing in i.comment]

    def get(self, family: Family, name: str, declaration: Any, key: Key) -> Item | None:
        """One element."""
        return self._held(family, name).get(key)

    def rules(self, family: Family, chain: str) -> list[RuleRefs]:
        """The references of ``chain``'s rules, from their text."""
        chains = self._chains.setdefault(family, {})
        found = chains.get(chain)
        if found is None:
            rules = self.fake.list_rules(family, self.table, chain)
            found = chains[chain] = [refs_of_text(rule.rule) for rule in rules]
        return found


def refs_of_text(rule: str) -> RuleRefs:
    """What a rule written as nft text refers to (as :class:`RuleRefs` of the kernel's)."""
    timeout = re.search(r"timeout ([0-9]+)s", rule)
    update = re.search(r"update @(\S+)", rule)
    return RuleRefs(
        lookups=tuple(m for m in re.findall(r"@(\S+)", rule) if not update or m != update[1]),
        verdicts=tuple(re.findall(r"\b(goto|jump) (\S+)", rule)),
        updates=update[1] if update else None,
        timeout_s=int(timeout[1]) if timeout else None,
        offsets=tuple(int(n) for n in re.findall(r"\boffset ([0-9]+)", rule)),
    )


class TableView:
    """One family's table of the live generation, read on demand from a
    :class:`TableSource` (answers are kept: a view is one moment's).

    ``generation`` is the generation the ``services`` chain dispatches from (what new
    connections use); ``generations`` every generation whose containers the table holds.
    """

    def __init__(self, reader: TableSource, family: Family) -> None:
        self.reader = reader
        self.family = family
        self.declarations: Mapping[str, Any] = reader.sets(family) if reader.exists(family) else {}
        self.generations = sorted(
            {g for name in self.declarations if (g := generation_of(name)) is not None}
        )
        self.generation: int | None = None
        if self.declarations:
            for rule in reader.rules(family, Names.SERVICES):
                for name in rule.lookups:
                    if name.startswith("dispatch-") and (g := generation_of(name)) is not None:
                        self.generation = g
        self.names = GenNames(self.generation if self.generation is not None else 0)
        self._dumps: dict[str, dict[Key, Item]] = {}
        self._gets: dict[tuple[str, Key], Item | None] = {}
        self._rules: dict[str, list[RuleRefs]] = {}

    def has(self, container: str) -> bool:
        """Whether the table holds ``container``."""
        return container in self.declarations

    def dump(self, container: str) -> dict[Key, Item]:
        """Every element of ``container`` by key (empty when there is no such set)."""
        found = self._dumps.get(container)
        if found is None:
            items = []
            if container in self.declarations:
                declaration = self.declarations[container]
                items = self.reader.elements(self.family, container, declaration)
            found = self._dumps[container] = {item.key: item for item in items}
        return found

    def get(self, container: str, key: Key) -> Item | None:
        """Element ``key`` of ``container`` (a dumped container answers from its dump)."""
        if container in self._dumps:
            return self._dumps[container].get(key)
        memo = (container, key)
        if memo not in self._gets:
            found = None
            if container in self.declarations:
                declaration = self.declarations[container]
                found = self.reader.get(self.family, container, declaration, key)
            self._gets[memo] = found
        return self._gets[memo]

    def rules(self, chain: str) -> list[RuleRefs]:
        """What each rule of ``chain`` refers to (:class:`~.reader.RuleRefs`)."""
        found = self._rules.get(chain)
        if found is None:
            found = self._rules[chain] = self.reader.rules(self.family, chain)
        return found

    def named_containers(self) -> list[tuple[Kind, str, str | None]]:
        """The containers whose elements name their Service: (kind, container,
        no-endpoint verdict or None for the dispatch set)."""
        out: list[tuple[Kind, str, str | None]] = []
        for kind in (Kind.IP, Kind.NODEPORT):
            out.append((kind, self.names.dispatch(kind), None))
            for verdict in NoEndpoint:
                out.append((kind, self.names.no_endpoint(kind, verdict), str(verdict)))
        return out

    def frontends_named(
        self, match: Any, containing: str | None = None
    ) -> list[tuple[Kind, Key, str | None]]:
        """Every frontend whose element comment ``match(comment)`` accepts: (kind, key,
        comment), each once, in table order. ``containing``: a text every accepted
        comment contains, so that only the elements holding it are decoded (a scan of
        the whole set still, but at C speed: :meth:`~.reader.TableReader.elements`)."""
        seen: dict[tuple[Kind, Key], str | None] = {}
        for kind, container, _verdict in self.named_containers():
            if containing is None or container in self._dumps:
                items: Iterable[Item] = self.dump(container).values()
            elif container in self.declarations:
                declaration = self.declarations[container]
                items = self.reader.elements(self.family, container, declaration, containing)
            else:
                items = ()
            for item in items:
                if item.comment is not None and match(item.comment):
                    seen.setdefault((kind, item.key), item.comment)
        return [(kind, key, name) for (kind, key), name in seen.items()]

    def frontend_at(
        self, dest: str, port: int, proto: str, nodeport_address: bool
    ) -> tuple[Kind, Key, str | None] | None:
        """The frontend a connection to ``dest:port/proto`` meets, asked by key (a
        handful of single-element gets, whatever the table holds): its address's
        element in the dispatch or no-endpoint sets, else, when ``nodeport_address``
        (``dest`` is an address NodePorts answer on), the NodePort's. (kind, key,
        comment), or None."""
        candidates: list[tuple[Kind, Key]] = [(Kind.IP, (dest, proto, str(port)))]
        if nodeport_address:
            candidates.append((Kind.NODEPORT, (proto, str(port))))
        for kind, key in candidates:
            for k, container, _verdict in self.named_containers():
                if k == kind and (item := self.get(container, key)) is not None:
                    return kind, key, item.comment
        return None

    def class_chain(self, kind: Kind, key: Key) -> str | None:
        """The class chain a new connection to frontend ``key`` reaches, walking the
        dispatch tree as the kernel does (None: not dispatched)."""
        if self.get(self.names.dispatch(kind), key) is None:
            return None
        chain = self.names.tree(kind, 0)
        for _depth in range(64):  # a tree is at most MAX_CLASS_BITS deep; a loop is a bug
            for rule in self.rules(chain):
                target = rule.target
                if target is None:
                    continue
                if not rule.lookups:
                    return str(target) if parse_class(target) else None
                if self.get(rule.lookups[0], key) is not None:
                    chain = target
                    break
            else:
                return None
        return None

    def explain(self, kind: Kind, key: Key, name: str | None) -> FrontendView:
        """One frontend (see :class:`FrontendView`)."""
        names = self.names
        chain = self.class_chain(kind, key)
        spec = parse_class(chain) if chain else None
        proto = key[1] if kind == Kind.IP else key[0]
        main: tuple[str | None, ...] = ()
        shortcut: tuple[str | None, ...] = ()
        if spec is not None and proto in SLOT_PROTOCOLS:
            main = self._slots(names.slots(kind, False, proto, spec.count), key, spec.count)
            if spec.shape == Shape.LOCAL and spec.shortcut:
                shortcut = self._slots(
                    names.slots(kind, True, proto, spec.shortcut), key, spec.shortcut
                )
        no_endpoint = None
        for verdict in NoEndpoint:
            if self.get(names.no_endpoint(kind, verdict), key) is not None:
                no_endpoint = str(verdict)
        maps: list[str] = []
        # A shared map's entries of this port: its lookup rules' pin numbers, or (maps keyed
        # by the frontend) the frontend itself.
        pins: dict[str, set[Key]] = {}
        timeout = None
        entries: list[Affinity] = []
        if spec is not None and spec.affinity:
            # An address the canonical maps turn into its port's cluster IP reads (and
            # writes) that frontend's entries.
            entry_kind, entry_key = kind, key
            cluster = self.get(names.affinity_canonical(kind), key)
            if cluster is not None and cluster.value:
                port = key[2] if kind == Kind.IP else None
                if kind == Kind.NODEPORT:
                    service_port = self.get(names.affinity_canonical_ports, key)
                    port = service_port.value[0] if service_port and service_port.value else None
                if port is not None:
                    entry_kind, entry_key = Kind.IP, (cluster.value[0], proto, port)
            for shortcut_pick in (False, True):
                held = self.get(names.affinity_lookup(entry_kind, shortcut_pick), entry_key)
                if held is not None and len(held.value) == 2 and held.value[1]:
                    for rule in self.rules(held.value[1]):
                        maps.extend(m for m in rule.lookups if m not in maps)
                        if len(rule.offsets) == 2:
                            for m in rule.lookups:
                                pins.setdefault(m, set()).add(tuple(map(str, rule.offsets)))
                        elif not rule.offsets and entry_kind == Kind.IP and ":" in entry_key[0]:
                            # IPv6 keyed by hashes of its cluster-IP frontend.
                            hashed = affinity_frontend6_pin(entry_key)
                            for m in rule.lookups:
                                if m.startswith(AFFINITY_SHARD_PREFIX):
                                    pins.setdefault(m, set()).add(hashed)
            record = self.get(names.affinity_record(kind), key)
            if record is not None and len(record.value) == 2 and record.value[1]:
                for rule in self.rules(record.value[1]):
                    if rule.timeout_s is not None:
                        timeout = rule.timeout_s
            for affinity_map in maps:
                mine = pins.get(affinity_map)
                by_frontend = affinity_map.startswith(AFFINITY_FRONTEND_PREFIX)
                for item in self.dump(affinity_map).values():
                    client = item.key[0]
                    if by_frontend:
                        if item.key[:3] != entry_key:
                            continue  # another frontend's entry
                        client = item.key[3]
                    elif mine is not None:
                        if item.key[:2] not in mine:
                            continue  # another port's entry
                        client = item.key[2]  # IPv6: a hash of the client's address
                    expires = None if item.expires_ms is None else item.expires_ms / 1000
                    endpoint = _endpoint(item.value) if len(item.value) == 2 else item.value[0]
                    entries.append(Affinity(client, endpoint, expires))
        cluster_ip = kind == Kind.IP and self.get(Names.CLUSTER_IPS, key[:1]) is not None
        addresses: tuple[str, ...] = ()
        if kind == Kind.NODEPORT:
            addresses = self.nodeport_addresses()
        return FrontendView(
            kind=str(kind),
            key=key,
            name=name,
            chain=chain,
            cls=spec,
            endpoints=main,
            shortcut=shortcut,
            no_endpoint=no_endpoint,
            source_ranges=kind == Kind.IP and self.get(names.firewall_ips, key) is not None,
            cluster_ip=cluster_ip,
            affinity_maps=tuple(maps),
            affinity_timeout_s=timeout,
            affinity=tuple(entries),
            nodeport_addresses=addresses,
        )

    def nodeport_addresses(self) -> tuple[str, ...]:
        """The addresses NodePorts answer on: ``nodeport-ips`` when the ``services``
        chain's NodePort rule reads it, else :data:`EVERY_LOCAL_ADDRESS`
        (nodePortAddresses unset: ``fib daddr type local``)."""
        dispatch = self.names.dispatch(Kind.NODEPORT)
        for rule in self.rules(Names.SERVICES):
            if dispatch in rule.lookups and Names.NODEPORT_IPS not in rule.lookups:
                return (EVERY_LOCAL_ADDRESS,)
        return tuple(sorted(k[0] for k in self.dump(Names.NODEPORT_IPS)))

    def answers_nodeports(self, dest: IPAddress, local: Sequence[IPAddress]) -> bool:
        """Whether NodePorts answer on ``dest`` (``local``: the node's addresses, what
        ``fib daddr type local`` matches without nodePortAddresses)."""
        addresses = self.nodeport_addresses()
        if EVERY_LOCAL_ADDRESS in addresses:
            return dest in local and not dest.is_loopback
        return str(dest) in addresses

    def _slots(self, container: str, key: Key, count: int) -> tuple[str | None, ...]:
        out: list[str | None] = []
        for slot in range(count):
            item = self.get(container, (*key, str(slot)))
            out.append(_endpoint(item.value) if item is not None else None)
        return tuple(out)


def explain_service(
    view: TableView, service: NamespacedName, port: str | None = None
) -> ServiceView:
    """Every frontend of ``service`` (of its port ``port``, when given) in ``view``."""
    # Every comment naming the Service begins with (at most) this much of its name.
    needle = str(service)[: COMMENT_LIMIT - 9]
    found = view.frontends_named(lambda c: comment_names(c, service, port), containing=needle)
    frontends = tuple(view.explain(kind, key, name) for kind, key, name in found)
    return ServiceView(service, view.family, view.generation, frontends)


def explain_address(
    view: TableView,
    dest: IPAddress,
    port: int,
    proto: str,
    local: Sequence[IPAddress] = (),
) -> FrontendView | None:
    """The frontend a connection to ``dest:port/proto`` meets (a NodePort when ``dest``
    is an address NodePorts answer on, ``local`` the node's addresses), found by key:
    what ``kubeproxy explain IP:PORT/PROTO`` prints, in constant time at any size."""
    found = view.frontend_at(str(dest), port, proto, view.answers_nodeports(dest, local))
    if found is None:
        return None
    kind, key, name = found
    return view.explain(kind, key, name)


def services_named(view: TableView) -> Iterable[str]:
    """Every Service port name the table's elements carry (sorted)."""
    names: set[str] = set()
    for _kind, container, _verdict in view.named_containers():
        names.update(i.comment for i in view.dump(container).values() if i.comment)
    return sorted(names)
