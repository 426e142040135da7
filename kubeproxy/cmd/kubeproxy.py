"""``kubeproxy``: answers for operators, read from the kernel (issue 30).

    kubeproxy explain NAMESPACE/SERVICE [--port NAME] [--family ipv4|ipv6] [--json]

Every answer is read from the kernel over netlink (:mod:`kubeproxy.backends.nftables.
reader`), never from the proxy's memory, so it is true when the proxy is wedged or gone.
``--netns NAME`` reads the table of a named network namespace (tests, and a node whose
proxy runs in one).

Exit codes: 0 an answer; 1 the kernel holds nothing for what was asked; 2 a usage error
or a kernel that could not be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Final, TextIO

from kubeproxy.backends.nftables.explain import FrontendView, ServiceView, TableView
from kubeproxy.backends.nftables.explain import explain_service as _explain_service
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.reader import TableReader
from kubeproxy.objects import NamespacedName

__all__ = ["PROG", "explain", "main"]

PROG: Final = "kubeproxy"
"""The tool's name (in messages and ``--help``)."""

_FAMILIES: Final = {"ipv4": (Family.IP,), "ipv6": (Family.IP6,), "both": (Family.IP, Family.IP6)}


def _service(text: str) -> NamespacedName:
    namespace, slash, name = text.partition("/")
    if not slash or not namespace or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAMESPACE/SERVICE")
    return NamespacedName(namespace, name)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="What the kernel holds for Services, in Service terms."
    )
    parser.add_argument("--netns", help="read the tables of this network namespace")
    commands = parser.add_subparsers(dest="command", required=True)
    explain_cmd = commands.add_parser(
        "explain", help="a Service's frontends, classes and endpoints, as the kernel holds them"
    )
    explain_cmd.add_argument("service", type=_service, metavar="NAMESPACE/SERVICE")
    explain_cmd.add_argument("--port", help="one port of the Service, by name")
    explain_cmd.add_argument("--family", choices=sorted(_FAMILIES), default="both")
    explain_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def explain(
    service: NamespacedName,
    port: str | None = None,
    families: Sequence[Family] = (Family.IP, Family.IP6),
    *,
    netns: str | None = None,
) -> list[ServiceView]:
    """``service`` (its port ``port``) in each family's table of the current generation."""
    with TableReader(netns) as reader:
        return [_explain_service(TableView(reader, family), service, port) for family in families]


def _slots(values: Sequence[str | None]) -> str:
    return ", ".join(
        f"[{slot}] {value if value is not None else 'MISSING'}" for slot, value in enumerate(values)
    )


def _print_frontend(fe: FrontendView, out: TextIO) -> None:
    where = " (cluster IP)" if fe.cluster_ip else ""
    if fe.nodeport_addresses:
        where = f" on {', '.join(fe.nodeport_addresses)}"
    print(f"  {fe.address}{where}  {fe.name or ''}", file=out)
    if fe.chain is not None:
        print(f"    class {fe.chain}: {fe.what}", file=out)
        print(f"    endpoints by slot: {_slots(fe.endpoints) or 'none'}", file=out)
        if fe.shortcut:
            print(f"    short-circuit (pods, this node): {_slots(fe.shortcut)}", file=out)
    else:
        print(f"    {fe.what}", file=out)
    if fe.chain is not None and fe.no_endpoint is not None:
        print(f"    no endpoint for clients from outside: {fe.no_endpoint}", file=out)
    if fe.source_ranges:
        print("    loadBalancerSourceRanges apply (firewall-ips): others dropped", file=out)
    if fe.affinity_maps:
        held = ", ".join(
            f"{a.client} -> {a.endpoint}"
            + (f" ({a.expires_s:.0f} s left)" if a.expires_s is not None else "")
            for a in fe.affinity
        )
        print(
            f"    affinity entries ({', '.join(fe.affinity_maps)}): {held or 'none held'}",
            file=out,
        )


def _print_views(views: Sequence[ServiceView], out: TextIO) -> None:
    for view in views:
        if view.generation is None:
            print(f"{view.service}: table {view.family} kube-proxy is not there", file=out)
            continue
        if not view.frontends:
            print(
                f"{view.service}: nothing in table {view.family} kube-proxy"
                f" (generation {view.generation})",
                file=out,
            )
            continue
        head = f"{view.service} in {view.family} kube-proxy, generation {view.generation}:"
        print(head, file=out)
        for fe in view.frontends:
            _print_frontend(fe, out)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run ``kubeproxy``; returns the exit code."""
    out = out if out is not None else sys.stdout
    args = _parser().parse_args(argv)
    try:
        views = explain(args.service, args.port, _FAMILIES[args.family], netns=args.netns)
    except (NftError, OSError) as err:
        print(f"{PROG}: cannot read the kernel's tables: {err}", file=sys.stderr)
        return 2
    if args.json:
        json.dump([v.as_json() for v in views], out, indent=2)
        print(file=out)
    else:
        _print_views(views, out)
    return 0 if any(v.frontends for v in views) else 1


if __name__ == "__main__":
    sys.exit(main())
