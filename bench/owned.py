"""A table no one else can break: connections to Services while others flush, delete and
reload, with the owned table and with today's unowned one, side by side in one run.

    make bench-owned                                       # 10k Services x 10, 3 rounds
    make bench-owned OWNED_ARGS="--services 1000 --rounds 5 --json /tmp/owned.json"

As root; the namespaces are the data-plane benchmark's (``kpxb-*``: a client, a node, an
endpoint namespace answering on every pod address; :func:`bench.dataplane.topology`),
with a foreign table at the same hooks (``inet kpxb-firewall``, what a firewall keeps).
The production binary ``kube-proxy-nftables`` runs in the node namespace over a
manifests directory of N synthetic Services with E endpoints each (:mod:`bench.synthetic`),
twice: with its defaults (the owned table, on a kernel with the owner and persist
flags) and with ``--feature-gates=NFTablesOwnedTable=false`` (today's table, repaired by
self-healing). A prober in the client namespace opens a new connection to a Service's
cluster IP every 50 ms (0.2 s timeout) and logs each outcome. Each run puts the node
through ``rounds`` rounds of the four disruptions of :mod:`bench.disruptions`
(``nft flush ruleset``, ``nft delete table ip kube-proxy``, ``iptables-nft-restore`` of
an empty ruleset, a firewalld-style reload), one at a time, each run as another process
in the node namespace.

For each mode and disruption: how often the command was refused (the owned table's
``EPERM``), the connections that failed, the longest outage the prober saw (from the
command's return to its last failed connection), and the proxy's own repair time
(``repaired X s after someone else changed them``, self-healing's line), with the
repairs counted. Prints a table and writes JSON (``--json``). Not part of ``make test``
nor of ``make bench``: the figures go to docs/operators.md, "Surviving firewall reloads".
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.disruptions import DISRUPTIONS, Disruption
from bench.netns import in_netns
from bench.selfheal import FIREWALL, REPAIRED, Prober, run_in, running_proxy, wait_for

__all__ = ["Outcome", "main", "measure"]

_TOUCHES_OUR_TABLE = frozenset({"flush", "delete", "reload"})
"""The disruptions that take today's unowned table (the iptables one never touches it):
the run waits for self-healing's repair after each. After every disruption it waits
1.5 s more and counts the repairs that came, so an owned table that was touched would
show a repair."""


@dataclass
class Outcome:
    """One mode's figures for one disruption, over every round (seconds)."""

    disruption: str
    what: str
    runs: int = 0
    refused: int = 0
    failed_connections: int = 0
    outages_s: list[float] = field(default_factory=list)
    repairs_s: list[float] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        """The figures, with the longest outage and the median and longest repair."""
        out = asdict(self)
        out["longest_outage_s"] = round(max(self.outages_s, default=0.0), 3)
        out["median_repair_s"] = (
            round(statistics.median(self.repairs_s), 3) if self.repairs_s else None
        )
        out["longest_repair_s"] = round(max(self.repairs_s), 3) if self.repairs_s else None
        return out


def _repairs(log: Path) -> list[float]:
    return [float(x) for x in REPAIRED.findall(log.read_text())]


def _disrupt(
    disruption: Disruption,
    node: str,
    prober: Prober,
    log: Path,
    cold: float,
    outcome: Outcome,
    *,
    owned: bool,
) -> None:
    before = len(_repairs(log))
    done = subprocess.run(
        in_netns(node, list(disruption.argv)),
        input=disruption.stdin,
        capture_output=True,
        text=True,
        check=False,
    )
    returned = time.monotonic()
    outcome.runs += 1
    if done.returncode != 0:
        outcome.refused += 1
    if disruption.name != "reload":  # the firewall's own table back, as its owner would
        run_in(node, "nft", "-f", "-", stdin=FIREWALL)
    if not owned and disruption.name in _TOUCHES_OUR_TABLE:
        # Today's table was hit: wait for self-healing's repair.
        wait_for(
            lambda: len(_repairs(log)) > before,
            f"the repair after {disruption.name}",
            10 * cold + 60,
        )
    time.sleep(1.5)  # connections after the repair (or after nothing happened)
    outcome.repairs_s.extend(_repairs(log)[before:])
    back = time.monotonic()
    wait_for(lambda: any(ok for t, ok in prober.since(back)), "a connection", 30)
    seen = prober.since(returned)
    failed = [t for t, ok in seen if not ok]
    outcome.failed_connections += len(failed)
    outcome.outages_s.append((failed[-1] + 0.2 - returned) if failed else 0.0)


def measure(services: int, endpoints: int, rounds: int, owned: bool) -> dict[str, Any]:
    """Run the proxy (owned table or not) at this scale through ``rounds`` rounds of
    every disruption."""
    extra = [] if owned else ["--feature-gates=NFTablesOwnedTable=false"]
    with running_proxy("kube-proxy-nftables", services, endpoints, extra) as run:
        node = run.topo.node
        flags = run_in(node, "nft", "list", "table", "ip", "kube-proxy").split("\n", 3)[1]
        outcomes = {d.name: Outcome(d.name, d.what) for d in DISRUPTIONS}
        started = time.monotonic()
        for _round in range(rounds):
            for disruption in DISRUPTIONS:
                outcome = outcomes[disruption.name]
                _disrupt(disruption, node, run.prober, run.log, run.cold, outcome, owned=owned)
        took = time.monotonic() - started
        changes = run.metric("kubeproxy_sync_proxy_rules_external_changes_total")
        total = len(run.prober.since(started))
    return {
        "mode": "owned" if owned else "unowned",
        "services": services,
        "endpoints": endpoints,
        "rounds": rounds,
        "table_flags_line": flags.strip(),
        "cold_full_sync_s": round(run.cold, 3),
        "loop_s": round(took, 1),
        "connections": total,
        "external_changes_counted": changes,
        "disruptions": [o.row() for o in outcomes.values()],
    }


def _print(runs: Sequence[dict[str, Any]]) -> None:
    first = runs[0]
    print(
        f"{first['services']} Services x {first['endpoints']} endpoints, {first['rounds']}"
        " rounds of each disruption, a new connection every 50 ms (0.2 s timeout)"
    )
    for run in runs:
        print(
            f"{run['mode']}: cold full sync {run['cold_full_sync_s']:.2f} s, table line"
            f" {run['table_flags_line']!r}, {run['connections']} connections in"
            f" {run['loop_s']:.0f} s, external changes counted"
            f" {run['external_changes_counted']:.0f}"
        )
    print("| table | disruption | runs | refused | failed connections | longest outage |", end="")
    print(" repairs | median repair | longest repair |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        for row in run["disruptions"]:
            median = row["median_repair_s"]
            longest = row["longest_repair_s"]
            print(
                f"| {run['mode']} | {row['what']} | {row['runs']} | {row['refused']} |"
                f" {row['failed_connections']} | {row['longest_outage_s']:.2f} s |"
                f" {len(row['repairs_s'])} | {'-' if median is None else f'{median:.2f} s'} |"
                f" {'-' if longest is None else f'{longest:.2f} s'} |"
            )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, measure both tables, print the table (and write the JSON);
    exit 1 when the owned table lost a connection."""
    parser = argparse.ArgumentParser(prog="python -m bench.owned", description=__doc__)
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures there")
    args = parser.parse_args(argv)
    runs = [measure(args.services, args.endpoints, args.rounds, owned) for owned in (True, False)]
    _print(runs)
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=2) + "\n")
    owned_failures = sum(r["failed_connections"] for r in runs[0]["disruptions"])
    return 0 if owned_failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
