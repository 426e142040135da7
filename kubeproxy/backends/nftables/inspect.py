"""Reading back what the map structure dispatches, for tests, tools and the demo.

The per-Service-chain structure had one map to read (``service-ips``); the map
structure holds every dispatched frontend in the ``dispatch-ips`` and
``dispatch-nodeports`` sets of the current generation (or, with the benchmarks' rule
dispatch, in one set per class). These helpers answer "which frontends are served, and by
which endpoints" from the kernel (or a fake) without knowing the class names.
"""

from __future__ import annotations

import re

from kubeproxy.backends.nftables.exec import NftExecutor
from kubeproxy.backends.nftables.frontends import Kind
from kubeproxy.backends.nftables.layout import (
    CLASS_NAME,
    SLOT_PROTOCOLS,
    GenNames,
    generation_of,
)
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.backends.nftables.table import TABLE

__all__ = ["current_generation", "served_frontends", "slots_of"]

Key = tuple[str, ...]


_DISPATCH_SET = re.compile(r"dispatch-(?:ips|nodeports)\.g([0-9]+)")


def _class_sets(names: list[str]) -> dict[int, list[str]]:
    by_gen: dict[int, list[str]] = {}
    for name in names:
        found = _DISPATCH_SET.fullmatch(name) or CLASS_NAME.fullmatch(name)
        if found is not None:
            by_gen.setdefault(int(found.group(1)), []).append(name)
    return by_gen


def current_generation(executor: NftExecutor, family: Family) -> int | None:
    """The newest generation in ``table <family> kube-proxy``, or None."""
    if not executor.table_exists(family, TABLE):
        return None
    gens = [g for n in executor.list_sets(family, TABLE) if (g := generation_of(n)) is not None]
    return max(gens, default=None)


def served_frontends(executor: NftExecutor, family: Family) -> set[Key]:
    """Every frontend key (``(ip, proto, port)`` or ``(proto, nodeport)``) dispatched by
    the newest generation: the frontends whose new connections are DNATed."""
    if not executor.table_exists(family, TABLE):
        return set()
    by_gen = _class_sets(executor.list_sets(family, TABLE))
    if not by_gen:
        return set()
    keys: set[Key] = set()
    for name in by_gen[max(by_gen)]:
        keys.update(element.key for element in executor.list_elements(family, TABLE, name))
    return keys


def slots_of(executor: NftExecutor, family: Family, key: Key) -> list[tuple[str, ...]]:
    """The endpoints (``(ip, port)``) in the main slots of one frontend, slot by slot."""
    gen = current_generation(executor, family)
    if gen is None:
        return []
    kind = Kind.IP if len(key) == 3 else Kind.NODEPORT
    proto = key[1] if kind == Kind.IP else key[0]
    if proto not in SLOT_PROTOCOLS:
        return []
    # The frontend's slots are in the map of its count's bucket: look in each.
    head = GenNames(gen).slots(kind, False, proto, 1).rpartition("-b")[0] + "-b"
    found: dict[int, tuple[str, ...]] = {}
    for name in executor.list_sets(family, TABLE):
        if name.startswith(head) and generation_of(name) == gen:
            for element in executor.list_elements(family, TABLE, name):
                if element.key[:-1] == key:
                    found[int(element.key[-1])] = element.value
    return [found[i] for i in sorted(found)]
