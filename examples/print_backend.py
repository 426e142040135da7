"""An out-of-tree backend in a few lines: print the Services the core hands it.

Run it on the example cluster with
``python examples/print_backend.py examples/cluster``. The core does the parsing, change
tracking, traffic policy and topology; the backend only renders what it receives.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kubeproxy import (
    IPFamily,
    ManifestSource,
    NodeInfo,
    Proxier,
    ProxierConfig,
    ProxySnapshot,
    SyncChanges,
)


class PrintBackend:
    """A backend that writes one line per Service port instead of programming a kernel."""

    def __init__(self, family: IPFamily) -> None:
        self._family = family
        self.lines: list[str] = []

    @property
    def family(self) -> IPFamily:
        """The family this backend serves."""
        return self._family

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Print every Service port with the endpoints that cluster traffic would reach."""
        kind = "full" if changes.full else "partial"
        lines = [f"# {kind} sync, {len(snapshot.services)} service ports"]
        for name in sorted(snapshot.services):
            port = snapshot.services[name]
            endpoints = snapshot.categorized[name].cluster
            targets = ", ".join(e.key for e in endpoints) or "(no endpoints: REJECT)"
            lines.append(f"{name} {port} -> {targets}")
        self.lines.extend(lines)
        print("\n".join(lines))

    def cleanup(self) -> None:
        """Nothing to remove: this backend never touched the kernel."""


def main(directory: str) -> int:
    """Load a manifests directory once and print what a backend would receive."""
    config = ProxierConfig(node_name="demo-node")
    backend = PrintBackend(IPFamily.IPV4)
    proxier = Proxier(IPFamily.IPV4, config, backend, node=NodeInfo(name="demo-node"))
    # Loading delivers every object, then "synced": the proxier syncs right away.
    ManifestSource(Path(directory), proxier, node_name="demo-node").load()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "examples/cluster"))
