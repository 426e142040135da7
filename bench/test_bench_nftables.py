"""Benchmarks of the nftables backend (issue 4), with upstream's structure side by side.

Run by ``make bench`` (everything) and ``make bench-quick`` (``-m quick``); never by
``make test``. Every measurement runs in fresh network namespaces (``kpxb-*``), deleted
afterwards. Figures land in ``bench/results/`` (see :mod:`bench.report`).

* cold full sync: our proxy in a fresh child process, fed N Services x 10 endpoints as
  Kubernetes dicts, one ``sync_now()``; time from the first handler call to the committed
  rules, and the child's peak RSS (libnftables runs inside it);
* upstream's structure (:mod:`bench.upstream_structure`) applied with ``nft -f``: wall
  time and nft's peak RSS;
* incremental sync: one endpoint changed / one Service added / one removed, then a sync;
  the median of repeated rounds;
* first-connection latency: real TCP connects from a client namespace through the node
  namespace holding the rules to the endpoint namespace.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from bench.dataplane import measure_connects, topology
from bench.harness import ApplyResult, ProxyProcess, apply_nft_file, proxy_process
from bench.netns import in_netns, namespace
from bench.report import OURS, UPSTREAM, Results
from bench.synthetic import CLUSTER_PORT, TARGET_PORT, build_services, synthetic_service
from bench.upstream_structure import write_upstream_ruleset

K = 1000
ENDPOINTS = 10
AFFINITY_SECONDS = 10800
INCREMENTAL_ROUNDS = 25
INCREMENTAL_WARMUP = 3
CONNECTS = 2000
# Upstream's structure at 10k Services takes minutes (it grows faster than linearly).
UPSTREAM_TIMEOUT_S = float(os.environ.get("KPXB_UPSTREAM_TIMEOUT_S", "1200"))

quick = pytest.mark.quick


def _pedantic(benchmark: BenchmarkFixture, target: Callable[[], object], rounds: int) -> None:
    """Time ``target`` ``rounds`` times, once per round (pytest-benchmark is untyped here)."""
    benchmark.pedantic(target, rounds=rounds, iterations=1)  # type: ignore[no-untyped-call]


def _mb(kb: int) -> float:
    return kb / 1024


def _map_size(netns: str, name: str) -> int:
    """How many elements ``map ip kube-proxy NAME`` holds: proof the rules were committed."""
    result = subprocess.run(
        in_netns(netns, ["nft", "-j", "list", "map", "ip", "kube-proxy", name]),
        capture_output=True,
        text=True,
        check=True,
    )
    for entry in json.loads(result.stdout)["nftables"]:
        if "map" in entry:
            return len(entry["map"].get("elem", []))
    raise AssertionError(f"no map {name} in the listing")


# Cold full sync ------------------------------------------------------------------------

COLD_CASES = [
    pytest.param(1 * K, False, marks=quick, id="1k"),
    pytest.param(1 * K, True, marks=quick, id="1k-affinity"),
    pytest.param(5 * K, False, marks=quick, id="5k"),
    pytest.param(5 * K, True, id="5k-affinity"),
    pytest.param(10 * K, False, id="10k"),
    pytest.param(10 * K, True, id="10k-affinity"),
    pytest.param(30 * K, False, id="30k"),
    pytest.param(30 * K, True, id="30k-affinity"),
]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize(("services", "affinity"), COLD_CASES)
def test_cold_sync(
    benchmark: BenchmarkFixture, results: Results, services: int, affinity: bool
) -> None:
    benchmark.group = "cold full sync"
    answers: list[dict[str, Any]] = []
    with (
        namespace("cold") as netns,
        proxy_process(
            netns, services, ENDPOINTS, affinity_seconds=AFFINITY_SECONDS if affinity else 0
        ) as proxy,
    ):
        _pedantic(benchmark, lambda: answers.append(proxy.request("cold")), rounds=1)
        peaks = proxy.request("rss")
        installed = _map_size(netns, "service-ips")
    answer = answers[0]
    record = results.add(
        "cold",
        OURS,
        services=services,
        endpoints=ENDPOINTS,
        affinity=affinity,
        seconds=answer["total_s"],
        feed_s=answer["feed_s"],
        sync_s=answer["sync_s"],
        peak_rss_mb=_mb(peaks["maxrss_self_kb"]),
        peak_children_rss_mb=_mb(peaks["maxrss_children_kb"]),
        rss_before_mb=_mb(proxy.ready["rss_now_kb"]),
        ok=answer["ok"],
    )
    benchmark.extra_info.update(record)
    assert answer["ok"]
    assert installed == services


UPSTREAM_CASES = [
    pytest.param(1 * K, False, marks=quick, id="1k"),
    pytest.param(1 * K, True, id="1k-affinity"),
    pytest.param(5 * K, False, marks=quick, id="5k"),
    pytest.param(10 * K, False, id="10k"),
]


@pytest.mark.timeout(UPSTREAM_TIMEOUT_S + 600)
@pytest.mark.parametrize(("services", "affinity"), UPSTREAM_CASES)
def test_upstream_cold(
    benchmark: BenchmarkFixture,
    results: Results,
    tmp_path: Path,
    services: int,
    affinity: bool,
) -> None:
    benchmark.group = "cold full sync"
    ruleset = tmp_path / "upstream.nft"
    synthetic = build_services(
        services, ENDPOINTS, affinity_seconds=AFFINITY_SECONDS if affinity else 0
    )
    lines = write_upstream_ruleset(ruleset, synthetic)
    outcome: list[ApplyResult] = []
    with namespace("upstream") as netns:
        _pedantic(
            benchmark,
            lambda: outcome.append(apply_nft_file(netns, ruleset, timeout_s=UPSTREAM_TIMEOUT_S)),
            rounds=1,
        )
        applied = outcome[0]
        installed = _map_size(netns, "service-ips") if applied.ok else 0
    record = results.add(
        "upstream_cold",
        UPSTREAM,
        services=services,
        endpoints=ENDPOINTS,
        affinity=affinity,
        seconds=applied.seconds,
        lines=lines,
        peak_rss_mb=applied.peak_rss_mb,
        ok=applied.ok,
        timed_out=applied.timed_out,
    )
    benchmark.extra_info.update(record)
    assert applied.ok or applied.timed_out, applied.stderr
    assert installed == services or applied.timed_out


# Incremental sync ----------------------------------------------------------------------


@pytest.fixture(
    scope="class",
    params=[pytest.param(1 * K, marks=quick, id="1k"), pytest.param(10 * K, id="10k")],
)
def synced_proxy(request: pytest.FixtureRequest) -> Iterator[tuple[int, ProxyProcess]]:
    """Our proxy after a cold sync of N Services, kept for one class's incremental rounds."""
    services: int = request.param
    with namespace("incr") as netns, proxy_process(netns, services, ENDPOINTS) as proxy:
        proxy.request("cold")
        yield services, proxy


class TestIncrementalSync:
    """One cold sync per size (the class-scoped proxy ends with the class), then changes."""

    @pytest.mark.timeout(900)
    @pytest.mark.parametrize("op", ["endpoint", "add", "remove"])
    def test_incremental_sync(
        self,
        benchmark: BenchmarkFixture,
        results: Results,
        synced_proxy: tuple[int, ProxyProcess],
        op: str,
    ) -> None:
        services, proxy = synced_proxy
        benchmark.group = f"incremental sync: {op}"
        for _ in range(INCREMENTAL_WARMUP):
            proxy.request(op)
        timings: list[float] = []
        _pedantic(
            benchmark,
            lambda: timings.append(proxy.request(op)["seconds"]),
            rounds=INCREMENTAL_ROUNDS,
        )
        ordered = sorted(timings)
        record = results.add(
            "incremental",
            OURS,
            services=services,
            endpoints=ENDPOINTS,
            op=op,
            rounds=len(ordered),
            median_ms=1000 * statistics.median(ordered),
            p90_ms=1000 * ordered[int(0.9 * (len(ordered) - 1))],
            max_ms=1000 * ordered[-1],
            ok=True,
        )
        benchmark.extra_info.update(record)
        assert len(timings) == INCREMENTAL_ROUNDS


# Data plane ----------------------------------------------------------------------------

DATAPLANE_CASES = [
    pytest.param(OURS, 1 * K, marks=quick, id="ours-1k"),
    pytest.param(OURS, 10 * K, id="ours-10k"),
    pytest.param(OURS, 30 * K, id="ours-30k"),
    pytest.param(UPSTREAM, 1 * K, id="upstream-1k"),
]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize(("subject", "services"), DATAPLANE_CASES)
def test_first_connection(results: Results, tmp_path: Path, subject: str, services: int) -> None:
    # Two extra Services on top: one with 2 endpoints, one with 1000.
    narrow, wide = synthetic_service(services + 10, 2), synthetic_service(services + 11, 1000)
    middle = synthetic_service(services // 2, ENDPOINTS)
    targets = {
        "direct": (str(middle.endpoints[0]), TARGET_PORT),
        "service-10": (str(middle.cluster_ip), CLUSTER_PORT),
        "service-2": (str(narrow.cluster_ip), CLUSTER_PORT),
        "service-1000": (str(wide.cluster_ip), CLUSTER_PORT),
    }
    with topology() as topo:
        if subject == OURS:
            extras = [(narrow.index, 2), (wide.index, 1000)]
            with proxy_process(topo.node, services, ENDPOINTS, extras=extras) as proxy:
                proxy.request("cold")
        else:
            ruleset = tmp_path / "upstream.nft"
            synthetic = [*build_services(services, ENDPOINTS), narrow, wide]
            write_upstream_ruleset(ruleset, synthetic)
            applied = apply_nft_file(topo.node, ruleset)
            assert applied.ok, applied.stderr
        assert _map_size(topo.node, "service-ips") == services + 2
        stats = measure_connects(topo, targets, count=CONNECTS)
    direct = stats["direct"].p50_us
    for case, latency in stats.items():
        results.add(
            "dataplane",
            subject,
            services=services,
            case=case,
            overhead_us=latency.p50_us - direct,
            **asdict(latency),
        )
    for case, latency in stats.items():
        # A ClusterIP answers only through DNAT: nothing else routes 10.96.0.0/12.
        assert latency.failures <= CONNECTS // 100, f"{case}: {latency.failures} failures"
