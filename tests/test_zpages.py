"""Upstream's z-pages: ``/statusz`` and ``/flagz`` on the metrics server, under their gates.

The texts are component-base's (header, warning, ``name<delimiter> value`` lines with one
of upstream's four delimiters); the binaries' flags reach ``/flagz`` as given; a gate set
to false takes its page away (404), as upstream installs neither then.
"""

from __future__ import annotations

import random
import re
import urllib.error
import urllib.request

import pytest

from kubeproxy.cmd.commandline import parse_options
from kubeproxy.daemon.serving import servers
from kubeproxy.metrics import MetricsServer, ProxyMetrics
from kubeproxy.objects import NodeInfo
from kubeproxy.zpages import DELIMITERS, flagz_page, statusz_page, uptime

WARNING = (
    "Warning: This endpoint is not meant to be machine parseable, has no formatting "
    "compatibility guarantees and is for debugging purposes only."
)


def test_uptime_is_written_as_upstream_writes_it() -> None:
    assert uptime(0) == "0 hr 00 min 00 sec"
    assert uptime(3723.9) == "1 hr 02 min 03 sec"
    assert uptime(-5) == "0 hr 00 min 00 sec"


@pytest.mark.parametrize("seed", range(8))
def test_statusz_has_upstreams_header_and_lines(seed: int) -> None:
    page = statusz_page(
        0.0, ["/metrics", "/configz", "/debug/pprof/heap", "/statusz"], now=3661.0,
        rng=random.Random(seed),
    ).decode()  # fmt: skip
    lines = page.split("\n")
    assert lines[:4] == ["", "kube-proxy statusz", WARNING, ""]
    delim = re.match(r"Started(.*?) Thu Jan 01 00:00:00 UTC 1970$", lines[4])
    assert delim is not None and delim.group(1) in DELIMITERS
    d = delim.group(1)
    assert lines[5] == f"Up{d} 1 hr 01 min 01 sec"
    assert lines[6].startswith(f"Python version{d} 3.")
    assert lines[7].startswith(f"Binary version{d} ")
    assert lines[8] == f"Paths{d} /configz /debug /metrics /statusz"


def test_flagz_lists_the_flags_sorted() -> None:
    page = flagz_page({"v": "4", "bind-address": "0.0.0.0"}, rng=random.Random(1)).decode()
    lines = page.split("\n")
    assert lines[:4] == ["", "kube-proxy flags", WARNING, ""]
    d = lines[4][len("bind-address") : -len("0.0.0.0")]
    assert d in DELIMITERS
    assert lines[4:6] == [f"bind-address{d}0.0.0.0", f"v{d}4"]


def fetch(port: int, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, "", ""


def test_the_metrics_server_serves_both_pages() -> None:
    server = MetricsServer(
        "127.0.0.1:0", ProxyMetrics(mode="nftables"), statusz=True, flagz={"v": "2"}
    )
    server.start()
    try:
        assert server.port is not None
        status, content_type, body = fetch(server.port, "/statusz")
        assert status == 200 and content_type == "text/plain; charset=utf-8"
        assert "kube-proxy statusz" in body
        # The delimiter after a name is one of DELIMITERS (chosen at random, as upstream
        # does), then a space.
        assert re.search(
            r"Paths(:|: |=| ) /configz /flagz /healthz /metrics /proxyMode /statusz", body
        )
        status, _, body = fetch(server.port, "/flagz")
        assert status == 200 and re.search(r"^v(:|: |=| )2$", body, re.MULTILINE)
    finally:
        server.stop()


def test_without_the_gates_neither_page_is_served() -> None:
    server = MetricsServer("127.0.0.1:0", ProxyMetrics(mode="nftables"))
    server.start()
    try:
        assert server.port is not None
        assert fetch(server.port, "/statusz")[0] == 404
        assert fetch(server.port, "/flagz")[0] == 404
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("gates", "served"),
    [
        ([], {"/statusz", "/flagz"}),  # both beta and on by default in 1.37
        (["--feature-gates=ComponentFlagz=false"], {"/statusz"}),
        (["--feature-gates=ComponentStatusz=false,ComponentFlagz=false"], set()),
    ],
)
def test_the_binaries_pages_follow_the_gates(gates: list[str], served: set[str]) -> None:
    argv = [*gates, "--v=3", "--nodeport-addresses=127.0.0.0/8", "--masquerade-all"]
    options = parse_options(argv, "kube-proxy-nftables", "nftables", get_hostname=lambda: "n")
    parts = servers(options, "nftables", 30.0, NodeInfo("n"))
    routes = parts.metrics_server.server.routes
    assert {"/statusz", "/flagz"} & set(routes) == served
    if "/flagz" in served:
        status, _headers, body = routes["/flagz"]()
        text = body.decode()
        assert status == 200
        for name, value in (
            ("v", "3"),
            ("nodeport-addresses", "127.0.0.0/8"),
            ("masquerade-all", "true"),
        ):
            assert re.search(rf"^{name}(:|: |=| ){re.escape(value)}$", text, re.MULTILINE)
