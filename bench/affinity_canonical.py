"""ClientIP affinity of Service ports with more addresses than their cluster IP: the
chains per port they keep today against entries keyed by the port's cluster-IP frontend
through shared chains (issue 32 item 3), written with ``nft`` into fresh namespaces.

Not the backend: a model of the affinity part of its table, to measure what the kernel
(and nft) pay for each structure before the backend and its encoder are changed. N ports,
each with a cluster IP and a load-balancer IP (both externalTrafficPolicy Cluster), 10
endpoints; the same dispatch and slot elements in all three subjects, committed as the
backend commits a full sync (every chain and container in one transaction, then the
elements in transactions of :data:`BATCH` elements):

* ``none``: no affinity;
* ``pinned``: today's structure for such ports: a lookup and a record chain of each port's
  own (its pin numbers as constants), both frontends' verdict elements pointing at them;
* ``canonical``: no chain per port: the load-balancer frontend's lookup and record chains,
  shared by every port of a map, turn the packet's destination into the port's cluster IP
  (``ip daddr set ... map @affinity-canonical-ips``) so that its entry is the cluster IP's
  one, restoring the packet after (``ct original`` before DNAT, ``ct reply`` after); one
  element per load-balancer frontend says which cluster IP is its port's.

    python -m bench.affinity_canonical --services 30000 --rounds 2

Each round runs the three in turn, each in a fresh namespace (deleted after), and prints
one JSON line per run: seconds from the first transaction to the last, and chains.
``tests/test_affinity_canonical_kernel.py`` checks the ``canonical`` rules' meaning with
real packets, NodePorts included (:func:`canonical_chains` has their chains too: the
destination and the port turned into the cluster IP's, ``tcp dport set``; the measured
ports have none, as most ports of a large cluster, 2700 NodePorts in all).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench.netns import in_netns, namespace

__all__ = ["BATCH", "SHARDS", "SUBJECTS", "canonical_chains", "one_port_table", "ruleset"]

BATCH = 6000
"""Elements per transaction (about the backend's: 69 batches at 30k x 10)."""
SHARDS = 256
SUBJECTS = ("none", "pinned", "canonical")
ENDPOINTS = 10
TIMEOUT = 10800


def _cluster_ip(i: int) -> str:
    return f"10.{96 + (i >> 16)}.{(i >> 8) & 255}.{i & 255}"


def _lb_ip(i: int) -> str:
    return f"198.{18 + (i >> 16)}.{(i >> 8) & 255}.{i & 255}"


def _endpoint(i: int, e: int) -> str:
    n = i * ENDPOINTS + e
    return f"10.{128 + (n >> 16)}.{(n >> 8) & 255}.{n & 255}"


def canonical_chains(shard: int) -> dict[str, list[str]]:
    """The shared chains of one map for TCP: a lookup and a record chain for the cluster
    IP (as the backend writes for ports on their cluster IP only), for the other
    addresses (destination turned into the port's cluster IP, restored after) and for
    NodePorts (destination and port turned into the cluster IP and the port)."""
    m = f"@affinity-frontends-{shard}"
    key = "ip daddr . meta l4proto . th dport . ip saddr"
    orig = "ct original ip daddr . meta l4proto . ct original proto-dst"
    np = "meta l4proto . ct original proto-dst"
    return {
        f"lookup-cip-{shard}": [f"meta l4proto tcp dnat to {key} map {m}"],
        f"lookup-ext-{shard}": [
            f"meta l4proto tcp ip daddr set {orig} map @affinity-canonical-ips "
            f"dnat to {key} map {m}",
            "ip daddr set ct original ip daddr",
        ],
        f"record-cip-{shard}": [
            f"meta l4proto {{ tcp, udp, sctp }} update {m} {{ ct original ip daddr . "
            f"meta l4proto . ct original proto-dst . ip saddr timeout {TIMEOUT}s : "
            "ip daddr . th dport } accept"
        ],
        f"record-ext-{shard}": [
            f"meta l4proto {{ tcp, udp, sctp }} ip daddr set {orig} map "
            f"@affinity-canonical-ips update {m} {{ ip daddr . meta l4proto . ct original "
            f"proto-dst . ip saddr timeout {TIMEOUT}s : "
            "ct reply ip saddr . ct reply proto-src } ip daddr set ct reply ip saddr accept",
            "ip daddr set ct reply ip saddr",
        ],
        # A NodePort: the node's address and the NodePort turned into the cluster IP and
        # the port (the port's protocol named: nft writes a port's checksum fix-up only
        # for a named transport header).
        f"lookup-np-{shard}": [
            f"tcp dport set {np} map @affinity-canonical-ports ip daddr set {np} map "
            f"@affinity-canonical-nodeports dnat to {key} map {m}",
            "ip daddr set ct original ip daddr tcp dport set ct original proto-dst",
        ],
        f"record-np-{shard}": [
            f"meta l4proto tcp tcp dport set {np} map @affinity-canonical-ports ip daddr set "
            f"{np} map @affinity-canonical-nodeports update {m} {{ {key} timeout {TIMEOUT}s "
            ": ct reply ip saddr . ct reply proto-src } ip daddr set ct reply ip saddr "
            "tcp dport set ct reply proto-src accept",
            "ip daddr set ct reply ip saddr tcp dport set ct reply proto-src",
        ],
    }


def one_port_table(
    cluster_ip: str,
    lb_ip: str,
    node_port: int,
    endpoints: tuple[str, str],
    *,
    size: int | None = None,
) -> str:
    """Table ``t`` with one port on ``cluster_ip``, ``lb_ip`` (TCP 80) and ``node_port``
    (on any local address), two endpoints on 8080, whose affinity is written by
    :func:`canonical_chains` (map 0), hooked in prerouting and output (the lookup) and
    forward and output (the record): what the kernel test reads. ``size`` declares the
    affinity map's."""
    picks = ", ".join(f"{n} : {ep} . 8080" for n, ep in enumerate(endpoints))
    bound = f"size {size} ; " if size is not None else ""
    chains = canonical_chains(0)
    cip, lb = f"{cluster_ip} . tcp . 80", f"{lb_ip} . tcp . 80"
    chains["pick"] = [
        "ip daddr . meta l4proto . th dport vmap @affinity-lookup-ips",
        "fib daddr type local meta l4proto . th dport vmap @affinity-lookup-nodeports",
        f"meta l4proto tcp dnat to numgen random mod {len(endpoints)} map {{ {picks} }}",
    ]
    chains["record"] = [
        "ct state new ct status dnat meta l4proto { tcp, udp, sctp } ct original ip daddr"
        " . meta l4proto . ct original proto-dst vmap @affinity-record-ips",
        "ct state new ct status dnat meta l4proto { tcp, udp, sctp } meta l4proto . "
        "ct original proto-dst vmap @affinity-record-nodeports",
    ]
    hooks = {
        "nat-prerouting": ("nat", "prerouting", "-100"),
        "nat-output": ("nat", "output", "-100"),
        "filter-forward": ("filter", "forward", "0"),
        "filter-output": ("filter", "output", "0"),
    }
    for name, (kind, hook, priority) in hooks.items():
        verdict = "jump pick" if kind == "nat" else "jump record"
        chains[name] = [f"type {kind} hook {hook} priority {priority} ;", f"{verdict}"]
        if kind == "nat":
            chains[name][1] = f"ip daddr . meta l4proto . th dport {{ {cip}, {lb} }} jump pick"
            chains[name].append(f"fib daddr type local tcp dport {node_port} jump pick")
    lines = [
        "table ip t {",
        "  map affinity-lookup-ips { typeof ip daddr . meta l4proto . th dport : verdict ;"
        f" elements = {{ {cip} : jump lookup-cip-0, {lb} : jump lookup-ext-0 }} }}",
        "  map affinity-record-ips { typeof ip daddr . meta l4proto . th dport : verdict ;"
        f" elements = {{ {cip} : goto record-cip-0, {lb} : goto record-ext-0 }} }}",
        "  map affinity-canonical-ips { typeof ip daddr . meta l4proto . th dport : ip daddr ;"
        f" elements = {{ {lb} : {cluster_ip} }} }}",
        "  map affinity-lookup-nodeports { typeof meta l4proto . th dport : verdict ;"
        f" elements = {{ tcp . {node_port} : jump lookup-np-0 }} }}",
        "  map affinity-record-nodeports { typeof meta l4proto . th dport : verdict ;"
        f" elements = {{ tcp . {node_port} : goto record-np-0 }} }}",
        "  map affinity-canonical-nodeports { typeof meta l4proto . th dport : ip daddr ;"
        f" elements = {{ tcp . {node_port} : {cluster_ip} }} }}",
        "  map affinity-canonical-ports { typeof meta l4proto . th dport : th dport ;"
        f" elements = {{ tcp . {node_port} : 80 }} }}",
        "  map affinity-frontends-0 { typeof ip daddr . meta l4proto . th dport . ip saddr :"
        f" ip daddr . th dport ; {bound}flags dynamic,timeout ; timeout {TIMEOUT}s ; }}",
    ]
    lines += [
        f"  chain {name} {{\n" + "".join(f"    {r}\n" for r in rules) + "  }"
        for name, rules in chains.items()
    ]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _pinned_chains(i: int) -> dict[str, list[str]]:
    shard, high, low = i % SHARDS, 1_000_000 + i, 2_000_000 + i
    key = f"numgen random mod 1 offset {high} . numgen random mod 1 offset {low} . ip saddr"
    m = f"@affinity-clients-{shard}"
    return {
        f"lookup-{i}": [f"meta l4proto tcp dnat to {key} map {m}"],
        f"record-{i}": [f"update {m} {{ {key} timeout {TIMEOUT}s : ip daddr . th dport }} accept"],
    }


def ruleset(subject: str, services: int) -> tuple[str, list[str]]:
    """The first transaction (table, containers, chains) and the element batches."""
    head = ["table ip t {"]
    head.append("  map dispatch { typeof ip daddr . meta l4proto . th dport : verdict ; }")
    head.append(
        "  map slots { typeof ip daddr . meta l4proto . th dport . numgen random mod 1"
        " : ip daddr . th dport ; }"
    )
    elements: list[tuple[str, str]] = []
    chains: dict[str, list[str]] = {}
    if subject != "none":
        for kind in ("lookup", "record"):
            head.append(
                f"  map affinity-{kind}-ips {{ typeof ip daddr . meta l4proto . th dport"
                " : verdict ; }"
            )
        if subject == "pinned":
            dyn = "numgen random mod 1 . numgen random mod 1 . ip saddr : ip daddr . th dport"
            prefix = "affinity-clients"
        else:
            dyn = "ip daddr . meta l4proto . th dport . ip saddr : ip daddr . th dport"
            prefix = "affinity-frontends"
            head.append(
                "  map affinity-canonical-ips { typeof ip daddr . meta l4proto . th dport"
                " : ip daddr ; }"
            )
            head.append(
                "  map affinity-canonical-nodeports { typeof meta l4proto . th dport : ip daddr ; }"
            )
            head.append(
                "  map affinity-canonical-ports { typeof meta l4proto . th dport : th dport ; }"
            )
            for shard in range(SHARDS):
                chains.update(canonical_chains(shard))
        for shard in range(SHARDS):
            head.append(
                f"  map {prefix}-{shard} {{ typeof {dyn} ; flags dynamic,timeout ; "
                f"timeout {TIMEOUT}s ; }}"
            )
    for i in range(services):
        cip, lb = f"{_cluster_ip(i)} . tcp . 80", f"{_lb_ip(i)} . tcp . 80"
        for fe in (cip, lb):
            elements.append(("dispatch", f"{fe} : jump pick"))
            for e in range(ENDPOINTS):
                elements.append(("slots", f"{fe} . {e} : {_endpoint(i, e)} . 8080"))
        if subject == "pinned":
            own = _pinned_chains(i)
            chains.update(own)
            for fe in (cip, lb):
                elements.append(("affinity-lookup-ips", f"{fe} : jump lookup-{i}"))
                elements.append(("affinity-record-ips", f"{fe} : goto record-{i}"))
        elif subject == "canonical":
            shard = i % SHARDS
            elements.append(("affinity-lookup-ips", f"{cip} : jump lookup-cip-{shard}"))
            elements.append(("affinity-record-ips", f"{cip} : goto record-cip-{shard}"))
            elements.append(("affinity-lookup-ips", f"{lb} : jump lookup-ext-{shard}"))
            elements.append(("affinity-record-ips", f"{lb} : goto record-ext-{shard}"))
            elements.append(("affinity-canonical-ips", f"{lb} : {_cluster_ip(i)}"))
    pick = "ip daddr . meta l4proto . th dport . numgen random mod 10"
    chains["pick"] = [f"meta l4proto tcp dnat to {pick} map @slots"]
    head += [
        f"  chain {name} {{\n" + "".join(f"    {r}\n" for r in rules) + "  }"
        for name, rules in chains.items()
    ]
    head.append("}")
    return "\n".join(head) + "\n", list(_batches(elements))


def _batches(elements: list[tuple[str, str]]) -> Iterator[str]:
    for start in range(0, len(elements), BATCH):
        by_map: dict[str, list[str]] = {}
        for container, element in elements[start : start + BATCH]:
            by_map.setdefault(container, []).append(element)
        yield "".join(
            f"add element ip t {name} {{ {', '.join(items)} }}\n" for name, items in by_map.items()
        )


def measure(subject: str, services: int) -> dict[str, object]:
    """One cold write of ``subject`` into a fresh namespace."""
    first, batches = ruleset(subject, services)
    with tempfile.TemporaryDirectory(prefix="kpxb-affcanon-") as tmp, namespace("acan") as ns:
        paths = [Path(tmp, "0.nft")]
        paths[0].write_text(first)
        for n, text in enumerate(batches, 1):
            paths.append(Path(tmp, f"{n}.nft"))
            paths[-1].write_text(text)
        start = time.perf_counter()
        for path in paths:
            subprocess.run(in_netns(ns, ["nft", "-f", str(path)]), check=True)
        seconds = time.perf_counter() - start
    chains = first.count("  chain ")
    return {
        "subject": subject,
        "services": services,
        "seconds": round(seconds, 3),
        "chains": chains,
        "transactions": len(paths),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.affinity_canonical")
    parser.add_argument("--services", type=int, default=30000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--subject", action="append", choices=SUBJECTS, help="run only these (default: all)"
    )
    args = parser.parse_args()
    for _ in range(args.rounds):
        for subject in args.subject or SUBJECTS:
            print(json.dumps(measure(subject, args.services)), flush=True)


if __name__ == "__main__":
    main()
