"""Tables written in one userspace, read in another (``make test-userspace``).

A node runs more than one nft: the proxy's (from its image or the node's venv), the
node's own, other agents' containers. nft 1.1.2 began writing set user data (a "typeof"
record of the key, even for sets declared ``type ipv4_addr``) that nft before 1.1.4 and
1.0.6.1 cannot parse: they crash (SIGSEGV) on any command that loads the sets of the
namespace (upstream kube-proxy hit it: kubernetes/kubernetes#136786). So for each pair of
userspaces run, in a fresh network namespace, the writer's ``kube-proxy-nftables --once``
syncs the example cluster, then the reader's ``nft list ruleset`` lists it and the reader's
``kube-proxy-nftables --once`` syncs over it (as after a rollback, or with two images
during a rollout). Namespaces are named ``kpxu-<pid>-<n>`` and deleted whatever happens.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

PROXY_ONCE: Final = (
    "kube-proxy-nftables",
    "--manifests",
    "examples/cluster",
    "--hostname-override",
    "demo-node",
    "--once",
)
"""What the writer and each reader run (the venv's binary; from the repository)."""
TIMEOUT_S: Final = 300

Runner = Callable[[str, str, Sequence[str]], int]
"""(network namespace, userspace label, command) -> exit status (negative: a signal)."""


@dataclass(frozen=True, slots=True)
class CrossRead:
    """How one reader fared on the table one writer's proxy left."""

    writer: str
    reader: str
    wrote: int
    listed: int
    synced: int


def verdict(status: int) -> str:
    """``ok``, the signal that ended a command (``SIGSEGV``), or its exit status."""
    if status == 0:
        return "ok"
    # A shell reports a command killed by signal N as 128 + N.
    number = -status if status < 0 else status - 128 if status > 128 else 0
    if number:
        try:
            return signal.Signals(number).name
        except ValueError:
            pass
    return f"exit {status}"


def cross_read(labels: Sequence[str], run_in: Runner) -> list[CrossRead]:
    """Every writer and reader among ``labels``, each pair in a fresh namespace."""
    found = []
    for number, (writer, reader) in enumerate((w, r) for w in labels for r in labels):
        netns = f"kpxu-{os.getpid()}-{number}"
        subprocess.run(["ip", "netns", "add", netns], check=True)
        try:
            wrote = run_in(netns, writer, PROXY_ONCE)
            listed = run_in(netns, reader, ("nft", "list", "ruleset"))
            synced = run_in(netns, reader, PROXY_ONCE)
        finally:
            subprocess.run(["ip", "netns", "delete", netns], check=False, capture_output=True)
        found.append(CrossRead(writer, reader, wrote, listed, synced))
    return found


def cross_table(found: Sequence[CrossRead], nft: dict[str, str]) -> list[str]:
    """A Markdown table: a row per writer, a column per reader (``nft list ruleset``, then
    the reader's proxy syncing over the table); ``nft`` names each label's nft version."""
    readers = list(dict.fromkeys(c.reader for c in found))
    writers = list(dict.fromkeys(c.writer for c in found))

    def name(label: str) -> str:
        return f"{label} (nft {nft[label]})" if label in nft else label

    head = ["table written by", *(f"read by {name(r)}: list / proxy" for r in readers)]
    rows = [f"| {' | '.join(head)} |", f"|{' --- |' * len(head)}"]
    for writer in writers:
        cells = [f"{name(writer)}'s proxy"]
        for reader in readers:
            pair = next(c for c in found if (c.writer, c.reader) == (writer, reader))
            if pair.wrote != 0:
                cells.append(f"(writer: {verdict(pair.wrote)})")
            else:
                cells.append(f"{verdict(pair.listed)} / {verdict(pair.synced)}")
        rows.append(f"| {' | '.join(cells)} |")
    return rows


def as_json(found: Sequence[CrossRead]) -> list[dict[str, Any]]:
    """The pairs as plain data (``cross.json`` in the results)."""
    return [
        {
            "writer": c.writer,
            "reader": c.reader,
            "wrote": c.wrote,
            "listed": c.listed,
            "synced": c.synced,
        }
        for c in found
    ]
