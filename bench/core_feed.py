"""The core's part of a cold start, CPU time, several checkouts side by side (issue 32).

    python -m bench.core_feed --services 30000 --rounds 3 main=/work/main branch=/work/wt/NAME

The whole process (:mod:`bench.memory_compare`) mixes the core with the backend and the
kernel, and its wall time with the load of a shared machine. This measures only what the
core does with a ``--manifests`` directory before a backend sees anything, as CPU time
(``time.process_time``) of one process per run, with the garbage collector held as the
daemon holds it until its first full sync:

* *load*: :class:`~kubeproxy.sources.manifests.ManifestSource` reading the JSON ``kind:
  List`` files (:func:`bench.wholeproc.write_manifests`) into a Service and an
  EndpointSlice change tracker of each family (as the dual-stack proxier feeds them:
  the API validation, the JSON decoding, the parse);
* *apply*: each family's :class:`~kubeproxy.servicechanges.ServicePortMap` and
  :class:`~kubeproxy.endpointchanges.EndpointsMap` applying them, and every port's
  endpoints categorised (:func:`~kubeproxy.topology.categorize_endpoints`).

``--through proxiers`` feeds the source into what the daemon feeds instead: a
:class:`~kubeproxy.proxier.DualStackProxier` over the two families'
:class:`~kubeproxy.proxier.Proxier` (Services to both, each slice to its address type's),
each over a backend that only takes the snapshot (:class:`NullBackend`); *load* is the
source delivering into them, *apply* their first sync (the maps applied, every port
categorised, the snapshot built), so the proxiers' own glue is counted too.

A checkout is ``LABEL=ROOT[:PYTHON]`` as for :mod:`bench.memory_compare`; each run is
this file run as a script with ``ROOT`` first on ``PYTHONPATH``, so it measures that
checkout's ``kubeproxy`` (this file needs only the core's public names, which older
checkouts have too). The checkouts alternate within each round. Prints one line per
run and writes ``<results>/<date>-core-feed-<host>.json``. Not part of ``make bench``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from bench.memory_compare import Checkout

KIND: Final = "core-feed"
THROUGH: Final = ("trackers", "proxiers")
"""What the source feeds: the trackers alone (the default) or the dual-stack proxier."""
NODE: Final = "kpxb-node"


def feed(directory: Path, node_name: str = NODE) -> dict[str, Any]:
    """Load ``directory`` into both families' trackers, apply and categorise (see the
    module); the CPU seconds of each part and how many ports have endpoints."""
    from kubeproxy.endpointchanges import EndpointsChangeTracker, EndpointsMap
    from kubeproxy.objects import IPFamily
    from kubeproxy.servicechanges import ServiceChangeTracker, ServicePortMap
    from kubeproxy.sources.manifests import ManifestSource
    from kubeproxy.topology import categorize_endpoints

    services = {family: ServiceChangeTracker(family) for family in IPFamily}
    slices = {family: EndpointsChangeTracker(family, node_name) for family in IPFamily}

    class Feeder:
        """Every Service and EndpointSlice event into both families' trackers (a
        :class:`~kubeproxy.handlers.ProxyHandler`; the rest is not the core's load)."""

        def on_service_add(self, service: Any) -> None:
            for tracker in services.values():
                tracker.update(None, service)

        def on_service_update(self, old: Any, new: Any) -> None:
            for tracker in services.values():
                tracker.update(old, new)

        def on_service_delete(self, service: Any) -> None:
            for tracker in services.values():
                tracker.update(service, None)

        def on_endpoint_slice_add(self, slice_: Any) -> None:
            for tracker in slices.values():
                tracker.update(slice_, False)

        def on_endpoint_slice_update(self, old: Any, new: Any) -> None:
            for tracker in slices.values():
                tracker.update(new, False, previous=old)

        def on_endpoint_slice_delete(self, slice_: Any) -> None:
            for tracker in slices.values():
                tracker.update(slice_, True)

        def on_services_synced(self) -> None:
            pass

        def on_endpoint_slices_synced(self) -> None:
            pass

        def on_node_update(self, node: Any) -> None:
            pass

        def on_service_cidrs_changed(self, cidrs: Any) -> None:
            pass

    gc.disable()
    try:
        start = time.process_time()
        ManifestSource(directory, Feeder(), node_name=node_name).load()
        loaded = time.process_time()
        ports = 0
        for family in IPFamily:
            service_map, endpoints_map = ServicePortMap(), EndpointsMap()
            service_map.apply(services[family])
            endpoints_map.apply(slices[family])
            for name, port in service_map.items():
                endpoints = endpoints_map.get(name)
                if endpoints:
                    categorize_endpoints(endpoints, port, node_name, "")
                    ports += 1
        applied = time.process_time()
    finally:
        gc.enable()
    return {"load_cpu_s": loaded - start, "apply_cpu_s": applied - loaded, "ports": ports}


class NullBackend:
    """A backend that takes each snapshot and writes nothing (the core's part alone)."""

    def __init__(self, family: Any) -> None:
        self.family = family
        self.syncs = 0
        self.ports = 0

    def sync(self, snapshot: Any, changes: Any) -> None:
        """Count the sync and the ports with categorised endpoints."""
        endpoints = snapshot.endpoints
        self.ports = sum(1 for name in snapshot.services if endpoints.get(name))
        self.syncs += 1

    def cleanup(self) -> None:
        """Nothing was written."""


class _SyncedLater:
    """A handler passing everything on but the end of the slices' list (the proxiers
    sync at once on it), which the caller delivers itself, timed apart."""

    def __init__(self, handler: Any) -> None:
        self._handler = handler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)

    def on_endpoint_slices_synced(self) -> None:
        """Held back (see the class)."""


def feed_proxiers(directory: Path, node_name: str = NODE) -> dict[str, Any]:
    """``--through proxiers`` (see the module): the CPU seconds of the source delivering
    into the dual-stack proxier, of their first syncs, and how many ports have endpoints."""
    from kubeproxy.config import ProxierConfig
    from kubeproxy.objects import IPFamily
    from kubeproxy.proxier import DualStackProxier, Proxier
    from kubeproxy.sources.manifests import ManifestSource

    config = ProxierConfig(node_name=node_name)
    backends = [NullBackend(family) for family in IPFamily]
    proxiers = [Proxier(backend.family, config, backend) for backend in backends]
    handler = DualStackProxier(*proxiers)
    source = ManifestSource(directory, _SyncedLater(handler), node_name=node_name)
    gc.disable()
    try:
        start = time.process_time()
        source.load()
        loaded = time.process_time()
        handler.on_endpoint_slices_synced()  # both families complete now: each syncs
        applied = time.process_time()
    finally:
        gc.enable()
    if any(backend.syncs != 1 for backend in backends):
        raise RuntimeError(f"expected one sync per family, got {[b.syncs for b in backends]}")
    return {
        "load_cpu_s": loaded - start,
        "apply_cpu_s": applied - loaded,
        "ports": sum(backend.ports for backend in backends),
    }


def _child(subject: Checkout, manifests: Path, through: str) -> dict[str, Any]:
    script = str(Path(__file__).resolve())
    done = subject.run([str(subject.python), script, "child", str(manifests), through])
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module); ``child DIR`` is one run."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["child"]:
        through = args[2] if len(args) > 2 else "trackers"
        measure = feed_proxiers if through == "proxiers" else feed
        print(json.dumps(measure(Path(args[1]))))
        return 0
    from bench.memory_compare import checkouts_parser, write_runs
    from bench.synthetic import build_services
    from bench.wholeproc import write_manifests

    parser = checkouts_parser("python -m bench.core_feed", None, 30_000)
    parser.set_defaults(rounds=3)
    parser.add_argument("--through", choices=THROUGH, default=THROUGH[0])
    options = parser.parse_args(args)
    load = os.getloadavg()[0]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kpxb-corefeed-") as work:
        services = build_services(options.services, options.endpoints)
        manifests = write_manifests(Path(work) / "manifests", services)
        for index in range(options.rounds):
            for subject in options.checkouts:
                run = {
                    "label": subject.label,
                    "round": index,
                    "through": options.through,
                    **_child(subject, manifests, options.through),
                }
                runs.append(run)
                print(
                    f"{options.services} round {index} {subject.label}: load CPU "
                    f"{run['load_cpu_s']:.2f} s, apply and categorise CPU "
                    f"{run['apply_cpu_s']:.2f} s ({run['ports']} ports)",
                    flush=True,
                )
    path = write_runs(options, KIND, "python -m bench.core_feed " + " ".join(args), load, runs)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    if sys.path and sys.path[0] == str(Path(__file__).resolve().parent):
        # Run as a script (a child): the checkout on PYTHONPATH, not this directory.
        sys.path.pop(0)
    sys.exit(main())
