"""The watcher: reports the foreign commits an :class:`~kubeproxy.nftevents.Interest` cares
about to the self-healing core, or falls back to comparing the ruleset generation."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from kubeproxy.nftevents.commits import CommitAssembler, Interest
from kubeproxy.nftevents.eventsocket import EventsLost, EventSocket, KernelFilter, read_generation
from kubeproxy.nftevents.messages import Generation, parse_datagram
from kubeproxy.nftevents.ownership import OwnWriters
from kubeproxy.selfheal import ChangeKind, ExternalChange, WatchHost

if TYPE_CHECKING:
    from kubeproxy.backend import ProxySnapshot, SyncChanges
    from kubeproxy.proxier import Proxier

__all__ = ["FALLBACK_INTERVAL", "NftablesEventWatcher"]

# The old module's name: operators may filter on it.
logger = logging.getLogger("kubeproxy.nftevents")

FALLBACK_INTERVAL: Final = 3.0
"""Seconds between generation checks when events cannot be had."""


@dataclass
class _Fallback:
    """State of the generation-compare fallback."""

    expected: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class NftablesEventWatcher:
    """A :class:`~kubeproxy.selfheal.Watcher` over nf_tables events.

    Reports the foreign commits ``interest`` cares about, a ``missed-events`` change when
    messages were lost, and, when the event socket cannot be opened, falls back to
    comparing the ruleset generation every ``fallback_interval`` seconds with the one
    our last sync left (any foreign commit then counts, relevant or not: there is no
    telling which objects it touched). ``socket_factory`` and ``generation`` replace the
    kernel (tests).
    """

    def __init__(
        self,
        interest: Interest,
        *,
        netns: str | None = None,
        own: OwnWriters | None = None,
        fallback_interval: float = FALLBACK_INTERVAL,
        socket_factory: Callable[[str | None], EventSocket] | None = None,
        generation: Callable[[], int] | None = None,
    ) -> None:
        self.interest = interest
        self.netns = netns
        self.own = own if own is not None else OwnWriters()
        self.fallback_interval = fallback_interval
        self._socket_factory = socket_factory or (lambda ns: EventSocket(ns))
        self._generation = generation or (lambda: read_generation(netns))
        self._fallback: _Fallback | None = None
        self._lost_logged = False
        self.ready = threading.Event()
        """Set once the watcher listens (or has fallen back to polling)."""

    @property
    def name(self) -> str:
        """For thread names and log lines."""
        return f"nft-events ({self.interest.what})"

    def run(self, stop: threading.Event, host: WatchHost) -> None:
        """Watch until ``stop`` is set."""
        try:
            events = self._socket_factory(self.netns)
        except OSError as err:
            logger.warning(
                "Cannot listen to nf_tables events for %s (%s); checking the ruleset "
                "generation every %gs instead",
                self.interest.what,
                err,
                self.fallback_interval,
            )
            self._poll_generation(stop, host)
            return
        try:
            self._listen(events, stop, host.report)
        finally:
            events.close()

    def after_sync(self, proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """In fallback mode, remember the generation our sync left."""
        fallback = self._fallback
        if fallback is None:
            return
        try:
            current = self._generation()
        except OSError as err:
            logger.debug("cannot read the ruleset generation: %s", err)
            return
        with fallback.lock:
            fallback.expected = current

    def _listen(
        self, events: EventSocket, stop: threading.Event, report: Callable[[ExternalChange], None]
    ) -> None:
        own = self.own
        own.netns_cookie = events.netns_cookie
        dropped = KernelFilter(events, own.refresh() | {events.portid})
        stops = [c.subscribe(functools.partial(dropped.set_running, c)) for c in own.children]
        try:
            self._read(events, stop, report, dropped)
        finally:
            for unsubscribe in stops:
                unsubscribe()

    def _read(
        self,
        events: EventSocket,
        stop: threading.Event,
        report: Callable[[ExternalChange], None],
        dropped: KernelFilter,
    ) -> None:
        own = self.own
        assembler = CommitAssembler()
        relevant = self.interest.relevant
        # Commits never interleave (the kernel serializes them), so the messages of one
        # run from its first to its NEWGEN, all from one port id. A message from another
        # port id starts the next commit: if the previous one's NEWGEN never came (lost
        # with an overflow, already reported), its changes are dropped rather than
        # counted into the next one. The sender is judged at its commit's first relevant
        # message (a commit touching nothing of ours costs no look at /proc at all). The
        # rest of a commit cut by an overflow is reported like any other: a second full
        # sync rather than a change gone unseen.
        sender: int | None = None
        sender_is_us: bool | None = None
        self.ready.set()
        logger.info("Watching %s for changes by others (nf_tables events)", self.interest.what)
        while not stop.is_set():
            try:
                datagrams = events.receive(0.5)
            except EventsLost:
                assembler.discard()
                sender = None
                self._lost(report)
                continue
            for datagram in datagrams:
                for item in parse_datagram(datagram):
                    if item.portid in dropped.sockets:
                        continue  # ours, queued before the filter knew the socket
                    if item.portid != sender:
                        assembler.discard()  # a commit whose NEWGEN was lost
                        sender, sender_is_us = item.portid, None
                    if isinstance(item, Generation):
                        sender = None
                        if not assembler.pending:
                            continue
                        if sender_is_us or own.is_ours(item.portid, item.pid):
                            assembler.discard()
                            continue
                        commit = assembler.close(item)
                        if commit is not None:
                            for change in self.interest.describe(commit):
                                report(change)
                        continue
                    if sender_is_us or not relevant(item):
                        continue
                    if sender_is_us is None:
                        sender_is_us = own.is_ours(item.portid, 0, wait=0.0)
                        if own.sockets - dropped.sockets:
                            # A socket of ours sent its first commit: filter it from now on.
                            dropped.set_sockets(own.sockets | {events.portid})
                        if sender_is_us:
                            continue
                    assembler.add(item)

    def _lost(self, report: Callable[[ExternalChange], None]) -> None:
        level = logging.DEBUG if self._lost_logged else logging.WARNING
        logger.log(
            level,
            "nf_tables events were lost (socket buffer overflow) while watching %s; "
            "comparing with the kernel once (full sync)%s",
            self.interest.what,
            "" if self._lost_logged else "; later losses are logged at debug level",
        )
        self._lost_logged = True
        report(
            ExternalChange(ChangeKind.MISSED, f"nf_tables events about {self.interest.what} lost")
        )

    def _poll_generation(self, stop: threading.Event, host: WatchHost) -> None:
        # Read under the sync locks, so that a sync of ours is never half done when
        # compared; after_sync records what each of our syncs left. A foreign commit
        # landing between a check and our next sync is missed (that sync records the
        # generation it leaves): the fallback is coarser than the events.
        fallback = self._fallback = _Fallback()
        self.ready.set()
        while not stop.wait(self.fallback_interval):
            try:
                with host.syncs_held():
                    current = self._generation()
            except OSError as err:
                logger.debug("cannot read the ruleset generation: %s", err)
                continue
            with fallback.lock:
                expected, fallback.expected = fallback.expected, current
            if expected is not None and current != expected:
                host.report(
                    ExternalChange(
                        ChangeKind.MISSED,
                        f"the ruleset changed (generation {expected} -> {current}) and "
                        f"nf_tables events cannot be had to tell whether {self.interest.what} "
                        "were touched",
                    )
                )
