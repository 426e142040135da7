"""``kubeproxy explain|verify --mode iptables``: iptables mode's answers, read from the
kernel with ``iptables-save`` (:mod:`kubeproxy.backends.iptables.explain`).

Separate from :mod:`kubeproxy.cmd.kubeproxy` so that nftables mode's command never loads
the iptables backend. ipvs mode is not read: its Services are IPVS virtual servers
(``ipvsadm -Ln`` lists them by address, with their real servers and weights, which is
already an operator's view) plus ipsets and iptables rules that name no Service, and this
kernel has no IP_VS to test a reader against.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any, TextIO

from kubeproxy.objects import IPFamily, NamespacedName

__all__ = ["IptablesError", "run_explain_iptables", "verify_iptables"]


class IptablesError(Exception):
    """The iptables tools could not be run or read (their message)."""


def _endpoints(found: Sequence[tuple[str, str | None]]) -> str:
    shown = []
    for endpoint, probability in found:
        chance = f" (p {float(probability):.3f})" if probability is not None else ""
        shown.append(endpoint + chance)
    return ", ".join(shown) or "none"


def _print(
    service: NamespacedName, family: IPFamily, frontends: Sequence[Any], out: TextIO
) -> None:
    print(f"{service} in iptables ({family}):", file=out)
    for fe in frontends:
        table = "filter" if fe.no_endpoint else "nat"
        print(f'  {fe.address}  {table} {fe.chain} "{fe.comment}"', file=out)
        if fe.no_endpoint:
            print(f"    no endpoint: new connections get {fe.no_endpoint}", file=out)
            continue
        print(f"    chains: {' -> '.join(fe.path) or 'none'}", file=out)
        for match in fe.masquerade:
            print(f"    masqueraded when: {match}", file=out)
        print(f"    endpoints: {_endpoints(fe.endpoints)}", file=out)
        if fe.affinity_s is not None:
            print(f"    ClientIP affinity {fe.affinity_s} s", file=out)


def run_explain_iptables(
    args: argparse.Namespace, families: Sequence[IPFamily], out: TextIO
) -> int:
    """``explain --mode iptables``: a Service's frontends per family (exit 1: none)."""
    from kubeproxy.backends.iptables.exec import IptablesError as ToolError
    from kubeproxy.backends.iptables.explain import explain_service, read_tables

    if not isinstance(args.service, NamespacedName):
        print("kubeproxy explain IP:PORT/PROTO: nftables mode only", file=out)
        return 2
    found: dict[IPFamily, list[Any]] = {}
    try:
        for family in families:
            tables = read_tables(family, args.netns)
            found[family] = explain_service(
                tables["nat"], tables["filter"], args.service, args.port
            )
    except (ToolError, OSError) as err:
        print(f"kubeproxy: cannot read iptables: {err}", file=out)
        return 2
    if args.json:
        data = {str(f): [fe.as_json() for fe in fes] for f, fes in found.items()}
        json.dump({"service": str(args.service), "families": data}, out, indent=2)
        print(file=out)
    else:
        for family, frontends in found.items():
            if frontends:
                _print(args.service, family, frontends, out)
        empty = [str(f) for f, fes in found.items() if not fes]
        if empty:
            print(f"{args.service}: not in iptables ({', '.join(empty)})", file=out)
    return 0 if any(found.values()) else 1


def verify_iptables(
    fakes: Sequence[Any], families: Sequence[IPFamily], *, netns: str | None = None
) -> list[Any]:
    """The differences between the kernel's iptables chains and the dry run's."""
    from kubeproxy.backends.iptables.exec import IptablesError as ToolError
    from kubeproxy.backends.iptables.explain import verify_tables

    try:
        return list(verify_tables(fakes, families, netns=netns))
    except ToolError as err:
        raise IptablesError(str(err)) from err
