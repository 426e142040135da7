"""The memory benchmark's pieces (issue 32, item 2): ``/usr/bin/time -v``'s report, the
live allocations summed by site and by what holds them."""

from __future__ import annotations

import tracemalloc

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
    assert holder("/usr/lib/python3.11/json/decoder.py") == "manifest text, JSON decoding"
    assert holder("/w/kubeproxy/sources/jsonitems.py") == "manifest text, JSON decoding"
    assert holder("/w/kubeproxy/parse.py") == "API objects (parsed)"
    assert holder("/w/kubeproxy/backends/nftables/elements.py") == "encoded batches"
    assert holder("/w/kubeproxy/backends/nftables/batchsocket.py") == "socket (answer buffers)"
    assert holder("/w/kubeproxy/backends/nftables/frontends.py") == "backend model"
    assert holder("/w/kubeproxy/endpointchanges.py") == (
        "trackers, snapshot, categories (the core)"
    )
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
        "backend model": 2,
        "interpreter, modules, stdlib": 1,
    }
    assert summary["sites"] == [
        {"site": "kubeproxy.parse:10", "mb": 2, "blocks": 2, "holder": "API objects (parsed)"},
        {
            "site": "kubeproxy.backends.nftables.diff:5",
            "mb": 2,
            "blocks": 1,
            "holder": "backend model",
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
