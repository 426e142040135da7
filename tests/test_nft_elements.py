"""Elements over our own netlink batches: encoding, and the kernel's view of them.

The promise that makes this transport acceptable: elements sent this way list exactly as
if nft had added them (they carry no bytecode), a batch is one transaction, and errors
name what was refused. Kernel tests run in namespaces ``kpxe-<pid>-<hex>``.
"""

from __future__ import annotations

import errno
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kubeproxy.backends.nftables.elements import ElementBatch, ElementWriter, encode_part
from kubeproxy.backends.nftables.exec import LibNftables
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.objects import Family, NftError

SLOTS4 = (("ipv4_addr", "inet_proto", "inet_service", "integer"), ("ipv4_addr", "inet_service"))
SLOTS6 = (("ipv6_addr", "inet_proto", "inet_service", "integer"), ("ipv6_addr", "inet_service"))
TABLES = """
table ip t {
    map slots { typeof ip daddr . meta l4proto . th dport . numgen random mod 1 : ip daddr . tcp dport ; }
    set frontends { type ipv4_addr . inet_proto . inet_service ; }
    set ports { type inet_proto . inet_service ; }
}
table ip6 t {
    map slots { typeof ip6 daddr . meta l4proto . th dport . numgen random mod 1 : ip6 daddr . tcp dport ; }
}
"""  # noqa: E501
TYPES4 = {
    "slots": SLOTS4,
    "frontends": (("ipv4_addr", "inet_proto", "inet_service"), ()),
    "ports": (("inet_proto", "inet_service"), ()),
}


def test_parts_are_encoded_as_the_kernel_stores_them() -> None:
    assert encode_part("ipv4_addr", "10.96.0.1") == bytes([10, 96, 0, 1])
    assert encode_part("ipv6_addr", "fd00::1") == bytes([0xFD] + [0] * 14 + [1])
    assert encode_part("inet_proto", "udp") == bytes([17, 0, 0, 0])
    assert encode_part("inet_service", "8080") == bytes([0x1F, 0x90, 0, 0])
    assert encode_part("integer", "3") == (3).to_bytes(4, sys.byteorder)
    for datatype, bad in [
        ("ipv4_addr", "10.0.0"),
        ("ipv4_addr", "fd00::1"),
        ("ipv6_addr", "10.0.0.1"),
        ("inet_proto", "icmp"),
        ("inet_service", "65536"),
        ("inet_service", "-1"),
        ("integer", "4294967296"),
        ("verdict", "drop"),
    ]:
        with pytest.raises(ValueError):
            encode_part(datatype, bad)


def test_the_fake_applies_a_batch_as_its_commands() -> None:
    fake = FakeNft()
    fake.run_text(
        "add table ip t\n"
        "add map ip t slots { typeof ip daddr . meta l4proto . th dport . "
        "numgen random mod 1 : ip daddr . tcp dport ; }"
    )
    batch = ElementBatch(
        Family.IP,
        "t",
        TYPES4,
        adds=[("slots", ("10.96.0.1", "tcp", "80", "0"), ("10.0.0.1", "8080"))],
    )
    fake.write_elements(batch)
    assert fake.transactions[-1].render().splitlines() == batch.commands()
    with pytest.raises(NftError) as refused:
        fake.write_elements(
            ElementBatch(
                Family.IP,
                "t",
                TYPES4,
                adds=[("slots", ("10.96.0.1", "tcp", "80", "0"), ("10.0.0.2", "8080"))],
            )
        )
    assert refused.value.errno == errno.EEXIST


# Kernel tests ----------------------------------------------------------------------------


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    names = [f"kpxe-{os.getpid() % 100000}-{secrets.token_hex(2)}" for _ in range(2)]
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True)
        yield names[0], names[1]
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "delete", name], check=False)


def _changes() -> tuple[ElementBatch, ElementBatch]:
    adds: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
        (
            "slots",
            (f"10.96.{i // 200}.{i % 200}", "tcp", "80", str(i % 7)),
            (f"10.1.0.{i % 250}", "8080"),
        )
        for i in range(3000)
    ]
    adds += [
        ("frontends", (f"10.96.0.{i}", p, "53"), ()) for i in range(20) for p in ("udp", "sctp")
    ]
    adds += [("ports", ("tcp", str(30000 + i)), ()) for i in range(10)]
    first = ElementBatch(Family.IP, "t", TYPES4, adds=adds)
    second = ElementBatch(
        Family.IP,
        "t",
        TYPES4,
        deletes=[(c, k) for c, k, _v in adds[::3]],
        adds=[("slots", ("10.96.0.1", "tcp", "80", "0"), ("10.2.0.1", "9090"))],
    )
    return first, second


@pytest.mark.kernel
def test_elements_list_as_if_nft_had_added_them(namespaces: tuple[str, str]) -> None:
    ours, theirs = namespaces
    first, second = _changes()
    v6 = ElementBatch(
        Family.IP6,
        "t",
        {"slots": SLOTS6},
        adds=[("slots", ("fd00::10", "udp", "53", "1"), ("fd00::1:2", "5353"))],
    )
    with LibNftables(ours) as nft_ours, LibNftables(theirs) as nft_theirs:
        for nft in (nft_ours, nft_theirs):
            nft.run_text(TABLES)
        writer = ElementWriter(ours)
        try:
            for batch in (first, second, v6):
                writer.send(batch)  # 3000 elements: several messages, one transaction
                nft_theirs.run_text("\n".join(batch.commands()))
        finally:
            writer.close()
        assert nft_ours.run_text("list ruleset") == nft_theirs.run_text("list ruleset")
        listed = nft_ours.run_text("list map ip t slots")
        assert "10.96.0.1 . tcp . 80 . 0 : 10.2.0.1 . 9090" in listed


@pytest.mark.kernel
def test_a_refused_batch_changes_nothing_and_says_what(namespaces: tuple[str, str]) -> None:
    ns, _ = namespaces
    with LibNftables(ns) as nft:
        nft.run_text(TABLES)
        nft.run_text("add element ip t slots { 10.96.0.1 . tcp . 80 . 0 : 10.0.0.1 . 8080 }")
        before = nft.run_text("list ruleset")
        writer = ElementWriter(ns)
        try:
            clash = ElementBatch(
                Family.IP,
                "t",
                TYPES4,
                adds=[
                    ("ports", ("tcp", "30001"), ()),
                    ("slots", ("10.96.0.1", "tcp", "80", "0"), ("10.0.0.9", "8080")),
                ],
            )
            with pytest.raises(
                NftError, match=r"add element slots \{ 10.96.0.1 . tcp . 80 . 0 \}: File exists"
            ) as refused:
                writer.send(clash)
            assert refused.value.errno == errno.EEXIST
            assert nft.run_text("list ruleset") == before
            missing = ElementBatch(Family.IP, "t", TYPES4, deletes=[("ports", ("udp", "1"))])
            with pytest.raises(NftError) as gone:
                writer.send(missing)
            assert gone.value.errno == errno.ENOENT
            # The socket is still in step: the next batch goes through.
            writer.send(ElementBatch(Family.IP, "t", TYPES4, adds=[("ports", ("udp", "1"), ())]))
            assert "udp . 1" in nft.run_text("list set ip t ports")
        finally:
            writer.close()
