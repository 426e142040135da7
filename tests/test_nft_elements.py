"""Elements over our own netlink batches: encoding, and the kernel's view of them.

The promise that makes this transport acceptable: elements sent this way list exactly as
if nft had added them (they carry no bytecode), a batch is one transaction, and errors
name what was refused. Kernel tests run in namespaces ``kpxe-<pid>-<hex>``.
"""

from __future__ import annotations

import errno
import json
import operator
import os
import secrets
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from kubeproxy.backends.nftables.batchsocket import (
    BatchSocket,
    answers,
    batch_refusal,
    one_generation,
)
from kubeproxy.backends.nftables.elements import (
    ElementBatch,
    ElementWriter,
    GroupedAdds,
    GroupedDeletes,
    _Message,
    comment_userdata,
    each_key_once,
    each_once,
    element_encoder,
    element_frames,
    encode_part,
    pair_elements,
    read_whole,
    slot_elements,
    with_comment,
)
from kubeproxy.backends.nftables.exec import LibNftables
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.reader import _blob_key

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


def test_a_comment_is_the_user_data_nft_writes() -> None:
    # libnftnl's udata: type 0 (the element comment), its length with the NUL, the text.
    assert comment_userdata("demo/web:http") == b"\x00\x0edemo/web:http\x00"
    plain = element_encoder(*TYPES4["ports"])(("tcp", "30080"), ())
    named = with_comment(plain, "demo/web:http")
    (length,) = struct.unpack_from("=H", named)
    assert length == len(named) == len(plain) + 4 + 16  # padded to 4 bytes
    assert named[: len(plain)][4:] == plain[4:]
    for bad in ('say "hi"', "x" * 129, "tab\there"):
        with pytest.raises(ValueError):
            comment_userdata(bad)


Dumped = list[tuple[str, str]] | None
BY_ADDRESS: Callable[[list[tuple[str, str]]], bool] = each_key_once(operator.itemgetter(0))


def _scripted(*dumps: Dumped) -> tuple[list[int], Callable[[], Dumped]]:
    """A dump that gives ``dumps`` in turn, and the count of dumps asked."""
    asked: list[int] = []

    def dump() -> Dumped:
        asked.append(1)
        return dumps[len(asked) - 1]

    return asked, dump


@pytest.mark.parametrize(
    "first",
    [None, [("10.0.0.1", "a"), ("10.0.0.2", "b"), ("10.0.0.1", "a")]],
    ids=["interrupted", "a key repeated"],
)
def test_a_disturbed_dump_is_asked_again(
    first: list[tuple[str, str]] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    pauses: list[float] = []
    monkeypatch.setattr("kubeproxy.backends.nftables.elements.time.sleep", pauses.append)
    whole = [("10.0.0.1", "a"), ("10.0.0.2", "b")]
    asked, dump = _scripted(first, whole)
    assert read_whole(dump, BY_ADDRESS, "listing x") == whole
    assert len(asked) == 2
    assert len(pauses) == 1 and 0 < pauses[0] < 0.1


def test_a_dump_disturbed_every_time_is_an_eintr_and_repeats_count_only_for_elements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pauses: list[float] = []
    monkeypatch.setattr("kubeproxy.backends.nftables.elements.time.sleep", pauses.append)
    repeated = [("10.0.0.1", "a"), ("10.0.0.1", "a")]
    asked, dump = _scripted(*[repeated] * 10)
    with pytest.raises(NftError) as caught:
        read_whole(dump, BY_ADDRESS, "listing x")
    assert caught.value.errno == errno.EINTR and "listing x" in str(caught.value)
    assert len(asked) == 5 and pauses == sorted(pauses) and sum(pauses) < 0.1
    # Rules and sets are lists: the same object twice is not a disturbed dump.
    asked, dump = _scripted(repeated)
    assert read_whole(dump, None, "rules of c") == repeated


def test_a_dump_whose_messages_carry_two_generations_was_interrupted() -> None:
    """``res_id``, the generation's low 16 bits, in each message's ``nfgenmsg``."""
    message = struct.Struct("=BBH")
    quiet = [message.pack(2, 0, 0x0400) + b"elements", message.pack(2, 0, 0x0400)]
    assert one_generation(quiet) and one_generation([]) and one_generation(quiet[:1])
    assert not one_generation([*quiet, message.pack(2, 0, 0x0500) + b"elements"])
    assert each_once([b"a", b"b"]) and not each_once([b"a", b"b", b"a"])


def test_an_elements_key_is_cut_from_its_dumped_bytes_without_its_value() -> None:
    encode = element_encoder(("ipv4_addr", "inet_service"), ("ipv4_addr",), dumped=True)
    one = encode(("10.0.0.1", "80"), ("10.1.0.1",))
    assert _blob_key(one) == _blob_key(encode(("10.0.0.1", "80"), ("10.1.0.2",)))
    assert _blob_key(one) != _blob_key(encode(("10.0.0.1", "81"), ("10.1.0.1",)))
    assert bytes([10, 0, 0, 1]) in _blob_key(one) and bytes([10, 1, 0, 1]) not in _blob_key(one)


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


class _SilentSocket:
    """A netlink socket the kernel never answers on."""

    def __init__(self) -> None:
        self.timeout: float | None = None
        self.closed = False
        self.sent = 0

    def settimeout(self, timeout: float | None) -> None:
        self.timeout = timeout

    def setsockopt(self, *args: object) -> None:
        pass

    def sendall(self, data: bytes) -> None:
        self.sent += 1

    def recv(self, size: int) -> bytes:
        if self.timeout == 0.0:
            raise BlockingIOError
        raise TimeoutError("timed out")

    def close(self) -> None:
        self.closed = True


def test_no_answer_is_an_nft_error_and_the_socket_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sockets: list[_SilentSocket] = []

    def opened(self: BatchSocket) -> _SilentSocket:
        sockets.append(_SilentSocket())
        return sockets[-1]

    monkeypatch.setattr(BatchSocket, "_open", opened)
    writer = ElementWriter()
    batch = ElementBatch(Family.IP, "t", TYPES4, adds=[("ports", ("tcp", "1"), ())])
    with pytest.raises(NftError, match="no answer; whether it committed is unknown") as failed:
        writer.send(batch)
    assert failed.value.errno == errno.ETIMEDOUT
    assert writer.replaced == 1
    assert sockets[0].closed and sockets[0].sent == 1
    assert not sockets[1].closed and sockets[1].sent == 0


def test_an_extended_ack_is_read_to_the_element() -> None:
    # What the kernel sends for a refused element with NETLINK_CAP_ACK and
    # NETLINK_EXT_ACK: the error, the refused message's header only, then attributes.
    header = struct.Struct("=IHHII")
    attrs = struct.pack("=HHI", 8, 2, 60) + struct.pack("=HH", 9, 1) + b"oops\0" + b"\0" * 3
    body = struct.pack("=i", -errno.EEXIST) + header.pack(1000, 0xA0C, 0x405, 7, 0) + attrs
    data = header.pack(16 + len(body), 2, 0x100 | 0x200, 7, 99) + body
    assert list(answers(data)) == [(7, errno.EEXIST, 60, "oops")]
    message = _Message("add", "slots", (("a",), ("b",), ("c",)), (40, 60, 80))
    assert message.element_at(60) == ("b",)
    assert message.element_at(79) == ("b",)
    assert message.element_at(20) is None
    assert str(message.refusal(errno.EEXIST, 60, "")) == "add element slots { b }: File exists"
    assert str(message.refusal(errno.EEXIST, None, "")) == (
        "add element slots { one of a, b, c }: File exists"
    )
    assert str(batch_refusal("element transaction", errno.EPERM, "")) == (
        "element transaction refused: Operation not permitted"
    )


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
    # Frontends name their Service port in a comment: a few, of every length up to the
    # longest nft takes (128 characters).
    comments = {
        (container, key): f"ns-{i}/{'s' * (i * 6)}:dns"[:128]
        for i, (container, key, _v) in enumerate(a for a in adds if a[0] != "slots")
    }
    first = ElementBatch(Family.IP, "t", TYPES4, adds=adds, comments=comments)
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


def _sets(count: int) -> str:
    return (
        "table ip many {\n"
        + "".join(
            f"    set s{i} {{ type ipv4_addr . inet_proto . inet_service ; }}\n"
            for i in range(count)
        )
        + "}\n"
    )


@pytest.mark.kernel
def test_a_batch_touching_a_thousand_containers_commits(namespaces: tuple[str, str]) -> None:
    # Issue 19: about 270 containers in one batch overflowed the receive buffer with one
    # acknowledgement per message, though the kernel had committed.
    ns, _ = namespaces
    types = {f"s{i}": (("ipv4_addr", "inet_proto", "inet_service"), ()) for i in range(1000)}
    adds = [(f"s{i}", (f"10.96.{i // 250}.{i % 250}", "tcp", "80"), ()) for i in range(1000)]
    with LibNftables(ns) as nft:
        nft.run_text(_sets(1000))
        writer = ElementWriter(ns)
        try:
            writer.send(ElementBatch(Family.IP, "many", types, adds=adds))
            writer.send(
                ElementBatch(Family.IP, "many", types, deletes=[(c, k) for c, k, _ in adds])
            )
            writer.send(ElementBatch(Family.IP, "many", types, adds=adds))
            assert writer.replaced == 0
        finally:
            writer.close()
        assert "10.96.3.249 . tcp . 80" in nft.run_text("list set ip many s999")
        assert "10.96.0.0 . tcp . 80" in nft.run_text("list set ip many s0")


@pytest.mark.kernel
def test_a_refusal_names_the_element_the_kernel_refused(namespaces: tuple[str, str]) -> None:
    # A clash on one element of a 2000-element add used to be reported as the first
    # three keys of its message.
    ns, _ = namespaces
    with LibNftables(ns) as nft:
        nft.run_text(TABLES)
        nft.run_text("add element ip t slots { 10.96.0.5 . tcp . 80 . 0 : 10.0.0.1 . 8080 }")
        writer = ElementWriter(ns)
        try:
            adds = [
                ("slots", (f"10.96.{i // 250}.{i % 250}", "tcp", "80", "0"), ("10.0.0.2", "80"))
                for i in range(2000)
            ]
            with pytest.raises(NftError) as refused:
                writer.send(ElementBatch(Family.IP, "t", TYPES4, adds=adds))
            assert str(refused.value) == (
                "add element slots { 10.96.0.5 . tcp . 80 . 0 }: File exists"
            )
            listed = nft.run_text("list map ip t slots")
            assert "elements = { 10.96.0.5 . tcp . 80 . 0 : 10.0.0.1 . 8080 }" in listed
        finally:
            writer.close()


_UNPRIVILEGED_SEND = """
import json, sys, time
from kubeproxy.backends.nftables.elements import ElementBatch, ElementWriter
from kubeproxy.backends.nftables.objects import Family, NftError
writer = ElementWriter(sys.argv[1], timeout=30.0)
started = time.monotonic()
try:
    writer.send(ElementBatch(Family.IP, "t", {"ports": (("inet_proto", "inet_service"), ())},
                             adds=[("ports", ("tcp", "30001"), ())]))
    outcome = {"error": None}
except NftError as err:
    outcome = {"error": str(err), "errno": err.errno}
outcome["seconds"] = time.monotonic() - started
print(json.dumps(outcome))
"""


@pytest.mark.kernel
def test_a_batch_refused_on_its_begin_is_answered_at_once(namespaces: tuple[str, str]) -> None:
    # Without CAP_NET_ADMIN the kernel refuses the batch on its begin message and says
    # nothing else; the writer used to wait out its 30 s timeout for the other answers.
    ns, _ = namespaces
    with LibNftables(ns) as nft:
        nft.run_text(TABLES)
    # setpriv drops the capability from the bounding set, so root's Python starts
    # without it (entering the namespace needs CAP_SYS_ADMIN, which stays).
    done = subprocess.run(
        [
            "setpriv",
            "--inh-caps=-net_admin",
            "--bounding-set=-net_admin",
            "--ambient-caps=-net_admin",
            sys.executable,
            "-c",
            _UNPRIVILEGED_SEND,
            ns,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    outcome = json.loads(done.stdout)
    assert outcome["errno"] == errno.EPERM, outcome
    assert outcome["error"] == "element transaction refused: Operation not permitted"
    # Far below the 30 s the writer waited before (a second was too close: a loaded
    # machine can stall one process that long).
    assert outcome["seconds"] < 10.0


@pytest.mark.kernel
def test_a_dump_reads_what_nft_lists(namespaces: tuple[str, str]) -> None:
    ns, _ = namespaces
    with LibNftables(ns) as nft:
        nft.run_text(TABLES)
        nft.run_text(
            "add map ip t sticky { type ipv4_addr : ipv4_addr . inet_service ; "
            "flags dynamic,timeout ; timeout 3h ; }\n"
            "add element ip t sticky { 10.0.0.5 : 10.180.0.1 . 8080, "
            "10.0.0.6 timeout 60s : 10.180.0.2 . 9090 }"
        )
        writer = ElementWriter(ns)
        try:
            writer.send(
                ElementBatch(
                    Family.IP,
                    "t",
                    TYPES4,
                    adds=[
                        (
                            "slots",
                            (f"10.96.{i // 200}.{i % 200}", "udp", "53", "0"),
                            ("10.1.0.1", "53"),
                        )
                        for i in range(300)
                    ],
                )
            )
            sticky = writer.read(
                Family.IP, "t", "sticky", (("ipv4_addr",), ("ipv4_addr", "inet_service"))
            )
            slots = writer.read(Family.IP, "t", "slots", SLOTS4)
            with pytest.raises(NftError) as missing:
                writer.read(Family.IP, "t", "nope", SLOTS4)
        finally:
            writer.close()
        listed = {(e.key, e.value) for e in nft.list_elements(Family.IP, "t", "sticky")}
        assert (
            set(sticky)
            == listed
            == {
                (("10.0.0.5",), ("10.180.0.1", "8080")),
                (("10.0.0.6",), ("10.180.0.2", "9090")),
            }
        )
        assert len(slots) == 300 and (("10.96.0.7", "udp", "53", "0"), ("10.1.0.1", "53")) in slots
        assert missing.value.errno == errno.ENOENT


# Elements packed when queued (a full sync's slots and hairpin pairs) ---------------------

HAIRPIN4 = (("ipv4_addr", "ipv4_addr"), ())


@pytest.mark.parametrize(
    ("types", "key", "endpoints"),
    [
        (
            SLOTS4,
            ("172.30.0.1", "tcp", "80"),
            [f"10.0.{i // 250}.{i % 250 + 1}:8080" for i in range(1100)],
        ),
        (SLOTS6, ("fd01::1", "udp", "53"), ["[fd00::1]:53", "[fd00::a:2]:5353"]),
        (
            (("inet_proto", "inet_service", "integer"), ("ipv4_addr", "inet_service")),
            ("tcp", "30080"),
            ["10.0.0.1:80"],
        ),
    ],
)
def test_packed_slots_are_the_encoders_bytes_and_read_back_as_their_text(
    types: tuple[tuple[str, ...], tuple[str, ...]], key: tuple[str, ...], endpoints: list[str]
) -> None:
    encode = element_encoder(*types)
    text = []
    for index, endpoint in enumerate(endpoints):
        host, _, port = endpoint.rpartition(":")
        text.append(((*key, str(index)), (host.strip("[]"), port)))
    packed = slot_elements(types, key, endpoints)
    assert packed.elements == [encode(k, v) for k, v in text]
    assert list(packed) == text
    assert list(packed[1:3]) == text[1:3]
    assert len(packed) == len(text)


def test_packed_pairs_are_the_encoders_bytes() -> None:
    hosts = ["10.0.0.1", "10.0.0.2"]
    packed = pair_elements(HAIRPIN4, hosts)
    assert packed.elements == [element_encoder(*HAIRPIN4)((h, h), ()) for h in hosts]
    assert list(packed) == [((h, h), ()) for h in hosts]


@pytest.mark.parametrize(
    "make",
    [
        lambda: slot_elements(SLOTS4, ("172.30.0.1", "tcp", "80"), ["10.0.0.256:80"]),
        lambda: slot_elements(SLOTS4, ("172.30.0.1", "tcp", "80"), ["10.0.0.1:99999"]),
        lambda: slot_elements(SLOTS4, ("fd00::1", "tcp", "80"), ["10.0.0.1:80"]),
        lambda: slot_elements(HAIRPIN4, ("10.0.0.1",), ["10.0.0.1:80"]),
        lambda: pair_elements(HAIRPIN4, ["fd00::1"]),
        lambda: pair_elements(SLOTS4, ["10.0.0.1"]),
    ],
)
def test_packing_refuses_what_the_encoder_refuses(make: object) -> None:
    with pytest.raises(ValueError):
        make()  # type: ignore[operator]


def test_grouped_and_encoded_batches_send_the_messages_of_a_flat_batch() -> None:
    types = {
        "slots": SLOTS4,
        "hairpin": HAIRPIN4,
        "frontends": (("ipv4_addr", "inet_proto", "inet_service"), ()),
    }
    key: tuple[str, ...] = ("172.30.0.1", "tcp", "80")
    endpoints = [f"10.0.{i // 250}.{i % 250 + 1}:8080" for i in range(3000)]
    slots = slot_elements(SLOTS4, key, endpoints)
    hairpin = pair_elements(HAIRPIN4, [e.rpartition(":")[0] for e in endpoints])
    deletes = {"frontends": [("172.30.0.9", "tcp", "80")]}
    groups = {"slots": slots, "frontends": [(key, ())], "hairpin": hairpin}
    comments: dict[tuple[str, tuple[str, ...]], str] = {("frontends", key): "ns/web:http"}
    grouped = ElementBatch(
        Family.IP, "t", types, GroupedDeletes(deletes), GroupedAdds(groups), comments
    )
    flat = ElementBatch(Family.IP, "t", types, list(grouped.deletes), list(grouped.adds), comments)
    assert len(grouped) == len(flat) == 1 + 1 + 2 * len(endpoints)
    assert grouped.adds[1] == flat.adds[1]
    framed = element_frames(grouped)
    assert len(framed) > 3  # the slots and the pairs are cut into several messages
    assert [(f.kind, f.flags, f.body) for f in framed] == [
        (f.kind, f.flags, f.body) for f in element_frames(flat)
    ]
    assert grouped.commands() == flat.commands()
    # A refusal names the element whose attribute holds the offset, encoded or not.
    message = framed[1].refusable
    assert isinstance(message, _Message)
    assert message.element_at(message.offsets[2] + 1) == (*key, "2")
