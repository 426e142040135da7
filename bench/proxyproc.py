"""Our proxy in a process of its own, fed synthetic Services and driven over stdin/stdout.

Run inside the namespace it programs::

    ip netns exec NS python -m bench.proxyproc --netns NS --services N --endpoints E

It builds the Services and EndpointSlices as Kubernetes JSON dicts, creates the backend
(``--backend``: a ``kubeproxy.backends`` entry point name, or ``module:function``) and a
:class:`kubeproxy.proxier.Proxier`, prints ``{"event": "ready", ...}`` and then answers
one JSON line per command line:

* ``{"op": "cold"}``: feed every object to the proxier, mark the sources synced, sync
  once; the timings (the end-to-end figure: objects in memory to rules committed);
* ``{"op": "endpoint"}``: change one endpoint of one Service, sync; ``{"op": "add"}``:
  add one Service with its endpoints, sync; ``{"op": "remove"}``: delete one Service
  and its slices, sync (each rotates through the Services);
* ``{"op": "rss"}``: peak resident memory of this process and of its children;
* ``{"op": "quit"}``.

Every answer to a sync carries ``tool_s`` and ``tool_calls``: the time spent inside the
kernel tools during it (libnftables calls, ``iptables-restore`` and other tool processes;
see :mod:`bench.toolclock`), and the children's peak RSS so far (the tool processes').

A process per measurement because ``ru_maxrss`` is a process-lifetime peak: a fresh
process reports the peak of one cold sync alone, and since libnftables runs in-process,
that peak includes nft's parsing of the transaction.
"""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import json
import logging
import resource
import sys
import time
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, cast

from bench import toolclock
from bench.synthetic import (
    NODE_IP,
    NODE_NAME,
    POD_CIDR,
    SERVICE_CIDR,
    SyntheticService,
    build_services,
    mixed_services,
    synthetic_service,
)
from kubeproxy.backend import Backend, BackendFactory
from kubeproxy.config import LocalDetectMode, LocalDetector, ProxierConfig
from kubeproxy.objects import IPAddress, IPFamily, NodeInfo
from kubeproxy.proxier import Proxier

__all__ = ["BenchProxy", "bench_config", "load_backend_factory", "main"]

log = logging.getLogger(__name__)

_ADDED_INDEX_BASE = 100_000  # indexes of Services added during incremental runs
_SPARE_OFFSET = 14
_PAGE_KB = resource.getpagesize() // 1024


def bench_config() -> ProxierConfig:
    """The proxier settings of every benchmark: ClusterCIDR detector, our service CIDR."""
    return ProxierConfig(
        node_name=NODE_NAME,
        local_detector=LocalDetector(LocalDetectMode.CLUSTER_CIDR, (POD_CIDR,)),
        service_cidrs=(SERVICE_CIDR,),
        node_port_addresses=("primary",),  # the kube-proxy-nftables default
        min_sync_period=0.0,
    )


def load_backend_factory(name: str) -> BackendFactory:
    """A backend factory by entry-point name (``nftables``) or as ``module:function``."""
    if ":" in name:
        module, _, attribute = name.partition(":")
        return cast(BackendFactory, getattr(importlib.import_module(module), attribute))
    found = entry_points(group="kubeproxy.backends", name=name)
    for entry in found:
        return cast(BackendFactory, entry.load())
    raise LookupError(f"no kubeproxy.backends entry point named {name!r}")


def _rss_now_kb() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE_KB


def _peaks() -> dict[str, int]:
    return {
        "maxrss_self_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "maxrss_children_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
        "rss_now_kb": _rss_now_kb(),
    }


class BenchProxy:
    """A Proxier over a real backend, with the synthetic cluster it is fed."""

    def __init__(
        self,
        services: Sequence[SyntheticService],
        backend: Backend,
        *,
        node_ip: IPAddress = NODE_IP,
        config: ProxierConfig | None = None,
        clock: toolclock.ToolClock | None = None,
    ) -> None:
        self.services = list(services)
        self.config = config or bench_config()
        self.clock = clock or toolclock.ToolClock()
        node = NodeInfo(name=self.config.node_name, addresses=(node_ip,))
        self.proxier = Proxier(
            IPFamily.IPV4, self.config, backend, node=node, host_addresses=lambda: [node_ip]
        )
        self._service_dicts = [s.service_dict() for s in self.services]
        self._slice_dicts = [d for s in self.services for d in s.slice_dicts()]
        self._endpoints_now: dict[int, tuple[ipaddress.IPv4Address, ...]] = {}
        self._generation: dict[int, int] = {}
        self._endpoint_turn = 0
        self._removed = 0
        self._added = 0
        self._affinity = self.services[0].affinity_seconds if self.services else 0

    def cold(self) -> dict[str, Any]:
        """Feed everything, mark the sources synced (the Proxier syncs then), sync once.

        ``feed_s`` is the handler calls that queue the objects; ``sync_s`` the rest, from
        the "synced" signals (the Proxier's first, full sync) to the committed rules.
        """
        mark, tools = self.clock.snapshot(), self.clock.by_tool()
        start = time.perf_counter()
        for service in self._service_dicts:
            self.proxier.on_service_add(service)
        for slice_ in self._slice_dicts:
            self.proxier.on_endpoint_slice_add(slice_)
        fed = time.perf_counter()
        self.proxier.on_services_synced()
        self.proxier.on_endpoint_slices_synced()
        # Returns at once when the initial sync above succeeded; retries it otherwise.
        ok = self.proxier.sync_now()
        done = time.perf_counter()
        # The dicts are the "objects in memory" of the measurement; once fed, the
        # incremental operations build their own.
        self._service_dicts.clear()
        self._slice_dicts.clear()
        return {
            "ok": ok,
            "feed_s": fed - start,
            "sync_s": done - fed,
            "total_s": done - start,
            **self.clock.since(mark),
            "tools": self.clock.by_tool(since=tools),
            **_peaks(),
            "tool_peak_kb": self.clock.peak_kb,
        }

    def _timed_sync(self, start: float, mark: tuple[float, int]) -> dict[str, Any]:
        ok = self.proxier.sync_now()
        seconds = time.perf_counter() - start
        return {"ok": ok, "seconds": seconds, **self.clock.since(mark)}

    def change_endpoint(self) -> dict[str, Any]:
        """Swap the last endpoint of the next Service with a spare address, and sync."""
        service = self.services[self._endpoint_turn % len(self.services)]
        self._endpoint_turn += 1
        if len(service.endpoints) > _SPARE_OFFSET:
            raise ValueError(f"{service.port_label}: no spare address for an endpoint change")
        current = self._endpoints_now.get(service.index, service.endpoints)
        generation = self._generation.get(service.index, 1)
        # The spare address sits in the Service's own 16-address block, past its endpoints.
        spare = service.endpoints[0] + _SPARE_OFFSET
        last = service.endpoints[-1] if current[-1] == spare else spare
        changed = (*current[:-1], last)
        old = service.slice_dicts(current, generation=generation)
        new = service.slice_dicts(changed, generation=generation + 1)
        mark, start = self.clock.snapshot(), time.perf_counter()
        for before, after in zip(old, new, strict=True):
            self.proxier.on_endpoint_slice_update(before, after)
        result = self._timed_sync(start, mark)
        self._endpoints_now[service.index] = changed
        self._generation[service.index] = generation + 1
        return result

    def add_service(self) -> dict[str, Any]:
        """Add one new Service with its endpoints, and sync."""
        width = len(self.services[0].endpoints) if self.services else 1
        service = synthetic_service(
            _ADDED_INDEX_BASE + self._added, width, affinity_seconds=self._affinity
        )
        self._added += 1
        service_dict, slices = service.service_dict(), service.slice_dicts()
        mark, start = self.clock.snapshot(), time.perf_counter()
        self.proxier.on_service_add(service_dict)
        for slice_ in slices:
            self.proxier.on_endpoint_slice_add(slice_)
        return self._timed_sync(start, mark)

    def remove_service(self) -> dict[str, Any]:
        """Delete one of the original Services (from the end) with its slices, and sync."""
        self._removed += 1
        service = self.services[-self._removed]
        service_dict = service.service_dict()
        slices = service.slice_dicts(
            self._endpoints_now.pop(service.index, service.endpoints),
            generation=self._generation.pop(service.index, 1),
        )
        mark, start = self.clock.snapshot(), time.perf_counter()
        self.proxier.on_service_delete(service_dict)
        for slice_ in slices:
            self.proxier.on_endpoint_slice_delete(slice_)
        return self._timed_sync(start, mark)


def _parse_extra(text: str) -> tuple[int, int]:
    index, _, count = text.partition(":")
    return int(index), int(count)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: build, report ready, answer commands until ``quit``."""
    parser = argparse.ArgumentParser(prog="python -m bench.proxyproc")
    parser.add_argument("--netns", default=None, help="namespace the backend programs")
    parser.add_argument("--backend", default="nftables")
    parser.add_argument("--services", type=int, required=True)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--affinity-seconds", type=int, default=0)
    parser.add_argument(
        "--extra", action="append", default=[], help="INDEX:ENDPOINTS, an extra Service"
    )
    parser.add_argument(
        "--wide-every", type=int, default=0, help="every K-th Service gets --wide-endpoints"
    )
    parser.add_argument("--wide-endpoints", type=int, default=250)
    parser.add_argument("--node-ip", default=str(NODE_IP))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # Before any backend module is imported (a backend may bind subprocess.Popen).
    clock = toolclock.install()

    if args.wide_every:
        services = mixed_services(
            args.services,
            args.endpoints,
            wide_every=args.wide_every,
            wide_endpoints=args.wide_endpoints,
            affinity_seconds=args.affinity_seconds,
        )
    else:
        services = build_services(
            args.services, args.endpoints, affinity_seconds=args.affinity_seconds
        )
    for index, count in map(_parse_extra, args.extra):
        services.append(synthetic_service(index, count, affinity_seconds=args.affinity_seconds))
    config = bench_config()
    backend = load_backend_factory(args.backend)(IPFamily.IPV4, config, netns=args.netns)
    proxy = BenchProxy(
        services, backend, node_ip=ipaddress.IPv4Address(args.node_ip), config=config, clock=clock
    )
    ops: dict[str, Callable[[], dict[str, Any]]] = {
        "cold": proxy.cold,
        "endpoint": proxy.change_endpoint,
        "add": proxy.add_service,
        "remove": proxy.remove_service,
        "rss": lambda: {**_peaks(), "tool_peak_kb": clock.peak_kb},
    }
    _emit({"event": "ready", **_peaks()})
    for line in sys.stdin:
        command = json.loads(line)
        op = command.get("op")
        if op == "quit":
            _emit({"event": "bye", **_peaks()})
            return 0
        handler = ops.get(op) if isinstance(op, str) else None
        if handler is None:
            _emit({"event": "error", "error": f"unknown op {op!r}"})
            continue
        _emit({"event": op, **handler()})
    return 0


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
