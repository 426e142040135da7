"""The micro-benchmarks run, and ``make bench-micro`` compares every one with the baseline.

Timing is never checked here (``make test`` is not a benchmark): each benchmark runs once
(``--benchmark-disable``), so its own assertions hold, and the committed baseline must hold
exactly the benchmarks the file defines.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MICRO = REPO / "bench" / "test_micro.py"
BASELINE = REPO / "bench" / "results" / "micro-baseline.json"


def test_every_micro_benchmark_runs() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--noconftest",  # bench/conftest.py wants root for the kernel benchmarks
            "--benchmark-disable",
            "-q",
            str(MICRO),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    defined = re.findall(r"^def (test_\w+)\(benchmark", MICRO.read_text(), re.MULTILINE)
    assert f"{len(defined)} passed" in result.stdout


def test_the_baseline_holds_every_micro_benchmark() -> None:
    defined = set(re.findall(r"^def (test_\w+)\(benchmark", MICRO.read_text(), re.MULTILINE))
    saved = {b["name"] for b in json.loads(BASELINE.read_text())["benchmarks"]}
    assert saved == defined
    makefile = (REPO / "Makefile").read_text()
    assert "--benchmark-compare=$(MICRO_BASELINE)" in makefile
    assert f"MICRO_BASELINE := {BASELINE.relative_to(REPO)}" in makefile
