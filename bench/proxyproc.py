"""Our proxy in a process of its own, fed synthetic Services and driven over stdin/stdout.

Run inside the namespace it programs::

    ip netns exec NS python -m bench.proxyproc --netns NS --services N --endpoints E

It builds the Services and EndpointSlices as Kubernetes JSON dicts, creates the backend
(``--backend``: a ``kubeproxy.backends`` entry point name, or ``module:function``) and a
:class:`kubeproxy.proxier.Proxier`, prints ``{"event": "ready", ...}`` and then answers
one JSON line per command line. ``--mix realistic`` builds the realistic mix instead
(:func:`bench.synthetic.realistic_services`: both families, so a backend per family
behind a :class:`~kubeproxy.proxier.DualStackProxier`), ``--mix exposed`` every Service
reachable beyond its cluster IP (:func:`bench.synthetic.exposed_services`, N x E, both
families, ``--affinity-seconds`` on every one); ``--class-ladder N`` builds N
ClusterIP Services with 1 to N endpoints (N endpoint-count classes).

* ``{"op": "cold"}``: feed every object to the proxier, mark the sources synced, sync
  once; the timings (the end-to-end figure: objects in memory to rules committed);
* ``{"op": "endpoint"}``: change one endpoint of one Service, sync; ``{"op": "add"}``:
  add one Service with its endpoints, sync; ``{"op": "remove"}``: delete one Service
  and its slices, sync (each rotates through the Services); ``{"op": "newcount"}``: add
  one IPv4 ClusterIP Service whose endpoint count no Service had (the smallest such count
  first, so a class and a pick the table never had), sync; ``{"op": "seencount"}``: the
  same with the largest count some Service has below that one (the control: about as
  many elements, no new class);
* ``{"op": "churn", "seconds": S, "rate": R, "seed": N}``: the proxier's own sync loop
  (:meth:`kubeproxy.proxier.Proxier.run`, rate-limited by ``--min-sync-period`` as the
  daemon's is) runs for S seconds while R random endpoint changes per second arrive
  through the handlers; the answer lists every sync the loop ran (its duration as the
  core measures it, and how many Services it carried) and the process CPU time spent
  meanwhile (:meth:`BenchProxy.churn`);
* ``{"op": "rss"}``: peak resident memory of this process and of its children;
* ``{"op": "quit"}``.

The ready line carries ``input_kb``: how much the resident size grew while the synthetic
cluster (the :class:`~bench.synthetic.SyntheticService` list, the Service and
EndpointSlice dicts) was built, the benchmark's own share of the proxy's peak.

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
import itertools
import json
import logging
import random
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from bench import toolclock
from bench.harness import percentile
from bench.synthetic import (
    NODE_IP,
    NODE_IP6,
    NODE_NAME,
    POD_CIDR,
    POD_CIDR6,
    SERVICE_CIDR,
    SERVICE_CIDR6,
    EndpointSwaps,
    SyntheticService,
    build_services,
    exposed_services,
    mixed_services,
    realistic_service,
    realistic_services,
    synthetic_service,
)
from kubeproxy.backend import Backend, BackendFactory, ProxySnapshot, SyncChanges
from kubeproxy.config import LocalDetectMode, LocalDetector, ProxierConfig
from kubeproxy.configfile.model import KubeProxyNFTablesConfiguration
from kubeproxy.entrypoints import load_backend
from kubeproxy.objects import IPAddress, IPFamily, NodeInfo
from kubeproxy.proxier import DualStackProxier, FinishedSync, NullObserver, Proxier

__all__ = [
    "DAEMON_MIN_SYNC_PERIOD",
    "BenchProxy",
    "SyncLog",
    "SyncRecord",
    "bench_config",
    "emit",
    "load_backend_factory",
    "main",
]

log = logging.getLogger(__name__)

_ADDED_INDEX_BASE = 100_000  # indexes of Services added during incremental runs
_PAGE_KB = resource.getpagesize() // 1024


DAEMON_MIN_SYNC_PERIOD: float | None = (
    KubeProxyNFTablesConfiguration().min_sync_period.seconds or None
)
"""``nftables.minSyncPeriod``'s default as the proxier takes it: None, unset, so the sync
loop rests by each sync's cost (:mod:`kubeproxy.pacing`), which is what batches a stream
of changes in ``kube-proxy-nftables`` (the churn benchmark runs with it)."""


def _min_sync_period(text: str) -> float | None:
    return None if text == "paced" else float(text)


def bench_config(min_sync_period: float | None = 0.0) -> ProxierConfig:
    """The proxier settings of every benchmark: ClusterCIDR detector, our service CIDR.

    ``min_sync_period`` 0 for the benchmarks that call :meth:`Proxier.sync_now` after
    each change; the churn benchmark passes :data:`DAEMON_MIN_SYNC_PERIOD`.
    """
    return ProxierConfig(
        node_name=NODE_NAME,
        local_detector=LocalDetector(LocalDetectMode.CLUSTER_CIDR, (POD_CIDR, POD_CIDR6)),
        service_cidrs=(SERVICE_CIDR, SERVICE_CIDR6),
        node_port_addresses=("primary",),  # the kube-proxy-nftables default
        min_sync_period=min_sync_period,
    )


def load_backend_factory(name: str) -> BackendFactory:
    """A backend factory by entry-point name (``nftables``) or as ``module:function``."""
    if ":" in name:
        module, _, attribute = name.partition(":")
        return cast(BackendFactory, getattr(importlib.import_module(module), attribute))
    return load_backend(name)


def _rss_now_kb() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE_KB


def _peak_kb() -> int:
    """This process's own peak resident size (``VmHWM``).

    Not ``ru_maxrss``: the kernel carries a process's peak across ``execve``, so a child
    forked from the (by then large) pytest process reported the parent's size at fork
    time (267 MB for a 1k-Service proxy whose own peak is about 50 MB).
    """
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peaks() -> dict[str, int]:
    return {
        "maxrss_self_kb": _peak_kb(),
        "maxrss_children_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
        "rss_now_kb": _rss_now_kb(),
    }


@dataclass(frozen=True, slots=True)
class SyncRecord:
    """One sync as the core saw it: when it ended, full or not, how long, ok or not."""

    ended: float
    full: bool
    seconds: float
    ok: bool


class SyncLog(NullObserver):
    """Every sync the proxier ran (a :class:`~kubeproxy.proxier.SyncObserver`), and how
    many Services each successful one carried (as an after-sync hook)."""

    def __init__(self) -> None:
        self.syncs: list[SyncRecord] = []
        self.changed: list[int] = []

    def sync_finished(self, sync: FinishedSync) -> None:
        """Record the sync."""
        self.syncs.append(
            SyncRecord(time.perf_counter(), sync.full, sync.duration, sync.error is None)
        )

    def __call__(self, proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """After a successful sync: the number of Services it changed."""
        self.changed.append(len(changes.changed_services))


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
        backend6: Backend | None = None,
        realistic: bool = False,
    ) -> None:
        self.services = list(services)
        self.config = config or bench_config()
        self.clock = clock or toolclock.ToolClock()
        self.sync_log = SyncLog()
        addresses = (node_ip,) if backend6 is None else (node_ip, NODE_IP6)
        node = NodeInfo(name=self.config.node_name, addresses=addresses)

        def proxier(family: IPFamily, of_family: Backend) -> Proxier:
            return Proxier(
                family,
                self.config,
                of_family,
                node=node,
                host_addresses=lambda: list(addresses),
                observer=self.sync_log,
                after_sync=(self.sync_log,),
            )

        self.proxier: Proxier | DualStackProxier = proxier(IPFamily.IPV4, backend)
        if backend6 is not None:
            self.proxier = DualStackProxier(self.proxier, proxier(IPFamily.IPV6, backend6))
        self._realistic = realistic
        self._added_rng = random.Random(7)
        # Services whose endpoints an endpoint change can swap (see EndpointSwaps).
        self._swappable = [
            s for s in self.services if len(s.endpoints) <= EndpointSwaps.SPARE_OFFSET
        ]
        self._service_dicts = [s.service_dict() for s in self.services]
        self._slice_dicts = [d for s in self.services for d in s.slice_dicts()]
        self._swaps = EndpointSwaps()
        self._endpoint_turn = 0
        self._removed = 0
        self._added = 0
        self._affinity = self.services[0].affinity_seconds if self.services else 0
        self._counts = {s.endpoint_count for s in self.services}

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
        service = self._swappable[self._endpoint_turn % len(self._swappable)]
        self._endpoint_turn += 1
        old, new = self._swaps.swap(service)
        mark, start = self.clock.snapshot(), time.perf_counter()
        for before, after in zip(old, new, strict=True):
            self.proxier.on_endpoint_slice_update(before, after)
        return self._timed_sync(start, mark)

    def churn(self, seconds: float, rate: float, seed: int = 11) -> dict[str, Any]:
        """Endpoint changes of random Services at ``rate`` per second for ``seconds``,
        through the handlers, while the proxier's own sync loop batches them.

        The changes are built before the clock starts (the informer's decoding is not
        modelled); the handler calls run on this thread at their due times, the syncs
        on the loop's thread, as in the daemon. ``cpu_s`` is this process's CPU time
        (every thread: handlers, syncs, libnftables) over the ``wall_s`` window; the
        syncs are those that ended inside it.
        """
        rng = random.Random(seed)
        count = round(seconds * rate)
        swappable = self._swappable
        changes = [self._swaps.swap(swappable[rng.randrange(len(swappable))]) for _ in range(count)]
        stop = threading.Event()
        loop = threading.Thread(target=self.proxier.run, args=(stop,), name="sync-loop")
        first, first_changed = len(self.sync_log.syncs), len(self.sync_log.changed)
        late = 0.0
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        loop.start()
        for number, (old, new) in enumerate(changes):
            delay = start + number / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            else:
                late = max(late, -delay)
            for previous, current in zip(old, new, strict=True):
                self.proxier.on_endpoint_slice_update(previous, current)
        time.sleep(max(0.0, start + seconds - time.perf_counter()))
        after = resource.getrusage(resource.RUSAGE_SELF)
        end = time.perf_counter()
        stop.set()
        loop.join()
        syncs = [s for s in self.sync_log.syncs[first:] if s.ended <= end]
        durations = sorted(s.seconds for s in syncs)
        changed = self.sync_log.changed[first_changed:][: sum(s.ok for s in syncs)]
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return {
            "ok": bool(syncs) and all(s.ok for s in syncs),
            "wall_s": end - start,
            "cpu_s": cpu,
            "changes": count,
            "late_max_s": late,
            "syncs": len(syncs),
            "full_syncs": sum(s.full for s in syncs),
            "failed_syncs": sum(not s.ok for s in syncs),
            "sync_p50_ms": 1000 * (percentile(durations, 0.5) or 0.0),
            "sync_p99_ms": 1000 * (percentile(durations, 0.99) or 0.0),
            "sync_max_ms": 1000 * (durations[-1] if durations else 0.0),
            "sync_mean_ms": 1000 * (statistics.fmean(durations) if durations else 0.0),
            "services_per_sync_median": statistics.median(changed) if changed else 0,
            "min_sync_period_s": self.config.min_sync_period,
            **_peaks(),
        }

    def add_service(self) -> dict[str, Any]:
        """Add one new Service with its endpoints (one of the realistic mix's shapes, with
        it), and sync."""
        index = _ADDED_INDEX_BASE + self._added
        if self._realistic:
            service = realistic_service(index, self._added_rng, iter(()))
            self._counts.add(service.endpoint_count)
        else:
            width = len(self.services[0].endpoints) if self.services else 1
            service = synthetic_service(index, width, affinity_seconds=self._affinity)
        self._added += 1
        service_dict, slices = service.service_dict(), service.slice_dicts()
        mark, start = self.clock.snapshot(), time.perf_counter()
        self.proxier.on_service_add(service_dict)
        for slice_ in slices:
            self.proxier.on_endpoint_slice_add(slice_)
        return self._timed_sync(start, mark)

    def add_count(self, new: bool) -> dict[str, Any]:
        """Add one IPv4 ClusterIP Service (no affinity, Cluster policies) with the smallest
        endpoint count no Service had (``new``), or with the largest count below it that
        some Service has (the control), and sync."""
        unseen = next(n for n in itertools.count(1) if n not in self._counts)
        count = unseen if new else max(n for n in self._counts if n < unseen)
        self._counts.add(count)
        index = _ADDED_INDEX_BASE + self._added
        self._added += 1
        service = synthetic_service(index, count)
        service_dict, slices = service.service_dict(), service.slice_dicts()
        mark, start = self.clock.snapshot(), time.perf_counter()
        self.proxier.on_service_add(service_dict)
        for slice_ in slices:
            self.proxier.on_endpoint_slice_add(slice_)
        return {**self._timed_sync(start, mark), "count": count}

    def remove_service(self) -> dict[str, Any]:
        """Delete one of the original Services (from the end) with its slices, and sync."""
        self._removed += 1
        service = self.services[-self._removed]
        service_dict = service.service_dict()
        slices = self._swaps.forget(service)
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
    parser.add_argument(
        "--mix",
        choices=("uniform", "realistic", "exposed"),
        default="uniform",
        help="the cluster's shape",
    )
    parser.add_argument("--class-ladder", action="store_true", help="Service i has i+1 endpoints")
    parser.add_argument("--node-ip", default=str(NODE_IP))
    parser.add_argument(
        "--min-sync-period",
        type=_min_sync_period,
        default=0.0,
        help="the proxier's minSyncPeriod, or 'paced' (only the churn's sync loop heeds it)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # Before any backend module is imported (a backend may bind subprocess.Popen).
    clock = toolclock.install()
    config = bench_config(args.min_sync_period)
    factory = load_backend_factory(args.backend)
    backend = factory(IPFamily.IPV4, config, netns=args.netns)
    realistic = args.mix == "realistic"
    two_families = args.mix in ("realistic", "exposed")
    backend6 = factory(IPFamily.IPV6, config, netns=args.netns) if two_families else None
    # Everything from here to the ready line is the synthetic input (and an idle Proxier).
    before_input_kb = _rss_now_kb()

    if realistic:
        services = realistic_services(args.services)
    elif args.mix == "exposed":
        services = exposed_services(
            args.services, args.endpoints, affinity_seconds=args.affinity_seconds
        )
    elif args.class_ladder:
        services = [synthetic_service(index, index + 1) for index in range(args.services)]
    elif args.wide_every:
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
    proxy = BenchProxy(
        services,
        backend,
        node_ip=ipaddress.IPv4Address(args.node_ip),
        config=config,
        clock=clock,
        backend6=backend6,
        realistic=realistic,
    )
    ops: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
        "cold": lambda _: proxy.cold(),
        "endpoint": lambda _: proxy.change_endpoint(),
        "add": lambda _: proxy.add_service(),
        "remove": lambda _: proxy.remove_service(),
        "newcount": lambda _: proxy.add_count(new=True),
        "seencount": lambda _: proxy.add_count(new=False),
        "churn": lambda c: proxy.churn(
            float(c["seconds"]), float(c["rate"]), int(c.get("seed", 11))
        ),
        "rss": lambda _: {**_peaks(), "tool_peak_kb": clock.peak_kb},
    }
    ready = _peaks()
    ready["input_kb"] = ready["rss_now_kb"] - before_input_kb
    emit({"event": "ready", **ready})
    for line in sys.stdin:
        command = json.loads(line)
        op = command.get("op")
        if op == "quit":
            emit({"event": "bye", **_peaks()})
            return 0
        handler = ops.get(op) if isinstance(op, str) else None
        if handler is None:
            emit({"event": "error", "error": f"unknown op {op!r}"})
            continue
        emit({"event": op, **handler(command)})
    return 0


def emit(message: dict[str, Any]) -> None:
    """One JSON line on standard output, flushed (the parent reads line by line)."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
