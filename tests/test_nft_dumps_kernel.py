"""A dump of a set the kernel is resizing gives each element once, in the kernel.

A set of ours is a hash table that the kernel resizes in a worker after insertions fill
it and after deletions empty it; a dump that spans several netlink messages and meets a
resize repeats elements, and no ``NLM_F_DUMP_INTR`` says so
(:func:`~kubeproxy.backends.nftables.elements.read_whole` has the details). Here a set
is filled with 800 addresses by the socket's writer thread (as a full sync fills its
sets) and emptied again, a hundred times, and read right after each filling by every
reader of ours: the socket's (what affinity cleaning reads) and
the table reader's, decoded (``explain``) and as bytes (``verify``). Measured before
the readers asked again: one cycle in thirty to one in ten had a dump that repeated
elements (none when the same thread writes and reads: the worker's resize is done by
then).

A commit between two messages of a dump is caught as well (the kernel's flag for that,
``NLM_F_DUMP_INTR``, is never set on an element dump): 2,000 of a set's 20,000 elements
are deleted right after the first message is read.

Namespaces are named ``kpxrz-...`` and deleted whatever happens.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator

import pytest

from kubeproxy.backends.nftables.elements import ElementBatch, Key
from kubeproxy.backends.nftables.objects import Family, Set, Table
from kubeproxy.backends.nftables.owner import OwnedNftables
from kubeproxy.backends.nftables.reader import TableReader
from kubeproxy.backends.nftables.table import TABLE
from kubeproxy.backends.nftables.transaction import Transaction
from tests.kernelkit import lone_namespace

pytestmark = pytest.mark.kernel

PREFIX = "kpxrz"
TYPES = {"addresses": (("ipv4_addr",), ())}
CYCLES = 100
ADDRESSES = 800
NAMES = ("socket", "decoded", "bytes")


@contextlib.contextmanager
def _one_set() -> Iterator[tuple[OwnedNftables, TableReader]]:
    """A namespace whose table holds set ``addresses``; our socket and a table reader's."""
    with lone_namespace(PREFIX) as ns:
        # owner_flags 0: ownership is not what is tested here, and any kernel has this.
        executor = OwnedNftables(ns.name, owner_flags=0)
        reader = TableReader(ns.name)
        try:
            tx = Transaction(Family.IP, TABLE)
            tx.add(Table())
            tx.add(Set("addresses", "ipv4_addr"))
            executor.run(tx)
            yield executor, reader
        finally:
            reader.close()
            executor.close()


def test_every_reader_gives_each_element_once_while_the_set_is_resized() -> None:
    with _one_set() as (executor, reader):
        declaration = reader.sets(Family.IP)["addresses"]
        readers: dict[str, Callable[[], list[Key]]] = {
            "socket": lambda: [
                key
                for key, _value in executor.read_elements(
                    Family.IP, TABLE, "addresses", TYPES["addresses"]
                )
            ],
            "decoded": lambda: [
                item.key for item in reader.elements(Family.IP, "addresses", declaration)
            ],
            "bytes": lambda: [
                item.key
                for item in reader.decode_blobs(
                    declaration, reader.element_blobs(Family.IP, "addresses", declaration)
                )
            ],
        }
        for cycle in range(CYCLES):
            addresses = [f"10.{cycle}.{i // 256}.{i % 256}" for i in range(ADDRESSES)]
            wanted = sorted((a,) for a in addresses)
            for start in range(0, ADDRESSES, 100):
                adds = [("addresses", (a,), ()) for a in addresses[start : start + 100]]
                executor.post_elements(ElementBatch(Family.IP, TABLE, TYPES, adds=adds))
            executor.settle_elements()  # the table reader's socket does not wait
            # Each reader reads first in a third of the cycles (the first read is
            # the one that meets the resize).
            for name in NAMES[cycle % 3 :] + NAMES[: cycle % 3]:
                read = readers[name]()
                assert sorted(read) == wanted, (
                    f"cycle {cycle}, the {name} reader: {len(read)} elements, "
                    f"{len(set(read))} distinct, of {ADDRESSES}"
                )
            deletes = [("addresses", (a,)) for a in addresses]
            executor.write_elements(ElementBatch(Family.IP, TABLE, TYPES, deletes=deletes))


class _CommitAfterFirstMessage:
    """The reader's socket, but a commit runs once, right after the first message of a
    dump is read (the kernel fills the later ones as they are read)."""

    def __init__(self, sock: socket.socket, commit: Callable[[], None]) -> None:
        self._sock = sock
        self._commit = commit
        self.requests = 0
        self.committed = False

    def sendall(self, data: bytes) -> None:
        self.requests += 1
        self._sock.sendall(data)

    def recv_into(self, buffer: bytearray) -> int:
        size = self._sock.recv_into(buffer)
        if not self.committed:
            self.committed = True
            self._commit()
        return size

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


@pytest.mark.parametrize("reading", ["decoded", "bytes"])
def test_a_commit_between_two_messages_of_a_dump_is_not_missed(reading: str) -> None:
    """The kernel flags no element dump ``NLM_F_DUMP_INTR``; deleting elements the walk
    already passed makes the next messages skip as many live ones. Each message's
    generation (``res_id``) says a commit came between them."""
    with _one_set() as (executor, reader):
        addresses = [f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}" for i in range(20_000)]
        for start in range(0, len(addresses), 5000):
            adds = [("addresses", (a,), ()) for a in addresses[start : start + 5000]]
            executor.write_elements(ElementBatch(Family.IP, TABLE, TYPES, adds=adds))
        gone = addresses[::10]
        declaration = reader.sets(Family.IP)["addresses"]
        sock = _CommitAfterFirstMessage(
            reader.channel.sock,
            lambda: executor.write_elements(
                ElementBatch(Family.IP, TABLE, TYPES, deletes=[("addresses", (a,)) for a in gone])
            ),
        )
        reader.channel.sock = sock  # type: ignore[assignment]
        if reading == "decoded":
            read = [i.key for i in reader.elements(Family.IP, "addresses", declaration)]
        else:
            blobs = reader.element_blobs(Family.IP, "addresses", declaration)
            read = [i.key for i in reader.decode_blobs(declaration, blobs)]
        assert sock.committed
        assert sorted(read) == sorted((a,) for a in set(addresses) - set(gone)), (
            f"{len(read)} elements read, {len(addresses) - len(gone)} held"
        )
        assert sock.requests == 2  # the interrupted dump, and the whole one
