"""The data-plane topology: a client, a node running the rules, and one endpoint namespace.

::

    client ns                node ns (rules under test)             endpoint ns
    eth0 10.99.0.2..N  <-->  kpxb-cli 10.99.0.1                     server on *:8080
                             kpxb-pod  10.99.1.1   <-->  eth0 10.99.1.2
                             route 10.128.0.0/9 via 10.99.1.2       route local 10.128.0.0/9 dev lo

The endpoint namespace owns the whole pod CIDR as local addresses (one ``local`` route,
"AnyIP"), so every synthetic endpoint address of every Service answers without creating
a namespace or an address per endpoint. Client traffic to a ClusterIP is DNATed in the
node namespace (prerouting), forwarded, and masqueraded (the client is outside the pod
CIDR), exactly the path a new connection from outside the node takes.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.harness import python_module
from bench.netns import in_netns, ip, namespaces, sysctl
from bench.synthetic import NODE_IP, POD_CIDR, TARGET_PORT

__all__ = ["LatencyStats", "Topology", "measure_connects", "topology"]

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
_CLIENT_NET = "10.99.0"
_POD_LINK_PEER = "10.99.1.2"


@dataclass(frozen=True, slots=True)
class Topology:
    """The three namespaces of one data-plane measurement and the client's source IPs."""

    node: str
    client: str
    endpoints: str
    client_sources: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Connect latencies (microseconds) of one series of new connections."""

    count: int
    failures: int
    p50_us: float
    p90_us: float
    p99_us: float
    mean_us: float

    @classmethod
    def of(cls, latencies: list[float], failures: int) -> LatencyStats:
        """Percentiles of ``latencies`` (nearest-rank on the sorted list)."""
        if not latencies:
            raise ValueError(f"no connection succeeded ({failures} failures)")
        ordered = sorted(latencies)

        def rank(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return cls(
            count=len(ordered),
            failures=failures,
            p50_us=rank(0.50),
            p90_us=rank(0.90),
            p99_us=rank(0.99),
            mean_us=statistics.fmean(ordered),
        )


@contextmanager
def topology(client_sources: int = 16) -> Iterator[Topology]:
    """Build the three namespaces and start the endpoint server; tear everything down."""
    with namespaces("node", "cli", "ep") as (node, client, endpoints):
        sysctl(node, "net.ipv4.ip_forward", "1")
        sysctl(node, "net.ipv4.conf.all.rp_filter", "0")
        sysctl(node, "net.ipv4.conf.default.rp_filter", "0")
        ip("-n", node, "link", "add", "kpxb-cli", "type", "veth", "peer", "name", "eth0",
           "netns", client)  # fmt: skip
        ip("-n", node, "addr", "add", f"{_CLIENT_NET}.1/24", "dev", "kpxb-cli")
        ip("-n", node, "link", "set", "kpxb-cli", "up")
        sources = tuple(f"{_CLIENT_NET}.{2 + k}" for k in range(client_sources))
        for source in sources:
            ip("-n", client, "addr", "add", f"{source}/24", "dev", "eth0")
        ip("-n", client, "link", "set", "eth0", "up")
        ip("-n", client, "route", "add", "default", "via", f"{_CLIENT_NET}.1")
        ip("-n", node, "link", "add", "kpxb-pod", "type", "veth", "peer", "name", "eth0",
           "netns", endpoints)  # fmt: skip
        ip("-n", node, "addr", "add", f"{NODE_IP}/24", "dev", "kpxb-pod")
        ip("-n", node, "link", "set", "kpxb-pod", "up")
        ip("-n", endpoints, "addr", "add", f"{_POD_LINK_PEER}/24", "dev", "eth0")
        ip("-n", endpoints, "link", "set", "eth0", "up")
        ip("-n", endpoints, "route", "add", "default", "via", str(NODE_IP))
        ip("-n", endpoints, "route", "add", "local", str(POD_CIDR), "dev", "lo")
        ip("-n", node, "route", "add", str(POD_CIDR), "via", _POD_LINK_PEER)
        server = subprocess.Popen(
            in_netns(endpoints, python_module("bench.probe", "serve", "--port", str(TARGET_PORT))),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "listening":
                raise RuntimeError("endpoint server did not start")
            yield Topology(node, client, endpoints, sources)
        finally:
            server.kill()
            server.wait()


def measure_connects(
    topo: Topology, targets: dict[str, tuple[str, int]], count: int = 2000, rounds: int = 8
) -> dict[str, LatencyStats]:
    """Open ``count`` new connections from the client to each target, interleaved.

    ``targets`` maps a case name to ``(ip, port)``; the result maps it to its latencies.
    """
    argv = ["connect", "--sources", ",".join(topo.client_sources)]
    argv += ["--count", str(count), "--rounds", str(rounds)]
    for name, (address, port) in targets.items():
        argv += ["--target", f"{name}={address}:{port}"]
    # Real-time priority for the client: the whole round trip runs in its context
    # (veth hands packets over in softirq), so other load on the machine then no longer
    # preempts it; without it the tail shows 4-16 ms scheduler ticks, not rules.
    result = subprocess.run(
        in_netns(topo.client, ["chrt", "--fifo", "10", *python_module("bench.probe", *argv)]),
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    data = json.loads(result.stdout)
    if result.stderr.strip():
        log.warning("probe: %s", result.stderr.strip())
    return {
        name: LatencyStats.of(list(entry["latencies_us"]), int(entry["failures"]))
        for name, entry in data.items()
    }
