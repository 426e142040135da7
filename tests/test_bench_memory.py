"""The memory benchmark's pieces (issue 32, item 2): ``/usr/bin/time -v``'s report, the
live allocations summed by site and by what holds them."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from bench.memory import holder, summarise_traces, time_v

_REPORT = """\tCommand being timed: "kube-proxy-nftables --once"
\tUser time (seconds): 17.25
\tSystem time (seconds): 2.50
\tMaximum resident set size (kbytes): 859132
\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:02.50
"""


def test_time_v_reads_the_wall_time_and_the_peak() -> None:
    assert time_v(_REPORT) == (62.5, 859132, 19.75)
    hours = _REPORT.replace("1:02.50", "1:00:02.50")
    assert time_v(hours) == (3602.5, 859132, 19.75)
    with pytest.raises(ValueError, match="not a /usr/bin/time -v report"):
        time_v("nothing")


def test_holders_by_module() -> None:
    text = "manifest text, JSON decoding (file buffer)"
    assert holder("/usr/lib/python3.11/json/decoder.py") == text
    assert holder("/w/kubeproxy/sources/jsonitems.py") == text
    assert holder("/w/kubeproxy/parse.py") == "API objects (parsed)"
    assert holder("/w/kubeproxy/backends/nftables/elements.py") == "encoded batches (netlink)"
    assert holder("/w/kubeproxy/backends/nftables/batchsocket.py") == "socket (answer buffers)"
    assert holder("/w/kubeproxy/backends/nftables/frontends.py") == "backend model, generation"
    assert holder("/w/kubeproxy/endpointchanges.py") == "EndpointSlice tracker"
    assert holder("/w/kubeproxy/servicechanges.py") == "Service tracker"
    assert holder("/w/kubeproxy/topology.py") == "proxier: snapshot, categorised endpoints"
    assert holder("/w/kubeproxy/runner.py") == "the rest of the core"
    assert holder("/usr/lib/python3.11/enum.py") == "interpreter, modules, stdlib"


def test_live_allocations_are_summed_by_site_and_holder() -> None:
    parse = (("/w/kubeproxy/parse.py", 10),)
    diff = (("/w/kubeproxy/backends/nftables/diff.py", 5),)
    mb = 1024 * 1024
    traces = [(0, mb, parse, 1), (0, mb, parse, 1), (0, 2 * mb, diff, 1), (0, mb, (), 0)]
    summary = summarise_traces(traces, top=2)
    assert summary["traced_mb"] == 5 and summary["blocks"] == 4
    assert summary["holders_mb"] == {
        "API objects (parsed)": 2,
        "backend model, generation": 2,
        "interpreter, modules, stdlib": 1,
    }
    assert summary["sites"] == [
        {"site": "kubeproxy.parse:10", "mb": 2, "blocks": 2, "holder": "API objects (parsed)"},
        {
            "site": "kubeproxy.backends.nftables.diff:5",
            "mb": 2,
            "blocks": 1,
            "holder": "backend model, generation",
        },
    ]


def test_the_raw_traces_have_the_shape_summarised() -> None:
    tracemalloc.start(1)
    try:
        kept = [bytes(1000) for _ in range(10)]
        traces = tracemalloc._get_traces()  # type: ignore[attr-defined]
    finally:
        tracemalloc.stop()
    summary = summarise_traces(traces)
    assert len(kept) == 10
    ours = [s for s in summary["sites"] if "test_bench_memory.py" in s["site"]]
    assert ours and ours[0]["blocks"] >= 10 and ours[0]["mb"] * 1024 * 1024 >= 10_000


def test_compared_checkouts_are_read_and_run_from_their_root(tmp_path: Path) -> None:
    from bench.memory_compare import binary_argv, checkout, traced_argv

    main = checkout(f"main={tmp_path}")
    assert (main.label, main.root, main.python) == ("main", tmp_path, tmp_path / ".venv/bin/python")
    borrowed = checkout(f"c1={tmp_path}:/opt/venv/bin/python")
    assert borrowed.python == Path("/opt/venv/bin/python")
    assert borrowed.env()["PYTHONPATH"] == str(tmp_path)
    for bad in ("main", "=x", "main="):
        with pytest.raises(ValueError, match="LABEL=ROOT"):
            checkout(bad)
    flags = ["--manifests", "/m", "--once"]
    argv = binary_argv(main, flags)
    assert argv[:4] == ["/usr/bin/time", "-v", str(main.python), "-c"]
    assert "kubeproxy.cmd.nftables" in argv[4] and argv[5:] == flags
    traced = traced_argv(borrowed, tmp_path / "out.json", flags)
    assert traced[:4] == ["/opt/venv/bin/python", "-m", "bench.memory", "child"]
    assert traced[traced.index("--") + 1 :] == flags


def test_both_sources_run_side_by_side_in_one_command(tmp_path: Path) -> None:
    """``--source both``: each checkout's ``--once`` from the manifests, then from the fake
    API server holding the same cluster, each measured (as root, in fresh namespaces)."""
    import json
    import sys

    from bench.memory_compare import main

    repo = Path(__file__).resolve().parent.parent
    argv = [f"now={repo}:{sys.executable}", "--services", "3", "--endpoints", "2"]
    assert main([*argv, "--source", "both", "--results", str(tmp_path)]) == 0
    (written,) = tmp_path.glob("*-memory-compare-*.json")
    runs = json.loads(written.read_text())["runs"]
    assert [(r["label"], r["source"]) for r in runs] == [("now", "manifests"), ("now", "api")]
    assert all(r["cpu_s"] > 0 and r["max_rss_kb"] > 0 for r in runs)
