"""How fast ``kubeproxy explain`` reads a big table: by name (every element decoded, or
only the answer messages holding the name), by address, and nft's JSON.

    python -m bench.explain                      # 100k Services x 10 endpoints
    python -m bench.explain --services 30000 --nft-json

A cold full sync of ``bench.nft_scale.build_world`` (with names) into a fresh network
namespace ``kpxe-<pid>`` (deleted whatever happens), then, best of ``--runs`` each, side
by side in one run:

* **explain by name, every element decoded** (before): ``explain bench/s<N/2>``'s work
  in process as it was: each set that names Services dumped and decoded whole, the
  comments matched, then one question per fact of each frontend;
* **explain by name, filtered dump** (now): the same dumps, but only the answer messages
  whose bytes hold the name are decoded (``TableReader.elements(containing=...)``);
* **explain by address**: ``explain IP:PORT/PROTO``: single-element gets only;
* **every Service named**: the dumps decoded whole (``services_named``);
* the same three from process start, through the installed ``kubeproxy`` script;
* with ``--nft-json``: ``nft -j list table`` and ``nft -j list set dispatch-ips``
  (what a tool built on nft's JSON starts with; at 100k the first ran for over 90 s
  of CPU at 1.1 GB before it was stopped, hence opt-in).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.nft_scale import CONFIG, build_world, namespace, service_port
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
    parser.add_argument("--nft-json", action="store_true", help="time nft -j listings too")
    args = parser.parse_args(argv)
    from kubeproxy.backends.nftables.explain import explain_address
    from kubeproxy.backends.nftables.frontends import comment_names

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
        port = service_port(args.services // 2, affinity=False)
        address = (port.cluster_ip, port.port, str(port.protocol).lower())

        def explain() -> object:
            with TableReader(netns) as reader:
                view = explain_service(TableView(reader, Family.IP), service)
                assert view.frontends and view.frontends[0].endpoints
                return view

        def explain_decoding_all() -> object:
            with TableReader(netns) as reader:
                table = TableView(reader, Family.IP)
                found = table.frontends_named(lambda c: comment_names(c, service))
                views = [table.explain(kind, key, name) for kind, key, name in found]
                assert views and views[0].endpoints
                return views

        def explain_by_address() -> object:
            with TableReader(netns) as reader:
                fe = explain_address(TableView(reader, Family.IP), *address)
                assert fe is not None and fe.endpoints
                return fe

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

        script = str(Path(sys.executable).parent / "kubeproxy")

        def cli(*what: str) -> object:
            return subprocess.run(
                [script, "--netns", netns, "explain", *what], capture_output=True, check=True
            )

        ip_text = f"{address[0]}:{address[1]}/{address[2]}"
        result: dict[str, object] = {
            "services": args.services,
            "endpoints": args.endpoints,
            "cold_sync_s": round(synced, 1),
            "explain_by_name_decoding_all_s": _best(args.runs, explain_decoding_all),
            "explain_by_name_filtered_s": _best(args.runs, explain),
            "explain_by_address_s": _best(args.runs, explain_by_address),
            "every_service_named_s": _best(args.runs, named),
            "process_explain_by_name_s": _best(
                args.runs, lambda: cli(str(service), "--family", "ipv4")
            ),
            "process_explain_by_address_s": _best(args.runs, lambda: cli(ip_text)),
            "process_help_s": _best(args.runs, lambda: cli("--help")),
        }
        if args.nft_json:
            result["nft_json_list_table_s"] = _best(
                args.runs, lambda: nft_json("table", "ip", "kube-proxy")
            )
            result["nft_json_list_dispatch_set_s"] = _best(
                args.runs, lambda: nft_json("set", "ip", "kube-proxy", f"dispatch-ips.g{gen}")
            )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
