"""Can this node run nftables mode? Named feature probes, each with the kernel that has it.

Every kernel feature the rule structures use is a :class:`FeatureProbe`: a few lines of
nft (the rules, and the sets and maps they read) and the first kernel (and nft) known to
have it. A structure that starts using a new feature adds a probe to :data:`PROBES`;
nothing else changes.

Why probes are committed, not dry-run: the kernel checks where an expression may run
(``reject`` only in some hooks, say) when a transaction is *committed*; a dry run (``nft
-c``) aborts before that and accepts what the commit would refuse (measured on 6.18:
``reject`` in a postrouting chain passes ``nft -c`` and fails ``nft -f``; adding and
deleting the table in one transaction passes too). So each probe's rules sit in a
regular chain that a base chain of the probe's hook jumps to only for IP protocol 255
(reserved: no packet has it), in a throw-away table :data:`PROBE_TABLE` that is deleted
right after. :func:`check_support` commits all probes in one transaction (a few
milliseconds of start-up), and only when that fails each probe on its own, to name what is
missing, in one line::

    kernel 5.4.0-150 lacks interval concatenations (Linux 5.6+; used for
    loadBalancerSourceRanges); nftables mode needs Linux 5.10 or newer (first error: ...)

Upstream refuses nftables mode below Linux 5.13 by version number; we test the features
instead (distribution kernels backport features, or lack them). Which kernels were tested
and how each probe fared there is in docs/kernels-and-images.md ("Kernels tested").
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from string import Template
from typing import Final

from kubeproxy.backends.nftables.exec import (
    MIN_NFT_VERSION,
    NftExecutor,
    delete_table,
    parse_version,
)
from kubeproxy.backends.nftables.fake import parse_commands
from kubeproxy.backends.nftables.layout import (
    MAX_CLASS_BITS,
    firewall_allow_key,
    firewall_allow_rule,
)
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.featuregates import NFTABLES_NETLINK, NFTABLES_OWNED_TABLE, FeatureGates

__all__ = [
    "MIN_KERNEL",
    "OWNER_KERNEL",
    "PERSIST_KERNEL",
    "PROBES",
    "PROBE_TABLE",
    "TESTED_NFT",
    "FeatureProbe",
    "ProbeResult",
    "TableOwnership",
    "check_support",
    "nft_cautions",
    "probe_all",
    "probe_transaction",
    "table_ownership",
]

log = logging.getLogger(__name__)

TESTED_NFT: Final = ("1.0.6", "1.1.3", "1.1.7")
"""The nft (libnftables) versions every kernel test ran with: Debian 12's, Debian 13's
and Debian unstable's (``make test-userspace``; docs/kernels-and-images.md, "Userspaces tested")."""

PROBE_TABLE: Final = "kubeproxy-support-check"
"""The throw-away table the probes are committed to (and deleted from at once)."""
UNUSED_PROTOCOL: Final = 255
"""IP protocol number 255 is reserved: the jump into a probe's rules never matches."""


@dataclass(frozen=True, slots=True)
class FeatureProbe:
    """One kernel feature nftables mode needs, as a few lines of nft.

    ``rules`` go into a regular chain ``<key>-probe``, reached from a base chain of type
    ``hook[0]`` at hook ``hook[1]`` (a jump that never matches); ``objects`` are the
    sets, maps, elements and chains they use, written ``<noun> <name> ...`` as in ``add
    <noun> <family> <table> <name> ...``. Placeholders, filled per family: ``$ip`` (``ip``
    or ``ip6``), ``$addr_type``, ``$addr`` and ``$other`` (two addresses), ``$net`` (a
    network holding neither), ``$dnat_to`` (``$other`` with port 80). Names start with
    ``key`` (all probes also run as one transaction). ``kernel`` and ``nft`` are the
    first versions known to have the feature, ``evidence`` how that is known;
    ``used_for`` says what needs it. A probe that is not ``required`` is reported by the
    kernel matrix but refuses nothing (a feature a structure may come to use, or a shape
    it stopped using because some kernels refuse it).
    """

    key: str
    name: str
    kernel: str
    nft: str
    used_for: str
    hook: tuple[str, str]
    rules: tuple[str, ...]
    objects: tuple[str, ...] = ()
    families: frozenset[Family] = frozenset({Family.IP, Family.IP6})
    evidence: str = "kernel history"
    required: bool = True


_OLDEST_TESTED = "oldest kernel tested: Debian 11's 5.10"

TREE_DEPTH: Final = 6 + MAX_CLASS_BITS
"""How deep the class dispatch's paths go below a base chain (``services``, the tree, the
class, its pick and the affinity lookup, and one level per set bit of a class number)."""


def _tree_probe(depth: int) -> FeatureProbe:
    """Chains ``depth`` levels deep below the base chain, each level a set lookup and a
    goto, as the class dispatch's decision tree builds them."""
    levels = range(1, depth)
    return FeatureProbe(
        "tree",
        f"paths of {depth} chains (set lookups and gotos)",
        "3.13",
        "0.9.0",
        "the class dispatch's decision tree (the kernel refuses 16 levels)",
        ("nat", "prerouting"),
        ("$ip daddr @tree-set goto tree-1",),
        (
            "set tree-set { type $addr_type ; }",
            *(f"chain tree-{n}" for n in levels),
            *(f"rule tree-{n} $ip daddr @tree-set goto tree-{n + 1}" for n in levels[:-1]),
        ),
    )


PROBES: Final[tuple[FeatureProbe, ...]] = (
    FeatureProbe(
        "comment",
        "table comments",
        "5.10",
        "0.9.7",
        "the table's comment (NFTA_TABLE_USERDATA), as upstream's table has",
        ("filter", "input"),
        ("accept",),
    ),
    FeatureProbe(
        "vmap",
        "concatenated verdict maps",
        "4.1",
        "0.9.0",
        "dispatching on address . protocol . port",
        ("nat", "prerouting"),
        ("$ip daddr . meta l4proto . th dport vmap @vmap-map",),
        (
            "chain vmap-target",
            "map vmap-map { type $addr_type . inet_proto . inet_service : verdict ; }",
            'element vmap-map { $addr . tcp . 80 comment "a/b:c" : goto vmap-target }',
        ),
    ),
    FeatureProbe(
        "fib",
        "fib address type",
        "4.10",
        "0.9.0",
        "NodePorts on every local address; LoadBalancer traffic from the node itself",
        ("nat", "prerouting"),
        ("fib daddr type local goto fib-target", "fib saddr type local goto fib-target"),
        ("chain fib-target",),
    ),
    FeatureProbe(
        "slots",
        "DNAT to address . port from a typeof map keyed by numgen",
        "5.10",
        "1.0.1",
        "choosing an endpoint slot (numgen random) of a Service",
        ("nat", "prerouting"),
        ("dnat to $ip daddr . meta l4proto . th dport . numgen random mod 2 map @slots-map",),
        (
            "map slots-map { typeof $ip daddr . meta l4proto . th dport . numgen random mod 1"
            " : $ip daddr . tcp dport ; }",
        ),
        evidence=_OLDEST_TESTED,
    ),
    FeatureProbe(
        "record",
        "ct original in a concatenated verdict-map key",
        "5.10",
        "1.0.1",
        "finding, after DNAT, the affinity record chain of a connection's Service port",
        ("filter", "forward"),
        (
            "meta l4proto { tcp, udp, sctp } ct original $ip daddr . meta l4proto"
            " . ct original proto-dst vmap @record-map",
        ),
        (
            "chain record-target",
            "map record-map { type $addr_type . inet_proto . inet_service : verdict ; }",
            "element record-map { $addr . tcp . 80 : goto record-target }",
        ),
        evidence=_OLDEST_TESTED,
    ),
    FeatureProbe(
        "lookup4",
        "DNAT to address . port from a map the packet path fills",
        "5.10",
        "1.0.1",
        "ClientIP session affinity: the recorded endpoint of a client",
        ("nat", "prerouting"),
        ("meta l4proto tcp dnat to ip saddr map @lookup4-map",),
        (
            "map lookup4-map { type ipv4_addr : ipv4_addr . inet_service ;"
            " flags dynamic,timeout ; timeout 10800s ; }",
        ),
        frozenset({Family.IP}),
        evidence=_OLDEST_TESTED,
    ),
    FeatureProbe(
        "lookup6",
        "DNAT to an address from a map the packet path fills",
        "5.10",
        "1.0.1",
        "ClientIP session affinity: the recorded endpoint of a client",
        ("nat", "prerouting"),
        ("meta l4proto tcp dnat to ip6 saddr map @lookup6-map : 80",),
        (
            "map lookup6-map { type ipv6_addr : ipv6_addr ;"
            " flags dynamic,timeout ; timeout 10800s ; }",
        ),
        frozenset({Family.IP6}),
        evidence=_OLDEST_TESTED,
    ),
    FeatureProbe(
        "update4",
        "map updates with a timeout from the packet path",
        "5.10",
        "1.0.1",
        "ClientIP session affinity: recording a new connection's endpoint",
        ("filter", "forward"),
        ("update @update4-map { ip saddr timeout 10s : ip daddr . th dport }",),
        (
            "map update4-map { type ipv4_addr : ipv4_addr . inet_service ;"
            " flags dynamic,timeout ; timeout 10800s ; }",
        ),
        frozenset({Family.IP}),
        evidence=_OLDEST_TESTED,
    ),
    FeatureProbe(
        "frontlookup",
        "DNAT to address . port from a map keyed by destination, protocol and client",
        "5.10",
        "1.0.6",
        "ClientIP session affinity of a port answering on its cluster IP only: the"
        " recorded endpoint of a client",
        ("nat", "prerouting"),
        (
            "meta l4proto tcp dnat to ip daddr . meta l4proto . th dport . ip saddr"
            " map @frontlookup-map",
        ),
        (
            "map frontlookup-map { typeof ip daddr . meta l4proto . th dport . ip saddr"
            " : ip daddr . th dport ; flags dynamic,timeout ; timeout 10800s ; }",
        ),
        frozenset({Family.IP}),
        evidence="tested on Debian 12's 6.1 and 6.12 and on 6.18",
    ),
    FeatureProbe(
        "frontupdate",
        "map updates keyed by the original destination, protocol and client",
        "5.10",
        "1.0.6",
        "ClientIP session affinity of a port answering on its cluster IP only: recording"
        " a new connection's endpoint",
        ("filter", "forward"),
        (
            "meta l4proto { tcp, udp, sctp } update @frontupdate-map { ct original ip daddr"
            " . meta l4proto . ct original proto-dst . ip saddr timeout 10s"
            " : ip daddr . th dport }",
        ),
        (
            "map frontupdate-map { typeof ip daddr . meta l4proto . th dport . ip saddr"
            " : ip daddr . th dport ; flags dynamic,timeout ; timeout 10800s ; }",
        ),
        frozenset({Family.IP}),
        evidence="tested on Debian 12's 6.1 and 6.12 and on 6.18",
    ),
    FeatureProbe(
        "frontcanonical",
        "address and port writes from a map lookup, before DNAT",
        "5.10",
        "1.0.6",
        "ClientIP session affinity of a port's other addresses: a load-balancer or external"
        " IP, or a NodePort, turned into the port's cluster IP (and Service port)",
        ("nat", "prerouting"),
        (
            "tcp dport set meta l4proto . th dport map @frontcanonical-ports ip daddr set"
            " meta l4proto . ct original proto-dst map @frontcanonical-ips",
            "ip daddr set ct original ip daddr tcp dport set ct original proto-dst",
        ),
        (
            "map frontcanonical-ports { typeof meta l4proto . th dport : th dport ; }",
            "map frontcanonical-ips { typeof meta l4proto . th dport : ip daddr ; }",
        ),
        frozenset({Family.IP}),
        evidence="tested on 6.18; the same statements on Debian 12's 6.1 and 6.12"
        " (tests/test_affinity_canonical_kernel.py)",
    ),
    FeatureProbe(
        "frontreply",
        "map updates valued from the connection's reply direction, then an address write",
        "5.10",
        "1.0.6",
        "ClientIP session affinity of a port's other addresses: recording a new"
        " connection's endpoint under the cluster IP's entry",
        ("filter", "forward"),
        (
            "meta l4proto { tcp, udp, sctp } update @frontreply-map { ip daddr . meta l4proto"
            " . ct original proto-dst . ip saddr timeout 10s : ct reply ip saddr . ct reply"
            " proto-src } ip daddr set ct reply ip saddr accept",
        ),
        (
            "map frontreply-map { typeof ip daddr . meta l4proto . th dport . ip saddr"
            " : ip daddr . th dport ; flags dynamic,timeout ; timeout 10800s ; }",
        ),
        frozenset({Family.IP}),
        evidence="tested on 6.18; the same statements on Debian 12's 6.1 and 6.12"
        " (tests/test_affinity_canonical_kernel.py)",
    ),
    FeatureProbe(
        "frontcanonical6",
        "IPv6 address writes from a map lookup, before DNAT",
        "4.17",
        "1.0.6",
        "ClientIP session affinity of an IPv6 port's other addresses: a load-balancer or"
        " external IP, or a NodePort, turned into the port's cluster IP",
        ("nat", "prerouting"),
        (
            "ip6 daddr set ip6 daddr . meta l4proto . th dport map @frontcanonical6-ips",
            "ip6 daddr set ct original ip6 daddr",
        ),
        ("map frontcanonical6-ips { typeof ip6 daddr . meta l4proto . th dport : ip6 daddr ; }",),
        frozenset({Family.IP6}),
        evidence="kernel history (conntrack IPv6 address keys: 4.17); tested on 6.18 and"
        " Debian 12's 6.1 (tests/test_nft_affinity_exposed_kernel.py)",
    ),
    FeatureProbe(
        "frontkey6",
        "map updates keyed by hashes of a concatenation, valued from the reply direction",
        "4.17",
        "1.0.6",
        "ClientIP session affinity of IPv6 ports keyed by their cluster-IP frontend: two"
        " hashes of it and one of the client",
        ("filter", "forward"),
        (
            "meta l4proto { tcp, udp, sctp } update @frontkey6-map { jhash ip6 daddr . meta"
            " l4proto . ct original proto-dst mod 4294967295 seed 0x1 . jhash ct original ip6"
            " daddr . meta l4proto . ct original proto-dst mod 4294967295 seed 0x2 . jhash ip6"
            " saddr mod 4294967295 seed 0x0 timeout 10s : ct reply ip6 saddr } ip6 daddr set"
            " ct reply ip6 saddr accept",
        ),
        (
            "map frontkey6-map { typeof numgen random mod 1 . numgen random mod 1 . numgen"
            " random mod 1 : ip6 daddr ; flags dynamic,timeout ; timeout 10800s ; }",
        ),
        frozenset({Family.IP6}),
        evidence="kernel history (conntrack IPv6 address keys: 4.17); tested on 6.18 and"
        " Debian 12's 6.1 (tests/test_nft_affinity_exposed_kernel.py)",
    ),
    FeatureProbe(
        "update6",
        "map updates with a timeout from the packet path",
        "5.10",
        "1.0.1",
        "ClientIP session affinity: recording a new connection's endpoint",
        ("filter", "forward"),
        ("th dport 80 update @update6-map { ip6 saddr timeout 10s : ip6 daddr }",),
        (
            "map update6-map { type ipv6_addr : ipv6_addr ;"
            " flags dynamic,timeout ; timeout 10800s ; }",
        ),
        frozenset({Family.IP6}),
        evidence=_OLDEST_TESTED,
    ),
    _tree_probe(TREE_DEPTH),
    FeatureProbe(
        "interval",
        "interval concatenations",
        "5.6",
        "0.9.4",
        "loadBalancerSourceRanges (per protocol: address . port . source range)",
        ("filter", "prerouting"),
        (firewall_allow_rule("$ip", "tcp", "interval-set"),),
        (
            f"set interval-set {{ typeof {firewall_allow_key('$ip')} ; flags interval ; }}",
            "element interval-set { $addr . 80 . $net, $addr . 80 . $other }",
        ),
    ),
    FeatureProbe(
        "byteorder",
        "a one-byte host-order field in an interval concatenation",
        "5.6",
        "0.9.4",
        "nothing (loadBalancerSourceRanges' key before 6.12's byteorder check:"
        " address . meta l4proto . port . source range)",
        ("filter", "prerouting"),
        ("$ip daddr . meta l4proto . th dport . $ip saddr @byteorder-set return",),
        (
            "set byteorder-set { typeof $ip daddr . meta l4proto . th dport . $ip saddr ;"
            " flags interval ; }",
        ),
        evidence=(
            "nft before 1.1.0 converts meta l4proto with hton(len 1, size 2); kernels with"
            ' "netfilter: nft_byteorder: remove multi-register support" refuse it'
            " (Debian's 6.12.117)"
        ),
        required=False,
    ),
    FeatureProbe(
        "reject",
        "reject in the input, forward and output hooks",
        "3.18",
        "0.9.0",
        "refusing connections to Services without endpoints",
        ("filter", "forward"),
        ("$ip daddr $addr reject",),
    ),
    FeatureProbe(
        "prereject",
        "reject in prerouting",
        "5.9",
        "0.9.0",
        "nothing yet (a structure refusing before DNAT would)",
        ("filter", "prerouting"),
        ("$ip daddr $addr reject",),
        required=False,
    ),
    FeatureProbe(
        "dnat",
        "DNAT",
        "3.18",
        "0.9.0",
        "every Service",
        ("nat", "prerouting"),
        ("meta l4proto tcp dnat to $dnat_to",),
    ),
    FeatureProbe(
        "masq",
        "fully-random masquerade",
        "3.18",
        "0.9.0",
        "masquerading",
        ("nat", "postrouting"),
        ("masquerade fully-random",),
    ),
)
"""The features the map structure (and the previous chain structure) use."""

_PRIORITIES: Final = {"filter": 0, "nat": 100}


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


MIN_KERNEL: Final = max((p.kernel for p in PROBES if p.required), key=_release)
"""The first kernel with every required probe's feature (the table comment's: 5.10)."""


def _tokens(family: Family) -> dict[str, str]:
    if family is Family.IP6:
        return {
            "ip": "ip6",
            "addr_type": "ipv6_addr",
            "addr": "fd00::1",
            "other": "fd00::2",
            "net": "fd00:1::/64",
            "dnat_to": "[fd00::2]:80",
        }
    return {
        "ip": "ip",
        "addr_type": "ipv4_addr",
        "addr": "10.0.0.1",
        "other": "10.0.0.2",
        "net": "10.1.0.0/16",
        "dnat_to": "10.0.0.2:80",
    }


def _probe_lines(probe: FeatureProbe) -> list[str]:
    kind, hook = probe.hook
    base, chain = f"{probe.key}-hook", f"{probe.key}-probe"
    return [
        f"chain {base} {{ type {kind} hook {hook} priority {_PRIORITIES[kind]} ; }}",
        f"chain {chain}",
        *probe.objects,
        f"rule {base} meta l4proto {UNUSED_PROTOCOL} jump {chain}",
        *(f"rule {chain} {rule}" for rule in probe.rules),
    ]


def probe_transaction(probes: Sequence[FeatureProbe], family: Family) -> Transaction:
    """One transaction creating :data:`PROBE_TABLE` with ``probes`` (those for ``family``)."""
    tokens = _tokens(family)
    lines = [f'add table {family} {PROBE_TABLE} {{ comment "kubeproxy support check" ; }}']
    for probe in probes:
        if family not in probe.families:
            continue
        for line in _probe_lines(probe):
            noun, _, rest = Template(line).substitute(tokens).partition(" ")
            lines.append(f"add {noun} {family} {PROBE_TABLE} {rest}")
    tx = Transaction(family, PROBE_TABLE)
    for _family, _table, _verb, obj in parse_commands("\n".join(lines)):
        tx.add(obj)
    return tx


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """How one probe fared: ``error`` is nft's message when the kernel refused it."""

    probe: FeatureProbe
    family: Family
    error: str | None

    @property
    def ok(self) -> bool:
        """Whether the kernel accepted the probe."""
        return self.error is None


def _try(executor: NftExecutor, probes: Sequence[FeatureProbe], family: Family) -> str | None:
    """Commit the probes, then delete them; None, or nft's error (nothing was created)."""
    tx = probe_transaction(probes, family)
    try:
        executor.run(tx)
    except NftError as err:
        return " ".join(str(err).split())
    finally:
        delete_table(executor, family, PROBE_TABLE)
    return None


def probe_all(
    executor: NftExecutor, family: Family, probes: Sequence[FeatureProbe] = PROBES
) -> list[ProbeResult]:
    """Every probe for ``family`` (of :data:`PROBES` unless given), each on its own."""
    return [
        ProbeResult(probe, family, _try(executor, [probe], family))
        for probe in probes
        if family in probe.families
    ]


def _kernel_release() -> str:
    try:
        with open("/proc/sys/kernel/osrelease") as release:
            return release.read().strip()
    except OSError:
        return "(unknown)"


def nft_cautions(version: str) -> list[str]:
    """What is known to go wrong with nft (libnftables) ``version`` on a node: notes, not
    refusals (the proxy runs; the line says why it may stop).

    nft 1.1.2 records a set's key in its user data in a form nft before 1.1.2 cannot
    parse, and those versions crash (SIGSEGV) on any command that loads the namespace's
    sets: listing, adding elements, adding rules that name a set (the fix, nftables
    be737a19, is in 1.1.4 and in the stable release 1.0.6.1; kubernetes/kubernetes#136786).
    Measured with ``make test-userspace``: Debian 12's nft 1.0.6, and this proxy using it,
    crashed on tables Debian 13's 1.1.3 or unstable's 1.1.7 wrote. This proxy declares its
    own sets so that every nft reads them (:func:`~.objects.readable_by_every_nft`); other
    programs on the node may not.
    """
    parsed = parse_version(version)
    if parsed < (1, 1, 2) and not (1, 0, 6, 1) <= parsed < (1, 0, 7):
        return [
            f"nftables {version} crashes (SIGSEGV) loading sets that nft 1.1.2 or newer"
            " wrote (fixed in 1.0.6.1 and 1.1.4; kubernetes/kubernetes#136786): if this"
            " proxy dies by a signal, another program on this node writes sets with a newer"
            " nft; run the proxy with an nft that has the fix"
        ]
    return []


def check_support(
    executor: NftExecutor,
    family: Family = Family.IP,
    *,
    probes: Sequence[FeatureProbe] = PROBES,
) -> None:
    """Raise :class:`NftError` in one line unless nftables mode can run here.

    Needs nft (libnftables) >= 1.0.1 and a kernel that accepts every required probe.
    The message names the kernel, each missing feature with the first kernel that has
    it, and the kernel that has them all. Leaves nothing behind. Logs the version's
    :func:`nft_cautions` (information) first, before any command that could crash on them.
    """
    version = executor.version()
    if parse_version(version) < MIN_NFT_VERSION:
        wanted = ".".join(map(str, MIN_NFT_VERSION))
        raise NftError(f"nftables {version} is too old: nftables mode needs {wanted} or newer")
    for caution in nft_cautions(version):
        # Information, not a warning: every Debian 12 node has this nft, and it only
        # matters on the day the proxy dies of it (then this is the line that says why).
        log.info("%s: %s", family, caution)
    family = Family(family)
    required = [p for p in probes if p.required]
    together = _try(executor, required, family)
    if together is None:
        return
    missing = [r for r in probe_all(executor, family, required) if not r.ok]
    if not missing:  # each passes alone but not all together: nft's words, unexplained
        raise NftError(f"the nftables support check failed: {together}", errno.EOPNOTSUPP)
    lacks = "; ".join(
        f"{r.probe.name} (Linux {r.probe.kernel}+; used for {r.probe.used_for})" for r in missing
    )
    needed = max([MIN_KERNEL, *(r.probe.kernel for r in missing)], key=_release)
    raise NftError(
        f"kernel {_kernel_release()} lacks {lacks}; nftables mode needs Linux {needed} or newer"
        f" (first error: {missing[0].error})",
        errno.EOPNOTSUPP,
    )


# The owned table ---------------------------------------------------------------------------

OWNER_KERNEL: Final = "5.12"
"""The first kernel with the ``owner`` table flag (``NFT_TABLE_F_OWNER``)."""
PERSIST_KERNEL: Final = "6.9"
"""The first kernel with the ``persist`` table flag (``NFT_TABLE_F_PERSIST``)."""


@dataclass(frozen=True, slots=True)
class TableOwnership:
    """Whether nftables mode owns its table here (:mod:`.owner`), and why (or why not)."""

    owned: bool
    reason: str

    def describe(self, family: Family, table: str) -> str:
        """One line for the log: ``table ip kube-proxy is owned by this proxy: ...``."""
        verdict = "is owned by this proxy" if self.owned else "is not owned"
        return f"table {family} {table} {verdict}: {self.reason}"


def table_ownership(gates: FeatureGates, probe: Callable[[], tuple[bool, bool]]) -> TableOwnership:
    """Whether to own the table: the ``NFTablesOwnedTable`` and ``NFTablesNetlink`` gates,
    then what ``probe`` says the kernel takes (``owner``, ``persist``; see
    :func:`~.owner.probe_table_flags`).

    Owner without persist (Linux 5.12 to 6.8, Debian 12's 6.1) is not owned: the table
    would go with its owner's socket at every restart, upgrade or crash of the proxy, and
    nothing would be served until the next proxy's first sync (seconds at 10k Services),
    where an unowned table keeps serving through a restart and only another process's
    flush takes it down (repaired by self-healing). Measured on 6.18: a table created
    with ``owner`` alone is gone as soon as its socket closes.
    """
    if not gates.enabled(NFTABLES_OWNED_TABLE):
        return TableOwnership(False, f"the {NFTABLES_OWNED_TABLE} feature gate is off")
    if not gates.enabled(NFTABLES_NETLINK):
        return TableOwnership(
            False,
            f"{NFTABLES_NETLINK} is off: every write goes through libnftables, which writes"
            " on a socket of its own and so cannot keep a table owned",
        )
    release = _kernel_release()
    try:
        owner, persist = probe()
    except NftError as err:
        return TableOwnership(False, f"the table flags could not be probed ({err})")
    if not owner:
        return TableOwnership(
            False, f"kernel {release} lacks the owner table flag (Linux {OWNER_KERNEL}+)"
        )
    if not persist:
        return TableOwnership(
            False,
            f"kernel {release} has the owner table flag but lacks persist (Linux"
            f" {PERSIST_KERNEL}+), and an owned table without it is deleted with its owner"
            " at every restart of the proxy; self-healing repairs what others change",
        )
    return TableOwnership(
        True,
        f"kernel {release} has the owner and persist table flags (Linux {OWNER_KERNEL}+,"
        f" {PERSIST_KERNEL}+): no other process can change, flush or delete it, and a"
        " restarted proxy adopts it",
    )
