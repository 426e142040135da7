"""nft-clusterip-proxy: an out-of-tree service proxy in one file, run as a node daemon.

It renders ClusterIPs only (no NodePorts, external IPs, policies or masquerade), each as
one nftables rule in a table of its own; the library daemon does everything else: the
API source and its wait for the Node, node IPs, /healthz, /metrics, Events, the run loop.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
from collections.abc import Sequence
from pathlib import Path

from kubeproxy import (
    DaemonOptions,
    DaemonPlugins,
    IPFamily,
    ProxierConfig,
    ProxySnapshot,
    SyncChanges,
    SyncError,
    run_daemon,
)

NAME = "nft-clusterip-proxy"


class ClusterIPBackend:
    """One nftables table per family (``nft-clusterip``), rewritten whole at every sync."""

    def __init__(self, family: IPFamily, config: ProxierConfig, *, netns: str | None = None):
        self.family = family
        self.ip = "ip" if family is IPFamily.IPV4 else "ip6"
        self.table = f"table {self.ip} nft-clusterip"
        where = ["ip", "netns", "exec", netns] if netns else []  # the flow kit's node
        self.nft = [*where, "nft", "-f", "-"]

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """DNAT each ClusterIP port to a random one of its endpoints, in one transaction."""
        lines = [f"{self.table} {{}}", f"delete {self.table}", f"{self.table} {{"]
        for hook in ("prerouting", "output"):
            lines.append(f"chain {hook} {{ type nat hook {hook} priority -100; jump services; }}")
        lines.append("chain services {")
        for port in snapshot.services.values():  # every address and port already validated
            endpoints = snapshot.categorized[port.name].cluster
            targets = ", ".join(f"{i} : {ep.address} . {ep.port}" for i, ep in enumerate(endpoints))
            match = f"{self.ip} daddr {port.cluster_ip} {port.protocol.lower} dport {port.port}"
            pick = f"numgen random mod {len(endpoints)} map {{ {targets} }}"
            lines += [f"{match} dnat {self.ip} addr . port to {pick}"] if endpoints else []
        self._nft("\n".join([*lines, "}", "}"]))

    def cleanup(self) -> None:
        """Remove the table."""
        self._nft(f"{self.table} {{}}\ndelete {self.table}")

    def _nft(self, script: str) -> None:
        done = subprocess.run(self.nft, input=script, text=True, capture_output=True)
        if done.returncode != 0:
            raise SyncError(f"nft: {' '.join(done.stderr.split())}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run as a node's proxy until SIGTERM: ``--config FILE`` [``--master URL``]."""
    parser = argparse.ArgumentParser(prog=NAME, description=__doc__)
    parser.add_argument("--config", type=Path, required=True, help="KubeProxyConfiguration")
    parser.add_argument("--master", default="", help="API server URL (else the kubeconfig)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname).1s %(name)s] %(message)s")
    try:
        options = DaemonOptions.from_file(args.config, mode="nftables", master=args.master)
    except ValueError as err:  # ConfigError: names the field (or the unreadable file)
        parser.error(f"--config {args.config}: {err}")
    return run_daemon(options, ClusterIPBackend, plugins=DaemonPlugins(mode="nftables", name=NAME))


if __name__ == "__main__":
    raise SystemExit(main())
