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

Also: the rules alone (every ``add rule`` of the sync) through our encoder, per rule;
and one rule (``services``' dispatch lookup) through our encoder (compiled from its text
and encoded) next to pyroute2's ``nft_rule_msg`` encoding the same expressions already
compiled (pyroute2 cannot compile nft's language: its messages only carry expressions),
the library the project uses elsewhere for netlink. With ``--kernel``, a whole cold sync
into a fresh network namespace both ways (``OwnedNftables`` and ``LibNftables``),
alternately, best of ``--runs``.
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
from kubeproxy.backends.nftables.objects import Family, Map, NftError, Rule, Set
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


_DISPATCH = "ip daddr . meta l4proto . th dport @dispatch-ips.g1 goto dispatch-ips-0.g1"


def one_rule(runs: int) -> tuple[float, float]:
    """Seconds for one rule: ours (compiled and encoded), pyroute2 (encoded only)."""
    from collections import OrderedDict

    from pyroute2.netlink.nfnetlink.nftsocket import nft_rule_msg
    from pyroute2.nftables.expressions import genex

    from kubeproxy.backends.nftables.ruleencoder import RuleEncoder

    def unknown(name: str) -> Declaration:
        raise NftError(name)

    encoder = RuleEncoder(Family.IP, unknown, lambda: 1)

    def pyroute2() -> bytes:
        verdict = [("NFTA_VERDICT_CODE", -4), ("NFTA_VERDICT_CHAIN", "dispatch-ips-0.g1")]
        exprs = [
            genex("payload", OrderedDict(dreg=1, base=1, offset=16, len=4)),
            genex("meta", OrderedDict(key=16, dreg=9)),
            genex("payload", OrderedDict(dreg=10, base=2, offset=2, len=2)),
            genex("lookup", OrderedDict(set="dispatch-ips.g1", sreg=1)),
            genex(
                "immediate",
                OrderedDict(dreg=0, data={"attrs": [("NFTA_DATA_VERDICT", {"attrs": verdict})]}),
            ),
        ]
        msg = nft_rule_msg()
        msg["nfgen_family"] = 2
        msg["attrs"] = [
            ("NFTA_RULE_TABLE", "kube-proxy"),
            ("NFTA_RULE_CHAIN", "services"),
            ("NFTA_RULE_EXPRESSIONS", exprs),
        ]
        msg.encode()
        return bytes(msg.data)

    ours = _best(runs, lambda: [encoder.encode(_DISPATCH) for _ in range(200)]) / 200
    theirs = _best(runs, lambda: [pyroute2() for _ in range(200)]) / 200
    return ours, theirs


def kernel_cold_sync(services: int, runs: int) -> tuple[float, float]:
    """Best seconds of a cold full sync into a fresh namespace: owned, libnftables."""
    from bench.netns import namespaces
    from kubeproxy.backends.nftables import backend_over
    from kubeproxy.backends.nftables.exec import LibNftables
    from kubeproxy.backends.nftables.owner import OwnedNftables

    snapshot = build_world(services, 10, False).snapshot()
    best = {"owned": float("inf"), "libnftables": float("inf")}
    for _ in range(runs):
        for kind in best:
            with namespaces("own") as (netns,):
                executor = OwnedNftables(netns) if kind == "owned" else LibNftables(netns)
                backend = backend_over(executor, IPFamily.IPV4, CONFIG)
                started = time.perf_counter()
                backend.sync(snapshot, SyncChanges(full=True))
                best[kind] = min(best[kind], time.perf_counter() - started)
                executor.close()
    return best["owned"], best["libnftables"]


def main(argv: Sequence[str] | None = None) -> int:
    """Measure each size, print a table."""
    parser = argparse.ArgumentParser(prog="python -m bench.owned_encoding", description=__doc__)
    parser.add_argument("--services", type=int, nargs="+", default=[10000, 100000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kernel", action="store_true", help="also a cold sync both ways")
    args = parser.parse_args(argv)
    ours, theirs = one_rule(args.runs)
    print(
        f"one rule ({_DISPATCH!r}): ours, compiled and encoded, {ours * 1e6:.1f} us;"
        f" pyroute2's nft_rule_msg, encoded only, {theirs * 1e6:.1f} us"
    )
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
    if args.kernel:
        for services in args.services:
            owned, text = kernel_cold_sync(services, args.runs)
            print(
                f"cold full sync of {services} Services x 10 into a namespace, best of"
                f" {args.runs}: owned {owned:.2f} s, libnftables {text:.2f} s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
