"""Plain-data views of Services, endpoints and the node, as the proxy core hands them out.

Everything here is a frozen, slotted dataclass built from an already validated Kubernetes
object (see :mod:`kubeproxy.parse`), except the two keys of every map, which are named
tuples (see :class:`NamespacedName`). Backends read these; nothing here talks to the kernel.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import MISSING, dataclass, field, fields
from enum import StrEnum
from typing import Final, NamedTuple, TypeAlias, TypeVar, overload

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network

__all__ = [
    "IS_LOCAL",
    "LOCAL_READY_MARKS",
    "NO_HINTS",
    "READY",
    "REMOTE",
    "SERVING",
    "TERMINATING",
    "CategorizedEndpoints",
    "Endpoint",
    "EndpointRows",
    "Endpoints",
    "IPAddress",
    "IPFamily",
    "IPNetwork",
    "NamespacedName",
    "NodeInfo",
    "Protocol",
    "ServicePort",
    "ServicePortName",
    "endpoint_addresses",
    "endpoint_flags",
    "endpoint_key",
    "endpoint_keys",
    "endpoint_ports",
    "endpoint_string",
    "flag_marks",
    "make_endpoint",
    "slot_init",
]


_Class = TypeVar("_Class", bound=type)


def slot_init(cls: _Class) -> _Class:
    """Give a frozen, slotted dataclass an ``__init__`` that writes each slot through the
    slot's own descriptor: the same signature, defaults and resulting object as the
    dataclass' own, made faster. Apply it above ``@dataclass``; a class with a
    ``__post_init__``, a default factory or keyword-only fields is refused.

    Why: a frozen dataclass' ``__init__`` sets each field through ``object.__setattr__``,
    which looks the descriptor up again per field. A cold start makes one of these per
    Service port several times over (the parsed port, its categorised endpoints, the
    backend's frontends and port plan): measured with ``python -m bench.micro_core``
    (``init`` part, the shared machine), a ServicePort made with keywords 1.74 against
    1.33 us, a CategorizedEndpoints 0.53 against 0.32 us. :class:`Endpoint` does the same by hand.
    """
    namespace: dict[str, object] = {}
    params: list[str] = []
    body: list[str] = []
    if "__post_init__" in vars(cls):
        raise TypeError(f"{cls.__name__} has a __post_init__")
    for index, spec in enumerate(fields(cls)):
        if not spec.init or spec.kw_only or spec.default_factory is not MISSING:
            raise TypeError(f"{cls.__name__}.{spec.name}: only plain fields are supported")
        namespace[f"_set{index}"] = getattr(cls, spec.name).__set__
        if spec.default is MISSING:
            params.append(spec.name)
        else:
            namespace[f"_default{index}"] = spec.default
            params.append(f"{spec.name}=_default{index}")
        body.append(f"    _set{index}(self, {spec.name})")
    # The field names are the class's own identifiers, never data: the same code the
    # dataclass generates, with the setters bound once.
    source = f"def __init__(self, {', '.join(params)}):\n" + "\n".join(body) + "\n"
    exec(source, namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"  # type: ignore[attr-defined]
    cls.__init__ = init  # type: ignore[misc]
    return cls


class IPFamily(StrEnum):
    """An IP family, spelled as Kubernetes spells it (`ipFamilies`, `addressType`)."""

    IPV4 = "IPv4"
    IPV6 = "IPv6"

    # The string's own hash, in C: Enum's is a Python call hashing the member's name (and
    # so differed from the equal string's, "IPV4" against "IPv4").
    __hash__ = str.__hash__

    @property
    def version(self) -> int:
        """4 or 6, as :attr:`ipaddress.IPv4Address.version` says."""
        return 4 if self is IPFamily.IPV4 else 6

    @property
    def other(self) -> IPFamily:
        """The other family (for dual-stack fan-out)."""
        return IPFamily.IPV6 if self is IPFamily.IPV4 else IPFamily.IPV4

    @classmethod
    def of(cls, address: IPAddress | IPNetwork) -> IPFamily:
        """The family of an address or network."""
        return cls.IPV4 if address.version == 4 else cls.IPV6


class Protocol(StrEnum):
    """A Service port's protocol."""

    TCP = "TCP"
    UDP = "UDP"
    SCTP = "SCTP"

    # The string's own hash, in C, not Enum's Python call: every ServicePortName key
    # hashes its protocol (see NamespacedName).
    __hash__ = str.__hash__

    # A property shadowing str.lower keeps rule-building code short (`proto.lower`); calling
    # `Protocol.TCP.lower()` is therefore an error, use `.lower` without parentheses.
    @property
    def lower(self) -> str:  # type: ignore[override]
        """The protocol as the kernel tools spell it (`tcp`, `udp`, `sctp`)."""
        return self.value.lower()


class NamespacedName(NamedTuple):
    """The identity of a namespaced object.

    A named tuple, not a dataclass, as :class:`ServicePortName`: these are the keys of
    every map of the core and the backends, hashed about 20 times per Service at start-up
    (the trackers, the Service map, the port index, the proxier). A dataclass hashes and
    compares in Python; a tuple in C. Measured (``python -m bench.micro_core``, shared
    machine): a dict lookup by an equal key that is another object took 253 ns against
    59 ns (466 against 95 ns for a ServicePortName), making one 429 against 240 ns, for
    8 bytes more per key. Like the dataclass it replaces it is
    immutable, ordered by its fields and hashed as the tuple of its fields; unlike it, it
    also equals a plain tuple of the same fields (no code mixes the two as keys).
    """

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class ServicePortName(NamedTuple):
    """The key of every per-port map: a Service, one of its port names, and the protocol.

    A named tuple for its hash, as :class:`NamespacedName`.

    Printed like upstream: ``ns/name:port`` or ``ns/name`` when the port is unnamed.
    """

    service: NamespacedName
    port: str
    protocol: Protocol

    def __str__(self) -> str:
        if self.port:
            return f"{self.service}:{self.port}"
        return str(self.service)


def endpoint_string(ip: IPAddress, port: int) -> str:
    """``IP:port``, with IPv6 addresses bracketed: the identity of an endpoint."""
    if ip.version == 6:
        return f"[{ip}]:{port}"
    return f"{ip}:{port}"


@slot_init
@dataclass(frozen=True, slots=True)
class ServicePort:
    """One port of a Service, seen by the proxier of one IP family.

    Only addresses of that family appear. ``session_affinity_seconds`` is 0 when the
    Service has no ClientIP affinity. ``health_check_node_port`` is 0 unless the Service
    is a LoadBalancer with ``externalTrafficPolicy: Local``.
    """

    name: ServicePortName
    cluster_ip: IPAddress
    port: int
    protocol: Protocol
    node_port: int = 0
    external_ips: tuple[IPAddress, ...] = ()
    load_balancer_vips: tuple[IPAddress, ...] = ()
    load_balancer_source_ranges: tuple[IPNetwork, ...] = ()
    session_affinity_seconds: int = 0
    internal_policy_local: bool = False
    external_policy_local: bool = False
    health_check_node_port: int = 0

    def __str__(self) -> str:
        return f"{endpoint_string(self.cluster_ip, self.port)}/{self.protocol.value}"

    @property
    def session_affinity(self) -> bool:
        """Whether ClientIP session affinity is on."""
        return self.session_affinity_seconds > 0

    @property
    def externally_accessible(self) -> bool:
        """Reachable from outside the cluster: a NodePort, a load-balancer VIP or an external IP."""
        return bool(self.node_port or self.load_balancer_vips or self.external_ips)

    @property
    def uses_cluster_endpoints(self) -> bool:
        """Whether any path to this port uses cluster-wide endpoints.

        True unless internal traffic is Local and nothing external reaches the port:
        ``externalTrafficPolicy: Local`` still sends in-cluster traffic to external
        destinations to every endpoint (the pod and host short-circuit).
        """
        return not self.internal_policy_local or self.externally_accessible

    @property
    def uses_local_endpoints(self) -> bool:
        """Whether any path to this port uses node-local endpoints only."""
        return self.internal_policy_local or (
            self.external_policy_local and self.externally_accessible
        )


IS_LOCAL: Final = 1
"""The bit of :attr:`Endpoint.flags` that says :attr:`Endpoint.is_local`."""
READY: Final = 2
"""The bit of :attr:`Endpoint.flags` that says :attr:`Endpoint.ready`."""
SERVING: Final = 4
"""The bit of :attr:`Endpoint.flags` that says :attr:`Endpoint.serving`."""
TERMINATING: Final = 8
"""The bit of :attr:`Endpoint.flags` that says :attr:`Endpoint.terminating`."""
REMOTE: Final = 16
"""The bit of :attr:`Endpoint.flags` that says :attr:`Endpoint.remote`."""
_DEFAULT_FLAGS: Final = READY | SERVING


def endpoint_flags(
    is_local: bool, ready: bool, serving: bool, terminating: bool, remote: bool = False
) -> int:
    """The :attr:`Endpoint.flags` of these conditions."""
    return (
        (IS_LOCAL if is_local else 0)
        | (READY if ready else 0)
        | (SERVING if serving else 0)
        | (TERMINATING if terminating else 0)
        | (REMOTE if remote else 0)
    )


def flag_marks(test: Callable[[int], object]) -> bytes:
    """A translation table over :attr:`EndpointRows.flags`: byte ``b`` is 1 where
    ``test(b)`` holds, else 0, so ``rows.flags.translate(table)`` marks a whole list's
    endpoints in C (``1 in`` it: whether any holds)."""
    return bytes(1 if test(bits) else 0 for bits in range(256))


LOCAL_READY_MARKS: Final = flag_marks(lambda bits: bits & IS_LOCAL and bits & READY)
"""The :func:`flag_marks` of endpoints both local and ready (the topology's local list,
the map's count of local ready endpoints)."""


@dataclass(frozen=True, slots=True, init=False, repr=False)
class Endpoint:
    """One backend of a Service port, merged from the Service's EndpointSlices.

    Kept small, as a big cluster has a million of them (issue 32). The address is its
    canonical text (``address``, as ``str(ip)`` spells it), not an
    :class:`ipaddress.IPv4Address`: at 100k Services x 10 endpoints the address object and
    the int inside it were 84 MB, and every backend writes the text anyway; :attr:`ip`
    parses the text again when an address object is wanted. The five conditions are bits
    of one small int (``flags``), read through properties of their own names: five slots
    were 32 MB more.

    ``Endpoint(address, port, is_local, ready, serving, terminating, zone_hints,
    node_hints, remote)`` (hints left out: none) takes an address object or any text
    :func:`ipaddress.ip_address` reads (and keeps its canonical text); a condition left
    out (None) is taken from ``flags`` when given (as :func:`dataclasses.replace` gives
    it), else is its default: ready and serving, not local, terminating nor remote.
    """

    address: str
    """The endpoint's IP address, canonical text (``10.0.0.1``, ``fd00::1``)."""
    port: int
    flags: int
    """:data:`IS_LOCAL`, :data:`READY`, :data:`SERVING`, :data:`TERMINATING` and
    :data:`REMOTE`, or-ed (see :func:`endpoint_flags`)."""
    hints: tuple[frozenset[str], frozenset[str]]
    """(:attr:`zone_hints`, :attr:`node_hints`): one slot for both, as most endpoints
    have neither (one shared pair then): 8 MB less at 1M endpoints."""
    key: str = field(compare=False, init=False)
    """``IP:port`` (IPv6 bracketed): the endpoint's identity everywhere (sorting, dedup,
    rule names), computed once."""

    def __init__(
        self,
        address: IPAddress | str,
        port: int,
        is_local: bool | None = None,
        ready: bool | None = None,
        serving: bool | None = None,
        terminating: bool | None = None,
        zone_hints: frozenset[str] | None = None,
        node_hints: frozenset[str] | None = None,
        remote: bool | None = None,
        flags: int | None = None,
        hints: tuple[frozenset[str], frozenset[str]] | None = None,
    ) -> None:
        # hints as dataclasses.replace gives it; zone_hints or node_hints given override it.
        given_zones, given_nodes = NO_HINTS if hints is None else hints
        zone_hints = given_zones if zone_hints is None else zone_hints
        node_hints = given_nodes if node_hints is None else node_hints
        text = str(ipaddress.ip_address(address))
        bits = _DEFAULT_FLAGS if flags is None else flags
        for given, bit in (
            (is_local, IS_LOCAL),
            (ready, READY),
            (serving, SERVING),
            (terminating, TERMINATING),
            (remote, REMOTE),
        ):
            if given is not None:
                bits = bits | bit if given else bits & ~bit
        hints = (zone_hints, node_hints) if zone_hints or node_hints else NO_HINTS
        _fill(self, text, port, endpoint_key(text, port), bits, hints)

    @property
    def zone_hints(self) -> frozenset[str]:
        """The zones its ``hints.forZones`` name (empty when none)."""
        return self.hints[0]

    @property
    def node_hints(self) -> frozenset[str]:
        """The nodes its ``hints.forNodes`` name (empty when none)."""
        return self.hints[1]

    @property
    def is_local(self) -> bool:
        """Runs on this node (its ``nodeName`` is this proxy's node)."""
        return self.flags & IS_LOCAL != 0

    @property
    def ready(self) -> bool:
        """Its ``conditions.ready`` (true when not given)."""
        return self.flags & READY != 0

    @property
    def serving(self) -> bool:
        """Its ``conditions.serving`` (true when not given)."""
        return self.flags & SERVING != 0

    @property
    def terminating(self) -> bool:
        """Its ``conditions.terminating`` (false when not given)."""
        return self.flags & TERMINATING != 0

    @property
    def remote(self) -> bool:
        """Known to run on another node (its ``nodeName`` names another node): it can
        never be the source of a hairpin connection through this node."""
        return self.flags & REMOTE != 0

    @property
    def ip(self) -> IPAddress:
        """The address as an address object (parsed again at each call)."""
        return ipaddress.ip_address(self.address)

    @property
    def version(self) -> int:
        """4 or 6, as :attr:`ipaddress.IPv4Address.version` says."""
        return 6 if ":" in self.address else 4

    def with_port(self, port: int) -> Endpoint:
        """A copy with another port (sharing the address text, the hints and the flags)."""
        endpoint: Endpoint = _new(Endpoint)
        address = self.address
        key = endpoint_key(address, port)
        _fill(endpoint, address, port, key, self.flags, self.hints)
        return endpoint

    def __str__(self) -> str:
        return self.key

    def __repr__(self) -> str:
        return (
            f"Endpoint(address={self.address!r}, port={self.port!r}, "
            f"is_local={self.is_local}, ready={self.ready}, serving={self.serving}, "
            f"terminating={self.terminating}, zone_hints={self.zone_hints!r}, "
            f"node_hints={self.node_hints!r}, remote={self.remote})"
        )


_Filler: TypeAlias = Callable[
    [Endpoint, str, int, str, int, tuple[frozenset[str], frozenset[str]]], None
]
_Maker: TypeAlias = Callable[
    [str, int, str, bool, bool, bool, bool, frozenset[str], frozenset[str], bool], Endpoint
]


def _endpoint_builders() -> tuple[_Filler, _Maker]:
    # A frozen dataclass sets every field through object.__setattr__; at hundreds of
    # thousands of endpoints per start-up that was most of the parsing time. Writing the
    # slots through their descriptors gives the same object in a quarter of the time.
    setters = {f.name: getattr(Endpoint, f.name).__set__ for f in fields(Endpoint)}
    set_address, set_port, set_key = setters["address"], setters["port"], setters["key"]
    set_flags, set_hints = setters["flags"], setters["hints"]
    new = object.__new__
    no_hints = NO_HINTS

    def fill(
        endpoint: Endpoint,
        address: str,
        port: int,
        key: str,
        flags: int,
        hints: tuple[frozenset[str], frozenset[str]],
    ) -> None:
        set_address(endpoint, address)
        set_port(endpoint, port)
        set_flags(endpoint, flags)
        set_hints(endpoint, hints)
        set_key(endpoint, key)

    # The same sets again rather than a call of fill: the parser calls this once per
    # endpoint of the cluster, and a Python call costs as much as the sets.
    def make(
        address: str,
        port: int,
        key: str,
        is_local: bool,
        ready: bool,
        serving: bool,
        terminating: bool,
        zone_hints: frozenset[str],
        node_hints: frozenset[str],
        remote: bool = False,
    ) -> Endpoint:
        endpoint: Endpoint = new(Endpoint)
        set_address(endpoint, address)
        set_port(endpoint, port)
        set_flags(
            endpoint,
            (IS_LOCAL if is_local else 0)
            | (READY if ready else 0)
            | (SERVING if serving else 0)
            | (TERMINATING if terminating else 0)
            | (REMOTE if remote else 0),
        )
        set_hints(endpoint, (zone_hints, node_hints) if zone_hints or node_hints else no_hints)
        set_key(endpoint, key)
        return endpoint

    return fill, make


NO_HINTS: Final[tuple[frozenset[str], frozenset[str]]] = (frozenset(), frozenset())
"""The (zone hints, node hints) pair of an endpoint without hints: one shared pair,
which the parser and :class:`EndpointRows` hand out and test by identity first."""
_fill, _make = _endpoint_builders()
_new = object.__new__
make_endpoint: _Maker = _make
"""Build an :class:`Endpoint` fast, from already validated parts and its precomputed key.

``make_endpoint(address, port, key, is_local, ready, serving, terminating, zone_hints,
node_hints, remote)``: ``address`` must be the canonical text of a valid address and
``key`` ``endpoint_key(address, port)``; then the result equals ``Endpoint(address, port,
is_local, ...)``. The parser uses it for the hundreds of thousands of endpoints of a big
cluster (no address object, no second parse).
"""


def endpoint_key(address: str, port: int) -> str:
    """``address:port``, the address bracketed when it is IPv6 (``address`` is an
    :attr:`Endpoint.address`)."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


_Hints: TypeAlias = tuple[frozenset[str], frozenset[str]]


class EndpointRows(Sequence[Endpoint]):
    """Endpoints sorted by key, held as columns: a sequence of :class:`Endpoint` that
    keeps no object per endpoint (issue 32).

    At 100k Services x 10 endpoints an :class:`Endpoint` each was 69 MB and the tuples
    holding them 11 MB more, for 15 bytes or so of each endpoint on the wire. Here one
    slice's (or one port's) endpoints are a tuple of keys, a tuple of address texts
    (the very strings an :class:`Endpoint` would hold, which the backends keep too),
    their port (one int when all share it, as in a slice) and their :data:`READY`...
    bits as one ``bytes``; the hints only when some endpoint has any. An
    :class:`Endpoint` is made when one is read (indexing, iterating: about 0.3 us each),
    so code that reads endpoints one by one works unchanged, while the core and the
    backends read the columns (:attr:`keys`, :attr:`addresses`,
    :func:`endpoint_keys`...) of a whole list at once.

    Equal to another :class:`EndpointRows` with the same columns, and to a tuple of the
    same :class:`Endpoint` objects (and hashed as that tuple). Build one with
    :meth:`of` (from endpoints) or :meth:`columns` (from validated columns).
    """

    __slots__ = ("_port", "addresses", "flags", "hints", "keys")

    keys: tuple[str, ...]
    """The endpoints' keys (``IP:port``), sorted."""
    addresses: tuple[str, ...]
    """Their addresses' canonical texts, in the same order."""
    flags: bytes
    """Their :attr:`Endpoint.flags`, one byte each."""
    hints: tuple[_Hints, ...] | None
    """Their (zone hints, node hints) pairs; None when none has any."""
    _port: int | tuple[int, ...]

    def __init__(self) -> None:
        raise TypeError("use EndpointRows.of or EndpointRows.columns")

    @classmethod
    def columns(
        cls,
        keys: tuple[str, ...],
        addresses: tuple[str, ...],
        ports: int | tuple[int, ...],
        flags: bytes,
        hints: tuple[_Hints, ...] | None = None,
    ) -> EndpointRows:
        """Rows from columns already in key order: ``keys[i]`` is
        ``endpoint_key(addresses[i], port)``; ``ports`` one port for all, or one each;
        ``hints`` None or one pair each. Not checked: the parser and :meth:`of` call it."""
        rows: EndpointRows = _new(cls)
        if type(ports) is tuple:
            first = ports[0] if ports else 0
            if all(p == first for p in ports):
                ports = first
        if hints is not None and all(h is NO_HINTS or not (h[0] or h[1]) for h in hints):
            hints = None
        _set_keys(rows, keys)
        _set_addresses(rows, addresses)
        _set_port(rows, ports)
        _set_flags(rows, _shared_flags(flags))
        _set_hints(rows, hints)
        return rows

    @classmethod
    def of(cls, endpoints: Iterable[Endpoint]) -> EndpointRows:
        """The rows of ``endpoints`` (any order: sorted by key here, stably); the rows
        themselves when ``endpoints`` is one."""
        if type(endpoints) is EndpointRows:
            return endpoints
        ordered = sorted(endpoints, key=_endpoint_sort_key)
        hints = tuple(e.hints for e in ordered)
        return cls.columns(
            tuple(e.key for e in ordered),
            tuple(e.address for e in ordered),
            tuple(e.port for e in ordered),
            bytes(e.flags for e in ordered),
            hints,
        )

    @property
    def ports(self) -> tuple[int, ...]:
        """Each endpoint's port."""
        port = self._port
        return port if type(port) is tuple else (port,) * len(self.keys)  # type: ignore[return-value]

    def port_at(self, index: int) -> int:
        """The port of the endpoint at ``index``."""
        port = self._port
        return port[index] if type(port) is tuple else port  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self.keys)

    def _endpoint(self, index: int) -> Endpoint:
        endpoint: Endpoint = _new(Endpoint)
        hints = self.hints
        _fill(
            endpoint,
            self.addresses[index],
            self.port_at(index),
            self.keys[index],
            self.flags[index],
            NO_HINTS if hints is None else hints[index],
        )
        return endpoint

    @overload
    def __getitem__(self, index: int) -> Endpoint: ...

    @overload
    def __getitem__(self, index: slice) -> Endpoints: ...

    def __getitem__(self, index: int | slice) -> Endpoint | Endpoints:
        if isinstance(index, slice):
            chosen = range(len(self.keys))[index]
            if chosen.step < 0 and len(chosen) > 1:
                # Backwards, no longer sorted by key: a tuple, as rows are always sorted
                # (what endpoint_keys' readers and the nftables plan count on).
                return tuple([self._endpoint(i) for i in chosen])
            return self.take(chosen)
        return self._endpoint(range(len(self.keys))[index])

    def __iter__(self) -> Iterator[Endpoint]:
        new, fill = _new, _fill
        port = self._port
        ports = port if type(port) is tuple else itertools.repeat(port)
        hints = self.hints
        every = itertools.repeat(NO_HINTS) if hints is None else hints
        for address, key, bits, port_of, hint in zip(
            self.addresses, self.keys, self.flags, ports, every, strict=False
        ):
            endpoint: Endpoint = new(Endpoint)
            fill(endpoint, address, port_of, key, bits, hint)  # type: ignore[arg-type]
            yield endpoint

    def take(self, indices: Iterable[int]) -> EndpointRows:
        """The rows at ``indices`` (ascending, so still sorted by key)."""
        chosen = list(indices)
        keys, addresses, flags, hints = self.keys, self.addresses, self.flags, self.hints
        port = self._port
        return EndpointRows.columns(
            tuple([keys[i] for i in chosen]),
            tuple([addresses[i] for i in chosen]),
            tuple([port[i] for i in chosen]) if type(port) is tuple else port,
            bytes([flags[i] for i in chosen]),
            None if hints is None else tuple([hints[i] for i in chosen]),
        )

    def __eq__(self, other: object) -> bool:
        if type(other) is EndpointRows:
            return (
                self.keys == other.keys
                and self.flags == other.flags
                and self.addresses == other.addresses
                and self._port == other._port
                and self.hints == other.hints
            )
        if isinstance(other, tuple):
            return tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"EndpointRows({list(self)!r})"


def _endpoint_sort_key(endpoint: Endpoint) -> str:
    return endpoint.key


def _row_setters() -> tuple[Callable[[EndpointRows, object], None], ...]:
    # As for Endpoint: a slot's descriptor sets it without a call of __setattr__.
    names = ("keys", "addresses", "_port", "flags", "hints")
    return tuple(getattr(EndpointRows, name).__set__ for name in names)


_set_keys, _set_addresses, _set_port, _set_flags, _set_hints = _row_setters()


_FLAG_RUNS: dict[tuple[int, int], bytes] = {}


def _shared_flags(flags: bytes) -> bytes:
    # Most lists have every endpoint ready and serving: one bytes object per length
    # and value instead of one per list (at 100k lists of 10, 4 MB).
    if not flags or flags.count(flags[0]) != len(flags) or len(flags) > 64:
        return flags
    found = _FLAG_RUNS.get((flags[0], len(flags)))
    if found is None:
        found = _FLAG_RUNS[(flags[0], len(flags))] = bytes(flags)
    return found


Endpoints: TypeAlias = Sequence[Endpoint]
"""A list of endpoints as the core hands them out: an :class:`EndpointRows` (what the
core makes) or a tuple of :class:`Endpoint` (what a caller may give)."""


def endpoint_keys(endpoints: Endpoints) -> tuple[str, ...]:
    """The endpoints' keys, in their order (the rows' own tuple when they are rows)."""
    if type(endpoints) is EndpointRows:
        return endpoints.keys
    return tuple([e.key for e in endpoints])


def endpoint_addresses(endpoints: Endpoints) -> tuple[str, ...]:
    """The endpoints' address texts, in their order (the rows' own tuple when rows)."""
    if type(endpoints) is EndpointRows:
        return endpoints.addresses
    return tuple([e.address for e in endpoints])


def endpoint_ports(endpoints: Endpoints) -> tuple[int, ...]:
    """The endpoints' ports, in their order."""
    if type(endpoints) is EndpointRows:
        return endpoints.ports
    return tuple([e.port for e in endpoints])


@slot_init
@dataclass(frozen=True, slots=True)
class CategorizedEndpoints:
    """The endpoints of one Service port after traffic policy and topology.

    ``cluster`` serves traffic under the Cluster policy (topology-filtered, or the
    serving-terminating fallback); ``local`` serves traffic under a Local policy;
    ``all_reachable`` is every endpoint some path may reach; ``has_any`` says whether the
    Service has any usable endpoint anywhere (no: REJECT; yes but none local under a Local
    policy: DROP). The core gives each list as :class:`EndpointRows` (read them one by
    one, or whole through :func:`endpoint_keys` and the like); a tuple of
    :class:`Endpoint` is accepted too.
    """

    cluster: Endpoints = ()
    local: Endpoints = ()
    all_reachable: Endpoints = ()
    has_any: bool = False


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What the proxy knows of its own Node.

    ``addresses`` are the node's host IPs (primary first); ``pod_cidrs`` its
    ``spec.podCIDRs``; ``zone`` the ``topology.kubernetes.io/zone`` label.
    """

    name: str
    zone: str = ""
    addresses: tuple[IPAddress, ...] = ()
    pod_cidrs: tuple[IPNetwork, ...] = ()
    deleting: bool = False
    to_be_deleted_taint: bool = False

    def addresses_of(self, family: IPFamily) -> tuple[IPAddress, ...]:
        """The node's host IPs of one family, primary first."""
        return tuple(a for a in self.addresses if a.version == family.version)

    def pod_cidrs_of(self, family: IPFamily) -> tuple[IPNetwork, ...]:
        """The node's pod CIDRs of one family."""
        return tuple(c for c in self.pod_cidrs if c.version == family.version)
