"""``kube-proxy-iptables``: the proxy with its mode fixed to iptables.

Everything but the mode is shared with the other binaries: see :mod:`kubeproxy.cmd.binary`.
A start removes the nftables mode's tables, as upstream does.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Final

from kubeproxy.cmd.binary import Binary, run

__all__ = ["BINARY", "MODE", "PROG", "main"]

PROG: Final = "kube-proxy-iptables"
"""The binary's name (in messages and ``--help``)."""

MODE: Final = "iptables"
"""The proxy mode this binary runs in."""

BINARY: Final = Binary(PROG, MODE)
"""This binary, for :func:`kubeproxy.cmd.binary.run`."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kube-proxy-iptables``; returns the process exit code."""
    return run(BINARY, argv)


if __name__ == "__main__":
    sys.exit(main())
