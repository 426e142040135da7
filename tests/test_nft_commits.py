"""SyncOps: additions queued one by one, as lists, and packed (``EncodedPairs``), to one
container in any mix, commit the same elements in the same order and the same bytes."""

from __future__ import annotations

import pytest

from kubeproxy.backends.nftables.commits import SyncOps
from kubeproxy.backends.nftables.elements import ElementBatch, element_frames, pair_elements
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.backends.nftables.table import Key
from kubeproxy.backends.nftables.transaction import Transaction

HAIRPIN = (("ipv4_addr", "ipv4_addr"), ())
TYPES = {"hairpin": HAIRPIN}
HOSTS = [f"10.0.0.{i}" for i in range(1, 9)]


def _ops(batches: list[ElementBatch]) -> SyncOps:
    def run(tx: Transaction) -> None:
        raise AssertionError("no text transaction expected")

    return SyncOps(Family.IP, TYPES, run=run, write_elements=batches.append, budget=100)


def _pair(host: str) -> tuple[Key, Key]:
    return ((host, host), ())


@pytest.mark.parametrize(
    "order",
    ["packed, packed", "packed, one", "one, packed", "list, packed", "packed, list"],
)
def test_any_mix_of_queued_additions_commits_the_same_batch(order: str) -> None:
    batches: list[ElementBatch] = []
    ops = _ops(batches)
    first, second = HOSTS[:4], HOSTS[4:]
    for how, hosts in zip(order.split(", "), (first, second), strict=True):
        if how == "packed":
            ops.add_all("hairpin", pair_elements(HAIRPIN, hosts))
        elif how == "list":
            ops.add_all("hairpin", [_pair(h) for h in hosts])
        else:
            for host in hosts:
                ops.add("hairpin", *_pair(host))
    ops.commit()
    (batch,) = batches
    assert list(batch.adds) == [("hairpin", *_pair(h)) for h in HOSTS]
    flat = ElementBatch(Family.IP, "kube-proxy", TYPES, adds=list(batch.adds))
    assert [f.body for f in element_frames(batch)] == [f.body for f in element_frames(flat)]
    assert ops.elements == {"hairpin": [len(HOSTS), 0]}
