"""Records the nf_tables event payloads of ``tests/nft_event_payloads.py`` (as root).

    .venv/bin/python -m tests.nft_event_recorder \
        > tests/nft_event_payloads.py

In a throw-away network namespace (``kpxrec-<pid>``, deleted afterwards) it listens to
``NFNLGRP_NFTABLES`` and runs, in order: a commit of ours (libnftables in this process:
our table with a chain, a map and an element), iptables-nft building upstream-like chains
(a child process of ours), a foreign table at the same hooks (``nft``), then the damage a
firewall reload or an operator does: deleting a map element, flushing a chain, flushing
one of our iptables-nft chains, deleting the jump to it, a CNI chain of someone else's,
and ``nft flush ruleset``. Each step's datagrams are written with the port ids and pids
that tell ours from theirs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kubeproxy.backends.nftables.exec import LibNftables
from kubeproxy.nftevents import EventSocket

NETNS = f"kpxrec-{os.getpid()}"

OURS = """\
add table ip kube-proxy
add chain ip kube-proxy services
add map ip kube-proxy service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; }
add chain ip kube-proxy service-web
add rule ip kube-proxy service-web meta l4proto tcp dnat to 10.180.0.10:8080
add element ip kube-proxy service-ips { 172.30.0.10 . tcp . 80 : goto service-web }
add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips
add table ip6 kube-proxy
add chain ip6 kube-proxy services
"""

FOREIGN_TABLE = """\
add table inet firewall
add chain inet firewall input { type filter hook input priority 0 ; }
add rule inet firewall input tcp dport 22 accept
"""


def _run(*argv: str) -> int:
    """Run a tool in the namespace; its pid."""
    process = subprocess.Popen(["ip", "netns", "exec", NETNS, *argv])
    if process.wait() != 0:
        raise SystemExit(f"{' '.join(argv)} failed")
    return process.pid


def main() -> None:
    """Record every step; print the Python module."""
    subprocess.run(["ip", "netns", "add", NETNS], check=True)
    try:
        events = EventSocket(NETNS)
        steps: list[tuple[str, dict[str, int], list[bytes]]] = []

        def record(name: str, **ids: int) -> None:
            time.sleep(0.2)
            steps.append((name, ids, events.receive(0.5)))

        with LibNftables(netns=NETNS) as ours:
            ours.run_text(OURS)
            record("ours")
        # Children of ours: "ip netns exec" execs the tool, so the pid stays the same.
        pid = _run("iptables-nft", "-t", "nat", "-N", "KUBE-SERVICES")
        pid2 = _run("iptables-nft", "-t", "nat", "-A", "PREROUTING", "-j", "KUBE-SERVICES")
        record("iptables-ours", child=pid, child2=pid2)
        subprocess.run(
            ["ip", "netns", "exec", NETNS, "nft", "-f", "-"], input=FOREIGN_TABLE, text=True
        ).check_returncode()
        record("foreign-table")
        _run("nft", "delete element ip kube-proxy service-ips { 172.30.0.10 . tcp . 80 }")
        record("delete-element")
        _run("nft", "flush chain ip kube-proxy service-web")
        record("flush-chain")
        _run("iptables-nft", "-t", "nat", "-A", "KUBE-SERVICES", "-j", "RETURN")
        _run("iptables-nft", "-t", "nat", "-F", "KUBE-SERVICES")
        record("iptables-flush")
        _run("iptables-nft", "-t", "nat", "-D", "PREROUTING", "-j", "KUBE-SERVICES")
        record("iptables-delete-jump")
        _run("iptables-nft", "-t", "nat", "-N", "CNI-HOSTPORT")
        _run("iptables-nft", "-t", "nat", "-A", "POSTROUTING", "-j", "CNI-HOSTPORT")
        record("iptables-cni")
        _run("nft", "flush ruleset")
        record("flush-ruleset")
        events.close()
    finally:
        subprocess.run(["ip", "netns", "del", NETNS], check=False)
    out = sys.stdout
    out.write('"""nf_tables event datagrams recorded by tests/nft_event_recorder.py (kernel ')
    out.write(
        f'{os.uname().release}).\n\nRegenerate with that module; do not edit by hand.\n"""\n\n'
    )
    out.write("STEPS: dict[str, tuple[dict[str, int], list[str]]] = {\n")
    for name, ids, datagrams in steps:
        out.write(f"    {name!r}: (\n        {ids!r},\n        [\n")
        for datagram in datagrams:
            text = datagram.hex()
            lines = [text[i : i + 80] for i in range(0, len(text), 80)]
            out.write("            (\n")
            out.writelines(f'                "{line}"\n' for line in lines)
            out.write("            ),\n")
        out.write("        ],\n    ),\n")
    out.write("}\n")


if __name__ == "__main__":
    main()
