"""Our table, and the words every renderer of it writes with.

The nftables backend writes one table per family (``table ip kube-proxy``, ``table ip6
kube-proxy``). This module holds what does not depend on how Services are laid out in it:

* the table's name and comment, and upstream's names of the fixed chains, sets and maps
  (:class:`Names`) with its base chains, hooks and priorities (:func:`base_chains`), which
  other components treat as public (see the package README);
* the words that differ between ``ip`` and ``ip6`` (:class:`FamilyTokens`);
* the specs renderers return (:class:`ContainerSpec`, :class:`FixedChain`,
  :class:`ChainSpec`), what rendering a Service port needs besides the port
  (:class:`RenderContext`, built once per sync) and the error of a port that cannot be
  rendered safely (:class:`InvalidPort`);
* the names of per-Service-port chains and affinity maps: readable, bounded, and a
  function of their content (:func:`port_identity`, :func:`chain_name`,
  :func:`affinity_map_name`).

The map structure (:mod:`.layout`, :mod:`.frontends`, :mod:`.backend`) is built of these,
and so is the previous, per-Service-chain structure that the benchmarks keep next to it
(``bench/chain_structure``); that is why they live here, in neither structure's modules.

A per-Service-port chain is called ``<prefix>-<H>-<ns>/<svc>/<proto>/<port>`` (a group
chain adds ``/<k>``), where ``H`` is the first 8 characters of the base32 SHA-256 of the
chain's identity and its rules. A chain of a given name therefore always holds the same
rules: a backend that finds the name in the kernel (after a restart, or at a periodic full
sync) can reuse it without reading its rules back, and a chain whose rules change becomes
a new chain that the elements switch to atomically.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import logging
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from kubeproxy.backends.nftables.objects import PROTOCOL_NUMBERS
from kubeproxy.config import LocalDetector
from kubeproxy.objects import IPAddress, IPFamily, ServicePortName

__all__ = [
    "AFFINITY6_MAP_TYPE",
    "AFFINITY_FIND",
    "AFFINITY_FRONTEND_PREFIX",
    "AFFINITY_FULL",
    "AFFINITY_MAP_PREFIX",
    "AFFINITY_SHARDS",
    "AFFINITY_SHARD_PREFIX",
    "AFFINITY_TIMEOUT",
    "CHAIN_NAME_MAX",
    "MAX_AFFINITY_SECONDS",
    "TABLE",
    "TABLE_COMMENT",
    "ChainSpec",
    "ContainerSpec",
    "FamilyTokens",
    "FixedChain",
    "InvalidName",
    "InvalidPort",
    "Key",
    "Names",
    "RenderContext",
    "affinity_frontend6_pin",
    "affinity_frontend_shard",
    "affinity_map_name",
    "affinity_pin",
    "base_chains",
    "chain_name",
    "check_port_name",
    "context_or_default",
    "jhash",
    "port_identity",
    "tokens_for",
]

TABLE = "kube-proxy"
"""Our table's name, in family ``ip`` and ``ip6``."""
TABLE_COMMENT = "rules for kube-proxy"

AFFINITY_TIMEOUT = 3 * 3600
"""Default lifetime (seconds) of an ``affinity`` entry; each entry carries its own."""
AFFINITY6_MAP_TYPE = "ipv6_addr : ipv6_addr"
"""Type of the per-port IPv6 affinity maps (client address : endpoint address)."""
MAX_AFFINITY_SECONDS = 86400
"""Upper bound of ``sessionAffinityConfig.clientIP.timeoutSeconds`` (as the API)."""

Key = tuple[str, ...]
"""A set or map key, one string per concatenated field (``("10.0.0.1", "tcp", "80")``)."""

CHAIN_NAME_MAX = 240
"""Longest chain name we write (the kernel allows 255; upstream keeps 16 spare)."""

AFFINITY_MAP_PREFIX = "affinity-"
"""Prefix of the per-port affinity maps (:func:`affinity_map_name`)."""
AFFINITY_SHARD_PREFIX = "affinity-clients-"
"""Prefix of the shared affinity maps (:func:`affinity_pin`): ``affinity-clients-0`` to
``affinity-clients-255``."""
AFFINITY_SHARDS = 256
"""How many shared affinity maps a family has. The kernel walks a set's bindings (one per
rule that names it) for each new one, and walks the table's sets to find a set a rule
names: one map named by every port's two chains is quadratic in the ports, a map per port
quadratic in the maps; 256 keeps both walks short at 100k ports. Measured with ``nft -f``,
30k ports, a lookup and a record chain each: 1 map 8.9 s, 16 maps 9.6 s, 64 6.2 s, 256
5.3 s, against 2.5-3.2 s for the same chains naming no map (2026-11-29, shared machine)."""
AFFINITY_FRONTEND_PREFIX = "affinity-frontends-"
"""Prefix of the shared affinity maps keyed by the frontend itself
(:func:`affinity_frontend_shard`): ``affinity-frontends-0`` to ``affinity-frontends-255``,
IPv4 only (an IPv6 port keyed by its frontend keeps its entries in ``affinity-clients-<n>``,
:func:`affinity_frontend6_pin`)."""
AFFINITY_FIND = "affinity-find"
"""The chain that sends a new connection to its port's record chain (``goto``, by the
``affinity-record-*`` verdict maps): with the shared maps one that comes back to
``affinity-record`` could not be recorded."""
AFFINITY_FULL = "affinity-full"
"""The chain ``affinity-record`` jumps to when a record chain of the shared maps could
write no entry (its map is full): one counted rule, read for the metrics."""

_HASH_CHARS = 8
# Namespaces, Service names and port names are DNS labels / IANA service names after API
# validation; this is the last check before they become part of a kernel object name.
_NAME_PART = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_PORT_PART = re.compile(r"([A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?)?")
# What an interface name may be to stand in a rule literally (inside double quotes).
_INTERFACE = re.compile(r"[A-Za-z0-9_.@+-]{1,15}")


class Names:
    """Upstream's names of the fixed chains, sets and maps.

    The map structure writes the chains and ``cluster-ips``/``nodeport-ips``; the verdict
    maps (``service-ips`` and the like) are what upstream's and the per-Service-chain
    structure's tables hold, and what the map structure deletes from a table they left.
    """

    FILTER_PREROUTING_PRE_DNAT = "filter-prerouting-pre-dnat"
    FILTER_OUTPUT_PRE_DNAT = "filter-output-pre-dnat"
    FILTER_INPUT = "filter-input"
    FILTER_FORWARD = "filter-forward"
    FILTER_OUTPUT = "filter-output"
    NAT_PREROUTING = "nat-prerouting"
    NAT_OUTPUT = "nat-output"
    NAT_POSTROUTING = "nat-postrouting"

    SERVICES = "services"
    SERVICE_ENDPOINTS_CHECK = "service-endpoints-check"
    NODEPORT_ENDPOINTS_CHECK = "nodeport-endpoints-check"
    FIREWALL_CHECK = "firewall-check"
    CLUSTER_IPS_CHECK = "cluster-ips-check"
    REJECT_CHAIN = "reject-chain"
    MARK_FOR_MASQUERADE = "mark-for-masquerade"
    MASQUERADING = "masquerading"
    AFFINITY_LOOKUP = "affinity-lookup"

    CLUSTER_IPS = "cluster-ips"
    NODEPORT_IPS = "nodeport-ips"
    SERVICE_IPS = "service-ips"
    SERVICE_NODEPORTS = "service-nodeports"
    FIREWALL_IPS = "firewall-ips"
    NO_ENDPOINT_SERVICES = "no-endpoint-services"
    NO_ENDPOINT_NODEPORTS = "no-endpoint-nodeports"
    HAIRPIN_ENDPOINTS = "hairpin-endpoints"
    AFFINITY = "affinity"


@dataclass(frozen=True, slots=True)
class FamilyTokens:
    """The words that differ between the ``ip`` and ``ip6`` tables."""

    family: IPFamily
    table_family: str
    """``ip`` or ``ip6``: the table family and the match prefix (``ip daddr``)."""
    addr_type: str
    """``ipv4_addr`` or ``ipv6_addr``."""
    loopback: str
    """What NodePort matching must exclude: ``127.0.0.0/8`` or ``::1``."""

    def address(self, ip: IPAddress) -> str:
        """An address as written in a rule or element (canonical text form)."""
        return str(ip)


_TOKENS = {
    IPFamily.IPV4: FamilyTokens(IPFamily.IPV4, "ip", "ipv4_addr", "127.0.0.0/8"),
    IPFamily.IPV6: FamilyTokens(IPFamily.IPV6, "ip6", "ipv6_addr", "::1"),
}


def tokens_for(family: IPFamily) -> FamilyTokens:
    """The tokens of one family."""
    return _TOKENS[family]


@dataclass(frozen=True, slots=True)
class ContainerSpec:
    """A named set (``is_map`` false) or map of the table."""

    name: str
    is_map: bool
    type: str
    flags: tuple[str, ...] = ()
    timeout: int | None = None
    size: int | None = None
    comment: str | None = None
    typeof: bool = False
    """``type`` holds expressions, written ``typeof`` (see :class:`~.objects.Set`)."""


@dataclass(frozen=True, slots=True)
class FixedChain:
    """A chain that does not depend on Services (``hook`` set: a base chain)."""

    name: str
    rules: tuple[str, ...]
    type: str | None = None
    hook: str | None = None
    priority: int | None = None
    comment: str | None = None
    rule_comment: str | None = None
    """The comment of every rule (what a counter is read by)."""


@dataclass(frozen=True, slots=True)
class ChainSpec:
    """A per-Service-port chain: its content-hashed name and its rules, in order."""

    name: str
    rules: tuple[str, ...]


def base_chains(after_dnat: tuple[str, ...] = ()) -> tuple[FixedChain, ...]:
    """Upstream's base chains (names, hooks, priorities) and the jumps they hold.

    Both structures have exactly these (other components rely on them); ``after_dnat``
    rules are appended to the three filter chains that see packets after DNAT.
    """

    def new(target: str) -> str:
        return f"ct state new jump {target}"

    return (
        FixedChain(
            Names.FILTER_PREROUTING_PRE_DNAT,
            (new(Names.FIREWALL_CHECK),),
            "filter",
            "prerouting",
            -110,
        ),
        FixedChain(
            Names.FILTER_OUTPUT_PRE_DNAT, (new(Names.FIREWALL_CHECK),), "filter", "output", -110
        ),
        FixedChain(
            Names.FILTER_INPUT,
            (new(Names.NODEPORT_ENDPOINTS_CHECK), new(Names.SERVICE_ENDPOINTS_CHECK), *after_dnat),
            "filter",
            "input",
            0,
        ),
        FixedChain(
            Names.FILTER_FORWARD,
            (new(Names.SERVICE_ENDPOINTS_CHECK), new(Names.CLUSTER_IPS_CHECK), *after_dnat),
            "filter",
            "forward",
            0,
        ),
        FixedChain(
            Names.FILTER_OUTPUT,
            (new(Names.SERVICE_ENDPOINTS_CHECK), new(Names.CLUSTER_IPS_CHECK), *after_dnat),
            "filter",
            "output",
            0,
        ),
        FixedChain(Names.NAT_PREROUTING, (f"jump {Names.SERVICES}",), "nat", "prerouting", -100),
        FixedChain(Names.NAT_OUTPUT, (f"jump {Names.SERVICES}",), "nat", "output", -100),
        FixedChain(
            Names.NAT_POSTROUTING, (f"jump {Names.MASQUERADING}",), "nat", "postrouting", 100
        ),
    )


class InvalidPort(ValueError):
    """A Service port that cannot be rendered (bad name, port or address)."""


@dataclass(frozen=True, slots=True)
class RenderContext:
    """What rendering needs besides the port: family words, masquerading and detection.

    ``masquerade_match`` is the condition (after ``<ip> daddr <clusterIP>``) under which
    cluster-IP traffic is masqueraded (``""`` for masqueradeAll, ``None`` for never);
    ``local_match`` tells traffic from local pods (``None``: no detector).
    """

    tokens: FamilyTokens
    masquerade_match: str | None
    local_match: str | None
    node_addresses: tuple[IPAddress, ...] = ()
    shared_affinity: bool = True
    """ClientIP affinity in the shared maps (:func:`affinity_pin`), or (False, the
    benchmarks' structure before issue 32) in maps of each port's own."""
    frontend_affinity: bool = True
    """With the shared maps: an IPv4 port whose addresses all pick from one endpoint list
    (but a UDP port with a NodePort, see :mod:`.frontends`) keys its entries by its
    cluster-IP frontend (:func:`affinity_frontend_shard`), or (False, the benchmarks'
    structure before) by its pins like every other port."""
    frontend_affinity6: bool = True
    """With :attr:`frontend_affinity`: IPv6 ports too (their key two hashes of the
    cluster-IP frontend and one of the client, see :func:`affinity_frontend6_pin`), or
    (False, the benchmarks' structure before) IPv6 ports by their pins."""

    @classmethod
    def build(
        cls,
        tokens: FamilyTokens,
        detector: LocalDetector,
        *,
        masquerade_all: bool,
        node_addresses: Sequence[IPAddress] = (),
    ) -> RenderContext:
        """The context for a detector (already for this family) and the masquerade flag.

        Raises :class:`ValueError` for an interface name nft could not take literally.
        """
        local: str | None = None
        masq: str | None = None
        found = detector.local_traffic(tokens.family, _INTERFACE, "*")
        if found is not None:
            what = "iifname" if found.by_interface else f"{tokens.table_family} saddr"
            value = f'"{found.value}"' if found.by_interface else found.value
            local, masq = f"{what} {value}", f"{what} != {value}"
        if masquerade_all:
            masq = ""
        addresses = tuple(a for a in node_addresses if a.version == tokens.family.version)
        return cls(tokens, masq, local, addresses)


def context_or_default(
    tokens: FamilyTokens,
    detector: LocalDetector,
    *,
    masquerade_all: bool,
    node_addresses: Sequence[IPAddress],
    logger: logging.Logger,
) -> RenderContext:
    """:meth:`RenderContext.build`, or, for a detector nft cannot take, the context
    without a detector, with one error line on ``logger`` (the Services still work)."""
    try:
        return RenderContext.build(
            tokens, detector, masquerade_all=masquerade_all, node_addresses=node_addresses
        )
    except ValueError as err:
        logger.error("ignoring the local-traffic detector: %s", err)
        return RenderContext.build(
            tokens, type(detector)(), masquerade_all=masquerade_all, node_addresses=node_addresses
        )


class InvalidName(ValueError):
    """A Service port whose names cannot appear in a kernel object name."""


def port_identity(name: ServicePortName) -> str:
    """``<ns>/<svc>/<proto lower>/<port name>``: the readable part of the port's chain names.

    Raises :class:`InvalidName` when a part has characters nft would not accept in a name.
    """
    ns = name.service.namespace
    svc = name.service.name
    if _NAME_PART.fullmatch(ns) is None:
        raise InvalidName(f"namespace {ns!r} is not a valid name")
    if _NAME_PART.fullmatch(svc) is None:
        raise InvalidName(f"service name {svc!r} is not a valid name")
    if _PORT_PART.fullmatch(name.port) is None:
        raise InvalidName(f"port name {name.port!r} is not a valid name")
    return f"{ns}/{svc}/{name.protocol.lower}/{name.port}"


# The three parts of a port's identity in one pattern (no part holds a "/", so where each
# ends is certain): :func:`check_port_name` matches it once, not each part.
_IDENTITY = re.compile(
    rf"{_NAME_PART.pattern}/{_NAME_PART.pattern}/{_PORT_PART.pattern}".replace("(", "(?:")
)


def check_port_name(name: ServicePortName) -> None:
    """Raise :class:`InvalidName` as :func:`port_identity` does, for a port whose name it
    would refuse; nothing else.

    Why not :func:`port_identity` itself: every port of every full sync is checked
    (its name reaches logs and comments), and one match of the parts joined took 0.40
    against 1.03 us a port for three matches and the identity made (``timeit``,
    ``time.process_time``, best of 5, 100k names, 2026-11-29, the shared machine)."""
    service = name.service
    if _IDENTITY.fullmatch(f"{service.namespace}/{service.name}/{name.port}") is None:
        port_identity(name)  # raises, naming the part
        raise InvalidName(f"service port {name} is not a valid name")


def chain_name(prefix: str, identity: str, rules: Iterable[str], group: int | None = None) -> str:
    """The name of a per-Service-port chain with these ``rules``.

    ``identity`` comes from :func:`port_identity`; ``group`` numbers a group chain. The
    result is at most :data:`CHAIN_NAME_MAX` characters; truncation keeps the prefix and
    the hash (which covers the full identity), so truncated names stay unique.
    """
    suffix = identity if group is None else f"{identity}/{group}"
    # prefix NUL suffix, then each rule after a newline (one update: it runs per chain).
    text = "\n".join((f"{prefix}\0{suffix}", *rules))
    tag = _b32_tag(hashlib.sha256(text.encode()).digest())
    name = f"{prefix}-{tag}-{suffix}"
    if len(name) > CHAIN_NAME_MAX:
        name = name[: CHAIN_NAME_MAX - 3] + "..."
    return name


_B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"


def _b32_tag(digest: bytes) -> str:
    # The first _HASH_CHARS characters of base64.b32encode(digest) (5 bits each, from the
    # top); b32encode is pure Python and encodes the whole digest, noticeable at 10k chains.
    bits = int.from_bytes(digest[: (_HASH_CHARS * 5 + 7) // 8], "big")
    top = ((_HASH_CHARS * 5 + 7) // 8) * 8 - 5
    return "".join([_B32[(bits >> (top - 5 * i)) & 31] for i in range(_HASH_CHARS)])


def affinity_map_name(identity: str, prefix: str, port: int) -> str:
    """Name of a per-port affinity map: ``affinity-<16 hash chars>``.

    One map per port identity, endpoint list (``prefix``: which dispatch chain or list
    reads it) and endpoint port (0 where one map serves every port). The name is stable
    while those are, so the map (and its entries) survive endpoint changes.
    """
    digest = hashlib.sha256(f"{identity}\0{prefix}\0{port}".encode()).digest()
    return f"{AFFINITY_MAP_PREFIX}{base64.b32encode(digest)[:16].decode()}"


def _shard_number(identity: str) -> int:
    return int.from_bytes(hashlib.sha256(identity.encode()).digest()[:4], "big") % AFFINITY_SHARDS


def affinity_frontend_shard(identity: str) -> tuple[str, int]:
    """The shared map keyed by the frontend (``affinity-frontends-<n>``) that holds the
    ClientIP entries of a port answering on its cluster IP only, and ``n``: by ``identity``
    alone, the number :func:`affinity_pin` gives the port."""
    number = _shard_number(identity)
    return f"{AFFINITY_FRONTEND_PREFIX}{number}", number


def affinity_pin(identity: str, which: str, port: int) -> tuple[str, int, int]:
    """Where a port's ClientIP entries live in the shared maps: the map (``affinity-
    clients-<n>``, by ``identity`` alone, so every entry of a port is in one map) and the
    two 32-bit numbers that start each entry's key, for endpoint list ``which`` and
    endpoint port ``port`` (0 where the value holds the port).

    64 bits of the SHA-256 of the three: at 100k ports with two lists each, two ports
    share numbers with a chance of about 1 in 10^9 (their clients would then share
    entries). A number is never 0, which nft would not list as ``offset 0``."""
    digest = hashlib.sha256(f"{identity}\0{which}\0{port}".encode()).digest()
    high = int.from_bytes(digest[:4], "big") or 1
    low = int.from_bytes(digest[4:8], "big") or 1
    return f"{AFFINITY_SHARD_PREFIX}{_shard_number(identity)}", high, low


AFFINITY6_FRONTEND_SEEDS = (0x6B707831, 0x6B707832)
"""The seeds of the two 32-bit hashes of an IPv6 cluster-IP frontend that start the key
of its port's entries (:func:`affinity_frontend6_pin`)."""
_MASK = 0xFFFFFFFF


def _rol32(value: int, shift: int) -> int:
    return ((value << shift) | (value >> (32 - shift))) & _MASK


# __jhash_mix: each step (target, source, then added, rotation) on the words a, b, c:
# target = (target - source) ^ rol(source), then source += added.
_MIX = ((0, 2, 1, 4), (1, 0, 2, 6), (2, 1, 0, 8), (0, 2, 1, 16), (1, 0, 2, 19), (2, 1, 0, 4))


def _mix(words: list[int]) -> None:
    for target, source, added, shift in _MIX:
        words[target] = ((words[target] - words[source]) & _MASK) ^ _rol32(words[source], shift)
        words[source] = (words[source] + words[added]) & _MASK


# __jhash_final: each step (target, source, rotation) on the words a, b, c.
_FINAL = ((2, 1, 14), (0, 2, 11), (1, 0, 25), (2, 1, 16), (0, 2, 4), (1, 0, 14), (2, 1, 24))


def _final(words: list[int]) -> int:
    for target, source, shift in _FINAL:
        words[target] = ((words[target] ^ words[source]) - _rol32(words[source], shift)) & _MASK
    return words[2]


def jhash(data: bytes, seed: int) -> int:
    """The kernel's ``jhash()`` (``include/linux/jhash.h``) of ``data``: its 12-byte
    blocks read as words in this machine's byte order (``__get_unaligned_cpu32``), the
    tail byte by byte, little end first.

    By hand: no library computes it, and the backend must know the numbers an nft
    ``jhash`` writes into a key to find a port's entries (those of endpoints gone).
    ``tests/test_nft_affinity_exposed_kernel.py`` checks it against the numbers of
    entries real connections wrote."""
    words = [(0xDEADBEEF + len(data) + seed) & _MASK] * 3
    rest = data
    while len(rest) > 12:
        _add(words, rest, sys.byteorder)
        _mix(words)
        rest = rest[12:]
    if not rest:
        return words[2]
    _add(words, rest.ljust(12, b"\0"), "little")
    return _final(words)


def _add(words: list[int], block: bytes, order: Literal["little", "big"]) -> None:
    for i in range(3):
        words[i] = (words[i] + int.from_bytes(block[4 * i : 4 * i + 4], order)) & _MASK


def affinity_frontend6_pin(frontend: Key) -> tuple[str, str]:
    """The two numbers (as nft lists them) that start the key of the ClientIP entries of
    an IPv6 port keyed by its cluster-IP frontend (``address, protocol, port``): what
    ``jhash ip6 daddr . meta l4proto . th dport mod 4294967295 seed S`` writes for each
    of :data:`AFFINITY6_FRONTEND_SEEDS`. The hash reads the concatenation's registers:
    the address's 16 bytes, the protocol's byte and the port's two (network order), each
    padded with zeros to 4 bytes; ``mod 4294967295`` scales it (``reciprocal_scale``).
    64 bits: at 100k ports two share numbers with a chance of about 1 in 10^9."""
    address, protocol, port = frontend
    data = (
        ipaddress.IPv6Address(address).packed
        + bytes((PROTOCOL_NUMBERS[protocol], 0, 0, 0))
        + int(port).to_bytes(2, "big")
        + bytes(2)
    )
    first, second = AFFINITY6_FRONTEND_SEEDS
    return (
        str((jhash(data, first) * _MASK) >> 32),
        str((jhash(data, second) * _MASK) >> 32),
    )
