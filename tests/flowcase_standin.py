"""A stand-in backend for testing the flow-case runner itself.

It ignores what the core computed and writes, into the node namespace, a tiny ruleset
made by hand for each Service namespace present in the snapshot: the "what to do" table
:data:`RULES`. The case files under ``tests/flowcases_standin/`` use those namespaces, and
their flows say either what the hand-made rules really do (the runner must report PASS)
or something else (the runner must report FAIL). Flow names start with ``pass:``,
``fail:`` or ``skip:`` accordingly.

Use it as ``--backend tests.flowcase_standin:factory`` (from the repository root).
"""

from __future__ import annotations

import subprocess
from typing import Final

from kubeproxy.backend import Backend, ProxySnapshot, SyncChanges, SyncError
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPFamily

TABLE: Final = "kpxf_standin"

_BASE: Final = """\
table {family} {table} {{
    chain nat_pre {{ type nat hook prerouting priority -100; }}
    chain nat_out {{ type nat hook output priority -100; }}
    chain nat_post {{ type nat hook postrouting priority 100; }}
    chain filter_fwd {{ type filter hook forward priority 0; }}
    chain filter_out {{ type filter hook output priority 0; }}
}}
"""


def _dispatch(match: str, verdict: str) -> str:
    """The same DNAT dispatch for traffic arriving (prerouting) and leaving (output)."""
    return f"add rule @ nat_pre {match} {verdict}\nadd rule @ nat_out {match} {verdict}\n"


def _filter(match: str, verdict: str) -> str:
    return f"add rule @ filter_fwd {match} {verdict}\nadd rule @ filter_out {match} {verdict}\n"


# What to do, per Service namespace and family: nft commands, "@" standing for the table.
RULES: Final[dict[str, dict[IPFamily, str]]] = {
    # Two of the three endpoints the EndpointSlice lists; masquerade for everything that
    # is not from a pod, and for hairpin.
    "dnat": {
        IPFamily.IPV4: (
            "add chain @ web-a\n"
            "add rule @ web-a meta l4proto { tcp, sctp } dnat to 10.180.1.1:8080\n"
            "add chain @ web-b\n"
            "add rule @ web-b meta l4proto { tcp, sctp } dnat to 10.180.2.1:8080\n"
            "add chain @ web\n"
            "add rule @ web numgen random mod 2 vmap { 0 : goto web-a, 1 : goto web-b }\n"
            + _dispatch("ip daddr 172.30.1.1 meta l4proto { tcp, sctp } th dport 80", "goto web")
            + _dispatch("ip daddr 192.168.0.2 tcp dport 30080", "goto web")
            + _dispatch("ip daddr 172.30.1.2 udp dport 53", "dnat to 10.180.1.1:5353")
            + "add rule @ nat_post ct status dnat ip saddr != 10.0.0.0/8 masquerade\n"
            "add rule @ nat_post ct status dnat ip saddr 10.180.1.1 ip daddr 10.180.1.1"
            " masquerade\n"
        ),
    },
    "affinity": {
        IPFamily.IPV4: (
            "add set @ sticky-a { type ipv4_addr; flags dynamic,timeout; timeout 10m; }\n"
            "add set @ sticky-b { type ipv4_addr; flags dynamic,timeout; timeout 10m; }\n"
            "add chain @ sticky-a\n"
            "add rule @ sticky-a update @sticky-a { ip saddr }\n"
            "add rule @ sticky-a meta l4proto tcp dnat to 10.180.1.40:80\n"
            "add chain @ sticky-b\n"
            "add rule @ sticky-b update @sticky-b { ip saddr }\n"
            "add rule @ sticky-b meta l4proto tcp dnat to 10.180.2.40:80\n"
            "add chain @ sticky\n"
            "add rule @ sticky ip saddr @sticky-a goto sticky-a\n"
            "add rule @ sticky ip saddr @sticky-b goto sticky-b\n"
            "add rule @ sticky numgen random mod 2 vmap { 0 : goto sticky-a, 1 : goto sticky-b }\n"
            + _dispatch("ip daddr 172.30.5.1 tcp dport 80", "goto sticky")
        ),
    },
    "drop": {IPFamily.IPV4: _filter("ip daddr 172.30.2.1", "drop")},
    # A DNAT to a pod IP that nothing owns (a stale endpoint).
    "ghost": {
        IPFamily.IPV4: _dispatch("ip daddr 172.30.4.4 tcp dport 80", "dnat to 10.180.9.9:8080")
    },
    "reject": {
        IPFamily.IPV4: (
            _filter("ip daddr 172.30.3.1", "reject")
            + _filter("ip daddr 172.30.3.2 tcp dport 80", "reject with tcp reset")
        ),
    },
    "dnat6": {
        IPFamily.IPV6: (
            "add chain @ web-a\nadd rule @ web-a meta l4proto tcp dnat to [fd00:10::a1]:8080\n"
            "add chain @ web-b\nadd rule @ web-b meta l4proto tcp dnat to [fd00:10::a2]:8080\n"
            "add chain @ web\n"
            "add rule @ web numgen random mod 2 vmap { 0 : goto web-a, 1 : goto web-b }\n"
            + _dispatch("ip6 daddr fd00:10:96::10 tcp dport 80", "goto web")
            + "add rule @ nat_post ct status dnat ip6 saddr != fd00:10::/64 masquerade\n"
            + _filter("ip6 daddr fd00:10:96::11", "reject")
        ),
    },
    "dual": {
        IPFamily.IPV4: _dispatch("ip daddr 172.30.6.1 tcp dport 80", "dnat to 10.180.6.1:80"),
        IPFamily.IPV6: _dispatch(
            "ip6 daddr fd00:10:96::61 tcp dport 80", "dnat to [fd00:10::61]:80"
        ),
    },
}

SYNC_ERROR_NAMESPACE: Final = "sync-error"
"""A Service in this namespace makes every sync fail."""
INTERRUPT_NAMESPACE: Final = "interrupt"
"""A Service in this namespace makes the sync raise KeyboardInterrupt (as Ctrl-C would)."""


class StandinBackend:
    """Writes the hand-made rules of the namespaces present; nothing else."""

    def __init__(self, family: IPFamily, netns: str) -> None:
        self._family = family
        self.netns = netns
        self.nft_family = "ip" if family is IPFamily.IPV4 else "ip6"
        self.syncs = 0

    @property
    def family(self) -> IPFamily:
        return self._family

    def _nft(self, text: str) -> None:
        done = subprocess.run(
            ["ip", "netns", "exec", self.netns, "nft", "-f", "-"],
            input=text,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise SyncError(f"nft: {done.stderr.strip()}")

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        self.syncs += 1
        namespaces = sorted({name.service.namespace for name in snapshot.services})
        if SYNC_ERROR_NAMESPACE in namespaces:
            raise SyncError("the stand-in refuses this sync")
        if INTERRUPT_NAMESPACE in namespaces:
            raise KeyboardInterrupt
        table = f"{self.nft_family} {TABLE}"
        text = f"add table {table}\ndelete table {table}\n"
        text += _BASE.format(family=self.nft_family, table=TABLE)
        for namespace in namespaces:
            text += RULES.get(namespace, {}).get(self._family, "")
        self._nft(_expand(text, table))

    def cleanup(self) -> None:
        table = f"{self.nft_family} {TABLE}"
        self._nft(f"add table {table}\ndelete table {table}\n")


def _expand(text: str, table: str) -> str:
    # "@ " names the table at the start of a command; "@name" inside a rule is a set.
    return "\n".join(line.replace(" @ ", f" {table} ", 1) for line in text.splitlines()) + "\n"


def factory(family: IPFamily, config: ProxierConfig, *, netns: str | None = None) -> Backend:
    """The stand-in's :class:`~kubeproxy.backend.BackendFactory`."""
    if netns is None:
        raise ValueError("the stand-in only programs a namespace (netns=...)")
    return StandinBackend(family, netns)
