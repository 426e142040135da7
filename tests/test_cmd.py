"""The binaries: a bad flag, --dry-run, --once, --cleanup, and the `make run` demo.

The option parsing itself is tested in test_options.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "cluster"
BIN = Path(sys.executable).parent / "kube-proxy-nftables"


def test_bad_flag_exits_2_with_one_line() -> None:
    result = subprocess.run(
        [str(BIN), "--manifests", str(EXAMPLES), "--cluster-cidr", "bogus"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "kube-proxy-nftables: --cluster-cidr: clusterCIDR: 'bogus' is not a CIDR"
        " (e.g. 10.100.0.0/16 or fde4:8dba:82e1::/48)"
    ]


def test_print_backend_example_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "print_backend.py"), str(EXAMPLES)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.splitlines() == [
        "# full sync, 3 service ports",
        "demo/dns:dns 172.30.0.53:53/UDP -> 10.244.0.13:5353",
        "demo/shop:http 172.30.0.20:80/TCP -> 10.244.0.11:8080",
        "demo/web:http 172.30.0.10:80/TCP -> 10.244.0.11:8080, 10.244.0.12:8080",
    ]


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"kpxc-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _in_ns(ns: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, check=False
    )


@pytest.mark.kernel
def test_dry_run_prints_and_touches_nothing(netns: str) -> None:
    result = _in_ns(
        netns, str(BIN), "--manifests", str(EXAMPLES), "--hostname-override", "demo-node",
        "--dry-run",
    )
    assert result.returncode == 0, result.stderr
    assert "add table ip kube-proxy" in result.stdout
    assert "172.30.0.10 . tcp . 80" in result.stdout
    assert _in_ns(netns, "nft", "list", "tables").stdout.strip() == ""


@pytest.mark.kernel
def test_once_programs_then_cleanup_removes_only_ours(netns: str) -> None:
    foreign = "table inet kpxc-foreign {\n\tchain input {\n\t\ttype filter hook input priority 0; policy accept;\n\t}\n}\n"
    assert subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "-f", "-"], input=foreign, text=True, check=False
    ).returncode == 0
    before = _in_ns(netns, "nft", "list", "table", "inet", "kpxc-foreign").stdout
    result = _in_ns(
        netns, str(BIN), "--manifests", str(EXAMPLES), "--hostname-override", "demo-node",
        "--once",
    )
    assert result.returncode == 0, result.stderr
    listing = _in_ns(netns, "nft", "list", "table", "ip", "kube-proxy").stdout
    assert "172.30.0.10 . tcp . 80" in listing
    cleanup = _in_ns(netns, str(BIN), "--cleanup")
    assert cleanup.returncode == 0, cleanup.stderr
    tables = _in_ns(netns, "nft", "list", "tables").stdout.split("\n")
    assert [t for t in tables if t] == ["table inet kpxc-foreign"]
    assert _in_ns(netns, "nft", "list", "table", "inet", "kpxc-foreign").stdout == before


@pytest.mark.kernel
def test_make_run_demo_succeeds() -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    result = subprocess.run(
        [sys.executable, "-m", "kubeproxy.cmd.demo", str(EXAMPLES)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo succeeded" in result.stdout
    assert "hello from pod" in result.stdout
    assert "dns answer from pod3" in result.stdout
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert "kpxd-" not in leftover.stdout
