"""The network-programming benchmark's pieces: commit stamps from real nf_tables events,
pairing updates with commits, and the target checks (issue 29)."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

import kubeproxy.host.nlmsg as nlmsg
from bench.commitstamps import Commit, CommitStamper, element_addresses, match_updates
from bench.programming import thirds
from bench.programming_report import queue_tolerance_ms, queued, render, targets
from tests.kernelkit import lone_namespace, run_in


def _element(key: bytes) -> bytes:
    # NFTA_LIST_ELEM { NFTA_SET_ELEM_KEY { NFTA_DATA_VALUE key } }
    return nlmsg.nested(1, nlmsg.nested(1, nlmsg.attr(1, key)))


def test_element_addresses_are_the_first_four_bytes_of_each_key() -> None:
    keys = [bytes([10, 96, 0, 1]) + b"\x06\0\0\0\0\x50\0\0", bytes([10, 96, 1, 2])]
    body = (
        nlmsg.attr(1, nlmsg.string("kube-proxy"))
        + nlmsg.attr(2, nlmsg.string("endpoints-tcp-b4.g1"))
        + nlmsg.nested(3, *(_element(key) for key in keys))
    )
    assert list(element_addresses(body)) == [0x0A600001, 0x0A600102]
    assert list(element_addresses(nlmsg.nested(3, _element(b"\x01\x02")))) == []


def test_each_update_is_paired_with_the_first_commit_after_it_naming_its_address() -> None:
    a, b = 0x0A600001, 0x0A600002
    commits = [
        Commit(1.0, 7, frozenset({a})),
        Commit(2.0, 8, frozenset({b})),
        Commit(3.0, 9, frozenset({a, b})),
    ]
    updates = [(0.5, "10.96.0.1"), (1.5, "10.96.0.1"), (1.9, "10.96.0.2"), (3.5, "10.96.0.2")]
    match = match_updates(updates, commits)
    assert list(match.latencies) == [0.5, 1.5, pytest.approx(0.1), None]
    assert match.missing == 1
    assert match.reached == [0.5, 1.5, pytest.approx(0.1)]


@pytest.mark.kernel
def test_the_stamper_records_each_commit_of_our_table_with_its_addresses() -> None:
    with lone_namespace("kpxt-np") as ns:
        run_in(
            ns.name,
            "nft",
            "-f",
            "-",
            stdin="table ip kube-proxy {\n"
            " map m { type ipv4_addr . inet_proto . inet_service : ipv4_addr; }\n}\n"
            "table ip other {\n set s { type ipv4_addr; }\n}\n",
        )
        with CommitStamper(ns.name) as stamper:
            started = time.monotonic()
            element = "{ 10.96.0.1 . tcp . 80 : 10.1.0.1 }"
            run_in(ns.name, "nft", f"add element ip kube-proxy m {element}")
            run_in(ns.name, "nft", "add element ip other s { 10.96.0.9 }")
            run_in(ns.name, "nft", "delete element ip kube-proxy m { 10.96.0.1 . tcp . 80 }")
            deadline = time.monotonic() + 5
            while len(stamper.commits) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        # Another table's commit is no one's update; each of ours is stamped after it began.
        assert [c.addresses for c in stamper.commits] == [frozenset({0x0A600001})] * 2
        assert all(c.at >= started for c in stamper.commits)
        assert stamper.lost == 0


def _record(**fields: Any) -> dict[str, Any]:
    record = {
        "runner": "paced",
        "before": False,
        "services": 30_000,
        "rate": 50.0,
        "updates": 3000,
        "reached": 3000,
        "missing": 0,
        "events_lost": 0,
        "p50_ms": 30.0,
        "p99_ms": 80.0,
        "max_ms": 120.0,
        "cpu_share": 0.04,
        "syncs_per_s": 18.0,
        "changes_per_sync": 2.8,
        "metric_p99_s": 0.1,
        "partial_mean_ms": 2.0,
        "p50_first_third_ms": 30.0,
        "p50_last_third_ms": 31.0,
        "p99_first_third_ms": 80.0,
        "p99_last_third_ms": 82.0,
        "load_1m": 3.0,
    }
    record.update(fields)
    return record


def test_targets_hold_and_miss_as_the_issue_says() -> None:
    fast = _record(rate=500.0, cpu_share=0.15, changes_per_sync=25.0, p50_last_third_ms=90.0)
    before = _record(runner="minSyncPeriod 1s (before)", before=True, p99_ms=1500.0)
    held = targets([_record(), fast, before])
    assert [verdict for _, _, verdict in held] == [True, True, True, True]
    # A queue: the last third's median far above the first's; an update never committed.
    queue = _record(rate=500.0, p50_last_third_ms=400.0, changes_per_sync=25.0)
    lost = _record(missing=1, reached=2999, p99_ms=120.0, cpu_share=0.06)
    missed = targets([lost, queue])
    assert [verdict for _, _, verdict in missed] == [False, False, False, False]


def test_render_lists_every_record_and_the_targets() -> None:
    document = {
        "command": "make bench",
        "commit": "abc1234",
        "when": "2026-11-29T03:00:00+00:00",
        "minutes": 14.2,
        "machine": {"nproc": 2, "kernel": "6.18", "python": "3.11"},
        "records": [_record(), _record(runner="minSyncPeriod 1s (before)", before=True)],
    }
    text = render(document, "bench/results/x.json")
    assert text.count("| 30k | 50 |") == 2
    assert "| target (issue 29) |" in text and "**missed**" not in text


def _series(seconds: float, rate: float, latency: Any, seed: int = 5) -> list[float | None]:
    """Latencies (s) of updates made at ``rate`` a second for ``seconds``: ``latency(t)``
    of the update made at ``t``."""
    rng = random.Random(seed)
    return [latency(i / rate, rng) for i in range(int(seconds * rate))]


def _judged(latencies: list[float | None], sync_ms: float) -> bool | None:
    return queued({**thirds(latencies), "partial_mean_ms": sync_ms})


def _flat(t: float, rng: random.Random) -> float:
    # Uniform waits for a 50 ms rest and a 10 ms sync, with the shared machine's stalls:
    # every update of one 400 ms stretch waits for the same late commit (as measured).
    stall = 0.4 - (t - 25.0) if 25.0 <= t < 25.4 else 0.0
    return rng.uniform(0.005, 0.07) + stall


def test_a_flat_series_with_a_late_stall_is_no_queue() -> None:
    """The quiet re-measure's shape (30k, 500/s): flat, one stall late in the window; the
    halves' p99s had called it a queue (383 against 164 ms)."""
    latencies = _series(30, 500, _flat)
    assert _judged(latencies, sync_ms=10.0) is False
    figures = thirds(latencies)
    assert figures["p99_last_third_ms"] is not None and figures["p99_last_third_ms"] > 200


def test_a_growing_queue_is_a_queue_however_noisy() -> None:
    """Arrivals 10 % above what the loop serves: each update waits 0.1 s longer for every
    second the window has run (the committed loaded run grew faster: 2.8 s to 7.6 s)."""

    def queue(t: float, rng: random.Random) -> float:
        return _flat(t, rng) + 0.1 * t

    assert _judged(_series(30, 500, queue), sync_ms=10.0) is True
    # Even when the syncs themselves were slow (the tolerance grows with them).
    assert _judged(_series(30, 500, queue), sync_ms=100.0) is True


def test_queue_tolerance_follows_the_sync_cost() -> None:
    assert queue_tolerance_ms({"partial_mean_ms": 2.0}) == 100.0
    assert queue_tolerance_ms({"partial_mean_ms": 50.0}) == 300.0
    assert queue_tolerance_ms({}) == 100.0


def test_unreached_updates_and_old_documents() -> None:
    assert thirds([None] * 9)["p50_first_third_ms"] is None
    assert queued({}) is None
    # Written before the thirds: judged on the halves' p99 as then.
    assert queued({"p99_first_half_ms": 100.0, "p99_second_half_ms": 400.0}) is True
    assert queued({"p99_first_half_ms": 100.0, "p99_second_half_ms": 150.0}) is False
