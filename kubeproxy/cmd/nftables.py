"""``kube-proxy-nftables``: the proxy with its mode fixed to nftables (what the DaemonSet runs).

Everything but the mode is shared with the other binaries: see :mod:`kubeproxy.cmd.binary`.
A start removes what iptables and ipvs modes left behind, as upstream does.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Final

from kubeproxy.cmd.binary import Binary, run, version
from kubeproxy.cmd.modes import CleanupFailureCounter

__all__ = ["BINARY", "MODE", "PROG", "CleanupFailureCounter", "main", "version"]

PROG: Final = "kube-proxy-nftables"
"""The binary's name (in messages and ``--help``)."""

MODE: Final = "nftables"
"""The proxy mode this binary runs in."""

BINARY: Final = Binary(PROG, MODE)
"""This binary, for :func:`kubeproxy.cmd.binary.run`."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kube-proxy-nftables``; returns the process exit code."""
    return run(BINARY, argv)


if __name__ == "__main__":
    sys.exit(main())
