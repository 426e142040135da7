"""The kernel-floor benchmark's pieces (issue 32): the recording socket and its replay in
the kernel, the profile's grouping by module, and the report's table and target."""

from __future__ import annotations

import pstats
from typing import Any

import pytest

from bench.floor import (
    CpuTime,
    Recorder,
    RecordingSocket,
    TimedBackend,
    kernel_threads,
    kernel_threads_s,
    replay,
)
from bench.floor_report import render, targets
from bench.profile_modules import KERNEL_WAIT, by_category, by_module, category, module_name
from kubeproxy.backend import SyncChanges
from kubeproxy.backends.nftables import backend_over
from kubeproxy.backends.nftables.owner import OwnedNftables, probe_table_flags
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPFamily
from tests.kernelkit import echo_snapshot, lone_namespace, run_in, without_owner


@pytest.mark.kernel
def test_the_recorded_batches_replayed_elsewhere_build_the_same_table() -> None:
    with lone_namespace("kpxt-fl") as ours, lone_namespace("kpxt-fl") as floor:
        owner, persist = probe_table_flags(ours.name)
        if not (owner and persist):
            pytest.skip("kernel lacks the owner and persist table flags (Linux 6.9+)")
        recorder = Recorder()
        executor = OwnedNftables(ours.name, channel=RecordingSocket(recorder, ours.name))
        backend = backend_over(executor, IPFamily.IPV4, ProxierConfig(node_name="kpxt-node"))
        backend.sync(echo_snapshot("kpxt", 20), SyncChanges(full=True))
        executor.close()
        assert recorder.batches and recorder.reads >= 1
        assert recorder.summary()["messages"] == sum(len(b.seqs) for b in recorder.batches)
        done = replay(recorder.batches, floor.name)
        assert done.wall_s >= done.exchange_s > 0
        # The replaying thread's own clocks: never more than the span they were read over.
        assert done.cpu.total_s >= 0 and done.runqueue_s >= 0
        assert done.cpu.total_s + done.runqueue_s <= done.wall_s + 0.01
        summary = recorder.summary()
        assert summary["exchange_cpu_s"] == pytest.approx(
            sum(b.cpu.total_s for b in recorder.batches)
        )
        listings = [
            without_owner(run_in(ns.name, "nft", "list", "table", "ip", "kube-proxy"))
            for ns in (ours, floor)
        ]
        assert "bulk/s19" in listings[0] or "172.30.16.19" in listings[0]
        assert listings[0] == listings[1]


class _Stats(pstats.Stats):
    """A profile's table as cProfile leaves it, without a profile run."""

    def __init__(self, table: dict[Any, Any]) -> None:
        self.stats = table


def test_builtins_count_for_their_callers_and_socket_calls_are_the_kernel_wait() -> None:
    diff = ("/x/kubeproxy/backends/nftables/diff.py", 10, "plan")
    proxier = ("/x/kubeproxy/proxier.py", 5, "sync")
    sock = ("/x/kubeproxy/backends/nftables/batchsocket.py", 7, "exchange")
    table = {
        diff: (1, 1, 0.5, 1.0, {}),
        proxier: (1, 1, 0.25, 2.0, {}),
        sock: (1, 1, 0.125, 1.0, {}),
        ("~", 0, "<built-in method builtins.len>"): (
            4,
            4,
            0.4,
            0.4,
            {diff: (3, 3, 0.3, 0.3), proxier: (1, 1, 0.1, 0.1)},
        ),
        ("~", 0, "<method 'sendall' of '_socket.socket' objects>"): (
            1,
            1,
            0.75,
            0.75,
            {sock: (1, 1, 0.75, 0.75)},
        ),
    }
    modules = by_module(_Stats(table))
    assert modules["kubeproxy.backends.nftables.diff"] == pytest.approx(0.8)
    assert modules["kubeproxy.proxier"] == pytest.approx(0.35)
    assert modules[KERNEL_WAIT] == 0.75
    categories = by_category(modules)
    assert list(categories) == ["diff", KERNEL_WAIT, "model (core)", "encoding"]
    assert categories["encoding"] == 0.125


def test_module_names_and_categories() -> None:
    assert module_name("/w/kubeproxy/backends/nftables/__init__.py") == (
        "kubeproxy.backends.nftables"
    )
    assert module_name("/usr/lib/python3.11/json/decoder.py") == "stdlib"
    assert module_name("/w/.venv/lib/python3.11/site-packages/kubeproxy/x.py") == ("site-packages")
    assert category("kubeproxy.backends.nftables.frontends") == "model (backend)"
    assert category("kubeproxy.servicechanges") == "model (core)"
    assert category("kubeproxy.host.nlmsg") == "encoding"
    assert category("stdlib") == "other (interpreter, stdlib, bench)"


def _record(services: int, ours: float, floor: float) -> dict[str, Any]:
    """A record whose CPU times are its wall times halved (the target is judged on CPU)."""
    return {
        "services": services,
        "mix": "uniform",
        "gc_held": True,
        "ours": {
            "total_s": ours,
            "feed_s": 1.0,
            "sync_s": ours - 1.0,
            **CpuTime(ours / 2 - 0.5, 0.5).fields(),
            **CpuTime(ours / 4 - 0.25, 0.25).fields("backend_"),
            **CpuTime(0.0, floor / 2).fields("exchange_"),
            **CpuTime().fields("read_"),
            "kernel_threads_s": 1.0,
            "gc_s": 0.0,
            "gc_passes": 0,
            "exchange_s": floor,
            "read_s": 0.01,
            "batches": 3,
            "messages": 30,
            "bytes": 2_000_000,
            "largest_batch_bytes": 1_000_000,
        },
        "floor": {
            "wall_s": floor,
            "exchange_s": floor,
            "walls_s": [floor, floor, floor],
            **CpuTime(0.0, floor / 2).fields(),
            "cpus_s": [floor / 2] * 3,
            "kernel_threads_s": [0.5, 1.0, 2.0],
        },
        "profile": {"profiled_s": 2 * ours, "categories": {"model (core)": 3.0, "diff": 1.0}},
    }


def test_the_target_is_judged_at_100k_only_and_the_table_says_so() -> None:
    records = [_record(10_000, 9.0, 2.0), _record(100_000, 30.0, 10.0)]
    checks = targets(records)
    assert [(name.startswith("100k uniform"), held) for name, _, held in checks] == [(True, False)]
    assert targets([_record(100_000, 19.0, 10.0)])[0][2] is True
    document = {
        "when": "2026-11-29T06:00:00+00:00",
        "commit": "abc",
        "command": "make bench-floor",
        "machine": {"nproc": 2, "kernel": "6.1"},
        "load_before": 3.0,
        "load_after": 4.0,
        "records": records,
    }
    text = render(document, "x.json")
    assert "| 100k | uniform | 30.00 (1.00 + 29.00) |" in text
    # CPU: ours 15 = core 7.5 + backend 2.5 + kernel 5, the floor 5; with the deferred
    # work (the floor's median kernel threads, 1) on both sides, 16 over 6.
    assert "| 100k | uniform | 15.00 (14.50 + 0.50) | 7.50 | 2.50 | 5.00 (0.00 + 5.00) |" in text
    assert "| 3.0x | 2.7x | 1.0x |" in text
    assert "CPU 15.0 s against 5.0 s: 3.0x (wall 30.0 s against 10.0 s: 3.0x)" in text
    assert "**missed**" in text
    assert "| 10k | uniform | 18.0 | 75 % | 25 % |" in text


def test_cpu_times_add_and_a_timed_backend_counts_its_syncs() -> None:
    assert CpuTime(1.0, 2.0) + CpuTime(0.5, 0.25) == CpuTime(1.5, 2.25)
    assert CpuTime(1.0, 2.0).fields("x_") == {"x_user_s": 1.0, "x_system_s": 2.0, "x_cpu_s": 3.0}

    class Spinning:
        family = IPFamily.IPV4
        syncs = 0

        def sync(self, snapshot: Any, changes: SyncChanges) -> None:
            self.syncs += 1
            sum(range(200_000))  # some CPU time to count

        def cleanup(self) -> None:
            pass

    inner = Spinning()
    timed = TimedBackend(inner)
    assert timed.family is IPFamily.IPV4
    timed.sync(None, SyncChanges(full=True))  # type: ignore[arg-type]
    timed.sync(None, SyncChanges(full=True))  # type: ignore[arg-type]
    assert inner.syncs == 2 and timed.cpu.total_s > 0


def test_kernel_threads_count_from_where_they_were_and_an_ended_one_for_nothing() -> None:
    before = {("7", "100"): 5_000_000_000, ("8", "100"): 1_000_000_000, ("9", "50"): 10}
    # 7 ran 0.5 s more, 8 ended, 9's pid was reused by a thread started since (0.25 s).
    now = {("7", "100"): 5_500_000_000, ("9", "900"): 250_000_000}
    assert kernel_threads_s(before, now) == pytest.approx(0.75)
    threads = kernel_threads()  # this machine's: kthreadd (pid 2) at least, when /proc shows it
    assert all(ran >= 0 for ran in threads.values())
    assert kernel_threads_s(threads) >= 0
