"""``trace --live`` without a kernel: the trace table's rules, trace events decoded from
the bytes the kernel sends, hops described in our names, packets followed to a count
(the kernel test with real packets is test_livetrace_kernel.py)."""

from __future__ import annotations

import io
import ipaddress
import struct
from dataclasses import replace

import pytest

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.backends.nftables.livetrace import (
    Hop,
    describe_hop,
    follow,
    frontend_key,
    parse_datagram,
    trace_rules,
)
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.backends.nftables.reader import RuleRefs

ip = ipaddress.ip_address


def test_the_trace_table_marks_one_frontend_only_and_is_owned() -> None:
    text = trace_rules(Family.IP, ip("172.30.0.10"), 80, "tcp", ip("10.0.0.2"))
    assert text.splitlines() == [
        "add table ip kube-proxy-trace { flags owner; }",
        "add chain ip kube-proxy-trace prerouting"
        " { type filter hook prerouting priority raw; policy accept; }",
        "add rule ip kube-proxy-trace prerouting ip daddr 172.30.0.10 meta l4proto tcp"
        " th dport 80 ip saddr 10.0.0.2 meta nftrace set 1",
        "add chain ip kube-proxy-trace output"
        " { type filter hook output priority raw; policy accept; }",
        "add rule ip kube-proxy-trace output ip daddr 172.30.0.10 meta l4proto tcp"
        " th dport 80 ip saddr 10.0.0.2 meta nftrace set 1",
    ]
    six = trace_rules(Family.IP6, ip("fd00::10"), 53, "udp")
    assert "ip6 daddr fd00::10 meta l4proto udp th dport 53 meta nftrace set 1" in six
    for port, proto in ((0, "tcp"), (80, "icmp")):
        with pytest.raises(ValueError, match="cannot trace"):
            trace_rules(Family.IP, ip("172.30.0.10"), port, proto)


def _event(
    chain: str,
    kind: int,
    handle: int | None = None,
    verdict: tuple[int, str] | None = None,
    packet: bytes = b"",
    table: str = "kube-proxy",
    policy: int | None = None,
) -> bytes:
    """One NFT_MSG_TRACE message as the kernel writes it."""
    body = nlmsg.NFGEN.pack(2, 0, 0)
    body += nlmsg.attr(1, nlmsg.string(table)) + nlmsg.attr(2, nlmsg.string(chain))
    if handle is not None:
        body += nlmsg.attr(3, struct.pack(">Q", handle))
    body += nlmsg.attr(4, struct.pack(">I", kind))
    if verdict is not None:
        code, target = verdict
        parts = [nlmsg.attr(1, struct.pack(">i", code))]
        if target:
            parts.append(nlmsg.attr(2, nlmsg.string(target)))
        body += nlmsg.nested(5, *parts)
    body += nlmsg.attr(6, struct.pack(">I", 0xABCD))
    if packet:
        body += nlmsg.attr(8, packet[:20]) + nlmsg.attr(9, packet[20:])
    if policy is not None:
        body += nlmsg.attr(16, struct.pack(">I", policy))
    return nlmsg.message(nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_NFTABLES, 17), 0, 0, body)


def _syn(source: str, dest: str, sport: int, dport: int) -> bytes:
    header = bytearray(20)
    header[0] = 0x45
    header[9] = 6
    header[12:16] = ip(source).packed
    header[16:20] = ip(dest).packed
    return bytes(header) + struct.pack(">HH", sport, dport) + bytes(16)


def test_trace_events_are_decoded_from_the_kernels_bytes() -> None:
    datagram = _event(
        "services", 3, 94, (-4, "dispatch-ips-0.g1"), _syn("10.0.0.2", "172.30.0.10", 5000, 80)
    ) + _event("nat-postrouting", 1, policy=1)
    first, second = parse_datagram(datagram)
    assert first == Hop(
        id=0xABCD,
        family=2,
        table="kube-proxy",
        chain="services",
        kind="rule",
        handle=94,
        verdict=("goto", "dispatch-ips-0.g1"),
        source="10.0.0.2",
        dest="172.30.0.10",
        proto="tcp",
        sport=5000,
        dport=80,
    )
    assert first.packet == "10.0.0.2:5000 -> 172.30.0.10:80/tcp"
    assert (second.kind, second.policy, second.packet) == ("policy", "accept", "?")
    # Another subsystem's message, or a truncated one, is skipped.
    assert parse_datagram(b"\x00" * 12) == []
    assert parse_datagram(datagram[:-8]) == [first]


class _Table:
    """Our table as describe_hop asks about it."""

    rules = {("services", 94): RuleRefs(lookups=("dispatch-ips.g1",))}
    names: dict[tuple[str, tuple[str, ...]], str] = {
        ("dispatch-ips.g1", ("172.30.0.10", "tcp", "80")): "demo/web:http"
    }

    def rule(self, chain: str, handle: int) -> RuleRefs | None:
        return self.rules.get((chain, handle))

    def frontend(self, container: str, key: tuple[str, ...]) -> str | None:
        return self.names.get((container, key))


def _hop(chain: str, **fields: object) -> Hop:
    base: dict[str, object] = {"id": 7, "family": 2, "table": "kube-proxy", "chain": chain}
    base.update(fields)
    return Hop(**base)  # type: ignore[arg-type]


def test_hops_are_described_in_our_names() -> None:
    packet = _hop("nat-prerouting", kind="rule", source="10.0.0.2", dest="172.30.0.10", proto="tcp")
    packet = replace(packet, sport=5000, dport=80)
    dispatched = _hop("services", kind="rule", handle=94, verdict=("goto", "dispatch-ips-0.g1"))
    assert describe_hop(dispatched, _Table(), packet) == (
        "services rule 94 (@dispatch-ips.g1; 172.30.0.10 . tcp . 80 is demo/web:http):"
        " goto dispatch-ips-0.g1"
    )
    cls = _hop("internal-2.g1", kind="rule", handle=5, verdict=("goto", "pick-2.g1"))
    assert describe_hop(cls, _Table(), packet).startswith(  # type: ignore[union-attr]
        "internal-2.g1 (class: cluster IP: 2 endpoint(s)"
    )
    assert describe_hop(cls, _Table(), packet, first_in_chain=False) == (
        "internal-2.g1 rule 5: goto pick-2.g1"
    )
    end = _hop("firewall-check", kind="rule", verdict=("continue", ""))
    assert describe_hop(end, _Table()) == "firewall-check: no rule decided, continue"
    # Another table: only a refusal is worth a line; the trace table's hops never are.
    theirs = _hop("input", table="filter", kind="policy", policy="drop")
    assert describe_hop(theirs, _Table()) == "filter input policy: drop (not our table)"
    assert (
        describe_hop(_hop("input", table="filter", kind="policy", policy="accept"), _Table())
        is None
    )
    assert (
        describe_hop(
            _hop("output", table="kube-proxy-trace", kind="policy", policy="drop"), _Table()
        )
        is None
    )


def test_a_frontends_key_in_the_sets_that_name_services() -> None:
    packet = _hop(
        "x", kind="rule", source="10.0.0.2", dest="172.30.0.10", proto="udp", sport=1, dport=53
    )
    assert frontend_key("dispatch-ips.g3", packet) == ("172.30.0.10", "udp", "53")
    assert frontend_key("no-endpoint-nodeports-drop.g3", packet) == ("udp", "53")
    assert frontend_key("class-bit-ips-0.g3", packet) is None
    assert frontend_key("dispatch-ips.g3", _hop("x", kind="rule")) is None


class _Events:
    """Hops arriving in batches, one batch per receive; the clock moves a second each."""

    def __init__(self, batches: list[list[Hop]], clock: list[float]) -> None:
        self.batches = batches
        self.clock = clock

    def receive(self, timeout: float) -> list[Hop]:
        self.clock[0] += 1.0
        return self.batches.pop(0) if self.batches else []


def test_packets_are_followed_to_a_count_or_a_time() -> None:
    now = [0.0]

    def marked(packet_id: int, sport: int) -> Hop:
        return _hop(
            "prerouting",
            id=packet_id,
            table="kube-proxy-trace",
            kind="rule",
            handle=4,
            verdict=("continue", ""),
            source="10.0.0.2",
            dest="172.30.0.10",
            proto="tcp",
            sport=sport,
            dport=80,
        )

    hop = _hop("nat-output", kind="policy", policy="accept")
    out = io.StringIO()
    # The second packet reuses the first's id (the kernel's id is the buffer's address);
    # a third is not followed; a hop of no marked packet is left out.
    events = _Events(
        [
            [marked(7, 5000), hop, replace(hop, id=99)],
            [marked(7, 5001), hop, marked(8, 5002), replace(hop, id=8)],
        ],
        now,
    )
    seen = follow(events, _Table(), out, packets=2, seconds=60, clock=lambda: now[0])
    assert seen == 2
    assert out.getvalue().splitlines() == [
        "#1 10.0.0.2:5000 -> 172.30.0.10:80/tcp arrives",
        "#1 nat-output: end of base chain, policy accept",
        "#2 10.0.0.2:5001 -> 172.30.0.10:80/tcp arrives",
        "#2 nat-output: end of base chain, policy accept",
    ]
    assert now[0] < 10  # stopped soon after the count, not at the time limit
    quiet = follow(
        _Events([], now), _Table(), io.StringIO(), packets=1, seconds=5, clock=lambda: now[0]
    )
    assert quiet == 0
