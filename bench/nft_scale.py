"""Scale check of the nftables backend: cold full syncs and incremental syncs, real kernel.

Each measurement runs in a fresh child process (so its peak RSS is its own, libnftables
included) against a fresh network namespace ``kpxr-bench-<pid>`` that is always deleted.

    python bench/nft_scale.py                       # 1k, 10k, 30k x 10 endpoints, +/- affinity
    python bench/nft_scale.py --services 10000 --no-affinity-variant --incremental

Reusable pieces: :func:`build_world` (a snapshot built directly, no API objects),
:func:`measure_cold` and :func:`measure_incremental` (in-process, given a netns), and
:func:`run_isolated` (a measurement in a child process, returns its JSON result).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kubeproxy.backend import NodePortAddresses, ProxySnapshot, SyncChanges
from kubeproxy.config import LocalDetectMode, LocalDetector, ProxierConfig
from kubeproxy.objects import (
    CategorizedEndpoints,
    Endpoint,
    IPFamily,
    NamespacedName,
    NodeInfo,
    Protocol,
    ServicePort,
    ServicePortName,
)

NODE = "bench-node"
CONFIG = ProxierConfig(node_name=NODE)


@dataclass
class World:
    """A snapshot's contents, mutable for incremental steps."""

    services: dict[ServicePortName, ServicePort] = field(default_factory=dict)
    endpoints: dict[ServicePortName, tuple[Endpoint, ...]] = field(default_factory=dict)
    categorized: dict[ServicePortName, CategorizedEndpoints] = field(default_factory=dict)

    def set(self, port: ServicePort, eps: tuple[Endpoint, ...]) -> None:
        self.services[port.name] = port
        self.endpoints[port.name] = eps
        self.categorized[port.name] = CategorizedEndpoints(eps, (), eps, bool(eps))

    def remove(self, name: ServicePortName) -> None:
        del self.services[name]
        del self.endpoints[name]
        del self.categorized[name]

    def snapshot(self) -> ProxySnapshot:
        return ProxySnapshot(
            IPFamily.IPV4,
            NodeInfo(NODE, addresses=(ipaddress.ip_address("192.168.0.2"),)),
            self.services,
            self.endpoints,
            self.categorized,
            service_cidrs=(ipaddress.ip_network("172.16.0.0/12"),),
            node_port_addresses=NodePortAddresses(addresses=(ipaddress.ip_address("192.168.0.2"),)),
            local_detector=LocalDetector(
                LocalDetectMode.CLUSTER_CIDR, (ipaddress.ip_network("10.0.0.0/8"),)
            ),
        )


def service_port(index: int, affinity: bool, node_port: bool = False) -> ServicePort:
    """Service ``bench/s<index>``, ClusterIP 172.16.0.0 + index, port 80/TCP."""
    name = ServicePortName(NamespacedName("bench", f"s{index}"), "http", Protocol.TCP)
    return ServicePort(
        name,
        ipaddress.ip_address(0xAC100000 + index),
        80,
        Protocol.TCP,
        node_port=30000 + index if node_port and index < 2768 else 0,
        session_affinity_seconds=10800 if affinity else 0,
    )


def endpoints(index: int, count: int, generation: int = 0) -> tuple[Endpoint, ...]:
    """``count`` endpoints for service ``index`` in 10.0.0.0/8 (``generation`` shifts one)."""
    base = 0x0A000000 + index * 16
    eps = [Endpoint(ipaddress.ip_address(base + k), 8080) for k in range(count)]
    if generation:
        eps[0] = Endpoint(ipaddress.ip_address(base + 15), 8080 + generation)
    return tuple(sorted(eps, key=lambda e: e.key))


def build_world(services: int, eps: int, affinity: bool) -> World:
    """``services`` ClusterIP Services with ``eps`` endpoints each (a few NodePorts too)."""
    world = World()
    for index in range(services):
        world.set(service_port(index, affinity, node_port=index % 10 == 0), endpoints(index, eps))
    return world


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_cold(netns: str, services: int, eps: int, affinity: bool) -> dict[str, Any]:
    """A cold full sync into ``netns`` (empty), through libnftables in this process."""
    from kubeproxy.backends.nftables import create_backend

    started = time.perf_counter()
    world = build_world(services, eps, affinity)
    built = time.perf_counter()
    backend = create_backend(IPFamily.IPV4, CONFIG, netns=netns)
    begin = time.perf_counter()
    backend.sync(world.snapshot(), SyncChanges(full=True))
    done = time.perf_counter()
    return {
        "scenario": "cold",
        "services": services,
        "endpoints": eps,
        "affinity": affinity,
        "build_s": round(built - started, 3),
        "sync_s": round(done - begin, 3),
        "transactions": backend.last_transactions,
        "operations": backend.last_operations,
        "peak_rss_mb": round(_rss_mb(), 1),
    }


def measure_incremental(
    netns: str, services: int, eps: int, affinity: bool, rounds: int = 20
) -> dict[str, Any]:
    """After a cold sync: median/max time of one-endpoint-changed, add and remove syncs."""
    from kubeproxy.backends.nftables import create_backend

    world = build_world(services, eps, affinity)
    backend = create_backend(IPFamily.IPV4, CONFIG, netns=netns)
    backend.sync(world.snapshot(), SyncChanges(full=True))
    results: dict[str, list[float]] = {"endpoint_changed": [], "service_added": [], "removed": []}
    ops: dict[str, int] = {}
    clock = time.perf_counter
    for r in range(rounds):
        index = (r * 7919) % services
        name = service_port(index, affinity).name
        world.set(service_port(index, affinity), endpoints(index, eps, generation=r + 1))
        t0 = clock()
        backend.sync(world.snapshot(), _changed(name))
        results["endpoint_changed"].append(clock() - t0)
        ops["endpoint_changed"] = backend.last_operations

        new = service_port(services + r, affinity)
        world.set(new, endpoints(services + r, eps))
        t0 = clock()
        backend.sync(world.snapshot(), _changed(new.name))
        results["service_added"].append(clock() - t0)
        ops["service_added"] = backend.last_operations

        world.remove(new.name)
        t0 = clock()
        backend.sync(world.snapshot(), _changed(new.name))
        results["removed"].append(clock() - t0)
        ops["removed"] = backend.last_operations
        # Stale chains go a second later; wait so they do not pile up into one sync.
        time.sleep(0.05)
    summary: dict[str, Any] = {
        "scenario": "incremental",
        "services": services,
        "endpoints": eps,
        "affinity": affinity,
        "peak_rss_mb": round(_rss_mb(), 1),
    }
    for key, values in results.items():
        values.sort()
        summary[f"{key}_median_ms"] = round(values[len(values) // 2] * 1000, 2)
        summary[f"{key}_max_ms"] = round(values[-1] * 1000, 2)
        summary[f"{key}_ops"] = ops[key]
    return summary


def _changed(name: ServicePortName) -> SyncChanges:
    return SyncChanges(full=False, changed_services=frozenset({name.service}))


@contextmanager
def namespace(name: str) -> Iterator[str]:
    """A fresh network namespace, deleted afterwards whatever happens."""
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def run_isolated(
    scenario: str, services: int, eps: int, affinity: bool, timeout: float = 900
) -> dict[str, Any]:
    """Run one measurement in a child process with its own namespace; return its result."""
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        scenario,
        "--services",
        str(services),
        "--endpoints",
        str(eps),
    ]
    if affinity:
        argv.append("--affinity")
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=timeout)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _child(args: argparse.Namespace) -> None:
    services = int(args.services)
    with namespace(f"kpxr-bench-{os.getpid()}") as netns:
        if args.child == "cold":
            result = measure_cold(netns, services, args.endpoints, args.affinity)
        else:
            result = measure_incremental(netns, services, args.endpoints, args.affinity)
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--services", default="1000,10000,30000")
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--affinity", action="store_true", help="(child) affinity on")
    parser.add_argument("--no-affinity-variant", action="store_true")
    parser.add_argument("--incremental", action="store_true", help="also incremental at 10k")
    parser.add_argument("--only-incremental", action="store_true")
    parser.add_argument("--child", choices=["cold", "incremental"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    variants = [False] if args.no_affinity_variant else [False, True]
    if not args.only_incremental:
        for count in (int(s) for s in args.services.split(",")):
            for affinity in variants:
                print(json.dumps(run_isolated("cold", count, args.endpoints, affinity)), flush=True)
    if args.incremental or args.only_incremental:
        for affinity in variants:
            print(
                json.dumps(run_isolated("incremental", 10000, args.endpoints, affinity)),
                flush=True,
            )


if __name__ == "__main__":
    main()
