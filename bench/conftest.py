"""Benchmark session: root check, the ``quick`` marker, and results written at the end."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.report import Results, recorded_command

# KPXB_RESULTS_DIR sends a trial run's files elsewhere (bench/results/ holds the record).
RESULTS_DIR = Path(
    os.environ.get("KPXB_RESULTS_DIR") or Path(__file__).resolve().parent / "results"
)
_WRITTEN = pytest.StashKey[list[Path]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "quick: part of `make bench-quick` (a few minutes)")
    config.stash[_WRITTEN] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.geteuid() != 0:
        pytest.exit("the benchmarks need root (they create network namespaces)", returncode=2)


@pytest.fixture(scope="session")
def results(request: pytest.FixtureRequest) -> Iterator[Results]:
    """The run's records; written to bench/results/ when the session ends."""
    command = recorded_command(shlex.join(["pytest", *sys.argv[1:]]))
    collected = Results(command)
    try:
        yield collected
    finally:
        if collected.records:
            request.config.stash[_WRITTEN].extend(collected.write(RESULTS_DIR))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    written = terminalreporter.config.stash.get(_WRITTEN, [])
    if written:
        terminalreporter.write_sep("-", "benchmark results")
        for path in written:
            terminalreporter.write_line(str(path))
        markdown = next((p for p in written if p.suffix == ".md"), None)
        if markdown is not None:
            terminalreporter.write_line(markdown.read_text())
