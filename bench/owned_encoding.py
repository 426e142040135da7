"""What encoding the owned table's writes costs: a whole cold sync, in memory.

    python -m bench.owned_encoding                       # 10k and 100k Services x 10
    python -m bench.owned_encoding --services 1000 --runs 5

The map structure's cold full sync of N Services (``bench.nft_scale.build_world``) is
recorded once (every transaction and element batch the backend hands its executor), then
encoded, best of ``--runs``, the ways the two executors do it:

* **owned** (``OwnedNftables``): the transactions as nf_tables messages by our encoder
  (``batchencoder.encode_transaction``: tables, chains, sets, rules, verdict and range
  elements), the element batches as messages by ``ElementWriter.frames``;
* **libnftables** (``LibNftables``): the transactions rendered as nft text
  (``Transaction.render_chunks``, what is handed to libnftables, which then parses and
  compiles it in C: not counted here), the element batches as above (the
  ``NFTablesNetlink`` gate's default).

Also: the rules alone (every ``add rule`` of the sync) through our encoder, per rule.
No kernel is touched; the kernel-side figures (a whole cold sync both ways, into a
namespace) are ``make bench-owned``'s and the README's.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.nft_scale import CONFIG, build_world
from kubeproxy.backend import SyncChanges
from kubeproxy.backends.nftables.backend import NftablesBackend
from kubeproxy.backends.nftables.batchencoder import encode_transaction
from kubeproxy.backends.nftables.declarations import Declaration
from kubeproxy.backends.nftables.elements import ElementBatch, element_frames
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.objects import Map, NftError, Rule, Set
from kubeproxy.backends.nftables.owner import OWNER_FLAGS
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.objects import IPFamily

__all__ = ["main", "measure"]


class _Recorder(FakeNft):
    """Takes every transaction and batch, keeps them, and holds nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[Transaction | ElementBatch] = []

    def run(self, tx: Transaction) -> None:
        if tx.error is not None:
            raise tx.error
        self.writes.append(tx)

    def write_elements(self, batch: ElementBatch) -> None:
        self.writes.append(batch)


def _best(runs: int, work: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def measure(services: int, runs: int) -> dict[str, Any]:
    """Record one cold sync of ``services`` Services x 10 and time its encodings."""
    recorder = _Recorder()
    backend = NftablesBackend(IPFamily.IPV4, CONFIG, executor=recorder, support_check=False)
    backend.sync(build_world(services, 10, False).snapshot(), SyncChanges(full=True))
    txs = [w for w in recorder.writes if isinstance(w, Transaction)]
    batches = [w for w in recorder.writes if isinstance(w, ElementBatch)]
    declared: dict[str, Declaration] = {}
    for tx in txs:
        for _verb, obj in tx.operations():
            if isinstance(obj, Set | Map):
                declared[obj.name] = Declaration.of(obj)

    def lookup(name: str) -> Declaration:
        found = declared.get(name)
        if found is None:
            raise NftError(f"set {name} does not exist")
        return found

    def owned() -> None:
        for tx in txs:
            encode_transaction(tx, lookup, table_flags=OWNER_FLAGS)
        for batch in batches:
            element_frames(batch)

    def text() -> None:
        for tx in txs:
            for _chunk in tx.render_chunks(elements_per_line=64):
                pass
        for batch in batches:
            element_frames(batch)

    rules = Transaction(txs[0].family, txs[0].table)
    for tx in txs:
        for verb, obj in tx.operations():
            if verb == "add" and isinstance(obj, Rule):
                rules.add(obj)

    def rules_only() -> None:
        encode_transaction(rules, lookup, table_flags=OWNER_FLAGS)

    tx_ops = sum(len(tx) for tx in txs)
    elements = sum(len(batch) for batch in batches)
    return {
        "services": services,
        "transactions": len(txs),
        "transaction_operations": tx_ops,
        "element_batches": len(batches),
        "batch_elements": elements,
        "rules": len(rules),
        "owned_s": round(_best(runs, owned), 4),
        "libnftables_text_s": round(_best(runs, text), 4),
        "rules_only_s": round(_best(runs, rules_only), 4),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Measure each size, print a table."""
    parser = argparse.ArgumentParser(prog="python -m bench.owned_encoding", description=__doc__)
    parser.add_argument("--services", type=int, nargs="+", default=[10000, 100000])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    print("| Services | transaction ops | batch elements | rules | owned: encode all |", end="")
    print(" libnftables: render text (+ elements) | owned: the rules alone |")
    print("|---|---|---|---|---|---|---|")
    for services in args.services:
        row = measure(services, args.runs)
        per_rule = row["rules_only_s"] / max(1, row["rules"]) * 1e6
        print(
            f"| {row['services']} | {row['transaction_operations']} | {row['batch_elements']} |"
            f" {row['rules']} | {row['owned_s']:.3f} s | {row['libnftables_text_s']:.3f} s |"
            f" {row['rules_only_s'] * 1000:.1f} ms ({per_rule:.0f} us a rule) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
