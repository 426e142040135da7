"""Network programming under churn, end to end: API server to kernel commit (issue 29).

``kube-proxy-nftables`` runs as a node runs it, in a namespace of its own, watching the
fake API server (:mod:`bench.apiserverproc`, a process of its own in the same namespace).
Once its first full sync is done and :data:`WARMUP_S` of updates (not measured) have
built what the first changes build once, the fake updates EndpointSlices at a given rate
(each update flips the last endpoint of one slice, a Service's endpoint count going from
10 to 9 or back) and stamps each with the monotonic time it was handed the update; a
:class:`~bench.commitstamps.CommitStamper` in the benchmark process stamps every commit
of our table as its events arrive, with the Service addresses it changed. Each update's
latency is the time from its acceptance to the first commit after it that changes its
Service (:func:`~bench.commitstamps.match_updates`); an update no commit carried is
counted as missing.

Beside that, from the daemon itself over the same window (:func:`bench.daemonbench.churn`):
its CPU time (``/proc``: every thread, user and system) over the window, its partial
syncs per second and their mean duration, full syncs, and the p99 bucket of its own
``kubeproxy_network_programming_duration_seconds``.

The daemon, the fake API server and the stamping thread run at :data:`NICENESS` (-10;
``KPXB_PROGRAMMING_NICE`` changes it, 0 runs them as any other process): on this
project's two shared cores other developers' tests and VMs keep 10 to 15 processes
runnable, and at that load, unniced, the daemon and the API server were starved of CPU at
500 updates a second (the API server fell 3-5 s behind its schedule, syncs of 100
changes took 115 ms of wall time at 30k and 1 s at 100k) and the latency measured the
neighbours, not the proxy (``bench/results/20261129T023907Z-programming-vm.json``). The
CPU figures are the daemon's own process time either way.

Each runner (:data:`RUNNERS`) gets a fresh API server and a fresh daemon over the same
cluster, and the same sequence of updates (the fake's shuffled order is seeded): the
sync loop as it is shipped, and as it was (upstream's fixed rest of
``minSyncPeriod: 1s`` after every sync, which ``--iptables-min-sync-period=1s`` still
selects), side by side in one run. ``KPXB_PROGRAMMING_BASELINE=<git revision>`` adds a
third (:func:`baseline_runner`): the daemon as it was at that commit, its code exported
from git and put first on ``PYTHONPATH``, with today's defaults (paced), so a change to
the daemon is measured against the code it replaced in the same run.
"""

from __future__ import annotations

import functools
import os
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from bench.commitstamps import CommitStamper, match_updates
from bench.daemonbench import api_server, churn, daemon_argv, node_process, write_cluster
from bench.harness import REPO, percentile
from bench.synthetic import SyntheticService

__all__ = ["RUNNERS", "Runner", "Window", "baseline_runner", "measure", "thirds"]


NICENESS: Final = int(os.environ.get("KPXB_PROGRAMMING_NICE", "-10"))
"""The ``nice`` value the measured processes run at (see the module documentation)."""


WARMUP_S: Final = 2.0
"""Seconds of updates at the first window's rate before it, not measured."""


@dataclass(frozen=True, slots=True)
class Runner:
    """A way to run the sync loop: its name in the results and the daemon's flags."""

    name: str
    flags: tuple[str, ...] = ()
    before: bool = False
    code: str | None = None
    """A git revision whose code the daemon runs instead of the working tree's."""


RUNNERS: Final = (
    Runner("paced"),
    Runner("minSyncPeriod 1s (before)", ("--iptables-min-sync-period=1s",), before=True),
)
"""The shipped sync loop (nftables mode's default: paced by the sync's cost) and the one
it replaced (a fixed rest of 1 s, upstream's default, still what an operator setting
``minSyncPeriod: 1s`` gets)."""


def baseline_runner(revision: str) -> Runner:
    """The daemon as it was at ``revision`` (a commit, a branch), paced as shipped then."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", f"{revision}^{{commit}}"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return Runner(f"paced at {commit} (before)", before=True, code=commit)


def _exported(revision: str, workdir: Path) -> Path:
    """``revision``'s tree, exported once under ``workdir`` (``git archive``)."""
    target = workdir / f"code-{revision}"
    if not target.exists():
        target.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "archive", revision], cwd=REPO, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


@dataclass(frozen=True, slots=True)
class Window:
    """``rate`` EndpointSlice updates a second for ``seconds``."""

    rate: float
    seconds: float


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 2)


def thirds(latencies: Sequence[float | None]) -> dict[str, float | None]:
    """The p50 and p99 (ms) of the reached updates of the window's first third and of
    its last (in the order the updates were made): a queue shows as a last third's
    median above the first's (:func:`bench.programming_report.queued` judges it).

    Medians, not the p99s of two halves: a few hundred milliseconds' stall of a shared
    machine moves a half's p99 by as much, wherever it falls (a quiet re-measure at 30k
    Services and 500 updates a second had p99s of 164 and 383 ms in the two halves and
    no queue), while a queue moves every update after it began."""
    third = len(latencies) // 3
    first = [x for x in latencies[:third] if x is not None]
    last = [x for x in latencies[len(latencies) - third :] if x is not None] if third else []

    def median(values: list[float]) -> float | None:
        return _ms(statistics.median(values)) if values else None

    return {
        "p50_first_third_ms": median(first),
        "p50_last_third_ms": median(last),
        "p99_first_third_ms": _ms(percentile(first, 0.99)),
        "p99_last_third_ms": _ms(percentile(last, 0.99)),
    }


def _window_figures(
    daemon: dict[str, Any], latencies: Sequence[float | None], lost: int
) -> dict[str, Any]:
    ordered = sorted(x for x in latencies if x is not None)
    syncs = daemon["partial_syncs"]
    return {
        "updates": daemon["changes"],
        "reached": len(ordered),
        "missing": len(latencies) - len(ordered),
        "events_lost": lost,
        "p50_ms": _ms(statistics.median(ordered)) if ordered else None,
        "p90_ms": _ms(percentile(ordered, 0.9)),
        "p99_ms": _ms(percentile(ordered, 0.99)),
        "max_ms": _ms(ordered[-1]) if ordered else None,
        "mean_ms": _ms(statistics.fmean(ordered)) if ordered else None,
        "cpu_share": daemon["cpu_share"],
        "cpu_s": daemon["cpu_s"],
        "window_s": daemon["window_s"],
        "syncs_per_s": daemon["syncs_per_s"],
        "partial_syncs": daemon["partial_syncs"],
        "full_syncs": daemon["full_syncs"],
        "partial_mean_ms": daemon["partial_mean_ms"],
        "metric_p50_s": daemon["programming_p50_s"],
        "metric_p99_s": daemon["programming_p99_s"],
        "metric_samples": daemon["programming_samples"],
        "late_max_s": daemon["late_max_s"],
        "changes_per_sync": daemon["changes"] / syncs if syncs else None,
        **thirds(latencies),
        "load_1m": os.getloadavg()[0],
    }


def _all_committed(stamper: CommitStamper) -> Callable[[dict[str, Any]], bool]:
    """Whether every update of a window's answer has reached the kernel (and a moment
    passed for its sync's work after the commit to end, so the CPU counts it)."""

    def check(fed: dict[str, Any]) -> bool:
        updates = [(float(at), str(address)) for at, address in fed["updates"]]
        return match_updates(updates[-200:], stamper.commits).missing == 0

    return check


def measure(
    netns: str,
    services: Sequence[SyntheticService],
    runner: Runner,
    windows: Sequence[Window],
    workdir: Path,
    *,
    sync_timeout_s: float = 900.0,
    settle_s: float = 30.0,
    raw: list[Any] | None = None,
) -> list[dict[str, Any]]:
    """Start the API server and the daemon (with ``runner``'s flags) in ``netns`` over
    ``services``, then run each window of updates in turn; one record per window."""
    manifests = workdir / "manifests"
    if not manifests.exists():
        write_cluster(manifests, services)
    records: list[dict[str, Any]] = []
    with ExitStack() as stack:
        api = stack.enter_context(api_server(netns, manifests, sync_timeout_s, niceness=NICENESS))
        argv = daemon_argv(api_port=api.ready["port"], extra=runner.flags)
        if runner.code is not None:
            argv = ["env", f"PYTHONPATH={_exported(runner.code, workdir)}", *argv]
        if NICENESS:
            argv = ["nice", "-n", str(NICENESS), *argv]
        log = workdir / f"daemon-{re.sub(r'[^A-Za-z0-9]+', '-', runner.name)}.log"
        node = stack.enter_context(node_process(netns, argv, log=log))
        first_sync_s = node.synced(sync_timeout_s)
        stamper = stack.enter_context(CommitStamper(netns, niceness=NICENESS))
        if windows:
            # Not measured: the first changes after the first sync build what later ones
            # reuse (a dispatch class for an endpoint count no Service had: a rule bound
            # to the 30k-element map, 20 ms of kernel time each, three in the first
            # seconds), once in the daemon's life; the windows measure the churn.
            api.request("churn", timeout_s=WARMUP_S + 120, seconds=WARMUP_S, rate=windows[0].rate)
            time.sleep(1.0)
        for window in windows:
            feed = functools.partial(
                api.request,
                "churn",
                timeout_s=window.seconds + 120,
                seconds=window.seconds,
                rate=window.rate,
                record=True,
            )
            daemon = churn(node, feed, settle_s=settle_s, settled=_all_committed(stamper))
            updates = [(float(at), str(address)) for at, address in daemon.pop("updates")]
            match = match_updates(updates, stamper.commits)
            if raw is not None:
                raw.append((window, updates, match.latencies, list(stamper.commits)))
            records.append(
                {
                    "runner": runner.name,
                    "before": runner.before,
                    "flags": list(runner.flags),
                    "services": len(services),
                    "rate": window.rate,
                    "seconds": window.seconds,
                    "first_sync_s": first_sync_s,
                    "niceness": max(-20, min(19, os.nice(0) + NICENESS)),
                    "bench_niceness": os.nice(0),
                    **_window_figures(daemon, match.latencies, stamper.lost),
                }
            )
    return records
