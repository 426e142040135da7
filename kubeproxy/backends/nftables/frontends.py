"""What one Service port puts into the map structure's data (pure functions).

The map structure (see the package README) keeps no per-Service chain: every Service
port becomes *frontends* (its cluster IP, each external IP and load-balancer IP, its
NodePort), and each frontend becomes data elements only:

* membership of its *class* set (the class says how traffic to it is treated: which
  endpoint list, how many endpoints, masquerading, the Local-policy short-circuits,
  session affinity), read by one rule per class;
* its endpoints as numbered slots of a map read by ``numgen random mod N``;
* membership of the no-endpoint reject/drop sets and of the firewall sets;
* its Service port's name (:func:`frontend_comment`), the comment of its element in the
  dispatch set (or the no-endpoint set), so tools reading the kernel name its Service;
* for ClientIP session affinity, elements of the affinity lookup and record verdict
  maps that send the frontend to its port's affinity chains (:class:`AffinityPlan`).

An endpoint change therefore touches data elements only, and the kernel never
re-validates the table for it (see the package README).

Behaviour follows upstream kube-proxy's nftables mode (the same decisions as the
per-Service-chain structure the benchmarks keep, ``bench/chain_structure/render.py``);
this module only says *which* class and lists each frontend gets.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from kubeproxy.backends.nftables.table import (
    AFFINITY6_FRONTEND_SEEDS,
    AFFINITY6_MAP_TYPE,
    AFFINITY_MAP_PREFIX,
    MAX_AFFINITY_SECONDS,
    ChainSpec,
    InvalidPort,
    Key,
    RenderContext,
    affinity_frontend6_pin,
    affinity_frontend_shard,
    affinity_map_name,
    affinity_pin,
    chain_name,
    check_port_name,
    port_identity,
)
from kubeproxy.objects import (
    CategorizedEndpoints,
    EndpointRows,
    Endpoints,
    IPAddress,
    IPFamily,
    NamespacedName,
    Protocol,
    ServicePort,
    ServicePortName,
    endpoint_addresses,
    endpoint_ports,
    slot_init,
)

__all__ = [
    "AFFINITY_LOCAL_ENDPOINTS",
    "AFFINITY_MAP_SIZE",
    "AffinityMap",
    "AffinityPin",
    "AffinityPlan",
    "ClassSpec",
    "Frontend",
    "Kind",
    "NoEndpoint",
    "PortPlan",
    "Shape",
    "comment_names",
    "endpoint_value",
    "frontend_comment",
    "plan_port",
]


class Kind(enum.StrEnum):
    """What a frontend is keyed by (a StrEnum: its members are the strings they stand
    for, so the names built from them are unchanged)."""

    IP = "ip"
    """A frontend keyed by ``address . protocol . port`` (cluster, external, LB IPs)."""
    NODEPORT = "nodeport"
    """A frontend keyed by ``protocol . port`` on the node's NodePort addresses."""

    # The string's own hash, in C, not Enum's Python call (as objects.Protocol): a full
    # sync hashes a ClassSpec (its kind and shape) several times a frontend; measured,
    # a dict lookup of a ClassSpec took 0.39 against 1.06 us (timeit, the shared
    # machine, 2026-11-29), and a member now hashes as the string it equals.
    __hash__ = str.__hash__


class Shape(enum.StrEnum):
    """What is done to a frontend's traffic before the DNAT (part of its class)."""

    INTERNAL = "internal"
    """Cluster-IP traffic: the internal endpoint list, masqueraded as the detector says."""
    EXTERNAL = "external"
    """External traffic under ``externalTrafficPolicy: Cluster``: always masqueraded."""
    LOCAL = "local"
    """External traffic under ``externalTrafficPolicy: Local``: node-local endpoints,
    except traffic from local pods and from the node itself, which uses every endpoint
    (the short-circuits upstream has)."""

    # The string's own hash, in C, not Enum's Python call (as objects.Protocol): see Kind.
    __hash__ = str.__hash__


class NoEndpoint(enum.StrEnum):
    """The verdict for new connections to a frontend without an endpoint for it (its
    value is the nft verdict and the word in the no-endpoint sets' names)."""

    REJECT = "reject"
    """No endpoint anywhere: new connections are rejected."""
    DROP = "drop"
    """Endpoints exist, none of them for this frontend's policy: new connections are
    dropped."""

    # The string's own hash, in C, not Enum's Python call (as objects.Protocol): see Kind.
    __hash__ = str.__hash__


AFFINITY_MAP_SIZE = 65535
"""Clients one affinity map holds (the kernel's bound for a set that rules update, see
:func:`~.layout.affinity_container`): each port's lists have maps of their own, as
upstream's endpoints have sets of their own, so one busy Service never crowds out
another's clients."""
AFFINITY4_MAP_TYPE = "ipv4_addr : ipv4_addr . inet_service"
"""An IPv4 affinity map: client address : endpoint address . port."""
_CONSTANT = "numgen random mod 1"
# A 32-bit constant in a key: nft 1.0.6 cannot type a literal number in the concatenation
# of a map lookup ("Can't parse symbolic invalid expressions"); "numgen random mod 1
# offset N" is always N, typed as an integer.
AFFINITY6_CLIENT = "jhash ip6 saddr mod 4294967295 seed 0x0"
"""The client in an IPv6 key of the shared maps: a 32-bit hash of its address. nft 1.0.6
puts a dynamic map's value in the register after the first 16 bytes of the key, so a key
of the pin numbers and a whole IPv6 address would be overwritten by the value (its
listing looks right; the kernel holds a key no lookup finds). Two clients of one port
with the same hash share an entry (both still go to an endpoint of that port). The seed
is given: without one the kernel draws one per rule, and the lookup and the record would
hash differently."""
_CLUSTER_LIST = "service"
_LOCAL_LIST = "local"
_FRONTEND_LOOKUP = "ip daddr . meta l4proto . th dport . ip saddr"
# After DNAT the frontend is the connection's original destination. nft types ``ct
# original proto-dst`` only after a protocol match, and lists a one-protocol match before
# ``th dport`` as the dependency of ``tcp dport``, dropping it: the listing would not load
# again. A set of protocols stays as written (as in ``affinity-find``).
_FRONTEND_RECORD = (
    "meta l4proto {{ tcp, udp, sctp }} update @{shard} {{ ct original ip daddr . meta l4proto"
    " . ct original proto-dst . ip saddr timeout {seconds}s : ip daddr . th dport }} accept"
)


@dataclass(frozen=True, slots=True)
class _ByFrontend:
    """The ClientIP affinity of a port keyed by its cluster-IP frontend: the chains its
    verdict elements go to (the cluster IP's lookup and record; the record chains of its
    other addresses and of its NodePort), and its plan."""

    lookup: str
    record: str
    plan: AffinityPlan
    record_other: str | None = None
    record_nodeport: str | None = None


def _frontend_affinity(
    ctx: RenderContext,
    port: ServicePort,
    frontend: Key,
    endpoints: tuple[str, ...],
) -> _ByFrontend | None:
    """A port whose every address picks from one endpoint list keys its entries by its
    cluster-IP frontend: that frontend names the port, and after DNAT the packet carries
    it (its original destination), so its entries go in a map keyed by the frontend,
    read and written by chains every such port of the map (and protocol, or timeout)
    shares, and the port has no chain of its own. Each port's two chains (their
    creation, their rules' map bindings, every later commit walking them) were most of
    what affinity cost a cold sync (see the package README).

    Its other addresses (external and load-balancer IPs, the NodePort) read and write
    the same entry, as upstream's one set per endpoint serves every address of the port:
    the generation's ``affinity-canonical-*`` maps turn their destination (and a
    NodePort's port) into the cluster IP's before the lookup and the record, and the
    packet is put back after (:func:`~.layout.affinity_dispatch_chains`,
    ``affinity-find``); the port's elements in those maps are data, no chain.

    IPv6: a frontend and a client do not fit the 16 bytes of key nft 1.0.6 leaves
    before the value, so the key is hashes of both (:func:`_frontend_affinity6`).

    None for the ports that keep their pins: ports whose addresses
    pick from different lists (a Local traffic policy: upstream's ``local-`` chain reads
    only the local endpoints' entries), and UDP ports with a NodePort: turning a
    NodePort into the Service port is a ``udp dport set``, and the kernel's payload
    write updates a UDP checksum of 0 (a datagram sent without one: ``SO_NO_CHECK``,
    VXLAN's default over IPv4) into 0xffff, a checksum the receiver drops, even when
    the port is put back; an address write keeps the 0 (the pseudo-header update
    exempts it), so their other addresses alone would be safe, but a port's entries
    are keyed one way for all its addresses."""
    ipv6 = ctx.tokens.family is IPFamily.IPV6
    if (
        not (ctx.shared_affinity and ctx.frontend_affinity)
        or (ipv6 and not ctx.frontend_affinity6)
        or port.internal_policy_local
        or port.external_policy_local
        or (port.node_port and port.protocol is Protocol.UDP)
    ):
        return None
    if ipv6:
        return _frontend_affinity6(port, frontend, endpoints)
    shard, _number = affinity_frontend_shard(port_identity(port.name))
    proto, seconds = port.protocol.lower, port.session_affinity_seconds
    lookup, record, chains, shared = _frontend_chains(shard, proto, seconds)
    pin = AffinityPin(shard, frontend, endpoints)
    return _with_other_addresses(
        port, lookup, record, chains, AffinityPlan((), (), (), (pin,), shared), _RECORDS4
    )


def _with_other_addresses(
    port: ServicePort,
    lookup: str,
    record: str,
    chains: tuple[ChainSpec, ...],
    plan: AffinityPlan,
    records: tuple[Callable[[str, int], ChainSpec], Callable[[str, str, int], ChainSpec]],
) -> _ByFrontend:
    """A port's :class:`_ByFrontend`: ``chains`` and, for its external and load-balancer
    IPs and its NodePort, the record chains ``records`` build (of its map and timeout,
    and protocol), in ``plan`` (whose chains are replaced)."""
    shard = plan.pins[0].shard
    seconds = port.session_affinity_seconds
    record_other = record_nodeport = None
    if port.external_ips or port.load_balancer_vips:
        other = records[0](shard, seconds)
        record_other = other.name
        chains = (*chains, other)
    if port.node_port:
        nodeport = records[1](shard, port.protocol.lower, seconds)
        record_nodeport = nodeport.name
        chains = (*chains, nodeport)
    return _ByFrontend(
        lookup, record, dataclasses.replace(plan, chains=chains), record_other, record_nodeport
    )


def _frontend_affinity6(
    port: ServicePort, frontend: Key, endpoints: tuple[str, ...]
) -> _ByFrontend | None:
    """:func:`_frontend_affinity` of an IPv6 port: its entries in the shared map its pins
    would use (``affinity-clients-<n>``), keyed by two 32-bit hashes of the cluster-IP
    frontend and one of the client (:data:`AFFINITY6_FRONTEND_KEY`; a key is 16 bytes at
    most in an nft 1.0.6 update, see the package README), the value the endpoint's
    address; the endpoint port is the lookup chain's constant, so one chain per map,
    protocol and endpoint port. A port whose endpoints answer on several ports keeps its
    pins (a pin per endpoint port). The pin numbers are what the kernel's ``jhash``
    writes (:func:`~.table.affinity_frontend6_pin`, 14 us a port), for the cleaning of
    entries of endpoints gone."""
    ports = {key.rpartition(":")[2] for key in endpoints}
    if len(ports) > 1:
        return None
    target = int(next(iter(ports))) if ports else 0
    shard, _high, _low = affinity_pin(port_identity(port.name), _CLUSTER_LIST, 0)
    proto, seconds = port.protocol.lower, port.session_affinity_seconds
    lookup, record, chains, _maps = _frontend6_chains(shard, proto, target, seconds)
    if not target:
        # No endpoint: no frontend reads the lookup chain (nothing is dispatched).
        chains = chains[1:]
    pin = AffinityPin(shard, affinity_frontend6_pin(frontend), endpoints, target)
    return _with_other_addresses(
        port, lookup, record, chains, AffinityPlan((), (), (), (pin,), ()), _RECORDS6
    )


def _frontend6_hashes(frontend: str) -> str:
    return " . ".join(
        f"jhash {frontend} mod 4294967295 seed {seed:#x}" for seed in AFFINITY6_FRONTEND_SEEDS
    )


AFFINITY6_FRONTEND_KEY = f"{_frontend6_hashes('ip6 daddr . meta l4proto . th dport')} . {{client}}"
"""The key of an IPv6 port's entries keyed by its cluster-IP frontend: two hashes of the
frontend (:data:`~.table.AFFINITY6_FRONTEND_SEEDS`) and one of the client
(:data:`AFFINITY6_CLIENT`), 12 bytes; after DNAT the frontend is the connection's
original destination (``ct original ip6 daddr . meta l4proto . ct original proto-dst``:
the same registers, so the same numbers), for another address the packet turned into the
cluster IP's."""
_FRONTEND6_RECORD_KEY = (
    f"{_frontend6_hashes('ct original ip6 daddr . meta l4proto . ct original proto-dst')}"
    f" . {AFFINITY6_CLIENT}"
)
_FRONTEND6_OTHER_KEY = (
    f"{_frontend6_hashes('ip6 daddr . meta l4proto . ct original proto-dst')} . {AFFINITY6_CLIENT}"
)
_FRONTEND6_NODEPORT_KEY = (
    f"{_frontend6_hashes('ip6 daddr . meta l4proto . {proto} dport')} . {AFFINITY6_CLIENT}"
)


@functools.lru_cache(maxsize=4096)
def _frontend6_chains(
    shard: str, proto: str, target: int, seconds: int
) -> tuple[str, str, tuple[ChainSpec, ...], tuple[str, ...]]:
    """:func:`_frontend_chains` of IPv6: the lookup chain of map ``shard`` for protocol
    ``proto`` and endpoint port ``target``, and the record chain for ``seconds``."""
    owner = _chain_owner(shard)
    key = AFFINITY6_FRONTEND_KEY.format(client=AFFINITY6_CLIENT)
    lookup = (f"meta l4proto {proto} dnat to {key} map @{shard} : {target}",)
    record = (
        f"meta l4proto {{ tcp, udp, sctp }} update @{shard} {{ {_FRONTEND6_RECORD_KEY} "
        f"timeout {seconds}s : ip6 daddr }} accept",
    )
    specs = (
        ChainSpec(chain_name("affinity-lookup", owner, lookup), lookup),
        ChainSpec(chain_name("affinity-record", owner, record), record),
    )
    return specs[0].name, specs[1].name, specs, ()


@functools.lru_cache(maxsize=4096)
def _other_record_chain6(shard: str, seconds: int) -> ChainSpec:
    """The record chain of map ``shard``'s IPv6 ports' external and load-balancer IPs."""
    rules = (
        f"meta l4proto {{ tcp, udp, sctp }} update @{shard} {{ {_FRONTEND6_OTHER_KEY} "
        f"timeout {seconds}s : ct reply ip6 saddr }} ip6 daddr set ct reply ip6 saddr accept",
        "ip6 daddr set ct reply ip6 saddr",
    )
    return ChainSpec(chain_name("affinity-record-other", _chain_owner(shard), rules), rules)


@functools.lru_cache(maxsize=4096)
def _nodeport_record_chain6(shard: str, proto: str, seconds: int) -> ChainSpec:
    """The record chain of map ``shard``'s IPv6 ports' NodePorts of protocol ``proto``."""
    key = _FRONTEND6_NODEPORT_KEY.format(proto=proto)
    rules = (
        f"update @{shard} {{ {key} timeout {seconds}s : ct reply ip6 saddr }} "
        f"ip6 daddr set ct reply ip6 saddr {proto} dport set ct reply proto-src accept",
        f"ip6 daddr set ct reply ip6 saddr {proto} dport set ct reply proto-src",
    )
    return ChainSpec(chain_name("affinity-record-nodeport", _chain_owner(shard), rules), rules)


_RECORDS6 = (_other_record_chain6, _nodeport_record_chain6)


# What the record chains of the other addresses write: the key from the packet turned
# into the cluster IP's (by affinity-find), the endpoint from the connection's reply
# direction (the packet's own destination is the cluster IP's for now); the packet is
# put back in the same rule, and again by a second rule when the kernel refused the
# update (a full map), or it would leave for the cluster IP.
_OTHER_RECORD = (
    "meta l4proto {{ tcp, udp, sctp }} update @{shard} {{ ip daddr . meta l4proto . ct original"
    " proto-dst . ip saddr timeout {seconds}s : ct reply ip saddr . ct reply proto-src }} "
    "ip daddr set ct reply ip saddr accept",
    "ip daddr set ct reply ip saddr",
)
# A NodePort's: the port was turned into the Service port too (a named protocol: nft
# writes a port's checksum fix-up only for a named transport header; ``tcp dport`` in the
# key, as nft lists a protocol match before ``th dport``).
_NODEPORT_RECORD = (
    "update @{shard} {{ ip daddr . meta l4proto . {proto} dport . ip saddr timeout {seconds}s :"
    " ct reply ip saddr . ct reply proto-src }} ip daddr set ct reply ip saddr {proto} dport "
    "set ct reply proto-src accept",
    "ip daddr set ct reply ip saddr {proto} dport set ct reply proto-src",
)


@functools.lru_cache(maxsize=4096)
def _other_record_chain(shard: str, seconds: int) -> ChainSpec:
    """The record chain of map ``shard``'s ports' external and load-balancer IPs."""
    rules = tuple(r.format(shard=shard, seconds=seconds) for r in _OTHER_RECORD)
    return ChainSpec(chain_name("affinity-record-other", _chain_owner(shard), rules), rules)


@functools.lru_cache(maxsize=4096)
def _nodeport_record_chain(shard: str, proto: str, seconds: int) -> ChainSpec:
    """The record chain of map ``shard``'s ports' NodePorts of protocol ``proto``."""
    rules = tuple(r.format(shard=shard, proto=proto, seconds=seconds) for r in _NODEPORT_RECORD)
    return ChainSpec(chain_name("affinity-record-nodeport", _chain_owner(shard), rules), rules)


_RECORDS4 = (_other_record_chain, _nodeport_record_chain)


# Every port of a map (and protocol, or timeout) shares these chains: built once (a chain
# name is a SHA-256 of its rules, 8 us, twice a port: 0.5 s at 30k ports; and their tuples
# are one object each, not one per port: fewer objects for every pass of the collector).
# Bounded by the maps, the protocols and the timeouts in use.
@functools.lru_cache(maxsize=4096)
def _frontend_chains(
    shard: str, proto: str, seconds: int
) -> tuple[str, str, tuple[ChainSpec, ...], tuple[str, ...]]:
    """The lookup chain of frontend-keyed map ``shard`` for protocol ``proto``, its record
    chain for ``seconds`` (see :meth:`_Affinity.record`), both, and the map (as a
    plan holds them)."""
    owner = _chain_owner(shard)
    lookup = (f"meta l4proto {proto} dnat to {_FRONTEND_LOOKUP} map @{shard}",)
    record = (_FRONTEND_RECORD.format(shard=shard, seconds=seconds),)
    specs = (
        ChainSpec(chain_name("affinity-lookup", owner, lookup), lookup),
        ChainSpec(chain_name("affinity-record", owner, record), record),
    )
    return specs[0].name, specs[1].name, specs, (shard,)


def _chain_owner(shard: str) -> str:
    """What a shared chain's name ends with: ``frontends-<n>`` (no port's name: the chain
    belongs to every port of its map)."""
    return shard.removeprefix(AFFINITY_MAP_PREFIX)


@dataclass(frozen=True, slots=True, order=True)
class ClassSpec:
    """How traffic to a frontend is treated; frontends of one class share one rule.

    ``count`` endpoints are chosen from the frontend's main list (``shortcut`` from its
    short-circuit list, for :attr:`Shape.LOCAL`); ``affinity`` adds the ClientIP lookup.
    """

    kind: Kind
    shape: Shape
    count: int
    shortcut: int = 0
    affinity: bool = False


@slot_init
@dataclass(frozen=True, slots=True)
class Frontend:
    """One frontend of a Service port and everything the data holds for it.

    ``endpoints`` and ``shortcut`` are endpoint keys (``IP:port``, sorted); the backend
    numbers them into stable slots. ``cls`` is None when nothing dispatches the
    frontend (no usable endpoint for it); ``no_endpoint`` is a :class:`NoEndpoint`
    verdict or None. With ClientIP affinity, ``lookup`` and ``shortcut_lookup``
    name the chains its main and short-circuit picks look the client up in, and
    ``record`` the chain that records a new connection's endpoint (all in the port's
    :class:`AffinityPlan`). ``name`` is the Service port's :func:`frontend_comment`, the
    comment of the frontend's dispatch and no-endpoint elements.
    """

    kind: Kind
    key: Key
    cls: ClassSpec | None
    endpoints: tuple[str, ...] = ()
    shortcut: tuple[str, ...] = ()
    no_endpoint: NoEndpoint | None = None
    lookup: str | None = None
    shortcut_lookup: str | None = None
    record: str | None = None
    name: str | None = None
    canonical: Key | None = None
    """With ClientIP affinity keyed by the cluster-IP frontend, for another address of the
    port: the cluster IP (and, for a NodePort, the Service port) its packets are turned
    into to read and write that frontend's entry (the ``affinity-canonical-*`` maps)."""


COMMENT_LIMIT = 128
"""Longest frontend comment: what nft's parser takes (``NFTNL_UDATA_COMMENT_MAXLEN``), so
a listing of the table loads again."""
_SHORTENED = "~"
_ANY_PROTOCOL = Protocol.TCP  # the comment names no protocol (a port name is unique)


def frontend_comment(name: ServicePortName) -> str:
    """What the kernel keeps to name a frontend's Service port: upstream's
    ``namespace/name:port`` (``namespace/name`` for an unnamed port), as the comment of the
    frontend's dispatch (or no-endpoint) element.

    A name longer than :data:`COMMENT_LIMIT` (a 63-character namespace and Service name
    with a long port name can be 143) keeps its first characters, a ``~`` and eight
    characters of its hash (:func:`comment_names`)."""
    text = str(name)
    if len(text) <= COMMENT_LIMIT:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{text[: COMMENT_LIMIT - 9]}{_SHORTENED}{digest}"


def comment_names(comment: str, service: NamespacedName, port: str | None = None) -> bool:
    """Whether a frontend comment (:func:`frontend_comment`) names a port of ``service``
    (of that ``port`` name, when given). A shortened comment names the Service whose full
    name begins with its kept characters (and, with ``port``, whose hash matches)."""
    if port is not None:
        return comment == frontend_comment(ServicePortName(service, port, _ANY_PROTOCOL))
    whole = str(service)
    if comment == whole or comment.startswith(whole + ":"):
        return True
    kept, shortened, _digest = comment.rpartition(_SHORTENED)
    return bool(shortened) and len(comment) == COMMENT_LIMIT and (whole + ":").startswith(kept)


AFFINITY_LOCAL_ENDPOINTS = "affinity-local-endpoints"
"""The set of ``endpoint . port`` of the node-local lists of ClientIP ports that pick
from both lists (outside generations: content-named record chains read it)."""


@dataclass(frozen=True, slots=True)
class AffinityMap:
    """One dynamic ``client : endpoint`` map of a Service port's affinity.

    ``allowed`` are the values an entry may hold while the port's endpoints are what
    they are (``(ip, port)`` for IPv4, ``(ip,)`` for IPv6): the backend deletes the
    others after an endpoint went away.
    """

    name: str
    type: str
    allowed: frozenset[Key]


@dataclass(frozen=True, slots=True)
class AffinityPin:
    """The entries of one endpoint list of a Service port in a shared affinity map
    (:func:`~.table.affinity_pin`): in map ``shard``, keyed by the two numbers ``pin``
    (as nft lists them) and the client; or, in a map keyed by the frontend
    (:func:`~.table.affinity_frontend_shard`), by the frontend ``pin`` (address, protocol,
    port) and the client. ``endpoints`` are the list's endpoint keys (the plan's own
    tuple) and ``port`` the endpoint port of an IPv6 pin (whose entries hold the address
    alone; 0 where they hold address and port; an IPv6 port keyed by its cluster-IP
    frontend has the two hashes of it as its ``pin``, see
    :func:`~.table.affinity_frontend6_pin`): what :attr:`allowed` is made of, only
    when the cleaner needs it (a frozenset of values a port was 2.4 KB and 5 us, for
    every port at every full sync)."""

    shard: str
    pin: Key
    endpoints: tuple[str, ...]
    port: int = 0

    @property
    def allowed(self) -> frozenset[Key]:
        """The values an entry may hold while the list is what it is; the backend deletes
        the others after an endpoint went away."""
        values = (endpoint_value(key) for key in self.endpoints)
        if self.port:
            return frozenset((host,) for host, port in values if int(port) == self.port)
        return frozenset(values)


@dataclass(frozen=True, slots=True)
class AffinityPlan:
    """ClientIP affinity of one Service port: per endpoint list (the port's cluster list
    and its node-local list, as upstream's ``service-`` and ``local-`` chains), dynamic
    maps of the client's endpoint, shared by every frontend that picks from that list.

    ``chains`` (content-named: a name always holds the same rules) read the maps before
    the random pick (``affinity-lookup-``) and write them after DNAT, one chain for the
    whole port (``affinity-record-``): a connection's endpoint goes into the map of every
    list that holds it, as upstream records a client per endpoint, which both its
    cluster-list and local-list chains read. ``local_members`` (``(ip, port)`` of the
    local list, when both lists are used) tell the record chain which endpoints the local
    list holds (:data:`AFFINITY_LOCAL_ENDPOINTS`). IPv6 has one map per endpoint port:
    nft 1.0.6 aborts on a dynamic-map update wider than 32 bytes, which an IPv6 ``client
    : endpoint . port`` needs.
    """

    maps: tuple[AffinityMap, ...]
    chains: tuple[ChainSpec, ...]
    local_members: tuple[Key, ...] = ()
    pins: tuple[AffinityPin, ...] = ()
    shared_maps: tuple[str, ...] = ()
    """The maps keyed by the frontend the port's entries are in (declared while some
    port uses them, see :func:`~.layout.affinity_frontend_map`)."""


@slot_init
@dataclass(frozen=True, slots=True)
class PortPlan:
    """Everything one Service port puts into the table.

    ``firewall`` pairs each load-balancer frontend subject to source ranges with the
    sources it accepts (CIDRs or addresses). ``cluster_ip`` (in ``cluster-ips``) and
    ``hairpin`` (endpoint addresses, each an ``address . address`` element of
    ``hairpin-endpoints``) may be shared with other ports: the backend counts them.
    ``claims`` are the keys no other port may use (each once; a tuple, as most ports
    claim one key: a frozenset of one was 216 bytes a port); ``affinity`` the port's ClientIP
    affinity maps and chains.
    """

    frontends: tuple[Frontend, ...]
    firewall: tuple[tuple[Key, tuple[str, ...]], ...]
    cluster_ip: str
    hairpin: tuple[str, ...]
    claims: tuple[Key, ...]
    affinity: AffinityPlan | None = None


def endpoint_value(key: str) -> Key:
    """An endpoint key (``10.0.0.1:80``, ``[fd00::1]:80``) as map value parts."""
    host, _, port = key.rpartition(":")
    if host.startswith("["):
        host = host[1:-1]
    return (host, port)


def _check_port(what: str, value: int, *, zero_ok: bool = False) -> None:
    if not (0 if zero_ok else 1) <= value <= 65535:
        raise InvalidPort(f"{what} {value} is out of range")


# What a family's addresses are: an address's ``version`` is a Python property, a type
# test is C's.
_ADDRESS_TYPES: Final = {IPFamily.IPV4: ipaddress.IPv4Address, IPFamily.IPV6: ipaddress.IPv6Address}


def _check(ctx: RenderContext, port: ServicePort, eps: CategorizedEndpoints) -> None:
    """Raise :class:`InvalidPort` for anything that must not reach nft.

    Every port of every full sync passes here, so the usual port's checks are the
    cheapest that say the same: the ranges compared inline, the cluster IP's family by
    its type (a ``version`` is a Python property, twice a port), one :func:`_check_port`
    only to word a refusal. Measured on the proxier's own snapshot of 20k ClusterIP
    Services x 10 endpoints (``timeit``, ``time.process_time``, best of 5, three runs
    alternating with main ``d4d5b59``, 2026-11-29, the shared machine at load 8-10 with
    the test suite running): a port's checks took 2.8-3.2 against 4.1-4.2 us (with
    :func:`~.table.check_port_name` and :func:`_check_endpoints`' columns), its whole
    plan 7.0-7.5 against 8.6-8.8 us."""
    check_port_name(port.name)  # names must be safe: they appear in logs and comments
    if not 1 <= port.port <= 65535:
        _check_port("port", port.port)
    if not 0 <= port.node_port <= 65535:
        _check_port("nodePort", port.node_port, zero_ok=True)
    if port.session_affinity_seconds > MAX_AFFINITY_SECONDS:
        raise InvalidPort(f"session affinity timeout {port.session_affinity_seconds}s is too long")
    family = ctx.tokens.family
    address_type = _ADDRESS_TYPES[family]
    if not isinstance(port.cluster_ip, address_type):
        raise InvalidPort(f"cluster IP {port.cluster_ip} is not {family}")
    # Most ports have no other address: no generator made for them.
    if port.external_ips or port.load_balancer_vips:
        for ip in (*port.external_ips, *port.load_balancer_vips):
            if not isinstance(ip, address_type):
                raise InvalidPort(f"service IP {ip} is not {family}")
    # The three lists usually share endpoints (often the very same tuple): check each
    # distinct list once (told apart by identity, without a dict made a port).
    cluster, local, every = eps.cluster, eps.local, eps.all_reachable
    _check_endpoints(ctx, cluster)
    if local is not cluster:
        _check_endpoints(ctx, local)
    if every is not cluster and every is not local:
        _check_endpoints(ctx, every)
    if port.load_balancer_source_ranges:
        version = family.version
        for cidr in port.load_balancer_source_ranges:
            if cidr.version != version:
                raise InvalidPort(f"source range {cidr} is not {family}")


def _check_endpoints(ctx: RenderContext, group: Endpoints) -> None:
    """Raise :class:`InvalidPort` for an endpoint of ``group`` of the other family or with
    a port out of range.

    Checked a list at a time (the rows' own columns), the loop below finding the culprit:
    an endpoint's version (a property) and port were two thirds of the port's checks,
    0.7 s of a profiled 30k Services x 10 full sync. The rows' columns are read
    directly, no call a list to fetch them (measured with :func:`_check`)."""
    if type(group) is EndpointRows:
        addresses, ports = group.addresses, group.ports
    else:
        addresses, ports = endpoint_addresses(group), endpoint_ports(group)
    if not addresses:
        return
    if ctx.tokens.family is IPFamily.IPV4:
        family_ok = ":" not in " ".join(addresses)
    else:
        family_ok = all(":" in address for address in addresses)
    if family_ok and min(ports) >= 1 and max(ports) <= 65535:
        return
    version = ctx.tokens.family.version
    for ep in group:
        if ep.version != version:
            raise InvalidPort(f"endpoint {ep.address} is not {ctx.tokens.family}")
        if not 1 <= ep.port <= 65535:
            raise InvalidPort(f"endpoint port {ep.port} is out of range")


# A protocol as nft spells it, one string each: ``Protocol.lower`` is two Python calls (a
# property over the enum's ``value``) and makes a new string each time, which every
# frontend key, claim and port state of the port then held: at 100k Services the peak
# was 6-7 MiB lower with these (``bench.memory_compare``, 471 against 477 MiB from the
# manifests, 485-486 against 492 from the API; bench/README.md).
_PROTOCOL_TEXT: Final = {protocol: protocol.lower for protocol in Protocol}

# One object per distinct class, not one per frontend.
_class = functools.lru_cache(maxsize=4096)(ClassSpec)


@functools.lru_cache(maxsize=4096)
def _port_text(port: int) -> str:
    # One string per port number, not one per frontend (100k frontends hold a few).
    return str(port)


def _address_text(ip: IPAddress) -> str:
    """``str(ip)``, an IPv4 address's in C: the dotted quad is what ``inet_ntoa`` writes
    (``str`` of an IPv4Address formats it in Python: 1.56 against 0.65 us, ``timeit``,
    the shared machine; once per port of a full sync)."""
    if ip.version == 4:
        return _inet_ntoa(int(ip).to_bytes(4, "big"))
    return str(ip)


_inet_ntoa = socket.inet_ntoa


def _keys(endpoints: Endpoints) -> tuple[str, ...]:
    if type(endpoints) is EndpointRows:
        return endpoints.keys  # sorted already: the core's own tuple, shared (11 MB at 100k)
    keys = [ep.key for ep in endpoints]  # a list comprehension: no generator per port
    keys.sort()
    return tuple(keys)


def plan_port(ctx: RenderContext, port: ServicePort, eps: CategorizedEndpoints) -> PortPlan:
    """The frontends, firewall and shared elements of one Service port.

    ``eps`` is the core's categorisation; policy decisions are read from it and from the
    port's flags, never re-derived. Raises :class:`InvalidPort` (a :class:`ValueError`)
    when the port cannot be rendered safely.
    """
    _check(ctx, port, eps)
    proto = _PROTOCOL_TEXT[port.protocol]
    port_text = _port_text(port.port)
    cip = _address_text(port.cluster_ip)
    sticky = port.session_affinity_seconds > 0

    cluster = _keys(eps.cluster) if port.uses_cluster_endpoints else ()
    local = _keys(eps.local) if port.uses_local_endpoints else ()
    internal = local if port.internal_policy_local else cluster
    no_endpoint = NoEndpoint.DROP if eps.has_any else NoEndpoint.REJECT
    cluster_key: Key = (cip, proto, port_text)
    affinity = None
    record = internal_lookup = by_frontend = None
    if sticky:
        by_frontend = _frontend_affinity(ctx, port, cluster_key, internal)
        if by_frontend is None:
            affinity = _Affinity(ctx, port, cluster, local)
            record = affinity.record()
        else:
            record, internal_lookup = by_frontend.record, by_frontend.lookup

    frontends: list[Frontend] = []
    claims: list[Key] = [cluster_key]
    name = frontend_comment(port.name)
    internal_list = _LOCAL_LIST if port.internal_policy_local else _CLUSTER_LIST
    if internal:
        frontends.append(
            Frontend(
                Kind.IP,
                cluster_key,
                _class(Kind.IP, Shape.INTERNAL, len(internal), 0, sticky),
                internal,
                lookup=affinity.lookup(internal_list) if affinity else internal_lookup,
                record=record,
                name=name,
            )
        )
    else:
        frontends.append(Frontend(Kind.IP, cluster_key, None, no_endpoint=no_endpoint, name=name))

    external_keys: list[tuple[Kind, Key]] = []
    for ext in (*port.external_ips, *port.load_balancer_vips):
        key: Key = (str(ext), proto, port_text)
        if key not in claims:
            claims.append(key)
            external_keys.append((Kind.IP, key))
    if port.node_port:
        node_key: Key = (proto, _port_text(port.node_port))
        claims.append(node_key)
        external_keys.append((Kind.NODEPORT, node_key))

    if external_keys:
        if port.external_policy_local:
            main, shortcut = local, cluster
            shape = Shape.LOCAL
            served = eps.has_any and bool(local or cluster)
        else:
            main, shortcut = cluster, ()
            shape = Shape.EXTERNAL
            served = bool(cluster)
        lookup = shortcut_lookup = None
        if affinity is not None and served:
            main_list = _LOCAL_LIST if shape == Shape.LOCAL else _CLUSTER_LIST
            lookup = affinity.lookup(main_list) if main else None
            shortcut_lookup = affinity.lookup(_CLUSTER_LIST) if shortcut else None
        for kind, key in external_keys:
            if served:
                cls = _class(kind, shape, len(main), len(shortcut), sticky)
                canonical: Key | None = None
                fe_record = record
                if by_frontend is not None:
                    # The cluster IP's entry, read through the canonical maps (no lookup
                    # element of its own) and written by the address kind's record chain.
                    if kind == Kind.IP:
                        canonical, fe_record = (cip,), by_frontend.record_other
                    else:
                        canonical, fe_record = (cip, port_text), by_frontend.record_nodeport
                fe = Frontend(
                    kind,
                    key,
                    cls,
                    main,
                    shortcut,
                    None if main else no_endpoint,
                    lookup,
                    shortcut_lookup,
                    fe_record,
                    name,
                    canonical,
                )
            else:
                fe = Frontend(kind, key, None, no_endpoint=no_endpoint, name=name)
            frontends.append(fe)

    firewall: list[tuple[Key, tuple[str, ...]]] = []
    if port.load_balancer_vips and port.load_balancer_source_ranges:
        sources = _allowed_sources(ctx, port)
        for vip in dict.fromkeys(port.load_balancer_vips):
            firewall.append(((str(vip), proto, port_text), sources))

    # Every endpoint, as upstream: a hairpin connection comes from the endpoint itself,
    # and whether an endpoint runs here is only as good as the node name it names (with
    # a --hostname-override it may name none). Measured: at 30k Services x 10 endpoints,
    # none of them local, this costs 0.4 s of a 5 s cold sync. The endpoint's own address
    # text: one string per endpoint, however many ports share it (the parser's, shared
    # with every port's copy of the endpoint), no second copy split from the key.
    # The core's tuple itself when no address repeats (11 MB at 100k Services).
    addresses = endpoint_addresses(eps.all_reachable)
    unique = dict.fromkeys(addresses)
    hairpin = addresses if len(unique) == len(addresses) else tuple(unique)
    return PortPlan(
        tuple(frontends),
        tuple(firewall),
        cip,
        hairpin,
        tuple(claims),
        affinity.plan() if affinity is not None else by_frontend.plan if by_frontend else None,
    )


def _allowed_sources(ctx: RenderContext, port: ServicePort) -> tuple[str, ...]:
    """A load balancer's source ranges as ``firewall-allow`` takes them: no range inside
    another (the kernel refuses overlapping entries of an interval set, and one refused
    element fails the whole sync), and the VIPs when a range holds a node address (a VIP
    looped back to the node arrives from the VIP itself; upstream allows it), unless a
    range covers them already."""
    given = port.load_balancer_source_ranges
    ranges: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = [
        *ipaddress.collapse_addresses(c for c in given if isinstance(c, ipaddress.IPv4Network)),
        *ipaddress.collapse_addresses(c for c in given if isinstance(c, ipaddress.IPv6Network)),
    ]
    allowed = [str(cidr) for cidr in ranges]
    if any(a in cidr for a in ctx.node_addresses for cidr in ranges):
        for vip in dict.fromkeys(port.load_balancer_vips):
            if not any(vip in cidr for cidr in ranges):
                allowed.append(str(vip))
    return tuple(allowed)


class _Affinity:
    """Builds one port's :class:`AffinityPlan` as frontends ask for its chains."""

    def __init__(
        self,
        ctx: RenderContext,
        port: ServicePort,
        cluster: tuple[str, ...],
        local: tuple[str, ...],
    ) -> None:
        self.ctx = ctx
        self.identity = port_identity(port.name)
        # The port's own protocol, a plain comparison: DNAT to an address and port needs a
        # transport protocol in the rule, and a set of protocols ("{ tcp, udp, sctp }")
        # would be an anonymous set per chain. The kernel names each new anonymous set by
        # scanning every set of the table (``nf_tables_set_alloc_name``), and finds a set
        # named in a rule by walking the same list, so with a chain per port that made
        # the cold sync quadratic: every Service with ClientIP affinity, 10k: 32.3 s,
        # 26.3 s of it in the kernel, against 1.9 s without affinity (``make bench``,
        # test_cold_affinity, 2026-11-27).
        self.l4 = f"meta l4proto {port.protocol.lower}"
        self.seconds = port.session_affinity_seconds
        self.lists = {_CLUSTER_LIST: cluster, _LOCAL_LIST: local}
        self.ipv6 = ctx.tokens.family is IPFamily.IPV6
        self.maps: dict[str, AffinityMap] = {}
        self.pins: dict[Key, AffinityPin] = {}
        self.targets: dict[str, list[tuple[str, str, int]]] = {}
        self.chains: dict[str, ChainSpec] = {}
        # The lists some frontend picks from, known before any frontend is built (the
        # record chain, shared by every frontend, writes each of them).
        self.used = set()
        internal = local if port.internal_policy_local else cluster
        if internal:
            self.used.add(_LOCAL_LIST if port.internal_policy_local else _CLUSTER_LIST)
        if port.external_ips or port.load_balancer_vips or port.node_port:
            if port.external_policy_local:
                if local:
                    self.used.add(_LOCAL_LIST)
                if cluster:
                    self.used.add(_CLUSTER_LIST)
            elif cluster:
                self.used.add(_CLUSTER_LIST)

    def _maps_of(self, which: str) -> list[tuple[str, int]]:
        """(map name, endpoint port: 0 for IPv4's one map) of one endpoint list (the
        per-port maps)."""
        endpoints = [endpoint_value(key) for key in self.lists[which]]
        if not self.ipv6:
            name = affinity_map_name(self.identity, which, 0)
            if name not in self.maps:
                self.maps[name] = AffinityMap(name, AFFINITY4_MAP_TYPE, frozenset(endpoints))
            return [(name, 0)]
        out = []
        for port in sorted({int(p) for _host, p in endpoints}):
            name = affinity_map_name(self.identity, which, port)
            if name not in self.maps:
                hosts = frozenset((h,) for h, p in endpoints if int(p) == port)
                self.maps[name] = AffinityMap(name, AFFINITY6_MAP_TYPE, hosts)
            out.append((name, port))
        return out

    def _targets(self, which: str) -> list[tuple[str, str, int]]:
        """(map name, key expression, endpoint port: 0 for IPv4) of the entries of one
        endpoint list: the port's own maps keyed by the client, or the shared maps keyed
        by the list's pin numbers and the client (IPv6: a 32-bit hash of it, see
        :data:`AFFINITY6_SHARED_KEY`)."""
        known = self.targets.get(which)
        if known is not None:
            return known
        ip = "ip6" if self.ipv6 else "ip"
        if not self.ctx.shared_affinity:
            return [(name, f"{ip} saddr", port) for name, port in self._maps_of(which)]
        lists = self.lists[which]
        ports = sorted({int(endpoint_value(k)[1]) for k in lists}) if self.ipv6 else [0]
        out = []
        for port in ports:
            shard, high, low = affinity_pin(self.identity, which, port)
            pin = (str(high), str(low))
            if pin not in self.pins:
                self.pins[pin] = AffinityPin(shard, pin, lists, port)
            client = AFFINITY6_CLIENT if self.ipv6 else "ip saddr"
            key = f"{_CONSTANT} offset {high} . {_CONSTANT} offset {low} . {client}"
            out.append((shard, key, port))
        self.targets[which] = out
        return out

    def _chain(self, prefix: str, rules: list[str]) -> str:
        spec = ChainSpec(chain_name(prefix, self.identity, rules), tuple(rules))
        self.chains.setdefault(spec.name, spec)
        return spec.name

    def lookup(self, which: str) -> str:
        """The chain that DNATs a client with a recorded endpoint of list ``which``."""
        if self.ipv6:
            rules = [
                f"{self.l4} dnat to {key} map @{name} : {port}"
                for name, key, port in self._targets(which)
            ]
        else:
            rules = [
                f"{self.l4} dnat to {key} map @{name}" for name, key, _ in self._targets(which)
            ]
        return self._chain("affinity-lookup", rules)

    def record(self) -> str:
        """The chain that records a new connection's endpoint in the entries of every list
        the port picks from that holds it: the cluster list holds every endpoint a pick
        may choose, the local list those in :data:`AFFINITY_LOCAL_ENDPOINTS` (when the
        port picks from both).

        With the shared maps the last list's rules end in ``accept``: the fixed
        ``affinity-find`` chain goes here (``goto``), and ``affinity-record``, which
        jumped to it, counts (``affinity-full``) the connections that come back, those
        whose entry the kernel refused (the map is full). ``accept`` ends the base chain
        as its end would: ``affinity-record`` is the last rule of the filter chains,
        whose policy accepts (no rule of another table is skipped)."""
        seconds = self.seconds
        both = len(self.used) == 2
        shared = self.ctx.shared_affinity
        order = (_LOCAL_LIST, _CLUSTER_LIST) if shared else (_CLUSTER_LIST, _LOCAL_LIST)
        last = _CLUSTER_LIST if _CLUSTER_LIST in self.used else _LOCAL_LIST
        ip = "ip6" if self.ipv6 else "ip"
        rules = []
        for which in order:
            if which not in self.used:
                continue
            member = (
                f"{ip} daddr . th dport @{AFFINITY_LOCAL_ENDPOINTS} "
                if both and which == _LOCAL_LIST
                else ""
            )
            end = " accept" if shared and which == last else ""
            for name, key, port in self._targets(which):
                if self.ipv6:
                    rules.append(
                        f"th dport {port} {member}update @{name} "
                        f"{{ {key} timeout {seconds}s : ip6 daddr }}{end}"
                    )
                else:
                    rules.append(
                        f"{member}update @{name} "
                        f"{{ {key} timeout {seconds}s : ip daddr . th dport }}{end}"
                    )
        return self._chain("affinity-record", rules)

    def plan(self) -> AffinityPlan:
        """Everything asked for so far."""
        members: tuple[Key, ...] = ()
        if len(self.used) == 2:
            members = tuple(endpoint_value(key) for key in self.lists[_LOCAL_LIST])
        return AffinityPlan(
            tuple(self.maps.values()),
            tuple(self.chains.values()),
            members,
            tuple(self.pins.values()),
        )
