"""``kube-proxy``: the multi-mode binary, for configurations written for upstream's.

The mode comes from ``mode`` in the configuration file or ``--proxy-mode`` (``nftables``,
``iptables``, ``ipvs``). Without one it runs in iptables mode, upstream's default, after
logging a warning and posting a ``ProxyModeDefaulted`` Warning event about the Node: set
the mode explicitly (nftables is the one to choose). Everything else is shared with the
other binaries: see :mod:`kubeproxy.cmd.binary`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Final

from kubeproxy.cmd.binary import Binary, run

__all__ = ["BINARY", "PROG", "main"]

PROG: Final = "kube-proxy"
"""The binary's name (in messages and ``--help``)."""

BINARY: Final = Binary(PROG)
"""This binary, for :func:`kubeproxy.cmd.binary.run`."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kube-proxy``; returns the process exit code."""
    return run(BINARY, argv)


if __name__ == "__main__":
    sys.exit(main())
