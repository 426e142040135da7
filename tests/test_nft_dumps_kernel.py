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

Namespaces are named ``kpxrz-...`` and deleted whatever happens.
"""

from __future__ import annotations

from collections.abc import Callable

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


def test_every_reader_gives_each_element_once_while_the_set_is_resized() -> None:
    with lone_namespace(PREFIX) as ns:
        # owner_flags 0: ownership is not what is tested here, and any kernel has this.
        executor = OwnedNftables(ns.name, owner_flags=0)
        reader = TableReader(ns.name)
        try:
            tx = Transaction(Family.IP, TABLE)
            tx.add(Table())
            tx.add(Set("addresses", "ipv4_addr"))
            executor.run(tx)
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
        finally:
            reader.close()
            executor.close()
