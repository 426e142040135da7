"""A full sync's element batches committed by the socket's writer thread against the same
sync committing each batch before it goes on (issue 32), side by side in one run.

    python -m bench.pipeline --services 30000 --rounds 3

As root. For each round, each writer in turn (alternating, so both see the same load on
a shared machine), a fresh child process in a fresh namespace runs the in-process full
sync :mod:`bench.proxyproc` times (:meth:`~bench.proxyproc.BenchProxy.cold`: N Services x
10 endpoints, the dicts in memory to the rules committed) over the owned table's
executor, with ``pipelined_elements`` on or off
(:class:`~kubeproxy.backends.nftables.backend.NftablesBackend`). Reported per run: the
wall time; the process's CPU time (user and system, every thread's: the pipeline moves
the kernel's work to another thread, it does not remove it); the CPU time of the thread
that syncs and how long it waited for the writer thread, whose sum is about the wall
time on a machine with a core to spare (other work on the cores stretches the wall time,
not these); the peak resident size; how many batches the writer thread sent. The
collector is held as the daemon holds it. Prints one line per run and the medians; with
``--results DIR`` writes the records there as JSON. Not part of ``make bench`` nor of
``make test``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness import module_in_netns
from bench.netns import namespace
from kubeproxy.objects import IPFamily

WRITERS = ("synchronous", "pipelined")
CHILD_TIMEOUT_S = 1800.0


def child(services: int, writer: str, netns: str) -> dict[str, Any]:
    """One full sync in this process (see the module); its figures."""
    from bench.proxyproc import BenchProxy, bench_config
    from bench.synthetic import build_services
    from kubeproxy.backends.nftables.backend import NftablesBackend
    from kubeproxy.backends.nftables.owner import OwnedNftables
    from kubeproxy.daemon.gctuning import GcTuner

    config = bench_config()
    executor = OwnedNftables(netns)
    backend = NftablesBackend(
        IPFamily.IPV4, config, executor=executor, pipelined_elements=writer == "pipelined"
    )
    proxy = BenchProxy(build_services(services, 10), backend, config=config)
    tuner = GcTuner([IPFamily.IPV4])
    tuner.hold()
    before = resource.getrusage(resource.RUSAGE_SELF)
    thread_before = resource.getrusage(resource.RUSAGE_THREAD)
    cold = proxy.cold()
    thread_after = resource.getrusage(resource.RUSAGE_THREAD)
    after = resource.getrusage(resource.RUSAGE_SELF)
    tuner.release()
    if not cold["ok"]:
        raise SystemExit(f"the full sync failed: {cold}")
    return {
        "services": services,
        "writer": writer,
        "wall_s": cold["total_s"],
        "sync_s": cold["sync_s"],
        "user_s": after.ru_utime - before.ru_utime,
        "system_s": after.ru_stime - before.ru_stime,
        "sync_thread_s": thread_after.ru_utime
        - thread_before.ru_utime
        + thread_after.ru_stime
        - thread_before.ru_stime,
        "peak_rss_kb": after.ru_maxrss,
        "posted": executor.channel.posted,
        "posting_wait_s": executor.channel.posting_wait_s,
        "load": os.getloadavg()[0],
    }


def run(services: int, writer: str) -> dict[str, Any]:
    """:func:`child` in a child process in a fresh namespace."""
    with namespace("pipe") as netns:
        argv = ["child", "--services", str(services), "--writer", writer, "--netns", netns]
        return module_in_netns(netns, "bench.pipeline", *argv, timeout_s=CHILD_TIMEOUT_S)


def _line(record: dict[str, Any]) -> str:
    cpu = record["user_s"] + record["system_s"]
    return (
        f"{record['services']} {record['writer']:>11}: wall {record['wall_s']:6.2f} s"
        f"  CPU {cpu:6.2f} s (user {record['user_s']:.2f}, system {record['system_s']:.2f};"
        f" the sync's thread {record['sync_thread_s']:.2f})"
        f"  peak RSS {record['peak_rss_kb'] / 1024:5.0f} MiB  posted {record['posted']}"
        f" (waited {record['posting_wait_s']:.2f} s)"
        f"  load {record['load']:.1f}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``child ...`` (in a namespace; one JSON line) or the whole run (see the module)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "child":
        parser = argparse.ArgumentParser(prog="python -m bench.pipeline child")
        parser.add_argument("--services", type=int, required=True)
        parser.add_argument("--writer", choices=WRITERS, required=True)
        parser.add_argument("--netns", required=True)
        options = parser.parse_args(args[1:])
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        print(json.dumps(child(options.services, options.writer, options.netns)), flush=True)
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__)
    parser.add_argument("--services", type=int, default=30_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results", type=Path)
    options = parser.parse_args(args)
    records = []
    for _round in range(options.rounds):
        for writer in WRITERS:
            record = run(options.services, writer)
            print(_line(record), flush=True)
            records.append(record)
    for writer in WRITERS:
        mine = [r for r in records if r["writer"] == writer]
        wall = statistics.median(r["wall_s"] for r in mine)
        cpu = statistics.median(r["user_s"] + r["system_s"] for r in mine)
        thread = statistics.median(r["sync_thread_s"] for r in mine)
        print(
            f"median {writer:>11}: wall {wall:6.2f} s  CPU {cpu:6.2f} s"
            f"  the sync's thread {thread:6.2f} s"
        )
    if options.results is not None:
        options.results.mkdir(parents=True, exist_ok=True)
        path = options.results / f"pipeline-{options.services}.json"
        path.write_text(json.dumps(records, indent=1) + "\n")
        print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
