"""Surviving firewall reloads at scale: how soon rules someone else removed are back.

    make bench-selfheal                                  # nftables, 10k Services x 10
    make bench-selfheal SELFHEAL_ARGS="--mode iptables"  # iptables (the node's variant)
    make bench-selfheal SELFHEAL_ARGS="--services 1000 --json /tmp/selfheal.json"

As root; the namespaces are the data-plane benchmark's (``kpxb-*``: a client, a node, an
endpoint namespace answering on every pod address; :func:`bench.dataplane.topology`).
The production binary (``kube-proxy-nftables`` or ``kube-proxy-iptables``) runs in the
node namespace over a manifests directory of N synthetic Services with E endpoints each
(:mod:`bench.synthetic`), with a foreign table at the same hooks (``inet kpxb-firewall``,
what a firewall keeps). A prober in the client namespace opens a new connection to a
Service's cluster IP every 50 ms (0.2 s timeout) and logs each outcome. Then, one at a
time, what a firewall reload or an operator does:

* ``table``: ``nft delete table ip kube-proxy`` (iptables mode: ``ip nat``);
* ``ruleset``: ``nft flush ruleset``, the foreign table restored by its owner right after;
* ``chain``: ``nft flush chain`` of the first regular chain of ours holding rules
  (iptables mode: ``iptables -t nat -F`` of our first chain with rules);
* ``element``: ``nft delete element`` of an element naming the probed cluster IP, a
  map's if any (iptables mode: ``iptables -t nat -D`` of our first rule naming it).

For each: the proxy's own figure (``repaired X s after someone else changed them``: from
the report to the end of the repairing full sync), the outage the prober saw (from the
damage command's return to its last failed connection), the failed connections, and the
target: back within (cold full-sync time + 1 s). Prints a table and writes JSON
(``--json``). Not part of ``make test`` nor of ``make bench``'s default run: the numbers
go to docs/operators.md, "Surviving firewall reloads".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.dataplane import topology
from bench.netns import in_netns
from bench.synthetic import (
    CLUSTER_PORT,
    NODE_NAME,
    POD_CIDR,
    build_services,
    service_ip,
)
from bench.wholeproc import binary_path, write_manifests
from kubeproxy.backends.iptables.proxier import owns_chain
from kubeproxy.backends.nftables.exec import LibNftables
from kubeproxy.backends.nftables.objects import Family

__all__ = [
    "FIREWALL",
    "REPAIRED",
    "Case",
    "Prober",
    "RunningProxy",
    "main",
    "metric",
    "run_in",
    "running_proxy",
    "wait_for",
]

TABLE = "kube-proxy"
FIREWALL = """table inet kpxb-firewall {
	chain input {
		type filter hook input priority filter; policy accept;
		tcp dport 22 accept
	}
	chain forward {
		type filter hook forward priority filter; policy accept;
	}
}
"""
REPAIRED = re.compile(r"IPv4 rules repaired ([0-9.]+)s after someone else changed them")
_PROBE = """
import socket, sys, time
target = (sys.argv[1], int(sys.argv[2]))
while True:
    started = time.monotonic()
    try:
        with socket.create_connection(target, timeout=0.2):
            ok = 1
    except OSError:
        ok = 0
    print(f"{started:.4f} {ok}", flush=True)
    time.sleep(max(0.0, 0.05 - (time.monotonic() - started)))
"""


@dataclass
class Case:
    """One damage case's figures (seconds)."""

    case: str
    damage_s: float
    repaired_s: float | None
    outage_s: float
    failed_connections: int
    full_syncs: int
    within_target: bool


class Prober:
    """The client's connection loop, outcomes read as they come."""

    def __init__(self, client: str, address: str) -> None:
        argv = in_netns(client, [sys.executable, "-c", _PROBE, address, str(CLUSTER_PORT)])
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        self.results: list[tuple[float, bool]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            started, ok = line.split()
            self.results.append((float(started), ok == "1"))

    def since(self, moment: float) -> list[tuple[float, bool]]:
        return [r for r in list(self.results) if r[0] >= moment]

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def run_in(netns: str, *argv: str, stdin: str | None = None) -> str:
    """``argv`` in ``netns``; its output (a failure raises)."""
    done = subprocess.run(
        in_netns(netns, list(argv)), input=stdin, capture_output=True, text=True, check=True
    )
    return done.stdout


def metric(netns: str, port: int, name: str) -> float:
    """The sum of every sample of metric ``name`` on the proxy's ``/metrics``."""
    text = run_in(netns, "curl", "-s", f"http://127.0.0.1:{port}/metrics")
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _first_nft_chain_with_rules(netns: str) -> str:
    chains = json.loads(run_in(netns, "nft", "-j", "list", "chains", "ip"))["nftables"]
    for item in chains:
        chain = item.get("chain")
        if not chain or chain["table"] != TABLE or "hook" in chain:
            continue
        listed = json.loads(run_in(netns, "nft", "-j", "list", "chain", "ip", TABLE, chain["name"]))
        if any("rule" in i for i in listed["nftables"]):
            return str(chain["name"])
    raise RuntimeError("no regular chain of ours holds rules")


def _nft_element_naming(netns: str, address: str) -> tuple[str, str]:
    """(map or set, key) of an element naming ``address``, a map's first: a map element
    is what sends the address somewhere."""
    found: list[tuple[bool, str, str]] = []
    with LibNftables(netns=netns) as reader:
        for name in reader.list_sets(Family.IP, TABLE):
            for element in reader.list_elements(Family.IP, TABLE, name):
                if address in element.key:
                    found.append((not element.is_map, name, " . ".join(element.key)))
    if not found:
        raise RuntimeError(f"no element of ours names {address}")
    _, container, key = min(found)
    return container, key


def _iptables_rules(netns: str) -> list[list[str]]:
    return [
        shlex.split(line)
        for line in run_in(netns, "iptables-nft", "-t", "nat", "-S").splitlines()
        if line.startswith("-A ") and owns_chain("nat", line.split()[1])
    ]


def _damages(mode: str, netns: str, address: str) -> dict[str, Callable[[], None]]:
    """The damage of each case (targets picked from the kernel before the clock starts)."""

    def tool(*argv: str) -> Callable[[], None]:
        def run() -> None:
            run_in(netns, *argv)

        return run

    def nft(*args: str) -> Callable[[], None]:
        return tool("nft", *args)

    if mode == "nftables":
        chain = _first_nft_chain_with_rules(netns)
        container, key = _nft_element_naming(netns, address)
        return {
            "table": nft("delete", "table", "ip", TABLE),
            "ruleset": nft("flush", "ruleset"),
            "chain": nft("flush", "chain", "ip", TABLE, chain),
            "element": nft("delete", "element", "ip", TABLE, container, f"{{ {key} }}"),
        }
    rules = _iptables_rules(netns)
    chain = rules[0][1]
    rule = next(r for r in rules if any(address in word for word in r))

    def iptables(*args: str) -> Callable[[], None]:
        return tool("iptables-nft", "-t", "nat", *args)

    return {
        "table": nft("delete", "table", "ip", "nat"),
        "ruleset": nft("flush", "ruleset"),
        "chain": iptables("-F", chain),
        "element": iptables("-D", *rule[1:]),
    }


def wait_for(check: Callable[[], bool], what: str, timeout: float) -> None:
    """Until ``check()``; ``TimeoutError`` naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: nothing after {timeout:.0f} s")
        time.sleep(0.05)


METRICS_PORT = 10249
"""Where the proxy under test serves ``/metrics`` (in the node namespace)."""
FULL_SYNCS = "kubeproxy_sync_full_proxy_rules_duration_seconds"


@dataclass
class RunningProxy:
    """The production binary running in the node namespace of the data-plane topology,
    synced once, and the prober connecting to one of its Services."""

    topo: Any
    log: Path
    cold: float
    """The first full sync's seconds (the proxy's own histogram)."""
    prober: Prober
    address: str

    def metric(self, name: str) -> float:
        """The sum of metric ``name``'s samples on the proxy's ``/metrics``."""
        return metric(self.topo.node, METRICS_PORT, name)


@contextlib.contextmanager
def running_proxy(
    binary: str,
    services: int,
    endpoints: int,
    extra: Sequence[str] = (),
    keep_log: Path | None = None,
) -> Iterator[RunningProxy]:
    """``binary`` (``kube-proxy-nftables`` ...) over N synthetic Services x E endpoints in
    the node namespace, with the foreign table at the same hooks, after its first full
    sync and a first connection of the prober; stopped (and its log copied to
    ``keep_log``) afterwards."""
    with tempfile.TemporaryDirectory(prefix="kpxb-selfheal-") as tmp, topology(1) as topo:
        directory = Path(tmp) / "cluster"
        write_manifests(directory, build_services(services, endpoints))
        log_path = Path(tmp) / "proxy.log"
        argv = [
            str(binary_path(binary)),
            f"--hostname-override={NODE_NAME}",
            f"--manifests={directory}",
            f"--cluster-cidr={POD_CIDR}",
            f"--metrics-bind-address=127.0.0.1:{METRICS_PORT}",
            "--healthz-bind-address=127.0.0.1:10256",
            *extra,
        ]
        run_in(topo.node, "nft", "-f", "-", stdin=FIREWALL)
        with log_path.open("w") as log:
            proxy = subprocess.Popen(in_netns(topo.node, argv), stdout=log, stderr=log)
        prober: Prober | None = None
        try:

            def synced() -> bool:
                try:
                    return metric(topo.node, METRICS_PORT, f"{FULL_SYNCS}_count") >= 1
                except subprocess.CalledProcessError:
                    return False

            wait_for(synced, "the first full sync", 1800)
            cold = metric(topo.node, METRICS_PORT, f"{FULL_SYNCS}_sum")
            address = str(service_ip(services // 2))
            prober = Prober(topo.client, address)
            wait_for(lambda: any(ok for _, ok in prober.results), "a first connection", 30)
            yield RunningProxy(topo, log_path, cold, prober, address)
        finally:
            if prober is not None:
                prober.close()
            proxy.terminate()
            proxy.wait(30)
            if keep_log is not None:
                keep_log.write_text(log_path.read_text())


def measure(
    mode: str, services: int, endpoints: int, cases: Sequence[str], keep_log: Path | None = None
) -> dict[str, Any]:
    """Run the proxy at this scale and put every case through it (its log copied to
    ``keep_log`` if given)."""
    # In nftables mode, what self-healing repairs: today's unowned table (an owned one
    # refuses every damage here; bench.owned puts the two side by side).
    extra = ["--feature-gates=NFTablesOwnedTable=false"] if mode == "nftables" else []
    with running_proxy(f"kube-proxy-{mode}", services, endpoints, extra, keep_log) as run:
        node = run.topo.node

        def full_syncs() -> int:
            return int(run.metric(f"{FULL_SYNCS}_count"))

        damages = _damages(mode, node, run.address)
        firewall = run_in(node, "nft", "list", "table", "inet", "kpxb-firewall")
        results = []
        for case in cases:
            before = full_syncs()
            result = _case(case, damages[case], node, run.prober, run.log, run.cold)
            # Every full sync the case caused (the repair, and any other it asked for).
            result.full_syncs = full_syncs() - before
            results.append(result)
            after = run_in(node, "nft", "list", "table", "inet", "kpxb-firewall")
            assert after == firewall, "the foreign table was touched"
        changes = run.metric("kubeproxy_sync_proxy_rules_external_changes_total")
    return {
        "mode": mode,
        "services": services,
        "endpoints": endpoints,
        "cold_full_sync_s": round(run.cold, 3),
        "external_changes_counted": changes,
        "cases": [asdict(r) for r in results],
    }


def _case(
    case: str,
    damage: Callable[[], None],
    netns: str,
    prober: Prober,
    log_path: Path,
    cold: float,
) -> Case:
    repairs_before = len(REPAIRED.findall(log_path.read_text()))
    started = time.monotonic()
    damage()
    if case == "ruleset":
        run_in(netns, "nft", "-f", "-", stdin=FIREWALL)  # the owner puts its table back
    done = time.monotonic()

    def repaired() -> bool:
        return len(REPAIRED.findall(log_path.read_text())) > repairs_before

    wait_for(repaired, f"the repair after {case}", 10 * cold + 60)
    took = float(REPAIRED.findall(log_path.read_text())[-1])
    back = time.monotonic()
    wait_for(lambda: any(ok for t, ok in prober.since(back)), f"a connection after {case}", 30)
    time.sleep(1.0)  # a few more connections after the repair
    seen = prober.since(done)
    failed = [t for t, ok in seen if not ok]
    outage = (failed[-1] + 0.2 - done) if failed else 0.0  # the attempt's timeout included
    return Case(
        case,
        round(done - started, 3),
        round(took, 3),
        round(outage, 3),
        len(failed),
        0,
        # Rules fully back (the proxy's repair) and connections working, both in time.
        max(outage, took) <= cold + 1.0,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, measure, print the table (and write the JSON)."""
    parser = argparse.ArgumentParser(prog="python -m bench.selfheal", description=__doc__)
    parser.add_argument("--mode", choices=("nftables", "iptables"), default="nftables")
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--cases", default="table,ruleset,chain,element")
    parser.add_argument("--json", type=Path, help="also write the figures there")
    parser.add_argument("--log", type=Path, help="keep the proxy's log there")
    args = parser.parse_args(argv)
    run = measure(args.mode, args.services, args.endpoints, args.cases.split(","), args.log)
    print(
        f"{run['mode']}, {run['services']} Services x {run['endpoints']} endpoints: "
        f"cold full sync {run['cold_full_sync_s']:.2f} s; target: back within "
        f"{run['cold_full_sync_s'] + 1:.2f} s"
    )
    print("| case | damage took | repaired (proxy) | outage seen | failed connections |", end="")
    print(" full syncs | within target |")
    print("|---|---|---|---|---|---|---|")
    for case in run["cases"]:
        print(
            f"| {case['case']} | {case['damage_s']:.2f} s | {case['repaired_s']:.2f} s | "
            f"{case['outage_s']:.2f} s | {case['failed_connections']} | {case['full_syncs']} | "
            f"{'yes' if case['within_target'] else 'NO'} |"
        )
    print(f"external changes counted: {run['external_changes_counted']:.0f}")
    if args.json is not None:
        args.json.write_text(json.dumps(run, indent=2) + "\n")
    return 0 if all(c["within_target"] for c in run["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
