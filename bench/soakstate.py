"""What our nftables tables mean, read back from the kernel, to compare two of them.

The soak (``bench.soak``) compares, at every checkpoint, the tables of the daemon that has
lived through hours of churn and faults with the tables a fresh ``--once`` run writes
for the same API state in a namespace of its own. Text equality means nothing here:
generation numbers, class numbers and endpoint slots depend on history, and a long-lived
generation keeps classes nobody uses until its end. So both listings (``nft -j list
table``) are reduced to what a packet meets (:class:`TableState`):

* every dispatched frontend and the class chain it lands in (the dispatch tree walked
  with the frontend's class bits, as the kernel walks it);
* every frontend's endpoints, per slot map, slots ignored (a multiset);
* the elements of every other set and map (no-endpoint verdicts, firewall and its
  allowed sources, cluster and NodePort IPs, hairpin, affinity verdict maps...), the
  content-named affinity maps and the ``affinity-frontends-<n>`` maps some port uses by
  name, the shared ``affinity-clients-<n>`` maps not at all (their entries are clients,
  not state; both tables declare all of them);
* the rules of every chain a packet can reach (the fixed chains, the classes in use, what
  they jump or go to, what verdict maps send to), handles and counters left out;

with the live generation's ``.gN`` written ``.g*``. Whatever belongs to another
generation is a leftover (:attr:`TableState.leftovers`); chains nothing reaches are only
counted (:attr:`TableState.unreached`).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TableState", "compare", "counts", "table_state"]

_GEN = re.compile(r"\.g([0-9]+)(?![0-9])")
_TREE = re.compile(r"dispatch-(?:ips|nodeports)-[0-9]+\.g")
_SLOTS = re.compile(r"(?:shortcut-)?(?:nodeport-)?endpoints-[a-z]+-b[0-9]+\.g")
_CONTENT_MAP = re.compile(r"affinity-[A-Z0-9]+$")
_CLIENT_MAP = re.compile(r"affinity-clients-[0-9]+$")
# Declared while some port uses them: their names are state, their entries clients.
_FRONTEND_MAP = re.compile(r"affinity-frontends-[0-9]+$")
_ROOTS = {"ips": "dispatch-ips", "nodeports": "dispatch-nodeports"}
_TRANSPORT = ("tcp", "udp", "sctp", "th")


def _text(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _bare(element: object) -> object:
    """An element's key without its ``elem`` wrapper (a comment, a timeout): a frontend's
    dispatch element names its Service, its class-bit elements do not."""
    if isinstance(element, dict) and "elem" in element:
        return element["elem"].get("val")
    return element


def _strip(expr: object) -> object:
    """A rule expression without what differs between two equal rules: counter values,
    and the protocol nft names a port by. ``nft list table`` prints one and the same rule
    (``... meta l4proto . th dport ... map @endpoints-tcp-...``, whose bytecode checks the
    protocol first, per ``nft --debug=netlink``) as ``tcp dport`` or ``th dport``
    depending on the rules it listed before."""
    if isinstance(expr, dict):
        if "counter" in expr and isinstance(expr["counter"], dict):
            return {"counter": None}
        if expr.get("field") in ("dport", "sport") and expr.get("protocol") in _TRANSPORT:
            return {**expr, "protocol": "th"}
        return {k: _strip(v) for k, v in expr.items()}
    if isinstance(expr, list):
        return [_strip(v) for v in expr]
    return expr


def _targets(value: object) -> Iterable[str]:
    """The chains a rule expression or a verdict jumps or goes to, the sets it reads."""
    if isinstance(value, dict):
        for verdict in ("jump", "goto"):
            if isinstance(value.get(verdict), dict):
                yield str(value[verdict]["target"])
        for item in value.values():
            yield from _targets(item)
    elif isinstance(value, list):
        for item in value:
            yield from _targets(item)
    elif isinstance(value, str) and value.startswith("@"):
        yield value[1:]


@dataclass
class TableState:
    """One family's table, reduced to what a packet meets (see the module)."""

    generation: int | None = None
    classes: dict[str, str] = field(default_factory=dict)
    slots: dict[str, list[str]] = field(default_factory=dict)
    elements: dict[str, list[str]] = field(default_factory=dict)
    rules: dict[str, list[str]] = field(default_factory=dict)
    content_maps: set[str] = field(default_factory=set)
    leftovers: list[str] = field(default_factory=list)
    unreached: int = 0
    chains: int = 0
    sets: int = 0
    element_count: int = 0


def table_state(listing: Mapping[str, Any]) -> TableState:
    """Reduce ``nft -j list table`` output (parsed) to its :class:`TableState`."""
    chains: dict[str, list[list[Any]]] = {}
    containers: dict[str, list[Any]] = {}
    for item in listing.get("nftables", ()):
        if "chain" in item:
            chains.setdefault(item["chain"]["name"], [])
        elif "rule" in item:
            chains.setdefault(item["rule"]["chain"], []).append(item["rule"]["expr"])
        elif "set" in item or "map" in item:
            body = item.get("set") or item.get("map")
            containers[body["name"]] = list(body.get("elem", ()))
    state = TableState(chains=len(chains), sets=len(containers))
    state.element_count = sum(len(e) for e in containers.values())
    fixed = [n for n in chains if _GEN.search(n) is None]
    referenced = {int(g) for n in fixed for g in _GEN.findall(_text(chains[n]))}
    if len(referenced) != 1:
        state.leftovers = sorted([*chains, *containers]) if chains or containers else []
        return state
    live = state.generation = referenced.pop()
    marker = re.compile(rf"\.g{live}(?![0-9])")

    def canon(value: object) -> str:
        return marker.sub(".g*", value if isinstance(value, str) else _text(value))

    names = [*chains, *containers]
    state.leftovers = sorted(
        n for n in names if (m := _GEN.search(n)) is not None and int(m.group(1)) != live
    )
    members: dict[str, set[str]] = {
        name: {_text(_bare(e)) for e in elements} for name, elements in containers.items()
    }
    # Frontends -> class chains: the dispatch tree, walked with each frontend's bits.
    roots: list[str] = []
    for plural, head in _ROOTS.items():
        dispatch = f"{head}.g{live}"
        root = f"{head}-0.g{live}"
        roots.append(root)
        for frontend in members.get(dispatch, ()):
            landed = _walk(root, frontend, chains, members)
            state.classes[f"{plural} {frontend}"] = canon(landed)
    for name, elements in containers.items():
        if marker.search(name) is None and _GEN.search(name) is not None:
            continue  # a leftover: reported above
        if _CLIENT_MAP.fullmatch(name):
            continue  # clients' pins, recorded by packets
        if _CONTENT_MAP.fullmatch(name) or _FRONTEND_MAP.fullmatch(name):
            state.content_maps.add(name)
        elif name.startswith("class-bit-") or _ROOTS["ips"] + f".g{live}" == name:
            continue  # the dispatch: in classes
        elif name == f"{_ROOTS['nodeports']}.g{live}":
            continue
        elif _SLOTS.match(name):
            for element in elements:
                key, value = element
                frontend = _text(key["concat"][:-1])
                state.slots.setdefault(f"{canon(name)} {frontend}", []).append(_text(value))
        elif elements:
            state.elements[canon(name)] = sorted(canon(e) for e in elements)
    for values in state.slots.values():
        values.sort()
    # The chains a packet can reach (the tree is in classes), and their rules.
    reached: set[str] = set()
    todo = [*fixed, *(c.replace(".g*", f".g{live}") for c in state.classes.values())]
    while todo:
        name = todo.pop()
        if name in reached or (name not in chains and name not in containers):
            continue
        if _TREE.match(name) or name in roots:
            continue
        reached.add(name)
        todo.extend(_targets(chains.get(name, containers.get(name))))
    for name in reached:
        if name in chains:
            state.rules[canon(name)] = [canon(_strip(rule)) for rule in chains[name]]
    state.unreached = sum(
        1 for n in chains if n not in reached and not _TREE.match(n) and n not in state.leftovers
    )
    return state


def _walk(chain: str, frontend: str, chains: Mapping[str, list[list[Any]]],
          members: Mapping[str, set[str]]) -> str:  # fmt: skip
    """Where a packet of ``frontend`` lands from dispatch-tree chain ``chain``: follow the
    first rule whose set holds the frontend (or that has no set), until a chain outside
    the tree."""
    for _ in range(64):
        if not _TREE.match(chain):
            return chain
        for expr in chains.get(chain, ()):
            sets = [t for t in _targets(expr) if t in members]
            jumps = [t for t in _targets(expr) if t not in members]
            if sets and not all(frontend in members[s] for s in sets):
                continue
            if jumps:
                chain = jumps[0]
                break
        else:
            return f"(falls through {chain})"
    return f"(loops at {chain})"


def compare(live: TableState, fresh: TableState, *, limit: int = 8) -> list[str]:
    """What ``live`` holds that ``fresh`` does not, and the other way round (at most
    ``limit`` examples per part), and ``live``'s leftovers; [] when they mean the same."""
    found: list[str] = []
    if live.leftovers:
        found.append(f"{len(live.leftovers)} leftover objects: {live.leftovers[:limit]}")
    for part in ("classes", "slots", "elements", "rules"):
        ours: Mapping[str, Any] = getattr(live, part)
        theirs: Mapping[str, Any] = getattr(fresh, part)
        differing = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        if differing:
            examples = [_difference(k, ours.get(k), theirs.get(k)) for k in differing]
            found.append(f"{part}: {len(differing)} differ: {examples[:limit]}")
    if live.content_maps != fresh.content_maps:
        extra = sorted(live.content_maps - fresh.content_maps)
        missing = sorted(fresh.content_maps - live.content_maps)
        found.append(f"affinity maps: extra {extra[:limit]}, missing {missing[:limit]}")
    return found


def counts(states: Iterable[TableState]) -> Counter[str]:
    """Kernel objects held (chains, sets, elements) over ``states``."""
    total: Counter[str] = Counter()
    for state in states:
        total["chains"] += state.chains
        total["sets"] += state.sets
        total["elements"] += state.element_count
    return total


def _difference(key: str, ours: object, theirs: object) -> str:
    """One difference, short: for lists, the first item that differs on each side."""
    if isinstance(ours, list) and isinstance(theirs, list):
        only_ours = [x for x in ours if x not in theirs]
        only_theirs = [x for x in theirs if x not in ours]
        if not only_ours and not only_theirs:
            return f"{key}: same items, another order"
        return f"{key}: live {only_ours[:2]!r} vs fresh {only_theirs[:2]!r}"[:600]
    return f"{key}: live {ours!r} vs fresh {theirs!r}"[:600]
