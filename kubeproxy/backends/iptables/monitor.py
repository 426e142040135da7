"""Self-healing in iptables modes: someone else's changes to our chains, found fast.

Two watchers (:func:`watchers`):

* **canary checks**, for both variants: every :data:`CANARY_INTERVAL` seconds (upstream
  checks every sync period, 30 s by default) each family's ``KUBE-PROXY-CANARY`` chains
  are looked for in mangle, nat and filter (:meth:`IptablesBackend.missing_canaries`, a
  few milliseconds); a missing one means someone flushed or deleted those tables;
* **nf_tables events**, where iptables is iptables-nft (its tables are nf_tables tables
  ``ip nat``, ``ip6 filter``...): a commit by another process that deletes one of those
  tables, changes one of our chains (:class:`OurChains`), or adds or deletes a rule
  jumping to one of them (our jumps from the built-in chains) is reported within
  milliseconds. Our own commits come from the iptables tools the executor spawned; it
  tells the watcher their pids (:class:`~kubeproxy.host.children.ChildProcesses`).

iptables-legacy has no change events: there the canary is all there is. A chain of ours
flushed by name (``iptables -t nat -F KUBE-SERVICES``) is found only by the events.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Final

from kubeproxy.backends.iptables.exec import IptablesVariant
from kubeproxy.backends.iptables.naming import CANARY
from kubeproxy.backends.iptables.proxier import IptablesBackend, owns_chain
from kubeproxy.backends.iptables.restore import TABLES
from kubeproxy.host.children import ChildProcesses
from kubeproxy.nftevents import (
    Commit,
    NftablesEventWatcher,
    ObjectChange,
    OwnWriters,
    summarize,
)
from kubeproxy.objects import IPFamily
from kubeproxy.selfheal import ChangeKind, ExternalChange, PeriodicCheck, Watcher

__all__ = ["CANARY_INTERVAL", "OurChains", "canary_watcher", "event_watcher", "watchers"]

CANARY_INTERVAL: Final = 5.0
"""Seconds between canary checks (upstream: the sync period, 30 s by default)."""

_FAMILIES: Final = {"ip": IPFamily.IPV4, "ip6": IPFamily.IPV6}
# A chain name inside a rule's attributes (a jump's target): iptables chain names of ours
# are upper case letters, digits and dashes.
_CHAIN_NAME = re.compile(rb"KUBE-[A-Z0-9-]+")


class OurChains:
    """The :class:`~kubeproxy.nftevents.Interest` of iptables-nft: changes to our chains.

    ``owns(table, chain)`` says which chains are ours (iptables and ipvs modes own
    different ones; kubelet's ``KUBE-FIREWALL`` and friends are nobody's here). Relevant:
    a deleted ``nat``/``filter``/``mangle`` table (ours went with it), anything done to a
    chain of ours, and rules added to or deleted from other chains that name one of ours
    (the jumps into them).
    """

    def __init__(self, owns: Callable[[str, str], bool], families: Sequence[IPFamily]) -> None:
        self._owns = owns
        wanted = set(families)
        self._families = {name: f for name, f in _FAMILIES.items() if f in wanted}

    @property
    def what(self) -> str:
        """For log lines."""
        return f"iptables-nft tables {'/'.join(self._families)} {', '.join(TABLES)}"

    def relevant(self, change: ObjectChange) -> bool:
        """Whether ``change`` touches our chains (see the class documentation)."""
        if change.family not in self._families or change.table not in TABLES:
            return False
        if change.op == "DELTABLE":
            return True
        if change.name and self._owns(change.table, change.name):
            return True
        if change.op in ("NEWRULE", "DELRULE") and b"KUBE-" in change.body:
            return any(
                self._owns(change.table, found.decode())
                for found in _CHAIN_NAME.findall(change.body)
            )
        return False

    def describe(self, commit: Commit) -> list[ExternalChange]:
        """One change per family touched."""
        return summarize(commit, self._families)


def event_watcher(
    owns: Callable[[str, str], bool],
    families: Sequence[IPFamily],
    children: Sequence[ChildProcesses],
    netns: str | None = None,
) -> NftablesEventWatcher:
    """nf_tables events about our chains (``owns``) in ``families``; ``children`` are the
    registries of the executors that run our iptables tools."""
    return NftablesEventWatcher(OurChains(owns, families), netns=netns, own=OwnWriters(children))


def canary_watcher(backend: IptablesBackend, interval: float = CANARY_INTERVAL) -> PeriodicCheck:
    """The canary check of one backend's family, every ``interval`` seconds."""
    family = backend.family

    def check() -> list[ExternalChange]:
        missing = backend.missing_canaries()
        if not missing:
            return []
        detail = (
            f"{family} canary chain {CANARY} gone from {', '.join(missing)} (or flushed, in"
            " mangle): someone flushed those tables"
        )
        return [ExternalChange(ChangeKind.CANARY, detail, family)]

    return PeriodicCheck(f"iptables-canary-{family.value}", check, interval, family=family)


def watchers(
    backends: Sequence[IptablesBackend],
    netns: str | None = None,
    *,
    canary_interval: float = CANARY_INTERVAL,
) -> list[Watcher]:
    """The watchers of iptables mode for ``backends`` (one per family): canary checks,
    and nf_tables events where the backends use iptables-nft."""
    found: list[Watcher] = [canary_watcher(b, canary_interval) for b in backends]
    nft = [b for b in backends if b.executor.variant is IptablesVariant.NFT]
    if nft:
        children = [
            c for b in nft if isinstance(c := getattr(b.executor, "children", None), ChildProcesses)
        ]
        found.append(event_watcher(owns_chain, [b.family for b in nft], children, netns))
    return found
