"""Every endpoint count as data (issue 32 item 4): a feasibility study, measured.

The shipped nftables structure picks an endpoint with ``numgen random mod N``, N a
constant in a rule, so a Service whose count no frontend had needs new chains (a class
and a pick chain, a tree chain) and the kernel validates the table for them. This module
writes tables of the realistic mix's shape (:func:`bench.synthetic.realistic_services`)
into fresh namespaces, in several structures side by side (the skeleton as ``nft`` text
through libnftables, the elements through the backend's netlink element writer, as the
owned table writes them), and times the same changes against each, the structures'
order alternating every round; then real TCP connects through the deepest count:

``shipped``
    the structure of ``kubeproxy/backends/nftables`` (the nftables README, "Structure"),
    approximated: one class chain per (kind, shape, count), one pick chain per (kind,
    count) whose three rules (tcp, udp, sctp) read the slot map of the count's bucket (its
    bit length), the class tree of ``class-bit-*`` sets (numbers by popularity, fewest
    bits first, never more than 8 set). A never-seen count adds its chains and rewrites its
    tree parent.
``data``
    the README's sketch: the class is its shape only (3 shape chains); each pick family
    (kind, protocol) is 32 chains, one per ``count-hi`` value ((N - 1) >> 5), reached by a
    5-bit tree of ``count-hi-<kind>-<j>`` sets, each holding 32 rules ``KEY @count-lo-<kind>-<v>
    dnat ... numgen random mod N map @<bucket map>``. Every count 1..1024 exists from the
    start: a new count is elements only.
``data-maps``
    ``data`` with one slot map per count instead of per bucket, so no map is read by
    more than one rule (the bucket map of 512-1023 is read by 512 rules in ``data``).
``data-leafmaps``
    ``data`` with one slot map per count-hi chain (its 32 counts): each map read by 32
    rules, 192 maps in all.
``data-tree``
    a tree over the count itself: count N has number ``numbers[N - 1]`` (12 bits, at
    most 5 set, small counts first) and one chain with its bit tests and one pick rule;
    ``count-bit-<kind>-<j>`` sets carry a frontend's number. 1024 chains per family.

Approximations (the study is about the pick, not every shape): every Service is in the
``ip`` family (100k frontends' Service IPs, not 90k); Local traffic policies are served
as Cluster (no shortcut families: the sketch adds two pick families per kind for them);
no affinity; TCP only in the data (the udp and sctp maps and rules exist, empty).

Run as root (the namespaces are created and always deleted); ``bench/README.md``
("Every count as data") has the figures and what they say::

    python -m bench.count_structure --services 100000 --rounds 60      # changes, connects
    python -m bench.count_structure --services 100000 --writes 2       # full writes only
    python -m bench.count_structure --structure shipped --structure data-leafmaps ...
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

from bench.netns import in_netns, ip, namespace
from bench.synthetic import endpoint_ips, realistic_services, service_ip
from kubeproxy.backends.nftables.elements import ElementBatch
from kubeproxy.backends.nftables.exec import LibNftables
from kubeproxy.backends.nftables.objects import Family, NftError

TABLE = "kube-proxy"
PROTOCOLS = ("tcp", "udp", "sctp")
KINDS = ("ips", "nodeports")
MAX_COUNT = 1024
"""Counts precreated by the data structures (the mix's largest is 1000)."""
POD_CIDR = "10.128.0.0/9"
TARGET_PORT = 8080
_CHUNK = 20_000
"""Elements per ``nft`` run of the full write (the backend's element batches are
bounded too; one 1.5M-element run takes nft 1.0.6 gigabytes)."""
_KEY = {"ips": "ip daddr . meta l4proto . th dport", "nodeports": "meta l4proto . th dport"}
_KEY_TYPE = {
    "ips": "ipv4_addr . inet_proto . inet_service",
    "nodeports": "inet_proto . inet_service",
}
_SHAPE_BITS = {("ips", "internal"): 0, ("ips", "external"): 1, ("nodeports", "external"): 0}
STRUCTURES = ("shipped", "data", "data-maps", "data-leafmaps", "data-tree")


@dataclass(frozen=True, slots=True)
class Frontend:
    """One frontend: its kind, its key as nft writes it, its shape and endpoints."""

    kind: str
    key: str
    shape: str
    count: int
    endpoints: tuple[str, ...]


def frontends(services: int) -> list[Frontend]:
    """The IPv4 frontends of ``services`` Services of the realistic mix (see the module
    documentation for what is approximated)."""
    out: list[Frontend] = []
    for svc in realistic_services(services):
        eps = tuple(f"{a} . {TARGET_PORT}" for a in endpoint_ips(svc.index, svc.endpoint_count))
        out.append(
            Frontend("ips", f"{service_ip(svc.index)} . tcp . 80", "internal", len(eps), eps)
        )
        for lb in svc.load_balancer_ips:
            if ":" not in lb:
                out.append(Frontend("ips", f"{lb} . tcp . 80", "external", len(eps), eps))
        if svc.external_ip:
            ext = ipaddress.IPv4Address("100.64.0.1") + svc.index
            out.append(Frontend("ips", f"{ext} . tcp . 80", "external", len(eps), eps))
        if svc.node_port:
            out.append(Frontend("nodeports", f"tcp . {svc.node_port}", "external", len(eps), eps))
    return out


def bucket(count: int) -> int:
    """The shipped slot map of a count: its bit length (1, 2-3, 4-7, ...)."""
    return count.bit_length()


def small_numbers(width: int, most_bits: int) -> list[int]:
    """Numbers below ``2**width`` with at most ``most_bits`` bits set, fewest bits first:
    what the class tree hands out by popularity (each set bit is one goto deeper)."""
    pool = [n for n in range(1 << width) if n.bit_count() <= most_bits]
    return sorted(pool, key=lambda n: (n.bit_count(), n))


def tree_rules(
    number: int,
    width: int,
    present: set[int],
    test: str,
    goto: str,
) -> list[str]:
    """The bit tests of tree chain ``number``: the bits below its lowest set bit (all
    ``width`` for 0), highest first, each to the subtree one more bit set, if used
    (``test`` + bit is the match, ``goto`` + number the subtree's chain)."""
    low = (number & -number).bit_length() - 1 if number else width
    return [
        f"{test}{j} goto {goto}{number | 1 << j}"
        for j in range(low - 1, -1, -1)
        if number | 1 << j in present
    ]


def tree_chains(numbers: set[int]) -> set[int]:
    """Every tree chain the numbers need: each number and its prefixes (lowest set bit
    cleared in turn)."""
    out = {0}
    for n in numbers:
        while n:
            out.add(n)
            n &= n - 1
    return out


def depth_of(number: int) -> int:
    """Gotos from a tree's root to ``number``'s chain."""
    return number.bit_count()


@dataclass(frozen=True, slots=True)
class Change:
    """One change: nft text for chains and rules (empty when none), then one element
    transaction (``deletes`` applied before ``elements``)."""

    chains: str
    elements: dict[str, list[str]]
    deletes: dict[str, list[str]] = field(default_factory=dict)


def element_diff(
    old: dict[str, list[str]], new: dict[str, list[str]]
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The additions and deletions that turn ``old`` elements into ``new`` ones."""
    adds: dict[str, list[str]] = {}
    deletes: dict[str, list[str]] = {}
    for container in old.keys() | new.keys():
        before, after = set(old.get(container, ())), set(new.get(container, ()))
        if after - before:
            adds[container] = sorted(after - before)
        if before - after:
            deletes[container] = sorted(e.partition(" : ")[0] for e in before - after)
    return adds, deletes


@dataclass
class Table:
    """A structure's text: the skeleton (chains, sets, rules), then its elements."""

    name: str
    skeleton: list[str] = field(default_factory=list)
    elements: dict[str, list[str]] = field(default_factory=dict)
    max_depth: int = 0
    chains: int = 0
    rules: int = 0

    def add(self, container: str, element: str) -> None:
        self.elements.setdefault(container, []).append(element)

    def chain(self, name: str, rules: Sequence[str]) -> None:
        self.chains += 1
        self.rules += len(rules)
        body = "".join(f"\t\t{r}\n" for r in rules)
        self.skeleton.append(f"\tchain {name} {{\n{body}\t}}\n")

    def set(self, name: str, kind: str) -> None:
        self.skeleton.append(f"\tset {name} {{ type {_KEY_TYPE[kind]}; }}\n")

    def slot_map(self, name: str, kind: str, proto: str) -> None:
        self.skeleton.append(
            f"\tmap {name} {{ typeof {_KEY[kind]} . numgen random mod 1 : "
            f"ip daddr . {proto} dport; }}\n"
        )

    def text(self) -> str:
        return f"table ip {TABLE} {{\n{''.join(self.skeleton)}}}\n"


def _common(t: Table) -> None:
    t.skeleton.append(
        "\tset nodeport-ips { type ipv4_addr; elements = { 10.99.1.1 } }\n"
        "\tchain nat-prerouting { type nat hook prerouting priority dstnat; policy accept; "
        "jump services; }\n"
        "\tchain nat-output { type nat hook output priority -100; policy accept; jump services; }\n"
        "\tchain mark-for-masquerade { meta mark set meta mark | 0x00004000; }\n"
    )
    t.chain(
        "services",
        [
            f"{_KEY['ips']} @dispatch-ips goto dispatch-ips-0",
            f"ip daddr @nodeport-ips {_KEY['nodeports']} @dispatch-nodeports "
            "goto dispatch-nodeports-0",
        ],
    )
    for kind in KINDS:
        t.set(f"dispatch-{kind}", kind)
    # base -> services -> dispatch-0: the levels before the tree's bits.
    t.max_depth = 2


def _shape_rules(kind: str, shape: str) -> list[str]:
    if shape == "internal":
        return [f"ip saddr != {POD_CIDR} jump mark-for-masquerade"]
    return ["jump mark-for-masquerade"]


def _slot_elements(t: Table, mapname: Callable[[Frontend, str], str], f: Frontend) -> None:
    name = mapname(f, "tcp")
    for slot, ep in enumerate(f.endpoints):
        t.add(name, f"{f.key} . {slot} : {ep}")


@dataclass
class Shipped:
    """The shipped class structure (approximated: see the module documentation)."""

    fronts: list[Frontend]
    numbers: dict[tuple[str, str, int], int] = field(default_factory=dict)
    free: dict[str, list[int]] = field(default_factory=dict)
    picks: set[tuple[str, int]] = field(default_factory=set)
    width: int = 12

    name = "shipped"

    def __post_init__(self) -> None:
        popular = Counter((f.kind, f.shape, f.count) for f in self.fronts)
        for kind in KINDS:
            self.free[kind] = small_numbers(self.width, 8)
            for cls, _ in popular.most_common():
                if cls[0] == kind:
                    self.numbers[cls] = self.free[kind].pop(0)

    def class_chain(self, cls: tuple[str, str, int]) -> str:
        kind, shape, count = cls
        return f"{'nodeport' if kind == 'nodeports' else shape}-{count}"

    def pick_chain(self, kind: str, count: int) -> str:
        return f"pick-{'nodeport-' if kind == 'nodeports' else ''}{count}"

    def slot_map(self, f: Frontend, proto: str) -> str:
        return f"{'nodeport-' if f.kind == 'nodeports' else ''}endpoints-{proto}-b{bucket(f.count)}"

    def _class_rules(self, cls: tuple[str, str, int]) -> list[str]:
        kind, shape, count = cls
        return [*_shape_rules(kind, shape), f"goto {self.pick_chain(kind, count)}"]

    def _pick_rules(self, kind: str, count: int) -> list[str]:
        prefix = "nodeport-" if kind == "nodeports" else ""
        return [
            f"dnat ip to {_KEY[kind]} . numgen random mod {count} map "
            f"@{prefix}endpoints-{p}-b{bucket(count)}"
            for p in PROTOCOLS
        ]

    def _tree_rules(self, kind: str, number: int, present: set[int]) -> list[str]:
        used = {n: c for c, n in self.numbers.items() if c[0] == kind}
        rules = tree_rules(
            number,
            self.width,
            present,
            f"{_KEY[kind]} @class-bit-{kind}-",
            f"dispatch-{kind}-",
        )
        if number in used:
            rules.append(f"goto {self.class_chain(used[number])}")
        return rules

    def table(self) -> Table:
        t = Table(self.name)
        _common(t)
        for kind in KINDS:
            for j in range(self.width):
                t.set(f"class-bit-{kind}-{j}", kind)
            for b in range(1, bucket(MAX_COUNT) + 1):
                for p in PROTOCOLS:
                    t.slot_map(self.slot_map(Frontend(kind, "", "", 1 << (b - 1), ()), p), kind, p)
        for cls in self.numbers:
            t.chain(self.class_chain(cls), self._class_rules(cls))
            if (cls[0], cls[2]) not in self.picks:
                self.picks.add((cls[0], cls[2]))
                t.chain(self.pick_chain(cls[0], cls[2]), self._pick_rules(cls[0], cls[2]))
        for kind in KINDS:
            present = tree_chains({n for c, n in self.numbers.items() if c[0] == kind})
            for n in sorted(present):
                t.chain(f"dispatch-{kind}-{n}", self._tree_rules(kind, n, present))
            deepest = max(depth_of(n) for c, n in self.numbers.items() if c[0] == kind)
            # dispatch-0 .. tree .. class chain (+1) -> pick (+1), mark-for-masquerade (+1)
            t.max_depth = max(t.max_depth, 2 + deepest + 2)
        for f in self.fronts:
            self.frontend_elements(t, f)
        return t

    def frontend_elements(self, t: Table, f: Frontend) -> None:
        t.add(f"dispatch-{f.kind}", f.key)
        number = self.numbers[(f.kind, f.shape, f.count)]
        for j in range(self.width):
            if number >> j & 1:
                t.add(f"class-bit-{f.kind}-{j}", f.key)
        _slot_elements(t, self.slot_map, f)

    def change(self, old: Frontend | None, f: Frontend) -> Change:
        """What serves ``f`` (``old``: the same frontend before, if it was served): a
        class of its own (chains) if never seen, and its element changes."""
        lines: list[str] = []
        cls = (f.kind, f.shape, f.count)
        if cls not in self.numbers:
            number = self.free[f.kind].pop(0)
            self.numbers[cls] = number
            present = tree_chains({n for c, n in self.numbers.items() if c[0] == f.kind})
            parent = number & (number - 1)
            new = Table("")
            if (f.kind, f.count) not in self.picks:
                self.picks.add((f.kind, f.count))
                new.chain(self.pick_chain(f.kind, f.count), self._pick_rules(f.kind, f.count))
            new.chain(self.class_chain(cls), self._class_rules(cls))
            new.chain(f"dispatch-{f.kind}-{number}", self._tree_rules(f.kind, number, present))
            lines.append(new.text())
            lines.append(f"flush chain ip {TABLE} dispatch-{f.kind}-{parent}\n")
            for rule in self._tree_rules(f.kind, parent, present):
                lines.append(f"add rule ip {TABLE} dispatch-{f.kind}-{parent} {rule}\n")
        before, after = Table(""), Table("")
        if old is not None:
            self.frontend_elements(before, old)
        self.frontend_elements(after, f)
        return Change("".join(lines), *element_diff(before.elements, after.elements))


@dataclass
class DataCounts:
    """The sketch's structure: shapes as classes, every count 1..1024 as data."""

    fronts: list[Frontend]
    maps: str = "bucket"
    """Which counts share a slot map: ``bucket`` (bit length, as shipped), ``count``
    (a map per count), ``leaf`` (the 32 counts of one count-hi chain)."""
    name: str = "data"

    def slot_map(self, f: Frontend, proto: str) -> str:
        if self.maps == "count":
            return f"endpoints-{f.kind}-{proto}-c{f.count}"
        if self.maps == "leaf":
            return f"endpoints-{f.kind}-{proto}-h{(f.count - 1) >> 5}"
        return f"endpoints-{f.kind}-{proto}-b{bucket(f.count)}"

    def _maps(self, t: Table) -> None:
        for kind in KINDS:
            for p in PROTOCOLS:
                names = {
                    self.slot_map(Frontend(kind, "", "", n, ()), p) for n in range(1, MAX_COUNT + 1)
                }
                for name in sorted(names):
                    t.slot_map(name, kind, p)

    def _shapes(self, t: Table) -> None:
        """Shape tree (at most one bit) and shape chains, each to its protocol's family."""
        for kind in KINDS:
            t.set(f"shape-bit-{kind}-0", kind)
            shapes = {bit: shape for (k, shape), bit in _SHAPE_BITS.items() if k == kind}
            present = set(shapes)
            for n in sorted(present):
                rules = tree_rules(
                    n,
                    1,
                    present,
                    f"{_KEY[kind]} @shape-bit-{kind}-",
                    f"dispatch-{kind}-",
                )
                t.chain(f"dispatch-{kind}-{n}", [*rules, f"goto {kind}-{shapes[n]}"])
                t.chain(
                    f"{kind}-{shapes[n]}",
                    [
                        *_shape_rules(kind, shapes[n]),
                        *(f"meta l4proto {p} goto pick-{kind}-{p}-0" for p in PROTOCOLS),
                    ],
                )
        # base, services, dispatch-0, shape bit (1), shape chain, mark-for-masquerade
        t.max_depth = 2 + 1 + 1

    def table(self) -> Table:
        """The whole table: fixed chains, slot maps, shapes, pick families, elements."""
        t = Table(self.name)
        _common(t)
        self._maps(t)
        self._shapes(t)
        self._picks(t)
        for f in self.fronts:
            t.add(f"dispatch-{f.kind}", f.key)
            if _SHAPE_BITS[(f.kind, f.shape)]:
                t.add(f"shape-bit-{f.kind}-0", f.key)
            self._count_elements(t, f)
            _slot_elements(t, self.slot_map, f)
        return t

    def _picks(self, t: Table) -> None:
        """Per (kind, protocol): 32 chains of 32 count rules behind the count-hi tree."""
        for kind in KINDS:
            for j in range(5):
                t.set(f"count-hi-{kind}-{j}", kind)
            for v in range(32):
                t.set(f"count-lo-{kind}-{v}", kind)
            present = set(range(MAX_COUNT // 32))
            for p in PROTOCOLS:
                for h in sorted(present):
                    rules = tree_rules(
                        h,
                        5,
                        present,
                        f"{_KEY[kind]} @count-hi-{kind}-",
                        f"pick-{kind}-{p}-",
                    )
                    for v in range(32):
                        n = 32 * h + v + 1
                        m = self.slot_map(Frontend(kind, "", "", n, ()), p)
                        rules.append(
                            f"{_KEY[kind]} @count-lo-{kind}-{v} dnat ip to {_KEY[kind]} "
                            f". numgen random mod {n} map @{m}"
                        )
                    t.chain(f"pick-{kind}-{p}-{h}", rules)
        # shape chain -> pick-0 (+1) -> at most 5 count-hi bits
        t.max_depth = max(t.max_depth, 2 + 1 + 1 + 5)

    def _count_elements(self, t: Table, f: Frontend) -> None:
        hi, lo = (f.count - 1) >> 5, (f.count - 1) & 31
        for j in range(5):
            if hi >> j & 1:
                t.add(f"count-hi-{f.kind}-{j}", f.key)
        t.add(f"count-lo-{f.kind}-{lo}", f.key)

    def change(self, old: Frontend | None, f: Frontend) -> Change:
        """What serves ``f`` (``old``: the same frontend before, if it was served):
        element changes only, whatever its count."""
        before, after = Table(""), Table("")
        for t, front in ((before, old), (after, f)):
            if front is None:
                continue
            t.add(f"dispatch-{front.kind}", front.key)
            if _SHAPE_BITS[(front.kind, front.shape)]:
                t.add(f"shape-bit-{front.kind}-0", front.key)
            self._count_elements(t, front)
            _slot_elements(t, self.slot_map, front)
        return Change("", *element_diff(before.elements, after.elements))


@dataclass
class DataTree(DataCounts):
    """Every count a leaf of its own: a 12-bit tree over the count's number (at most 5
    bits set, small counts first), one pick rule per chain."""

    name: str = "data-tree"
    width: int = 12

    def __post_init__(self) -> None:
        self.number = small_numbers(self.width, 5)[:MAX_COUNT]

    def _picks(self, t: Table) -> None:
        """Per (kind, protocol): a chain per count number, its bit tests and one rule."""
        by_number = {n: count for count, n in enumerate(self.number, start=1)}
        present = tree_chains(set(by_number))
        for kind in KINDS:
            for j in range(self.width):
                t.set(f"count-bit-{kind}-{j}", kind)
            for p in PROTOCOLS:
                for n in sorted(present):
                    rules = tree_rules(
                        n,
                        self.width,
                        present,
                        f"{_KEY[kind]} @count-bit-{kind}-",
                        f"pick-{kind}-{p}-",
                    )
                    if n in by_number:
                        m = self.slot_map(Frontend(kind, "", "", by_number[n], ()), p)
                        rules.append(
                            f"dnat ip to {_KEY[kind]} . numgen random mod {by_number[n]} map @{m}"
                        )
                    t.chain(f"pick-{kind}-{p}-{n}", rules)
        t.max_depth = max(t.max_depth, 2 + 1 + 1 + max(n.bit_count() for n in self.number))

    def _count_elements(self, t: Table, f: Frontend) -> None:
        number = self.number[f.count - 1]
        for j in range(self.width):
            if number >> j & 1:
                t.add(f"count-bit-{f.kind}-{j}", f.key)


Structure = Shipped | DataCounts


def make(name: str, fronts: list[Frontend]) -> Structure:
    """The structure called ``name`` (:data:`STRUCTURES`) over ``fronts``."""
    if name == "shipped":
        return Shipped(fronts)
    if name == "data":
        return DataCounts(fronts)
    if name == "data-maps":
        return DataCounts(fronts, maps="count", name="data-maps")
    if name == "data-leafmaps":
        return DataCounts(fronts, maps="leaf", name="data-leafmaps")
    if name == "data-tree":
        return DataTree(fronts)
    raise ValueError(f"unknown structure {name!r}")


def container_types(container: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Key and value types of one of our containers, from its name."""
    if container == "nodeport-ips":
        return ("ipv4_addr",), ()
    kind = "nodeports" if "nodeport" in container else "ips"
    key = tuple(_KEY_TYPE[kind].split(" . "))
    if "endpoints" in container:
        return (*key, "integer"), ("ipv4_addr", "inet_service")
    return key, ()


def _parts(element: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    key, _, value = element.partition(" : ")
    return tuple(key.split(" . ")), tuple(value.split(" . ")) if value else ()


def element_batch(
    adds: dict[str, list[str]] | None = None, deletes: dict[str, list[str]] | None = None
) -> ElementBatch:
    """One netlink transaction of element changes (deletions first), as the backend's
    element writer sends them (no nft parser, no cache listing)."""
    names = set(adds or {}) | set(deletes or {})
    return ElementBatch(
        Family.IP,
        TABLE,
        {c: container_types(c) for c in names},
        deletes=[(c, _parts(e)[0]) for c, items in (deletes or {}).items() for e in items],
        adds=[(c, *_parts(e)) for c, items in (adds or {}).items() for e in items],
    )


def write_table(nft: LibNftables, table: Table) -> dict[str, float]:
    """Write ``table`` as a full sync would: the skeleton through nft, then the elements
    in netlink transactions of at most :data:`_CHUNK` elements."""
    batches: list[ElementBatch] = []
    pending: dict[str, list[str]] = {}
    size = 0
    for container, items in table.elements.items():
        for start in range(0, len(items), _CHUNK):
            part = items[start : start + _CHUNK]
            pending.setdefault(container, []).extend(part)
            size += len(part)
            if size >= _CHUNK:
                batches.append(element_batch(pending))
                pending, size = {}, 0
    if pending:
        batches.append(element_batch(pending))
    started = time.perf_counter()
    nft.run_text(table.text())
    skeleton = time.perf_counter() - started
    for batch in batches:
        nft.write_elements(batch)
    return {"skeleton_s": skeleton, "total_s": time.perf_counter() - started}


def timed(nft: LibNftables, text: str) -> float:
    """Milliseconds of one libnftables run of ``text`` (parse, cache, kernel commit)."""
    started = time.perf_counter()
    nft.run_text(text)
    return 1000 * (time.perf_counter() - started)


def timed_elements(nft: LibNftables, batch: ElementBatch) -> float:
    """Milliseconds of one element transaction over the netlink writer."""
    started = time.perf_counter()
    nft.write_elements(batch)
    return 1000 * (time.perf_counter() - started)


def timed_change(nft: LibNftables, change: Change) -> tuple[float, float]:
    """Milliseconds of ``change``: its chains through nft, then its elements; and of
    the chains alone."""
    chains = timed(nft, change.chains) if change.chains else 0.0
    batch = element_batch(change.elements, change.deletes)
    return chains + timed_elements(nft, batch), chains


def summary(samples: Sequence[float]) -> dict[str, float]:
    """Median and p99 (the nearest rank) of ``samples``, in their unit."""
    ordered = sorted(samples)
    return {
        "median": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "n": float(len(ordered)),
    }


# Real connections -----------------------------------------------------------------------

_SERVER = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080)); s.listen(4096)
print("ready", flush=True)
while True:
    c, _ = s.accept(); c.close()
"""

_CLIENT = """
import socket, struct, sys, time
addr, seconds = sys.argv[1], float(sys.argv[2])
linger = struct.pack("ii", 1, 0)
n = 0; end = time.perf_counter() + seconds; start = time.perf_counter()
cpu0 = time.process_time()
while time.perf_counter() < end:
    c = socket.socket(); c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
    c.connect((addr, 80 if addr.startswith("10.95.") else 8080)); c.close(); n += 1
cpu = time.process_time() - cpu0
print(1e6 * (time.perf_counter() - start) / n, 1e6 * cpu / n)
"""

PROBE_IP = "10.95.255.1"


def connect_us(netns: str, addr: str, seconds: float) -> tuple[float, float]:
    """Microseconds per TCP connect (and reset) from ``netns`` to ``addr``: wall clock,
    and the client's CPU time (user and system: the output hook's NAT chains run in the
    connecting process, and CPU time moves less with other work than the clock does)."""
    out = subprocess.run(
        in_netns(netns, [sys.executable, "-c", _CLIENT, addr, str(seconds)]),
        capture_output=True,
        text=True,
        check=True,
    )
    wall, cpu = out.stdout.split()
    return float(wall), float(cpu)


def probe_frontend(server_ip: str) -> Frontend:
    """A ClusterIP frontend of the deepest count (1024), every slot the server."""
    eps = tuple(f"{server_ip} . {TARGET_PORT}" for _ in range(MAX_COUNT))
    return Frontend("ips", f"{PROBE_IP} . tcp . 80", "internal", MAX_COUNT, eps)


# The run --------------------------------------------------------------------------------


def absent_counts(fronts: list[Frontend]) -> list[int]:
    """Counts up to 1000 no frontend has (a Service of one is a never-seen count)."""
    seen = {f.count for f in fronts}
    return [n for n in range(1, 1001) if n not in seen]


def full_writes(services: int, structures: Sequence[str], repeats: int) -> dict[str, list[float]]:
    """Seconds of each structure's full write (skeleton and elements, the text rendered
    before), ``repeats`` times into fresh namespaces, the order alternating each time."""
    fronts = frontends(services)
    seconds: dict[str, list[float]] = {name: [] for name in structures}
    for r in range(repeats):
        for name in structures if r % 2 == 0 else list(reversed(structures)):
            table = make(name, fronts).table()
            with namespace("i32w") as ns, LibNftables(ns) as nft:
                seconds[name].append(write_table(nft, table)["total_s"])
            del table
            print(name, f"{seconds[name][-1]:.2f} s", flush=True)
    return seconds


def growth_steps(fronts: list[Frontend], taken: set[int]) -> list[tuple[Frontend, Frontend]]:
    """Endpoint changes that bring a never-seen count: a ClusterIP frontend of N - 1
    endpoints gains one, N a count no frontend has (and none in ``taken``); one per N."""
    by_count: dict[int, Frontend] = {}
    for f in fronts:
        if f.kind == "ips" and f.shape == "internal":
            by_count.setdefault(f.count, f)
    steps: list[tuple[Frontend, Frontend]] = []
    for n in absent_counts(fronts):
        old = by_count.get(n - 1)
        if n in taken or old is None:
            continue
        extra = f"10.122.{len(steps) >> 8 & 255}.{len(steps) & 255} . {TARGET_PORT}"
        steps.append((old, replace(old, count=n, endpoints=(*old.endpoints, extra))))
    return steps


def run(
    services: int, rounds: int, structures: Sequence[str], connect_seconds: float, seed: int = 7
) -> dict[str, object]:
    """Write every structure into its own namespace, then alternate the changes."""
    fronts = frontends(services)
    rng = random.Random(seed)
    result: dict[str, object] = {
        "services": services,
        "frontends": len(fronts),
        "slots": sum(f.count for f in fronts),
    }
    absent = absent_counts(fronts)
    result["absent_counts"] = len(absent)
    with ExitStack() as stack:
        server = stack.enter_context(namespace("i32srv"))
        srv = subprocess.Popen(
            in_netns(server, [sys.executable, "-c", _SERVER]), stdout=subprocess.PIPE, text=True
        )
        stack.callback(srv.wait)
        stack.callback(srv.kill)
        built: dict[str, tuple[Structure, LibNftables, str]] = {}
        info: dict[str, dict[str, object]] = {}
        for k, name in enumerate(structures):
            ns = stack.enter_context(namespace(f"i32{k}"))
            veth = f"kpxi32{os.getpid() % 10000}{k}"
            ip("-n", ns, "link", "add", veth, "type", "veth", "peer", "name", veth + "p")
            ip("-n", ns, "link", "set", veth + "p", "netns", server)
            ip("-n", ns, "addr", "add", f"10.20{k}.0.1/24", "dev", veth)
            ip("-n", ns, "link", "set", veth, "up")
            # The DNAT of nat-output comes after the route lookup: the VIP needs a route.
            ip("-n", ns, "route", "add", "default", "via", f"10.20{k}.0.2")
            ip("-n", server, "addr", "add", f"10.20{k}.0.2/24", "dev", veth + "p")
            ip("-n", server, "link", "set", veth + "p", "up")
            st = make(name, [*fronts, probe_frontend(f"10.20{k}.0.2")])
            nft = LibNftables(ns)
            stack.callback(nft.close)
            started = time.perf_counter()
            table = st.table()
            render_s = time.perf_counter() - started
            try:
                times = write_table(nft, table)
                accepted = "yes"
            except NftError as err:
                times, accepted = {}, f"refused: {str(err)[:300]}"
            info[name] = {
                "chains": table.chains,
                "rules": table.rules,
                "max_depth": table.max_depth,
                "accepted": accepted,
                "render_s": render_s,
                **times,
            }
            print(name, json.dumps(info[name]), flush=True)
            if accepted == "yes":
                built[name] = (st, nft, ns)
            del table
        result["tables"] = info
        samples: dict[str, dict[str, list[float]]] = {n: {} for n in built}

        def note(name: str, op: str, ms: float) -> None:
            samples[name].setdefault(op, []).append(ms)

        changing = [f for f in fronts if f.count >= 2]
        grow = growth_steps(fronts, set(absent[:rounds]))
        result["growth_steps"] = len(grow)
        for r in range(rounds):
            f = rng.choice(changing)
            slot = rng.randrange(f.count)
            new_ep = f"10.127.{r >> 8 & 255}.{r & 255} . {TARGET_PORT}"
            count = absent[r % len(absent)] if r < len(absent) else rng.choice(absent)
            index = 100_000 + r if services <= 100_000 else services + r
            new = Frontend(
                "ips",
                f"{service_ip(index)} . tcp . 80",
                "internal",
                count,
                tuple(f"10.126.{(k >> 8) & 255}.{k & 255} . {TARGET_PORT}" for k in range(count)),
            )
            small = Frontend(
                "ips",
                f"{service_ip(index + 5000)} . tcp . 80",
                "internal",
                3,
                ("10.125.0.1 . 8080", "10.125.0.2 . 8080", "10.125.0.3 . 8080"),
            )
            fill = [
                f"10.124.{k >> 8 & 255}.{k & 255} . tcp . 80 . 0 : 10.123.0.1 . 8080"
                for k in range(1000)
            ]
            fill_keys = [e.split(" : ")[0] for e in fill]
            order = list(built.items()) if r % 2 == 0 else list(reversed(built.items()))
            for name, (st, nft, _) in order:
                m = st.slot_map(f, "tcp")
                # nft's own floor: libnftables lists the table's chains and sets first.
                note(
                    name,
                    "nft_floor",
                    timed(
                        nft,
                        f"add element ip {TABLE} nodeport-ips {{ 10.99.9.9 }}\n"
                        f"delete element ip {TABLE} nodeport-ips {{ 10.99.9.9 }}\n",
                    ),
                )
                one = {"nodeport-ips": ["10.99.9.9"]}
                note(name, "floor", timed_elements(nft, element_batch(one)))
                nft.write_elements(element_batch(deletes=one))
                note(
                    name,
                    "endpoint",
                    timed_elements(
                        nft,
                        element_batch(
                            {m: [f"{f.key} . {slot} : {new_ep}"]},
                            {m: [f"{f.key} . {slot}"]},
                        ),
                    ),
                )
                total, chains = timed_change(nft, st.change(None, new))
                note(name, "newcount", total)
                note(name, "newcount_chains", chains)
                if r < len(grow):
                    step = st.change(*grow[r])
                    total, chains = timed_change(nft, step)
                    note(name, "growcount", total)
                    note(name, "growcount_chains", chains)
                    moved = sum(map(len, step.elements.values())) + sum(
                        map(len, step.deletes.values())
                    )
                    # Not milliseconds: how many elements the step changed.
                    note(name, "growcount_elements", float(moved))
                note(name, "smallservice", timed_change(nft, st.change(None, small))[0])
                big = st.slot_map(Frontend("ips", "", "", 1000, ()), "tcp")
                note(name, "fill1000", timed_elements(nft, element_batch({big: fill})))
                nft.write_elements(element_batch(deletes={big: fill_keys}))
            if r % 10 == 0:
                print(f"round {r}", flush=True)
        result["changes_ms"] = {
            n: {op: summary(v) for op, v in ops.items()} for n, ops in samples.items()
        }
        if connect_seconds > 0:
            conns: dict[str, dict[str, list[float]]] = {
                n: {"probe": [], "direct": [], "probe_cpu": [], "direct_cpu": []} for n in built
            }
            for r in range(10):
                order = list(built.items()) if r % 2 == 0 else list(reversed(built.items()))
                for name, (_, _, ns) in order:
                    k = structures.index(name)
                    for where, addr in (("probe", PROBE_IP), ("direct", f"10.20{k}.0.2")):
                        wall, cpu = connect_us(ns, addr, connect_seconds)
                        conns[name][where].append(wall)
                        conns[name][f"{where}_cpu"].append(cpu)
            result["connect_us"] = {
                n: {w: summary(v) for w, v in c.items()} for n, c in conns.items()
            }
            # Each round's probe less its direct connects, one after the other: the
            # structure's walk with less of the machine's drift than either median.
            result["connect_extra_us"] = {
                n: summary([p - d for p, d in zip(c["probe"], c["direct"], strict=True)])
                for n, c in conns.items()
            }
            result["connect_extra_cpu_us"] = {
                n: summary([p - d for p, d in zip(c["probe_cpu"], c["direct_cpu"], strict=True)])
                for n, c in conns.items()
            }
            result["connect_raw_us"] = conns
    return result


def report(result: dict[str, object]) -> str:
    """The result as a few lines: per structure, its table and each change's figures."""
    lines = [
        f"{result['services']} Services, {result['frontends']} frontends, "
        f"{result['slots']} slots, {result['absent_counts']} counts <= 1000 absent"
    ]
    tables = result.get("tables", {})
    changes = result.get("changes_ms", {})
    conns = result.get("connect_us", {})
    assert isinstance(tables, dict) and isinstance(changes, dict) and isinstance(conns, dict)
    for name, t in tables.items():
        lines.append(
            f"{name}: {t['chains']} chains, {t['rules']} rules, depth {t['max_depth']}, "
            f"accepted {t['accepted']}, write {t.get('total_s', float('nan')):.1f} s "
            f"(skeleton {t.get('skeleton_s', float('nan')):.2f} s)"
        )
        for op, s in changes.get(name, {}).items():
            lines.append(
                f"  {op}: median {s['median']:.2f} ms, p99 {s['p99']:.2f} ms (n={s['n']:.0f})"
            )
        for where, s in conns.get(name, {}).items():
            lines.append(f"  connect {where}: median {s['median']:.1f} us (n={s['n']:.0f})")
        extra = result.get("connect_extra_us", {})
        assert isinstance(extra, dict)
        if name in extra:
            e = extra[name]
            lines.append(f"  connect probe - direct, paired: median {e['median']:.1f} us")
        extra_cpu = result.get("connect_extra_cpu_us", {})
        assert isinstance(extra_cpu, dict)
        if name in extra_cpu:
            e = extra_cpu[name]
            lines.append(f"  connect CPU probe - direct, paired: median {e['median']:.1f} us")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (see the module documentation)."""
    parser = argparse.ArgumentParser(prog="python -m bench.count_structure")
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--structure", action="append", choices=STRUCTURES, default=[])
    parser.add_argument("--connect-seconds", type=float, default=2.0)
    parser.add_argument("--json", help="write the result here too")
    parser.add_argument(
        "--writes", type=int, default=0, help="only time full writes, this many each"
    )
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    structures = args.structure or list(STRUCTURES)
    if args.writes:
        result: dict[str, object] = {
            "services": args.services,
            "full_write_s": full_writes(args.services, structures, args.writes),
        }
    else:
        result = run(args.services, args.rounds, structures, args.connect_seconds)
    machine: dict[str, object] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kernel": os.uname().release,
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    result["machine"] = machine
    result["command"] = "python -m bench.count_structure " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    machine["commit"] = commit or "unknown"
    text = json.dumps(result, indent=1)
    print(report(result) if not args.writes else text)
    if args.json:
        with tempfile.NamedTemporaryFile(
            "w", dir=os.path.dirname(args.json) or ".", delete=False
        ) as out:
            out.write(text)
        os.replace(out.name, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
