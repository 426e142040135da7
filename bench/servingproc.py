"""A proxy's health and metrics servers in a process of their own, over a real nftables
backend holding a synthetic cluster; driven over stdin/stdout.

Run inside the namespace it programs (:data:`NODE_ADDRESS` must be on one of its links)::

    ip netns exec NS python -m bench.servingproc --services 10000 --health-checks 1000

It wires what the daemon wires (:mod:`kubeproxy.daemon`), through the core's public API
only: a :class:`~kubeproxy.proxier.Proxier` over the ``nftables`` backend entry point,
:class:`~kubeproxy.metrics.ProxyMetrics` tracking it, :class:`~kubeproxy.health.ProxyHealth`
fed by a :class:`~kubeproxy.health.HealthObserver`, ``/healthz`` on ``0.0.0.0:10256``,
``/metrics`` on ``127.0.0.1:10249`` and one HealthCheckNodePort listener per LoadBalancer
Service (``externalTrafficPolicy: Local``, one ready endpoint on this node) on the node
address. ``--listeners baseline`` gives every server the standard library's accept queue
(5) and no handler cap, as before; ``tuned`` the defaults (the kernel's limit, a cap).

It feeds ``--services`` ClusterIP Services (10 endpoints each) and ``--health-checks``
LoadBalancer Services, syncs, prints ``{"event": "ready", ...}`` and answers one JSON line
per command line:

* ``{"op": "churn-on"}``: from now on a thread changes one endpoint of one Service and
  syncs, again and again with no pause (every sync an incremental one, as in a cluster
  whose endpoints never stop moving); ``{"op": "churn-off"}`` stops it and answers how
  many syncs ran and their median and longest duration;
* ``{"op": "quit"}``.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from bench.proxyproc import bench_config, emit, load_backend_factory
from bench.synthetic import (
    NODE_NAME,
    EndpointSwaps,
    SyntheticService,
    build_services,
    synthetic_service,
)
from kubeproxy.health import HealthObserver, ProxyHealth, ProxyHealthServer, ServiceHealthServer
from kubeproxy.metrics import MetricsServer, ProxyMetrics
from kubeproxy.objects import IPFamily, NodeInfo
from kubeproxy.proxier import ObserverGroup, Proxier

__all__ = [
    "HEALTHZ_PORT",
    "HEALTH_CHECK_PORT_BASE",
    "LISTENER_SETTINGS",
    "METRICS_PORT",
    "NODE_ADDRESS",
    "main",
]

NODE_ADDRESS = ipaddress.IPv4Address("198.18.0.10")
"""The node's address here, where the health-check listeners bind (nodePortAddresses
``primary``): in the benchmarking range, outside the synthetic service CIDR, whose
catch-all drop rule would swallow bench.synthetic's NODE_IP."""
HEALTHZ_PORT = 10256
METRICS_PORT = 10249
HEALTH_CHECK_PORT_BASE = 40000
"""LoadBalancer Service ``k`` answers its health checks on this port + ``k``."""
_NODE_PORT_BASE = 30000
_LB_INDEX_BASE = 200_000  # Service indexes of the LoadBalancer Services

LISTENER_SETTINGS: dict[str, dict[str, Any]] = {
    "tuned": {},  # the servers' defaults: the kernel's accept-queue limit, a handler cap
    "baseline": {"backlog": 5, "max_handlers": None},  # the standard library's defaults
}
"""The keyword arguments each server gets, by ``--listeners`` name."""

log = logging.getLogger(__name__)


def load_balancer(number: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """LoadBalancer Service ``number`` (eTP Local, health-check port) and its slices."""
    base = synthetic_service(_LB_INDEX_BASE + number, 1)
    service = base.service_dict()
    spec = service["spec"]
    spec["type"] = "LoadBalancer"
    spec["externalTrafficPolicy"] = "Local"
    spec["healthCheckNodePort"] = HEALTH_CHECK_PORT_BASE + number
    spec["ports"][0]["nodePort"] = _NODE_PORT_BASE + number
    slices = base.slice_dicts()
    for endpoint in slices[0]["endpoints"]:
        endpoint["nodeName"] = NODE_NAME  # a local endpoint: the health check says 200
    return service, slices


class ServingProxy:
    """The servers, the proxier they watch, and the endpoint churn."""

    def __init__(self, services: Sequence[SyntheticService], health_checks: int, mode: str):
        settings = LISTENER_SETTINGS[mode]
        factory = load_backend_factory("nftables")
        config = bench_config()
        node = NodeInfo(name=NODE_NAME, addresses=(NODE_ADDRESS,))
        self.metrics = ProxyMetrics(mode="nftables")
        self.health = ProxyHealth(2 * config.sync_period, node=node)
        checks = ServiceHealthServer(IPFamily.IPV4, self.health, node_name=NODE_NAME, **settings)
        self.observer = HealthObserver(self.health, {IPFamily.IPV4: checks})
        self.proxier = Proxier(
            IPFamily.IPV4,
            config,
            factory(IPFamily.IPV4, config),
            node=node,
            host_addresses=lambda: [NODE_ADDRESS],
            observer=ObserverGroup([self.metrics, self.observer]),
            after_sync=(self.metrics.after_sync, self.observer.after_sync),
        )
        self.metrics.track(self.proxier)
        self.healthz = ProxyHealthServer(
            f"0.0.0.0:{HEALTHZ_PORT}", self.health, self.metrics, hard_fail=True, **settings
        )
        self.metrics_server = MetricsServer(
            f"127.0.0.1:{METRICS_PORT}", self.metrics, hard_fail=True, **settings
        )
        self.services = list(services)
        self.health_checks = health_checks
        self._turn = 0
        self._swaps = EndpointSwaps()
        self._churning = threading.Event()
        self._churn_thread: threading.Thread | None = None
        self._sync_seconds: list[float] = []

    def start(self) -> dict[str, Any]:
        """Serve, feed every object, sync once; what the ready line reports."""
        self.healthz.start()
        self.metrics_server.start()
        started = time.perf_counter()
        for service in self.services:
            self.proxier.on_service_add(service.service_dict())
            for slice_ in service.slice_dicts():
                self.proxier.on_endpoint_slice_add(slice_)
        for number in range(self.health_checks):
            service_dict, slices = load_balancer(number)
            self.proxier.on_service_add(service_dict)
            for slice_ in slices:
                self.proxier.on_endpoint_slice_add(slice_)
        self.proxier.on_services_synced()
        self.proxier.on_endpoint_slices_synced()
        ok = self.proxier.sync_now()
        listening = self.observer.service_health[IPFamily.IPV4].listening()
        return {
            "event": "ready",
            "ok": ok,
            "cold_sync_s": time.perf_counter() - started,
            "health_check_listeners": len(listening),
            "health_check_ports": sorted(p for sockets in listening.values() for _, p in sockets),
        }

    def churn_on(self) -> dict[str, Any]:
        """Start changing endpoints and syncing in a loop."""
        if self._churn_thread is None:
            self._sync_seconds.clear()
            self._churning.set()
            self._churn_thread = threading.Thread(target=self._churn, name="churn", daemon=True)
            self._churn_thread.start()
        return {"ok": True}

    def churn_off(self) -> dict[str, Any]:
        """Stop the churn; how many syncs ran and how long they took."""
        self._churning.clear()
        if self._churn_thread is not None:
            self._churn_thread.join(60)
            self._churn_thread = None
        seconds = self._sync_seconds
        return {
            "ok": True,
            "syncs": len(seconds),
            "sync_median_s": statistics.median(seconds) if seconds else None,
            "sync_max_s": max(seconds, default=None),
        }

    def _churn(self) -> None:
        while self._churning.is_set():
            service = self.services[self._turn % len(self.services)]
            self._turn += 1
            old, new = self._swaps.swap(service)
            for previous, updated in zip(old, new, strict=True):
                self.proxier.on_endpoint_slice_update(previous, updated)
            started = time.perf_counter()
            if not self.proxier.sync_now():
                log.error("a churn sync failed")
            self._sync_seconds.append(time.perf_counter() - started)

    def stop(self) -> None:
        """Stop the churn and the servers (the namespace takes the rules with it)."""
        self.churn_off()
        self.healthz.stop()
        self.metrics_server.stop()
        self.observer.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Build, serve, answer commands until ``quit`` or end of input."""
    parser = argparse.ArgumentParser(prog="bench.servingproc")
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--health-checks", type=int, default=1000)
    parser.add_argument("--listeners", choices=sorted(LISTENER_SETTINGS), default="tuned")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    proxy = ServingProxy(build_services(args.services, 10), args.health_checks, args.listeners)

    try:
        emit(proxy.start())
        for line in sys.stdin:
            op = json.loads(line).get("op")
            if op == "quit":
                break
            if op == "churn-on":
                emit(proxy.churn_on())
            elif op == "churn-off":
                emit(proxy.churn_off())
            else:
                emit({"event": "error", "error": f"unknown op {op!r}"})
    except Exception as err:
        log.exception("serving proxy failed")
        emit({"event": "error", "error": str(err)})
        return 1
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
