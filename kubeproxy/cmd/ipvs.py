"""``kube-proxy-ipvs``: the proxy with its mode fixed to ipvs (deprecated, as upstream).

Starting logs upstream's deprecation warning, posts the ``IPVSDeprecation`` event and
sets ``kubeproxy_deprecated_proxy_mode{mode="ipvs"}``; migrate to ``kube-proxy-nftables``
(docs/operators.md, "Switching modes"). Everything else is shared with the other binaries: see
:mod:`kubeproxy.cmd.binary`. The mode needs a kernel with IP_VS.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Final

from kubeproxy.cmd.binary import Binary, run

__all__ = ["BINARY", "MODE", "PROG", "main"]

PROG: Final = "kube-proxy-ipvs"
"""The binary's name (in messages and ``--help``)."""

MODE: Final = "ipvs"
"""The proxy mode this binary runs in."""

BINARY: Final = Binary(PROG, MODE)
"""This binary, for :func:`kubeproxy.cmd.binary.run`."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kube-proxy-ipvs``; returns the process exit code."""
    return run(BINARY, argv)


if __name__ == "__main__":
    sys.exit(main())
