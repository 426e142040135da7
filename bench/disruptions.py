"""What a host firewall, an operator or another component does to a node's rules.

Shared by the owned-table bench (:mod:`bench.owned`) and its kernel test
(``tests/test_nft_owned_kernel.py``): each is a command run in the node's network
namespace, as another process would run it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DISRUPTIONS", "EMPTY_XTABLES", "FIREWALL_RELOAD", "Disruption"]

EMPTY_XTABLES = """*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
COMMIT
"""
"""What ``iptables-save`` prints on a node without rules: restoring it empties the
xtables tables (``ip filter``, ``ip nat``)."""

FIREWALL_RELOAD = """flush ruleset
table inet kpxb-firewalld {
	chain filter_INPUT {
		type filter hook input priority filter + 10; policy accept;
		ct state established,related accept
		iifname "lo" accept
		tcp dport 22 accept
	}
	chain filter_FORWARD {
		type filter hook forward priority filter + 10; policy accept;
	}
}
"""
"""A firewall's reload as ``nft -f`` of its whole configuration does it (firewalld with
``FlushAllOnReload``, nftables.service, hand-written scripts): the ruleset flushed and
the firewall's own table written back, in one transaction."""


@dataclass(frozen=True, slots=True)
class Disruption:
    """One command another process runs on the node: ``argv`` (with ``stdin``)."""

    name: str
    what: str
    argv: tuple[str, ...]
    stdin: str | None = None


DISRUPTIONS = (
    Disruption("flush", "nft flush ruleset", ("nft", "flush", "ruleset")),
    Disruption(
        "delete", "nft delete table ip kube-proxy", ("nft", "delete", "table", "ip", "kube-proxy")
    ),
    Disruption(
        "iptables",
        "iptables-nft-restore of an empty ruleset",
        ("iptables-nft-restore",),
        EMPTY_XTABLES,
    ),
    Disruption(
        "reload",
        "a firewalld-style reload (flush ruleset + its table)",
        ("nft", "-f", "-"),
        FIREWALL_RELOAD,
    ),
)
"""The four the owned table is proven against (issue 29)."""
