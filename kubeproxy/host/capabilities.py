"""Which Linux capabilities this process holds, to name a missing one before it bites.

Without ``CAP_NET_ADMIN`` every kernel call of a proxy mode fails, each with its own
unhelpful text ("cache initialization failed: Operation not permitted" from nft,
"Permission denied (you must be root)" from iptables); iptables-legacy also needs
``CAP_NET_RAW`` (it talks to the kernel over a raw socket). Reading the effective set
from ``/proc/self/status`` lets the binaries say once, up front, what is missing.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Final

__all__ = [
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_SYS_RESOURCE",
    "effective_capabilities",
    "missing_capabilities",
]

CAP_NET_ADMIN: Final = "CAP_NET_ADMIN"
"""Netfilter rules (nftables, iptables-nft), conntrack and links over netlink."""

CAP_NET_RAW: Final = "CAP_NET_RAW"
"""iptables-legacy's raw socket (reading and writing x_tables)."""

CAP_SYS_RESOURCE: Final = "CAP_SYS_RESOURCE"
"""Lowering ``oom_score_adj``."""

# Bit numbers from linux/capability.h, for the names this project needs.
_BITS: Final = {CAP_NET_ADMIN: 12, CAP_NET_RAW: 13, CAP_SYS_RESOURCE: 24}

_STATUS: Final = Path("/proc/self/status")


def effective_capabilities(status: Path = _STATUS) -> frozenset[str] | None:
    """The capabilities (of those this module names) in the effective set of this process.

    None when ``status`` cannot be read or has no ``CapEff`` line (then nobody can tell,
    and callers should not claim anything is missing).
    """
    try:
        text = status.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            try:
                mask = int(line.split(":", 1)[1].strip(), 16)
            except ValueError:
                return None
            return frozenset(name for name, bit in _BITS.items() if mask >> bit & 1)
    return None


def missing_capabilities(required: Iterable[str], status: Path = _STATUS) -> list[str]:
    """Those of ``required`` this process lacks, in the order given ([] when unknown)."""
    held = effective_capabilities(status)
    if held is None:
        return []
    return [name for name in required if name not in held]
