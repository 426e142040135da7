"""The bytes a sync sends to the kernel, against a golden record (issue 32, item 1).

The backend's model, diff and encoders are rewritten for speed from time to time; what
they send must not change with them. :class:`RecordingNft` is the fake executor that also
encodes every transaction the way the owned table's executor does
(:func:`~kubeproxy.backends.nftables.batchencoder.encode_transaction`) and every element
batch the way its element writer does
(:func:`~kubeproxy.backends.nftables.elements.element_frames`), and keeps each message's
type, flags and body: the netlink batches less their sequence numbers. A small cluster of
each mix goes through a full sync and the incremental changes the benchmarks time, and the
digest of each step's messages must equal the one recorded in
``tests/data/sync-bytes.json``.

The record was written by the code before the issue 32 speed-ups of the backend (main at
``2a10c37``) with ``python -m tests.test_nft_sync_bytes``; a change that means to change
the bytes rewrites it the same way, and says why in its commit.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.proxyproc import BenchProxy, bench_config
from bench.synthetic import build_services, realistic_services
from kubeproxy.backends.nftables import NftablesBackend
from kubeproxy.backends.nftables.batchencoder import encode_transaction
from kubeproxy.backends.nftables.declarations import Declaration
from kubeproxy.backends.nftables.elements import (
    ElementBatch,
    EncodedPairs,
    GroupedAdds,
    element_frames,
)
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.table import TABLE
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.objects import IPFamily

GOLDEN = Path(__file__).parent / "data" / "sync-bytes.json"


class RecordingNft(FakeNft):
    """A :class:`FakeNft` that keeps the netlink messages each write would send."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[tuple[int, int, bytes]] = []
        self._declared: dict[Family, dict[str, Declaration]] = {}
        self._as_elements = False
        self.packed = 0
        """Element lists that came packed (``EncodedPairs``)."""

    def _declaration(self, family: Family) -> Callable[[str], Declaration]:
        known = self._declared.setdefault(family, {})

        def declared(name: str) -> Declaration:
            found = known.get(name)
            if found is None:
                raise NftError(f"set {name}: not declared", 2)
            return found

        return declared

    def run(self, tx: Transaction) -> None:
        """Record ``tx`` as the owned table's executor encodes it, then apply it."""
        if not self._as_elements and tx.table == TABLE and tx.error is None and len(tx):
            encoded = encode_transaction(tx, self._declaration(tx.family))
            self.messages.extend((m.kind, m.flags, m.body) for m in encoded.messages)
            known = self._declared.setdefault(tx.family, {})
            if encoded.table_deleted:
                known.clear()
            for name in encoded.deleted:
                known.pop(name, None)
            known.update(encoded.declared)
        super().run(tx)

    def write_elements(self, batch: ElementBatch) -> None:
        """Record ``batch`` as the element writer encodes it, then apply it."""
        if len(batch):
            self.messages.extend((f.kind, f.flags, f.body) for f in element_frames(batch))
            if isinstance(batch.adds, GroupedAdds):
                groups = batch.adds.groups.values()
                self.packed += sum(isinstance(pairs, EncodedPairs) for pairs in groups)
        self._as_elements = True
        try:
            super().write_elements(batch)
        finally:
            self._as_elements = False

    def take_digest(self) -> str:
        """The digest of the messages recorded since the last call (and forget them)."""
        digest = hashlib.sha256()
        for kind, flags, body in self.messages:
            digest.update(kind.to_bytes(2, "little") + flags.to_bytes(2, "little"))
            digest.update(len(body).to_bytes(4, "little") + body)
        count = len(self.messages)
        self.messages.clear()
        return f"{digest.hexdigest()} {count} messages"


def _backend(fake: FakeNft, family: IPFamily, packed: bool = True) -> NftablesBackend:
    return NftablesBackend(
        family,
        bench_config(),
        executor=fake,
        support_check=False,
        elements_per_transaction=700,
        packed_elements=packed,  # as over netlink (the fake alone would take text)
    )


def _steps(mix: str, packed: bool = True, fake: RecordingNft | None = None) -> dict[str, str]:
    """Each step of one small cluster's life and the digest of what it sent (elements
    packed as queued, or not)."""
    fake = fake or RecordingNft()
    if mix == "uniform":
        services = build_services(60, 10, affinity_seconds=0)
        proxy = BenchProxy(services, _backend(fake, IPFamily.IPV4, packed))
    elif mix == "affinity":
        services = build_services(40, 3, affinity_seconds=10800)
        proxy = BenchProxy(services, _backend(fake, IPFamily.IPV4, packed))
    else:
        proxy = BenchProxy(
            realistic_services(150),
            _backend(fake, IPFamily.IPV4, packed),
            backend6=_backend(fake, IPFamily.IPV6, packed),
            realistic=True,
        )
    out: dict[str, str] = {}
    actions: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("cold", proxy.cold),
        ("change_endpoint", proxy.change_endpoint),
        ("add_service", proxy.add_service),
        ("add_count_new", lambda: proxy.add_count(True)),
        ("add_count_seen", lambda: proxy.add_count(False)),
        ("remove_service", proxy.remove_service),
        ("change_endpoint_2", proxy.change_endpoint),
    ]
    for step, action in actions:
        result = action()
        assert result["ok"], step
        assert fake.messages, f"{mix} {step} sent nothing"
        out[step] = fake.take_digest()
    return out


MIXES = ("uniform", "affinity", "realistic")


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "text"])
@pytest.mark.parametrize("mix", MIXES)
def test_sync_sends_the_recorded_bytes(mix: str, packed: bool) -> None:
    golden = json.loads(GOLDEN.read_text())
    fake = RecordingNft()
    assert _steps(mix, packed, fake) == golden[mix]
    assert (fake.packed > 0) == packed


def test_recorder_sees_a_change_of_bytes() -> None:
    """The digest depends on what is sent: a different cluster gives different digests."""
    fake = RecordingNft()
    proxy = BenchProxy(build_services(5, 2, affinity_seconds=0), _backend(fake, IPFamily.IPV4))
    proxy.cold()
    first = fake.take_digest()
    fake2 = RecordingNft()
    proxy2 = BenchProxy(build_services(5, 3, affinity_seconds=0), _backend(fake2, IPFamily.IPV4))
    proxy2.cold()
    assert fake2.take_digest() != first


if __name__ == "__main__":  # pragma: no cover - writes the record
    GOLDEN.write_text(json.dumps({mix: _steps(mix) for mix in MIXES}, indent=1) + "\n")
    sys.stdout.write(f"wrote {GOLDEN}\n")
