"""How fast ``kubeproxy explain`` reads a big table: our netlink reader against nft's JSON.

    python -m bench.explain                      # 100k Services x 10 endpoints
    python -m bench.explain --services 10000

A cold full sync of ``bench.nft_scale.build_world`` (with names) into a fresh network
namespace ``kpxe-<pid>`` (deleted whatever happens), then, best of ``--runs`` each:

* **explain (netlink)**: ``kubeproxy explain bench/s<N/2>``'s work in process
  (``TableReader`` + ``explain_service``): one dump of each set that names Services,
  then one question per fact of each frontend;
* **explain, every Service named**: the dumps alone (``services_named``), what finding a
  Service by name costs whatever else is asked;
* **nft -j list table**: what a tool built on nft's JSON would start with (the whole
  table listed and parsed);
* **nft -j list set dispatch-ips**: the one set that names Services, through nft (1.0.6
  fetches every element of the table before it lists one set).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

from bench.nft_scale import CONFIG, build_world, namespace
from kubeproxy.backend import SyncChanges
from kubeproxy.objects import IPFamily, NamespacedName

__all__ = ["main"]


def _best(runs: int, work: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(runs):
        began = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - began)
    return round(best, 3)


def main(argv: list[str] | None = None) -> int:
    from kubeproxy.backends.nftables import create_backend
    from kubeproxy.backends.nftables.explain import TableView, explain_service, services_named
    from kubeproxy.backends.nftables.objects import Family
    from kubeproxy.backends.nftables.reader import TableReader

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=100_000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)

    with namespace(f"kpxe-{os.getpid()}") as netns:
        world = build_world(args.services, args.endpoints, affinity=False)
        backend = create_backend(IPFamily.IPV4, CONFIG, netns=netns)
        began = time.perf_counter()
        backend.sync(world.snapshot(), SyncChanges(full=True))
        synced = time.perf_counter() - began
        close = getattr(backend, "close", None)
        if close is not None:
            close()  # the table orphaned: libnftables may read it like any other tool
        service = NamespacedName("bench", f"s{args.services // 2}")

        def explain() -> object:
            with TableReader(netns) as reader:
                view = explain_service(TableView(reader, Family.IP), service)
                assert view.frontends and view.frontends[0].endpoints
                return view

        def named() -> object:
            with TableReader(netns) as reader:
                return list(services_named(TableView(reader, Family.IP)))

        with TableReader(netns) as reader:
            gen = TableView(reader, Family.IP).generation

        def nft_json(*what: str) -> object:
            out = subprocess.run(
                ["ip", "netns", "exec", netns, "nft", "-j", "list", *what],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            return json.loads(out)

        result = {
            "services": args.services,
            "endpoints": args.endpoints,
            "cold_sync_s": round(synced, 1),
            "explain_netlink_s": _best(args.runs, explain),
            "every_service_named_s": _best(args.runs, named),
            "nft_json_list_table_s": _best(
                args.runs, lambda: nft_json("table", "ip", "kube-proxy")
            ),
            "nft_json_list_dispatch_set_s": _best(
                args.runs, lambda: nft_json("set", "ip", "kube-proxy", f"dispatch-ips.g{gen}")
            ),
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
