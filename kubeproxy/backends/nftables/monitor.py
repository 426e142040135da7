"""Self-healing in nftables mode: someone else's changes to our tables, found at once.

:func:`watchers` gives the binary one :class:`~kubeproxy.nftevents.NftablesEventWatcher`
watching ``table ip kube-proxy`` and ``table ip6 kube-proxy`` (those of the families we
proxy). Any commit by another process that adds or deletes anything in them (the table
itself, a chain, a rule, a set or map, an element) is reported, and the core answers
with a full sync. Which objects went missing only shapes the log line and the metric's
``kind``: the watcher knows the tables' names and nothing of their structure, so it stays
right whatever the rules inside look like. Our own commits (libnftables in this process)
are recognised by their socket and never reported.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

from kubeproxy.backends.nftables.table import TABLE
from kubeproxy.nftevents import (
    Commit,
    NftablesEventWatcher,
    ObjectChange,
    OwnWriters,
    summarize,
)
from kubeproxy.objects import IPFamily
from kubeproxy.selfheal import ExternalChange, Watcher

__all__ = ["NFT_FAMILIES", "OurTables", "watchers"]

NFT_FAMILIES: Final = {"ip": IPFamily.IPV4, "ip6": IPFamily.IPV6}
"""nft's family names of our tables, and the IP family each serves."""


class OurTables:
    """The :class:`~kubeproxy.nftevents.Interest` of nftables mode: any change to our
    tables (of ``families``) counts."""

    def __init__(self, families: Iterable[IPFamily] = (IPFamily.IPV4, IPFamily.IPV6)) -> None:
        wanted = set(families)
        self._families = {name: f for name, f in NFT_FAMILIES.items() if f in wanted}
        self._tables = frozenset((name, TABLE) for name in self._families)

    @property
    def what(self) -> str:
        """``tables ip/ip6 kube-proxy``."""
        return f"table{'s' if len(self._tables) > 1 else ''} {'/'.join(self._families)} {TABLE}"

    def relevant(self, change: ObjectChange) -> bool:
        """Whether the change is in one of our tables."""
        return (change.family, change.table) in self._tables

    def describe(self, commit: Commit) -> list[ExternalChange]:
        """One change per family whose table was touched."""
        return summarize(commit, self._families)


def watchers(families: Sequence[IPFamily], netns: str | None = None) -> list[Watcher]:
    """The watchers for nftables mode: nf_tables events about our tables of ``families``,
    in ``netns`` or the current namespace."""
    watcher: Watcher = NftablesEventWatcher(OurTables(families), netns=netns, own=OwnWriters())
    return [watcher]
