"""A full sync whose element batches go to the socket's writer thread, in the kernel:

* it leaves the same table as the synchronous one (``nft list table`` and every
  attribute the kernel holds: ``tests/nftdump.py``), over a few hundred Services in
  transactions of a hundred elements;
* a batch the kernel refuses in the middle of it (its table name changed on the way, so
  the kernel answers ``ENOENT``) fails the sync with the kernel's error, nothing after
  it is sent, the half generation is taken back, and the next sync is whole;
* nothing passes a posted batch: a read of a set on the same socket, right after
  batches were posted and before they are settled, finds every element they add.

Namespaces are named ``kpxq-...`` and deleted whatever happens.
"""

from __future__ import annotations

import errno
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from kubeproxy.backend import SyncChanges, SyncError
from kubeproxy.backends.nftables.backend import NftablesBackend
from kubeproxy.backends.nftables.batchsocket import BatchSocket, Refusable
from kubeproxy.backends.nftables.elements import ElementBatch
from kubeproxy.backends.nftables.layout import generation_of
from kubeproxy.backends.nftables.objects import Family, Set, Table
from kubeproxy.backends.nftables.owner import OwnedNftables
from kubeproxy.backends.nftables.table import TABLE
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPFamily
from tests.kernelkit import echo_snapshot, lone_namespace
from tests.nftdump import dump

pytestmark = pytest.mark.kernel

PREFIX = "kpxq"
CONFIG = ProxierConfig(node_name="kpxq-node")
SERVICES = 300
ELEMENT = "element transaction"


class _Socket(BatchSocket):
    """A socket that counts what it sends, and spoils the ``spoil``-th element batch's
    table name (same length: the kernel reads the batch and refuses it)."""

    def __init__(self, netns: str, spoil: int = 0) -> None:
        super().__init__(netns)
        self.spoil = spoil
        self.sent: list[str] = []

    def exchange(
        self, payload: bytes, begin: int, sent: Mapping[int, Refusable], what: str
    ) -> None:
        self.sent.append(what)
        if what == ELEMENT and self.sent.count(ELEMENT) == self.spoil:
            payload = payload.replace(TABLE.encode() + b"\0", b"kube-proxx\0")
        super().exchange(payload, begin, sent, what)


def _backend(
    netns: str, channel: BatchSocket, *, pipelined: bool, failures: Path | None = None
) -> NftablesBackend:
    # owner_flags 0: the table written as the owned one is, on any kernel (ownership
    # is not what is tested here).
    executor = OwnedNftables(netns, channel=channel, owner_flags=0)
    return NftablesBackend(
        IPFamily.IPV4,
        CONFIG,
        executor=executor,
        elements_per_transaction=100,
        pipelined_elements=pipelined,
        failure_dir=failures,
    )


def _listing(netns: str) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "list", "table", "ip", TABLE],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_a_pipelined_full_sync_leaves_the_table_the_synchronous_one_does() -> None:
    snapshot = echo_snapshot(PREFIX, SERVICES)
    with lone_namespace(PREFIX) as one, lone_namespace(PREFIX) as two:
        pipelined, plain = _Socket(one.name), _Socket(two.name)
        try:
            _backend(one.name, pipelined, pipelined=True).sync(snapshot, SyncChanges(full=True))
            _backend(two.name, plain, pipelined=False).sync(snapshot, SyncChanges(full=True))
            assert pipelined.posted > 10 and plain.posted == 0
            assert pipelined.sent == plain.sent
            assert _listing(one.name) == _listing(two.name)
            assert dump(one.name, "ip") == dump(two.name, "ip")
        finally:
            pipelined.close()
            plain.close()


def test_a_refused_batch_mid_sync_fails_it_cleanly(tmp_path: Path) -> None:
    snapshot = echo_snapshot(PREFIX, SERVICES)
    with lone_namespace(PREFIX) as ns, lone_namespace(PREFIX) as twin:
        channel, plain = _Socket(ns.name, spoil=4), _Socket(twin.name)
        try:
            backend = _backend(ns.name, channel, pipelined=True, failures=tmp_path)
            with pytest.raises(SyncError) as failed:
                backend.sync(snapshot, SyncChanges(full=True))
            assert isinstance(failed.value.__cause__, Exception)
            assert getattr(failed.value.__cause__, "errno", None) == errno.ENOENT
            # Nothing of the generation was sent after the refused batch.
            elements = [i for i, what in enumerate(channel.sent) if what == ELEMENT]
            assert len(elements) == 4
            assert all(what != ELEMENT for what in channel.sent[elements[-1] + 1 :])
            assert "refused element batch" in (tmp_path / "failed-sync-ip.nft").read_text()
            # Taken back: no chain or set of a generation is left in the kernel.
            assert [n for n in _names(backend) if generation_of(n) is not None] == []
            channel.spoil = 0
            backend.sync(snapshot, SyncChanges(full=False))
            assert backend.last_sync_full
            _backend(twin.name, plain, pipelined=False).sync(snapshot, SyncChanges(full=True))
            # The same table as a first sync writes, but for the generation's number.
            assert _numberless(_listing(ns.name)) == _numberless(_listing(twin.name))
        finally:
            channel.close()
            plain.close()


ADDRESSES = {"addresses": (("ipv4_addr",), ())}


def test_a_read_on_the_socket_waits_for_the_posted_batches() -> None:
    with lone_namespace(PREFIX) as ns:
        executor = OwnedNftables(ns.name, owner_flags=0)
        try:
            tx = Transaction(Family.IP, TABLE)
            tx.add(Table())
            tx.add(Set("addresses", "ipv4_addr"))
            executor.run(tx)
            addresses = [f"10.1.{i // 256}.{i % 256}" for i in range(800)]
            for start in range(0, len(addresses), 100):
                adds = [("addresses", (a,), ()) for a in addresses[start : start + 100]]
                executor.post_elements(ElementBatch(Family.IP, TABLE, ADDRESSES, adds=adds))
            assert executor.channel.posting  # not settled: the read must wait for them
            types = ADDRESSES["addresses"]
            read = executor.read_elements(Family.IP, TABLE, "addresses", types)
            assert sorted(key for key, _value in read) == sorted((a,) for a in addresses)
            executor.settle_elements()
            assert executor.channel.posted == 8 and not executor.channel.posting
        finally:
            executor.close()


def _numberless(listing: str) -> str:
    return re.sub(r"\.g[0-9]+\b", ".gN", listing)


def _names(backend: NftablesBackend) -> list[str]:
    executor = backend.executor
    return [*executor.list_chains(Family.IP, TABLE), *executor.list_sets(Family.IP, TABLE)]
