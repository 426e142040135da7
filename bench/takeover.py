"""Taking a node over at scale: from the start of our proxy to the last object of the
previous one gone, and the connections that failed meanwhile.

    make bench-takeover                                          # 1k and 10k Services x 10
    make bench-takeover TAKEOVER_ARGS="--services 30000 --cases upstream-iptables"
    make bench-takeover TAKEOVER_ARGS="--services 1000 --json /tmp/takeover.json"

As root; the namespaces are the data-plane benchmark's (``kpxb-*``: a client, a node, an
endpoint namespace answering on every pod address; :func:`bench.dataplane.topology`).
For each case the node first holds what the previous proxy wrote for N synthetic
Services x E endpoints (:mod:`bench.synthetic`), then the production binary starts in
the node namespace as a daemon over a manifests directory of the same Services, while a
prober in the client namespace opens a new connection to a Service's cluster IP every
50 ms (0.2 s timeout). The cases:

* ``upstream-nftables``: upstream's nftables table (its first sync's transaction, from
  :mod:`bench.upstream_structure`, 1.34+ layout), taken over by ``kube-proxy-nftables``;
* ``upstream-iptables``: upstream's iptables chains (iptables-nft; written by our
  ``kube-proxy-iptables`` without a service CIDR: exactly upstream's chains and rules),
  taken over by ``kube-proxy-nftables``;
* ``ours-nftables-to-iptables``: a switch between our own modes, the first step of the
  way back to upstream's iptables mode: our nftables tables, taken over by
  ``kube-proxy-iptables``;
* ``ours-nftables-restart``: our own table taken over by a restarted
  ``kube-proxy-nftables`` (the old generation swept), the baseline.

Reported per case, from the proxy's process start (its log's timestamps): our rules live
(the end of the first full sync of every family), the previous proxy's last object gone
(the takeover's "Took the node over" line: our table swept, the other modes' leftovers
removed), checked afterwards (nothing of the previous proxy in ``nft`` or
``iptables-save``), and the failed connections from the start to a second after that.
Not part of ``make test`` nor of ``make bench``: the figures go to `images/README.md`'s "Replacing
kube-proxy".
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.dataplane import Topology, topology
from bench.netns import in_netns
from bench.selfheal import Prober, wait_for
from bench.synthetic import NODE_NAME, POD_CIDR, SERVICE_CIDR, SyntheticService, build_services
from bench.synthetic import service_ip as cluster_ip
from bench.upstream_structure import write_upstream_ruleset
from bench.wholeproc import binary_path, write_manifests

__all__ = ["CASES", "Result", "main", "measure"]

CASES = (
    "upstream-nftables",
    "upstream-iptables",
    "ours-nftables-to-iptables",
    "ours-nftables-restart",
)
_KLOG_TIME = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+)")
_TOOK_OVER = "Took the node over"
_LIVE = "First full sync done"  # every family's first full sync is in (GcTuner's line)
_DELETED = re.compile(r"(\d+) unused objects deleted")


@dataclass
class Result:
    """One case at one size (seconds from our process start)."""

    case: str
    services: int
    previous_write_s: float
    rules_live_s: float
    previous_gone_s: float
    objects_deleted: int
    left_afterwards: int
    connections: int
    failed_connections: int


def _run(netns: str, *argv: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        in_netns(netns, list(argv)), input=stdin, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {done.stderr[-2000:]}")
    return done.stdout


def _flags(manifests: Path, *, cidr: bool = True) -> list[str]:
    return [
        f"--hostname-override={NODE_NAME}",
        f"--manifests={manifests}",
        f"--cluster-cidr={POD_CIDR}",
        *([f"--service-cluster-ip-range={SERVICE_CIDR}"] if cidr else []),
        "--healthz-bind-address=",
        "--metrics-bind-address=",
    ]


def _klog_time(line: str, year: int) -> float | None:
    """The wall-clock time of a klog line (``I1129 02:14:53.867089 ...``)."""
    found = _KLOG_TIME.match(line)
    if found is None:
        return None
    stamp = datetime.datetime.strptime(f"{year}{found[1]} {found[2]}", "%Y%m%d %H:%M:%S.%f")
    return stamp.timestamp()


def _previous(case: str, node: str, manifests: Path, services: Sequence[SyntheticService]) -> None:
    """Write what the previous proxy leaves on the node."""
    if case == "upstream-nftables":
        with tempfile.NamedTemporaryFile("w", suffix=".nft", prefix="kpxb-upstream-") as ruleset:
            write_upstream_ruleset(Path(ruleset.name), services)
            _run(node, "nft", "-f", ruleset.name)
    elif case == "upstream-iptables":
        _run(
            node, str(binary_path("kube-proxy-iptables")), *_flags(manifests, cidr=False), "--once"
        )
    else:
        _run(node, str(binary_path("kube-proxy-nftables")), *_flags(manifests), "--once")


def _left(case: str, node: str) -> int:
    """How many objects of the previous proxy the node still holds."""
    if case == "upstream-nftables":
        chains = _run(node, "nft", "list", "chains", "ip")
        maps = _run(node, "nft", "-t", "list", "maps", "ip")
        return chains.count("/") // 3 + maps.count("service-ips")
    if case == "upstream-iptables":
        saved = _run(node, "iptables-nft-save")
        return sum(1 for line in saved.splitlines() if line.startswith(":KUBE-SVC"))
    if case == "ours-nftables-to-iptables":
        # Not "nft list tables": nft 1.0.6 reads the whole ruleset for it, and iptables
        # mode's rules at 30k Services took it more than 18 minutes.
        tables = 0
        for family in ("ip", "ip6"):
            listed = subprocess.run(
                in_netns(node, ["nft", "list", "table", family, "kube-proxy"]),
                capture_output=True,
                check=False,
            )
            tables += listed.returncode == 0
        return tables
    chains = _run(node, "nft", "list", "chains", "ip")
    return len(re.findall(r"\.g1 ", chains))


def _case(
    case: str,
    topo: Topology,
    tmp: Path,
    services: Sequence[SyntheticService],
    keep_logs: Path | None = None,
) -> Result:
    manifests = write_manifests(tmp / "cluster", services)
    started = time.monotonic()
    _previous(case, topo.node, manifests, services)
    previous_write = time.monotonic() - started
    prober = Prober(topo.client, str(cluster_ip(len(services) // 2)))
    log_path = tmp / f"{case}.log"
    mode = "iptables" if case == "ours-nftables-to-iptables" else "nftables"
    argv = [str(binary_path(f"kube-proxy-{mode}")), *_flags(manifests), "-v", "2"]
    proxy: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: any(ok for _, ok in prober.results), "a first connection", 60)
        with log_path.open("w") as log:
            start_wall, start = time.time(), time.monotonic()
            proxy = subprocess.Popen(in_netns(topo.node, argv), stdout=log, stderr=log)
        wait_for(lambda: _TOOK_OVER in log_path.read_text(), "the takeover", 3600)
        done = time.monotonic()
        time.sleep(1.0)
        lines = log_path.read_text().splitlines()
        year = datetime.datetime.fromtimestamp(start_wall).year
        took = [t for line in lines if _TOOK_OVER in line and (t := _klog_time(line, year))]
        syncs = [t for line in lines if _LIVE in line and (t := _klog_time(line, year))]
        deleted = [int(m[1]) for line in lines if (m := _DELETED.search(line))]
        seen = prober.since(start)
        left = _left(case, topo.node)
    finally:
        prober.close()
        if proxy is not None:
            proxy.terminate()
            proxy.wait(60)
        if keep_logs is not None:
            keep_logs.mkdir(parents=True, exist_ok=True)
            (keep_logs / f"{case}-{len(services)}.log").write_text(log_path.read_text())
    live = (syncs[0] - start_wall) if syncs else float("nan")
    gone = (took[0] - start_wall) if took else done - start
    return Result(
        case,
        len(services),
        round(previous_write, 2),
        round(live, 2),
        round(gone, 2),
        deleted[0] if deleted else 0,
        left,
        len(seen),
        sum(1 for _, ok in seen if not ok),
    )


def measure(
    cases: Sequence[str], services: int, endpoints: int, keep_logs: Path | None = None
) -> list[Result]:
    """Every case at this size, each in fresh namespaces (the proxy's logs copied into
    ``keep_logs`` if given)."""
    results = []
    synthetic = build_services(services, endpoints)
    for case in cases:
        with tempfile.TemporaryDirectory(prefix="kpxb-takeover-") as tmp, topology(1) as topo:
            results.append(_case(case, topo, Path(tmp), synthetic, keep_logs))
            print(_row(results[-1]), flush=True)
    return results


def _row(r: Result) -> str:
    return (
        f"| {r.case} | {r.services // 1000}k | {r.previous_write_s:.1f} s | "
        f"{r.rules_live_s:.2f} s | {r.previous_gone_s:.2f} s | {r.objects_deleted} | "
        f"{r.left_afterwards} | {r.failed_connections} of {r.connections} |"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, measure, print the table (and write the JSON)."""
    parser = argparse.ArgumentParser(prog="python -m bench.takeover", description=__doc__)
    parser.add_argument("--services", default="1000,10000", help="comma-separated sizes")
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", type=Path, help="also write the figures there")
    parser.add_argument("--logs", type=Path, help="keep the proxy's logs in this directory")
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    print(
        "| case | Services | previous proxy's write | our rules live | previous proxy's "
        "last object gone | objects swept from our table | left afterwards | failed "
        "connections |"
    )
    print("|---|---|---|---|---|---|---|---|")
    results: list[dict[str, Any]] = []
    for size in (int(s) for s in args.services.split(",")):
        results += [asdict(r) for r in measure(cases, size, args.endpoints, args.logs)]
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    bad = [r for r in results if r["failed_connections"] or r["left_afterwards"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
