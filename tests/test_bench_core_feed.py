"""The core's cold-start CPU benchmark (:mod:`bench.core_feed`, issue 32): it feeds the
whole cluster through the source into both families' trackers, and its command line runs
each checkout's child and keeps every run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.core_feed import feed, feed_proxiers, main
from bench.synthetic import build_services, realistic_services
from bench.wholeproc import write_manifests

REPO = Path(__file__).resolve().parent.parent


def test_every_port_with_endpoints_is_fed_and_categorised(tmp_path: Path) -> None:
    services = [*build_services(7, 3), *build_services(2, 0, first_index=7)]
    result = feed(write_manifests(tmp_path / "m", services))
    assert result["ports"] == 7  # the two without endpoints have nothing to categorise
    assert result["load_cpu_s"] > 0 and result["apply_cpu_s"] >= 0


def test_dual_stack_services_count_once_per_family(tmp_path: Path) -> None:
    services = realistic_services(60)
    expected = sum((2 if s.family == "dual" else 1) for s in services if s.endpoint_count)
    assert feed(write_manifests(tmp_path / "m", services))["ports"] == expected


def test_through_the_proxiers_the_same_ports_have_endpoints(tmp_path: Path) -> None:
    # Services to both families, each slice to its address type's: what the daemon does.
    manifests = write_manifests(tmp_path / "m", realistic_services(60))
    through = feed_proxiers(manifests)
    assert through["ports"] == feed(manifests)["ports"] > 0
    assert through["load_cpu_s"] > 0 and through["apply_cpu_s"] > 0


def test_the_command_line_alternates_checkouts_and_writes_every_run(tmp_path: Path) -> None:
    python = sys.executable
    code = main(
        [
            f"a={REPO}:{python}",
            f"b={REPO}:{python}",
            "--services",
            "5",
            "--endpoints",
            "2",
            "--rounds",
            "2",
            "--results",
            str(tmp_path),
            "--through",
            "proxiers",
        ]
    )
    assert code == 0
    (written,) = tmp_path.glob("*-core-feed-*.json")
    runs = json.loads(written.read_text())["runs"]
    assert [(r["label"], r["round"]) for r in runs] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    assert {r["through"] for r in runs} == {"proxiers"}
    assert {r["ports"] for r in runs} == {5}
