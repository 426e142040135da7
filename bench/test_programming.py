"""Network programming under churn, API server to kernel, at 1k, 30k and 100k (issue 29).

::

    make bench BENCH_ARGS='-k programming'     # about 20 minutes here

For each size, the daemon as shipped (the sync loop paced by what each sync costs) and
as it was (``--iptables-min-sync-period=1s``: upstream's fixed rest of one second), each
in a fresh namespace with a fresh fake API server over the same cluster, take 50
EndpointSlice updates a second for :data:`BASE_SECONDS`, then ten times that for
:data:`FAST_SECONDS` (:mod:`bench.programming` says what is measured and how). Results go
to ``bench/results/<date>-programming-<host>.json`` and ``bench/results/programming.md``,
apart from ``latest.md``; ``python -m bench.readme`` carries them into docs/benchmarks.md
(and a line into the README).
``KPXB_PROGRAMMING_BASELINE=main`` (any git revision) adds the daemon as it was there
(:func:`bench.programming.baseline_runner`).
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.conftest import RESULTS_DIR
from bench.netns import namespace
from bench.programming import RUNNERS, Window, baseline_runner, measure
from bench.programming_report import KIND, render
from bench.report import write_document
from bench.synthetic import build_services

K = 1000
ENDPOINTS = 10
BASE_RATE = 50.0
# KPXB_PROGRAMMING_SECONDS shortens both windows for a trial run (base, fast).
BASE_SECONDS, FAST_SECONDS = (
    float(x) for x in os.environ.get("KPXB_PROGRAMMING_SECONDS", "60,30").split(",")
)
SYNC_TIMEOUT_S = float(os.environ.get("KPXB_SYNC_TIMEOUT_S", "600"))
WINDOWS = (Window(BASE_RATE, BASE_SECONDS), Window(10 * BASE_RATE, FAST_SECONDS))
# KPXB_PROGRAMMING_BASELINE=<git revision> adds the daemon as it was there, side by side.
BASELINE = os.environ.get("KPXB_PROGRAMMING_BASELINE")


class ProgrammingResults:
    """The run's records, written as one JSON document and a Markdown table."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def write(self) -> None:
        if not self.records:
            return
        fields = {
            "pytest_args": shlex.join(sys.argv[1:]),
            "minutes": (time.monotonic() - self.started) / 60,
            "endpoints": ENDPOINTS,
            "records": self.records,
        }
        command = "pytest bench/test_programming.py"
        path, document = write_document(RESULTS_DIR, KIND, command, fields)
        (RESULTS_DIR / f"{KIND}.md").write_text(
            "# Network programming under churn (latest run)\n\n" + render(document, path.name)
        )


@pytest.fixture(scope="module")
def programming_results() -> Iterator[ProgrammingResults]:
    results = ProgrammingResults()
    try:
        yield results
    finally:
        results.write()


@pytest.mark.timeout(2 * (SYNC_TIMEOUT_S + BASE_SECONDS + FAST_SECONDS) + 900)
@pytest.mark.parametrize(
    "services",
    [
        pytest.param(1 * K, id="1k"),
        pytest.param(30 * K, id="30k"),
        pytest.param(100 * K, id="100k"),
    ],
)
def test_programming(
    programming_results: ProgrammingResults, tmp_path: Path, services: int
) -> None:
    """Both runners over the same cluster and the same updates, one after the other."""
    cluster = build_services(services, ENDPOINTS)
    runners = (*RUNNERS, baseline_runner(BASELINE)) if BASELINE else RUNNERS
    for runner in runners:
        with namespace("np") as netns:
            records = measure(
                netns, cluster, runner, WINDOWS, tmp_path, sync_timeout_s=SYNC_TIMEOUT_S
            )
        programming_results.records.extend({**r, "endpoints": ENDPOINTS} for r in records)
        for record in records:
            assert record["reached"] > 0, record
