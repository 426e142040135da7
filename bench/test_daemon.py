"""The whole process a node runs, next to the in-process figures of the same run (issue 20).

``kube-proxy-nftables`` as a daemon (:mod:`bench.daemonbench`), in a fresh namespace,
fed through the fake API server (lists in pages of 500) or a manifests directory (JSON,
and YAML at 10k and 30k): when ``/livez`` and ``/healthz`` answer, the first sync (from
the process start), its peak memory, the daemon's own partial-sync metric over one
endpoint change at a time, at 100k where its memory goes (source, proxier, backend), and
a churn through the API at 30k. Compared by :func:`bench.targets.daemon_targets` with
``test_control_plane``'s in-process cold and incremental syncs of the same run.

The cluster is :func:`cluster` (N Services x 10 endpoints); a benchmark of another shape
passes its own list of :class:`~bench.synthetic.SyntheticService`.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from bench.daemonbench import DaemonCase, run_case
from bench.harness import percentile, proxy_process
from bench.netns import namespace
from bench.report import Results
from bench.subjects import NFTABLES
from bench.synthetic import SyntheticService, build_services

K = 1000
ENDPOINTS = 10
ROUNDS = 25  # partial syncs timed per case, after 3 untimed ones
CHURN_RATE = 50.0
CHURN_SECONDS = 60.0
SYNC_TIMEOUT_S = float(os.environ.get("KPXB_SYNC_TIMEOUT_S", "600"))

quick = pytest.mark.quick


def cluster(services: int) -> list[SyntheticService]:
    """The cluster the daemon benchmarks read: ``services`` Services x 10 endpoints."""
    return build_services(services, ENDPOINTS)


# (source, Services, partial syncs timed, memory split). The first sync and start-up are
# measured in every case; the YAML directory only at 10k and 30k (its parsing alone is
# most of a start there, see docs/operators.md), the split at 100k.
DAEMON_CASES = [
    pytest.param("api", 1 * K, 5, False, marks=quick, id="api-1k"),
    pytest.param("manifests", 1 * K, 5, False, marks=quick, id="manifests-1k"),
    pytest.param("api", 10 * K, 0, False, id="api-10k"),
    pytest.param("manifests", 10 * K, 0, False, id="manifests-10k"),
    pytest.param("manifests-yaml", 10 * K, 0, False, id="manifests-yaml-10k"),
    pytest.param("api", 30 * K, ROUNDS, False, id="api-30k"),
    pytest.param("manifests", 30 * K, ROUNDS, False, id="manifests-30k"),
    pytest.param("manifests-yaml", 30 * K, 0, False, id="manifests-yaml-30k"),
    pytest.param("api", 100 * K, ROUNDS, True, id="api-100k"),
    pytest.param("manifests", 100 * K, ROUNDS, True, id="manifests-100k"),
]


def _flat(figures: dict[str, Any]) -> dict[str, Any]:
    split = figures.pop("split", None) or {}
    figures.pop("churn", None)
    for key in ("source_mb", "proxier_mb", "backend_mb"):
        if key in split:
            figures[f"split_{key}"] = split[key]
    if "rss_mb" in split:
        figures["split_rss_mb"] = split["rss_mb"]
    return figures


@pytest.mark.timeout(3 * SYNC_TIMEOUT_S + 900)
@pytest.mark.parametrize(("source", "services", "rounds", "split"), DAEMON_CASES)
def test_daemon(
    results: Results, tmp_path: Path, source: str, services: int, rounds: int, split: bool
) -> None:
    """Start-up, first sync, memory and partial syncs of the daemon a node runs."""
    case = DaemonCase(source, rounds=rounds, split=split)
    with namespace("dm") as netns:
        figures = run_case(netns, cluster(services), case, tmp_path, sync_timeout_s=SYNC_TIMEOUT_S)
    results.add("daemon", NFTABLES.name, endpoints=ENDPOINTS, **_flat(figures))
    assert figures["livez_s"] is not None and figures["healthz_ok_s"] is not None


@pytest.mark.timeout(2 * SYNC_TIMEOUT_S + 900)
@pytest.mark.parametrize(
    ("services", "seconds"),
    [
        pytest.param(1 * K, 10.0, marks=quick, id="1k-10s"),
        pytest.param(30 * K, CHURN_SECONDS, id="30k"),
    ],
)
def test_daemon_churn(results: Results, tmp_path: Path, services: int, seconds: float) -> None:
    """Endpoint changes through the API at :data:`CHURN_RATE` a second: the daemon's
    CPU, its partial syncs and the network-programming latency it reports."""
    case = DaemonCase("api", churn_s=seconds, churn_rate=CHURN_RATE)
    with namespace("dc") as netns:
        figures = run_case(netns, cluster(services), case, tmp_path, sync_timeout_s=SYNC_TIMEOUT_S)
    churn = figures["churn"]
    results.add(
        "daemon_churn",
        NFTABLES.name,
        services=services,
        endpoints=ENDPOINTS,
        source="api",
        rate=CHURN_RATE,
        **churn,
        ok=bool(churn["partial_syncs"]) and churn["full_syncs"] == 0,
    )
    assert churn["partial_syncs"] > 0


# A daemon syncing once a second (minSyncPeriod 1 s, the default before issue 29; an
# isolated change after an idle second today) syncs with cold caches, where
# test_control_plane's incremental rounds run back to back: the same in-process proxy at
# that cadence tells what the idle second alone costs a sync.
CADENCE_S = 1.0
CADENCE_WARMUP = 3


@pytest.mark.timeout(2 * SYNC_TIMEOUT_S + 600)
@pytest.mark.parametrize(
    "services",
    [
        pytest.param(1 * K, marks=quick, id="1k"),
        pytest.param(30 * K, id="30k"),
        pytest.param(100 * K, id="100k"),
    ],
)
def test_in_process_at_the_daemons_cadence(results: Results, services: int) -> None:
    """test_control_plane's endpoint change, one every :data:`CADENCE_S` seconds."""
    with (
        namespace("cad") as netns,
        proxy_process(netns, services, ENDPOINTS, backend=NFTABLES.backend) as proxy,
    ):
        assert proxy.request("cold", timeout_s=SYNC_TIMEOUT_S)["ok"]
        seconds = []
        for number in range(CADENCE_WARMUP + ROUNDS):
            time.sleep(CADENCE_S)
            answer = proxy.request("endpoint")
            if number >= CADENCE_WARMUP:
                seconds.append(answer["seconds"])
    ordered = sorted(seconds)
    results.add(
        "incremental_cadence",
        NFTABLES.name,
        services=services,
        endpoints=ENDPOINTS,
        op="endpoint",
        gap_s=CADENCE_S,
        rounds=len(ordered),
        median_ms=1000 * statistics.median(ordered),
        p90_ms=1000 * (percentile(ordered, 0.9) or 0.0),
        max_ms=1000 * ordered[-1],
        ok=True,
    )
