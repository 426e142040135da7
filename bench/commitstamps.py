"""When the kernel committed each change of a Service: nf_tables events, stamped on arrival.

The network-programming benchmark (:mod:`bench.test_programming`) needs, for every
EndpointSlice update the API server accepted, the moment the kernel committed the rules
that carry it. The kernel announces every committed change of a namespace on the
nf_tables event group (:class:`kubeproxy.nftevents.EventSocket`): one message per element
added or deleted, then ``NEWGEN`` closing the commit. :class:`CommitStamper` reads them in
a thread of the benchmark process (not the daemon's: its figures stay its own), and
records each commit of ``table ip kube-proxy`` as the monotonic time its ``NEWGEN``
arrived and the IPv4 frontends its elements name: the first four bytes of an element's
key, which in the map structure is the frontend's address (``ip daddr . proto . port``,
``... . slot``). A commit that adds or deletes no such element is left out.

``CLOCK_MONOTONIC`` is one clock for every process of the machine, so these stamps and
the fake API server's (:mod:`bench.apiserverproc`) compare directly. A stamp is taken
when the event reaches this thread: after the commit, by the time the kernel takes to
queue the messages and this thread to be scheduled (microseconds idle, more when the
two cores are busy), so latencies are over-stated by that much, never under-stated.

:func:`match_updates` pairs each update with the first commit at or after its acceptance
that names its Service's address.
"""

from __future__ import annotations

import bisect
import ipaddress
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.nftevents import EventsLost, EventSocket, Generation, ObjectChange, parse_datagram

__all__ = ["Commit", "CommitStamper", "Match", "element_addresses", "match_updates"]

_ELEMENT_OPS: Final = frozenset({"NEWSETELEM", "DELSETELEM"})
_NFTA_SET_ELEM_LIST_ELEMENTS: Final = 3
_NFTA_LIST_ELEM: Final = 1
_NFTA_SET_ELEM_KEY: Final = 1
_NFTA_DATA_VALUE: Final = 1
_GIVE_UP_S: Final = 120.0  # an update not committed within this long counts as missing


@dataclass(frozen=True, slots=True)
class Commit:
    """One commit of our table: when its ``NEWGEN`` arrived (monotonic seconds), its
    generation, and the IPv4 addresses (as integers) its elements start with."""

    at: float
    generation: int
    addresses: frozenset[int]


def _nested(data: bytes, start: int, end: int, kind: int) -> Iterator[tuple[int, int]]:
    for attribute, first, last in nlmsg.attributes(data, start, end):
        if attribute == kind:
            yield first, last


def element_addresses(body: bytes) -> Iterator[int]:
    """The first four bytes of every element key of a ``NEWSETELEM``/``DELSETELEM``
    message's attributes, as an integer (an IPv4 address in network order)."""
    for first, last in _nested(body, 0, len(body), _NFTA_SET_ELEM_LIST_ELEMENTS):
        for elem_first, elem_last in _nested(body, first, last, _NFTA_LIST_ELEM):
            for key_first, key_last in _nested(body, elem_first, elem_last, _NFTA_SET_ELEM_KEY):
                for value_first, value_last in _nested(body, key_first, key_last, _NFTA_DATA_VALUE):
                    if value_last - value_first >= 4:
                        yield int.from_bytes(body[value_first : value_first + 4], "big")


class CommitStamper:
    """Reads the nf_tables events of ``netns`` in a thread and keeps :attr:`commits`.

    Start it once the daemon's first full sync is done (that sync's hundreds of thousands
    of messages are no one's update); ``stop()`` ends the thread. ``niceness`` (when not
    0) is the reading thread's ``nice`` value, so a busy machine delays its stamps less.
    :attr:`lost` counts buffer overflows (the kernel dropped messages: the figures would
    be incomplete).
    """

    def __init__(
        self, netns: str, *, table: str = "kube-proxy", family: str = "ip", niceness: int = 0
    ) -> None:
        self.table = table
        self.family = family
        self.niceness = niceness
        self.commits: list[Commit] = []
        self.lost = 0
        self._events = EventSocket(netns)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="commit-stamper", daemon=True)

    def __enter__(self) -> CommitStamper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop reading and close the socket."""
        self._stop.set()
        self._thread.join(5)
        self._events.close()

    def _read(self) -> None:
        if self.niceness:
            # Linux's nice is per thread: this one only, not the benchmark process.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.niceness)
        pending: set[int] = set()
        while not self._stop.is_set():
            try:
                datagrams = self._events.receive(0.2)
            except EventsLost:
                self.lost += 1
                continue
            if not datagrams:
                continue
            arrived = time.monotonic()
            for datagram in datagrams:
                for item in parse_datagram(datagram):
                    if isinstance(item, Generation):
                        if pending:
                            self.commits.append(
                                Commit(arrived, item.generation, frozenset(pending))
                            )
                            pending = set()
                    elif self._ours(item):
                        pending.update(element_addresses(item.body))

    def _ours(self, change: ObjectChange) -> bool:
        return (
            change.op in _ELEMENT_OPS
            and change.table == self.table
            and change.family == self.family
        )


@dataclass(frozen=True, slots=True)
class Match:
    """The updates paired with commits: each update's latency (seconds, None for one no
    commit carried), in the order given."""

    latencies: tuple[float | None, ...]

    @property
    def reached(self) -> list[float]:
        """The latencies of the updates a commit carried."""
        return [latency for latency in self.latencies if latency is not None]

    @property
    def missing(self) -> int:
        """How many updates no commit carried."""
        return sum(1 for latency in self.latencies if latency is None)


def match_updates(updates: Iterable[tuple[float, str]], commits: Sequence[Commit]) -> Match:
    """Pair each ``(accepted at, Service address)`` with the first commit at or after it
    that names the address: the update's network-programming latency.

    An update of a Service changed again before the first update's commit would share that
    commit; the benchmark touches each Service at most once every few seconds (far more
    than any latency it measures), so each commit found is the update's own.
    """
    times = [commit.at for commit in commits]
    latencies: list[float | None] = []
    for accepted, address in updates:
        wanted = int(ipaddress.IPv4Address(address))
        found: float | None = None
        for index in range(bisect.bisect_left(times, accepted), len(commits)):
            if commits[index].at - accepted > _GIVE_UP_S:
                break
            if wanted in commits[index].addresses:
                found = commits[index].at - accepted
                break
        latencies.append(found)
    return Match(tuple(latencies))
